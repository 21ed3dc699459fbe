/* coll_nccl.c: the collectives table over NCCL's function table (coll_nccl.h).
 * Plain C: it builds in every configuration; only the real table needs
 * libnccl. */
#include "worker/coll_nccl.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include "common/util.h"

static const uint8_t MAGIC[8] = {'T', 'S', 'R', 'N', 'C', 'C', 'L', '1'};

struct tsr_comm {
    const tsr_nccl_api_t *api;
    void *stream;               /* the engine's */
    int poll_us;
    void *comm;                 /* NULL once aborted or destroyed */
    int rank, n;
    uint64_t epoch;
    int (*cancelled)(void *arg);    /* the rendezvous's: a newer epoch ends a wait too */
    void *cancel_arg;
    bool failed;
    bool past_deadline;         /* the first failure was an operation's deadline */
    char why[512];              /* the first failure: every later operation reports it */
    const char *pending;        /* the last operation issued and not yet settled, or NULL */
};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

int tsr_nccl_blob_make(const tsr_nccl_api_t *api, uint64_t epoch, uint64_t group, int n,
                       uint8_t blob[TSR_NCCL_BLOB_BYTES], char *err, size_t errlen)
{
    uint8_t id[TSR_NCCL_ID_BYTES];
    if (api->get_unique_id(id) != TSR_NCCL_OK) {
        tsr_set_err(err, errlen, "ncclGetUniqueId failed: %s", api->last_error(NULL));
        return -1;
    }
    memcpy(blob, MAGIC, 8);
    put64(blob + 8, epoch);
    put64(blob + 16, group);
    for (int i = 0; i < 4; i++) blob[24 + i] = (uint8_t)((uint32_t)n >> (8 * i));
    memcpy(blob + 28, id, TSR_NCCL_ID_BYTES);
    return 0;
}

static int poll_us(const tsr_comm_t *c) { return c->poll_us > 0 ? c->poll_us : 1000; }

/* Between two polls of an operation: the first turns only yield (most
 * operations end within microseconds), then the wait grows to poll_us. */
static void pause_turn(const tsr_comm_t *c, int turn)
{
    if (turn < 64) {
        sched_yield();
        return;
    }
    int us = 10 << (turn - 64 < 7 ? turn - 64 : 7);
    usleep((useconds_t)(us < poll_us(c) ? us : poll_us(c)));
}

/* Aborts c for why (kept as its failure) and copies why into err. */
static int fail(tsr_comm_t *c, char *err, size_t errlen, const char *why)
{
    if (!c->failed) {
        c->failed = true;
        snprintf(c->why, sizeof c->why, "%s", why);
        if (c->comm) c->api->comm_abort(c->comm);
        c->comm = NULL;
    }
    tsr_set_err(err, errlen, "%s", c->why);
    return -1;
}

/* Who the operation waited for: the peer in a pair, else the others. */
static void peers_text(const tsr_comm_t *c, char *buf, size_t len)
{
    if (c->n == 2) snprintf(buf, len, "rank %d", 1 - c->rank);
    else snprintf(buf, len, "one of the other %d ranks", c->n - 1);
}

static int nccl_create(void *ctx, const tsr_rendezvous_t *rv, tsr_comm_t **out, char *err,
                       size_t errlen)
{
    const tsr_coll_ctx_t *x = ctx;
    if (!x || !x->nccl) {
        tsr_set_err(err, errlen, "the NCCL backend was given no NCCL context");
        return -1;
    }
    const uint8_t *b = rv->blob;
    if (!b || rv->blob_len != TSR_NCCL_BLOB_BYTES || memcmp(b, MAGIC, 8)) {
        tsr_set_err(err, errlen, "the rendezvous blob (%zu bytes) is not an NCCL one", rv->blob_len);
        return -1;
    }
    uint64_t epoch = get64(b + 8), group = get64(b + 16);
    uint64_t n = (uint64_t)b[24] | (uint64_t)b[25] << 8 | (uint64_t)b[26] << 16 |
                 (uint64_t)b[27] << 24;
    if (epoch != rv->epoch) {
        tsr_set_err(err, errlen,
                    "the NCCL rendezvous blob is for epoch %llu; this group forms in epoch "
                    "%llu: refused",
                    (unsigned long long)epoch, (unsigned long long)rv->epoch);
        return -1;
    }
    if (group != rv->group || n != (uint64_t)rv->n) {
        tsr_set_err(err, errlen,
                    "the NCCL rendezvous blob is for another group (%llu ranks, group %llx; "
                    "this one has %d ranks, group %llx): refused",
                    (unsigned long long)n, (unsigned long long)group, rv->n,
                    (unsigned long long)rv->group);
        return -1;
    }
    if (rv->rank < 0 || rv->rank >= rv->n) {
        tsr_set_err(err, errlen, "rank %d is outside a group of %d", rv->rank, rv->n);
        return -1;
    }
    tsr_comm_t *c = calloc(1, sizeof *c);
    if (!c) {
        tsr_set_err(err, errlen, "out of memory");
        return -1;
    }
    c->api = x->nccl;
    c->stream = x->stream;
    c->poll_us = x->poll_us;
    c->rank = rv->rank;
    c->n = rv->n;
    c->epoch = rv->epoch;
    c->cancelled = rv->cancelled;
    c->cancel_arg = rv->cancel_arg;
    char why[512];
    if (x->nccl->comm_init(&c->comm, rv->n, b + 28, rv->rank, x->device) == TSR_NCCL_ERROR) {
        tsr_set_err(err, errlen, "ncclCommInitRankConfig (rank %d of %d, epoch %llu) failed: %s",
                    rv->rank, rv->n, (unsigned long long)rv->epoch,
                    x->nccl->last_error(c->comm));
        /* NCCL may have made the communicator before it failed: it is let go of too */
        if (c->comm) x->nccl->comm_abort(c->comm);
        free(c);
        return -1;
    }
    int64_t deadline = now_ms() + rv->timeout_ms;
    int st;
    while ((st = x->nccl->comm_status(c->comm)) == TSR_NCCL_IN_PROGRESS) {
        if (rv->cancelled && rv->cancelled(rv->cancel_arg)) {
            snprintf(why, sizeof why,
                     "forming the NCCL group (rank %d of %d, epoch %llu) was cancelled: a "
                     "newer epoch or a stop",
                     rv->rank, rv->n, (unsigned long long)rv->epoch);
            goto failed;
        }
        if (now_ms() >= deadline) {
            snprintf(why, sizeof why,
                     "the NCCL group (rank %d of %d, epoch %llu) did not form within %d ms",
                     rv->rank, rv->n, (unsigned long long)rv->epoch, rv->timeout_ms);
            goto failed;
        }
        usleep((useconds_t)poll_us(c));
    }
    if (st == TSR_NCCL_ERROR) {
        snprintf(why, sizeof why, "the NCCL group (rank %d of %d, epoch %llu) failed to form: %s",
                 rv->rank, rv->n, (unsigned long long)rv->epoch, x->nccl->last_error(c->comm));
        goto failed;
    }
    *out = c;
    return 0;
failed:
    fail(c, err, errlen, why);
    free(c);
    return -1;
}

/* The failure for a wait on what was issued that passed its deadline or
 * was cancelled; 0 while it may go on. */
static int wait_turn(tsr_comm_t *c, const char *what, int64_t deadline, int timeout_ms,
                     char *err, size_t errlen)
{
    char why[512], who[64];
    if (c->cancelled && c->cancelled(c->cancel_arg)) {
        snprintf(why, sizeof why,
                 "NCCL %s (rank %d of %d, epoch %llu) was abandoned: a newer epoch or a stop",
                 what, c->rank, c->n, (unsigned long long)c->epoch);
        return fail(c, err, errlen, why);
    }
    if (now_ms() >= deadline) {
        peers_text(c, who, sizeof who);
        snprintf(why, sizeof why,
                 "NCCL %s (rank %d of %d, epoch %llu) did not complete within %d ms: %s "
                 "is dead or stalled",
                 what, c->rank, c->n, (unsigned long long)c->epoch, timeout_ms, who);
        if (!c->failed) c->past_deadline = true;
        return fail(c, err, errlen, why);
    }
    return 0;
}

static bool usable(tsr_comm_t *c, char *err, size_t errlen)
{
    if (!c->failed) return true;
    tsr_set_err(err, errlen, "%s", c->why);
    return false;
}

/* Polls NCCL's asynchronous error (ncclCommGetAsyncError), and with
 * with_stream the stream too, against the deadline and the epoch, until
 * the communicator is done issuing `what` (and the stream has run all that
 * was issued).  0 then; else the communicator fails and -1. */
static int poll_done(tsr_comm_t *c, const char *what, bool with_stream, int timeout_ms,
                     char *err, size_t errlen)
{
    const tsr_nccl_api_t *api = c->api;
    char why[512];
    int64_t deadline = now_ms() + timeout_ms;
    for (int turn = 0;; turn++) {
        int a = api->comm_status(c->comm);
        if (a == TSR_NCCL_ERROR) {
            snprintf(why, sizeof why, "NCCL reported an error during %s (rank %d of %d): %s",
                     what, c->rank, c->n, api->last_error(c->comm));
            return fail(c, err, errlen, why);
        }
        int s = TSR_NCCL_OK;
        if (with_stream && a == TSR_NCCL_OK) s = api->stream_query(c->stream);
        if (s == TSR_NCCL_ERROR) {
            snprintf(why, sizeof why, "a CUDA error during NCCL %s (rank %d of %d): %s", what,
                     c->rank, c->n, api->last_error(NULL));
            return fail(c, err, errlen, why);
        }
        if (a == TSR_NCCL_OK && s == TSR_NCCL_OK) return 0;
        if (wait_turn(c, what, deadline, timeout_ms, err, errlen) < 0) return -1;
        pause_turn(c, turn);
    }
}

/* Waits until the operation just enqueued (st: the enqueue's status) is
 * issued: a non-blocking communicator may answer ncclInProgress and go on
 * issuing it in the background.  Not for its completion: that is settle's,
 * so the host does not wait on the stream once per operation. */
static int issued(tsr_comm_t *c, const char *what, int st, int timeout_ms, char *err,
                  size_t errlen)
{
    if (st == TSR_NCCL_ERROR) {
        char why[512];
        snprintf(why, sizeof why, "NCCL %s (rank %d of %d) could not be issued: %s", what,
                 c->rank, c->n, c->api->last_error(c->comm));
        return fail(c, err, errlen, why);
    }
    if (poll_done(c, what, false, timeout_ms, err, errlen) < 0) return -1;
    c->pending = what;
    return 0;
}

/* The watchdog of what was issued: waits, against the deadline and the
 * epoch, until the stream has run it all. */
static int nccl_settle(tsr_comm_t *c, int timeout_ms, char *err, size_t errlen)
{
    if (!usable(c, err, errlen)) return -1;
    if (!c->pending) return 0;
    if (poll_done(c, c->pending, true, timeout_ms, err, errlen) < 0) return -1;
    c->pending = NULL;
    return 0;
}

static int nccl_allreduce(tsr_comm_t *c, tsr_buf_t buf, int timeout_ms, char *err,
                          size_t errlen)
{
    if (!usable(c, err, errlen)) return -1;
    int st = c->api->allreduce_sum(c->comm, buf.ptr, buf.count, buf.dtype, c->stream);
    return issued(c, "all-reduce", st, timeout_ms, err, errlen);
}

static int nccl_allgather(tsr_comm_t *c, tsr_buf_t send, tsr_buf_t recv, int timeout_ms,
                          char *err, size_t errlen)
{
    if (!usable(c, err, errlen)) return -1;
    if (recv.count != send.count * (size_t)c->n || recv.dtype != send.dtype) {
        tsr_set_err(err, errlen, "all-gather of %zu elements into %zu (%d ranks)", send.count,
                    recv.count, c->n);
        return -1;
    }
    int st = c->api->allgather(c->comm, send.ptr, recv.ptr, send.count, send.dtype,
                                 c->stream);
    return issued(c, "all-gather", st, timeout_ms, err, errlen);
}

static int nccl_broadcast(tsr_comm_t *c, tsr_buf_t buf, int root, int timeout_ms, char *err,
                          size_t errlen)
{
    if (!usable(c, err, errlen)) return -1;
    if (root < 0 || root >= c->n) {
        tsr_set_err(err, errlen, "broadcast from rank %d in a group of %d", root, c->n);
        return -1;
    }
    int st = c->api->broadcast(c->comm, buf.ptr, buf.count, buf.dtype, root, c->stream);
    return issued(c, "broadcast", st, timeout_ms, err, errlen);
}

static int nccl_group(tsr_comm_t *c, const tsr_p2p_t *ops, int n, int timeout_ms, char *err,
                      size_t errlen)
{
    if (!usable(c, err, errlen)) return -1;
    for (int i = 0; i < n; i++)
        if (ops[i].peer < 0 || ops[i].peer >= c->n || ops[i].peer == c->rank) {
            tsr_set_err(err, errlen, "send/recv with rank %d from rank %d of %d", ops[i].peer,
                        c->rank, c->n);
            return -1;
        }
    const tsr_nccl_api_t *api = c->api;
    int st = api->group_start();
    for (int i = 0; i < n && st == TSR_NCCL_OK; i++) {
        const tsr_buf_t *b = &ops[i].buf;
        st = ops[i].is_send
                 ? api->send(c->comm, b->ptr, b->count, b->dtype, ops[i].peer, c->stream)
                 : api->recv(c->comm, b->ptr, b->count, b->dtype, ops[i].peer, c->stream);
    }
    /* the group is always closed, or NCCL's next group would nest in it */
    if (api->group_end() != TSR_NCCL_OK) st = TSR_NCCL_ERROR;
    /* Settled here: the replica runner hands a stage's activations on and
     * takes the next ones without tracking the stream, so a pipeline link
     * keeps its wait (it is one per step, not one per layer). */
    if (issued(c, "send/recv", st, timeout_ms, err, errlen) < 0) return -1;
    return nccl_settle(c, timeout_ms, err, errlen);
}

/* NCCL has no way to wait for a peer's message without receiving it; the
 * replica's step headers travel on the host control channel instead. */
static int nccl_poll(tsr_comm_t *c, int peer, int timeout_ms, char *err, size_t errlen)
{
    (void)peer;
    (void)timeout_ms;
    if (!usable(c, err, errlen)) return -1;
    tsr_set_err(err, errlen, "the NCCL backend cannot poll; step headers use the control channel");
    return -1;
}

static void nccl_abort(tsr_comm_t *c, const char *why)
{
    char err[8];
    fail(c, err, sizeof err, why && *why ? why : "aborted");
}

static int nccl_rank(const tsr_comm_t *c) { return c->rank; }
static bool nccl_past_deadline(const tsr_comm_t *c) { return c->failed && c->past_deadline; }
static int nccl_size(const tsr_comm_t *c) { return c->n; }

static void nccl_destroy(tsr_comm_t **c_p)
{
    if (!c_p || !*c_p) return;
    tsr_comm_t *c = *c_p;
    if (c->comm) c->api->comm_abort(c->comm);   /* settled or not, never finalized */
    free(c);
    *c_p = NULL;
}

const tsr_coll_ops_t tsr_coll_nccl = {
    .name = "nccl",
    .mem = TSR_MEM_DEVICE,
    .create = nccl_create,
    .allreduce_sum = nccl_allreduce,
    .allgather = nccl_allgather,
    .broadcast = nccl_broadcast,
    .group = nccl_group,
    .poll = nccl_poll,
    .settle = nccl_settle,
    .abort = nccl_abort,
    .rank = nccl_rank,
    .size = nccl_size,
    .destroy = nccl_destroy,
    .past_deadline = nccl_past_deadline,
};
