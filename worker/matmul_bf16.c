/* matmul_bf16.c: products of f32 rows by bf16 weight panels, on AMX tiles
 * where the CPU has them (see matmul_bf16.h for the layout and the numbers).
 *
 * Two AMX kernels, both with 4 accumulator tiles (C, 16 rows by 16 f32
 * outputs each):
 *   amx_group, up to 16 rows: one tile of x (A: 16 rows by 32 bf16) meets
 *     the weight blocks (B: 16 pairs of columns by 16 outputs, one 1 KiB
 *     block of a panel) of 4 adjacent panels;
 *   amx_pair, 17 to 32 rows: two A tiles (rows 0-15 and 16-31) meet two B
 *     tiles, so each weight block is loaded once for 32 rows.  With whole
 *     tiles stored straight into y, a 1536 x 512 product of 128 rows on one
 *     core with the weights in cache went from 0.23 to 0.18-0.21 ms
 *     (bench/matmul --threads 1 --out 1536 --in 512 measures it).
 * Longer batches go 32 rows at a time, a last 1-16 through amx_group; a
 * panel group's weights stream from memory once for the first 32 rows and
 * come from L2 for the next. */
#include "worker/matmul_bf16.h"

#include <stdalign.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "worker/cpu_kernels.h"
#include "worker/kmath.h"
#include "worker/matmul_f32.h"

#define KDEPTH 32                   /* bf16 columns per A tile row */
#define GROUP 4                     /* panels per pass (C tiles) */
/* As tsr_pool_matmul: small products stay on the caller, and no claim
 * covers much more than 256 KiB of weights. */
#define MIN_MACS 32768
#define CHUNK_BYTES (256 << 10)

int tsr_bf16_in_padded(int in)
{
    return in > 0 ? (in + KDEPTH - 1) / KDEPTH * KDEPTH : 0;
}

size_t tsr_bf16_packed_elems(int out, int in)
{
    if (out <= 0 || in <= 0) return 0;
    return (size_t)(out + TSR_PANEL - 1) / TSR_PANEL * TSR_PANEL * (size_t)tsr_bf16_in_padded(in);
}

/* Elements in one panel: in_padded / 2 pairs of 16 outputs by 2. */
static size_t panel_elems(int in)
{
    return (size_t)tsr_bf16_in_padded(in) * TSR_PANEL;
}

/* Where W[row][k] lies in a packed matrix of `in` columns (the header's
 * formula). */
static size_t packed_index(int in, int row, int k)
{
    return (size_t)(row / TSR_PANEL) * panel_elems(in) + (size_t)(k / 2) * 2 * TSR_PANEL +
           (size_t)(row % TSR_PANEL) * 2 + (size_t)(k & 1);
}

void tsr_bf16_pack_rows(uint16_t *wb, int out, int in, int row0, const float *rows, int n)
{
    for (int r = 0; r < n; r++) {
        int o = row0 + r;
        if (o < 0 || o >= out) continue;
        for (int k = 0; k < in; k++)
            wb[packed_index(in, o, k)] = tsr_k_f32_to_bf16(rows[(size_t)r * in + k]);
    }
}

void tsr_bf16_packed_row(const uint16_t *wb, int in, int row, float *dst)
{
    for (int k = 0; k < in; k++) dst[k] = tsr_k_bf16_to_f32(wb[packed_index(in, row, k)]);
}

/* ---- AMX ------------------------------------------------------------------------ */

#if defined(__x86_64__)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_cfg_t;

/* Rows the calling thread's tile configuration has (0: none loaded yet):
 * 1-16 the one-row-block layout (amx_group), 17-32 the two-row-block
 * layout (amx_pair).  The configuration is the thread's register state:
 * each pool thread loads its own, and again only when a row block's height
 * changes. */
static __thread int amx_rows;

AMX static void amx_config(int rows)
{
    if (amx_rows == rows) return;
    amx_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < (rows <= 16 ? 7 : 8); t++) c.colsb[t] = 64;
    if (rows <= 16) {
        for (int t = 0; t <= 4; t++) c.rows[t] = (uint8_t)rows;    /* C0-3, A */
        c.rows[5] = c.rows[6] = 16;                                  /* B */
    } else {
        const uint8_t r1 = (uint8_t)(rows - 16);
        c.rows[0] = c.rows[1] = 16, c.rows[2] = c.rows[3] = r1;      /* C: 2 row blocks x 2 panels */
        c.rows[4] = 16, c.rows[5] = r1;                              /* A0, A1 */
        c.rows[6] = c.rows[7] = 16;                                  /* B0, B1 */
    }
    /* GCC 12 does not count the whole 64 bytes as read by ldtilecfg and
     * dropped the stores to rows[] without this. */
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
    amx_rows = rows;
}

/* Gives the tile state back after a claim: a thread that keeps it dirty
 * has 8 KiB more saved at every context switch and keeps its core out of
 * the deeper idle states.  The next claim loads its configuration again. */
AMX static void amx_release(void)
{
    _tile_release();
    amx_rows = 0;
}

/* Copies the first `rows` rows and `no` columns of C tile values. */
static inline void put_tile(float *y, int ldy, const float *c, int rows, int no)
{
    for (int r = 0; r < rows; r++) memcpy(y + (size_t)r * ldy, c + r * 16, (size_t)no * sizeof(float));
}

/* Stores C tile t (`rows` rows) as columns 16q.. of y, straight when the
 * panel is whole; a last partial panel (no columns) goes through a buffer. */
#define STORE_TILE(t, yq, ldy, rows, whole, no)                                                \
    do {                                                                                       \
        if (whole) _tile_stored(t, yq, (ldy) * (int)sizeof(float));                            \
        else {                                                                                 \
            alignas(64) float c_[16 * 16];                                                     \
            _tile_stored(t, c_, 64);                                                           \
            put_tile(yq, ldy, c_, rows, no);                                                   \
        }                                                                                      \
    } while (0)

/* rows (<= 16) rows of xb (ldx bf16 a row, padding zeroed) by
 * np (1-4) adjacent panels starting at w; the last panel has no columns. */
AMX static void amx_group(float *y, int ldy, const uint16_t *xb, int ldx, const uint16_t *w,
                          size_t ps, int rows, int np, int no)
{
    amx_config(rows);
    _tile_zero(0);
    if (np > 1) _tile_zero(1);
    if (np > 2) _tile_zero(2);
    if (np > 3) _tile_zero(3);
    for (int kb = 0; kb < ldx; kb += KDEPTH) {
        _tile_loadd(4, xb + kb, ldx * 2);
        const uint16_t *b = w + (size_t)kb * TSR_PANEL;
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (np > 1) {
            _tile_loadd(6, b + ps, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (np > 2) {
            _tile_loadd(5, b + 2 * ps, 64);
            _tile_dpbf16ps(2, 4, 5);
        }
        if (np > 3) {
            _tile_loadd(6, b + 3 * ps, 64);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    STORE_TILE(0, y, ldy, rows, np > 1 || no == TSR_PANEL, no);
    if (np > 1) STORE_TILE(1, y + TSR_PANEL, ldy, rows, np > 2 || no == TSR_PANEL, no);
    if (np > 2) STORE_TILE(2, y + 2 * TSR_PANEL, ldy, rows, np > 3 || no == TSR_PANEL, no);
    if (np > 3) STORE_TILE(3, y + 3 * TSR_PANEL, ldy, rows, no == TSR_PANEL, no);
}

/* 17-32 rows of xb by np (1-4) adjacent panels, two at a time: each B tile
 * meets both row blocks' A tiles, so a weight block is read from cache
 * once per 32 rows, not once per 16.  Every output row still
 * accumulates its own A row over kb in order, as amx_group does. */
AMX static void amx_pair(float *y, int ldy, const uint16_t *xb, int ldx, const uint16_t *w,
                         size_t ps, int rows, int np, int no)
{
    amx_config(rows);
    const int r1 = rows - 16;
    const uint16_t *x1 = xb + (size_t)16 * ldx;
    for (int q = 0; q < np; q += 2) {
        const int two = q + 1 < np;
        const uint16_t *wq = w + (size_t)q * ps;
        _tile_zero(0);
        _tile_zero(2);
        if (two) {
            _tile_zero(1);
            _tile_zero(3);
        }
        for (int kb = 0; kb < ldx; kb += KDEPTH) {
            const uint16_t *b = wq + (size_t)kb * TSR_PANEL;
            _tile_loadd(4, xb + kb, ldx * 2);
            _tile_loadd(5, x1 + kb, ldx * 2);
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (two) {
                _tile_loadd(7, b + ps, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        float *y0 = y + (size_t)q * TSR_PANEL, *y1 = y0 + (size_t)16 * ldy;
        const int whole0 = q < np - 1 || no == TSR_PANEL, whole1 = q + 1 < np - 1 || no == TSR_PANEL;
        STORE_TILE(0, y0, ldy, 16, whole0, no);
        STORE_TILE(2, y1, ldy, r1, whole0, no);
        if (two) {
            STORE_TILE(1, y0 + TSR_PANEL, ldy, 16, whole1, no);
            STORE_TILE(3, y1 + TSR_PANEL, ldy, r1, whole1, no);
        }
    }
}
#endif

int tsr_cpu_amx(void)
{
    static int answer = -1;
    int a = __atomic_load_n(&answer, __ATOMIC_RELAXED);
    if (a >= 0) return a;
    a = 0;
#if defined(__x86_64__)
    const char *k = getenv("TSR_CPU_KERNELS");
    unsigned eax, ebx, ecx, edx;
    /* CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE; the kernel must
     * also agree to save the tile state for this process. */
    if ((!k || !*k || !strcmp(k, "amx")) && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) &&
        (edx >> 22 & 1u) && (edx >> 24 & 1u) &&
        syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0)
        a = 1;
#endif
    __atomic_store_n(&answer, a, __ATOMIC_RELAXED);
    return a;
}

/* ---- rounding x ----------------------------------------------------------------------- */

/* On the calling thread before the product, so it must be cheap: scalar it
 * was about 0.5 ms of a 32-sequence decode step of the 58M model. */
#if defined(__x86_64__)
__attribute__((target("avx512f"))) static void round_row_avx512(uint16_t *d, const float *x, int n)
{
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff),
                  abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000),
                  quiet = _mm512_set1_epi32(0x00400000);
    int k = 0;
    for (; k + 16 <= n; k += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(x + k));
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, quiet));
        _mm256_storeu_si256((__m256i *)(d + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    }
    for (; k < n; k++) d[k] = tsr_k_f32_to_bf16(x[k]);
}
#endif

void tsr_bf16_round_row(uint16_t *d, const float *x, int n)
{
#if defined(__x86_64__)
    if (tsr_cpu_kernels() == TSR_KERNELS_AVX512) {
        round_row_avx512(d, x, n);
        return;
    }
#endif
    for (int k = 0; k < n; k++) d[k] = tsr_k_f32_to_bf16(x[k]);
}

/* ---- the portable build ------------------------------------------------------------ */

/* One output row of one panel: a multiply-add chain over the column pairs
 * in order, the pair's odd column first, then its even one, as AVX512-BF16's
 * VDPBF16PS adds them.  A product of two bf16 values is exact in f32, so
 * each step rounds once, and the two builds give the same bits but where
 * a subnormal is involved (the instruction reads and writes those as 0). */
static void plain_panel_row(float *y, const uint16_t *xr, const uint16_t *w, int kin, int no)
{
    float acc[TSR_PANEL] = {0};
    for (int j = 0; j < kin / 2; j++) {
        const float x0 = tsr_k_bf16_to_f32(xr[2 * j]), x1 = tsr_k_bf16_to_f32(xr[2 * j + 1]);
        const uint16_t *wj = w + (size_t)j * 2 * TSR_PANEL;
        for (int r = 0; r < TSR_PANEL; r++) {
            acc[r] += x1 * tsr_k_bf16_to_f32(wj[2 * r + 1]);
            acc[r] += x0 * tsr_k_bf16_to_f32(wj[2 * r]);
        }
    }
    memcpy(y, acc, (size_t)no * sizeof(float));
}

/* ---- AVX512-BF16 ------------------------------------------------------------------- */

#if defined(__x86_64__)
/* For CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and 5, Intel Cooper
 * Lake): one 64-byte line of a panel is 16 outputs by one column pair,
 * exactly VDPBF16PS's second operand, and the pair of x it meets is one
 * broadcast 32-bit lane.  A tile of up to 12 rows by 2 panels keeps its 24
 * accumulators in registers, as the f32 AVX-512 tile does; the weights'
 * lines are asked for 8 ahead into L2.  Up to 6 rows read 4 panels side
 * by side and 7 or 8 rows 3, as more streams draw more from memory: steps
 * of the 58M model on 2 Zen 5 cores (bench/engine_step, int8 KV, context
 * 16) took 1.67-1.68 ms against 1.78-1.97 with 2 panels for 1 sequence,
 * 1.73-1.80 against 2.04-2.09 for 4, and 2.29-2.35 against 2.52-2.56 for
 * 8.  More than 12 rows fetch the next group ahead as the f32 build does
 * (dp_panels): a 32-sequence step at context 16 took 4.8-5.0 ms against
 * 5.9-6.2 without.  Every output is one chain over the pairs in order,
 * whatever the tile, so a row's bits do not depend on the batch (and equal
 * the portable build's, plain_panel_row). */
#define DP_ROWS 12
#define DP_PREFETCH 8               /* lines ahead, within the panel */
#define DP __attribute__((target("avx512f,avx512bf16")))
DP static inline __attribute__((always_inline)) void dp_tile(
    float *y, int ldy, const uint16_t *xb, int ldx, const uint16_t *w, size_t ps, int no, int own,
    const uint16_t *nx, size_t nx_lines, const int R, const int NP)
{
    const int kp = ldx / 2;
    size_t due = 0;   /* nx_lines per kp steps, as a running remainder */
    __m512 acc[DP_ROWS][4];
    _Pragma("GCC unroll 12") for (int r = 0; r < R; r++)
    _Pragma("GCC unroll 4") for (int q = 0; q < NP; q++)
        acc[r][q] = _mm512_setzero_ps();
    for (int j = 0; j < kp; j++) {
        __m512bh wl[4];
        _Pragma("GCC unroll 4") for (int q = 0; q < NP; q++) {
            const uint16_t *line = w + q * ps + (size_t)j * 2 * TSR_PANEL;
            if (own && j + DP_PREFETCH < kp)   /* within the panel */
                _mm_prefetch((const char *)(line + DP_PREFETCH * 2 * TSR_PANEL), _MM_HINT_T1);
            wl[q] = (__m512bh)_mm512_loadu_si512(line);
        }
        for (due += nx_lines; due >= (size_t)kp; due -= (size_t)kp, nx += 2 * TSR_PANEL)
            _mm_prefetch((const char *)nx, _MM_HINT_T1);
        _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {
            uint32_t pair;
            memcpy(&pair, xb + (size_t)r * ldx + 2 * j, sizeof pair);
            const __m512bh xs = (__m512bh)_mm512_set1_epi32((int)pair);
            _Pragma("GCC unroll 4") for (int q = 0; q < NP; q++)
                acc[r][q] = _mm512_dpbf16_ps(acc[r][q], xs, wl[q]);
        }
    }
    _Pragma("GCC unroll 12") for (int r = 0; r < R; r++)
    _Pragma("GCC unroll 4") for (int q = 0; q < NP; q++) {
        float *yr = y + (size_t)r * ldy + q * TSR_PANEL;
        if (q < NP - 1 || no == TSR_PANEL) _mm512_storeu_ps(yr, acc[r][q]);
        else _mm512_mask_storeu_ps(yr, (__mmask16)((1u << no) - 1), acc[r][q]);
    }
}

#define DP_CASE(R)                                                                             \
    case R:                                                                                    \
        switch (np) { /* 4 panels side by side up to 6 rows, 3 up to 8 (rows x panels <= 24) */\
        case 4: if (R <= 6) dp_tile(yt, ldy, xt, ldx, w, ps, no, own, nx, nx_lines, R, 4); break; \
        case 3: if (R <= 8) dp_tile(yt, ldy, xt, ldx, w, ps, no, own, nx, nx_lines, R, 3); break; \
        case 2: dp_tile(yt, ldy, xt, ldx, w, ps, no, own, nx, nx_lines, R, 2); break;          \
        default: dp_tile(yt, ldy, xt, ldx, w, ps, no, own, nx, nx_lines, R, 1); break;         \
        }                                                                                      \
        break;

/* Panels [p0, p1) G at a time, the T rows in tiles of at most 12 whose
 * heights differ by one at most. */
DP static void dp_panels(float *y, int ldy, const uint16_t *xb, int ldx, const uint16_t *wb,
                         int T, int out, int p0, int p1)
{
    const size_t ps = (size_t)ldx * TSR_PANEL;
    const int G = tsr_tile_group(T), tiles = (T + DP_ROWS - 1) / DP_ROWS;
    const size_t kp = (size_t)ldx / 2;   /* a panel's lines: one a column pair */
    for (int p = p0; p < p1; p += G) {
        const int np = p1 - p < G ? p1 - p : G, last = (p + np - 1) * TSR_PANEL;
        const int no = out - last < TSR_PANEL ? out - last : TSR_PANEL;
        const int next_np = p1 - (p + G) < G ? p1 - (p + G) : G;
        const uint16_t *w = wb + (size_t)p * ps;
        for (int t = 0, left = tiles, r, ti = 0; t < T; t += r, left--, ti++) {
            r = (T - t + left - 1) / left;
            float *yt = y + (size_t)t * ldy + (size_t)p * TSR_PANEL;
            const uint16_t *xt = xb + (size_t)t * ldx;
            int own;
            size_t l0;
            const size_t nx_lines = tsr_tile_fetch_share(next_np, kp, tiles, ti, p == p0, &own, &l0);
            const uint16_t *nx = nx_lines ? w + (size_t)G * ps + l0 * 2 * TSR_PANEL : w;
            switch (r) {
                DP_CASE(1) DP_CASE(2) DP_CASE(3) DP_CASE(4)
                DP_CASE(5) DP_CASE(6) DP_CASE(7) DP_CASE(8)
                DP_CASE(9) DP_CASE(10) DP_CASE(11)
                default: DP_CASE(12)
            }
        }
    }
}
#endif

int tsr_cpu_avx512bf16(void)
{
    static int answer = -1;
    int a = __atomic_load_n(&answer, __ATOMIC_RELAXED);
    if (a >= 0) return a;
    a = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    a = !tsr_cpu_amx() && tsr_cpu_kernels() == TSR_KERNELS_AVX512 &&
        __builtin_cpu_supports("avx512bf16");
#endif
    __atomic_store_n(&answer, a, __ATOMIC_RELAXED);
    return a;
}

const char *tsr_bf16_products_name(void)
{
    return tsr_cpu_amx() ? "AMX" : tsr_cpu_avx512bf16() ? "AVX512-BF16" : "portable build";
}

/* ---- the product ------------------------------------------------------------------- */

typedef struct {
    float *y;
    int ldy;
    const uint16_t *xb, *wb;
    int T, ldx, out, panels, chunk, amx, dp;   /* ldx: in padded to whole tiles */
} job_t;

static void run_chunk(void *arg, int i)
{
    const job_t *j = arg;
    const size_t ps = (size_t)j->ldx * TSR_PANEL;   /* elements in one panel */
    const int p0 = i * j->chunk, p1 = p0 + j->chunk < j->panels ? p0 + j->chunk : j->panels;
#if defined(__x86_64__)
    if (j->amx) {
        /* 32 rows at a time (the last 1-16 in one row block) through every
         * group of the claim: a row block's x stays in L1 while the claim's
         * weights (at most about CHUNK_BYTES) come from L2 after the first */
        for (int t = 0; t < j->T; t += 32) {
            const int rows = j->T - t < 32 ? j->T - t : 32;
            const uint16_t *xt = j->xb + (size_t)t * j->ldx;
            for (int p = p0; p < p1; p += GROUP) {
                const int np = p1 - p < GROUP ? p1 - p : GROUP, last = (p + np - 1) * TSR_PANEL;
                const int no = j->out - last < TSR_PANEL ? j->out - last : TSR_PANEL;
                const uint16_t *w = j->wb + (size_t)p * ps;
                float *yt = j->y + (size_t)t * j->ldy + (size_t)p * TSR_PANEL;
                if (rows > 16) amx_pair(yt, j->ldy, xt, j->ldx, w, ps, rows, np, no);
                else amx_group(yt, j->ldy, xt, j->ldx, w, ps, rows, np, no);
            }
        }
        amx_release();
        return;
    }
    if (j->dp) {
        dp_panels(j->y, j->ldy, j->xb, j->ldx, j->wb, j->T, j->out, p0, p1);
        return;
    }
#endif
    for (int p = p0; p < p1; p += GROUP) {
        const int np = p1 - p < GROUP ? p1 - p : GROUP, last = (p + np - 1) * TSR_PANEL;
        const int no = j->out - last < TSR_PANEL ? j->out - last : TSR_PANEL;
        const uint16_t *w = j->wb + (size_t)p * ps;
        float *yp = j->y + (size_t)p * TSR_PANEL;
        for (int q = 0; q < np; q++)
            for (int t = 0; t < j->T; t++)
                plain_panel_row(yp + (size_t)t * j->ldy + q * TSR_PANEL, j->xb + (size_t)t * j->ldx,
                                w + q * ps, j->ldx, q == np - 1 ? no : TSR_PANEL);
    }
}

void tsr_pool_matmul_bf16(tsr_pool_t *p, float *y, int ldy, const float *x, uint16_t *xb,
                          const uint16_t *wb, int T, int in, int out)
{
    if (T <= 0 || out <= 0 || in <= 0) return;
    const int ldx = tsr_bf16_in_padded(in), panels = (out + TSR_PANEL - 1) / TSR_PANEL;
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * in;
        uint16_t *d = xb + (size_t)t * ldx;
        tsr_bf16_round_row(d, xr, in);
        for (int k = in; k < ldx; k++) d[k] = 0;
    }
    /* Whole groups per claim, at least 4 claims per thread, none much over
     * CHUNK_BYTES of weights. */
    const int threads = tsr_pool_threads(p), groups = (panels + GROUP - 1) / GROUP;
    int chunk = (groups + 4 * threads - 1) / (4 * threads);
    int cap = (int)(CHUNK_BYTES / (GROUP * panel_elems(in) * sizeof(uint16_t)));
    if (chunk > cap) chunk = cap;
    if (chunk < 1) chunk = 1;
    if ((long long)T * in * out < 2LL * MIN_MACS) chunk = groups;
    job_t j = {y, ldy, xb, wb, T, ldx, out, panels, chunk * GROUP, tsr_cpu_amx(), tsr_cpu_avx512bf16()};
    tsr_pool_for(p, (groups + chunk - 1) / chunk, run_chunk, &j);
}
