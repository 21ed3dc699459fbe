/* test_budget.c: the helpers of common/budget.h that the planner, the
 * executor and the engines share.  (The KV pool and GPU memory figures are
 * worked by hand in test_slice.c, the weight bytes in test_deploy.c; the
 * CUDA engine's allocations are held against this file's figures in
 * tests/cuda/test_buffers.cu.) */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "common/budget.h"

static tsr_model_info_t small_model(void)
{
    tsr_model_info_t m;
    memset(&m, 0, sizeof m);
    m.hidden_size = 64, m.intermediate_size = 128, m.num_hidden_layers = 7;
    m.num_attention_heads = 8, m.num_key_value_heads = 4, m.head_dim = 8;
    m.vocab_size = 250, m.dtype_bytes = 4;
    return m;
}

/* The batching defaults, and a prefill chunk never longer than a sequence. */
static void test_step_rows_defaults_and_cap(void **state)
{
    (void)state;
    int seqs, tokens;
    tsr_step_rows(0, 0, 4096, &seqs, &tokens);
    assert_int_equal(seqs, 32);
    assert_int_equal(tokens, 32 + 128);
    tsr_step_rows(8, 512, 8192, &seqs, &tokens);
    assert_int_equal(seqs, 8);
    assert_int_equal(tokens, 8 + 512);
    tsr_step_rows(4, 1000, 300, &seqs, &tokens);
    assert_int_equal(tokens, 4 + 300);
}

/* One pool of blocks holds, keys and values together, what the blocks'
 * bytes say, for every KV type the engines keep. */
static void test_kv_pool_elems_agree_with_block_bytes(void **state)
{
    (void)state;
    tsr_model_info_t m = small_model();
    for (int tp = 1; tp <= 4; tp *= 2)
        for (int layers = 1; layers <= 4; layers++) {
            uint64_t elems = tsr_kv_pool_elems(&m, tp, layers, 9);
            assert_int_equal(elems, (uint64_t)layers * 9 * (4 / tp) * TSR_KV_BLOCK * 8);
            const int bf16 = tsr_kv_row_bytes(TSR_KV_BF16, 8);
            const int f32 = tsr_kv_row_bytes(TSR_KV_F32, 8);
            const int B = TSR_KV_BLOCK;
            assert_int_equal(2 * elems * 2, 9 * tsr_kv_block_bytes(&m, tp, layers, B, bf16));
            assert_int_equal(2 * elems * 4, 9 * tsr_kv_block_bytes(&m, tp, layers, B, f32));
        }
}

/* A cuda block is TSR_KV_BLOCK positions of the stage's own layers, BF16. */
static void test_cuda_block_bytes_per_stage(void **state)
{
    (void)state;
    tsr_model_info_t m = small_model();
    tsr_deployment_t d;
    memset(&d, 0, sizeof d);
    d.device = TSR_DEVICE_CUDA, d.tensor = 2, d.pipeline = 3;
    /* 7 layers on 3 stages: 3, 2, 2 */
    assert_int_equal(tsr_cuda_block_bytes(&m, &d, 0), 2 * 3 * 2 * TSR_KV_BLOCK * 8 * 2);
    assert_int_equal(tsr_cuda_block_bytes(&m, &d, 2), 2 * 2 * 2 * TSR_KV_BLOCK * 8 * 2);
}

/* What the engine holds of its weights: BF16 on a GPU whatever the file's
 * type; on a CPU f32, BF16 with matmul_dtype bf16, or int8 with
 * weights_dtype int8 and a 4-byte scale for each row of a matrix. */
static void test_piece_weight_bytes_per_engine(void **state)
{
    (void)state;
    tsr_model_info_t m = small_model();   /* an f32 checkpoint */
    tsr_deployment_t d;
    memset(&d, 0, sizeof d);
    d.tensor = 2, d.pipeline = 2;
    uint64_t file = tsr_model_piece_bytes(&m, 2, 1, 2);
    d.device = TSR_DEVICE_CPU;
    assert_int_equal(tsr_weight_elem_bytes(&d), 4);
    assert_int_equal(tsr_piece_weight_bytes(&m, &d, 1), file);
    d.matmul_dtype = TSR_KV_BF16;
    assert_int_equal(tsr_weight_elem_bytes(&d), 2);
    assert_int_equal(tsr_piece_weight_bytes(&m, &d, 1), file / 2);
    d.matmul_dtype = TSR_KV_AUTO, d.weights_dtype = TSR_KV_INT8;
    assert_int_equal(tsr_weight_elem_bytes(&d), 1);
    /* the last stage at tp 2: its layers' matrix rows and its LM head's vocabulary rows */
    const tsr_model_info_t *k = &m;
    int b, e;
    tsr_layer_split(k->num_hidden_layers, 2, 1, &b, &e);
    const uint64_t hd = (uint64_t)k->head_dim, H = (uint64_t)k->hidden_size,
                   layer_rows = (k->num_attention_heads + 2 * k->num_key_value_heads) * hd / 2 +
                                H + 2 * (uint64_t)k->intermediate_size / 2 + H,
                   vocab_rows = ((uint64_t)k->vocab_size + 1) / 2;
    assert_int_equal(tsr_piece_weight_bytes(&m, &d, 1),
                     file / 4 + 4 * ((uint64_t)(e - b) * layer_rows + vocab_rows));
    d.device = TSR_DEVICE_CUDA, d.matmul_dtype = TSR_KV_AUTO, d.weights_dtype = TSR_KV_AUTO;
    assert_int_equal(tsr_piece_weight_bytes(&m, &d, 1), file / 2);
    uint64_t w;
    d.max_seq_len = 64, d.gpu_memory_percent = 90;
    tsr_piece_memory(&m, &d, 1, 0, &w, NULL, NULL);
    assert_int_equal(w, file / 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_step_rows_defaults_and_cap),
        cmocka_unit_test(test_kv_pool_elems_agree_with_block_bytes),
        cmocka_unit_test(test_cuda_block_bytes_per_stage),
        cmocka_unit_test(test_piece_weight_bytes_per_engine),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
