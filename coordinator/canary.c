/* canary.c: whether a ready replica really generates.  A replica can be "ready" (every
 * worker heartbeats, every piece loaded) and still not generate: a hung step, a wedged
 * device.  So each idle ready replica gets a one-token request every
 * canary_interval_ms; a canary with no token within canary_timeout_ms marks the
 * replica unhealthy (status says why, the router sends it nothing) until a later
 * canary succeeds or the replica is rewired.  Above the requests layer: it sends its
 * canaries under ids the router will not reuse, and looks at the router's requests
 * for a busy replica's progress. */
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "assign.h"
#include "canary.h"
#include "placement.h"
#include "router.h"

static void canary_send(tsr_coord_t *c, const tsr_deployment_t *d, int r, tsr_canary_t *k,
                        tsr_worker_t *leader, int64_t now)
{
    uint64_t wid = tsr_requests_new_id(c);
    if (!wid) return;
    int32_t prompt[1] = {0};
    Tessera__Generate g = TESSERA__GENERATE__INIT;
    g.request_id = wid;
    g.n_prompt = 1;
    g.prompt = prompt;
    g.max_tokens = 1;
    g.top_p = 1.0f;
    g.timeout_ms = (uint32_t)c->cfg->canary_timeout_ms;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = leader->piece.epoch;
    env.worker = leader->name;
    env.body_case = TESSERA__ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    if (tsr_coord_send(c, leader->rid, leader->rid_len, &env) < 0) return;
    k->wid = wid;
    k->sent_ms = now;
    k->epoch = leader->piece.epoch;
    snprintf(k->leader, sizeof k->leader, "%s", leader->name);
    c->stats.canaries++;
    tsr_debug("canary %llu -> %s replica %d", (unsigned long long)wid, d->name, r);
}

static void canary_fail(tsr_coord_t *c, const char *dep, int r, tsr_canary_t *k,
                        const char *why)
{
    if (!k->unhealthy)
        tsr_warn("deployment %s replica %d is unhealthy: %s; no requests go to it", dep, r, why);
    k->unhealthy = true;
    snprintf(k->why, sizeof k->why, "%s", why);
    k->wid = 0;
    c->stats.canaries_failed++;
    /* Requests sent to it since the canary went out would wait for good. */
    char msg[300];
    snprintf(msg, sizeof msg, "its replica is unhealthy: %s", why);
    tsr_requests_fail_replica(c, dep, r, msg);
    /* A new epoch: whatever hangs is let go of (the ranks abort their
     * groups and form again), and a member whose data plane cannot let go
     * reports itself stuck (its watchdog) and is replaced, so a replica
     * that no peer's deadline will ever report (every rank wedged, a hung
     * step of a lone rank) still recovers. */
    snprintf(msg, sizeof msg, "unhealthy (%s)", why);
    tsr_coord_rewire_later(c, dep, r, msg, c->now_ms ? c->now_ms : tsr_now_ms());
}

int64_t tsr_canary_tick(tsr_coord_t *c, int64_t now)
{
    int interval = c->cfg->canary_interval_ms;
    if (!interval) return 0;
    int64_t next = 0;
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        const tsr_deployment_t *d = &c->cfg->deployments[i];
        tsr_dep_state_t *ds = &c->deps[i];
        for (int r = 0; ds->canary && r < ds->n_completed && r < d->replicas; r++) {
            tsr_canary_t *k = &ds->canary[r];
            tsr_worker_t *leader = tsr_registry_ready_leader(c->reg, d, r);
            if (!leader) {  /* being placed, loaded or rewired */
                k->wid = 0;
                k->unhealthy = false;
                k->epoch = 0;
                continue;
            }
            if (leader->piece.epoch != k->epoch) {
                /* A new set of pieces starts healthy and is checked after an
                 * interval. */
                k->wid = 0;
                k->unhealthy = false;
                k->epoch = leader->piece.epoch;
                k->next_ms = now + interval;
            }
            if (k->wid) {
                int64_t due = k->sent_ms + c->cfg->canary_timeout_ms;
                if (now >= due) {
                    char why[200];
                    snprintf(why, sizeof why, "its canary (a one-token request) got no token "
                             "within %d ms (canary_timeout_ms)", c->cfg->canary_timeout_ms);
                    tsr_requests_cancel_at(c, k->leader, k->epoch, k->wid, "canary timed out");
                    canary_fail(c, d->name, r, k, why);
                    k->next_ms = now + interval;
                } else if (!next || due < next) {
                    next = due;
                }
                continue;
            }
            /* An idle replica, or a busy one silent for an interval (no
             * token and no new request on it: a hung step); a busy one that
             * streams tokens shows it works by them. */
            int64_t progress = tsr_requests_progress_ms(c, d, r);
            bool busy = progress && now - progress < interval;
            if (now >= k->next_ms && !busy) {
                canary_send(c, d, r, k, leader, now);
                k->next_ms = now + interval;
                if (k->wid) {
                    int64_t due = now + c->cfg->canary_timeout_ms;
                    if (!next || due < next) next = due;
                }
            }
            /* A busy one is looked at again when its silence would reach an
             * interval (never a time in the past, which would make the loop
             * spin), or at the tick after the message that ends its work. */
            int64_t at = busy && progress + interval > k->next_ms ? progress + interval : k->next_ms;
            if (!next || at < next) next = at;
        }
    }
    return next;
}

bool tsr_canary_token(tsr_coord_t *c, const tsr_worker_t *w, const Tessera__TokenEvent *t)
{
    if (!w->has_piece) return false;
    tsr_canary_t *k = tsr_coord_canary(c, w->piece.key.deployment, w->piece.key.replica);
    if (!k || !k->wid || k->wid != t->request_id) return false;
    if (t->error[0]) {
        char why[300];
        snprintf(why, sizeof why, "its canary failed: %s", t->error);
        canary_fail(c, w->piece.key.deployment, w->piece.key.replica, k, why);
        return true;
    }
    if (w->piece.key.stage != w->piece.key.pp_size - 1 || w->piece.key.tp != 0) return true;
    if (k->unhealthy)
        tsr_info("deployment %s replica %d is healthy again (its canary answered)",
                 w->piece.key.deployment, w->piece.key.replica);
    k->unhealthy = false;
    k->why[0] = '\0';
    k->wid = 0;
    return true;
}

