/* kv_format.h: how the CPU engine's KV cache holds its rows: where a
 * position of one head lies (blocks of TSR_KV_BLOCK positions) and in what
 * element format (f32, bf16, or int8 with a scale per row of one head), with
 * the writes (kv_format.c) and the vector loads the attention kernels
 * inline (here). */
#ifndef TSR_KV_FORMAT_H
#define TSR_KV_FORMAT_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "worker/kmath.h"
#include "worker/kvpool.h"
#include "worker/simd.h"

/* What the pools hold (kv_dtype): f32, bf16, or int8 with a scale per
 * row of one head (a scale pool beside each). */
enum { TSR_KVF_F32 = 0, TSR_KVF_BF16 = 1, TSR_KVF_I8 = 2, TSR_KVF_I8_AVX2 = 3 };
/* TSR_KVF_I8_AVX2 is TSR_KVF_I8 for the kernels built for AVX2
 * (worker/attention_cpu.c), which widen int8 with AVX2's own instruction;
 * the pools hold the same. */
static inline int tsr_kvf_is_i8(int kt) { return kt >= TSR_KVF_I8; }

static inline size_t tsr_kvf_esize(int kt)
{
    return kt == TSR_KVF_F32 ? 4 : kt == TSR_KVF_BF16 ? 2 : 1;
}

/* One piece's KV cache: the engine allocates and owns the pools, the block
 * tables are worker/kvpool.h's. */
typedef struct {
    int kind;                       /* TSR_KVF_F32, TSR_KVF_BF16 or TSR_KVF_I8 */
    int heads, head_dim;            /* this rank's KV heads */
    int blocks;                     /* the blocks this rank holds (per layer) */
    const tsr_kvpool_t *table;      /* which block holds a slot's positions */
    /* The sequence split (parallel.sequence): block id b of the table is
     * held by rank b % seq_size, at its block b / seq_size; this rank is
     * seq_rank.  1 and 0 without a split. */
    int seq_size, seq_rank;
    void *k, *v;                    /* [layers][blocks][heads][TSR_KV_BLOCK][head_dim] */
    float *kscale, *vscale;         /* int8: [layers][blocks][heads][TSR_KV_BLOCK], each
                                       row's scale (at its element offset / head_dim) */
} tsr_kvf_cache_t;

/* A block holds, per KV head, its 16 positions one after another, so the
 * attention of one head reads contiguous memory.  The element offset of
 * position pos of slot, KV head 0 (the next head is TSR_KV_BLOCK * head_dim
 * further on), in either pool. */
static inline size_t tsr_kvf_off(const tsr_kvf_cache_t *c, int l, int slot, int pos)
{
    const size_t kvw = (size_t)c->heads * c->head_dim;
    int32_t block = tsr_kvpool_table(c->table, slot)[pos / TSR_KV_BLOCK] / c->seq_size;
    return ((size_t)l * c->blocks + block) * TSR_KV_BLOCK * kvw +
           (size_t)(pos % TSR_KV_BLOCK) * c->head_dim;
}

/* Whether this rank holds position pos of slot (always, without a
 * sequence split). */
static inline int tsr_kvf_holds(const tsr_kvf_cache_t *c, int slot, int pos)
{
    return c->seq_size == 1 ||
           tsr_kvpool_table(c->table, slot)[pos / TSR_KV_BLOCK] % c->seq_size == c->seq_rank;
}

/* Bytes from an element offset. */
static inline const void *tsr_kvf_ptr(const void *pool, size_t off, int kt)
{
    return (const char *)pool + off * tsr_kvf_esize(kt);
}

/* Rows of position pos of slot (layer l): k's and v's kv_heads * head_dim
 * floats, one head after another, into the cache in its format.  In bf16
 * (the CUDA engine's rounding) each head's full 16s go in tsr_kvf_load16's
 * order; in int8 as round-half-even(x / scale) with scale = max |x| / 127
 * (in f32, tests/reference/llama_ref.py's round_int8), one scale per head;
 * a head's row with a NaN or an infinity as zeros with a NaN scale. */
void tsr_kvf_write(const tsr_kvf_cache_t *c, int l, int slot, int pos, const float *k,
                   const float *v);

/* The pools' elements, f32, bf16 (the top half of an f32's bits, so
 * widening puts zeros below it) or int8 (the integer, as a float: the
 * row's scale is applied to its score and to its weight, not to each
 * element).  The kind kt is a constant at every call site: the kernels are
 * compiled once per element type (worker/attention_cpu.c).
 *
 * A bf16 row keeps each full 16 of its head_dim in the order 0-3, 8-11,
 * 4-7, 12-15 (kv_format.c), because interleaving 16 stored elements with
 * zeros, 128 bits at a time (one vpunpcklwd and one vpunpckhwd), then gives
 * dimensions 0-7 and 8-15 in order: two instructions for 16 elements.  The
 * rest of a row (8, then one at a time) is in order. */
typedef unsigned short v8u16 __attribute__((vector_size(16)));
typedef unsigned short v16u16 __attribute__((vector_size(32)));
typedef unsigned int v8u __attribute__((vector_size(32)));

/* 8 int8 elements as floats: one sign extension and one conversion.  Not
 * always_inline: GCC inlines it into the AVX2 kernels only (a target
 * mismatch elsewhere), and only they call it (TSR_KVF_I8_AVX2). */
static inline __attribute__((target("avx2"))) v8f tsr_kvf_i8_load8_avx2(const signed char *p)
{
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Elements [i, i + 8) past a row's full 16s (below). */
static inline __attribute__((always_inline)) v8f tsr_kvf_load8(const void *p, size_t i, int kt);

/* Elements [i, i + 16) of a row's full 16 (i a multiple of 16). */
static inline __attribute__((always_inline)) void tsr_kvf_load16(const void *p, size_t i,
                                                                 int kt, v8f *lo, v8f *hi)
{
    if (kt != TSR_KVF_BF16) {
        *lo = tsr_kvf_load8(p, i, kt), *hi = tsr_kvf_load8(p, i + 8, kt);
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
static inline __attribute__((always_inline)) v8f tsr_kvf_load8(const void *p, size_t i, int kt)
{
    if (kt == TSR_KVF_F32) return load8((const float *)p + i);
    if (kt == TSR_KVF_I8_AVX2) return tsr_kvf_i8_load8_avx2((const signed char *)p + i);
    if (kt == TSR_KVF_I8) {   /* the portable kernels: one at a time */
        v8f r;
        for (int k = 0; k < 8; k++) r[k] = ((const signed char *)p)[i + (size_t)k];
        return r;
    }
    v8u16 h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

static inline __attribute__((always_inline)) float tsr_kvf_load1(const void *p, size_t i, int kt)
{
    return kt == TSR_KVF_BF16        ? tsr_k_bf16_to_f32(((const uint16_t *)p)[i])
           : tsr_kvf_is_i8(kt) ? (float)((const signed char *)p)[i]
                               : ((const float *)p)[i];
}

#endif
