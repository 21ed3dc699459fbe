#include "common/budget.h"

#include "common/slice.h"

/* Bytes of a slice at elem bytes a parameter, and row_extra more a row of
 * a matrix (int8 weights' scales). */
static uint64_t slice_bytes(const tsr_slice_t *sl, int elem, int row_extra)
{
    return (uint64_t)tsr_slice_elems(sl) * (uint64_t)elem +
           (sl->cols ? (uint64_t)(sl->r1 - sl->r0) * (uint64_t)row_extra : 0);
}

/* What tp rank 0 of the stage holds (rank 0 has the widest vocabulary
 * chunk), exactly as the engines load it: common/slice.c decides. */
static uint64_t piece_bytes(const tsr_model_info_t *m, int stages, int stage, int tensor, int elem,
                            int row_extra)
{
    static const tsr_tensor_kind_t per_layer[] = {TSR_T_ATTN_NORM, TSR_T_MLP_NORM, TSR_T_Q,
                                                  TSR_T_K, TSR_T_V, TSR_T_O, TSR_T_GATE,
                                                  TSR_T_UP, TSR_T_DOWN};
    tsr_slice_t sl;
    uint64_t layer = 0, params = 0;
    int begin, end;

    if (stages <= 0 || tensor <= 0 || stage < 0 || stage >= stages ||
        m->num_attention_heads <= 0)
        return 0;
    for (size_t i = 0; i < sizeof per_layer / sizeof per_layer[0]; i++) {
        if (tsr_slice_of(m, per_layer[i], 0, tensor, &sl) < 0) return 0;
        layer += slice_bytes(&sl, elem, row_extra);
    }
    tsr_layer_split(m->num_hidden_layers, stages, stage, &begin, &end);
    params = (uint64_t)(end - begin) * layer;
    for (int t = TSR_T_EMBED; t <= TSR_T_FINAL_NORM; t++) {
        if (!tsr_stage_holds((tsr_tensor_kind_t)t, stage, stages)) continue;
        /* A tied head is stage 0's embedding when both are on one stage. */
        if (t == TSR_T_LM_HEAD && m->tie_word_embeddings && stages == 1) continue;
        if (tsr_slice_of(m, (tsr_tensor_kind_t)t, 0, tensor, &sl) < 0) return 0;
        params += slice_bytes(&sl, elem, row_extra);
    }
    return params;
}

uint64_t tsr_model_piece_bytes(const tsr_model_info_t *m, int stages, int stage, int tensor)
{
    return piece_bytes(m, stages, stage, tensor, m->dtype_bytes, 0);
}

int tsr_weight_elem_bytes(const tsr_deployment_t *d)
{
    if (d->device == TSR_DEVICE_CUDA) return 2;
    if (d->weights_dtype == TSR_KV_INT8) return 1;
    return tsr_kv_dtype_on(d->device, d->matmul_dtype) == TSR_KV_BF16 ? 2 : 4;
}

uint64_t tsr_piece_weight_bytes(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage)
{
    /* int8: each matrix row's f32 scale besides (worker/matmul_f32.h) */
    return piece_bytes(m, d->pipeline, stage, d->tensor, tsr_weight_elem_bytes(d),
                       tsr_weight_elem_bytes(d) == 1 ? (int)sizeof(float) : 0);
}

void tsr_step_rows(int max_batch, int prefill_chunk, int max_seq_len, int *seqs, int *tokens)
{
    int batch = max_batch > 0 ? max_batch : 32;
    int chunk = prefill_chunk > 0 ? prefill_chunk : 128;
    if (chunk > max_seq_len) chunk = max_seq_len;
    *seqs = batch;
    *tokens = batch + chunk;
}

uint64_t tsr_kv_block_bytes(const tsr_model_info_t *m, int tp_size, int n_layers,
                            int block_positions, int row_bytes)
{
    uint64_t kvh = (uint64_t)(m->num_key_value_heads / (tp_size > 0 ? tp_size : 1));
    return 2 * (uint64_t)n_layers * kvh * (uint64_t)block_positions * (uint64_t)row_bytes;
}

uint64_t tsr_kv_pool_elems(const tsr_model_info_t *m, int tp_size, int n_layers, int kv_blocks)
{
    uint64_t kvh = (uint64_t)(m->num_key_value_heads / (tp_size > 0 ? tp_size : 1));
    return (uint64_t)n_layers * (uint64_t)kv_blocks * kvh * TSR_KV_BLOCK * (uint64_t)m->head_dim;
}

int tsr_kv_pool_blocks(const tsr_model_info_t *m, int tp_size, int pp_size,
                       uint64_t budget_bytes, int max_seqs, int max_seq_len,
                       int block_positions, int row_bytes)
{
    int per_seq = (int)(((int64_t)max_seq_len + block_positions - 1) / block_positions);
    uint64_t blocks = (uint64_t)max_seqs * (uint64_t)per_seq;
    if (budget_bytes) {
        int b, e;
        tsr_layer_split(m->num_hidden_layers, pp_size, 0, &b, &e);  /* stage 0 is the largest */
        uint64_t bb = tsr_kv_block_bytes(m, tp_size, e - b > 0 ? e - b : 1, block_positions,
                                         row_bytes);
        blocks = bb ? budget_bytes / bb : 0;
    }
    if (blocks < 1) blocks = 1;
    if (blocks > (1u << 30)) blocks = 1u << 30;
    return (int)blocks;
}

/* The reserve of a cuda piece: the CUDA context and cuBLAS's workspace,
 * the RoPE tables, the step's activations (f32 and BF16 rows) and, on the
 * last stage, logits (this rank's and the gathered), the sampling buffers
 * and the sort's scratch.  worker/cuda/buffers.c lists them one by one;
 * tests/cuda/test_buffers.cu holds the two together. */
static uint64_t cuda_reserve(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage)
{
    const uint64_t H = (uint64_t)m->hidden_size, tp = (uint64_t)d->tensor,
                   I = (uint64_t)m->intermediate_size / tp,
                   qw = (uint64_t)m->num_attention_heads / tp * (uint64_t)m->head_dim,
                   kvw = (uint64_t)m->num_key_value_heads / tp * (uint64_t)m->head_dim,
                   V = (uint64_t)m->vocab_size;
    int seqs, tokens;
    tsr_step_rows(d->max_batch, d->prefill_chunk, d->max_seq_len, &seqs, &tokens);
    uint64_t T = (uint64_t)tokens, S = (uint64_t)seqs;
    uint64_t C = (V + tp - 1) / tp;
    uint64_t r = TSR_CUDA_CONTEXT_BYTES + 4 * (uint64_t)d->max_seq_len * (uint64_t)m->head_dim +
                 T * (4 * H * 4 + (qw + 2 * kvw) * 4 + 2 * I * 4 + H * 2 + qw * 2 + I * 2);
    /* the sort's scratch is cub's two alternate buffers, keys and values: 8 bytes a logit */
    if (stage == d->pipeline - 1) r += S * C * 4 * (1 + tp) + S * V * (16 + 8);
    return r;
}

uint64_t tsr_cuda_block_bytes(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage)
{
    int b, e;
    tsr_layer_split(m->num_hidden_layers, d->pipeline, stage, &b, &e);
    return tsr_kv_block_bytes(m, d->tensor, e - b, TSR_KV_BLOCK,
                              tsr_kv_row_bytes(TSR_KV_BF16, m->head_dim));
}

int tsr_cuda_kv_blocks(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage,
                       uint64_t gpu_bytes)
{
    int seqs, tokens;
    tsr_step_rows(d->max_batch, d->prefill_chunk, d->max_seq_len, &seqs, &tokens);
    int full = tsr_kv_pool_blocks(m, d->tensor, d->pipeline, (uint64_t)d->kv_cache_mib << 20,
                                  seqs, d->max_seq_len, TSR_KV_BLOCK,
                                  tsr_kv_row_bytes(TSR_KV_BF16, m->head_dim));
    if (d->kv_cache_mib || !gpu_bytes) return full;
    uint64_t w = tsr_piece_weight_bytes(m, d, stage), r = cuda_reserve(m, d, stage),
             bb = tsr_cuda_block_bytes(m, d, stage);
    uint64_t cap = gpu_bytes * (uint64_t)d->gpu_memory_percent / 100;
    uint64_t blocks = cap > w + r && bb ? (cap - w - r) / bb : 0;
    return blocks < (uint64_t)full ? (int)blocks : full;
}

uint64_t tsr_piece_memory(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage,
                          uint64_t gpu_bytes, uint64_t *weights, uint64_t *kv, uint64_t *reserve)
{
    uint64_t w = 0, k = 0, r = 0;
    if (d->device == TSR_DEVICE_CUDA) {
        w = tsr_piece_weight_bytes(m, d, stage);
        r = cuda_reserve(m, d, stage);
        k = (uint64_t)tsr_cuda_kv_blocks(m, d, stage, gpu_bytes) *
            tsr_cuda_block_bytes(m, d, stage);
    }
    if (weights) *weights = w;
    if (kv) *kv = k;
    if (reserve) *reserve = r;
    return w + k + r;
}

uint64_t tsr_piece_need(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage)
{
    if (d->device != TSR_DEVICE_CUDA) return 0;
    uint64_t w = tsr_piece_weight_bytes(m, d, stage), r = cuda_reserve(m, d, stage), k;
    if (d->kv_cache_mib)   /* the budget as given (the pool is at most that) */
        k = (uint64_t)tsr_cuda_kv_blocks(m, d, stage, 0) * tsr_cuda_block_bytes(m, d, stage);
    else                   /* at least one sequence of max_seq_len */
        k = (((uint64_t)d->max_seq_len + TSR_KV_BLOCK - 1) / TSR_KV_BLOCK) *
            tsr_cuda_block_bytes(m, d, stage);
    uint64_t total = w + r + k, pct = (uint64_t)d->gpu_memory_percent;
    return (total * 100 + pct - 1) / pct;
}
