/* kv_format.c: rows into the CPU engine's KV cache in its element format
 * (f32, bf16, or int8 with a scale per row of one head); kv_format.h says
 * where they go and how the attention kernels read them back. */
#include "worker/kv_format.h"

#include <float.h>
#include <math.h>

#include "worker/cpu_kernels.h"
#include "worker/matmul_bf16.h"

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

/* A row of n elements as int8 at d and its scale at *scale (tsr_kvf_write):
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

/* One head's row of n elements into pool at element offset off (its scale,
 * for int8, at scales[off / n]), as tsr_kvf_write describes.  Inline, as
 * it was in the engine: called out of line, it added 0.05 % to the
 * instructions of a bench/engine_step run (callgrind). */
static inline void write_row(int kind, void *pool, float *scales, size_t off, const float *x,
                             int n)
{
    if (kind == TSR_KVF_F32) {
        memcpy((float *)pool + off, x, (size_t)n * sizeof(float));
        return;
    }
    if (kind == TSR_KVF_I8) {
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

void tsr_kvf_write(const tsr_kvf_cache_t *c, int l, int slot, int pos, const float *k,
                   const float *v)
{
    const int hd = c->head_dim;
    const size_t off = tsr_kvf_off(c, l, slot, pos);
    for (int h = 0; h < c->heads; h++) {
        const size_t o = off + (size_t)h * TSR_KV_BLOCK * hd;
        write_row(c->kind, c->k, c->kscale, o, k + (size_t)h * hd, hd);
        write_row(c->kind, c->v, c->vscale, o, v + (size_t)h * hd, hd);
    }
}
