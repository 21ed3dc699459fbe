#include "reconciler.h"

size_t tsr_reconcile_actions(const tsr_plan_t *plan, const tsr_plan_worker_t *workers,
                             size_t n_workers, tsr_action_t *acts)
{
    size_t n = 0;
    for (size_t w = 0; w < n_workers; w++) {
        const tsr_piece_t *p = tsr_plan_piece_of(plan, (int)w);
        /* kept by the planner but held by nobody: the planner was told so to keep a
         * piece where it is about to be (a standby that moves it back, rebalance.c) */
        if (p && (!p->kept || !workers[w].current.deployment[0]))
            acts[n++] = (tsr_action_t){TSR_ACT_ASSIGN, (int)w, p};
        else if (!p && workers[w].current.deployment[0])
            acts[n++] = (tsr_action_t){TSR_ACT_UNASSIGN, (int)w, NULL};
    }
    return n;
}
