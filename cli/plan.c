/* plan.c: `tessera plan FILE.yaml`, a dry run of the placement on a
 * described cluster, without a coordinator. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "common/budget.h"
#include "common/deploy.h"
#include "common/modelcfg.h"
#include "coordinator/layout.h"
#include "coordinator/planner.h"

static void plan_usage(FILE *f)
{
    fprintf(f,
            "usage: tessera plan FILE.yaml [--nodes N] [--per-node G] [--gpu-memory GIB]\n"
            "                    [--nvlink K] [--explain [--mem-gbs X] [--gflops X] [--cores C]\n"
            "                    [--threads T]] [--diff]\n"
            "\n"
            "Validates the deployment file and each model's config.json, then prints where\n"
            "every piece (replica, stage, tensor-parallel rank) would go and how many bytes\n"
            "each device holds, on a cluster of N nodes with G workers of each device kind\n"
            "per node.  For cuda pieces: weights in BF16, the KV pool (kv_cache_mib's; else\n"
            "max_batch sequences of max_seq_len, or with --gpu-memory what\n"
            "gpu_memory_percent of the GPU leaves) and a reserve for the CUDA context,\n"
            "activations and sampling.  A GPU must hold the weights, the reserve and\n"
            "kv_cache_mib's pool (or one sequence of max_seq_len) within\n"
            "gpu_memory_percent, as the coordinator checks.  Starts nothing.\n"
            "  --nodes N        nodes in the cluster (default: just enough for the file)\n"
            "  --per-node G     workers per node and device kind (default 8 for cuda; for\n"
            "                   cpu, all workers on one node)\n"
            "  --gpu-memory GIB memory of each GPU of the described cluster; a piece that\n"
            "                   needs more is not placed (default: not checked)\n"
            "  --nvlink K       GPUs per NVLink domain on a node (default: all of a node's,\n"
            "                   as with NVSwitch; 1: no NVLink); a tensor-parallel group\n"
            "                   goes inside one domain when one has room.  The LINK column\n"
            "                   names each cuda piece's domain\n"
            "  --explain        also, per deployment, the ways it could be cut (tensor x\n"
            "                   pipeline): memory per device against what a device has,\n"
            "                   whether it fits or by how much it misses, the estimated ms\n"
            "                   per token (one sequence) and tokens/s (max_batch sequences),\n"
            "                   the replicas the cluster's devices hold, whether the file's\n"
            "                   layout fits and why not, and the cut the rule (the fewest\n"
            "                   devices that fit, then the fastest per token) would choose\n"
            "                   (GPU memory: --gpu-memory's, else 80 GiB, an H100's)\n"
            "  --diff           ask the running coordinator (--coordinator, --config) for its\n"
            "                   workers and pieces and print what a reload of FILE would\n"
            "                   do, changing nothing: the pieces that stay, the workers that\n"
            "                   load a piece (reading its weights) or are released, the\n"
            "                   replicas rewired (keeping their weights), and which replicas\n"
            "                   stop serving while pieces load\n"
            "  --mem-gbs X      memory bandwidth of a device for the estimates, GB/s\n"
            "                   (default: 3350 for cuda, an H100 SXM's; 20 for a cpu worker)\n"
            "  --gflops X       matrix-product rate of a device, GFLOP/s (default: 989000 for\n"
            "                   cuda, an H100 SXM's dense BF16; 200 for a cpu worker)\n"
            "  --cores C        cores a node's cpu workers share (default: not limited):\n"
            "                   when a replica's workers busy at once (one stage's for one\n"
            "                   sequence, every stage's at max_batch) run more threads than\n"
            "                   C, the estimates give each its share of the rates above\n"
            "  --threads T      threads each cpu worker runs (TSR_THREADS; default C, as a\n"
            "                   worker runs one on every CPU it may use)\n"
            "exit status: 0 placed, 1 a bad file (--diff: or no answer), 2 bad arguments, 3 not\n"
            "everything placed (--diff: the coordinator refused)\n");
}

static int parse_pos(const char *opt, const char *s, int *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || !*s || v < 1 || v > 100000) {
        fprintf(stderr, "tessera plan: %s: expected an integer from 1 to 100000, got '%s'\n", opt,
                s);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int parse_rate(const char *opt, const char *s, double *out)
{
    char *end;
    double v = strtod(s, &end);
    if (*end || !*s || !(v > 0) || v > 1e9) {
        fprintf(stderr, "tessera plan: %s: expected a positive number up to 1e9, got '%s'\n", opt,
                s);
        return -1;
    }
    *out = v;
    return 0;
}

static void human(uint64_t b, char *buf, size_t len)
{
    if (b >= (1ull << 30)) snprintf(buf, len, "%.2f GiB", (double)b / (1ull << 30));
    else snprintf(buf, len, "%.2f MiB", (double)b / (1ull << 20));
}

/* The devices of the described cluster a deployment of `kind` may use: `free` of
 * them, `per_node` a node (each node one NVLink domain of `nvlink` GPUs, or all of
 * its own), GPUs of gpu_gib (80, an H100's, when not given), and the rates. */
static int g_cores, g_threads;  /* --cores, --threads (0: not given) */

static tsr_devices_t described(tsr_device_t kind, int free, int per_node, int gpu_gib, int nvlink,
                               double mem_gbs, double gflops)
{
    bool gpu = kind == TSR_DEVICE_CUDA;
    tsr_devices_t v = {.devices = free > 0 ? free : 0, .per_node = per_node,
                       .per_domain = gpu ? (nvlink ? nvlink : per_node) : 0,
                       .memory = gpu ? (uint64_t)(gpu_gib ? gpu_gib : 80) << 30 : 0};
    tsr_devices_defaults(&v, kind);
    if (mem_gbs) v.mem_gbs = mem_gbs;
    if (gflops) v.gflops = gflops;
    if (!gpu) v.cores = g_cores, v.threads = g_threads;
    return v;
}

/* A deployment with parallel auto (or one dimension auto): its cut chosen over
 * `free` devices, replicas auto as many as they hold; said on stdout. */
static void choose_auto(const tsr_model_info_t *m, tsr_deployment_t *d, int free, int per_node,
                        int gpu_gib, int nvlink, double mem_gbs, double gflops)
{
    tsr_devices_t devs = described(d->device, free, per_node, gpu_gib, nvlink, mem_gbs, gflops);
    tsr_layout_t cut = {.tensor = d->tensor, .pipeline = d->pipeline};
    char why[256] = "";
    if ((d->auto_tensor || d->auto_pipeline) &&
        tsr_layout_choose_auto(m, d, &devs, &cut, why, sizeof why) < 0) {
        printf("deployment %s: parallel auto: its layout cannot be chosen: %s\n", d->name, why);
        return;
    }
    d->tensor = cut.tensor;
    d->pipeline = cut.pipeline;
    if (d->auto_replicas) {
        int r = devs.devices / (d->tensor * d->pipeline);
        d->replicas = r > 0 ? r : 1;
    }
    printf("deployment %s: parallel auto: tp %d x pp %d x %d replica(s) over %d %s device(s)%s%s\n",
           d->name, d->tensor, d->pipeline, d->replicas, devs.devices, tsr_device_name(d->device),
           why[0] ? ": " : "", why);
}

/* One candidate's row of --explain. */
static void explain_row(const tsr_layout_t *c, const char *mark)
{
    char need[32], fit[48];
    human(c->need, need, sizeof need);
    if (!c->valid) snprintf(fit, sizeof fit, "no: %.40s", c->invalid);
    else if (!c->have) snprintf(fit, sizeof fit, "(unchecked)");
    else if (c->fits) snprintf(fit, sizeof fit, "yes");
    else {
        char by[32];
        human(c->need - c->have, by, sizeof by);
        snprintf(fit, sizeof fit, "no: %s short", by);
    }
    printf("  %-2s %3d %3d %7d %12s  %-24s %-8s %9.2f %11.0f %8d %11.0f\n", mark, c->tensor,
           c->pipeline, c->tensor * c->pipeline, need, fit, tsr_link_name(c->link), c->ms_token,
           c->tok_s, c->replicas, c->tok_s_all);
}

/* --explain: the ways deployment d could be cut on devs, its own among them, and the
 * cut the rule would choose.  For each tensor size, the pipeline depths up to the
 * first that fits and one more (the rest only use more devices for less). */
static void explain_deployment(const tsr_model_info_t *m, const tsr_deployment_t *d,
                               const tsr_devices_t *devs)
{
    size_t n = tsr_layout_candidates(m, d, devs, NULL, 0);
    tsr_layout_t *c = calloc(n ? n : 1, sizeof *c);
    if (!c) {
        fprintf(stderr, "tessera plan: out of memory for %zu candidates\n", n);
        return;
    }
    tsr_layout_candidates(m, d, devs, c, n);
    char have[32], why[512];
    human(devs->memory, have, sizeof have);
    printf("  ways to cut it over %d %s device(s), %d per node, %s each; estimates at %.0f "
           "GB/s and %.0f GFLOP/s a device, %d positions of context:\n",
           devs->devices, tsr_device_name(d->device), devs->per_node,
           devs->memory ? have : "memory unchecked", devs->mem_gbs, devs->gflops,
           d->max_seq_len / 2 > 0 ? d->max_seq_len / 2 : 1);
    if (devs->cores)
        printf("  (workers of %d thread(s) sharing %d core(s) a node: a replica whose busy "
               "workers run more threads gets the cores' share)\n",
               devs->threads > 0 ? devs->threads : 1, devs->cores);
    printf("  %-2s %3s %3s %7s %12s  %-24s %-8s %9s %11s %8s %11s\n", "", "TP", "PP", "DEVICES",
           "NEED/DEVICE", "FITS", "LINK", "MS/TOKEN", "TOK/S/REPL", "REPLICAS", "TOK/S ALL");
    int k = tsr_layout_choose(c, n, d->latency_target_ms, why, sizeof why);
    bool own_listed = false;
    for (size_t i = 0; i < n; i++) {
        bool own = c[i].tensor == d->tensor && c[i].pipeline == d->pipeline;
        bool shown = own || (int)i == k || c[i].pipeline == 1 ||
                     (i > 0 && c[i - 1].tensor == c[i].tensor && !c[i - 1].fits) ||
                     (i > 1 && c[i - 2].tensor == c[i].tensor && !c[i - 2].fits);
        if (!shown) continue;
        own_listed |= own;
        explain_row(&c[i], own && (int)i == k ? "=*" : own ? "=" : (int)i == k ? "*" : "");
    }
    tsr_layout_t mine;
    tsr_layout_of(m, d, devs, d->tensor, d->pipeline, &mine);
    if (!own_listed) explain_row(&mine, "=");
    printf("  (= the file's layout, * the rule's choice)\n");
    char need[32], by[32];
    human(mine.need, need, sizeof need);
    if (!mine.valid)
        printf("  the file's tp %d x pp %d cannot be placed: %s\n", d->tensor, d->pipeline,
               mine.invalid);
    else if (!mine.fits) {
        human(mine.need - mine.have, by, sizeof by);
        printf("  the file's tp %d x pp %d does not fit: it needs %s per device, %s more than "
               "the %s each has\n", d->tensor, d->pipeline, need, by, have);
    } else
        printf("  the file's tp %d x pp %d fits: %s per device, about %.2f ms per token\n",
               d->tensor, d->pipeline, need, mine.ms_token);
    printf("  %s: %s\n", k >= 0 ? "the rule would choose" : "nothing to choose", why);
    free(c);
}

int tsr_cmd_plan(const tsr_cli_t *cli, int argc, char **argv)
{
    int nodes = 0, per_node = 0, rc = 1, gpu_gib = 0, nvlink = 0, explain = 0, diff = 0;
    double mem_gbs = 0, gflops = 0;
    static const struct option opts[] = {{"nodes", required_argument, 0, 'n'},
                                         {"per-node", required_argument, 0, 'g'},
                                         {"gpu-memory", required_argument, 0, 'm'},
                                         {"nvlink", required_argument, 0, 'l'},
                                         {"explain", no_argument, 0, 'x'},
                                         {"diff", no_argument, 0, 'd'},
                                         {"mem-gbs", required_argument, 0, 'b'},
                                         {"gflops", required_argument, 0, 'f'},
                                         {"cores", required_argument, 0, 'c'},
                                         {"threads", required_argument, 0, 't'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int o;
    optind = 0;  /* 0 re-initialises GNU getopt (and its argument permutation) */
    g_cores = g_threads = 0;
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (o) {
        case 'n': if (parse_pos("--nodes", optarg, &nodes) < 0) return 2; break;
        case 'g': if (parse_pos("--per-node", optarg, &per_node) < 0) return 2; break;
        case 'm': if (parse_pos("--gpu-memory", optarg, &gpu_gib) < 0) return 2; break;
        case 'l': if (parse_pos("--nvlink", optarg, &nvlink) < 0) return 2; break;
        case 'x': explain = 1; break;
        case 'd': diff = 1; break;
        case 'b': if (parse_rate("--mem-gbs", optarg, &mem_gbs) < 0) return 2; break;
        case 'f': if (parse_rate("--gflops", optarg, &gflops) < 0) return 2; break;
        case 'c': if (parse_pos("--cores", optarg, &g_cores) < 0) return 2; break;
        case 't': if (parse_pos("--threads", optarg, &g_threads) < 0) return 2; break;
        case 'h': plan_usage(stdout); return 0;
        default: plan_usage(stderr); return 2;
        }
    }
    if (optind != argc - 1) {
        plan_usage(stderr);
        return 2;
    }
    const char *path = argv[optind];
    if (diff) return tsr_plan_diff(cli, path);
    char err[1024];
    tsr_config_t *cfg = NULL;
    tsr_model_info_t *models = NULL;
    int *layers = NULL;
    tsr_plan_worker_t *ws = NULL;
    char (*names)[64] = NULL, (*nodenames)[32] = NULL, (*domains)[48] = NULL;
    tsr_plan_t *plan = NULL;
    uint64_t **mem = NULL;

    if (tsr_config_load(path, &cfg, err, sizeof err) < 0) {
        fprintf(stderr, "%s\n", err);
        goto out;
    }
    size_t nd = cfg->n_deployments;
    models = calloc(nd ? nd : 1, sizeof *models);
    layers = calloc(nd ? nd : 1, sizeof *layers);
    mem = calloc(nd ? nd : 1, sizeof *mem);
    if (!models || !layers || !mem) goto out;
    int need[2] = {0, 0};
    for (size_t i = 0; i < nd; i++) {
        const tsr_deployment_t *d = &cfg->deployments[i];
        if (tsr_model_load_for(d, (int)i, path, &models[i], err, sizeof err) < 0) {
            fprintf(stderr, "%s\n", err);
            goto out;
        }
        layers[i] = models[i].num_hidden_layers;
        need[d->device] += d->replicas * d->pipeline * d->tensor;
    }

    /* The described cluster: `nodes` nodes, each with per-node workers of
     * every device kind the file uses. */
    int per[2];
    for (int k = 0; k < 2; k++) {
        per[k] = per_node ? per_node : (k == TSR_DEVICE_CUDA ? 8 : (need[k] ? need[k] : 1));
        if (!nodes && need[k]) {
            int n = (need[k] + per[k] - 1) / per[k];
            if (n > nodes) nodes = n;
        }
    }
    if (!nodes) nodes = 1;
    /* Auto layouts are chosen over the described cluster as the coordinator chooses
     * over its workers (the deployments before take their devices first). */
    int used[2] = {0, 0};
    for (size_t i = 0; i < nd; i++) {
        tsr_deployment_t *d = &cfg->deployments[i];
        if (d->auto_tensor || d->auto_pipeline || d->auto_replicas)
            choose_auto(&models[i], d, nodes * per[d->device] - used[d->device], per[d->device],
                        gpu_gib, nvlink, mem_gbs, gflops);
        used[d->device] += d->replicas * d->pipeline * d->tensor;
        if (d->device == TSR_DEVICE_CUDA) {
            if (!(mem[i] = calloc((size_t)d->pipeline, sizeof *mem[i]))) goto out;
            for (int s = 0; s < d->pipeline; s++)
                mem[i][s] = tsr_piece_need(&models[i], d, s);
        }
    }
    size_t nw = 0;
    for (int k = 0; k < 2; k++) if (need[k]) nw += (size_t)nodes * (size_t)per[k];
    ws = calloc(nw ? nw : 1, sizeof *ws);
    names = calloc(nw ? nw : 1, sizeof *names);
    nodenames = calloc((size_t)nodes, sizeof *nodenames);
    domains = calloc(nw ? nw : 1, sizeof *domains);
    if (!ws || !names || !nodenames || !domains) {
        fprintf(stderr, "tessera plan: out of memory for a cluster of %zu workers\n", nw);
        goto out;
    }
    for (int n = 0; n < nodes; n++) snprintf(nodenames[n], sizeof nodenames[n], "node%d", n);
    size_t w = 0;
    for (int n = 0; n < nodes; n++)
        for (int k = 0; k < 2; k++)
            for (int g = 0; need[k] && g < per[k]; g++, w++) {
                snprintf(names[w], sizeof names[w], "node%d-%s%d", n, tsr_device_name((tsr_device_t)k), g);
                ws[w] = (tsr_plan_worker_t){.name = names[w], .node = nodenames[n],
                                            .device = (tsr_device_t)k, .eligible = true};
                if (k == TSR_DEVICE_CUDA) {
                    ws[w].memory = (uint64_t)gpu_gib << 30;
                    /* domains of K GPUs (one when K is unset); none for K = 1 */
                    int size = nvlink ? nvlink : per[k];
                    if (size > 1) {
                        snprintf(domains[w], sizeof domains[w], "nvl%d", g / size);
                        ws[w].domain = domains[w];
                    }
                }
            }

    if (tsr_plan_compute_mem(cfg, layers, (const uint64_t *const *)mem, ws, nw, &plan, err,
                             sizeof err) < 0) {
        fprintf(stderr, "%s: %s\n", path, err);
        goto out;
    }
    printf("plan for %s on %d node(s)", path, nodes);
    for (int k = 0; k < 2; k++)
        if (need[k]) printf(", %d %s worker(s) per node", per[k], tsr_device_name((tsr_device_t)k));
    if (gpu_gib) printf(", %d GiB per GPU", gpu_gib);
    printf("\n");
    int short_total = 0;
    for (size_t i = 0; i < nd; i++) {
        const tsr_deployment_t *d = &cfg->deployments[i];
        const tsr_model_info_t *m = &models[i];
        printf("\ndeployment %s: %s, tp %d x pp %d x %d replica(s) = %d piece(s); %d layers, "
               "%d heads, %d kv heads\n  model %s\n",
               d->name, tsr_device_name(d->device), d->tensor, d->pipeline, d->replicas,
               d->tensor * d->pipeline * d->replicas, m->num_hidden_layers,
               m->num_attention_heads, m->num_key_value_heads, d->model_path);
        if (d->replicas_max)
            printf("  replicas follow load: %d to start, up to %d (%d more piece(s) from the idle "
                   "workers, beyond coordinator.reserve_spares %d)\n", d->replicas_min,
                   d->replicas_max, d->tensor * d->pipeline * (d->replicas_max - d->replicas_min),
                   cfg->reserve_spares);
        bool gpu = d->device == TSR_DEVICE_CUDA;
        printf("  %-7s %-5s %-9s %-3s %-20s %-8s", "REPLICA", "STAGE", "LAYERS", "TP", "WORKER",
               "NODE");
        if (gpu) printf(" %-6s", "LINK");
        printf(" %12s", "WEIGHTS");
        if (gpu) printf(" %12s %12s %12s", "KV", "RESERVE", "TOTAL");
        printf("\n");
        uint64_t maxb = 0, maxt = 0;
        /* every rank of a replica holds the same KV blocks: the tightest stage's */
        int kv_blocks = -1;
        for (int st = 0; gpu && st < d->pipeline; st++) {
            int kb = tsr_cuda_kv_blocks(m, d, st, (uint64_t)gpu_gib << 30);
            if (kv_blocks < 0 || kb < kv_blocks) kv_blocks = kb;
        }
        for (size_t p = 0; p < plan->n_pieces; p++) {
            const tsr_piece_t *pc = &plan->pieces[p];
            if (pc->deployment != (int)i) continue;
            /* what the engine holds, not what the checkpoint stores */
            uint64_t b = tsr_piece_weight_bytes(m, d, pc->stage), kv = 0, rs = 0;
            uint64_t total = b;
            if (gpu) {
                tsr_piece_memory(m, d, pc->stage, 0, NULL, NULL, &rs);
                kv = (uint64_t)kv_blocks * tsr_cuda_block_bytes(m, d, pc->stage);
                total = b + kv + rs;
            }
            if (b > maxb) maxb = b;
            if (total > maxt) maxt = total;
            char hb[32], hk[32], hr[32], ht[32], layers_s[32];
            human(b, hb, sizeof hb);
            snprintf(layers_s, sizeof layers_s, "%d-%d", pc->layer_begin, pc->layer_end - 1);
            printf("  %-7d %-5d %-9s %-3d %-20s %-8s", pc->replica, pc->stage, layers_s, pc->tp,
                   pc->worker >= 0 ? ws[pc->worker].name : "(unplaced)",
                   pc->worker >= 0 ? ws[pc->worker].node : "-");
            if (gpu)
                printf(" %-6s", pc->worker >= 0 && ws[pc->worker].domain ? ws[pc->worker].domain
                                                                        : "-");
            printf(" %12s", hb);
            if (gpu) {
                human(kv, hk, sizeof hk), human(rs, hr, sizeof hr), human(total, ht, sizeof ht);
                printf(" %12s %12s %12s", hk, hr, ht);
            }
            printf("\n");
        }
        char hb[32], sb[256];
        if (gpu) {
            human(maxt, hb, sizeof hb);
            printf("  per-device memory: at most %s per GPU (weights in BF16, KV pool, reserve)\n",
                   hb);
        } else {
            human(maxb, hb, sizeof hb);
            printf("  per-device memory: at most %s of weights (%d-byte parameters%s), plus KV "
                   "cache and activations\n", hb, tsr_weight_elem_bytes(d),
                   d->weights_dtype == TSR_KV_INT8 ? ": int8, and a 4-byte scale a row" : "");
        }
        if (plan->deps[i].short_by) {
            printf("  NOT PLACED: %s\n", tsr_plan_shortage_of(plan, i, ws, sb, sizeof sb));
            short_total += plan->deps[i].short_by;
        }
        if (explain) {
            /* the devices of its kind the deployments before it leave */
            int before = 0;
            for (size_t j = 0; j < i; j++)
                if (cfg->deployments[j].device == d->device)
                    before += cfg->deployments[j].replicas * cfg->deployments[j].pipeline *
                              cfg->deployments[j].tensor;
            tsr_devices_t devs = described(d->device, nodes * per[d->device] - before,
                                           per[d->device], gpu_gib, nvlink, mem_gbs, gflops);
            explain_deployment(m, d, &devs);
        }
    }
    size_t idle = 0;
    for (size_t k = 0; k < nw; k++) idle += tsr_plan_piece_of(plan, (int)k) == NULL;
    printf("\n%zu worker(s) left idle as spares\n", idle);
    rc = short_total ? 3 : 0;
out:
    for (size_t i = 0; mem && cfg && i < cfg->n_deployments; i++) free(mem[i]);
    free(mem);
    tsr_plan_destroy(&plan);
    free(nodenames);
    free(domains);
    free(names);
    free(ws);
    free(layers);
    free(models);
    tsr_config_destroy(&cfg);
    return rc;
}
