/* fp8.h: the 8-bit float of FP8 checkpoints, E4M3 in its "FN" form (1 sign
 * bit, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, the one
 * NaN pattern S.1111.111; largest finite 448, smallest subnormal 2^-9), as
 * safetensors' F8_E4M3 holds it.
 *
 * Header-only and `__host__ __device__` under nvcc (common/draw.h's
 * TSR_HD): the checkpoint reader (common/safetensors.c) widens it on the
 * CPU, worker/kmath.h gives it to the CUDA kernels, and
 * tests/cuda/test_kmath.cu checks both ways on the host. */
#ifndef TSR_FP8_H
#define TSR_FP8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/draw.h"

/* Exact: every E4M3 value is a float. */
static inline TSR_HD float tsr_e4m3_to_f32(uint8_t v)
{
    const uint32_t sign = (uint32_t)(v & 0x80u) << 24, exp = (v >> 3) & 0xfu, man = v & 0x7u;
    uint32_t u;
    if (exp == 0xf && man == 0x7) {
        u = sign | 0x7fc00000u;                      /* NaN */
    } else if (exp) {
        u = sign | ((exp + 120u) << 23) | (man << 20);   /* 2^(exp-7) x 1.man */
    } else if (!man) {
        u = sign;                                     /* +-0 */
    } else {                                          /* subnormal: man x 2^-9 */
        float f = (float)man * 0.001953125f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* f to the nearest E4M3, ties to even; beyond 448 in magnitude saturated
 * to +-448 (an FP8 quantizer scales so that nothing lies beyond); a NaN
 * stays a NaN. */
static inline TSR_HD uint8_t tsr_f32_to_e4m3(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);   /* NaN */
    float m;
    memcpy(&m, &a, sizeof m);
    if (m >= 464.0f) return (uint8_t)(sign | 0x7eu);        /* 448 and beyond: the largest */
    if (m < 0.015625f) {                                    /* below 2^-6: subnormal steps of 2^-9 */
        const float q = rintf(m * 512.0f);                  /* exact scaling, ties to even */
        return (uint8_t)(sign | (uint8_t)q);                /* 8 (= 2^-6) rounds up into normals */
    }
    /* normal: keep 3 mantissa bits, rounding the 20 below to nearest even */
    uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
    const uint32_t exp = (r >> 23) - 120u, man = (r >> 20) & 0x7u;
    return (uint8_t)(sign | (uint8_t)(exp << 3) | (uint8_t)man);
}

#endif
