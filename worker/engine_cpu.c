/* engine_cpu.c: the Llama forward pass on the CPU, f32, batched.
 *
 * Sharding (Megatron): q, k, v, gate and up are split by output rows, o and
 * down by input columns, so each layer ends its attention and its MLP with
 * one all-reduce.  The embedding is split by vocabulary rows and completed
 * with an all-reduce; the LM head too, and its logits are all-gathered.
 * Who holds which slice is common/slice.c's answer.
 *
 * One step runs every token row of a batch together: each weight matrix is
 * read once per step whatever the number of sequences in it.  q, k and v
 * are one fused matrix, gate and up another.  The products run on one pool
 * of threads for the whole step (worker/cpu_pool.h) with a kernel whose
 * every output is one multiply-add chain in a fixed order, so a sequence's
 * numbers do not depend on what it was batched with. */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common/log.h"
#include "common/safetensors.h"
#include "common/slice.h"
#include "common/util.h"
#include "worker/cpu_kernels.h"
#include "worker/cpu_pool.h"
#include "worker/simd.h"
#include "worker/engine.h"
#include "worker/kvpool.h"
#include "worker/kmath.h"
#include "worker/matmul_bf16.h"
#include "worker/matmul_f32.h"

/* Matrices are packed in panels of 16 rows: f32 (worker/matmul_f32.h), or
 * bf16 with matmul_dtype bf16 (worker/matmul_bf16.h); the shapes below are
 * the logical [rows, cols]. */
typedef struct {
    float *attn_norm, *mlp_norm;    /* [H] */
    void *wqkv;                     /* [(q_heads + 2 kv_heads) * head_dim, H]: q, k, v rows */
    void *wo;                       /* [H, q_heads * head_dim]: this rank's columns */
    void *wgu;                      /* [2 * inter, H]: gate rows, then up rows */
    void *wd;                       /* [H, inter]: this rank's columns */
} layer_t;

/* What the KV pools hold (kv_dtype): f32, bf16, or int8 with a scale per
 * row of one head (a scale pool beside each). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2, KV_I8_AVX2 = 3 };
/* KV_I8_AVX2 is KV_I8 for the kernels built for AVX2 (att_task_for), which
 * widen int8 with AVX2's own instruction; the pools hold the same. */
static inline int kv_is_i8(int kt) { return kt >= KV_I8; }

static inline size_t kv_esize(int kt) { return kt == KV_F32 ? 4 : kt == KV_BF16 ? 2 : 1; }

struct tsr_engine {
    tsr_model_info_t m;
    tsr_piece_spec_t spec;
    const tsr_coll_ops_t *ops;
    tsr_comm_t *tp;
    int coll_ms;                /* the deadline of its operations (set_comm) */
    tsr_pool_t *pool;
    int hidden, head_dim, q_heads, kv_heads, inter, n_layers, vocab;
    int v_begin, v_end, v_chunk;    /* this rank's vocabulary rows; every rank's width */
    void *embed;                    /* [v_end - v_begin, H], stage 0, packed too */
    void *lm_head;                  /* [v_end - v_begin, H], last stage, packed */
    float *final_norm;              /* [H], last stage */
    layer_t *layers;
    tsr_kvpool_t *kv;
    void *kpool, *vpool;            /* [n_layers][kv_blocks][kv_heads][TSR_KV_BLOCK][head_dim] */
    float *kscale, *vscale;         /* kv_dtype int8: [n_layers][kv_blocks][kv_heads][TSR_KV_BLOCK],
                                       each row's scale (at its element offset / head_dim) */
    int kv_kind;                    /* what the pools hold: KV_F32, KV_BF16, KV_I8 */
    int mm_bf16;                    /* weights in bf16 panels (matmul_dtype bf16), else f32 */
    uint16_t *xb;                   /* bf16 products: a step's rows of x rounded */
    float *rope_cos, *rope_sin;     /* [max_seq][head_dim / 2] */
    /* scratch for max_tokens rows */
    float *x, *h, *qkv, *att, *proj, *gu, *act, *hin, *hout;
    int32_t *row_slot, *row_pos;
    float *logits, *gathered, *row;  /* [max_seqs][v_chunk], [tp][max_seqs][v_chunk],
                                       [max_seqs][tp * v_chunk] (tp > 1) */
    int last_sampled;               /* rows of logits the last step gathered */
    /* Tests: after this many steps, fail as a GPU does on a sticky error
     * (TSR_TEST_DEVICE_FAULT_AFTER), so the worker's exit path can be
     * exercised on machines without one; 0: never. */
    long fault_after, steps;
    uint64_t *alive;            /* set_alive's count, or NULL */
    int fatal;
    uint64_t wbytes, kvbytes;
};

/* ---- kernels ------------------------------------------------------------------- */

/* Products go through tsr_pool_matmul (worker/matmul_f32.c) or, with bf16
 * weights, tsr_pool_matmul_bf16 (worker/matmul_bf16.c): batch-invariant,
 * on the pool's threads. */
static void matmul(tsr_engine_t *e, float *y, int ldy, const float *x, const void *w, int T,
                   int in, int out)
{
    if (e->mm_bf16) tsr_pool_matmul_bf16(e->pool, y, ldy, x, e->xb, w, T, in, out);
    else tsr_pool_matmul(e->pool, y, ldy, x, w, T, in, out);
    /* A sign of life for the watchdog: a long step on a big model is many
     * of these, a stuck thread none. */
    if (e->alive) __atomic_fetch_add(e->alive, 1, __ATOMIC_RELAXED);
}

/* Row `row` of a packed table (the embedding), widened to f32. */
static void packed_row(const tsr_engine_t *e, const void *w, int in, int row, float *dst)
{
    if (e->mm_bf16) tsr_bf16_packed_row(w, in, row, dst);
    else tsr_packed_row(w, in, row, dst);
}

/* RMSNorm of one row: the sum of squares in double, four lanes side by
 * side and then added in one fixed order (the same for every row, so a
 * row's result does not depend on its neighbours), the scaling in floats. */
static inline __attribute__((always_inline)) void rmsnorm_body(float *out, const float *x,
                                                               const float *w, int H, float eps)
{
    typedef double v4d __attribute__((vector_size(32)));
    typedef float v4f __attribute__((vector_size(16)));
    v4d a = {0}, b = {0};
    int j = 0;
    for (; j + 8 <= H; j += 8) {
        v4f lo, hi;
        memcpy(&lo, x + j, sizeof lo);
        memcpy(&hi, x + j + 4, sizeof hi);
        const v4d dl = __builtin_convertvector(lo, v4d), dh = __builtin_convertvector(hi, v4d);
        a += dl * dl, b += dh * dh;
    }
    a += b;
    double ss = (a[0] + a[2]) + (a[1] + a[3]);
    for (; j < H; j++) ss += (double)x[j] * x[j];
    const float s = tsr_k_rms_scale(ss, H, eps);
    const v8f sv = bcast8(s);
    j = 0;
    for (; j + 8 <= H; j += 8) {
        const v8f r = load8(w + j) * (load8(x + j) * sv);
        memcpy(out + j, &r, sizeof r);
    }
    for (; j < H; j++) out[j] = w[j] * (x[j] * s);
}

__attribute__((target("avx2,fma"))) static void rmsnorm_fma(float *out, const float *x,
                                                           const float *w, int H, float eps)
{
    rmsnorm_body(out, x, w, H, eps);
}

static void rmsnorm_plain(float *out, const float *x, const float *w, int H, float eps)
{
    rmsnorm_body(out, x, w, H, eps);
}

static void rmsnorm_row(float *out, const float *x, const float *w, int H, float eps)
{
    if (tsr_cpu_kernels() != TSR_KERNELS_PLAIN) rmsnorm_fma(out, x, w, H, eps);
    else rmsnorm_plain(out, x, w, H, eps);
}

/* Row-wise work of a step (the residual add and RMSNorm, RoPE and the KV
 * cache writes, SwiGLU) on the pool, ROW_TASK rows a task: done on the
 * calling thread alone it was about a quarter of a 32-sequence decode step
 * of the 58M model (bench/engine_step). */
#define ROW_TASK 4

typedef struct {
    tsr_engine_t *e;
    const float *w;      /* norm weights */
    const float *add;    /* added into x first (the residual), or NULL */
    int T, l;
} rows_job_t;

static void norm_task(void *arg, int i)
{
    const rows_job_t *j = arg;
    tsr_engine_t *e = j->e;
    const int H = e->hidden;
    for (int t = i * ROW_TASK; t < j->T && t < (i + 1) * ROW_TASK; t++) {
        float *x = e->x + (size_t)t * H;
        if (j->add)
            for (int k = 0; k < H; k++) x[k] += j->add[(size_t)t * H + k];
        rmsnorm_row(e->h + (size_t)t * H, x, j->w, H, e->m.rms_norm_eps);
    }
}

/* e->h = RMSNorm(e->x (+= add first, when add is not NULL)) for T rows. */
static void add_norm(tsr_engine_t *e, const float *add, const float *w, int T)
{
    rows_job_t j = {e, w, add, T, 0};
    tsr_pool_for(e->pool, (T + ROW_TASK - 1) / ROW_TASK, norm_task, &j);
}

/* Rotate-half RoPE, as transformers applies it to HF-layout q and k: the
 * first and second halves of each head are the pair's two coordinates. */
static void rope_row(const tsr_engine_t *e, float *v, int heads, int pos)
{
    int hd = e->head_dim, half = hd / 2;
    const float *c = e->rope_cos + (size_t)pos * half, *s = e->rope_sin + (size_t)pos * half;
    for (int h = 0; h < heads; h++, v += hd) {
        int j = 0;
        /* tsr_k_rope_pair 8 pairs at a time, in this file's base target:
         * the same multiplies and adds, none fused, so the same bits */
        for (; j + 8 <= half; j += 8) {
            const v8f x = load8(v + j), y = load8(v + j + half), cv = load8(c + j), sv = load8(s + j);
            const v8f a = x * cv - y * sv, b = y * cv + x * sv;
            memcpy(v + j, &a, sizeof a);
            memcpy(v + j + half, &b, sizeof b);
        }
        for (; j < half; j++) tsr_k_rope_pair(&v[j], &v[j + half], c[j], s[j]);
    }
}

/* ---- loading --------------------------------------------------------------- */

/* Reads norm weights t (layer li), a vector every rank holds whole. */
static int read_vector(const tsr_st_t *st, tsr_engine_t *e, tsr_tensor_kind_t t, int li, float *dst,
                       char *err, size_t errlen)
{
    char name[160];
    tsr_slice_t s;
    if (tsr_slice_named(&e->m, t, li, e->spec.tp_rank, e->spec.tp_size, name, sizeof name, &s,
                        err, errlen) < 0)
        return -1;
    int64_t shape[1] = {s.rows};
    if (tsr_st_expect(st, name, 1, shape, err, errlen) < 0) return -1;
    if (s.r1 > s.r0 &&
        tsr_st_read_f32(st, tsr_st_find(st, name), 0, 1, s.r0, s.r1, dst, err, errlen) < 0)
        return -1;
    e->wbytes += (uint64_t)(s.r1 - s.r0) * sizeof(float);
    return 0;
}

/* Reads this rank's slice of matrix t (layer li) as rows row0 .. of the
 * packed matrix wp[out, in] (worker/matmul_f32.h), a block of rows at a
 * time, so no second copy of a large matrix is ever held.  The slice must
 * have in columns and fit in rows [row0, out). */
static int read_packed(const tsr_st_t *st, tsr_engine_t *e, tsr_tensor_kind_t t, int li, void *wp,
                       int out, int in, int row0, char *err, size_t errlen)
{
    enum { BLOCK_FLOATS = 1 << 18 };   /* 1 MiB of rows per read */
    char name[160];
    tsr_slice_t s;
    if (tsr_slice_named(&e->m, t, li, e->spec.tp_rank, e->spec.tp_size, name, sizeof name, &s,
                        err, errlen) < 0)
        return -1;
    int64_t shape[2] = {s.rows, s.cols};
    if (tsr_st_expect(st, name, 2, shape, err, errlen) < 0) return -1;
    const int64_t cols = s.c1 - s.c0;
    if (cols <= 0 || s.r1 <= s.r0) return 0;
    if (cols != in || row0 < 0 || row0 + (s.r1 - s.r0) > out) {
        tsr_set_err(err, errlen, "%s: a slice of %lld x %lld does not fit rows %d.. of a %d x %d "
                    "matrix (engine bug)", name, (long long)(s.r1 - s.r0), (long long)cols, row0,
                    out, in);
        return -1;
    }
    int64_t step = BLOCK_FLOATS / cols > 0 ? BLOCK_FLOATS / cols : 1;
    float *buf = malloc((size_t)(step * cols) * sizeof(float));
    if (!buf) {
        tsr_set_err(err, errlen, "%s: out of memory for a staging block", name);
        return -1;
    }
    const tsr_tensor_t *tensor = tsr_st_find(st, name);
    int rc = 0;
    for (int64_t r = s.r0; r < s.r1 && rc == 0; r += step) {
        int64_t n = s.r1 - r < step ? s.r1 - r : step;
        rc = tsr_st_read_f32(st, tensor, r, r + n, s.c0, s.c1, buf, err, errlen);
        if (rc == 0 && e->mm_bf16)
            tsr_bf16_pack_rows(wp, out, (int)cols, row0 + (int)(r - s.r0), buf, (int)n);
        else if (rc == 0)
            tsr_pack_rows(wp, out, (int)cols, row0 + (int)(r - s.r0), buf, (int)n);
    }
    free(buf);
    if (rc < 0) return -1;
    e->wbytes += (uint64_t)(s.r1 - s.r0) * cols * (e->mm_bf16 ? 2 : sizeof(float));
    return 0;
}

/* Zeroed, on a 64-byte boundary: the kernels' 32-byte loads then never
 * straddle a cache line (measured: 65 -> 100 GFLOPS for a product of 32
 * rows on this project's build machine). */
static float *alloc_f(size_t n, int *bad)
{
    void *p = NULL;
    size_t bytes = (n ? n : 1) * sizeof(float);
    if (posix_memalign(&p, 64, bytes) != 0) {
        *bad = 1;
        return NULL;
    }
    memset(p, 0, bytes);
    return p;
}

/* Page-aligned and not touched here: the KV pool's pages become resident
 * only as blocks are used (every position is written before attention uses
 * it; the rest of a partial block is read and masked, and reading a page
 * never written maps the zero page). */
static void *alloc_lazy(size_t bytes, int *bad)
{
    void *p = NULL;
    if (posix_memalign(&p, 4096, bytes ? bytes : 1) != 0) {
        *bad = 1;
        return NULL;
    }
    return p;
}

/* Weight matrices: on 2 MiB pages where the kernel offers them, since a
 * decode step streams every matrix and 4 KiB pages cost a TLB miss every
 * 1024 floats.  Only large buffers, so the rounding wastes little; free()
 * releases them. */
static void *alloc_w(size_t bytes, int *bad)
{
    const size_t huge = (size_t)2 << 20;
    if (bytes < huge) return alloc_f((bytes + sizeof(float) - 1) / sizeof(float), bad);
    size_t len = (bytes + huge - 1) & ~(huge - 1);
    void *p = NULL;
    if (posix_memalign(&p, huge, len) != 0) {
        *bad = 1;
        return NULL;
    }
    madvise(p, len, MADV_HUGEPAGE);   /* advice: failing it only costs speed */
    return p;
}

/* A packed matrix of out rows of `in` columns, f32 (worker/matmul_f32.h)
 * or bf16 (worker/matmul_bf16.h), its padding zeroed. */
static void *alloc_packed(const tsr_engine_t *e, int out, int in, int *bad)
{
    if (e->mm_bf16) {
        size_t bytes = tsr_bf16_packed_elems(out, in) * sizeof(uint16_t);
        void *w = alloc_w(bytes, bad);
        if (w) memset(w, 0, bytes);
        return w;
    }
    float *w = alloc_w(tsr_packed_floats(out, in) * sizeof(float), bad);
    if (w) tsr_pack_clear_tail(w, out, in);
    return w;
}

static int load_layer(const tsr_st_t *st, tsr_engine_t *e, int li, layer_t *L, char *err,
                      size_t errlen)
{
    const size_t H = e->hidden, qw = (size_t)e->q_heads * e->head_dim,
                 kvw = (size_t)e->kv_heads * e->head_dim, I = e->inter;
    int bad = 0;
    L->attn_norm = alloc_f(H, &bad);
    L->mlp_norm = alloc_f(H, &bad);
    const int nqkv = (int)(qw + 2 * kvw), h = (int)H;
    L->wqkv = alloc_packed(e, nqkv, h, &bad);
    L->wo = alloc_packed(e, h, (int)qw, &bad);
    L->wgu = alloc_packed(e, 2 * (int)I, h, &bad);
    L->wd = alloc_packed(e, h, (int)I, &bad);
    if (bad) {
        tsr_set_err(err, errlen, "out of memory for the weights of layer %d", li);
        return -1;
    }
    if (read_vector(st, e, TSR_T_ATTN_NORM, li, L->attn_norm, err, errlen) ||
        read_vector(st, e, TSR_T_MLP_NORM, li, L->mlp_norm, err, errlen) ||
        read_packed(st, e, TSR_T_Q, li, L->wqkv, nqkv, h, 0, err, errlen) ||
        read_packed(st, e, TSR_T_K, li, L->wqkv, nqkv, h, (int)qw, err, errlen) ||
        read_packed(st, e, TSR_T_V, li, L->wqkv, nqkv, h, (int)(qw + kvw), err, errlen) ||
        read_packed(st, e, TSR_T_O, li, L->wo, h, (int)qw, 0, err, errlen) ||
        read_packed(st, e, TSR_T_GATE, li, L->wgu, 2 * (int)I, h, 0, err, errlen) ||
        read_packed(st, e, TSR_T_UP, li, L->wgu, 2 * (int)I, h, (int)I, err, errlen) ||
        read_packed(st, e, TSR_T_DOWN, li, L->wd, h, (int)I, 0, err, errlen))
        return -1;
    return 0;
}

/* RoPE tables, with transformers' "llama3" rescaling of the frequencies. */
static void rope_tables(tsr_engine_t *e)
{
    tsr_rope_cfg_t rc = tsr_rope_cfg(&e->m);
    int half = e->head_dim / 2;
    for (int i = 0; i < half; i++) {
        double inv = tsr_k_rope_inv_freq(&rc, i, e->head_dim);
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
    for (int l = 0; e->layers && l < e->n_layers; l++) {
        layer_t *L = &e->layers[l];
        free(L->attn_norm), free(L->mlp_norm), free(L->wqkv), free(L->wo), free(L->wgu);
        free(L->wd);
    }
    free(e->layers);
    if (e->lm_head != e->embed) free(e->lm_head);
    free(e->embed), free(e->final_norm), free(e->kpool), free(e->vpool);
    free(e->kscale), free(e->vscale);
    free(e->rope_cos), free(e->rope_sin), free(e->x), free(e->h), free(e->qkv), free(e->att);
    free(e->proj), free(e->gu), free(e->act), free(e->hin), free(e->hout), free(e->xb);
    free(e->row_slot), free(e->row_pos), free(e->logits), free(e->gathered), free(e->row);
    tsr_kvpool_destroy(&e->kv);
    tsr_pool_destroy(&e->pool);
    free(e);
}

static int check_spec(const tsr_model_info_t *m, const char *dir, const tsr_piece_spec_t *s,
                      char *err, size_t errlen)
{
    if (m->head_dim > 512) {
        tsr_set_err(err, errlen, "%s/config.json: head_dim %d is larger than the 512 this engine supports",
                    dir, m->head_dim);
        return -1;
    }
    if (s->max_seq_len < 1 || s->max_seqs < 1 || s->max_tokens < 1 || s->kv_blocks < 1) {
        tsr_set_err(err, errlen,
                    "a piece needs max_seq_len, sequence slots, step rows and KV blocks "
                    "(got %d, %d, %d and %d)",
                    s->max_seq_len, s->max_seqs, s->max_tokens, s->kv_blocks);
        return -1;
    }
    return tsr_model_check_piece(m, dir, s->tp_rank, s->tp_size, s->stage, s->pp_size,
                                 s->layer_begin, s->layer_end, err, errlen);
}

static int cpu_load(const char *dir, const tsr_piece_spec_t *spec, tsr_engine_t **out, char *err,
                    size_t errlen)
{
    int rc = -1, bad = 0;
    tsr_st_t *st = NULL;
    tsr_engine_t *e = calloc(1, sizeof *e);
    if (!e) return -1;
    e->spec = *spec;
    if (tsr_model_info_load(dir, &e->m, err, errlen) < 0 || check_spec(&e->m, dir, spec, err, errlen) < 0)
        goto out;
    if (tsr_kv_dtype_check(spec->kv_dtype, 1u << TSR_KV_F32 | 1u << TSR_KV_BF16 | 1u << TSR_KV_INT8,
                           "CPU", err, errlen) < 0)
        goto out;
    e->kv_kind = spec->kv_dtype == TSR_KV_BF16   ? KV_BF16
                 : spec->kv_dtype == TSR_KV_INT8 ? KV_I8
                                                 : KV_F32;
    if (tsr_elem_dtype_check("matmul_dtype", spec->matmul_dtype, 1u << TSR_KV_F32 | 1u << TSR_KV_BF16,
                             "CPU", "multiply in", err, errlen) < 0)
        goto out;
    e->mm_bf16 = spec->matmul_dtype == TSR_KV_BF16;
    const tsr_model_info_t *m = &e->m;
    e->hidden = m->hidden_size;
    e->head_dim = m->head_dim;
    e->q_heads = m->num_attention_heads / spec->tp_size;
    e->kv_heads = m->num_key_value_heads / spec->tp_size;
    e->inter = m->intermediate_size / spec->tp_size;
    e->n_layers = spec->layer_end - spec->layer_begin;
    e->vocab = m->vocab_size;
    tsr_vocab_range(m, spec->tp_rank, spec->tp_size, &e->v_begin, &e->v_end, &e->v_chunk);
    if (!(e->pool = tsr_pool_new(spec->threads))) {
        tsr_set_err(err, errlen, "cannot start the engine's threads");
        goto out;
    }
    tsr_info("cpu engine: %d threads, %s kernels%s%s", tsr_pool_threads(e->pool),
             tsr_cpu_kernels_name(tsr_cpu_kernels()), e->mm_bf16 ? ", bf16 products: " : "",
             e->mm_bf16 ? tsr_bf16_products_name() : "");
    if (tsr_st_open(dir, &st, err, errlen) < 0) goto out;

    const size_t H = e->hidden, vrows = (size_t)(e->v_end - e->v_begin);
    bool first = spec->stage == 0, last = spec->stage == spec->pp_size - 1;
    const int vr = (int)vrows, h = (int)H;
    if (first && (!(e->embed = alloc_packed(e, vr, h, &bad)) ||
                  read_packed(st, e, TSR_T_EMBED, 0, e->embed, vr, h, 0, err, errlen) < 0))
        goto oom_or_fail;
    if (last) {
        if (!(e->final_norm = alloc_f(H, &bad)) ||
            read_vector(st, e, TSR_T_FINAL_NORM, 0, e->final_norm, err, errlen) < 0)
            goto oom_or_fail;
        if (m->tie_word_embeddings && first) {
            e->lm_head = e->embed;  /* one copy serves both */
        } else if (!(e->lm_head = alloc_packed(e, vr, h, &bad)) ||
                   read_packed(st, e, TSR_T_LM_HEAD, 0, e->lm_head, vr, h, 0, err, errlen) < 0) {
            goto oom_or_fail;
        }
    }
    /* The piece's last layer is in the checkpoint, or config.json claims layers it lacks
     * (and a billion of them would read as "out of memory"). */
    char last_name[160];
    if (e->n_layers > 0 &&
        !tsr_st_find(st, tsr_tensor_name(m, TSR_T_ATTN_NORM, spec->layer_end - 1, last_name,
                                         sizeof last_name))) {
        tsr_set_err(err, errlen, "%s: no tensor %s: the checkpoint has fewer layers than "
                    "config.json's num_hidden_layers %d", dir, last_name, m->num_hidden_layers);
        goto out;
    }
    e->layers = calloc(e->n_layers ? (size_t)e->n_layers : 1, sizeof *e->layers);
    if (!e->layers) {
        bad = true;
        goto oom_or_fail;
    }
    for (int l = 0; l < e->n_layers; l++)
        if (load_layer(st, e, spec->layer_begin + l, &e->layers[l], err, errlen) < 0) goto out;

    const size_t S = (size_t)spec->max_seq_len, T = (size_t)spec->max_tokens,
                 kvw = (size_t)e->kv_heads * e->head_dim, qw = (size_t)e->q_heads * e->head_dim;
    size_t pool = (size_t)e->n_layers * spec->kv_blocks * TSR_KV_BLOCK * kvw;
    e->kv = tsr_kvpool_new(spec->kv_blocks, spec->max_seqs, spec->max_seq_len);
    if (!e->kv) {   /* its tables grow with max_seq_len: say so */
        tsr_set_err(err, errlen, "out of memory for the KV block tables of %d sequences of "
                    "max_seq_len %d", spec->max_seqs, spec->max_seq_len);
        goto out;
    }
    const size_t esize = kv_esize(e->kv_kind), nscale = e->kv_kind == KV_I8 ? pool / e->head_dim : 0;
    e->kpool = alloc_lazy(pool * esize, &bad);
    e->vpool = alloc_lazy(pool * esize, &bad);
    if (nscale) {
        e->kscale = alloc_lazy(nscale * sizeof(float), &bad);
        e->vscale = alloc_lazy(nscale * sizeof(float), &bad);
    }
    e->kvbytes = 2 * (pool * esize + nscale * sizeof(float));
    int rope_bad = 0;
    e->rope_cos = alloc_f(S * e->head_dim / 2, &rope_bad);
    e->rope_sin = alloc_f(S * e->head_dim / 2, &rope_bad);
    if (rope_bad) {   /* they grow with max_seq_len too */
        tsr_set_err(err, errlen, "out of memory for the RoPE tables of max_seq_len %d (%llu MiB)",
                    spec->max_seq_len, (unsigned long long)((S * e->head_dim * 4) >> 20));
        goto out;
    }
    e->x = alloc_f(T * H, &bad);
    e->h = alloc_f(T * H, &bad);
    e->proj = alloc_f(T * H, &bad);
    /* the stage boundary's rows: left untouched, so the one a stage never
     * uses (both, without a pipeline) never becomes resident */
    e->hin = alloc_lazy(T * H * sizeof(float), &bad);
    e->hout = alloc_lazy(T * H * sizeof(float), &bad);
    e->qkv = alloc_f(T * (qw + 2 * kvw), &bad);
    e->att = alloc_f(T * qw, &bad);
    e->gu = alloc_f(T * 2 * e->inter, &bad);
    e->act = alloc_f(T * e->inter, &bad);
    if (e->mm_bf16) {   /* the widest input of a product: H, q_heads * head_dim or inter */
        size_t w = H > qw ? H : qw;
        w = w > (size_t)e->inter ? w : (size_t)e->inter;
        e->xb = (uint16_t *)alloc_f((T * (size_t)tsr_bf16_in_padded((int)w) + 1) / 2, &bad);
    }
    e->row_slot = calloc(T, sizeof *e->row_slot);
    e->row_pos = calloc(T, sizeof *e->row_pos);
    if (last) {
        size_t B = (size_t)spec->max_seqs;
        /* one rank's logits are the gathered ones: no second copy */
        if (spec->tp_size > 1) e->logits = alloc_f(B * e->v_chunk, &bad);
        e->gathered = alloc_f((size_t)spec->tp_size * B * e->v_chunk, &bad);
        if (spec->tp_size > 1) e->row = alloc_f(B * spec->tp_size * e->v_chunk, &bad);
    }
    if (bad || !e->kv || !e->row_slot || !e->row_pos) {
        tsr_set_err(err, errlen,
                    "out of memory for a KV pool of %d blocks (%llu MiB) and scratch for %d "
                    "token rows",
                    spec->kv_blocks, (unsigned long long)(e->kvbytes >> 20), spec->max_tokens);
        goto out;
    }
    rope_tables(e);
    const char *fault = getenv("TSR_TEST_DEVICE_FAULT_AFTER");
    e->fault_after = fault ? strtol(fault, NULL, 10) : 0;
    *out = e;
    e = NULL;
    rc = 0;
    goto out;
oom_or_fail:
    /* an allocation failed; otherwise a read did, and err says which tensor and why */
    if (bad) tsr_set_err(err, errlen, "out of memory for the weights");
out:
    tsr_st_close(&st);
    engine_free(e);
    return rc;
}

/* ---- the forward pass ------------------------------------------------------ */

/* The TP sum of buf, there when this returns: the host reads it next, so
 * a backend that returns once an operation is queued is settled at once. */
static int allreduce(tsr_engine_t *e, float *buf, size_t n, char *err, size_t errlen)
{
    if (!e->tp) return 0;   /* tp 1 (a group of one under TSR_TEST_NCCL_SOLO sums too) */
    if (e->ops->allreduce_sum(e->tp, tsr_host_buf(buf, n, TSR_DT_F32), e->coll_ms, err, errlen) < 0)
        return -1;
    return tsr_coll_settle(e->ops, e->tp, e->coll_ms, err, errlen);
}

/* A block holds, per KV head, its 16 positions one after another, so the
 * attention of one head reads contiguous memory.  The element offset of
 * position pos of slot, KV head 0 (the next head is TSR_KV_BLOCK * head_dim
 * further on), in either pool. */
static inline size_t kv_off(const tsr_engine_t *e, int l, int slot, int pos)
{
    const size_t kvw = (size_t)e->kv_heads * e->head_dim;
    int32_t block = tsr_kvpool_table(e->kv, slot)[pos / TSR_KV_BLOCK];
    return ((size_t)l * e->spec.kv_blocks + block) * TSR_KV_BLOCK * kvw +
           (size_t)(pos % TSR_KV_BLOCK) * e->head_dim;
}

/* The pools' elements, f32, bf16 (the top half of an f32's bits, so
 * widening puts zeros below it) or int8 (the integer, as a float: the
 * row's scale is applied to its score and to its weight, not to each
 * element).  The kind kt is a constant at every call site: the kernels are
 * compiled once per element type (att_task_for).
 *
 * A bf16 row keeps each full 16 of its head_dim in the order 0-3, 8-11,
 * 4-7, 12-15 (kv_store), because interleaving 16 stored elements with
 * zeros, 128 bits at a time (one vpunpcklwd and one vpunpckhwd), then gives
 * dimensions 0-7 and 8-15 in order: two instructions for 16 elements.  The
 * rest of a row (8, then one at a time) is in order. */
typedef unsigned short v8u16 __attribute__((vector_size(16)));
typedef unsigned short v16u16 __attribute__((vector_size(32)));
typedef unsigned int v8u __attribute__((vector_size(32)));

/* 8 int8 elements as floats: one sign extension and one conversion.  Not
 * always_inline: GCC inlines it into the AVX2 kernels only (a target
 * mismatch elsewhere), and only they call it (KV_I8_AVX2). */
static inline __attribute__((target("avx2"))) v8f i8_load8_avx2(const signed char *p)
{
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Elements [i, i + 16) of a row's full 16 (i a multiple of 16). */
static inline __attribute__((always_inline)) v8f kv_load8(const void *p, size_t i, int kt);

static inline __attribute__((always_inline)) void kv_load16(const void *p, size_t i, int kt,
                                                            v8f *lo, v8f *hi)
{
    if (kt != KV_BF16) {
        *lo = kv_load8(p, i, kt), *hi = kv_load8(p, i + 8, kt);
        return;
    }
    const v16u16 zero = {0}, first = {0, 16, 1, 17, 2, 18, 3, 19, 8, 24, 9, 25, 10, 26, 11, 27},
                 second = {4, 20, 5, 21, 6, 22, 7, 23, 12, 28, 13, 29, 14, 30, 15, 31};
    v16u16 x;
    memcpy(&x, (const uint16_t *)p + i, sizeof x);
    *lo = (v8f)__builtin_shuffle(zero, x, first);
    *hi = (v8f)__builtin_shuffle(zero, x, second);
}

/* Elements [i, i + 8) past a row's full 16s. */
static inline __attribute__((always_inline)) v8f kv_load8(const void *p, size_t i, int kt)
{
    if (kt == KV_F32) return load8((const float *)p + i);
    if (kt == KV_I8_AVX2) return i8_load8_avx2((const signed char *)p + i);
    if (kt == KV_I8) {   /* the portable kernels: one at a time */
        v8f r;
        for (int k = 0; k < 8; k++) r[k] = ((const signed char *)p)[i + (size_t)k];
        return r;
    }
    v8u16 h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

static inline __attribute__((always_inline)) float kv_load1(const void *p, size_t i, int kt)
{
    return kt == KV_BF16 ? tsr_k_bf16_to_f32(((const uint16_t *)p)[i])
           : kv_is_i8(kt) ? (float)((const signed char *)p)[i]
                         : ((const float *)p)[i];
}

/* The first m (<= 8) of 8 elements of a finite row as int8: x / scale
 * rounded to nearest, ties to even (adding and taking away 1.5 * 2^23 does
 * that for |v| < 2^22: nearbyintf without a libm call), clamped to +-127 (a
 * subnormal row's scale is inexact enough to pass it). */
static inline __attribute__((always_inline)) void i8_store8(signed char *d, v8f x, float scale,
                                                            int m)
{
    const v8f magic = bcast8(0x1.8p23f), lo = bcast8(-127.0f), hi = bcast8(127.0f);
    v8f v = (x / bcast8(scale) + magic) - magic;
    const v8i ge = v >= lo, le = v <= hi;
    v = (v8f)((ge & (v8i)v) | (~ge & (v8i)lo));
    v = (v8f)((le & (v8i)v) | (~le & (v8i)hi));
    /* to 8 bytes with two saturating packs (SSE2, so either build): GCC
     * narrowed a vector conversion one element at a time */
    const v8i q = __builtin_convertvector(v, v8i);
    __m128i q0, q1;
    memcpy(&q0, &q, sizeof q0);
    memcpy(&q1, (const char *)&q + sizeof q0, sizeof q1);
    const __m128i b = _mm_packs_epi16(_mm_packs_epi32(q0, q1), _mm_setzero_si128());
    memcpy(d, &b, (size_t)m);
}

/* |x| of 8 elements into the running maximum m; fin keeps the lanes that
 * have seen only finite values (NaN too fails a <= FLT_MAX). */
static inline __attribute__((always_inline)) void i8_absmax8(v8f x, v8f *m, v8i *fin)
{
    const v8f a = (v8f)((v8i)x & ~(v8i)bcast8(-0.0f));
    *fin &= a <= bcast8(FLT_MAX);
    const v8i gt = a > *m;
    *m = (v8f)((gt & (v8i)a) | (~gt & (v8i)*m));
}

/* A row of n elements as int8 at d and its scale at *scale (kv_store):
 * max |x| 8 lanes at a time (the maximum is exact in any order), then
 * i8_store8; the last n % 8 go through both from one zero-padded copy
 * (zeros change neither the maximum nor finiteness).  Built twice, in this
 * file's base target and for AVX2: the same operations, so the same bits;
 * the base build's 8-lane vectors are pairs of 4, and its scalar maximum
 * was 6 % of a 32-sequence serving step. */
static inline __attribute__((always_inline)) void i8_row_body(signed char *d, float *scale,
                                                              const float *x, int n)
{
    const int full = n & ~7;
    float pad[8] = {0};
    memcpy(pad, x + full, (size_t)(n - full) * sizeof(float));
    v8f m = bcast8(0.0f);
    v8i fin = ~(v8i){0};
    for (int i = 0; i < full; i += 8) i8_absmax8(load8(x + i), &m, &fin);
    if (full < n) i8_absmax8(load8(pad), &m, &fin);
    float amax = 0;
    int finite = 1;
    for (int k = 0; k < 8; k++) {
        amax = m[k] > amax ? m[k] : amax;
        finite &= fin[k] != 0;
    }
    if (!finite || amax == 0) {   /* NaN or inf: the row reads back as NaN, as the reference's */
        memset(d, 0, (size_t)n);
        *scale = finite ? 0 : NAN;
        return;
    }
    const float sc = amax / 127.0f;
    for (int i = 0; i < full; i += 8) i8_store8(d + i, load8(x + i), sc, 8);
    if (full < n) i8_store8(d + full, load8(pad), sc, n - full);
    *scale = sc;
}

static void i8_row_plain(signed char *d, float *scale, const float *x, int n)
{
    i8_row_body(d, scale, x, n);
}

__attribute__((target("avx2"))) static void i8_row_avx2(signed char *d, float *scale,
                                                        const float *x, int n)
{
    i8_row_body(d, scale, x, n);
}

/* A row of n elements (one head's) into the pool at element offset off;
 * in bf16 when the pool is (the CUDA engine's rounding), its full 16s in
 * kv_load16's order; in int8 as round-half-even(x / scale) with scale =
 * max |x| / 127 (in f32, tests/reference/llama_ref.py's round_int8),
 * stored at scales[off / n]; a row with a NaN or an infinity as zeros with
 * a NaN scale. */
static inline void kv_store(const tsr_engine_t *e, void *pool, float *scales, size_t off,
                            const float *x, int n)
{
    if (e->kv_kind == KV_F32) {
        memcpy((float *)pool + off, x, (size_t)n * sizeof(float));
        return;
    }
    if (e->kv_kind == KV_I8) {
        (tsr_cpu_kernels() != TSR_KERNELS_PLAIN ? i8_row_avx2 : i8_row_plain)(
            (signed char *)pool + off, &scales[off / (size_t)n], x, n);
        return;
    }
    uint16_t *d = (uint16_t *)pool + off, r[n];
    tsr_bf16_round_row(r, x, n);
    int i = 0;
    for (; i + 16 <= n; i += 16) {                /* quarters 0, 2, 1, 3 */
        memcpy(d + i, r + i, 8);
        memcpy(d + i + 4, r + i + 8, 8);
        memcpy(d + i + 8, r + i + 4, 8);
        memcpy(d + i + 12, r + i + 12, 8);
    }
    memcpy(d + i, r + i, (size_t)(n - i) * sizeof *d);
}

/* Bytes from an element offset. */
static inline const void *kv_ptr(const void *pool, size_t off, int kt)
{
    return (const char *)pool + off * kv_esize(kt);
}

/* Attention work is cut into (entry, query head, 16 rows) tasks, so a long
 * prompt chunk spreads over the threads like the decodes around it. */
#define ATT_ROWS 16

typedef struct {
    tsr_engine_t *e;
    const tsr_batch_t *b;
    const int *first_row;       /* per entry: its first row */
    const int *first_task;      /* per entry: its first task; [n_entries] = the total */
    int l;
} att_job_t;

/* Scores of q against the 4 keys at k (rows of hd floats), over the
 * first hd & ~7 dimensions, half-reduced: lanes 0-3 hold each key's sum of
 * its vector lanes 0-3, lanes 4-7 that of lanes 4-7 (att_scores finishes
 * them).  The four multiply-add chains run side by side. */
static inline __attribute__((always_inline)) v8f dot4_part(const float *q, const void *k,
                                                           size_t hd, int kt)
{
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    size_t d = 0;
    for (; d + 16 <= hd; d += 16) {
        const v8f x = load8(q + d), y = load8(q + d + 8);
        v8f l0, h0, l1, h1, l2, h2, l3, h3;
        kv_load16(k, d, kt, &l0, &h0), kv_load16(k, hd + d, kt, &l1, &h1);
        kv_load16(k, 2 * hd + d, kt, &l2, &h2), kv_load16(k, 3 * hd + d, kt, &l3, &h3);
        a0 += x * l0, a1 += x * l1, a2 += x * l2, a3 += x * l3;
        a0 += y * h0, a1 += y * h1, a2 += y * h2, a3 += y * h3;
    }
    if (d + 8 <= hd) {
        const v8f x = load8(q + d);
        a0 += x * kv_load8(k, d, kt), a1 += x * kv_load8(k, hd + d, kt);
        a2 += x * kv_load8(k, 2 * hd + d, kt), a3 += x * kv_load8(k, 3 * hd + d, kt);
    }
    return hadd8(hadd8(a0, a1), hadd8(a2, a3));
}

/* dot4_part for two query rows at once, each key line loaded once for
 * both; every sum is formed exactly as dot4_part forms it. */
static inline __attribute__((always_inline)) void dot4x2_part(const float *q0, const float *q1,
                                                              const void *k, size_t hd, int kt,
                                                              v8f *out0, v8f *out1)
{
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    size_t d = 0;
    /* a key at a time (14 vector registers), each accumulator in the same
     * order as dot4_part's: the 8 dimensions of d, then those of d + 8 */
#define KEY16(j, aj, bj)                                                                          \
    do {                                                                                          \
        v8f l, h;                                                                                 \
        kv_load16(k, (j) * hd + d, kt, &l, &h);                                                 \
        aj += x * l, bj += y * l;                                                                 \
        aj += x2 * h, bj += y2 * h;                                                               \
    } while (0)
    for (; d + 16 <= hd; d += 16) {
        const v8f x = load8(q0 + d), x2 = load8(q0 + d + 8), y = load8(q1 + d),
                  y2 = load8(q1 + d + 8);
        KEY16(0, a0, b0);
        KEY16(1, a1, b1);
        KEY16(2, a2, b2);
        KEY16(3, a3, b3);
    }
#undef KEY16
    if (d + 8 <= hd) {
        const v8f x = load8(q0 + d), y = load8(q1 + d);
        const v8f l0 = kv_load8(k, d, kt), l1 = kv_load8(k, hd + d, kt),
                  l2 = kv_load8(k, 2 * hd + d, kt), l3 = kv_load8(k, 3 * hd + d, kt);
        a0 += x * l0, a1 += x * l1, a2 += x * l2, a3 += x * l3;
        b0 += y * l0, b1 += y * l1, b2 += y * l2, b3 += y * l3;
    }
    *out0 = hadd8(hadd8(a0, a1), hadd8(a2, a3));
    *out1 = hadd8(hadd8(b0, b1), hadd8(b2, b3));
}

/* The 8 scores of two dot4_part results (keys 0-3, keys 4-7), each
 * ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) over its vector lanes,
 * then the dimensions past hd & ~7 added one by one.  The same for every
 * row whatever its neighbours, so rows taken in pairs and alone agree. */
static inline __attribute__((always_inline)) v8f att_scores(v8f lo, v8f hi, const float *q,
                                                            const void *k, int hd, int kt)
{
    const v8i first = {0, 1, 2, 3, 8, 9, 10, 11}, second = {4, 5, 6, 7, 12, 13, 14, 15};
    v8f s = __builtin_shuffle(lo, hi, first) + __builtin_shuffle(lo, hi, second);
    for (int d = hd & ~7; d < hd; d++)
        for (int p = 0; p < 8; p++) s[p] = fmaf(q[d], kv_load1(k, (size_t)p * hd + d, kt), s[p]);
    return s;
}

/* One row's running attention for one head: the softmax state and the
 * accumulator (hd floats, in v8f; the last hd % 8 in tail). */
typedef struct {
    tsr_osm_t st;
    float tail[8];
} att_row_t;

/* A block's scores s[0..1] (positions 0-7, 8-15; those from np on are
 * not the sequence's and count for nothing) turned into weights
 * exp(score - max) in sc, merged into the row's running softmax
 * (worker/kmath.h's tsr_k_osm_merge); the accumulator then becomes
 * ca * acc + cb * (sum of weight * value).  All in vectors: the scalar
 * exponentials were most of attention's time at decode. */
static inline __attribute__((always_inline)) void att_weights(const v8f *s, int np, float scale,
                                                              float *sc, att_row_t *r, float *ca,
                                                              float *cb)
{
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const v8i in0 = lane < np, in1 = lane + 8 < np;
    const v8f ninf = bcast8(-INFINITY);
    v8f s0 = s[0] * bcast8(scale), s1 = s[1] * bcast8(scale);
    s0 = (v8f)((in0 & (v8i)s0) | (~in0 & (v8i)ninf));
    s1 = (v8f)((in1 & (v8i)s1) | (~in1 & (v8i)ninf));
    v8i gt = s1 > s0;
    v8f mx = (v8f)((gt & (v8i)s1) | (~gt & (v8i)s0));
    float m = mx[0];
    for (int k = 1; k < 8; k++) m = mx[k] > m ? mx[k] : m;
    const v8f w0 = (v8f)(in0 & (v8i)exp8(s0 - bcast8(m))),
              w1 = (v8f)(in1 & (v8i)exp8(s1 - bcast8(m)));
    memcpy(sc, &w0, sizeof w0);
    memcpy(sc + 8, &w1, sizeof w1);
    tsr_osm_t bs = {m, hsum8(w0 + w1)};
    tsr_k_osm_merge(&r->st, bs, ca, cb);
}

/* The values of a block weighted by sc into a row, columns [d, hd): 32 at
 * a time in registers, then 8, then one. */
static inline __attribute__((always_inline)) void att_values(const float *sc, const void *vb,
                                                             int kt, int np, int hd, int d,
                                                             float ca, float cb, att_row_t *r,
                                                             v8f *acc)
{
    const int hd8 = hd & ~7, hd16 = hd & ~15;
    const v8f cav = bcast8(ca), cbv = bcast8(cb);
    for (; d + 32 <= hd16; d += 32) {
        v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        for (int p = 0; p < np; p++) {
            const size_t v = (size_t)p * hd + d;
            const v8f wv = bcast8(sc[p]);
            v8f l0, h0, l1, h1;
            kv_load16(vb, v, kt, &l0, &h0), kv_load16(vb, v + 16, kt, &l1, &h1);
            s0 += wv * l0, s1 += wv * h0, s2 += wv * l1, s3 += wv * h1;
        }
        acc[d / 8] = acc[d / 8] * cav + s0 * cbv;
        acc[d / 8 + 1] = acc[d / 8 + 1] * cav + s1 * cbv;
        acc[d / 8 + 2] = acc[d / 8 + 2] * cav + s2 * cbv;
        acc[d / 8 + 3] = acc[d / 8 + 3] * cav + s3 * cbv;
    }
    for (; d + 16 <= hd16; d += 16) {
        v8f s0 = {0}, s1 = {0};
        for (int p = 0; p < np; p++) {
            const v8f wv = bcast8(sc[p]);
            v8f l, h;
            kv_load16(vb, (size_t)p * hd + d, kt, &l, &h);
            s0 += wv * l, s1 += wv * h;
        }
        acc[d / 8] = acc[d / 8] * cav + s0 * cbv;
        acc[d / 8 + 1] = acc[d / 8 + 1] * cav + s1 * cbv;
    }
    if (d + 8 <= hd8) {
        v8f s0 = {0};
        for (int p = 0; p < np; p++) s0 += bcast8(sc[p]) * kv_load8(vb, (size_t)p * hd + d, kt);
        acc[d / 8] = acc[d / 8] * cav + s0 * cbv;
        d += 8;
    }
    for (; d < hd; d++) {
        float s0 = 0;
        for (int p = 0; p < np; p++) s0 = fmaf(sc[p], kv_load1(vb, (size_t)p * hd + d, kt), s0);
        r->tail[d - hd8] = fmaf(s0, cb, r->tail[d - hd8] * ca);
    }
}

/* An int8 block's row scales: the keys' onto the 8 scores s (keys 8g to
 * 8g + 7), and the values' onto the softmax weights sc (16), into wv: the
 * weights att_values takes.  Nothing for the other kinds (wv is sc). */
static inline __attribute__((always_inline)) v8f key_scale(v8f s, const float *ks, int g, int kt)
{
    return kv_is_i8(kt) ? s * load8(ks + 8 * g) : s;
}

static inline __attribute__((always_inline)) const float *value_weights(const float *sc,
                                                                       const float *vs, int kt,
                                                                       float *wv)
{
    if (!kv_is_i8(kt)) return sc;
    const v8f w0 = load8(sc) * load8(vs), w1 = load8(sc + 8) * load8(vs + 8);
    memcpy(wv, &w0, sizeof w0);
    memcpy(wv + 8, &w1, sizeof w1);
    return wv;
}

/* Takes np cached positions (keys kb, values vb: np rows of hd, in a block
 * of TSR_KV_BLOCK; for int8 their row scales ks, vs) into a row's state:
 * the block's scores (all 16 keys are read, those from np on are masked),
 * att_weights, att_values. */
static inline __attribute__((always_inline)) void att_block(const float *q, const void *kb,
                                                            const void *vb, const float *ks,
                                                            const float *vs, int kt, int np,
                                                            int hd, float scale, att_row_t *r,
                                                            v8f *acc)
{
    _Static_assert(TSR_KV_BLOCK == 16, "att_block scores blocks of 16 positions");
    float sc[TSR_KV_BLOCK], wv[TSR_KV_BLOCK], ca, cb;
    const size_t h = (size_t)hd;
    v8f s[2];
    for (int g = 0; g < 2; g++) {
        const void *k0 = kv_ptr(kb, 8 * g * h, kt), *k4 = kv_ptr(kb, (8 * g + 4) * h, kt);
        s[g] = key_scale(
            att_scores(dot4_part(q, k0, h, kt), dot4_part(q, k4, h, kt), q, k0, hd, kt), ks, g,
            kt);
    }
    att_weights(s, np, scale, sc, r, &ca, &cb);
    att_values(value_weights(sc, vs, kt, wv), vb, kt, np, hd, 0, ca, cb, r, acc);
}

/* att_block of a whole block for two rows of a prompt, with bits equal to
 * two att_block calls: each key and value line is loaded once for both
 * rows, which halves what a long prompt's attention reads from the cache
 * hierarchy (it reads every earlier position once per row). */
static inline __attribute__((always_inline)) void att_block2(const float *q0, const float *q1,
                                                             const void *kb, const void *vb,
                                                             const float *ks, const float *vs,
                                                             int kt, int hd, float scale,
                                                             att_row_t *r0, v8f *acc0,
                                                             att_row_t *r1, v8f *acc1)
{
    enum { NP = TSR_KV_BLOCK };
    float sc0[NP], sc1[NP], wv0[NP], wv1[NP], ca0, cb0, ca1, cb1;
    const size_t h = (size_t)hd;
    v8f s0[2], s1[2];
    for (int g = 0; g < 2; g++) {
        v8f lo0, lo1, hi0, hi1;
        const void *k0 = kv_ptr(kb, 8 * g * h, kt), *k4 = kv_ptr(kb, (8 * g + 4) * h, kt);
        dot4x2_part(q0, q1, k0, h, kt, &lo0, &lo1);
        dot4x2_part(q0, q1, k4, h, kt, &hi0, &hi1);
        s0[g] = key_scale(att_scores(lo0, hi0, q0, k0, hd, kt), ks, g, kt);
        s1[g] = key_scale(att_scores(lo1, hi1, q1, k0, hd, kt), ks, g, kt);
    }
    att_weights(s0, NP, scale, sc0, r0, &ca0, &cb0);
    att_weights(s1, NP, scale, sc1, r1, &ca1, &cb1);
    const float *w0p = value_weights(sc0, vs, kt, wv0), *w1p = value_weights(sc1, vs, kt, wv1);
    const int hd8 = hd & ~7;
    const v8f ca0v = bcast8(ca0), cb0v = bcast8(cb0), ca1v = bcast8(ca1), cb1v = bcast8(cb1);
    int d = 0;
    for (; d + 16 <= hd8; d += 16) {
        v8f s0 = {0}, s1 = {0}, t0 = {0}, t1 = {0};
        for (int p = 0; p < NP; p++) {
            const v8f w0 = bcast8(w0p[p]), w1 = bcast8(w1p[p]);
            v8f v0, v1;
            kv_load16(vb, (size_t)p * hd + d, kt, &v0, &v1);
            s0 += w0 * v0, s1 += w0 * v1, t0 += w1 * v0, t1 += w1 * v1;
        }
        acc0[d / 8] = acc0[d / 8] * ca0v + s0 * cb0v;
        acc0[d / 8 + 1] = acc0[d / 8 + 1] * ca0v + s1 * cb0v;
        acc1[d / 8] = acc1[d / 8] * ca1v + t0 * cb1v;
        acc1[d / 8 + 1] = acc1[d / 8 + 1] * ca1v + t1 * cb1v;
    }
    att_values(w0p, vb, kt, NP, hd, d, ca0, cb0, r0, acc0);
    att_values(w1p, vb, kt, NP, hd, d, ca1, cb1, r1, acc1);
}

static inline void att_row_init(att_row_t *r, v8f *acc, int hd)
{
    r->st = tsr_k_osm_init();
    memset(r->tail, 0, sizeof r->tail);
    memset(acc, 0, (size_t)(hd / 8) * sizeof *acc);
}

static inline void att_row_out(const att_row_t *r, const v8f *acc, int hd, float *out)
{
    const int hd8 = hd & ~7;
    for (int d = 0; d < hd8; d += 8)
        for (int k = 0; k < 8; k++) out[d + k] = acc[d / 8][k] / r->st.l;
    for (int d = hd8; d < hd; d++) out[d] = r->tail[d - hd8] / r->st.l;
}

/* Asks for a block's keys and values of one head: two 4 KiB runs
 * elsewhere in the pool, where the hardware's stream prefetch does not
 * follow (a block table, page-sized runs), so asked for while the block
 * before computes they are there when it is done.  Into L2 (locality 1,
 * prefetcht2, which AMD's cores fill into L2): 32 sequences
 * at context 400 took 38-42 ms a step against 40-62 ms with the lines
 * asked into L1 (bench/engine_step, alternating runs, 2-core EPYC VM). */
static inline __attribute__((always_inline)) void kv_prefetch(const tsr_engine_t *e, int l,
                                                               int slot, int pos, size_t run,
                                                               int kt)
{
    const size_t off = kv_off(e, l, slot, pos) + run;
    const char *kn = kv_ptr(e->kpool, off, kt), *vn = kv_ptr(e->vpool, off, kt);
    for (size_t i = 0; i < (size_t)TSR_KV_BLOCK * e->head_dim * kv_esize(kt); i += 64)
        __builtin_prefetch(kn + i, 0, 1), __builtin_prefetch(vn + i, 0, 1);
    if (kv_is_i8(kt))   /* the block's 16 scales: one line each */
        __builtin_prefetch(e->kscale + off / e->head_dim, 0, 1),
            __builtin_prefetch(e->vscale + off / e->head_dim, 0, 1);
}

/* Causal grouped-query attention of some rows of one entry for one query
 * head, over its sequence's cached positions block by block.  Rows go in
 * pairs through the blocks both see whole (att_block2), then one by one
 * through the rest (att_block), in block order either way, so a row's
 * result depends on that row alone, bit for bit, whatever its neighbours
 * (test_engine_cpu).  Compiled twice, for AVX2 with FMA and for any x86-64
 * (att_task_for picks), as the products are. */
static inline __attribute__((always_inline)) void att_task_body(void *arg, int t, int kt)
{
    const att_job_t *j = arg;
    tsr_engine_t *e = j->e;
    int ei = 0;
    while (j->first_task[ei + 1] <= t) ei++;
    const int qh = e->q_heads, kvh = e->kv_heads, hd = e->head_dim, group = qh / kvh, B = TSR_KV_BLOCK;
    const tsr_entry_t *en = &j->b->entries[ei];
    const float scale = 1.0f / sqrtf((float)hd);
    const int local = t - j->first_task[ei], h = local % qh, r0 = local / qh * ATT_ROWS;
    const size_t qkvw = (size_t)(qh + 2 * kvh) * hd, run = (size_t)(h / group) * B * hd;  /* kv_off */
    const int r1 = en->n < r0 + ATT_ROWS ? en->n : r0 + ATT_ROWS;
    v8f acc[2][64];
    att_row_t rs[2];
    /* an int8 block's key and value scales (tsr_engine_t.kscale) */
#define KV_SCALES(off)                                                                            \
    kv_is_i8(kt) ? e->kscale + (off) / (size_t)hd : NULL,                                         \
        kv_is_i8(kt) ? e->vscale + (off) / (size_t)hd : NULL
    for (int r = r0; r < r1;) {
        const int pair = r + 1 < r1, visible = en->pos + r + 1;   /* row r + 1 sees one more */
        const float *q[2];
        for (int k = 0; k <= pair; k++) {
            q[k] = e->qkv + ((size_t)j->first_row[ei] + r + k) * qkvw + (size_t)h * hd;
            att_row_init(&rs[k], acc[k], hd);
        }
        int b0 = 0;
        if (pair)
            for (; b0 + B <= visible; b0 += B) {
                kv_prefetch(e, j->l, en->slot, b0 + B, run, kt);   /* row r + 1 sees b0 + B */
                const size_t off = kv_off(e, j->l, en->slot, b0) + run;
                att_block2(q[0], q[1], kv_ptr(e->kpool, off, kt), kv_ptr(e->vpool, off, kt),
                           KV_SCALES(off), kt, hd, scale, &rs[0], acc[0], &rs[1], acc[1]);
            }
        for (int k = 0; k <= pair; k++) {
            const int vis = visible + k;
            /* two blocks ahead: 32 sequences at context 400 with bf16 KV and
             * bf16 products took 16.3-16.6 ms a step against 16.7-16.9 ms
             * one block ahead (three alternating runs, 2-core Xeon VM; on
             * the EPYC VM two or three ahead were within noise) */
            if (b0 + B < vis) kv_prefetch(e, j->l, en->slot, b0 + B, run, kt);
            for (int c0 = b0; c0 < vis; c0 += B) {
                if (c0 + 2 * B < vis) kv_prefetch(e, j->l, en->slot, c0 + 2 * B, run, kt);
                const size_t off = kv_off(e, j->l, en->slot, c0) + run;
                att_block(q[k], kv_ptr(e->kpool, off, kt), kv_ptr(e->vpool, off, kt),
                          KV_SCALES(off), kt, vis - c0 < B ? vis - c0 : B, hd, scale, &rs[k],
                          acc[k]);
            }
            att_row_out(&rs[k], acc[k], hd,
                        e->att + ((size_t)j->first_row[ei] + r + k) * qh * hd + (size_t)h * hd);
        }
        r += 1 + pair;
    }
#undef KV_SCALES
}

#define ATT_TASK(name, target, kt)                                                               \
    target static void name(void *arg, int t) { att_task_body(arg, t, kt); }
ATT_TASK(att_task_fma, __attribute__((target("avx2,fma"))), KV_F32)
ATT_TASK(att_task_fma_bf16, __attribute__((target("avx2,fma"))), KV_BF16)
ATT_TASK(att_task_fma_i8, __attribute__((target("avx2,fma"))), KV_I8_AVX2)
ATT_TASK(att_task_plain, , KV_F32)
ATT_TASK(att_task_plain_bf16, , KV_BF16)
ATT_TASK(att_task_plain_i8, , KV_I8)
#undef ATT_TASK

/* The attention kernel this CPU runs for a pool of kind kt: one choice for
 * the process, so every step of every sequence computes the same way. */
static void (*att_task_for(int kt))(void *, int)
{
    static void (*const fma[])(void *, int) = {att_task_fma, att_task_fma_bf16, att_task_fma_i8};
    static void (*const plain[])(void *, int) = {att_task_plain, att_task_plain_bf16,
                                                 att_task_plain_i8};
    return tsr_cpu_kernels() != TSR_KERNELS_PLAIN ? fma[kt] : plain[kt];
}

/* SwiGLU of n elements: gate * sigmoid(gate) * up, the sigmoid from
 * z = exp(-|gate|) (exp8 takes x <= 0): 1 / (1 + z) for gate >= 0, z / (1 +
 * z) below.  In vectors, as the scalar expf per element was most of the
 * MLP's time outside the products; the last n % 8 through the same vector
 * code, from a padded copy, so every element is computed alike. */
static inline __attribute__((always_inline)) v8f swiglu8(v8f g, v8f u)
{
    const v8i neg = g < bcast8(0.0f);
    const v8f a = (v8f)((v8i)g & ~(v8i)bcast8(-0.0f));          /* |g| */
    const v8f z = exp8(-a), one = bcast8(1.0f);
    const v8f num = (v8f)((neg & (v8i)z) | (~neg & (v8i)one));
    return g * (num / (one + z)) * u;
}

static inline __attribute__((always_inline)) void swiglu_body(float *a, const float *g,
                                                              const float *u, int n)
{
    int k = 0;
    for (; k + 8 <= n; k += 8) {
        const v8f r = swiglu8(load8(g + k), load8(u + k));
        memcpy(a + k, &r, sizeof r);
    }
    if (k < n) {
        float gp[8] = {0}, up[8] = {0}, r[8];
        memcpy(gp, g + k, (size_t)(n - k) * sizeof(float));
        memcpy(up, u + k, (size_t)(n - k) * sizeof(float));
        const v8f v = swiglu8(load8(gp), load8(up));
        memcpy(r, &v, sizeof v);
        memcpy(a + k, r, (size_t)(n - k) * sizeof(float));
    }
}

__attribute__((target("avx2,fma"))) static void swiglu_fma(float *a, const float *g,
                                                          const float *u, int n)
{
    swiglu_body(a, g, u, n);
}

static void swiglu_plain(float *a, const float *g, const float *u, int n)
{
    swiglu_body(a, g, u, n);
}

static void swiglu_task(void *arg, int i)
{
    const rows_job_t *j = arg;
    const int I = j->e->inter, fma = tsr_cpu_kernels() != TSR_KERNELS_PLAIN;
    for (int t = i * ROW_TASK; t < j->T && t < (i + 1) * ROW_TASK; t++) {
        const float *g = j->e->gu + (size_t)t * 2 * I, *u = g + I;
        float *a = j->e->act + (size_t)t * I;
        if (fma) swiglu_fma(a, g, u, I);
        else swiglu_plain(a, g, u, I);
    }
}

/* RoPE on a row's q and k, then its k and v into the cache. */
static void rope_kv_task(void *arg, int i)
{
    const rows_job_t *j = arg;
    tsr_engine_t *e = j->e;
    const int hd = e->head_dim, qh = e->q_heads, kvh = e->kv_heads;
    const size_t qw = (size_t)qh * hd, kvw = (size_t)kvh * hd, qkvw = qw + 2 * kvw;
    for (int t = i * ROW_TASK; t < j->T && t < (i + 1) * ROW_TASK; t++) {
        float *q = e->qkv + (size_t)t * qkvw, *k = q + qw, *v = k + kvw;
        rope_row(e, q, qh, e->row_pos[t]);
        rope_row(e, k, kvh, e->row_pos[t]);
        const size_t off = kv_off(e, j->l, e->row_slot[t], e->row_pos[t]);
        for (int h = 0; h < kvh; h++) {
            const size_t o = off + (size_t)h * TSR_KV_BLOCK * hd;
            kv_store(e, e->kpool, e->kscale, o, k + (size_t)h * hd, hd);
            kv_store(e, e->vpool, e->vscale, o, v + (size_t)h * hd, hd);
        }
    }
}

static int layer_forward(tsr_engine_t *e, const tsr_batch_t *b, const int *first_row, int l,
                         char *err, size_t errlen)
{
    const layer_t *L = &e->layers[l];
    const int H = e->hidden, hd = e->head_dim, qh = e->q_heads, kvh = e->kv_heads,
              I = e->inter, T = b->n_tokens;
    const size_t qw = (size_t)qh * hd, kvw = (size_t)kvh * hd, qkvw = qw + 2 * kvw;

    /* attention */
    add_norm(e, NULL, L->attn_norm, T);
    matmul(e, e->qkv, (int)qkvw, e->h, L->wqkv, T, H, (int)qkvw);
    tsr_pool_for(e->pool, (T + ROW_TASK - 1) / ROW_TASK, rope_kv_task,
                 &(rows_job_t){e, NULL, NULL, T, l});
    int first_task[b->n_entries + 1];
    first_task[0] = 0;
    for (int i = 0; i < b->n_entries; i++)
        first_task[i + 1] = first_task[i] + qh * ((b->entries[i].n + ATT_ROWS - 1) / ATT_ROWS);
    att_job_t aj = {e, b, first_row, first_task, l};
    tsr_pool_for(e->pool, first_task[b->n_entries], att_task_for(e->kv_kind), &aj);
    matmul(e, e->proj, H, e->att, L->wo, T, (int)qw, H);
    if (allreduce(e, e->proj, (size_t)T * H, err, errlen) < 0) return -1;   /* all-reduce 1 */

    /* SwiGLU MLP */
    add_norm(e, e->proj, L->mlp_norm, T);
    matmul(e, e->gu, 2 * I, e->h, L->wgu, T, H, 2 * I);
    tsr_pool_for(e->pool, (T + ROW_TASK - 1) / ROW_TASK, swiglu_task,
                 &(rows_job_t){e, NULL, NULL, T, l});
    matmul(e, e->proj, H, e->act, L->wd, T, I, H);
    if (allreduce(e, e->proj, (size_t)T * H, err, errlen) < 0) return -1;   /* all-reduce 2 */
    for (size_t i = 0; i < (size_t)T * H; i++) e->x[i] += e->proj[i];
    return 0;
}

static int embed(tsr_engine_t *e, const tsr_batch_t *b, char *err, size_t errlen)
{
    const int H = e->hidden;
    /* Vocabulary-parallel lookup: each rank fills the rows it holds. */
    memset(e->x, 0, (size_t)b->n_tokens * H * sizeof(float));
    for (int i = 0; i < b->n_tokens; i++) {
        int32_t t = b->tokens[i];
        if (t < 0 || t >= e->vocab) {
            tsr_set_err(err, errlen, "token id %d at position %d is outside the vocabulary (%d)",
                        t, e->row_pos[i], e->vocab);
            return -1;
        }
        if (t >= e->v_begin && t < e->v_end)
            packed_row(e, e->embed, H, t - e->v_begin, e->x + (size_t)i * H);
    }
    return allreduce(e, e->x, (size_t)b->n_tokens * H, err, errlen);
}

typedef struct {
    tsr_engine_t *e;
    const tsr_entry_t *const *which;   /* the sampling entries, in order */
    int ns;
    int32_t *sampled;
} sample_job_t;

/* Sampled row s: its logits from every rank's gathered slice, then the draw. */
static void sample_task(void *arg, int s)
{
    const sample_job_t *j = arg;
    tsr_engine_t *e = j->e;
    const int C = e->v_chunk, tp = e->spec.tp_size;
    const tsr_entry_t *en = j->which[s];
    float *row = e->gathered + (size_t)s * C;   /* one rank: already one row */
    if (tp > 1) {
        row = e->row + (size_t)s * tp * C;
        for (int r = 0; r < tp; r++)
            memcpy(row + (size_t)r * C, e->gathered + ((size_t)r * j->ns + s) * C,
                   (size_t)C * sizeof(float));
    }
    j->sampled[s] = tsr_sample(row, e->vocab, en->temperature, en->top_p, en->seed,
                               (uint64_t)(en->pos + en->n));
}

/* Logits of each sampling entry's last row over this rank's vocabulary
 * (padded to v_chunk with -inf), gathered from every rank, then sampled on
 * tp rank 0. */
static int sample_all(tsr_engine_t *e, const tsr_batch_t *b, const int *first_row,
                      int32_t *sampled, char *err, size_t errlen)
{
    const int H = e->hidden, C = e->v_chunk, tp = e->spec.tp_size;
    int ns = 0;
    e->last_sampled = 0;
    for (int i = 0; i < b->n_entries; i++) {
        if (!b->entries[i].sample) continue;
        const float *x = e->x + (size_t)(first_row[i] + b->entries[i].n - 1) * H;
        rmsnorm_row(e->h + (size_t)ns * H, x, e->final_norm, H, e->m.rms_norm_eps);
        ns++;
    }
    if (!ns) return 0;
    int vs = e->v_end - e->v_begin;
    float *lg = tp > 1 ? e->logits : e->gathered;
    if (vs > 0) matmul(e, lg, C, e->h, e->lm_head, ns, H, vs);
    for (int s = 0; s < ns; s++)
        for (int v = vs; v < C; v++) lg[(size_t)s * C + v] = -INFINITY;
    if (tp > 1 &&
        (e->ops->allgather(e->tp, tsr_host_buf(e->logits, (size_t)ns * C, TSR_DT_F32),
                           tsr_host_buf(e->gathered, (size_t)tp * ns * C, TSR_DT_F32), e->coll_ms,
                           err, errlen) < 0 ||
         tsr_coll_settle(e->ops, e->tp, e->coll_ms, err, errlen) < 0))
        return -1;
    e->last_sampled = ns;
    if (e->spec.tp_rank != 0) return 0;
    /* Each sampled row on the pool's threads: a greedy pick scans the whole
     * vocabulary, and 32 of them one after another held up the step. */
    const tsr_entry_t *which[ns];
    for (int i = 0, k = 0; i < b->n_entries; i++)
        if (b->entries[i].sample) which[k++] = &b->entries[i];
    sample_job_t sj = {e, which, ns, sampled};
    tsr_pool_for(e->pool, ns, sample_task, &sj);
    return 0;
}

static int cpu_step(tsr_engine_t *e, const tsr_batch_t *b, int32_t *sampled, char *err,
                    size_t errlen)
{
    const tsr_piece_spec_t *s = &e->spec;
    int first_row[b->n_entries > 0 ? b->n_entries : 1];
    if (b->n_entries > s->max_seqs) {
        tsr_set_err(err, errlen, "a batch of %d entries exceeds this piece's %d slots",
                    b->n_entries, s->max_seqs);
        return -1;
    }
    if (e->fault_after > 0 && ++e->steps >= e->fault_after) {
        e->fatal = 1;
        tsr_set_err(err, errlen, "fatal device error: injected after %ld steps "
                    "(TSR_TEST_DEVICE_FAULT_AFTER)", e->fault_after);
        return -1;
    }
    if (tsr_batch_prepare(s, e->kv, b, first_row, e->row_slot, e->row_pos, err, errlen) < 0)
        return -1;
    if (!b->n_tokens) return 0;
    const size_t rows = (size_t)b->n_tokens * e->hidden;
    if (s->stage == 0) {
        if (embed(e, b, err, errlen) < 0) return -1;
    } else {
        memcpy(e->x, e->hin, rows * sizeof(float));
    }
    for (int l = 0; l < e->n_layers; l++)
        if (layer_forward(e, b, first_row, l, err, errlen) < 0) return -1;
    if (s->stage < s->pp_size - 1) {                      /* stage boundary */
        memcpy(e->hout, e->x, rows * sizeof(float));
        return 0;
    }
    return sample_all(e, b, first_row, sampled, err, errlen);
}

static void cpu_set_comm(tsr_engine_t *e, const tsr_coll_ops_t *ops, tsr_comm_t *tp,
                          int timeout_ms)
{
    e->ops = ops;
    e->tp = tp;
    e->coll_ms = timeout_ms > 0 ? timeout_ms : TSR_COLL_TIMEOUT_MS_DEFAULT;
}

static void cpu_set_alive(tsr_engine_t *e, uint64_t *ticks) { e->alive = ticks; }

static tsr_buf_t cpu_hidden(tsr_engine_t *e, int which)
{
    return tsr_host_buf(which ? e->hout : e->hin, (size_t)e->spec.max_tokens * e->hidden, TSR_DT_F32);
}

static int cpu_last_logits(tsr_engine_t *e, float *out, int max_rows)
{
    const int C = e->v_chunk, tp = e->spec.tp_size, ns = e->last_sampled;
    int rows = ns < max_rows ? ns : max_rows;
    if (!e->gathered) return 0;
    tsr_logits_ungather(e->gathered, tp, ns, C, e->vocab, rows, out);
    return rows;
}

static void cpu_release(tsr_engine_t *e, int slot) { tsr_kvpool_release(e->kv, slot); }
static void cpu_kv_usage(const tsr_engine_t *e, int *used, int *total)
{
    *used = tsr_kvpool_used(e->kv);
    *total = tsr_kvpool_total(e->kv);
}
static const tsr_model_info_t *cpu_model(const tsr_engine_t *e) { return &e->m; }
static uint64_t cpu_weight_bytes(const tsr_engine_t *e) { return e->wbytes; }
static uint64_t cpu_kv_bytes(const tsr_engine_t *e) { return e->kvbytes; }
static int cpu_fatal(const tsr_engine_t *e) { return e->fatal; }
static void cpu_destroy(tsr_engine_t **e_p)
{
    if (!e_p) return;
    engine_free(*e_p);
    *e_p = NULL;
}

const tsr_engine_ops_t tsr_engine_cpu = {
    .name = "cpu",
    .device = TSR_DEVICE_CPU,
    .kv_elem_bytes = (int)sizeof(float),
    .load = cpu_load,
    .set_comm = cpu_set_comm,
    .hidden = cpu_hidden,
    .step = cpu_step,
    .last_logits = cpu_last_logits,
    .release = cpu_release,
    .kv_usage = cpu_kv_usage,
    .model = cpu_model,
    .weight_bytes = cpu_weight_bytes,
    .kv_bytes = cpu_kv_bytes,
    .fatal = cpu_fatal,
    .destroy = cpu_destroy,
    .set_alive = cpu_set_alive,
};
