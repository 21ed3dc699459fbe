/* test_matmul_i8.c: the int8 products (worker/matmul_i8.c) give exactly
 * the bits of the rule matmul_i8.h states (inputs quantized in blocks of
 * 32, exact integer sums, one fused multiply-add chain over the blocks,
 * times the row's scale), in whichever build runs (tests/run.sh runs this
 * under TSR_CPU_KERNELS=plain too), for every tile shape and thread count,
 * so a row does not depend on what it is batched with; they stay within the
 * inputs' quantization of the product of the dequantized weights; they
 * never write outside their columns; a NaN input turns its own row NaN and
 * no other; weights quantize and pack by the stated rule. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/cpu_kernels.h"
#include "worker/matmul_f32.h"
#include "worker/matmul_i8.h"

#define SENTINEL 12345.0f

static float rnd(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((*s >> 40) & 0xffff) / 32768.0f - 1.0f;
}

/* W[out, in] packed with its rows' scales; the caller frees it. */
static void *packed(const float *w, int out, int in)
{
    const size_t bytes = tsr_i8_packed_bytes(out, in);
    void *wq = calloc(bytes ? bytes : 1, 1);
    float *sc = malloc(sizeof(float) * (size_t)(out > 0 ? out : 1));
    assert_true(wq && sc);
    for (int o = 0; o < out; o++) sc[o] = tsr_i8_row_scale(w + (size_t)o * in, in);
    tsr_i8_pack_rows(wq, out, in, 0, w, in, sc, out);
    free(sc);
    return wq;
}

static void *scratch(int T, int in)
{
    void *xs = aligned_alloc(64, (tsr_i8_x_bytes(T, in) + 63) / 64 * 64);
    assert_non_null(xs);
    return xs;
}

/* The rule, written out: output o of row x (in columns) against row w of W. */
static float rule(const float *x, const float *w, int in)
{
    const float s = tsr_i8_row_scale(w, in);
    float acc = 0.0f;
    for (int k0 = 0; k0 < in; k0 += 32) {
        const int n = in - k0 < 32 ? in - k0 : 32;
        const float d = tsr_i8_row_scale(x + k0, n);
        int32_t isum = 0;
        for (int k = k0; k < k0 + n; k++)
            isum += (int32_t)tsr_i8_quantize(x[k], d) * tsr_i8_quantize(w[k], s);
        acc = fmaf(d, (float)isum, acc);
    }
    return acc * s;
}

/* A row's scale is its largest magnitude / 127; weights round to nearest,
 * ties to even, within [-127, 127]; a row of zeros has scale 0 and only
 * zeros; a NaN poisons the scale; packed rows read back as q * s, the
 * padding stays zero; an int8 checkpoint's -128 is held as -127. */
static void test_weights_quantize_to_nearest_even_by_the_rows_largest(void **state)
{
    (void)state;
    const float row[5] = {-2.54f, 1.27f, 0.01f, 0.0f, 0.0f};
    const float s = tsr_i8_row_scale(row, 5);
    assert_true(s == 2.54f / 127.0f);
    assert_int_equal(tsr_i8_quantize(-2.54f, s), -127);
    assert_int_equal(tsr_i8_quantize(1.27f, s), 64);   /* 63.5 -> 64 (even) */
    assert_int_equal(tsr_i8_quantize(2.5f, 1.0f), 2);  /* ties to even */
    assert_int_equal(tsr_i8_quantize(3.5f, 1.0f), 4);
    assert_int_equal(tsr_i8_quantize(-0.5f, 1.0f), 0);
    assert_int_equal(tsr_i8_quantize(500.0f, 1.0f), 127);   /* clamped */
    assert_int_equal(tsr_i8_quantize(-500.0f, 1.0f), -127);
    assert_int_equal(tsr_i8_quantize(3.0f, 0.0f), 0);
    assert_int_equal(tsr_i8_quantize(3.0f, INFINITY), 0);
    const float zeros[3] = {0};
    assert_true(tsr_i8_row_scale(zeros, 3) == 0.0f);
    const float nan_row[3] = {1.0f, NAN, 2.0f}, nan_first[2] = {NAN, 2.0f};
    assert_true(isnan(tsr_i8_row_scale(nan_row, 3)));
    assert_true(isnan(tsr_i8_row_scale(nan_first, 2)));

    enum { OUT = 19, IN = 37 };   /* two panels, the second of 3 rows; 2 blocks, one partial */
    float w[OUT * IN], back[IN];
    uint64_t r = 5;
    for (int i = 0; i < OUT * IN; i++) w[i] = rnd(&r);
    for (int k = 0; k < IN; k++) w[7 * IN + k] = 0.0f;   /* row 7: all zeros */
    void *wq = packed(w, OUT, IN);
    for (int o = 0; o < OUT; o++) {
        const float so = tsr_i8_row_scale(w + o * IN, IN);
        tsr_i8_packed_row(wq, OUT, IN, o, back);
        for (int k = 0; k < IN; k++) {
            const float want = (float)tsr_i8_quantize(w[o * IN + k], so) * so;
            if (memcmp(&want, &back[k], sizeof want))
                fail_msg("row %d column %d reads back %g, q * s is %g", o, k, back[k], want);
            if (fabsf(back[k] - w[o * IN + k]) > so / 2 * 1.0001f)
                fail_msg("row %d column %d: %g is more than half a step from %g", o, k, back[k],
                         w[o * IN + k]);
        }
    }
    /* the padding (rows 19-31, columns 37-63) is zero: its bytes sum to nothing */
    const float *sc = wq;
    const int8_t *q = (const int8_t *)wq + 32 * sizeof(float);
    for (int o = OUT; o < 32; o++) assert_true(sc[o] == 0.0f);
    long nonzero = 0;
    for (int p = 0; p < 2; p++)
        for (int j = 0; j < 64 / 4; j++)
            for (int rr = 0; rr < 16; rr++)
                for (int e = 0; e < 4; e++)
                    if (16 * p + rr >= OUT || 4 * j + e >= IN)
                        nonzero += q[(size_t)p * 16 * 64 + ((size_t)j * 16 + rr) * 4 + e] != 0;
    assert_int_equal(nonzero, 0);
    free(wq);
    /* a checkpoint's integers: -128 held as -127, the rest as they are */
    const float qrow[4] = {-128.0f, -127.0f, 5.0f, 127.0f}, qs = 0.5f;
    void *wc = calloc(tsr_i8_packed_bytes(1, 4), 1);
    tsr_i8_pack_q_rows(wc, 1, 4, 0, qrow, 4, &qs, 1);
    tsr_i8_packed_row(wc, 1, 4, 0, back);
    assert_true(back[0] == -63.5f && back[1] == -63.5f && back[2] == 2.5f && back[3] == 63.5f);
    free(wc);
}

/* Runs the product of T rows at `threads` threads into a matrix of out + 3
 * columns: every output has the bits of the rule, and the other columns
 * kept their sentinel.  Some rows' first block is all zeros, or subnormal,
 * and some rows' second block has a largest magnitude of 127 and inputs at
 * ties (n + 0.5), as the vector quantizing must round them as the scalar
 * rule does. */
static void check_rule(tsr_pool_t *p, int T, int in, int out)
{
    const int ldy = out + 3;
    uint64_t s = (uint64_t)(T * 7919 + out * 31 + in);
    float *x = malloc(sizeof(float) * T * in), *w = malloc(sizeof(float) * out * in);
    float *y = malloc(sizeof(float) * T * ldy);
    assert_true(x && w && y);
    for (int i = 0; i < T * in; i++) x[i] = rnd(&s) * (float)(1 + i % 7);
    for (int t = 0; t < T; t++) {
        float *xt = x + (size_t)t * in;
        for (int k = 0; k < 32 && k < in; k++)
            if (t % 4 == 1) xt[k] = 0.0f;
            else if (t % 4 == 2) xt[k] = (float)(k - 16) * 1e-40f;
        for (int k = 32; k < 64 && k < in && t % 4 == 3; k++)
            xt[k] = k == 40 ? -127.0f : (float)((k % 2 ? 1 : -1) * (k % 9)) + 0.5f;
    }
    for (int i = 0; i < out * in; i++) w[i] = rnd(&s) * (float)(1 + i % 5);
    for (int i = 0; i < T * ldy; i++) y[i] = SENTINEL;
    void *wq = packed(w, out, in), *xs = scratch(T, in);
    tsr_pool_matmul_i8(p, y, ldy, x, xs, wq, T, in, out);
    for (int t = 0; t < T; t++) {
        for (int o = 0; o < out; o++) {
            const float want = rule(x + (size_t)t * in, w + (size_t)o * in, in);
            if (memcmp(&want, &y[t * ldy + o], sizeof want))
                fail_msg("%s kernels, %d threads, T %d in %d out %d: y[%d][%d] = %.9g, the rule "
                         "gives %.9g", tsr_cpu_kernels_name(tsr_cpu_kernels()),
                         tsr_pool_threads(p), T, in, out, t, o, y[t * ldy + o], want);
        }
        for (int o = out; o < ldy; o++)
            if (y[t * ldy + o] != SENTINEL)
                fail_msg("T %d in %d out %d: column %d (outside the output) was written", T, in,
                         out, o);
    }
    free(x), free(w), free(y), free(wq), free(xs);
}

static void test_every_output_has_the_bits_of_the_stated_rule(void **state)
{
    (void)state;
    static const int threads[] = {1, 3};
    static const int Ts[] = {1, 2, 3, 4, 5, 7, 13, 40};
    static const int outs[] = {1, 15, 16, 17, 100, 513};
    static const int ins[] = {1, 7, 32, 33, 64, 100, 130};
    for (size_t h = 0; h < sizeof threads / sizeof *threads; h++) {
        tsr_pool_t *p = tsr_pool_new(threads[h]);
        assert_non_null(p);
        for (size_t a = 0; a < sizeof Ts / sizeof *Ts; a++)
            for (size_t b = 0; b < sizeof outs / sizeof *outs; b++)
                for (size_t c = 0; c < sizeof ins / sizeof *ins; c++)
                    check_rule(p, Ts[a], ins[c], outs[b]);
        tsr_pool_destroy(&p);
    }
    tsr_pool_t *p = tsr_pool_new(4);
    check_rule(p, 1, 2048, 4100);   /* decode-sized, split across the threads */
    check_rule(p, 130, 96, 333);
    tsr_pool_destroy(&p);
}

/* A row of y has the same bits whatever rows share its product (1 to 13,
 * at every offset). */
static void test_a_row_has_the_same_bits_whatever_it_is_batched_with(void **state)
{
    (void)state;
    enum { T = 40, IN = 70, OUT = 203 };
    uint64_t s = 77;
    float *x = malloc(sizeof(float) * T * IN), *w = malloc(sizeof(float) * OUT * IN);
    float *all = malloc(sizeof(float) * T * OUT), *part = malloc(sizeof(float) * 13 * OUT);
    assert_true(x && w && all && part);
    for (int i = 0; i < T * IN; i++) x[i] = rnd(&s);
    for (int i = 0; i < OUT * IN; i++) w[i] = rnd(&s);
    tsr_pool_t *p = tsr_pool_new(2);
    void *wq = packed(w, OUT, IN), *xs = scratch(T, IN);
    tsr_pool_matmul_i8(p, all, OUT, x, xs, wq, T, IN, OUT);
    for (int n = 1; n <= 13; n++)
        for (int t = 0; t + n <= T; t++) {
            tsr_pool_matmul_i8(p, part, OUT, x + (size_t)t * IN, xs, wq, n, IN, OUT);
            for (int r = 0; r < n; r++)
                if (memcmp(part + (size_t)r * OUT, all + (size_t)(t + r) * OUT, sizeof(float) * OUT))
                    fail_msg("row %d computed with %d row(s) differs from the same row among %d",
                             t + r, n, T);
        }
    tsr_pool_destroy(&p);
    free(x), free(w), free(all), free(part), free(wq), free(xs);
}

/* Against the product of x and the dequantized weights in double: off by
 * no more than the inputs' quantization (half a step of each block's scale
 * on each input) allows. */
static void test_products_stay_within_the_inputs_quantization(void **state)
{
    (void)state;
    enum { T = 5, IN = 300, OUT = 50 };
    uint64_t s = 9;
    float *x = malloc(sizeof(float) * T * IN), *w = malloc(sizeof(float) * OUT * IN);
    float *y = malloc(sizeof(float) * T * OUT), *row = malloc(sizeof(float) * IN);
    for (int i = 0; i < T * IN; i++) x[i] = rnd(&s) * (i % 11 == 0 ? 8.0f : 1.0f);
    for (int i = 0; i < OUT * IN; i++) w[i] = rnd(&s);
    tsr_pool_t *p = tsr_pool_new(2);
    void *wq = packed(w, OUT, IN), *xs = scratch(T, IN);
    tsr_pool_matmul_i8(p, y, OUT, x, xs, wq, T, IN, OUT);
    double worst = 0;
    for (int o = 0; o < OUT; o++) {
        tsr_i8_packed_row(wq, OUT, IN, o, row);
        for (int t = 0; t < T; t++) {
            double ref = 0, bound = 0;
            for (int k0 = 0; k0 < IN; k0 += 32) {
                const int n = IN - k0 < 32 ? IN - k0 : 32;
                const double d = tsr_i8_row_scale(x + t * IN + k0, n);
                for (int k = k0; k < k0 + n; k++) {
                    ref += (double)x[t * IN + k] * row[k];
                    bound += d / 2 * fabs(row[k]);
                }
            }
            const double err = fabs(y[t * OUT + o] - ref);
            if (err > bound * 1.001 + 1e-6)
                fail_msg("y[%d][%d] = %g, the exact product %g: off by %g, the quantization "
                         "allows %g", t, o, y[t * OUT + o], ref, err, bound);
            if (bound > 0 && err / bound > worst) worst = err / bound;
        }
    }
    assert_true(worst > 0);   /* the inputs were quantized: not exact */
    tsr_pool_destroy(&p);
    free(x), free(w), free(y), free(row), free(wq), free(xs);
}

/* A NaN or infinite input turns its own row's outputs NaN, and only its
 * own: the other rows of the product keep their numbers. */
static void test_a_nan_input_turns_only_its_row_nan(void **state)
{
    (void)state;
    enum { T = 3, IN = 70, OUT = 20 };
    uint64_t s = 3;
    float x[T * IN], w[OUT * IN], y[T * OUT], clean[T * OUT];
    for (int i = 0; i < T * IN; i++) x[i] = rnd(&s);
    for (int i = 0; i < OUT * IN; i++) w[i] = rnd(&s);
    tsr_pool_t *p = tsr_pool_new(1);
    void *wq = packed(w, OUT, IN), *xs = scratch(T, IN);
    tsr_pool_matmul_i8(p, clean, OUT, x, xs, wq, T, IN, OUT);
    for (int v = 0; v < 2; v++) {
        float bad[T * IN];
        memcpy(bad, x, sizeof bad);
        bad[1 * IN + 40] = v ? INFINITY : NAN;
        tsr_pool_matmul_i8(p, y, OUT, bad, xs, wq, T, IN, OUT);
        for (int o = 0; o < OUT; o++) {
            assert_true(isnan(y[1 * OUT + o]));
            assert_memory_equal(&y[o], &clean[o], sizeof(float));
            assert_memory_equal(&y[2 * OUT + o], &clean[2 * OUT + o], sizeof(float));
        }
    }
    tsr_pool_destroy(&p);
    free(wq), free(xs);
}

/* The build the CPU's flags allow is the one that runs: AVX512-VNNI with
 * the AVX-512 kernels and VNNI, AVX2 under TSR_CPU_KERNELS=avx2 or without
 * VNNI, the portable build under plain (tests/run.sh runs this file under
 * each). */
static void test_the_build_the_cpu_allows_runs(void **state)
{
    (void)state;
    const char *name = tsr_i8_products_name();
    const tsr_cpu_kernels_t k = tsr_cpu_kernels();
    printf("int8 products: %s (%s kernels)\n", name, tsr_cpu_kernels_name(k));
    const char *want = "portable build";
#if defined(__x86_64__)
    if (k == TSR_KERNELS_AVX512 && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("avx512bw"))
        want = "AVX512-VNNI";
    else if (k != TSR_KERNELS_PLAIN)
        want = "AVX2";
#endif
    assert_string_equal(name, want);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_weights_quantize_to_nearest_even_by_the_rows_largest),
        cmocka_unit_test(test_every_output_has_the_bits_of_the_stated_rule),
        cmocka_unit_test(test_a_row_has_the_same_bits_whatever_it_is_batched_with),
        cmocka_unit_test(test_products_stay_within_the_inputs_quantization),
        cmocka_unit_test(test_a_nan_input_turns_only_its_row_nan),
        cmocka_unit_test(test_the_build_the_cpu_allows_runs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
