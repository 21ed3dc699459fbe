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
