#include "worker/replica.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STEP_MAGIC 0x54535350u  /* "TSSP" */

enum { OP_NOP = 0, OP_PREFILL = 1, OP_DECODE = 2, OP_STOP = 3 };

/* What travels with every step; the tokens (stage 0) or the hidden state
 * (later stages) follow it. */
typedef struct {
    uint32_t magic, op;
    uint64_t req, seed;
    int32_t pos, n, max_tokens, prompt_len;
    float temperature, top_p;
} step_t;

/* The last stage's rank 0 samples; this is what it keeps per request. */
typedef struct {
    uint64_t req, rng;
    int index;
} sampler_t;

/* Token travelling back from the last stage to the leader. */
typedef struct {
    uint64_t req;
    int32_t token, done;
} back_t;

const char *tsr_finish_reason(const tsr_model_info_t *m, int32_t token, int index,
                              int prompt_len, int max_tokens, int max_seq_len)
{
    for (int i = 0; i < m->n_eos; i++)
        if (token == m->eos_ids[i]) return "eos";
    if (index + 1 >= max_tokens) return "max_tokens";
    if (prompt_len + index >= max_seq_len) return "max_seq_len";  /* no room for the next */
    return NULL;
}

static int is_first(const tsr_replica_rank_t *r) { return r->spec.stage == 0; }
static int is_last(const tsr_replica_rank_t *r) { return r->spec.stage == r->spec.pp_size - 1; }
static int is_leader(const tsr_replica_rank_t *r) { return is_first(r) && r->spec.tp_rank == 0; }

/* A step from a peer is checked before its payload is read: the payload's
 * size comes from it. */
static int step_ok(const tsr_replica_rank_t *r, const step_t *st, const char *from, char *err,
                   size_t errlen)
{
    if (st->magic == STEP_MAGIC && st->op <= OP_STOP && st->n >= 0 &&
        st->n <= r->spec.max_seq_len)
        return 0;
    snprintf(err, errlen,
             "malformed step from %s: magic 0x%08x (expected 0x%08x), op %u, %d positions "
             "(max_seq_len %d)",
             from, st->magic, STEP_MAGIC, st->op, st->n, r->spec.max_seq_len);
    return -1;
}

/* Moves a step (and its payload) from where this rank gets it: the leader
 * already has it, the rest of stage 0 gets it by broadcast, later stages
 * from the previous stage. */
static int receive_step(tsr_replica_rank_t *r, step_t *st, int32_t *tokens, float *hidden,
                        int timeout, char *err, size_t errlen)
{
    int H = r->eng_ops->model(r->eng)->hidden_size;
    if (is_first(r)) {
        if (r->spec.tp_size > 1) {
            if (r->ops->broadcast(r->tp, st, sizeof *st, 0, timeout, err, errlen) < 0 ||
                step_ok(r, st, "the leader", err, errlen) < 0)
                return -1;
            if (st->n && r->ops->broadcast(r->tp, tokens, (size_t)st->n * sizeof *tokens, 0,
                                           timeout, err, errlen) < 0)
                return -1;
        }
        return 0;
    }
    if (r->ops->recv(r->prev, 0, st, sizeof *st, timeout, err, errlen) < 0 ||
        step_ok(r, st, "the previous stage", err, errlen) < 0)
        return -1;
    if ((st->op == OP_PREFILL || st->op == OP_DECODE) &&
        r->ops->recv(r->prev, 0, hidden, (size_t)st->n * H * sizeof(float), timeout, err,
                     errlen) < 0)
        return -1;
    return 0;
}

static int pass_down(tsr_replica_rank_t *r, const step_t *st, const float *hidden, char *err,
                     size_t errlen)
{
    if (is_last(r)) return 0;
    int H = r->eng_ops->model(r->eng)->hidden_size, t = r->peer_timeout_ms;
    if (r->ops->send(r->next, 1, st, sizeof *st, t, err, errlen) < 0) return -1;
    if (st->op == OP_PREFILL || st->op == OP_DECODE)
        return r->ops->send(r->next, 1, hidden, (size_t)st->n * H * sizeof(float), t, err, errlen);
    return 0;
}

/* Runs one compute step on this rank.  On the last stage's rank 0 it
 * samples, reports and (pp > 1) sends the token back to the leader;
 * *back receives it there. */
static int compute(tsr_replica_rank_t *r, const tsr_replica_io_t *io, const step_t *st,
                   const int32_t *tokens, float *hidden, float *out, sampler_t *smp,
                   back_t *back, char *err, size_t errlen)
{
    const tsr_model_info_t *m = r->eng_ops->model(r->eng);
    if (r->eng_ops->forward(r->eng, 0, st->pos, st->n, tokens, is_first(r) ? NULL : hidden, out,
                            err, errlen) < 0)
        return -1;
    if (!is_last(r)) return pass_down(r, st, out, err, errlen);
    if (r->spec.tp_rank != 0) return 0;
    if (st->op == OP_PREFILL) *smp = (sampler_t){st->req, st->seed, 0};
    int32_t tok = tsr_sample(out, m->vocab_size, st->temperature, st->top_p, &smp->rng);
    const char *fin = tsr_finish_reason(m, tok, smp->index, st->prompt_len, st->max_tokens,
                                        r->spec.max_seq_len);
    io->emit(io->arg, st->req, tok, smp->index, fin != NULL, fin, NULL);
    smp->index++;
    *back = (back_t){st->req, tok, fin != NULL};
    if (r->spec.pp_size > 1)
        return r->ops->send(r->loop, 0, back, sizeof *back, r->peer_timeout_ms, err, errlen);
    return 0;
}

/* The leader's side of one step: hand it to the TP group and run it. */
static int lead_step(tsr_replica_rank_t *r, const tsr_replica_io_t *io, step_t *st,
                     int32_t *tokens, float *hidden, float *out, sampler_t *smp, back_t *back,
                     char *err, size_t errlen)
{
    int t = r->peer_timeout_ms;
    st->magic = STEP_MAGIC;
    if (r->spec.tp_size > 1) {
        if (r->ops->broadcast(r->tp, st, sizeof *st, 0, t, err, errlen) < 0) return -1;
        if (st->n && r->ops->broadcast(r->tp, tokens, (size_t)st->n * sizeof *tokens, 0, t, err,
                                       errlen) < 0)
            return -1;
    }
    if (st->op != OP_PREFILL && st->op != OP_DECODE) return pass_down(r, st, hidden, err, errlen);
    if (compute(r, io, st, tokens, hidden, out, smp, back, err, errlen) < 0) return -1;
    if (r->spec.pp_size > 1 &&
        r->ops->recv(r->loop, 1, back, sizeof *back, r->token_timeout_ms, err, errlen) < 0)
        return -1;
    return 0;
}

static int lead(tsr_replica_rank_t *r, const tsr_replica_io_t *io, int32_t *tokens,
                float *hidden, float *out, sampler_t *smp, char *err, size_t errlen)
{
    for (;;) {
        step_t st = {0};
        back_t back = {0};
        if (io->should_stop(io->arg)) {
            st.op = OP_STOP;
            lead_step(r, io, &st, tokens, hidden, out, smp, &back, err, errlen);
            return 0;
        }
        tsr_request_t q;
        if (!io->next_request(io->arg, &q, r->idle_ms)) {
            st.op = OP_NOP;
            if (lead_step(r, io, &st, tokens, hidden, out, smp, &back, err, errlen) < 0) return -1;
            continue;
        }
        if (q.n_prompt < 1 || q.n_prompt > r->spec.max_seq_len) {
            char why[128];
            snprintf(why, sizeof why, "prompt of %d tokens does not fit max_seq_len %d",
                     q.n_prompt, r->spec.max_seq_len);
            io->emit(io->arg, q.request_id, -1, 0, 1, NULL, why);
            free(q.prompt);
            continue;
        }
        st = (step_t){STEP_MAGIC, OP_PREFILL, q.request_id, q.seed, 0, q.n_prompt,
                      q.max_tokens, q.n_prompt, q.temperature, q.top_p};
        memcpy(tokens, q.prompt, (size_t)q.n_prompt * sizeof *tokens);
        free(q.prompt);
        for (int i = 0;; i++) {
            if (lead_step(r, io, &st, tokens, hidden, out, smp, &back, err, errlen) < 0) {
                io->emit(io->arg, st.req, -1, i, 1, NULL, err);
                return -1;
            }
            if (back.done) break;
            st.op = OP_DECODE;
            st.pos = st.prompt_len + i;
            st.n = 1;
            tokens[0] = back.token;
        }
    }
}

static int follow(tsr_replica_rank_t *r, const tsr_replica_io_t *io, int32_t *tokens,
                  float *hidden, float *out, sampler_t *smp, char *err, size_t errlen)
{
    for (;;) {
        step_t st;
        back_t back;
        if (receive_step(r, &st, tokens, hidden, r->peer_timeout_ms, err, errlen) < 0) {
            if (is_last(r) && r->spec.tp_rank == 0 && smp->req)
                io->emit(io->arg, smp->req, -1, smp->index, 1, NULL, err);
            return -1;
        }
        if (st.op == OP_STOP) {
            pass_down(r, &st, hidden, err, errlen);
            return 0;
        }
        if (st.op == OP_NOP) {
            if (pass_down(r, &st, hidden, err, errlen) < 0) return -1;
            continue;
        }
        if (compute(r, io, &st, tokens, hidden, out, smp, &back, err, errlen) < 0) {
            if (is_last(r) && r->spec.tp_rank == 0)
                io->emit(io->arg, st.req, -1, smp->index, 1, NULL, err);
            return -1;
        }
    }
}

int tsr_replica_run(tsr_replica_rank_t *r, const tsr_replica_io_t *io, char *err, size_t errlen)
{
    const tsr_model_info_t *m = r->eng_ops->model(r->eng);
    size_t S = (size_t)r->spec.max_seq_len, H = (size_t)m->hidden_size;
    size_t outn = S * H > (size_t)m->vocab_size ? S * H : (size_t)m->vocab_size;
    if (!r->idle_ms) r->idle_ms = 250;
    if (!r->peer_timeout_ms) r->peer_timeout_ms = 3000;
    if (!r->token_timeout_ms) r->token_timeout_ms = 60000;
    int32_t *tokens = calloc(S, sizeof *tokens);
    float *hidden = calloc(S * H, sizeof *hidden), *out = calloc(outn, sizeof *out);
    sampler_t smp = {0};
    int rc = -1;
    if (!tokens || !hidden || !out) {
        snprintf(err, errlen, "out of memory for step buffers");
        goto out;
    }
    rc = is_leader(r) ? lead(r, io, tokens, hidden, out, &smp, err, errlen)
                      : follow(r, io, tokens, hidden, out, &smp, err, errlen);
out:
    free(tokens);
    free(hidden);
    free(out);
    return rc;
}
