/* matmul_i8.h: the CPU engine's products with int8 weights (deployment key
 * weights_dtype: int8), as integer dot products.
 *
 * Why: a decode step reads every weight once, and f32 weights are 4 bytes
 * each.  Held in int8 they are one byte, but widening each to f32 in
 * registers costs more instructions than the memory spends delivering it
 * on an AVX2 core (14 GB/s a core of int8 widened, against a DRAM bound of
 * 18 GB/s a core on this project's 2-core build machine); multiplied as
 * integers, 32 weights take four instructions.
 *
 * Numbers.  Weights: row o of W is held as integers q[o][k] in [-127, 127]
 * and one f32 scale s[o] = max_k |W[o][k]| / 127 over the whole row (every
 * column, also where a rank holds some of them); q = W / s rounded to
 * nearest, ties to even (a row of zeros: s = 0, q = 0).  An int8
 * checkpoint's rows are taken as they are, a -128 read as -127.
 * Inputs: each row of x is quantized the same way in blocks of 32 columns
 * (TSR_I8_BLOCK): d = max |x| / 127 over the block, xq = x / d rounded to
 * nearest even.  Then
 *     y[t][o] = s[o] * (the fused multiply-add chain over the blocks b in
 *               order of d[t][b] * isum[t][b][o]),
 * isum the exact integer sum of the block's 32 products xq * q (at most
 * 32 * 127 * 127 in magnitude, so exact as a float too).  Every build (the
 * portable one, AVX2, and AVX-512 VNNI; an AVX-512 CPU without VNNI runs
 * the AVX2 one) gives the same bits, and a row of y depends on its own row of x alone (batch
 * invariance).  A NaN or infinite input gives a NaN output.
 *
 * Layout: the scales (out rounded up to 16, f32), then panels of 16 rows
 * (TSR_PANEL) by in rounded up to 32 columns, in quads of 4 columns: byte
 * ((p * in32 / 4 + j) * 16 + r) * 4 + e holds q[16p + r][4j + e], zero past
 * in and past out.  A quad of a panel is one 64-byte line, its first half
 * rows 0-7 and its second rows 8-15. */
#ifndef TSR_MATMUL_I8_H
#define TSR_MATMUL_I8_H

#include <stddef.h>
#include <stdint.h>

#include "worker/cpu_pool.h"

#define TSR_I8_BLOCK 32

/* in rounded up to whole blocks; 0 when in <= 0. */
int tsr_i8_in_padded(int in);

/* Bytes a packed int8 W[out, in] takes; 0 when out or in is not positive. */
size_t tsr_i8_packed_bytes(int out, int in);

/* The scale of a row of n weights (max |w| / 127, in f32); NaN when one
 * weight is NaN, infinite when one is infinite. */
float tsr_i8_row_scale(const float *w, int n);

/* w / scale rounded to nearest (ties to even) within [-127, 127]; 0 when
 * scale is not positive. */
int8_t tsr_i8_quantize(float w, float scale);

/* Packs n rows (row r's `in` weights at rows + r * ld) as rows row0 ..
 * row0+n-1 of wq, quantized by scales[r].  wq must start zeroed. */
void tsr_i8_pack_rows(void *wq, int out, int in, int row0, const float *rows, int ld,
                      const float *scales, int n);

/* The same for rows already quantized (an int8 checkpoint): row r's `in`
 * integers at q + r * ld (as floats, in [-128, 127]; -128 is held as
 * -127) and its scale. */
void tsr_i8_pack_q_rows(void *wq, int out, int in, int row0, const float *q, int ld,
                        const float *scales, int n);

/* Row `row` of a packed wq, dequantized (q * s), into dst[in]. */
void tsr_i8_packed_row(const void *wq, int out, int in, int row, float *dst);

/* The build of the int8 products this process runs, as logs and
 * benchmarks name it: "AVX512-VNNI", "AVX2" or "portable build". */
const char *tsr_i8_products_name(void);

/* Bytes of the scratch a product of T rows of `in` columns quantizes its
 * inputs into (xs below). */
size_t tsr_i8_x_bytes(int T, int in);

/* y[T, out] = x[T, in] . W[out, in]^T with W packed (above), split across
 * the pool's threads by groups of panels; ldy >= out is y's row stride,
 * columns outside [0, out) are not touched; x and y must not overlap.  xs
 * is the caller's scratch of tsr_i8_x_bytes(T, in) bytes on a 64-byte
 * boundary. */
void tsr_pool_matmul_i8(tsr_pool_t *p, float *y, int ldy, const float *x, void *xs,
                        const void *wq, int T, int in, int out);

#endif
