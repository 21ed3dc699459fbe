/* test_health.c: deciding that a worker is dead (coordinator/health.c) over
 * the registry (coordinator/registry.c), driven by a fake clock: every time
 * is a plain int64 the test passes in. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/health.h"
#include "coordinator/registry.h"

#define TIMEOUT 1000

/* ---- helpers ------------------------------------------------------------- */

static tsr_worker_t *add(tsr_registry_t *reg, const char *name, int64_t last_seen,
                         const char *deployment, int stage)
{
    tsr_worker_t *w = tsr_registry_upsert(reg, name);
    assert_non_null(w);
    w->state = TSR_W_READY;
    w->last_seen_ms = last_seen;
    if (deployment) {
        tsr_piece_key_t k = {.stage = stage, .tp_size = 1, .pp_size = 2};
        snprintf(k.deployment, sizeof k.deployment, "%s", deployment);
        assert_int_equal(tsr_registry_set_piece(reg, w, &k, 1, 0), 0);
    }
    return w;
}

/* What the callback saw, one row per call. */
#define MAX_CALLS 16
typedef struct {
    int n;
    char name[MAX_CALLS][TSR_NAME_MAX + 1];
    bool had_piece[MAX_CALLS];
    char deployment[MAX_CALLS][TSR_NAME_MAX + 1];
    int stage[MAX_CALLS];
    tsr_wstate_t state[MAX_CALLS];
} calls_t;

static void record_dead(tsr_worker_t *w, void *arg)
{
    calls_t *c = arg;
    assert_true(c->n < MAX_CALLS);
    snprintf(c->name[c->n], sizeof c->name[c->n], "%s", w->name);
    c->had_piece[c->n] = w->has_piece;
    snprintf(c->deployment[c->n], sizeof c->deployment[c->n], "%s", w->piece.key.deployment);
    c->stage[c->n] = w->piece.key.stage;
    c->state[c->n] = w->state;
    c->n++;
}

static int calls_for(const calls_t *c, const char *name)
{
    int k = 0;
    for (int i = 0; i < c->n; i++) k += strcmp(c->name[i], name) == 0;
    return k;
}

static void count_dead(tsr_worker_t *w, void *arg)
{
    (void)w;
    (*(int *)arg)++;
}

/* ---- overdue ------------------------------------------------------------- */

static void test_worker_is_not_overdue_at_timeout_but_is_one_ms_after(void **state)
{
    (void)state;
    assert_false(tsr_health_overdue(0, 0, TIMEOUT));
    assert_false(tsr_health_overdue(0, 999, TIMEOUT));
    assert_false(tsr_health_overdue(0, 1000, TIMEOUT));
    assert_true(tsr_health_overdue(0, 1001, TIMEOUT));
    /* Relative to last_seen, not to zero, and on large monotonic clocks. */
    int64_t big = (int64_t)1 << 40;
    assert_false(tsr_health_overdue(big, big + 1000, TIMEOUT));
    assert_true(tsr_health_overdue(big, big + 1001, TIMEOUT));
}

static void test_scan_honours_the_timeout_boundary(void **state)
{
    (void)state;
    tsr_registry_t *reg = tsr_registry_new();
    calls_t c = { 0 };
    tsr_worker_t *w = add(reg, "w", 0, "d", 0);

    assert_int_equal(tsr_health_scan(reg, 1000, TIMEOUT, record_dead, &c), 0);
    assert_int_equal(w->state, TSR_W_READY);
    assert_int_equal(c.n, 0);
    assert_int_equal(tsr_health_scan(reg, 1001, TIMEOUT, record_dead, &c), 1);
    assert_int_equal(w->state, TSR_W_DEAD);
    assert_int_equal(c.n, 1);
    tsr_registry_destroy(&reg);
    assert_null(reg);
}

/* ---- scan ---------------------------------------------------------------- */

static void test_scan_marks_exactly_the_overdue_workers_dead(void **state)
{
    (void)state;
    tsr_registry_t *reg = tsr_registry_new();
    calls_t c = { 0 };
    /* At now = 1600: a is 1600 ms silent, b 1001, c 1000 (not yet), d 100. */
    tsr_worker_t *a = add(reg, "a", 0, "dep-a", 0);
    tsr_worker_t *b = add(reg, "b", 599, "dep-b", 1);
    tsr_worker_t *cw = add(reg, "c", 600, "dep-c", 0);
    tsr_worker_t *d = add(reg, "d", 1500, NULL, 0);
    d->state = TSR_W_IDLE;

    assert_int_equal(tsr_health_scan(reg, 1600, TIMEOUT, record_dead, &c), 2);
    assert_int_equal(c.n, 2);
    assert_int_equal(calls_for(&c, "a"), 1);
    assert_int_equal(calls_for(&c, "b"), 1);

    /* The callback ran before the piece was dropped and saw it whole. */
    for (int i = 0; i < c.n; i++) {
        assert_true(c.had_piece[i]);
        assert_int_not_equal(c.state[i], TSR_W_DEAD);
        if (strcmp(c.name[i], "a") == 0) {
            assert_string_equal(c.deployment[i], "dep-a");
            assert_int_equal(c.stage[i], 0);
        } else {
            assert_string_equal(c.deployment[i], "dep-b");
            assert_int_equal(c.stage[i], 1);
        }
    }

    /* Afterwards the dead hold nothing and say why. */
    tsr_worker_t *dead[] = { a, b };
    for (int i = 0; i < 2; i++) {
        assert_int_equal(dead[i]->state, TSR_W_DEAD);
        assert_false(dead[i]->has_piece);
        assert_int_equal(dead[i]->dead_since_ms, 1600);
        assert_non_null(strstr(dead[i]->reason, "no heartbeat"));
    }
    assert_non_null(strstr(a->reason, "1600 ms"));
    assert_non_null(strstr(b->reason, "1001 ms"));

    /* The others are untouched. */
    assert_int_equal(cw->state, TSR_W_READY);
    assert_true(cw->has_piece);
    assert_string_equal(cw->piece.key.deployment, "dep-c");
    assert_int_equal(d->state, TSR_W_IDLE);
    assert_int_equal(cw->reason[0], '\0');
    assert_int_equal(tsr_registry_alive(reg), 2);
    assert_int_equal(tsr_registry_size(reg), 4);
    tsr_registry_destroy(&reg);
}

static void test_scan_without_callback_still_marks_dead(void **state)
{
    (void)state;
    tsr_registry_t *reg = tsr_registry_new();
    tsr_worker_t *w = add(reg, "w", 0, "d", 0);

    assert_int_equal(tsr_health_scan(reg, 5000, TIMEOUT, NULL, NULL), 1);
    assert_int_equal(w->state, TSR_W_DEAD);
    assert_false(w->has_piece);
    tsr_registry_destroy(&reg);
}

static void test_already_dead_workers_are_not_reported_again(void **state)
{
    (void)state;
    tsr_registry_t *reg = tsr_registry_new();
    calls_t c = { 0 };
    tsr_worker_t *a = add(reg, "a", 0, "d", 0);
    tsr_worker_t *b = add(reg, "b", 2000, "d", 1);
    tsr_worker_t *m = add(reg, "m", 0, "d", 0);
    assert_true(tsr_health_mark_dead(reg, m, 10, "fatal: device lost"));

    assert_int_equal(tsr_health_scan(reg, 1500, TIMEOUT, record_dead, &c), 1);
    assert_int_equal(calls_for(&c, "a"), 1);
    int64_t a_since = a->dead_since_ms;

    /* Much later: b is overdue now; a and m stay as they were. */
    assert_int_equal(tsr_health_scan(reg, 9000, TIMEOUT, record_dead, &c), 1);
    assert_int_equal(tsr_health_scan(reg, 20000, TIMEOUT, record_dead, &c), 0);
    assert_int_equal(c.n, 2);
    assert_int_equal(calls_for(&c, "a"), 1);
    assert_int_equal(calls_for(&c, "b"), 1);
    assert_int_equal(calls_for(&c, "m"), 0);
    assert_int_equal(b->state, TSR_W_DEAD);
    assert_int_equal(a->dead_since_ms, a_since);
    assert_int_equal(m->dead_since_ms, 10);
    assert_string_equal(m->reason, "fatal: device lost");
    assert_int_equal(tsr_registry_alive(reg), 0);
    tsr_registry_destroy(&reg);
}

static void test_heartbeating_worker_stays_alive_across_many_scans(void **state)
{
    (void)state;
    tsr_registry_t *reg = tsr_registry_new();
    int deaths = 0;
    tsr_worker_t *live = add(reg, "live", 0, "d", 0);
    tsr_worker_t *quiet = add(reg, "quiet", 0, "d", 1);
    int step = tsr_health_scan_interval_ms(100);

    for (int64_t t = 0; t <= 60000; t += step) {
        if (t % 100 == 0) live->last_seen_ms = t;
        tsr_health_scan(reg, t, TIMEOUT, count_dead, &deaths);
        assert_int_equal(live->state, TSR_W_READY);
        assert_true(live->has_piece);
    }
    /* The silent one died, once; the heartbeating one never did. */
    assert_int_equal(deaths, 1);
    assert_int_equal(quiet->state, TSR_W_DEAD);
    assert_int_equal(live->state, TSR_W_READY);
    tsr_registry_destroy(&reg);
}

/* ---- detection bound ----------------------------------------------------- */

/* Heartbeats every 100 ms up to and including T, then silence; scans every
 * tsr_health_scan_interval_ms(100).  Death must come after the timeout and no
 * later than one heartbeat interval past it, whatever the phase of the
 * heartbeats against the scan ticks. */
static void test_death_is_declared_within_one_heartbeat_after_timeout(void **state)
{
    (void)state;
    const int hb = 100;
    const int scan = tsr_health_scan_interval_ms(hb);
    assert_true(scan > 0 && scan <= hb);

    for (int phase = 0; phase < hb; phase += 3) {
        tsr_registry_t *reg = tsr_registry_new();
        int deaths = 0;
        tsr_worker_t *w = add(reg, "w", phase, "d", 0);
        const int64_t T = 5000 + phase;      /* last heartbeat */
        int64_t next_hb = phase, declared = -1;

        for (int64_t now = 0; now <= T + 5000 && declared < 0; now += scan) {
            /* Deliver heartbeats due by now (they arrive between ticks). */
            while (next_hb <= now && next_hb <= T) {
                w->last_seen_ms = next_hb;
                next_hb += hb;
            }
            if (tsr_health_scan(reg, now, TIMEOUT, count_dead, &deaths) > 0)
                declared = now;
        }
        assert_int_equal(w->last_seen_ms, T);
        if (declared < 0) fail_msg("phase %d: never declared dead", phase);
        if (declared <= T + TIMEOUT)
            fail_msg("phase %d: declared at %lld, not after T + timeout %lld", phase,
                     (long long)declared, (long long)(T + TIMEOUT));
        if (declared > T + TIMEOUT + hb)
            fail_msg("phase %d: declared at %lld, later than T + timeout + heartbeat %lld",
                     phase, (long long)declared, (long long)(T + TIMEOUT + hb));
        assert_int_equal(deaths, 1);
        tsr_registry_destroy(&reg);
    }
}

static void test_scan_interval_is_a_quarter_heartbeat_but_at_least_5ms(void **state)
{
    (void)state;
    assert_int_equal(tsr_health_scan_interval_ms(100), 25);
    assert_int_equal(tsr_health_scan_interval_ms(1000), 250);
    assert_int_equal(tsr_health_scan_interval_ms(20), 5);
    assert_int_equal(tsr_health_scan_interval_ms(8), 5);
    assert_int_equal(tsr_health_scan_interval_ms(1), 5);
}

/* ---- mark_dead ----------------------------------------------------------- */

static void test_mark_dead_copies_reason_and_is_idempotent(void **state)
{
    (void)state;
    tsr_registry_t *reg = tsr_registry_new();
    tsr_worker_t *w = add(reg, "w", 100, "d", 1);
    char reason[64];

    snprintf(reason, sizeof reason, "fatal: Xid 79");
    assert_true(tsr_health_mark_dead(reg, w, 4242, reason));
    memset(reason, 'Z', sizeof reason - 1);     /* the worker must keep its copy */
    reason[sizeof reason - 1] = '\0';
    assert_string_equal(w->reason, "fatal: Xid 79");
    assert_int_equal(w->state, TSR_W_DEAD);
    assert_int_equal(w->dead_since_ms, 4242);
    assert_false(w->has_piece);
    assert_int_equal(tsr_registry_alive(reg), 0);

    /* A second death changes nothing. */
    assert_false(tsr_health_mark_dead(reg, w, 9999, "something else"));
    assert_string_equal(w->reason, "fatal: Xid 79");
    assert_int_equal(w->dead_since_ms, 4242);
    tsr_registry_destroy(&reg);
}

/* A dead worker's figures were its process's: status must not go on
 * showing the KV cache, queue or load it last reported as if current. */
static void test_mark_dead_clears_the_live_figures(void **state)
{
    (void)state;
    tsr_registry_t *reg = tsr_registry_new();
    tsr_worker_t *w = add(reg, "w", 100, "d", 1);
    w->kv_blocks_used = 12;
    w->kv_blocks_total = 64;
    w->queued = 3;
    w->running = 2;
    w->load = 0.75f;
    w->weight_bytes = 1000;
    w->kv_bytes = 2000;
    assert_true(tsr_health_mark_dead(reg, w, 5, "gone"));
    assert_int_equal(w->kv_blocks_used, 0);
    assert_int_equal(w->kv_blocks_total, 0);
    assert_int_equal(w->queued, 0);
    assert_int_equal(w->running, 0);
    assert_true(w->load == 0.0f);
    assert_int_equal(w->weight_bytes, 0);
    assert_int_equal(w->kv_bytes, 0);
    tsr_registry_destroy(&reg);
}

static void test_mark_dead_truncates_an_overlong_reason_safely(void **state)
{
    (void)state;
    tsr_registry_t *reg = tsr_registry_new();
    tsr_worker_t *w = add(reg, "w", 0, NULL, 0);
    size_t n = sizeof w->reason * 2;
    char *long_reason = malloc(n + 1);

    assert_non_null(long_reason);
    memset(long_reason, 'r', n);
    long_reason[n] = '\0';
    assert_true(tsr_health_mark_dead(reg, w, 1, long_reason));
    assert_int_equal(strlen(w->reason), sizeof w->reason - 1);
    assert_memory_equal(w->reason, long_reason, sizeof w->reason - 1);
    free(long_reason);
    tsr_registry_destroy(&reg);
}

/* ---- registry ------------------------------------------------------------ */

static void test_registry_upsert_creates_once_and_find_returns_it(void **state)
{
    (void)state;
    tsr_registry_t *reg = tsr_registry_new();
    assert_non_null(reg);
    assert_int_equal(tsr_registry_size(reg), 0);
    assert_int_equal(tsr_registry_alive(reg), 0);
    assert_null(tsr_registry_find(reg, "x"));
    assert_null(tsr_registry_at(reg, 0));

    tsr_worker_t *x = tsr_registry_upsert(reg, "x");
    assert_non_null(x);
    assert_string_equal(x->name, "x");
    assert_int_equal(x->state, TSR_W_IDLE);
    assert_false(x->has_piece);
    assert_false(x->drained);
    assert_int_equal(x->last_seen_ms, 0);
    assert_int_equal(x->rid_len, 0);
    x->heartbeats = 7;

    assert_ptr_equal(tsr_registry_upsert(reg, "x"), x);   /* same entry, not reset */
    assert_int_equal(x->heartbeats, 7);
    assert_ptr_equal(tsr_registry_find(reg, "x"), x);
    assert_int_equal(tsr_registry_size(reg), 1);

    tsr_worker_t *y = tsr_registry_upsert(reg, "y");
    assert_ptr_not_equal(x, y);
    assert_int_equal(tsr_registry_size(reg), 2);
    assert_ptr_equal(tsr_registry_at(reg, 0), x);
    assert_ptr_equal(tsr_registry_at(reg, 1), y);
    assert_null(tsr_registry_at(reg, 2));
    assert_null(tsr_registry_find(reg, "z"));
    assert_null(tsr_registry_find(reg, "X"));

    /* The key is a copy: changing the caller's buffer changes nothing. */
    char name[16] = "zed";
    tsr_worker_t *z = tsr_registry_upsert(reg, name);
    strcpy(name, "zoo");
    assert_ptr_equal(tsr_registry_find(reg, "zed"), z);
    assert_null(tsr_registry_find(reg, "zoo"));
    tsr_registry_destroy(&reg);
    assert_null(reg);
}

static void test_registry_alive_counts_workers_not_dead(void **state)
{
    (void)state;
    tsr_registry_t *reg = tsr_registry_new();
    tsr_worker_t *w[4];
    static const char *names[4] = { "a", "b", "c", "d" };
    for (int i = 0; i < 4; i++) w[i] = tsr_registry_upsert(reg, names[i]);
    w[1]->state = TSR_W_FAILED;     /* failed is not dead */
    w[2]->state = TSR_W_LOADING;
    assert_int_equal(tsr_registry_alive(reg), 4);
    tsr_health_mark_dead(reg, w[3], 1, "gone");
    assert_int_equal(tsr_registry_alive(reg), 3);
    tsr_health_mark_dead(reg, w[1], 1, "gone");
    assert_int_equal(tsr_registry_alive(reg), 2);
    /* Dead workers stay listed. */
    assert_int_equal(tsr_registry_size(reg), 4);
    assert_ptr_equal(tsr_registry_find(reg, "d"), w[3]);
    tsr_registry_destroy(&reg);
}

static void test_registry_holds_and_finds_ten_thousand_workers(void **state)
{
    (void)state;
    enum { N = 10000 };
    tsr_registry_t *reg = tsr_registry_new();
    tsr_worker_t **seen = calloc(N, sizeof *seen);
    char name[32];

    assert_non_null(seen);
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "node-%03d-gpu-%d", i / 8, i % 8);
        seen[i] = tsr_registry_upsert(reg, name);
        assert_non_null(seen[i]);
        seen[i]->pid = (uint32_t)i;
    }
    assert_int_equal(tsr_registry_size(reg), N);
    assert_int_equal(tsr_registry_alive(reg), N);
    /* Entries never move while the table grows. */
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "node-%03d-gpu-%d", i / 8, i % 8);
        tsr_worker_t *w = tsr_registry_find(reg, name);
        assert_ptr_equal(w, seen[i]);
        assert_string_equal(w->name, name);
        assert_int_equal(w->pid, (uint32_t)i);
        assert_ptr_equal(tsr_registry_at(reg, (size_t)i), w);
    }
    assert_null(tsr_registry_find(reg, "node-1250-gpu-0"));
    /* Upserting them all again adds nothing. */
    for (int i = 0; i < N; i += 97) {
        snprintf(name, sizeof name, "node-%03d-gpu-%d", i / 8, i % 8);
        assert_ptr_equal(tsr_registry_upsert(reg, name), seen[i]);
    }
    assert_int_equal(tsr_registry_size(reg), N);

    /* One scan over all of them: only the silent half dies. */
    for (int i = 0; i < N; i++) seen[i]->last_seen_ms = (i % 2) ? 5000 : 0;
    int deaths = 0;
    assert_int_equal(tsr_health_scan(reg, 5000, TIMEOUT, count_dead, &deaths), N / 2);
    assert_int_equal(deaths, N / 2);
    assert_int_equal(tsr_registry_alive(reg), N / 2);
    free(seen);
    tsr_registry_destroy(&reg);
}

static void test_registry_destroy_is_safe_on_null(void **state)
{
    (void)state;
    tsr_registry_t *reg = NULL;
    tsr_registry_destroy(&reg);
    tsr_registry_destroy(NULL);
    assert_null(reg);
}

/* ---- the piece index ------------------------------------------------------ */

static tsr_piece_key_t key_of(const char *dep, int replica, int stage, int tp, int tp_size,
                              int pp_size)
{
    tsr_piece_key_t k = {.replica = replica, .stage = stage, .tp = tp, .tp_size = tp_size,
                         .pp_size = pp_size, .layer_begin = stage * 4, .layer_end = stage * 4 + 4};
    snprintf(k.deployment, sizeof k.deployment, "%s", dep);
    return k;
}

/* Every worker holding a piece is found under its (deployment, replica) and
 * slot, and only there; giving a worker another piece moves it. */
static void test_index_finds_each_piece_by_replica_and_slot(void **state)
{
    (void)state;
    tsr_registry_t *reg = tsr_registry_new();
    char name[16];
    tsr_worker_t *w[8];
    /* d: 2 replicas of tp 2 x pp 2, registered in a scrambled order */
    static const int order[8] = {5, 2, 7, 0, 3, 6, 1, 4};
    for (int i = 0; i < 8; i++) {
        snprintf(name, sizeof name, "w%d", i);
        w[i] = tsr_registry_upsert(reg, name);
    }
    for (int i = 0; i < 8; i++) {
        int p = order[i];
        tsr_piece_key_t k = key_of("d", p / 4, p % 4 / 2, p % 2, 2, 2);
        assert_int_equal(tsr_registry_set_piece(reg, w[i], &k, 7, 0), 0);
        assert_true(w[i]->has_piece);
        assert_int_equal(w[i]->piece.epoch, 7);
    }
    for (int i = 0; i < 8; i++) {
        int p = order[i];
        assert_ptr_equal(tsr_registry_at_slot(reg, "d", p / 4, 2, 2, p % 4), w[i]);
        assert_null(tsr_registry_at_slot(reg, "d", p / 4, 1, 2, p % 4));  /* another layout */
        tsr_piece_key_t k = key_of("d", p / 4, p % 4 / 2, p % 2, 2, 2);
        assert_ptr_equal(tsr_registry_holder(reg, &k, NULL), w[i]);
        assert_null(tsr_registry_holder(reg, &k, w[i]));
    }
    size_t n;
    assert_non_null(tsr_registry_replica(reg, "d", 0, &n));
    assert_int_equal(n, 4);
    assert_null(tsr_registry_replica(reg, "d", 2, &n));
    assert_int_equal(n, 0);
    assert_null(tsr_registry_replica(reg, "e", 0, &n));

    /* w0 moves from replica 1 slot 1 to replica 0 of deployment e */
    tsr_piece_key_t e0 = key_of("e", 0, 0, 0, 1, 1);
    assert_int_equal(tsr_registry_set_piece(reg, w[0], &e0, 8, 42), 0);
    assert_null(tsr_registry_at_slot(reg, "d", 1, 2, 2, 1));
    tsr_registry_replica(reg, "d", 1, &n);
    assert_int_equal(n, 3);
    tsr_worker_t *const *m = tsr_registry_replica(reg, "e", 0, &n);
    assert_int_equal(n, 1);
    assert_ptr_equal(m[0], w[0]);
    assert_int_equal(w[0]->piece.kv_budget, 42);

    /* clearing empties a replica's entry; clearing twice is harmless */
    tsr_registry_clear_piece(reg, w[0]);
    tsr_registry_clear_piece(reg, w[0]);
    assert_false(w[0]->has_piece);
    assert_null(tsr_registry_replica(reg, "e", 0, &n));
    tsr_registry_destroy(&reg);
}

/* A worker that dies or is forgotten leaves the index. */
static void test_index_drops_dead_and_forgotten_workers(void **state)
{
    (void)state;
    tsr_registry_t *reg = tsr_registry_new();
    tsr_worker_t *a = add(reg, "a", 0, "d", 0);
    tsr_worker_t *b = add(reg, "b", 0, "d", 1);
    size_t n;
    tsr_registry_replica(reg, "d", 0, &n);
    assert_int_equal(n, 2);
    assert_true(tsr_health_mark_dead(reg, a, 5, "gone"));
    assert_ptr_equal(tsr_registry_replica(reg, "d", 0, &n)[0], b);
    assert_int_equal(n, 1);
    /* b keeps its piece until it is forgotten; forgetting a live one's is not possible,
     * so kill it and forget both */
    assert_true(tsr_health_mark_dead(reg, b, 6, "gone"));
    assert_int_equal(tsr_registry_forget_dead(reg, 10), 2);
    assert_null(tsr_registry_replica(reg, "d", 0, &n));
    /* a new worker of the same name starts with no piece */
    tsr_worker_t *a2 = tsr_registry_upsert(reg, "a");
    assert_false(a2->has_piece);
    tsr_registry_destroy(&reg);
}

static void test_worker_state_names_are_stable(void **state)
{
    (void)state;
    assert_string_equal(tsr_wstate_name(TSR_W_IDLE), "idle");
    assert_string_equal(tsr_wstate_name(TSR_W_LOADING), "loading");
    assert_string_equal(tsr_wstate_name(TSR_W_READY), "ready");
    assert_string_equal(tsr_wstate_name(TSR_W_FAILED), "failed");
    assert_string_equal(tsr_wstate_name(TSR_W_DEAD), "dead");
    assert_string_equal(tsr_wstate_name((tsr_wstate_t)99), "unknown");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_worker_is_not_overdue_at_timeout_but_is_one_ms_after),
        cmocka_unit_test(test_scan_honours_the_timeout_boundary),
        cmocka_unit_test(test_scan_marks_exactly_the_overdue_workers_dead),
        cmocka_unit_test(test_scan_without_callback_still_marks_dead),
        cmocka_unit_test(test_already_dead_workers_are_not_reported_again),
        cmocka_unit_test(test_heartbeating_worker_stays_alive_across_many_scans),
        cmocka_unit_test(test_death_is_declared_within_one_heartbeat_after_timeout),
        cmocka_unit_test(test_scan_interval_is_a_quarter_heartbeat_but_at_least_5ms),
        cmocka_unit_test(test_mark_dead_copies_reason_and_is_idempotent),
        cmocka_unit_test(test_mark_dead_clears_the_live_figures),
        cmocka_unit_test(test_mark_dead_truncates_an_overlong_reason_safely),
        cmocka_unit_test(test_registry_upsert_creates_once_and_find_returns_it),
        cmocka_unit_test(test_registry_alive_counts_workers_not_dead),
        cmocka_unit_test(test_registry_holds_and_finds_ten_thousand_workers),
        cmocka_unit_test(test_registry_destroy_is_safe_on_null),
        cmocka_unit_test(test_worker_state_names_are_stable),
        cmocka_unit_test(test_index_finds_each_piece_by_replica_and_slot),
        cmocka_unit_test(test_index_drops_dead_and_forgotten_workers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
