/* cpu_pool.h: one pool of threads for a whole forward step of the CPU engine.
 *
 * Why: the engine once made ~57 small OpenBLAS calls per decoded token, and
 * OpenBLAS threads woke and slept around each (20% of worker time went to
 * sched_yield).  The pool's threads stay awake across a step, and its own
 * product (tsr_pool_matmul) splits each matrix between them.
 *
 * Threads: the caller's thread is one of the pool's threads; n-1 helpers
 * are started.  A helper spins for a short while after its work (so back to
 * back calls cost no system call), then sleeps on a futex.
 *
 * Thread safety: a pool serves one caller at a time; tsr_pool_for and
 * tsr_pool_matmul are not reentrant (fn must not call back into the pool).
 * Two engines in one process need two pools, or a lock around the calls. */
#ifndef TSR_CPU_POOL_H
#define TSR_CPU_POOL_H

#include <stddef.h>

typedef struct tsr_pool tsr_pool_t;

/* A pool of n_threads threads, the caller's included (n_threads-1 helpers
 * are started).  n_threads <= 0: $TSR_THREADS if set, else the number of
 * CPUs this process may run on (sched_getaffinity).
 * Returns NULL on failure (no thread could be started, no memory); caller
 * owns the pool and frees it with tsr_pool_destroy. */
tsr_pool_t *tsr_pool_new(int n_threads);
/* The build of the CPU kernels this process runs: the products here and the
 * engine's attention.  The best the CPU has (AVX-512 for the products of 4
 * rows or more, with AVX2+FMA for the rest and for attention; AVX2+FMA; the
 * portable build), unless TSR_CPU_KERNELS is "avx2" (no AVX-512) or "plain"
 * (the portable build), for tests and for comparing ("avx512" and "amx"
 * give the best there is here; other values are warned about and ignored).
 * AMX serves the bf16 products alone (worker/matmul_bf16.h): unset or
 * "amx" allows it, any other value, "avx512" included, turns it off.
 * The AVX-512 and AVX2 builds give the same bits (one fused multiply-add
 * chain per output); the portable one rounds each product where the
 * compiler does not fuse them.  Asked once per process; the same answer
 * for every caller. */
typedef enum { TSR_KERNELS_PLAIN, TSR_KERNELS_AVX2, TSR_KERNELS_AVX512 } tsr_cpu_kernels_t;
tsr_cpu_kernels_t tsr_cpu_kernels(void);
/* "plain", "avx2" or "avx512". */
const char *tsr_cpu_kernels_name(tsr_cpu_kernels_t k);

/* Stops and joins the helpers, frees the pool, sets *p_p NULL.  NULL-safe
 * (p_p NULL or *p_p NULL).  Must not run while a call is in progress. */
void tsr_pool_destroy(tsr_pool_t **p_p);

/* Threads in the pool, the caller's included (>= 1). */
int tsr_pool_threads(const tsr_pool_t *p);

/* Runs fn(arg, i) for every i in [0, n), each exactly once, spread over the
 * pool's threads and the calling thread; returns when all calls are done.
 * Indices are handed out as they are claimed, so a helper that wakes late
 * finds less to do instead of holding the caller up.  n <= 0 does nothing.
 * Not reentrant: one caller at a time, and fn must not call into the pool. */
void tsr_pool_for(tsr_pool_t *p, int n, void (*fn)(void *arg, int i), void *arg);

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

/* How long a helper spins for new work before it sleeps (default
 * TSR_POOL_SPIN_US).  0 makes helpers sleep at once (useful to measure the
 * futex path).  Call between jobs only. */
void tsr_pool_set_spin_us(tsr_pool_t *p, int us);

/* 50 us rather than a few: it has to outlast the caller's single-threaded
 * work between two products (norms, RoPE, attention at short contexts) or
 * every product starts with helpers asleep.  Measured on a 2-core EPYC VM
 * (bench/bench_pool, a shared host): helpers asleep at each call cost a
 * decode step of 48 products 0.3-1.7 ms (2-13%); spinning, a handoff costs
 * the caller 0.2-0.3 us.  The price is at most 50 us of each helper's CPU
 * after the last product. */
#define TSR_POOL_SPIN_US 50

#endif
