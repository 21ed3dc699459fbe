/* health.h: deciding that a worker is dead.
 *
 * A worker is dead after timeout_ms without any message from it, or as soon
 * as it reports a fatal error.  Time is passed in, never read here, so the
 * logic is driven by a fake clock in the tests. */
#ifndef TSR_HEALTH_H
#define TSR_HEALTH_H

#include <stdbool.h>
#include <stdint.h>
#include "registry.h"

/* True when a worker last heard from at last_seen_ms is overdue at now_ms. */
bool tsr_health_overdue(int64_t last_seen_ms, int64_t now_ms, int timeout_ms);

/* Marks w dead at now_ms with reason (copied), dropping its piece and the
 * figures it last reported (KV blocks, queue, load, bytes held).  Returns
 * true if it was alive before. */
bool tsr_health_mark_dead(tsr_registry_t *reg, tsr_worker_t *w, int64_t now_ms, const char *reason);

/* Scans every live worker and marks the overdue ones dead.  Calls
 * on_dead(w, arg) for each newly dead worker (before its piece is dropped,
 * so the callback can still see it).  Returns the number marked. */
int tsr_health_scan(tsr_registry_t *reg, int64_t now_ms, int timeout_ms,
                    void (*on_dead)(tsr_worker_t *w, void *arg), void *arg);

/* How often to scan so that a death is seen at most one heartbeat after the
 * timeout: a quarter of the heartbeat interval, at least 5 ms. */
int tsr_health_scan_interval_ms(int heartbeat_interval_ms);

#endif
