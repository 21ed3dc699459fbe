/* rebalance.c: pieces moved back where they belong, make before break.  Above the
 * requests layer, beside autoscale.c: it reads the registry and the router's count
 * of requests, sends the standby assignment (assign.c), takes a new epoch from
 * placement, and leaves the switch itself to the next plan, told where the piece is
 * (tsr_coord_hint_move).
 *
 * What is moved: a rank of a tensor-parallel group whose ranks are all ready and
 * do not share a place, when an idle worker of the deployment's kind stands where
 * most of the group is: first the node (an all-reduce across the network on every
 * layer), then the NVLink domain within it.  The idle worker must be able to hold
 * the piece (a cuda piece's bytes) and must not share a GPU with another rank of
 * the group.  The move, step by step:
 *   1. the idle worker is sent the piece with no peer placed (tsr_send_standby): it
 *      loads the weights and serves nothing;
 *   2. once it says ready, and another replica of the deployment serves or the
 *      piece's replica has no request in flight, one plan gives it the piece and
 *      unassigns the old holder; the replica is rewired in the new epoch, its other
 *      members keep their weights, and the requests on it resume (not counted as
 *      failures);
 *   3. it is done when the registry shows the new holder with the piece.
 * A move is given up when the piece, its holder or the standby changes under it
 * (a death, a drain, a reload, a plan that gives the standby another piece, a
 * failure to load), and the standby's weights are then dropped. */
#include "rebalance.h"

#include <stdio.h>
#include <string.h>

#include "assign.h"
#include "common/budget.h"
#include "common/log.h"
#include "placement.h"
#include "router.h"

/* Tensor groups larger than this are left where they are. */
#define MAX_GROUP 256

/* The tensor group of stage s of replica r of d when every rank is placed and ready
 * in d's layout (into g, d->tensor of them). */
static bool group_of(tsr_coord_t *c, const tsr_deployment_t *d, int r, int s, tsr_worker_t **g)
{
    for (int t = 0; t < d->tensor; t++) {
        g[t] = tsr_registry_at_slot(c->reg, d->name, r, d->tensor, d->pipeline, s * d->tensor + t);
        if (!g[t] || g[t]->state != TSR_W_READY) return false;
    }
    return true;
}

/* Whether ranks a and b of a group share a place at this level. */
static bool together(const tsr_worker_t *a, const tsr_worker_t *b, bool domain)
{
    return !strcmp(a->node, b->node) && (!domain || !strcmp(a->nvlink_domain, b->nvlink_domain));
}

/* An idle worker that can take rank `odd` of group g at g[home]'s place. */
static tsr_worker_t *standby_for(tsr_coord_t *c, size_t di, int s, tsr_worker_t *const *g, int n,
                                 int home, int odd, bool domain)
{
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    uint64_t need = d->device == TSR_DEVICE_CUDA ? tsr_piece_need(&c->deps[di].model, d, s) : 0;
    for (size_t i = 0, nw = tsr_registry_size(c->reg); i < nw; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        if (!tsr_coord_worker_idle(c, w) || w->device != d->device ||
            strcmp(w->node, g[home]->node) ||
            (domain && strcmp(w->nvlink_domain, g[home]->nvlink_domain)))
            continue;
        if (need && w->memory && w->memory < need) continue;
        /* a smaller GPU would lower the replica's KV budget: every member would reload */
        if (d->device == TSR_DEVICE_CUDA && w->memory < g[odd]->memory) continue;
        /* one that failed to load this piece is not asked again for a while */
        if (c->rebalance.failed_until_ms > c->now_ms && !strcmp(c->rebalance.failed_worker, w->name) &&
            tsr_piece_equal(&c->rebalance.failed_key, &g[odd]->piece.key))
            continue;
        bool shares_gpu = false;
        for (int k = 0; k < n; k++)
            shares_gpu |= k != odd && w->pci_bus_id[0] && !strcmp(g[k]->node, w->node) &&
                          !strcmp(g[k]->pci_bus_id, w->pci_bus_id);
        if (!shares_gpu) return w;
    }
    return NULL;
}

/* The first piece that can move back, with its holder and where it goes. */
static bool find_move(tsr_coord_t *c, size_t *di_out, tsr_worker_t **from, tsr_worker_t **to)
{
    tsr_worker_t *g[MAX_GROUP];
    for (size_t di = 0; di < c->cfg->n_deployments; di++) {
        const tsr_deployment_t *d = &c->cfg->deployments[di];
        if (!c->deps[di].model_ok || !c->deps[di].layout_chosen || c->deps[di].reshard.active ||
            d->tensor < 2 ||
            d->tensor > MAX_GROUP)
            continue;
        for (int r = 0; r < d->replicas; r++)
            for (int s = 0; s < d->pipeline; s++) {
                if (!group_of(c, d, r, s, g)) continue;
                for (int level = 0; level < 2; level++) {
                    /* the places most ranks share, each tried as home in rank order:
                     * the first rank elsewhere moves there if an idle worker can take it */
                    bool domain = level == 1, moved = false;
                    int n = d->tensor, cnt[MAX_GROUP], most = 0;
                    for (int a = 0; a < n; a++) {
                        cnt[a] = 0;
                        for (int b = 0; b < n; b++) cnt[a] += together(g[a], g[b], domain);
                        if (cnt[a] > most) most = cnt[a];
                    }
                    if (most == n) continue;  /* one place at this level: look closer */
                    for (int home = 0; home < n && !moved; home++) {
                        bool first = cnt[home] == most && !(domain && !g[home]->nvlink_domain[0]);
                        for (int b = 0; b < home && first; b++) first = !together(g[b], g[home], domain);
                        if (!first) continue;
                        int odd = 0;
                        while (together(g[odd], g[home], domain)) odd++;
                        tsr_worker_t *w = standby_for(c, di, s, g, n, home, odd, domain);
                        if (w) {
                            *di_out = di, *from = g[odd], *to = w;
                            moved = true;
                        }
                    }
                    if (moved) return true;
                    break;  /* a closer level cannot help while this one is split */
                }
            }
    }
    return false;
}

static void describe(char *buf, size_t len, const tsr_piece_key_t *k, const char *from,
                     const char *from_node, const char *to, const char *to_node)
{
    snprintf(buf, len, "%s r%d s%d t%d from %s (node %s) to %s (node %s)", k->deployment,
             k->replica, k->stage, k->tp, from, from_node, to, to_node);
}

/* The move under way is at `step` (status's doing). */
static void at_step(tsr_coord_t *c, const char *step)
{
    snprintf(c->rebalance.doing, sizeof c->rebalance.doing, "moving %s: %s", c->rebalance.what,
             step);
}

static void end_move(tsr_coord_t *c, bool moved, const char *why)
{
    const char *what = c->rebalance.what;
    if (moved) {
        c->rebalance.moves++;
        snprintf(c->rebalance.last, sizeof c->rebalance.last, "moved %s", what);
        tsr_info("rebalance: %s", c->rebalance.last);
    } else {
        c->rebalance.abandoned++;
        snprintf(c->rebalance.last, sizeof c->rebalance.last, "gave up moving %s: %s", what, why);
        tsr_warn("rebalance: %s", c->rebalance.last);
        /* the standby's weights go, unless a plan gave it something else meanwhile */
        tsr_worker_t *w = tsr_registry_find(c->reg, c->rebalance.to);
        if (w && w->state != TSR_W_DEAD && !w->has_piece)
            tsr_send_unassign(c, w, "the move it stood by for was given up");
    }
    c->rebalance.active = c->rebalance.switching = c->rebalance.loaded = false;
    c->rebalance.doing[0] = '\0';
}

/* The move under way, one step. */
static void step(tsr_coord_t *c)
{
    tsr_piece_key_t *k = &c->rebalance.key;
    tsr_worker_t *from = tsr_registry_find(c->reg, c->rebalance.from);
    tsr_worker_t *to = tsr_registry_find(c->reg, c->rebalance.to);
    int di = tsr_coord_dep_index(c, k->deployment);
    bool from_holds = from && from->state != TSR_W_DEAD && from->has_piece &&
                      tsr_piece_equal(&from->piece.key, k);
    bool to_holds = to && to->state != TSR_W_DEAD && to->has_piece && tsr_piece_equal(&to->piece.key, k);
    /* the standby holds it (a plan, the switch or a failover of the old holder, gave it) */
    if (to_holds && !from_holds) {
        end_move(c, true, NULL);
        return;
    }
    const char *why = di < 0 ? "the deployment is gone"
                      : !to || to->state == TSR_W_DEAD ? "the worker it was moving to died"
                      : to->drained                     ? "the worker it was moving to was drained"
                      : to->has_piece && !to_holds      ? "a plan gave the standby another piece"
                      : !from_holds ? "the piece's holder no longer holds it (it died, was "
                                      "drained, or a reload changed the piece)"
                                    : NULL;
    if (why) {
        end_move(c, false, why);
        return;
    }
    if (!c->rebalance.loaded || c->rebalance.switching) return;
    /* no replica that serves stops: another one serves, or this one is idle */
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    if (!tsr_requests_another_serves(c, d, k->replica) &&
        tsr_requests_in_flight(c, d->name, k->replica) > 0)
        return;
    c->rebalance.switching = true;
    at_step(c, "the weights are loaded; the replica is rewired onto it");
    tsr_coord_mark_dirty(c);
}

int64_t tsr_rebalance_tick(tsr_coord_t *c, int64_t now)
{
    int64_t interval = (int64_t)c->cfg->rebalance_interval_s * 1000;
    if (c->rebalance.active && !interval) end_move(c, false, "coordinator.rebalance_interval_s is 0");
    if (c->rebalance.active) {
        step(c);
        /* until a plan has made the switch, every plan is told where the piece is */
        if (c->rebalance.switching)
            tsr_coord_hint_move(c, c->rebalance.to, c->rebalance.from, &c->rebalance.key);
        return c->rebalance.active ? now + 100 : 0;
    }
    if (!interval || now < c->plan_after_ms) return 0;
    if (c->rebalance.last_ms && now - c->rebalance.last_ms < interval)
        return c->rebalance.last_ms + interval;
    size_t di;
    tsr_worker_t *from, *to;
    if (!find_move(c, &di, &from, &to)) return 0;
    uint64_t epoch = tsr_coord_next_epoch(c);
    if (!epoch) return 0;
    c->rebalance.active = true;
    c->rebalance.switching = c->rebalance.loaded = false;
    c->rebalance.key = from->piece.key;
    c->rebalance.epoch = epoch;
    c->rebalance.last_ms = now;
    snprintf(c->rebalance.from, sizeof c->rebalance.from, "%s", from->name);
    snprintf(c->rebalance.to, sizeof c->rebalance.to, "%s", to->name);
    describe(c->rebalance.what, sizeof c->rebalance.what, &from->piece.key, from->name, from->node,
             to->name, to->node);
    char step[TSR_NAME_MAX + 32];
    snprintf(step, sizeof step, "%s loads its weights", to->name);
    at_step(c, step);
    tsr_info("rebalance: %s (epoch %llu)", c->rebalance.doing, (unsigned long long)epoch);
    if (tsr_send_standby(c, to, (int)di, &from->piece.key, epoch) < 0)
        end_move(c, false, "the standby could not be sent its piece");
    return now + 100;
}

bool tsr_rebalance_message(tsr_coord_t *c, tsr_worker_t *w, const tsr_env_t *env)
{
    if (!c->rebalance.active || strcmp(w->name, c->rebalance.to) || env->epoch != c->rebalance.epoch ||
        w->has_piece)
        return false;
    if (env->body_case == TESSERA__ENVELOPE__BODY_READY && !c->rebalance.loaded) {
        c->rebalance.loaded = true;
        at_step(c, "the weights are loaded; it switches once another replica serves or this one "
                   "is idle");
    } else if (env->body_case == TESSERA__ENVELOPE__BODY_FAILED) {
        if (env->failed->fatal) return false;  /* the loop declares it dead */
        char why[400];
        snprintf(why, sizeof why, "the standby failed to load: %s", env->failed->reason);
        snprintf(c->rebalance.failed_worker, sizeof c->rebalance.failed_worker, "%s", w->name);
        c->rebalance.failed_key = c->rebalance.key;
        c->rebalance.failed_until_ms =
            (c->now_ms ? c->now_ms : tsr_now_ms()) + 10 * (int64_t)c->cfg->rebalance_interval_s * 1000;
        end_move(c, false, why);
    }
    return true;
}
