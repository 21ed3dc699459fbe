#include "common/slice.h"

#include "common/util.h"

#include <stdio.h>

void tsr_vocab_range(const tsr_model_info_t *m, int tp_rank, int tp_size, int *begin, int *end,
                     int *chunk)
{
    int V = m->vocab_size, c = (V + tp_size - 1) / tp_size;
    int b = tp_rank * c < V ? tp_rank * c : V;
    *begin = b;
    *end = b + c < V ? b + c : V;
    if (chunk) *chunk = c;
}

const char *tsr_tensor_name(const tsr_model_info_t *m, tsr_tensor_kind_t t, int layer, char *buf,
                            size_t len)
{
    static const char *per_layer[] = {
        [TSR_T_ATTN_NORM] = "input_layernorm", [TSR_T_MLP_NORM] = "post_attention_layernorm",
        [TSR_T_Q] = "self_attn.q_proj",        [TSR_T_K] = "self_attn.k_proj",
        [TSR_T_V] = "self_attn.v_proj",        [TSR_T_O] = "self_attn.o_proj",
        [TSR_T_GATE] = "mlp.gate_proj",        [TSR_T_UP] = "mlp.up_proj",
        [TSR_T_DOWN] = "mlp.down_proj",
    };
    switch (t) {
    case TSR_T_EMBED: snprintf(buf, len, "model.embed_tokens.weight"); break;
    case TSR_T_LM_HEAD:
        snprintf(buf, len, m->tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
        break;
    case TSR_T_FINAL_NORM: snprintf(buf, len, "model.norm.weight"); break;
    default:
        if (t < 0 || t >= TSR_T_COUNT) snprintf(buf, len, "?");
        else snprintf(buf, len, "model.layers.%d.%s.weight", layer, per_layer[t]);
    }
    return buf;
}

bool tsr_stage_holds(tsr_tensor_kind_t t, int stage, int pp_size)
{
    switch (t) {
    case TSR_T_EMBED: return stage == 0;
    case TSR_T_LM_HEAD:
    case TSR_T_FINAL_NORM: return stage == pp_size - 1;
    default: return t >= 0 && t < TSR_T_COUNT;
    }
}

int tsr_slice_of(const tsr_model_info_t *m, tsr_tensor_kind_t t, int r, int tp, tsr_slice_t *out)
{
    const int64_t H = m->hidden_size, hd = m->head_dim, N = m->num_attention_heads,
                  K = m->num_key_value_heads, I = m->intermediate_size;
    if (tp < 1 || r < 0 || r >= tp || N % tp || K % tp || I % tp) return -1;
    const int64_t Nl = N / tp * hd, Kl = K / tp * hd, Il = I / tp;
    tsr_slice_t s = {0};
    int vb, ve;
    switch (t) {
    case TSR_T_EMBED:
    case TSR_T_LM_HEAD:
        tsr_vocab_range(m, r, tp, &vb, &ve, NULL);
        s = (tsr_slice_t){m->vocab_size, H, vb, ve, 0, H};
        break;
    case TSR_T_FINAL_NORM:
    case TSR_T_ATTN_NORM:
    case TSR_T_MLP_NORM: s = (tsr_slice_t){H, 0, 0, H, 0, 0}; break;
    case TSR_T_Q: s = (tsr_slice_t){N * hd, H, r * Nl, (r + 1) * Nl, 0, H}; break;
    case TSR_T_K:
    case TSR_T_V: s = (tsr_slice_t){K * hd, H, r * Kl, (r + 1) * Kl, 0, H}; break;
    case TSR_T_O: s = (tsr_slice_t){H, N * hd, 0, H, r * Nl, (r + 1) * Nl}; break;
    case TSR_T_GATE:
    case TSR_T_UP: s = (tsr_slice_t){I, H, r * Il, (r + 1) * Il, 0, H}; break;
    case TSR_T_DOWN: s = (tsr_slice_t){H, I, 0, H, r * Il, (r + 1) * Il}; break;
    default: return -1;
    }
    *out = s;
    return 0;
}

int64_t tsr_slice_elems(const tsr_slice_t *s)
{
    return s->cols ? (s->r1 - s->r0) * (s->c1 - s->c0) : s->r1 - s->r0;
}

uint64_t tsr_kv_block_bytes(const tsr_model_info_t *m, int tp_size, int n_layers,
                            int block_positions, int row_bytes)
{
    uint64_t kvh = (uint64_t)(m->num_key_value_heads / (tp_size > 0 ? tp_size : 1));
    return 2 * (uint64_t)n_layers * kvh * (uint64_t)block_positions * (uint64_t)row_bytes;
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

/* The parts of a cuda piece that do not depend on its GPU: weights in BF16
 * and the reserve. */
static void cuda_fixed(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage,
                       uint64_t *w, uint64_t *r)
{
    const uint64_t H = (uint64_t)m->hidden_size, tp = (uint64_t)d->tensor,
                   I = (uint64_t)m->intermediate_size / tp,
                   qw = (uint64_t)m->num_attention_heads / tp * (uint64_t)m->head_dim,
                   kvw = (uint64_t)m->num_key_value_heads / tp * (uint64_t)m->head_dim,
                   V = (uint64_t)m->vocab_size;
    int batch = d->max_batch > 0 ? d->max_batch : 32;
    int chunk = d->prefill_chunk > 0 ? d->prefill_chunk : 128;
    if (chunk > d->max_seq_len) chunk = d->max_seq_len;
    *w = m->dtype_bytes > 0
             ? tsr_model_piece_bytes(m, d->pipeline, stage, d->tensor) / (uint64_t)m->dtype_bytes * 2
             : 0;
    /* the CUDA context and cuBLAS's workspace, the RoPE tables, the step's
     * activations (f32 and BF16 rows) and, on the last stage, logits (this
     * rank's and the gathered), the sampling buffers and the sort's scratch
     * (engine_cuda.c's alloc_all) */
    uint64_t T = (uint64_t)batch + (uint64_t)chunk, S = (uint64_t)batch;
    uint64_t C = (V + tp - 1) / tp;
    *r = TSR_CUDA_CONTEXT_BYTES + 4 * (uint64_t)d->max_seq_len * (uint64_t)m->head_dim +
         T * (4 * H * 4 + (qw + 2 * kvw) * 4 + 2 * I * 4 + H * 2 + qw * 2 + I * 2);
    if (stage == d->pipeline - 1) *r += S * C * 4 * (1 + tp) + S * V * (16 + 8);
}

/* Bytes of one KV block of this stage's layers, in BF16. */
static uint64_t cuda_block_bytes(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage)
{
    int b, e;
    tsr_layer_split(m->num_hidden_layers, d->pipeline, stage, &b, &e);
    return tsr_kv_block_bytes(m, d->tensor, e - b, 16, tsr_kv_row_bytes(TSR_KV_BF16, m->head_dim));
}

int tsr_cuda_kv_blocks(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage,
                       uint64_t gpu_bytes)
{
    int batch = d->max_batch > 0 ? d->max_batch : 32;
    int full = tsr_kv_pool_blocks(m, d->tensor, d->pipeline, (uint64_t)d->kv_cache_mib << 20,
                                  batch, d->max_seq_len, 16,
                                  tsr_kv_row_bytes(TSR_KV_BF16, m->head_dim));
    if (d->kv_cache_mib || !gpu_bytes) return full;
    uint64_t w, r, bb = cuda_block_bytes(m, d, stage);
    cuda_fixed(m, d, stage, &w, &r);
    uint64_t cap = gpu_bytes * (uint64_t)d->gpu_memory_percent / 100;
    uint64_t blocks = cap > w + r && bb ? (cap - w - r) / bb : 0;
    return blocks < (uint64_t)full ? (int)blocks : full;
}

uint64_t tsr_piece_memory(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage,
                          uint64_t gpu_bytes, uint64_t *weights, uint64_t *kv, uint64_t *reserve)
{
    uint64_t w = 0, k = 0, r = 0;
    if (d->device == TSR_DEVICE_CUDA) {
        cuda_fixed(m, d, stage, &w, &r);
        k = (uint64_t)tsr_cuda_kv_blocks(m, d, stage, gpu_bytes) * cuda_block_bytes(m, d, stage);
    }
    if (weights) *weights = w;
    if (kv) *kv = k;
    if (reserve) *reserve = r;
    return w + k + r;
}

uint64_t tsr_piece_need(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage)
{
    if (d->device != TSR_DEVICE_CUDA) return 0;
    uint64_t w, r, k;
    cuda_fixed(m, d, stage, &w, &r);
    if (d->kv_cache_mib)   /* the budget as given (the pool is at most that) */
        k = (uint64_t)tsr_cuda_kv_blocks(m, d, stage, 0) * cuda_block_bytes(m, d, stage);
    else                   /* at least one sequence of max_seq_len */
        k = (((uint64_t)d->max_seq_len + 15) / 16) * cuda_block_bytes(m, d, stage);
    uint64_t total = w + r + k, pct = (uint64_t)d->gpu_memory_percent;
    return (total * 100 + pct - 1) / pct;
}

int tsr_slice_named(const tsr_model_info_t *m, tsr_tensor_kind_t t, int layer, int tp_rank,
                    int tp_size, char *name, size_t len, tsr_slice_t *out, char *err,
                    size_t errlen)
{
    tsr_tensor_name(m, t, layer, name, len);
    if (tsr_slice_of(m, t, tp_rank, tp_size, out) < 0) {
        tsr_set_err(err, errlen, "%s: tensor-parallel size %d does not divide it", name, tp_size);
        return -1;
    }
    return 0;
}
