/* reshard.c: a reload's new cut built beside the running one, make before break.
 * Beside rebalance.c (above the requests layer): it places as many replicas of the new
 * cut as the idle workers hold (after letting old replicas go, when none is idle) with
 * the planner itself (the same rules: tensor groups on one node, distinct GPUs,
 * memory), sends each piece to its standby (assign.c), and at the switch changes the
 * deployment's cut and tells placement where each piece already is
 * (tsr_coord_hint_move).  Old replicas with requests in flight finish them in place
 * (their workers `finishing`, out of placement) before they are let go; the new cut's
 * other replicas then load on their workers.  The steps show in the deployment's status
 * as reshard.doing. */
#include "reshard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "assign.h"
#include "common/budget.h"
#include "common/log.h"
#include "placement.h"
#include "planner.h"
#include "router.h"

/* How long an old cut's replica may take to finish its requests in place before they
 * move to the new cut's replicas (resumed from their tokens). */
#define FINISH_MAX_MS 30000
/* How long a worker that finished an old cut's requests keeps its weights for a plan or a
 * standby to give it a piece (which keeps the layers it holds) before it lets go. */
#define RELEASE_GRACE_MS 1000

bool tsr_reshard_choose(int replicas, int per_old, int want, int per_new, int idle,
                        int *beside, int *drop)
{
    *beside = *drop = 0;
    if (per_old < 1 || per_new < 1 || want < 1 || replicas < 1) return false;
    if (idle < per_new) {   /* old replicas make room, one serving at least */
        *drop = (per_new - idle + per_old - 1) / per_old;
        if (*drop > replicas - 1) {
            *drop = 0;
            return false;
        }
        idle += *drop * per_old;
    }
    *beside = idle / per_new < want ? idle / per_new : want;
    return true;
}

/* What the build is, for the status lines: "tp 2 x pp 1 x 2" when it builds all of the
 * new cut beside, "1 of the 2 replicas of tp 2 x pp 1" when it builds some. */
static void what_builds(const tsr_dep_state_t *ds, char *out, size_t len)
{
    if (ds->reshard.beside >= ds->reshard.replicas)
        snprintf(out, len, "tp %d x pp %d x %d", ds->reshard.tensor, ds->reshard.pipeline,
                 ds->reshard.replicas);
    else
        snprintf(out, len, "%d of the %d replicas of tp %d x pp %d", ds->reshard.beside,
                 ds->reshard.replicas, ds->reshard.tensor, ds->reshard.pipeline);
}

/* The new cut applies now: the deployment takes it and the state ends. */
static void apply(tsr_coord_t *c, size_t di, const char *how)
{
    tsr_deployment_t *d = &c->cfg->deployments[di];
    tsr_dep_state_t *ds = &c->deps[di];
    int was_t = d->tensor, was_p = d->pipeline, was_r = d->replicas;
    d->tensor = ds->reshard.tensor;
    d->pipeline = ds->reshard.pipeline;
    if (tsr_dep_set_replicas(ds, d, ds->reshard.replicas) < 0)
        tsr_error("deployment %s: out of memory resizing to %d replicas", d->name,
                  ds->reshard.replicas);
    tsr_dep_note_cut(ds, d);
    snprintf(ds->reshard.last, sizeof ds->reshard.last, "tp %d x pp %d x %d replaced tp %d x pp "
             "%d x %d %s", d->tensor, d->pipeline, d->replicas, was_t, was_p, was_r, how);
    tsr_coord_mark_dirty(c);
}

/* Old replicas of d (from from_replica on) finish their requests in place: every member
 * leaves the registry's replicas (the plan neither places nor releases it; new requests
 * go to the others) until its replica's attempts end (finish_done).  At the switch
 * (every = false) only whole, ready replicas do: `serve` of them (those with requests in
 * flight first, whose workers would not be free at once anyway) go on taking new
 * requests beside the new cut's (`serving`), the others with requests in flight take no
 * new one; the rest are released by the plan (a broken one's requests move as before).
 * Old replicas let go to make room (every = true) all finish, so that no plan hands
 * their workers to anyone else before the standbys are sent.  Returns the workers that
 * finish; *kept (may be NULL) the replicas that serve. */
static int finish_in_place(tsr_coord_t *c, const tsr_deployment_t *d, int from_replica,
                           bool every, int serve, int *kept, int64_t now)
{
    int n = 0, per = d->tensor * d->pipeline, served = 0;
    tsr_worker_t **m = calloc((size_t)per, sizeof *m);
    if (!m) return 0;   /* out of memory: the plan releases them, their requests move */
    /* pass 0 keeps serving the busy whole replicas, pass 1 the idle ones, up to serve;
     * pass 1 also marks the busy ones left (they only finish) */
    for (int pass = 0; pass < 2; pass++) {
        for (int r = from_replica; r < d->replicas; r++) {
            const tsr_worker_t *lead =
                tsr_registry_at_slot(c->reg, d->name, r, d->tensor, d->pipeline, 0);
            if (!lead) continue;
            uint64_t epoch = lead->piece.epoch;
            int held = 0;
            bool whole = true;
            for (int k = 0; k < per; k++) {
                m[k] = tsr_registry_at_slot(c->reg, d->name, r, d->tensor, d->pipeline, k);
                if (!m[k]) continue;
                held++;
                whole &= m[k]->state == TSR_W_READY && m[k]->piece.epoch == epoch;
            }
            whole &= held == per;
            bool busy = tsr_requests_of_attempt(c, d->name, r, epoch, NULL) > 0;
            bool keep = !every && whole && served < serve && (busy || pass == 1);
            if (!every && !keep && (pass == 0 || !whole || !busy)) continue;
            served += keep;
            for (int k = 0; k < per; k++) {
                if (!m[k]) continue;
                m[k]->finished = m[k]->piece;
                m[k]->finished.epoch = epoch;      /* the attempts' */
                m[k]->finished_pid = m[k]->pid;
                m[k]->finishing_since_ms = now;
                tsr_registry_clear_piece(c->reg, m[k]);
                m[k]->finishing = true;
                m[k]->serving = keep;
                m[k]->finish_failed = false;
                m[k]->room = every;
                m[k]->room_done = false;
                n++;
            }
        }
        if (every) break;
    }
    free(m);
    if (kept) *kept = served;
    if (served)
        tsr_info("deployment %s: %d replica(s) of the old cut go on taking requests beside the "
                 "new cut's until its other replicas serve", d->name, served);
    if (n > served * per)
        tsr_info("deployment %s: %d worker(s) of the old cut finish the requests they have in "
                 "flight, taking no new one, before they are let go", d->name, n - served * per);
    return n;
}

/* Whether w was let go to make room for d's new cut and is held for its standbys. */
static bool held_for(const tsr_worker_t *w, const tsr_deployment_t *d)
{
    return w->room_done && w->state != TSR_W_DEAD && !w->drained && w->device == d->device &&
           !strcmp(w->finished.key.deployment, d->name);
}

int tsr_reshard_free_for(const tsr_coord_t *c, const tsr_deployment_t *d)
{
    int n = tsr_coord_idle_count(c, d->device);
    for (size_t i = 0, nw = tsr_registry_size(c->reg); i < nw; i++)
        n += held_for(tsr_registry_at(c->reg, i), d);
    return n;
}

/* Whether m is a member of the old cut's replica that w finishes for (w included). */
static bool same_old_replica(const tsr_worker_t *m, const tsr_worker_t *w)
{
    return m->finishing && m->finished.epoch == w->finished.epoch &&
           m->finished.key.replica == w->finished.key.replica &&
           !strcmp(m->finished.key.deployment, w->finished.key.deployment);
}

/* Whether deployment di's old replicas may still serve beside its new cut: its change
 * of cut is switching and has not stopped them, nor been replaced by a reload. */
static bool serving_on(const tsr_coord_t *c, int di, int64_t now)
{
    return di >= 0 && tsr_coord_serving_beside(c, &c->cfg->deployments[di]) &&
           now - c->deps[di].reshard.switched_ms <= FINISH_MAX_MS;
}

/* Whether worker w, finishing an old cut's requests, is done: its replica's attempts
 * have ended, a member of it died, restarted or registered again (they move to the new
 * cut, from their tokens), or FINISH_MAX_MS passed (the same).  Then it is let go. */
static bool finish_done(tsr_coord_t *c, tsr_worker_t *w, int64_t now)
{
    const tsr_holding_t *f = &w->finished;
    if (w->room_done) {   /* held for its deployment's standbys until they are sent */
        int di = tsr_coord_dep_index(c, f->key.deployment);
        if (di >= 0 && c->deps[di].reshard.active && !c->deps[di].reshard.sent &&
            w->state != TSR_W_DEAD)
            return false;
        w->finishing = w->room = w->room_done = false;
        /* out of placement until now: the grace for a plan to give it a piece starts now */
        if (w->release_due_ms) w->release_due_ms = now + RELEASE_GRACE_MS;
        tsr_coord_mark_dirty(c);
        return true;
    }
    int di = tsr_coord_dep_index(c, f->key.deployment);
    bool broken = di < 0;
    for (size_t i = 0, nw = tsr_registry_size(c->reg); i < nw && !broken; i++) {
        const tsr_worker_t *m = tsr_registry_at(c->reg, i);
        broken = same_old_replica(m, w) &&
                 (m->state != TSR_W_READY || m->pid != m->finished_pid || m->finish_failed);
    }
    if (w->serving && (broken || !serving_on(c, di, now))) {
        /* every member stops taking requests together; a broken one's move now */
        for (size_t i = 0, nw = tsr_registry_size(c->reg); i < nw; i++) {
            tsr_worker_t *m = tsr_registry_at(c->reg, i);
            if (!m->serving || !same_old_replica(m, w)) continue;
            m->serving = false;
            m->finishing_since_ms = now;
        }
        if (di >= 0 && c->deps[di].reshard.serving > 0) c->deps[di].reshard.serving--;
    }
    if (w->serving) return false;                   /* it takes requests still */
    const char *why = broken ? "a worker of its old cut's replica was lost while it finished"
                      : now - w->finishing_since_ms > FINISH_MAX_MS
                          ? "its old cut's replica did not finish it within 30 s"
                          : NULL;
    if (tsr_requests_of_attempt(c, f->key.deployment, f->key.replica, f->epoch, why) && !why)
        return false;
    if (w->state == TSR_W_READY && w->pid == w->finished_pid) {
        w->state = TSR_W_IDLE;                  /* let go after RELEASE_GRACE_MS (release) */
        w->release_due_ms = now + RELEASE_GRACE_MS;
    }
    /* one let go to make room stays held for the standbys (unless it died) */
    w->room_done = w->room && w->state != TSR_W_DEAD;
    w->finishing = w->room_done;
    if (di >= 0 && c->deps[di].reshard.active) c->deps[di].reshard.freed_ms = now;
    tsr_info("worker %s finished with %s r%d s%d t%d of the old cut%s%s", w->name,
             f->key.deployment, f->key.replica, f->key.stage, f->key.tp, why ? ": " : "",
             why ? why : "");
    tsr_coord_mark_dirty(c);
    return true;
}

/* Gives up building beside: the new cut applies at once (the replicas are rebuilt),
 * keeping what the standbys loaded where the plan gives them their piece. */
static void give_up(tsr_coord_t *c, size_t di, const char *why)
{
    tsr_dep_state_t *ds = &c->deps[di];
    char how[300];
    snprintf(how, sizeof how, "at once, rebuilt while it loads: %s", why);
    apply(c, di, how);
    for (int k = 0; k < ds->reshard.n; k++) {
        const tsr_standby_t *sb = &ds->reshard.standby[k];
        tsr_worker_t *w = tsr_registry_find(c->reg, sb->worker);
        if (!w || w->state == TSR_W_DEAD || w->has_piece) continue;
        if (sb->loaded) tsr_coord_hint_move(c, sb->worker, NULL, &sb->key);
        else tsr_send_unassign(c, w, "the layout it loaded for applies without it");
    }
    tsr_warn("deployment %s: %s", c->cfg->deployments[di].name, ds->reshard.last);
    ds->reshard.active = ds->reshard.switching = false;
    ds->reshard.doing[0] = '\0';
}

/* `replicas` replicas of the new cut placed by the planner (its usual rules: tensor
 * groups on one node, distinct GPUs, memory) on the workers of the deployment's kind
 * that are idle or, keep >= 0, hold a piece of one of its old replicas from keep on
 * (those it may let go to make room).  ws (room for every registered worker) gets the
 * plan's workers.  NULL, with why, when they cannot all be placed. */
static tsr_plan_t *plan_new_cut(tsr_coord_t *c, size_t di, int replicas, int keep,
                                tsr_worker_t **ws, char *why, size_t why_len)
{
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    tsr_dep_state_t *ds = &c->deps[di];
    tsr_deployment_t target = *d;
    target.tensor = ds->reshard.tensor;
    target.pipeline = ds->reshard.pipeline;
    target.replicas = replicas;
    tsr_config_t view = *c->cfg;
    view.deployments = &target;
    view.n_deployments = 1;
    size_t n = tsr_registry_size(c->reg), k = 0;
    tsr_plan_worker_t *pw = calloc(n ? n : 1, sizeof *pw);
    uint64_t *need = calloc((size_t)target.pipeline, sizeof *need);
    tsr_plan_t *plan = NULL;
    if (!pw || !need) {
        snprintf(why, why_len, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        bool freed = keep >= 0 && w->has_piece && w->state != TSR_W_DEAD &&
                      !strcmp(w->piece.key.deployment, d->name) && w->piece.key.replica >= keep;
        if ((!tsr_coord_worker_idle(c, w) && !freed && !held_for(w, d)) ||
            w->device != d->device)
            continue;
        ws[k] = w;
        pw[k] = (tsr_plan_worker_t){.name = w->name, .node = w->node, .device = w->device,
                                    .memory = w->device == TSR_DEVICE_CUDA ? w->memory : 0,
                                    .domain = w->nvlink_domain, .gpu = w->pci_bus_id,
                                    .eligible = true};
        k++;
    }
    for (int s = 0; s < target.pipeline && d->device == TSR_DEVICE_CUDA; s++)
        need[s] = tsr_piece_need(&ds->model, &target, s);
    const uint64_t *needs[1] = {d->device == TSR_DEVICE_CUDA ? need : NULL};
    int layers = ds->model.num_hidden_layers;
    if (tsr_plan_compute_mem(&view, &layers, needs, pw, k, &plan, why, why_len) < 0) goto out;
    if (plan->deps[0].short_by > 0) {
        tsr_plan_shortage_of(plan, 0, pw, why, why_len);
        tsr_plan_destroy(&plan);
    }
out:
    free(need);
    free(pw);
    return plan;
}

/* Places the replicas to build beside on the idle workers and sends each its standby
 * piece.  False when they cannot hold them (someone took idle workers since). */
static bool send_standbys(tsr_coord_t *c, size_t di, char *why, size_t why_len)
{
    tsr_dep_state_t *ds = &c->deps[di];
    size_t n = tsr_registry_size(c->reg);
    tsr_worker_t **ws = calloc(n ? n : 1, sizeof *ws);
    tsr_plan_t *plan = ws ? plan_new_cut(c, di, ds->reshard.beside, -1, ws, why, why_len) : NULL;
    bool ok = false;
    if (!ws) snprintf(why, why_len, "out of memory");
    if (!plan) goto out;
    uint64_t epoch = tsr_coord_next_epoch(c);
    ds->reshard.standby = calloc(plan->n_pieces, sizeof *ds->reshard.standby);
    if (!epoch || !ds->reshard.standby) {
        snprintf(why, why_len, "%s", epoch ? "out of memory" : "the plan epoch is at its limit");
        goto out;
    }
    ds->reshard.epoch = epoch;
    for (size_t i = 0; i < plan->n_pieces; i++) {
        const tsr_piece_t *p = &plan->pieces[i];
        tsr_standby_t *sb = &ds->reshard.standby[ds->reshard.n++];
        tsr_piece_key_t *key = &sb->key;
        snprintf(key->deployment, sizeof key->deployment, "%s", c->cfg->deployments[di].name);
        key->replica = p->replica, key->stage = p->stage, key->tp = p->tp;
        key->tp_size = ds->reshard.tensor, key->pp_size = ds->reshard.pipeline;
        key->layer_begin = p->layer_begin, key->layer_end = p->layer_end;
        snprintf(sb->worker, sizeof sb->worker, "%s", ws[p->worker]->name);
        sb->pid = ws[p->worker]->pid;
        if (tsr_send_standby(c, ws[p->worker], (int)di, key, epoch) < 0) {
            snprintf(why, why_len, "standby %s could not be sent its piece", sb->worker);
            goto out;
        }
    }
    ok = true;
out:
    tsr_plan_destroy(&plan);
    free(ws);
    return ok;
}

/* The most replicas of the new cut (up to those it wants) the planner places on the idle
 * workers and those of d's last `drop` old replicas, or 0. */
static int placeable(tsr_coord_t *c, size_t di, int drop, int idle, tsr_worker_t **ws,
                     char *why, size_t why_len)
{
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    const tsr_dep_state_t *ds = &c->deps[di];
    int most = (idle + drop * d->tensor * d->pipeline) / (ds->reshard.tensor * ds->reshard.pipeline);
    for (int b = most < ds->reshard.replicas ? most : ds->reshard.replicas; b >= 1; b--) {
        tsr_plan_t *plan = plan_new_cut(c, di, b, d->replicas - drop, ws, why, why_len);
        if (plan) {
            tsr_plan_destroy(&plan);
            return b;
        }
    }
    return 0;
}

/* Old replicas make room for the first replicas of the new cut: the fewest (never the
 * last) whose workers, with the idle ones, the planner can place one new replica on
 * or more (a tensor group needs its node, a GPU its memory).  Those replicas take no
 * new request and finish theirs in place; once they have, their workers are idle and
 * the standbys are sent to them in the same tick, before any plan could give them
 * away.  False, the cut applied at once as before, when no choice places one. */
static bool let_go(tsr_coord_t *c, size_t di, int64_t now)
{
    tsr_dep_state_t *ds = &c->deps[di];
    tsr_deployment_t *d = &c->cfg->deployments[di];
    int idle = tsr_reshard_free_for(c, d), beside = 0, drop;
    char why[300] = "";
    size_t n = tsr_registry_size(c->reg);
    tsr_worker_t **ws = calloc(n ? n : 1, sizeof *ws);
    for (drop = ds->reshard.dropped; ws && drop < d->replicas; drop++)
        if ((beside = placeable(c, di, drop, idle, ws, why, sizeof why))) break;
    free(ws);
    if (!beside) {
        char msg[400];
        snprintf(msg, sizeof msg, "not one replica of it can be placed on the idle workers and "
                 "those of the old replicas it could let go (%s)", why[0] ? why : "out of memory");
        give_up(c, di, msg);
        return false;
    }
    int keep = d->replicas - drop;
    if (drop != ds->reshard.dropped || beside != ds->reshard.beside) {
        /* the planner's rules (a group's node, a GPU's memory) wanted another count than
         * the reload's answer said */
        snprintf(ds->reshard.doing, sizeof ds->reshard.doing,
                 "%d of the %d replicas of tp %d x pp %d are built on idle workers while tp %d "
                 "x pp %d x %d serves (%d old replica(s) let go to make room, as the planner "
                 "placed them); the other %d load after the switch", beside,
                 ds->reshard.replicas, ds->reshard.tensor, ds->reshard.pipeline, d->tensor,
                 d->pipeline, keep, drop, ds->reshard.replicas - beside);
        tsr_info("deployment %s: %s", d->name, ds->reshard.doing);
    }
    ds->reshard.dropped = drop;
    ds->reshard.beside = beside;
    finish_in_place(c, d, keep, true, 0, NULL, now);
    if (tsr_dep_set_replicas(ds, d, keep) < 0) {
        give_up(c, di, "out of memory");
        return false;
    }
    tsr_coord_mark_dirty(c);
    return true;
}

/* The old replicas that serve beside the new cut's stop taking requests (and finish
 * theirs, as the others did at the switch) once every replica of the new cut serves, or
 * nothing of it loads any more after a plan (its pieces failed, or placed nowhere), or
 * FINISH_MAX_MS after the switch. */
static void stop_serving(tsr_coord_t *c, size_t di, int64_t now)
{
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    tsr_dep_state_t *ds = &c->deps[di];
    bool complete = true, loading = false, freeing = false;
    for (int r = 0; r < d->replicas; r++) complete &= tsr_registry_ready_leader(c->reg, d, r) != NULL;
    for (size_t i = 0, nw = tsr_registry_size(c->reg); i < nw; i++) {
        const tsr_worker_t *w = tsr_registry_at(c->reg, i);
        loading |= w->has_piece && w->state == TSR_W_LOADING && !strcmp(w->piece.key.deployment, d->name);
        /* old workers that only finish: the rest of the new cut waits for them */
        freeing |= w->finishing && !w->serving && !strcmp(w->finished.key.deployment, d->name);
    }
    int64_t since = ds->reshard.freed_ms > ds->reshard.switched_ms ? ds->reshard.freed_ms
                                                                  : ds->reshard.switched_ms;
    const char *why = complete ? "every replica of the new cut serves"
                      : !loading && !freeing && c->last_plan_ms >= since   /* the tick's plan runs after */
                          ? "the new cut's other replicas do not load (see the deployment's "
                            "placement)"
                      : now - ds->reshard.switched_ms > FINISH_MAX_MS
                          ? "the new cut's other replicas did not serve within 30 s"
                          : NULL;
    if (!why) return;
    for (size_t i = 0, nw = tsr_registry_size(c->reg); i < nw; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        if (!w->serving || strcmp(w->finished.key.deployment, d->name)) continue;
        w->serving = false;
        w->finishing_since_ms = now;    /* its requests have FINISH_MAX_MS from now */
    }
    tsr_info("deployment %s: the %d old replica(s) serving beside the new cut take no new "
             "request (%s): they finish theirs and are let go", d->name, ds->reshard.serving, why);
    ds->reshard.serving = 0;
    snprintf(ds->reshard.doing, sizeof ds->reshard.doing, "%s; the old replicas finish the "
             "requests they have in flight, taking no new one", why);
}

/* One step of deployment di's change of cut; true while it goes on. */
static bool step(tsr_coord_t *c, size_t di, int64_t now)
{
    tsr_dep_state_t *ds = &c->deps[di];
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    char why[300], what[96];
    what_builds(ds, what, sizeof what);
    if (!ds->reshard.sent) {
        if (!ds->reshard.since_ms) ds->reshard.since_ms = now;
        if (ds->reshard.dropped && !ds->reshard.let_go) {
            ds->reshard.let_go = true;
            return let_go(c, di, now);
        }
        /* old replicas let go to make room: their workers are idle once a plan has
         * released them, or they finished (unless a failover takes them first) */
        int idle = tsr_reshard_free_for(c, d);
        if (ds->reshard.dropped && idle < ds->reshard.beside * ds->reshard.tensor *
                                               ds->reshard.pipeline &&
            now - ds->reshard.since_ms < FINISH_MAX_MS + 5000)
            return true;
        ds->reshard.sent = true;
        if (!send_standbys(c, di, why, sizeof why)) {
            give_up(c, di, why);
            return false;
        }
        snprintf(ds->reshard.doing, sizeof ds->reshard.doing,
                 "%s %s on %d idle worker(s) while tp %d x pp %d x %d serves", what,
                 ds->reshard.beside >= ds->reshard.replicas ? "loads" : "load", ds->reshard.n, d->tensor, d->pipeline, d->replicas);
        tsr_info("deployment %s: %s (epoch %llu)", d->name, ds->reshard.doing,
                 (unsigned long long)ds->reshard.epoch);
        return true;
    }
    int loaded = 0, placed = 0;
    for (int k = 0; k < ds->reshard.n; k++) {
        const tsr_standby_t *sb = &ds->reshard.standby[k];
        const tsr_worker_t *w = tsr_registry_find(c->reg, sb->worker);
        bool holds = w && w->state != TSR_W_DEAD && w->has_piece && tsr_piece_equal(&w->piece.key, &sb->key);
        const char *lost = holds                         ? NULL
                           : !w || w->state == TSR_W_DEAD ? "died"
                           : w->pid != sb->pid           ? "restarted"
                           : w->drained                  ? "was drained"
                           : w->has_piece                ? "was given another piece"
                           : sb->failed                  ? "could not load its piece"
                                                         : NULL;
        /* while switching, one lost is done too: the plan placed its piece elsewhere */
        placed += holds || (ds->reshard.switching && lost);
        loaded += sb->loaded;
        if (ds->reshard.switching || holds) continue;
        if (lost) {
            snprintf(why, sizeof why, "standby %s %s", sb->worker, lost);
            give_up(c, di, why);
            return false;
        }
    }
    if (ds->reshard.switching) {
        /* done once the plan has given the standbys their pieces; until then every
         * plan is told where they are */
        int finishing = 0;
        for (size_t i = 0, nw = tsr_registry_size(c->reg); i < nw; i++) {
            const tsr_worker_t *w = tsr_registry_at(c->reg, i);
            finishing += w->finishing && !strcmp(w->finished.key.deployment, d->name);
        }
        if (ds->reshard.serving) stop_serving(c, di, now);
        if (placed == ds->reshard.n && !finishing) {
            ds->reshard.active = ds->reshard.switching = false;
            tsr_info("deployment %s: %s", d->name, ds->reshard.last);
            ds->reshard.doing[0] = '\0';
            return false;
        }
        for (int k = 0; k < ds->reshard.n; k++)
            tsr_coord_hint_move(c, ds->reshard.standby[k].worker, NULL, &ds->reshard.standby[k].key);
        return true;
    }
    if (loaded < ds->reshard.n) return true;
    /* the old replicas whose workers the new cut's other replicas do not need go on
     * serving beside the new ones until those load */
    int rest = ds->reshard.replicas - ds->reshard.beside, per_old = d->tensor * d->pipeline;
    int need = rest * ds->reshard.tensor * ds->reshard.pipeline - tsr_coord_idle_count(c, d->device);
    int serve = d->replicas - (need > 0 ? (need + per_old - 1) / per_old : 0);
    if (serve > rest) serve = rest;     /* as many replicas as the file asks, no more */
    ds->reshard.finishing = finish_in_place(c, d, 0, false, serve, &ds->reshard.serving, now);
    ds->reshard.switched_ms = now;
    char how[240];
    if (!rest)
        snprintf(how, sizeof how, "after its pieces loaded beside it (%.1f s), swapped in by a "
                 "rewire", (double)(now - ds->reshard.since_ms) / 1000.0);
    else
        snprintf(how, sizeof how, "after %d of its replicas loaded beside it (%.1f s%s), swapped "
                 "in by a rewire; the other %d loaded on the workers the old cut freed while "
                 "those served", ds->reshard.beside, (double)(now - ds->reshard.since_ms) / 1000.0,
                 ds->reshard.dropped ? ", old replicas let go to make room" : "", rest);
    apply(c, di, how);
    ds->reshard.switching = true;
    if (ds->reshard.serving)
        snprintf(ds->reshard.doing, sizeof ds->reshard.doing,
                 "every piece of %s is loaded: the replicas switch to it; %d old replica(s) "
                 "serve beside them until the other %d load", what, ds->reshard.serving, rest);
    else
        snprintf(ds->reshard.doing, sizeof ds->reshard.doing,
                 "every piece of %s is loaded: the replicas switch to it%s", what,
                 ds->reshard.finishing ? "; the old replicas with requests in flight finish "
                                         "them first, taking no new one" : "");
    for (int k = 0; k < ds->reshard.n; k++)
        tsr_coord_hint_move(c, ds->reshard.standby[k].worker, NULL, &ds->reshard.standby[k].key);
    return true;
}

/* A worker that finished an old cut's requests, idle since: a plan or a standby gave it
 * a piece (its assignment replaces the old one, keeping the layers both hold), or it is
 * told to let go of the old piece once RELEASE_GRACE_MS has passed.  Returns when to
 * look again (0: done). */
static int64_t release(tsr_coord_t *c, tsr_worker_t *w, int64_t now)
{
    if (w->has_piece || w->state == TSR_W_DEAD || w->pid != w->finished_pid ||
        tsr_coord_is_standby(c, w->name)) {
        w->release_due_ms = 0;
        return 0;
    }
    if (now < w->release_due_ms) return w->release_due_ms;
    tsr_send_unassign(c, w, "the old cut's requests it finished are done");
    w->release_due_ms = 0;
    return 0;
}

int64_t tsr_reshard_tick(tsr_coord_t *c, int64_t now)
{
    int64_t next = 0;
    for (size_t i = 0, nw = tsr_registry_size(c->reg); i < nw; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        if (w->finishing && !finish_done(c, w, now)) next = now + 50;
        int64_t due = w->release_due_ms && !w->finishing ? release(c, w, now) : 0;
        if (due && (!next || due < next)) next = due;
    }
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        if (c->deps[i].reshard.active && now >= c->plan_after_ms && step(c, i, now))
            next = now + 100;
    return next;
}

bool tsr_reshard_message(tsr_coord_t *c, tsr_worker_t *w, const tsr_env_t *env)
{
    if (w->has_piece) return false;
    if (w->finishing && env->epoch == w->finished.epoch) {
        /* an old cut's piece that finishes (or serves beside) failed: its replica takes
         * no more requests and what it has moves (finish_done) */
        if (env->body_case != TESSERA__ENVELOPE__BODY_FAILED) return true;
        if (env->failed->fatal) return false;   /* the loop declares it dead */
        tsr_warn("worker %s, finishing %s r%d of the old cut, reports it failed: %s", w->name,
                 w->finished.key.deployment, w->finished.key.replica, env->failed->reason);
        w->finish_failed = true;
        return true;
    }
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        tsr_dep_state_t *ds = &c->deps[i];
        if (!ds->reshard.active || env->epoch != ds->reshard.epoch) continue;
        for (int k = 0; k < ds->reshard.n; k++) {
            tsr_standby_t *sb = &ds->reshard.standby[k];
            if (strcmp(sb->worker, w->name)) continue;
            if (env->body_case == TESSERA__ENVELOPE__BODY_READY) sb->loaded = true;
            if (env->body_case == TESSERA__ENVELOPE__BODY_FAILED) {
                if (env->failed->fatal) return false;  /* the loop declares it dead */
                sb->failed = true;
            }
            return true;
        }
    }
    return false;
}
