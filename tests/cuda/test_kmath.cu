/* test_kmath.cu: the CUDA kernels' math, run on the CPU.
 *
 * nvcc builds this as a host program, so it runs on machines without a
 * GPU (CI's).  The functions under test are worker/kmath.h's
 * __host__ __device__ ones, the very code the kernels in
 * worker/cuda/kernels.cu call; around them the tests replay each
 * kernel's decomposition (lanes, warps, tiles, block tables, scans) and
 * compare with the CPU engine's functions or a plain double reference. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

extern "C" {
#include <cmocka.h>
#include "common/safetensors.h"
#include "worker/engine.h"
#include "worker/kvpool.h"
}

static uint64_t rng_state = 0x1234567;
static double urand(void)
{
    rng_state = tsr_mix64(rng_state + 0x9e3779b97f4a7c15ull);
    return (double)(rng_state >> 11) * (1.0 / 9007199254740992.0);
}

/* ---- conversions: the device's equal the loader's ------------------------------ */

static void test_bf16_matches_host_conversion(void **state)
{
    (void)state;
    const uint32_t special[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                                0x7f800001u, 0x00000001u, 0x3f808000u, 0x3f818000u, 0x7f7fffffu};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++) {
        float f;
        memcpy(&f, &special[i], 4);
        assert_int_equal(tsr_k_f32_to_bf16(f), tsr_f32_to_bf16(f));
    }
    for (int i = 0; i < 1000000; i++) {
        uint32_t u = (uint32_t)(tsr_mix64((uint64_t)i) >> 17);
        float f;
        memcpy(&f, &u, 4);
        assert_int_equal(tsr_k_f32_to_bf16(f), tsr_f32_to_bf16(f));
        uint16_t h = (uint16_t)u;
        float a = tsr_k_bf16_to_f32(h), b = tsr_bf16_to_f32(h);
        assert_memory_equal(&a, &b, 4);
    }
}

/* FP8 E4M3 as nvcc builds common/fp8.h for the kernels: every pattern
 * widens to its value and narrows back to itself (test_safetensors checks
 * the rounding of every other float against a search, as gcc builds it). */
static void test_e4m3_both_ways_as_nvcc_builds_them(void **state)
{
    (void)state;
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        const float v = tsr_e4m3_to_f32((uint8_t)b);
        if (e == 15 && m == 7) {
            assert_true(isnan(v));
            continue;
        }
        const float want = (b & 0x80 ? -1.0f : 1.0f) *
                           (e ? ldexpf(1.0f + (float)m / 8.0f, e - 7) : ldexpf((float)m, -9));
        assert_memory_equal(&v, &want, 4);
        assert_int_equal(tsr_f32_to_e4m3(v), b);
    }
    assert_int_equal(tsr_f32_to_e4m3(1000.0f), 0x7e);
}

static void test_f16_matches_host_conversion(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float a = tsr_k_f16_to_f32((uint16_t)h), b = tsr_f16_to_f32((uint16_t)h);
        if (isnan(b)) {
            assert_true(isnan(a));
            continue;
        }
        assert_memory_equal(&a, &b, 4);
    }
}

/* ---- RMSNorm: the kernel's strided partial sums ------------------------------------- */

static void test_rmsnorm_decomposition(void **state)
{
    (void)state;
    const int H = 4096, THREADS = 256;
    std::vector<float> x(H);
    for (int j = 0; j < H; j++) x[j] = (float)(urand() * 4 - 2);
    /* k_add_rmsnorm: thread t sums elements t, t + 256, ... in float; the
     * block adds the partials in double */
    double total = 0;
    for (int t = 0; t < THREADS; t++) {
        float ss = 0;
        for (int j = t; j < H; j += THREADS) ss += x[j] * x[j];
        total += ss;
    }
    double ref = 0;
    for (int j = 0; j < H; j++) ref += (double)x[j] * x[j];
    float a = tsr_k_rms_scale(total, H, 1e-5f), b = (float)(1.0 / sqrt(ref / H + 1e-5));
    assert_true(fabsf(a - b) <= 1e-6f * fabsf(b));
}

/* ---- RoPE: llama3 rescaling against the published formula --------------------------- */

static void test_rope_llama3_frequencies(void **state)
{
    (void)state;
    tsr_rope_cfg_t c = {500000.0f, 1, 8.0f, 1.0f, 4.0f, 8192};
    const int hd = 128;
    for (int i = 0; i < hd / 2; i++) {
        /* transformers' _compute_llama3_parameters, written out again */
        double base = 1.0 / pow(500000.0, (2.0 * i) / hd);
        double wavelen = 2 * M_PI / base, want;
        if (wavelen < 8192.0 / 4.0) want = base;
        else if (wavelen > 8192.0 / 1.0) want = base / 8.0;
        else {
            double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
            want = (1 - smooth) * base / 8.0 + smooth * base;
        }
        double got = tsr_k_rope_inv_freq(&c, i, hd);
        assert_true(fabs(got - want) <= 1e-12 * want);
    }
    c.llama3 = 0;
    assert_true(tsr_k_rope_inv_freq(&c, 5, hd) == pow(500000.0, -10.0 / hd));
    /* the rotation is a rotation: lengths are kept */
    float a = 0.6f, b = -0.8f;
    tsr_k_rope_pair(&a, &b, cosf(1.1f), sinf(1.1f));
    assert_true(fabsf(a * a + b * b - 1.0f) < 1e-6f);
}

/* ---- the paged KV cache's layout ------------------------------------------------------- */

static void test_kv_offset_matches_cpu_layout(void **state)
{
    (void)state;
    const int n_blocks = 7, kvh = 3, hd = 8, layers = 2;
    tsr_kvpool_t *p = tsr_kvpool_new(n_blocks, 2, 64);
    assert_non_null(p);
    assert_int_equal(tsr_kvpool_grow(p, 0, 20), 0);   /* 2 blocks */
    assert_int_equal(tsr_kvpool_grow(p, 1, 40), 0);   /* 3 blocks */
    std::vector<int> seen((size_t)layers * n_blocks * kvh * TSR_KV_BLOCK * hd, 0);
    for (int slot = 0; slot < 2; slot++) {
        const int32_t *t = tsr_kvpool_table(p, slot);
        int n_pos = slot ? 40 : 20;
        for (int l = 0; l < layers; l++)
            for (int pos = 0; pos < n_pos; pos++)
                for (int kh = 0; kh < kvh; kh++) {
                    size_t off = tsr_k_kv_offset(t, n_blocks, kvh, hd, l, pos, kh);
                    /* kv_format.h's tsr_kvf_off, written out */
                    size_t cpu = ((size_t)l * n_blocks + t[pos / TSR_KV_BLOCK]) * TSR_KV_BLOCK * kvh * hd +
                                 (size_t)(pos % TSR_KV_BLOCK) * hd + (size_t)kh * TSR_KV_BLOCK * hd;
                    assert_int_equal(off, cpu);
                    assert_true(off + hd <= seen.size());
                    for (int d = 0; d < hd; d++) seen[off + d]++;
                }
    }
    for (size_t i = 0; i < seen.size(); i++) assert_true(seen[i] <= 1);   /* no two positions share */
    tsr_kvpool_destroy(&p);
}

/* ---- attention: k_attention's tiles, warps and lanes over a paged pool ---------------- */

/* The kernel's work for one tile of one head, replayed: 4 warps of 32
 * lanes, rows warp + 4i, dimensions lane + 32j, a butterfly sum for each
 * score, one online-softmax state per row. */
static void attention_tile(const float *qkv, size_t qkvw, const uint16_t *kpool,
                           const uint16_t *vpool, const int32_t *table, int n_blocks, int qh,
                           int kvh, int hd, int h, int row0, int n, int pos0, float *out)
{
    const int W = 4, R = (TSR_ATT_TILE + W - 1) / W, DPL = 8, kh = h / (qh / kvh);
    const float scale = 1.0f / sqrtf((float)hd);
    for (int warp = 0; warp < W; warp++)
        for (int i = 0; i < R; i++) {
            int r = warp + i * W;
            if (r >= n) break;
            float q[32][8], acc[32][8];
            for (int lane = 0; lane < 32; lane++)
                for (int j = 0; j < DPL; j++) {
                    int d = lane + 32 * j;
                    q[lane][j] = d < hd ? qkv[(size_t)(row0 + r) * qkvw + (size_t)h * hd + d] : 0;
                    acc[lane][j] = 0;
                }
            tsr_osm_t sm = tsr_k_osm_init();
            int visible = pos0 + r + 1;
            for (int b0 = 0; b0 < pos0 + n; b0 += TSR_KV_BLOCK) {
                size_t base = tsr_k_kv_offset(table, n_blocks, kvh, hd, 0, b0, kh);
                int np = std::min(TSR_KV_BLOCK, pos0 + n - b0);
                for (int p = 0; p < np && b0 + p < visible; p++) {
                    float part[32];
                    for (int lane = 0; lane < 32; lane++) {
                        part[lane] = 0;
                        for (int j = 0; j < DPL; j++) {
                            int d = lane + 32 * j;
                            if (d < hd) part[lane] += q[lane][j] * tsr_k_bf16_to_f32(kpool[base + (size_t)p * hd + d]);
                        }
                    }
                    for (int o = 16; o; o >>= 1) {
                        float nx[32];
                        for (int lane = 0; lane < 32; lane++) nx[lane] = part[lane] + part[lane ^ o];
                        memcpy(part, nx, sizeof part);
                    }
                    float w, c = tsr_k_osm_push(&sm, part[0] * scale, &w);
                    for (int lane = 0; lane < 32; lane++)
                        for (int j = 0; j < DPL; j++) {
                            int d = lane + 32 * j;
                            if (d < hd)
                                acc[lane][j] = acc[lane][j] * c +
                                               w * tsr_k_bf16_to_f32(vpool[base + (size_t)p * hd + d]);
                        }
                }
            }
            for (int lane = 0; lane < 32; lane++)
                for (int j = 0; j < DPL; j++) {
                    int d = lane + 32 * j;
                    if (d < hd) out[(size_t)(row0 + r) * qh * hd + (size_t)h * hd + d] = acc[lane][j] / sm.l;
                }
        }
}

static void test_attention_tiles_equal_softmax(void **state)
{
    (void)state;
    const int qh = 4, kvh = 2, hd = 64, n_blocks = 16, max_seq = 200;
    const size_t qkvw = (size_t)(qh + 2 * kvh) * hd;
    tsr_kvpool_t *p = tsr_kvpool_new(n_blocks, 3, max_seq);
    /* another slot first, so this sequence's blocks are not 0, 1, 2, ... */
    assert_int_equal(tsr_kvpool_grow(p, 1, 17), 0);
    const int pos0 = 37, n = 40;                      /* a prompt chunk over earlier context */
    assert_int_equal(tsr_kvpool_grow(p, 0, pos0 + n), 0);
    const int32_t *table = tsr_kvpool_table(p, 0);
    std::vector<uint16_t> kpool((size_t)n_blocks * kvh * TSR_KV_BLOCK * hd),
        vpool(kpool.size());
    std::vector<float> qkv((size_t)n * qkvw), out((size_t)n * qh * hd, NAN);
    for (int pos = 0; pos < pos0 + n; pos++)
        for (int kh = 0; kh < kvh; kh++)
            for (int d = 0; d < hd; d++) {
                size_t off = tsr_k_kv_offset(table, n_blocks, kvh, hd, 0, pos, kh) + d;
                kpool[off] = tsr_k_f32_to_bf16((float)(urand() * 2 - 1));
                vpool[off] = tsr_k_f32_to_bf16((float)(urand() * 2 - 1));
            }
    for (size_t i = 0; i < qkv.size(); i++) qkv[i] = (float)(urand() * 4 - 2);
    /* the tiles the engine lays out for this entry */
    int covered = 0;
    for (int t = 0; t < tsr_k_att_tiles(n); t++) {
        int off, rows;
        tsr_k_att_tile(n, t, &off, &rows);
        assert_int_equal(off, covered);
        assert_true(rows >= 1 && rows <= TSR_ATT_TILE);
        covered += rows;
        for (int h = 0; h < qh; h++)
            attention_tile(qkv.data(), qkvw, kpool.data(), vpool.data(), table, n_blocks, qh, kvh,
                           hd, h, off, rows, pos0 + off, out.data());
    }
    assert_int_equal(covered, n);
    /* reference: causal softmax attention in double */
    double worst = 0;
    for (int r = 0; r < n; r++)
        for (int h = 0; h < qh; h++) {
            int kh = h / (qh / kvh), visible = pos0 + r + 1;
            std::vector<double> sc(visible);
            double mx = -INFINITY, sum = 0;
            for (int pos = 0; pos < visible; pos++) {
                size_t off = tsr_k_kv_offset(table, n_blocks, kvh, hd, 0, pos, kh);
                double s = 0;
                for (int d = 0; d < hd; d++)
                    s += (double)qkv[(size_t)r * qkvw + (size_t)h * hd + d] * tsr_k_bf16_to_f32(kpool[off + d]);
                sc[pos] = s / sqrt((double)hd);
                mx = std::max(mx, sc[pos]);
            }
            for (int pos = 0; pos < visible; pos++) sum += sc[pos] = exp(sc[pos] - mx);
            for (int d = 0; d < hd; d++) {
                double o = 0;
                for (int pos = 0; pos < visible; pos++)
                    o += sc[pos] / sum *
                         tsr_k_bf16_to_f32(vpool[tsr_k_kv_offset(table, n_blocks, kvh, hd, 0, pos, kh) + d]);
                worst = std::max(worst, fabs(o - out[(size_t)r * qh * hd + (size_t)h * hd + d]));
            }
        }
    assert_true(worst < 2e-5);
    tsr_kvpool_destroy(&p);
}

/* Two tiles of keys merged give what one pass over all of them gives. */
static void test_online_softmax_merge(void **state)
{
    (void)state;
    for (int trial = 0; trial < 200; trial++) {
        int n = 1 + (int)(urand() * 100), cut = (int)(urand() * n);
        std::vector<float> s(n), v(n);
        for (int i = 0; i < n; i++) s[i] = (float)(urand() * 20 - 10), v[i] = (float)urand();
        tsr_osm_t all = tsr_k_osm_init(), a = tsr_k_osm_init(), b = tsr_k_osm_init();
        float acc = 0, acc_a = 0, acc_b = 0, w;
        for (int i = 0; i < n; i++) {
            float c = tsr_k_osm_push(&all, s[i], &w);
            acc = acc * c + w * v[i];
        }
        for (int i = 0; i < cut; i++) {
            float c = tsr_k_osm_push(&a, s[i], &w);
            acc_a = acc_a * c + w * v[i];
        }
        for (int i = cut; i < n; i++) {
            float c = tsr_k_osm_push(&b, s[i], &w);
            acc_b = acc_b * c + w * v[i];
        }
        float ca, cb;
        tsr_k_osm_merge(&a, b, &ca, &cb);
        float merged = (ca * acc_a + cb * acc_b) / a.l;
        assert_true(fabsf(merged - acc / all.l) < 1e-5f);
        /* The split decode attention's merge: four warps' states, each
         * over every fourth run of 16 keys (a warp may have seen none),
         * folded from the empty state in warp order. */
        tsr_osm_t part[4], folded = tsr_k_osm_init();
        float acc_p[4] = {0, 0, 0, 0}, acc_f = 0;
        for (int q = 0; q < 4; q++) part[q] = tsr_k_osm_init();
        for (int i = 0; i < n; i++) {
            int q = (i / 16) % 4;
            float c = tsr_k_osm_push(&part[q], s[i], &w);
            acc_p[q] = acc_p[q] * c + w * v[i];
        }
        for (int q = 0; q < 4; q++) {
            tsr_k_osm_merge(&folded, part[q], &ca, &cb);
            acc_f = acc_f * ca + acc_p[q] * cb;
        }
        assert_true(fabsf(acc_f / folded.l - acc / all.l) < 1e-5f);
    }
}

/* ---- sampling: k_sample_prep, the segmented sort and k_sample_pick ----------------- */

/* The kernels' algorithm on the host: first maximum; weights; a stable
 * descending sort when top_p cuts; the cut as the first prefix (in tiles
 * of 1024, scanned) reaching top_p * sum; the draw as the first prefix
 * passing r. */
static int32_t gpu_sample(const float *logits, int V, float temp, float top_p, uint64_t seed,
                          uint64_t pos)
{
    int best = 0;
    for (int i = 1; i < V; i++)
        if (logits[i] > logits[best]) best = i;
    if (tsr_k_greedy(temp)) return best;
    std::vector<float> w(V);
    std::vector<int32_t> id(V);
    double sum = 0;
    for (int i = 0; i < V; i++) {
        w[i] = tsr_k_sample_weight(logits[i], logits[best], temp);
        id[i] = i;
        sum += w[i];
    }
    bool cut = tsr_k_top_p_cuts(top_p);
    int k = V;
    double keep = sum;
    if (cut) {
        std::stable_sort(id.begin(), id.end(), [&](int a, int b) { return w[a] > w[b]; });
        std::vector<float> ws(V);
        for (int i = 0; i < V; i++) ws[i] = w[id[i]];
        w = ws;
        double run = 0, goal = top_p * sum;
        int found = V;
        for (int t0 = 0; t0 < V && found == V; t0 += 1024) {
            double incl = run;
            for (int i = t0; i < std::min(V, t0 + 1024); i++) {
                incl += w[i];
                if (incl >= goal) {
                    found = i;
                    break;
                }
            }
            for (int i = t0; i < std::min(V, t0 + 1024); i++) run += w[i];
        }
        k = found + 1 < V ? found + 1 : V;
        keep = 0;
        for (int i = 0; i < k; i++) keep += w[i];
    }
    double r = tsr_draw(seed, pos) * keep, acc = 0;
    for (int i = 0; i < k; i++) {
        acc += w[i];
        if (r < acc && w[i] > 0) return id[i];
    }
    return best;
}

static void test_sampling_matches_cpu_engine(void **state)
{
    (void)state;
    const int V = 3000;
    std::vector<float> lg(V);
    int differ = 0, sampled_not_best = 0;
    for (int trial = 0; trial < 600; trial++) {
        double spread = trial % 3 == 0 ? 1.0 : trial % 3 == 1 ? 5.0 : 15.0;
        for (int i = 0; i < V; i++) lg[i] = (float)(urand() * spread);
        if (trial % 7 == 0) lg[(int)(urand() * V)] = lg[(int)(urand() * V)];   /* ties */
        if (trial % 11 == 0) lg[3] = -INFINITY;
        float temp = trial % 5 == 0 ? 0.0f : (float)(0.2 + urand() * 1.5);
        float top_p = trial % 4 == 0 ? 1.0f : (float)(0.05 + urand() * 0.9);
        uint64_t seed = tsr_mix64((uint64_t)trial), pos = (uint64_t)trial * 3;
        int32_t a = gpu_sample(lg.data(), V, temp, top_p, seed, pos);
        int32_t b = tsr_sample(lg.data(), V, temp, top_p, seed, pos);
        differ += a != b;
        int best = (int)(std::max_element(lg.begin(), lg.end()) - lg.begin());
        sampled_not_best += b != best;
    }
    assert_int_equal(differ, 0);
    assert_true(sampled_not_best > 100);   /* the trials really sampled */
    /* NaN and infinite temperatures are greedy on both */
    assert_true(tsr_k_greedy(NAN) && tsr_k_greedy(INFINITY) && tsr_k_greedy(-1.0f));
    assert_false(tsr_k_top_p_cuts(NAN));
}

/* ---- launch arithmetic ----------------------------------------------------------------- */

static void test_launch_arithmetic(void **state)
{
    (void)state;
    int prev = 0;
    for (int n = 1; n <= 72; n++) {
        int b = tsr_k_graph_bucket(n, 72);
        assert_true(b >= n && b >= prev);
        assert_true(b <= 8 ? (b & (b - 1)) == 0 : b % 8 == 0);
        prev = b;
    }
    assert_int_equal(tsr_k_graph_bucket(100, 72), 100);   /* past the buckets: exact size */
    assert_int_equal(tsr_k_att_tiles(1), 1);
    assert_int_equal(tsr_k_att_tiles(16), 1);
    assert_int_equal(tsr_k_att_tiles(17), 2);
    /* the small-batch product's warps cover a row's pieces once, in order */
    for (int nvec = 1; nvec < 3000; nvec += 7)
        for (int warps = 1; warps <= 16; warps++) {
            int next = 0;
            for (int w = 0; w < warps; w++) {
                int b, e;
                tsr_k_gemv_span(nvec, warps, w, &b, &e);
                assert_int_equal(b, next);
                assert_true(e >= b && e <= nvec);
                next = e;
            }
            assert_int_equal(next, nvec);
        }
    for (int n = 1; n < 5000; n += 37) {
        int t = tsr_k_row_threads(n);
        assert_true(t % 32 == 0 && t >= 32 && t <= 1024);
    }
}

/* ---- the tensor-core attention kernel's operand layouts and rows ---- */

typedef void (*layout_fn)(int lane, int i, int *d0, int *d1);

/* Every element of a dim0 x dim1 operand is element i < elems of exactly
 * one lane, and each register's two elements (2j, 2j + 1) are adjacent
 * along dimension `along` (0 or 1). */
static void check_layout(layout_fn f, int elems, int dim0, int dim1, int along)
{
    std::vector<int> seen((size_t)dim0 * dim1, 0);
    for (int lane = 0; lane < 32; lane++)
        for (int i = 0; i < elems; i++) {
            int a, b, a2, b2;
            f(lane, i, &a, &b);
            assert_true(a >= 0 && a < dim0 && b >= 0 && b < dim1);
            seen[(size_t)a * dim1 + b]++;
            if (i % 2 == 0) {
                f(lane, i + 1, &a2, &b2);
                assert_int_equal(a2, a + (along == 0));
                assert_int_equal(b2, b + (along == 1));
            }
        }
    for (int x : seen) assert_int_equal(x, 1);
}

/* The operand layouts as the kernel relies on them: A (16 x 16) and C
 * (16 x 8) pairs adjacent along a row (Q loads as float2, the output as
 * BF16 pairs), B (16 x 8) pairs adjacent along k (K and V^T as 32-bit
 * words) with its second register 8 further along k; A's rows are C's;
 * and the C registers of two adjacent key tiles are the A operand of their
 * 16 keys (P is taken from S's registers). */
static void test_mma_operand_layouts(void **state)
{
    (void)state;
    check_layout(tsr_k_mma_a, 8, 16, 16, 1);
    check_layout(tsr_k_mma_b, 4, 16, 8, 0);
    check_layout(tsr_k_mma_c, 4, 16, 8, 1);
    for (int lane = 0; lane < 32; lane++) {
        for (int i = 0; i < 4; i++) {
            int k, n, k0, n0;
            tsr_k_mma_b(lane, i, &k, &n);
            tsr_k_mma_b(lane, 0, &k0, &n0);
            assert_int_equal(k, k0 + (i & 1) + 8 * (i >> 1));
        }
        for (int i = 0; i < 8; i++) {
            int r, c, cr, cc;
            tsr_k_mma_a(lane, i, &r, &c);
            /* A's rows: C element 0's row for registers 0 and 2, element 2's for 1 and 3 */
            tsr_k_mma_c(lane, ((i >> 1) & 1) * 2, &cr, &cc);
            assert_int_equal(r, cr);
            /* P from S: A element i of keys [0, 16) is C element (reg & 1) * 2
             * + (i & 1) of key tile reg / 2 (keys 8 * tile + column) */
            int reg = i >> 1, tile = reg >> 1, e = (reg & 1) * 2 + (i & 1);
            tsr_k_mma_c(lane, e, &cr, &cc);
            assert_int_equal(cr, r);
            assert_int_equal(8 * tile + cc, c);
        }
    }
}

/* The blocks of a tile cover each (position, query head of the group)
 * once, and the launch's block count per KV head holds the largest tile. */
static void test_gqa_rows_cover_a_tile_once(void **state)
{
    (void)state;
    const int groups[] = {1, 2, 4, 8, 16};
    for (size_t gi = 0; gi < sizeof groups / sizeof *groups; gi++) {
        const int g = groups[gi], chunks = tsr_k_gqa_chunks(TSR_ATT_TILE, g);
        for (int n = 1; n <= TSR_ATT_TILE; n++) {
            int seen[TSR_ATT_TILE][16] = {{0}};
            assert_true(tsr_k_gqa_chunks(n, g) <= chunks);
            for (int ch = 0; ch < chunks; ch++)
                for (int r = ch * TSR_ATT_ROWS; r < (ch + 1) * TSR_ATT_ROWS && r < n * g; r++) {
                    int po, ho;
                    tsr_k_gqa_row(r, g, &po, &ho);
                    assert_true(po >= 0 && po < n && ho >= 0 && ho < g);
                    seen[po][ho]++;
                }
            for (int p = 0; p < n; p++)
                for (int h = 0; h < g; h++) assert_int_equal(seen[p][h], 1);
        }
    }
}

/* ---- the engine's load refuses a KV or weight type it does not keep, before any device call ---- */

static void test_cuda_engine_refuses_an_f32_int8_or_unknown_kv_dtype_and_f32_weights(void **state)
{
    (void)state;
    tsr_backend_t b;
    char err[256] = "";
    assert_int_equal(tsr_backend_for(TSR_DEVICE_CUDA, &b, err, sizeof err), 0);
    tsr_piece_spec_t spec;
    memset(&spec, 0, sizeof spec);
    tsr_engine_t *e = NULL;
    spec.kv_dtype = TSR_KV_F32;
    assert_int_equal(b.engine->load("/nonexistent", &spec, &e, err, sizeof err), -1);
    assert_null(e);
    assert_non_null(strstr(err, "kv_dtype f32"));
    spec.kv_dtype = TSR_KV_INT8;   /* the CPU engine's alone */
    err[0] = '\0';
    assert_int_equal(b.engine->load("/nonexistent", &spec, &e, err, sizeof err), -1);
    assert_null(e);
    assert_non_null(strstr(err, "kv_dtype int8"));
    spec.kv_dtype = 7;
    err[0] = '\0';
    assert_int_equal(b.engine->load("/nonexistent", &spec, &e, err, sizeof err), -1);
    assert_non_null(strstr(err, "kv_dtype 7"));
    assert_int_equal(b.engine->kv_elem_bytes, 2);   /* auto: bf16 */
    /* its weights are bf16 only too */
    spec.kv_dtype = TSR_KV_AUTO;
    spec.matmul_dtype = TSR_KV_F32;
    err[0] = '\0';
    assert_int_equal(b.engine->load("/nonexistent", &spec, &e, err, sizeof err), -1);
    assert_null(e);
    assert_non_null(strstr(err, "matmul_dtype f32"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16_matches_host_conversion),
        cmocka_unit_test(test_f16_matches_host_conversion),
        cmocka_unit_test(test_e4m3_both_ways_as_nvcc_builds_them),
        cmocka_unit_test(test_rmsnorm_decomposition),
        cmocka_unit_test(test_rope_llama3_frequencies),
        cmocka_unit_test(test_kv_offset_matches_cpu_layout),
        cmocka_unit_test(test_attention_tiles_equal_softmax),
        cmocka_unit_test(test_online_softmax_merge),
        cmocka_unit_test(test_sampling_matches_cpu_engine),
        cmocka_unit_test(test_launch_arithmetic),
        cmocka_unit_test(test_mma_operand_layouts),
        cmocka_unit_test(test_gqa_rows_cover_a_tile_once),
        cmocka_unit_test(test_cuda_engine_refuses_an_f32_int8_or_unknown_kv_dtype_and_f32_weights),
    };
    return cmocka_run_group_tests_name("kmath (the CUDA kernels' math, on the CPU)", tests, NULL, NULL);
}
