/* test_coll_staged.c: the host-staged collectives (worker/cuda/coll_staged.c)
 * copy a device buffer to host memory before the TCP operation and back
 * after it, exactly once each way and only where needed, over two ranks on
 * loopback.  No GPU: the copies are a memcpy put in place of the CUDA
 * runtime's (tsr_coll_staged_test_copy), which counts them per rank.  Built
 * without CUDA, there is nothing to test and it says so. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "worker/collective.h"

#ifdef TSR_HAVE_CUDA
#include "worker/cuda/cuda.h"

enum { N = 2, COUNT = 1000, FORM_MS = 3000, OP_MS = 5000 };
static const uint8_t SECRET[32] = "test_coll_staged data secret...";

/* Per rank thread: copies made and their bytes, each way. */
static __thread int to_host, to_dev;
static __thread size_t host_bytes, dev_bytes;
static bool fail_copies;

static int fake_copy(void *dst, const void *src, size_t bytes, int to_device, char *err,
                     size_t errlen)
{
    if (fail_copies) {
        tsr_set_err(err, errlen, "injected copy failure");
        return -1;
    }
    memcpy(dst, src, bytes);
    if (to_device) to_dev++, dev_bytes += bytes;
    else to_host++, host_bytes += bytes;
    return 0;
}

typedef struct rank rank_t;
typedef int (*body_fn)(rank_t *k, tsr_comm_t *c);
struct rank {
    int rank;
    tsr_tcp_listener_t *l;
    const char *eps[N];
    body_fn body;
    int rc;
    char err[512];
    int to_host, to_dev;
    size_t host_bytes, dev_bytes;
    float out[N * COUNT];
};

static tsr_buf_t dev_f32(float *p, size_t n) { return (tsr_buf_t){p, n, TSR_DT_F32, TSR_MEM_DEVICE}; }

static void *rank_main(void *arg)
{
    rank_t *k = arg;
    char blob[256];
    size_t len = (size_t)snprintf(blob, sizeof blob, "%s\n%s", k->eps[0], k->eps[1]);
    tsr_rendezvous_t rv = {.epoch = 1, .group = 1, .rank = k->rank, .n = N, .blob = blob,
                           .blob_len = len, .timeout_ms = FORM_MS, .secret = SECRET,
                           .secret_len = sizeof SECRET};
    tsr_comm_t *c = NULL;
    k->rc = tsr_coll_staged.create(&(tsr_coll_ctx_t){.listener = k->l}, &rv, &c, k->err,
                                   sizeof k->err);
    if (k->rc == 0) k->rc = k->body(k, c);
    k->to_host = to_host, k->to_dev = to_dev;
    k->host_bytes = host_bytes, k->dev_bytes = dev_bytes;
    tsr_coll_staged.destroy(&c);
    return NULL;
}

static void run(rank_t *k, body_fn body)
{
    char err[256];
    tsr_tcp_listener_t *l[N];
    pthread_t th[N];
    for (int r = 0; r < N; r++) {
        l[r] = tsr_tcp_listen("127.0.0.1", 0, err, sizeof err);
        if (!l[r]) fail_msg("%s", err);
    }
    for (int r = 0; r < N; r++) {
        memset(&k[r], 0, sizeof k[r]);
        k[r].rank = r, k[r].l = l[r], k[r].body = body, k[r].rc = -1;
        for (int i = 0; i < N; i++) k[r].eps[i] = tsr_tcp_listener_endpoint(l[i]);
    }
    for (int r = 0; r < N; r++) assert_int_equal(pthread_create(&th[r], NULL, rank_main, &k[r]), 0);
    for (int r = 0; r < N; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < N; r++) tsr_tcp_listener_destroy(&l[r]);
}

/* run, and every rank formed its group and its body succeeded. */
static void run_ok(rank_t *k, body_fn body)
{
    run(k, body);
    for (int r = 0; r < N; r++)
        if (k[r].rc) fail_msg("rank %d: %s", r, k[r].err);
}

/* Rank r copied to the host `th` times (hb bytes) and to the device `td`
 * times (db bytes). */
static void expect_copies(const rank_t *k, int th, size_t hb, int td, size_t db)
{
    assert_int_equal(k->to_host, th);
    assert_int_equal(k->host_bytes, hb);
    assert_int_equal(k->to_dev, td);
    assert_int_equal(k->dev_bytes, db);
}

static float val(int rank, int i) { return (float)(rank * 1000 + i) * 0.5f; }

static int allreduce_body(rank_t *k, tsr_comm_t *c)
{
    for (int i = 0; i < COUNT; i++) k->out[i] = val(k->rank, i);
    return tsr_coll_staged.allreduce_sum(c, dev_f32(k->out, COUNT), OP_MS, k->err, sizeof k->err);
}

static void test_a_device_allreduce_is_copied_out_and_back_once(void **state)
{
    (void)state;
    static rank_t k[N];
    run_ok(k, allreduce_body);
    for (int r = 0; r < N; r++) {
        for (int i = 0; i < COUNT; i++) assert_true(k[r].out[i] == val(0, i) + val(1, i));
        expect_copies(&k[r], 1, COUNT * sizeof(float), 1, COUNT * sizeof(float));
    }
}

static int host_body(rank_t *k, tsr_comm_t *c)
{
    for (int i = 0; i < COUNT; i++) k->out[i] = val(k->rank, i);
    return tsr_coll_staged.allreduce_sum(c, tsr_host_buf(k->out, COUNT, TSR_DT_F32), OP_MS,
                                         k->err, sizeof k->err);
}

static void test_a_host_buffer_is_not_copied(void **state)
{
    (void)state;
    static rank_t k[N];
    run_ok(k, host_body);
    for (int r = 0; r < N; r++) {
        assert_true(k[r].out[7] == val(0, 7) + val(1, 7));
        expect_copies(&k[r], 0, 0, 0, 0);
    }
}

/* The receive side of an all-gather is only written: it is not read from
 * the device first. */
static int allgather_body(rank_t *k, tsr_comm_t *c)
{
    static __thread float mine[COUNT];
    for (int i = 0; i < COUNT; i++) mine[i] = val(k->rank, i);
    return tsr_coll_staged.allgather(c, dev_f32(mine, COUNT), dev_f32(k->out, N * COUNT), OP_MS,
                                     k->err, sizeof k->err);
}

static void test_a_device_allgather_reads_only_the_send_side(void **state)
{
    (void)state;
    static rank_t k[N];
    run_ok(k, allgather_body);
    for (int r = 0; r < N; r++) {
        for (int s = 0; s < N; s++)
            for (int i = 0; i < COUNT; i++) assert_true(k[r].out[s * COUNT + i] == val(s, i));
        expect_copies(&k[r], 1, COUNT * sizeof(float), 1, N * COUNT * sizeof(float));
    }
}

/* Rank 0 sends a device buffer and receives into a host one; rank 1 the
 * other way round: only the device legs are staged. */
static int group_body(rank_t *k, tsr_comm_t *c)
{
    static __thread float send[COUNT];
    for (int i = 0; i < COUNT; i++) send[i] = val(k->rank, i);
    tsr_p2p_t legs[2] = {
        {1 - k->rank, true, k->rank == 0 ? dev_f32(send, COUNT) : tsr_host_buf(send, COUNT, TSR_DT_F32)},
        {1 - k->rank, false, k->rank == 0 ? tsr_host_buf(k->out, COUNT, TSR_DT_F32) : dev_f32(k->out, COUNT)},
    };
    return tsr_coll_staged.group(c, legs, 2, OP_MS, k->err, sizeof k->err);
}

static void test_grouped_send_and_recv_stage_only_the_device_legs(void **state)
{
    (void)state;
    static rank_t k[N];
    run_ok(k, group_body);
    for (int r = 0; r < N; r++)
        for (int i = 0; i < COUNT; i++) assert_true(k[r].out[i] == val(1 - r, i));
    expect_copies(&k[0], 1, COUNT * sizeof(float), 0, 0);   /* its device send, before */
    expect_copies(&k[1], 0, 0, 1, COUNT * sizeof(float));   /* its device receive, after */
}

/* A failed copy fails the operation with the copy's reason. */
static void test_a_failed_copy_fails_the_operation_with_its_reason(void **state)
{
    (void)state;
    static rank_t k[N];
    fail_copies = true;
    run(k, allreduce_body);
    fail_copies = false;
    for (int r = 0; r < N; r++) {
        assert_int_equal(k[r].rc, -1);
        assert_non_null(strstr(k[r].err, "injected copy failure"));
    }
}

int main(void)
{
    tsr_coll_staged_test_copy(fake_copy);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_device_allreduce_is_copied_out_and_back_once),
        cmocka_unit_test(test_a_host_buffer_is_not_copied),
        cmocka_unit_test(test_a_device_allgather_reads_only_the_send_side),
        cmocka_unit_test(test_grouped_send_and_recv_stage_only_the_device_legs),
        cmocka_unit_test(test_a_failed_copy_fails_the_operation_with_its_reason),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
#else
static void test_nothing_to_stage_without_cuda(void **state)
{
    (void)state;
    skip();
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_nothing_to_stage_without_cuda)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
#endif
