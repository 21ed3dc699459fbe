/* piece.h: the one type that names a piece of a deployment.
 *
 * A piece is one (deployment, replica, stage, tp rank) of a layout; the
 * layout (tp size, pp size, the stage's layer range) travels with it, since
 * the same four numbers under another layout are another piece.  The
 * coordinator's registry, the planner, the Assignment on the wire and the
 * worker's executor all hold a piece as this struct, and convert to and from
 * the wire only here. */
#ifndef TSR_PIECE_H
#define TSR_PIECE_H

#include <stdbool.h>
#include "common/wire.h"

typedef struct {
    char deployment[TSR_NAME_MAX + 1];  /* "": no piece */
    int replica, stage, tp;
    int tp_size, pp_size;
    int layer_begin, layer_end;         /* [begin, end) */
} tsr_piece_key_t;

/* The key an Assignment carries (its deployment cut to TSR_NAME_MAX). */
void tsr_piece_from_wire(tsr_piece_key_t *k, const Tessera__Assignment *a);
/* Sets the Assignment's piece fields; a->deployment points into k. */
void tsr_piece_to_wire(const tsr_piece_key_t *k, Tessera__Assignment *a);
/* The same piece: deployment, replica, stage and tp rank (layouts aside). */
bool tsr_piece_same(const tsr_piece_key_t *a, const tsr_piece_key_t *b);
/* The same piece of the same layout. */
bool tsr_piece_equal(const tsr_piece_key_t *a, const tsr_piece_key_t *b);
/* Its rank in the replica: stage * tp_size + tp. */
int tsr_piece_slot(const tsr_piece_key_t *k);

/* The id of one of a replica's communicator groups, the same on every
 * member (a hash of its place): kind "tp" (stage a's tensor-parallel
 * group, b 0), "pp" (the link into stage a of tp rank b), "ctl". */
uint64_t tsr_group_id(const char *deployment, int replica, const char *kind, int a, int b);

/* The groups whose rank 0 this piece is, the only ones it may publish a
 * rendezvous blob for: its stage's TP group when it is tp rank 0 (a group
 * of one at tp 1, which a worker forms only under TSR_TEST_NCCL_SOLO), and
 * its link to the next stage.  Returns how many (0..2). */
int tsr_piece_led_groups(const tsr_piece_key_t *k, uint64_t out[2]);

#endif
