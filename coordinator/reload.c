/* reload.c: rereading the configuration while serving.  A reload that cannot be
 * applied changes nothing; one that can keeps every placement it can, and rewires
 * the replicas whose keys changed. */
#include "reload.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "assign.h"
#include "common/log.h"
#include "common/util.h"
#include "deptok.h"
#include "placement.h"
#include "reshard.h"


/* Deployment nd (ds its new state) changes the cut od serves with.  When od serves
 * (every replica ready) and idle workers (less `reserved`, set aside by the deployments
 * before it in this reload, which it adds to) can hold one replica of the new cut or
 * more, if need be after old replicas are let go while one serves
 * (tsr_reshard_choose), nd keeps od's cut for now and its state records the new one:
 * reshard.c has the idle workers load those replicas beside the old ones and swaps the
 * new cut in once they are loaded; its other replicas then load on the workers the old
 * cut frees.  Otherwise the new cut applies at once and the replicas are rebuilt; the
 * state says why. */
static void defer_cut(tsr_coord_t *c, const tsr_deployment_t *od, tsr_deployment_t *nd,
                      tsr_dep_state_t *ds, int reserved[2])
{
    if (nd->auto_tensor || nd->auto_pipeline || nd->auto_replicas || nd->device != od->device ||
        (nd->tensor == od->tensor && nd->pipeline == od->pipeline))
        return;
    int ready = 0;
    for (int r = 0; r < od->replicas; r++) ready += tsr_registry_ready_leader(c->reg, od, r) != NULL;
    int per_old = od->tensor * od->pipeline, per_new = nd->tensor * nd->pipeline;
    int idle = tsr_reshard_free_for(c, od) - reserved[nd->device], beside = 0, drop = 0;
    if (ready < od->replicas ||
        !tsr_reshard_choose(od->replicas, per_old, nd->replicas, per_new, idle, &beside, &drop)) {
        snprintf(ds->reshard.last, sizeof ds->reshard.last,
                 "tp %d x pp %d x %d replaced tp %d x pp %d at once, rebuilt while it loads: %s",
                 nd->tensor, nd->pipeline, nd->replicas, od->tensor, od->pipeline,
                 ready < od->replicas ? "the old layout was not serving whole"
                 : "building one replica of the new one beside it needs more idle workers");
        if (ready == od->replicas) {
            size_t len = strlen(ds->reshard.last);
            snprintf(ds->reshard.last + len, sizeof ds->reshard.last - len,
                     " (%d, %d idle, and %d replica(s) serving)", per_new, idle, od->replicas);
        }
        tsr_warn("deployment %s: %s", nd->name, ds->reshard.last);
        return;
    }
    int want = nd->replicas;
    /* the old count for now: reshard.c lets `drop` replicas go at its first step */
    if (tsr_dep_set_replicas(ds, nd, od->replicas) < 0) return;  /* out of memory: at once */
    int from_idle = beside * per_new - drop * per_old;
    reserved[nd->device] += from_idle > 0 ? from_idle : 0;
    ds->reshard.active = true;
    ds->reshard.tensor = nd->tensor;
    ds->reshard.pipeline = nd->pipeline;
    ds->reshard.replicas = want;
    ds->reshard.beside = beside;
    ds->reshard.dropped = drop;
    nd->tensor = od->tensor;
    nd->pipeline = od->pipeline;
    tsr_dep_note_cut(ds, nd);
    if (beside == want && !drop)
        snprintf(ds->reshard.doing, sizeof ds->reshard.doing,
                 "tp %d x pp %d x %d is built on %d idle worker(s) while tp %d x pp %d x %d serves",
                 ds->reshard.tensor, ds->reshard.pipeline, want, beside * per_new, od->tensor, od->pipeline,
                 od->replicas);
    else
        snprintf(ds->reshard.doing, sizeof ds->reshard.doing,
                 "%d of the %d replicas of tp %d x pp %d are built on idle workers while tp %d x "
                 "pp %d x %d serves%s; the other %d load after the switch on the workers it frees",
                 beside, want, ds->reshard.tensor, ds->reshard.pipeline, od->tensor, od->pipeline,
                 od->replicas - drop, drop ? " (old replicas let go to make room)" : "",
                 want - beside);
    /* with old replicas let go, reshard.c may let one more go to place the first */
    tsr_info("deployment %s: %s", nd->name, ds->reshard.doing);
}

int tsr_coord_reload(tsr_coord_t *c, char *err, size_t errlen)
{
    /* test builds: TSR_TEST_RELOAD_HOLD_MS holds each reload, as a slow disk under the
     * model directories would */
#ifdef TSR_TESTING
    tsr_test_hold("TSR_TEST_RELOAD_HOLD_MS", 10000);
#endif
    /* Reads already done are taken first: the new states then keep what they read. */
    tsr_deptok_collect(c);
    tsr_config_t *cfg = NULL;
    if (tsr_config_load(c->config_path, &cfg, err, errlen) < 0) return -1;
    /* The HTTP server was started with the old ones. */
    bool same_http = !cfg->http_endpoint == !c->cfg->http_endpoint &&
                     (!cfg->http_endpoint || !strcmp(cfg->http_endpoint, c->cfg->http_endpoint)) &&
                     !cfg->api_keys_file == !c->cfg->api_keys_file &&
                     (!cfg->api_keys_file || !strcmp(cfg->api_keys_file, c->cfg->api_keys_file));
    if (strcmp(cfg->workers_endpoint, c->cfg->workers_endpoint) ||
        strcmp(cfg->control_endpoint, c->cfg->control_endpoint) || !same_http) {
        snprintf(err, errlen, "%s: changing coordinator endpoints (http_endpoint and "
                 "api_keys_file included) needs a restart", c->config_path);
        tsr_config_destroy(&cfg);
        return -1;
    }
    if (cfg->security_none != c->cfg->security_none || strcmp(cfg->keys_dir, c->cfg->keys_dir)) {
        snprintf(err, errlen, "%s: changing coordinator.security or keys_dir needs a restart "
                              "(keys added to or removed from the store apply at once)",
                 c->config_path);
        tsr_config_destroy(&cfg);
        return -1;
    }
    tsr_dep_state_t *deps = tsr_deps_build(cfg, c->deps, c->cfg->n_deployments, true);
    if (!deps) {
        tsr_config_destroy(&cfg);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    /* A reload that would take a running deployment down because its model
     * cannot be read is refused: the old plan keeps serving. */
    for (size_t i = 0; i < cfg->n_deployments; i++) {
        if (deps[i].model_ok) continue;
        snprintf(err, errlen, "%s", deps[i].model_error);
        tsr_deps_free(deps, cfg->n_deployments);
        tsr_config_destroy(&cfg);
        return -1;
    }
    /* A change of cut under way (reshard.c) goes on when the file still asks for that
     * cut; otherwise it gives way to the file's latest and its standbys are let go.  A
     * new cut is built beside the old one where idle workers allow. */
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        tsr_dep_state_t *os = &c->deps[i];
        if (!os->reshard.active) continue;
        int ni = -1;
        for (size_t j = 0; j < cfg->n_deployments; j++)
            if (!strcmp(cfg->deployments[j].name, os->name)) ni = (int)j;
        tsr_deployment_t *nd = ni >= 0 ? &cfg->deployments[ni] : NULL;
        if (nd && nd->device == c->cfg->deployments[i].device && !nd->auto_tensor &&
            !nd->auto_pipeline && !nd->auto_replicas && nd->tensor == os->reshard.tensor &&
            nd->pipeline == os->reshard.pipeline && nd->replicas == os->reshard.replicas &&
            tsr_dep_set_replicas(&deps[ni], nd, c->cfg->deployments[i].replicas) == 0) {
            nd->tensor = c->cfg->deployments[i].tensor;  /* the cut in force until the switch */
            nd->pipeline = c->cfg->deployments[i].pipeline;
            tsr_dep_note_cut(&deps[ni], nd);
            deps[ni].reshard = os->reshard;          /* the standbys move with it */
            os->reshard.standby = NULL;
            os->reshard.active = false;
            continue;
        }
        for (int k = 0; k < os->reshard.n; k++) {
            tsr_worker_t *w = tsr_registry_find(c->reg, os->reshard.standby[k].worker);
            if (w && w->state != TSR_W_DEAD && !w->has_piece)
                tsr_send_unassign(c, w, "the layout it stood by for was replaced by a reload");
        }
        os->reshard.active = false;                  /* its standbys are idle again */
    }
    int reserved[2] = {0, 0};  /* idle workers set aside by the deployments before */
    for (size_t i = 0; i < cfg->n_deployments; i++) {
        const tsr_deployment_t *od = tsr_config_find(c->cfg, cfg->deployments[i].name);
        if (od && !deps[i].reshard.active) defer_cut(c, od, &cfg->deployments[i], &deps[i], reserved);
    }
    /* Replicas already waiting to be rewired keep waiting, under the new
     * configuration's numbering. */
    tsr_coord_lost_renumber(c, cfg);
    /* A deployment that keeps its layout but changes its model, max_seq_len
     * or batching keys keeps its placement; its replicas are rewired so every
     * worker loads the new model, resizes its KV cache or rebuilds its
     * scheduler. */
    for (size_t i = 0; i < cfg->n_deployments; i++) {
        const tsr_deployment_t *nd = &cfg->deployments[i];
        const tsr_deployment_t *od = tsr_config_find(c->cfg, nd->name);
        if (!od || !tsr_assignment_changed(od, nd)) continue;
        for (int r = 0; r < nd->replicas; r++) tsr_coord_mark_lost(c, (int)i, r);
    }
    tsr_deps_free(c->deps, c->cfg->n_deployments);
    tsr_config_destroy(&c->cfg);
    c->cfg = cfg;
    c->deps = deps;
    tsr_deptok_request(c);
    tsr_deptok_publish(c);
    /* Pieces that failed to load are tried again: the operator may have
     * fixed the model directory.  A piece whose layout the reload changed is
     * left to the planner, which replaces it. */
    /* The failed ranks of one replica are retried in one epoch: they share its
     * data-port secret and form together. */
    size_t n = tsr_registry_size(c->reg);
    tsr_replica_set_t retried = {0};
    uint64_t first = c->epoch + 1;
    for (size_t i = 0; i < n; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        if (w->state != TSR_W_FAILED || !w->has_piece) continue;
        int di = tsr_coord_dep_index(c, w->piece.key.deployment);
        if (di < 0 || !tsr_coord_piece_fits(c, di, &w->piece.key)) continue;
        size_t t = 0;
        while (t < retried.n && (retried.di[t] != di || retried.replica[t] != w->piece.key.replica))
            t++;
        if (t == retried.n) {
            if (c->epoch >= TSR_EPOCH_MAX) {    /* epochs never wrap (placement.c) */
                tsr_error("plan epoch %llu is at its limit: failed pieces are not retried; "
                          "restart the workers and the coordinator",
                          (unsigned long long)c->epoch);
                break;
            }
            tsr_replica_set_add(&retried, di, w->piece.key.replica);
            if (retried.n == t) continue;   /* out of memory: the next reload tries again */
            c->epoch++;
        }
        w->piece.epoch = first + t;
        w->state = TSR_W_LOADING;
        w->reason[0] = '\0';
        tsr_send_assign(c, w, di);
    }
    free(retried.di);
    free(retried.replica);
    c->dirty = true;
    tsr_info("reloaded %s: %zu deployment(s)", c->config_path, cfg->n_deployments);
    return 0;
}
