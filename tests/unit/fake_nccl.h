/* fake_nccl.h: NCCL's function table (worker/coll_nccl.h) over host memory, for
 * tests on machines without a GPU.  Ranks are threads of the test process;
 * a group is found by its unique id.  Each rank's k-th operation on a
 * communicator is the group's round k, carried out when every rank has
 * issued it (every rank takes part in every round, p2p included, which is
 * how Tessera's two-rank pipeline links use it).  A rank that stops issuing
 * operations leaves its peers' rounds unfinished: a dead peer.  Only F32 and
 * I32 are summed. */
#ifndef TSR_FAKE_NCCL_H
#define TSR_FAKE_NCCL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "worker/coll_nccl.h"

#define FAKE_MAX_RANKS 8
#define FAKE_ROUNDS 16
#define FAKE_LEGS 8

enum { FAKE_AR, FAKE_AG, FAKE_BC, FAKE_SEND, FAKE_RECV };

typedef struct {
    int kind;
    void *a, *b;                /* the buffer (AR, BC, SEND, RECV); AG: send, recv */
    size_t count;
    tsr_dtype_t dt;
    int peer;                   /* SEND/RECV: the peer; BC: the root */
} fake_leg_t;

typedef struct fake_group {
    uint8_t id[TSR_NCCL_ID_BYTES];
    int n, joined, refs;
    bool error;
    uint64_t done;              /* rounds below this are carried out */
    uint64_t next[FAKE_MAX_RANKS];
    int arrived[FAKE_ROUNDS];
    fake_leg_t legs[FAKE_ROUNDS][FAKE_MAX_RANKS][FAKE_LEGS];
    int n_legs[FAKE_ROUNDS][FAKE_MAX_RANKS];
} fake_group_t;

typedef struct {
    fake_group_t *g;
    int rank;
    /* fake_inprogress_polls: an operation not yet issued (its legs wait
     * until comm_status has been asked that many times) */
    int deferred_polls, n_deferred;
    fake_leg_t deferred[FAKE_LEGS];
    void *deferred_stream;
} fake_comm_t;

/* Tests: every operation stays "being issued" (ncclInProgress, not yet on
 * its stream) for this many comm_status polls, as a non-blocking
 * communicator's may. */
static int fake_inprogress_polls;

/* A rank's stream: the last round it issued. */
typedef struct {
    fake_group_t *g;
    uint64_t round;
} fake_stream_t;

/* Tests: the next call of one kind fails (once), as the real library's may. */
enum {
    FAKE_FAIL_NONE,
    FAKE_FAIL_ID,               /* ncclGetUniqueId returns an error */
    FAKE_FAIL_INIT,             /* ncclCommInitRankConfig returns an error, with a comm
                                   made (which must still be aborted) */
    FAKE_FAIL_FORMING,          /* the group being formed reports an asynchronous error */
    FAKE_FAIL_ENQUEUE,          /* the next operation cannot be enqueued */
    FAKE_FAIL_STREAM,           /* the next stream query reports a CUDA error */
};
static int fake_fail_next;

static pthread_mutex_t fake_mu = PTHREAD_MUTEX_INITIALIZER;
static fake_group_t *fake_groups[64];
/* Counts (fake_mu): rounds carried out, communicators aborted. */
static unsigned long fake_rounds_run, fake_aborts;
static unsigned fake_id_seq;
/* The injected failure of that kind, if it is the one armed (disarming it). */
static bool fake_failing(int kind)
{
    pthread_mutex_lock(&fake_mu);
    bool f = fake_fail_next == kind;
    if (f) fake_fail_next = FAKE_FAIL_NONE;
    pthread_mutex_unlock(&fake_mu);
    return f;
}

/* The stream of a caller that has none (a CPU engine): one per thread. */
static _Thread_local fake_stream_t fake_default_stream;

static _Thread_local struct {
    int depth;
    fake_comm_t *comm;
    void *stream;
    fake_leg_t legs[FAKE_LEGS];
    int n;
} fake_gs;

static int fake_get_unique_id(uint8_t id[TSR_NCCL_ID_BYTES])
{
    memset(id, 0, TSR_NCCL_ID_BYTES);
    if (fake_failing(FAKE_FAIL_ID)) return TSR_NCCL_ERROR;
    pthread_mutex_lock(&fake_mu);
    unsigned v = ++fake_id_seq;
    pthread_mutex_unlock(&fake_mu);
    memcpy(id, &v, sizeof v);
    id[TSR_NCCL_ID_BYTES - 1] = 0x5a;
    return TSR_NCCL_OK;
}

static int fake_comm_init(void **comm, int n, const uint8_t id[TSR_NCCL_ID_BYTES], int rank,
                          int device)
{
    (void)device;
    if (n < 1 || n > FAKE_MAX_RANKS) return TSR_NCCL_ERROR;
    pthread_mutex_lock(&fake_mu);
    fake_group_t *g = NULL;
    int free_slot = -1;
    for (int i = 0; i < 64; i++) {
        if (fake_groups[i] && !memcmp(fake_groups[i]->id, id, TSR_NCCL_ID_BYTES))
            g = fake_groups[i];
        else if (!fake_groups[i] && free_slot < 0)
            free_slot = i;
    }
    if (!g) {
        if (free_slot < 0 || !(g = calloc(1, sizeof *g))) {
            pthread_mutex_unlock(&fake_mu);
            return TSR_NCCL_ERROR;
        }
        memcpy(g->id, id, TSR_NCCL_ID_BYTES);
        g->n = n;
        fake_groups[free_slot] = g;
    }
    fake_comm_t *c = calloc(1, sizeof *c);
    c->g = g;
    c->rank = rank;
    g->joined++;
    g->refs++;
    pthread_mutex_unlock(&fake_mu);
    *comm = c;
    if (fake_failing(FAKE_FAIL_INIT)) return TSR_NCCL_ERROR;
    if (fake_failing(FAKE_FAIL_FORMING)) {
        pthread_mutex_lock(&fake_mu);
        g->error = true;
        pthread_mutex_unlock(&fake_mu);
    }
    return TSR_NCCL_IN_PROGRESS;
}

static void fake_arrive_locked(fake_comm_t *c, void *stream, const fake_leg_t *legs, int n);

static int fake_comm_status(void *comm)
{
    fake_comm_t *c = comm;
    pthread_mutex_lock(&fake_mu);
    int st = c->g->error ? TSR_NCCL_ERROR
             : c->g->joined < c->g->n ? TSR_NCCL_IN_PROGRESS : TSR_NCCL_OK;
    if (st == TSR_NCCL_OK && c->n_deferred) {
        if (--c->deferred_polls <= 0) {
            fake_arrive_locked(c, c->deferred_stream, c->deferred, c->n_deferred);
            c->n_deferred = 0;
        }
        st = TSR_NCCL_IN_PROGRESS;
    }
    pthread_mutex_unlock(&fake_mu);
    return st;
}

static void fake_release(void *comm)
{
    fake_comm_t *c = comm;
    pthread_mutex_lock(&fake_mu);
    if (--c->g->refs == 0) {
        for (int i = 0; i < 64; i++)
            if (fake_groups[i] == c->g) fake_groups[i] = NULL;
        free(c->g);
    }
    pthread_mutex_unlock(&fake_mu);
    free(c);
}

/* Carries out round r of g (every rank's legs are in); fake_mu held. */
static void fake_run_round(fake_group_t *g, uint64_t r)
{
    fake_rounds_run++;
    int s = (int)(r % FAKE_ROUNDS);
    fake_leg_t *l0 = &g->legs[s][0][0];
    size_t es = tsr_dtype_size(l0->dt), bytes = l0->count * es;
    switch (l0->kind) {
    case FAKE_AR: {
        if (l0->dt == TSR_DT_F32) {
            float *sum = calloc(l0->count ? l0->count : 1, sizeof *sum);
            for (int k = 0; k < g->n; k++)
                for (size_t i = 0; i < l0->count; i++) sum[i] += ((float *)g->legs[s][k][0].a)[i];
            for (int k = 0; k < g->n; k++) memcpy(g->legs[s][k][0].a, sum, bytes);
            free(sum);
        } else if (l0->dt == TSR_DT_I32) {
            int32_t *sum = calloc(l0->count ? l0->count : 1, sizeof *sum);
            for (int k = 0; k < g->n; k++)
                for (size_t i = 0; i < l0->count; i++) sum[i] += ((int32_t *)g->legs[s][k][0].a)[i];
            for (int k = 0; k < g->n; k++) memcpy(g->legs[s][k][0].a, sum, bytes);
            free(sum);
        }
        break;
    }
    case FAKE_AG:
        for (int k = 0; k < g->n; k++)
            for (int j = 0; j < g->n; j++)
                memcpy((char *)g->legs[s][k][0].b + (size_t)j * bytes, g->legs[s][j][0].a, bytes);
        break;
    case FAKE_BC:
        for (int k = 0; k < g->n; k++)
            if (k != l0->peer) memcpy(g->legs[s][k][0].a, g->legs[s][l0->peer][0].a, bytes);
        break;
    default:  /* send/recv legs */
        for (int k = 0; k < g->n; k++)
            for (int i = 0; i < g->n_legs[s][k]; i++) {
                fake_leg_t *snd = &g->legs[s][k][i];
                if (snd->kind != FAKE_SEND) continue;
                int p = snd->peer;
                for (int j = 0; j < g->n_legs[s][p]; j++) {
                    fake_leg_t *rcv = &g->legs[s][p][j];
                    if (rcv->kind == FAKE_RECV && rcv->peer == k)
                        memcpy(rcv->a, snd->a, snd->count * tsr_dtype_size(snd->dt));
                }
            }
    }
}

static int fake_submit(fake_comm_t *c, void *stream, const fake_leg_t *legs, int n)
{
    if (!stream) stream = &fake_default_stream;
    pthread_mutex_lock(&fake_mu);
    if (fake_inprogress_polls > 0) {
        memcpy(c->deferred, legs, (size_t)n * sizeof *legs);
        c->n_deferred = n;
        c->deferred_polls = fake_inprogress_polls;
        c->deferred_stream = stream;
    } else {
        fake_arrive_locked(c, stream, legs, n);
    }
    pthread_mutex_unlock(&fake_mu);
    return TSR_NCCL_OK;
}

static void fake_arrive_locked(fake_comm_t *c, void *stream, const fake_leg_t *legs, int n)
{
    fake_group_t *g = c->g;
    uint64_t r = g->next[c->rank]++;
    int s = (int)(r % FAKE_ROUNDS);
    memcpy(g->legs[s][c->rank], legs, (size_t)n * sizeof *legs);
    g->n_legs[s][c->rank] = n;
    if (++g->arrived[s] == g->n) {
        fake_run_round(g, r);
        g->arrived[s] = 0;
        g->done = r + 1;
    }
    fake_stream_t *st = stream;
    st->g = g;
    st->round = r;
}

static int fake_one(void *comm, fake_leg_t leg, void *stream)
{
    if (fake_failing(FAKE_FAIL_ENQUEUE)) return TSR_NCCL_ERROR;
    if (fake_gs.depth) {
        if (fake_gs.n == FAKE_LEGS) return TSR_NCCL_ERROR;
        fake_gs.comm = comm;
        fake_gs.stream = stream;
        fake_gs.legs[fake_gs.n++] = leg;
        return TSR_NCCL_OK;
    }
    return fake_submit(comm, stream, &leg, 1);
}

static int fake_allreduce(void *comm, void *buf, size_t count, tsr_dtype_t dt, void *stream)
{
    return fake_one(comm, (fake_leg_t){FAKE_AR, buf, NULL, count, dt, 0}, stream);
}
static int fake_allgather(void *comm, const void *send, void *recv, size_t count, tsr_dtype_t dt,
                          void *stream)
{
    return fake_one(comm, (fake_leg_t){FAKE_AG, (void *)send, recv, count, dt, 0}, stream);
}
static int fake_broadcast(void *comm, void *buf, size_t count, tsr_dtype_t dt, int root,
                          void *stream)
{
    return fake_one(comm, (fake_leg_t){FAKE_BC, buf, NULL, count, dt, root}, stream);
}
static int fake_send(void *comm, const void *buf, size_t count, tsr_dtype_t dt, int peer,
                     void *stream)
{
    return fake_one(comm, (fake_leg_t){FAKE_SEND, (void *)buf, NULL, count, dt, peer}, stream);
}
static int fake_recv(void *comm, void *buf, size_t count, tsr_dtype_t dt, int peer, void *stream)
{
    return fake_one(comm, (fake_leg_t){FAKE_RECV, buf, NULL, count, dt, peer}, stream);
}
static int fake_group_start(void)
{
    if (!fake_gs.depth++) fake_gs.n = 0;
    return TSR_NCCL_OK;
}
static int fake_group_end(void)
{
    if (fake_gs.depth <= 0) return TSR_NCCL_ERROR;
    if (--fake_gs.depth || !fake_gs.n) return TSR_NCCL_OK;
    return fake_submit(fake_gs.comm, fake_gs.stream, fake_gs.legs, fake_gs.n);
}

static int fake_stream_query(void *stream)
{
    fake_stream_t *st = stream ? stream : &fake_default_stream;
    if (fake_failing(FAKE_FAIL_STREAM)) return TSR_NCCL_ERROR;
    pthread_mutex_lock(&fake_mu);
    int r = !st->g || st->g->done > st->round ? TSR_NCCL_OK : TSR_NCCL_IN_PROGRESS;
    pthread_mutex_unlock(&fake_mu);
    return r;
}

static const char *fake_last_error(void *comm)
{
    return comm ? "fake: the group was told to fail" : "fake: no error";
}

/* Makes every communicator of the group with that unique id report an
 * asynchronous error.  Returns whether the group exists. */
static inline bool fake_nccl_inject_error(const uint8_t id[TSR_NCCL_ID_BYTES])
{
    bool found = false;
    pthread_mutex_lock(&fake_mu);
    for (int i = 0; i < 64; i++)
        if (fake_groups[i] && !memcmp(fake_groups[i]->id, id, TSR_NCCL_ID_BYTES)) {
            fake_groups[i]->error = found = true;
        }
    pthread_mutex_unlock(&fake_mu);
    return found;
}

static void fake_abort(void *comm)
{
    pthread_mutex_lock(&fake_mu);
    fake_aborts++;
    pthread_mutex_unlock(&fake_mu);
    fake_release(comm);
}
/* One of the counts above, read under the lock. */
static inline unsigned long fake_count(const unsigned long *what)
{
    pthread_mutex_lock(&fake_mu);
    unsigned long v = *what;
    pthread_mutex_unlock(&fake_mu);
    return v;
}

static const tsr_nccl_api_t fake_nccl = {
    .name = "fake",
    .get_unique_id = fake_get_unique_id,
    .comm_init = fake_comm_init,
    .comm_status = fake_comm_status,
    .comm_abort = fake_abort,
    .allreduce_sum = fake_allreduce,
    .allgather = fake_allgather,
    .broadcast = fake_broadcast,
    .send = fake_send,
    .recv = fake_recv,
    .group_start = fake_group_start,
    .group_end = fake_group_end,
    .stream_query = fake_stream_query,
    .last_error = fake_last_error,
};

#endif
