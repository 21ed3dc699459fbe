/* placement.h: the plan and the transition to it (placement.c).  Placement owns the
 * epoch, dirty, plan_after_ms, last_plan_ms and place in tsr_coord_t, and the retry
 * fields of each deployment's state. */
#ifndef TSR_PLACEMENT_H
#define TSR_PLACEMENT_H

#include <stdbool.h>
#include <stdint.h>
#include "state.h"

/* What placement keeps between plans: the replicas that lost a worker (or that a
 * reload or a retry asks to rewire) since the last plan, and the ones the last plan
 * marked for rewiring. */
typedef struct tsr_placement tsr_placement_t;

/* NULL when out of memory.  Caller owns it (tsr_placement_destroy). */
tsr_placement_t *tsr_placement_new(void);
void tsr_placement_destroy(tsr_placement_t **self_p);
/* Replica `replica` of deployment index di (< 0: none) is rewired by the next plan. */
void tsr_coord_mark_lost(tsr_coord_t *c, int di, int replica);
/* The replicas marked for the next plan keep their marks under next's numbering (a
 * reload, before c->cfg becomes next); those of deployments next lacks are dropped. */
void tsr_coord_lost_renumber(tsr_coord_t *c, const tsr_config_t *next);
/* The replicas the plan just made rewires, not yet given their new epoch (read by the
 * requests layer, to move their requests off first).  Valid until the next call into
 * placement. */
const tsr_replica_set_t *tsr_coord_rewiring(const tsr_coord_t *c);

/* Runs the planner now and applies its actions (assignments, unassignments); every
 * replica that changed, or lost a worker, is marked in c->rewiring for
 * tsr_coord_rewire_marked, under a new epoch.  Callers go through tsr_coord_plan
 * (replan.h), which moves the requests off the marked replicas in between. */
void tsr_coord_replan(tsr_coord_t *c, int64_t now_ms);
/* Whether planning may run now (past plan_after_ms); when not, leaves it to the tick
 * (dirty). */
bool tsr_coord_may_plan(tsr_coord_t *c, int64_t now_ms);
/* For the next plan only: worker `to`, which holds nothing, is seen as holding key (it
 * loaded it as a standby), and worker `from` (NULL: none) as no longer holding it, so
 * the plan keeps the piece on `to` and assigns it there (the rest of its replica is
 * rewired, not reloaded).  A second hint for the same `to` replaces the first. */
void tsr_coord_hint_move(tsr_coord_t *c, const char *to, const char *from,
                         const tsr_piece_key_t *key);
/* A new epoch for a message outside a plan (a standby assignment, rebalance.c):
 * c->epoch raised by one and returned; 0 at TSR_EPOCH_MAX (logged). */
uint64_t tsr_coord_next_epoch(tsr_coord_t *c);
/* Something that may change the placement happened (a worker came, died or was
 * drained): the tick plans. */
void tsr_coord_mark_dirty(tsr_coord_t *c);
/* No plan before plan_after_ms (a fresh coordinator lets its workers re-attach
 * first); the first tick after it plans. */
void tsr_coord_plan_after(tsr_coord_t *c, int64_t plan_after_ms);
/* For the tick: true when a plan is wanted and due now (past plan_after_ms, and
 * PLAN_MIN_GAP_MS after the last, so a burst of registrations becomes one plan); it is
 * then counted as made.  The caller plans (tsr_coord_plan). */
bool tsr_coord_plan_ready(tsr_coord_t *c, int64_t now_ms);
/* When the tick should next look: the time a wanted plan is due, or 0 when none is
 * wanted. */
int64_t tsr_coord_plan_due(const tsr_coord_t *c);
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
/* Marks the replicas whose backoff is over for the next plan. */
void tsr_coord_run_retries(tsr_coord_t *c, int64_t now);

#endif
