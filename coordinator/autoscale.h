/* autoscale.h: replicas that follow load (autoscale.c).  A deployment whose
 * parallel.replicas is a range, {min: N, max: M}, starts with min replicas; the
 * coordinator adds one from idle workers when its queue wait stays above
 * scale_up_queue_ms for scale_up_window_s, and removes one, drained first, when
 * the others could have held every request in flight for scale_down_idle_s.
 * Its fields are each deployment's `scale` (state.h). */
#ifndef TSR_AUTOSCALE_H
#define TSR_AUTOSCALE_H

#include <stdint.h>
#include "state.h"

/* The longest a replica being removed is drained: requests still on it after this
 * resume on the others (nothing fails; they are prefilled again). */
#define TSR_SCALE_DRAIN_MAX_MS 30000

/* Looks at every deployment with a range of replicas, in file order (the ones
 * earlier in the file win idle workers first), and makes at most one decision
 * for each: a replica more (marking the placement dirty), a replica to drain, or
 * the drained one removed.  Idle workers of a kind are left to failover first:
 * coordinator.reserve_spares of them, and any a deployment short of workers
 * needs (a deployment above its min gives one back for it).  Each decision is
 * logged, counted in the deployment's metrics and shown in its status with its
 * reason.  Returns when it next needs to run (0: nothing pending). */
int64_t tsr_autoscale_tick(tsr_coord_t *c, int64_t now_ms);

#endif
