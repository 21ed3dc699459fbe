/* test_simd.c: the vector helpers the CPU kernels are built from
 * (worker/simd.h), in both builds the kernels are compiled for: AVX2 with
 * FMA, and plain x86-64. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "worker/simd.h"

/* exp8 over n inputs (a multiple of 8), in the two builds. */
__attribute__((target("avx2,fma"))) static void exp_fma(const float *x, float *y, int n)
{
    for (int i = 0; i < n; i += 8) {
        v8f v = exp8(load8(x + i));
        memcpy(y + i, &v, sizeof v);
    }
}

static void exp_plain(const float *x, float *y, int n)
{
    for (int i = 0; i < n; i += 8) {
        v8f v = exp8(load8(x + i));
        memcpy(y + i, &v, sizeof v);
    }
}

/* The largest error of y against exp(x) in double, in units of the
 * float spacing at the true value. */
static double worst_ulps(const float *x, const float *y, int n, float *at)
{
    double worst = 0;
    for (int i = 0; i < n; i++) {
        double t = exp((double)x[i]);
        if (x[i] < -87.0f) t = exp(-87.0);      /* the documented floor */
        double ulp = nextafterf((float)t, INFINITY) - (float)t;
        double e = fabs((double)y[i] - t) / ulp;
        if (e > worst) worst = e, *at = x[i];
    }
    return worst;
}

static void test_the_vector_exponential_is_within_one_and_a_half_float_steps_of_exp(void **state)
{
    (void)state;
    enum { N = 1 << 20 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    assert_non_null(x);
    assert_non_null(y);
    srand(7);
    for (int i = 0; i < N; i++) {
        /* a grid over [-90, 0], then random points, the ends included */
        x[i] = i < N / 2 ? -90.0f * (float)i / (N / 2 - 1)
                         : -(float)rand() / RAND_MAX * (i % 3 ? 1.0f : 87.0f);
    }
    x[N - 1] = 0.0f, x[N - 2] = -0.0f, x[N - 3] = -1e-30f, x[N - 4] = -87.0f;
    for (int build = 0; build < 2; build++) {
        if (build == 0 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
            continue;
        (build == 0 ? exp_fma : exp_plain)(x, y, N);
        float at = 0;
        double w = worst_ulps(x, y, N, &at);
        if (w > 1.5) print_error("%s build: %.2f float steps from exp at x = %.9g\n",
                                 build == 0 ? "FMA" : "plain", w, at);
        assert_true(w <= 1.5);
        assert_true(y[N - 1] == 1.0f);
    }
    free(x);
    free(y);
}

/* hadd8 pairs neighbouring lanes of its two vectors as documented. */
static void test_lane_pair_sums_take_the_documented_lanes(void **state)
{
    (void)state;
    v8f a, b;
    for (int i = 0; i < 8; i++) a[i] = (float)(1 << i), b[i] = (float)(1 << (i + 8));
    v8f h = hadd8(a, b);
    const int want[8][2] = {{0, 1}, {2, 3}, {8, 9}, {10, 11}, {4, 5}, {6, 7}, {12, 13}, {14, 15}};
    for (int i = 0; i < 8; i++)
        assert_float_equal(h[i], (float)((1 << want[i][0]) + (1 << want[i][1])), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_the_vector_exponential_is_within_one_and_a_half_float_steps_of_exp),
        cmocka_unit_test(test_lane_pair_sums_take_the_documented_lanes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
