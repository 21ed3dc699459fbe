/* test_scheduler.c: the continuous-batching contract of worker/scheduler.h,
 * proved on sequence arrays built by hand: decodes take one token, prompts
 * are cut into prefill_chunk-sized chunks that sample only at their end,
 * admission is first come first served within max_batch and the KV
 * reservation, in-flight and cancelled sequences are left alone, and a
 * pipeline of P stages gets about 1/P of the batch per step.  A seeded
 * simulator then drives the scheduler the way the leader in worker/replica.c
 * does, against a real worker/kvpool.h pool, and checks every step, with
 * admission by the worst case and on demand; on demand, in tight pools,
 * sequences are preempted and resumed, a grow never fails, and every
 * request still gets all its tokens at the positions it would have. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/kvpool.h"
#include "worker/scheduler.h"

#define MAX_SEQS 64
#define MAX_SLOTS 16

static tsr_sched_cfg_t cfg_of(int max_batch, int prefill_chunk, int max_seq_len, int blocks,
                              int micro_batches)
{
    return (tsr_sched_cfg_t){max_batch, prefill_chunk, max_seq_len, blocks, micro_batches, false, 0};
}

/* A running sequence whose prompt is done and whose last token came back:
 * ready for a decode at position n_prompt + n_generated - 1. */
static tsr_sched_seq_t decoding(int slot, int n_prompt, int n_generated, int max_tokens)
{
    return (tsr_sched_seq_t){slot, n_prompt, n_prompt + n_generated - 1, n_generated, max_tokens,
                             false, false, 0, 0};
}

static tsr_sched_seq_t prefilling(int slot, int n_prompt, int n_cached, int max_tokens)
{
    return (tsr_sched_seq_t){slot, n_prompt, n_cached, 0, max_tokens, false, false, 0, 0};
}

static tsr_sched_seq_t waiting(int n_prompt, int max_tokens)
{
    return (tsr_sched_seq_t){-1, n_prompt, 0, 0, max_tokens, false, false, 0, 0};
}

/* slot_used as the leader keeps it: exactly the slots of running sequences. */
static void slots_of(const tsr_sched_seq_t *s, int n, int max_batch, bool *used)
{
    memset(used, 0, (size_t)max_batch * sizeof *used);
    for (int i = 0; i < n; i++)
        if (s[i].slot >= 0) used[s[i].slot] = true;
}

static int next(const tsr_sched_cfg_t *cfg, const tsr_sched_seq_t *s, int n,
                tsr_sched_entry_t *out)
{
    bool used[MAX_SLOTS];
    assert_true(cfg->max_batch <= MAX_SLOTS);
    slots_of(s, n, cfg->max_batch, used);
    return tsr_sched_next(cfg, s, n, used, out, NULL);
}

/* Applies a plan the way the leader's lead_step does. */
static void apply(tsr_sched_seq_t *s, const tsr_sched_entry_t *e, int n)
{
    for (int k = 0; k < n; k++) {
        if (e[k].admitted) s[e[k].seq].slot = e[k].slot;
        s[e[k].seq].n_cached += e[k].n;
        if (e[k].sample) s[e[k].seq].in_flight = true;
    }
}

static const tsr_sched_entry_t *entry_for(const tsr_sched_entry_t *e, int n, int seq)
{
    for (int k = 0; k < n; k++)
        if (e[k].seq == seq) return &e[k];
    return NULL;
}

/* ---- by hand ------------------------------------------------------------------------- */

static void test_decode_gets_one_token_at_n_cached(void **state)
{
    (void)state;
    tsr_sched_cfg_t c = cfg_of(4, 16, 512, 100, 1);
    tsr_sched_seq_t s[2] = {decoding(2, 10, 3, 20), decoding(0, 5, 1, 20)};
    tsr_sched_entry_t e[4];
    assert_int_equal(next(&c, s, 2, e), 2);
    for (int i = 0; i < 2; i++) {
        const tsr_sched_entry_t *x = entry_for(e, 2, i);
        assert_non_null(x);
        assert_int_equal(x->slot, s[i].slot);
        assert_int_equal(x->pos, s[i].n_cached);
        assert_int_equal(x->n, 1);
        assert_true(x->sample);
        assert_false(x->admitted);
    }
    assert_int_equal(entry_for(e, 2, 0)->pos, 12);
}

static void test_long_prompt_is_cut_into_chunks_that_sample_only_at_the_end(void **state)
{
    (void)state;
    tsr_sched_cfg_t c = cfg_of(2, 32, 512, 100, 1);
    tsr_sched_seq_t s[1] = {waiting(100, 5)};
    tsr_sched_entry_t e[2];
    static const int want[] = {32, 32, 32, 4};
    for (int step = 0; step < 4; step++) {
        assert_int_equal(next(&c, s, 1, e), 1);
        assert_int_equal(e[0].pos, 32 * step);
        assert_int_equal(e[0].n, want[step]);
        assert_int_equal(e[0].sample, step == 3);
        assert_int_equal(e[0].admitted, step == 0);
        apply(s, e, 1);
    }
    assert_int_equal(s[0].n_cached, 100);
    /* In flight for its first token: nothing to do. */
    assert_int_equal(next(&c, s, 1, e), 0);
    /* The token came back: the next step decodes it at position 100. */
    s[0].in_flight = false;
    s[0].n_generated = 1;
    assert_int_equal(next(&c, s, 1, e), 1);
    assert_int_equal(e[0].pos, 100);
    assert_int_equal(e[0].n, 1);
    assert_true(e[0].sample);
}

static void test_prompt_tokens_of_a_step_never_exceed_prefill_chunk(void **state)
{
    (void)state;
    /* Two running prompts and two waiting ones, with room for all. */
    tsr_sched_cfg_t c = cfg_of(8, 24, 512, 1000, 1);
    tsr_sched_seq_t s[5] = {prefilling(0, 20, 10, 50), decoding(1, 7, 2, 50),
                            prefilling(2, 50, 0, 50), waiting(30, 50), waiting(3, 50)};
    tsr_sched_entry_t e[8];
    for (int step = 0; step < 20; step++) {
        int n = next(&c, s, 5, e), prompt = 0;
        if (n == 0) break;
        for (int k = 0; k < n; k++) {
            const tsr_sched_seq_t *q = &s[e[k].seq];
            assert_true(e[k].n >= 1);
            if (e[k].pos < q->n_prompt) {
                prompt += e[k].n;
                assert_true(e[k].pos + e[k].n <= q->n_prompt);
                assert_int_equal(e[k].sample, e[k].pos + e[k].n == q->n_prompt);
            }
        }
        assert_true(prompt <= 24);
        apply(s, e, n);
        for (int i = 0; i < 5; i++)     /* every token comes back at once */
            if (s[i].in_flight) {
                s[i].in_flight = false;
                s[i].n_generated++;
            }
    }
    /* 93 prompt tokens at 24 a step: all of them went in. */
    for (int i = 0; i < 5; i++) assert_true(s[i].n_cached >= s[i].n_prompt);
}

static void test_decodes_keep_flowing_while_a_long_prompt_is_cut(void **state)
{
    (void)state;
    tsr_sched_cfg_t c = cfg_of(4, 8, 512, 1000, 1);
    tsr_sched_seq_t s[4] = {decoding(0, 4, 1, 50), prefilling(1, 200, 0, 5),
                            decoding(2, 9, 3, 50), decoding(3, 1, 1, 50)};
    tsr_sched_entry_t e[4];
    assert_int_equal(next(&c, s, 4, e), 4);
    for (int i = 0; i < 4; i++) assert_non_null(entry_for(e, 4, i));
    assert_int_equal(entry_for(e, 4, 1)->n, 8);
    assert_false(entry_for(e, 4, 1)->sample);
}

static void test_waiting_are_admitted_first_come_first_served(void **state)
{
    (void)state;
    tsr_sched_cfg_t c = cfg_of(4, 64, 512, 100, 1);
    tsr_sched_seq_t s[3] = {waiting(10, 5), waiting(10, 5), waiting(10, 5)};
    tsr_sched_entry_t e[4];
    assert_int_equal(next(&c, s, 3, e), 3);
    for (int k = 0; k < 3; k++) {
        assert_int_equal(e[k].seq, k);
        assert_true(e[k].admitted);
        assert_int_equal(e[k].pos, 0);
        assert_int_equal(e[k].n, 10);
        assert_true(e[k].sample);
    }
    /* With a chunk of 15, the first gets its whole prompt and the second
     * the rest; the third, though admissible, waits for prompt budget. */
    c.prefill_chunk = 15;
    int n = next(&c, s, 3, e);
    assert_int_equal(n, 2);
    assert_int_equal(e[0].seq, 0);
    assert_int_equal(e[1].seq, 1);
    assert_int_equal(e[1].n, 5);
    assert_false(e[1].sample);
}

static void test_later_small_request_does_not_jump_a_blocked_big_one(void **state)
{
    (void)state;
    /* Pool of 10 blocks; the running one reserves ceil((40 + 40 - 1) / 16) = 5.
     * The big one needs ceil((100 + 9) / 16) = 7 > 5 left; the small one
     * (1 block) would fit but must not pass it. */
    tsr_sched_cfg_t c = cfg_of(4, 128, 512, 10, 1);
    tsr_sched_seq_t s[3] = {decoding(0, 40, 1, 40), waiting(100, 10), waiting(4, 2)};
    assert_int_equal(tsr_sched_worst_blocks(&c, &s[0]), 5);
    assert_int_equal(tsr_sched_worst_blocks(&c, &s[1]), 7);
    assert_int_equal(tsr_sched_worst_blocks(&c, &s[2]), 1);
    tsr_sched_entry_t e[4];
    int n = next(&c, s, 3, e);
    assert_int_equal(n, 1);
    assert_int_equal(e[0].seq, 0);
    assert_false(e[0].admitted);
    /* Once the running one is gone, the big one goes first, then the small. */
    int m = next(&c, s + 1, 2, e);
    assert_int_equal(m, 2);
    assert_int_equal(e[0].seq, 0);
    assert_int_equal(e[1].seq, 1);
}

static void test_cancelled_waiting_request_blocks_nobody(void **state)
{
    (void)state;
    tsr_sched_cfg_t c = cfg_of(4, 64, 512, 10, 1);
    tsr_sched_seq_t s[2] = {waiting(300, 10), waiting(4, 2)};   /* the first needs 20 */
    s[0].cancelled = true;
    tsr_sched_entry_t e[4];
    assert_int_equal(next(&c, s, 2, e), 1);
    assert_int_equal(e[0].seq, 1);
    assert_true(e[0].admitted);
}

static void test_admission_stops_at_max_batch_running(void **state)
{
    (void)state;
    tsr_sched_cfg_t c = cfg_of(3, 64, 512, 1000, 1);
    tsr_sched_seq_t s[6] = {decoding(1, 5, 1, 9), waiting(2, 2), waiting(2, 2),
                            waiting(2, 2), waiting(2, 2), waiting(2, 2)};
    tsr_sched_entry_t e[3];
    int n = next(&c, s, 6, e), admitted = 0;
    for (int k = 0; k < n; k++) admitted += e[k].admitted;
    assert_int_equal(admitted, 2);
    assert_int_equal(n, 3);
    /* Full: no admission at all, even with every running one in flight. */
    apply(s, e, n);
    assert_int_equal(next(&c, s, 6, e), 0);
}

static void test_worst_case_is_prompt_plus_max_tokens_minus_one_up_to_max_seq_len(void **state)
{
    (void)state;
    tsr_sched_cfg_t c = cfg_of(4, 64, 512, 1000, 1);
    tsr_sched_seq_t s = waiting(20, 13);            /* 32 positions */
    assert_int_equal(tsr_sched_worst_blocks(&c, &s), 2);
    s.max_tokens = 14;                              /* 33 */
    assert_int_equal(tsr_sched_worst_blocks(&c, &s), 3);
    s.max_tokens = 1;                               /* the prompt only */
    assert_int_equal(tsr_sched_worst_blocks(&c, &s), 2);
    s = waiting(500, 100);                          /* 599, held to 512 */
    assert_int_equal(tsr_sched_worst_blocks(&c, &s), 32);
    c.max_seq_len = 100;                            /* not a block multiple */
    assert_int_equal(tsr_sched_worst_blocks(&c, &s), 7);
}

static void test_admission_respects_the_kv_reservation(void **state)
{
    (void)state;
    /* Pool 20.  Running: 3 blocks (20 + 14 - 1 = 33 positions) and 6
     * (90 + 7 - 1 = 96), reserved in full although nothing is cached yet:
     * 11 left.  The chunk is wide enough that only the pool can say no. */
    tsr_sched_cfg_t c = cfg_of(8, 512, 512, 20, 1);
    tsr_sched_seq_t s[4] = {prefilling(0, 20, 0, 14), prefilling(1, 90, 0, 7),
                            waiting(170, 8), waiting(1, 1)};
    assert_int_equal(tsr_sched_worst_blocks(&c, &s[0]), 3);
    assert_int_equal(tsr_sched_worst_blocks(&c, &s[1]), 6);
    assert_int_equal(tsr_sched_worst_blocks(&c, &s[2]), 12);   /* 177 positions */
    tsr_sched_entry_t e[8];
    int n = next(&c, s, 4, e);
    assert_int_equal(n, 2);
    for (int k = 0; k < n; k++) assert_false(e[k].admitted);
    /* One position less fits exactly: 11 blocks, then none left for the next. */
    s[2].max_tokens = 7;
    assert_int_equal(tsr_sched_worst_blocks(&c, &s[2]), 11);
    n = next(&c, s, 4, e);
    int admitted = 0;
    for (int k = 0; k < n; k++)
        if (e[k].admitted) {
            admitted++;
            assert_int_equal(e[k].seq, 2);
        }
    assert_int_equal(admitted, 1);
}

static void test_in_flight_and_cancelled_sequences_are_never_scheduled(void **state)
{
    (void)state;
    tsr_sched_cfg_t c = cfg_of(8, 64, 512, 1000, 1);
    tsr_sched_seq_t s[7] = {decoding(0, 5, 2, 9), prefilling(1, 40, 8, 9),
                            decoding(2, 5, 2, 9), prefilling(3, 40, 8, 9),
                            waiting(5, 5), decoding(4, 3, 1, 9), decoding(5, 6, 1, 9)};
    s[0].in_flight = true;
    s[0].n_cached++;            /* as the leader leaves it after a decode */
    s[6].in_flight = true;      /* the flag alone says no, whatever the positions say */
    s[1].cancelled = true;
    s[2].cancelled = true;
    s[3].in_flight = true;      /* a prompt whose last chunk is out */
    s[3].n_cached = 40;
    s[4].cancelled = true;
    tsr_sched_entry_t e[8];
    int n = next(&c, s, 7, e);
    assert_int_equal(n, 1);
    assert_int_equal(e[0].seq, 5);
}

static void test_admitted_sequences_get_distinct_free_slots(void **state)
{
    (void)state;
    tsr_sched_cfg_t c = cfg_of(6, 64, 512, 1000, 1);
    tsr_sched_seq_t s[6] = {decoding(0, 5, 1, 9), decoding(2, 5, 1, 9), decoding(5, 5, 1, 9),
                            waiting(3, 3), waiting(3, 3), waiting(3, 3)};
    bool used[6];
    slots_of(s, 6, 6, used);
    tsr_sched_entry_t e[6];
    int n = tsr_sched_next(&c, s, 6, used, e, NULL), k = 0;
    assert_int_equal(n, 6);
    int want[] = {1, 3, 4}, got = 0;
    for (k = 0; k < n; k++)
        if (e[k].admitted) {
            assert_false(used[e[k].slot]);
            assert_int_equal(e[k].slot, want[got++]);
        }
    assert_int_equal(got, 3);
    /* A slot freed but not yet given back counts: slot_used is the truth. */
    used[1] = true;
    n = tsr_sched_next(&c, s, 6, used, e, NULL);
    got = 0;
    for (k = 0; k < n; k++)
        if (e[k].admitted) {
            assert_false(used[e[k].slot]);
            assert_int_equal(e[k].slot, want[1 + got++]);
        }
    assert_int_equal(got, 2);
}

static void test_two_micro_batches_take_half_of_eight_ready_sequences(void **state)
{
    (void)state;
    tsr_sched_cfg_t c = cfg_of(8, 64, 512, 1000, 2);
    tsr_sched_seq_t s[8];
    for (int i = 0; i < 8; i++) s[i] = decoding(i, 4, 1, 10);
    tsr_sched_entry_t e[8];
    int n = next(&c, s, 8, e);
    assert_int_equal(n, 4);
    apply(s, e, n);
    /* The other half goes in the second micro-batch. */
    int m = next(&c, s, 8, e);
    assert_int_equal(m, 4);
    for (int k = 0; k < m; k++) assert_false(s[e[k].seq].in_flight);
    apply(s, e, m);
    for (int i = 0; i < 8; i++) assert_true(s[i].in_flight);
    /* Three stages, 8 sequences: ceil(8 / 3) = 3 a step. */
    for (int i = 0; i < 8; i++) s[i] = decoding(i, 4, 1, 10);
    c.micro_batches = 3;
    assert_int_equal(next(&c, s, 8, e), 3);
}

/* ---- the simulator ------------------------------------------------------------------- */

enum { R_PENDING, R_LIVE, R_FINISHED, R_CANCELLED, R_REFUSED };

typedef struct {
    int n_prompt, max_tokens, arrival, state, tokens;
} sim_req_t;

typedef struct {
    tsr_sched_cfg_t cfg;
    sim_req_t req[MAX_SEQS];
    int n_req, next_arrival;
    /* The leader's table: sequences in arrival order, with their request id. */
    tsr_sched_seq_t s[MAX_SEQS];
    int id[MAX_SEQS];
    bool done[MAX_SEQS];
    int n;
    bool slot_used[MAX_SLOTS];
    tsr_kvpool_t *pool;
    /* Steps whose tokens have not come back: a ring of micro_batches. */
    int flight[4][MAX_SLOTS], fl_n[4], fl_head, fl_count;
    uint32_t rng;
    uint64_t admissions;
    int preemptions;
} sim_t;

static uint32_t rng_next(uint32_t *s)
{
    /* xorshift32: deterministic across libcs, unlike rand() */
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

static int rng_range(uint32_t *s, int lo, int hi)
{
    return lo + (int)(rng_next(s) % (uint32_t)(hi - lo + 1));
}

static int sim_find(const sim_t *m, int id)
{
    for (int i = 0; i < m->n; i++)
        if (m->id[i] == id) return i;
    return -1;
}

/* intake(): refused at once when it can never fit, as the leader does. */
static void sim_intake(sim_t *m, int id)
{
    sim_req_t *q = &m->req[id];
    tsr_sched_seq_t s = waiting(q->n_prompt, q->max_tokens);
    if (q->n_prompt > m->cfg.max_seq_len || tsr_sched_worst_blocks(&m->cfg, &s) > m->cfg.total_blocks) {
        q->state = R_REFUSED;
        return;
    }
    assert_true(m->n < MAX_SEQS);
    m->s[m->n] = s;
    m->id[m->n] = id;
    m->done[m->n] = false;
    m->n++;
    q->state = R_LIVE;
}

/* housekeep(): finished or cancelled sequences not in the pipeline leave. */
static void sim_housekeep(sim_t *m)
{
    for (int i = m->n; i-- > 0;) {
        if (!(m->s[i].cancelled || m->done[i]) || m->s[i].in_flight) continue;
        sim_req_t *q = &m->req[m->id[i]];
        q->state = m->s[i].cancelled ? R_CANCELLED : R_FINISHED;
        if (m->s[i].slot >= 0) {
            m->slot_used[m->s[i].slot] = false;
            tsr_kvpool_release(m->pool, m->s[i].slot);
        }
        memmove(m->s + i, m->s + i + 1, (size_t)(m->n - i - 1) * sizeof *m->s);
        memmove(m->id + i, m->id + i + 1, (size_t)(m->n - i - 1) * sizeof *m->id);
        memmove(m->done + i, m->done + i + 1, (size_t)(m->n - i - 1) * sizeof *m->done);
        m->n--;
    }
}

/* apply_tokens(): the oldest step's tokens come back. */
static void sim_return(sim_t *m, const int *ids, int n_ids)
{
    for (int k = 0; k < n_ids; k++) {
        int i = sim_find(m, ids[k]);
        assert_true(i >= 0);
        tsr_sched_seq_t *s = &m->s[i];
        assert_true(s->in_flight);
        s->in_flight = false;
        s->n_generated++;
        m->req[ids[k]].tokens++;
        assert_true(s->n_generated <= s->max_tokens);
        if (s->n_generated == s->max_tokens ||
            s->n_prompt + s->n_generated - 1 >= m->cfg.max_seq_len)
            m->done[i] = true;
    }
}

static void sim_pop(sim_t *m)
{
    sim_return(m, m->flight[m->fl_head], m->fl_n[m->fl_head]);
    m->fl_head = (m->fl_head + 1) % m->cfg.micro_batches;
    m->fl_count--;
}

/* Nothing that could run is left out, unless the step is full: cap entries
 * (the running and admissible sequences over the micro-batches, at least
 * one) or, for prompts, the whole prefill_chunk spent. */
static void sim_check_work_conserving(const sim_t *m, const tsr_sched_entry_t *e, int n,
                                      int admitted, bool budget_spent)
{
    const tsr_sched_cfg_t *c = &m->cfg;
    int running = 0, reserved = 0, admissible = 0, extra = 0;
    for (int i = 0; i < m->n; i++)
        if (m->s[i].slot >= 0) {
            running++;
            reserved += tsr_sched_worst_blocks(c, &m->s[i]);
        }
    for (int i = 0; i < m->n && admissible < c->max_batch - running; i++) {
        if (m->s[i].slot >= 0 || m->s[i].cancelled) continue;
        int need = tsr_sched_worst_blocks(c, &m->s[i]);
        if (reserved + extra + need > c->total_blocks) break;
        extra += need;
        admissible++;
    }
    int cap = (running + admissible + c->micro_batches - 1) / c->micro_batches;
    if (cap < 1) cap = 1;
    assert_true(n <= cap);
    bool full = n == cap;
    assert_true(admitted <= admissible);
    if (admitted < admissible) assert_true(full || budget_spent);
    for (int i = 0; i < m->n; i++) {
        const tsr_sched_seq_t *s = &m->s[i];
        if (s->slot < 0 || s->cancelled || s->in_flight || entry_for(e, n, i)) continue;
        if (s->n_cached < s->n_prompt) assert_true(full || budget_spent);
        else assert_true(full);     /* a decode ready and left out */
    }
}

/* Every rule a plan must keep, checked before it is applied. */
static void sim_check_plan(const sim_t *m, const tsr_sched_entry_t *e, int n)
{
    const tsr_sched_cfg_t *c = &m->cfg;
    bool seen[MAX_SEQS] = {false}, slot_taken[MAX_SLOTS];
    memcpy(slot_taken, m->slot_used, sizeof slot_taken);
    int prompt = 0, admitted = 0;
    assert_true(n <= c->max_batch);
    assert_true(n <= (c->max_batch + c->micro_batches - 1) / c->micro_batches);
    for (int k = 0; k < n; k++) {
        assert_in_range(e[k].seq, 0, m->n - 1);
        const tsr_sched_seq_t *s = &m->s[e[k].seq];
        assert_false(seen[e[k].seq]);
        seen[e[k].seq] = true;
        assert_false(s->cancelled);
        assert_false(s->in_flight);
        assert_false(m->done[e[k].seq]);
        assert_int_equal(e[k].pos, s->n_cached);
        assert_true(e[k].n >= 1);
        if (e[k].admitted) {
            assert_int_equal(s->slot, -1);
            assert_in_range(e[k].slot, 0, c->max_batch - 1);
            assert_false(slot_taken[e[k].slot]);
            slot_taken[e[k].slot] = true;
            admitted++;
        } else {
            assert_true(s->slot >= 0);
            assert_int_equal(e[k].slot, s->slot);
        }
        /* a sequence preempted after generating computes all it was fed again */
        int known = s->n_prompt + (s->n_generated > 0 ? s->n_generated - 1 : 0);
        if (e[k].pos < known) {
            prompt += e[k].n;
            assert_true(e[k].pos + e[k].n <= known);
            assert_int_equal(e[k].sample, s->n_generated == 0 && e[k].pos + e[k].n == s->n_prompt);
        } else {
            assert_int_equal(e[k].pos, s->n_prompt + s->n_generated - 1);
            assert_int_equal(e[k].n, 1);
            assert_true(e[k].sample);
        }
    }
    assert_true(prompt <= c->prefill_chunk);
    /* A prompt is cut only where the step's prompt budget runs out (on demand
     * also where the pool's room does). */
    if (!c->on_demand) {
        for (int k = 0; k < n; k++)
            if (e[k].pos + e[k].n < m->s[e[k].seq].n_prompt) assert_int_equal(prompt, c->prefill_chunk);
        sim_check_work_conserving(m, e, n, admitted, prompt == c->prefill_chunk);
    }
    /* First come, first served: the admitted are the oldest waiting ones. */
    for (int i = 0, left = admitted; i < m->n; i++) {
        if (m->s[i].slot >= 0 || m->s[i].cancelled) continue;
        if (left > 0) {
            const tsr_sched_entry_t *x = entry_for(e, n, i);
            assert_non_null(x);
            assert_true(x->admitted);
            left--;
        } else {
            assert_null(entry_for(e, n, i));
        }
    }
}

/* What must hold between steps. */
static void sim_check_state(const sim_t *m)
{
    int reserved = 0, physical = 0, owner[MAX_SLOTS];
    for (int k = 0; k < MAX_SLOTS; k++) owner[k] = -1;
    for (int i = 0; i < m->n; i++) {
        const tsr_sched_seq_t *s = &m->s[i];
        if (s->slot < 0) {
            assert_int_equal(s->n_cached, 0);
            continue;
        }
        assert_int_equal(owner[s->slot], -1);   /* no slot used twice */
        owner[s->slot] = i;
        assert_true(m->slot_used[s->slot]);
        reserved += tsr_sched_worst_blocks(&m->cfg, s);
        physical += tsr_kv_blocks_for(s->n_cached);
        assert_true(s->n_cached <= m->cfg.max_seq_len);
        assert_int_equal(tsr_kvpool_held(m->pool, s->slot), tsr_kv_blocks_for(s->n_cached));
    }
    for (int k = 0; k < m->cfg.max_batch; k++)
        if (owner[k] < 0) {
            assert_false(m->slot_used[k]);
            assert_int_equal(tsr_kvpool_held(m->pool, k), 0);
        }
    if (!m->cfg.on_demand) assert_true(reserved <= m->cfg.total_blocks);
    assert_true(physical <= m->cfg.total_blocks);
    assert_int_equal(physical, tsr_kvpool_used(m->pool));
}

static void sim_apply(sim_t *m, const tsr_sched_entry_t *e, int n)
{
    int *ids = m->flight[(m->fl_head + m->fl_count) % m->cfg.micro_batches], ns = 0;
    for (int k = 0; k < n; k++) {
        tsr_sched_seq_t *s = &m->s[e[k].seq];
        if (e[k].admitted) {
            s->slot = e[k].slot;
            m->slot_used[e[k].slot] = true;
            s->admitted = ++m->admissions;
        }
        s->n_cached += e[k].n;
        /* The engine grows each slot as it runs the step: the reservation, or
         * on demand the scheduler's count of the pool's room, must make this
         * impossible to fail. */
        assert_int_equal(tsr_kvpool_grow(m->pool, s->slot, s->n_cached), 0);
        if (e[k].sample) {
            s->in_flight = true;
            ids[ns++] = m->id[e[k].seq];
        }
    }
    if (m->cfg.micro_batches == 1) {
        sim_return(m, ids, ns);     /* one stage: tokens are back at once */
    } else if (ns > 0) {
        m->fl_n[(m->fl_head + m->fl_count) % m->cfg.micro_batches] = ns;
        m->fl_count++;
    }
}

/* One seeded workload from arrival to the last token; returns the steps. */
static int sim_run(uint32_t seed, bool on_demand, int *preemptions)
{
    sim_t *m = calloc(1, sizeof *m);
    assert_non_null(m);
    m->rng = seed;
    uint32_t *r = &m->rng;
    int max_batch = rng_range(r, 1, 8);
    int msl = rng_range(r, 0, 3) ? 512 : rng_range(r, 64, 320);
    int roomy = max_batch * 22;     /* 22 = ceil((300 + 40 - 1) / 16) */
    int blocks;
    switch (rng_range(r, 0, 3)) {
    case 0: blocks = rng_range(r, 1, 21); break;            /* some never fit */
    case 1: blocks = rng_range(r, 22, 44); break;           /* tight */
    case 2: blocks = rng_range(r, 22, roomy + 22); break;
    default: blocks = roomy + rng_range(r, 0, 100); break;  /* roomy */
    }
    m->cfg = cfg_of(max_batch, rng_range(r, 1, 64), msl, blocks, rng_range(r, 1, 3));
    m->cfg.on_demand = on_demand;
    m->pool = tsr_kvpool_new(blocks, max_batch, msl);
    assert_non_null(m->pool);
    m->n_req = rng_range(r, 1, 24);
    int t = 0;
    for (int i = 0; i < m->n_req; i++) {
        t += rng_range(r, 0, 1) ? 0 : rng_range(r, 1, 30);
        m->req[i] = (sim_req_t){rng_range(r, 1, 300), rng_range(r, 1, 40), t, R_PENDING, 0};
    }
    int cancel_odds = rng_range(r, 0, 1) ? 0 : rng_range(r, 20, 400);
    const int limit = 100000;
    int tick = 0, steps = 0;
    for (; tick < limit; tick++) {
        while (m->next_arrival < m->n_req && m->req[m->next_arrival].arrival <= tick)
            sim_intake(m, m->next_arrival++);
        /* A cancellation lands before or after the housekeeping: the
         * scheduler must not count on the caller to have removed it. */
        bool late = rng_range(r, 0, 1);
        if (!late && cancel_odds && m->n > 0 && rng_range(r, 1, cancel_odds) == 1)
            m->s[rng_range(r, 0, m->n - 1)].cancelled = true;
        /* Tokens that came back already. */
        while (m->fl_count > 0 && rng_range(r, 0, 2) == 0) sim_pop(m);
        sim_housekeep(m);
        if (late && cancel_odds && m->n > 0 && rng_range(r, 1, cancel_odds) == 1)
            m->s[rng_range(r, 0, m->n - 1)].cancelled = true;
        sim_check_state(m);
        tsr_sched_entry_t e[MAX_SLOTS];
        int n = 0;
        if (m->fl_count < m->cfg.micro_batches) {
            tsr_sched_seq_t before[MAX_SEQS];
            memcpy(before, m->s, sizeof before);
            int victim;
            for (;;) {
                m->cfg.free_blocks = tsr_kvpool_total(m->pool) - tsr_kvpool_used(m->pool);
                n = tsr_sched_next(&m->cfg, m->s, m->n, m->slot_used, e, &victim);
                assert_memory_equal(before, m->s, sizeof before);   /* nothing changed */
                if (n > 0 || victim < 0) break;
                /* preempt(): the latest admitted running one, not in flight */
                assert_true(m->cfg.on_demand);
                assert_in_range(victim, 0, m->n - 1);
                tsr_sched_seq_t *v = &m->s[victim];
                assert_true(v->slot >= 0 && !v->in_flight && !v->cancelled);
                for (int i = 0; i < m->n; i++)
                    if (m->s[i].slot >= 0 && !m->s[i].in_flight && !m->s[i].cancelled)
                        assert_true(m->s[i].admitted <= v->admitted);
                m->slot_used[v->slot] = false;
                tsr_kvpool_release(m->pool, v->slot);
                v->slot = -1;
                v->n_cached = 0;
                m->preemptions++;
                memcpy(before, m->s, sizeof before);
            }
        }
        if (n > 0) {
            sim_check_plan(m, e, n);
            sim_apply(m, e, n);
            sim_check_state(m);
            steps++;
            continue;
        }
        if (m->fl_count > 0) {
            sim_pop(m);
            continue;
        }
        if (m->next_arrival < m->n_req) {
            tick = m->req[m->next_arrival].arrival - 1;
            continue;
        }
        /* Nothing runs, nothing is in flight, nothing will arrive: only a
         * late cancellation, which the next housekeeping removes, may be left. */
        int left = m->n;
        sim_housekeep(m);
        if (m->n < left) continue;
        if (m->n > 0)
            fail_msg("seed 0x%08x: stalled with %d sequence(s) left (max_batch %d, chunk %d, "
                     "blocks %d, micro-batches %d)",
                     seed, m->n, max_batch, m->cfg.prefill_chunk, blocks, m->cfg.micro_batches);
        break;
    }
    if (tick >= limit) fail_msg("seed 0x%08x: not done after %d ticks", seed, limit);
    for (int i = 0; i < m->n_req; i++) {
        const sim_req_t *q = &m->req[i];
        assert_true(q->state == R_FINISHED || q->state == R_CANCELLED || q->state == R_REFUSED);
        if (q->state == R_FINISHED) {
            int room = msl - q->n_prompt + 1;   /* tokens until max_seq_len */
            assert_int_equal(q->tokens, q->max_tokens < room ? q->max_tokens : room);
        }
        if (q->state == R_REFUSED) {
            tsr_sched_seq_t s = waiting(q->n_prompt, q->max_tokens);
            assert_true(q->n_prompt > msl || tsr_sched_worst_blocks(&m->cfg, &s) > blocks);
        }
    }
    assert_int_equal(tsr_kvpool_used(m->pool), 0);
    tsr_kvpool_destroy(&m->pool);
    if (preemptions) *preemptions += m->preemptions;
    free(m);
    return steps;
}

static void test_random_workloads_keep_every_rule_and_all_finish(void **state)
{
    (void)state;
    uint32_t seed = 0x5c4ed01u;
    long steps = 0;
    for (int round = 0; round < 3000; round++) {
        rng_next(&seed);
        steps += sim_run(seed, false, NULL);
    }
    assert_true(steps > 0);
}

static void test_on_demand_random_workloads_preempt_and_all_finish(void **state)
{
    (void)state;
    uint32_t seed = 0x0dd5eedu;
    long steps = 0;
    int preemptions = 0;
    for (int round = 0; round < 3000; round++) {
        rng_next(&seed);
        steps += sim_run(seed, true, &preemptions);
    }
    assert_true(steps > 0);
    assert_true(preemptions > 100);     /* tight pools did run out */
}

/* On demand a sequence is admitted by its first chunk, not its worst case:
 * two that reserving could not hold together run together. */
static void test_on_demand_admits_by_what_a_sequence_needs_now(void **state)
{
    (void)state;
    tsr_sched_cfg_t c = cfg_of(4, 64, 512, 20, 1);
    tsr_sched_seq_t s[2] = {waiting(20, 200), waiting(20, 200)};   /* worst 14 blocks each */
    tsr_sched_entry_t e[4];
    assert_int_equal(next(&c, s, 2, e), 1);
    c.on_demand = true;
    c.free_blocks = 20;
    assert_int_equal(next(&c, s, 2, e), 2);
    /* with less room the second's first chunk is cut to what fits, leaving a
     * block for the first to grow into */
    c.free_blocks = 4;
    assert_int_equal(next(&c, s, 2, e), 2);
    assert_int_equal(e[0].n, 20);
    assert_int_equal(e[1].n, 16);
    c.free_blocks = 3;              /* and with none to spare it waits */
    assert_int_equal(next(&c, s, 2, e), 1);
    /* cached blocks nobody holds count against the room when attached */
    s[0].n_cached = 16;
    s[0].attach_taken = 1;
    c.free_blocks = 2;
    assert_int_equal(next(&c, s, 2, e), 1);
    assert_int_equal(e[0].pos, 16);
    c.free_blocks = 1;
    assert_int_equal(next(&c, s, 2, e), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_gets_one_token_at_n_cached),
        cmocka_unit_test(test_long_prompt_is_cut_into_chunks_that_sample_only_at_the_end),
        cmocka_unit_test(test_prompt_tokens_of_a_step_never_exceed_prefill_chunk),
        cmocka_unit_test(test_decodes_keep_flowing_while_a_long_prompt_is_cut),
        cmocka_unit_test(test_waiting_are_admitted_first_come_first_served),
        cmocka_unit_test(test_later_small_request_does_not_jump_a_blocked_big_one),
        cmocka_unit_test(test_cancelled_waiting_request_blocks_nobody),
        cmocka_unit_test(test_admission_stops_at_max_batch_running),
        cmocka_unit_test(test_worst_case_is_prompt_plus_max_tokens_minus_one_up_to_max_seq_len),
        cmocka_unit_test(test_admission_respects_the_kv_reservation),
        cmocka_unit_test(test_in_flight_and_cancelled_sequences_are_never_scheduled),
        cmocka_unit_test(test_admitted_sequences_get_distinct_free_slots),
        cmocka_unit_test(test_two_micro_batches_take_half_of_eight_ready_sequences),
        cmocka_unit_test(test_random_workloads_keep_every_rule_and_all_finish),
        cmocka_unit_test(test_on_demand_random_workloads_preempt_and_all_finish),
        cmocka_unit_test(test_on_demand_admits_by_what_a_sequence_needs_now),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
