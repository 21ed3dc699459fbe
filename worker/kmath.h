/* kmath.h: the per-element math of the engines' kernels, and the index and
 * launch arithmetic around them.
 *
 * Header-only, free of library state, and `__host__ __device__` under nvcc:
 * the CUDA kernels call these functions on the GPU, the CPU engine calls
 * some of them too, and tests/cuda/test_kmath.cu (a host program nvcc
 * builds) runs the kernels' decompositions on the CPU against the CPU
 * engine's plain loops, on machines without a GPU. */
#ifndef TSR_KMATH_H
#define TSR_KMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/draw.h"   /* TSR_HD, tsr_draw */
#include "common/fp8.h"    /* E4M3, both ways */
#ifdef __cplusplus
extern "C" {
#endif
#include "worker/kvpool.h"  /* TSR_KV_BLOCK */
#ifdef __cplusplus
}
#endif

#define TSR_ATT_TILE 16         /* query rows one attention task covers */

/* ---- bf16 ------------------------------------------------------------------- */

static inline TSR_HD float tsr_k_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even; a NaN stays a NaN (common/safetensors.c's rule). */
static inline TSR_HD uint16_t tsr_k_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* IEEE half to f32 (subnormals, infinities and NaNs included). */
static inline TSR_HD float tsr_k_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (!man) {
        u = sign;
    } else {                        /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---- RMSNorm, SwiGLU -------------------------------------------------------- */

/* The factor every element of a row is multiplied by, from the row's sum of
 * squares (summed in any order by the caller). */
static inline TSR_HD float tsr_k_rms_scale(double sum_sq, int n, float eps)
{
    return (float)(1.0 / sqrt(sum_sq / n + eps));
}

static inline TSR_HD float tsr_k_swiglu(float gate, float up)
{
    return gate / (1.0f + expf(-gate)) * up;
}

/* ---- RoPE ------------------------------------------------------------------- */

typedef struct {
    float theta;
    int llama3;                      /* rope_scaling "llama3" */
    float factor, low_freq_factor, high_freq_factor;
    int original_max_pos;
} tsr_rope_cfg_t;

/* Inverse frequency of rotary pair i of a head of head_dim, with
 * transformers' "llama3" rescaling when cfg->llama3. */
static inline TSR_HD double tsr_k_rope_inv_freq(const tsr_rope_cfg_t *cfg, int i, int head_dim)
{
    double inv = pow((double)cfg->theta, -2.0 * i / head_dim);
    if (!cfg->llama3) return inv;
    double orig = cfg->original_max_pos;
    double low_wl = orig / cfg->low_freq_factor, high_wl = orig / cfg->high_freq_factor;
    double wl = 2.0 * 3.14159265358979323846 / inv;
    if (wl > low_wl) return inv / cfg->factor;
    if (wl < high_wl) return inv;
    double smooth = (orig / wl - cfg->low_freq_factor) /
                    (cfg->high_freq_factor - cfg->low_freq_factor);
    return (1 - smooth) * inv / cfg->factor + smooth * inv;
}

/* Rotate-half: a head's first and second halves are a pair's coordinates. */
static inline TSR_HD void tsr_k_rope_pair(float *a, float *b, float c, float s)
{
    float x = *a, y = *b;
    *a = x * c - y * s;
    *b = y * c + x * s;
}

/* ---- online softmax ----------------------------------------------------------- */

/* The running state of one query row's attention over the keys seen so
 * far: the largest score m, the sum l of exp(score - m), and (held by the
 * caller) the accumulator of exp(score - m) * value. */
typedef struct {
    float m, l;
} tsr_osm_t;

static inline TSR_HD tsr_osm_t tsr_k_osm_init(void)
{
    tsr_osm_t s = {-INFINITY, 0.0f};
    return s;
}

/* Takes in one score: returns the factor the accumulator is multiplied by
 * before adding w * value, and sets *w. */
static inline TSR_HD float tsr_k_osm_push(tsr_osm_t *s, float score, float *w)
{
    float c = 1.0f;
    if (score > s->m) {
        c = expf(s->m - score);
        s->l *= c;
        s->m = score;
    }
    *w = expf(score - s->m);
    s->l += *w;
    return c;
}

/* Merges state b into a (two tiles of keys of the same row): returns the
 * factors for a's accumulator (*ca) and b's (*cb); the merged accumulator
 * is ca * acc_a + cb * acc_b. */
static inline TSR_HD void tsr_k_osm_merge(tsr_osm_t *a, tsr_osm_t b, float *ca, float *cb)
{
    float m = a->m > b.m ? a->m : b.m;
    if (m == -INFINITY) {
        *ca = 1.0f, *cb = 0.0f;
        return;
    }
    *ca = expf(a->m - m);
    *cb = expf(b.m - m);
    a->l = a->l * *ca + b.l * *cb;
    a->m = m;
}

/* ---- the paged KV cache ------------------------------------------------------ */

/* Element offset of (layer l, position pos, KV head kh, dim 0) in a pool of
 * n_blocks blocks per layer, for a sequence whose block table is table: a
 * block holds, per KV head, its 16 positions one after another. */
static inline TSR_HD size_t tsr_k_kv_offset(const int32_t *table, int n_blocks, int kv_heads,
                                            int head_dim, int l, int pos, int kh)
{
    size_t block = (size_t)table[pos / TSR_KV_BLOCK];
    return (((size_t)l * n_blocks + block) * kv_heads + kh) * TSR_KV_BLOCK * head_dim +
           (size_t)(pos % TSR_KV_BLOCK) * head_dim;
}

/* ---- sampling ------------------------------------------------------------------ */

/* A token's unnormalised probability (worker/sample.c's rule): 0 where the
 * exponential is not finite. */
static inline TSR_HD float tsr_k_sample_weight(float logit, float max_logit, float temperature)
{
    float p = expf((logit - max_logit) / temperature);
    return isfinite(p) ? p : 0.0f;
}

/* Whether a row is sampled greedily: anything but a positive finite
 * temperature. */
static inline TSR_HD int tsr_k_greedy(float temperature)
{
    return !(temperature > 0.0f) || !isfinite(temperature);
}

/* Whether top_p cuts the distribution at all. */
static inline TSR_HD int tsr_k_top_p_cuts(float top_p)
{
    return top_p > 0.0f && top_p < 1.0f;
}

/* ---- launch arithmetic ----------------------------------------------------------- */

/* Attention tasks of an entry of n query rows: tiles of TSR_ATT_TILE rows
 * for each query head. */
static inline TSR_HD int tsr_k_att_tiles(int n)
{
    return (n + TSR_ATT_TILE - 1) / TSR_ATT_TILE;
}

/* Tile t of an entry of n query rows: its first row (from the entry's
 * first) and its row count. */
static inline TSR_HD void tsr_k_att_tile(int n, int t, int *row_off, int *rows)
{
    *row_off = t * TSR_ATT_TILE;
    *rows = n - *row_off < TSR_ATT_TILE ? n - *row_off : TSR_ATT_TILE;
}

/* The tensor-core attention kernel's query rows.  A tile of n positions
 * of one entry, for the g query heads that share a KV head, is n * g rows,
 * position-major (row r: position r / g of the tile, head r % g of the
 * group); each block takes TSR_ATT_ROWS of them, 16 per warp. */
#define TSR_ATT_ROWS 64

static inline TSR_HD int tsr_k_gqa_chunks(int n, int g)
{
    return (n * g + TSR_ATT_ROWS - 1) / TSR_ATT_ROWS;
}

static inline TSR_HD void tsr_k_gqa_row(int r, int g, int *pos_off, int *head_off)
{
    *pos_off = r / g;
    *head_off = r % g;
}

/* The operands of the m16n8k16 BF16 matrix instruction (mma.sync), as the
 * PTX ISA lays them out over a warp's 32 lanes: lane's element i of A
 * (16 x 16, i < 8), of B (16 x 8, i < 4) and of the f32 C (16 x 8, i < 4).
 * Elements 2j and 2j + 1 of A and B share one 32-bit register, lower half
 * first. */
static inline TSR_HD void tsr_k_mma_a(int lane, int i, int *row, int *col)
{
    *row = (lane >> 2) + 8 * ((i >> 1) & 1);
    *col = (lane & 3) * 2 + (i & 1) + 8 * (i >> 2);
}

static inline TSR_HD void tsr_k_mma_b(int lane, int i, int *k, int *n)
{
    *k = (lane & 3) * 2 + (i & 1) + 8 * (i >> 1);
    *n = lane >> 2;
}

static inline TSR_HD void tsr_k_mma_c(int lane, int i, int *row, int *col)
{
    *row = (lane >> 2) + 8 * (i >> 1);
    *col = (lane & 3) * 2 + (i & 1);
}

/* The small-batch product's split of a row of nvec 16-byte pieces over a
 * block's `warps` warps: warp w takes pieces [*begin, *end). */
static inline TSR_HD void tsr_k_gemv_span(int nvec, int warps, int w, int *begin, int *end)
{
    int per = (nvec + warps - 1) / warps;
    *begin = w * per < nvec ? w * per : nvec;
    *end = *begin + per < nvec ? *begin + per : nvec;
}

/* The smallest CUDA-graph bucket that holds a decode batch of n sequences
 * (1, 2, 4, 8, then multiples of 8), or n itself past max. */
static inline TSR_HD int tsr_k_graph_bucket(int n, int max)
{
    int b = 1;
    while (b < n && b < 8) b *= 2;
    if (n > 8) b = (n + 7) / 8 * 8;
    return b > max ? n : b;
}

/* Threads for a row-wise kernel over n elements: a multiple of 32, at most
 * 1024, enough for 4 elements per thread when the row is long. */
static inline TSR_HD int tsr_k_row_threads(int n)
{
    int t = (n + 3) / 4;
    t = (t + 31) / 32 * 32;
    return t < 32 ? 32 : t > 1024 ? 1024 : t;
}

#endif
