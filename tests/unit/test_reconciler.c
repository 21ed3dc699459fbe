/* test_reconciler.c: the actions that turn what workers hold into the plan
 * (coordinator/reconciler.c), on plans computed by the real planner for a
 * tp=2 pp=2 deployment over five workers, one of them a spare. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/planner.h"
#include "coordinator/reconciler.h"

#define N_WORKERS 5
#define LAYERS 8

typedef struct {
    tsr_deployment_t dep;
    int layers[1];
    tsr_config_t cfg;
    tsr_plan_worker_t w[N_WORKERS];
    tsr_plan_t *plan;
    tsr_action_t acts[N_WORKERS];
    size_t n_acts;
} fixture_t;

static const char *names[N_WORKERS] = { "w0", "w1", "w2", "w3", "w4" };
/* Two nodes of two and a lone spare: room for each TP group on one node. */
static const char *nodes[N_WORKERS] = { "n1", "n1", "n2", "n2", "n3" };

static int setup(void **state)
{
    fixture_t *f = calloc(1, sizeof *f);
    if (!f) return -1;
    f->dep = (tsr_deployment_t){ .name = "llama", .model = "models/llama",
                                 .model_path = "/srv/models/llama", .device = TSR_DEVICE_CPU,
                                 .tensor = 2, .pipeline = 2, .replicas = 1,
                                 .max_seq_len = 2048, .line = 3, .column = 5 };
    f->layers[0] = LAYERS;
    f->cfg = (tsr_config_t){ .path = "test.yaml", .workers_endpoint = "tcp://0.0.0.0:7400",
                             .control_endpoint = "tcp://127.0.0.1:7401",
                             .heartbeat_interval_ms = 100, .worker_timeout_ms = 1000,
                             .deployments = &f->dep, .n_deployments = 1 };
    for (int i = 0; i < N_WORKERS; i++)
        f->w[i] = (tsr_plan_worker_t){ .name = names[i], .node = nodes[i],
                                       .device = TSR_DEVICE_CPU, .eligible = true };
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture_t *f = *state;
    tsr_plan_destroy(&f->plan);
    free(f);
    return 0;
}

/* Plans from the fixture's current holdings and reconciles. */
static void plan_and_reconcile(fixture_t *f)
{
    char err[256] = "";
    tsr_plan_destroy(&f->plan);
    if (tsr_plan_compute(&f->cfg, f->layers, f->w, N_WORKERS, &f->plan, err, sizeof err) != 0)
        fail_msg("plan failed: %s", err);
    memset(f->acts, 0xa5, sizeof f->acts);    /* stale garbage must not be read back */
    f->n_acts = tsr_reconcile_actions(f->plan, f->w, N_WORKERS, f->acts);
    assert_true(f->n_acts <= N_WORKERS);
}

static size_t count_kind(const fixture_t *f, tsr_action_kind_t k)
{
    size_t n = 0;
    for (size_t i = 0; i < f->n_acts; i++) n += f->acts[i].kind == k;
    return n;
}

/* Each worker is the subject of at most one action. */
static void assert_one_action_per_worker(const fixture_t *f)
{
    int seen[N_WORKERS] = { 0 };
    for (size_t i = 0; i < f->n_acts; i++) {
        assert_in_range(f->acts[i].worker, 0, N_WORKERS - 1);
        assert_int_equal(seen[f->acts[i].worker]++, 0);
    }
}

/* Makes every worker hold exactly what the plan gives it (what the workers
 * report once they have carried out the actions). */
static void apply_plan_as_holdings(fixture_t *f)
{
    for (int w = 0; w < N_WORKERS; w++) {
        const tsr_piece_t *p = tsr_plan_piece_of(f->plan, w);
        tsr_piece_key_t h = { 0 };
        if (p) {
            const tsr_deployment_t *d = &f->cfg.deployments[p->deployment];
            h = (tsr_piece_key_t){ .replica = p->replica, .stage = p->stage, .tp = p->tp,
                                   .tp_size = d->tensor, .pp_size = d->pipeline,
                                   .layer_begin = p->layer_begin, .layer_end = p->layer_end };
            snprintf(h.deployment, sizeof h.deployment, "%s", d->name);
        }
        f->w[w].current = h;
    }
}

static int spare_of(const fixture_t *f)
{
    int spare = -1;
    for (int w = 0; w < N_WORKERS; w++) {
        if (!tsr_plan_piece_of(f->plan, w)) {
            assert_int_equal(spare, -1);   /* exactly one */
            spare = w;
        }
    }
    assert_true(spare >= 0);
    return spare;
}

/* ---- tests --------------------------------------------------------------- */

static void test_first_plan_from_idle_assigns_all_four_pieces(void **state)
{
    fixture_t *f = *state;
    plan_and_reconcile(f);

    assert_int_equal(f->n_acts, 4);
    assert_int_equal(count_kind(f, TSR_ACT_ASSIGN), 4);
    assert_int_equal(count_kind(f, TSR_ACT_UNASSIGN), 0);
    assert_one_action_per_worker(f);

    /* The four ASSIGNs cover the four (stage, tp) pieces, each once, with the
     * right layers, and each points at the plan's piece for that worker. */
    int covered[2][2] = { { 0 } };
    for (size_t i = 0; i < f->n_acts; i++) {
        const tsr_action_t *a = &f->acts[i];
        assert_non_null(a->piece);
        assert_ptr_equal(a->piece, tsr_plan_piece_of(f->plan, a->worker));
        assert_int_equal(a->piece->worker, a->worker);
        assert_false(a->piece->kept);
        assert_int_equal(a->piece->deployment, 0);
        assert_int_equal(a->piece->replica, 0);
        covered[a->piece->stage][a->piece->tp]++;
        assert_int_equal(a->piece->layer_begin, a->piece->stage * LAYERS / 2);
        assert_int_equal(a->piece->layer_end, (a->piece->stage + 1) * LAYERS / 2);
    }
    for (int s = 0; s < 2; s++)
        for (int t = 0; t < 2; t++) assert_int_equal(covered[s][t], 1);

    /* The spare is left out: no action names it. */
    int spare = spare_of(f);
    for (size_t i = 0; i < f->n_acts; i++) assert_int_not_equal(f->acts[i].worker, spare);
}

static void test_plan_already_held_needs_no_actions(void **state)
{
    fixture_t *f = *state;
    plan_and_reconcile(f);
    apply_plan_as_holdings(f);
    tsr_plan_t *first = f->plan;
    f->plan = NULL;

    plan_and_reconcile(f);
    assert_int_equal(f->n_acts, 0);
    /* Nothing moved: same worker for every piece, each kept. */
    for (size_t i = 0; i < f->plan->n_pieces; i++) {
        assert_int_equal(f->plan->pieces[i].worker, first->pieces[i].worker);
        assert_true(f->plan->pieces[i].kept);
    }
    tsr_plan_destroy(&first);
}

static void test_drained_holder_is_replaced_by_the_spare(void **state)
{
    fixture_t *f = *state;
    plan_and_reconcile(f);
    apply_plan_as_holdings(f);
    int spare = spare_of(f);
    int drained = spare == 0 ? 1 : 0;     /* any holder will do */
    const tsr_piece_t *held = tsr_plan_piece_of(f->plan, drained);
    assert_non_null(held);
    int stage = held->stage, tp = held->tp;
    f->w[drained].eligible = false;

    plan_and_reconcile(f);
    assert_int_equal(f->n_acts, 2);
    assert_int_equal(count_kind(f, TSR_ACT_ASSIGN), 1);
    assert_int_equal(count_kind(f, TSR_ACT_UNASSIGN), 1);
    assert_one_action_per_worker(f);
    for (size_t i = 0; i < f->n_acts; i++) {
        const tsr_action_t *a = &f->acts[i];
        if (a->kind == TSR_ACT_ASSIGN) {
            /* The spare takes exactly the drained worker's piece. */
            assert_int_equal(a->worker, spare);
            assert_non_null(a->piece);
            assert_int_equal(a->piece->stage, stage);
            assert_int_equal(a->piece->tp, tp);
            assert_int_equal(a->piece->worker, spare);
            assert_false(a->piece->kept);
        } else {
            assert_int_equal(a->worker, drained);
            assert_null(a->piece);
        }
    }
    assert_null(tsr_plan_piece_of(f->plan, drained));
}

static void test_removed_deployment_unassigns_every_holder(void **state)
{
    fixture_t *f = *state;
    plan_and_reconcile(f);
    apply_plan_as_holdings(f);
    int spare = spare_of(f);
    f->cfg.n_deployments = 0;

    plan_and_reconcile(f);
    assert_int_equal(f->plan->n_pieces, 0);
    assert_int_equal(f->n_acts, 4);
    assert_int_equal(count_kind(f, TSR_ACT_UNASSIGN), 4);
    assert_one_action_per_worker(f);
    for (size_t i = 0; i < f->n_acts; i++) {
        assert_int_not_equal(f->acts[i].worker, spare);   /* holds nothing */
        assert_null(f->acts[i].piece);
    }
}

/* A worker holding a piece whose layout changed (here: the model grew, so the
 * layer ranges moved) is sent the new piece, not unassigned and left idle. */
static void test_changed_layout_reassigns_instead_of_unassigning(void **state)
{
    fixture_t *f = *state;
    plan_and_reconcile(f);
    apply_plan_as_holdings(f);
    f->layers[0] = LAYERS + 4;

    plan_and_reconcile(f);
    assert_int_equal(count_kind(f, TSR_ACT_UNASSIGN), 0);
    assert_int_equal(count_kind(f, TSR_ACT_ASSIGN), 4);
    for (size_t i = 0; i < f->n_acts; i++) {
        const tsr_piece_t *p = f->acts[i].piece;
        assert_non_null(p);
        assert_int_equal(p->layer_end - p->layer_begin, (LAYERS + 4) / 2);
        assert_true(f->w[f->acts[i].worker].current.deployment[0]);
    }
}

/* An idle ineligible worker is not told anything. */
static void test_idle_ineligible_worker_gets_no_action(void **state)
{
    fixture_t *f = *state;
    plan_and_reconcile(f);
    apply_plan_as_holdings(f);
    int spare = spare_of(f);
    f->w[spare].eligible = false;

    plan_and_reconcile(f);
    assert_int_equal(f->n_acts, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_first_plan_from_idle_assigns_all_four_pieces,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_plan_already_held_needs_no_actions,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_drained_holder_is_replaced_by_the_spare,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_removed_deployment_unassigns_every_holder,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_changed_layout_reassigns_instead_of_unassigning,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_idle_ineligible_worker_gets_no_action,
                                        setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
