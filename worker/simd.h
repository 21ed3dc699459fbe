/* simd.h: the 8-float vectors the CPU kernels are written with (GCC vector
 * extensions; AVX2 where the function is compiled for it, two SSE halves
 * elsewhere).  Header-only, for the CPU kernels: worker/matmul_f32.c,
 * worker/engine_cpu.c, worker/attention_cpu.c, worker/kv_format.c and
 * worker/sample.c (gcc's alone: the fuzz build compiles them with gcc). */
#ifndef TSR_SIMD_H
#define TSR_SIMD_H

#include <string.h>

/* The vectors never cross a call boundary that is not inlined (all
 * always_inline, so an -O0 build inlines them into the AVX2 kernels too),
 * so the note GCC gives on the AVX argument ABI for them is moot:
 * the Makefile turns it off (-Wno-psabi; no pragma reaches that note). */
typedef float v8f __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8f load8(const float *p)
{
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef int v8i __attribute__((vector_size(32)));

/* x in all 8 lanes.  As a shuffle: GCC makes that one vbroadcastss in
 * AVX2 clones, where the 8-element initialiser became 9 inserts. */
static inline __attribute__((always_inline)) v8f bcast8(float x)
{
    return __builtin_shuffle((v8f){x}, (v8i){0, 0, 0, 0, 0, 0, 0, 0});
}

/* The lanes summed in one fixed order. */
static inline __attribute__((always_inline)) float hsum8(v8f a)
{
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* Sums of neighbouring lanes, as x86's vhaddps forms them: [a0 + a1, a2 +
 * a3, b0 + b1, b2 + b3, a4 + a5, a6 + a7, b4 + b5, b6 + b7]. */
static inline __attribute__((always_inline)) v8f hadd8(v8f a, v8f b)
{
    const v8i even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* exp(x) for x <= 0 in all lanes: x = n ln 2 + r with |r| <= ln 2 / 2,
 * e^r by its Taylor series to r^7 (truncation below 1e-8 relative), 2^n
 * put into the exponent bits.  Inputs below -87 give about 1e-38, not 0:
 * a softmax weight beside the maximum's 1, it is nothing. */
static inline __attribute__((always_inline)) v8f exp8(v8f x)
{
    const v8f lo = bcast8(-87.0f), round = bcast8(12582912.0f);   /* 1.5 * 2^23 */
    v8i below = x < lo;
    x = (v8f)((below & (v8i)lo) | (~below & (v8i)x));
    const v8f n = (x * bcast8(1.44269504f) + round) - round;
    const v8f r = (x - n * bcast8(0.693359375f)) - n * bcast8(-2.12194440e-4f);
    v8f p = bcast8(1.0f / 5040);
    p = p * r + bcast8(1.0f / 720);
    p = p * r + bcast8(1.0f / 120);
    p = p * r + bcast8(1.0f / 24);
    p = p * r + bcast8(1.0f / 6);
    p = p * r + bcast8(0.5f);
    p = p * r + bcast8(1.0f);
    p = p * r + bcast8(1.0f);
    const v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8f)e;
}

#endif
