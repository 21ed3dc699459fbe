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
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
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

#include "common/safetensors.h"
#include "worker/collective.h"

#define MAXR 4
#define FORM_MS 3000
#define OP_MS 5000
#define SLACK_MS 500

static const tsr_coll_ops_t *ops = &tsr_coll_tcp;
static const uint8_t SECRET[32] = "test_collective data secret...";

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

/* Integers in [-2^29, 2^29) with busy low bits: four of them sum without
 * overflow, and a float on the way would lose the low bits. */
static int32_t ival(int rank, size_t i)
{
    uint32_t x = (uint32_t)i * 2654435761u ^ (uint32_t)(rank + 1) * 40503u * 977u;
    return (int32_t)(x & 0x3fffffffu) - 0x20000000;
}

static tsr_buf_t f32_buf(float *p, size_t count)
{
    return tsr_host_buf(p, count, TSR_DT_F32);
}

static tsr_buf_t i32_buf(void *p, size_t count)
{
    return tsr_host_buf(p, count, TSR_DT_I32);
}

/* Raw bytes travel as I32: len must be a multiple of 4. */
static tsr_buf_t byte_buf(void *p, size_t len)
{
    return tsr_host_buf(p, len / 4, TSR_DT_I32);
}

/* ---- a group of rank threads ------------------------------------------------- */

typedef struct rank_ctx rank_ctx_t;
typedef int (*body_fn)(rank_ctx_t *k);

struct rank_ctx {
    int rank, n;
    uint64_t epoch, group;
    tsr_tcp_listener_t *l;
    const char **eps;
    bool via_create;            /* form through ops->create and a blob */
    const char *const *names;   /* via_create: the members' worker names (NULL none) */
    int (*cancelled)(void *arg);    /* via_create: the rendezvous's cancellation */
    void *cancel_arg;
    body_fn body;
    const uint8_t *secret;      /* start_rank: 32 bytes to form with (NULL: comm_new's) */
    void *arg;                  /* the test's shared state */
    tsr_comm_t *comm;
    int rc;                     /* 0: forming and body succeeded */
    char err[512];
    int64_t op_ms, op2_ms;      /* what the body chose to time */
    void *buf;                  /* the body's result, freed by group_close */
};

typedef struct {
    int n;
    bool via_create;
    const char *const *names;
    int (*cancelled)(void *arg);
    void *cancel_arg;
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

/* The TCP rendezvous blob: the endpoints, one a line. */
static size_t make_blob(char *blob, size_t cap, const char *const *eps, int n)
{
    size_t len = 0;
    for (int i = 0; i < n && len < cap; i++)
        len += (size_t)snprintf(blob + len, cap - len, "%s%s", i ? "\n" : "", eps[i]);
    return len < cap ? len : cap - 1;
}

static void *rank_main(void *arg)
{
    rank_ctx_t *k = arg;
    if (k->via_create) {
        char blob[MAXR * 64];
        tsr_rendezvous_t rv = {.epoch = k->epoch, .group = k->group, .rank = k->rank, .n = k->n,
                               .blob = blob, .timeout_ms = FORM_MS, .secret = SECRET,
                               .secret_len = sizeof SECRET, .cancelled = k->cancelled,
                               .cancel_arg = k->cancel_arg, .names = k->names};
        rv.blob_len = make_blob(blob, sizeof blob, k->eps, k->n);
        if (ops->create(&(tsr_coll_ctx_t){.listener = k->l}, &rv, &k->comm, k->err, sizeof k->err)) k->comm = NULL;
    } else {
        k->comm = tsr_tcp_comm_new(k->l, k->epoch, k->group, k->rank, k->n, k->eps, FORM_MS,
                                   k->err, sizeof k->err);
    }
    k->rc = !k->comm ? -1 : k->body ? k->body(k) : 0;
    return NULL;
}

static void group_start(group_t *g, int rank, body_fn body, void *arg)
{
    rank_ctx_t *k = &g->k[rank];
    *k = (rank_ctx_t){.rank = rank, .n = g->n, .epoch = 1, .group = 1, .l = g->l[rank],
                      .eps = g->eps, .via_create = g->via_create, .names = g->names,
                      .cancelled = g->cancelled,
                      .cancel_arg = g->cancel_arg, .body = body, .arg = arg, .rc = -1};
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

/* The body's own check failed: say what, for fail_msg on the main thread. */
static int body_fail(rank_ctx_t *k, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k->err, sizeof k->err, fmt, ap);
    va_end(ap);
    return -1;
}

/* One I32 summed over the group: all ranks have reached this point, and
 * the group carries data. */
static int sync_body(rank_ctx_t *k)
{
    int32_t v = k->rank + 1;
    if (ops->allreduce_sum(k->comm, i32_buf(&v, 1), OP_MS, k->err, sizeof k->err)) return -1;
    if (v != k->n * (k->n + 1) / 2) return body_fail(k, "sum %d in a group of %d", v, k->n);
    return 0;
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
    float *b = malloc(f->count * sizeof(float));
    if (!(k->buf = b)) return -1;
    for (size_t i = 0; i < f->count; i++)
        b[i] = f->whole ? whole(k->rank, i) : rnd(f->seed, k->rank, i);
    return ops->allreduce_sum(k->comm, f32_buf(b, f->count), OP_MS, k->err, sizeof k->err);
}

static void check_allreduce(int n, size_t count, uint32_t seed, bool exact_order)
{
    group_t g;
    fill_t f = {count, seed, false};
    group_open(&g, n);
    group_run(&g, allreduce_body, &f);
    group_expect_ok(&g);
    const float *b0 = g.k[0].buf;
    for (size_t i = 0; i < count; i++) {
        float ref = rnd(seed, 0, i);
        for (int r = 1; r < n; r++) ref += rnd(seed, r, i);
        /* The small path adds in rank order, so it matches this exactly;
         * the ring adds in ring order, so only closely. */
        if (exact_order && memcmp(&ref, &b0[i], sizeof ref))
            fail_msg("n %d [%zu]: %.9g, expected %.9g", n, i, b0[i], ref);
        if (!exact_order && fabsf(ref - b0[i]) > 1e-5f)
            fail_msg("n %d [%zu]: %.9g, expected about %.9g", n, i, b0[i], ref);
    }
    for (int r = 1; r < n; r++)
        if (memcmp(b0, g.k[r].buf, count * sizeof(float)))
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
        for (int r = 0; r < n; r++) {
            const float *b = g.k[r].buf;
            for (size_t i = 0; i < count; i++) {
                float want = 0;
                for (int q = 0; q < n; q++) want += whole(q, i);
                if (b[i] != want)
                    fail_msg("n %d rank %d [%zu]: %g, expected %g", n, r, i, b[i], want);
            }
        }
        group_close(&g);
        check_allreduce(n, count, 21 + (uint32_t)n, false);
    }
}

static int allreduce_i32_body(rank_ctx_t *k)
{
    const size_t *count = k->arg;
    int32_t *b = malloc(*count * sizeof *b);
    if (!(k->buf = b)) return -1;
    for (size_t i = 0; i < *count; i++) b[i] = ival(k->rank, i);
    return ops->allreduce_sum(k->comm, i32_buf(b, *count), OP_MS, k->err, sizeof k->err);
}

static void test_allreduce_of_i32_sums_exactly(void **state)
{
    (void)state;
    /* 100000 I32 is 400 KB: were integers sent down the float path, this
     * size would take the ring, and either way floats lose the low bits. */
    static const size_t counts[] = {1, 1000, 100000};
    for (int n = 1; n <= MAXR; n++)
        for (int c = 0; c < 3; c++) {
            size_t count = counts[c];
            group_t g;
            group_open(&g, n);
            group_run(&g, allreduce_i32_body, &count);
            group_expect_ok(&g);
            for (int r = 0; r < n; r++) {
                const int32_t *b = g.k[r].buf;
                for (size_t i = 0; i < count; i++) {
                    int64_t want = 0;
                    for (int q = 0; q < n; q++) want += ival(q, i);
                    if (b[i] != want)
                        fail_msg("n %d rank %d [%zu]: %d, expected %lld", n, r, i, b[i],
                                 (long long)want);
                }
            }
            group_close(&g);
        }
}

/* ---- 16-bit floats ---- */

typedef struct {
    size_t count;
    tsr_dtype_t dt;
    uint32_t seed;
} half_t;

static uint16_t to_half(tsr_dtype_t dt, float f)
{
    return dt == TSR_DT_BF16 ? tsr_f32_to_bf16(f) : tsr_f32_to_f16(f);
}

static float from_half(tsr_dtype_t dt, uint16_t h)
{
    return dt == TSR_DT_BF16 ? tsr_bf16_to_f32(h) : tsr_f16_to_f32(h);
}

/* The spacing of dt's values around |x|: one rounding moves a sum by at
 * most this (by half of it, rounding to nearest). */
static double half_ulp(tsr_dtype_t dt, double x)
{
    int e, mant = dt == TSR_DT_BF16 ? 7 : 10, min_exp = dt == TSR_DT_BF16 ? -133 : -24;
    frexp(fabs(x), &e);         /* |x| = m 2^e, m in [0.5, 1) */
    int u = e - 1 - mant;
    return ldexp(1.0, u > min_exp ? u : min_exp);
}

static int half_body(rank_ctx_t *k)
{
    const half_t *h = k->arg;
    uint16_t *b = malloc(h->count * sizeof *b);
    if (!(k->buf = b)) return -1;
    for (size_t i = 0; i < h->count; i++) b[i] = to_half(h->dt, rnd(h->seed, k->rank, i));
    return ops->allreduce_sum(k->comm, tsr_host_buf(b, h->count, h->dt), OP_MS, k->err,
                              sizeof k->err);
}

static void check_half(int n, tsr_dtype_t dt, size_t count, uint32_t seed)
{
    group_t g;
    half_t h = {count, dt, seed};
    group_open(&g, n);
    group_run(&g, half_body, &h);
    group_expect_ok(&g);
    const uint16_t *b0 = g.k[0].buf;
    for (size_t i = 0; i < count; i++) {
        double exact = 0;
        for (int r = 0; r < n; r++) exact += from_half(dt, to_half(dt, rnd(seed, r, i)));
        double got = from_half(dt, b0[i]);
        double big = fabs(got) > fabs(exact) ? fabs(got) : fabs(exact);
        if (fabs(got - exact) > half_ulp(dt, big))
            fail_msg("%s n %d count %zu [%zu]: %.9g, expected %.9g within one rounding",
                     tsr_dtype_name(dt), n, count, i, got, exact);
    }
    for (int r = 1; r < n; r++)
        if (memcmp(b0, g.k[r].buf, count * sizeof *b0))
            fail_msg("%s n %d count %zu: rank %d's bits differ from rank 0's",
                     tsr_dtype_name(dt), n, count, r);
    group_close(&g);
}

static void test_allreduce_of_bf16_and_f16_sums_within_one_rounding_bit_identically(void **state)
{
    (void)state;
    static const tsr_dtype_t dts[] = {TSR_DT_BF16, TSR_DT_F16};
    for (int d = 0; d < 2; d++)
        for (int n = 2; n <= MAXR; n++) {
            check_half(n, dts[d], 1000, 31 + (uint32_t)n);
            /* 40000 elements are 160 KB once widened to f32: the ring. */
            check_half(n, dts[d], 40001, 41 + (uint32_t)n);
        }
}

static int device_body(rank_ctx_t *k)
{
    float v[4] = {1, 2, 3, 4};
    tsr_buf_t b = f32_buf(v, 4);
    b.mem = TSR_MEM_DEVICE;
    int64_t t0 = now_ms();
    int rc = ops->allreduce_sum(k->comm, b, OP_MS, k->err, sizeof k->err);
    k->op_ms = now_ms() - t0;
    if (rc == 0) return body_fail(k, "an allreduce of device memory succeeded");
    return strstr(k->err, "device memory") ? 0 : -1;
}

static void test_allreduce_of_device_memory_is_refused(void **state)
{
    (void)state;
    group_t g;
    group_open(&g, 2);
    group_run(&g, device_body, NULL);
    group_expect_ok(&g);
    /* Refused before anything waits on the peer. */
    for (int r = 0; r < 2; r++) assert_true(g.k[r].op_ms < 100);
    group_close(&g);

    char err[512];
    float v[4] = {1, 2, 3, 4};
    tsr_buf_t b = f32_buf(v, 4);
    b.mem = TSR_MEM_DEVICE;
    tsr_comm_t *c = tsr_tcp_comm_new(NULL, 1, 1, 0, 1, NULL, 300, err, sizeof err);
    assert_non_null(c);
    /* Even a group of one, which has nothing to send, must not touch it. */
    err[0] = '\0';
    assert_int_equal(ops->allreduce_sum(c, b, 100, err, sizeof err), -1);
    if (!strstr(err, "device memory")) fail_msg("%s", err);
    assert_int_equal(ops->mem, TSR_MEM_HOST);
    ops->destroy(&c);
}

#define TPUT_ITERS 20

/* Starts from 1.0 everywhere: each of 2 ranks doubles it, so after the
 * loop every element is exactly 2^(iterations). */
static int throughput_body(rank_ctx_t *k)
{
    size_t count = (size_t)1 << 20;
    float *b = malloc(count * sizeof(float));
    if (!(k->buf = b)) return -1;
    for (size_t i = 0; i < count; i++) b[i] = 1.0f;
    if (ops->allreduce_sum(k->comm, f32_buf(b, count), OP_MS, k->err, sizeof k->err)) return -1;
    int64_t t0 = now_ms();
    for (int it = 0; it < TPUT_ITERS; it++)
        if (ops->allreduce_sum(k->comm, f32_buf(b, count), OP_MS, k->err, sizeof k->err))
            return -1;
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
    for (int r = 0; r < 2; r++) {
        const float *b = g.k[r].buf;
        for (size_t i = 0; i < (size_t)1 << 20; i++)
            if (b[i] != want) fail_msg("rank %d [%zu]: %g, expected %g", r, i, b[i], want);
    }
    double ms = (double)g.k[0].op_ms / TPUT_ITERS;
    if (ms <= 0) ms = 0.01;
    print_message("allreduce of 1M floats (4 MiB) x 2 ranks on loopback: %.2f ms each, "
                  "%.2f GB/s of buffer\n", ms, 4.0 * 1048576 / (ms / 1000) / 1e9);
    group_close(&g);
}

#define LATE_MS 300

/* Rank 2 comes late to an allgather and then to an allreduce: the others
 * wait for it, which is what callers use in place of a barrier. */
static int late_body(rank_ctx_t *k)
{
    int32_t part = k->rank * 10, all[3] = {-1, -1, -1}, one = 1;
    if (k->rank == 2) sleep_ms(LATE_MS);
    int64_t t0 = now_ms();
    if (ops->allgather(k->comm, i32_buf(&part, 1), i32_buf(all, 3), OP_MS, k->err,
                       sizeof k->err))
        return -1;
    k->op_ms = now_ms() - t0;
    if (all[0] != 0 || all[1] != 10 || all[2] != 20)
        return body_fail(k, "gathered %d %d %d", all[0], all[1], all[2]);
    if (k->rank == 2) sleep_ms(LATE_MS);
    t0 = now_ms();
    if (ops->allreduce_sum(k->comm, i32_buf(&one, 1), OP_MS, k->err, sizeof k->err)) return -1;
    k->op2_ms = now_ms() - t0;
    return one == 3 ? 0 : body_fail(k, "sum %d", one);
}

static void test_allgather_and_allreduce_wait_for_the_last_rank(void **state)
{
    (void)state;
    group_t g;
    group_open(&g, 3);
    group_run(&g, late_body, NULL);
    group_expect_ok(&g);
    for (int r = 0; r < 2; r++) {
        if (g.k[r].op_ms < LATE_MS - 50) fail_msg("rank %d: allgather %lld ms", r,
                                                  (long long)g.k[r].op_ms);
        if (g.k[r].op2_ms < LATE_MS - 50) fail_msg("rank %d: allreduce %lld ms", r,
                                                   (long long)g.k[r].op2_ms);
    }
    group_close(&g);
}

/* ---- allgather ------------------------------------------------------------------- */

typedef struct {
    size_t count;               /* per rank */
    tsr_dtype_t dt;             /* F32 or I32 */
} gather_t;

/* The bits of element i of rank's part: the rank in the top byte for I32,
 * a whole number that names (rank, i) for F32. */
static uint32_t gather_val(int rank, tsr_dtype_t dt, size_t i)
{
    if (dt == TSR_DT_I32) return (uint32_t)rank << 24 | (uint32_t)(i & 0xffffff);
    float f = (float)(rank * 100000 + (int)(i % 100000));
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The receive buffer starts as 0xff bytes, so a part left out shows. */
static int allgather_body(rank_ctx_t *k)
{
    const gather_t *ga = k->arg;
    size_t total = ga->count * (size_t)k->n;
    uint32_t *send = malloc((ga->count ? ga->count : 1) * 4), *recv = malloc(total * 4 + 4);
    int rc = -1;
    k->buf = recv;
    if (!send || !recv) goto out;
    memset(recv, 0xff, total * 4);
    for (size_t i = 0; i < ga->count; i++) {
        send[i] = gather_val(k->rank, ga->dt, i);
    }
    rc = ops->allgather(k->comm, tsr_host_buf(send, ga->count, ga->dt),
                        tsr_host_buf(recv, total, ga->dt), OP_MS, k->err, sizeof k->err);
out:
    free(send);
    return rc;
}

static void test_allgather_puts_every_rank_part_in_rank_order(void **state)
{
    (void)state;
    static const gather_t cases[] = {{3, TSR_DT_F32}, {100003, TSR_DT_I32}, {0, TSR_DT_I32}};
    for (int n = 1; n <= MAXR; n++)
        for (int c = 0; c < 3; c++) {
            gather_t ga = cases[c];
            group_t g;
            group_open(&g, n);
            group_run(&g, allgather_body, &ga);
            group_expect_ok(&g);
            for (int r = 0; r < n; r++) {
                const uint32_t *b = g.k[r].buf;
                for (int q = 0; q < n; q++)
                    for (size_t i = 0; i < ga.count; i++) {
                        uint32_t got = b[(size_t)q * ga.count + i];
                        uint32_t want = gather_val(q, ga.dt, i);
                        if (got != want)
                            fail_msg("n %d rank %d: part %d [%zu] is 0x%08x, expected 0x%08x",
                                     n, r, q, i, got, want);
                    }
            }
            group_close(&g);
        }
}

static int gather_refusal_body(rank_ctx_t *k)
{
    int32_t send[3] = {1, 2, 3}, recv[3 * 2 + 1];
    int64_t t0 = now_ms();
    int a = ops->allgather(k->comm, i32_buf(send, 3), i32_buf(recv, 5), OP_MS, k->err,
                           sizeof k->err);
    if (a == 0) return body_fail(k, "a receive buffer of 5 for 2 parts of 3 was taken");
    if (!strstr(k->err, "receive buffer of 5")) return -1;
    int b = ops->allgather(k->comm, i32_buf(send, 3), i32_buf(recv, 7), OP_MS, k->err,
                           sizeof k->err);
    if (b == 0) return body_fail(k, "a receive buffer of 7 for 2 parts of 3 was taken");
    if (!strstr(k->err, "receive buffer of 7")) return -1;
    /* Same size in bytes, another element type. */
    int c = ops->allgather(k->comm, i32_buf(send, 3),
                           tsr_host_buf(recv, 6, TSR_DT_F32), OP_MS, k->err, sizeof k->err);
    if (c == 0) return body_fail(k, "an F32 receive buffer for I32 parts was taken");
    k->op_ms = now_ms() - t0;
    return 0;
}

static void test_allgather_refuses_a_receive_buffer_of_the_wrong_count(void **state)
{
    (void)state;
    group_t g;
    group_open(&g, 2);
    group_run(&g, gather_refusal_body, NULL);
    group_expect_ok(&g);
    for (int r = 0; r < 2; r++) assert_true(g.k[r].op_ms < 100);
    group_close(&g);
}

/* ---- broadcast --------------------------------------------------------------------- */

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
    if (ops->broadcast(k->comm, byte_buf(b, BCAST_LEN), 2, OP_MS, k->err, sizeof k->err) ||
        ops->broadcast(k->comm, byte_buf(small, sizeof small), 2, OP_MS, k->err, sizeof k->err))
        goto out;
    for (size_t i = 0; i < BCAST_LEN; i++)
        if (b[i] != (uint8_t)(i * 31 + 7)) {
            body_fail(k, "byte %zu is %u", i, b[i]);
            goto out;
        }
    for (size_t i = 0; i < sizeof small; i++)
        if (small[i] != 0x5a) {
            body_fail(k, "small byte %zu is %u", i, small[i]);
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

/* ---- send, recv and group --------------------------------------------------------- */

#define P2P_LEN ((size_t)8 << 20)

static uint8_t pattern(int from, size_t i)
{
    return (uint8_t)(i * 13 + (size_t)from * 101 + (i >> 12));
}

static void fill_pattern(uint8_t *b, size_t len, int from)
{
    for (size_t i = 0; i < len; i++) b[i] = pattern(from, i);
}

static int check_pattern(rank_ctx_t *k, const uint8_t *b, size_t len, int from)
{
    for (size_t i = 0; i < len; i++)
        if (b[i] != pattern(from, i))
            return body_fail(k, "byte %zu from rank %d is %u", i, from, b[i]);
    return 0;
}

static int p2p_send(rank_ctx_t *k, int peer, void *b, size_t len, int timeout_ms)
{
    return tsr_coll_send(ops, k->comm, peer, byte_buf(b, len), timeout_ms, k->err,
                         sizeof k->err);
}

static int p2p_recv(rank_ctx_t *k, int peer, void *b, size_t len, int timeout_ms)
{
    return tsr_coll_recv(ops, k->comm, peer, byte_buf(b, len), timeout_ms, k->err,
                         sizeof k->err);
}

/* Both ranks send 8 MiB first and receive second: far more than the socket
 * buffers hold, so this finishes only if send keeps reading meanwhile.
 * Then messages of 12, 0 and 1000 bytes keep their boundaries. */
static int exchange_body(rank_ctx_t *k)
{
    int other = 1 - k->rank, rc = -1;
    uint8_t *out = malloc(P2P_LEN), *in = malloc(P2P_LEN);
    if (!out || !in) goto out;
    fill_pattern(out, P2P_LEN, k->rank);
    for (int round = 0; round < 2; round++) {
        if (p2p_send(k, other, out, P2P_LEN, OP_MS) || p2p_recv(k, other, in, P2P_LEN, OP_MS) ||
            check_pattern(k, in, P2P_LEN, other))
            goto out;
    }
    static const size_t sizes[] = {12, 0, 1000};
    for (int i = 0; i < 3; i++)
        if (p2p_send(k, other, out, sizes[i], OP_MS)) goto out;
    for (int i = 0; i < 3; i++)
        if (p2p_recv(k, other, in, sizes[i], OP_MS) || check_pattern(k, in, sizes[i], other))
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

#define GROUP_LEN ((size_t)4 << 20)

/* Every rank sends GROUP_LEN bytes to every other rank and receives as
 * much from each, all in one group call. */
static int group_body(rank_ctx_t *k)
{
    uint8_t *out = malloc(GROUP_LEN), *in[MAXR] = {0};
    tsr_p2p_t leg[2 * MAXR];
    int nleg = 0, rc = -1;
    if (!out) goto out;
    fill_pattern(out, GROUP_LEN, k->rank);
    for (int p = 0; p < k->n; p++) {
        if (p == k->rank) continue;
        if (!(in[p] = malloc(GROUP_LEN))) goto out;
        /* Receives first on odd ranks: the order in the group must not matter. */
        tsr_p2p_t s = {p, true, byte_buf(out, GROUP_LEN)};
        tsr_p2p_t r = {p, false, byte_buf(in[p], GROUP_LEN)};
        leg[nleg++] = k->rank % 2 ? r : s;
        leg[nleg++] = k->rank % 2 ? s : r;
    }
    int64_t t0 = now_ms();
    if (ops->group(k->comm, leg, nleg, OP_MS, k->err, sizeof k->err)) goto out;
    k->op_ms = now_ms() - t0;
    for (int p = 0; p < k->n; p++)
        if (p != k->rank && check_pattern(k, in[p], GROUP_LEN, p)) goto out;
    rc = 0;
out:
    free(out);
    for (int p = 0; p < MAXR; p++) free(in[p]);
    return rc;
}

static void test_group_exchanges_4MiB_both_ways_in_one_call_without_deadlock(void **state)
{
    (void)state;
    for (int n = 2; n <= 3; n++) {
        group_t g;
        group_open(&g, n);
        group_run(&g, group_body, NULL);
        group_expect_ok(&g);
        for (int r = 0; r < n; r++) assert_true(g.k[r].op_ms < OP_MS);
        group_close(&g);
    }
}

static int group_refusal_body(rank_ctx_t *k)
{
    int other = 1 - k->rank;
    int32_t a[4] = {0}, b[4] = {0};
    tsr_p2p_t two_sends[2] = {{other, true, i32_buf(a, 4)}, {other, true, i32_buf(b, 4)}};
    tsr_p2p_t two_recvs[2] = {{other, false, i32_buf(a, 4)}, {other, false, i32_buf(b, 4)}};
    tsr_p2p_t to_self[1] = {{k->rank, true, i32_buf(a, 4)}};
    int64_t t0 = now_ms();
    if (ops->group(k->comm, two_sends, 2, OP_MS, k->err, sizeof k->err) == 0)
        return body_fail(k, "a group with two sends to rank %d ran", other);
    if (!strstr(k->err, "two sends")) return -1;
    if (ops->group(k->comm, two_recvs, 2, OP_MS, k->err, sizeof k->err) == 0)
        return body_fail(k, "a group with two receives from rank %d ran", other);
    if (!strstr(k->err, "two recvs")) return -1;
    if (ops->group(k->comm, to_self, 1, OP_MS, k->err, sizeof k->err) == 0)
        return body_fail(k, "a send to itself ran");
    if (!strstr(k->err, "not another rank")) return -1;
    k->op_ms = now_ms() - t0;
    return 0;
}

static void test_group_with_two_sends_to_one_peer_is_refused(void **state)
{
    (void)state;
    group_t g;
    group_open(&g, 2);
    group_run(&g, group_refusal_body, NULL);
    group_expect_ok(&g);
    for (int r = 0; r < 2; r++) assert_true(g.k[r].op_ms < 100);
    group_close(&g);
}

static int mismatch_body(rank_ctx_t *k)
{
    uint8_t b[200] = {0};
    if (k->rank == 0) return p2p_send(k, 1, b, 100, OP_MS);
    if (p2p_recv(k, 0, b, 200, OP_MS) == 0) return body_fail(k, "a 200-byte recv succeeded");
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
    int32_t v = 1;
    assert_int_equal(ops->allreduce_sum(g.k[1].comm, i32_buf(&v, 1), 100, err, sizeof err), -1);
    assert_non_null(strstr(err, "earlier failure"));
    assert_int_equal(ops->poll(g.k[1].comm, 0, 100, err, sizeof err), -1);
    assert_non_null(strstr(err, "earlier failure"));
    group_close(&g);
}

/* Rank 2 finishes and closes; rank 0's sends to rank 1 read other ranks
 * eagerly while they wait, and must not fail over rank 2's EOF (the data
 * reached rank 1).  The closed rank is reported by the next operation
 * that involves it. */
static int closed_bystander_body(rank_ctx_t *k)
{
    sem_t *closed = k->arg;
    uint8_t b[4096];
    if (k->rank == 2) {
        ops->destroy(&k->comm);
        sem_post(closed);
        sem_post(closed);
        return 0;
    }
    sem_wait(closed);
    if (k->rank == 1) {
        for (int i = 0; i < 2; i++)
            if (p2p_recv(k, 0, b, sizeof b, OP_MS) || check_pattern(k, b, sizeof b, 0)) return -1;
        return 0;
    }
    sleep_ms(50);               /* rank 2's EOF is in rank 0's socket by now */
    fill_pattern(b, sizeof b, 0);
    for (int i = 0; i < 2; i++)
        if (p2p_send(k, 1, b, sizeof b, OP_MS)) return -1;
    int64_t t0 = now_ms();
    if (p2p_recv(k, 2, b, 8, OP_MS) == 0)
        return body_fail(k, "a recv from a closed rank succeeded");
    k->op_ms = now_ms() - t0;
    return strstr(k->err, "rank 2 (") && strstr(k->err, "closed") ? 0 : -1;
}

static void test_a_send_is_not_failed_by_another_rank_that_closed(void **state)
{
    (void)state;
    group_t g;
    sem_t closed;
    sem_init(&closed, 0, 0);
    group_open(&g, 3);
    group_run(&g, closed_bystander_body, &closed);
    group_expect_ok(&g);
    assert_true(g.k[0].op_ms < 100);
    group_close(&g);
    sem_destroy(&closed);
}

/* A peer that went away is named the way an operator knows it: its worker
 * and node (from the rendezvous), then its address. */
static int closed_peer_named_body(rank_ctx_t *k)
{
    sem_t *closed = k->arg;
    uint8_t b[8];
    if (k->rank == 1) {
        ops->destroy(&k->comm);
        sem_post(closed);
        return 0;
    }
    sem_wait(closed);
    if (p2p_recv(k, 1, b, sizeof b, OP_MS) == 0)
        return body_fail(k, "a recv from a closed rank succeeded");
    char want[128];
    snprintf(want, sizeof want, "rank 1 (worker w-one on node n-one, %s)", k->eps[1]);
    return strstr(k->err, want) && strstr(k->err, "closed") ? 0 : -1;
}

static void test_a_closed_peer_is_named_by_worker_and_node(void **state)
{
    (void)state;
    static const char *const names[] = {"worker w-zero on node n-zero", "worker w-one on node n-one"};
    group_t g;
    sem_t closed;
    sem_init(&closed, 0, 0);
    group_open(&g, 2);
    g.via_create = true;
    g.names = names;
    group_run(&g, closed_peer_named_body, &closed);
    group_expect_ok(&g);
    group_close(&g);
    sem_destroy(&closed);
}

/* ---- poll ------------------------------------------------------------------------- */

#define POLL_MS 300
#define POLL_BIG ((size_t)32 << 20)

typedef struct {
    sem_t go, sent;
} poll_t;

/* Rank 0 polls rank 1: before anything was sent (0 at the timeout), while
 * a message is on its way (1, as it arrives), and after a long send of
 * its own that pulled rank 1's next message into the inbox (1 at once,
 * though the socket is empty by then).  Rank 1 sends {1,2,3,4} when told
 * to, then {5,6,7,8}, then takes rank 0's long message. */
static int poll_body(rank_ctx_t *k)
{
    poll_t *pt = k->arg;
    int32_t m[4] = {0};
    uint8_t *big = malloc(POLL_BIG);
    int rc = -1;
    if (!big) goto out;
    if (k->rank == 1) {
        int32_t m1[4] = {1, 2, 3, 4}, m2[4] = {5, 6, 7, 8};
        sem_wait(&pt->go);
        sleep_ms(100);
        if (tsr_coll_send(ops, k->comm, 0, i32_buf(m1, 4), OP_MS, k->err, sizeof k->err) ||
            tsr_coll_send(ops, k->comm, 0, i32_buf(m2, 4), OP_MS, k->err, sizeof k->err))
            goto out;
        sem_post(&pt->sent);
        if (p2p_recv(k, 0, big, POLL_BIG, OP_MS) || check_pattern(k, big, POLL_BIG, 0)) goto out;
        rc = 0;
        goto out;
    }
    int64_t t0 = now_ms();
    int r = ops->poll(k->comm, 1, POLL_MS, k->err, sizeof k->err);
    int64_t el = now_ms() - t0;
    if (r != 0 || el < POLL_MS - 10 || el > POLL_MS + SLACK_MS) {
        body_fail(k, "poll with nothing sent: %d after %lld ms (timeout %d)", r, (long long)el,
                  POLL_MS);
        goto out;
    }
    sem_post(&pt->go);
    t0 = now_ms();
    r = ops->poll(k->comm, 1, OP_MS, k->err, sizeof k->err);
    el = now_ms() - t0;
    if (r != 1 || el > OP_MS / 2) {
        body_fail(k, "poll while a message comes: %d after %lld ms", r, (long long)el);
        goto out;
    }
    if (tsr_coll_recv(ops, k->comm, 1, i32_buf(m, 4), OP_MS, k->err, sizeof k->err)) goto out;
    if (m[0] != 1 || m[3] != 4) {
        body_fail(k, "first message %d %d %d %d", m[0], m[1], m[2], m[3]);
        goto out;
    }
    /* The second message sits in the socket before the long send starts,
     * and the send reads it into the inbox while it waits on rank 1. */
    sem_wait(&pt->sent);
    sleep_ms(50);
    fill_pattern(big, POLL_BIG, 0);
    if (p2p_send(k, 1, big, POLL_BIG, OP_MS)) goto out;
    t0 = now_ms();
    r = ops->poll(k->comm, 1, POLL_MS, k->err, sizeof k->err);
    el = now_ms() - t0;
    if (r != 1 || el > POLL_MS / 2) {
        body_fail(k, "poll with a message in the inbox: %d after %lld ms", r, (long long)el);
        goto out;
    }
    if (tsr_coll_recv(ops, k->comm, 1, i32_buf(m, 4), OP_MS, k->err, sizeof k->err)) goto out;
    if (m[0] != 5 || m[3] != 8) {
        body_fail(k, "second message %d %d %d %d", m[0], m[1], m[2], m[3]);
        goto out;
    }
    if ((r = ops->poll(k->comm, 1, 0, k->err, sizeof k->err)) != 0) {
        body_fail(k, "poll after both messages were taken: %d", r);
        goto out;
    }
    rc = 0;
out:
    free(big);
    return rc;
}

static void test_poll_says_when_a_message_waits_and_times_out_when_none(void **state)
{
    (void)state;
    group_t g;
    poll_t pt;
    sem_init(&pt.go, 0, 0);
    sem_init(&pt.sent, 0, 0);
    group_open(&g, 2);
    group_run(&g, poll_body, &pt);
    group_expect_ok(&g);
    group_close(&g);
    sem_destroy(&pt.go);
    sem_destroy(&pt.sent);
}

/* A peer that closed its end is not "nothing sent": poll returns at once
 * and the receive that follows names the peer. */
static int poll_closed_body(rank_ctx_t *k)
{
    sem_t *closed = k->arg;
    if (k->rank == 1) {
        ops->destroy(&k->comm);
        sem_post(closed);
        return 0;
    }
    sem_wait(closed);
    int64_t t0 = now_ms();
    int r = ops->poll(k->comm, 1, OP_MS, k->err, sizeof k->err);
    k->op_ms = now_ms() - t0;
    if (r == 0) return body_fail(k, "poll on a closed peer timed out");
    int32_t v[2];
    if (r == 1 &&
        tsr_coll_recv(ops, k->comm, 1, i32_buf(v, 2), OP_MS, k->err, sizeof k->err) == 0)
        return body_fail(k, "a recv from a closed peer succeeded");
    return strstr(k->err, "rank 1 (") ? 0 : -1;
}

static void test_poll_on_a_closed_peer_returns_at_once(void **state)
{
    (void)state;
    group_t g;
    sem_t closed;
    sem_init(&closed, 0, 0);
    group_open(&g, 2);
    group_run(&g, poll_closed_body, &closed);
    group_expect_ok(&g);
    assert_true(g.k[0].op_ms < 100);
    group_close(&g);
    sem_destroy(&closed);
}

/* ---- abort ------------------------------------------------------------------------ */

#define WHY "replaced by epoch 9"

/* Every operation on an aborted communicator fails at once with the
 * reason given to abort; from collective.h, one per member of the table. */
static int aborted_ops_fail(rank_ctx_t *k, tsr_comm_t *c)
{
    int32_t v[4] = {0}, all[4 * MAXR] = {0};
    int n = ops->size(c), peer = (ops->rank(c) + 1) % n;
    tsr_p2p_t leg = {peer, true, i32_buf(v, 4)};
    static const char *const what[] = {"allreduce", "allgather", "broadcast", "group",
                                       "send", "recv", "poll"};
    for (int i = 0; i < 7; i++) {
        k->err[0] = '\0';
        int64_t t0 = now_ms();
        int rc = i == 0   ? ops->allreduce_sum(c, i32_buf(v, 4), OP_MS, k->err, sizeof k->err)
                 : i == 1 ? ops->allgather(c, i32_buf(v, 4), i32_buf(all, 4 * (size_t)n), OP_MS,
                                           k->err, sizeof k->err)
                 : i == 2 ? ops->broadcast(c, i32_buf(v, 4), 0, OP_MS, k->err, sizeof k->err)
                 : i == 3 ? ops->group(c, &leg, 1, OP_MS, k->err, sizeof k->err)
                 : i == 4 ? tsr_coll_send(ops, c, peer, i32_buf(v, 4), OP_MS, k->err,
                                          sizeof k->err)
                 : i == 5 ? tsr_coll_recv(ops, c, peer, i32_buf(v, 4), OP_MS, k->err,
                                          sizeof k->err)
                          : ops->poll(c, peer, OP_MS, k->err, sizeof k->err);
        int64_t el = now_ms() - t0;
        if (rc != -1) return body_fail(k, "%s after abort returned %d", what[i], rc);
        if (!strstr(k->err, WHY)) return body_fail(k, "%s after abort: \"%s\"", what[i], k->err);
        if (el > 100) return body_fail(k, "%s after abort took %lld ms", what[i], (long long)el);
    }
    return 0;
}

static int abort_body(rank_ctx_t *k)
{
    if (k->rank == 1) return 0;     /* the peer that is never heard from */
    ops->abort(k->comm, WHY);
    return aborted_ops_fail(k, k->comm);
}

static void test_after_abort_every_operation_fails_at_once_with_the_reason(void **state)
{
    (void)state;
    group_t g;
    group_open(&g, 2);
    group_run(&g, abort_body, NULL);
    group_expect_ok(&g);
    group_close(&g);

    /* A group of one, which would otherwise have nothing to do. */
    char err[256];
    rank_ctx_t k = {0};
    tsr_comm_t *c = tsr_tcp_comm_new(NULL, 1, 1, 0, 1, NULL, 300, err, sizeof err);
    assert_non_null(c);
    ops->abort(c, WHY);
    if (aborted_ops_fail(&k, c)) fail_msg("%s", k.err);
    ops->destroy(&c);
}

/* ---- create from a rendezvous blob ------------------------------------------------ */

static void test_create_refuses_a_blob_naming_fewer_endpoints_than_ranks(void **state)
{
    (void)state;
    group_t g;
    char err[512], blob[256];
    group_open(&g, 3);
    size_t len = make_blob(blob, sizeof blob, g.eps, 2);
    tsr_rendezvous_t rv = {.epoch = 1, .group = 1, .rank = 0, .n = 3, .blob = blob,
                           .blob_len = len, .timeout_ms = FORM_MS};
    tsr_comm_t *c = NULL;
    int64_t t0 = now_ms();
    err[0] = '\0';
    assert_int_equal(ops->create(&(tsr_coll_ctx_t){.listener = g.l[0]}, &rv, &c, err, sizeof err), -1);
    assert_null(c);
    if (!strstr(err, "2 endpoint(s) for a group of 3")) fail_msg("%s", err);
    /* Empty lines name nobody. */
    len = (size_t)snprintf(blob, sizeof blob, "%s\n\n%s\n", g.eps[0], g.eps[1]);
    rv.blob_len = len;
    err[0] = '\0';
    assert_int_equal(ops->create(&(tsr_coll_ctx_t){.listener = g.l[0]}, &rv, &c, err, sizeof err), -1);
    if (!strstr(err, "2 endpoint(s) for a group of 3")) fail_msg("%s", err);
    rv.blob_len = 0;
    assert_int_equal(ops->create(&(tsr_coll_ctx_t){.listener = g.l[0]}, &rv, &c, err, sizeof err), -1);
    if (!strstr(err, "0 endpoint(s) for a group of 3")) fail_msg("%s", err);
    assert_null(c);
    /* Refused on sight, not after waiting for the peers. */
    assert_true(now_ms() - t0 < 100);
    group_close(&g);
}

static void test_create_from_a_blob_forms_a_working_group(void **state)
{
    (void)state;
    for (int n = 1; n <= MAXR; n++) {
        group_t g;
        group_open(&g, n);
        g.via_create = true;
        group_run(&g, sync_body, NULL);
        group_expect_ok(&g);
        for (int r = 0; r < n; r++) {
            assert_int_equal(ops->rank(g.k[r].comm), r);
            assert_int_equal(ops->size(g.k[r].comm), n);
        }
        group_close(&g);
    }
    /* A blob ending in a newline and a group of one without a listener
     * (create needs the listener even then, as its ctx). */
    group_t g;
    char err[512], blob[256];
    group_open(&g, 1);
    size_t len = (size_t)snprintf(blob, sizeof blob, "%s\n", g.eps[0]);
    tsr_rendezvous_t rv = {.epoch = 1, .group = 1, .rank = 0, .n = 1, .blob = blob,
                           .blob_len = len, .timeout_ms = FORM_MS};
    tsr_comm_t *c = NULL;
    if (ops->create(&(tsr_coll_ctx_t){.listener = g.l[0]}, &rv, &c, err, sizeof err)) fail_msg("%s", err);
    assert_non_null(c);
    ops->destroy(&c);
    assert_int_equal(ops->create(NULL, &rv, &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "listener"));
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
    int32_t got;
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
    if (ops->allreduce_sum(w->tp, f32_buf(&w->sum, 1), OP_MS, w->err, sizeof w->err)) return NULL;
    int32_t token = 0xfeed;
    if (w->worker == 2 &&
        tsr_coll_send(ops, w->link, 0, i32_buf(&token, 1), OP_MS, w->err, sizeof w->err))
        return NULL;
    if (w->worker == 0 &&
        tsr_coll_recv(ops, w->link, 1, i32_buf(&w->got, 1), OP_MS, w->err, sizeof w->err))
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
                                .body = sync_body, .rc = -1};
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
                          .eps = g.eps, .body = sync_body, .rc = -1};
    assert_int_equal(pthread_create(&g.th[0], NULL, rank_main, &g.k[0]), 0);

    int64_t t0 = now_ms();
    tsr_comm_t *stale = tsr_tcp_comm_new(g.l[1], 6, 5, 1, 2, g.eps, FORM_MS, err, sizeof err);
    assert_null(stale);
    assert_true(now_ms() - t0 < 1000);
    assert_non_null(strstr(err, "rank 0"));
    assert_non_null(strstr(err, "refused"));
    assert_non_null(strstr(err, "epoch 6 is older than its epoch 7"));

    g.k[1] = (rank_ctx_t){.rank = 1, .n = 2, .epoch = 7, .group = 5, .l = g.l[1],
                          .eps = g.eps, .body = sync_body, .rc = -1};
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
    float v = 2.5f, all = 0;
    assert_int_equal(ops->allreduce_sum(c, f32_buf(&v, 1), 100, err, sizeof err), 0);
    assert_true(v == 2.5f);
    assert_int_equal(ops->allgather(c, f32_buf(&v, 1), f32_buf(&all, 1), 100, err, sizeof err),
                     0);
    assert_true(all == 2.5f);
    assert_int_equal(ops->broadcast(c, f32_buf(&v, 1), 0, 100, err, sizeof err), 0);
    assert_true(v == 2.5f);
    assert_int_equal(ops->group(c, NULL, 0, 100, err, sizeof err), 0);
    assert_int_equal(ops->size(c), 1);
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
    int rc = ops->allreduce_sum(k->comm, f32_buf(k->buf, count), DEAD_MS, k->err, sizeof k->err);
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
        /* a closed connection, not a deadline */
        assert_false(tsr_coll_past_deadline(ops, g.k[r].comm));
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
    int rc = ops->allreduce_sum(k->comm, f32_buf(v, 16), SILENT_MS, k->err, sizeof k->err);
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
        /* the coordinator names the rank that did not report this */
        assert_true(tsr_coll_past_deadline(ops, g.k[r].comm));
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
    int rc = b ? p2p_send(k, 1, b, len, 300) : body_fail(k, "out of memory");
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

static uint64_t get64(const uint8_t *p)
{
    uint32_t hi, lo;
    memcpy(&hi, p, 4), memcpy(&lo, p + 4, 4);
    return (uint64_t)ntohl(hi) << 32 | ntohl(lo);
}

/* The data port's wire format as a stranger sees it (collective_tcp.c):
 * the acceptor's challenge (magic, version, nonce), the connector's
 * handshake (36 bytes, its nonce, its HMAC) and the ack (magic, status,
 * detail, the acceptor's HMAC). */
#define T_CHAL_LEN 24
#define T_HS_BODY 36
#define T_HS_LEN (T_HS_BODY + 16 + 32)
#define T_ACK_LEN 48
#define T_HDR_LEN 32
#define ACK_AUTH 8
/* The detail of the last ack raw_join_with read (an epoch, a group size). */
static uint64_t last_ack_detail;
/* tsr_tcp_comm_new's fixed secret (tests only). */
static const uint8_t COMM_NEW_SECRET[32] = "tessera test secret, not secret";

static int raw_connect(const char *ep)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(
                                                       strchr(ep, ':') + 1))};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct timeval tv = {3, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

/* Sends a complete handshake (hs: T_HS_LEN bytes) after the challenge;
 * returns the ack's status. */
static uint32_t raw_handshake(int fd, const uint8_t *hs)
{
    uint8_t chal[T_CHAL_LEN], ack[T_ACK_LEN];
    assert_int_equal(recv(fd, chal, sizeof chal, MSG_WAITALL), (ssize_t)sizeof chal);
    assert_int_equal(send(fd, hs, T_HS_LEN, MSG_NOSIGNAL), (ssize_t)T_HS_LEN);
    assert_int_equal(recv(fd, ack, sizeof ack, MSG_WAITALL), (ssize_t)sizeof ack);
    uint32_t magic, status;
    memcpy(&magic, ack, 4), memcpy(&status, ack + 4, 4);
    assert_int_equal(ntohl(magic), 0x54535243);
    return ntohl(status);
}

/* Joins rank 0's group as `rank` over a raw blocking socket, proving
 * `secret` (NULL: tsr_tcp_comm_new's); returns the fd, with *status the
 * acceptor's answer (0: accepted). */
static int raw_join_with(const char *ep, uint64_t epoch, uint64_t group, uint32_t rank,
                         uint32_t n, const uint8_t *secret, uint32_t *status)
{
    int fd = raw_connect(ep);
    uint8_t chal[T_CHAL_LEN], hs[T_HS_LEN], ack[T_ACK_LEN], m[1 + T_HS_BODY + 32 + 4];
    assert_int_equal(recv(fd, chal, sizeof chal, MSG_WAITALL), (ssize_t)sizeof chal);
    put32(hs, 0x54535243), put32(hs + 4, 2), put64(hs + 8, epoch), put64(hs + 16, group);
    put32(hs + 24, rank), put32(hs + 28, n), put32(hs + 32, 0);
    for (int i = 0; i < 16; i++) hs[T_HS_BODY + i] = (uint8_t)(rand() & 0xff);
    m[0] = 'C';
    memcpy(m + 1, hs, T_HS_BODY);
    memcpy(m + 1 + T_HS_BODY, chal + 8, 16);
    memcpy(m + 1 + T_HS_BODY + 16, hs + T_HS_BODY, 16);
    put32(m + 1 + T_HS_BODY + 32, 0);
    unsigned int ml = 32;
    const uint8_t *key = secret ? secret : COMM_NEW_SECRET;
    assert_non_null(HMAC(EVP_sha256(), key, 32, m, sizeof m, hs + T_HS_BODY + 16, &ml));
    assert_int_equal(send(fd, hs, sizeof hs, MSG_NOSIGNAL), (ssize_t)sizeof hs);
    assert_int_equal(recv(fd, ack, sizeof ack, MSG_WAITALL), (ssize_t)sizeof ack);
    uint32_t magic;
    memcpy(&magic, ack, 4), memcpy(status, ack + 4, 4);
    assert_int_equal(ntohl(magic), 0x54535243);
    *status = ntohl(*status);
    last_ack_detail = get64(ack + 8);
    return fd;
}

static int raw_join(const char *ep, uint64_t epoch, uint64_t group, uint32_t rank, uint32_t n,
                    uint32_t *status)
{
    return raw_join_with(ep, epoch, group, rank, n, NULL, status);
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
    int rc = !b ? body_fail(k, "out of memory")
             : gb->send ? p2p_send(k, 1, b, len, 300) : p2p_recv(k, 1, b, len, 2000);
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

/* ---- strangers on the data port (issue 7) ------------------------------------ */

static const uint8_t WRONG_SECRET[32] = "not the replica's secret at all";

static void *comm_new_thread(void *arg)
{
    rank_ctx_t *k = arg;
    if (k->secret)
        k->comm = tsr_tcp_comm_new_cancellable(k->l, k->epoch, k->group, k->rank, k->n, k->eps,
                                               k->secret, 32, FORM_MS, NULL, NULL, k->err,
                                               sizeof k->err);
    else
        k->comm = tsr_tcp_comm_new(k->l, k->epoch, k->group, k->rank, k->n, k->eps, FORM_MS,
                                   k->err, sizeof k->err);
    k->rc = !k->comm ? -1 : k->body ? k->body(k) : 0;
    return NULL;
}

/* secret: 32 bytes, or NULL for tsr_tcp_comm_new's fixed one. */
static void start_rank_with(group_t *g, int r, uint64_t epoch, const char **eps, body_fn body,
                            const uint8_t *secret)
{
    g->k[r] = (rank_ctx_t){.rank = r, .n = g->n, .epoch = epoch, .group = 1, .l = g->l[r],
                           .eps = eps, .body = body, .secret = secret, .rc = -1};
    assert_int_equal(pthread_create(&g->th[r], NULL, comm_new_thread, &g->k[r]), 0);
}

static void start_rank(group_t *g, int r, uint64_t epoch, const char **eps, body_fn body)
{
    start_rank_with(g, r, epoch, eps, body, NULL);
}

/* Issue 38, item 12: a handshake of another epoch was answered STALE or
 * EARLY with the rank's own epoch before its proof was looked at, so a
 * stranger learnt the current epoch.  A handshake proven with no secret the
 * rank knows gets the same answer at every epoch, carrying no number; the
 * honest rank then joins. */
static void test_a_stranger_learns_no_epoch_from_the_data_port(void **state)
{
    (void)state;
    group_t g;
    uint32_t st;
    group_open(&g, 2);
    start_rank(&g, 0, 7, g.eps, sync_body);
    const uint64_t epochs[] = {0, 6, 7, 8, 1ull << 40};
    for (size_t i = 0; i < sizeof epochs / sizeof epochs[0]; i++) {
        int fd = raw_join_with(g.eps[0], epochs[i], 1, 1, 2, WRONG_SECRET, &st);
        if (st != ACK_AUTH || last_ack_detail != 0)
            fail_msg("a stranger's handshake for epoch %llu got status %u, detail %llu",
                     (unsigned long long)epochs[i], st, (unsigned long long)last_ack_detail);
        close(fd);
    }
    start_rank(&g, 1, 7, g.eps, sync_body);
    for (int r = 0; r < 2; r++) pthread_join(g.th[r], NULL);
    group_expect_ok(&g);
    group_close(&g);
}

/* Peers of adjacent epochs, each holding its epoch's own secret as the
 * coordinator gives them out: a rank behind is told at once that it is
 * stale (the acceptor remembers the secret of the epoch it formed before),
 * and a rank ahead, whose secret the acceptor cannot know yet, is refused
 * without a number and keeps trying until the acceptor forms its epoch. */
static void test_peers_of_adjacent_epochs_are_told_or_retry(void **state)
{
    (void)state;
    static const uint8_t s7[32] = "the secret of epoch seven......", s8[32] = "the secret of epoch eight......",
                         s9[32] = "the secret of epoch nine.......";
    group_t g;
    char err[512];
    group_open(&g, 2);
    start_rank_with(&g, 0, 7, g.eps, sync_body, s7);
    start_rank_with(&g, 1, 7, g.eps, sync_body, s7);
    for (int r = 0; r < 2; r++) pthread_join(g.th[r], NULL);
    group_expect_ok(&g);
    for (int r = 0; r < 2; r++) ops->destroy(&g.k[r].comm);

    /* Rank 0 forms epoch 8; rank 1, still in 7, is told so at once. */
    start_rank_with(&g, 0, 8, g.eps, sync_body, s8);
    int64_t t0 = now_ms();
    tsr_comm_t *stale = tsr_tcp_comm_new_cancellable(g.l[1], 7, 1, 1, 2, g.eps, s7, sizeof s7,
                                                     FORM_MS, NULL, NULL, err, sizeof err);
    assert_null(stale);
    assert_true(now_ms() - t0 < 1000);
    if (!strstr(err, "epoch 7 is older than its epoch 8")) fail_msg("stale rank: %s", err);
    start_rank_with(&g, 1, 8, g.eps, sync_body, s8);
    for (int r = 0; r < 2; r++) pthread_join(g.th[r], NULL);
    group_expect_ok(&g);
    for (int r = 0; r < 2; r++) ops->destroy(&g.k[r].comm);

    /* Rank 1 is in epoch 9 while rank 0 still forms 8: refused, it retries
     * and joins once rank 0 forms 9. */
    start_rank_with(&g, 1, 9, g.eps, sync_body, s9);
    tsr_comm_t *old = tsr_tcp_comm_new_cancellable(g.l[0], 8, 1, 0, 2, g.eps, s8, sizeof s8, 500,
                                                   NULL, NULL, err, sizeof err);
    assert_null(old);
    if (!strstr(err, "refused a connection from rank 1 (epoch 9")) fail_msg("rank 0: %s", err);
    start_rank_with(&g, 0, 9, g.eps, sync_body, s9);
    for (int r = 0; r < 2; r++) pthread_join(g.th[r], NULL);
    group_expect_ok(&g);
    group_close(&g);
}

/* A stranger without the replica's secret is refused, whether it speaks the
 * protocol by hand or through this very code with another secret (which
 * keeps trying until its own deadline, as a rank ahead of the acceptor's
 * epoch must); the honest rank then joins and the group works. */
static void test_a_stranger_without_the_secret_cannot_join(void **state)
{
    (void)state;
    group_t g;
    uint32_t st;
    char err[512];
    group_open(&g, 2);
    start_rank(&g, 0, 1, g.eps, sync_body);
    int fd = raw_join_with(g.eps[0], 1, 1, 1, 2, WRONG_SECRET, &st);
    assert_int_equal(st, ACK_AUTH);
    close(fd);
    tsr_tcp_listener_t *sl = tsr_tcp_listen("127.0.0.1", 0, err, sizeof err);
    assert_non_null(sl);
    tsr_comm_t *stranger = tsr_tcp_comm_new_cancellable(sl, 1, 1, 1, 2, g.eps, WRONG_SECRET,
                                                        sizeof WRONG_SECRET, 500, NULL,
                                                        NULL, err, sizeof err);
    assert_null(stranger);
    if (!strstr(err, "does not prove the replica's secret")) fail_msg("stranger: %s", err);
    tsr_tcp_listener_destroy(&sl);
    /* Without a secret at all, no group of two is formed. */
    assert_null(tsr_tcp_comm_new_cancellable(g.l[1], 1, 1, 1, 2, g.eps, NULL, 0, FORM_MS, NULL,
                                             NULL, err, sizeof err));
    assert_non_null(strstr(err, "data-port secret"));
    start_rank(&g, 1, 1, g.eps, sync_body);
    pthread_join(g.th[0], NULL);
    pthread_join(g.th[1], NULL);
    group_expect_ok(&g);
    group_close(&g);
}

/* A man in the middle between rank 1 (the connector) and rank 0: forwards
 * both ways, records the first bytes rank 1 sends, and flips one bit at
 * byte flip_at of that direction (0: none). */
typedef struct {
    int lfd;
    char ep[64];
    const char *target;
    size_t flip_at;
    uint8_t rec[T_HS_LEN];
    size_t nrec;
    pthread_t th;
} proxy_t;

static void *proxy_main(void *arg)
{
    proxy_t *px = arg;
    struct pollfd lp = {px->lfd, POLLIN, 0};
    if (poll(&lp, 1, 5000) != 1) return NULL;
    int a = accept(px->lfd, NULL, NULL), b = raw_connect(px->target);
    size_t up = 0;
    uint8_t buf[65536];
    for (;;) {
        struct pollfd p[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
        if (poll(p, 2, 5000) <= 0) break;
        if (p[0].revents) {
            ssize_t r = recv(a, buf, sizeof buf, 0);
            if (r <= 0) break;
            for (ssize_t i = 0; i < r; i++, up++) {
                if (px->nrec < sizeof px->rec) px->rec[px->nrec++] = buf[i];
                if (px->flip_at && up == px->flip_at) buf[i] ^= 0x10;
            }
            if (send(b, buf, (size_t)r, MSG_NOSIGNAL) != r) break;
        }
        if (p[1].revents) {
            ssize_t r = recv(b, buf, sizeof buf, 0);
            if (r <= 0 || send(a, buf, (size_t)r, MSG_NOSIGNAL) != r) break;
        }
    }
    close(a);
    close(b);
    return NULL;
}

static void proxy_start(proxy_t *px, const char *target, size_t flip_at)
{
    *px = (proxy_t){.target = target, .flip_at = flip_at};
    struct sockaddr_in a = {.sin_family = AF_INET};
    socklen_t al = sizeof a;
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    px->lfd = socket(AF_INET, SOCK_STREAM, 0);
    assert_int_equal(bind(px->lfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(px->lfd, 4), 0);
    getsockname(px->lfd, (struct sockaddr *)&a, &al);
    snprintf(px->ep, sizeof px->ep, "127.0.0.1:%d", ntohs(a.sin_port));
    assert_int_equal(pthread_create(&px->th, NULL, proxy_main, px), 0);
}

static void proxy_stop(proxy_t *px)
{
    pthread_join(px->th, NULL);
    close(px->lfd);
}

#define FLIP_LEN 4096

static int flip_recv_body(rank_ctx_t *k)
{
    uint8_t *b = calloc(FLIP_LEN, 1);
    int rc = p2p_recv(k, 1, b, FLIP_LEN, OP_MS);
    free(b);
    if (rc == 0) return body_fail(k, "a frame with a flipped bit was accepted");
    if (!strstr(k->err, "fails its integrity check") || !strstr(k->err, "rank 1"))
        return -1;
    /* The communicator is broken, as after any other failure. */
    int32_t v = 1;
    if (ops->allreduce_sum(k->comm, i32_buf(&v, 1), OP_MS, k->err, sizeof k->err) == 0)
        return body_fail(k, "the communicator still works after a forged frame");
    return 0;
}

static int flip_send_body(rank_ctx_t *k)
{
    uint8_t *b = calloc(FLIP_LEN, 1);
    int rc = p2p_send(k, 0, b, FLIP_LEN, OP_MS);
    free(b);
    return rc;
}

/* One bit flipped on the wire, in a frame's payload, in its tag or in its
 * header, fails the receive with a message naming the sender. */
static void test_a_flipped_bit_in_a_frame_is_detected(void **state)
{
    (void)state;
    const size_t at[] = {T_HS_LEN + T_HDR_LEN + 100,          /* payload */
                         T_HS_LEN + T_HDR_LEN + FLIP_LEN + 3, /* tag */
                         T_HS_LEN + 6};                       /* header: the kind */
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) {
        group_t g;
        proxy_t px;
        group_open(&g, 2);
        proxy_start(&px, g.eps[0], at[i]);
        const char *via[2] = {px.ep, g.eps[1]};
        start_rank(&g, 0, 1, g.eps, flip_recv_body);
        start_rank(&g, 1, 1, via, flip_send_body);
        pthread_join(g.th[0], NULL);
        pthread_join(g.th[1], NULL);
        if (i < 2) {
            expect_ok(&g, 0);
        } else if (g.k[0].rc == 0) {
            fail_msg("a flipped header bit was accepted");
        }
        expect_ok(&g, 1);
        group_close(&g);
        proxy_stop(&px);
    }
}

/* A handshake recorded on the wire is refused when replayed: in a later
 * epoch, and in the same epoch on a new connection (the
 * acceptor's nonce differs, so the proof does not match). */
static void test_a_replayed_handshake_is_refused(void **state)
{
    (void)state;
    group_t g;
    proxy_t px;
    uint32_t st;
    group_open(&g, 2);
    proxy_start(&px, g.eps[0], 0);
    const char *via[2] = {px.ep, g.eps[1]};
    start_rank(&g, 0, 5, g.eps, sync_body);
    start_rank(&g, 1, 5, via, sync_body);
    pthread_join(g.th[0], NULL);
    pthread_join(g.th[1], NULL);
    group_expect_ok(&g);
    ops->destroy(&g.k[0].comm);
    ops->destroy(&g.k[1].comm);
    proxy_stop(&px);
    assert_int_equal(px.nrec, T_HS_LEN);

    start_rank(&g, 0, 6, g.eps, NULL);
    int fd = raw_connect(g.eps[0]);
    /* Its proof covers the old connection's nonce, so it proves nothing
     * here: refused as a stranger's, not told it is stale (issue 38). */
    assert_int_equal(raw_handshake(fd, px.rec), ACK_AUTH);
    close(fd);
    /* An honest rank 1 of epoch 6 still joins. */
    int ok = raw_join(g.eps[0], 6, 1, 1, 2, &st);
    assert_int_equal(st, 0);
    pthread_join(g.th[0], NULL);
    expect_ok(&g, 0);
    ops->destroy(&g.k[0].comm);
    close(ok);

    start_rank(&g, 0, 5, g.eps, NULL);
    fd = raw_connect(g.eps[0]);
    assert_int_equal(raw_handshake(fd, px.rec), ACK_AUTH);
    close(fd);
    ok = raw_join(g.eps[0], 5, 1, 1, 2, &st);
    assert_int_equal(st, 0);
    pthread_join(g.th[0], NULL);
    expect_ok(&g, 0);
    close(ok);
    group_close(&g);
}

/* Issue 7, attack 8: idle connections that never send a handshake used to
 * hold every accept slot.  20 of them do not keep a group from forming. */
static void test_twenty_idle_connections_do_not_block_forming(void **state)
{
    (void)state;
    group_t g;
    int idle[20];
    group_open(&g, 2);
    for (int i = 0; i < 20; i++) idle[i] = raw_connect(g.eps[0]);
    int64_t t0 = now_ms();
    start_rank(&g, 0, 1, g.eps, sync_body);
    sleep_ms(50);               /* rank 0 has accepted the idle ones first */
    for (int i = 0; i < 20; i++) {
        int extra = raw_connect(g.eps[0]);  /* and more keep coming */
        close(extra);
    }
    start_rank(&g, 1, 1, g.eps, sync_body);
    pthread_join(g.th[0], NULL);
    pthread_join(g.th[1], NULL);
    int64_t took = now_ms() - t0;
    group_expect_ok(&g);
    if (took > 1500) fail_msg("forming took %lld ms behind 20 idle connections", (long long)took);
    for (int i = 0; i < 20; i++) close(idle[i]);
    group_close(&g);
}

/* A pending handshake has a deadline: a rank that accepts nobody else
 * still drops an idle connection after 2 s (its peer would see EOF). */
static void test_an_idle_connection_is_dropped_after_two_seconds(void **state)
{
    (void)state;
    group_t g;
    group_open(&g, 2);
    int fd = raw_connect(g.eps[0]);
    g.k[0] = (rank_ctx_t){.rank = 0, .n = 2, .epoch = 1, .group = 1, .l = g.l[0], .eps = g.eps,
                          .rc = -1};
    assert_int_equal(pthread_create(&g.th[0], NULL, comm_new_thread, &g.k[0]), 0);
    uint8_t chal[T_CHAL_LEN], more;
    assert_int_equal(recv(fd, chal, sizeof chal, MSG_WAITALL), (ssize_t)sizeof chal);
    int64_t t0 = now_ms();
    assert_int_equal(recv(fd, &more, 1, 0), 0);     /* EOF, not the 3 s receive timeout */
    int64_t took = now_ms() - t0;
    if (took < 1800 || took > 2900) fail_msg("dropped after %lld ms", (long long)took);
    close(fd);
    pthread_join(g.th[0], NULL);    /* times out: rank 1 never came */
    assert_int_equal(g.k[0].rc, -1);
    assert_non_null(strstr(g.k[0].err, "sent no handshake within 2000 ms"));
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

/* Forms rank my_rank of 2 with a peer that never comes, through
 * tsr_tcp_comm_new_cancellable or through ops->create with the same flag. */
static tsr_comm_t *form_cancellable(bool via_create, tsr_tcp_listener_t *me, int my_rank,
                                    const char **eps, cancel_ctx_t *c, char *err, size_t errlen)
{
    if (!via_create)
        return tsr_tcp_comm_new_cancellable(me, 1, 77, my_rank, 2, eps, SECRET, sizeof SECRET,
                                            10000, cancel_flag, c, err, errlen);
    char blob[128];
    tsr_rendezvous_t rv = {.epoch = 1, .group = 77, .rank = my_rank, .n = 2, .blob = blob,
                           .timeout_ms = 10000, .cancelled = cancel_flag, .cancel_arg = c,
                           .secret = SECRET, .secret_len = sizeof SECRET};
    rv.blob_len = make_blob(blob, sizeof blob, eps, 2);
    tsr_comm_t *comm = NULL;
    return ops->create(&(tsr_coll_ctx_t){.listener = me}, &rv, &comm, err, errlen) ? NULL : comm;
}

/* A rank waiting for a peer that never forms (connecting side and
 * accepting side) gives up as soon as it is cancelled, not at its timeout. */
static void test_forming_can_be_cancelled_before_the_timeout(void **state)
{
    (void)state;
    char err[256];
    tsr_tcp_listener_t *silent = tsr_tcp_listen("127.0.0.1", 0, err, sizeof err);
    assert_non_null(silent);
    for (int via_create = 0; via_create < 2; via_create++)
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
            tsr_comm_t *comm = form_cancellable(via_create, me, my_rank, eps, &c, err,
                                                sizeof err);
            double took = mono_s() - t0;
            pthread_join(th, NULL);
            assert_null(comm);
            assert_non_null(strstr(err, "cancelled"));
            if (took > 1.5)
                fail_msg("%s rank %d: cancelled after %.2f s, timeout was 10 s",
                         via_create ? "create" : "comm_new", my_rank, took);
            tsr_tcp_listener_destroy(&me);
        }
    tsr_tcp_listener_destroy(&silent);
}

/* An operation waiting on a stalled peer ends soon after the epoch does
 * (the rendezvous's cancellation turns true), not at its deadline: a worker
 * lets go of an old epoch at once, whatever its peers do. */
typedef struct {
    sem_t release;
    cancel_ctx_t cancel;
} stalled_op_t;

static int stalled_op_body(rank_ctx_t *k)
{
    stalled_op_t *s = k->arg;
    if (k->rank == 1) {         /* connected, and then never takes part */
        sem_wait(&s->release);
        return 0;
    }
    float v[16] = {0};
    pthread_t th;
    pthread_create(&th, NULL, cancel_later, &s->cancel);    /* 200 ms from now */
    int64_t t0 = now_ms();
    int rc = ops->allreduce_sum(k->comm, f32_buf(v, 16), 10000, k->err, sizeof k->err);
    k->op_ms = now_ms() - t0;
    pthread_join(th, NULL);
    return rc == 0 ? -1 : 0;
}

static void test_an_operation_on_a_stalled_peer_ends_when_cancelled(void **state)
{
    (void)state;
    group_t g;
    stalled_op_t s;
    sem_init(&s.release, 0, 0);
    group_open(&g, 2);
    s.cancel = (cancel_ctx_t){g.l[0], 0};
    g.via_create = true;
    g.cancelled = cancel_flag;
    g.cancel_arg = &s.cancel;
    for (int r = 0; r < 2; r++) group_start(&g, r, stalled_op_body, &s);
    pthread_join(g.th[0], NULL);
    sem_post(&s.release);
    pthread_join(g.th[1], NULL);
    group_expect_ok(&g);
    if (!strstr(g.k[0].err, "allreduce (epoch 1) was abandoned: a newer epoch or a stop"))
        fail_msg("rank 0: %s", g.k[0].err);
    if (g.k[0].op_ms < 190 || g.k[0].op_ms > 1500)
        fail_msg("rank 0 let go %lld ms into a 10 s wait, cancelled at 200 ms",
                 (long long)g.k[0].op_ms);
    /* broken for good: the next operation fails at once with the reason */
    float v = 0;
    char err[256];
    assert_int_equal(ops->allreduce_sum(g.k[0].comm, f32_buf(&v, 1), 10000, err, sizeof err), -1);
    assert_non_null(strstr(err, "abandoned"));
    assert_false(tsr_coll_past_deadline(ops, g.k[0].comm));
    group_close(&g);
    sem_destroy(&s.release);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_allreduce_small_adds_in_rank_order_on_every_rank),
        cmocka_unit_test(test_allreduce_large_ring_is_exact_and_bit_identical),
        cmocka_unit_test(test_allreduce_of_i32_sums_exactly),
        cmocka_unit_test(test_allreduce_of_bf16_and_f16_sums_within_one_rounding_bit_identically),
        cmocka_unit_test(test_allreduce_of_device_memory_is_refused),
        cmocka_unit_test(test_allreduce_throughput_1M_floats_2_ranks),
        cmocka_unit_test(test_allgather_and_allreduce_wait_for_the_last_rank),
        cmocka_unit_test(test_allgather_puts_every_rank_part_in_rank_order),
        cmocka_unit_test(test_allgather_refuses_a_receive_buffer_of_the_wrong_count),
        cmocka_unit_test(test_broadcast_from_a_nonzero_root_reaches_every_rank),
        cmocka_unit_test(test_send_recv_8MiB_both_ways_at_once_does_not_deadlock),
        cmocka_unit_test(test_group_exchanges_4MiB_both_ways_in_one_call_without_deadlock),
        cmocka_unit_test(test_group_with_two_sends_to_one_peer_is_refused),
        cmocka_unit_test(test_recv_of_a_different_length_than_sent_fails),
        cmocka_unit_test(test_a_send_is_not_failed_by_another_rank_that_closed),
        cmocka_unit_test(test_a_closed_peer_is_named_by_worker_and_node),
        cmocka_unit_test(test_poll_says_when_a_message_waits_and_times_out_when_none),
        cmocka_unit_test(test_poll_on_a_closed_peer_returns_at_once),
        cmocka_unit_test(test_after_abort_every_operation_fails_at_once_with_the_reason),
        cmocka_unit_test(test_create_refuses_a_blob_naming_fewer_endpoints_than_ranks),
        cmocka_unit_test(test_create_from_a_blob_forms_a_working_group),
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
        cmocka_unit_test(test_a_stranger_without_the_secret_cannot_join),
        cmocka_unit_test(test_a_flipped_bit_in_a_frame_is_detected),
        cmocka_unit_test(test_a_replayed_handshake_is_refused),
        cmocka_unit_test(test_a_stranger_learns_no_epoch_from_the_data_port),
        cmocka_unit_test(test_peers_of_adjacent_epochs_are_told_or_retry),
        cmocka_unit_test(test_twenty_idle_connections_do_not_block_forming),
        cmocka_unit_test(test_an_idle_connection_is_dropped_after_two_seconds),
        cmocka_unit_test(test_forming_can_be_cancelled_before_the_timeout),
        cmocka_unit_test(test_an_operation_on_a_stalled_peer_ends_when_cancelled),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
