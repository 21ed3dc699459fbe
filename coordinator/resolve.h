/* resolve.h: auto layouts chosen from the live workers (resolve.c). */
#ifndef TSR_RESOLVE_H
#define TSR_RESOLVE_H

#include <stdbool.h>
#include "state.h"

/* Before a plan: chooses the cut of every auto deployment not chosen yet (in
 * file order, over the workers the ones before leave), and grows auto replicas
 * to what the free workers hold.  A deployment whose cut cannot be chosen yet
 * keeps layout_chosen false (it is not planned) with the reason in layout_why. */
void tsr_coord_resolve_layouts(tsr_coord_t *c);

/* What tsr_coord_adopt_layout changed, to put back when the piece is not adopted. */
typedef struct {
    bool layout_chosen;
    int tensor, pipeline, replicas;
} tsr_layout_undo_t;

/* At registration (now: the loop's clock): a piece k a worker holds of
 * deployment di.  An auto deployment not chosen yet takes k's cut (a restarted
 * coordinator keeps what its workers serve), and auto replicas grow to include
 * k's replica; only during the re-attach grace.  *undo records what it changed:
 * when the piece is then not adopted, tsr_coord_adopt_undo puts it back.  False
 * when k's cut cannot be the deployment's. */
bool tsr_coord_adopt_layout(tsr_coord_t *c, int di, const tsr_piece_key_t *k, int64_t now,
                            tsr_layout_undo_t *undo);
void tsr_coord_adopt_undo(tsr_coord_t *c, int di, const tsr_layout_undo_t *undo);

#endif
