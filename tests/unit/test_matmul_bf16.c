/* test_matmul_bf16.c: the bf16 products (worker/matmul_bf16.c) equal a
 * double-precision product of the bf16-rounded operands within f32
 * accumulation error, give a row the same bits whatever it is batched with
 * and however many threads run it, never write outside their columns, and
 * pack and unpack rows exactly.  On a CPU with AMX they run on AMX, on one
 * with AVX512-BF16 but no AMX on that (and the runs under
 * TSR_CPU_KERNELS=avx2 and plain in tests/run.sh take the portable build);
 * elsewhere the portable build is what is tested.  The builds without AMX
 * give the bits of one pairwise f32 chain, checked here exactly. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/kmath.h"
#include "worker/matmul_bf16.h"

#define SENTINEL 12345.0f

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 - 0.5);
}

static float rb(float f) { return tsr_k_bf16_to_f32(tsr_k_f32_to_bf16(f)); }

typedef struct {
    int out, in;
    float *w;          /* [out][in] */
    uint16_t *wb;      /* packed */
} mat_t;

static mat_t make_mat(int out, int in)
{
    mat_t m = {out, in, malloc((size_t)out * in * sizeof(float)), NULL};
    assert_non_null(m.w);
    for (size_t i = 0; i < (size_t)out * in; i++) m.w[i] = frand();
    size_t n = tsr_bf16_packed_elems(out, in);
    assert_true(posix_memalign((void **)&m.wb, 64, n * 2) == 0);
    memset(m.wb, 0, n * 2);
    /* in two pieces, as the engine packs q, k and v into one matrix */
    int half = out / 2;
    tsr_bf16_pack_rows(m.wb, out, in, 0, m.w, half);
    tsr_bf16_pack_rows(m.wb, out, in, half, m.w + (size_t)half * in, out - half);
    return m;
}

static void free_mat(mat_t *m)
{
    free(m->w), free(m->wb);
}

static uint16_t *scratch(int T, int in)
{
    uint16_t *xb = NULL;
    assert_true(posix_memalign((void **)&xb, 64, (size_t)T * tsr_bf16_in_padded(in) * 2) == 0);
    return xb;
}

static void test_packing_rounds_to_bf16_and_unpacks_exactly(void **state)
{
    (void)state;
    static const int shapes[][2] = {{1, 1}, {16, 32}, {17, 33}, {40, 100}, {3, 70}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        mat_t m = make_mat(shapes[s][0], shapes[s][1]);
        float row[128];
        for (int o = 0; o < m.out; o++) {
            tsr_bf16_packed_row(m.wb, m.in, o, row);
            for (int k = 0; k < m.in; k++)
                if (row[k] != rb(m.w[(size_t)o * m.in + k]))
                    fail_msg("%dx%d: row %d col %d: %g, not bf16(%g)", m.out, m.in, o, k, row[k],
                             m.w[(size_t)o * m.in + k]);
        }
        free_mat(&m);
    }
    assert_int_equal(tsr_bf16_in_padded(33), 64);
    assert_int_equal(tsr_bf16_packed_elems(17, 33), 32 * 64);
    assert_int_equal(tsr_bf16_packed_elems(0, 33), 0);
}

/* y against a double product of the rounded operands: f32 accumulation of
 * n terms errs by at most about n * 2^-24 of the sum of magnitudes. */
static void check_against_double(const float *y, int ldy, const float *x, const mat_t *m, int T)
{
    for (int t = 0; t < T; t++)
        for (int o = 0; o < m->out; o++) {
            double s = 0, mag = 0;
            for (int k = 0; k < m->in; k++) {
                double p = (double)rb(x[(size_t)t * m->in + k]) * rb(m->w[(size_t)o * m->in + k]);
                s += p, mag += fabs(p);
            }
            double got = y[(size_t)t * ldy + o], tol = mag * m->in * 6e-8 + 1e-30;
            if (fabs(got - s) > tol)
                fail_msg("%dx%d T=%d: y[%d][%d] = %.9g, the rounded operands give %.9g (tol %.3g)",
                         m->out, m->in, T, t, o, got, s, tol);
        }
}

static void test_product_equals_the_rounded_operands_product(void **state)
{
    (void)state;
    static const int shapes[][2] = {{16, 32}, {17, 33}, {100, 512}, {64, 96}, {200, 1376}, {5, 7},
                                    {192, 96}, {96, 160}, {280, 96}, {320, 96}};
    static const int Ts[] = {1, 2, 3, 15, 16, 17, 33};
    for (int threads = 1; threads <= 2; threads++) {
        tsr_pool_t *p = tsr_pool_new(threads);
        assert_non_null(p);
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
            mat_t m = make_mat(shapes[s][0], shapes[s][1]);
            for (size_t ti = 0; ti < sizeof Ts / sizeof *Ts; ti++) {
                const int T = Ts[ti], ldy = m.out + 3;
                /* one row more than T: nothing may be written past row T - 1 */
                float *x = malloc((size_t)T * m.in * sizeof *x), *y = malloc((size_t)(T + 1) * ldy * sizeof *y);
                uint16_t *xb = scratch(T, m.in);
                for (size_t i = 0; i < (size_t)T * m.in; i++) x[i] = frand() * 4;
                for (size_t i = 0; i < (size_t)(T + 1) * ldy; i++) y[i] = SENTINEL;
                tsr_pool_matmul_bf16(p, y, ldy, x, xb, m.wb, T, m.in, m.out);
                check_against_double(y, ldy, x, &m, T);
                for (int t = 0; t < T; t++)
                    for (int c = m.out; c < ldy; c++)
                        if (y[(size_t)t * ldy + c] != SENTINEL)
                            fail_msg("%dx%d T=%d: column %d of row %d written past out", m.out,
                                     m.in, T, c, t);
                for (int c = 0; c < ldy; c++)
                    if (y[(size_t)T * ldy + c] != SENTINEL)
                        fail_msg("%dx%d T=%d: row %d written past T", m.out, m.in, T, T);
                free(x), free(y), free(xb);
            }
            free_mat(&m);
        }
        tsr_pool_destroy(&p);
    }
}

/* The builds other than AMX's (AVX512-BF16's, the portable one) give every
 * output as one f32 chain over the column pairs in order, each pair's odd
 * column first: the same bits as that chain computed here, for every shape
 * and batch height, so the two builds agree with each other (no subnormals
 * arise from these operands).  AMX sums in its own way and is checked
 * against the double product above. */
static void test_other_builds_add_each_pair_odd_column_first(void **state)
{
    (void)state;
    if (tsr_cpu_amx()) {
        printf("AMX: its own order, checked against the double product only\n");
        return;
    }
    static const int shapes[][2] = {{16, 32}, {17, 33}, {100, 512}, {5, 7}, {200, 1376}};
    static const int Ts[] = {1, 2, 3, 4, 12, 13, 25, 33};
    tsr_pool_t *p = tsr_pool_new(2);
    assert_non_null(p);
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        mat_t m = make_mat(shapes[s][0], shapes[s][1]);
        for (size_t ti = 0; ti < sizeof Ts / sizeof *Ts; ti++) {
            const int T = Ts[ti];
            float *x = malloc((size_t)T * m.in * sizeof *x), *y = malloc((size_t)T * m.out * sizeof *y);
            uint16_t *xb = scratch(T, m.in);
            for (size_t i = 0; i < (size_t)T * m.in; i++) x[i] = frand() * 4;
            tsr_pool_matmul_bf16(p, y, m.out, x, xb, m.wb, T, m.in, m.out);
            for (int t = 0; t < T; t++)
                for (int o = 0; o < m.out; o++) {
                    const float *xr = x + (size_t)t * m.in, *wr = m.w + (size_t)o * m.in;
                    float want = 0;
                    for (int k = 0; k < m.in; k += 2) {
                        if (k + 1 < m.in) want = fmaf(rb(xr[k + 1]), rb(wr[k + 1]), want);
                        want = fmaf(rb(xr[k]), rb(wr[k]), want);
                    }
                    if (memcmp(&want, &y[(size_t)t * m.out + o], sizeof want))
                        fail_msg("%s, %dx%d T=%d: y[%d][%d] = %.9g, the pairwise chain gives %.9g",
                                 tsr_bf16_products_name(), m.out, m.in, T, t, o,
                                 y[(size_t)t * m.out + o], want);
                }
            free(x), free(y), free(xb);
        }
        free_mat(&m);
    }
    tsr_pool_destroy(&p);
}

/* Each row alone (T = 1, one thread) against the same row inside batches
 * of every height and position, on two threads: the same bits. */
static void test_a_row_gets_the_same_bits_whatever_it_is_batched_with(void **state)
{
    (void)state;
    const int in = 1376, out = 300, maxT = 40;
    mat_t m = make_mat(out, in);
    tsr_pool_t *one = tsr_pool_new(1), *two = tsr_pool_new(2);
    assert_non_null(one);
    assert_non_null(two);
    float *x = malloc((size_t)maxT * in * sizeof *x), *alone = malloc((size_t)maxT * out * sizeof *alone),
          *y = malloc((size_t)maxT * out * sizeof *y);
    uint16_t *xb = scratch(maxT, in);
    for (size_t i = 0; i < (size_t)maxT * in; i++) x[i] = frand() * (i % 7 == 0 ? 100 : 1);
    for (int t = 0; t < maxT; t++)
        tsr_pool_matmul_bf16(one, alone + (size_t)t * out, out, x + (size_t)t * in, xb, m.wb, 1, in, out);
    for (int T = 1; T <= maxT; T += (T < 18 ? 1 : 7))
        for (int t0 = 0; t0 + T <= maxT; t0 += (T > 20 ? maxT : 5)) {
            tsr_pool_matmul_bf16(two, y, out, x + (size_t)t0 * in, xb, m.wb, T, in, out);
            for (int t = 0; t < T; t++)
                if (memcmp(y + (size_t)t * out, alone + (size_t)(t0 + t) * out, out * sizeof *y))
                    fail_msg("row %d in a batch of %d from %d differs from the row alone", t0 + t,
                             T, t0);
        }
    free(x), free(alone), free(y), free(xb);
    free_mat(&m);
    tsr_pool_destroy(&one);
    tsr_pool_destroy(&two);
}

/* The input rounding (vector where the CPU has AVX-512) gives the scalar
 * rounding's bits for every kind of float: ties both ways, values that
 * carry into the exponent, infinities, NaNs, subnormals, random patterns. */
static void test_rounding_rows_equals_the_scalar_rounding_bit_for_bit(void **state)
{
    (void)state;
    enum { N = 4099 };
    static const uint32_t special[] = {0x00000000, 0x80000000, 0x3f808000, 0x3f818000, 0x3f807fff,
                                       0x3f7fffff, 0x7f7fffff, 0x7f800000, 0xff800000, 0x7fc00000,
                                       0x7f800001, 0xffffffff, 0x00000001, 0x807fffff, 0x00008000,
                                       0x4b7f8000};
    float *x = malloc(N * sizeof *x);
    uint16_t *d = malloc(N * sizeof *d);
    for (int i = 0; i < N; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t u = (uint32_t)rng ^ (uint32_t)(rng >> 32);
        if (i % 5 == 0) u = special[(i / 5) % (sizeof special / sizeof *special)];
        memcpy(&x[i], &u, sizeof u);
    }
    for (int n = 1; n <= N; n += n < 40 ? 1 : 1000) {
        memset(d, 0xaa, N * sizeof *d);
        tsr_bf16_round_row(d, x, n);
        for (int i = 0; i < n; i++)
            if (d[i] != tsr_k_f32_to_bf16(x[i])) {
                uint32_t u;
                memcpy(&u, &x[i], sizeof u);
                fail_msg("n %d: element %d (0x%08x) rounds to 0x%04x, not 0x%04x", n, i, u, d[i],
                         tsr_k_f32_to_bf16(x[i]));
            }
        if (n < N) assert_int_equal(d[n], 0xaaaa);   /* nothing past n */
    }
    free(x), free(d);
}

/* 1 when /proc/cpuinfo's first flags line names flag. */
static int cpu_has(const char *flag)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[8192], pat[64];
    int yes = 0;
    snprintf(pat, sizeof pat, " %s", flag);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "flags", 5)) {
            const char *h = strstr(line, pat);
            yes = h && (h[strlen(pat)] == ' ' || h[strlen(pat)] == '\n');
            break;
        }
    if (f) fclose(f);
    return yes;
}

static void test_amx_is_reported_consistently(void **state)
{
    (void)state;
    const char *k = getenv("TSR_CPU_KERNELS");
    int amx = tsr_cpu_amx();
    assert_int_equal(amx, tsr_cpu_amx());
    if (k && *k && strcmp(k, "amx")) assert_int_equal(amx, 0);  /* a lesser build asked for */
    /* A CPU that says it has AMX (and a kernel new enough to show it) must
     * get it when nothing forbids it: a broken detection would otherwise
     * leave every test here passing on the portable build. */
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[4096];
    int tile = 0, bf16 = 0;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "flags", 5)) {
            tile |= strstr(line, " amx_tile") != NULL, bf16 |= strstr(line, " amx_bf16") != NULL;
            break;
        }
    if (f) fclose(f);
    if (tile && bf16 && (!k || !*k || !strcmp(k, "amx"))) assert_int_equal(amx, 1);
    /* Without AMX, a CPU with AVX512-BF16 gets it when the AVX-512 kernels
     * are allowed, and never alongside AMX or on a lesser build. */
    int dp = tsr_cpu_avx512bf16();
    if (amx || (k && (!strcmp(k, "avx2") || !strcmp(k, "plain")))) assert_int_equal(dp, 0);
    else if (cpu_has("avx512_bf16") && cpu_has("avx512f")) assert_int_equal(dp, 1);
    printf("bf16 products: %s\n", tsr_bf16_products_name());
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_packing_rounds_to_bf16_and_unpacks_exactly),
        cmocka_unit_test(test_product_equals_the_rounded_operands_product),
        cmocka_unit_test(test_other_builds_add_each_pair_odd_column_first),
        cmocka_unit_test(test_a_row_gets_the_same_bits_whatever_it_is_batched_with),
        cmocka_unit_test(test_rounding_rows_equals_the_scalar_rounding_bit_for_bit),
        cmocka_unit_test(test_amx_is_reported_consistently),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
