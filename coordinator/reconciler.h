/* reconciler.h: the difference between the desired plan and what the
 * workers hold, as a list of actions.  Computing the actions is pure (tested
 * without sockets); placement.c applies them, and is the only code that
 * does. */
#ifndef TSR_RECONCILER_H
#define TSR_RECONCILER_H

#include <stddef.h>
#include "planner.h"

typedef enum { TSR_ACT_ASSIGN = 0, TSR_ACT_UNASSIGN = 1 } tsr_action_kind_t;

typedef struct {
    tsr_action_kind_t kind;
    int worker;                 /* index into the planner's workers array */
    const tsr_piece_t *piece;   /* ASSIGN: the piece (points into the plan) */
} tsr_action_t;

/* Fills acts (capacity n_workers) and returns how many actions there are:
 * ASSIGN for every worker whose planned piece differs from what it holds,
 * UNASSIGN for every worker that holds a piece and is planned to hold none.
 * A worker already holding exactly its planned piece gets no action. */
size_t tsr_reconcile_actions(const tsr_plan_t *plan, const tsr_plan_worker_t *workers,
                             size_t n_workers, tsr_action_t *acts);

#endif
