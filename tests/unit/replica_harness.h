/* replica_harness.h: a whole replica in this process, for the unit tests
 * of the data plane (include after cmocka.h).
 *
 * One thread per rank, each with its own TCP listener, its CPU engine and
 * the communicators the executor forms (control channel, TP group, links
 * between stages), all driven by the replica runner the worker uses.  The
 * leader's requests come from a script: each arrives at a time, may be
 * cancelled after some tokens, and every token reported by the last stage
 * is recorded per request.  The run ends when every request has finished
 * and every rank's KV pool is empty again. */
#ifndef TSR_REPLICA_HARNESS_H
#define TSR_REPLICA_HARNESS_H

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/slice.h"
#include "worker/collective.h"
#include "worker/engine.h"
#include "worker/kvpool.h"
#include "worker/replica.h"

#define H_MAX_RANKS 16
#define H_MAX_TOKENS 512

typedef struct {
    /* the script */
    int32_t *prompt;
    int n_prompt, max_tokens;
    float temperature, top_p;
    uint64_t seed;
    int arrive_ms;              /* after the start */
    int after;                  /* and not before request after - 1 is done (0: no wait) */
    int cancel_after;           /* cancel once this many tokens came (0: never) */
    /* what happened */
    int32_t tokens[H_MAX_TOKENS];
    int n_tokens;
    int done, failed, cancel_sent;
    int retryable;              /* the failure was the replica's, not the request's */
    char error[256];
    char finish[16];
    int cached;                 /* prompt positions its replica took from the prefix cache */
} h_req_t;

typedef struct {
    const char *dir;
    int tp, pp;
    int max_batch, prefill_chunk, max_queue, kv_blocks, max_seq_len;
    int kv_dtype;               /* tsr_kv_dtype_t (0: auto) */
    int prefix_cache;           /* the leader caches prefixes (under a fixed secret) */
    int kv_reserve;             /* admit by the worst case (kv_admission reserve) */
    int matmul_dtype;           /* the same values: the products' type (0: auto) */
    int weights_dtype;          /* auto or int8 weights (weights_dtype) */
    h_req_t *reqs;
    int n_reqs;
    /* logits of every sampled token of request 0, for layout checks */
    float *logits;
    int n_logits, vocab;
    /* after the run */
    int kv_used[H_MAX_RANKS], kv_total[H_MAX_RANKS], kv_cached[H_MAX_RANKS];
    tsr_replica_stats_t stats[H_MAX_RANKS];   /* each rank's last report */
    int max_running;
    uint64_t weight_bytes[H_MAX_RANKS];
    int rc[H_MAX_RANKS];
    char err[H_MAX_RANKS][512];
} h_run_t;

typedef struct {
    h_run_t *run;
    int idx, stage, rank;
    tsr_tcp_listener_t **ls;
    const char **eps;
    tsr_engine_t *inner;
    int next_req;
    int64_t t0;
    int held;                   /* tokens emitted since the last flush */
    int unflushed;              /* steps that began with tokens not flushed */
} h_rank_t;

static pthread_mutex_t h_mu = PTHREAD_MUTEX_INITIALIZER;

static int64_t h_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- an engine that records request 0's logits (delegates the rest) --------- */

struct tsr_engine {
    h_rank_t *k;
    const tsr_batch_t *last;
};

static int h_step(tsr_engine_t *e, const tsr_batch_t *b, int32_t *sampled, char *err, size_t len)
{
    h_rank_t *k = e->k;
    if (k->held) k->unflushed++;    /* the last step's tokens must be handed on by now */
    int rc = tsr_engine_cpu.step(k->inner, b, sampled, err, len);
    h_run_t *run = k->run;
    if (rc == 0 && k->stage == run->pp - 1 && k->rank == 0 && run->logits) {
        /* Slot of request 0 is the slot of the entry whose tokens it sent:
         * the tests that record logits run request 0 alone. */
        float *rows = malloc((size_t)b->n_entries * run->vocab * sizeof *rows);
        int n = rows ? tsr_engine_cpu.last_logits(k->inner, rows, b->n_entries) : 0;
        pthread_mutex_lock(&h_mu);
        for (int i = 0; i < n && run->n_logits < H_MAX_TOKENS; i++)
            memcpy(run->logits + (size_t)run->n_logits++ * run->vocab, rows + (size_t)i * run->vocab,
                   (size_t)run->vocab * sizeof(float));
        pthread_mutex_unlock(&h_mu);
        free(rows);
    }
    return rc;
}
static void h_set_comm(tsr_engine_t *e, const tsr_coll_ops_t *o, tsr_comm_t *c, int ms)
{
    tsr_engine_cpu.set_comm(e->k->inner, o, c, ms);
}
static tsr_buf_t h_hidden(tsr_engine_t *e, int w) { return tsr_engine_cpu.hidden(e->k->inner, w); }
static void h_release(tsr_engine_t *e, int s) { tsr_engine_cpu.release(e->k->inner, s); }
static void h_kv_usage(const tsr_engine_t *e, int *u, int *t) { tsr_engine_cpu.kv_usage(e->k->inner, u, t); }
static const tsr_model_info_t *h_model(const tsr_engine_t *e) { return tsr_engine_cpu.model(e->k->inner); }
static tsr_kvpool_t *h_kvpool(tsr_engine_t *e) { return tsr_engine_cpu.kvpool(e->k->inner); }
static const tsr_engine_ops_t h_recording = {.name = "recording", .step = h_step,
                                             .set_comm = h_set_comm, .hidden = h_hidden,
                                             .release = h_release, .kv_usage = h_kv_usage,
                                             .model = h_model, .kvpool = h_kvpool};

/* ---- io ----------------------------------------------------------------------- */

static int h_next_request(void *arg, tsr_request_t *r, int wait_ms)
{
    h_rank_t *k = arg;
    h_run_t *run = k->run;
    int64_t until = h_now_ms() + wait_ms;
    for (;;) {
        int after = k->next_req < run->n_reqs ? run->reqs[k->next_req].after : 0;
        pthread_mutex_lock(&h_mu);
        int waits = after > 0 && after <= run->n_reqs && !run->reqs[after - 1].done;
        pthread_mutex_unlock(&h_mu);
        if (k->next_req < run->n_reqs && !waits &&
            h_now_ms() - k->t0 >= run->reqs[k->next_req].arrive_ms) {
            h_req_t *q = &run->reqs[k->next_req];
            memset(r, 0, sizeof *r);
            r->request_id = (uint64_t)k->next_req + 1;
            r->prompt = malloc((size_t)q->n_prompt * sizeof *r->prompt);
            memcpy(r->prompt, q->prompt, (size_t)q->n_prompt * sizeof *r->prompt);
            r->n_prompt = q->n_prompt;
            r->max_tokens = q->max_tokens;
            r->temperature = q->temperature;
            r->top_p = q->top_p;
            r->seed = q->seed;
            k->next_req++;
            return 1;
        }
        if (h_now_ms() >= until) return 0;
        usleep(1000);
    }
}

static int h_next_cancel(void *arg, uint64_t *id, char *reason, size_t len)
{
    h_rank_t *k = arg;
    h_run_t *run = k->run;
    int found = 0;
    pthread_mutex_lock(&h_mu);
    for (int i = 0; i < run->n_reqs && !found; i++) {
        h_req_t *q = &run->reqs[i];
        if (q->cancel_after && !q->cancel_sent && !q->done && q->n_tokens >= q->cancel_after) {
            q->cancel_sent = 1;
            *id = (uint64_t)i + 1;
            snprintf(reason, len, "test cancel");
            found = 1;
        }
    }
    pthread_mutex_unlock(&h_mu);
    return found;
}

static void h_emit(void *arg, uint64_t id, int32_t token, int index, int done, int retryable,
                   const char *fin, const char *error)
{
    h_rank_t *k = arg;
    h_run_t *run = k->run;
    if (!error) k->held++;
    if (id < 1 || id > (uint64_t)run->n_reqs) return;
    h_req_t *q = &run->reqs[id - 1];
    pthread_mutex_lock(&h_mu);
    if (!q->done) {
        if (error) {
            q->failed = 1;
            q->retryable = retryable;
            q->done = 1;
            snprintf(q->error, sizeof q->error, "%s", error);
        } else if (index == q->n_tokens && q->n_tokens < H_MAX_TOKENS) {
            q->tokens[q->n_tokens++] = token;
            if (done) {
                q->done = 1;
                snprintf(q->finish, sizeof q->finish, "%s", fin ? fin : "");
            }
        } else {
            q->failed = 1;
            q->retryable = retryable;
            q->done = 1;
            snprintf(q->error, sizeof q->error, "token index %d out of order (had %d)", index,
                     q->n_tokens);
        }
    }
    pthread_mutex_unlock(&h_mu);
}

static void h_flush(void *arg) { ((h_rank_t *)arg)->held = 0; }

static int h_should_stop(void *arg)
{
    h_rank_t *k = arg;
    h_run_t *run = k->run;
    int stop = k->next_req == run->n_reqs;
    pthread_mutex_lock(&h_mu);
    for (int i = 0; stop && i < run->n_reqs; i++) stop = run->reqs[i].done;
    for (int i = 0; stop && i < run->tp * run->pp; i++) stop = run->kv_used[i] == 0;
    pthread_mutex_unlock(&h_mu);
    return stop;
}

static void h_report(void *arg, const tsr_replica_stats_t *s)
{
    h_rank_t *k = arg;
    pthread_mutex_lock(&h_mu);
    k->run->kv_used[k->idx] = s->kv_used;
    k->run->kv_total[k->idx] = s->kv_total;
    k->run->kv_cached[k->idx] = s->kv_cached;
    k->run->stats[k->idx] = *s;
    if (s->running > k->run->max_running) k->run->max_running = s->running;
    pthread_mutex_unlock(&h_mu);
}

static void h_cached(void *arg, uint64_t id, int tokens)
{
    h_rank_t *k = arg;
    if (id < 1 || id > (uint64_t)k->run->n_reqs) return;
    pthread_mutex_lock(&h_mu);
    k->run->reqs[id - 1].cached = tokens;
    pthread_mutex_unlock(&h_mu);
}

/* ---- one rank ---------------------------------------------------------------- */

static tsr_comm_t *h_group(h_rank_t *k, const char *kind, uint64_t gid, int rank, int n,
                           const int *members)
{
    char blob[H_MAX_RANKS * 64] = "";
    size_t len = 0;
    for (int i = 0; i < n; i++) len += (size_t)sprintf(blob + len, "%s\n", k->eps[members[i]]);
    static const uint8_t secret[32] = "replica harness data secret....";
    tsr_rendezvous_t rv = {1, gid, rank, n, blob, len, 20000, NULL, NULL, secret,
                           sizeof secret, NULL, NULL, NULL, NULL};
    tsr_comm_t *c = NULL;
    tsr_coll_ctx_t ctx = {.listener = k->ls[k->idx]};
    if (tsr_coll_tcp.create(&ctx, &rv, &c, k->run->err[k->idx], sizeof k->run->err[0]) < 0) {
        char tmp[600];
        snprintf(tmp, sizeof tmp, "%s group: %s", kind, k->run->err[k->idx]);
        snprintf(k->run->err[k->idx], sizeof k->run->err[0], "%s", tmp);
        return NULL;
    }
    return c;
}

static void *h_rank_main(void *arg)
{
    h_rank_t *k = arg;
    h_run_t *run = k->run;
    tsr_replica_rank_t r = {0};
    int m[H_MAX_RANKS], tp = run->tp, s = k->stage, t = k->rank, n = run->tp * run->pp;
    char *err = run->err[k->idx];
    size_t errlen = sizeof run->err[0];
    run->rc[k->idx] = -1;
    /* The executor's order: control channel, TP group, link up, link down. */
    if (n > 1) {
        for (int i = 0; i < n; i++) m[i] = i;
        if (!(r.ctl = h_group(k, "ctl", 7, k->idx, n, m))) return NULL;
    }
    if (tp > 1) {
        for (int i = 0; i < tp; i++) m[i] = s * tp + i;
        if (!(r.tp = h_group(k, "tp", 100 + (uint64_t)s, t, tp, m))) goto out;
    }
    if (s > 0) {
        m[0] = (s - 1) * tp + t, m[1] = s * tp + t;
        if (!(r.prev = h_group(k, "pp", 200 + (uint64_t)(s * 16 + t), 1, 2, m))) goto out;
    }
    if (s < run->pp - 1) {
        m[0] = s * tp + t, m[1] = (s + 1) * tp + t;
        if (!(r.next = h_group(k, "pp", 200 + (uint64_t)((s + 1) * 16 + t), 0, 2, m))) goto out;
    }
    tsr_model_info_t mi;
    if (tsr_model_info_load(run->dir, &mi, err, errlen) < 0) goto out;
    r.spec = (tsr_piece_spec_t){t, tp, s, run->pp, 0, 0, run->max_seq_len, run->max_batch,
                                run->max_batch + run->prefill_chunk, run->kv_blocks, 1, 0,
                                run->kv_dtype, run->matmul_dtype, run->weights_dtype, 0, 1};
    tsr_layer_split(mi.num_hidden_layers, run->pp, s, &r.spec.layer_begin, &r.spec.layer_end);
    if (tsr_engine_cpu.load(run->dir, &r.spec, &k->inner, err, errlen) < 0) goto out;
    run->weight_bytes[k->idx] = tsr_engine_cpu.weight_bytes(k->inner);
    struct tsr_engine wrap = {k, NULL};
    tsr_engine_cpu.set_comm(k->inner, &tsr_coll_tcp, r.tp, 0);
    r.eng_ops = &h_recording;
    r.eng = &wrap;
    r.ops = &tsr_coll_tcp;
    r.ctl_ops = &tsr_coll_tcp;
    r.prefill_chunk = run->prefill_chunk;
    r.max_queue = run->max_queue;
    r.idle_ms = 20;
    static const uint8_t prefix_secret[16] = "harness prefix.";
    if (run->prefix_cache) r.prefix_secret = prefix_secret;
    r.kv_reserve = run->kv_reserve;
    k->t0 = h_now_ms();
    tsr_replica_io_t io = {h_next_request, h_next_cancel, h_emit, h_should_stop, h_report, h_flush,
                           h_cached, k};
    run->rc[k->idx] = tsr_replica_run(&r, &io, err, errlen);
    if (k->held) k->unflushed++;
out:
    tsr_engine_cpu.destroy(&k->inner);
    if (r.ctl) tsr_coll_tcp.destroy(&r.ctl);
    if (r.tp) tsr_coll_tcp.destroy(&r.tp);
    if (r.prev) tsr_coll_tcp.destroy(&r.prev);
    if (r.next) tsr_coll_tcp.destroy(&r.next);
    return NULL;
}

/* Runs the script through a tp x pp replica; fails the test on any rank's
 * error.  Defaults: max_batch 8, prefill_chunk 32, max_queue 256, a pool
 * of max_batch full sequences, max_seq_len 512 (fields left 0). */
static void h_run(h_run_t *run)
{
    char err[256];
    tsr_model_info_t m;
    assert_int_equal(tsr_model_info_load(run->dir, &m, err, sizeof err), 0);
    if (!run->max_batch) run->max_batch = 8;
    if (!run->prefill_chunk) run->prefill_chunk = 32;
    if (!run->max_queue) run->max_queue = 256;
    if (!run->max_seq_len) run->max_seq_len = 512;
    if (!run->kv_blocks) run->kv_blocks = run->max_batch * tsr_kv_blocks_for(run->max_seq_len);
    run->vocab = m.vocab_size;
    int n = run->tp * run->pp;
    tsr_tcp_listener_t *ls[H_MAX_RANKS];
    const char *eps[H_MAX_RANKS];
    h_rank_t ranks[H_MAX_RANKS];
    pthread_t th[H_MAX_RANKS];
    for (int i = 0; i < n; i++) {
        ls[i] = tsr_tcp_listen("127.0.0.1", 0, err, sizeof err);
        assert_non_null(ls[i]);
        eps[i] = tsr_tcp_listener_endpoint(ls[i]);
        run->kv_used[i] = -1;   /* not reported yet */
    }
    for (int i = 0; i < n; i++) {
        ranks[i] = (h_rank_t){run, i, i / run->tp, i % run->tp, ls, eps, NULL, 0, 0, 0, 0};
        pthread_create(&th[i], NULL, h_rank_main, &ranks[i]);
    }
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < n; i++) tsr_tcp_listener_destroy(&ls[i]);
    for (int i = 0; i < n; i++)
        if (run->rc[i] != 0) fail_msg("tp %d pp %d rank %d: %s", run->tp, run->pp, i, run->err[i]);
    /* io.flush's contract: a step's tokens are handed on before the next
     * step runs and before the runner returns. */
    for (int i = 0; i < n; i++)
        if (ranks[i].unflushed)
            fail_msg("tp %d pp %d rank %d: %d step(s) left tokens unflushed", run->tp, run->pp, i,
                     ranks[i].unflushed);
}

#endif
