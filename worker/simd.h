/* simd.h: the 8-float vectors the CPU kernels are written with (GCC vector
 * extensions; AVX2 where the function is compiled for it, two SSE halves
 * elsewhere).  Header-only, for worker/cpu_pool.c, worker/engine_cpu.c and
 * worker/sample.c (gcc's alone: the fuzz build compiles them with gcc). */
#ifndef TSR_SIMD_H
#define TSR_SIMD_H

#include <string.h>

/* The vectors never cross a call boundary that is not inlined (all static
 * inline), so the ABI note GCC gives for them is moot. */
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p)
{
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef int v8i __attribute__((vector_size(32)));

/* x in all 8 lanes.  As a shuffle: GCC makes that one vbroadcastss in
 * AVX2 clones, where the 8-element initialiser became 9 inserts. */
static inline v8f bcast8(float x)
{
    return __builtin_shuffle((v8f){x}, (v8i){0, 0, 0, 0, 0, 0, 0, 0});
}

/* The lanes summed in one fixed order. */
static inline float hsum8(v8f a)
{
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

#endif
