/* replan.h: a plan applied in its order (replan.c). */
#ifndef TSR_REPLAN_H
#define TSR_REPLAN_H

#include <stdint.h>
#include "state.h"

/* Runs the planner (placement marks the replicas it rewires), moves the requests off
 * those replicas (a Cancel to their leaders in the epoch they ran in), then rewires
 * them in the new epoch. */
void tsr_coord_plan(tsr_coord_t *c, int64_t now_ms);
/* The same where planning may run now (past plan_after_ms), so a control request
 * answers with the new plan; else leaves it to the tick (dirty). */
void tsr_coord_plan_now(tsr_coord_t *c, int64_t now_ms);

#endif
