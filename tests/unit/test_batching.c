/* test_batching.c: batching never changes what a request gets.
 *
 * A script of requests (random arrival times, prompts of 1 to 300 tokens,
 * mixed max_tokens, greedy and seeded sampling, some cancelled in the
 * middle) runs through an in-process replica (tests/unit/replica_harness.h)
 * with a KV pool too small for all of them at once, under tp=1 pp=1, tp=2
 * pp=1, tp=1 pp=2 and tp=2 pp=2.  Every request must get exactly the tokens
 * it gets when it runs alone (a cancelled one: a prefix of them), none may
 * fail for want of blocks, several must have run together, and every
 * rank's pool must be empty at the end.  Requests run alone are checked
 * against the NumPy reference.  The same holds with a bf16 KV cache, whose
 * requests alone match the reference with its keys and values rounded to
 * bf16, and with bf16 products (matmul_dtype bf16: AMX where the CPU has
 * it), whose requests alone match the reference with its weights and the
 * products' inputs rounded to bf16, and with an int8 KV cache, whose
 * requests alone match the reference with its keys and values rounded as
 * that cache holds them, and with int8 weights (weights_dtype int8), whose
 * requests alone match the reference with its weights and the products'
 * inputs quantized as the engine does (batched at tp=2, held to their own
 * tokens alone at tp=2, as with bf16 products).  Also: a queue that is full refuses at once, and a
 * request that could never fit the pool is refused with the numbers. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "replica_harness.h"

#define N_REQS 20
static char model_dir[64];
static h_req_t script[N_REQS];
/* The numeric modes: f32 throughout, the KV cache in bf16, the products in
 * bf16, the KV cache in int8, the weights in int8; each request's tokens
 * alone in each. */
static const struct {
    int kv, mm, wt;
    const char *name;
} mode[5] = {{TSR_KV_F32, TSR_KV_F32, TSR_KV_AUTO, "f32"},
             {TSR_KV_BF16, TSR_KV_F32, TSR_KV_AUTO, "bf16 KV"},
             {TSR_KV_F32, TSR_KV_BF16, TSR_KV_AUTO, "bf16 matmul"},
             {TSR_KV_INT8, TSR_KV_F32, TSR_KV_AUTO, "int8 KV"},
             {TSR_KV_F32, TSR_KV_F32, TSR_KV_INT8, "int8 weights"}};
static int32_t alone[5][N_REQS][H_MAX_TOKENS];
static int n_alone[5][N_REQS];

static uint64_t rng_state = 12345;
static uint32_t rnd(uint32_t n)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33) % n;
}

static void make_script(void)
{
    for (int i = 0; i < N_REQS; i++) {
        h_req_t *q = &script[i];
        memset(q, 0, sizeof *q);
        /* A few long prompts (chunked prefill), most short. */
        q->n_prompt = i % 5 == 0 ? 200 + (int)rnd(101) : 1 + (int)rnd(40);
        q->prompt = malloc((size_t)q->n_prompt * sizeof *q->prompt);
        for (int k = 0; k < q->n_prompt; k++) q->prompt[k] = 3 + (int32_t)rnd(250);
        q->max_tokens = 1 + (int)rnd(24);
        if (i % 3 == 1) {
            q->temperature = 0.8f;
            q->top_p = 0.9f;
            q->seed = 1000 + (uint64_t)i;
        }
        q->arrive_ms = (int)rnd(300);
        if (i % 4 == 3 && q->max_tokens > 4) q->cancel_after = 2;
    }
    /* Arrival order is script order. */
    for (int i = 1; i < N_REQS; i++)
        if (script[i].arrive_ms < script[i - 1].arrive_ms) script[i].arrive_ms = script[i - 1].arrive_ms;
}

static void reset_outcome(h_req_t *q)
{
    q->n_tokens = 0;
    q->done = q->failed = q->cancel_sent = 0;
    q->error[0] = q->finish[0] = 0;
}

/* Every request of the script alone (max_batch 1) at tensor-parallel size
 * tp, in mode kv: its tokens into tokens[i], their number into n[i]. */
static void run_each_alone(int tp, int kv, int32_t tokens[][H_MAX_TOKENS], int *n)
{
    for (int i = 0; i < N_REQS; i++) {
        h_req_t q = script[i];
        reset_outcome(&q);
        q.arrive_ms = 0;
        q.cancel_after = 0;
        h_run_t run = {.dir = model_dir, .tp = tp, .pp = 1, .reqs = &q, .n_reqs = 1, .max_batch = 1,
                       .kv_dtype = mode[kv].kv, .matmul_dtype = mode[kv].mm,
                       .weights_dtype = mode[kv].wt};
        h_run(&run);
        if (q.failed) fail_msg("request %d alone (tp %d, %s): %s", i, tp, mode[kv].name, q.error);
        memcpy(tokens[i], q.tokens, sizeof q.tokens);
        n[i] = q.n_tokens;
    }
}

static void run_alone_against_the_reference(int kv)
{
    run_each_alone(1, kv, alone[kv], n_alone[kv]);
    /* Greedy ones against the reference (it recomputes every position, so
     * only the short ones). */
    int checked = 0;
    for (int i = 0; i < N_REQS && checked < 4; i++) {
        const h_req_t *q = &script[i];
        if (q->temperature > 0 || q->n_prompt > 40) continue;
        char cmd[2048], ids[1024] = "", line[1024] = "", got[1024] = "";
        for (int k = 0; k < q->n_prompt; k++)
            snprintf(ids + strlen(ids), sizeof ids - strlen(ids), "%s%d", k ? "," : "", q->prompt[k]);
        snprintf(cmd, sizeof cmd,
                 "python3 tests/reference/llama_ref.py %s --prompt-ids %s --max-tokens %d --stop-at-eos "
                 "--kv-dtype %s --matmul-dtype %s --weights-dtype %s",
                 model_dir, ids, q->max_tokens, tsr_kv_dtype_name(mode[kv].kv),
                 tsr_kv_dtype_name(mode[kv].mm), tsr_kv_dtype_name(mode[kv].wt));
        FILE *p = popen(cmd, "r");
        assert_non_null(p);
        if (!fgets(line, sizeof line, p)) line[0] = 0;
        assert_int_equal(pclose(p), 0);
        line[strcspn(line, "\n")] = 0;
        for (int k = 0; k < n_alone[kv][i]; k++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%d", k ? "," : "", alone[kv][i][k]);
        if (strcmp(got, line))
            fail_msg("request %d, %s: tessera %s, reference %s", i, mode[kv].name, got, line);
        checked++;
    }
    assert_true(checked >= 2);
}

static void test_each_request_alone_matches_the_numpy_reference(void **state)
{
    (void)state;
    run_alone_against_the_reference(0);
}

static void test_with_a_bf16_kv_cache_each_request_alone_matches_the_reference_rounding_k_and_v(
    void **state)
{
    (void)state;
    run_alone_against_the_reference(1);
}

static void test_with_an_int8_kv_cache_each_request_alone_matches_the_reference_rounding_k_and_v(
    void **state)
{
    (void)state;
    run_alone_against_the_reference(3);
}

/* The script batched at tp x pp in mode kv, in a pool of `blocks`, reserving or on
 * demand, with or without the prefix cache; returns the leader's preemptions. */
static uint64_t run_batched_in(int tp, int pp, int kv, int blocks, int reserve, int cache)
{
    /* What "alone" means at this layout.  With bf16 products, tp ranks sum
     * partial products of o and down in another order than one rank does,
     * and rounding the next input to bf16 can turn that last-bit difference
     * into a step of 2^-8 (with int8 weights, quantizing it into a step of
     * its block's scale): tokens alone then differ between tp sizes, so
     * batched tp=2 is held to its own requests alone at tp=2 (pp splits no
     * sum: its alone is tp's). */
    static int32_t own[N_REQS][H_MAX_TOKENS];
    static int n_own[N_REQS];
    int32_t (*want)[H_MAX_TOKENS] = alone[kv];
    int *n_want = n_alone[kv];
    if ((mode[kv].mm == TSR_KV_BF16 || mode[kv].wt == TSR_KV_INT8) && tp > 1) {
        run_each_alone(tp, kv, own, n_own);
        want = own, n_want = n_own;
    }
    h_req_t reqs[N_REQS];
    memcpy(reqs, script, sizeof reqs);
    for (int i = 0; i < N_REQS; i++) {
        reset_outcome(&reqs[i]);
        if (blocks < 32) reqs[i].arrive_ms = 0;   /* a tight pool: all at once */
    }
    h_run_t run = {.dir = model_dir, .tp = tp, .pp = pp, .reqs = reqs, .n_reqs = N_REQS,
                   .max_batch = 6, .prefill_chunk = 48, .kv_blocks = blocks,
                   .kv_dtype = mode[kv].kv, .matmul_dtype = mode[kv].mm,
                   .weights_dtype = mode[kv].wt, .kv_reserve = reserve,
                   .prefix_cache = cache};
    h_run(&run);
    for (int i = 0; i < N_REQS; i++) {
        const h_req_t *q = &reqs[i];
        if (q->cancel_after) {
            if (!q->failed || !strstr(q->error, "cancelled"))
                fail_msg("tp %d pp %d request %d was to be cancelled: %s", tp, pp, i,
                         q->failed ? q->error : "finished");
            if (q->n_tokens > n_want[i] || memcmp(q->tokens, want[i], (size_t)q->n_tokens * 4))
                fail_msg("tp %d pp %d cancelled request %d: its tokens are not a prefix of its own", tp, pp, i);
            continue;
        }
        if (q->failed) fail_msg("tp %d pp %d request %d failed: %s", tp, pp, i, q->error);
        if (q->n_tokens != n_want[i] || memcmp(q->tokens, want[i], (size_t)q->n_tokens * 4))
            fail_msg("tp %d pp %d %s request %d (prompt %d, %s): batched tokens differ from its tokens alone",
                     tp, pp, mode[kv].name, i, q->n_prompt,
                     q->temperature > 0 ? "sampled" : "greedy");
    }
    if (run.max_running < 3) fail_msg("tp %d pp %d: at most %d sequences ran together", tp, pp, run.max_running);
    if (reserve) assert_int_equal(run.stats[0].preemptions, 0);
    for (int r = 0; r < tp * pp; r++) {
        assert_int_equal(run.kv_total[r], blocks);
        if (run.kv_used[r] != 0) fail_msg("tp %d pp %d rank %d: %d KV blocks still held", tp, pp, r, run.kv_used[r]);
    }
    return run.stats[0].preemptions;
}

/* 32 blocks: one 300-token prompt (about 20 blocks with its tokens) and a few short
 * ones at a time; the rest must wait (reserving) or take blocks as they go. */
static void run_batched(int tp, int pp, int kv)
{
    run_batched_in(tp, pp, kv, 32, 0, 0);
}

/* 22 blocks, on demand, all arriving at once: the 300-token prompts fill the pool, so running sequences are
 * preempted and resume by computing their positions again; with the prefix cache they
 * take back what is still cached.  Nobody's tokens change. */
static void test_on_demand_a_tight_pool_preempts_and_every_request_keeps_its_tokens(void **state)
{
    (void)state;
    uint64_t p = run_batched_in(1, 1, 0, 22, 0, 0) + run_batched_in(2, 2, 0, 22, 0, 0) +
                 run_batched_in(1, 2, 0, 22, 0, 1) + run_batched_in(2, 1, 3, 22, 0, 1);
    if (p == 0) fail_msg("no sequence was preempted in a pool of 22 blocks");
}

static void test_reserving_never_preempts_and_every_request_keeps_its_tokens(void **state)
{
    (void)state;
    run_batched_in(1, 1, 0, 32, 1, 0);
    run_batched_in(2, 2, 0, 32, 1, 1);
}

static void test_with_bf16_products_each_request_alone_matches_the_reference_rounding_them(
    void **state)
{
    (void)state;
    run_alone_against_the_reference(2);
}

static void test_batched_tp1_pp1_gives_every_request_its_own_tokens(void **state)
{
    (void)state;
    run_batched(1, 1, 0);
}
static void test_batched_tp2_pp1_gives_every_request_its_own_tokens(void **state)
{
    (void)state;
    run_batched(2, 1, 0);
}
static void test_batched_tp1_pp2_gives_every_request_its_own_tokens(void **state)
{
    (void)state;
    run_batched(1, 2, 0);
}
static void test_batched_tp2_pp2_gives_every_request_its_own_tokens(void **state)
{
    (void)state;
    run_batched(2, 2, 0);
}
static void test_batched_tp1_pp1_with_a_bf16_kv_cache_gives_every_request_its_own_tokens(void **state)
{
    (void)state;
    run_batched(1, 1, 1);
}
static void test_batched_tp2_pp2_with_a_bf16_kv_cache_gives_every_request_its_own_tokens(void **state)
{
    (void)state;
    run_batched(2, 2, 1);
}

static void test_batched_tp1_pp1_with_bf16_products_gives_every_request_its_own_tokens(void **state)
{
    (void)state;
    run_batched(1, 1, 2);
}
static void test_batched_tp2_pp1_with_bf16_products_gives_every_request_its_own_tokens(void **state)
{
    (void)state;
    run_batched(2, 1, 2);
}
static void test_batched_tp1_pp2_with_bf16_products_gives_every_request_its_own_tokens(void **state)
{
    (void)state;
    run_batched(1, 2, 2);
}
static void test_batched_tp2_pp2_with_bf16_products_gives_every_request_its_own_tokens(void **state)
{
    (void)state;
    run_batched(2, 2, 2);
}

static void test_batched_tp1_pp1_with_an_int8_kv_cache_gives_every_request_its_own_tokens(
    void **state)
{
    (void)state;
    run_batched(1, 1, 3);
}

static void test_batched_tp2_pp2_with_an_int8_kv_cache_gives_every_request_its_own_tokens(
    void **state)
{
    (void)state;
    run_batched(2, 2, 3);
}

static void test_with_int8_weights_each_request_alone_matches_the_reference_quantizing_them(
    void **state)
{
    (void)state;
    run_alone_against_the_reference(4);
}

static void test_batched_tp1_pp1_with_int8_weights_gives_every_request_its_own_tokens(void **state)
{
    (void)state;
    run_batched(1, 1, 4);
}

static void test_batched_tp2_pp2_with_int8_weights_gives_every_request_its_own_tokens(void **state)
{
    (void)state;
    run_batched(2, 2, 4);
}

static void test_a_full_queue_refuses_at_once(void **state)
{
    (void)state;
    h_req_t reqs[6];
    memset(reqs, 0, sizeof reqs);
    int32_t p[3] = {5, 6, 7};
    for (int i = 0; i < 6; i++) reqs[i] = (h_req_t){.prompt = p, .n_prompt = 3, .max_tokens = 20};
    h_run_t run = {.dir = model_dir, .tp = 1, .pp = 1, .reqs = reqs, .n_reqs = 6,
                   .max_batch = 1, .max_queue = 2};
    h_run(&run);
    int refused = 0, served = 0;
    for (int i = 0; i < 6; i++) {
        if (reqs[i].failed) {
            if (!strstr(reqs[i].error, "queue is full (max_queue 2")) fail_msg("request %d: %s", i, reqs[i].error);
            /* A refusal for load: not a broken replica (it is not resumed
             * elsewhere), but busy, so the client may try later (503). */
            assert_int_equal(reqs[i].retryable, TSR_FAIL_BUSY);
            assert_int_equal(reqs[i].n_tokens, 0);
            refused++;
        } else {
            assert_int_equal(reqs[i].n_tokens, 20);
            served++;
        }
    }
    /* One runs, two wait, the other three are turned away. */
    assert_int_equal(served, 3);
    assert_int_equal(refused, 3);
}

static void test_a_request_larger_than_the_pool_is_refused_with_the_numbers(void **state)
{
    (void)state;
    int32_t *p = calloc(200, sizeof *p);
    for (int i = 0; i < 200; i++) p[i] = 3 + i % 100;
    h_req_t q = {.prompt = p, .n_prompt = 200, .max_tokens = 8};
    h_run_t run = {.dir = model_dir, .tp = 1, .pp = 1, .reqs = &q, .n_reqs = 1, .kv_blocks = 8};
    h_run(&run);
    assert_true(q.failed);
    assert_false(q.retryable);
    if (!strstr(q.error, "needs 13 KV blocks of 16 positions and the pool has 8"))
        fail_msg("refusal: %s", q.error);
    free(p);
}

/* ---- the prefix cache ---------------------------------------------------------- */

#define N_CACHE 9
static h_req_t cache_script[N_CACHE];
static int32_t cache_alone[N_CACHE][H_MAX_TOKENS];
static int n_cache_alone[N_CACHE];

/* Requests that share prefixes: a 70-token system prompt before each of
 * seven (four full blocks and a part), an eighth that resends the first prompt and the
 * first answer (a second turn: blocks of generated tokens), each alone with
 * no cache for reference; a ninth whose prompt is the system prompt's first
 * 64 tokens (whole blocks: its last block is computed again). */
static void make_cache_script(void)
{
    static int32_t sys[70];
    uint64_t saved = rng_state;
    rng_state = 777;
    for (int k = 0; k < 70; k++) sys[k] = 3 + (int32_t)rnd(250);
    for (int i = 0; i < N_CACHE; i++) {
        h_req_t *q = &cache_script[i];
        memset(q, 0, sizeof *q);
        int extra = i < 6 ? 5 + (int)rnd(36) : 20;
        q->n_prompt = i == 8 ? 64 : 70 + extra;
        q->prompt = malloc((size_t)(q->n_prompt + 40) * sizeof *q->prompt);
        memcpy(q->prompt, sys, (q->n_prompt < 70 ? (size_t)q->n_prompt : 70) * sizeof *sys);
        for (int k = 70; k < q->n_prompt; k++) q->prompt[k] = 3 + (int32_t)rnd(250);
        q->max_tokens = i == 0 ? 24 : 6 + (int)rnd(7);
        if (i % 3 == 2) {
            q->temperature = 0.8f;
            q->top_p = 0.9f;
            q->seed = 500 + (uint64_t)i;
        }
    }
    rng_state = saved;
}

static void cache_alone_one(int i)
{
    h_req_t q = cache_script[i];
    reset_outcome(&q);
    h_run_t run = {.dir = model_dir, .tp = 1, .pp = 1, .reqs = &q, .n_reqs = 1, .max_batch = 1};
    h_run(&run);
    if (q.failed) fail_msg("cache request %d alone: %s", i, q.error);
    memcpy(cache_alone[i], q.tokens, sizeof q.tokens);
    n_cache_alone[i] = q.n_tokens;
}

static void test_with_the_prefix_cache_off_each_request_alone_gives_the_reference_tokens(void **state)
{
    (void)state;
    make_cache_script();
    for (int i = 0; i < 7; i++) cache_alone_one(i);
    /* the second turn: the first prompt, the first answer, more text */
    h_req_t *t = &cache_script[7], *first = &cache_script[0];
    memcpy(t->prompt, first->prompt, (size_t)first->n_prompt * sizeof *t->prompt);
    memcpy(t->prompt + first->n_prompt, cache_alone[0], (size_t)n_cache_alone[0] * sizeof(int32_t));
    t->n_prompt = first->n_prompt + n_cache_alone[0] + 5;
    for (int k = first->n_prompt + n_cache_alone[0]; k < t->n_prompt; k++) t->prompt[k] = 3 + k % 200;
    cache_alone_one(7);
    cache_alone_one(8);
}

/* The script with the cache on at tp x pp, in a pool of kv_blocks: the
 * first request alone, the rest once it is done (the first three at once,
 * then one by one), so later prompts find earlier blocks. */
static void run_cached(int tp, int pp, int kv_blocks, h_run_t *run, h_req_t *reqs)
{
    memcpy(reqs, cache_script, sizeof cache_script);
    for (int i = 0; i < N_CACHE; i++) {
        reset_outcome(&reqs[i]);
        reqs[i].after = i == 0 ? 0 : i <= 3 ? 1 : i;
    }
    *run = (h_run_t){.dir = model_dir, .tp = tp, .pp = pp, .reqs = reqs, .n_reqs = N_CACHE,
                     .max_batch = 4, .prefill_chunk = 32, .kv_blocks = kv_blocks,
                     .prefix_cache = 1};
    h_run(run);
    long cached = 0;
    for (int i = 0; i < N_CACHE; i++) {
        const h_req_t *q = &reqs[i];
        if (q->failed) fail_msg("tp %d pp %d cached request %d failed: %s", tp, pp, i, q->error);
        if (q->n_tokens != n_cache_alone[i] ||
            memcmp(q->tokens, cache_alone[i], (size_t)q->n_tokens * 4))
            fail_msg("tp %d pp %d request %d (prompt %d, %d cached): tokens differ from its tokens "
                     "alone without the cache", tp, pp, i, q->n_prompt, q->cached);
        cached += q->cached;
    }
    /* what the leader counted is what the requests were told */
    assert_int_equal(run->stats[0].prompt_cached, cached);
    long prompts = 0;
    for (int i = 0; i < N_CACHE; i++) prompts += reqs[i].n_prompt;
    /* each prompt position computed or cached once (a preempted sequence computes again) */
    if (run->stats[0].preemptions == 0)
        assert_int_equal(run->stats[0].prompt_computed + run->stats[0].prompt_cached, prompts);
    else
        assert_true(run->stats[0].prompt_computed + run->stats[0].prompt_cached >= (uint64_t)prompts);
    for (int r = 0; r < tp * pp; r++)
        if (run->kv_used[r] != 0) fail_msg("tp %d pp %d rank %d: %d KV blocks still held", tp, pp, r, run->kv_used[r]);
}

static void prefix_cache_hits(int tp, int pp)
{
    h_run_t run;
    h_req_t reqs[N_CACHE];
    run_cached(tp, pp, 64, &run, reqs);
    assert_int_equal(reqs[0].cached, 0);
    for (int i = 1; i < 7; i++)     /* the system prompt's four full blocks */
        if (reqs[i].cached < 64) fail_msg("tp %d pp %d request %d took %d cached positions", tp, pp, i, reqs[i].cached);
    /* the second turn takes the first prompt and the blocks its answer filled */
    int full = (reqs[0].n_prompt + n_cache_alone[0] - 1) / 16 * 16;
    if (reqs[7].cached < full) fail_msg("tp %d pp %d: the second turn took %d cached positions of %d", tp, pp, reqs[7].cached, full);
    /* a prompt of whole cached blocks computes its last block again */
    assert_int_equal(reqs[8].cached, 48);
    for (int r = 0; r < tp * pp; r++) assert_true(run.kv_cached[r] > 0);
}

static void test_with_the_prefix_cache_tp1_pp1_takes_shared_prefixes_and_gives_the_same_tokens(void **state)
{
    (void)state;
    prefix_cache_hits(1, 1);
}

static void test_with_the_prefix_cache_tp2_pp2_takes_shared_prefixes_and_gives_the_same_tokens(void **state)
{
    (void)state;
    prefix_cache_hits(2, 2);
}

static void test_with_the_prefix_cache_a_small_pool_evicts_and_the_tokens_stay(void **state)
{
    (void)state;
    /* 14 blocks: the second turn alone needs 9 of them, so cached blocks go */
    h_run_t run;
    h_req_t reqs[N_CACHE];
    run_cached(2, 1, 14, &run, reqs);
    assert_true(run.stats[0].evictions > 0);
    assert_true(run.stats[1].evictions == run.stats[0].evictions);
}

static int setup(void **state)
{
    (void)state;
    snprintf(model_dir, sizeof model_dir, "/tmp/tsr-batch-XXXXXX");
    if (!mkdtemp(model_dir)) return -1;
    /* 3 query heads per KV head, on each of 2 tensor ranks too: an odd
     * grouped-query layout against the reference. */
    char *argv[] = {"model-init", model_dir, "--hidden", "48", "--intermediate", "128",
                    "--layers", "4", "--heads", "6", "--kv-heads", "2", "--vocab", "256",
                    "--max-pos", "512", "--seed", "21", "--force", NULL};
    if (tsr_cmd_model_init(19, argv)) return -1;
    make_script();
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    for (int i = 0; i < N_REQS; i++) free(script[i].prompt);
    for (int i = 0; i < N_CACHE; i++) free(cache_script[i].prompt);
    snprintf(cmd, sizeof cmd, "rm -rf %s", model_dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_request_alone_matches_the_numpy_reference),
        cmocka_unit_test(test_with_a_bf16_kv_cache_each_request_alone_matches_the_reference_rounding_k_and_v),
        cmocka_unit_test(test_batched_tp1_pp1_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_batched_tp2_pp1_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_batched_tp1_pp2_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_batched_tp2_pp2_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_batched_tp1_pp1_with_a_bf16_kv_cache_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_batched_tp2_pp2_with_a_bf16_kv_cache_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_with_bf16_products_each_request_alone_matches_the_reference_rounding_them),
        cmocka_unit_test(test_batched_tp1_pp1_with_bf16_products_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_batched_tp2_pp1_with_bf16_products_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_batched_tp1_pp2_with_bf16_products_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_batched_tp2_pp2_with_bf16_products_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_with_an_int8_kv_cache_each_request_alone_matches_the_reference_rounding_k_and_v),
        cmocka_unit_test(test_batched_tp1_pp1_with_an_int8_kv_cache_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_batched_tp2_pp2_with_an_int8_kv_cache_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_with_int8_weights_each_request_alone_matches_the_reference_quantizing_them),
        cmocka_unit_test(test_batched_tp1_pp1_with_int8_weights_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_batched_tp2_pp2_with_int8_weights_gives_every_request_its_own_tokens),
        cmocka_unit_test(test_a_full_queue_refuses_at_once),
        cmocka_unit_test(test_a_request_larger_than_the_pool_is_refused_with_the_numbers),
        cmocka_unit_test(test_on_demand_a_tight_pool_preempts_and_every_request_keeps_its_tokens),
        cmocka_unit_test(test_reserving_never_preempts_and_every_request_keeps_its_tokens),
        cmocka_unit_test(test_with_the_prefix_cache_off_each_request_alone_gives_the_reference_tokens),
        cmocka_unit_test(test_with_the_prefix_cache_tp1_pp1_takes_shared_prefixes_and_gives_the_same_tokens),
        cmocka_unit_test(test_with_the_prefix_cache_tp2_pp2_takes_shared_prefixes_and_gives_the_same_tokens),
        cmocka_unit_test(test_with_the_prefix_cache_a_small_pool_evicts_and_the_tokens_stay),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
