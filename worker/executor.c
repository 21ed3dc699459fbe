#include "worker/executor.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/budget.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/util.h"
#include "common/piece.h"
#include "common/prefix.h"
#include "worker/kvpool.h"

#define MAX_PEERS 1024
#define FORM_TIMEOUT_MS 120000  /* peers may still be loading their weights */
#define WATCH_GAP_MS 500         /* tsr_executor_watch: a longer gap is a stopped process */
#define WATCH_MIN_MS 2000       /* its limit: collective_timeout_ms, but at least this, so
                                   a thread that waits a moment for a core is not stuck */
#define MAIL_MAX 3              /* rendezvous blobs waiting: a piece is in at most 3 groups */

typedef struct {
    bool active;
    tsr_piece_key_t key;        /* which piece, in which layout */
    char model_path[TSR_PATH_MAX + 1];
    uint64_t epoch;
    int max_seq_len;
    int max_batch, prefill_chunk, max_queue;
    int coll_ms;                /* collective_timeout_ms (none sent: the default) */
    uint64_t kv_cache_bytes;
    int kv_dtype;               /* tsr_kv_dtype_t, as the coordinator sent it */
    int matmul_dtype;           /* the same values: the weights' type (matmul_dtype) */
    int weights_dtype;          /* auto, or int8 weights (weights_dtype) */
    tsr_device_t device;
    int n_peers;
    char peers[MAX_PEERS][TSR_NAME_MAX + 1];
    char devices[MAX_PEERS][TSR_NAME_MAX + 40];  /* each peer's "node/bus id" ("" no NCCL) */
    char names[MAX_PEERS][2 * TSR_NAME_MAX + 20];  /* "worker W on node N" ("" unknown) */
    uint64_t groups[MAIL_MAX];      /* the tensor groups this piece forms (tp, prev, next) */
    int n_groups;
    uint8_t secret[64];         /* the replica's data-port secret for this epoch */
    size_t secret_len;
    uint8_t prefix_secret[TSR_PREFIX_SECRET];   /* the prefix cache's keys */
    bool kv_reserve;            /* kv_admission reserve */
    bool prefix_cache;          /* a secret came: the leader caches prefixes */
} job_t;

/* A FIFO of nodes that start with a qnode_t (requests in, events out);
 * callers hold ex->mu. */
typedef struct qnode {
    struct qnode *next;
} qnode_t;

typedef struct {
    qnode_t *head, *tail;
} fifo_t;

static void fifo_push(fifo_t *q, qnode_t *n)
{
    n->next = NULL;
    if (q->tail) q->tail->next = n;
    else q->head = n;
    q->tail = n;
}

static qnode_t *fifo_pop(fifo_t *q)
{
    qnode_t *n = q->head;
    if (n && !(q->head = n->next)) q->tail = NULL;
    return n;
}

typedef struct {
    qnode_t link;               /* first: a qreq_t is a qnode_t */
    tsr_request_t r;
} qreq_t;

typedef struct {
    qnode_t link;
    tsr_event_t ev;
} ev_node_t;

typedef struct {
    qnode_t link;
    uint64_t id;
    char reason[128];
} cancel_node_t;

struct tsr_executor {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool shutdown;
    uint64_t job_gen, run_gen;      /* the job asked for / the one running */
    job_t *job;                     /* latest job (heap: it is large) */
    fifo_t requests;            /* qreq_t, for the leader */
    fifo_t cancels;             /* cancel_node_t, for the leader */
    fifo_t events;              /* ev_node_t, for the agent */
    int pipe_r, pipe_w;
    tsr_tcp_listener_t *listener;
    char endpoint[TSR_NAME_MAX + 1];
    int device_index;               /* the GPU of a CUDA worker */
    /* TSR_TEST_NCCL_SOLO=1 (the device check, on one GPU): a tp=1 piece
     * whose backend has NCCL forms its stage's TP group anyway, a group of
     * one, so a deployment runs its sums through an NCCL communicator
     * formed through the coordinator. */
    bool nccl_solo;
    bool device_lost;               /* a fatal device error, or the thread is stuck (below):
                                       the worker must restart */
    /* The watchdog of the thread itself (tsr_executor_watch, on the agent's
     * thread).  A new job owes the thread a pickup from owed_ms on; a
     * serving thread lets go of its epoch within run_limit_ms (its waits
     * end when the epoch does), except while it loads weights or while it
     * shows signs of life (a finished step, a part of one: a long step on
     * a big model is not a stuck thread). */
    int64_t owed_ms;                /* when job_gen first passed run_gen, or the thread's
                                       last sign of life since (0: not owed) */
    uint64_t life_seen;             /* steps + alive at the watchdog's previous look */
    bool loading;                   /* reading weights: not bound by the limit */
    int run_limit_ms;               /* the running job's collective_timeout_ms */
    uint64_t run_epoch;             /* the running job's epoch */
    int64_t last_watch_ms;          /* the agent's previous look (0: none yet) */
    bool stuck;                     /* the watchdog fired: destroy does not wait for it */
    bool exited;                    /* the thread has returned (mu; cv is signalled): a
                                       stuck one is joined only then */
    uint64_t wbytes, kvbytes;
    tsr_executor_stats_t stats;
    tsr_executor_stats_t totals;    /* the counts of the runs that ended */
    uint64_t steps;                 /* forward steps finished, every piece this process held
                                       (__atomic builtins: the engine's device may add to it) */
    uint64_t alive;                 /* parts of steps done (the engine's set_alive), the same */
    /* Events that could not be queued (out of memory): the agent is told by
     * one synthesized failure of that epoch, so nothing waits for them. */
    uint64_t events_lost, lost_epoch;
    /* Rendezvous blobs relayed by the coordinator for the job's epoch, by
     * group, until the group forms (or the next assignment). */
    struct {
        uint64_t epoch, group;
        uint8_t blob[256];
        size_t len;
    } mail[MAIL_MAX];
    int n_mail;
};

/* Where event nodes come from (tests make it fail). */
static void *(*ev_calloc)(size_t, size_t) = calloc;

void tsr_executor_test_set_event_alloc(void *(*alloc)(size_t, size_t))
{
    ev_calloc = alloc ? alloc : calloc;
}

/* ---- events ------------------------------------------------------------------ */

static void wake_agent(tsr_executor_t *ex)
{
    char b = 1;
    if (write(ex->pipe_w, &b, 1) < 0 && errno != EAGAIN) tsr_warn("executor: wake pipe: %s", strerror(errno));
}

/* Queues ev for the agent and, when wake, wakes it (one byte on the pipe).
 * Tokens are queued unwoken and woken for once per step (io_flush): a wake
 * per token let the agent's thread preempt the step's threads 32 times a
 * step on a 2-core machine. */
static void queue_event(tsr_executor_t *ex, const tsr_event_t *ev, bool wake)
{
    ev_node_t *n = ev_calloc(1, sizeof *n);
    pthread_mutex_lock(&ex->mu);
    if (n) {
        n->ev = *ev;
        fifo_push(&ex->events, &n->link);
    } else {
        ex->events_lost++;
        if (ev->epoch > ex->lost_epoch) ex->lost_epoch = ev->epoch;
    }
    pthread_mutex_unlock(&ex->mu);
    if (wake) wake_agent(ex);
}

static void push_event(tsr_executor_t *ex, const tsr_event_t *ev) { queue_event(ex, ev, true); }

static void push_simple(tsr_executor_t *ex, tsr_event_kind_t kind, uint64_t epoch, const char *text)
{
    tsr_event_t ev = {.kind = kind, .epoch = epoch, .retryable = 0};
    snprintf(ev.text, sizeof ev.text, "%s", text ? text : "");
    push_event(ex, &ev);
}

/* The data plane broke (a peer, a connection, a deadline): the weights are
 * fine, so the coordinator rewires the replica.  past_deadline: the stage's
 * tensor-parallel group waited past its deadline for the other ranks. */
static void push_data_plane_failure(tsr_executor_t *ex, uint64_t epoch, const char *text,
                                    bool past_deadline)
{
    tsr_event_t ev = {.kind = TSR_EV_FAILED, .epoch = epoch, .retryable = 1,
                      .past_deadline = past_deadline};
    snprintf(ev.text, sizeof ev.text, "%s", text ? text : "");
    push_event(ex, &ev);
}

int tsr_executor_pop_event(tsr_executor_t *ex, tsr_event_t *ev)
{
    char buf[64];
    while (read(ex->pipe_r, buf, sizeof buf) > 0) {}
    pthread_mutex_lock(&ex->mu);
    ev_node_t *n = (ev_node_t *)fifo_pop(&ex->events);
    uint64_t lost = n ? 0 : ex->events_lost, epoch = ex->lost_epoch;
    if (lost) ex->events_lost = 0;
    pthread_mutex_unlock(&ex->mu);
    if (n) {
        *ev = n->ev;
        free(n);
        return 1;
    }
    if (!lost) return 0;
    /* A lost ready, failure or token would leave someone waiting for good:
     * the piece fails instead (retryable: its requests resume elsewhere and
     * the replica is rewired). */
    memset(ev, 0, sizeof *ev);
    ev->kind = TSR_EV_FAILED;
    ev->epoch = epoch;
    ev->retryable = 1;
    snprintf(ev->text, sizeof ev->text,
             "data plane: the worker ran out of memory and lost %llu event(s)",
             (unsigned long long)lost);
    return 1;
}

/* ---- replica io (on the executor thread) ---------------------------------------- */

typedef struct {
    tsr_executor_t *ex;
    uint64_t gen, epoch;
    bool held;                  /* tokens queued that the agent was not woken for */
    uint64_t cached_req;        /* io_cached's request, for its first token */
    int cached;
    tsr_replica_stats_t last;   /* the run's latest figures */
} run_ctx_t;

static int io_next_request(void *arg, tsr_request_t *r, int wait_ms)
{
    run_ctx_t *c = arg;
    tsr_executor_t *ex = c->ex;
    struct timespec dl = tsr_monotonic_after_ms(wait_ms);
    pthread_mutex_lock(&ex->mu);
    while (!ex->requests.head && !ex->shutdown && ex->job_gen == c->gen)
        if (pthread_cond_timedwait(&ex->cv, &ex->mu, &dl) == ETIMEDOUT) break;
    qreq_t *n = NULL;
    if (ex->job_gen == c->gen && !ex->shutdown) n = (qreq_t *)fifo_pop(&ex->requests);
    pthread_mutex_unlock(&ex->mu);
    if (!n) return 0;
    *r = n->r;
    free(n);
    return 1;
}

static void io_emit(void *arg, uint64_t req, int32_t token, int index, int done, int retryable,
                    const char *finish, const char *error)
{
    run_ctx_t *c = arg;
    tsr_event_t ev = {.kind = TSR_EV_TOKEN, .epoch = c->epoch, .request_id = req,
                      .token = token, .index = index, .done = done, .retryable = retryable};
    snprintf(ev.finish, sizeof ev.finish, "%s", finish ? finish : "");
    snprintf(ev.text, sizeof ev.text, "%s", error ? error : "");
    if (index == 0 && !error && req == c->cached_req) ev.cached = c->cached;
    bool hold = !error;         /* a failure goes at once; tokens wait for io_flush */
    queue_event(c->ex, &ev, !hold);
    c->held |= hold;
}

static void io_flush(void *arg)
{
    run_ctx_t *c = arg;
    if (c->held) wake_agent(c->ex);
    c->held = false;
}

static int io_next_cancel(void *arg, uint64_t *id, char *reason, size_t len)
{
    run_ctx_t *c = arg;
    pthread_mutex_lock(&c->ex->mu);
    cancel_node_t *n = (cancel_node_t *)fifo_pop(&c->ex->cancels);
    pthread_mutex_unlock(&c->ex->mu);
    if (!n) return 0;
    *id = n->id;
    snprintf(reason, len, "%s", n->reason);
    free(n);
    return 1;
}

static void io_cached(void *arg, uint64_t req, int tokens)
{
    run_ctx_t *c = arg;
    c->cached_req = req;
    c->cached = tokens;
}

/* The figures of this run on top of those of the runs before. */
static void io_report(void *arg, const tsr_replica_stats_t *s)
{
    run_ctx_t *c = arg;
    const tsr_executor_stats_t *t = &c->ex->totals;
    c->last = *s;
    pthread_mutex_lock(&c->ex->mu);
    c->ex->stats = (tsr_executor_stats_t){s->queued, s->running, s->kv_used, s->kv_total, 0,
                                          s->kv_cached, t->evictions + s->evictions,
                                          t->prompt_cached + s->prompt_cached,
                                          t->prompt_computed + s->prompt_computed,
                                          t->preemptions + s->preemptions};
    pthread_mutex_unlock(&c->ex->mu);
}

/* A run ended: its counts join the totals. */
static void totals_add(tsr_executor_t *ex, const tsr_replica_stats_t *s)
{
    pthread_mutex_lock(&ex->mu);
    ex->totals.evictions += s->evictions;
    ex->totals.prompt_cached += s->prompt_cached;
    ex->totals.prompt_computed += s->prompt_computed;
    ex->totals.preemptions += s->preemptions;
    ex->stats.queued = ex->stats.running = 0;
    pthread_mutex_unlock(&ex->mu);
}

static int io_should_stop(void *arg)
{
    run_ctx_t *c = arg;
    pthread_mutex_lock(&c->ex->mu);
    int stop = c->ex->shutdown || c->ex->job_gen != c->gen;
    pthread_mutex_unlock(&c->ex->mu);
    return stop;
}

/* Fails every queued request: nobody here will serve them. */
static void fail_queued(tsr_executor_t *ex, uint64_t epoch, const char *why)
{
    pthread_mutex_lock(&ex->mu);
    qreq_t *n = (qreq_t *)ex->requests.head;
    ex->requests = (fifo_t){NULL, NULL};
    pthread_mutex_unlock(&ex->mu);
    while (n) {
        qreq_t *next = (qreq_t *)n->link.next;
        tsr_event_t ev = {.kind = TSR_EV_TOKEN, .epoch = epoch, .request_id = n->r.request_id,
                          .token = -1, .done = 1, .retryable = 1};
        snprintf(ev.text, sizeof ev.text, "%s", why);
        push_event(ex, &ev);
        free(n->r.prompt);
        free(n);
        n = next;
    }
}

/* ---- the thread ------------------------------------------------------------ */

static uint64_t group_id(const job_t *j, const char *kind, int a, int b)
{
    return tsr_group_id(j->key.deployment, j->key.replica, kind, a, b);
}

static int form_cancelled(void *arg) { return io_should_stop(arg); }

/* rv->exchange: rank 0 of a group publishes its blob (the agent sends it to
 * the coordinator, which relays it to the replica's members in this epoch);
 * the others wait for the relayed blob of this epoch and group. */
static int io_exchange(void *arg, uint64_t group, const void *mine, size_t len, void *out,
                       size_t cap, size_t *out_len, int timeout_ms, char *err, size_t errlen)
{
    run_ctx_t *c = arg;
    tsr_executor_t *ex = c->ex;
    if (mine) {
        tsr_event_t ev = {.kind = TSR_EV_RENDEZVOUS, .epoch = c->epoch, .group = group};
        if (len > sizeof ev.blob) {
            snprintf(err, errlen, "a rendezvous blob of %zu bytes (at most %zu)", len,
                     sizeof ev.blob);
            return -1;
        }
        memcpy(ev.blob, mine, len);
        ev.blob_len = len;
        push_event(ex, &ev);
        return 0;
    }
    struct timespec dl = tsr_monotonic_after_ms(timeout_ms);
    int rc = -1;
    pthread_mutex_lock(&ex->mu);
    for (;;) {
        int k = 0;
        while (k < ex->n_mail && !(ex->mail[k].epoch == c->epoch && ex->mail[k].group == group))
            k++;
        if (k < ex->n_mail) {
            if (ex->mail[k].len > cap) {
                snprintf(err, errlen, "the relayed rendezvous blob has %zu bytes (at most %zu)",
                         ex->mail[k].len, cap);
            } else {
                memcpy(out, ex->mail[k].blob, ex->mail[k].len);
                *out_len = ex->mail[k].len;
                rc = 0;
            }
            ex->mail[k] = ex->mail[--ex->n_mail];
            break;
        }
        if (ex->shutdown || ex->job_gen != c->gen) {
            snprintf(err, errlen, "waiting for group %llx's rendezvous was cancelled: a newer "
                     "epoch or a stop", (unsigned long long)group);
            break;
        }
        if (pthread_cond_timedwait(&ex->cv, &ex->mu, &dl) == ETIMEDOUT) {
            snprintf(err, errlen,
                     "group %llx's rendezvous blob (from its rank 0, relayed by the "
                     "coordinator) did not arrive within %d ms",
                     (unsigned long long)group, timeout_ms);
            break;
        }
    }
    pthread_mutex_unlock(&ex->mu);
    return rc;
}

void tsr_executor_rendezvous(tsr_executor_t *ex, uint64_t epoch, uint64_t group,
                             const void *blob, size_t len)
{
    pthread_mutex_lock(&ex->mu);
    bool mine = false;
    for (int i = 0; i < ex->job->n_groups; i++) mine |= ex->job->groups[i] == group;
    if (!mine || epoch != ex->job->epoch || !ex->job->active || len > sizeof ex->mail[0].blob) {
        /* another member's group, another epoch, or too large */
        tsr_debug("dropped a rendezvous blob for group %llx, epoch %llu (%zu bytes)",
                  (unsigned long long)group, (unsigned long long)epoch, len);
    } else {
        int k = 0;
        while (k < ex->n_mail && !(ex->mail[k].epoch == epoch && ex->mail[k].group == group))
            k++;
        if (k == ex->n_mail && ex->n_mail < MAIL_MAX) ex->n_mail++;
        if (k < ex->n_mail) {
            ex->mail[k].epoch = epoch;
            ex->mail[k].group = group;
            memcpy(ex->mail[k].blob, blob, len);
            ex->mail[k].len = len;
        }
        pthread_cond_broadcast(&ex->cv);
    }
    pthread_mutex_unlock(&ex->mu);
}

/* Forms one of the replica's groups through the backend's rendezvous: for
 * TCP, the members' data endpoints, one per line; for NCCL, the blob its
 * rank 0 makes, relayed through the coordinator (io_exchange). */
static tsr_comm_t *form(const tsr_coll_ctx_t *cctx, const tsr_coll_ops_t *ops, const job_t *j,
                        run_ctx_t *ctx, const char *kind, int a, int b, int rank, int n,
                        const int *members, char *err, size_t errlen)
{
    char *blob = malloc((size_t)n * (TSR_NAME_MAX + 2) + 1);
    size_t len = 0;
    tsr_comm_t *c = NULL;
    if (!blob) {
        snprintf(err, errlen, "out of memory for a rendezvous");
        return NULL;
    }
    const char *devices[MAX_PEERS], *names[MAX_PEERS];
    for (int i = 0; i < n; i++) {
        len += (size_t)sprintf(blob + len, "%s\n", j->peers[members[i]]);
        devices[i] = j->devices[members[i]];
        names[i] = j->names[members[i]];
    }
    tsr_rendezvous_t rv = {.epoch = j->epoch, .group = group_id(j, kind, a, b), .rank = rank,
                           .n = n, .blob = blob, .blob_len = len, .timeout_ms = FORM_TIMEOUT_MS,
                           .cancelled = form_cancelled, .cancel_arg = ctx, .secret = j->secret,
                           .secret_len = j->secret_len, .devices = devices, .names = names,
                           .exchange = io_exchange, .exchange_arg = ctx};
    if (ops->create((void *)cctx, &rv, &c, err, errlen) < 0) c = NULL;
    free(blob);
    return c;
}

/* The replica's communicators, formed in the same order on every rank:
 * the control channel over every rank (host memory, TCP whatever the
 * device), then the tensor channels of the piece's backend: the stage's
 * TP group, the link from the previous stage and the link to the next. */
static int wire_up(const tsr_coll_ctx_t *cctx, const tsr_backend_t *be, const job_t *j,
                   bool solo, run_ctx_t *ctx, tsr_replica_rank_t *r, char *err, size_t errlen)
{
    int tp = j->key.tp_size, s = j->key.stage, t = j->key.tp, m[MAX_PEERS];
    if (j->n_peers != j->key.tp_size * j->key.pp_size) {
        snprintf(err, errlen, "the replica's peer list has %d entries, expected %d", j->n_peers,
                 j->key.tp_size * j->key.pp_size);
        return -1;
    }
    r->ops = be->coll;
    r->ctl_ops = &tsr_coll_tcp;
    if (j->n_peers > 1) {
        for (int i = 0; i < j->n_peers; i++) m[i] = i;
        if (!(r->ctl = form(cctx, &tsr_coll_tcp, j, ctx, "ctl", 0, 0, s * tp + t, j->n_peers, m,
                            err, errlen)))
            return -1;
    }
    if (tp > 1 || (solo && cctx->nccl)) {
        for (int i = 0; i < tp; i++) m[i] = s * tp + i;
        if (!(r->tp = form(cctx, be->coll, j, ctx, "tp", s, 0, t, tp, m, err, errlen))) return -1;
    }
    if (s > 0) {
        m[0] = (s - 1) * tp + t, m[1] = s * tp + t;
        if (!(r->prev = form(cctx, be->coll, j, ctx, "pp", s, t, 1, 2, m, err, errlen))) return -1;
    }
    if (s < j->key.pp_size - 1) {
        m[0] = s * tp + t, m[1] = (s + 1) * tp + t;
        if (!(r->next = form(cctx, be->coll, j, ctx, "pp", s + 1, t, 0, 2, m, err, errlen))) return -1;
    }
    return 0;
}

/* Every communicator of the replica is aborted first, whatever ended the
 * epoch (a failure, a newer epoch, a stop): a backend with work in flight
 * (NCCL) lets go of it at once, never waiting on a peer that may be dead,
 * before it is freed. */
static void unwire(tsr_replica_rank_t *r, const char *why)
{
    if (r->tp) r->ops->abort(r->tp, why);
    if (r->prev) r->ops->abort(r->prev, why);
    if (r->next) r->ops->abort(r->next, why);
    if (r->ctl) r->ctl_ops->abort(r->ctl, why);
    if (r->tp) r->ops->destroy(&r->tp);
    if (r->prev) r->ops->destroy(&r->prev);
    if (r->next) r->ops->destroy(&r->next);
    if (r->ctl) r->ctl_ops->destroy(&r->ctl);
}

static bool same_piece(const job_t *a, const job_t *b)
{
    /* the weights are the same whichever replica the piece serves */
    tsr_piece_key_t ak = a->key, bk = b->key;
    ak.replica = bk.replica = 0;
    return a->active && b->active && tsr_piece_equal(&ak, &bk) &&
           !strcmp(a->model_path, b->model_path) && a->max_seq_len == b->max_seq_len && a->max_batch == b->max_batch &&
           a->prefill_chunk == b->prefill_chunk && a->kv_cache_bytes == b->kv_cache_bytes &&
           a->device == b->device &&
           /* auto and the type it stands for (an older coordinator sent auto) */
           tsr_kv_dtype_on(a->device, a->kv_dtype) == tsr_kv_dtype_on(b->device, b->kv_dtype) &&
           tsr_kv_dtype_on(a->device, a->matmul_dtype) == tsr_kv_dtype_on(b->device, b->matmul_dtype) &&
           a->weights_dtype == b->weights_dtype;
}

/* Serves one job until it is replaced.  *loaded is the piece whose weights
 * *eng holds, kept across jobs that only rewire. */
static bool peers_complete(const job_t *j)
{
    if (j->n_peers != j->key.tp_size * j->key.pp_size) return false;
    for (int i = 0; i < j->n_peers; i++)
        if (!j->peers[i][0]) return false;
    return true;
}

/* The piece's shape and sizes, from the assignment and the deployment's
 * batching keys (0: the documented defaults). */
static void piece_spec(const tsr_executor_t *ex, const job_t *j, const tsr_model_info_t *m,
                       const tsr_engine_ops_t *eng, tsr_piece_spec_t *spec)
{
    int batch, tokens;
    tsr_step_rows(j->max_batch, j->prefill_chunk, j->max_seq_len, &batch, &tokens);
    *spec = (tsr_piece_spec_t){j->key.tp, j->key.tp_size, j->key.stage, j->key.pp_size,
                               j->key.layer_begin, j->key.layer_end, j->max_seq_len, batch,
                               tokens, 0, 0, ex->device_index, j->kv_dtype,
                               j->matmul_dtype, j->weights_dtype, 0, 1};
    int row = tsr_kv_engine_row_bytes(eng, j->kv_dtype, m->head_dim);
    spec->kv_blocks = tsr_kv_pool_blocks(m, j->key.tp_size, j->key.pp_size, j->kv_cache_bytes, batch,
                                         j->max_seq_len, TSR_KV_BLOCK,
                                         row > 0 ? row : 4 * m->head_dim);
}

/* The device is unusable: say why (fatal, so the coordinator moves the
 * piece at once), and let the worker exit so that its supervisor restarts
 * it with a fresh context. */
static void device_lost(tsr_executor_t *ex, uint64_t epoch, const char *why)
{
    tsr_event_t ev = {.kind = TSR_EV_FAILED, .epoch = epoch, .fatal = 1};
    snprintf(ev.text, sizeof ev.text, "%s", why);
    push_event(ex, &ev);
    pthread_mutex_lock(&ex->mu);
    ex->device_lost = true;
    pthread_mutex_unlock(&ex->mu);
}

/* Loading weights takes as long as the disk does, and ends a newer job's
 * wait only once it is done: the watchdog's clock for a job that arrived
 * meanwhile starts when the load ends. */
static void set_loading(tsr_executor_t *ex, bool on)
{
    pthread_mutex_lock(&ex->mu);
    ex->loading = on;
    if (!on && ex->owed_ms) ex->owed_ms = tsr_now_ms();
    pthread_mutex_unlock(&ex->mu);
}

/* Serves one job until it is replaced.  *loaded is the piece whose weights
 * *eng holds, kept across jobs that only rewire the replica. */
static void serve(tsr_executor_t *ex, const job_t *j, uint64_t gen, job_t *loaded,
                  tsr_engine_t **eng, tsr_backend_t *be)
{
    char err[512], why[600];
    const char *failed = NULL;
    tsr_replica_rank_t r = {0};
    r.steps = &ex->steps;
    run_ctx_t ctx = {.ex = ex, .gen = gen, .epoch = j->epoch};
    if (!same_piece(j, loaded) || !*eng) {
        /* the piece held: an engine that can keeps the layers the new one holds too */
        tsr_engine_t *donor = *eng;
        const tsr_engine_ops_t *donor_ops = be->engine;
        *eng = NULL;
        loaded->active = false;
        push_simple(ex, TSR_EV_PROGRESS, j->epoch, "loading weights");
        set_loading(ex, true);
        /* test builds: TSR_TEST_LOAD_HOLD_MS makes each load as slow as a large model's */
#ifdef TSR_TESTING
        tsr_test_hold("TSR_TEST_LOAD_HOLD_MS", 60000);
#endif
        tsr_model_info_t m;
        bool ok = tsr_backend_for(j->device, be, err, sizeof err) == 0 &&
                  tsr_model_info_load(j->model_path, &m, err, sizeof err) == 0;
        int kept = 0;
        if (ok) {
            piece_spec(ex, j, &m, be->engine, &r.spec);
            if (donor && donor_ops == be->engine && be->engine->load_from) {
                ok = be->engine->load_from(&donor, j->model_path, &r.spec, eng, &kept, err,
                                           sizeof err) == 0;
            } else {
                if (donor) donor_ops->destroy(&donor);   /* its memory first */
                ok = be->engine->load(j->model_path, &r.spec, eng, err, sizeof err) == 0;
            }
        }
        if (donor) donor_ops->destroy(&donor);
        if (ok && kept)
            tsr_info("kept %d of the %d layer(s) of %s r%d s%d t%d from the piece it held", kept,
                     j->key.layer_end - j->key.layer_begin, j->key.deployment, j->key.replica,
                     j->key.stage, j->key.tp);
        set_loading(ex, false);
        if (!ok) {
            push_simple(ex, TSR_EV_FAILED, j->epoch, err);
            goto out;
        }
        *loaded = *j;
        pthread_mutex_lock(&ex->mu);
        ex->wbytes = be->engine->weight_bytes(*eng);
        ex->kvbytes = be->engine->kv_bytes(*eng);
        pthread_mutex_unlock(&ex->mu);
    } else {   /* only rewired: the loaded engine knows its model */
        piece_spec(ex, j, be->engine->model(*eng), be->engine, &r.spec);
    }
    /* A replica with a piece still unplaced cannot run; the weights are
     * loaded, and the next epoch brings the full peer list. */
    if (!peers_complete(j)) {
        push_simple(ex, TSR_EV_READY, j->epoch, NULL);
        goto out;
    }
    push_simple(ex, TSR_EV_PROGRESS, j->epoch, "connecting to the replica's peers");
    /* What the backends form from: the listener, and for a GPU piece NCCL
     * (when this machine has it), the GPU and the engine's stream. */
    char nccl_why[256] = "";
    tsr_coll_ctx_t cctx = {.listener = ex->listener, .fallback = be->fallback,
                           .device = ex->device_index, .nccl_why = nccl_why};
    if (be->nccl) cctx.nccl = be->nccl(nccl_why, sizeof nccl_why);
    if (be->engine->stream) cctx.stream = be->engine->stream(*eng);
    if (wire_up(&cctx, be, j, ex->nccl_solo, &ctx, &r, err, sizeof err) < 0) {
        failed = err;   /* the groups already formed are aborted with it */
        if (be->engine->fatal && be->engine->fatal(*eng)) {
            device_lost(ex, j->epoch, err);
            goto out;
        }
        snprintf(why, sizeof why, "data plane: %s", err);
        if (!io_should_stop(&ctx)) push_data_plane_failure(ex, j->epoch, why, false);
        goto out;
    }
    be->engine->set_comm(*eng, r.ops, r.tp, j->coll_ms);
    push_simple(ex, TSR_EV_READY, j->epoch, NULL);
    r.eng_ops = be->engine;
    r.eng = *eng;
    if (be->engine->set_progress) be->engine->set_progress(*eng, &ex->steps);
    if (be->engine->set_alive) be->engine->set_alive(*eng, &ex->alive);
    r.prefill_chunk = j->prefill_chunk > 0 ? j->prefill_chunk : 128;
    r.max_queue = j->max_queue;
    r.token_timeout_ms = 2 * j->coll_ms;   /* a hand-off waits for a stage's collectives */
    r.prefix_secret = j->prefix_cache ? j->prefix_secret : NULL;
    r.kv_reserve = j->kv_reserve;
    tsr_replica_io_t io = {io_next_request, io_next_cancel, io_emit, io_should_stop, io_report,
                           io_flush, io_cached, &ctx};
    if (tsr_replica_run(&r, &io, err, sizeof err) < 0) {
        failed = err;
        if (be->engine->fatal && be->engine->fatal(*eng)) {
            device_lost(ex, j->epoch, err);
            goto out;
        }
        if (!io_should_stop(&ctx)) {
            snprintf(why, sizeof why, "data plane: %s", err);
            push_data_plane_failure(ex, j->epoch, why, tsr_coll_past_deadline(r.ops, r.tp));
        }
    }
out:
    if (*eng) be->engine->set_comm(*eng, NULL, NULL, 0);
    if (!failed) {
        pthread_mutex_lock(&ex->mu);
        failed = ex->shutdown            ? "the worker is stopping"
                 : ex->job_gen != gen      ? "a newer epoch replaced this one"
                                           : "the replica's leader ended the epoch";
        pthread_mutex_unlock(&ex->mu);
    }
    unwire(&r, failed);
    fail_queued(ex, j->epoch, "the replica stopped before serving it");
    totals_add(ex, &ctx.last);
}

static void *executor_main(void *arg)
{
    tsr_executor_t *ex = arg;
    tsr_engine_t *eng = NULL;
    tsr_backend_t be = {0};
    job_t *loaded = calloc(1, sizeof *loaded), *job = calloc(1, sizeof *job);
    if (!loaded || !job) goto out;
    for (;;) {
        pthread_mutex_lock(&ex->mu);
        while (!ex->shutdown && ex->job_gen == ex->run_gen) pthread_cond_wait(&ex->cv, &ex->mu);
        if (ex->shutdown) {
            pthread_mutex_unlock(&ex->mu);
            break;
        }
        uint64_t gen = ex->run_gen = ex->job_gen;
        *job = *ex->job;
        ex->owed_ms = 0;
        /* A job without a piece has no collectives; its thread only frees
         * the engine, which may take a while on a device. */
        ex->run_limit_ms = !job->active                ? TSR_COLL_TIMEOUT_MS_DEFAULT
                           : job->coll_ms < WATCH_MIN_MS ? WATCH_MIN_MS
                                                         : job->coll_ms;
        ex->run_epoch = job->epoch;
        pthread_mutex_unlock(&ex->mu);
        if (!job->active) {
            if (eng) be.engine->destroy(&eng);
            loaded->active = false;
            pthread_mutex_lock(&ex->mu);
            ex->wbytes = ex->kvbytes = 0;
            ex->stats = ex->totals;     /* the counts stay: they are since it started */
            ex->stats.queued = ex->stats.running = ex->stats.kv_used = ex->stats.kv_total = 0;
            ex->stats.kv_cached = 0;
            pthread_mutex_unlock(&ex->mu);
            fail_queued(ex, job->epoch, "this worker holds no piece any more");
            continue;
        }
        serve(ex, job, gen, loaded, &eng, &be);
    }
out:
    if (eng) be.engine->destroy(&eng);
    free(loaded);
    free(job);
    pthread_mutex_lock(&ex->mu);
    ex->exited = true;
    pthread_cond_broadcast(&ex->cv);
    pthread_mutex_unlock(&ex->mu);
    return NULL;
}

/* ---- the agent's side -------------------------------------------------------- */

tsr_executor_t *tsr_executor_new(const char *bind_host, const char *advertise_host, char *err,
                                 size_t errlen)
{
    tsr_executor_t *ex = calloc(1, sizeof *ex);
    int fds[2] = {-1, -1};
    if (!ex) return NULL;
    ex->job = calloc(1, sizeof *ex->job);
    ex->run_limit_ms = TSR_COLL_TIMEOUT_MS_DEFAULT;   /* idle: it takes its first job at once */
#ifdef TSR_TESTING
    const char *solo = getenv("TSR_TEST_NCCL_SOLO");
    ex->nccl_solo = solo && !strcmp(solo, "1");
#endif
    ex->listener = tsr_tcp_listen(bind_host, 0, err, errlen);
    if (!ex->job || !ex->listener || pipe2(fds, O_NONBLOCK | O_CLOEXEC) < 0) goto fail;
    ex->pipe_r = fds[0];
    ex->pipe_w = fds[1];
    if (advertise_host && tsr_tcp_listener_advertise(ex->listener, advertise_host) < 0) {
        snprintf(err, errlen, "cannot advertise data address %s", advertise_host);
        goto fail;
    }
    snprintf(ex->endpoint, sizeof ex->endpoint, "%s", tsr_tcp_listener_endpoint(ex->listener));
    pthread_mutex_init(&ex->mu, NULL);
    tsr_cond_init_monotonic(&ex->cv);
    if (pthread_create(&ex->thread, NULL, executor_main, ex) != 0) {
        snprintf(err, errlen, "cannot start the data-plane thread");
        pthread_mutex_destroy(&ex->mu);
        pthread_cond_destroy(&ex->cv);
        goto fail;
    }
    return ex;
fail:
    if (fds[0] >= 0) close(fds[0]), close(fds[1]);
    tsr_tcp_listener_destroy(&ex->listener);
    free(ex->job);
    free(ex);
    return NULL;
}

void tsr_executor_destroy(tsr_executor_t **ex_p)
{
    if (!ex_p || !*ex_p) return;
    tsr_executor_t *ex = *ex_p;
    pthread_mutex_lock(&ex->mu);
    ex->shutdown = true;
    pthread_cond_broadcast(&ex->cv);
    bool stuck = ex->stuck;
    pthread_mutex_unlock(&ex->mu);
    tsr_tcp_listener_wake(ex->listener);
    if (stuck) {
        /* It did not let go of its epoch; it will not see the stop either.
         * The process is exiting: give it a second (on the monotonic clock, and
         * as a wait on its own exit, which every join interceptor sees), else
         * leave it and what it may still touch. */
        struct timespec dl = tsr_monotonic_after_ms(1000);
        pthread_mutex_lock(&ex->mu);
        while (!ex->exited && pthread_cond_timedwait(&ex->cv, &ex->mu, &dl) != ETIMEDOUT) {}
        bool exited = ex->exited;
        pthread_mutex_unlock(&ex->mu);
        if (!exited) {
            tsr_warn("the data-plane thread is stuck: left running as the worker exits");
            *ex_p = NULL;
            return;
        }
    }
    pthread_join(ex->thread, NULL);
    fail_queued(ex, 0, "worker shutting down");
    tsr_event_t ev;
    while (tsr_executor_pop_event(ex, &ev)) {}
    /* cancels nobody will read any more (the piece stopped before them) */
    for (qnode_t *n; (n = fifo_pop(&ex->cancels));) free(n);
    close(ex->pipe_r);
    close(ex->pipe_w);
    tsr_tcp_listener_destroy(&ex->listener);
    pthread_mutex_destroy(&ex->mu);
    pthread_cond_destroy(&ex->cv);
    free(ex->job);
    free(ex);
    *ex_p = NULL;
}

const char *tsr_executor_endpoint(const tsr_executor_t *ex) { return ex->endpoint; }
int tsr_executor_event_fd(const tsr_executor_t *ex) { return ex->pipe_r; }

void tsr_executor_bytes(tsr_executor_t *ex, uint64_t *weights, uint64_t *kv)
{
    pthread_mutex_lock(&ex->mu);
    *weights = ex->wbytes;
    *kv = ex->kvbytes;
    pthread_mutex_unlock(&ex->mu);
}

/* "worker W on node N" for peer i of as, or "" when the coordinator did
 * not say (an older one) or the slot has no holder. */
static void peer_name(const Tessera__Assignment *as, int i, char *out, size_t len)
{
    const char *w = i < (int)as->n_peer_workers ? as->peer_workers[i] : "";
    const char *node = i < (int)as->n_peer_nodes ? as->peer_nodes[i] : "";
    if (!w || !*w) out[0] = '\0';
    else if (!node || !*node) snprintf(out, len, "worker %.128s", w);
    else snprintf(out, len, "worker %.128s on node %.128s", w, node);
}

void tsr_executor_assign(tsr_executor_t *ex, const Tessera__Assignment *as)
{
    pthread_mutex_lock(&ex->mu);
    job_t *j = ex->job;
    memset(j, 0, sizeof *j);
    j->active = true;
    tsr_piece_from_wire(&j->key, as);
    snprintf(j->model_path, sizeof j->model_path, "%s", as->model_path);
    j->epoch = as->epoch;
    j->max_seq_len = (int)as->max_seq_len;
    j->max_batch = (int)as->max_batch;
    j->prefill_chunk = (int)as->prefill_chunk;
    j->max_queue = (int)as->max_queue;
    j->kv_cache_bytes = as->kv_cache_bytes;
    j->kv_dtype = as->kv_dtype > INT_MAX ? INT_MAX : (int)as->kv_dtype;   /* unknown: refused at load */
    j->matmul_dtype = as->matmul_dtype > INT_MAX ? INT_MAX : (int)as->matmul_dtype;
    j->weights_dtype = as->weights_dtype > INT_MAX ? INT_MAX : (int)as->weights_dtype;
    j->device = as->device == TESSERA__DEVICE_KIND__DEVICE_CUDA ? TSR_DEVICE_CUDA : TSR_DEVICE_CPU;
    j->coll_ms = as->collective_timeout_ms && as->collective_timeout_ms <= TSR_COLL_TIMEOUT_MS_MAX
                     ? (int)as->collective_timeout_ms
                     : tsr_coll_timeout_default(j->device);
    j->n_peers = as->n_peers < MAX_PEERS ? (int)as->n_peers : MAX_PEERS;
    for (int i = 0; i < j->n_peers; i++) {
        snprintf(j->peers[i], sizeof j->peers[i], "%s", as->peers[i]);
        snprintf(j->devices[i], sizeof j->devices[i], "%s",
                 i < (int)as->n_peer_devices ? as->peer_devices[i] : "");
        peer_name(as, i, j->names[i], sizeof j->names[i]);
    }
    /* the groups whose relayed blobs it takes; those of an older epoch go */
    int tp = j->key.tp_size, st = j->key.stage, t = j->key.tp;
    j->n_groups = 0;
    if (tp > 1 || ex->nccl_solo) j->groups[j->n_groups++] = group_id(j, "tp", st, 0);
    if (st > 0) j->groups[j->n_groups++] = group_id(j, "pp", st, t);
    if (st < j->key.pp_size - 1) j->groups[j->n_groups++] = group_id(j, "pp", st + 1, t);
    for (int k = 0; k < ex->n_mail;)
        if (ex->mail[k].epoch != j->epoch) ex->mail[k] = ex->mail[--ex->n_mail];
        else k++;
    /* A missing or oversized secret stays empty: forming then fails, naming it. */
    if (as->data_secret.data && as->data_secret.len <= sizeof j->secret) {
        memcpy(j->secret, as->data_secret.data, as->data_secret.len);
        j->secret_len = as->data_secret.len;
    }
    j->kv_reserve = as->kv_admission == 1;
    if (as->prefix_cache && as->prefix_secret.data && as->prefix_secret.len == TSR_PREFIX_SECRET) {
        memcpy(j->prefix_secret, as->prefix_secret.data, TSR_PREFIX_SECRET);
        j->prefix_cache = true;
    }
    ex->job_gen++;
    if (!ex->owed_ms) ex->owed_ms = tsr_now_ms();
    pthread_cond_broadcast(&ex->cv);
    pthread_mutex_unlock(&ex->mu);
    tsr_tcp_listener_wake(ex->listener);  /* a wait for peers of the old job ends */
}

void tsr_executor_unassign(tsr_executor_t *ex)
{
    pthread_mutex_lock(&ex->mu);
    memset(ex->job, 0, sizeof *ex->job);
    ex->job_gen++;
    if (!ex->owed_ms) ex->owed_ms = tsr_now_ms();
    pthread_cond_broadcast(&ex->cv);
    pthread_mutex_unlock(&ex->mu);
    tsr_tcp_listener_wake(ex->listener);  /* a wait for peers of the old job ends */
}

void tsr_executor_submit(tsr_executor_t *ex, tsr_request_t *r)
{
    qreq_t *n = calloc(1, sizeof *n);
    if (!n) {
        pthread_mutex_lock(&ex->mu);
        uint64_t epoch = ex->job->epoch;
        pthread_mutex_unlock(&ex->mu);
        tsr_event_t ev = {.kind = TSR_EV_TOKEN, .epoch = epoch, .request_id = r->request_id,
                          .token = -1, .done = 1, .retryable = 1};
        snprintf(ev.text, sizeof ev.text, "the worker is out of memory for the request");
        push_event(ex, &ev);
        free(r->prompt);
        r->prompt = NULL;
        return;
    }
    n->r = *r;
    r->prompt = NULL;
    pthread_mutex_lock(&ex->mu);
    bool leader = ex->job->active && ex->job->key.stage == 0 && ex->job->key.tp == 0;
    uint64_t epoch = ex->job->epoch;
    if (leader) {
        fifo_push(&ex->requests, &n->link);
        pthread_cond_broadcast(&ex->cv);
    }
    pthread_mutex_unlock(&ex->mu);
    if (!leader) {
        tsr_event_t ev = {.kind = TSR_EV_TOKEN, .epoch = epoch, .request_id = n->r.request_id,
                          .token = -1, .done = 1, .retryable = 1};
        snprintf(ev.text, sizeof ev.text, "this worker is not a replica leader");
        push_event(ex, &ev);
        free(n->r.prompt);
        free(n);
    }
}

void tsr_executor_cancel(tsr_executor_t *ex, uint64_t request_id, const char *reason)
{
    cancel_node_t *n = calloc(1, sizeof *n);
    if (!n) return;
    n->id = request_id;
    snprintf(n->reason, sizeof n->reason, "%s", reason ? reason : "");
    pthread_mutex_lock(&ex->mu);
    fifo_push(&ex->cancels, &n->link);
    pthread_cond_broadcast(&ex->cv);
    pthread_mutex_unlock(&ex->mu);
}

void tsr_executor_stats(tsr_executor_t *ex, tsr_executor_stats_t *out)
{
    pthread_mutex_lock(&ex->mu);
    *out = ex->stats;
    pthread_mutex_unlock(&ex->mu);
    out->steps = __atomic_load_n(&ex->steps, __ATOMIC_RELAXED);
}

void tsr_executor_set_device(tsr_executor_t *ex, int index)
{
    ex->device_index = index;
}

bool tsr_executor_watch(tsr_executor_t *ex, int64_t now)
{
    char why[400];
    tsr_event_t ev = {.kind = TSR_EV_FAILED, .fatal = 1};
    pthread_mutex_lock(&ex->mu);
    /* The agent looks every 100 ms or so: a gap of over 500 ms is time the whole
     * process did not run (SIGSTOP, a suspended machine), which the thread
     * did not have either, so it does not count against it. */
    if (ex->owed_ms && ex->last_watch_ms && now - ex->last_watch_ms > WATCH_GAP_MS)
        ex->owed_ms += now - ex->last_watch_ms;
    ex->last_watch_ms = now;
    /* A thread that is getting on with its step is not stuck, however long
     * the step: the limit counts from its last sign of life. */
    uint64_t life = __atomic_load_n(&ex->steps, __ATOMIC_RELAXED) +
                    __atomic_load_n(&ex->alive, __ATOMIC_RELAXED);
    if (life != ex->life_seen && ex->owed_ms) ex->owed_ms = now;
    ex->life_seen = life;
    int64_t owed = ex->owed_ms ? now - ex->owed_ms : 0;
    bool fire = !ex->stuck && !ex->loading && owed > ex->run_limit_ms;
    if (fire) {
        ex->stuck = ex->device_lost = true;
        snprintf(why, sizeof why,
                 "the data-plane thread is stuck: it has not let go of epoch %llu, nor "
                 "finished any part of a step, for %lld ms (since the next assignment arrived, "
                 "or its last sign of life after that; limit %d ms, from "
                 "collective_timeout_ms), so it is blocked outside every "
                 "deadline (a driver call, a collective that ignores its abort); the worker "
                 "exits to be restarted",
                 (unsigned long long)ex->run_epoch, (long long)owed, ex->run_limit_ms);
        /* Said for the piece the agent holds now (the newer job's), so the
         * coordinator hears it; with none, the exit speaks for itself. */
        ev.epoch = ex->job->epoch;
        snprintf(ev.text, sizeof ev.text, "%s", why);
    }
    bool active = ex->job->active;
    pthread_mutex_unlock(&ex->mu);
    if (!fire) return false;
    tsr_error("%s", why);
    if (active) push_event(ex, &ev);
    return true;
}

bool tsr_executor_device_lost(tsr_executor_t *ex)
{
    pthread_mutex_lock(&ex->mu);
    bool lost = ex->device_lost;
    pthread_mutex_unlock(&ex->mu);
    return lost;
}
