/* matmul_f32.c: the f32 products y = x . W^T on the pool's threads, W packed
 * in panels of 16 rows (matmul_f32.h), each in a portable, an AVX2+FMA and
 * an AVX-512 build (worker/cpu_kernels.h says which runs). */
#include "worker/matmul_f32.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <string.h>

#include "worker/cpu_kernels.h"
#include "worker/simd.h"

/* Below about this many multiply-adds per chunk a product runs on the
 * caller alone: 16K MACs read 64 KiB of weights, 1-4 us, and under that
 * the handoff (~0.3 us with helpers spinning, bench_pool) plus the helpers'
 * misses on x and y stop being small next to the work. */
#define MIN_MACS_PER_CHUNK 16384
#define CHUNK_BYTES (256 << 10)

/* W is packed in panels of TSR_PANEL rows (see matmul_f32.h): panel p holds
 * rows [16p, 16p + 16) column by column, so the 16 weights that meet one
 * input x[k] are one 64-byte line, and a panel is one sequential stream.
 * The kernel is an outer product: a tile of up to 6 rows of x by one panel,
 * 12 accumulators of 8 lanes; at each k it broadcasts x[t][k] for the tile's
 * rows and multiplies-adds the panel's line into them.  Every output is
 * then one multiply-add chain over k = 0, 1, ..., in-1, whichever tile, token
 * block or thread it falls in, so a row of y does not depend on T or on the
 * other rows of x (batch invariance), without a horizontal sum. */

static inline void store_tile_row(float *y, v8f a, v8f b, int no)
{
    if (no == TSR_PANEL) {
        memcpy(y, &a, sizeof a);
        memcpy(y + 8, &b, sizeof b);
        return;
    }
    float s[TSR_PANEL];
    memcpy(s, &a, sizeof a);
    memcpy(s + 8, &b, sizeof b);
    memcpy(y, s, (size_t)no * sizeof(float));
}

/* R rows of x by NP adjacent panels (R and NP constants after inlining,
 * R * NP <= 6): 2 * R * NP accumulators of 8 lanes, at most 12, with room
 * left in the 16 vector registers for a weight line and the broadcast.  For
 * a few rows (decode) several panels are read side by side: a core keeps
 * more reads in flight over several sequential streams than over one
 * (bench/stream --read on a 2-core EPYC VM: 17 GB/s with one stream per
 * thread, 27 GB/s with four).  Only the group's last panel may be partial
 * (no columns).  Every output is one multiply-add chain over k in order,
 * whatever R and NP are. */
#define TILE_FN(NAME, ATTR, MADD, BCAST)                                                       \
    ATTR static inline __attribute__((always_inline)) void NAME(                               \
        float *y, int ldy, const float *x, int in, const float *wp, size_t pf, int no,       \
        const int R, const int NP)                                                             \
    {                                                                                          \
        const size_t ps = (size_t)TSR_PANEL * in;                                              \
        v8f acc[6][4][2];                                                                      \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                                    \
        _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)                                   \
            acc[r][j][0] = acc[r][j][1] = bcast8(0.0f);                                        \
        for (size_t k = 0; k < (size_t)in; k++) {                                              \
            const float *wk = wp + k * TSR_PANEL;                                              \
            __builtin_prefetch(wk + pf, 0, 1); /* prefetcht2: L2 on AMD */                    \
            v8f lo[4], hi[4];                                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)                               \
                lo[j] = load8(wk + j * ps), hi[j] = load8(wk + j * ps + 8);                    \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                              \
                const v8f s = BCAST(x + (size_t)r * in + k);                                   \
                _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)                           \
                    acc[r][j][0] = MADD(lo[j], s, acc[r][j][0]),                               \
                    acc[r][j][1] = MADD(hi[j], s, acc[r][j][1]);                               \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                                    \
        _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)                                   \
            store_tile_row(y + (size_t)r * ldy + j * TSR_PANEL, acc[r][j][0], acc[r][j][1],    \
                           j == NP - 1 ? no : TSR_PANEL);                                      \
    }

/* Panels [p0, p1) for T rows of x.  One to three rows (decode) go in one
 * pass over groups of 4, 3 or 2 panels; more go in tiles of 6 rows by one
 * panel, the first tile of a panel prefetching the next panel line by
 * line into L2 (into L1 a panel ahead is too far: on a 2-core EPYC VM
 * with AVX-512, 8 rows took 20 % longer that way, bench_pool), so the
 * weights come from memory while the tile computes. */
#define PANELS_FN(NAME, TILE, ATTR)                                                            \
    ATTR static void NAME(float *y, int ldy, const float *x, const float *wp, int T, int in,   \
                          int out, int p0, int p1)                                             \
    {                                                                                          \
        if (T <= 3) {                                                                          \
            const int G = T == 1 ? 4 : T == 2 ? 3 : 2;                                         \
            for (int p = p0; p < p1; p += G) {                                                 \
                const int np = p1 - p < G ? p1 - p : G, last = (p + np - 1) * TSR_PANEL;       \
                const int no = out - last < TSR_PANEL ? out - last : TSR_PANEL;                \
                const float *w = wp + (size_t)p * TSR_PANEL * in;                              \
                float *yp = y + (size_t)p * TSR_PANEL;                                         \
                switch (T * 8 + np) {                                                          \
                case 8 + 1: TILE(yp, ldy, x, in, w, 0, no, 1, 1); break;                       \
                case 8 + 2: TILE(yp, ldy, x, in, w, 0, no, 1, 2); break;                       \
                case 8 + 3: TILE(yp, ldy, x, in, w, 0, no, 1, 3); break;                       \
                case 8 + 4: TILE(yp, ldy, x, in, w, 0, no, 1, 4); break;                       \
                case 16 + 1: TILE(yp, ldy, x, in, w, 0, no, 2, 1); break;                      \
                case 16 + 2: TILE(yp, ldy, x, in, w, 0, no, 2, 2); break;                      \
                case 16 + 3: TILE(yp, ldy, x, in, w, 0, no, 2, 3); break;                      \
                case 24 + 1: TILE(yp, ldy, x, in, w, 0, no, 3, 1); break;                      \
                default: TILE(yp, ldy, x, in, w, 0, no, 3, 2); break;                          \
                }                                                                              \
            }                                                                                  \
            return;                                                                            \
        }                                                                                      \
        for (int p = p0; p < p1; p++) {                                                        \
            const float *w = wp + (size_t)p * TSR_PANEL * in;                                  \
            const int o = p * TSR_PANEL, no = out - o < TSR_PANEL ? out - o : TSR_PANEL;       \
            /* the next panel, while there is one in this chunk */                          \
            size_t pf = p + 1 < p1 ? (size_t)TSR_PANEL * in : 0;                               \
            for (int t = 0; t < T; t += 6, pf = 0) {                                           \
                float *yt = y + (size_t)t * ldy + o;                                           \
                const float *xt = x + (size_t)t * in;                                          \
                switch (T - t) {                                                               \
                case 1: TILE(yt, ldy, xt, in, w, pf, no, 1, 1); break;                         \
                case 2: TILE(yt, ldy, xt, in, w, pf, no, 2, 1); break;                         \
                case 3: TILE(yt, ldy, xt, in, w, pf, no, 3, 1); break;                         \
                case 4: TILE(yt, ldy, xt, in, w, pf, no, 4, 1); break;                         \
                case 5: TILE(yt, ldy, xt, in, w, pf, no, 5, 1); break;                         \
                default: TILE(yt, ldy, xt, in, w, pf, no, 6, 1); break;                        \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

#define MADD_PLAIN(a, b, c) ((a) * (b) + (c))
#define BCAST_PLAIN(p) bcast8(*(p))
TILE_FN(tile_generic, , MADD_PLAIN, BCAST_PLAIN)
PANELS_FN(panels_generic, tile_generic, )
#if defined(__x86_64__)
#define MADD_FMA(a, b, c) __builtin_ia32_vfmaddps256((a), (b), (c))
#define BCAST_AVX(p) __builtin_ia32_vbroadcastss256(p)
TILE_FN(tile_fma, __attribute__((target("avx2,fma"))), MADD_FMA, BCAST_AVX)
PANELS_FN(panels_fma, tile_fma, __attribute__((target("avx2,fma"))))
#endif

#if defined(__x86_64__)
/* The AVX-512 build, for 4 rows of x or more: a panel's 16 columns are one
 * 16-lane register, so a tile of up to 12 rows by 2 adjacent panels keeps
 * its 24 accumulators in the 32 registers.  Up to 12 rows then read each
 * weight line from memory once (the AVX2 tile is 6 rows high), from two
 * sequential streams, each asked for 8 lines ahead into L2.  Every output
 * is the same multiply-add chain over k as in the AVX2 build, so the two
 * give the same bits (test_cpu_pool); decodes of 1 to 3 rows, bound by
 * memory, keep the AVX2 path.  Up to 6 rows read 4 panels side by side
 * and 7 or 8 rows 3 (24 accumulators at most), as more streams draw more
 * from memory: a step of 4 sequences of the 58M model took 3.42-3.47 ms
 * against 4.10-4.23 with 2 panels (bench/engine_step, 2 Zen 5 cores).
 *
 * More than 12 rows take several tiles over the same two panels: the first
 * reads them from memory, the others from L2.  So that memory is not idle
 * while those compute, the tiles of a group share out the next group's
 * lines and ask for them into L2, evenly over their k loops (nx lines over
 * `in` steps); only the chunk's first group, which no tile fetched ahead,
 * asks for its own lines.  A 32-row step of a 302 MB stack of products
 * (bench/bench_pool, 2 cores of an AMD EPYC VM with AVX-512) went from
 * 15.7-16.1 to 13.8-14.4 ms, and 32 serving streams from 1,698-1,728 to
 * 1,917-1,926 tokens/s. */
#define TILE512_ROWS 12
#define TILE512_PREFETCH (8 * TSR_PANEL)
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void tile512(
    float *y, int ldy, const float *x, int in, const float *wp, int no, int own, const float *nx,
    size_t nx_lines, const int R, const int NP)
{
    const size_t ps = (size_t)TSR_PANEL * in;
    size_t due = 0;   /* nx_lines per `in` steps, as a running remainder */
    __m512 acc[TILE512_ROWS][4];
    _Pragma("GCC unroll 12") for (int r = 0; r < R; r++)
    _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)
        acc[r][j] = _mm512_setzero_ps();
    for (size_t k = 0; k < (size_t)in; k++) {
        const float *wk = wp + k * TSR_PANEL;
        __m512 w[4];
        _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++) {
            if (own && k + TILE512_PREFETCH / TSR_PANEL < (size_t)in)   /* within the panel */
                _mm_prefetch((const char *)(wk + j * ps + TILE512_PREFETCH), _MM_HINT_T1);
            w[j] = _mm512_loadu_ps(wk + j * ps);
        }
        for (due += nx_lines; due >= (size_t)in; due -= (size_t)in, nx += TSR_PANEL)
            _mm_prefetch((const char *)nx, _MM_HINT_T1);
        _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_set1_ps(x[(size_t)r * in + k]);
            _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++)
                acc[r][j] = _mm512_fmadd_ps(w[j], s, acc[r][j]);
        }
    }
    _Pragma("GCC unroll 12") for (int r = 0; r < R; r++)
    _Pragma("GCC unroll 4") for (int j = 0; j < NP; j++) {
        float *yr = y + (size_t)r * ldy + j * TSR_PANEL;
        if (j < NP - 1 || no == TSR_PANEL) _mm512_storeu_ps(yr, acc[r][j]);
        else _mm512_mask_storeu_ps(yr, (__mmask16)((1u << no) - 1), acc[r][j]);
    }
}

#define TILE512_CASE(R)                                                                        \
    case R:                                                                                    \
        switch (np) { /* rows x panels <= 24 accumulators */                                 \
        case 4: if (R <= 6) tile512(yt, ldy, xt, in, w, no, own, nx, nx_lines, R, 4); break;   \
        case 3: if (R <= 8) tile512(yt, ldy, xt, in, w, no, own, nx, nx_lines, R, 3); break;   \
        case 2: tile512(yt, ldy, xt, in, w, no, own, nx, nx_lines, R, 2); break;               \
        default: tile512(yt, ldy, xt, in, w, no, own, nx, nx_lines, R, 1); break;              \
        }                                                                                      \
        break;

/* Panels [p0, p1) G at a time; the T rows in as few tiles of at most 12
 * as there can be, of heights that differ by one at most (8 rows are one
 * tile, 14 are 7 and 7). */
__attribute__((target("avx512f"))) static void panels_avx512(float *y, int ldy, const float *x,
                                                             const float *wp, int T, int in,
                                                             int out, int p0, int p1)
{
    if (T <= 3) {
        panels_fma(y, ldy, x, wp, T, in, out, p0, p1);
        return;
    }
    const int tiles = (T + TILE512_ROWS - 1) / TILE512_ROWS, G = tsr_tile_group(T);
    for (int p = p0; p < p1; p += G) {
        const int np = p1 - p < G ? p1 - p : G, last = (p + np - 1) * TSR_PANEL;
        const int no = out - last < TSR_PANEL ? out - last : TSR_PANEL;
        const int next_np = p1 - (p + G) < G ? p1 - (p + G) : G;
        const float *w = wp + (size_t)p * TSR_PANEL * in;
        for (int t = 0, left = tiles, r, ti = 0; t < T; t += r, left--, ti++) {
            r = (T - t + left - 1) / left;
            float *yt = y + (size_t)t * ldy + (size_t)p * TSR_PANEL;
            const float *xt = x + (size_t)t * in;
            int own;
            size_t l0;
            const size_t nx_lines = tsr_tile_fetch_share(next_np, in, tiles, ti, p == p0, &own, &l0);
            /* a pointer into the next group only when there is one */
            const float *nx = nx_lines ? w + ((size_t)G * in + l0) * TSR_PANEL : w;
            switch (r) {   /* r >= 4: T >= 4, and past 12 rows the tiles are at least 6 */
                TILE512_CASE(4)
                TILE512_CASE(5) TILE512_CASE(6) TILE512_CASE(7) TILE512_CASE(8)
                TILE512_CASE(9) TILE512_CASE(10) TILE512_CASE(11)
                default: TILE512_CASE(12)
            }
        }
    }
}
#endif

typedef void (*panels_fn)(float *, int, const float *, const float *, int, int, int, int, int);

/* The build of panels this process runs: one choice for the process
 * (tsr_cpu_kernels), so every product computes the same way. */
static panels_fn panels_for(void)
{
#if defined(__x86_64__)
    switch (tsr_cpu_kernels()) {
    case TSR_KERNELS_AVX512: return panels_avx512;
    case TSR_KERNELS_AVX2: return panels_fma;
    case TSR_KERNELS_PLAIN: break;
    }
#endif
    return panels_generic;
}

typedef struct {
    float *y;
    int ldy;
    const float *x, *wp;
    int T, in, out, chunk, panels, tblock;
    panels_fn kernel;
} matmul_job_t;

static void matmul_chunk(void *arg, int i)
{
    const matmul_job_t *j = arg;
    int p0 = i * j->chunk, p1 = p0 + j->chunk < j->panels ? p0 + j->chunk : j->panels;
    for (int t = 0; t < j->T; t += j->tblock)
        j->kernel(j->y + (size_t)t * j->ldy, j->ldy, j->x + (size_t)t * j->in, j->wp,
                  j->T - t < j->tblock ? j->T - t : j->tblock, j->in, j->out, p0, p1);
}

void tsr_pool_matmul(tsr_pool_t *p, float *y, int ldy, const float *x, const float *wp, int T,
                     int in, int out)
{
    if (T <= 0 || out <= 0) return;
    if (in < 0) in = 0;
    const int panels = (out + TSR_PANEL - 1) / TSR_PANEL;
    /* At least 4 chunks per thread, so late wakers even out, and none over
     * CHUNK_BYTES of weights: the pool hands out chunks in shrinking claims
     * (cpu_pool.c's run_job), so the last claim, which a thread that finishes first
     * waits for, is one small chunk even on the LM head. */
    const int threads = tsr_pool_threads(p);
    int chunk = (panels + 4 * threads - 1) / (4 * threads);
    int cap = (int)(CHUNK_BYTES / ((size_t)TSR_PANEL * (in > 0 ? in : 1) * sizeof(float)));
    cap = cap < 4 ? 4 : cap / 4 * 4;   /* whole groups of the decode path's 4 panels */
    if (chunk > cap) chunk = cap;
    /* Token blocks whose rows of x stay in L2 (256 KiB of them) while the
     * chunk's panels stream by, a multiple of both builds' tile heights (6
     * and 12 rows), and one whole AVX-512 tile at least, so that up to 12
     * rows read each weight once however long the rows are. */
    int tblock = in > 0 ? (int)((256 << 10) / ((size_t)in * sizeof(float))) / 12 * 12 : T;
    if (tblock < 12) tblock = 12;
    /* Too small to pay for a wake-up: on the calling thread alone. */
    if ((long long)T * in * out < 2LL * MIN_MACS_PER_CHUNK) chunk = panels;
    if (chunk < 1) chunk = 1;
    matmul_job_t j = {y, ldy, x, wp, T, in, out, chunk, panels, tblock, panels_for()};
    tsr_pool_for(p, (panels + chunk - 1) / chunk, matmul_chunk, &j);
}

size_t tsr_packed_floats(int out, int in)
{
    if (out <= 0 || in <= 0) return 0;
    return (size_t)(out + TSR_PANEL - 1) / TSR_PANEL * TSR_PANEL * (size_t)in;
}

void tsr_pack_rows(float *wp, int out, int in, int row0, const float *rows, int n)
{
    for (int r = 0; r < n; r++) {
        int o = row0 + r;
        if (o < 0 || o >= out) continue;
        float *dst = wp + (size_t)(o / TSR_PANEL) * TSR_PANEL * in + o % TSR_PANEL;
        const float *src = rows + (size_t)r * in;
        for (int k = 0; k < in; k++) dst[(size_t)k * TSR_PANEL] = src[k];
    }
}

void tsr_pack_clear_tail(float *wp, int out, int in)
{
    int last = out % TSR_PANEL;
    if (!last || in <= 0) return;
    float *panel = wp + (size_t)(out / TSR_PANEL) * TSR_PANEL * in;
    for (int k = 0; k < in; k++)
        memset(panel + (size_t)k * TSR_PANEL + last, 0, (size_t)(TSR_PANEL - last) * sizeof(float));
}

void tsr_packed_row(const float *wp, int in, int row, float *dst)
{
    const float *src = wp + (size_t)(row / TSR_PANEL) * TSR_PANEL * in + row % TSR_PANEL;
    for (int k = 0; k < in; k++) dst[k] = src[(size_t)k * TSR_PANEL];
}
