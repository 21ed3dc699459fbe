/* planner.c: deployments + workers + current holdings -> desired placement.
 *
 * The work is done in three passes over one scratch context:
 *   1. lay out every piece (deployment, replica, stage, tp) with its layers;
 *   2. keep each piece whose worker already holds exactly it (rule 2 beats
 *      file order: a later deployment never loses a piece to an earlier one);
 *   3. serve deployments in file order, filling TP groups node by node.
 * Workers are visited in (node name, worker name) order everywhere, which is
 * what makes the result independent of the order of the workers array. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "planner.h"

#include "common/util.h"
#include "../common/modelcfg.h"

typedef struct {
    const tsr_config_t *cfg;
    const int *layers;
    const uint64_t *const *need;   /* [deployment][stage] bytes, or NULL */
    const tsr_plan_worker_t *workers;
    int n_workers;
    int *order;        /* worker indices by node name, then worker name */
    int *node_of;      /* node id per worker; ids follow node name order */
    int *node_start;   /* first position in order[] of each node */
    int n_nodes;
    int *owner;        /* piece each worker gets in the plan, -1 none */
    int *free_on;      /* free workers per node, for the deployment served */
    int *dep_base;     /* index of each deployment's first piece */
    tsr_plan_t *plan;
} planner_t;

typedef struct {
    const char *node;
    const char *name;
    int index;
} worker_key_t;


/* ---- input checks ------------------------------------------------------ */

static int check_deployment(const tsr_config_t *cfg, const int *layers, size_t i,
                            long long *total, char *err, size_t errlen)
{
    const tsr_deployment_t *d = &cfg->deployments[i];
    long long n;

    if (!d->name) {
        tsr_set_err(err, errlen, "deployments[%zu]: missing name", i);
        return -1;
    }
    for (size_t j = 0; j < i; j++) {
        /* Holdings name their deployment; two with one name would be ambiguous. */
        if (cfg->deployments[j].name && strcmp(cfg->deployments[j].name, d->name) == 0) {
            tsr_set_err(err, errlen, "deployments[%zu] (%s): name already used by deployments[%zu]",
                    i, d->name, j);
            return -1;
        }
    }
    if (d->tensor < 1 || d->pipeline < 1 || d->replicas < 1) {
        tsr_set_err(err, errlen, "deployments[%zu] (%s): parallel.tensor %d, pipeline %d and "
                "replicas %d must all be positive", i, d->name, d->tensor, d->pipeline,
                d->replicas);
        return -1;
    }
    if (layers[i] < 1) {
        tsr_set_err(err, errlen, "deployments[%zu] (%s): model layer count %d is not positive",
                i, d->name, layers[i]);
        return -1;
    }
    if (d->pipeline > layers[i]) {
        tsr_set_err(err, errlen, "deployments[%zu] (%s): parallel.pipeline %d exceeds the "
                "model's %d layers", i, d->name, d->pipeline, layers[i]);
        return -1;
    }
    n = (long long)d->tensor * d->pipeline * d->replicas;
    *total += n;
    /* Piece and worker indices are ints in the public structs. */
    if (n > INT_MAX || *total > INT_MAX) {
        tsr_set_err(err, errlen, "deployments[%zu] (%s): %lld pieces is too many", i, d->name, n);
        return -1;
    }
    return 0;
}

static int check_input(const tsr_config_t *cfg, const int *layers,
                       const tsr_plan_worker_t *workers, size_t n_workers,
                       char *err, size_t errlen)
{
    long long total = 0;

    if (!cfg) {
        tsr_set_err(err, errlen, "planner: no configuration");
        return -1;
    }
    if (cfg->n_deployments > 0 && (!cfg->deployments || !layers)) {
        tsr_set_err(err, errlen, "planner: %zu deployments but no deployment or layer table",
                cfg->n_deployments);
        return -1;
    }
    if (n_workers > 0 && !workers) {
        tsr_set_err(err, errlen, "planner: %zu workers but no worker table", n_workers);
        return -1;
    }
    if (n_workers > INT_MAX) {
        tsr_set_err(err, errlen, "planner: %zu workers is too many", n_workers);
        return -1;
    }
    for (size_t i = 0; i < cfg->n_deployments; i++)
        if (check_deployment(cfg, layers, i, &total, err, errlen) < 0)
            return -1;
    for (size_t w = 0; w < n_workers; w++) {
        if (!workers[w].name) {
            tsr_set_err(err, errlen, "planner: workers[%zu] has no name", w);
            return -1;
        }
    }
    return 0;
}

/* ---- context ------------------------------------------------------------ */

static const char *node_name(const tsr_plan_worker_t *w)
{
    return w->node ? w->node : "";
}

static int cmp_worker_key(const void *a, const void *b)
{
    const worker_key_t *x = a, *y = b;
    int c = strcmp(x->node, y->node);

    if (c == 0)
        c = strcmp(x->name, y->name);
    if (c == 0)
        c = (x->index > y->index) - (x->index < y->index);
    return c;
}

/* Sorts workers by node then name and numbers the nodes in name order, so a
 * node's workers sit together in order[] starting at node_start[id]. */
static int index_workers(planner_t *pl)
{
    int rc = -1;
    int n = pl->n_workers;
    worker_key_t *keys = calloc((size_t)n + 1, sizeof *keys);

    if (!keys)
        goto out;
    for (int i = 0; i < n; i++)
        keys[i] = (worker_key_t){ node_name(&pl->workers[i]), pl->workers[i].name, i };
    qsort(keys, (size_t)n, sizeof *keys, cmp_worker_key);
    pl->n_nodes = 0;
    for (int i = 0; i < n; i++) {
        if (i == 0 || strcmp(keys[i].node, keys[i - 1].node) != 0)
            pl->node_start[pl->n_nodes++] = i;
        pl->order[i] = keys[i].index;
        pl->node_of[keys[i].index] = pl->n_nodes - 1;
        pl->owner[keys[i].index] = -1;
    }
    rc = 0;
out:
    free(keys);
    return rc;
}

static tsr_plan_t *plan_new(size_t n_pieces, size_t n_deps)
{
    tsr_plan_t *p = calloc(1, sizeof *p);

    if (!p)
        return NULL;
    p->pieces = calloc(n_pieces + 1, sizeof *p->pieces);
    p->deps = calloc(n_deps + 1, sizeof *p->deps);
    if (!p->pieces || !p->deps) {
        tsr_plan_destroy(&p);
        return NULL;
    }
    p->n_pieces = n_pieces;
    p->n_deps = n_deps;
    return p;
}

static void planner_release(planner_t *pl)
{
    free(pl->order);
    free(pl->node_of);
    free(pl->node_start);
    free(pl->owner);
    free(pl->free_on);
    free(pl->dep_base);
    tsr_plan_destroy(&pl->plan);
}

static int planner_init(planner_t *pl, const tsr_config_t *cfg, const int *layers,
                        const tsr_plan_worker_t *workers, size_t n_workers)
{
    size_t nw = n_workers + 1, nd = cfg->n_deployments + 1;
    size_t total = 0;

    pl->cfg = cfg;
    pl->layers = layers;
    pl->workers = workers;
    pl->n_workers = (int)n_workers;
    pl->order = calloc(nw, sizeof *pl->order);
    pl->node_of = calloc(nw, sizeof *pl->node_of);
    pl->node_start = calloc(nw, sizeof *pl->node_start);
    pl->owner = calloc(nw, sizeof *pl->owner);
    pl->free_on = calloc(nw, sizeof *pl->free_on);
    pl->dep_base = calloc(nd, sizeof *pl->dep_base);
    if (!pl->order || !pl->node_of || !pl->node_start || !pl->owner || !pl->free_on
        || !pl->dep_base)
        return -1;
    for (size_t d = 0; d < cfg->n_deployments; d++) {
        const tsr_deployment_t *dep = &cfg->deployments[d];
        pl->dep_base[d] = (int)total;
        total += (size_t)dep->tensor * (size_t)dep->pipeline * (size_t)dep->replicas;
    }
    pl->plan = plan_new(total, cfg->n_deployments);
    if (!pl->plan)
        return -1;
    return index_workers(pl);
}

/* Bytes one piece of stage s of deployment d needs; 0 when not checked. */
static uint64_t need_of(const planner_t *pl, int d, int s)
{
    return pl->need && pl->need[d] ? pl->need[d][s] : 0;
}

/* Whether worker w has room for a piece of stage s of deployment d. */
static bool fits(const planner_t *pl, int w, int d, int s)
{
    uint64_t mem = pl->workers[w].memory, need = need_of(pl, d, s);
    return !mem || !need || mem >= need;
}

/* ---- pieces ------------------------------------------------------------- */

static int piece_index(const planner_t *pl, int d, int replica, int stage, int tp)
{
    const tsr_deployment_t *dep = &pl->cfg->deployments[d];

    return pl->dep_base[d] + (replica * dep->pipeline + stage) * dep->tensor + tp;
}

static void build_pieces(planner_t *pl)
{
    for (size_t d = 0; d < pl->cfg->n_deployments; d++) {
        const tsr_deployment_t *dep = &pl->cfg->deployments[d];
        tsr_plan_deployment_t *pd = &pl->plan->deps[d];

        pd->n_pieces = dep->tensor * dep->pipeline * dep->replicas;
        pd->device = dep->device;
        for (int r = 0; r < dep->replicas; r++)
            for (int s = 0; s < dep->pipeline; s++)
                for (int t = 0; t < dep->tensor; t++) {
                    tsr_piece_t *p = &pl->plan->pieces[piece_index(pl, (int)d, r, s, t)];
                    p->deployment = (int)d;
                    p->replica = r;
                    p->stage = s;
                    p->tp = t;
                    p->worker = -1;
                    tsr_layer_split(pl->layers[d], dep->pipeline, s,
                                    &p->layer_begin, &p->layer_end);
                }
    }
}

static void assign(planner_t *pl, int piece, int w, bool kept)
{
    pl->plan->pieces[piece].worker = w;
    pl->plan->pieces[piece].kept = kept;
    pl->owner[w] = piece;
}

static int find_deployment(const tsr_config_t *cfg, const char *name)
{
    for (size_t d = 0; d < cfg->n_deployments; d++)
        if (strcmp(cfg->deployments[d].name, name) == 0)
            return (int)d;
    return -1;
}

/* The piece this worker holds if it is still exactly a piece of the plan,
 * else -1; anything else it holds is stale and the worker counts as idle. */
static int piece_held(const planner_t *pl, const tsr_plan_worker_t *w)
{
    const tsr_piece_key_t *h = &w->current;
    const tsr_deployment_t *dep;
    int d, begin, end;

    if (!h->deployment[0] || (d = find_deployment(pl->cfg, h->deployment)) < 0)
        return -1;
    dep = &pl->cfg->deployments[d];
    if (w->device != dep->device || h->tp_size != dep->tensor || h->pp_size != dep->pipeline)
        return -1;
    if (h->replica < 0 || h->replica >= dep->replicas || h->stage < 0
        || h->stage >= dep->pipeline || h->tp < 0 || h->tp >= dep->tensor)
        return -1;
    tsr_layer_split(pl->layers[d], dep->pipeline, h->stage, &begin, &end);
    if (h->layer_begin != begin || h->layer_end != end)
        return -1;
    return piece_index(pl, d, h->replica, h->stage, h->tp);
}

/* When two workers claim one piece the first in name order keeps it; the
 * other is freed, which is the only way to end with a single owner. */
static void keep_current(planner_t *pl)
{
    for (int i = 0; i < pl->n_workers; i++) {
        int w = pl->order[i];
        int p;

        if (!pl->workers[w].eligible)
            continue;
        p = piece_held(pl, &pl->workers[w]);
        /* a holder whose GPU no longer has room (a reload raised the need) lets go */
        if (p >= 0 && pl->plan->pieces[p].worker < 0 &&
            fits(pl, w, pl->plan->pieces[p].deployment, pl->plan->pieces[p].stage))
            assign(pl, p, w, true);
    }
}

/* ---- nodes and free workers -------------------------------------------- */

/* Free for a piece of stage s of deployment d; s -1: for any of its stages. */
static bool is_free(const planner_t *pl, int w, int d, int s)
{
    if (!pl->workers[w].eligible || pl->workers[w].device != pl->cfg->deployments[d].device ||
        pl->owner[w] >= 0)
        return false;
    return s < 0 || fits(pl, w, d, s);
}

/* Free workers per node (free_on) and in all for stage s of deployment d
 * (s -1: any stage). */
static int count_free(planner_t *pl, int d, int s)
{
    int total = 0;

    memset(pl->free_on, 0, (size_t)(pl->n_nodes + 1) * sizeof *pl->free_on);
    for (int w = 0; w < pl->n_workers; w++) {
        if (is_free(pl, w, d, s)) {
            pl->free_on[pl->node_of[w]]++;
            total++;
        }
    }
    return total;
}

static const char *domain_of(const planner_t *pl, int w)
{
    const char *d = pl->workers[w].domain;
    return d ? d : "";
}

static const char *gpu_of(const planner_t *pl, int w)
{
    const char *g = pl->workers[w].gpu;
    return g ? g : "";
}

/* The distinct GPUs among the workers on `node` free for stage s of deployment d (in
 * NVLink domain `domain` when that is not NULL); a worker whose GPU is not known counts
 * as one of its own. */
static int free_gpus(const planner_t *pl, int node, int d, int s, const char *domain)
{
    int n = 0;
    for (int i = pl->node_start[node]; i < pl->n_workers; i++) {
        int w = pl->order[i];
        if (pl->node_of[w] != node) break;
        if (!is_free(pl, w, d, s) || (domain && strcmp(domain_of(pl, w), domain))) continue;
        bool seen = false;
        for (int k = pl->node_start[node]; k < i && !seen && gpu_of(pl, w)[0]; k++) {
            int v = pl->order[k];
            seen = is_free(pl, v, d, s) && (!domain || !strcmp(domain_of(pl, v), domain)) &&
                   !strcmp(gpu_of(pl, v), gpu_of(pl, w));
        }
        n += !seen;
    }
    return n;
}

/* Whether worker w's GPU is known and already holds a rank of piece's TP group. */
static bool gpu_taken_by_mate(const planner_t *pl, int w, const tsr_piece_t *pc)
{
    const char *g = gpu_of(pl, w);
    if (!g[0]) return false;
    int first = piece_index(pl, pc->deployment, pc->replica, pc->stage, 0);
    for (int t = 0; t < pl->cfg->deployments[pc->deployment].tensor; t++) {
        int m = pl->plan->pieces[first + t].worker;
        if (m >= 0 && pl->node_of[m] == pl->node_of[w] && !strcmp(gpu_of(pl, m), g))
            return true;
    }
    return false;
}

/* Gives `piece` a free worker with room on `node` (which has one): on a GPU none of
 * its TP group's placed ranks uses, in the NVLink domain `domain` (when that is not
 * NULL), as far as the node allows, a distinct GPU first; then the first by name, or,
 * when memory is checked, the one with the least memory that has room (unknown memory
 * last), so roomier GPUs stay for larger pieces. */
static void take_from_node_in(planner_t *pl, int node, int piece, const char *domain)
{
    const tsr_piece_t *pc = &pl->plan->pieces[piece];
    bool best_fit = need_of(pl, pc->deployment, pc->stage) > 0;
    int pick = -1;

    /* passes: 0 distinct GPU in the domain, 1 distinct GPU, 2 in the domain, 3 any */
    for (int pass = 0; pass < 4 && pick < 0; pass++)
    for (int i = pl->node_start[node]; i < pl->n_workers; i++) {
        int w = pl->order[i];

        if (pl->node_of[w] != node)
            break;
        if (!is_free(pl, w, pc->deployment, pc->stage))
            continue;
        if (pass % 2 == 0 && (!domain || strcmp(domain_of(pl, w), domain)))
            continue;
        if (pass < 2 && gpu_taken_by_mate(pl, w, pc))
            continue;
        if (!best_fit) {
            pick = w;
            break;
        }
        uint64_t m = pl->workers[w].memory ? pl->workers[w].memory : UINT64_MAX;
        uint64_t pm = pick < 0 ? 0 : pl->workers[pick].memory ? pl->workers[pick].memory : UINT64_MAX;
        if (pick < 0 || m < pm)
            pick = w;
    }
    if (pick >= 0) {
        assign(pl, piece, pick, false);
        pl->free_on[node]--;
    }
}

static void take_from_node(planner_t *pl, int node, int piece)
{
    take_from_node_in(pl, node, piece, NULL);
}

/* The NVLink domain on `node` with room for `need` ranks of stage s of
 * deployment d: one with `need` distinct GPUs before one with `need` workers
 * only, then the tightest (larger domains stay whole for larger groups; ties by
 * the first worker's name); NULL when none has room or the node's workers
 * report no domain. */
static const char *fitting_domain(const planner_t *pl, int node, int d, int s, int need)
{
    const char *best = NULL;
    int best_free = 0;
    bool best_gpus = false;
    for (int i = pl->node_start[node]; i < pl->n_workers; i++) {
        int w = pl->order[i];
        if (pl->node_of[w] != node) break;
        const char *dom = domain_of(pl, w);
        if (!dom[0] || !is_free(pl, w, d, s)) continue;
        bool seen = false;  /* counted with an earlier worker of the domain */
        for (int k = pl->node_start[node]; k < i && !seen; k++)
            seen = is_free(pl, pl->order[k], d, s) && !strcmp(domain_of(pl, pl->order[k]), dom);
        if (seen) continue;
        int n = 0;
        for (int k = i; k < pl->n_workers && pl->node_of[pl->order[k]] == node; k++)
            n += is_free(pl, pl->order[k], d, s) && !strcmp(domain_of(pl, pl->order[k]), dom);
        bool gpus = n >= need && free_gpus(pl, node, d, s, dom) >= need;
        if (n >= need && (!best || (gpus && !best_gpus) || (gpus == best_gpus && n < best_free))) {
            best = dom;
            best_free = n;
            best_gpus = gpus;
        }
    }
    return best;
}

/* Pieces of group (d, r, s) already on node; with other_stages, counts the
 * replica's other stages instead, which we would rather not share a node with. */
static int count_on_node(const planner_t *pl, int d, int r, int s, int node, bool other_stages)
{
    const tsr_deployment_t *dep = &pl->cfg->deployments[d];
    int n = 0;

    for (int s2 = 0; s2 < dep->pipeline; s2++) {
        if ((s2 == s) == other_stages)
            continue;
        for (int t = 0; t < dep->tensor; t++) {
            int w = pl->plan->pieces[piece_index(pl, d, r, s2, t)].worker;
            if (w >= 0 && pl->node_of[w] == node)
                n++;
        }
    }
    return n;
}

/* Best fit among nodes with room for the whole group: first a node with a
 * distinct GPU for every rank (ranks sharing a GPU cannot share an NCCL
 * communicator), then one the replica's other stages do not use, then the
 * tightest node so large nodes stay whole for larger groups.  Scanning in name
 * order breaks ties by name. */
static int pick_fitting_node(const planner_t *pl, int d, int r, int s, int need)
{
    int best = -1;
    bool best_shared = false, best_gpus = false;

    for (int n = 0; n < pl->n_nodes; n++) {
        bool shared, gpus;

        if (pl->free_on[n] < need)
            continue;
        shared = count_on_node(pl, d, r, s, n, true) > 0;
        gpus = free_gpus(pl, n, d, s, NULL) >= need;
        if (best < 0 || (gpus && !best_gpus)
            || (gpus == best_gpus && !shared && best_shared)
            || (gpus == best_gpus && shared == best_shared
                && pl->free_on[n] < pl->free_on[best])) {
            best = n;
            best_shared = shared;
            best_gpus = gpus;
        }
    }
    return best;
}

/* For a group that cannot sit on one node: fewest nodes means roomiest first. */
static int roomiest_node(const planner_t *pl)
{
    int best = -1;

    for (int n = 0; n < pl->n_nodes; n++)
        if (pl->free_on[n] > 0 && (best < 0 || pl->free_on[n] > pl->free_on[best]))
            best = n;
    return best;
}

/* A missing rank joins the rest of its group if it can (the all-reduce stays
 * on the node), else follows the same preferences as a whole group. */
static int pick_node_for_rank(const planner_t *pl, int d, int r, int s)
{
    int best = -1, best_mates = 0, best_others = 0;

    for (int n = 0; n < pl->n_nodes; n++) {
        int mates, others;

        if (pl->free_on[n] < 1)
            continue;
        mates = count_on_node(pl, d, r, s, n, false);
        others = count_on_node(pl, d, r, s, n, true) > 0;
        if (best < 0 || mates > best_mates
            || (mates == best_mates && others < best_others)
            || (mates == best_mates && others == best_others
                && pl->free_on[n] < pl->free_on[best])) {
            best = n;
            best_mates = mates;
            best_others = others;
        }
    }
    return best;
}

/* ---- serving ------------------------------------------------------------ */

static void place_whole_group(planner_t *pl, int d, int r, int s)
{
    int tensor = pl->cfg->deployments[d].tensor;
    int first = piece_index(pl, d, r, s, 0);
    int node = pick_fitting_node(pl, d, r, s, tensor);
    int t = 0;

    if (node >= 0) {
        /* inside one NVLink domain of the node when one has room */
        const char *dom = fitting_domain(pl, node, d, s, tensor);
        for (t = 0; t < tensor; t++)
            take_from_node_in(pl, node, first + t, dom);
        return;
    }
    while (t < tensor && (node = roomiest_node(pl)) >= 0)
        while (t < tensor && pl->free_on[node] > 0)
            take_from_node(pl, node, first + t++);
}

static void place_missing_ranks(planner_t *pl, int d, int r, int s)
{
    int first = piece_index(pl, d, r, s, 0);

    for (int t = 0; t < pl->cfg->deployments[d].tensor; t++) {
        int node;

        if (pl->plan->pieces[first + t].worker >= 0)
            continue;
        node = pick_node_for_rank(pl, d, r, s);
        if (node < 0)
            return;
        /* beside a placed mate on that node: in its NVLink domain if it can */
        const char *dom = NULL;
        for (int k = 0; k < pl->cfg->deployments[d].tensor && !dom; k++) {
            int m = pl->plan->pieces[first + k].worker;
            if (m >= 0 && pl->node_of[m] == node && domain_of(pl, m)[0]) dom = domain_of(pl, m);
        }
        take_from_node_in(pl, node, first + t, dom);
    }
}

static int count_placed(const planner_t *pl, int first, int n)
{
    int placed = 0;

    for (int i = first; i < first + n; i++)
        if (pl->plan->pieces[i].worker >= 0)
            placed++;
    return placed;
}

/* Workers a deployment with nothing placed lacks, memory counted: taking
 * its stages from the largest need down, each must find, among the free
 * workers with room for it, one for every piece of it and of the larger
 * stages before it.  Sets the memory fields when memory is the cause. */
static int short_whole(planner_t *pl, int d)
{
    const tsr_deployment_t *dep = &pl->cfg->deployments[d];
    tsr_plan_deployment_t *pd = &pl->plan->deps[d];
    int n_free = count_free(pl, d, -1), short_by = dep->replicas * dep->pipeline * dep->tensor - n_free;
    int cum = 0, n_stages = dep->pipeline;
    bool *done = calloc((size_t)n_stages, sizeof *done);

    for (int k = 0; done && k < n_stages; k++) {
        int s = -1;
        for (int t = 0; t < n_stages; t++)
            if (!done[t] && (s < 0 || need_of(pl, d, t) > need_of(pl, d, s)))
                s = t;
        done[s] = true;
        cum += dep->replicas * dep->tensor;
        int fit = count_free(pl, d, s), lack = cum - fit;
        if (lack > short_by) short_by = lack;
        /* memory is a cause when some free workers have no room for it */
        if (lack > 0 && fit < n_free && (pd->mem_stage < 0 || need_of(pl, d, s) > pd->mem_need)) {
            pd->mem_stage = s;
            pd->mem_need = need_of(pl, d, s);
        }
    }
    free(done);
    return short_by > 0 ? short_by : 0;
}

/* For the message: the roomiest eligible worker of the deployment's kind. */
static void note_largest(planner_t *pl, int d)
{
    tsr_plan_deployment_t *pd = &pl->plan->deps[d];
    for (int i = 0; i < pl->n_workers; i++) {
        int w = pl->order[i];
        if (!pl->workers[w].eligible || pl->workers[w].device != pl->cfg->deployments[d].device)
            continue;
        if (pd->mem_largest_worker < 0 || pl->workers[w].memory > pd->mem_largest) {
            pd->mem_largest = pl->workers[w].memory;
            pd->mem_largest_worker = w;
        }
    }
}

static void serve_deployment(planner_t *pl, int d)
{
    const tsr_deployment_t *dep = &pl->cfg->deployments[d];
    tsr_plan_deployment_t *pd = &pl->plan->deps[d];
    int base = pl->dep_base[d];
    int kept = count_placed(pl, base, pd->n_pieces);

    pd->mem_stage = pd->mem_largest_worker = -1;
    /* A deployment with nothing placed cannot serve until it is whole, so it
     * must not hold workers that a later deployment could use. */
    if (kept == 0 && (pd->short_by = short_whole(pl, d)) > 0) {
        pd->placed = 0;
        if (pd->mem_stage >= 0) note_largest(pl, d);
        return;
    }
    pd->mem_stage = -1;
    /* Groups in (replica, stage) order; when memory is checked, stage by
     * stage from the largest need down, so a roomy GPU is not taken by a
     * small stage that a smaller one could hold (the order short_whole
     * proved sufficient). */
    int *order = malloc((size_t)dep->pipeline * sizeof *order);
    if (!order) {
        pd->placed = count_placed(pl, base, pd->n_pieces);
        pd->short_by = pd->n_pieces - pd->placed;
        return;
    }
    for (int s = 0; s < dep->pipeline; s++) order[s] = s;
    for (int i = 1; i < dep->pipeline; i++)   /* stable insertion sort by need, descending */
        for (int j = i; j > 0 && need_of(pl, d, order[j]) > need_of(pl, d, order[j - 1]); j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    bool by_stage = pl->need && pl->need[d];
    int outer = by_stage ? dep->pipeline : dep->replicas, inner = by_stage ? dep->replicas : dep->pipeline;
    for (int a = 0; a < outer; a++) {
        for (int b = 0; b < inner; b++) {
            int r = by_stage ? b : a, s = by_stage ? order[a] : b;
            int first = piece_index(pl, d, r, s, 0);
            int placed = count_placed(pl, first, dep->tensor);

            count_free(pl, d, s);
            if (placed == 0)
                place_whole_group(pl, d, r, s);
            else if (placed < dep->tensor)
                place_missing_ranks(pl, d, r, s);
            /* what is still missing for lack of a worker with room */
            if (count_placed(pl, first, dep->tensor) < dep->tensor && need_of(pl, d, s) &&
                count_free(pl, d, -1) > 0 &&
                (pd->mem_stage < 0 || need_of(pl, d, s) > pd->mem_need)) {
                pd->mem_stage = s;
                pd->mem_need = need_of(pl, d, s);
            }
        }
    }
    free(order);
    pd->placed = count_placed(pl, base, pd->n_pieces);
    pd->short_by = pd->n_pieces - pd->placed;
    if (pd->mem_stage >= 0) note_largest(pl, d);
}

/* ---- public ------------------------------------------------------------- */

int tsr_plan_compute(const tsr_config_t *cfg, const int *layers,
                     const tsr_plan_worker_t *workers, size_t n_workers,
                     tsr_plan_t **out, char *err, size_t errlen)
{
    return tsr_plan_compute_mem(cfg, layers, NULL, workers, n_workers, out, err, errlen);
}

int tsr_plan_compute_mem(const tsr_config_t *cfg, const int *layers,
                         const uint64_t *const *need, const tsr_plan_worker_t *workers,
                         size_t n_workers, tsr_plan_t **out, char *err, size_t errlen)
{
    int rc = -1;
    planner_t pl = { 0 };

    pl.need = need;
    if (!out) {
        tsr_set_err(err, errlen, "planner: no output pointer");
        goto out;
    }
    *out = NULL;
    if (check_input(cfg, layers, workers, n_workers, err, errlen) < 0)
        goto out;
    if (planner_init(&pl, cfg, layers, workers, n_workers) < 0) {
        tsr_set_err(err, errlen, "planner: out of memory");
        goto out;
    }
    build_pieces(&pl);
    keep_current(&pl);
    for (size_t d = 0; d < cfg->n_deployments; d++)
        serve_deployment(&pl, (int)d);
    pl.plan->worker_piece = pl.owner;    /* the planner's own index, kept */
    pl.plan->n_workers = n_workers;
    pl.owner = NULL;
    *out = pl.plan;
    pl.plan = NULL;   /* transferred */
    rc = 0;
out:
    planner_release(&pl);
    return rc;
}

void tsr_plan_destroy(tsr_plan_t **self_p)
{
    tsr_plan_t *p;

    if (!self_p || !*self_p)
        return;
    p = *self_p;
    free(p->pieces);
    free(p->deps);
    free(p->worker_piece);
    free(p);
    *self_p = NULL;
}

const tsr_piece_t *tsr_plan_piece_of(const tsr_plan_t *p, int w)
{
    if (!p || w < 0 || (size_t)w >= p->n_workers || !p->worker_piece ||
        p->worker_piece[w] < 0)
        return NULL;
    return &p->pieces[p->worker_piece[w]];
}

const char *tsr_plan_shortage(const tsr_plan_t *p, size_t i, char *buf, size_t len)
{
    return tsr_plan_shortage_of(p, i, NULL, buf, len);
}

const char *tsr_plan_shortage_of(const tsr_plan_t *p, size_t i, const tsr_plan_worker_t *workers,
                                 char *buf, size_t len)
{
    if (!p || i >= p->n_deps)
        return tsr_shortage_text(0, TSR_DEVICE_CPU, buf, len);
    const tsr_plan_deployment_t *pd = &p->deps[i];
    tsr_shortage_text(pd->short_by, pd->device, buf, len);
    if (!pd->short_by || pd->mem_stage < 0 || !buf || !len) return buf;
    const char *kind = tsr_device_name(pd->device);
    size_t n = strlen(buf);
    if (pd->mem_largest_worker >= 0 && pd->mem_largest < pd->mem_need)
        snprintf(buf + n, len - n, ": stage %d needs %.1f GiB per %s worker; the largest, %s, has "
                 "%.1f GiB", pd->mem_stage, pd->mem_need / 1073741824.0, kind,
                 workers ? workers[pd->mem_largest_worker].name : "(a worker)",
                 pd->mem_largest / 1073741824.0);
    else
        snprintf(buf + n, len - n, " with at least %.1f GiB (stage %d's need)",
                 pd->mem_need / 1073741824.0, pd->mem_stage);
    return buf;
}

const char *tsr_shortage_text(int short_by, tsr_device_t device, char *buf, size_t len)
{
    if (!buf || len == 0)
        return "";
    buf[0] = '\0';
    if (short_by > 0)
        snprintf(buf, len, "needs %d more %s worker%s", short_by, tsr_device_name(device),
                 short_by == 1 ? "" : "s");
    return buf;
}
