/* replan.c: a plan applied in its order.  Placement marks the replicas the plan
 * rewires; the requests on them move off while their leaders still hold the epoch the
 * requests ran in (so the Cancel each leader is sent is in that epoch, not fenced off
 * as stale); then placement gives the replicas their new epoch.  This file is the seam
 * between the two layers, so that placement never calls the requests layer. */
#include "replan.h"

#include "placement.h"
#include "router.h"

void tsr_coord_plan(tsr_coord_t *c, int64_t now_ms)
{
    tsr_coord_replan(c, now_ms);
    tsr_requests_follow_moves(c);
    tsr_coord_rewire_marked(c);
}

void tsr_coord_plan_now(tsr_coord_t *c, int64_t now_ms)
{
    if (tsr_coord_may_plan(c, now_ms)) tsr_coord_plan(c, now_ms);
}
