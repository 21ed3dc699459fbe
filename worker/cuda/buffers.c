#include "worker/cuda/buffers.h"

#include <stdbool.h>

#include "common/budget.h"
#include "common/slice.h"
#include "worker/kmath.h"
#include "worker/kvpool.h"

size_t tsr_cuda_meta_layout(char *base, int max_tokens, int max_seqs, int max_tiles,
                            int max_blocks_per_seq, tsr_cuda_meta_t *m, size_t *fixed)
{
    const size_t T = (size_t)max_tokens, S = (size_t)max_seqs, tiles = (size_t)max_tiles;
    size_t off = 0;
    /* offsets first: base may be NULL, and NULL plus an offset is no pointer */
#define TAKE(field, type, n)                                                                      \
    do {                                                                                          \
        if (base) m->field = (type *)(base + off);                                                \
        off += ((n) * sizeof(type) + 15) & ~(size_t)15;                                           \
    } while (0)
    TAKE(tokens, int32_t, T);
    TAKE(row_pos, int32_t, T);
    TAKE(row_tbl, int32_t, T);
    TAKE(tile_row0, int32_t, tiles);
    TAKE(tile_n, int32_t, tiles);
    TAKE(tile_pos0, int32_t, tiles);
    TAKE(tile_tbl, int32_t, tiles);
    TAKE(samp_row, int32_t, S);
    TAKE(samp_temp, float, S);
    TAKE(samp_top_p, float, S);
    TAKE(samp_seed, unsigned long long, S);
    TAKE(samp_pos, unsigned long long, S);
#undef TAKE
    if (base) m->tables = (int32_t *)(base + off);
    if (fixed) *fixed = off;
    return off + S * (size_t)max_blocks_per_seq * sizeof(int32_t);
}

/* BF16 elements of the slices of tensors t[0..n) held by spec's rank. */
static int held(const tsr_model_info_t *m, const tsr_piece_spec_t *spec,
                const tsr_tensor_kind_t *t, int n, size_t *elems)
{
    tsr_slice_t s;
    *elems = 0;
    for (int i = 0; i < n; i++) {
        if (tsr_slice_of(m, t[i], spec->tp_rank, spec->tp_size, &s) < 0) return -1;
        *elems += (size_t)tsr_slice_elems(&s);
    }
    return 0;
}

static void put(tsr_cuda_plan_t *p, tsr_cuda_buf_id_t id, const char *what, tsr_cuda_part_t part,
                int count, size_t bytes)
{
    p->buf[id] = (tsr_cuda_buf_t){what, part, count, bytes};
}

/* The weights, in BF16, as load_weights fills them: q, k and v in one
 * buffer, gate and up in another. */
static int plan_weights(const tsr_model_info_t *m, const tsr_piece_spec_t *spec,
                        tsr_cuda_plan_t *p)
{
    static const struct {
        tsr_cuda_buf_id_t id;
        const char *what;
        tsr_tensor_kind_t t[3];
        int n;
    } w[] = {
        {TSR_CB_EMBED, "the embedding", {TSR_T_EMBED}, 1},
        {TSR_CB_FINAL_NORM, "the final norm", {TSR_T_FINAL_NORM}, 1},
        {TSR_CB_LM_HEAD, "the LM head", {TSR_T_LM_HEAD}, 1},
        {TSR_CB_ATTN_NORM, "a layer's weights", {TSR_T_ATTN_NORM}, 1},
        {TSR_CB_MLP_NORM, "a layer's weights", {TSR_T_MLP_NORM}, 1},
        {TSR_CB_WQKV, "a layer's weights", {TSR_T_Q, TSR_T_K, TSR_T_V}, 3},
        {TSR_CB_WO, "a layer's weights", {TSR_T_O}, 1},
        {TSR_CB_WGU, "a layer's weights", {TSR_T_GATE, TSR_T_UP}, 2},
        {TSR_CB_WD, "a layer's weights", {TSR_T_DOWN}, 1},
    };
    const bool first = spec->stage == 0, last = spec->stage == spec->pp_size - 1;
    const int layers = spec->layer_end - spec->layer_begin;
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) {
        size_t elems;
        if (held(m, spec, w[i].t, w[i].n, &elems) < 0) return -1;
        int count = layers;
        if (w[i].id == TSR_CB_EMBED) count = first;
        if (w[i].id == TSR_CB_FINAL_NORM) count = last;
        /* a tied head is the embedding when one stage holds both */
        if (w[i].id == TSR_CB_LM_HEAD) count = last && !(m->tie_word_embeddings && first);
        put(p, w[i].id, w[i].what, TSR_CB_WEIGHTS, count, elems * 2);
    }
    return 0;
}

int tsr_cuda_plan(const tsr_model_info_t *m, const tsr_piece_spec_t *spec, tsr_cuda_plan_t *out)
{
    tsr_cuda_plan_t p = {0};
    if (plan_weights(m, spec, &p) < 0) return -1;
    const int tp = spec->tp_size, layers = spec->layer_end - spec->layer_begin;
    const size_t H = (size_t)m->hidden_size, hd = (size_t)m->head_dim,
                 qw = (size_t)(m->num_attention_heads / tp) * hd,
                 kvw = (size_t)(m->num_key_value_heads / tp) * hd,
                 I = (size_t)(m->intermediate_size / tp), V = (size_t)m->vocab_size,
                 T = (size_t)spec->max_tokens, S = (size_t)spec->max_seqs;
    const bool last = spec->stage == spec->pp_size - 1;
    int vb, ve, chunk;
    tsr_vocab_range(m, spec->tp_rank, tp, &vb, &ve, &chunk);
    const size_t C = (size_t)chunk;

    const size_t pool = (size_t)tsr_kv_pool_elems(m, tp, layers, spec->kv_blocks) * 2;
    put(&p, TSR_CB_KPOOL, "the KV pool", TSR_CB_KV, 1, pool);
    put(&p, TSR_CB_VPOOL, "the KV pool", TSR_CB_KV, 1, pool);
    const size_t rope = (size_t)spec->max_seq_len * (hd / 2) * 4;
    put(&p, TSR_CB_ROPE_COS, "the RoPE tables", TSR_CB_RESERVE, 1, rope);
    put(&p, TSR_CB_ROPE_SIN, "the RoPE tables", TSR_CB_RESERVE, 1, rope);
    /* the residual stream, the projections' sums and the stage boundary's
     * rows in f32; the products' inputs in BF16 */
    put(&p, TSR_CB_X, "activations", TSR_CB_RESERVE, 1, T * H * 4);
    put(&p, TSR_CB_PROJ, "activations", TSR_CB_RESERVE, 1, T * H * 4);
    put(&p, TSR_CB_HIN, "activations", TSR_CB_RESERVE, 1, T * H * 4);
    put(&p, TSR_CB_HOUT, "activations", TSR_CB_RESERVE, 1, T * H * 4);
    put(&p, TSR_CB_QKV, "activations", TSR_CB_RESERVE, 1, T * (qw + 2 * kvw) * 4);
    put(&p, TSR_CB_GU, "activations", TSR_CB_RESERVE, 1, T * 2 * I * 4);
    put(&p, TSR_CB_H, "activations", TSR_CB_RESERVE, 1, T * H * 2);
    put(&p, TSR_CB_ATT, "activations", TSR_CB_RESERVE, 1, T * qw * 2);
    put(&p, TSR_CB_ACT, "activations", TSR_CB_RESERVE, 1, T * I * 2);
    /* the last stage: this rank's logits and the gathered [tp][S][C], each
     * sampled row's weights and ids (unsorted and sorted), its segment,
     * first maximum, pick and sum */
    put(&p, TSR_CB_LOGITS, "logits", TSR_CB_RESERVE, last, S * C * 4);
    put(&p, TSR_CB_GATHERED, "logits", TSR_CB_RESERVE, last, (size_t)tp * S * C * 4);
    put(&p, TSR_CB_W, "sampling scratch", TSR_CB_RESERVE, last, S * V * 4);
    put(&p, TSR_CB_W_SORTED, "sampling scratch", TSR_CB_RESERVE, last, S * V * 4);
    put(&p, TSR_CB_IDS, "sampling scratch", TSR_CB_RESERVE, last, S * V * 4);
    put(&p, TSR_CB_IDS_SORTED, "sampling scratch", TSR_CB_RESERVE, last, S * V * 4);
    put(&p, TSR_CB_SEG_BEGIN, "sampling scratch", TSR_CB_CONTEXT, last, S * 4);
    put(&p, TSR_CB_SEG_END, "sampling scratch", TSR_CB_CONTEXT, last, S * 4);
    put(&p, TSR_CB_BEST, "sampling scratch", TSR_CB_CONTEXT, last, S * 4);
    put(&p, TSR_CB_SAMPLED, "sampling scratch", TSR_CB_CONTEXT, last, S * 4);
    put(&p, TSR_CB_WSUM, "sampling scratch", TSR_CB_CONTEXT, last, S * 8);
    put(&p, TSR_CB_SORT_TMP, "sampling scratch", TSR_CB_RESERVE, last, S * V * 8);

    p.max_tiles = spec->max_seqs + spec->max_tokens / TSR_ATT_TILE + 1;
    p.max_blocks_per_seq = tsr_kv_blocks_for(spec->max_seq_len);
    size_t meta = tsr_cuda_meta_layout(NULL, spec->max_tokens, spec->max_seqs, p.max_tiles,
                                       p.max_blocks_per_seq, NULL, &p.meta_fixed);
    put(&p, TSR_CB_META, "step metadata", TSR_CB_CONTEXT, 1, meta);
    put(&p, TSR_CB_WORKSPACE, "the cuBLAS workspace", TSR_CB_CONTEXT, 1,
        TSR_CUDA_WORKSPACE_BYTES);
    *out = p;
    return 0;
}

uint64_t tsr_cuda_plan_bytes(const tsr_cuda_plan_t *p, int part)
{
    uint64_t sum = 0;
    for (int i = 0; i < TSR_CB_COUNT; i++)
        if (part < 0 || (int)p->buf[i].part == part)
            sum += (uint64_t)p->buf[i].count * p->buf[i].bytes;
    return sum;
}
