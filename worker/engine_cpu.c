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
 * are one fused matrix, gate and up another.  The products
 * (worker/matmul_f32.h, worker/matmul_bf16.h) and attention
 * (worker/attention_cpu.h, over the KV cache of worker/kv_format.h) run on
 * one pool of threads for the whole step (worker/cpu_pool.h), each output
 * computed in a fixed order, so a sequence's numbers do not depend on what
 * it was batched with. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "common/budget.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "common/slice.h"
#include "common/util.h"
#include "worker/attention_cpu.h"
#include "worker/cpu_kernels.h"
#include "worker/cpu_pool.h"
#include "worker/engine.h"
#include "worker/kmath.h"
#include "worker/kv_format.h"
#include "worker/kvpool.h"
#include "worker/matmul_bf16.h"
#include "worker/matmul_f32.h"
#include "worker/matmul_i8.h"
#include "worker/simd.h"

/* Matrices are packed in panels of 16 rows: f32 (worker/matmul_f32.h),
 * bf16 with matmul_dtype bf16 (worker/matmul_bf16.h), or int8 with a scale
 * per row with weights_dtype int8 (worker/matmul_i8.h), the embedding and
 * the LM head included; the shapes below are the logical [rows, cols]. */
typedef enum { W_F32, W_BF16, W_I8 } wfmt_t;

typedef struct {
    float *attn_norm, *mlp_norm;    /* [H] */
    void *wqkv;                     /* [(q_heads + 2 kv_heads) * head_dim, H]: q, k, v rows */
    void *wo;                       /* [H, q_heads * head_dim]: this rank's columns */
    void *wgu;                      /* [2 * inter, H]: gate rows, then up rows */
    void *wd;                       /* [H, inter]: this rank's columns */
    uint64_t bytes;                 /* of the checkpoint's weights it holds */
} layer_t;

struct tsr_engine {
    tsr_model_info_t m;
    tsr_piece_spec_t spec;
    const tsr_coll_ops_t *ops;
    tsr_comm_t *tp;
    tsr_comm_t *seq;            /* the sequence split's ranks (set_seq_comm), or NULL */
    int coll_ms;                /* the deadline of its operations (set_comm) */
    tsr_pool_t *pool;
    int hidden, head_dim, q_heads, kv_heads, inter, n_layers, vocab;
    int v_begin, v_end, v_chunk;    /* this rank's vocabulary rows; every rank's width */
    void *embed;                    /* [v_end - v_begin, H], stage 0, packed too */
    void *lm_head;                  /* [v_end - v_begin, H], last stage, packed */
    float *final_norm;              /* [H], last stage */
    layer_t *layers;
    tsr_kvpool_t *kv;               /* the KV blocks' tables */
    tsr_kvf_cache_t kvc;            /* the KV cache: its pools, in kv_dtype's format */
    wfmt_t wfmt;                    /* how the matrices are held */
    uint16_t *xb;                   /* bf16 products: a step's rows of x rounded */
    void *xs;                       /* int8 products: a step's rows of x quantized */
    float *rope_cos, *rope_sin;     /* [max_seq][head_dim / 2] */
    /* scratch for max_tokens rows */
    float *x, *h, *qkv, *att, *proj, *gu, *act, *hin, *hout;
    /* a sequence split: this rank's partial attention states, every rank's;
     * every row's q in batch order (in rows as wide as qkv's, as attention
     * reads them); the step's rows this rank holds (their block is its
     * own), in batch order, and how many */
    float *att_part, *att_all, *qkv_all;
    int *own, n_own;
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
    uint64_t stamp;                 /* the model files it was read from (files_stamp) */
};

/* ---- kernels ------------------------------------------------------------------- */

/* Products go through tsr_pool_matmul (worker/matmul_f32.c) or, with int8
 * weights, tsr_pool_matmul_i8 (worker/matmul_i8.c), or with bf16 weights
 * tsr_pool_matmul_bf16 (worker/matmul_bf16.c): batch-invariant, on the
 * pool's threads. */
static void matmul(tsr_engine_t *e, float *y, int ldy, const float *x, const void *w, int T,
                   int in, int out)
{
    switch (e->wfmt) {
    case W_BF16: tsr_pool_matmul_bf16(e->pool, y, ldy, x, e->xb, w, T, in, out); break;
    case W_I8: tsr_pool_matmul_i8(e->pool, y, ldy, x, e->xs, w, T, in, out); break;
    case W_F32: tsr_pool_matmul(e->pool, y, ldy, x, w, T, in, out); break;
    }
    /* A sign of life for the watchdog: a long step on a big model is many
     * of these, a stuck thread none. */
    if (e->alive) __atomic_fetch_add(e->alive, 1, __ATOMIC_RELAXED);
}

/* Row `row` of a packed table of out rows (the embedding), widened to f32. */
static void packed_row(const tsr_engine_t *e, const void *w, int out, int in, int row,
                       float *dst)
{
    switch (e->wfmt) {
    case W_BF16: tsr_bf16_packed_row(w, in, row, dst); break;
    case W_I8: tsr_i8_packed_row(w, out, in, row, dst); break;
    case W_F32: tsr_packed_row(w, in, row, dst); break;
    }
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
    const int *rows;     /* rope_kv_task: row t is the batch's row rows[t] (NULL: t) */
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
    rows_job_t j = {e, w, add, T, 0, NULL};
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
    const tsr_dtype_t vt = tsr_st_find(st, name)->dtype;
    if (vt == TSR_DT_I8 || vt == TSR_DT_F8E4M3) {
        tsr_set_err(err, errlen, "%s: an %s vector: only weight matrices may be quantized", name,
                    vt == TSR_DT_I8 ? "int8" : "FP8");
        return -1;
    }
    if (s.r1 > s.r0 &&
        tsr_st_read_f32(st, tsr_st_find(st, name), 0, 1, s.r0, s.r1, dst, err, errlen) < 0)
        return -1;
    e->wbytes += (uint64_t)(s.r1 - s.r0) * sizeof(float);
    return 0;
}

/* The scales of n rows of ld weights each, as int8 weights take them
 * (tsr_i8_row_scale: over the whole row, also where this rank holds some of
 * its columns); -1 naming the tensor and row when one cannot be quantized
 * (a NaN or infinite weight). */
static int row_scales(const char *name, const float *rows, int64_t ld, int64_t row0, int64_t n,
                      float *scales, char *err, size_t errlen)
{
    for (int64_t r = 0; r < n; r++) {
        scales[r] = tsr_i8_row_scale(rows + r * ld, (int)ld);
        if (!isfinite(scales[r])) {
            tsr_set_err(err, errlen, "%s: row %lld holds a NaN or infinite weight: it cannot be "
                        "held in int8 (weights_dtype int8)", name, (long long)(row0 + r));
            return -1;
        }
    }
    return 0;
}

/* The scales of rows [r0, r1) of the int8 or FP8 matrix `name` of `rows`
 * rows in a quantized checkpoint: tensor "<name>_scale", one scale a row
 * ([rows] or [rows, 1]) or one for the whole matrix ([], [1] or [1, 1]), a
 * float type, every scale positive and finite (-1 naming the tensor and
 * the row otherwise). */
static int read_scales(const tsr_st_t *st, const char *name, int64_t rows, int64_t r0, int64_t r1,
                       float *dst, char *err, size_t errlen)
{
    char sname[192];
    snprintf(sname, sizeof sname, "%s_scale", name);
    const tsr_tensor_t *t = tsr_st_find(st, sname);
    if (!t) {
        tsr_set_err(err, errlen, "%s: a quantized matrix without its scales (tensor %s is "
                    "missing)", name, sname);
        return -1;
    }
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    const int whole = n == 1 && t->ndim <= 2;   /* one for the matrix (also where rows is 1) */
    const int per_row = !whole && n == rows && (t->ndim == 1 || (t->ndim == 2 && t->shape[1] == 1));
    if (!whole && !per_row) {
        tsr_set_err(err, errlen, "%s: %d-dimensional, %lld scales: not one for each of %s's %lld "
                    "rows (expected [%lld] or [%lld, 1]) nor one for the matrix", sname, t->ndim,
                    (long long)n, name, (long long)rows, (long long)rows, (long long)rows);
        return -1;
    }
    if (t->dtype == TSR_DT_I8 || t->dtype == TSR_DT_F8E4M3) {
        tsr_set_err(err, errlen, "%s: scales must be F32, BF16 or F16, not %s", sname,
                    tsr_dtype_name(t->dtype));
        return -1;
    }
    if (r1 <= r0) return 0;
    if (whole) {   /* read once, given to every row */
        if (tsr_st_read_f32(st, t, 0, 1, 0, 1, dst, err, errlen) < 0) return -1;
        for (int64_t r = 1; r < r1 - r0; r++) dst[r] = dst[0];
    } else if ((t->ndim == 1 ? tsr_st_read_f32(st, t, 0, 1, r0, r1, dst, err, errlen)
                             : tsr_st_read_f32(st, t, r0, r1, 0, 1, dst, err, errlen)) < 0) {
        return -1;   /* a vector is one row to the reader, a [rows, 1] matrix rows of one */
    }
    for (int64_t r = 0; r < r1 - r0; r++)
        if (!(dst[r] > 0.0f) || !isfinite(dst[r])) {
            tsr_set_err(err, errlen, "%s: row %lld's scale is %g: a scale must be positive and "
                        "finite", sname, (long long)(r0 + r), (double)dst[r]);
            return -1;
        }
    return 0;
}

/* Reads this rank's slice of matrix t (layer li) as rows row0 .. of the
 * packed matrix wp[out, in] (worker/matmul_f32.h), a block of rows at a
 * time, so no second copy of a large matrix is ever held.  The slice must
 * have in columns and fit in rows [row0, out).  A quantized checkpoint's
 * matrix (I8 or F8_E4M3, with its scales: read_scales) is multiplied out
 * by them, row by row, except int8 into int8 weights, taken as it is.  Int8
 * weights quantized here read each block with every column of its rows,
 * which the scales are taken over. */
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
    const tsr_tensor_t *tensor = tsr_st_find(st, name);
    const int scaled = tensor->dtype == TSR_DT_I8 || tensor->dtype == TSR_DT_F8E4M3;
    const int as_is = tensor->dtype == TSR_DT_I8 && e->wfmt == W_I8;   /* int8 into int8 */
    const int requant = e->wfmt == W_I8 && !as_is;   /* int8 weights quantized here */
    /* the columns read per row: all of them where the scales are taken here */
    const int64_t c0 = requant ? 0 : s.c0, width = requant ? s.cols : cols;
    int64_t step = BLOCK_FLOATS / width > 0 ? BLOCK_FLOATS / width : 1;
    float *buf = malloc((size_t)(step * width) * sizeof(float));
    float *scales = scaled || requant ? malloc((size_t)step * sizeof(float)) : NULL;
    if (!buf || ((scaled || requant) && !scales)) {
        free(buf), free(scales);
        tsr_set_err(err, errlen, "%s: out of memory for a staging block", name);
        return -1;
    }
    int rc = 0;
    for (int64_t r = s.r0; r < s.r1 && rc == 0; r += step) {
        const int64_t n = s.r1 - r < step ? s.r1 - r : step;
        const int at = row0 + (int)(r - s.r0);
        rc = tsr_st_read_f32(st, tensor, r, r + n, c0, c0 + width, buf, err, errlen);
        if (rc == 0 && scaled) rc = read_scales(st, name, s.rows, r, r + n, scales, err, errlen);
        if (rc < 0) break;
        if (as_is) {   /* tsr_i8_pack_q_rows holds a -128 as -127 */
            tsr_i8_pack_q_rows(wp, out, (int)cols, at, buf, (int)cols, scales, (int)n);
            continue;
        }
        if (scaled)   /* the checkpoint's numbers: value x its row's scale (int8: -128 as -127) */
            for (int64_t i = 0; i < n * width; i++) {
                const float v = buf[i];
                buf[i] = (tensor->dtype == TSR_DT_I8 && v < -127.0f ? -127.0f : v) * scales[i / width];
            }
        if (requant) {
            rc = row_scales(name, buf, s.cols, r, n, scales, err, errlen);
            if (rc == 0)
                tsr_i8_pack_rows(wp, out, (int)cols, at, buf + s.c0, (int)s.cols, scales, (int)n);
        } else if (e->wfmt == W_BF16) {
            tsr_bf16_pack_rows(wp, out, (int)cols, at, buf, (int)n);
        } else {
            tsr_pack_rows(wp, out, (int)cols, at, buf, (int)n);
        }
    }
    free(buf), free(scales);
    if (rc < 0) return -1;
    const uint64_t rows = (uint64_t)(s.r1 - s.r0);
    e->wbytes += e->wfmt == W_I8    ? rows * ((uint64_t)cols + sizeof(float))
                 : e->wfmt == W_BF16 ? rows * cols * 2
                                     : rows * cols * sizeof(float);
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

/* A packed matrix of out rows of `in` columns, f32 (worker/matmul_f32.h),
 * int8 (worker/matmul_i8.h) or bf16 (worker/matmul_bf16.h), its padding
 * zeroed. */
static void *alloc_packed(const tsr_engine_t *e, int out, int in, int *bad)
{
    if (e->wfmt != W_F32) {
        size_t bytes = e->wfmt == W_I8 ? tsr_i8_packed_bytes(out, in)
                                       : tsr_bf16_packed_elems(out, in) * sizeof(uint16_t);
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
    const uint64_t before = e->wbytes;
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
    L->bytes = e->wbytes - before;
    return 0;
}

/* The model files of dir as they are now (config.json and the .safetensors files: name,
 * size, modification and change times, device and inode), hashed: weights read from them are reused by a new
 * piece only while it is the same. */
static uint64_t files_stamp(const char *dir)
{
    uint64_t h = 1469598103934665603ull;
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t n = strlen(de->d_name);
        if (strcmp(de->d_name, "config.json") &&
            (n < 12 || strcmp(de->d_name + n - 12, ".safetensors")))
            continue;
        char path[4352];
        struct stat sb;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        if (stat(path, &sb) < 0) continue;
        /* ctime too: a copy that keeps size and mtime (cp -p, rsync) still changes it */
        uint64_t v[8] = {(uint64_t)sb.st_size, (uint64_t)sb.st_mtim.tv_sec,
                         (uint64_t)sb.st_mtim.tv_nsec, (uint64_t)sb.st_ino, (uint64_t)sb.st_dev,
                         (uint64_t)sb.st_ctim.tv_sec, (uint64_t)sb.st_ctim.tv_nsec, 0};
        for (size_t i = 0; i < n; i++) v[7] = v[7] * 31 + (unsigned char)de->d_name[i];
        uint64_t x = 0;   /* order-free: the files' hashes are summed */
        for (int i = 0; i < 8; i++) x = (x ^ v[i]) * 1099511628211ull;
        h += x;
    }
    closedir(d);
    return h;
}

/* A layer of donor that the piece being loaded (e, its spec set) can take as it is: the
 * same model files, tensor-parallel slice and weight type.  NULL when none. */
static layer_t *reusable(tsr_engine_t *donor, const tsr_engine_t *e, int li)
{
    if (!donor || !donor->layers || donor->stamp != e->stamp || !e->stamp ||
        donor->spec.tp_size != e->spec.tp_size || donor->spec.tp_rank != e->spec.tp_rank ||
        donor->wfmt != e->wfmt || li < donor->spec.layer_begin ||
        li >= donor->spec.layer_end)
        return NULL;
    layer_t *L = &donor->layers[li - donor->spec.layer_begin];
    return L->wqkv ? L : NULL;
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

/* Frees everything of e but e itself, its layers excepted when e->layers is NULL; the
 * pointers freed are cleared. */
static void engine_free_parts(tsr_engine_t *e)
{
    for (int l = 0; e->layers && l < e->n_layers; l++) {
        layer_t *L = &e->layers[l];
        free(L->attn_norm), free(L->mlp_norm), free(L->wqkv), free(L->wo), free(L->wgu);
        free(L->wd);
    }
    free(e->layers);
    if (e->lm_head != e->embed) free(e->lm_head);
    free(e->embed), free(e->final_norm), free(e->kvc.k), free(e->kvc.v);
    free(e->kvc.kscale), free(e->kvc.vscale);
    free(e->rope_cos), free(e->rope_sin), free(e->x), free(e->h), free(e->qkv), free(e->att);
    free(e->att_part), free(e->att_all), free(e->qkv_all), free(e->own);
    free(e->proj), free(e->gu), free(e->act), free(e->hin), free(e->hout), free(e->xb), free(e->xs);
    free(e->row_slot), free(e->row_pos), free(e->logits), free(e->gathered), free(e->row);
    tsr_kvpool_destroy(&e->kv);
    tsr_pool_destroy(&e->pool);
    tsr_engine_t keep = {.spec = e->spec, .stamp = e->stamp, .wfmt = e->wfmt};
    *e = keep;
}

static void engine_free(tsr_engine_t *e)
{
    if (!e) return;
    engine_free_parts(e);
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
    if (s->seq_size < 0 || s->seq_rank < 0 || s->seq_rank >= (s->seq_size > 1 ? s->seq_size : 1)) {
        tsr_set_err(err, errlen, "sequence rank %d of %d: not a rank of the split", s->seq_rank,
                    s->seq_size);
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


/* Frees all of donor but the layers the piece being loaded (e) takes from it. */
static void donor_prune(tsr_engine_t *donor, const tsr_engine_t *e)
{
    for (int l = 0; donor->layers && l < donor->n_layers; l++) {
        layer_t *L = &donor->layers[l];
        if (reusable(donor, e, donor->spec.layer_begin + l) &&
            donor->spec.layer_begin + l >= e->spec.layer_begin &&
            donor->spec.layer_begin + l < e->spec.layer_end)
            continue;
        free(L->attn_norm), free(L->mlp_norm), free(L->wqkv), free(L->wo), free(L->wgu);
        free(L->wd);
        memset(L, 0, sizeof *L);
    }
    layer_t *keep = donor->layers;
    int n = donor->n_layers;
    donor->layers = NULL;     /* the rest (pool, KV cache, scratch, tables) goes now */
    engine_free_parts(donor);
    donor->layers = keep;
    donor->n_layers = n;
}

/* load, taking what it can from donor (may be NULL): *kept counts the layers taken. */
static int load_with(tsr_engine_t *donor, const char *dir, const tsr_piece_spec_t *spec,
                     tsr_engine_t **out, int *kept, char *err, size_t errlen)
{
    int rc = -1, bad = 0;
    tsr_st_t *st = NULL;
    if (kept) *kept = 0;
    tsr_engine_t *e = calloc(1, sizeof *e);
    if (!e) {
        tsr_set_err(err, errlen, "out of memory for an engine");
        return -1;
    }
    e->spec = *spec;
    e->stamp = files_stamp(dir);
    e->wfmt = spec->weights_dtype == TSR_KV_INT8   ? W_I8
              : spec->matmul_dtype == TSR_KV_BF16 ? W_BF16
                                                  : W_F32;
    if (donor) donor_prune(donor, e);
    if (tsr_model_info_load(dir, &e->m, err, errlen) < 0 || check_spec(&e->m, dir, spec, err, errlen) < 0)
        goto out;
    if (tsr_kv_dtype_check(spec->kv_dtype, 1u << TSR_KV_F32 | 1u << TSR_KV_BF16 | 1u << TSR_KV_INT8,
                           "CPU", err, errlen) < 0)
        goto out;
    e->kvc.kind = spec->kv_dtype == TSR_KV_BF16   ? TSR_KVF_BF16
                  : spec->kv_dtype == TSR_KV_INT8 ? TSR_KVF_I8
                                                  : TSR_KVF_F32;
    if (tsr_elem_dtype_check("matmul_dtype", spec->matmul_dtype, 1u << TSR_KV_F32 | 1u << TSR_KV_BF16,
                             "CPU", "multiply in", err, errlen) < 0 ||
        tsr_elem_dtype_check("weights_dtype", spec->weights_dtype, 1u << TSR_KV_INT8, "CPU",
                             "hold its weights in", err, errlen) < 0)
        goto out;
    if (e->wfmt == W_I8 && spec->matmul_dtype == TSR_KV_BF16) {
        tsr_set_err(err, errlen, "weights_dtype int8 with matmul_dtype bf16: int8 weights multiply "
                    "as integers, not in bf16 (leave matmul_dtype auto or f32)");
        goto out;
    }
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
             tsr_cpu_kernels_name(tsr_cpu_kernels()),
             e->wfmt == W_BF16 ? ", bf16 products: " : e->wfmt == W_I8 ? ", int8 products: " : "",
             e->wfmt == W_BF16 ? tsr_bf16_products_name()
             : e->wfmt == W_I8 ? tsr_i8_products_name() : "");
    if (tsr_st_open(dir, &st, err, errlen) < 0) goto out;
    /* files replaced since the stamp (before config.json was read, or the weights
     * opened) would mix two models in one piece: then nothing is taken from the donor */
    if (files_stamp(dir) != e->stamp) e->stamp = 0;

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
    for (int l = 0; l < e->n_layers; l++) {
        layer_t *from = reusable(donor, e, spec->layer_begin + l);
        if (from) {   /* held already: taken as it is */
            e->layers[l] = *from;
            memset(from, 0, sizeof *from);
            e->wbytes += e->layers[l].bytes;
            if (kept) (*kept)++;
        } else if (load_layer(st, e, spec->layer_begin + l, &e->layers[l], err, errlen) < 0) {
            goto out;
        }
    }

    const size_t S = (size_t)spec->max_seq_len, T = (size_t)spec->max_tokens,
                 kvw = (size_t)e->kv_heads * e->head_dim, qw = (size_t)e->q_heads * e->head_dim;
    const int seqn = spec->seq_size > 1 ? spec->seq_size : 1,
              held = (spec->kv_blocks + seqn - 1) / seqn;   /* the blocks this rank holds */
    size_t pool = (size_t)tsr_kv_pool_elems(m, spec->tp_size, e->n_layers, held);
    e->kv = tsr_kvpool_new(spec->kv_blocks, spec->max_seqs, spec->max_seq_len);
    if (!e->kv) {   /* its tables grow with max_seq_len: say so */
        tsr_set_err(err, errlen, "out of memory for the KV block tables of %d sequences of "
                    "max_seq_len %d", spec->max_seqs, spec->max_seq_len);
        goto out;
    }
    e->kvc.heads = e->kv_heads;
    e->kvc.head_dim = e->head_dim;
    e->kvc.blocks = held;
    e->kvc.table = e->kv;
    e->kvc.seq_size = seqn;
    e->kvc.seq_rank = spec->seq_rank;
    const size_t esize = tsr_kvf_esize(e->kvc.kind),
                 nscale = e->kvc.kind == TSR_KVF_I8 ? pool / e->head_dim : 0;
    e->kvc.k = alloc_lazy(pool * esize, &bad);
    e->kvc.v = alloc_lazy(pool * esize, &bad);
    if (nscale) {
        e->kvc.kscale = alloc_lazy(nscale * sizeof(float), &bad);
        e->kvc.vscale = alloc_lazy(nscale * sizeof(float), &bad);
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
    if (seqn > 1) {
        e->att_part = alloc_f(T * (qw + 2 * (size_t)e->q_heads), &bad);
        e->att_all = alloc_f(seqn * T * (qw + 2 * (size_t)e->q_heads), &bad);
        e->qkv_all = alloc_f(T * (qw + 2 * kvw), &bad);
        if (!(e->own = calloc(T, sizeof *e->own))) bad = true;
    }
    e->gu = alloc_f(T * 2 * e->inter, &bad);
    e->act = alloc_f(T * e->inter, &bad);
    /* the rows of a product's input, rounded (bf16) or quantized (int8), in scratch for
     * the widest input of a product: H, q_heads * head_dim or inter */
    size_t widest = H > qw ? H : qw;
    widest = widest > (size_t)e->inter ? widest : (size_t)e->inter;
    if (e->wfmt == W_BF16)
        e->xb = (uint16_t *)alloc_f((T * (size_t)tsr_bf16_in_padded((int)widest) + 1) / 2, &bad);
    if (e->wfmt == W_I8) e->xs = alloc_f((tsr_i8_x_bytes((int)T, (int)widest) + 3) / 4, &bad);
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
                    held, (unsigned long long)(e->kvbytes >> 20), spec->max_tokens);
        goto out;
    }
    rope_tables(e);
#ifdef TSR_TESTING
    const char *fault = getenv("TSR_TEST_DEVICE_FAULT_AFTER");
    e->fault_after = fault ? strtol(fault, NULL, 10) : 0;
#endif
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

static int cpu_load(const char *dir, const tsr_piece_spec_t *spec, tsr_engine_t **out, char *err,
                    size_t errlen)
{
    return load_with(NULL, dir, spec, out, NULL, err, errlen);
}

static int cpu_load_from(tsr_engine_t **donor, const char *dir, const tsr_piece_spec_t *spec,
                         tsr_engine_t **out, int *kept, char *err, size_t errlen)
{
    int rc = load_with(donor ? *donor : NULL, dir, spec, out, kept, err, errlen);
    if (donor) {
        engine_free(*donor);
        *donor = NULL;
    }
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

/* Attention of layer l into e->att.  With a sequence split, each rank
 * attends over the positions it holds, the ranks' partial states are
 * gathered, and every rank merges them in rank order. */
static int attention(tsr_engine_t *e, const tsr_batch_t *b, const int *first_row, int l,
                     char *err, size_t errlen)
{
    const int qh = e->q_heads, hd = e->head_dim, T = b->n_tokens, n = e->kvc.seq_size;
    if (n == 1) {
        tsr_attention_cpu(e->pool, &e->kvc, l, b, first_row, e->qkv, qh, e->att);
        return 0;
    }
    const size_t part = (size_t)T * qh * (hd + 2);
    tsr_attention_cpu(e->pool, &e->kvc, l, b, first_row, e->qkv_all, qh, e->att_part);
    if (e->ops->allgather(e->seq, tsr_host_buf(e->att_part, part, TSR_DT_F32),
                          tsr_host_buf(e->att_all, n * part, TSR_DT_F32), e->coll_ms, err,
                          errlen) < 0 ||
        tsr_coll_settle(e->ops, e->seq, e->coll_ms, err, errlen) < 0)
        return -1;
    tsr_attention_merge(e->att_all, n, part, T, qh, hd, e->att);
    return 0;
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
        const int r = j->rows ? j->rows[t] : t;
        float *q = e->qkv + (size_t)t * qkvw, *k = q + qw, *v = k + kvw;
        rope_row(e, q, qh, e->row_pos[r]);
        rope_row(e, k, kvh, e->row_pos[r]);
        tsr_kvf_write(&e->kvc, j->l, e->row_slot[r], e->row_pos[r], k, v);
    }
}

/* The sum over the sequence split's ranks of buf (n floats), there when
 * this returns. */
static int seq_sum(tsr_engine_t *e, float *buf, size_t n, char *err, size_t errlen)
{
    if (e->ops->allreduce_sum(e->seq, tsr_host_buf(buf, n, TSR_DT_F32), e->coll_ms, err,
                              errlen) < 0)
        return -1;
    return tsr_coll_settle(e->ops, e->seq, e->coll_ms, err, errlen);
}

/* A layer with a sequence split: the rows this rank holds (e->own) are
 * packed at the front of x, h, qkv, att, proj, gu and act, and only they
 * go through the products, norms and MLP here; attention needs every
 * row's q (its keys and values come from the caches), so the ranks' rows'
 * q are summed in batch order (each row is one rank's, zeros on the
 * others) and spread to qkv_all's rows, and every rank attends over its
 * blocks for every row (attention, merged), keeping its own rows'
 * results. */
static int layer_forward_split(tsr_engine_t *e, const tsr_batch_t *b, const int *first_row,
                               int l, char *err, size_t errlen)
{
    const layer_t *L = &e->layers[l];
    const int H = e->hidden, hd = e->head_dim, qh = e->q_heads, kvh = e->kv_heads,
              I = e->inter, T = b->n_tokens, n = e->n_own;
    const size_t qw = (size_t)qh * hd, kvw = (size_t)kvh * hd, qkvw = qw + 2 * kvw;

    add_norm(e, NULL, L->attn_norm, n);
    matmul(e, e->qkv, (int)qkvw, e->h, L->wqkv, n, H, (int)qkvw);
    tsr_pool_for(e->pool, (n + ROW_TASK - 1) / ROW_TASK, rope_kv_task,
                 &(rows_job_t){e, NULL, NULL, n, l, e->own});
    memset(e->qkv_all, 0, (size_t)T * qw * sizeof(float));   /* q alone, packed */
    for (int i = 0; i < n; i++)
        memcpy(e->qkv_all + (size_t)e->own[i] * qw, e->qkv + (size_t)i * qkvw, qw * sizeof(float));
    if (seq_sum(e, e->qkv_all, (size_t)T * qw, err, errlen) < 0) return -1;
    for (int t = T - 1; t > 0; t--)   /* to rows of qkvw, the last first: t * qkvw >= t * qw */
        memmove(e->qkv_all + (size_t)t * qkvw, e->qkv_all + (size_t)t * qw, qw * sizeof(float));
    if (attention(e, b, first_row, l, err, errlen) < 0) return -1;
    for (int i = 0; i < n; i++)   /* own[i] >= i: packing forward is safe */
        memmove(e->att + (size_t)i * qw, e->att + (size_t)e->own[i] * qw, qw * sizeof(float));
    matmul(e, e->proj, H, e->att, L->wo, n, (int)qw, H);
    if (allreduce(e, e->proj, (size_t)n * H, err, errlen) < 0) return -1;

    add_norm(e, e->proj, L->mlp_norm, n);
    matmul(e, e->gu, 2 * I, e->h, L->wgu, n, H, 2 * I);
    tsr_pool_for(e->pool, (n + ROW_TASK - 1) / ROW_TASK, swiglu_task,
                 &(rows_job_t){e, NULL, NULL, n, l, NULL});
    matmul(e, e->proj, H, e->act, L->wd, n, I, H);
    if (allreduce(e, e->proj, (size_t)n * H, err, errlen) < 0) return -1;
    for (size_t i = 0; i < (size_t)n * H; i++) e->x[i] += e->proj[i];
    return 0;
}

/* The layers of a step with a sequence split: x's rows this rank holds
 * packed first, the layers, then every rank's rows summed back into x in
 * batch order (into h, free then), so every rank leaves the stage with
 * every row. */
static int layers_split(tsr_engine_t *e, const tsr_batch_t *b, const int *first_row, char *err,
                        size_t errlen)
{
    const int H = e->hidden, T = b->n_tokens;
    e->n_own = 0;
    for (int t = 0; t < T; t++)
        if (tsr_kvf_holds(&e->kvc, e->row_slot[t], e->row_pos[t])) e->own[e->n_own++] = t;
    for (int i = 0; i < e->n_own; i++)
        memmove(e->x + (size_t)i * H, e->x + (size_t)e->own[i] * H, (size_t)H * sizeof(float));
    for (int l = 0; l < e->n_layers; l++)
        if (layer_forward_split(e, b, first_row, l, err, errlen) < 0) return -1;
    memset(e->h, 0, (size_t)T * H * sizeof(float));
    for (int i = 0; i < e->n_own; i++)
        memcpy(e->h + (size_t)e->own[i] * H, e->x + (size_t)i * H, (size_t)H * sizeof(float));
    if (seq_sum(e, e->h, (size_t)T * H, err, errlen) < 0) return -1;
    memcpy(e->x, e->h, (size_t)T * H * sizeof(float));
    return 0;
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
                 &(rows_job_t){e, NULL, NULL, T, l, NULL});
    if (attention(e, b, first_row, l, err, errlen) < 0) return -1;
    matmul(e, e->proj, H, e->att, L->wo, T, (int)qw, H);
    if (allreduce(e, e->proj, (size_t)T * H, err, errlen) < 0) return -1;   /* all-reduce 1 */

    /* SwiGLU MLP */
    add_norm(e, e->proj, L->mlp_norm, T);
    matmul(e, e->gu, 2 * I, e->h, L->wgu, T, H, 2 * I);
    tsr_pool_for(e->pool, (T + ROW_TASK - 1) / ROW_TASK, swiglu_task,
                 &(rows_job_t){e, NULL, NULL, T, l, NULL});
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
            packed_row(e, e->embed, e->v_end - e->v_begin, H, t - e->v_begin, e->x + (size_t)i * H);
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
#ifdef TSR_TESTING
    if (e->fault_after > 0 && ++e->steps >= e->fault_after) {
        e->fatal = 1;
        tsr_set_err(err, errlen, "fatal device error: injected after %ld steps "
                    "(TSR_TEST_DEVICE_FAULT_AFTER)", e->fault_after);
        return -1;
    }
#endif
    if (tsr_batch_prepare(s, e->kv, b, first_row, e->row_slot, e->row_pos, err, errlen) < 0)
        return -1;
    if (!b->n_tokens) return 0;
    const size_t rows = (size_t)b->n_tokens * e->hidden;
    if (s->stage == 0) {
        if (embed(e, b, err, errlen) < 0) return -1;
    } else {
        memcpy(e->x, e->hin, rows * sizeof(float));
    }
    if (e->kvc.seq_size > 1) {
        if (!e->seq) {
            tsr_set_err(err, errlen, "a sequence split of %d ranks has no communicator",
                        e->kvc.seq_size);
            return -1;
        }
        if (layers_split(e, b, first_row, err, errlen) < 0) return -1;
    } else {
        for (int l = 0; l < e->n_layers; l++)
            if (layer_forward(e, b, first_row, l, err, errlen) < 0) return -1;
    }
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

static void cpu_set_seq_comm(tsr_engine_t *e, tsr_comm_t *seq) { e->seq = seq; }

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
static tsr_kvpool_t *cpu_kvpool(tsr_engine_t *e) { return e->kv; }
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
    .load_from = cpu_load_from,
    .set_comm = cpu_set_comm,
    .set_seq_comm = cpu_set_seq_comm,
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
    .kvpool = cpu_kvpool,
};
