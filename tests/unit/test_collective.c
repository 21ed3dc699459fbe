/* test_collective.c: the TCP collectives (worker/collective_tcp.c) on
 * loopback.  Each rank is a thread of this process with its own listener on
 * 127.0.0.1 port 0; the dead-peer tests fork a real process as one rank, and
 * the garbage tests speak the wire format by hand through a raw socket.
 * Cmocka asserts only run on the main thread: rank threads record what
 * happened and the test checks it after joining them. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdbool.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "worker/collective.h"

#define MAXR 4
#define FORM_MS 3000
#define OP_MS 5000
#define SLACK_MS 500

static const tsr_coll_ops_t *ops = &tsr_coll_tcp;

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

/* Deterministic data per (seed, rank, index): floats in [-1, 1) whose sums
 * depend on the order of addition, so bit-identity means something. */
static float rnd(uint32_t seed, int rank, size_t i)
{
    uint64_t x = (uint64_t)seed * 0x9E3779B97F4A7C15ull ^ (uint64_t)rank << 40 ^ i;
    x ^= x >> 33, x *= 0xff51afd7ed558ccdull, x ^= x >> 33, x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (float)(x >> 40) / (float)(1u << 23) - 1.0f;
}

/* Whole numbers: every order of addition gives the same exact sum. */
static float whole(int rank, size_t i)
{
    return (float)((i * 7 + (size_t)rank * 13) % 1000) - 500.0f;
}

/* ---- a group of rank threads ------------------------------------------------- */

typedef struct rank_ctx rank_ctx_t;
typedef int (*body_fn)(rank_ctx_t *k);

struct rank_ctx {
    int rank, n;
    uint64_t epoch, group;
    tsr_tcp_listener_t *l;
    const char **eps;
    body_fn body;
    void *arg;                  /* the test's shared state */
    tsr_comm_t *comm;
    int rc;                     /* 0: comm_new and body succeeded */
    char err[512];
    int64_t op_ms;              /* what the body chose to time */
    float *buf;                 /* the body's result, freed by group_close */
};

typedef struct {
    int n;
    tsr_tcp_listener_t *l[MAXR];
    const char *eps[MAXR];
    rank_ctx_t k[MAXR];
    pthread_t th[MAXR];
} group_t;

static void group_open(group_t *g, int n)
{
    char err[256];
    memset(g, 0, sizeof *g);
    g->n = n;
    for (int i = 0; i < n; i++) {
        g->l[i] = tsr_tcp_listen("127.0.0.1", 0, err, sizeof err);
        if (!g->l[i]) fail_msg("%s", err);
        g->eps[i] = tsr_tcp_listener_endpoint(g->l[i]);
    }
}

static void *rank_main(void *arg)
{
    rank_ctx_t *k = arg;
    k->comm = tsr_tcp_comm_new(k->l, k->epoch, k->group, k->rank, k->n, k->eps, FORM_MS, k->err,
                               sizeof k->err);
    k->rc = !k->comm ? -1 : k->body ? k->body(k) : 0;
    return NULL;
}

static void group_start(group_t *g, int rank, body_fn body, void *arg)
{
    rank_ctx_t *k = &g->k[rank];
    *k = (rank_ctx_t){.rank = rank, .n = g->n, .epoch = 1, .group = 1, .l = g->l[rank],
                      .eps = g->eps, .body = body, .arg = arg, .rc = -1};
    assert_int_equal(pthread_create(&g->th[rank], NULL, rank_main, k), 0);
}

/* Runs body on every rank and waits for all of them. */
static void group_run(group_t *g, body_fn body, void *arg)
{
    for (int r = 0; r < g->n; r++) group_start(g, r, body, arg);
    for (int r = 0; r < g->n; r++) pthread_join(g->th[r], NULL);
}

static void expect_ok(const group_t *g, int r)
{
    if (g->k[r].rc != 0) fail_msg("rank %d of %d: %s", r, g->n, g->k[r].err);
}

static void group_expect_ok(const group_t *g)
{
    for (int r = 0; r < g->n; r++) expect_ok(g, r);
}

static void group_close(group_t *g)
{
    for (int r = 0; r < g->n; r++) {
        ops->destroy(&g->k[r].comm);
        assert_null(g->k[r].comm);
        free(g->k[r].buf);
        tsr_tcp_listener_destroy(&g->l[r]);
        assert_null(g->l[r]);
    }
}

/* ---- allreduce ------------------------------------------------------------------ */

typedef struct {
    size_t count;
    uint32_t seed;
    bool whole;
} fill_t;

/* Fills the rank's buffer, sums it, leaves the result in k->buf. */
static int allreduce_body(rank_ctx_t *k)
{
    const fill_t *f = k->arg;
    if (!(k->buf = malloc(f->count * sizeof(float)))) return -1;
    for (size_t i = 0; i < f->count; i++)
        k->buf[i] = f->whole ? whole(k->rank, i) : rnd(f->seed, k->rank, i);
    return ops->allreduce_sum(k->comm, k->buf, f->count, OP_MS, k->err, sizeof k->err);
}

static void check_allreduce(int n, size_t count, uint32_t seed, bool exact_order)
{
    group_t g;
    fill_t f = {count, seed, false};
    group_open(&g, n);
    group_run(&g, allreduce_body, &f);
    group_expect_ok(&g);
    for (size_t i = 0; i < count; i++) {
        float ref = rnd(seed, 0, i);
        for (int r = 1; r < n; r++) ref += rnd(seed, r, i);
        /* The small path adds in rank order, so it matches this exactly;
         * the ring adds in ring order, so only closely. */
        if (exact_order && memcmp(&ref, &g.k[0].buf[i], sizeof ref))
            fail_msg("n %d [%zu]: %.9g, expected %.9g", n, i, g.k[0].buf[i], ref);
        if (!exact_order && fabsf(ref - g.k[0].buf[i]) > 1e-5f)
            fail_msg("n %d [%zu]: %.9g, expected about %.9g", n, i, g.k[0].buf[i], ref);
    }
    for (int r = 1; r < n; r++)
        if (memcmp(g.k[0].buf, g.k[r].buf, count * sizeof(float)))
            fail_msg("n %d: rank %d's result differs from rank 0's", n, r);
    group_close(&g);
}

static void test_allreduce_small_adds_in_rank_order_on_every_rank(void **state)
{
    (void)state;
    for (int n = 1; n <= MAXR; n++) check_allreduce(n, 1000, 11, true);
    check_allreduce(3, 1, 12, true);
    check_allreduce(2, 16383, 13, true);   /* the largest buffer under 64 KiB */
}

static void test_allreduce_large_ring_is_exact_and_bit_identical(void **state)
{
    (void)state;
    /* 1000003 is divisible by none of 2, 3, 4: uneven ring segments. */
    const size_t count = 1000003;
    for (int n = 2; n <= MAXR; n++) {
        group_t g;
        fill_t f = {count, 0, true};
        group_open(&g, n);
        group_run(&g, allreduce_body, &f);
        group_expect_ok(&g);
        for (int r = 0; r < n; r++)
            for (size_t i = 0; i < count; i++) {
                float want = 0;
                for (int q = 0; q < n; q++) want += whole(q, i);
                if (g.k[r].buf[i] != want)
                    fail_msg("n %d rank %d [%zu]: %g, expected %g", n, r, i, g.k[r].buf[i],
                             want);
            }
        group_close(&g);
        check_allreduce(n, count, 21 + (uint32_t)n, false);
    }
}

#define TPUT_ITERS 20

/* Starts from 1.0 everywhere: each of 2 ranks doubles it, so after the
 * loop every element is exactly 2^(iterations). */
static int throughput_body(rank_ctx_t *k)
{
    size_t count = (size_t)1 << 20;
    if (!(k->buf = malloc(count * sizeof(float)))) return -1;
    for (size_t i = 0; i < count; i++) k->buf[i] = 1.0f;
    if (ops->allreduce_sum(k->comm, k->buf, count, OP_MS, k->err, sizeof k->err)) return -1;
    int64_t t0 = now_ms();
    for (int it = 0; it < TPUT_ITERS; it++)
        if (ops->allreduce_sum(k->comm, k->buf, count, OP_MS, k->err, sizeof k->err)) return -1;
    k->op_ms = now_ms() - t0;
    return 0;
}

static void test_allreduce_throughput_1M_floats_2_ranks(void **state)
{
    (void)state;
    group_t g;
    group_open(&g, 2);
    group_run(&g, throughput_body, NULL);
    group_expect_ok(&g);
    float want = ldexpf(1.0f, TPUT_ITERS + 1);
    for (int r = 0; r < 2; r++)
        for (size_t i = 0; i < (size_t)1 << 20; i++)
            if (g.k[r].buf[i] != want) fail_msg("rank %d [%zu]: %g, expected %g", r, i,
                                                g.k[r].buf[i], want);
    double ms = (double)g.k[0].op_ms / TPUT_ITERS;
    print_message("allreduce of 1M floats (4 MiB) x 2 ranks on loopback: %.2f ms each, "
                  "%.2f GB/s of buffer\n", ms, 4.0 * 1048576 / (ms / 1000) / 1e9);
    group_close(&g);
}

/* ---- broadcast, send, recv, barrier ---------------------------------------------- */

#define BCAST_LEN ((size_t)1 << 20)

static int broadcast_body(rank_ctx_t *k)
{
    uint8_t *b = calloc(BCAST_LEN, 1);
    uint8_t small[100] = {0};
    int rc = -1;
    if (!b) return -1;
    if (k->rank == 2) {
        for (size_t i = 0; i < BCAST_LEN; i++) b[i] = (uint8_t)(i * 31 + 7);
        memset(small, 0x5a, sizeof small);
    }
    if (ops->broadcast(k->comm, b, BCAST_LEN, 2, OP_MS, k->err, sizeof k->err) ||
        ops->broadcast(k->comm, small, sizeof small, 2, OP_MS, k->err, sizeof k->err))
        goto out;
    for (size_t i = 0; i < BCAST_LEN; i++)
        if (b[i] != (uint8_t)(i * 31 + 7)) {
            snprintf(k->err, sizeof k->err, "byte %zu is %u", i, b[i]);
            goto out;
        }
    for (size_t i = 0; i < sizeof small; i++)
        if (small[i] != 0x5a) {
            snprintf(k->err, sizeof k->err, "small byte %zu is %u", i, small[i]);
            goto out;
        }
    rc = 0;
out:
    free(b);
    return rc;
}

static void test_broadcast_from_a_nonzero_root_reaches_every_rank(void **state)
{
    (void)state;
    group_t g;
    group_open(&g, 3);
    group_run(&g, broadcast_body, NULL);
    group_expect_ok(&g);
    group_close(&g);
}

#define P2P_LEN ((size_t)8 << 20)

static uint8_t pattern(int from, size_t i)
{
    return (uint8_t)(i * 13 + (size_t)from * 101 + (i >> 12));
}

static int check_pattern(rank_ctx_t *k, const uint8_t *b, size_t len, int from)
{
    for (size_t i = 0; i < len; i++)
        if (b[i] != pattern(from, i)) {
            snprintf(k->err, sizeof k->err, "byte %zu from rank %d is %u", i, from, b[i]);
            return -1;
        }
    return 0;
}

/* Both ranks send 8 MiB first and receive second: far more than the socket
 * buffers hold, so this finishes only if send keeps reading meanwhile.
 * Then messages of 10, 0 and 1000 bytes keep their boundaries. */
static int exchange_body(rank_ctx_t *k)
{
    int other = 1 - k->rank, rc = -1;
    uint8_t *out = malloc(P2P_LEN), *in = malloc(P2P_LEN);
    if (!out || !in) goto out;
    for (size_t i = 0; i < P2P_LEN; i++) out[i] = pattern(k->rank, i);
    for (int round = 0; round < 2; round++) {
        if (ops->send(k->comm, other, out, P2P_LEN, OP_MS, k->err, sizeof k->err) ||
            ops->recv(k->comm, other, in, P2P_LEN, OP_MS, k->err, sizeof k->err) ||
            check_pattern(k, in, P2P_LEN, other))
            goto out;
    }
    static const size_t sizes[] = {10, 0, 1000};
    for (int i = 0; i < 3; i++)
        if (ops->send(k->comm, other, out, sizes[i], OP_MS, k->err, sizeof k->err)) goto out;
    for (int i = 0; i < 3; i++)
        if (ops->recv(k->comm, other, in, sizes[i], OP_MS, k->err, sizeof k->err) ||
            check_pattern(k, in, sizes[i], other))
            goto out;
    rc = 0;
out:
    free(out);
    free(in);
    return rc;
}

static void test_send_recv_8MiB_both_ways_at_once_does_not_deadlock(void **state)
{
    (void)state;
    group_t g;
    group_open(&g, 2);
    int64_t t0 = now_ms();
    group_run(&g, exchange_body, NULL);
    group_expect_ok(&g);
    assert_true(now_ms() - t0 < OP_MS);
    group_close(&g);
}

static int mismatch_body(rank_ctx_t *k)
{
    uint8_t b[200] = {0};
    if (k->rank == 0) return ops->send(k->comm, 1, b, 100, OP_MS, k->err, sizeof k->err);
    if (ops->recv(k->comm, 0, b, 200, OP_MS, k->err, sizeof k->err) == 0) return -1;
    return strstr(k->err, "100-byte") && strstr(k->err, "200 bytes") ? 0 : -1;
}

static void test_recv_of_a_different_length_than_sent_fails(void **state)
{
    (void)state;
    group_t g;
    group_open(&g, 2);
    group_run(&g, mismatch_body, NULL);
    group_expect_ok(&g);
    /* And the communicator is unusable afterwards. */
    char err[256];
    assert_int_equal(ops->barrier(g.k[1].comm, 100, err, sizeof err), -1);
    assert_non_null(strstr(err, "earlier failure"));
    group_close(&g);
}

#define LATE_MS 300

static int barrier_body(rank_ctx_t *k)
{
    if (k->rank == 2) sleep_ms(LATE_MS);
    int64_t t0 = now_ms();
    if (ops->barrier(k->comm, OP_MS, k->err, sizeof k->err)) return -1;
    k->op_ms = now_ms() - t0;
    return ops->barrier(k->comm, OP_MS, k->err, sizeof k->err);
}

static void test_barrier_waits_for_the_last_rank(void **state)
{
    (void)state;
    group_t g;
    group_open(&g, 3);
    group_run(&g, barrier_body, NULL);
    group_expect_ok(&g);
    assert_true(g.k[0].op_ms >= LATE_MS - 50);
    assert_true(g.k[1].op_ms >= LATE_MS - 50);
    group_close(&g);
}

/* ---- forming --------------------------------------------------------------------- */

/* Three workers.  Group 10 (a TP group): workers 0, 1, 2 as ranks 0, 1, 2.
 * Group 20 (a pipeline link): worker 0 as rank 0, worker 2 as rank 1.
 * Worker 0 forms 10 then 20, worker 2 forms 20 then 10: worker 2's link
 * connection reaches worker 0 while it forms group 10 (it cannot have
 * finished: it needs worker 2), so group 20 only forms if worker 0 acks
 * and stashes it then, and claims it afterwards. */
typedef struct {
    int worker;
    group_t *g;
    tsr_comm_t *tp, *link;
    float sum;
    uint32_t got;
    char err[512];
    int rc;
} two_ctx_t;

static tsr_comm_t *form(two_ctx_t *w, uint64_t group)
{
    const char *link_eps[2] = {w->g->eps[0], w->g->eps[2]};
    if (group == 10)
        return tsr_tcp_comm_new(w->g->l[w->worker], 1, 10, w->worker, 3, w->g->eps, FORM_MS,
                                w->err, sizeof w->err);
    return tsr_tcp_comm_new(w->g->l[w->worker], 1, 20, w->worker == 2 ? 1 : 0, 2, link_eps,
                            FORM_MS, w->err, sizeof w->err);
}

static void *two_groups_main(void *arg)
{
    two_ctx_t *w = arg;
    w->rc = -1;
    if (w->worker == 2 && !(w->link = form(w, 20))) return NULL;
    if (!(w->tp = form(w, 10))) return NULL;
    if (w->worker == 0 && !(w->link = form(w, 20))) return NULL;
    w->sum = (float)(w->worker + 1);
    if (ops->allreduce_sum(w->tp, &w->sum, 1, OP_MS, w->err, sizeof w->err)) return NULL;
    uint32_t token = 0xfeed;
    if (w->worker == 2 && ops->send(w->link, 0, &token, sizeof token, OP_MS, w->err,
                                    sizeof w->err))
        return NULL;
    if (w->worker == 0 && ops->recv(w->link, 1, &w->got, sizeof w->got, OP_MS, w->err,
                                    sizeof w->err))
        return NULL;
    w->rc = 0;
    return NULL;
}

static void test_two_groups_formed_in_different_orders_share_listeners(void **state)
{
    (void)state;
    group_t g;
    two_ctx_t w[3];
    pthread_t th[3];
    group_open(&g, 3);
    int64_t t0 = now_ms();
    for (int i = 0; i < 3; i++) {
        w[i] = (two_ctx_t){.worker = i, .g = &g};
        assert_int_equal(pthread_create(&th[i], NULL, two_groups_main, &w[i]), 0);
    }
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 3; i++)
        if (w[i].rc) fail_msg("worker %d: %s", i, w[i].err);
    /* Formed through the stash, not by waiting out a timeout. */
    assert_true(now_ms() - t0 < 1000);
    for (int i = 0; i < 3; i++) assert_true(w[i].sum == 6.0f);
    assert_int_equal(w[0].got, 0xfeed);
    assert_int_equal(ops->rank(w[0].link), 0);
    assert_int_equal(ops->rank(w[2].link), 1);
    assert_int_equal(ops->size(w[0].link), 2);
    for (int i = 0; i < 3; i++) {
        ops->destroy(&w[i].tp);
        ops->destroy(&w[i].link);
    }
    group_close(&g);
}

static int barrier_only(rank_ctx_t *k)
{
    return ops->barrier(k->comm, OP_MS, k->err, sizeof k->err);
}

/* Worker 0 forms group 10 (with worker 1) and group 20 (with worker 2) in
 * two threads at once, on its one listener: either thread may accept the
 * other's connection and must hand it over through the stash. */
static void test_two_threads_form_groups_on_one_listener_at_once(void **state)
{
    (void)state;
    for (int round = 0; round < 5; round++) {
        group_t g;
        rank_ctx_t k[4];
        pthread_t th[4];
        const char *eps10[2], *eps20[2];
        group_open(&g, 3);
        eps10[0] = eps20[0] = g.eps[0], eps10[1] = g.eps[1], eps20[1] = g.eps[2];
        static const int worker[4] = {0, 1, 0, 2};
        for (int i = 0; i < 4; i++) {
            k[i] = (rank_ctx_t){.rank = i % 2, .n = 2, .epoch = 3, .group = i < 2 ? 10 : 20,
                                .l = g.l[worker[i]], .eps = i < 2 ? eps10 : eps20,
                                .body = barrier_only, .rc = -1};
            assert_int_equal(pthread_create(&th[i], NULL, rank_main, &k[i]), 0);
        }
        int64_t t0 = now_ms();
        for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
        /* A stashed connection is found at once, not at the deadline. */
        assert_true(now_ms() - t0 < 1000);
        for (int i = 0; i < 4; i++) {
            if (k[i].rc) fail_msg("round %d thread %d: %s", round, i, k[i].err);
            ops->destroy(&k[i].comm);
        }
        group_close(&g);
    }
}

static void test_a_rank_of_an_older_epoch_is_refused(void **state)
{
    (void)state;
    group_t g;
    char err[512];
    group_open(&g, 2);
    g.k[0] = (rank_ctx_t){.rank = 0, .n = 2, .epoch = 7, .group = 5, .l = g.l[0],
                          .eps = g.eps, .body = barrier_only, .rc = -1};
    assert_int_equal(pthread_create(&g.th[0], NULL, rank_main, &g.k[0]), 0);

    int64_t t0 = now_ms();
    tsr_comm_t *stale = tsr_tcp_comm_new(g.l[1], 6, 5, 1, 2, g.eps, FORM_MS, err, sizeof err);
    assert_null(stale);
    assert_true(now_ms() - t0 < 1000);
    assert_non_null(strstr(err, "rank 0"));
    assert_non_null(strstr(err, "refused"));
    assert_non_null(strstr(err, "epoch 6 is older than its epoch 7"));

    g.k[1] = (rank_ctx_t){.rank = 1, .n = 2, .epoch = 7, .group = 5, .l = g.l[1],
                          .eps = g.eps, .body = barrier_only, .rc = -1};
    assert_int_equal(pthread_create(&g.th[1], NULL, rank_main, &g.k[1]), 0);
    for (int r = 0; r < 2; r++) pthread_join(g.th[r], NULL);
    group_expect_ok(&g);
    group_close(&g);
}

static void test_comm_new_times_out_naming_the_missing_rank(void **state)
{
    (void)state;
    group_t g;
    char err[512];
    group_open(&g, 2);
    int64_t t0 = now_ms();
    tsr_comm_t *c = tsr_tcp_comm_new(g.l[0], 1, 1, 0, 2, g.eps, 300, err, sizeof err);
    int64_t el = now_ms() - t0;
    assert_null(c);
    assert_true(el >= 290 && el < 300 + SLACK_MS);
    assert_non_null(strstr(err, "rank 1 ("));
    assert_non_null(strstr(err, "did not connect within 300 ms"));
    /* n == 1 needs no listener and no peers. */
    c = tsr_tcp_comm_new(NULL, 1, 1, 0, 1, NULL, 300, err, sizeof err);
    assert_non_null(c);
    float v = 2.5f;
    assert_int_equal(ops->allreduce_sum(c, &v, 1, 100, err, sizeof err), 0);
    assert_true(v == 2.5f);
    assert_int_equal(ops->barrier(c, 100, err, sizeof err), 0);
    ops->destroy(&c);
    assert_null(tsr_tcp_comm_new(g.l[0], 1, 1, 2, 2, g.eps, 300, err, sizeof err));
    group_close(&g);
}

static void test_listener_advertises_loopback_for_a_wildcard_bind(void **state)
{
    (void)state;
    char err[256];
    tsr_tcp_listener_t *l = tsr_tcp_listen("0.0.0.0", 0, err, sizeof err);
    assert_non_null(l);
    assert_true(tsr_tcp_listener_fd(l) >= 0);
    const char *ep = tsr_tcp_listener_endpoint(l);
    assert_int_equal(strncmp(ep, "127.0.0.1:", 10), 0);
    int port = atoi(ep + 10);
    assert_true(port > 0);
    assert_int_equal(tsr_tcp_listener_advertise(l, "10.1.2.3"), 0);
    char want[64];
    snprintf(want, sizeof want, "10.1.2.3:%d", port);
    assert_string_equal(tsr_tcp_listener_endpoint(l), want);
    tsr_tcp_listener_destroy(&l);
    /* Not an address of this host (TEST-NET-1): bind fails, no DNS asked. */
    assert_null(tsr_tcp_listen("192.0.2.1", 0, err, sizeof err));
    assert_non_null(strstr(err, "192.0.2.1"));
}

/* ---- dead, silent and garbage peers ----------------------------------------------- */

#define DEAD_MS 1000

/* A forked rank 2 forms the group, then either exits at once or waits to
 * be SIGKILLed; the thread ranks 0 and 1 must fail fast, naming it. */
typedef struct {
    pthread_barrier_t formed, go;
    bool ring;
} dead_t;

static int survivor_body(rank_ctx_t *k)
{
    dead_t *d = k->arg;
    size_t count = d->ring ? (size_t)1 << 20 : 1000;
    pthread_barrier_wait(&d->formed);
    pthread_barrier_wait(&d->go);
    if (!(k->buf = calloc(count, sizeof(float)))) return -1;
    int64_t t0 = now_ms();
    int rc = ops->allreduce_sum(k->comm, k->buf, count, DEAD_MS, k->err, sizeof k->err);
    k->op_ms = now_ms() - t0;
    return rc == 0 ? -1 : 0;    /* success here is the failure */
}

static void dead_peer_case(bool kill_it, bool ring)
{
    group_t g;
    dead_t d = {.ring = ring};
    char err[512];
    group_open(&g, 3);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        tsr_comm_t *c = tsr_tcp_comm_new(g.l[2], 1, 1, 2, 3, g.eps, FORM_MS, err, sizeof err);
        if (!c) _exit(1);
        if (kill_it) pause();
        _exit(0);
    }
    pthread_barrier_init(&d.formed, NULL, 3);
    pthread_barrier_init(&d.go, NULL, 3);
    for (int r = 0; r < 2; r++) group_start(&g, r, survivor_body, &d);
    pthread_barrier_wait(&d.formed);
    if (kill_it) kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    if (!kill_it) assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    pthread_barrier_wait(&d.go);
    for (int r = 0; r < 2; r++) pthread_join(g.th[r], NULL);
    for (int r = 0; r < 2; r++) {
        expect_ok(&g, r);
        assert_true(g.k[r].op_ms < DEAD_MS + SLACK_MS);
        /* The small path hears from rank 2 directly; in the ring rank 1's
         * left neighbour is rank 0, which stops on rank 2's failure. */
        if (!ring || r == 0)
            if (!strstr(g.k[r].err, "rank 2 (")) fail_msg("rank %d: %s", r, g.k[r].err);
    }
    pthread_barrier_destroy(&d.formed);
    pthread_barrier_destroy(&d.go);
    group_close(&g);
}

static void test_a_dead_peer_fails_allreduce_within_the_timeout(void **state)
{
    (void)state;
    dead_peer_case(false, false);
    dead_peer_case(true, false);
    dead_peer_case(true, true);
}

#define SILENT_MS 500

typedef struct {
    sem_t release;
} silent_t;

static int silent_body(rank_ctx_t *k)
{
    silent_t *s = k->arg;
    if (k->rank == k->n - 1) {  /* connected, and then never takes part */
        sem_wait(&s->release);
        return 0;
    }
    float v[16] = {0};
    int64_t t0 = now_ms();
    int rc = ops->allreduce_sum(k->comm, v, 16, SILENT_MS, k->err, sizeof k->err);
    k->op_ms = now_ms() - t0;
    return rc == 0 ? -1 : 0;
}

static void test_a_silent_peer_fails_allreduce_within_the_timeout(void **state)
{
    (void)state;
    group_t g;
    silent_t s;
    sem_init(&s.release, 0, 0);
    group_open(&g, 3);
    for (int r = 0; r < 3; r++) group_start(&g, r, silent_body, &s);
    for (int r = 0; r < 2; r++) pthread_join(g.th[r], NULL);
    sem_post(&s.release);
    pthread_join(g.th[2], NULL);
    group_expect_ok(&g);
    for (int r = 0; r < 2; r++) {
        assert_true(g.k[r].op_ms >= SILENT_MS - 10 && g.k[r].op_ms < SILENT_MS + SLACK_MS);
        if (!strstr(g.k[r].err, "rank 2 (") ||
            !strstr(g.k[r].err, "did not answer within 500 ms during allreduce"))
            fail_msg("rank %d: %s", r, g.k[r].err);
    }
    group_close(&g);
    sem_destroy(&s.release);
}

/* A reader that never reads: a large send must give up at its deadline. */
static int stalled_reader_body(rank_ctx_t *k)
{
    sem_t *release = k->arg;
    if (k->rank == 1) {
        sem_wait(release);
        return 0;
    }
    size_t len = (size_t)64 << 20;
    uint8_t *b = calloc(len, 1);
    int64_t t0 = now_ms();
    int rc = ops->send(k->comm, 1, b, len, 300, k->err, sizeof k->err);
    k->op_ms = now_ms() - t0;
    free(b);
    return rc == 0 ? -1 : 0;
}

static void test_a_send_to_a_stalled_reader_times_out(void **state)
{
    (void)state;
    group_t g;
    sem_t release;
    sem_init(&release, 0, 0);
    group_open(&g, 2);
    for (int r = 0; r < 2; r++) group_start(&g, r, stalled_reader_body, &release);
    pthread_join(g.th[0], NULL);
    sem_post(&release);
    pthread_join(g.th[1], NULL);
    group_expect_ok(&g);
    assert_true(g.k[0].op_ms < 300 + SLACK_MS);
    if (!strstr(g.k[0].err, "rank 1 (") ||
        !strstr(g.k[0].err, "did not take its data within 300 ms during send"))
        fail_msg("%s", g.k[0].err);
    group_close(&g);
    sem_destroy(&release);
}

/* The wire format, written out by hand so that the test pins it. */
static void put32(uint8_t *p, uint32_t v)
{
    v = htonl(v);
    memcpy(p, &v, 4);
}

static void put64(uint8_t *p, uint64_t v)
{
    put32(p, (uint32_t)(v >> 32));
    put32(p + 4, (uint32_t)v);
}

/* Joins rank 0's group as `rank` over a raw blocking socket; returns the
 * fd, with *status the acceptor's answer (0: accepted). */
static int raw_join(const char *ep, uint64_t epoch, uint64_t group, uint32_t rank, uint32_t n,
                    uint32_t *status)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(
                                                       strchr(ep, ':') + 1))};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct timeval tv = {3, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    uint8_t hs[32], ack[16];
    put32(hs, 0x54535243), put32(hs + 4, 1), put64(hs + 8, epoch), put64(hs + 16, group);
    put32(hs + 24, rank), put32(hs + 28, n);
    assert_int_equal(send(fd, hs, sizeof hs, MSG_NOSIGNAL), (ssize_t)sizeof hs);
    assert_int_equal(recv(fd, ack, sizeof ack, MSG_WAITALL), (ssize_t)sizeof ack);
    uint32_t magic;
    memcpy(&magic, ack, 4), memcpy(status, ack + 4, 4);
    assert_int_equal(ntohl(magic), 0x54535243);
    *status = ntohl(*status);
    return fd;
}

static void raw_header(int fd, uint32_t magic, uint32_t kind, uint64_t epoch, uint64_t seq,
                       uint64_t len)
{
    uint8_t h[32];
    put32(h, magic), put32(h + 4, kind), put64(h + 8, epoch), put64(h + 16, seq);
    put64(h + 24, len);
    assert_int_equal(send(fd, h, sizeof h, MSG_NOSIGNAL), (ssize_t)sizeof h);
}

typedef struct {
    bool send;                  /* rank 0 sends 16 MiB instead of receiving */
    const char *want;
} garbage_t;

static int garbage_body(rank_ctx_t *k)
{
    const garbage_t *gb = k->arg;
    size_t len = gb->send ? (size_t)16 << 20 : 4096;
    uint8_t *b = calloc(len, 1);
    int rc = gb->send ? ops->send(k->comm, 1, b, len, 300, k->err, sizeof k->err)
                      : ops->recv(k->comm, 1, b, len, 2000, k->err, sizeof k->err);
    free(b);
    return rc == 0 || !strstr(k->err, gb->want) ? -1 : 0;
}

static void garbage_case(uint32_t magic, uint64_t epoch, uint64_t seq, uint64_t len, bool send,
                         const char *want)
{
    group_t g;
    garbage_t gb = {send, want};
    uint32_t status;
    group_open(&g, 2);
    group_start(&g, 0, garbage_body, &gb);  /* rank 1 is the raw socket */
    int fd = raw_join(g.eps[0], 1, 1, 1, 2, &status);
    assert_int_equal(status, 0);
    raw_header(fd, magic, 5, epoch, seq, len);
    pthread_join(g.th[0], NULL);
    close(fd);
    expect_ok(&g, 0);
    group_close(&g);
}

static void test_garbage_from_a_peer_fails_cleanly(void **state)
{
    (void)state;
    garbage_case(0xdeadbeef, 1, 0, 4096, false, "bad magic 0xdeadbeef");
    garbage_case(0x54535246, 1, 0, (uint64_t)1 << 60, false,
                 "sent a 1152921504606846976-byte message where 4096 bytes");
    garbage_case(0x54535246, 9, 0, 4096, false, "of epoch 9");
    garbage_case(0x54535246, 1, 3, 4096, false, "sent frame 3");
    /* While sending, a huge incoming length is not allocated: the send
     * just times out, since the raw peer never reads. */
    garbage_case(0x54535246, 1, 0, (uint64_t)1 << 60, true, "did not take its data within 300");
}

static void *raw_rank0(void *arg)
{
    rank_ctx_t *k = arg;
    k->comm = tsr_tcp_comm_new(k->l, 1, 1, 0, 3, k->eps, FORM_MS, k->err, sizeof k->err);
    k->rc = k->comm ? 0 : -1;
    return NULL;
}

static void test_a_duplicate_or_misfit_handshake_is_refused(void **state)
{
    (void)state;
    group_t g;
    uint32_t st;
    group_open(&g, 3);
    g.k[0] = (rank_ctx_t){.l = g.l[0], .eps = g.eps, .rc = -1};
    assert_int_equal(pthread_create(&g.th[0], NULL, raw_rank0, &g.k[0]), 0);
    int a = raw_join(g.eps[0], 1, 1, 1, 3, &st);
    assert_int_equal(st, 0);
    int b = raw_join(g.eps[0], 1, 1, 1, 3, &st);
    assert_int_equal(st, 5);    /* duplicate */
    close(b);
    b = raw_join(g.eps[0], 1, 1, 2, 4, &st);
    assert_int_equal(st, 3);    /* a group of 4 is not this group of 3 */
    close(b);
    b = raw_join(g.eps[0], 1, 1, 0, 3, &st);
    assert_int_equal(st, 4);    /* rank 0 is the acceptor itself */
    close(b);
    b = raw_join(g.eps[0], 1, 1, 2, 3, &st);
    assert_int_equal(st, 0);
    pthread_join(g.th[0], NULL);
    expect_ok(&g, 0);
    close(a);
    close(b);
    group_close(&g);
}

/* ---- cancellation ---------------------------------------------------------------- */

typedef struct {
    tsr_tcp_listener_t *l;
    int flag;                   /* set by one thread, read by another: atomics */
} cancel_ctx_t;

static int cancel_flag(void *arg)
{
    return __atomic_load_n(&((cancel_ctx_t *)arg)->flag, __ATOMIC_ACQUIRE);
}

static void *cancel_later(void *arg)
{
    cancel_ctx_t *c = arg;
    usleep(200 * 1000);
    __atomic_store_n(&c->flag, 1, __ATOMIC_RELEASE);
    tsr_tcp_listener_wake(c->l);
    return NULL;
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* A rank waiting for a peer that never forms (connecting side and
 * accepting side) gives up as soon as it is cancelled, not at its timeout. */
static void test_forming_can_be_cancelled_before_the_timeout(void **state)
{
    (void)state;
    char err[256];
    tsr_tcp_listener_t *silent = tsr_tcp_listen("127.0.0.1", 0, err, sizeof err);
    assert_non_null(silent);
    for (int my_rank = 0; my_rank < 2; my_rank++) {
        tsr_tcp_listener_t *me = tsr_tcp_listen("127.0.0.1", 0, err, sizeof err);
        assert_non_null(me);
        const char *eps[2];
        eps[my_rank] = tsr_tcp_listener_endpoint(me);
        eps[1 - my_rank] = tsr_tcp_listener_endpoint(silent);
        cancel_ctx_t c = {me, 0};
        pthread_t th;
        pthread_create(&th, NULL, cancel_later, &c);
        double t0 = mono_s();
        tsr_comm_t *comm = tsr_tcp_comm_new_cancellable(me, 1, 77, my_rank, 2, eps, 10000,
                                                        cancel_flag, &c, err, sizeof err);
        double took = mono_s() - t0;
        pthread_join(th, NULL);
        assert_null(comm);
        assert_non_null(strstr(err, "cancelled"));
        if (took > 1.5) fail_msg("rank %d: cancelled after %.2f s, timeout was 10 s", my_rank, took);
        tsr_tcp_listener_destroy(&me);
    }
    tsr_tcp_listener_destroy(&silent);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_allreduce_small_adds_in_rank_order_on_every_rank),
        cmocka_unit_test(test_allreduce_large_ring_is_exact_and_bit_identical),
        cmocka_unit_test(test_allreduce_throughput_1M_floats_2_ranks),
        cmocka_unit_test(test_broadcast_from_a_nonzero_root_reaches_every_rank),
        cmocka_unit_test(test_send_recv_8MiB_both_ways_at_once_does_not_deadlock),
        cmocka_unit_test(test_recv_of_a_different_length_than_sent_fails),
        cmocka_unit_test(test_barrier_waits_for_the_last_rank),
        cmocka_unit_test(test_two_groups_formed_in_different_orders_share_listeners),
        cmocka_unit_test(test_two_threads_form_groups_on_one_listener_at_once),
        cmocka_unit_test(test_a_rank_of_an_older_epoch_is_refused),
        cmocka_unit_test(test_comm_new_times_out_naming_the_missing_rank),
        cmocka_unit_test(test_listener_advertises_loopback_for_a_wildcard_bind),
        cmocka_unit_test(test_a_dead_peer_fails_allreduce_within_the_timeout),
        cmocka_unit_test(test_a_silent_peer_fails_allreduce_within_the_timeout),
        cmocka_unit_test(test_a_send_to_a_stalled_reader_times_out),
        cmocka_unit_test(test_garbage_from_a_peer_fails_cleanly),
        cmocka_unit_test(test_a_duplicate_or_misfit_handshake_is_refused),
        cmocka_unit_test(test_forming_can_be_cancelled_before_the_timeout),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
