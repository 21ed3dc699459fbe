/* canary.h: whether a ready replica really generates (canary.c).  Each replica's
 * canary state (tsr_canary_t) lives in its deployment's state (state.h). */
#ifndef TSR_CANARY_H
#define TSR_CANARY_H

#include <stdbool.h>
#include <stdint.h>
#include "state.h"

/* Sends a canary to every idle ready replica that is due one, and marks a
 * replica whose canary got no token in time unhealthy.  Returns when it next
 * needs to run (0: never). */
int64_t tsr_canary_tick(tsr_coord_t *c, int64_t now_ms);
/* A TokenEvent from worker w (matched to its connection): true when it answers a
 * canary (it is then consumed: a failure marks the replica unhealthy, a token from
 * the replica's last stage healthy again); false when it is a request's. */
bool tsr_canary_token(tsr_coord_t *c, const tsr_worker_t *w, const Tessera__TokenEvent *t);

#endif
