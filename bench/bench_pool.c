/* bench_pool.c: matrix products of a decode step, multithreaded OpenBLAS
 * against the CPU engine's thread pool and its f32 products
 * (worker/cpu_pool.c, worker/matmul_f32.c).
 *   bench_pool [--threads N] [--seconds S]
 *
 * The step is a small f32 Llama's projections, back to back: 12 layers of
 * q,k,v fused [768+2*256, 768], o [768, 768], gate+up fused [4096, 768] and
 * down [768, 2048], ~75M weights, 302 MB, far more than any cache, so every
 * step streams all weights from memory and GB/s (weight bytes / step time)
 * is comparable with bench/stream --read's bandwidth.  The pool multiplies
 * the weights packed in panels (tsr_pack_rows), OpenBLAS the row-major
 * copy.  For T = 1, 8, 32 rows:
 *   (a) OpenBLAS with N threads, one sgemv (T = 1) or sgemm per matrix
 *   (b) tsr_pool_matmul with an N-thread pool (OpenBLAS single-threaded)
 *   (c) tsr_pool_matmul with a 1-thread pool
 * and, for T = 1, (b) with helpers that sleep at once, which puts a futex
 * wake-up in every call; and the pool's cost per call alone, an empty
 * job.  N defaults to the CPUs this process may use.
 * Each line is the mean over as many steps as fit in S seconds (default
 * 1.0), after one warm-up step. */
#include <cblas.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "worker/cpu_kernels.h"
#include "worker/cpu_pool.h"
#include "worker/matmul_f32.h"

enum { HIDDEN = 768, KV_DIM = 256, INTER = 2048, LAYERS = 12, MATS = 4, MAX_T = 32 };

typedef struct {
    int in, out;
    float *w, *wp;  /* row-major (OpenBLAS), packed (the pool) */
} mat_t;

typedef struct {
    mat_t m[LAYERS * MATS];
    int n;
    size_t bytes;
    float *x, *y;  /* [MAX_T, max in], [MAX_T, max out] */
} step_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static float *random_floats(size_t n, uint64_t *s)
{
    float *a = aligned_alloc(64, (n * sizeof *a + 63) / 64 * 64);
    if (!a) return NULL;
    for (size_t i = 0; i < n; i++) {
        *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
        a[i] = (float)((*s >> 40) & 0xffff) / 65536.0f - 0.5f;
    }
    return a;
}

/* Returns 0, or -1 when memory ran out; step_free cleans up either way. */
static int step_build(step_t *st)
{
    static const int shape[MATS][2] = {
        {HIDDEN, HIDDEN + 2 * KV_DIM}, {HIDDEN, HIDDEN}, {HIDDEN, 2 * INTER}, {INTER, HIDDEN}};
    uint64_t seed = 42;
    memset(st, 0, sizeof *st);
    for (int l = 0; l < LAYERS; l++) {
        for (int k = 0; k < MATS; k++) {
            mat_t *m = &st->m[st->n];
            m->in = shape[k][0];
            m->out = shape[k][1];
            m->w = random_floats((size_t)m->in * m->out, &seed);
            if (!m->w) return -1;
            /* as the engine holds weights: 2 MiB pages where the kernel offers them */
            const size_t huge = (size_t)2 << 20,
                         len = (tsr_packed_floats(m->out, m->in) * sizeof(float) + huge - 1) & ~(huge - 1);
            m->wp = aligned_alloc(huge, len);
            if (!m->wp) return -1;
            madvise(m->wp, len, MADV_HUGEPAGE);   /* advice: failing it only costs speed */
            tsr_pack_rows(m->wp, m->out, m->in, 0, m->w, m->out);
            tsr_pack_clear_tail(m->wp, m->out, m->in);
            st->n++;
            st->bytes += (size_t)m->in * m->out * sizeof(float);
        }
    }
    st->x = random_floats((size_t)MAX_T * INTER, &seed);
    st->y = random_floats((size_t)MAX_T * 2 * INTER, &seed);
    return st->x && st->y ? 0 : -1;
}

static void step_free(step_t *st)
{
    for (int i = 0; i < st->n; i++) free(st->m[i].w), free(st->m[i].wp);
    free(st->x);
    free(st->y);
}

/* What the engine did before the pool: each product threaded by OpenBLAS. */
static void step_openblas(const step_t *st, int T)
{
    for (int i = 0; i < st->n; i++) {
        const mat_t *m = &st->m[i];
        if (T == 1)
            cblas_sgemv(CblasRowMajor, CblasNoTrans, m->out, m->in, 1.0f, m->w, m->in, st->x, 1,
                        0.0f, st->y, 1);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, m->out, m->in, 1.0f, st->x,
                        m->in, m->w, m->in, 0.0f, st->y, m->out);
    }
}

static void nothing(void *arg, int i)
{
    (void)arg;
    (void)i;
}

/* The pool's own cost per call: an empty job of one index per thread. */
static void measure_handoff(const char *what, tsr_pool_t *p)
{
    int calls = 0;
    double t0 = now_s(), t;
    do {
        for (int i = 0; i < 1000; i++) tsr_pool_for(p, tsr_pool_threads(p), nothing, NULL);
        calls += 1000;
        t = now_s() - t0;
    } while (t < 0.3);
    printf("  %-48s %8.2f us/call\n", what, t / calls * 1e6);
}

static void step_pool(const step_t *st, tsr_pool_t *p, int T)
{
    for (int i = 0; i < st->n; i++) {
        const mat_t *m = &st->m[i];
        tsr_pool_matmul(p, st->y, m->out, st->x, m->wp, T, m->in, m->out);
    }
}

/* Times steps for about `seconds` and prints the mean; p NULL means OpenBLAS. */
static void measure(const char *what, const step_t *st, tsr_pool_t *p, int T, double seconds)
{
    if (p) step_pool(st, p, T);
    else step_openblas(st, T);
    int n = 0;
    double t0 = now_s(), t;
    do {
        if (p) step_pool(st, p, T);
        else step_openblas(st, T);
        n++;
        t = now_s() - t0;
    } while (t < seconds || n < 3);
    double s = t / n;
    printf("  %-48s %8.2f ms/step %7.2f GB/s  (%d steps)\n", what, s * 1e3,
           (double)st->bytes / s / 1e9, n);
}

int main(int argc, char **argv)
{
    int rc = 1, threads = 0;
    double seconds = 1.0;
    tsr_pool_t *pool = NULL, *single = NULL;
    step_t st;
    memset(&st, 0, sizeof st);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) seconds = atof(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_pool [--threads N] [--seconds S]\n");
            goto out;
        }
    }
    cpu_set_t set;
    int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
    if (threads <= 0) threads = cpus;

    if (step_build(&st) < 0) {
        fprintf(stderr, "bench_pool: out of memory for the weights\n");
        goto out;
    }
    pool = tsr_pool_new(threads);
    single = tsr_pool_new(1);
    if (!pool || !single) {
        fprintf(stderr, "bench_pool: cannot start a pool of %d threads\n", threads);
        goto out;
    }
    printf("bench_pool: %d cpus available, %d threads (OpenBLAS and pool), pool kernels %s, %s\n",
           cpus, threads, tsr_cpu_kernels_name(tsr_cpu_kernels()), openblas_get_config());
    printf("  step: %d layers x qkv [%d,%d] o [%d,%d] gate+up [%d,%d] down [%d,%d] = %d "
           "products, %.1fM weights, %.1f MB f32; helper spin %d us\n",
           LAYERS, HIDDEN + 2 * KV_DIM, HIDDEN, HIDDEN, HIDDEN, 2 * INTER, HIDDEN, HIDDEN, INTER,
           st.n, (double)st.bytes / 4e6, (double)st.bytes / 1e6, TSR_POOL_SPIN_US);

    if (threads > 1) {
        printf("empty tsr_pool_for, one index per thread\n");
        measure_handoff("helpers spinning", pool);
        tsr_pool_set_spin_us(pool, 0);
        measure_handoff("helpers asleep (futex wake each call)", pool);
        tsr_pool_set_spin_us(pool, TSR_POOL_SPIN_US);
    }
    static const int Ts[] = {1, 8, 32};
    for (size_t k = 0; k < sizeof Ts / sizeof *Ts; k++) {
        int T = Ts[k];
        char what[64];
        printf("T=%d (%s per product)\n", T, T == 1 ? "sgemv" : "sgemm");
        /* (a) OpenBLAS threaded; single-threaded while the pool runs (b), so its
         * threads do not contend for the same cores */
        openblas_set_num_threads(threads);
        snprintf(what, sizeof what, "(a) OpenBLAS, %d threads", threads);
        measure(what, &st, NULL, T, seconds);
        openblas_set_num_threads(1);
        snprintf(what, sizeof what, "(b) pool, %d threads", threads);
        measure(what, &st, pool, T, seconds);
        if (T == 1 && threads > 1) {
            tsr_pool_set_spin_us(pool, 0);
            snprintf(what, sizeof what, "(b) pool, %d threads, no spin (futex each call)",
                     threads);
            measure(what, &st, pool, T, seconds);
            tsr_pool_set_spin_us(pool, TSR_POOL_SPIN_US);
        }
        measure("(c) pool, 1 thread", &st, single, T, seconds);
    }
    rc = 0;
out:
    tsr_pool_destroy(&pool);
    tsr_pool_destroy(&single);
    step_free(&st);
    return rc;
}
