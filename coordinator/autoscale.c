/* autoscale.c: replicas that follow load.  Above the requests layer: it reads the
 * router's requests (how long they wait, how many are in flight, where) and the
 * deployment's metrics, tells the router which replica is draining
 * (deps[].scale.draining: the router sends it nothing new), changes a deployment's
 * replica count (state) and leaves the rest to the next plan (placement).
 *
 * Load is measured over windows of scale_up_window_s, one after the other: the
 * window's queue wait is the mean wait for a first token (in a worker's queue, for
 * the prompt's prefill, or for a replica) of the requests whose first token came in
 * it and of those still waiting at its end.  A mean, not the wait of the moment:
 * under steady load the oldest waiting request changes every time one is served.
 *
 * One more replica: a window's queue wait was above scale_up_queue_ms, every
 * replica is serving (a new one loading is the answer to the last decision), it is
 * below max, and idle workers of its kind are left for it after reserve_spares and
 * any a shortage needs.
 *
 * One fewer: the other replicas' batches could have held every request in flight,
 * and no window's queue wait was above the threshold, for scale_down_idle_s on end,
 * and it is above min.  The last replica is drained (nothing new goes to it), then
 * removed when its last request ends, or after TSR_SCALE_DRAIN_MAX_MS, when the
 * ones left resume on the others; a window above the threshold calls the drain off.
 * A deployment of a kind another deployment is short of gives back a replica above
 * its min the same way. */
#include "autoscale.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/budget.h"
#include "common/log.h"
#include "metrics.h"
#include "placement.h"
#include "router.h"

/* Workers of each kind nothing is placed on and none may hold yet: alive, not
 * drained, holding no piece. */
static void idle_workers(const tsr_coord_t *c, int idle[2])
{
    idle[TSR_DEVICE_CPU] = tsr_coord_idle_count(c, TSR_DEVICE_CPU);
    idle[TSR_DEVICE_CUDA] = tsr_coord_idle_count(c, TSR_DEVICE_CUDA);
}

/* Idle workers that could hold any piece of d (a cuda piece's bytes). */
static int idle_for(const tsr_coord_t *c, const tsr_deployment_t *d, const tsr_dep_state_t *ds)
{
    uint64_t need = 0;
    for (int s = 0; s < d->pipeline && d->device == TSR_DEVICE_CUDA; s++) {
        uint64_t n = tsr_piece_need(&ds->model, d, s);
        if (n > need) need = n;
    }
    int k = 0;
    for (size_t i = 0, n = tsr_registry_size(c->reg); i < n; i++) {
        const tsr_worker_t *w = tsr_registry_at(c->reg, i);
        k += tsr_coord_worker_idle(c, w) && w->device == d->device &&
             (!need || !w->memory || w->memory >= need);
    }
    return k;
}

/* Every replica of d has a ready leader (none is loading or broken). */
static bool all_serving(tsr_coord_t *c, const tsr_deployment_t *d)
{
    for (int r = 0; r < d->replicas; r++)
        if (!tsr_registry_ready_leader(c->reg, d, r)) return false;
    return true;
}

/* Records a decision: its text in status, the log, and the deployment's metrics. */
static void decided(tsr_coord_t *c, tsr_dep_state_t *ds, int64_t now, bool up, const char *fmt,
                    ...) __attribute__((format(printf, 5, 6)));
static void decided(tsr_coord_t *c, tsr_dep_state_t *ds, int64_t now, bool up, const char *fmt,
                    ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ds->scale.last, sizeof ds->scale.last, fmt, ap);
    va_end(ap);
    ds->scale.last_ms = now;
    if (up) ds->scale.ups++;
    else ds->scale.downs++;
    tsr_dep_metrics_t *m = tsr_metrics_of(&c->metrics, ds->name);
    if (m) {
        if (up) m->scale_ups++;
        else m->scale_downs++;
    }
    tsr_info("deployment %s: %s", ds->name, ds->scale.last);
}

/* The drain of d's last replica: removes it once nothing is on it (or the drain
 * ran out of time: what is left resumes on the others).  True while it goes on. */
static bool drain_step(tsr_coord_t *c, tsr_deployment_t *d, tsr_dep_state_t *ds, int64_t now)
{
    int r = ds->scale.draining;
    if (r != d->replicas - 1 || d->replicas <= 1) {  /* the count changed meanwhile */
        ds->scale.draining = -1;
        return false;
    }
    if (!ds->scale.give_back && ds->scale.window_above) {
        tsr_info("deployment %s: replica %d is kept: the queue wait is %.0f ms again, above "
                 "scale_up_queue_ms %d", d->name, r, ds->scale.window_wait_ms,
                 d->scale_up_queue_ms);
        ds->scale.draining = -1;
        return false;
    }
    /* the others must serve: one being rewired, unhealthy or moving leaves this one */
    if (!tsr_requests_another_serves(c, d, r)) {
        tsr_info("deployment %s: replica %d is kept for now: no other replica serves", d->name, r);
        ds->scale.draining = -1;
        return false;
    }
    int on = tsr_requests_in_flight(c, d->name, r);
    if (on > 0 && now - ds->scale.drain_since_ms < TSR_SCALE_DRAIN_MAX_MS) return true;
    if (on > 0)
        tsr_requests_move_off(c, d->name, r, "its replica was removed: the load fell");
    int was = d->replicas;
    if (tsr_dep_set_replicas(ds, d, was - 1) < 0) return true;  /* out of memory: later */
    ds->scale.draining = -1;
    ds->scale.room_since_ms = 0;
    decided(c, ds, now, false, "%d replica(s), from %d: %s%s", was - 1, was, ds->scale.why,
            on > 0 ? " (the requests left on it resumed on the others)" : "");
    tsr_coord_mark_dirty(c);
    return false;
}

static void drain_start(tsr_dep_state_t *ds, const tsr_deployment_t *d, int64_t now,
                        bool give_back, const char *why)
{
    ds->scale.draining = d->replicas - 1;
    ds->scale.give_back = give_back;
    ds->scale.drain_since_ms = now;
    snprintf(ds->scale.why, sizeof ds->scale.why, "%s", why);
    tsr_info("deployment %s: draining replica %d to remove it: %s", d->name, d->replicas - 1, why);
}

int64_t tsr_autoscale_tick(tsr_coord_t *c, int64_t now)
{
    int idle[2];
    idle_workers(c, idle);
    /* The first deployment of each kind short of workers, when what is idle and the
     * replicas above their min could make up for it: it takes what is idle first,
     * and a replica above its min goes back for it.  A shortage nothing could meet
     * (a deployment larger than the cluster) stops nobody. */
    int short_of[2] = {-1, -1}, givable[2] = {0, 0};
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        const tsr_deployment_t *d = &c->cfg->deployments[i];
        const tsr_dep_state_t *ds = &c->deps[i];
        if (!ds->model_ok || !ds->layout_chosen) continue;
        if (ds->short_by > 0 && short_of[d->device] < 0) short_of[d->device] = (int)i;
        if (d->replicas_max && d->replicas > d->replicas_min)
            givable[d->device] += d->tensor * d->pipeline * (d->replicas - d->replicas_min);
    }
    /* workers being given back already (drains for a shortage, their pieces) */
    int giving[2] = {0, 0};
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        const tsr_deployment_t *d = &c->cfg->deployments[i];
        if (c->deps[i].scale.draining >= 0 && c->deps[i].scale.give_back)
            giving[d->device] += d->tensor * d->pipeline;
    }
    int taken[2] = {0, 0};  /* idle workers promised this pass */
    for (int k = 0; k < 2; k++) {
        if (short_of[k] >= 0 && c->deps[short_of[k]].short_by > idle[k] + givable[k])
            short_of[k] = -1;
        if (short_of[k] >= 0) taken[k] = idle[k];  /* the shortage takes what is idle first */
    }
    int64_t next = 0;
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        tsr_deployment_t *d = &c->cfg->deployments[i];
        tsr_dep_state_t *ds = &c->deps[i];
        if (!d->replicas_max || !ds->model_ok || !ds->layout_chosen) {
            ds->scale.queue_wait_ms = 0;
            continue;
        }
        int n_wait = 0;
        int64_t sum_wait = 0;
        ds->scale.queue_wait_ms = tsr_requests_waiting(c, d->name, now, &n_wait, &sum_wait);
        /* the window: its mean wait for a first token once it is whole */
        tsr_dep_metrics_t *m = tsr_metrics_of(&c->metrics, d->name);
        const double sum_s = m ? m->ttft.sum : 0;
        const uint64_t count = m ? m->ttft.count : 0;
        const int64_t window = (int64_t)d->scale_up_window_s * 1000;
        bool window_end = false;
        if (!ds->scale.window_ms) {
            ds->scale.window_ms = now;
            ds->scale.window_sum0 = sum_s;
            ds->scale.window_n0 = count;
            ds->scale.window_wait_ms = -1;
        } else if (now - ds->scale.window_ms >= window) {
            uint64_t k = count - ds->scale.window_n0 + (uint64_t)n_wait;
            double total = (sum_s - ds->scale.window_sum0) * 1000.0 + (double)sum_wait;
            ds->scale.window_wait_ms = k ? total / (double)k : 0;
            /* one request alone (a long prompt's prefill) is no queue: another replica
             * could not serve it sooner */
            ds->scale.window_above = k >= 2 && ds->scale.window_wait_ms > d->scale_up_queue_ms;
            ds->scale.window_ms = now;
            ds->scale.window_sum0 = sum_s;
            ds->scale.window_n0 = count;
            window_end = true;
        }
        int64_t due = ds->scale.window_ms + window;
        if (!next || due < next) next = due;
        /* a drain to give a worker back ends when nobody is short any more */
        if (ds->scale.draining >= 0 && ds->scale.give_back && short_of[d->device] < 0) {
            tsr_info("deployment %s: replica %d is kept: no deployment is short of %s workers "
                     "now", d->name, ds->scale.draining, tsr_device_name(d->device));
            ds->scale.draining = -1;
        }
        if (ds->reshard.active) continue;  /* its cut changes: the count waits (reshard.c) */
        if (ds->scale.draining >= 0 && drain_step(c, d, ds, now)) {
            next = now + 100;
            continue;
        }
        const int in_flight = tsr_requests_in_flight(c, d->name, -1);
        const bool room = d->replicas > d->replicas_min && !ds->scale.window_above &&
                          in_flight <= (d->replicas - 1) * d->max_batch &&
                          tsr_requests_another_serves(c, d, d->replicas - 1);
        if (!room) ds->scale.room_since_ms = 0;
        else if (!ds->scale.room_since_ms) ds->scale.room_since_ms = now;
        const int per = d->tensor * d->pipeline;
        const int k = d->device;
        if (window_end) ds->scale.blocked[0] = '\0';

        /* another deployment of the kind lacks workers: one above min goes back, as
         * many as it lacks */
        if (short_of[k] >= 0 && short_of[k] != (int)i && d->replicas > d->replicas_min &&
            giving[k] + idle[k] < c->deps[short_of[k]].short_by) {
            giving[k] += per;
            char why[200];
            snprintf(why, sizeof why, "deployment %s needs %s workers",
                     c->cfg->deployments[short_of[k]].name, tsr_device_name(d->device));
            drain_start(ds, d, now, true, why);
            next = now + 100;
            continue;
        }
        if (window_end && ds->scale.window_above) {
            if (d->replicas >= d->replicas_max) {
                snprintf(ds->scale.blocked, sizeof ds->scale.blocked,
                         "the queue wait is above scale_up_queue_ms, but replicas are at max %d",
                         d->replicas_max);
            } else if (!all_serving(c, d)) {
                snprintf(ds->scale.blocked, sizeof ds->scale.blocked,
                         "a replica more waits until every replica serves");
            } else if (idle_for(c, d, ds) - c->cfg->reserve_spares - taken[k] < per) {
                snprintf(ds->scale.blocked, sizeof ds->scale.blocked,
                         "a replica more needs %d idle %s worker(s)%s", per,
                         tsr_device_name(d->device),
                         c->cfg->reserve_spares ? " beyond coordinator.reserve_spares" : "");
            } else if (tsr_dep_set_replicas(ds, d, d->replicas + 1) == 0) {
                taken[k] += per;
                decided(c, ds, now, true, "%d replica(s), from %d: the queue wait was %.0f ms "
                        "over %d s, above scale_up_queue_ms %d (%d request(s) in flight)",
                        d->replicas, d->replicas - 1, ds->scale.window_wait_ms,
                        d->scale_up_window_s, d->scale_up_queue_ms, in_flight);
                ds->scale.room_since_ms = 0;
                tsr_coord_mark_dirty(c);
            }
            continue;
        }
        if (ds->scale.room_since_ms &&
            now - ds->scale.room_since_ms >= (int64_t)d->scale_down_idle_s * 1000) {
            char why[200];
            snprintf(why, sizeof why, "the other replicas held every request in flight for "
                     "%d s (scale_down_idle_s)", d->scale_down_idle_s);
            drain_start(ds, d, now, false, why);
            next = now + 100;
            continue;
        }
        if (ds->scale.room_since_ms) {
            due = ds->scale.room_since_ms + (int64_t)d->scale_down_idle_s * 1000;
            if (due < next) next = due;
        }
    }
    return next;
}
