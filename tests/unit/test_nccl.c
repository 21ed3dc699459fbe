/* test_nccl.c: the NCCL collectives backend (worker/coll_nccl.c) over the
 * fake NCCL of fake_nccl.h, ranks as threads: a group forms only from its
 * own epoch's blob, a newer epoch cancels a formation within 100 ms, a dead
 * peer ends an operation at its deadline with an abort that names the
 * peer, an asynchronous error aborts, and the next epoch forms again. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fake_nccl.h"

#define GROUP 0x1234

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* One rank: its context (with its own stream) and what it formed. */
typedef struct {
    fake_stream_t stream;
    tsr_coll_ctx_t ctx;
    tsr_rendezvous_t rv;
    tsr_comm_t *comm;
    int rc;
    char err[512];
    atomic_int *cancel;         /* formation gives up when it turns non-zero */
    int64_t returned_ms;
} rank_t;

static int cancelled(void *arg) { return atomic_load((atomic_int *)arg); }

static void rank_init(rank_t *r, const uint8_t *blob, uint64_t epoch, int rank, int n,
                      int timeout_ms)
{
    memset(r, 0, sizeof *r);
    r->ctx = (tsr_coll_ctx_t){.nccl = &fake_nccl, .stream = &r->stream, .poll_us = 200};
    r->rv = (tsr_rendezvous_t){.epoch = epoch, .group = GROUP, .rank = rank, .n = n,
                               .blob = blob, .blob_len = TSR_NCCL_BLOB_BYTES,
                               .timeout_ms = timeout_ms};
}

static void *form_thread(void *arg)
{
    rank_t *r = arg;
    if (r->cancel) {
        r->rv.cancelled = cancelled;
        r->rv.cancel_arg = r->cancel;
    }
    r->rc = tsr_coll_nccl.create(&r->ctx, &r->rv, &r->comm, r->err, sizeof r->err);
    r->returned_ms = mono_ms();
    return NULL;
}

/* Forms an n-rank group of epoch from a fresh blob: every rank succeeds.
 * cancel (NULL: none) is every rank's newer-epoch flag. */
static void form_group_c(rank_t *ranks, int n, uint64_t epoch, uint8_t *blob, atomic_int *cancel)
{
    char err[256];
    assert_int_equal(tsr_nccl_blob_make(&fake_nccl, epoch, GROUP, n, blob, err, sizeof err), 0);
    pthread_t th[FAKE_MAX_RANKS];
    for (int i = 0; i < n; i++) {
        rank_init(&ranks[i], blob, epoch, i, n, 5000);
        ranks[i].cancel = cancel;
        assert_int_equal(pthread_create(&th[i], NULL, form_thread, &ranks[i]), 0);
    }
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < n; i++) {
        if (ranks[i].rc) fail_msg("rank %d: %s", i, ranks[i].err);
        assert_int_equal(tsr_coll_nccl.rank(ranks[i].comm), i);
        assert_int_equal(tsr_coll_nccl.size(ranks[i].comm), n);
    }
}

static void form_group(rank_t *ranks, int n, uint64_t epoch, uint8_t *blob)
{
    form_group_c(ranks, n, epoch, blob, NULL);
}

/* ---- operations on many threads --------------------------------------------- */

typedef struct {
    rank_t *r;
    int n;
    float data[8], gathered[24], bcast[4];
    float p2p_in[4];
    int rc;
    char err[512];
} ops_arg_t;

static void *ops_thread(void *arg)
{
    ops_arg_t *a = arg;
    tsr_comm_t *c = a->r->comm;
    int me = tsr_coll_nccl.rank(c);
    for (int i = 0; i < 8; i++) a->data[i] = (float)(me * 10 + i);
    tsr_buf_t d = {a->data, 8, TSR_DT_F32, TSR_MEM_DEVICE};
    a->rc = tsr_coll_nccl.allreduce_sum(c, d, 2000, a->err, sizeof a->err);
    if (!a->rc) a->rc = tsr_coll_nccl.settle(c, 2000, a->err, sizeof a->err);
    if (a->rc) return NULL;
    float mine[8];
    for (int i = 0; i < 8; i++) mine[i] = (float)(100 * me + i);
    a->rc = tsr_coll_nccl.allgather(c, (tsr_buf_t){mine, 8, TSR_DT_F32, TSR_MEM_DEVICE},
                                    (tsr_buf_t){a->gathered, (size_t)(8 * a->n), TSR_DT_F32,
                                                TSR_MEM_DEVICE},
                                    2000, a->err, sizeof a->err);
    if (a->rc) return NULL;
    for (int i = 0; i < 4; i++) a->bcast[i] = me == 1 ? (float)(7 + i) : -1.0f;
    a->rc = tsr_coll_nccl.broadcast(c, (tsr_buf_t){a->bcast, 4, TSR_DT_F32, TSR_MEM_DEVICE}, 1,
                                    2000, a->err, sizeof a->err);
    /* one settle for the all-gather and the broadcast, as a step has one */
    if (!a->rc) a->rc = tsr_coll_nccl.settle(c, 2000, a->err, sizeof a->err);
    if (a->rc || a->n != 2) return NULL;
    /* an exchange: each rank sends its id and receives the other's */
    float out[4] = {(float)me, (float)me, (float)me, (float)me};
    tsr_p2p_t legs[2] = {{1 - me, true, {out, 4, TSR_DT_F32, TSR_MEM_DEVICE}},
                         {1 - me, false, {a->p2p_in, 4, TSR_DT_F32, TSR_MEM_DEVICE}}};
    a->rc = tsr_coll_nccl.group(c, legs, 2, 2000, a->err, sizeof a->err);
    return NULL;
}

static void run_ops(rank_t *ranks, int n, ops_arg_t *args)
{
    pthread_t th[FAKE_MAX_RANKS];
    for (int i = 0; i < n; i++) {
        memset(&args[i], 0, sizeof args[i]);
        args[i].r = &ranks[i];
        args[i].n = n;
        assert_int_equal(pthread_create(&th[i], NULL, ops_thread, &args[i]), 0);
    }
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

static void test_a_formed_group_sums_gathers_broadcasts_and_exchanges(void **state)
{
    (void)state;
    for (int n = 2; n <= 3; n++) {
        rank_t ranks[3];
        uint8_t blob[TSR_NCCL_BLOB_BYTES];
        ops_arg_t args[3];
        form_group(ranks, n, 5, blob);
        run_ops(ranks, n, args);
        for (int k = 0; k < n; k++) {
            if (args[k].rc) fail_msg("rank %d: %s", k, args[k].err);
            for (int i = 0; i < 8; i++) {
                float want = 0;
                for (int j = 0; j < n; j++) want += (float)(j * 10 + i);
                assert_true(args[k].data[i] == want);
            }
            for (int j = 0; j < n; j++)
                for (int i = 0; i < 8; i++)
                    assert_true(args[k].gathered[j * 8 + i] == (float)(100 * j + i));
            for (int i = 0; i < 4; i++) assert_true(args[k].bcast[i] == (float)(7 + i));
            if (n == 2)
                for (int i = 0; i < 4; i++) assert_true(args[k].p2p_in[i] == (float)(1 - k));
        }
        for (int k = 0; k < n; k++) tsr_coll_nccl.destroy(&ranks[k].comm);
    }
}

/* An operation NCCL is still issuing (ncclInProgress) is not done when the
 * stream is idle: the wait goes on until it has been issued and has run. */
static void test_an_operation_still_being_issued_is_waited_for(void **state)
{
    (void)state;
    rank_t ranks[2];
    uint8_t blob[TSR_NCCL_BLOB_BYTES];
    ops_arg_t args[2];
    form_group(ranks, 2, 60, blob);
    fake_inprogress_polls = 5;
    run_ops(ranks, 2, args);
    fake_inprogress_polls = 0;
    for (int k = 0; k < 2; k++) {
        if (args[k].rc) fail_msg("rank %d: %s", k, args[k].err);
        for (int i = 0; i < 8; i++) assert_true(args[k].data[i] == (float)(10 + 2 * i));
        for (int i = 0; i < 4; i++) assert_true(args[k].bcast[i] == (float)(7 + i));
        for (int i = 0; i < 4; i++) assert_true(args[k].p2p_in[i] == (float)(1 - k));
    }
    for (int k = 0; k < 2; k++) tsr_coll_nccl.destroy(&ranks[k].comm);
}

typedef struct {
    rank_t *r;
    int after_ms;
    float *x;
    int rc;
    char err[512];
} late_arg_t;

static void *late_allreduce(void *arg)
{
    late_arg_t *a = arg;
    usleep((useconds_t)a->after_ms * 1000);
    a->rc = tsr_coll_nccl.allreduce_sum(a->r->comm, (tsr_buf_t){a->x, 4, TSR_DT_F32, TSR_MEM_DEVICE},
                                        2000, a->err, sizeof a->err);
    if (!a->rc) a->rc = tsr_coll_nccl.settle(a->r->comm, 2000, a->err, sizeof a->err);
    return NULL;
}

/* An all-reduce returns once it is queued on the stream, before the peer
 * has even issued its own (the host does not wait once per operation), and
 * settle is the wait: it returns when the peer's half has come and the sum
 * is there.  On a host backend settle is nothing to wait for. */
static void test_an_operation_returns_once_queued_and_settle_waits_for_it(void **state)
{
    (void)state;
    rank_t ranks[2];
    uint8_t blob[TSR_NCCL_BLOB_BYTES];
    form_group(ranks, 2, 70, blob);
    float x0[4] = {1, 2, 3, 4}, x1[4] = {10, 20, 30, 40};
    late_arg_t late = {&ranks[1], 200, x1, -1, ""};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, late_allreduce, &late), 0);
    char err[512];
    int64_t t0 = mono_ms();
    assert_int_equal(tsr_coll_nccl.allreduce_sum(ranks[0].comm,
                                                 (tsr_buf_t){x0, 4, TSR_DT_F32, TSR_MEM_DEVICE},
                                                 2000, err, sizeof err),
                     0);
    int64_t queued = mono_ms() - t0;
    if (queued >= 150) fail_msg("the all-reduce returned after %lld ms: it waited for the peer",
                                (long long)queued);
    assert_true(x0[0] == 1.0f);   /* not run yet: the peer has not issued */
    if (tsr_coll_nccl.settle(ranks[0].comm, 2000, err, sizeof err)) fail_msg("settle: %s", err);
    int64_t settled = mono_ms() - t0;
    pthread_join(th, NULL);
    if (late.rc) fail_msg("rank 1: %s", late.err);
    assert_true(settled >= 190);
    for (int i = 0; i < 4; i++) assert_true(x0[i] == (float)(11 * (i + 1)) && x1[i] == x0[i]);
    /* nothing issued since: settle returns at once */
    t0 = mono_ms();
    assert_int_equal(tsr_coll_nccl.settle(ranks[0].comm, 2000, err, sizeof err), 0);
    assert_true(mono_ms() - t0 < 50);
    for (int k = 0; k < 2; k++) tsr_coll_nccl.destroy(&ranks[k].comm);
    assert_int_equal(tsr_coll_settle(&tsr_coll_tcp, NULL, 10, err, sizeof err), 0);
}

/* A blob made for another epoch, group or size is refused, naming both. */
static void test_a_group_forms_only_from_its_own_epochs_blob(void **state)
{
    (void)state;
    uint8_t blob[TSR_NCCL_BLOB_BYTES];
    char err[256];
    assert_int_equal(tsr_nccl_blob_make(&fake_nccl, 7, GROUP, 2, blob, err, sizeof err), 0);
    rank_t r;
    rank_init(&r, blob, 8, 0, 2, 1000);
    tsr_comm_t *c = NULL;
    assert_int_equal(tsr_coll_nccl.create(&r.ctx, &r.rv, &c, err, sizeof err), -1);
    assert_null(c);
    assert_non_null(strstr(err, "epoch 7"));
    assert_non_null(strstr(err, "epoch 8"));
    rank_init(&r, blob, 7, 0, 3, 1000);  /* another size */
    assert_int_equal(tsr_coll_nccl.create(&r.ctx, &r.rv, &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "another group"));
    rank_init(&r, blob, 7, 0, 2, 1000);
    r.rv.group = GROUP + 1;
    assert_int_equal(tsr_coll_nccl.create(&r.ctx, &r.rv, &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "another group"));
    r.rv.group = GROUP;
    r.rv.blob_len = 12;
    assert_int_equal(tsr_coll_nccl.create(&r.ctx, &r.rv, &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "not an NCCL one"));
}

/* One rank waits for a peer that never comes: a newer epoch (the cancel
 * callback) ends the formation within 100 ms; without one, the deadline. */
static void test_a_newer_epoch_cancels_a_formation_within_100_ms(void **state)
{
    (void)state;
    uint8_t blob[TSR_NCCL_BLOB_BYTES];
    char err[256];
    assert_int_equal(tsr_nccl_blob_make(&fake_nccl, 3, GROUP, 2, blob, err, sizeof err), 0);
    atomic_int cancel = 0;
    rank_t r;
    rank_init(&r, blob, 3, 0, 2, 60000);
    r.cancel = &cancel;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, form_thread, &r), 0);
    /* it is waiting (not returned) until the cancel */
    usleep(30 * 1000);
    assert_int_equal(r.returned_ms, 0);
    int64_t t0 = mono_ms();
    atomic_store(&cancel, 1);
    pthread_join(th, NULL);
    assert_int_equal(r.rc, -1);
    assert_true(r.returned_ms - t0 < 100);
    assert_non_null(strstr(r.err, "cancelled"));
    assert_null(r.comm);

    /* no cancel: the formation deadline */
    rank_init(&r, blob, 3, 0, 2, 50);
    int64_t t1 = mono_ms();
    form_thread(&r);
    assert_int_equal(r.rc, -1);
    assert_true(r.returned_ms - t1 >= 50);
    assert_non_null(strstr(r.err, "did not form within 50 ms"));
}

/* Rank 1 dies after the group formed: rank 0's all-reduce ends at its
 * deadline, aborted, naming rank 1; later operations fail at once with the
 * same reason; the next epoch's group forms and works. */
static void test_a_dead_peer_aborts_at_the_deadline_and_the_next_epoch_forms(void **state)
{
    (void)state;
    rank_t ranks[2];
    uint8_t blob[TSR_NCCL_BLOB_BYTES];
    form_group(ranks, 2, 10, blob);
    tsr_coll_nccl.abort(ranks[1].comm, "killed");  /* the peer's process is gone */
    tsr_coll_nccl.destroy(&ranks[1].comm);

    float x[4] = {1, 2, 3, 4};
    char err[512];
    /* issued at once; the wait for it (settle) is what ends at the deadline */
    int64_t t0 = mono_ms();
    assert_int_equal(tsr_coll_nccl.allreduce_sum(ranks[0].comm,
                                                 (tsr_buf_t){x, 4, TSR_DT_F32, TSR_MEM_DEVICE},
                                                 150, err, sizeof err),
                     0);
    int rc = tsr_coll_nccl.settle(ranks[0].comm, 150, err, sizeof err);
    int64_t took = mono_ms() - t0;
    assert_int_equal(rc, -1);
    assert_true(took >= 150 && took < 1000);
    assert_non_null(strstr(err, "did not complete within 150 ms"));
    assert_non_null(strstr(err, "rank 1 is dead or stalled"));
    /* what the worker tells the coordinator, which names the rank that reported nothing */
    assert_true(tsr_coll_past_deadline(&tsr_coll_nccl, ranks[0].comm));
    char err2[512];
    t0 = mono_ms();
    assert_int_equal(tsr_coll_nccl.broadcast(ranks[0].comm,
                                             (tsr_buf_t){x, 4, TSR_DT_F32, TSR_MEM_DEVICE}, 0,
                                             5000, err2, sizeof err2),
                     -1);
    assert_true(mono_ms() - t0 < 50);
    assert_string_equal(err2, err);
    assert_int_equal(tsr_coll_nccl.settle(ranks[0].comm, 5000, err2, sizeof err2), -1);
    assert_string_equal(err2, err);
    tsr_coll_nccl.destroy(&ranks[0].comm);

    ops_arg_t args[2];
    form_group(ranks, 2, 11, blob);
    run_ops(ranks, 2, args);
    for (int k = 0; k < 2; k++)
        if (args[k].rc) fail_msg("rank %d: %s", k, args[k].err);
    for (int k = 0; k < 2; k++) tsr_coll_nccl.destroy(&ranks[k].comm);
}

typedef struct {
    atomic_int *flag;
    int after_ms;
    int64_t at;                 /* when it flipped */
} flip_t;

static void *flip_thread(void *arg)
{
    flip_t *f = arg;
    usleep((useconds_t)f->after_ms * 1000);
    f->at = mono_ms();
    atomic_store(f->flag, 1);
    return NULL;
}

/* An operation waiting on a silent peer is abandoned, and the communicator
 * aborted, within 100 ms of a newer epoch (not at its 60 s deadline). */
static void test_a_newer_epoch_abandons_a_waiting_operation(void **state)
{
    (void)state;
    rank_t ranks[2];
    uint8_t blob[TSR_NCCL_BLOB_BYTES];
    atomic_int newer = 0;
    form_group_c(ranks, 2, 50, blob, &newer);
    flip_t f = {&newer, 30, 0};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, flip_thread, &f), 0);
    float x[4] = {0};
    char err[512];
    assert_int_equal(tsr_coll_nccl.allreduce_sum(ranks[0].comm,
                                                 (tsr_buf_t){x, 4, TSR_DT_F32, TSR_MEM_DEVICE},
                                                 60000, err, sizeof err),
                     0);
    int rc = tsr_coll_nccl.settle(ranks[0].comm, 60000, err, sizeof err);
    int64_t done = mono_ms();
    pthread_join(th, NULL);
    assert_int_equal(rc, -1);
    assert_true(done - f.at < 100);
    assert_non_null(strstr(err, "abandoned: a newer epoch"));
    assert_false(tsr_coll_past_deadline(&tsr_coll_nccl, ranks[0].comm));
    for (int k = 0; k < 2; k++) tsr_coll_nccl.destroy(&ranks[k].comm);
}

/* An asynchronous error (ncclCommGetAsyncError) ends the operation at once
 * and aborts; so does ops->abort from the executor. */
static void test_an_async_error_or_an_abort_fails_every_later_operation(void **state)
{
    (void)state;
    rank_t ranks[2];
    uint8_t blob[TSR_NCCL_BLOB_BYTES];
    form_group(ranks, 2, 20, blob);
    assert_true(fake_nccl_inject_error(blob + 28));
    float x[4] = {0};
    char err[512];
    int64_t t0 = mono_ms();
    assert_int_equal(tsr_coll_nccl.allreduce_sum(ranks[0].comm,
                                                 (tsr_buf_t){x, 4, TSR_DT_F32, TSR_MEM_DEVICE},
                                                 5000, err, sizeof err),
                     -1);
    assert_true(mono_ms() - t0 < 1000);
    assert_non_null(strstr(err, "NCCL reported an error during all-reduce"));
    assert_false(tsr_coll_past_deadline(&tsr_coll_nccl, ranks[0].comm));

    tsr_coll_nccl.abort(ranks[1].comm, "a newer epoch");
    assert_int_equal(tsr_coll_nccl.allreduce_sum(ranks[1].comm,
                                                 (tsr_buf_t){x, 4, TSR_DT_F32, TSR_MEM_DEVICE},
                                                 5000, err, sizeof err),
                     -1);
    assert_string_equal(err, "a newer epoch");
    assert_false(tsr_coll_past_deadline(&tsr_coll_nccl, ranks[1].comm));
    for (int k = 0; k < 2; k++) tsr_coll_nccl.destroy(&ranks[k].comm);
}

/* Each call of NCCL's that can fail fails once: the communicator names the call, aborts
 * what NCCL gave it (one made by an init that then failed included: NCCL may hand one
 * back with its error), fails every later operation, and the next group forms. */
static void test_every_nccl_error_is_named_and_aborts(void **state)
{
    (void)state;
    char err[512];
    uint8_t blob[TSR_NCCL_BLOB_BYTES];
    rank_t r;

    fake_fail_next = FAKE_FAIL_ID;
    assert_int_equal(tsr_nccl_blob_make(&fake_nccl, 30, GROUP, 1, blob, err, sizeof err), -1);
    assert_non_null(strstr(err, "ncclGetUniqueId failed"));

    unsigned long aborts = fake_count(&fake_aborts);
    assert_int_equal(tsr_nccl_blob_make(&fake_nccl, 30, GROUP, 1, blob, err, sizeof err), 0);
    rank_init(&r, blob, 30, 0, 1, 2000);
    fake_fail_next = FAKE_FAIL_INIT;
    assert_int_equal(tsr_coll_nccl.create(&r.ctx, &r.rv, &r.comm, err, sizeof err), -1);
    assert_non_null(strstr(err, "ncclCommInitRankConfig (rank 0 of 1, epoch 30) failed"));
    assert_null(r.comm);
    assert_int_equal(fake_count(&fake_aborts), aborts + 1);

    assert_int_equal(tsr_nccl_blob_make(&fake_nccl, 31, GROUP, 1, blob, err, sizeof err), 0);
    rank_init(&r, blob, 31, 0, 1, 2000);
    fake_fail_next = FAKE_FAIL_FORMING;
    int64_t t0 = mono_ms();
    assert_int_equal(tsr_coll_nccl.create(&r.ctx, &r.rv, &r.comm, err, sizeof err), -1);
    assert_true(mono_ms() - t0 < 1000);   /* the error, not the deadline, ended it */
    assert_non_null(strstr(err, "(rank 0 of 1, epoch 31) failed to form"));
    assert_int_equal(fake_count(&fake_aborts), aborts + 2);

    float x[4] = {1, 2, 3, 4};
    tsr_buf_t b = {x, 4, TSR_DT_F32, TSR_MEM_DEVICE};
    rank_t g[1];
    form_group(g, 1, 32, blob);
    fake_fail_next = FAKE_FAIL_ENQUEUE;
    assert_int_equal(tsr_coll_nccl.allreduce_sum(g[0].comm, b, 2000, err, sizeof err), -1);
    assert_non_null(strstr(err, "NCCL all-reduce (rank 0 of 1) could not be issued"));
    assert_int_equal(fake_count(&fake_aborts), aborts + 3);
    /* failed for good: later operations say why, and issue nothing */
    assert_int_equal(tsr_coll_nccl.broadcast(g[0].comm, b, 0, 2000, err, sizeof err), -1);
    assert_non_null(strstr(err, "could not be issued"));
    tsr_coll_nccl.destroy(&g[0].comm);
    assert_int_equal(fake_count(&fake_aborts), aborts + 3);   /* aborted once */

    form_group(g, 1, 33, blob);
    assert_int_equal(tsr_coll_nccl.allreduce_sum(g[0].comm, b, 2000, err, sizeof err), 0);
    fake_fail_next = FAKE_FAIL_STREAM;
    assert_int_equal(tsr_coll_nccl.settle(g[0].comm, 2000, err, sizeof err), -1);
    assert_non_null(strstr(err, "a CUDA error during NCCL all-reduce (rank 0 of 1)"));
    assert_int_equal(fake_count(&fake_aborts), aborts + 4);
    tsr_coll_nccl.destroy(&g[0].comm);

    /* and the next epoch forms and sums */
    form_group(g, 1, 34, blob);
    assert_int_equal(tsr_coll_nccl.allreduce_sum(g[0].comm, b, 2000, err, sizeof err), 0);
    assert_int_equal(tsr_coll_nccl.settle(g[0].comm, 2000, err, sizeof err), 0);
    assert_true(x[0] == 1.0f && x[3] == 4.0f);
    tsr_coll_nccl.destroy(&g[0].comm);
    assert_int_equal(fake_fail_next, FAKE_FAIL_NONE);
}

/* ---- the GPU chooser (tsr_coll_gpu) ------------------------------------------------ */

/* The coordinator's relay, in miniature: rank 0's blob, by group. */
static pthread_mutex_t mb_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t mb_cv = PTHREAD_COND_INITIALIZER;
static uint8_t mb_blob[256];
static size_t mb_len;
static uint64_t mb_group;

static int mb_exchange(void *arg, uint64_t group, const void *mine, size_t len, void *out,
                       size_t cap, size_t *out_len, int timeout_ms, char *err, size_t errlen)
{
    (void)arg;
    pthread_mutex_lock(&mb_mu);
    if (mine) {
        memcpy(mb_blob, mine, len);
        mb_len = len;
        mb_group = group;
        pthread_cond_broadcast(&mb_cv);
        pthread_mutex_unlock(&mb_mu);
        return 0;
    }
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
    if (dl.tv_nsec >= 1000000000) dl.tv_sec++, dl.tv_nsec -= 1000000000;
    while (!(mb_len && mb_group == group))
        if (pthread_cond_timedwait(&mb_cv, &mb_mu, &dl)) {
            pthread_mutex_unlock(&mb_mu);
            snprintf(err, errlen, "no blob for group %llx arrived", (unsigned long long)group);
            return -1;
        }
    assert_true(mb_len <= cap);
    memcpy(out, mb_blob, mb_len);
    *out_len = mb_len;
    pthread_mutex_unlock(&mb_mu);
    return 0;
}

typedef struct {
    tsr_coll_ctx_t ctx;
    fake_stream_t stream;
    tsr_rendezvous_t rv;
    tsr_comm_t *comm;
    float x[4];
    int rc;
    char err[512];
} gpu_rank_t;

static void *gpu_thread(void *arg)
{
    gpu_rank_t *g = arg;
    g->rc = tsr_coll_gpu.create(&g->ctx, &g->rv, &g->comm, g->err, sizeof g->err);
    if (g->rc) return NULL;
    for (int i = 0; i < 4; i++) g->x[i] = (float)(tsr_coll_gpu.rank(g->comm) + i);
    tsr_buf_t b = {g->x, 4, TSR_DT_F32, TSR_MEM_HOST};
    g->rc = tsr_coll_gpu.allreduce_sum(g->comm, b, 5000, g->err, sizeof g->err);
    if (!g->rc) g->rc = tsr_coll_settle(&tsr_coll_gpu, g->comm, 5000, g->err, sizeof g->err);
    return NULL;
}

/* Two ranks through the chooser with the given GPUs and NCCL (or none);
 * both must succeed with the sum.  Returns the backend rank 0 used. */
static const char *gpu_pair(const char *dev0, const char *dev1, const tsr_nccl_api_t *nccl,
                            uint64_t epoch)
{
    char err[256];
    tsr_tcp_listener_t *ls[2];
    char eps[256] = "";
    size_t len = 0;
    for (int i = 0; i < 2; i++) {
        ls[i] = tsr_tcp_listen("127.0.0.1", 0, err, sizeof err);
        if (!ls[i]) fail_msg("%s", err);
        len += (size_t)sprintf(eps + len, "%s\n", tsr_tcp_listener_endpoint(ls[i]));
    }
    const char *devs[2] = {dev0, dev1};
    static const uint8_t secret[32] = "chooser test data secret.......";
    gpu_rank_t g[2];
    pthread_t th[2];
    pthread_mutex_lock(&mb_mu);
    mb_len = 0;
    pthread_mutex_unlock(&mb_mu);
    for (int i = 0; i < 2; i++) {
        memset(&g[i], 0, sizeof g[i]);
        g[i].ctx = (tsr_coll_ctx_t){.listener = ls[i], .nccl = nccl,
                                    .nccl_why = "cannot load libnccl.so.2: not found",
                                    .stream = &g[i].stream, .poll_us = 200};
        g[i].rv = (tsr_rendezvous_t){.epoch = epoch, .group = GROUP, .rank = i, .n = 2,
                                     .blob = eps, .blob_len = len, .timeout_ms = 5000,
                                     .secret = secret, .secret_len = sizeof secret,
                                     .devices = devs, .exchange = mb_exchange};
        assert_int_equal(pthread_create(&th[i], NULL, gpu_thread, &g[i]), 0);
    }
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    static char kind[32];
    for (int i = 0; i < 2; i++) {
        if (g[i].rc) fail_msg("rank %d: %s", i, g[i].err);
        for (int k = 0; k < 4; k++) assert_true(g[i].x[k] == (float)(1 + 2 * k));
    }
    snprintf(kind, sizeof kind, "%s", tsr_coll_gpu_kind(g[0].comm));
    assert_string_equal(tsr_coll_gpu_kind(g[1].comm), kind);
    for (int i = 0; i < 2; i++) {
        tsr_coll_gpu.destroy(&g[i].comm);
        tsr_tcp_listener_destroy(&ls[i]);
    }
    return kind;
}

/* Distinct GPUs and NCCL: the group is NCCL's, its blob made by rank 0 and
 * relayed.  Two ranks on one GPU, a GPU not known, or no NCCL: the fallback
 * (here TCP), and the group still works. */
static void test_the_gpu_chooser_uses_nccl_only_where_a_group_can_have_it(void **state)
{
    (void)state;
    assert_string_equal(gpu_pair("h1/0000:1a:00.0", "h1/0000:1b:00.0", &fake_nccl, 30), "nccl");
    /* the same bus id on two machines is two GPUs */
    assert_string_equal(gpu_pair("h1/0000:1a:00.0", "h2/0000:1a:00.0", &fake_nccl, 34), "nccl");
    assert_string_equal(gpu_pair("h1/0000:1a:00.0", "h1/0000:1a:00.0", &fake_nccl, 31), "tcp");
    assert_string_equal(gpu_pair("h1/0000:1a:00.0", "", &fake_nccl, 32), "tcp");
    assert_string_equal(gpu_pair("h1/0000:1a:00.0", "h1/0000:1b:00.0", NULL, 33), "tcp");
}

/* A rank whose blob never comes fails at the rendezvous deadline, naming the
 * group; no communicator is left behind. */
static void test_a_missing_rendezvous_blob_fails_at_the_deadline(void **state)
{
    (void)state;
    pthread_mutex_lock(&mb_mu);
    mb_len = 0;
    pthread_mutex_unlock(&mb_mu);
    const char *devs[2] = {"0000:1a:00.0", "0000:1b:00.0"};
    gpu_rank_t g;
    memset(&g, 0, sizeof g);
    g.ctx = (tsr_coll_ctx_t){.nccl = &fake_nccl, .stream = &g.stream, .poll_us = 200};
    g.rv = (tsr_rendezvous_t){.epoch = 40, .group = GROUP, .rank = 1, .n = 2, .timeout_ms = 50,
                              .devices = devs, .exchange = mb_exchange};
    assert_int_equal(tsr_coll_gpu.create(&g.ctx, &g.rv, &g.comm, g.err, sizeof g.err), -1);
    assert_null(g.comm);
    assert_non_null(strstr(g.err, "no blob for group"));
}

/* A relay that changes what rank 0 published (the unique id's last byte)
 * or drops it. */
static int mb_mode;   /* 0: as mb_exchange, 1: altered, 2: dropped */
static int odd_exchange(void *arg, uint64_t group, const void *mine, size_t len, void *out,
                        size_t cap, size_t *out_len, int timeout_ms, char *err, size_t errlen)
{
    if (mine && mb_mode) {
        if (mb_mode == 2) return 0;
        uint8_t copy[256];
        memcpy(copy, mine, len);
        copy[len - 1] ^= 1;
        return mb_exchange(arg, group, copy, len, out, cap, out_len, timeout_ms, err, errlen);
    }
    return mb_exchange(arg, group, mine, len, out, cap, out_len, timeout_ms, err, errlen);
}

/* Rank 0 forms from the copy of its blob the coordinator relayed, as every
 * rank does: a group of one forms from it and its all-reduce is its own
 * buffer; a relayed blob that is not the one rank 0 made is refused, and
 * one that never comes back fails at the deadline. */
static void test_rank_0_forms_only_from_its_own_relayed_blob(void **state)
{
    (void)state;
    const char *devs[1] = {"h1/0000:1a:00.0"};
    for (mb_mode = 0; mb_mode < 3; mb_mode++) {
        pthread_mutex_lock(&mb_mu);
        mb_len = 0;
        pthread_mutex_unlock(&mb_mu);
        gpu_rank_t g;
        memset(&g, 0, sizeof g);
        g.ctx = (tsr_coll_ctx_t){.nccl = &fake_nccl, .stream = &g.stream, .poll_us = 200};
        g.rv = (tsr_rendezvous_t){.epoch = 50, .group = GROUP, .rank = 0, .n = 1,
                                  .timeout_ms = 50, .devices = devs, .exchange = odd_exchange};
        int rc = tsr_coll_gpu.create(&g.ctx, &g.rv, &g.comm, g.err, sizeof g.err);
        if (mb_mode == 0) {
            if (rc) fail_msg("%s", g.err);
            assert_string_equal(tsr_coll_gpu_kind(g.comm), "nccl");
            float x[3] = {1.5f, -2, 7};
            tsr_buf_t b = {x, 3, TSR_DT_F32, TSR_MEM_HOST};
            assert_int_equal(tsr_coll_gpu.allreduce_sum(g.comm, b, 1000, g.err, sizeof g.err), 0);
            assert_int_equal(tsr_coll_settle(&tsr_coll_gpu, g.comm, 1000, g.err, sizeof g.err), 0);
            assert_true(x[0] == 1.5f && x[1] == -2 && x[2] == 7);
            tsr_coll_gpu.destroy(&g.comm);
        } else {
            assert_int_equal(rc, -1);
            assert_null(g.comm);
            assert_non_null(strstr(g.err, mb_mode == 1 ? "not the one this rank made"
                                                       : "no blob for group"));
        }
    }
    mb_mode = 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_formed_group_sums_gathers_broadcasts_and_exchanges),
        cmocka_unit_test(test_a_group_forms_only_from_its_own_epochs_blob),
        cmocka_unit_test(test_an_operation_still_being_issued_is_waited_for),
        cmocka_unit_test(test_an_operation_returns_once_queued_and_settle_waits_for_it),
        cmocka_unit_test(test_a_newer_epoch_cancels_a_formation_within_100_ms),
        cmocka_unit_test(test_a_dead_peer_aborts_at_the_deadline_and_the_next_epoch_forms),
        cmocka_unit_test(test_an_async_error_or_an_abort_fails_every_later_operation),
        cmocka_unit_test(test_a_newer_epoch_abandons_a_waiting_operation),
        cmocka_unit_test(test_every_nccl_error_is_named_and_aborts),
        cmocka_unit_test(test_the_gpu_chooser_uses_nccl_only_where_a_group_can_have_it),
        cmocka_unit_test(test_a_missing_rendezvous_blob_fails_at_the_deadline),
        cmocka_unit_test(test_rank_0_forms_only_from_its_own_relayed_blob),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
