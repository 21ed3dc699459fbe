/* matmul_f32.h: the CPU engine's products with f32 weights (the default
 * matmul_dtype), the weights packed in panels of 16 rows and each product
 * split across the threads of a pool (worker/cpu_pool.h).  The panel layout
 * and the walk of the AVX-512 tiles here serve the bf16 products too
 * (worker/matmul_bf16.h).
 *
 * Thread safety: as the pool's, one caller at a time per pool. */
#ifndef TSR_MATMUL_F32_H
#define TSR_MATMUL_F32_H

#include <stddef.h>

#include "worker/cpu_pool.h"

/* Weights for tsr_pool_matmul are packed in panels of TSR_PANEL rows:
 * panel p holds rows [16p, 16p + 16) of W[out, in] column by column
 * (wp[(p * in + k) * 16 + r] = W[16p + r][k]), the last panel padded with
 * zeros.  The 16 weights that meet one input are one cache line, and each
 * panel is read as one sequential stream. */
#define TSR_PANEL 16

/* Floats a packed W[out, in] takes (out rounded up to a whole panel);
 * 0 when out or in is not positive. */
size_t tsr_packed_floats(int out, int in);

/* Packs n rows of W (row-major, in floats each) as rows row0 .. row0+n-1
 * of the packed wp; rows outside [0, out) are skipped.  A matrix can be
 * packed in pieces (q, k and v into one fused matrix, a large one a block
 * of rows at a time). */
void tsr_pack_rows(float *wp, int out, int in, int row0, const float *rows, int n);

/* Zeroes the padding of the last panel (rows out .. the next multiple of
 * 16).  Call once per packed matrix. */
void tsr_pack_clear_tail(float *wp, int out, int in);

/* Row `row` of a packed W into dst[in] (an embedding lookup from a packed
 * table). */
void tsr_packed_row(const float *wp, int in, int row, float *dst);

/* How the AVX-512 builds of the products (f32 here, bf16 in
 * worker/matmul_bf16.c) walk a chunk of panels: T rows in tiles of at
 * most 12, of heights that differ by one at most, over groups of panels
 * side by side, as many as 24 accumulators allow (4 up to 6 rows, 3 up to
 * 8, else 2: more streams from memory for a step of few decodes). */
static inline int tsr_tile_group(int T) { return T <= 6 ? 4 : T <= 8 ? 3 : 2; }

/* With several tiles over one group, tile ti of tiles asks for its share
 * of the next group's lines (group_lines a panel of it, next_np panels of
 * the chunk, 0 to G) into L2 while it computes: lines [*first, *first +
 * return) from the next group's start; 0 when there is no next group in
 * the chunk or one tile only.  *own: the tile asks for its own group's
 * lines ahead, as nobody fetched them (the chunk's first group, or a
 * single tile). */
static inline size_t tsr_tile_fetch_share(int next_np, size_t panel_lines, int tiles, int ti,
                                          int first_group, int *own, size_t *first)
{
    const size_t n = tiles > 1 && next_np > 0 ? (size_t)next_np * panel_lines : 0;
    *own = ti == 0 && (first_group || tiles == 1);
    *first = n * ti / tiles;
    return n * (ti + 1) / tiles - *first;
}

/* y[T, out] = x[T, in] . W[out, in]^T (f32), W packed (above), split
 * across the threads by chunks of panels.  Every output is one
 * multiply-add chain over k = 0 .. in-1 in order, whichever tile, token
 * block or thread it falls in, so a row of y does not depend on T or on
 * the other rows of x: a sequence gets the same numbers whatever it is
 * batched with.  AVX2+FMA where the CPU has them.  ldy is y's row stride
 * (>= out), so the caller can write into a column range of a wider matrix;
 * columns of y outside [0, out) are not touched.  x and y must not
 * overlap.  Products too small to pay for a wake-up run on the calling
 * thread alone. */
void tsr_pool_matmul(tsr_pool_t *p, float *y, int ldy, const float *x, const float *wp, int T,
                     int in, int out);

#endif
