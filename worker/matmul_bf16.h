/* matmul_bf16.h: the CPU engine's products with bf16 weights (deployment key
 * matmul_dtype: bf16), on Intel AMX where the CPU has it, else with
 * AVX512-BF16 where it has that.
 *
 * Why: on 2 cores the f32 products cap a batched step near 180 GFLOP/s; one
 * core's AMX tiles multiply bf16 at several hundred GFLOP/s, so a step of
 * many sequences costs little more than its weight bytes, and those bytes
 * are half the f32 ones.
 *
 * Numbers: the weights are rounded to bf16 (to nearest even) when packed,
 * and each product rounds its input rows x to bf16 the same way; products
 * accumulate in f32.  AMX adds a tile's 32 products in its own order and
 * precision, which no IEEE sequence reproduces, so the other builds (a CPU
 * without AMX, or TSR_CPU_KERNELS set to anything but "amx") give results
 * that differ from it in the last bits.  Those builds, AVX512-BF16's and
 * the portable one, add each column pair's two products to an f32 chain
 * over the pairs in order, odd column first, and agree with each other but
 * where a subnormal is involved.  Within one build every
 * output depends on its own row of x alone, whatever T and the other rows
 * are (batch invariance, test_matmul_bf16).
 *
 * Layout: panels of 16 rows of W[out, in] (TSR_PANEL, worker/matmul_f32.h),
 * each holding pairs of columns: wb[((p * kp + j) * 16 + r) * 2 + e] =
 * bf16(W[16p + r][2j + e]) with kp = tsr_bf16_in_padded(in) / 2, zero past
 * in and past out.  One 1 KiB block of a panel (16 pairs of columns) is one
 * AMX B tile. */
#ifndef TSR_MATMUL_BF16_H
#define TSR_MATMUL_BF16_H

#include <stddef.h>
#include <stdint.h>

#include "worker/cpu_pool.h"

/* in rounded up to a whole AMX tile's depth (32 columns); 0 when in <= 0. */
int tsr_bf16_in_padded(int in);

/* bf16 elements a packed W[out, in] takes (out rounded up to 16, in to 32);
 * 0 when out or in is not positive. */
size_t tsr_bf16_packed_elems(int out, int in);

/* Packs n rows of W (row-major f32, in floats each), rounded to bf16, as
 * rows row0 .. row0+n-1 of wb; rows outside [0, out) are skipped.  wb must
 * start zeroed (the padding is never written). */
void tsr_bf16_pack_rows(uint16_t *wb, int out, int in, int row0, const float *rows, int n);

/* Row `row` of a packed wb, widened, into dst[in]. */
void tsr_bf16_packed_row(const uint16_t *wb, int in, int row, float *dst);

/* y[T, out] = bf16(x)[T, in] . W[out, in]^T, accumulated in f32, split
 * across the pool's threads by groups of panels.  ldy >= out is y's row
 * stride; columns outside [0, out) are not touched; x and y must not
 * overlap.  xb is the caller's scratch for the rounded rows of x, at least
 * T * tsr_bf16_in_padded(in) elements on a 64-byte boundary. */
void tsr_pool_matmul_bf16(tsr_pool_t *p, float *y, int ldy, const float *x, uint16_t *xb,
                          const uint16_t *wb, int T, int in, int out);

/* d[0..n) = bf16(x[0..n)), as tsr_k_f32_to_bf16 rounds each (to nearest
 * even, a NaN kept a NaN): the rounding of a product's input rows. */
void tsr_bf16_round_row(uint16_t *d, const float *x, int n);

/* 1 when this process multiplies bf16 on AMX: the CPU has AMX-BF16, the
 * kernel granted the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), and
 * TSR_CPU_KERNELS is unset or "amx".  Asked once per process. */
int tsr_cpu_amx(void);

/* 1 when this process multiplies bf16 with AVX512-BF16's VDPBF16PS: no
 * AMX, the AVX-512 kernels (tsr_cpu_kernels), and a CPU with AVX512-BF16.
 * Its products have the portable build's bits but where a subnormal is
 * involved (the instruction takes and gives those as 0). */
int tsr_cpu_avx512bf16(void);

/* The build of the bf16 products this process runs, as logs and
 * benchmarks name it: "AMX", "AVX512-BF16" or "portable build". */
const char *tsr_bf16_products_name(void);

#endif
