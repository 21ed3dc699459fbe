/* plan_diff.c: `tessera plan FILE --diff`: what a reload of FILE would do to the
 * running cluster, worked out as the coordinator would (the planner and the
 * reconciler over the workers and pieces its status reports) without changing
 * anything: which pieces stay, which workers load a piece (and so read weights),
 * which are released, which replicas are rewired keeping their weights, and
 * which replicas stop serving meanwhile. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "common/budget.h"
#include "common/deploy.h"
#include "common/modelcfg.h"
#include "coordinator/assign.h"
#include "coordinator/layout.h"
#include "coordinator/planner.h"
#include "coordinator/reconciler.h"
#include "coordinator/reshard.h"

static const char *jstr(json_t *o, const char *k)
{
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "";
}

static int jint(json_t *o, const char *k)
{
    return (int)json_integer_value(json_object_get(o, k));
}

static json_t *running_dep(json_t *doc, const char *name)
{
    size_t i;
    json_t *d;
    json_array_foreach(json_object_get(doc, "deployments"), i, d)
        if (!strcmp(jstr(d, "name"), name)) return d;
    return NULL;
}

static int dtype_of(const char *name)
{
    for (int k = TSR_KV_AUTO; k <= TSR_KV_INT8; k++)
        if (!strcmp(tsr_kv_dtype_name(k), name)) return k;
    return TSR_KV_AUTO;
}

/* The running deployment as the coordinator reports it, for the keys a reload
 * compares (its model, batching and memory keys). */
static tsr_deployment_t running_keys(json_t *rd, char *model, size_t len)
{
    tsr_deployment_t od = {0};
    snprintf(model, len, "%s", jstr(rd, "model"));
    od.model_path = model;
    tsr_device_parse(jstr(rd, "device"), &od.device);
    od.tensor = jint(rd, "tensor");
    od.pipeline = jint(rd, "pipeline");
    od.replicas = jint(rd, "replicas");
    od.max_seq_len = jint(rd, "max_seq_len");
    od.max_batch = jint(rd, "max_batch");
    od.prefill_chunk = jint(rd, "prefill_chunk");
    od.kv_cache_mib = jint(rd, "kv_cache_mib");
    od.max_queue = jint(rd, "max_queue");
    od.collective_timeout_ms = jint(rd, "collective_timeout_ms");
    od.gpu_memory_percent = jint(rd, "gpu_memory_percent");
    od.kv_dtype = dtype_of(jstr(rd, "kv_dtype"));
    od.matmul_dtype = dtype_of(jstr(rd, "matmul_dtype"));
    od.weights_dtype = dtype_of(jstr(rd, "weights_dtype"));   /* absent (older): auto */
    od.prefix_cache = json_is_true(json_object_get(rd, "prefix_cache"));
    od.kv_admission = !strcmp(jstr(rd, "kv_admission"), "reserve") ? TSR_KV_ADMIT_RESERVE
                                                                   : TSR_KV_ADMIT_ON_DEMAND;
    return od;
}

/* A live, placeable worker of kind `kind` in the status document. */
static bool free_of(json_t *w, tsr_device_t kind)
{
    return strcmp(jstr(w, "state"), "dead") && !json_is_true(json_object_get(w, "drained")) &&
           !strcmp(jstr(w, "device"), tsr_device_name(kind));
}

/* An auto layout of the file's deployment d, as the coordinator's reload would have
 * it: the running choice when nothing it depends on changes (the auto keys, the
 * device, the fixed dimension, the model, the latency target), else chosen over the
 * live workers of its kind the deployments before leave (`used`), counted as the
 * coordinator counts them (resolve.c). */
static void settle_auto(tsr_deployment_t *d, const tsr_model_info_t *m, json_t *doc, int used)
{
    json_t *rd = running_dep(doc, d->name), *pa = rd ? json_object_get(rd, "parallel_auto") : NULL;
    json_t *lt = rd ? json_object_get(rd, "latency_target_ms_per_token") : NULL;
    bool cut_kept = pa && json_is_true(json_object_get(rd, "layout_chosen")) &&
                    json_is_true(json_object_get(pa, "tensor")) == d->auto_tensor &&
                    json_is_true(json_object_get(pa, "pipeline")) == d->auto_pipeline &&
                    !strcmp(jstr(rd, "device"), tsr_device_name(d->device)) &&
                    !strcmp(jstr(rd, "model"), d->model_path) &&
                    (lt ? json_number_value(lt) : 0) == d->latency_target_ms &&
                    (d->auto_tensor || jint(rd, "tensor") == d->tensor) &&
                    (d->auto_pipeline || jint(rd, "pipeline") == d->pipeline);
    if (cut_kept) {
        d->tensor = jint(rd, "tensor");
        d->pipeline = jint(rd, "pipeline");
    }
    tsr_devices_t v = {0};
    tsr_devices_defaults(&v, d->device);
    json_t *ws = json_object_get(doc, "workers");
    size_t i, j;
    json_t *w, *x;
    bool given_bw = false, given_fl = false;  /* as resolve.c: the slowest rate given */
    json_array_foreach(ws, i, w) {
        if (!free_of(w, d->device)) continue;
        v.devices++;
        uint64_t mem = (uint64_t)json_integer_value(json_object_get(w, "memory"));
        if (d->device == TSR_DEVICE_CUDA && (!v.memory || mem < v.memory)) v.memory = mem;
        int on_node = 0, in_domain = 0;
        const char *dom = jstr(w, "nvlink_domain");
        json_array_foreach(ws, j, x) {
            if (!free_of(x, d->device)) continue;
            on_node += !strcmp(jstr(x, "node"), jstr(w, "node"));
            in_domain += dom[0] && !strcmp(jstr(x, "nvlink_domain"), dom);
        }
        if (on_node > v.per_node) v.per_node = on_node;
        if (in_domain > v.per_domain) v.per_domain = in_domain;
        double bw = json_number_value(json_object_get(w, "mem_gbs"));
        double fl = json_number_value(json_object_get(w, "gflops"));
        if (bw > 0 && (!given_bw || bw < v.mem_gbs)) v.mem_gbs = bw, given_bw = true;
        if (fl > 0 && (!given_fl || fl < v.gflops)) v.gflops = fl, given_fl = true;
    }
    v.devices = v.devices > used ? v.devices - used : 0;
    tsr_layout_t cut;
    char why[256];
    if (!cut_kept && (d->auto_tensor || d->auto_pipeline) &&
        tsr_layout_choose_auto(m, d, &v, &cut, why, sizeof why) == 0) {
        d->tensor = cut.tensor;
        d->pipeline = cut.pipeline;
    }
    if (d->auto_replicas) {
        /* kept at the running count while the cut stays; else what the workers hold */
        bool same = rd && json_is_true(json_object_get(pa, "replicas")) &&
                    jint(rd, "tensor") == d->tensor && jint(rd, "pipeline") == d->pipeline;
        int r = v.devices / (d->tensor * d->pipeline);
        if (same && jint(rd, "replicas") > r) r = jint(rd, "replicas");
        d->replicas = r > 0 ? r : 1;
    }
}

/* The replica (deployment di, replica r) a piece key names, as one number for a set. */
static long replica_id(int di, int r) { return (long)di * 1000000L + r; }

static bool in_set(const long *set, size_t n, long id)
{
    for (size_t i = 0; i < n; i++)
        if (set[i] == id) return true;
    return false;
}

int tsr_plan_diff(const tsr_cli_t *cli, const char *path)
{
    char err[1024];
    int rc = 1;
    tsr_config_t *cfg = NULL;
    json_t *doc = NULL;
    tsr_model_info_t *models = NULL;
    int *layers = NULL;
    uint64_t **need = NULL;
    tsr_plan_worker_t *pw = NULL;
    tsr_action_t *acts = NULL;
    tsr_plan_t *plan = NULL;
    long *loading = NULL, *rewired = NULL;   /* replicas that load pieces; rewired ones */
    size_t n_loading = 0, n_rewired = 0;

    if (tsr_config_load(path, &cfg, err, sizeof err) < 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    int q = tsr_cli_request(cli, TESSERA__CONTROL_REQUEST__KIND__STATUS, NULL, &doc);
    if (q) {
        rc = q;
        goto out;
    }
    size_t nd = cfg->n_deployments;
    models = calloc(nd ? nd : 1, sizeof *models);
    layers = calloc(nd ? nd : 1, sizeof *layers);
    need = calloc(nd ? nd : 1, sizeof *need);
    if (!models || !layers || !need) goto oom;
    int used[2] = {0, 0};
    for (size_t i = 0; i < nd; i++) {
        tsr_deployment_t *d = &cfg->deployments[i];
        if (tsr_model_load_for(d, (int)i, path, &models[i], err, sizeof err) < 0) {
            fprintf(stderr, "%s\n", err);
            goto out;
        }
        /* the coordinator sends workers the model's real path */
        char *real = realpath(d->model_path, NULL);
        if (real) {
            free(d->model_path);
            d->model_path = real;
        }
        if (d->auto_tensor || d->auto_pipeline || d->auto_replicas)
            settle_auto(d, &models[i], doc, used[d->device]);
        /* replicas that follow load keep the count they reached, within the new range,
         * when the cut stays (state.c) */
        json_t *rd = running_dep(doc, d->name);
        json_t *ra = rd ? json_object_get(rd, "autoscale") : NULL;
        if (d->replicas_max && json_is_object(ra) &&
            !strcmp(jstr(rd, "device"), tsr_device_name(d->device)) &&
            jint(rd, "tensor") == d->tensor && jint(rd, "pipeline") == d->pipeline) {
            long long n = jint(rd, "replicas");
            d->replicas = n < d->replicas_min ? d->replicas_min
                          : n > d->replicas_max ? d->replicas_max : (int)n;
        }
        used[d->device] += d->tensor * d->pipeline * d->replicas;
        layers[i] = models[i].num_hidden_layers;
        if (d->device == TSR_DEVICE_CUDA) {
            if (!(need[i] = calloc((size_t)d->pipeline, sizeof *need[i]))) goto oom;
            for (int s = 0; s < d->pipeline; s++) need[i][s] = tsr_piece_need(&models[i], d, s);
        }
    }

    /* the workers as the coordinator has them (dead ones do not count) */
    json_t *ws = json_object_get(doc, "workers");
    size_t nw = json_array_size(ws), k = 0;
    pw = calloc(nw ? nw : 1, sizeof *pw);
    acts = calloc(nw ? nw : 1, sizeof *acts);
    size_t all_replicas = 0;
    for (size_t i = 0; i < nd; i++) all_replicas += (size_t)cfg->deployments[i].replicas;
    loading = calloc(nw + 1, sizeof *loading);
    rewired = calloc(2 * nw + all_replicas + 1, sizeof *rewired);
    if (!pw || !acts || !loading || !rewired) goto oom;
    for (size_t i = 0; i < nw; i++) {
        json_t *w = json_array_get(ws, i);
        if (!strcmp(jstr(w, "state"), "dead")) continue;
        tsr_plan_worker_t *p = &pw[k];
        p->name = jstr(w, "name");
        p->node = jstr(w, "node");
        tsr_device_parse(jstr(w, "device"), &p->device);
        p->memory = p->device == TSR_DEVICE_CUDA
                        ? (uint64_t)json_integer_value(json_object_get(w, "memory")) : 0;
        p->domain = jstr(w, "nvlink_domain");
        p->gpu = jstr(w, "pci_bus_id");
        p->eligible = !json_is_true(json_object_get(w, "drained"));
        json_t *a = json_object_get(w, "assignment");
        if (json_is_object(a)) {
            tsr_piece_key_t *c = &p->current;
            snprintf(c->deployment, sizeof c->deployment, "%s", jstr(a, "deployment"));
            c->replica = jint(a, "replica");
            c->stage = jint(a, "stage");
            c->tp = jint(a, "tp");
            c->tp_size = jint(a, "tp_size");
            c->pp_size = jint(a, "pp_size");
            c->layer_begin = (int)json_integer_value(json_array_get(json_object_get(a, "layers"), 0));
            c->layer_end = (int)json_integer_value(json_array_get(json_object_get(a, "layers"), 1));
        }
        k++;
    }
    if (tsr_plan_compute_mem(cfg, layers, (const uint64_t *const *)need, pw, k, &plan, err,
                             sizeof err) < 0) {
        fprintf(stderr, "%s: %s\n", path, err);
        goto out;
    }
    size_t na = tsr_reconcile_actions(plan, pw, k, acts);

    /* replicas each deployment runs now (0: a new deployment), whether its cut stays,
     * and whether its model or a key its engines are built for changes (then every
     * piece reads its weights again; max_queue and collective_timeout_ms do not) */
    int *was = calloc(nd ? nd : 1, sizeof *was);
    bool *same_cut = calloc(nd ? nd : 1, sizeof *same_cut);
    bool *new_model = calloc(nd ? nd : 1, sizeof *new_model);
    int *beside = calloc(nd ? nd : 1, sizeof *beside);
    int stopping = 0;   /* replicas that stop taking requests */
    if (!was || !same_cut || !new_model || !beside) {
        free(was);
        free(same_cut);
        free(new_model);
        free(beside);
        goto oom;
    }
    for (size_t d = 0; d < nd; d++) {
        json_t *rd = running_dep(doc, cfg->deployments[d].name);
        was[d] = rd ? jint(rd, "replicas") : 0;
        same_cut[d] = rd && jint(rd, "tensor") == cfg->deployments[d].tensor &&
                      jint(rd, "pipeline") == cfg->deployments[d].pipeline;
        /* a new cut of a deployment that serves whole is built beside it, one replica
         * or more, when the idle workers of its kind (and old replicas it can let go
         * while one serves) hold them (reload.c): no replica stops meanwhile */
        const tsr_deployment_t *dd = &cfg->deployments[d];
        if (rd && !same_cut[d] && !strcmp(jstr(rd, "state"), "ready") && !dd->auto_tensor &&
            !dd->auto_pipeline && !dd->auto_replicas &&
            !strcmp(jstr(rd, "device"), tsr_device_name(dd->device))) {
            int idle = 0, drop = 0;
            size_t wi;
            json_t *w;
            json_array_foreach(json_object_get(doc, "workers"), wi, w)
                idle += free_of(w, dd->device) && !strcmp(jstr(w, "state"), "idle");
            int per_new = dd->tensor * dd->pipeline;
            if (tsr_reshard_choose(was[d], jint(rd, "tensor") * jint(rd, "pipeline"),
                                   dd->replicas, per_new, idle, &beside[d], &drop)) {
                if (drop) {
                    printf("  deployment %s: %d old replica(s) are let go to make room: they "
                           "take no new request and finish theirs (the others serve)\n",
                           dd->name, drop);
                    stopping += drop;
                }
                printf("  deployment %s: %d of its %d replica(s) in the new cut are built "
                       "beside the running one on %d worker(s), then swapped in (a rewire)%s\n",
                       dd->name, beside[d], dd->replicas, beside[d] * per_new,
                       beside[d] < dd->replicas ? "; the others load after the switch on "
                                                  "the workers the old cut frees, while those "
                                                  "serve" : "");
            }
        }
        if (rd) {  /* what a worker's engine is built for: any change reads the weights again */
            char model[PATH_MAX];
            tsr_deployment_t od = running_keys(rd, model, sizeof model);
            const tsr_deployment_t *nd2 = &cfg->deployments[d];
            new_model[d] = strcmp(od.model_path, nd2->model_path) ||
                           od.max_seq_len != nd2->max_seq_len || od.max_batch != nd2->max_batch ||
                           od.prefill_chunk != nd2->prefill_chunk ||
                           od.kv_cache_mib != nd2->kv_cache_mib ||
                           (nd2->device == TSR_DEVICE_CUDA && !nd2->kv_cache_mib &&
                            od.gpu_memory_percent != nd2->gpu_memory_percent) ||
                           tsr_kv_dtype_on(nd2->device, od.kv_dtype) !=
                               tsr_kv_dtype_on(nd2->device, nd2->kv_dtype) ||
                           tsr_kv_dtype_on(nd2->device, od.matmul_dtype) !=
                               tsr_kv_dtype_on(nd2->device, nd2->matmul_dtype) ||
                           od.weights_dtype != nd2->weights_dtype;
        }
    }
    printf("what a reload of %s would do (%zu live worker(s)):\n", path, k);
    /* deployments whose keys change: every replica rewired, weights kept unless the
     * model, its types or its KV pool change (then read again) */
    for (size_t i = 0; i < nd; i++) {
        tsr_deployment_t *d = &cfg->deployments[i];
        json_t *rd = running_dep(doc, d->name);
        if (!rd) {
            printf("  deployment %s: new (tp %d x pp %d x %d replica(s))\n", d->name, d->tensor,
                   d->pipeline, d->replicas);
            continue;
        }
        char model[PATH_MAX];
        tsr_deployment_t od = running_keys(rd, model, sizeof model);
        if (od.tensor != d->tensor || od.pipeline != d->pipeline)
            printf("  deployment %s: layout tp %d x pp %d -> tp %d x pp %d: its pieces are cut "
                   "again\n", d->name, od.tensor, od.pipeline, d->tensor, d->pipeline);
        else if (od.replicas != d->replicas)
            printf("  deployment %s: %d -> %d replica(s)\n", d->name, od.replicas, d->replicas);
        if (tsr_assignment_changed(&od, d)) {
            printf("  deployment %s: its model or batching keys change: every replica is "
                   "rewired with them\n", d->name);
            for (int r = 0; r < d->replicas; r++) rewired[n_rewired++] = replica_id((int)i, r);
        }
    }
    size_t i;
    json_t *rdj;
    json_array_foreach(json_object_get(doc, "deployments"), i, rdj)
        if (!tsr_config_find(cfg, jstr(rdj, "name")))
            printf("  deployment %s: removed: its workers are released\n", jstr(rdj, "name"));

    int n_keep = 0, n_load = 0, n_release = 0;
    for (size_t a = 0; a < na; a++) {
        const tsr_plan_worker_t *p = &pw[acts[a].worker];
        const tsr_piece_key_t *c = &p->current;
        if (acts[a].kind == TSR_ACT_UNASSIGN) {
            printf("  release %-20s %s r%d s%d t%d (no longer in the plan)\n", p->name,
                   c->deployment, c->replica, c->stage, c->tp);
            n_release++;
            int odi = -1;
            for (size_t j = 0; j < nd; j++)
                if (!strcmp(cfg->deployments[j].name, c->deployment)) odi = (int)j;
            if (odi >= 0 && !in_set(rewired, n_rewired, replica_id(odi, c->replica)))
                rewired[n_rewired++] = replica_id(odi, c->replica);
            continue;
        }
        const tsr_piece_t *pc = acts[a].piece;
        const tsr_deployment_t *d = &cfg->deployments[pc->deployment];
        char held[96] = "";
        if (c->deployment[0])
            snprintf(held, sizeof held, " (held %.64s r%d s%d t%d)", c->deployment, c->replica,
                     c->stage, c->tp);
        printf("  load    %-20s %s r%d s%d t%d layers %d-%d%s\n", p->name, d->name, pc->replica,
               pc->stage, pc->tp, pc->layer_begin, pc->layer_end - 1, held);
        n_load++;
        long id = replica_id(pc->deployment, pc->replica);
        if (!in_set(loading, n_loading, id)) loading[n_loading++] = id;
        if (!in_set(rewired, n_rewired, id)) rewired[n_rewired++] = id;
    }
    for (size_t p = 0; p < plan->n_pieces; p++) n_keep += plan->pieces[p].kept;
    printf("  %d piece(s) stay where they are, %d load, %d worker(s) released\n", n_keep, n_load,
           n_release);
    for (size_t d = 0; d < nd; d++) {
        const tsr_deployment_t *dep = &cfg->deployments[d];
        for (int r = 0; r < dep->replicas; r++) {
            long id = replica_id((int)d, r);
            bool loads = in_set(loading, n_loading, id);
            if (beside[d]) {
                if (r < beside[d])
                    printf("  replica %s/%d of the new cut is built beside the old one, which "
                           "serves until it is swapped in\n", dep->name, r);
                else
                    printf("  replica %s/%d of the new cut loads after the switch, while the "
                           "%d built beside serve\n", dep->name, r, beside[d]);
            } else if (r >= was[d]) {
                printf("  replica %s/%d is new: it serves once its pieces load\n", dep->name, r);
            } else if (!same_cut[d]) {
                printf("  replica %s/%d is rebuilt in the new cut: it stops serving while its "
                       "pieces load\n", dep->name, r);
                stopping++;
            } else if (loads || (new_model[d] && in_set(rewired, n_rewired, id))) {
                printf("  replica %s/%d stops serving while %s\n", dep->name, r,
                       new_model[d] ? "its pieces load again with the new model or keys"
                                    : "its new pieces load");
                stopping++;
            } else if (in_set(rewired, n_rewired, id)) {
                printf("  replica %s/%d is rewired (a new epoch; it keeps its weights and pauses "
                       "for the regrouping)\n", dep->name, r);
            }
        }
        if (plan->deps[d].short_by)
            printf("  deployment %s would be short of %d %s worker(s)\n", dep->name,
                   plan->deps[d].short_by, tsr_device_name(dep->device));
    }
    free(was);
    free(same_cut);
    free(new_model);
    free(beside);
    if (!n_load && !n_release && !n_rewired) printf("  nothing changes\n");
    else if (!stopping) printf("  no replica that serves now stops serving\n");
    else printf("  %d replica(s) that serve now stop taking requests meanwhile\n", stopping);
    rc = 0;
    goto out;
oom:
    fprintf(stderr, "tessera plan: out of memory\n");
out:
    for (size_t d = 0; need && cfg && d < cfg->n_deployments; d++) free(need[d]);
    free(need);
    tsr_plan_destroy(&plan);
    free(pw);
    free(acts);
    free(loading);
    free(rewired);
    free(layers);
    free(models);
    json_decref(doc);
    tsr_config_destroy(&cfg);
    return rc;
}
