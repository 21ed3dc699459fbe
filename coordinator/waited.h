/* waited.h: which members of a replica their tensor-parallel group waited for
 * (waited.c), read from the registry. */
#ifndef TSR_WAITED_H
#define TSR_WAITED_H

#include <stdbool.h>
#include <stddef.h>
#include "state.h"

/* True when w's tensor-parallel group waited for it: w is ready while every
 * other member of its stage has reported a failure in the same epoch, one
 * at least that a group operation passed its deadline (Failed.past_deadline),
 * and its pipeline hand-off neighbours (the same tp rank in the adjacent
 * stages) are there, in its epoch, and not so marked themselves.  The other
 * ranks' failures name no one in a group of more than two; the one that
 * reported nothing is the one they waited for. */
bool tsr_coord_waited_for(const tsr_coord_t *c, const tsr_worker_t *w);
/* "g1 (stage 0 tp 1), g5 (stage 1 tp 0)": the members of deployment d's
 * replica their groups waited for, into buf ("" none); how many. */
int tsr_coord_waited_for_text(const tsr_coord_t *c, const tsr_deployment_t *d, int replica,
                              char *buf, size_t len);

#endif
