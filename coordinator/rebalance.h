/* rebalance.h: pieces moved back where they belong (rebalance.c).  A failover puts
 * a piece on whatever spare is free; once a better place frees up (a tensor-parallel
 * group spans nodes or NVLink domains and an idle worker on the group's own node, or
 * domain, can take the odd rank), the piece moves there make before break: the idle
 * worker loads the piece's weights first (a standby assignment), and only then one
 * plan gives it the piece and lets the old holder go, so the replica is rewired,
 * not reloaded.  At most one move at a time, one begun every
 * coordinator.rebalance_interval_s (0: never); the state is c->rebalance. */
#ifndef TSR_REBALANCE_H
#define TSR_REBALANCE_H

#include <stdbool.h>
#include <stdint.h>
#include "state.h"

/* Looks for a piece to move back, begins, switches or gives up the move under way.
 * The switch waits until another replica of the deployment serves or the piece's
 * replica has no request in flight, so no replica that serves stops meanwhile.
 * Returns when it next needs to run (0: nothing pending). */
int64_t tsr_rebalance_tick(tsr_coord_t *c, int64_t now_ms);
/* A Ready, Progress or Failed from worker w: true when it is about the standby
 * assignment under way (it is then taken here), false for the loop to handle. */
bool tsr_rebalance_message(tsr_coord_t *c, tsr_worker_t *w, const tsr_env_t *env);

#endif
