/* engine_cpu.c: the Llama forward pass on the CPU, f32 on OpenBLAS.
 *
 * Sharding (Megatron): q, k, v, gate and up are split by output rows, o and
 * down by input columns, so each layer ends its attention and its MLP with
 * one all-reduce.  The embedding and the LM head are split by vocabulary
 * rows; the lookup and the logits are completed with an all-reduce too. */
#include <cblas.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/safetensors.h"
#include "worker/engine.h"

typedef struct {
    float *attn_norm, *mlp_norm;    /* [H] */
    float *wq, *wk, *wv;            /* [Nl*hd, H], [Kl*hd, H], [Kl*hd, H] */
    float *wo;                      /* [H, Nl*hd]: this rank's columns */
    float *wg, *wu;                 /* [Il, H] */
    float *wd;                      /* [H, Il]: this rank's columns */
} layer_t;

struct tsr_engine {
    tsr_model_info_t m;
    tsr_piece_spec_t spec;
    tsr_comm_t *tp;
    const tsr_coll_ops_t *ops;
    int H, hd, Nl, Kl, Il, nl, V;
    int v_begin, v_end;             /* this rank's vocabulary rows */
    float *embed;                   /* [v_end - v_begin, H], stage 0 */
    float *lm_head;                 /* [v_end - v_begin, H], last stage */
    float *final_norm;              /* [H], last stage */
    layer_t *layers;
    float *kcache, *vcache;         /* [max_seqs][nl][max_seq][Kl*hd] */
    float *rope_cos, *rope_sin;     /* [max_seq][hd/2] */
    /* scratch for up to max_seq positions */
    float *x, *h, *q, *k, *v, *att, *proj, *g, *u, *scores, *logits;
    uint64_t wbytes, kvbytes;
};

#define ERR(...) snprintf(err, errlen, __VA_ARGS__)

/* ---- loading --------------------------------------------------------------- */

/* Reads rows [r0,r1) x cols [c0,c1) of tensor `name`, whose full shape must
 * be rows x cols (cols 0: a vector of `rows` elements).  Caller owns *dst. */
static int load_slice(const tsr_st_t *st, tsr_engine_t *e, const char *name, int64_t rows,
                      int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float **dst,
                      char *err, size_t errlen)
{
    int64_t shape[2] = {rows, cols};
    if (tsr_st_expect(st, name, cols ? 2 : 1, shape, err, errlen) < 0) return -1;
    if (!cols) {
        c0 = r0;
        c1 = r1;
        r0 = 0;
        r1 = 1;
    }
    size_t n = (size_t)((r1 - r0) * (c1 - c0));
    float *buf = malloc((n ? n : 1) * sizeof *buf);
    if (!buf) {
        ERR("%s: out of memory for %zu floats", name, n);
        return -1;
    }
    if (n && tsr_st_read_f32(st, tsr_st_find(st, name), r0, r1, c0, c1, buf, err, errlen) < 0) {
        free(buf);
        return -1;
    }
    e->wbytes += n * sizeof *buf;
    *dst = buf;
    return 0;
}

static int load_layer(const tsr_st_t *st, tsr_engine_t *e, int li, layer_t *L, char *err,
                      size_t errlen)
{
    char n[160];
    const int H = e->H, hd = e->hd, r = e->spec.tp_rank;
    const int N = e->m.num_attention_heads, K = e->m.num_key_value_heads;
    const int In = e->m.intermediate_size;
#define P(s) (snprintf(n, sizeof n, "model.layers.%d.%s.weight", li, s), n)
    if (load_slice(st, e, P("input_layernorm"), H, 0, 0, H, 0, 0, &L->attn_norm, err, errlen) ||
        load_slice(st, e, P("post_attention_layernorm"), H, 0, 0, H, 0, 0, &L->mlp_norm, err, errlen) ||
        load_slice(st, e, P("self_attn.q_proj"), (int64_t)N * hd, H, (int64_t)r * e->Nl * hd,
                   (int64_t)(r + 1) * e->Nl * hd, 0, H, &L->wq, err, errlen) ||
        load_slice(st, e, P("self_attn.k_proj"), (int64_t)K * hd, H, (int64_t)r * e->Kl * hd,
                   (int64_t)(r + 1) * e->Kl * hd, 0, H, &L->wk, err, errlen) ||
        load_slice(st, e, P("self_attn.v_proj"), (int64_t)K * hd, H, (int64_t)r * e->Kl * hd,
                   (int64_t)(r + 1) * e->Kl * hd, 0, H, &L->wv, err, errlen) ||
        load_slice(st, e, P("self_attn.o_proj"), H, (int64_t)N * hd, 0, H,
                   (int64_t)r * e->Nl * hd, (int64_t)(r + 1) * e->Nl * hd, &L->wo, err, errlen) ||
        load_slice(st, e, P("mlp.gate_proj"), In, H, (int64_t)r * e->Il, (int64_t)(r + 1) * e->Il,
                   0, H, &L->wg, err, errlen) ||
        load_slice(st, e, P("mlp.up_proj"), In, H, (int64_t)r * e->Il, (int64_t)(r + 1) * e->Il, 0,
                   H, &L->wu, err, errlen) ||
        load_slice(st, e, P("mlp.down_proj"), H, In, 0, H, (int64_t)r * e->Il,
                   (int64_t)(r + 1) * e->Il, &L->wd, err, errlen))
        return -1;
#undef P
    return 0;
}

/* RoPE tables, with transformers' "llama3" rescaling of the frequencies. */
static void rope_tables(tsr_engine_t *e)
{
    const tsr_model_info_t *m = &e->m;
    int half = e->hd / 2;
    for (int i = 0; i < half; i++) {
        double inv = pow((double)m->rope_theta, -2.0 * i / e->hd);
        if (m->rope_llama3) {
            double orig = m->rope_original_max_pos;
            double low_wl = orig / m->rope_low_freq_factor;
            double high_wl = orig / m->rope_high_freq_factor;
            double wl = 2.0 * M_PI / inv;
            if (wl > low_wl) {
                inv /= m->rope_factor;
            } else if (wl >= high_wl) {
                double smooth = (orig / wl - m->rope_low_freq_factor) /
                                (m->rope_high_freq_factor - m->rope_low_freq_factor);
                inv = (1 - smooth) * inv / m->rope_factor + smooth * inv;
            }
        }
        for (int p = 0; p < e->spec.max_seq_len; p++) {
            double a = p * inv;
            e->rope_cos[(size_t)p * half + i] = (float)cos(a);
            e->rope_sin[(size_t)p * half + i] = (float)sin(a);
        }
    }
}

static void engine_free(tsr_engine_t *e)
{
    if (!e) return;
    for (int l = 0; e->layers && l < e->nl; l++) {
        layer_t *L = &e->layers[l];
        free(L->attn_norm), free(L->mlp_norm), free(L->wq), free(L->wk), free(L->wv);
        free(L->wo), free(L->wg), free(L->wu), free(L->wd);
    }
    free(e->layers);
    if (e->lm_head != e->embed) free(e->lm_head);
    free(e->embed), free(e->final_norm), free(e->kcache), free(e->vcache);
    free(e->rope_cos), free(e->rope_sin), free(e->x), free(e->h), free(e->q), free(e->k);
    free(e->v), free(e->att), free(e->proj), free(e->g), free(e->u), free(e->scores);
    free(e->logits);
    free(e);
}

static int check_spec(const tsr_model_info_t *m, const char *dir, const tsr_piece_spec_t *s,
                      char *err, size_t errlen)
{
    if (s->max_seq_len < 1 || s->max_seqs < 1) {
        ERR("a piece needs max_seq_len and sequence slots (got %d and %d)", s->max_seq_len,
            s->max_seqs);
        return -1;
    }
    return tsr_model_check_piece(m, dir, s->tp_rank, s->tp_size, s->stage, s->pp_size,
                                 s->layer_begin, s->layer_end, err, errlen);
}

static float *alloc_f(size_t n, int *bad)
{
    float *p = calloc(n ? n : 1, sizeof(float));
    if (!p) *bad = 1;
    return p;
}

static int cpu_load(const char *dir, const tsr_piece_spec_t *spec, tsr_comm_t *tp,
                    const tsr_coll_ops_t *ops, tsr_engine_t **out, char *err, size_t errlen)
{
    int rc = -1, bad = 0;
    tsr_st_t *st = NULL;
    tsr_engine_t *e = calloc(1, sizeof *e);
    if (!e) return -1;
    e->spec = *spec;
    e->tp = tp;
    e->ops = ops;
    if (tsr_model_info_load(dir, &e->m, err, errlen) < 0 || check_spec(&e->m, dir, spec, err, errlen) < 0)
        goto out;
    const tsr_model_info_t *m = &e->m;
    e->H = m->hidden_size;
    e->hd = m->head_dim;
    e->Nl = m->num_attention_heads / spec->tp_size;
    e->Kl = m->num_key_value_heads / spec->tp_size;
    e->Il = m->intermediate_size / spec->tp_size;
    e->nl = spec->layer_end - spec->layer_begin;
    e->V = m->vocab_size;
    int chunk = (e->V + spec->tp_size - 1) / spec->tp_size;
    e->v_begin = spec->tp_rank * chunk < e->V ? spec->tp_rank * chunk : e->V;
    e->v_end = e->v_begin + chunk < e->V ? e->v_begin + chunk : e->V;
    if (tsr_st_open(dir, &st, err, errlen) < 0) goto out;

    const int H = e->H;
    bool first = spec->stage == 0, last = spec->stage == spec->pp_size - 1;
    if (first && load_slice(st, e, "model.embed_tokens.weight", e->V, H, e->v_begin, e->v_end, 0,
                            H, &e->embed, err, errlen) < 0)
        goto out;
    if (last) {
        const char *head = m->tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
        if (load_slice(st, e, "model.norm.weight", H, 0, 0, H, 0, 0, &e->final_norm, err, errlen) < 0)
            goto out;
        if (m->tie_word_embeddings && first) {
            e->lm_head = e->embed;  /* one copy serves both */
        } else if (load_slice(st, e, head, e->V, H, e->v_begin, e->v_end, 0, H, &e->lm_head, err,
                              errlen) < 0) {
            goto out;
        }
    }
    e->layers = calloc(e->nl ? (size_t)e->nl : 1, sizeof *e->layers);
    if (!e->layers) goto out;
    for (int l = 0; l < e->nl; l++)
        if (load_layer(st, e, spec->layer_begin + l, &e->layers[l], err, errlen) < 0) goto out;

    size_t S = (size_t)spec->max_seq_len, kvw = (size_t)e->Kl * e->hd;
    size_t kv = (size_t)spec->max_seqs * e->nl * S * kvw;
    e->kcache = alloc_f(kv, &bad);
    e->vcache = alloc_f(kv, &bad);
    e->kvbytes = 2 * kv * sizeof(float);
    e->rope_cos = alloc_f(S * e->hd / 2, &bad);
    e->rope_sin = alloc_f(S * e->hd / 2, &bad);
    e->x = alloc_f(S * H, &bad);
    e->h = alloc_f(S * H, &bad);
    e->proj = alloc_f(S * H, &bad);
    e->q = alloc_f(S * e->Nl * e->hd, &bad);
    e->att = alloc_f(S * e->Nl * e->hd, &bad);
    e->k = alloc_f(S * kvw, &bad);
    e->v = alloc_f(S * kvw, &bad);
    e->g = alloc_f(S * e->Il, &bad);
    e->u = alloc_f(S * e->Il, &bad);
    e->scores = alloc_f(S * S, &bad);
    e->logits = alloc_f((size_t)e->V, &bad);
    if (bad) {
        ERR("out of memory for the KV cache and scratch of %zu positions", S);
        goto out;
    }
    rope_tables(e);
    *out = e;
    e = NULL;
    rc = 0;
out:
    tsr_st_close(&st);
    engine_free(e);
    return rc;
}

/* ---- the forward pass ------------------------------------------------------ */

/* y[n, out] = x[n, in] . W[out, in]^T */
static void matmul(float *y, const float *x, const float *w, int n, int in, int out)
{
    if (n == 1) {  /* decode: a matrix-vector product streams W once */
        cblas_sgemv(CblasRowMajor, CblasNoTrans, out, in, 1.0f, w, in, x, 1, 0.0f, y, 1);
        return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, w, in, 0.0f, y,
                out);
}

static void rmsnorm(float *out, const float *x, const float *w, int n, int H, float eps)
{
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * H;
        double ss = 0;
        for (int j = 0; j < H; j++) ss += (double)xi[j] * xi[j];
        float s = (float)(1.0 / sqrt(ss / H + eps));
        for (int j = 0; j < H; j++) out[(size_t)i * H + j] = w[j] * (xi[j] * s);
    }
}

/* Rotate-half RoPE, as transformers applies it to HF-layout q and k: the
 * first and second halves of each head are the pair's two coordinates. */
static void rope(const tsr_engine_t *e, float *x, int n, int heads, int pos)
{
    int hd = e->hd, half = hd / 2;
    for (int i = 0; i < n; i++) {
        const float *c = e->rope_cos + (size_t)(pos + i) * half;
        const float *s = e->rope_sin + (size_t)(pos + i) * half;
        for (int h = 0; h < heads; h++) {
            float *v = x + ((size_t)i * heads + h) * hd;
            for (int j = 0; j < half; j++) {
                float a = v[j], b = v[j + half];
                v[j] = a * c[j] - b * s[j];
                v[j + half] = b * c[j] + a * s[j];
            }
        }
    }
}

static int allreduce(tsr_engine_t *e, float *buf, size_t n, char *err, size_t errlen)
{
    if (e->spec.tp_size == 1) return 0;
    return e->ops->allreduce_sum(e->tp, buf, n, 30000, err, errlen);
}

/* Causal grouped-query attention of positions [pos, pos+n) over the cache. */
static void attention(tsr_engine_t *e, int seq, int l, int pos, int n)
{
    const int hd = e->hd, Nl = e->Nl, Kl = e->Kl, T = pos + n;
    const size_t S = (size_t)e->spec.max_seq_len, kvw = (size_t)Kl * hd;
    const float *kc = e->kcache + ((size_t)seq * e->nl + l) * S * kvw;
    const float *vc = e->vcache + ((size_t)seq * e->nl + l) * S * kvw;
    const float scale = 1.0f / sqrtf((float)hd);
    for (int h = 0; h < Nl; h++) {
        int kh = h / (Nl / Kl);  /* query heads share KV heads in groups */
        /* scores[n, T] = q_h . k_kh^T */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, T, hd, scale, e->q + (size_t)h * hd,
                    Nl * hd, kc + (size_t)kh * hd, (int)kvw, 0.0f, e->scores, T);
        for (int i = 0; i < n; i++) {
            float *row = e->scores + (size_t)i * T;
            int visible = pos + i + 1;
            float mx = row[0];
            for (int j = 1; j < visible; j++) mx = row[j] > mx ? row[j] : mx;
            double sum = 0;
            for (int j = 0; j < visible; j++) {
                row[j] = expf(row[j] - mx);
                sum += row[j];
            }
            for (int j = 0; j < visible; j++) row[j] = (float)(row[j] / sum);
            for (int j = visible; j < T; j++) row[j] = 0.0f;
        }
        /* att_h[n, hd] = scores . v_kh */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, hd, T, 1.0f, e->scores, T,
                    vc + (size_t)kh * hd, (int)kvw, 0.0f, e->att + (size_t)h * hd, Nl * hd);
    }
}

static int layer_forward(tsr_engine_t *e, int seq, int l, int pos, int n, char *err,
                         size_t errlen)
{
    const layer_t *L = &e->layers[l];
    const int H = e->H, hd = e->hd, Nl = e->Nl, Kl = e->Kl, Il = e->Il;
    const size_t S = (size_t)e->spec.max_seq_len, kvw = (size_t)Kl * hd;

    /* attention */
    rmsnorm(e->h, e->x, L->attn_norm, n, H, e->m.rms_norm_eps);
    matmul(e->q, e->h, L->wq, n, H, Nl * hd);
    matmul(e->k, e->h, L->wk, n, H, Kl * hd);
    matmul(e->v, e->h, L->wv, n, H, Kl * hd);
    rope(e, e->q, n, Nl, pos);
    rope(e, e->k, n, Kl, pos);
    float *kc = e->kcache + ((size_t)seq * e->nl + l) * S * kvw;
    float *vc = e->vcache + ((size_t)seq * e->nl + l) * S * kvw;
    memcpy(kc + (size_t)pos * kvw, e->k, (size_t)n * kvw * sizeof(float));
    memcpy(vc + (size_t)pos * kvw, e->v, (size_t)n * kvw * sizeof(float));
    attention(e, seq, l, pos, n);
    matmul(e->proj, e->att, L->wo, n, Nl * hd, H);
    if (allreduce(e, e->proj, (size_t)n * H, err, errlen) < 0) return -1;   /* all-reduce 1 */
    for (size_t i = 0; i < (size_t)n * H; i++) e->x[i] += e->proj[i];

    /* SwiGLU MLP */
    rmsnorm(e->h, e->x, L->mlp_norm, n, H, e->m.rms_norm_eps);
    matmul(e->g, e->h, L->wg, n, H, Il);
    matmul(e->u, e->h, L->wu, n, H, Il);
    for (size_t i = 0; i < (size_t)n * Il; i++) {
        float g = e->g[i];
        e->g[i] = g / (1.0f + expf(-g)) * e->u[i];
    }
    matmul(e->proj, e->g, L->wd, n, Il, H);
    if (allreduce(e, e->proj, (size_t)n * H, err, errlen) < 0) return -1;   /* all-reduce 2 */
    for (size_t i = 0; i < (size_t)n * H; i++) e->x[i] += e->proj[i];
    return 0;
}

static int cpu_forward(tsr_engine_t *e, int seq, int pos, int n, const int32_t *tokens,
                       const float *hidden_in, float *out, char *err, size_t errlen)
{
    const int H = e->H;
    const tsr_piece_spec_t *s = &e->spec;
    if (seq < 0 || seq >= s->max_seqs || pos < 0 || n < 1 || pos + n > s->max_seq_len) {
        ERR("positions [%d,%d) of sequence %d do not fit (max_seq_len %d, %d sequences)", pos,
            pos + n, seq, s->max_seq_len, s->max_seqs);
        return -1;
    }
    if (s->stage == 0) {
        /* Vocabulary-parallel lookup: each rank fills the rows it holds. */
        memset(e->x, 0, (size_t)n * H * sizeof(float));
        for (int i = 0; i < n; i++) {
            if (tokens[i] < 0 || tokens[i] >= e->V) {
                ERR("token id %d at position %d is outside the vocabulary (%d)", tokens[i],
                    pos + i, e->V);
                return -1;
            }
            if (tokens[i] >= e->v_begin && tokens[i] < e->v_end)
                memcpy(e->x + (size_t)i * H, e->embed + (size_t)(tokens[i] - e->v_begin) * H,
                       (size_t)H * sizeof(float));
        }
        if (allreduce(e, e->x, (size_t)n * H, err, errlen) < 0) return -1;
    } else {
        memcpy(e->x, hidden_in, (size_t)n * H * sizeof(float));
    }
    for (int l = 0; l < e->nl; l++)
        if (layer_forward(e, seq, l, pos, n, err, errlen) < 0) return -1;

    if (s->stage < s->pp_size - 1) {                      /* stage boundary */
        memcpy(out, e->x, (size_t)n * H * sizeof(float));
        return 0;
    }
    /* Last stage: logits of the last position, gathered across the vocab. */
    rmsnorm(e->h, e->x + (size_t)(n - 1) * H, e->final_norm, 1, H, e->m.rms_norm_eps);
    memset(out, 0, (size_t)e->V * sizeof(float));
    int vs = e->v_end - e->v_begin;
    if (vs > 0)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, vs, H, 1.0f, e->lm_head, H, e->h, 1, 0.0f,
                    out + e->v_begin, 1);
    return allreduce(e, out, (size_t)e->V, err, errlen);
}

static void cpu_set_comm(tsr_engine_t *e, tsr_comm_t *tp) { e->tp = tp; }
static const tsr_model_info_t *cpu_model(const tsr_engine_t *e) { return &e->m; }
static uint64_t cpu_weight_bytes(const tsr_engine_t *e) { return e->wbytes; }
static uint64_t cpu_kv_bytes(const tsr_engine_t *e) { return e->kvbytes; }
static void cpu_destroy(tsr_engine_t **e_p)
{
    if (!e_p) return;
    engine_free(*e_p);
    *e_p = NULL;
}

const tsr_engine_ops_t tsr_engine_cpu = {
    .name = "cpu",
    .load = cpu_load,
    .forward = cpu_forward,
    .set_comm = cpu_set_comm,
    .model = cpu_model,
    .weight_bytes = cpu_weight_bytes,
    .kv_bytes = cpu_kv_bytes,
    .destroy = cpu_destroy,
};

/* ---- sampling -------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct {
    float p;
    int32_t id;
} cand_t;

static int cand_desc(const void *a, const void *b)
{
    const cand_t *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? 1 : -1;
    return x->id - y->id;
}

int32_t tsr_sample(const float *logits, int vocab, float temperature, float top_p, uint64_t *rng)
{
    int32_t best = 0;
    for (int i = 1; i < vocab; i++)
        if (logits[i] > logits[best]) best = i;
    /* NaN compares false everywhere: treat anything but a positive finite
     * temperature as greedy, anything outside (0, 1] as no nucleus cut. */
    if (!(temperature > 0.0f) || !isfinite(temperature)) return best;

    cand_t *c = malloc((size_t)vocab * sizeof *c);
    if (!c) return best;
    double sum = 0;
    for (int i = 0; i < vocab; i++) {
        c[i].p = expf((logits[i] - logits[best]) / temperature);
        c[i].id = i;
        sum += c[i].p;
    }
    qsort(c, (size_t)vocab, sizeof *c, cand_desc);
    /* Nucleus: the smallest prefix whose mass reaches top_p. */
    if (!(top_p > 0.0f && top_p <= 1.0f)) top_p = 1.0f;
    double keep = c[0].p;
    int k = 1;  /* the most likely token is always kept */
    while (k < vocab && keep < top_p * sum) keep += c[k++].p;
    double r = (double)(splitmix64(rng) >> 11) / (double)(1ull << 53) * keep, acc = 0;
    int32_t pick = c[k - 1].id;
    for (int i = 0; i < k; i++) {
        acc += c[i].p;
        if (r < acc) {
            pick = c[i].id;
            break;
        }
    }
    free(c);
    return pick;
}
