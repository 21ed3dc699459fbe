/* test_slice.c: the sharding rules of common/slice.h on a small GQA model
 * built in C.  For tp 1, 2 and 4 the ranks' row or column ranges tile each
 * tensor exactly once, norms are whole, vocabulary chunks are ceil(V/tp)
 * wide; a tp that does not divide the heads is refused; names are Hugging
 * Face's; and the KV pool size is checked against numbers worked by hand. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <string.h>

#include "common/budget.h"
#include "common/slice.h"

enum { HIDDEN = 64, HEADS = 8, KV_HEADS = 4, HEAD_DIM = 8, INTER = 128, VOCAB = 250, LAYERS = 8 };

static tsr_model_info_t gqa_model(void)
{
    tsr_model_info_t m;
    memset(&m, 0, sizeof m);
    m.hidden_size = HIDDEN;
    m.intermediate_size = INTER;
    m.num_hidden_layers = LAYERS;
    m.num_attention_heads = HEADS;
    m.num_key_value_heads = KV_HEADS;
    m.head_dim = HEAD_DIM;
    m.vocab_size = VOCAB;
    m.max_position_embeddings = 512;
    m.dtype_bytes = 2;
    return m;
}

static const int TPS[] = {1, 2, 4};
#define N_TPS (int)(sizeof TPS / sizeof TPS[0])

/* The ranks' [lo, hi) ranges along one axis must cover [0, full) with every
 * index held by exactly one rank, and the other axis must be whole. */
static void assert_tiles(const tsr_model_info_t *m, tsr_tensor_kind_t t, int tp, bool by_rows,
                         int64_t rows, int64_t cols)
{
    int64_t full = by_rows ? rows : cols;
    int hits[1024] = {0};
    assert_true(full <= 1024);
    int64_t elems = 0;
    for (int r = 0; r < tp; r++) {
        tsr_slice_t s;
        assert_int_equal(tsr_slice_of(m, t, r, tp, &s), 0);
        assert_int_equal(s.rows, rows);
        assert_int_equal(s.cols, cols);
        int64_t lo = by_rows ? s.r0 : s.c0, hi = by_rows ? s.r1 : s.c1;
        if (by_rows) {
            assert_int_equal(s.c0, 0);
            assert_int_equal(s.c1, cols);
        } else {
            assert_int_equal(s.r0, 0);
            assert_int_equal(s.r1, rows);
        }
        assert_true(0 <= lo && lo <= hi && hi <= full);
        for (int64_t i = lo; i < hi; i++) hits[i]++;
        elems += tsr_slice_elems(&s);
    }
    for (int64_t i = 0; i < full; i++) assert_int_equal(hits[i], 1);
    assert_int_equal(elems, rows * cols);
}

static void test_q_k_v_gate_up_rows_tile_the_full_rows_once(void **state)
{
    (void)state;
    tsr_model_info_t m = gqa_model();
    for (int i = 0; i < N_TPS; i++) {
        int tp = TPS[i];
        assert_tiles(&m, TSR_T_Q, tp, true, HEADS * HEAD_DIM, HIDDEN);
        assert_tiles(&m, TSR_T_K, tp, true, KV_HEADS * HEAD_DIM, HIDDEN);
        assert_tiles(&m, TSR_T_V, tp, true, KV_HEADS * HEAD_DIM, HIDDEN);
        assert_tiles(&m, TSR_T_GATE, tp, true, INTER, HIDDEN);
        assert_tiles(&m, TSR_T_UP, tp, true, INTER, HIDDEN);
    }
}

static void test_q_and_kv_rows_follow_whole_heads(void **state)
{
    (void)state;
    /* GQA: rank r's query heads must use the kv heads rank r holds, so both
     * are cut at head boundaries in the same proportion. */
    tsr_model_info_t m = gqa_model();
    tsr_slice_t q, k;
    for (int i = 0; i < N_TPS; i++) {
        int tp = TPS[i];
        for (int r = 0; r < tp; r++) {
            assert_int_equal(tsr_slice_of(&m, TSR_T_Q, r, tp, &q), 0);
            assert_int_equal(tsr_slice_of(&m, TSR_T_K, r, tp, &k), 0);
            assert_int_equal(q.r0, (int64_t)r * (HEADS / tp) * HEAD_DIM);
            assert_int_equal(q.r1 - q.r0, (int64_t)(HEADS / tp) * HEAD_DIM);
            assert_int_equal(k.r0, (int64_t)r * (KV_HEADS / tp) * HEAD_DIM);
            assert_int_equal(k.r1 - k.r0, (int64_t)(KV_HEADS / tp) * HEAD_DIM);
        }
    }
}

static void test_o_and_down_columns_tile_the_full_columns_once(void **state)
{
    (void)state;
    tsr_model_info_t m = gqa_model();
    for (int i = 0; i < N_TPS; i++) {
        assert_tiles(&m, TSR_T_O, TPS[i], false, HIDDEN, HEADS * HEAD_DIM);
        assert_tiles(&m, TSR_T_DOWN, TPS[i], false, HIDDEN, INTER);
    }
}

static void test_o_columns_match_q_rows_and_down_columns_match_up_rows(void **state)
{
    (void)state;
    /* Row-parallel after column-parallel: a rank multiplies the activations
     * it produced itself, so no all-gather sits between them. */
    tsr_model_info_t m = gqa_model();
    tsr_slice_t a, b;
    for (int i = 0; i < N_TPS; i++)
        for (int r = 0; r < TPS[i]; r++) {
            assert_int_equal(tsr_slice_of(&m, TSR_T_Q, r, TPS[i], &a), 0);
            assert_int_equal(tsr_slice_of(&m, TSR_T_O, r, TPS[i], &b), 0);
            assert_int_equal(a.r0, b.c0);
            assert_int_equal(a.r1, b.c1);
            assert_int_equal(tsr_slice_of(&m, TSR_T_UP, r, TPS[i], &a), 0);
            assert_int_equal(tsr_slice_of(&m, TSR_T_DOWN, r, TPS[i], &b), 0);
            assert_int_equal(a.r0, b.c0);
            assert_int_equal(a.r1, b.c1);
        }
}

static void test_norms_are_whole_on_every_rank(void **state)
{
    (void)state;
    tsr_model_info_t m = gqa_model();
    static const tsr_tensor_kind_t norms[] = {TSR_T_FINAL_NORM, TSR_T_ATTN_NORM, TSR_T_MLP_NORM};
    for (int i = 0; i < N_TPS; i++)
        for (int r = 0; r < TPS[i]; r++)
            for (int k = 0; k < 3; k++) {
                tsr_slice_t s;
                assert_int_equal(tsr_slice_of(&m, norms[k], r, TPS[i], &s), 0);
                assert_int_equal(s.rows, HIDDEN);
                assert_int_equal(s.cols, 0);
                assert_int_equal(s.r0, 0);
                assert_int_equal(s.r1, HIDDEN);
                assert_int_equal(tsr_slice_elems(&s), HIDDEN);
            }
}

static void test_vocab_ranges_tile_the_vocabulary_in_chunks_of_ceil_v_over_tp(void **state)
{
    (void)state;
    tsr_model_info_t m = gqa_model();
    for (int i = 0; i < N_TPS; i++) {
        int tp = TPS[i], want_chunk = (VOCAB + tp - 1) / tp, next = 0;
        for (int r = 0; r < tp; r++) {
            int b, e, chunk;
            tsr_vocab_range(&m, r, tp, &b, &e, &chunk);
            assert_int_equal(chunk, want_chunk);
            assert_int_equal(b, next);                  /* contiguous, in rank order */
            int width = r < tp - 1 ? want_chunk : VOCAB - (tp - 1) * want_chunk;
            assert_int_equal(e - b, width);
            next = e;
            /* The embedding and the LM head are cut the same way. */
            tsr_slice_t se, sh;
            assert_int_equal(tsr_slice_of(&m, TSR_T_EMBED, r, tp, &se), 0);
            assert_int_equal(tsr_slice_of(&m, TSR_T_LM_HEAD, r, tp, &sh), 0);
            assert_int_equal(se.rows, VOCAB);
            assert_int_equal(se.r0, b);
            assert_int_equal(se.r1, e);
            assert_int_equal(se.c0, 0);
            assert_int_equal(se.c1, HIDDEN);
            assert_memory_equal(&se, &sh, sizeof se);
        }
        assert_int_equal(next, VOCAB);
        assert_tiles(&m, TSR_T_EMBED, tp, true, VOCAB, HIDDEN);
    }
    /* By hand: 250 over 4 is 63, 63, 63 and a short 61. */
    int b, e, chunk;
    tsr_vocab_range(&m, 3, 4, &b, &e, &chunk);
    assert_int_equal(chunk, 63);
    assert_int_equal(b, 189);
    assert_int_equal(e, 250);
    tsr_vocab_range(&m, 0, 4, &b, &e, NULL);           /* chunk may be NULL */
    assert_int_equal(e, 63);
}

static void test_last_rank_of_a_small_vocabulary_may_be_empty(void **state)
{
    (void)state;
    /* V = 9, tp = 4: chunk 3, so ranks hold 3, 3, 3 and 0 rows. */
    tsr_model_info_t m = gqa_model();
    m.vocab_size = 9;
    int b, e, chunk;
    tsr_vocab_range(&m, 3, 4, &b, &e, &chunk);
    assert_int_equal(chunk, 3);
    assert_int_equal(b, 9);
    assert_int_equal(e, 9);
    assert_tiles(&m, TSR_T_LM_HEAD, 4, true, 9, HIDDEN);
}

static void test_tp_that_does_not_divide_the_heads_is_refused(void **state)
{
    (void)state;
    tsr_model_info_t m = gqa_model();
    tsr_slice_t s;
    memset(&s, 0x5a, sizeof s);
    tsr_slice_t before = s;
    /* 3 divides neither 8 heads nor 4 kv heads; 8 divides the heads but not
     * the 4 kv heads. */
    for (int k = 0; k < TSR_T_COUNT; k++) {
        assert_int_equal(tsr_slice_of(&m, (tsr_tensor_kind_t)k, 0, 3, &s), -1);
        assert_int_equal(tsr_slice_of(&m, (tsr_tensor_kind_t)k, 0, 8, &s), -1);
    }
    assert_memory_equal(&s, &before, sizeof s);         /* nothing written */
    /* Heads divide but the intermediate size does not. */
    m.intermediate_size = 130;
    assert_int_equal(tsr_slice_of(&m, TSR_T_UP, 0, 4, &s), -1);
    m.intermediate_size = INTER;
    /* Ranks outside the group and a tp of 0. */
    assert_int_equal(tsr_slice_of(&m, TSR_T_Q, 2, 2, &s), -1);
    assert_int_equal(tsr_slice_of(&m, TSR_T_Q, -1, 2, &s), -1);
    assert_int_equal(tsr_slice_of(&m, TSR_T_Q, 0, 0, &s), -1);
    assert_int_equal(tsr_slice_of(&m, TSR_T_COUNT, 0, 1, &s), -1);
}

static void test_tensor_names_are_hugging_faces(void **state)
{
    (void)state;
    tsr_model_info_t m = gqa_model();
    char buf[128];
    static const struct {
        tsr_tensor_kind_t t;
        const char *name;
    } want[] = {
        {TSR_T_EMBED, "model.embed_tokens.weight"},
        {TSR_T_LM_HEAD, "lm_head.weight"},
        {TSR_T_FINAL_NORM, "model.norm.weight"},
        {TSR_T_ATTN_NORM, "model.layers.3.input_layernorm.weight"},
        {TSR_T_MLP_NORM, "model.layers.3.post_attention_layernorm.weight"},
        {TSR_T_Q, "model.layers.3.self_attn.q_proj.weight"},
        {TSR_T_K, "model.layers.3.self_attn.k_proj.weight"},
        {TSR_T_V, "model.layers.3.self_attn.v_proj.weight"},
        {TSR_T_O, "model.layers.3.self_attn.o_proj.weight"},
        {TSR_T_GATE, "model.layers.3.mlp.gate_proj.weight"},
        {TSR_T_UP, "model.layers.3.mlp.up_proj.weight"},
        {TSR_T_DOWN, "model.layers.3.mlp.down_proj.weight"},
    };
    assert_int_equal(sizeof want / sizeof want[0], TSR_T_COUNT);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        assert_string_equal(tsr_tensor_name(&m, want[i].t, 3, buf, sizeof buf), want[i].name);
    assert_string_equal(tsr_tensor_name(&m, TSR_T_Q, 11, buf, sizeof buf),
                        "model.layers.11.self_attn.q_proj.weight");
    /* The name is written into buf, and returned. */
    assert_ptr_equal(tsr_tensor_name(&m, TSR_T_DOWN, 0, buf, sizeof buf), buf);
}

static void test_tied_lm_head_is_the_embedding(void **state)
{
    (void)state;
    tsr_model_info_t m = gqa_model();
    m.tie_word_embeddings = 1;
    char buf[64];
    assert_string_equal(tsr_tensor_name(&m, TSR_T_LM_HEAD, 0, buf, sizeof buf),
                        "model.embed_tokens.weight");
}

static void test_stages_hold_embed_first_head_and_final_norm_last(void **state)
{
    (void)state;
    for (int pp = 1; pp <= 3; pp++)
        for (int st = 0; st < pp; st++) {
            assert_int_equal(tsr_stage_holds(TSR_T_EMBED, st, pp), st == 0);
            assert_int_equal(tsr_stage_holds(TSR_T_LM_HEAD, st, pp), st == pp - 1);
            assert_int_equal(tsr_stage_holds(TSR_T_FINAL_NORM, st, pp), st == pp - 1);
            assert_true(tsr_stage_holds(TSR_T_Q, st, pp));
            assert_true(tsr_stage_holds(TSR_T_ATTN_NORM, st, pp));
        }
}

static void test_kv_pool_without_budget_holds_max_seqs_full_sequences(void **state)
{
    (void)state;
    tsr_model_info_t m = gqa_model();
    const int BF16 = tsr_kv_row_bytes(TSR_KV_BF16, m.head_dim);
    const int F32 = tsr_kv_row_bytes(TSR_KV_F32, m.head_dim);
    /* ceil(100 / 16) = 7 blocks a sequence. */
    assert_int_equal(tsr_kv_pool_blocks(&m, 1, 1, 0, 4, 100, 16, BF16), 4 * 7);
    assert_int_equal(tsr_kv_pool_blocks(&m, 2, 3, 0, 3, 512, 16, F32), 3 * 32);
    assert_int_equal(tsr_kv_pool_blocks(&m, 4, 2, 0, 1, 16, 16, BF16), 1);
}

static void test_kv_pool_with_budget_prices_the_largest_stage(void **state)
{
    (void)state;
    tsr_model_info_t m = gqa_model();
    const int BF16 = tsr_kv_row_bytes(TSR_KV_BF16, m.head_dim);
    /* 8 layers over 3 stages: 3, 3, 2; the largest stage has 3.  A block of
     * 16 positions, keys and values, 4 kv heads of 8 at 2 bytes over tp:
     *   tp 1: 2 * 3 layers * 32 * 16 * 2 = 6144 bytes
     *   tp 2: 2 * 3 layers * 16 * 16 * 2 = 3072 bytes */
    assert_int_equal(tsr_kv_block_bytes(&m, 1, 3, 16, BF16), 6144);
    assert_int_equal(tsr_kv_block_bytes(&m, 2, 3, 16, BF16), 3072);
    /* int8: 8 one-byte elements and a 4-byte scale a row, 2 * 3 * 4 * 16 * 12 */
    assert_int_equal(tsr_kv_block_bytes(&m, 1, 3, 16, tsr_kv_row_bytes(TSR_KV_INT8, m.head_dim)),
                     4608);
    uint64_t mib = 1 << 20;
    assert_int_equal(tsr_kv_pool_blocks(&m, 1, 3, mib, 4, 512, 16, BF16), 170);  /* 1048576/6144 */
    assert_int_equal(tsr_kv_pool_blocks(&m, 2, 3, mib, 4, 512, 16, BF16), 341);  /* 1048576/3072 */
    assert_int_equal(tsr_kv_pool_blocks(&m, 2, 3, 6143 * 2, 4, 512, 16, BF16), 3);
    /* pp 2: 4 layers a stage, 8192 bytes a block at tp 1. */
    assert_int_equal(tsr_kv_pool_blocks(&m, 1, 2, mib, 4, 512, 16, BF16), 128);
    /* The budget decides, whatever max_seqs and max_seq_len say. */
    assert_int_equal(tsr_kv_pool_blocks(&m, 1, 3, mib, 1, 16, 16, BF16), 170);
}

static void test_kv_row_bytes_per_type(void **state)
{
    (void)state;
    assert_int_equal(tsr_kv_row_bytes(TSR_KV_F32, 64), 256);
    assert_int_equal(tsr_kv_row_bytes(TSR_KV_BF16, 64), 128);
    assert_int_equal(tsr_kv_row_bytes(TSR_KV_INT8, 64), 68);
    assert_int_equal(tsr_kv_row_bytes(TSR_KV_AUTO, 64), 0);   /* resolve auto first */
    assert_int_equal(tsr_kv_row_bytes(99, 64), 0);
}

static void test_kv_pool_is_never_below_one_block(void **state)
{
    (void)state;
    tsr_model_info_t m = gqa_model();
    const int BF16 = tsr_kv_row_bytes(TSR_KV_BF16, m.head_dim);
    assert_int_equal(tsr_kv_pool_blocks(&m, 1, 3, 1, 4, 512, 16, BF16), 1);
    assert_int_equal(tsr_kv_pool_blocks(&m, 1, 3, 6143, 4, 512, 16, BF16), 1);
    assert_int_equal(tsr_kv_pool_blocks(&m, 1, 1, 0, 0, 512, 16, BF16), 1);
}

/* Llama 3 8B's shape, for the GPU memory model. */
static tsr_model_info_t llama8b(void)
{
    tsr_model_info_t m;
    memset(&m, 0, sizeof m);
    m.hidden_size = 4096, m.intermediate_size = 14336, m.num_hidden_layers = 32;
    m.num_attention_heads = 32, m.num_key_value_heads = 8, m.head_dim = 128;
    m.vocab_size = 128256, m.dtype_bytes = 2;
    return m;
}

static tsr_deployment_t cuda_dep(int tp, int pp)
{
    tsr_deployment_t d;
    memset(&d, 0, sizeof d);
    d.device = TSR_DEVICE_CUDA, d.tensor = tp, d.pipeline = pp, d.replicas = 1;
    d.max_seq_len = 8192, d.max_batch = 32, d.prefill_chunk = 512, d.gpu_memory_percent = 90;
    return d;
}

/* A GPU of exactly a piece's need holds its weights, reserve and at least
 * one full sequence of KV within gpu_memory_percent; more memory gives more
 * blocks, up to max_batch full sequences. */
static void test_gpu_need_and_kv_blocks_agree(void **state)
{
    (void)state;
    tsr_model_info_t m = llama8b();
    for (int pp = 1; pp <= 4; pp *= 2)
        for (int tp = 1; tp <= 8; tp *= 2)
            for (int pi = 0; pi < 3; pi++) {
                const int pct = (int[]){10, 50, 99}[pi];
                tsr_deployment_t d = cuda_dep(tp, pp);
                d.gpu_memory_percent = pct;
                for (int s = 0; s < pp; s++) {
                    uint64_t need = tsr_piece_need(&m, &d, s), w, k, r;
                    int one = (d.max_seq_len + 15) / 16, full = d.max_batch * one;
                    int at_need = tsr_cuda_kv_blocks(&m, &d, s, need);
                    assert_true(at_need >= one);
                    assert_true(tsr_cuda_kv_blocks(&m, &d, s, need - need / 50) < one);
                    uint64_t total = tsr_piece_memory(&m, &d, s, need, &w, &k, &r);
                    assert_true(total <= need * (uint64_t)pct / 100);
                    assert_true(w > 0 && k > 0 && r >= TSR_CUDA_CONTEXT_BYTES);
                    int prev = at_need;
                    for (uint64_t g = need; g < need * 8; g += need / 2) {
                        int b = tsr_cuda_kv_blocks(&m, &d, s, g);
                        assert_true(b >= prev && b <= full);
                        prev = b;
                    }
                    assert_int_equal(tsr_cuda_kv_blocks(&m, &d, s, (uint64_t)1 << 50), full);
                    assert_int_equal(tsr_cuda_kv_blocks(&m, &d, s, 0), full);  /* unknown GPU */
                }
            }
    /* kv_cache_mib fixes the pool whatever the GPU; cpu pieces need nothing */
    tsr_deployment_t d = cuda_dep(1, 1);
    d.kv_cache_mib = 1024;
    assert_int_equal(tsr_cuda_kv_blocks(&m, &d, 0, (uint64_t)80 << 30),
                     tsr_cuda_kv_blocks(&m, &d, 0, (uint64_t)24 << 30));
    d.device = TSR_DEVICE_CPU;
    assert_int_equal(tsr_piece_need(&m, &d, 0), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_q_k_v_gate_up_rows_tile_the_full_rows_once),
        cmocka_unit_test(test_q_and_kv_rows_follow_whole_heads),
        cmocka_unit_test(test_o_and_down_columns_tile_the_full_columns_once),
        cmocka_unit_test(test_o_columns_match_q_rows_and_down_columns_match_up_rows),
        cmocka_unit_test(test_norms_are_whole_on_every_rank),
        cmocka_unit_test(test_vocab_ranges_tile_the_vocabulary_in_chunks_of_ceil_v_over_tp),
        cmocka_unit_test(test_last_rank_of_a_small_vocabulary_may_be_empty),
        cmocka_unit_test(test_tp_that_does_not_divide_the_heads_is_refused),
        cmocka_unit_test(test_tensor_names_are_hugging_faces),
        cmocka_unit_test(test_tied_lm_head_is_the_embedding),
        cmocka_unit_test(test_stages_hold_embed_first_head_and_final_norm_last),
        cmocka_unit_test(test_kv_pool_without_budget_holds_max_seqs_full_sequences),
        cmocka_unit_test(test_gpu_need_and_kv_blocks_agree),
        cmocka_unit_test(test_kv_pool_with_budget_prices_the_largest_stage),
        cmocka_unit_test(test_kv_row_bytes_per_type),
        cmocka_unit_test(test_kv_pool_is_never_below_one_block),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
