/* matmul_i8.c: products of f32 rows by int8 weight panels as integer dot
 * products (see matmul_i8.h for the layout and the numbers), on the pool's
 * threads, in a portable, an AVX2 and an AVX-512 VNNI build.
 *
 * The AVX2 tile: R rows of x by NP adjacent panels (R * NP <= 4, R <= 3),
 * two int32 accumulators of 8 rows each per (row, panel).  At each quad of
 * columns it broadcasts a row's 4 quantized inputs to every 32-bit lane,
 * gives each weight the sign of its input (VPSIGNB), multiplies by the
 * inputs' magnitudes as unsigned bytes and adds pairs (VPMADDUBSW: at most
 * 2 * 127 * 127, no saturation), and adds those pairs (VPMADDWD by ones)
 * into the accumulators: 32 weights in four instructions.  After each block
 * of 8 quads (32 columns) the integer sums, exact, are widened and
 * multiply-added into f32 sums with the block's input scale, in block
 * order, as the portable build does with fmaf: the two give the same bits
 * whatever the tile shapes, so a row's outputs do not depend on T. */
#include "worker/matmul_i8.h"

#include <math.h>
#include <stdalign.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "worker/cpu_kernels.h"
#include "worker/matmul_f32.h"

#define QUADS (TSR_I8_BLOCK / 4)   /* quads of columns in a block */
/* As tsr_pool_matmul: small products stay on the caller, and no claim
 * covers much more than 256 KiB of weights. */
#define MIN_MACS 32768
#define CHUNK_BYTES (256 << 10)

int tsr_i8_in_padded(int in)
{
    return in > 0 ? (in + TSR_I8_BLOCK - 1) / TSR_I8_BLOCK * TSR_I8_BLOCK : 0;
}

static size_t padded_rows(int out)
{
    return (size_t)(out + TSR_PANEL - 1) / TSR_PANEL * TSR_PANEL;
}

size_t tsr_i8_packed_bytes(int out, int in)
{
    if (out <= 0 || in <= 0) return 0;
    return padded_rows(out) * (sizeof(float) + (size_t)tsr_i8_in_padded(in));
}

static const int8_t *panels_of(const void *wq, int out)
{
    return (const int8_t *)wq + padded_rows(out) * sizeof(float);
}

/* Where q[row][0] lies among the panels (the header's formula); column k
 * is at that + col_offset(k). */
static size_t row_base(int in, int row)
{
    return (size_t)(row / TSR_PANEL) * TSR_PANEL * (size_t)tsr_i8_in_padded(in) +
           (size_t)(row % TSR_PANEL) * 4;
}

static inline size_t col_offset(int k) { return (size_t)(k >> 2) * 4 * TSR_PANEL + (size_t)(k & 3); }

float tsr_i8_row_scale(const float *w, int n)
{
    float m = 0.0f;
    for (int k = 0; k < n; k++) {
        const float a = fabsf(w[k]);
        if (isnan(a)) return a;
        if (a > m) m = a;
    }
    return m / 127.0f;
}

/* An integral float within [-127, 127]. */
static inline int8_t clamp127(float q)
{
    return (int8_t)(q > 127.0f ? 127 : q < -127.0f ? -127 : q);
}

int8_t tsr_i8_quantize(float w, float scale)
{
    if (!(scale > 0.0f) || !isfinite(scale)) return 0;
    return clamp127(nearbyintf(w / scale));   /* to nearest, ties to even */
}

/* Rows row0 .. of wq from n rows of ld floats: divided by their scales and
 * rounded (quantize), or integers already.  A row whose scale is not
 * positive and finite stays zero (wq starts zeroed). */
static void pack(void *wq, int out, int in, int row0, const float *rows, int ld,
                 const float *scales, int n, int quantize)
{
    float *sc = wq;
    int8_t *q = (int8_t *)panels_of(wq, out);
    for (int r = 0; r < n; r++) {
        const int o = row0 + r;
        if (o < 0 || o >= out) continue;
        sc[o] = scales[r];
        int8_t *dst = q + row_base(in, o);
        const float *src = rows + (size_t)r * ld, s = scales[r];
        if (quantize && (!(s > 0.0f) || !isfinite(s))) continue;
        for (int k = 0; k < in; k++)
            dst[col_offset(k)] = clamp127(quantize ? nearbyintf(src[k] / s) : src[k]);
    }
}

void tsr_i8_pack_rows(void *wq, int out, int in, int row0, const float *rows, int ld,
                      const float *scales, int n)
{
    pack(wq, out, in, row0, rows, ld, scales, n, 1);
}

void tsr_i8_pack_q_rows(void *wq, int out, int in, int row0, const float *q, int ld,
                        const float *scales, int n)
{
    pack(wq, out, in, row0, q, ld, scales, n, 0);
}

void tsr_i8_packed_row(const void *wq, int out, int in, int row, float *dst)
{
    const float s = ((const float *)wq)[row];
    const int8_t *q = panels_of(wq, out);
    q += row_base(in, row);
    for (int k = 0; k < in; k++) dst[k] = (float)q[col_offset(k)] * s;
}

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2,fma")))
#endif

/* ---- the inputs ----------------------------------------------------------------- */

/* The scratch: T rows of in32 quantized inputs, then T rows of in32 / 32
 * block scales on a 64-byte boundary. */
static float *x_scales(void *xs, int T, int in32)
{
    return (float *)((char *)xs + ((size_t)T * (size_t)in32 + 63) / 64 * 64);
}

/* The scratch's block sums times 128 (VNNI tile): T rows of in32 / 32
 * int32 after the block scales. */
static int32_t *x_sums(void *xs, int T, int in32)
{
    return (int32_t *)(x_scales(xs, T, in32) + (size_t)T * (size_t)(in32 / TSR_I8_BLOCK));
}

size_t tsr_i8_x_bytes(int T, int in)
{
    const int in32 = tsr_i8_in_padded(in);
    if (T <= 0 || in32 <= 0) return 64;
    return ((size_t)T * (size_t)in32 + 63) / 64 * 64 +
           (size_t)T * (size_t)(in32 / TSR_I8_BLOCK) * (sizeof(float) + sizeof(int32_t));
}

/* One block of n <= 32 inputs: xq[32] (zero past n), its scale and 128
 * times the sum of its xq. */
static void quantize_block(int8_t *xq, float *d, int32_t *c, const float *x, int n)
{
    int32_t sum = 0;
    *d = tsr_i8_row_scale(x, n);
    for (int k = 0; k < TSR_I8_BLOCK; k++) {
        xq[k] = k < n ? tsr_i8_quantize(x[k], *d) : 0;
        sum += xq[k];
    }
    *c = sum * 128;
}

#if defined(__x86_64__)
/* The same for a whole block of 32 finite inputs, in AVX2: the largest
 * magnitude is the same whatever the order, and a division, a rounding to
 * nearest even and a clamp give the same integers as tsr_i8_quantize.  A
 * block with a NaN or an infinity goes to quantize_block. */
AVX2 static void quantize_block_avx2(int8_t *xq, float *d, int32_t *c, const float *x)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    __m256 v[4], m = _mm256_setzero_ps();
    int bad = 0;
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        const __m256 a = _mm256_andnot_ps(sign, v[i]);
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_NLT_UQ));   /* NaN or infinite */
        m = _mm256_max_ps(m, a);
    }
    if (bad) {
        quantize_block(xq, d, c, x, TSR_I8_BLOCK);
        return;
    }
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xb1));
    const float s = _mm256_cvtss_f32(m) / 127.0f;
    *d = s;
    if (!(s > 0.0f)) {   /* all zeros (or too small to scale) */
        memset(xq, 0, TSR_I8_BLOCK);
        *c = 0;
        return;
    }
    const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256i q[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], sv),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        sum = _mm256_add_epi32(sum, q[i]);
    }
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)xq,
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *c = _mm_cvtsi128_si32(t) * 128;
}
#endif

/* Row x[in] in blocks: xq[in32] (zero past in), d[in32 / 32] and c[in32 /
 * 32], 128 times the sum of the block's xq.  A block with a NaN or
 * infinite input keeps that scale and zeros, which turns the outputs NaN. */
static void quantize_row(int8_t *xq, float *d, int32_t *c, const float *x, int in, int vec)
{
    const int in32 = tsr_i8_in_padded(in);
    for (int b = 0; b < in32 / TSR_I8_BLOCK; b++) {
        const int k0 = b * TSR_I8_BLOCK, n = in - k0 < TSR_I8_BLOCK ? in - k0 : TSR_I8_BLOCK;
#if defined(__x86_64__)
        if (vec && n == TSR_I8_BLOCK) {
            quantize_block_avx2(xq + k0, d + b, c + b, x + k0);
            continue;
        }
#endif
        (void)vec;
        quantize_block(xq + k0, d + b, c + b, x + k0, n);
    }
}

/* ---- the tiles ------------------------------------------------------------------ */

/* The portable build: R rows of x by one panel (w), the panel's no rows of
 * output (the panel's scales sc). */
static void tile_plain(float *y, int ldy, const int8_t *xq, const float *xd, int in32,
                       const int8_t *w, const float *sc, int no, int R)
{
    const int nb = in32 / TSR_I8_BLOCK;
    for (int rr = 0; rr < R; rr++) {
        float acc[TSR_PANEL] = {0};
        const int8_t *xr = xq + (size_t)rr * in32;
        for (int b = 0; b < nb; b++) {
            int32_t isum[TSR_PANEL] = {0};
            for (int j = b * QUADS; j < (b + 1) * QUADS; j++)
                for (int r = 0; r < TSR_PANEL; r++)
                    for (int e = 0; e < 4; e++)
                        isum[r] += (int32_t)xr[4 * j + e] * w[((size_t)j * TSR_PANEL + r) * 4 + e];
            const float d = xd[(size_t)rr * nb + b];
            for (int r = 0; r < TSR_PANEL; r++) acc[r] = fmaf(d, (float)isum[r], acc[r]);
        }
        for (int r = 0; r < no; r++) y[(size_t)rr * ldy + r] = acc[r] * sc[r];
    }
}

#if defined(__x86_64__)

AVX2 static inline __attribute__((always_inline)) void tile_avx2(
    float *y, int ldy, const int8_t *xq, const float *xd, int in32, const int8_t *w,
    const float *sc, int no, const int R, const int NP)
{
    const size_t ps = (size_t)TSR_PANEL * in32;
    const int nb = in32 / TSR_I8_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 fa[3][4][2];
    _Pragma("GCC unroll 3") for (int rr = 0; rr < R; rr++)
    _Pragma("GCC unroll 4") for (int jj = 0; jj < NP; jj++)
        fa[rr][jj][0] = fa[rr][jj][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i ia[3][4][2];
        _Pragma("GCC unroll 3") for (int rr = 0; rr < R; rr++)
        _Pragma("GCC unroll 4") for (int jj = 0; jj < NP; jj++)
            ia[rr][jj][0] = ia[rr][jj][1] = _mm256_setzero_si256();
        for (int j = b * QUADS; j < (b + 1) * QUADS; j++) {
            __m256i xb[3], ax[3];
            _Pragma("GCC unroll 3") for (int rr = 0; rr < R; rr++) {
                int32_t v;
                memcpy(&v, xq + (size_t)rr * in32 + 4 * j, sizeof v);
                xb[rr] = _mm256_set1_epi32(v);
                ax[rr] = _mm256_abs_epi8(xb[rr]);
            }
            _Pragma("GCC unroll 4") for (int jj = 0; jj < NP; jj++) {
                const int8_t *wl = w + jj * ps + (size_t)j * 4 * TSR_PANEL;
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)wl),
                              w1 = _mm256_loadu_si256((const __m256i *)(wl + 32));
                _Pragma("GCC unroll 3") for (int rr = 0; rr < R; rr++) {
                    const __m256i p0 = _mm256_maddubs_epi16(ax[rr], _mm256_sign_epi8(w0, xb[rr]));
                    const __m256i p1 = _mm256_maddubs_epi16(ax[rr], _mm256_sign_epi8(w1, xb[rr]));
                    ia[rr][jj][0] = _mm256_add_epi32(ia[rr][jj][0], _mm256_madd_epi16(p0, ones));
                    ia[rr][jj][1] = _mm256_add_epi32(ia[rr][jj][1], _mm256_madd_epi16(p1, ones));
                }
            }
        }
        _Pragma("GCC unroll 3") for (int rr = 0; rr < R; rr++) {
            const __m256 d = _mm256_set1_ps(xd[(size_t)rr * nb + b]);
            _Pragma("GCC unroll 4") for (int jj = 0; jj < NP; jj++)
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)
                fa[rr][jj][h] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(ia[rr][jj][h]), fa[rr][jj][h]);
        }
    }
    _Pragma("GCC unroll 3") for (int rr = 0; rr < R; rr++)
    _Pragma("GCC unroll 4") for (int jj = 0; jj < NP; jj++) {
        float *yr = y + (size_t)rr * ldy + jj * TSR_PANEL;
        alignas(32) float out[TSR_PANEL];
        _mm256_store_ps(out, _mm256_mul_ps(fa[rr][jj][0], _mm256_loadu_ps(sc + jj * TSR_PANEL)));
        _mm256_store_ps(out + 8,
                        _mm256_mul_ps(fa[rr][jj][1], _mm256_loadu_ps(sc + jj * TSR_PANEL + 8)));
        memcpy(yr, out, (size_t)(jj == NP - 1 ? no : TSR_PANEL) * sizeof(float));
    }
}

/* Panels [p0, p1) for T rows: one row (decode) over 4 panels side by
 * side, two over 2, more in tiles of 3 rows (the last 1 or 2) by one
 * panel. */
AVX2 static void panels_avx2(float *y, int ldy, const int8_t *xq, const float *xd,
                             const int32_t *xc, int in32, const int8_t *wp, const float *sc,
                             int T, int out, int p0, int p1)
{
    (void)xc;
    const size_t ps = (size_t)TSR_PANEL * in32;
    const int nb = in32 / TSR_I8_BLOCK;
    if (T <= 2) {
        const int G = T == 1 ? 4 : 2;
        for (int p = p0; p < p1; p += G) {
            const int np = p1 - p < G ? p1 - p : G, last = (p + np - 1) * TSR_PANEL;
            const int no = out - last < TSR_PANEL ? out - last : TSR_PANEL;
            const int8_t *w = wp + (size_t)p * ps;
            const float *s = sc + (size_t)p * TSR_PANEL;
            float *yp = y + (size_t)p * TSR_PANEL;
            switch (T * 8 + np) {
            case 8 + 1: tile_avx2(yp, ldy, xq, xd, in32, w, s, no, 1, 1); break;
            case 8 + 2: tile_avx2(yp, ldy, xq, xd, in32, w, s, no, 1, 2); break;
            case 8 + 3: tile_avx2(yp, ldy, xq, xd, in32, w, s, no, 1, 3); break;
            case 8 + 4: tile_avx2(yp, ldy, xq, xd, in32, w, s, no, 1, 4); break;
            case 16 + 1: tile_avx2(yp, ldy, xq, xd, in32, w, s, no, 2, 1); break;
            default: tile_avx2(yp, ldy, xq, xd, in32, w, s, no, 2, 2); break;
            }
        }
        return;
    }
    for (int p = p0; p < p1; p++) {
        const int o = p * TSR_PANEL, no = out - o < TSR_PANEL ? out - o : TSR_PANEL;
        const int8_t *w = wp + (size_t)p * ps;
        const float *s = sc + o;
        for (int t = 0; t < T; t += 3) {
            float *yt = y + (size_t)t * ldy + o;
            const int8_t *xt = xq + (size_t)t * in32;
            const float *dt = xd + (size_t)t * nb;
            switch (T - t) {
            case 1: tile_avx2(yt, ldy, xt, dt, in32, w, s, no, 1, 1); break;
            case 2: tile_avx2(yt, ldy, xt, dt, in32, w, s, no, 2, 1); break;
            default: tile_avx2(yt, ldy, xt, dt, in32, w, s, no, 3, 1); break;
            }
        }
    }
}

/* The AVX-512 VNNI tile: R rows of x (R <= VNNI_ROWS) by NP adjacent panels
 * (NP <= 4), one int32 accumulator of a panel's 16 rows per (row, panel): a
 * quad of a panel is one 512-bit line.  VPDPBUSD multiplies unsigned bytes
 * by signed ones, four to a 32-bit lane: each weight line goes in plus 128
 * (xor 0x80: 1..255) as the unsigned operand, and a row's 4 quantized
 * inputs as the signed one, broadcast from memory; after each block, 128
 * times the sum of the block's inputs (quantize_row) is taken off.  The
 * same exact integers as the AVX2 tile, then the same fused multiply-add
 * chain, so the same bits.  A line costs one xor shared by the R rows, and
 * one VPDPBUSD a row. */
#define VNNI_ROWS 4
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))

VNNI static inline __attribute__((always_inline)) void tile_vnni(
    float *y, int ldy, const int8_t *xq, const float *xd, const int32_t *xc, int in32,
    const int8_t *w, const float *sc, int no, const int R, const int NP)
{
    const size_t ps = (size_t)TSR_PANEL * in32;
    const int nb = in32 / TSR_I8_BLOCK;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    __m512 fa[VNNI_ROWS][4];
    _Pragma("GCC unroll 8") for (int rr = 0; rr < R; rr++)
    _Pragma("GCC unroll 4") for (int jj = 0; jj < NP; jj++) fa[rr][jj] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i ia[VNNI_ROWS][4];
        _Pragma("GCC unroll 8") for (int rr = 0; rr < R; rr++)
        _Pragma("GCC unroll 4") for (int jj = 0; jj < NP; jj++) ia[rr][jj] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int j = b * QUADS; j < (b + 1) * QUADS; j++) {
            __m512i wl[4];
            _Pragma("GCC unroll 4") for (int jj = 0; jj < NP; jj++)
                wl[jj] = _mm512_xor_si512(
                    _mm512_loadu_si512(w + jj * ps + (size_t)j * 4 * TSR_PANEL), bias);
            _Pragma("GCC unroll 8") for (int rr = 0; rr < R; rr++) {
                int32_t v;
                memcpy(&v, xq + (size_t)rr * in32 + 4 * j, sizeof v);
                const __m512i xb = _mm512_set1_epi32(v);
                _Pragma("GCC unroll 4") for (int jj = 0; jj < NP; jj++)
                    ia[rr][jj] = _mm512_dpbusd_epi32(ia[rr][jj], wl[jj], xb);
            }
        }
        _Pragma("GCC unroll 8") for (int rr = 0; rr < R; rr++) {
            const __m512 d = _mm512_set1_ps(xd[(size_t)rr * nb + b]);
            const __m512i c = _mm512_set1_epi32(xc[(size_t)rr * nb + b]);
            _Pragma("GCC unroll 4") for (int jj = 0; jj < NP; jj++)
                fa[rr][jj] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(ia[rr][jj], c)),
                                             fa[rr][jj]);
        }
    }
    _Pragma("GCC unroll 8") for (int rr = 0; rr < R; rr++)
    _Pragma("GCC unroll 4") for (int jj = 0; jj < NP; jj++) {
        const __m512 v = _mm512_mul_ps(fa[rr][jj], _mm512_loadu_ps(sc + jj * TSR_PANEL));
        const int n = jj == NP - 1 ? no : TSR_PANEL;
        _mm512_mask_storeu_ps(y + (size_t)rr * ldy + jj * TSR_PANEL, (__mmask16)((1u << n) - 1), v);
    }
}

#define VNNI_CASE(R, NP)                                                                       \
    case R * 8 + NP: tile_vnni(yt, ldy, xt, dt, ct, in32, w, s, no, R, NP); break;

/* Panels [p0, p1) for T rows: one row over 4 panels side by side, more in
 * tiles of up to VNNI_ROWS rows by 2 panels. */
VNNI static void panels_vnni(float *y, int ldy, const int8_t *xq, const float *xd,
                             const int32_t *xc, int in32, const int8_t *wp, const float *sc,
                             int T, int out, int p0, int p1)
{
    const size_t ps = (size_t)TSR_PANEL * in32;
    const int nb = in32 / TSR_I8_BLOCK, G = T == 1 ? 4 : 2;
    for (int p = p0; p < p1; p += G) {
        const int np = p1 - p < G ? p1 - p : G, last = (p + np - 1) * TSR_PANEL;
        const int no = out - last < TSR_PANEL ? out - last : TSR_PANEL;
        const int8_t *w = wp + (size_t)p * ps;
        const float *s = sc + (size_t)p * TSR_PANEL;
        for (int t = 0; t < T; t += VNNI_ROWS) {
            float *yt = y + (size_t)t * ldy + (size_t)p * TSR_PANEL;
            const int8_t *xt = xq + (size_t)t * in32;
            const float *dt = xd + (size_t)t * nb;
            const int32_t *ct = xc + (size_t)t * nb;
            switch ((T - t < VNNI_ROWS ? T - t : VNNI_ROWS) * 8 + np) {
                VNNI_CASE(1, 1) VNNI_CASE(1, 2) VNNI_CASE(1, 3) VNNI_CASE(1, 4)
                VNNI_CASE(2, 1) VNNI_CASE(2, 2) VNNI_CASE(3, 1) VNNI_CASE(3, 2)
                VNNI_CASE(4, 1) VNNI_CASE(4, 2)
            }
        }
    }
}
#endif

static void panels_plain(float *y, int ldy, const int8_t *xq, const float *xd,
                         const int32_t *xc, int in32, const int8_t *wp, const float *sc, int T,
                         int out, int p0, int p1)
{
    (void)xc;
    for (int p = p0; p < p1; p++) {
        const int o = p * TSR_PANEL, no = out - o < TSR_PANEL ? out - o : TSR_PANEL;
        tile_plain(y + o, ldy, xq, xd, in32, wp + (size_t)p * TSR_PANEL * in32, sc + o, no, T);
    }
}

typedef void (*panels_fn)(float *, int, const int8_t *, const float *, const int32_t *, int,
                          const int8_t *, const float *, int, int, int, int);

/* One build for the process: AVX-512 VNNI where tsr_cpu_kernels runs the
 * AVX-512 build and the CPU has VNNI and AVX512-BW, AVX2 wherever else it
 * runs AVX2 or AVX-512, the portable one otherwise.  All give the same
 * bits. */
static panels_fn panels_for(void)
{
#if defined(__x86_64__)
    const tsr_cpu_kernels_t k = tsr_cpu_kernels();
    if (k == TSR_KERNELS_AVX512 && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("avx512bw"))
        return panels_vnni;
    if (k != TSR_KERNELS_PLAIN) return panels_avx2;
#endif
    return panels_plain;
}

const char *tsr_i8_products_name(void)
{
    const panels_fn k = panels_for();
#if defined(__x86_64__)
    if (k == panels_vnni) return "AVX512-VNNI";
    if (k == panels_avx2) return "AVX2";
#endif
    return k == panels_plain ? "portable build" : "?";
}

typedef struct {
    float *y;
    int ldy;
    const int8_t *xq;
    const float *xd;
    const int32_t *xc;
    const int8_t *wp;
    const float *sc;
    int T, in32, out, chunk, panels;
    panels_fn kernel;
} job_t;

static void chunk_of(void *arg, int i)
{
    const job_t *j = arg;
    const int p0 = i * j->chunk, p1 = p0 + j->chunk < j->panels ? p0 + j->chunk : j->panels;
    j->kernel(j->y, j->ldy, j->xq, j->xd, j->xc, j->in32, j->wp, j->sc, j->T, j->out, p0, p1);
}

void tsr_pool_matmul_i8(tsr_pool_t *p, float *y, int ldy, const float *x, void *xs,
                        const void *wq, int T, int in, int out)
{
    if (T <= 0 || out <= 0) return;
    if (in <= 0) {   /* nothing to sum */
        for (int t = 0; t < T; t++) memset(y + (size_t)t * ldy, 0, (size_t)out * sizeof(float));
        return;
    }
    const int in32 = tsr_i8_in_padded(in), panels = (out + TSR_PANEL - 1) / TSR_PANEL;
    int8_t *xq = xs;
    float *xd = x_scales(xs, T, in32);
    int32_t *xc = x_sums(xs, T, in32);
    const int nb = in32 / TSR_I8_BLOCK;
    const panels_fn kernel = panels_for();
    const int vec = kernel != panels_plain;
    for (int t = 0; t < T; t++)
        quantize_row(xq + (size_t)t * in32, xd + (size_t)t * nb, xc + (size_t)t * nb,
                     x + (size_t)t * in, in, vec);
    /* as tsr_pool_matmul: 4 chunks a thread at least, none over CHUNK_BYTES,
     * whole groups of the decode path's 4 panels */
    const int threads = tsr_pool_threads(p);
    int chunk = (panels + 4 * threads - 1) / (4 * threads);
    int cap = (int)(CHUNK_BYTES / ((size_t)TSR_PANEL * in32));
    cap = cap < 4 ? 4 : cap / 4 * 4;
    if (chunk > cap) chunk = cap;
    if ((long long)T * in * out < 2LL * MIN_MACS) chunk = panels;
    if (chunk < 1) chunk = 1;
    job_t j = {y, ldy, xq, xd, xc, panels_of(wq, out), wq, T, in32, out, chunk, panels, kernel};
    tsr_pool_for(p, (panels + chunk - 1) / chunk, chunk_of, &j);
}
