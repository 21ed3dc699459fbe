/* placement.c: the plan and the way to it.  A tick (or a control request) runs the
 * planner over the live workers and applies the reconciler's actions; every replica
 * that changed is marked for rewiring (state: `rewiring`), the requests layer moves
 * its requests off, and tsr_coord_rewire_marked sends each member its new epoch.
 * Replicas whose data plane failed are rewired again after a backoff. */
#include "placement.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "assign.h"
#include "common/log.h"
#include "resolve.h"
#include "common/budget.h"
#include "planner.h"
#include "reconciler.h"
#include "topology.h"
#include "waited.h"

/* A piece the next plan sees where it is about to be: `to` holds it (a standby that
 * loaded it), `from` (if any) no longer does. */
typedef struct {
    char to[TSR_NAME_MAX + 1], from[TSR_NAME_MAX + 1];
    tsr_piece_key_t key;
} hint_t;

struct tsr_placement {
    hint_t *hints;              /* for the next plan only (tsr_coord_hint_move) */
    size_t n_hints, cap_hints;
    tsr_replica_set_t lost;     /* replicas that lost a worker since the last plan */
    tsr_replica_set_t rewiring; /* replicas the plan just made rewires: the requests
                                   layer moves their requests off (at the epoch they ran
                                   in), then tsr_coord_rewire_marked rewires them */
};

/* Whether the next plan has a hint that worker `name` holds a piece. */
static bool hinted(const tsr_placement_t *p, const char *name)
{
    for (size_t i = 0; i < p->n_hints; i++)
        if (!strcmp(p->hints[i].to, name)) return true;
    return false;
}

tsr_placement_t *tsr_placement_new(void) { return calloc(1, sizeof(tsr_placement_t)); }

void tsr_placement_destroy(tsr_placement_t **self_p)
{
    if (!self_p || !*self_p) return;
    free((*self_p)->hints);
    tsr_replica_set_free(&(*self_p)->lost);
    tsr_replica_set_free(&(*self_p)->rewiring);
    free(*self_p);
    *self_p = NULL;
}

void tsr_coord_mark_lost(tsr_coord_t *c, int di, int replica)
{
    tsr_replica_set_add(&c->place->lost, di, replica);
}

void tsr_coord_lost_renumber(tsr_coord_t *c, const tsr_config_t *next)
{
    tsr_replica_set_t *lost = &c->place->lost;
    size_t kept = 0;
    for (size_t t = 0; t < lost->n; t++) {
        int ni = -1;
        if (lost->di[t] >= 0 && (size_t)lost->di[t] < c->cfg->n_deployments) {
            const char *name = c->cfg->deployments[lost->di[t]].name;
            for (size_t k = 0; k < next->n_deployments; k++)
                if (!strcmp(next->deployments[k].name, name)) ni = (int)k;
        }
        if (ni < 0) continue;
        lost->di[kept] = ni;
        lost->replica[kept++] = lost->replica[t];
    }
    lost->n = kept;
}

const tsr_replica_set_t *tsr_coord_rewiring(const tsr_coord_t *c) { return &c->place->rewiring; }

/* Logs the members of a replica about to be rewired that its group waited for. */
static void warn_waited(tsr_coord_t *c, const tsr_deployment_t *d, int replica)
{
    char waited[512];
    if (tsr_coord_waited_for_text(c, d, replica, waited, sizeof waited))
        tsr_warn("deployment %s replica %d: its tensor-parallel group waited past "
                 "collective_timeout_ms for %s, which reported no failure while the group's "
                 "other ranks did",
                 d->name, replica, waited);
}

static void rewire(tsr_coord_t *c, int di, int replica)
{
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    /* One peer list serves every member. */
    tsr_piece_key_t key = {.replica = replica, .tp_size = d->tensor, .pp_size = d->pipeline};
    snprintf(key.deployment, sizeof key.deployment, "%s", d->name);
    size_t n_peers = 0;
    char **peers = tsr_replica_peers(c, &key, &n_peers);
    size_t n;
    tsr_worker_t *const *m = tsr_registry_replica(c->reg, d->name, replica, &n);
    for (size_t i = 0; i < n; i++) {
        tsr_worker_t *w = m[i];
        w->piece.epoch = c->epoch;
        w->state = TSR_W_LOADING;
        w->reason[0] = '\0';
        if (peers) tsr_send_assign_peers(c, w, di, peers, n_peers);
        else tsr_send_assign(c, w, di);
    }
    free(peers);
    tsr_info("rewire %s replica %d (epoch %llu): %zu member(s) form its data plane", d->name,
             replica, (unsigned long long)c->epoch, n);
}

void tsr_coord_rewire_marked(tsr_coord_t *c)
{
    tsr_replica_set_t *m = &c->place->rewiring;
    for (size_t t = 0; t < m->n; t++) rewire(c, m->di[t], m->replica[t]);
    m->n = 0;
}

/* Plans at most this often: a burst of registrations becomes one plan, not one per
 * message. */
#define PLAN_MIN_GAP_MS 20

void tsr_coord_mark_dirty(tsr_coord_t *c) { c->dirty = true; }

void tsr_coord_plan_after(tsr_coord_t *c, int64_t plan_after_ms)
{
    c->plan_after_ms = plan_after_ms;
    c->dirty = true;
}

int64_t tsr_coord_plan_due(const tsr_coord_t *c)
{
    if (!c->dirty) return 0;
    int64_t gap = c->last_plan_ms + PLAN_MIN_GAP_MS;
    return c->plan_after_ms > gap ? c->plan_after_ms : gap;
}

bool tsr_coord_plan_ready(tsr_coord_t *c, int64_t now_ms)
{
    int64_t due = tsr_coord_plan_due(c);
    if (!due || now_ms < due) return false;
    c->dirty = false;
    c->last_plan_ms = now_ms;
    return true;
}

void tsr_coord_hint_move(tsr_coord_t *c, const char *to, const char *from,
                         const tsr_piece_key_t *key)
{
    tsr_placement_t *p = c->place;
    size_t i = 0;
    while (i < p->n_hints && strcmp(p->hints[i].to, to)) i++;
    if (i == p->n_hints) {
        if (p->n_hints == p->cap_hints) {
            size_t cap = p->cap_hints ? 2 * p->cap_hints : 8;
            hint_t *h = realloc(p->hints, cap * sizeof *h);
            if (!h) return;   /* out of memory: the move waits for the next plan */
            p->hints = h;
            p->cap_hints = cap;
        }
        p->n_hints++;
    }
    hint_t *h = &p->hints[i];
    snprintf(h->to, sizeof h->to, "%s", to);
    snprintf(h->from, sizeof h->from, "%s", from ? from : "");
    h->key = *key;
}

uint64_t tsr_coord_next_epoch(tsr_coord_t *c)
{
    if (c->epoch >= TSR_EPOCH_MAX) {
        tsr_error("plan epoch %llu is at its limit %llu: no new epoch can be given; restart "
                  "the workers and the coordinator",
                  (unsigned long long)c->epoch, (unsigned long long)TSR_EPOCH_MAX);
        return 0;
    }
    return ++c->epoch;
}

bool tsr_coord_may_plan(tsr_coord_t *c, int64_t now_ms)
{
    if (now_ms < c->plan_after_ms) {
        c->dirty = true;
        return false;
    }
    c->dirty = false;
    c->last_plan_ms = now_ms;
    return true;
}

void tsr_coord_replan(tsr_coord_t *c, int64_t now_ms)
{
    (void)now_ms;
    size_t n = tsr_registry_size(c->reg);
    tsr_plan_worker_t *pw = calloc(n ? n : 1, sizeof *pw);
    tsr_plan_worker_t *held = calloc(n ? n : 1, sizeof *held);
    tsr_worker_t **ws = calloc(n ? n : 1, sizeof *ws);
    tsr_action_t *acts = calloc(n ? n : 1, sizeof *acts);
    int *layers = calloc(c->cfg->n_deployments ? c->cfg->n_deployments : 1, sizeof *layers);
    tsr_config_t view = *c->cfg;
    tsr_deployment_t *placeable = NULL;
    tsr_plan_t *plan = NULL;
    int *map = NULL;    /* planner's deployment index -> config index */
    uint64_t **need = NULL;
    if (!pw || !held || !ws || !acts || !layers) goto out;

    /* Deployments whose model could not be read are hidden from the planner
     * (replicas 0 would be invalid, so they are left out by name instead). */
    placeable = calloc(c->cfg->n_deployments ? c->cfg->n_deployments : 1, sizeof *placeable);
    if (!placeable) goto out;
    view.deployments = placeable;
    view.n_deployments = 0;
    map = calloc(c->cfg->n_deployments ? c->cfg->n_deployments : 1, sizeof *map);
    if (!map) goto out;
    /* What one piece of each stage needs on its GPU (cuda deployments). */
    need = calloc(c->cfg->n_deployments ? c->cfg->n_deployments : 1, sizeof *need);
    if (!need) goto out;
    tsr_coord_resolve_layouts(c);
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        /* an auto layout not chosen yet is not planned (status says why) */
        if (!c->deps[i].model_ok || !c->deps[i].layout_chosen) continue;
        const tsr_deployment_t *d = &c->cfg->deployments[i];
        if (d->device == TSR_DEVICE_CUDA) {
            uint64_t *st = calloc((size_t)d->pipeline, sizeof *st);
            if (!st) goto out;
            for (int s = 0; s < d->pipeline; s++)
                st[s] = tsr_piece_need(&c->deps[i].model, d, s);
            need[view.n_deployments] = st;
        }
        map[view.n_deployments] = (int)i;
        layers[view.n_deployments] = c->deps[i].model.num_hidden_layers;
        placeable[view.n_deployments++] = c->cfg->deployments[i];
    }

    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        if (w->state == TSR_W_DEAD || w->finishing) continue;  /* finishing: not yet free */
        /* a standby loading a piece (a move back, a new cut) is no one else's; at its
         * switch a hint gives it its piece */
        if (!w->has_piece && tsr_coord_is_standby(c, w->name) && !hinted(c->place, w->name))
            continue;
        ws[k] = w;
        pw[k].name = w->name;
        pw[k].node = w->node;
        pw[k].device = w->device;
        pw[k].memory = w->device == TSR_DEVICE_CUDA ? w->memory : 0;
        pw[k].eligible = !w->drained;
        if (w->has_piece) pw[k].current = w->piece.key;
        k++;
    }
    tsr_nvlink_domains(ws, k);
    for (size_t i = 0; i < k; i++) {
        pw[i].domain = ws[i]->nvlink_domain;
        pw[i].gpu = ws[i]->pci_bus_id;
    }

    /* Standbys (tsr_coord_hint_move): the piece is its standby's and its old holder
     * holds nothing, in the planner's eyes; the actions are still worked out from what
     * each worker really holds. */
    memcpy(held, pw, k * sizeof *pw);
    for (size_t h = 0; h < c->place->n_hints; h++) {
        const hint_t *x = &c->place->hints[h];
        for (size_t i = 0; i < k; i++) {
            if (!strcmp(pw[i].name, x->to) && !pw[i].current.deployment[0])
                pw[i].current = x->key;
            else if (x->from[0] && !strcmp(pw[i].name, x->from) &&
                     tsr_piece_equal(&pw[i].current, &x->key))
                memset(&pw[i].current, 0, sizeof pw[i].current);
        }
    }
    c->place->n_hints = 0;

    char err[256];
    if (tsr_plan_compute_mem(&view, layers, (const uint64_t *const *)need, pw, k, &plan, err,
                             sizeof err) < 0) {
        tsr_error("planner: %s", err);
        goto out;
    }
    c->stats.plans++;

    size_t na = tsr_reconcile_actions(plan, held, k, acts);
    /* Epochs never wrap: at the cap nothing more is planned, loudly. */
    if ((na > 0 || c->place->lost.n > 0) && c->epoch >= TSR_EPOCH_MAX) {
        tsr_error("plan epoch %llu is at its limit %llu: no new plan can be made; restart "
                  "the workers and the coordinator",
                  (unsigned long long)c->epoch, (unsigned long long)TSR_EPOCH_MAX);
        goto out;
    }
    if (na > 0) c->epoch++;
    /* The replicas this plan changes (empty: the last plan's were rewired). */
    tsr_replica_set_t *touched = &c->place->rewiring, *lost = &c->place->lost;
    for (size_t i = 0; i < na; i++) {
        tsr_worker_t *w = ws[acts[i].worker];
        if (acts[i].kind == TSR_ACT_UNASSIGN) {
            tsr_info("unassign %s from %s r%d s%d t%d (epoch %llu)", w->name,
                     w->piece.key.deployment, w->piece.key.replica, w->piece.key.stage, w->piece.key.tp,
                     (unsigned long long)c->epoch);
            tsr_replica_set_add(touched, tsr_coord_dep_index(c, w->piece.key.deployment), w->piece.key.replica);
            tsr_send_unassign(c, w, w->drained ? "drained" : "piece no longer in the plan");
            tsr_registry_clear_piece(c->reg, w);
            w->state = TSR_W_IDLE;
            w->reason[0] = w->detail[0] = '\0';
            continue;
        }
        const tsr_piece_t *p = acts[i].piece;
        int di = map[p->deployment];
        const tsr_deployment_t *d = &c->cfg->deployments[di];
        if (w->has_piece) tsr_replica_set_add(touched, tsr_coord_dep_index(c, w->piece.key.deployment), w->piece.key.replica);
        tsr_piece_key_t key = {.replica = p->replica, .stage = p->stage, .tp = p->tp,
                               .tp_size = d->tensor, .pp_size = d->pipeline,
                               .layer_begin = p->layer_begin, .layer_end = p->layer_end};
        snprintf(key.deployment, sizeof key.deployment, "%s", d->name);
        if (tsr_registry_set_piece(c->reg, w, &key, c->epoch, 0) < 0) {
            /* the piece stays unplaced; the next plan tries again */
            tsr_error("out of memory assigning %s r%d s%d t%d to %s", d->name, p->replica,
                      p->stage, p->tp, w->name);
            w->state = TSR_W_IDLE;
            c->dirty = true;
            continue;
        }
        w->state = TSR_W_LOADING;
        w->reason[0] = w->detail[0] = '\0';
        tsr_info("assign %s r%d s%d t%d layers [%d,%d) to %s on %s (epoch %llu)", d->name,
                 p->replica, p->stage, p->tp, p->layer_begin, p->layer_end, w->name, w->node,
                 (unsigned long long)c->epoch);
        tsr_replica_set_add(touched, di, p->replica);
    }
    /* A replica that lost a worker is rewired even when nobody replaces it:
     * its survivors stop waiting on the dead peer and hold their weights
     * until the replica is whole again. */
    for (size_t t = 0; t < lost->n; t++) {
        if (!na && t == 0) c->epoch++;
        tsr_replica_set_add(touched, lost->di[t], lost->replica[t]);
    }
    lost->n = 0;
    /* Every replica that changed is rewired as a whole in the new epoch
     * (tsr_coord_rewire_marked, once its requests have moved off). */
    for (size_t t = 0; t < touched->n; t++)
        warn_waited(c, &c->cfg->deployments[touched->di[t]], touched->replica[t]);

    /* What each deployment lacks, for status. */
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        c->deps[i].short_by = 0, c->deps[i].shortage[0] = '\0';
    for (size_t i = 0; i < view.n_deployments; i++) {
        c->deps[map[i]].short_by = plan->deps[i].short_by;
        c->deps[map[i]].short_memory = plan->deps[i].mem_stage >= 0 ? plan->deps[i].mem_need : 0;
        if (plan->deps[i].short_by) {
            tsr_plan_shortage_of(plan, i, pw, c->deps[map[i]].shortage,
                                 sizeof c->deps[map[i]].shortage);
            tsr_warn("deployment %s: %s", c->cfg->deployments[map[i]].name,
                     c->deps[map[i]].shortage);
        }
    }
out:
    tsr_plan_destroy(&plan);
    for (size_t i = 0; need && i < c->cfg->n_deployments; i++) free(need[i]);
    free(need);
    free(map);
    free(placeable);
    free(layers);
    free(acts);
    free(ws);
    free(held);
    free(pw);
}

/* A replica whose data plane broke without a worker dying (a peer that
 * stalled past its deadline, a dropped connection) is rewired again after a
 * backoff: the workers keep their weights and form new communicators. */
void tsr_coord_rewire_later(tsr_coord_t *c, const char *deployment, int replica,
                            const char *why, int64_t now)
{
    int di = tsr_coord_dep_index(c, deployment);
    if (di < 0) return;
    tsr_dep_state_t *ds = &c->deps[di];
    tsr_replica_set_add(&ds->retry, di, replica);
    if (ds->retry_at_ms) return;
    if (!ds->retry_backoff_ms) ds->retry_backoff_ms = 2000;
    ds->retry_at_ms = now + ds->retry_backoff_ms;
    tsr_warn("deployment %s replica %d: %s; rewiring in %d ms", ds->name, replica, why,
             ds->retry_backoff_ms);
    ds->retry_backoff_ms = ds->retry_backoff_ms * 2 > 60000 ? 60000 : ds->retry_backoff_ms * 2;
}

void tsr_coord_retry_failed(tsr_coord_t *c, tsr_worker_t *w, int64_t now)
{
    if (!w->retryable) return;  /* load errors need the operator */
    char why[600];
    snprintf(why, sizeof why, "data plane failed (%s)", w->reason);
    tsr_coord_rewire_later(c, w->piece.key.deployment, w->piece.key.replica, why, now);
}

/* Called on every piece that becomes ready.  Once every replica of its
 * deployment is ready, the deployment has been ready (a gap from now on is
 * "degraded", whoever looked).  Once its own replica is whole again, the
 * data plane formed: the rewiring backoff starts over, so that the next
 * failure (a new fault) is retried quickly.  A replica that never forms
 * keeps backing off. */
void tsr_coord_note_ready(tsr_coord_t *c, const tsr_worker_t *w)
{
    int di = tsr_coord_dep_index(c, w->piece.key.deployment);
    if (di < 0 || (c->deps[di].ever_ready && !c->deps[di].retry_backoff_ms)) return;
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    if (tsr_registry_ready_leader(c->reg, d, w->piece.key.replica)) c->deps[di].retry_backoff_ms = 0;
    int whole = 0;
    for (int r = 0; r < d->replicas; r++) whole += tsr_registry_ready_leader(c->reg, d, r) != NULL;
    if (whole == d->replicas) c->deps[di].ever_ready = true;
}

void tsr_coord_run_retries(tsr_coord_t *c, int64_t now)
{
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        tsr_dep_state_t *ds = &c->deps[i];
        if (!ds->retry_at_ms || now < ds->retry_at_ms) continue;
        for (size_t t = 0; t < ds->retry.n; t++)
            tsr_coord_mark_lost(c, (int)i, ds->retry.replica[t]);
        ds->retry.n = 0;
        ds->retry_at_ms = 0;
        c->dirty = true;
    }
}
