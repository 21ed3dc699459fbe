/* test_cpu_pool.c: the CPU engine's thread pool runs every index once,
 * computes the same products as a plain loop, and neither hangs nor leaks
 * its threads.  A hang fails the run: alarm() kills the binary. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "worker/cpu_kernels.h"
#include "worker/cpu_pool.h"
#include "worker/matmul_f32.h"

#define SENTINEL 12345.0f

typedef struct {
    atomic_int *count;
} count_job_t;

static void count_index(void *arg, int i)
{
    count_job_t *j = arg;
    atomic_fetch_add(&j->count[i], 1);
}

static void test_every_index_runs_exactly_once(void **state)
{
    (void)state;
    static const int threads[] = {1, 2, 4};
    static const int ns[] = {0, 1, 2, 3, 17, 1000};
    for (size_t t = 0; t < sizeof threads / sizeof *threads; t++) {
        tsr_pool_t *p = tsr_pool_new(threads[t]);
        assert_non_null(p);
        assert_int_equal(tsr_pool_threads(p), threads[t]);
        for (size_t k = 0; k < sizeof ns / sizeof *ns; k++) {
            int n = ns[k];
            atomic_int *count = calloc((size_t)n + 1, sizeof *count);
            assert_non_null(count);
            count_job_t j = {count};
            tsr_pool_for(p, n, count_index, &j);
            for (int i = 0; i < n; i++) {
                if (atomic_load(&count[i]) != 1)
                    fail_msg("threads %d n %d: index %d ran %d times", threads[t], n, i,
                             atomic_load(&count[i]));
            }
            assert_int_equal(atomic_load(&count[n]), 0);  /* nothing past the end */
            free(count);
        }
        tsr_pool_destroy(&p);
    }
}

/* Each index waits (up to 10 s) until two threads are inside fn at once:
 * it returns only if helpers really take indices alongside the caller. */
typedef struct {
    atomic_int inside;
    atomic_int max_inside;
} overlap_job_t;

static void wait_for_company(void *arg, int i)
{
    (void)i;
    overlap_job_t *j = arg;
    int now = atomic_fetch_add(&j->inside, 1) + 1;
    int seen = atomic_load(&j->max_inside);
    while (now > seen && !atomic_compare_exchange_weak(&j->max_inside, &seen, now)) {
    }
    for (int spins = 0; atomic_load(&j->max_inside) < 2 && spins < 10000; spins++)
        usleep(1000);
    atomic_fetch_sub(&j->inside, 1);
}

static void test_helpers_run_indices_alongside_the_caller(void **state)
{
    (void)state;
    tsr_pool_t *p = tsr_pool_new(4);
    assert_non_null(p);
    overlap_job_t j = {0, 0};
    tsr_pool_for(p, 4, wait_for_company, &j);
    assert_true(atomic_load(&j.max_inside) >= 2);
    tsr_pool_destroy(&p);
}

/* ---- matrix products -------------------------------------------------------- */

static float rnd(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((*s >> 40) & 0xffff) / 32768.0f - 1.0f;
}

/* W[out, in] packed for tsr_pool_matmul; the caller frees it. */
static float *packed(const float *w, int out, int in)
{
    size_t n = tsr_packed_floats(out, in);
    float *wp = malloc((n ? n : 1) * sizeof *wp);
    assert_non_null(wp);
    memset(wp, 0xff, (n ? n : 1) * sizeof *wp);   /* NaN everywhere: padding must be cleared */
    tsr_pack_rows(wp, out, in, 0, w, out);
    tsr_pack_clear_tail(wp, out, in);
    return wp;
}

/* Runs y = x . W^T through the pool into columns [0, out) of a matrix with
 * ldy = out + 5 columns, and checks it against a double-precision loop
 * (relative 1e-4 of the sum of |terms|) and that the other columns kept
 * their sentinel. */
static void check_matmul(tsr_pool_t *p, int T, int in, int out)
{
    int ldy = out + 5;
    uint64_t s = (uint64_t)(T * 1000003 + in * 1009 + out);
    float *x = malloc((size_t)T * in * sizeof *x);
    float *w = malloc((size_t)out * in * sizeof *w);
    float *y = malloc((size_t)T * ldy * sizeof *y);
    assert_non_null(x);
    assert_non_null(w);
    assert_non_null(y);
    for (int i = 0; i < T * in; i++) x[i] = rnd(&s);
    for (int i = 0; i < out * in; i++) w[i] = rnd(&s);
    for (int i = 0; i < T * ldy; i++) y[i] = SENTINEL;

    float *wp = packed(w, out, in);
    tsr_pool_matmul(p, y, ldy, x, wp, T, in, out);
    free(wp);

    for (int t = 0; t < T; t++) {
        for (int o = 0; o < out; o++) {
            double ref = 0, mag = 0;
            for (int i = 0; i < in; i++) {
                double term = (double)x[t * in + i] * w[o * in + i];
                ref += term;
                mag += fabs(term);
            }
            double got = y[t * ldy + o];
            if (fabs(got - ref) > 1e-4 * mag + 1e-6)
                fail_msg("T %d in %d out %d threads %d: y[%d][%d] = %g, expected %g", T, in, out,
                         tsr_pool_threads(p), t, o, got, ref);
        }
        for (int o = out; o < ldy; o++) {
            if (y[t * ldy + o] != SENTINEL)
                fail_msg("T %d in %d out %d: column %d (outside the output) was written", T, in,
                         out, o);
        }
    }
    free(x);
    free(w);
    free(y);
}

static void test_matmul_equals_a_naive_loop_into_a_column_range(void **state)
{
    (void)state;
    static const int threads[] = {1, 3, 4};
    static const int Ts[] = {1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 25, 64};
    static const int outs[] = {1, 15, 16, 17, 100, 513};
    static const int ins[] = {1, 7, 64};
    for (size_t h = 0; h < sizeof threads / sizeof *threads; h++) {
        tsr_pool_t *p = tsr_pool_new(threads[h]);
        assert_non_null(p);
        for (size_t a = 0; a < sizeof Ts / sizeof *Ts; a++)
            for (size_t b = 0; b < sizeof outs / sizeof *outs; b++)
                for (size_t c = 0; c < sizeof ins / sizeof *ins; c++)
                    check_matmul(p, Ts[a], ins[c], outs[b]);
        tsr_pool_destroy(&p);
    }
}

static void test_matmul_splits_a_512_token_prefill(void **state)
{
    (void)state;
    tsr_pool_t *p = tsr_pool_new(4);
    assert_non_null(p);
    check_matmul(p, 512, 96, 333);   /* 21 blocks over 4 threads, the last one partial */
    check_matmul(p, 512, 200, 1000);
    check_matmul(p, 1, 2048, 4100);  /* decode-sized, out not a multiple of 16 */
    check_matmul(p, 13, 6000, 40);   /* rows so long that a token block is its minimum, 12 */
    tsr_pool_destroy(&p);
}

/* A row of y has the same bits whatever other rows of x share the product
 * (1 to 13 or 40 of them, at every offset, so every tile height of the
 * AVX2 and AVX-512 builds and every position in a tile is crossed):
 * what lets a batched sequence get exactly its tokens alone. */
static void test_a_row_has_the_same_bits_whatever_it_is_batched_with(void **state)
{
    (void)state;
    enum { T = 40, IN = 70, OUT = 203 };   /* IN not a multiple of 8, OUT not of 16 */
    uint64_t s = 77;
    float *x = malloc(sizeof(float) * T * IN), *w = malloc(sizeof(float) * OUT * IN);
    float *all = malloc(sizeof(float) * T * OUT), *part = malloc(sizeof(float) * 13 * OUT);
    assert_true(x && w && all && part);
    for (int i = 0; i < T * IN; i++) x[i] = rnd(&s);
    for (int i = 0; i < OUT * IN; i++) w[i] = rnd(&s);
    tsr_pool_t *p = tsr_pool_new(2);
    assert_non_null(p);
    float *wp = packed(w, OUT, IN);
    tsr_pool_matmul(p, all, OUT, x, wp, T, IN, OUT);
    for (int n = 1; n <= 13; n++)
        for (int t = 0; t + n <= T; t++) {
            tsr_pool_matmul(p, part, OUT, x + (size_t)t * IN, wp, n, IN, OUT);
            for (int r = 0; r < n; r++)
                if (memcmp(part + (size_t)r * OUT, all + (size_t)(t + r) * OUT, sizeof(float) * OUT))
                    fail_msg("row %d computed with %d row(s) differs from the same row among %d",
                             t + r, n, T);
        }
    tsr_pool_destroy(&p);
    free(x), free(w), free(wp), free(all), free(part);
}

/* The fused builds (AVX2, AVX-512) compute every output as one fused
 * multiply-add chain over k in order from 0: the same bits as fmaf in a
 * loop, so the two builds agree with each other whichever a machine picks
 * (tests/run.sh runs this under TSR_CPU_KERNELS=avx2 too).  The portable
 * build may round each product, and is checked against the loop above. */
static void test_fused_builds_give_the_bits_of_an_fmaf_chain(void **state)
{
    (void)state;
    if (tsr_cpu_kernels() == TSR_KERNELS_PLAIN) {
        print_message("the portable kernels run here (TSR_CPU_KERNELS=plain or no AVX2+FMA)\n");
        skip();
    }
    enum { IN = 37, OUT = 83, MAXT = 27 };   /* 6 panels, the last of 3 columns */
    uint64_t s = 91;
    float *x = malloc(sizeof(float) * MAXT * IN), *w = malloc(sizeof(float) * OUT * IN);
    float *y = malloc(sizeof(float) * MAXT * OUT);
    assert_true(x && w && y);
    for (int i = 0; i < MAXT * IN; i++) x[i] = rnd(&s);
    for (int i = 0; i < OUT * IN; i++) w[i] = rnd(&s);
    float *wp = packed(w, OUT, IN);
    tsr_pool_t *p = tsr_pool_new(2);
    assert_non_null(p);
    for (int T = 1; T <= MAXT; T++) {
        tsr_pool_matmul(p, y, OUT, x, wp, T, IN, OUT);
        for (int t = 0; t < T; t++)
            for (int o = 0; o < OUT; o++) {
                float want = 0.0f;
                for (int k = 0; k < IN; k++) want = fmaf(w[o * IN + k], x[t * IN + k], want);
                if (memcmp(&want, &y[t * OUT + o], sizeof want))
                    fail_msg("%s kernels, T %d: y[%d][%d] = %.9g, the fmaf chain gives %.9g",
                             tsr_cpu_kernels_name(tsr_cpu_kernels()), T, t, o, y[t * OUT + o],
                             want);
            }
    }
    tsr_pool_destroy(&p);
    free(x), free(w), free(wp), free(y);
}

/* Packing in pieces (q, k, v into one fused matrix; blocks of rows) gives
 * the same panels as packing at once; every row reads back; the padding of
 * the last panel is zero. */
static void test_packing_in_pieces_round_trips_every_row(void **state)
{
    (void)state;
    enum { OUT = 37, IN = 9 };   /* two whole panels and 5 rows of a third */
    float w[OUT * IN], row[IN];
    for (int i = 0; i < OUT * IN; i++) w[i] = (float)i;
    float *whole = packed(w, OUT, IN);
    size_t n = tsr_packed_floats(OUT, IN);
    assert_int_equal(n, 48 * IN);
    float *parts = malloc(n * sizeof *parts);
    assert_non_null(parts);
    memset(parts, 0xff, n * sizeof *parts);
    tsr_pack_rows(parts, OUT, IN, 20, w + 20 * IN, 17);   /* the tail first */
    tsr_pack_rows(parts, OUT, IN, 0, w, 3);
    tsr_pack_rows(parts, OUT, IN, 3, w + 3 * IN, 17);
    tsr_pack_rows(parts, OUT, IN, 36, w, 5);              /* rows 37.. are skipped */
    tsr_pack_rows(parts, OUT, IN, 36, w + 36 * IN, 1);
    tsr_pack_clear_tail(parts, OUT, IN);
    assert_memory_equal(whole, parts, n * sizeof *parts);
    for (int r = 0; r < OUT; r++) {
        tsr_packed_row(whole, IN, r, row);
        assert_memory_equal(row, w + r * IN, sizeof row);
    }
    for (int k = 0; k < IN; k++)
        for (int lane = OUT % 16; lane < 16; lane++)
            assert_true(whole[(size_t)(2 * IN + k) * 16 + lane] == 0.0f);
    assert_int_equal(tsr_packed_floats(0, IN), 0);
    assert_int_equal(tsr_packed_floats(16, IN), 16 * IN);
    free(whole);
    free(parts);
}

static void test_matmul_with_no_inputs_writes_zeros(void **state)
{
    (void)state;
    tsr_pool_t *p = tsr_pool_new(2);
    assert_non_null(p);
    float y[2][4] = {{SENTINEL, SENTINEL, SENTINEL, SENTINEL},
                     {SENTINEL, SENTINEL, SENTINEL, SENTINEL}};
    float x = 0, w = 0;
    tsr_pool_matmul(p, &y[0][0], 4, &x, &w, 2, 0, 3);   /* in 0: nothing is read from w */
    for (int t = 0; t < 2; t++) {
        for (int o = 0; o < 3; o++) assert_true(y[t][o] == 0.0f);
        assert_true(y[t][3] == SENTINEL);
    }
    tsr_pool_destroy(&p);
}

/* ---- lifetime ----------------------------------------------------------------- */

/* Spinning helpers, sleeping helpers (spin 0: every call goes through the
 * futex) and the mix of both on an oversubscribed host must all finish. */
static void test_pool_is_reused_for_10000_back_to_back_calls(void **state)
{
    (void)state;
    static const int spins[] = {TSR_POOL_SPIN_US, 0, 1};
    alarm(120);
    for (size_t k = 0; k < sizeof spins / sizeof *spins; k++) {
        tsr_pool_t *p = tsr_pool_new(4);
        assert_non_null(p);
        tsr_pool_set_spin_us(p, spins[k]);
        atomic_int count[8] = {0};
        count_job_t j = {count};
        for (int call = 0; call < 10000; call++) tsr_pool_for(p, 1 + call % 8, count_index, &j);
        for (int i = 0; i < 8; i++) {
            int expect = 0;  /* calls whose n exceeds i */
            for (int n = 1; n <= 8; n++) if (n > i) expect += 10000 / 8;
            assert_int_equal(atomic_load(&count[i]), expect);
        }
        tsr_pool_destroy(&p);
        assert_null(p);
    }
    alarm(0);
}

static void test_pool_is_reused_for_10000_back_to_back_products(void **state)
{
    (void)state;
    alarm(120);
    tsr_pool_t *p = tsr_pool_new(4);
    assert_non_null(p);
    enum { IN = 128, OUT = 256 };
    static float w[OUT * IN], x[IN], y[OUT];
    for (int o = 0; o < OUT; o++)
        for (int i = 0; i < IN; i++) w[o * IN + i] = (float)((o + i) % 5);
    for (int i = 0; i < IN; i++) x[i] = 1.0f;
    float *wp = packed(w, OUT, IN);
    for (int call = 0; call < 10000; call++) {
        y[call % OUT] = -1;
        tsr_pool_matmul(p, y, OUT, x, wp, 1, IN, OUT);
    }
    free(wp);
    for (int o = 0; o < OUT; o++) {
        float ref = 0;
        for (int i = 0; i < IN; i++) ref += w[o * IN + i];
        assert_true(y[o] == ref);
    }
    tsr_pool_destroy(&p);
    alarm(0);
}

static void test_destroy_joins_idle_threads(void **state)
{
    (void)state;
    alarm(30);
    /* helpers asleep on the futex after a job */
    tsr_pool_t *p = tsr_pool_new(4);
    assert_non_null(p);
    atomic_int count[4] = {0};
    count_job_t j = {count};
    tsr_pool_for(p, 4, count_index, &j);
    usleep(20 * 1000);  /* far past the spin */
    tsr_pool_destroy(&p);
    assert_null(p);
    /* helpers that may not have run yet */
    p = tsr_pool_new(4);
    assert_non_null(p);
    tsr_pool_destroy(&p);
    assert_null(p);
    /* helpers still spinning */
    p = tsr_pool_new(3);
    assert_non_null(p);
    tsr_pool_for(p, 4, count_index, &j);
    tsr_pool_destroy(&p);
    assert_null(p);
    tsr_pool_destroy(&p);    /* NULL-safe */
    tsr_pool_destroy(NULL);
    alarm(0);
}

static void test_thread_count_defaults_to_affinity_or_TSR_THREADS(void **state)
{
    (void)state;
    cpu_set_t set;
    assert_int_equal(sched_getaffinity(0, sizeof set, &set), 0);
    int cpus = CPU_COUNT(&set);

    unsetenv("TSR_THREADS");
    tsr_pool_t *p = tsr_pool_new(0);
    assert_non_null(p);
    assert_int_equal(tsr_pool_threads(p), cpus);
    tsr_pool_destroy(&p);

    setenv("TSR_THREADS", "3", 1);
    p = tsr_pool_new(-1);
    assert_non_null(p);
    assert_int_equal(tsr_pool_threads(p), 3);
    tsr_pool_destroy(&p);

    p = tsr_pool_new(2);  /* an explicit count wins over the variable */
    assert_non_null(p);
    assert_int_equal(tsr_pool_threads(p), 2);
    tsr_pool_destroy(&p);

    setenv("TSR_THREADS", "many", 1);  /* warned about, then ignored */
    p = tsr_pool_new(0);
    assert_non_null(p);
    assert_int_equal(tsr_pool_threads(p), cpus);
    tsr_pool_destroy(&p);
    unsetenv("TSR_THREADS");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_index_runs_exactly_once),
        cmocka_unit_test(test_helpers_run_indices_alongside_the_caller),
        cmocka_unit_test(test_matmul_equals_a_naive_loop_into_a_column_range),
        cmocka_unit_test(test_a_row_has_the_same_bits_whatever_it_is_batched_with),
        cmocka_unit_test(test_fused_builds_give_the_bits_of_an_fmaf_chain),
        cmocka_unit_test(test_matmul_splits_a_512_token_prefill),
        cmocka_unit_test(test_packing_in_pieces_round_trips_every_row),
        cmocka_unit_test(test_matmul_with_no_inputs_writes_zeros),
        cmocka_unit_test(test_pool_is_reused_for_10000_back_to_back_calls),
        cmocka_unit_test(test_pool_is_reused_for_10000_back_to_back_products),
        cmocka_unit_test(test_destroy_joins_idle_threads),
        cmocka_unit_test(test_thread_count_defaults_to_affinity_or_TSR_THREADS),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
