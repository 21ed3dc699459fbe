#include "health.h"

#include <stdio.h>

bool tsr_health_overdue(int64_t last_seen_ms, int64_t now_ms, int timeout_ms)
{
    return now_ms - last_seen_ms > (int64_t)timeout_ms;
}

bool tsr_health_mark_dead(tsr_registry_t *reg, tsr_worker_t *w, int64_t now_ms, const char *reason)
{
    if (w->state == TSR_W_DEAD) return false;
    w->state = TSR_W_DEAD;
    w->dead_since_ms = now_ms;
    tsr_registry_clear_piece(reg, w);
    snprintf(w->reason, sizeof w->reason, "%s", reason);
    /* What it last reported was its process's: shown on a dead worker it
     * reads as a KV cache, a queue and a load that no longer exist. */
    w->kv_blocks_used = w->kv_blocks_total = w->kv_blocks_cached = w->queued = w->running = 0;
    w->load = 0;
    w->weight_bytes = w->kv_bytes = 0;
    return true;
}

int tsr_health_scan(tsr_registry_t *reg, int64_t now_ms, int timeout_ms,
                    void (*on_dead)(tsr_worker_t *w, void *arg), void *arg)
{
    int marked = 0;
    size_t n = tsr_registry_size(reg);
    for (size_t i = 0; i < n; i++) {
        tsr_worker_t *w = tsr_registry_at(reg, i);
        if (w->state == TSR_W_DEAD || !tsr_health_overdue(w->last_seen_ms, now_ms, timeout_ms))
            continue;
        char why[128];
        snprintf(why, sizeof why, "no heartbeat for %lld ms (timeout %d ms)",
                 (long long)(now_ms - w->last_seen_ms), timeout_ms);
        if (on_dead) on_dead(w, arg);
        tsr_health_mark_dead(reg, w, now_ms, why);
        marked++;
    }
    return marked;
}

int tsr_health_scan_interval_ms(int heartbeat_interval_ms)
{
    int t = heartbeat_interval_ms / 4;
    return t < 5 ? 5 : t;
}
