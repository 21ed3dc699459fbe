/* placement.h: the plan and the transition to it (placement.c).  Placement owns the
 * epoch, dirty, lost and rewiring in tsr_coord_t and the retry fields of each
 * deployment's state. */
#ifndef TSR_PLACEMENT_H
#define TSR_PLACEMENT_H

#include <stdbool.h>
#include <stdint.h>
#include "state.h"

/* Runs the planner now and applies its actions (assignments, unassignments); every
 * replica that changed, or lost a worker, is marked in c->rewiring for
 * tsr_coord_rewire_marked, under a new epoch.  Callers go through tsr_coord_plan
 * (replan.h), which moves the requests off the marked replicas in between. */
void tsr_coord_replan(tsr_coord_t *c, int64_t now_ms);
/* Whether planning may run now (past plan_after_ms); when not, leaves it to the tick
 * (dirty). */
bool tsr_coord_may_plan(tsr_coord_t *c, int64_t now_ms);
/* Rewires every replica in c->rewiring as a whole in the current epoch (its members
 * form new communicators from the new peer list; the ones that kept their piece keep
 * their weights), and empties the set. */
void tsr_coord_rewire_marked(tsr_coord_t *c);
/* Rewires replica of deployment (a new epoch on the same workers, unless
 * the plan moves a piece) after the deployment's backoff: 2 s, doubling up
 * to 60 s, back to 2 s once the replica is whole again.  why is logged. */
void tsr_coord_rewire_later(tsr_coord_t *c, const char *deployment, int replica,
                            const char *why, int64_t now_ms);
/* w's piece failed (its reason in w): its replica is rewired later when the failure
 * is retryable (load errors need the operator). */
void tsr_coord_retry_failed(tsr_coord_t *c, tsr_worker_t *w, int64_t now);
/* w's piece became ready: notes a deployment that was ready as a whole (a gap from
 * then on is "degraded"), and a replica whole again (its backoff starts over). */
void tsr_coord_note_ready(tsr_coord_t *c, const tsr_worker_t *w);
/* Moves the replicas whose backoff is over to c->lost, for the next plan. */
void tsr_coord_run_retries(tsr_coord_t *c, int64_t now);

#endif
