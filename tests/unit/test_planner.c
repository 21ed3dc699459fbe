/* test_planner.c: the placement rules of coordinator/planner.h, proved on
 * configs and worker sets built in C, plus a seeded property loop. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/planner.h"
#include "common/modelcfg.h"

#ifdef PLANNER_TEST_STANDALONE
/* Stand-ins for common/modelcfg.c and common/deploy.c, so this test links on
 * its own; the real build links those files instead. */
void tsr_layer_split(int n_layers, int stages, int stage, int *begin, int *end)
{
    int base = n_layers / stages, extra = n_layers % stages;

    *begin = stage * base + (stage < extra ? stage : extra);
    *end = *begin + base + (stage < extra ? 1 : 0);
}

const char *tsr_device_name(tsr_device_t d)
{
    return d == TSR_DEVICE_CUDA ? "cuda" : "cpu";
}
#endif

#define MAX_WORKERS 64
#define MAX_DEPS 4

/* A cluster under test: workers with stable name storage, and a config. */
typedef struct {
    tsr_plan_worker_t w[MAX_WORKERS];
    char names[MAX_WORKERS][16];
    char nodes[MAX_WORKERS][16];
    size_t n;
    tsr_deployment_t deps[MAX_DEPS];
    int layers[MAX_DEPS];
    tsr_config_t cfg;
} cluster_t;

static void cluster_init(cluster_t *c)
{
    memset(c, 0, sizeof *c);
    c->cfg.deployments = c->deps;
}

static int add_worker(cluster_t *c, const char *node, tsr_device_t dev)
{
    size_t i = c->n++;

    assert_true(i < MAX_WORKERS);
    snprintf(c->nodes[i], sizeof c->nodes[i], "%s", node);
    snprintf(c->names[i], sizeof c->names[i], "%s-w%02zu", node, i);
    c->w[i].name = c->names[i];
    c->w[i].node = c->nodes[i];
    c->w[i].device = dev;
    c->w[i].eligible = true;
    return (int)i;
}

static void add_node(cluster_t *c, const char *node, int n, tsr_device_t dev)
{
    for (int i = 0; i < n; i++)
        add_worker(c, node, dev);
}

static void add_dep(cluster_t *c, const char *name, tsr_device_t dev, int tensor,
                    int pipeline, int replicas, int layers)
{
    size_t i = c->cfg.n_deployments++;

    assert_true(i < MAX_DEPS);
    c->deps[i] = (tsr_deployment_t){ .name = (char *)name, .device = dev, .tensor = tensor,
                                     .pipeline = pipeline, .replicas = replicas };
    c->layers[i] = layers;
}

static tsr_plan_t *plan(cluster_t *c)
{
    tsr_plan_t *p = NULL;
    char err[256] = "";

    assert_int_equal(tsr_plan_compute(&c->cfg, c->layers, c->w, c->n, &p, err, sizeof err), 0);
    assert_non_null(p);
    return p;
}

/* What the reconciler would report back after carrying out plan p. */
static void apply(cluster_t *c, const tsr_plan_t *p)
{
    for (size_t w = 0; w < c->n; w++) {
        const tsr_piece_t *pc = tsr_plan_piece_of(p, (int)w);
        tsr_piece_key_t *h = &c->w[w].current;

        memset(h, 0, sizeof *h);
        if (!pc)
            continue;
        snprintf(h->deployment, sizeof h->deployment, "%s", c->deps[pc->deployment].name);
        h->replica = pc->replica;
        h->stage = pc->stage;
        h->tp = pc->tp;
        h->tp_size = c->deps[pc->deployment].tensor;
        h->pp_size = c->deps[pc->deployment].pipeline;
        h->layer_begin = pc->layer_begin;
        h->layer_end = pc->layer_end;
    }
}

static const tsr_piece_t *piece(const tsr_plan_t *p, int d, int r, int s, int t)
{
    for (size_t i = 0; i < p->n_pieces; i++) {
        const tsr_piece_t *pc = &p->pieces[i];
        if (pc->deployment == d && pc->replica == r && pc->stage == s && pc->tp == t)
            return pc;
    }
    fail_msg("no piece %d/%d/%d/%d", d, r, s, t);
    return NULL;
}

static const char *node_of_piece(const cluster_t *c, const tsr_plan_t *p,
                                 int d, int r, int s, int t)
{
    const tsr_piece_t *pc = piece(p, d, r, s, t);

    assert_true(pc->worker >= 0);
    return c->w[pc->worker].node;
}

/* Rule 1 and the bookkeeping every plan must satisfy, whatever the input. */
static void check_invariants(const cluster_t *c, const tsr_plan_t *p)
{
    int used[MAX_WORKERS] = { 0 };
    size_t k = 0;

    assert_int_equal(p->n_deps, c->cfg.n_deployments);
    for (size_t d = 0; d < c->cfg.n_deployments; d++) {
        const tsr_deployment_t *dep = &c->deps[d];
        int placed = 0;

        assert_int_equal(p->deps[d].n_pieces, dep->tensor * dep->pipeline * dep->replicas);
        assert_int_equal(p->deps[d].device, dep->device);
        for (int r = 0; r < dep->replicas; r++)
            for (int s = 0; s < dep->pipeline; s++)
                for (int t = 0; t < dep->tensor; t++, k++) {
                    const tsr_piece_t *pc = &p->pieces[k];
                    int b, e;

                    /* ordered by deployment, replica, stage, tp */
                    assert_int_equal(pc->deployment, (int)d);
                    assert_int_equal(pc->replica, r);
                    assert_int_equal(pc->stage, s);
                    assert_int_equal(pc->tp, t);
                    tsr_layer_split(c->layers[d], dep->pipeline, s, &b, &e);
                    assert_int_equal(pc->layer_begin, b);
                    assert_int_equal(pc->layer_end, e);
                    if (pc->worker < 0) {
                        assert_false(pc->kept);
                        continue;
                    }
                    assert_true(pc->worker < (int)c->n);
                    assert_int_equal(used[pc->worker]++, 0);
                    assert_true(c->w[pc->worker].eligible);
                    assert_int_equal(c->w[pc->worker].device, dep->device);
                    assert_ptr_equal(tsr_plan_piece_of(p, pc->worker), pc);
                    placed++;
                }
        assert_int_equal(p->deps[d].placed, placed);
        /* a deployment left empty is short by what the free workers lack,
         * one partly placed by exactly its missing pieces */
        if (placed > 0)
            assert_int_equal(p->deps[d].short_by, p->deps[d].n_pieces - placed);
        else
            assert_in_range(p->deps[d].short_by, p->deps[d].n_pieces > 0, p->deps[d].n_pieces);
    }
    assert_int_equal(p->n_pieces, k);
}

static int free_workers(const cluster_t *c, const tsr_plan_t *p, tsr_device_t dev)
{
    int n = 0;

    for (size_t w = 0; w < c->n; w++)
        if (c->w[w].eligible && c->w[w].device == dev && !tsr_plan_piece_of(p, (int)w))
            n++;
    return n;
}

/* ---- tests ---------------------------------------------------------------- */

static void test_every_piece_placed_once_and_no_worker_twice(void **state)
{
    cluster_t c;
    tsr_plan_t *p;

    (void)state;
    cluster_init(&c);
    add_node(&c, "a", 3, TSR_DEVICE_CUDA);
    add_node(&c, "b", 3, TSR_DEVICE_CUDA);
    add_dep(&c, "m", TSR_DEVICE_CUDA, 2, 1, 3, 8);
    p = plan(&c);
    check_invariants(&c, p);
    assert_int_equal(p->deps[0].placed, 6);
    assert_int_equal(p->deps[0].short_by, 0);
    for (size_t i = 0; i < p->n_pieces; i++)
        assert_false(p->pieces[i].kept);
    tsr_plan_destroy(&p);
    assert_null(p);
}

static void test_tp_groups_share_a_node_and_stages_use_different_nodes(void **state)
{
    cluster_t c;
    tsr_plan_t *p;

    (void)state;
    cluster_init(&c);
    add_node(&c, "n0", 4, TSR_DEVICE_CUDA);
    add_node(&c, "n1", 4, TSR_DEVICE_CUDA);
    add_dep(&c, "big", TSR_DEVICE_CUDA, 4, 2, 1, 32);
    p = plan(&c);
    check_invariants(&c, p);
    for (int s = 0; s < 2; s++)
        for (int t = 1; t < 4; t++)
            assert_string_equal(node_of_piece(&c, p, 0, 0, s, t), node_of_piece(&c, p, 0, 0, s, 0));
    assert_string_equal(node_of_piece(&c, p, 0, 0, 0, 0), "n0");
    assert_string_equal(node_of_piece(&c, p, 0, 0, 1, 0), "n1");
    tsr_plan_destroy(&p);
}

static void test_tp_group_takes_the_tightest_node_that_fits(void **state)
{
    cluster_t c;
    tsr_plan_t *p;

    (void)state;
    cluster_init(&c);
    add_node(&c, "a", 8, TSR_DEVICE_CUDA);
    add_node(&c, "b", 1, TSR_DEVICE_CUDA);
    add_node(&c, "c", 2, TSR_DEVICE_CUDA);
    add_dep(&c, "m", TSR_DEVICE_CUDA, 2, 1, 1, 4);
    p = plan(&c);
    check_invariants(&c, p);
    /* c is the tightest fit, which leaves a whole for a wide group later */
    assert_string_equal(node_of_piece(&c, p, 0, 0, 0, 0), "c");
    assert_string_equal(node_of_piece(&c, p, 0, 0, 0, 1), "c");
    tsr_plan_destroy(&p);
}

static void test_second_stage_avoids_the_node_of_the_first_when_another_fits(void **state)
{
    cluster_t c;
    tsr_plan_t *p;

    (void)state;
    cluster_init(&c);
    add_node(&c, "a", 4, TSR_DEVICE_CUDA);
    add_node(&c, "b", 8, TSR_DEVICE_CUDA);
    add_dep(&c, "m", TSR_DEVICE_CUDA, 2, 2, 1, 4);
    p = plan(&c);
    check_invariants(&c, p);
    /* best fit alone would put both stages on a */
    assert_string_equal(node_of_piece(&c, p, 0, 0, 0, 0), "a");
    assert_string_equal(node_of_piece(&c, p, 0, 0, 0, 1), "a");
    assert_string_equal(node_of_piece(&c, p, 0, 0, 1, 0), "b");
    assert_string_equal(node_of_piece(&c, p, 0, 0, 1, 1), "b");
    tsr_plan_destroy(&p);
}

static void test_tp_group_too_wide_for_any_node_fills_roomiest_nodes_first(void **state)
{
    cluster_t c;
    tsr_plan_t *p;

    (void)state;
    cluster_init(&c);
    add_node(&c, "a", 2, TSR_DEVICE_CUDA);
    add_node(&c, "b", 3, TSR_DEVICE_CUDA);
    add_node(&c, "c", 3, TSR_DEVICE_CUDA);
    add_dep(&c, "m", TSR_DEVICE_CUDA, 4, 1, 1, 4);
    p = plan(&c);
    check_invariants(&c, p);
    assert_string_equal(node_of_piece(&c, p, 0, 0, 0, 0), "b");
    assert_string_equal(node_of_piece(&c, p, 0, 0, 0, 1), "b");
    assert_string_equal(node_of_piece(&c, p, 0, 0, 0, 2), "b");
    assert_string_equal(node_of_piece(&c, p, 0, 0, 0, 3), "c");
    tsr_plan_destroy(&p);
}

static void test_layer_splits_are_even_contiguous_and_cover_all_layers(void **state)
{
    (void)state;
    for (int layers = 1; layers <= 40; layers++) {
        for (int pp = 1; pp <= layers && pp <= 9; pp++) {
            cluster_t c;
            tsr_plan_t *p;
            int next = 0, lo = layers, hi = 0;

            cluster_init(&c);
            add_node(&c, "n", pp, TSR_DEVICE_CPU);
            add_dep(&c, "m", TSR_DEVICE_CPU, 1, pp, 1, layers);
            p = plan(&c);
            check_invariants(&c, p);
            for (int s = 0; s < pp; s++) {
                const tsr_piece_t *pc = piece(p, 0, 0, s, 0);
                int n = pc->layer_end - pc->layer_begin;

                assert_int_equal(pc->layer_begin, next);
                assert_true(n >= 1);
                lo = n < lo ? n : lo;
                hi = n > hi ? n : hi;
                next = pc->layer_end;
            }
            assert_int_equal(next, layers);
            assert_true(hi - lo <= 1);
            tsr_plan_destroy(&p);
        }
    }
}

static void test_lost_worker_moves_only_its_piece_to_the_spare(void **state)
{
    cluster_t c;
    tsr_plan_t *p1, *p2;
    int spare, lost, changed = 0;

    (void)state;
    cluster_init(&c);
    add_node(&c, "n0", 2, TSR_DEVICE_CUDA);
    add_node(&c, "n1", 2, TSR_DEVICE_CUDA);
    spare = add_worker(&c, "n2", TSR_DEVICE_CUDA);
    add_dep(&c, "m", TSR_DEVICE_CUDA, 2, 2, 1, 10);
    p1 = plan(&c);
    check_invariants(&c, p1);
    assert_null(tsr_plan_piece_of(p1, spare));
    apply(&c, p1);
    lost = piece(p1, 0, 0, 1, 0)->worker;
    c.w[lost].eligible = false;

    p2 = plan(&c);
    check_invariants(&c, p2);
    for (size_t i = 0; i < p2->n_pieces; i++) {
        if (p2->pieces[i].worker == p1->pieces[i].worker) {
            assert_true(p2->pieces[i].kept);
            continue;
        }
        changed++;
        assert_int_equal(p1->pieces[i].worker, lost);
        assert_int_equal(p2->pieces[i].worker, spare);
        assert_false(p2->pieces[i].kept);
    }
    assert_int_equal(changed, 1);
    assert_int_equal(p2->deps[0].short_by, 0);
    tsr_plan_destroy(&p1);
    tsr_plan_destroy(&p2);
}

static void test_replacement_rank_joins_its_group_on_the_same_node(void **state)
{
    cluster_t c;
    tsr_plan_t *p1, *p2;
    int lost;

    (void)state;
    cluster_init(&c);
    add_node(&c, "a", 1, TSR_DEVICE_CUDA);   /* a tighter node that sorts first */
    add_node(&c, "b", 3, TSR_DEVICE_CUDA);
    add_dep(&c, "m", TSR_DEVICE_CUDA, 2, 1, 1, 4);
    p1 = plan(&c);
    assert_string_equal(node_of_piece(&c, p1, 0, 0, 0, 0), "b");
    apply(&c, p1);
    lost = piece(p1, 0, 0, 0, 0)->worker;
    c.w[lost].eligible = false;

    p2 = plan(&c);
    check_invariants(&c, p2);
    assert_true(piece(p2, 0, 0, 0, 1)->kept);
    assert_string_equal(node_of_piece(&c, p2, 0, 0, 0, 0), "b");
    tsr_plan_destroy(&p1);
    tsr_plan_destroy(&p2);
}

static void test_lost_worker_without_spare_keeps_the_rest_and_is_short_by_one(void **state)
{
    cluster_t c;
    tsr_plan_t *p1, *p2;
    char buf[64];
    int lost;

    (void)state;
    cluster_init(&c);
    add_node(&c, "n0", 4, TSR_DEVICE_CUDA);
    add_dep(&c, "m", TSR_DEVICE_CUDA, 2, 2, 1, 6);
    p1 = plan(&c);
    apply(&c, p1);
    lost = piece(p1, 0, 0, 0, 1)->worker;
    c.w[lost].eligible = false;

    p2 = plan(&c);
    check_invariants(&c, p2);
    assert_int_equal(p2->deps[0].placed, 3);
    assert_int_equal(p2->deps[0].short_by, 1);
    assert_int_equal(piece(p2, 0, 0, 0, 1)->worker, -1);
    for (size_t i = 0; i < p2->n_pieces; i++)
        if (p2->pieces[i].worker >= 0)
            assert_true(p2->pieces[i].kept);
    assert_string_equal(tsr_plan_shortage(p2, 0, buf, sizeof buf), "needs 1 more cuda worker");
    tsr_plan_destroy(&p1);
    tsr_plan_destroy(&p2);
}

static void test_new_deployment_short_of_workers_places_nothing_and_says_how_many(void **state)
{
    cluster_t c;
    tsr_plan_t *p;
    char buf[64];

    (void)state;
    cluster_init(&c);
    add_node(&c, "n0", 5, TSR_DEVICE_CUDA);
    add_dep(&c, "m", TSR_DEVICE_CUDA, 4, 2, 1, 8);
    p = plan(&c);
    check_invariants(&c, p);
    assert_int_equal(p->deps[0].placed, 0);
    assert_int_equal(p->deps[0].short_by, 3);
    assert_int_equal(free_workers(&c, p, TSR_DEVICE_CUDA), 5);
    assert_string_equal(tsr_plan_shortage(p, 0, buf, sizeof buf), "needs 3 more cuda workers");
    tsr_plan_destroy(&p);
}

static void test_shortage_text_is_empty_when_nothing_is_short(void **state)
{
    cluster_t c;
    tsr_plan_t *p;
    char buf[64] = "junk";

    (void)state;
    cluster_init(&c);
    add_node(&c, "n0", 1, TSR_DEVICE_CPU);
    add_dep(&c, "m", TSR_DEVICE_CPU, 1, 1, 2, 2);
    p = plan(&c);
    assert_string_equal(tsr_plan_shortage(p, 0, buf, sizeof buf), "needs 1 more cpu worker");
    p->deps[0].short_by = 2;
    assert_string_equal(tsr_plan_shortage(p, 0, buf, sizeof buf), "needs 2 more cpu workers");
    p->deps[0].short_by = 0;
    assert_string_equal(tsr_plan_shortage(p, 0, buf, sizeof buf), "");
    assert_string_equal(tsr_plan_shortage(p, 7, buf, sizeof buf), "");
    assert_string_equal(tsr_plan_shortage(NULL, 0, buf, sizeof buf), "");
    tsr_plan_destroy(&p);
}

static void test_cpu_workers_never_get_cuda_pieces(void **state)
{
    cluster_t c;
    tsr_plan_t *p;

    (void)state;
    cluster_init(&c);
    add_node(&c, "c", 4, TSR_DEVICE_CPU);
    add_node(&c, "g", 2, TSR_DEVICE_CUDA);
    add_dep(&c, "gpu", TSR_DEVICE_CUDA, 2, 2, 1, 4);
    add_dep(&c, "cpu", TSR_DEVICE_CPU, 1, 1, 3, 4);
    p = plan(&c);
    check_invariants(&c, p);
    assert_int_equal(p->deps[0].placed, 0);
    assert_int_equal(p->deps[0].short_by, 2);
    assert_int_equal(p->deps[1].placed, 3);
    for (size_t w = 0; w < c.n; w++) {
        const tsr_piece_t *pc = tsr_plan_piece_of(p, (int)w);
        if (pc)
            assert_int_equal(c.deps[pc->deployment].device, c.w[w].device);
    }
    tsr_plan_destroy(&p);
}

static void test_holding_on_wrong_device_kind_is_not_kept(void **state)
{
    cluster_t c;
    tsr_plan_t *p;
    int cpu, gpu;

    (void)state;
    cluster_init(&c);
    cpu = add_worker(&c, "a", TSR_DEVICE_CPU);
    gpu = add_worker(&c, "b", TSR_DEVICE_CUDA);
    add_dep(&c, "m", TSR_DEVICE_CUDA, 1, 1, 1, 4);
    c.w[cpu].current = (tsr_piece_key_t){ "m", 0, 0, 0, 1, 1, 0, 4 };
    p = plan(&c);
    check_invariants(&c, p);
    assert_null(tsr_plan_piece_of(p, cpu));
    assert_int_equal(piece(p, 0, 0, 0, 0)->worker, gpu);
    assert_false(piece(p, 0, 0, 0, 0)->kept);
    tsr_plan_destroy(&p);
}

static void test_layout_change_frees_old_holders_and_replaces_the_piece(void **state)
{
    cluster_t c;
    tsr_plan_t *p1, *p2;
    int w0, w1;

    (void)state;
    cluster_init(&c);
    w0 = add_worker(&c, "n0", TSR_DEVICE_CUDA);
    w1 = add_worker(&c, "n0", TSR_DEVICE_CUDA);
    add_dep(&c, "m", TSR_DEVICE_CUDA, 2, 1, 1, 4);
    p1 = plan(&c);
    apply(&c, p1);
    assert_int_equal(c.w[w0].current.tp_size, 2);

    c.deps[0].tensor = 1;
    p2 = plan(&c);
    check_invariants(&c, p2);
    assert_int_equal(p2->n_pieces, 1);
    /* tp 0 of a tp-2 group is not the tp-1 piece: a fresh load, on w0 by name */
    assert_int_equal(piece(p2, 0, 0, 0, 0)->worker, w0);
    assert_false(piece(p2, 0, 0, 0, 0)->kept);
    assert_null(tsr_plan_piece_of(p2, w1));
    tsr_plan_destroy(&p1);
    tsr_plan_destroy(&p2);
}

static void test_holders_of_a_removed_deployment_are_freed(void **state)
{
    cluster_t c;
    tsr_plan_t *p;
    int w0;

    (void)state;
    cluster_init(&c);
    w0 = add_worker(&c, "n0", TSR_DEVICE_CPU);
    add_dep(&c, "new", TSR_DEVICE_CPU, 1, 1, 1, 2);
    c.w[w0].current = (tsr_piece_key_t){ "gone", 0, 0, 0, 1, 1, 0, 2 };
    p = plan(&c);
    check_invariants(&c, p);
    assert_int_equal(piece(p, 0, 0, 0, 0)->worker, w0);
    assert_false(piece(p, 0, 0, 0, 0)->kept);
    tsr_plan_destroy(&p);
}

static void test_piece_claimed_by_two_workers_is_kept_by_one(void **state)
{
    cluster_t c;
    tsr_plan_t *p;
    int a, b;

    (void)state;
    cluster_init(&c);
    b = add_worker(&c, "n1", TSR_DEVICE_CPU);
    a = add_worker(&c, "n0", TSR_DEVICE_CPU);
    add_dep(&c, "m", TSR_DEVICE_CPU, 1, 1, 1, 3);
    c.w[a].current = (tsr_piece_key_t){ "m", 0, 0, 0, 1, 1, 0, 3 };
    c.w[b].current = c.w[a].current;
    p = plan(&c);
    check_invariants(&c, p);
    /* the tie goes to node name order, not to array order */
    assert_int_equal(piece(p, 0, 0, 0, 0)->worker, a);
    assert_true(piece(p, 0, 0, 0, 0)->kept);
    assert_null(tsr_plan_piece_of(p, b));
    tsr_plan_destroy(&p);
}

static void test_deployments_are_served_in_file_order(void **state)
{
    cluster_t c;
    tsr_plan_t *p;

    (void)state;
    cluster_init(&c);
    add_node(&c, "n0", 4, TSR_DEVICE_CUDA);
    add_dep(&c, "first", TSR_DEVICE_CUDA, 2, 1, 1, 4);
    add_dep(&c, "second", TSR_DEVICE_CUDA, 1, 3, 1, 6);
    add_dep(&c, "third", TSR_DEVICE_CUDA, 2, 1, 1, 4);
    p = plan(&c);
    check_invariants(&c, p);
    assert_int_equal(p->deps[0].placed, 2);
    /* second cannot be whole, so it holds nothing and third gets the rest */
    assert_int_equal(p->deps[1].placed, 0);
    assert_int_equal(p->deps[1].short_by, 1);
    assert_int_equal(p->deps[2].placed, 2);
    assert_string_equal(c.w[piece(p, 0, 0, 0, 0)->worker].name, "n0-w00");
    assert_string_equal(c.w[piece(p, 2, 0, 0, 0)->worker].name, "n0-w02");
    tsr_plan_destroy(&p);
}

static void test_kept_pieces_of_a_later_deployment_are_not_taken_by_an_earlier(void **state)
{
    cluster_t c;
    tsr_plan_t *p1, *p2;

    (void)state;
    cluster_init(&c);
    add_node(&c, "n0", 2, TSR_DEVICE_CPU);
    add_dep(&c, "late", TSR_DEVICE_CPU, 1, 1, 2, 2);
    p1 = plan(&c);
    apply(&c, p1);
    /* an earlier deployment appears in the file: it waits, late keeps serving */
    c.deps[1] = c.deps[0];
    c.layers[1] = c.layers[0];
    c.deps[0] = (tsr_deployment_t){ .name = "early", .device = TSR_DEVICE_CPU,
                                    .tensor = 1, .pipeline = 1, .replicas = 1 };
    c.layers[0] = 2;
    c.cfg.n_deployments = 2;
    p2 = plan(&c);
    check_invariants(&c, p2);
    assert_int_equal(p2->deps[0].placed, 0);
    assert_int_equal(p2->deps[0].short_by, 1);
    assert_int_equal(p2->deps[1].placed, 2);
    assert_true(piece(p2, 1, 0, 0, 0)->kept);
    assert_true(piece(p2, 1, 1, 0, 0)->kept);
    tsr_plan_destroy(&p1);
    tsr_plan_destroy(&p2);
}

static void test_drained_worker_gets_nothing(void **state)
{
    cluster_t c;
    tsr_plan_t *p;
    int drained;

    (void)state;
    cluster_init(&c);
    drained = add_worker(&c, "n0", TSR_DEVICE_CPU);
    add_node(&c, "n0", 2, TSR_DEVICE_CPU);
    c.w[drained].eligible = false;
    add_dep(&c, "m", TSR_DEVICE_CPU, 1, 1, 3, 2);
    p = plan(&c);
    check_invariants(&c, p);
    assert_null(tsr_plan_piece_of(p, drained));
    assert_int_equal(p->deps[0].placed, 0);
    assert_int_equal(p->deps[0].short_by, 1);
    tsr_plan_destroy(&p);
}

static void test_invalid_input_is_rejected_with_a_message(void **state)
{
    cluster_t c;
    tsr_plan_t *p = NULL;
    char err[256] = "";

    (void)state;
    cluster_init(&c);
    add_node(&c, "n0", 4, TSR_DEVICE_CPU);
    add_dep(&c, "tiny", TSR_DEVICE_CPU, 1, 4, 1, 2);
    assert_int_equal(tsr_plan_compute(&c.cfg, c.layers, c.w, c.n, &p, err, sizeof err), -1);
    assert_null(p);
    assert_non_null(strstr(err, "tiny"));
    assert_non_null(strstr(err, "pipeline 4"));
    assert_non_null(strstr(err, "2 layers"));

    c.layers[0] = 0;
    err[0] = '\0';
    assert_int_equal(tsr_plan_compute(&c.cfg, c.layers, c.w, c.n, &p, err, sizeof err), -1);
    assert_non_null(strstr(err, "layer count 0"));

    c.layers[0] = 8;
    c.deps[0].tensor = 0;
    err[0] = '\0';
    assert_int_equal(tsr_plan_compute(&c.cfg, c.layers, c.w, c.n, &p, err, sizeof err), -1);
    assert_non_null(strstr(err, "tensor 0"));

    c.deps[0].tensor = 1;
    add_dep(&c, "tiny", TSR_DEVICE_CPU, 1, 1, 1, 2);
    err[0] = '\0';
    assert_int_equal(tsr_plan_compute(&c.cfg, c.layers, c.w, c.n, &p, err, sizeof err), -1);
    assert_non_null(strstr(err, "already used"));

    assert_int_equal(tsr_plan_compute(NULL, NULL, NULL, 0, &p, err, sizeof err), -1);
    assert_null(p);
}

static void test_empty_inputs_give_an_empty_plan(void **state)
{
    cluster_t c;
    tsr_plan_t *p;

    (void)state;
    cluster_init(&c);
    p = plan(&c);
    assert_int_equal(p->n_pieces, 0);
    assert_int_equal(p->n_deps, 0);
    assert_null(tsr_plan_piece_of(p, 0));
    assert_null(tsr_plan_piece_of(NULL, 0));
    tsr_plan_destroy(&p);
    tsr_plan_destroy(&p);
    tsr_plan_destroy(NULL);
}

static void test_result_does_not_depend_on_worker_array_order(void **state)
{
    cluster_t c, r;
    tsr_plan_t *p1, *p2;

    (void)state;
    cluster_init(&c);
    add_node(&c, "n2", 3, TSR_DEVICE_CUDA);
    add_node(&c, "n0", 2, TSR_DEVICE_CUDA);
    add_node(&c, "n1", 3, TSR_DEVICE_CUDA);
    add_dep(&c, "m", TSR_DEVICE_CUDA, 2, 2, 2, 8);
    p1 = plan(&c);
    r = c;
    for (size_t i = 0; i < c.n; i++) {
        size_t j = c.n - 1 - i;
        r.w[i] = c.w[j];
    }
    r.cfg.deployments = r.deps;
    p2 = plan(&r);
    check_invariants(&r, p2);
    for (size_t i = 0; i < p1->n_pieces; i++)
        assert_string_equal(c.w[p1->pieces[i].worker].name, r.w[p2->pieces[i].worker].name);
    tsr_plan_destroy(&p1);
    tsr_plan_destroy(&p2);
}

/* ---- property loop ---------------------------------------------------------- */

static uint32_t rng_next(uint32_t *s)
{
    /* xorshift32: deterministic across libcs, unlike rand() */
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

static int rng_range(uint32_t *s, int lo, int hi)
{
    return lo + (int)(rng_next(s) % (uint32_t)(hi - lo + 1));
}

static void random_cluster(cluster_t *c, uint32_t *s)
{
    static const char *const dep_names[MAX_DEPS] = { "d0", "d1", "d2", "d3" };
    int n_nodes = rng_range(s, 1, 5);

    cluster_init(c);
    for (int n = 0; n < n_nodes; n++) {
        char node[8];
        int k = rng_range(s, 0, 8);

        snprintf(node, sizeof node, "node%d", rng_range(s, 0, 9));
        for (int i = 0; i < k && c->n < MAX_WORKERS; i++) {
            int w = add_worker(c, node, rng_range(s, 0, 3) ? TSR_DEVICE_CUDA : TSR_DEVICE_CPU);
            c->w[w].eligible = rng_range(s, 0, 9) != 0;
        }
    }
    for (int d = rng_range(s, 1, MAX_DEPS); d > 0; d--) {
        int pp = rng_range(s, 1, 3);
        add_dep(c, dep_names[c->cfg.n_deployments],
                rng_range(s, 0, 2) ? TSR_DEVICE_CUDA : TSR_DEVICE_CPU,
                rng_range(s, 1, 4), pp, rng_range(s, 1, 3), rng_range(s, pp, 12));
    }
}

/* A fresh deployment is all or nothing; a partly placed one took every
 * worker of its kind that was left, so none remain free at the end. */
static void check_fresh_plan(const cluster_t *c, const tsr_plan_t *p)
{
    for (size_t d = 0; d < p->n_deps; d++) {
        const tsr_plan_deployment_t *pd = &p->deps[d];

        assert_true(pd->placed == 0 || pd->placed == pd->n_pieces);
        if (pd->placed == 0)
            assert_true(pd->short_by > 0);
    }
    for (size_t i = 0; i < p->n_pieces; i++)
        assert_false(p->pieces[i].kept);
    (void)c;
}

static void check_partial_means_exhausted(const cluster_t *c, const tsr_plan_t *p)
{
    for (size_t d = 0; d < p->n_deps; d++)
        if (p->deps[d].placed > 0 && p->deps[d].short_by > 0)
            assert_int_equal(free_workers(c, p, p->deps[d].device), 0);
}

/* Replanning what is already running moves nothing. */
static void check_stable(cluster_t *c, const tsr_plan_t *p1)
{
    tsr_plan_t *p2;

    apply(c, p1);
    p2 = plan(c);
    check_invariants(c, p2);
    for (size_t i = 0; i < p1->n_pieces; i++) {
        assert_int_equal(p2->pieces[i].worker, p1->pieces[i].worker);
        assert_true(p2->pieces[i].worker < 0 || p2->pieces[i].kept);
    }
    tsr_plan_destroy(&p2);
}

/* Losing one busy worker moves at most its own piece, to a worker that was free. */
static void check_one_loss(cluster_t *c, const tsr_plan_t *p1, uint32_t *s)
{
    tsr_plan_t *p2;
    int busy[MAX_WORKERS], n_busy = 0, lost, lost_piece, had_free;

    for (size_t w = 0; w < c->n; w++)
        if (tsr_plan_piece_of(p1, (int)w))
            busy[n_busy++] = (int)w;
    if (n_busy == 0)
        return;
    lost = busy[rng_range(s, 0, n_busy - 1)];
    lost_piece = (int)(tsr_plan_piece_of(p1, lost) - p1->pieces);
    had_free = free_workers(c, p1, c->w[lost].device);
    c->w[lost].eligible = false;
    p2 = plan(c);
    check_invariants(c, p2);
    check_partial_means_exhausted(c, p2);
    for (size_t i = 0; i < p1->n_pieces; i++) {
        if ((int)i == lost_piece)
            continue;
        assert_int_equal(p2->pieces[i].worker, p1->pieces[i].worker);
        assert_true(p2->pieces[i].worker < 0 || p2->pieces[i].kept);
    }
    if (had_free > 0) {
        int w = p2->pieces[lost_piece].worker;
        assert_true(w >= 0);
        assert_null(tsr_plan_piece_of(p1, w));
        assert_false(p2->pieces[lost_piece].kept);
    } else {
        assert_int_equal(p2->pieces[lost_piece].worker, -1);
    }
    tsr_plan_destroy(&p2);
}

static void test_random_clusters_keep_every_rule(void **state)
{
    uint32_t seed = 0x7e55e7a;

    (void)state;
    for (int iter = 0; iter < 2000; iter++) {
        cluster_t c;
        tsr_plan_t *p;

        random_cluster(&c, &seed);
        p = plan(&c);
        check_invariants(&c, p);
        check_fresh_plan(&c, p);
        check_partial_means_exhausted(&c, p);
        check_stable(&c, p);
        check_one_loss(&c, p, &seed);
        tsr_plan_destroy(&p);
    }
}


/* ---- memory ---------------------------------------------------------------- */

#define GIB ((uint64_t)1 << 30)

static tsr_plan_t *plan_mem(cluster_t *c, const uint64_t *const *need)
{
    tsr_plan_t *p = NULL;
    char err[256] = "";

    assert_int_equal(tsr_plan_compute_mem(&c->cfg, c->layers, need, c->w, c->n, &p, err,
                                          sizeof err), 0);
    assert_non_null(p);
    return p;
}

/* The larger stage goes to the workers with room for it, the smaller one
 * to the rest. */
static void test_stages_go_to_workers_with_room(void **state)
{
    (void)state;
    cluster_t c;
    cluster_init(&c);
    for (int i = 0; i < 4; i++) c.w[add_worker(&c, "n0", TSR_DEVICE_CUDA)].memory = (i % 2 ? 24 : 16) * GIB;
    add_dep(&c, "big", TSR_DEVICE_CUDA, 2, 2, 1, 8);
    uint64_t st[2] = {20 * GIB, 14 * GIB};
    const uint64_t *need[1] = {st};
    tsr_plan_t *p = plan_mem(&c, need);
    assert_int_equal(p->deps[0].placed, 4);
    for (int t = 0; t < 2; t++) {
        assert_int_equal(c.w[piece(p, 0, 0, 0, t)->worker].memory, 24 * GIB);
        assert_int_equal(c.w[piece(p, 0, 0, 1, t)->worker].memory, 16 * GIB);
    }
    tsr_plan_destroy(&p);
    /* without the needs, the same workers in name order */
    p = plan(&c);
    assert_int_equal(c.w[piece(p, 0, 0, 0, 0)->worker].memory, 16 * GIB);
    tsr_plan_destroy(&p);
}

/* No worker has room for stage 0: nothing is placed, and the text gives
 * the numbers and the roomiest worker's name. */
static void test_layout_that_fits_no_gpu_is_refused_with_the_numbers(void **state)
{
    (void)state;
    cluster_t c;
    char buf[256];
    cluster_init(&c);
    for (int i = 0; i < 4; i++) c.w[add_worker(&c, "n0", TSR_DEVICE_CUDA)].memory = 16 * GIB;
    c.w[2].memory = 16 * GIB + GIB / 2;
    add_dep(&c, "big", TSR_DEVICE_CUDA, 2, 2, 1, 8);
    uint64_t st[2] = {(uint64_t)(21.3 * GIB), 14 * GIB};
    const uint64_t *need[1] = {st};
    tsr_plan_t *p = plan_mem(&c, need);
    assert_int_equal(p->deps[0].placed, 0);
    assert_int_equal(p->deps[0].short_by, 2);
    assert_int_equal(p->deps[0].mem_stage, 0);
    tsr_plan_shortage_of(p, 0, c.w, buf, sizeof buf);
    assert_string_equal(buf, "needs 2 more cuda workers: stage 0 needs 21.3 GiB per cuda worker; "
                             "the largest, n0-w02, has 16.5 GiB");
    /* every worker stays free for what comes next */
    for (size_t w = 0; w < c.n; w++) assert_null(tsr_plan_piece_of(p, (int)w));
    tsr_plan_destroy(&p);
}

/* One worker has room for stage 0's two ranks: one more is needed, with
 * that much memory; unknown memory (0) fits anything. */
static void test_short_of_roomy_workers_says_how_many_and_how_much(void **state)
{
    (void)state;
    cluster_t c;
    char buf[256];
    cluster_init(&c);
    c.w[add_worker(&c, "n0", TSR_DEVICE_CUDA)].memory = 24 * GIB;
    for (int i = 0; i < 3; i++) c.w[add_worker(&c, "n0", TSR_DEVICE_CUDA)].memory = 16 * GIB;
    add_dep(&c, "big", TSR_DEVICE_CUDA, 2, 2, 1, 8);
    uint64_t st[2] = {20 * GIB, 14 * GIB};
    const uint64_t *need[1] = {st};
    tsr_plan_t *p = plan_mem(&c, need);
    assert_int_equal(p->deps[0].placed, 0);
    assert_int_equal(p->deps[0].short_by, 1);
    tsr_plan_shortage_of(p, 0, c.w, buf, sizeof buf);
    assert_string_equal(buf, "needs 1 more cuda worker with at least 20.0 GiB (stage 0's need)");
    tsr_plan_destroy(&p);
    c.w[1].memory = 0;   /* unknown: taken as roomy enough */
    p = plan_mem(&c, need);
    assert_int_equal(p->deps[0].placed, 4);
    assert_int_equal(p->deps[0].short_by, 0);
    tsr_plan_destroy(&p);
}

/* A placed deployment that loses a roomy worker: the spare without room
 * is not used, and the shortage says why. */
static void test_spare_without_room_does_not_replace_a_roomy_worker(void **state)
{
    (void)state;
    cluster_t c;
    char buf[256];
    cluster_init(&c);
    for (int i = 0; i < 2; i++) c.w[add_worker(&c, "n0", TSR_DEVICE_CUDA)].memory = 24 * GIB;
    int spare = add_worker(&c, "n0", TSR_DEVICE_CUDA);
    c.w[spare].memory = 8 * GIB;
    add_dep(&c, "big", TSR_DEVICE_CUDA, 1, 2, 1, 8);
    uint64_t st[2] = {20 * GIB, 20 * GIB};
    const uint64_t *need[1] = {st};
    tsr_plan_t *p = plan_mem(&c, need);
    assert_int_equal(p->deps[0].placed, 2);
    assert_null(tsr_plan_piece_of(p, spare));
    apply(&c, p);
    tsr_plan_destroy(&p);
    c.w[0].eligible = false;   /* dies */
    p = plan_mem(&c, need);
    assert_int_equal(p->deps[0].placed, 1);
    assert_null(tsr_plan_piece_of(p, spare));
    tsr_plan_shortage_of(p, 0, c.w, buf, sizeof buf);
    assert_non_null(strstr(buf, "needs 1 more cuda worker"));
    assert_non_null(strstr(buf, "20.0 GiB"));
    tsr_plan_destroy(&p);
}

/* The larger need is served first: a small first stage does not take the
 * only GPU the larger last stage fits on. */
static void test_the_largest_stage_is_served_first(void **state)
{
    (void)state;
    cluster_t c;
    cluster_init(&c);
    int a = add_worker(&c, "n0", TSR_DEVICE_CUDA), b = add_worker(&c, "n0", TSR_DEVICE_CUDA);
    c.w[a].memory = 30 * GIB;
    c.w[b].memory = 15 * GIB;
    add_dep(&c, "big", TSR_DEVICE_CUDA, 1, 2, 1, 8);
    uint64_t st[2] = {10 * GIB, 20 * GIB};
    const uint64_t *need[1] = {st};
    tsr_plan_t *p = plan_mem(&c, need);
    assert_int_equal(p->deps[0].placed, 2);
    assert_int_equal(piece(p, 0, 0, 1, 0)->worker, a);
    assert_int_equal(piece(p, 0, 0, 0, 0)->worker, b);
    tsr_plan_destroy(&p);
}

/* A piece kept on a GPU that no longer has room for it (a reload raised
 * the need) moves to one that has. */
static void test_a_held_piece_that_no_longer_fits_moves(void **state)
{
    (void)state;
    cluster_t c;
    cluster_init(&c);
    int small = add_worker(&c, "n0", TSR_DEVICE_CUDA), big = add_worker(&c, "n0", TSR_DEVICE_CUDA);
    c.w[small].memory = 16 * GIB;
    c.w[big].memory = 80 * GIB;
    add_dep(&c, "m", TSR_DEVICE_CUDA, 1, 1, 1, 8);
    uint64_t st[1] = {10 * GIB};
    const uint64_t *need[1] = {st};
    tsr_plan_t *p = plan_mem(&c, need);
    assert_int_equal(piece(p, 0, 0, 0, 0)->worker, small);   /* the least memory with room */
    apply(&c, p);
    tsr_plan_destroy(&p);
    st[0] = 50 * GIB;
    p = plan_mem(&c, need);
    assert_int_equal(piece(p, 0, 0, 0, 0)->worker, big);
    assert_false(piece(p, 0, 0, 0, 0)->kept);
    assert_null(tsr_plan_piece_of(p, small));
    tsr_plan_destroy(&p);
}

/* A node whose GPUs form two NVLink domains, listed alternately by name: each
 * TP group takes both its ranks from one domain (by name alone it would
 * straddle them); a missing rank joins its mate's domain; a node without
 * domains is placed as before. */
static void test_a_tp_group_stays_inside_one_nvlink_domain(void **state)
{
    (void)state;
    cluster_t c;
    cluster_init(&c);
    add_node(&c, "n0", 4, TSR_DEVICE_CUDA);
    static const char *dom[4] = {"n0/X", "n0/Y", "n0/X", "n0/Y"};
    for (int i = 0; i < 4; i++) c.w[i].domain = dom[i];
    add_dep(&c, "m", TSR_DEVICE_CUDA, 2, 1, 2, 4);
    tsr_plan_t *p = plan(&c);
    for (int r = 0; r < 2; r++) {
        int a = p->pieces[r * 2].worker, b = p->pieces[r * 2 + 1].worker;
        assert_true(a >= 0 && b >= 0);
        assert_string_equal(c.w[a].domain, c.w[b].domain);
    }
    assert_int_equal(p->deps[0].short_by, 0);

    /* rank 1 of replica 0 lost: its replacement comes from its mate's domain */
    int mate = p->pieces[0].worker, gone = p->pieces[1].worker;
    for (size_t w = 0; w < c.n; w++) {
        const tsr_piece_t *pc = tsr_plan_piece_of(p, (int)w);
        memset(&c.w[w].current, 0, sizeof c.w[w].current);
        if (!pc) continue;
        c.w[w].current = (tsr_piece_key_t){"m", pc->replica, pc->stage, pc->tp, 2, 1, 0, 4};
    }
    tsr_plan_destroy(&p);
    add_worker(&c, "n0", TSR_DEVICE_CUDA);   /* n0-w04: domain Y */
    add_worker(&c, "n0", TSR_DEVICE_CUDA);   /* n0-w05: the mate's domain */
    c.w[4].domain = "n0/Y";
    c.w[5].domain = c.w[mate].domain;
    c.w[gone].eligible = false;
    p = plan(&c);
    assert_int_equal(p->pieces[0].worker, mate);
    assert_int_equal(p->pieces[1].worker, 5);
    tsr_plan_destroy(&p);

    /* without domains: by name, as before */
    for (size_t i = 0; i < c.n; i++) {
        c.w[i].domain = NULL;
        c.w[i].eligible = true;
        memset(&c.w[i].current, 0, sizeof c.w[i].current);
    }
    p = plan(&c);
    assert_int_equal(p->pieces[0].worker, 0);
    assert_int_equal(p->pieces[1].worker, 1);
    tsr_plan_destroy(&p);
}

/* Workers that share a GPU cannot share an NCCL communicator: a TP group's ranks take
 * distinct GPUs when the node has them (by name alone both ranks would land on one), even
 * outside the domain, and share one only when nothing else is free; workers whose GPU is
 * not known are placed as before. */
static void test_a_tp_group_takes_distinct_gpus_when_it_can(void **state)
{
    (void)state;
    cluster_t c;
    cluster_init(&c);
    add_node(&c, "n0", 4, TSR_DEVICE_CUDA);
    static const char *gpu[4] = {"0000:01:00.0", "0000:01:00.0", "0000:02:00.0", "0000:02:00.0"};
    for (int i = 0; i < 4; i++) c.w[i].gpu = gpu[i];
    add_dep(&c, "m", TSR_DEVICE_CUDA, 2, 1, 2, 4);
    tsr_plan_t *p = plan(&c);
    for (int r = 0; r < 2; r++) {
        int a = p->pieces[r * 2].worker, b = p->pieces[r * 2 + 1].worker;
        assert_true(a >= 0 && b >= 0);
        assert_string_not_equal(c.w[a].gpu, c.w[b].gpu);
    }
    assert_int_equal(p->deps[0].short_by, 0);
    tsr_plan_destroy(&p);

    /* a distinct GPU outside the domain beats a shared one inside it */
    static const char *dom[4] = {"n0/X", "n0/X", "n0/X", "n0/Y"};
    for (int i = 0; i < 4; i++) c.w[i].domain = dom[i];
    c.deps[0].replicas = 1;
    static const char *gpu2[4] = {"0000:01:00.0", "0000:01:00.0", "0000:01:00.0", "0000:02:00.0"};
    for (int i = 0; i < 4; i++) c.w[i].gpu = gpu2[i];
    p = plan(&c);
    int a = p->pieces[0].worker, b = p->pieces[1].worker;
    assert_string_not_equal(c.w[a].gpu, c.w[b].gpu);
    tsr_plan_destroy(&p);

    /* one GPU for all: the group still forms, sharing it */
    for (int i = 0; i < 4; i++) c.w[i].gpu = "0000:01:00.0", c.w[i].domain = NULL;
    c.deps[0].replicas = 2;
    p = plan(&c);
    assert_int_equal(p->deps[0].short_by, 0);
    assert_int_equal(p->pieces[0].worker, 0);
    assert_int_equal(p->pieces[1].worker, 1);
    tsr_plan_destroy(&p);

    /* GPUs not known: by name, as before */
    for (int i = 0; i < 4; i++) c.w[i].gpu = NULL;
    p = plan(&c);
    assert_int_equal(p->pieces[0].worker, 0);
    assert_int_equal(p->pieces[1].worker, 1);
    tsr_plan_destroy(&p);
}

/* The node and the domain are chosen for their GPUs too: a tighter node (or domain) whose
 * free workers share one GPU loses to one with a GPU for every rank. */
static void test_a_node_and_a_domain_with_distinct_gpus_win(void **state)
{
    (void)state;
    cluster_t c;
    cluster_init(&c);
    add_node(&c, "n0", 2, TSR_DEVICE_CUDA);   /* tighter, but one GPU */
    add_node(&c, "n1", 3, TSR_DEVICE_CUDA);
    static const char *gpu[5] = {"0000:01:00.0", "0000:01:00.0", "0000:01:00.0",
                                 "0000:02:00.0", "0000:03:00.0"};
    for (int i = 0; i < 5; i++) c.w[i].gpu = gpu[i];
    add_dep(&c, "m", TSR_DEVICE_CUDA, 2, 1, 1, 4);
    tsr_plan_t *p = plan(&c);
    int a = p->pieces[0].worker, b = p->pieces[1].worker;
    assert_string_equal(c.nodes[a], "n1");
    assert_string_equal(c.nodes[b], "n1");
    assert_string_not_equal(c.w[a].gpu, c.w[b].gpu);
    tsr_plan_destroy(&p);

    /* one node: domain X's two workers share a GPU, Y has two GPUs: Y, not X plus Y */
    cluster_init(&c);
    add_node(&c, "n0", 4, TSR_DEVICE_CUDA);
    static const char *gpu2[4] = {"0000:01:00.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"};
    static const char *dom[4] = {"n0/X", "n0/X", "n0/Y", "n0/Y"};
    for (int i = 0; i < 4; i++) c.w[i].gpu = gpu2[i], c.w[i].domain = dom[i];
    add_dep(&c, "m", TSR_DEVICE_CUDA, 2, 1, 1, 4);
    p = plan(&c);
    a = p->pieces[0].worker, b = p->pieces[1].worker;
    assert_string_equal(c.w[a].domain, "n0/Y");
    assert_string_equal(c.w[b].domain, "n0/Y");
    tsr_plan_destroy(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_piece_placed_once_and_no_worker_twice),
        cmocka_unit_test(test_tp_groups_share_a_node_and_stages_use_different_nodes),
        cmocka_unit_test(test_tp_group_takes_the_tightest_node_that_fits),
        cmocka_unit_test(test_second_stage_avoids_the_node_of_the_first_when_another_fits),
        cmocka_unit_test(test_tp_group_too_wide_for_any_node_fills_roomiest_nodes_first),
        cmocka_unit_test(test_layer_splits_are_even_contiguous_and_cover_all_layers),
        cmocka_unit_test(test_lost_worker_moves_only_its_piece_to_the_spare),
        cmocka_unit_test(test_replacement_rank_joins_its_group_on_the_same_node),
        cmocka_unit_test(test_lost_worker_without_spare_keeps_the_rest_and_is_short_by_one),
        cmocka_unit_test(test_new_deployment_short_of_workers_places_nothing_and_says_how_many),
        cmocka_unit_test(test_shortage_text_is_empty_when_nothing_is_short),
        cmocka_unit_test(test_cpu_workers_never_get_cuda_pieces),
        cmocka_unit_test(test_holding_on_wrong_device_kind_is_not_kept),
        cmocka_unit_test(test_layout_change_frees_old_holders_and_replaces_the_piece),
        cmocka_unit_test(test_holders_of_a_removed_deployment_are_freed),
        cmocka_unit_test(test_piece_claimed_by_two_workers_is_kept_by_one),
        cmocka_unit_test(test_deployments_are_served_in_file_order),
        cmocka_unit_test(test_kept_pieces_of_a_later_deployment_are_not_taken_by_an_earlier),
        cmocka_unit_test(test_drained_worker_gets_nothing),
        cmocka_unit_test(test_invalid_input_is_rejected_with_a_message),
        cmocka_unit_test(test_empty_inputs_give_an_empty_plan),
        cmocka_unit_test(test_result_does_not_depend_on_worker_array_order),
        cmocka_unit_test(test_random_clusters_keep_every_rule),
        cmocka_unit_test(test_stages_go_to_workers_with_room),
        cmocka_unit_test(test_layout_that_fits_no_gpu_is_refused_with_the_numbers),
        cmocka_unit_test(test_short_of_roomy_workers_says_how_many_and_how_much),
        cmocka_unit_test(test_spare_without_room_does_not_replace_a_roomy_worker),
        cmocka_unit_test(test_the_largest_stage_is_served_first),
        cmocka_unit_test(test_a_held_piece_that_no_longer_fits_moves),
        cmocka_unit_test(test_a_tp_group_stays_inside_one_nvlink_domain),
        cmocka_unit_test(test_a_tp_group_takes_distinct_gpus_when_it_can),
        cmocka_unit_test(test_a_node_and_a_domain_with_distinct_gpus_win),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
