/* rates.c: a CPU worker's memory read rate and product rate, measured once at start. */
#include "rates.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "cpu_pool.h"
#include "matmul_f32.h"

#define READ_BYTES ((size_t)128 << 20)
#define PASSES 3

typedef struct {
    uint64_t *buf;
    size_t words;
    int parts;
    _Atomic uint64_t sink;      /* the sums, so the reads are not optimised away */
} read_job_t;

static void span(const read_job_t *j, int i, size_t *b, size_t *e)
{
    size_t per = j->words / (size_t)j->parts;
    *b = per * (size_t)i;
    *e = i + 1 == j->parts ? j->words : *b + per;
}

/* Each thread writes its share first, so the pages are real (not the shared zero
 * page) and, on a NUMA machine, next to the thread that reads them. */
static void fill_part(void *arg, int i)
{
    read_job_t *j = arg;
    size_t b, e;
    span(j, i, &b, &e);
    for (size_t k = b; k < e; k++) j->buf[k] = k;
}

/* Four sums in flight, as a product's kernel keeps several reads going. */
static void read_part(void *arg, int i)
{
    read_job_t *j = arg;
    size_t b, e;
    span(j, i, &b, &e);
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    const uint64_t *p = j->buf;
    size_t k = b;
    for (; k + 4 <= e; k += 4) s0 += p[k], s1 += p[k + 1], s2 += p[k + 2], s3 += p[k + 3];
    for (; k < e; k++) s0 += p[k];
    atomic_fetch_add_explicit(&j->sink, s0 ^ s1 ^ s2 ^ s3, memory_order_relaxed);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double read_gbs(tsr_pool_t *pool)
{
    void *mem = mmap(NULL, READ_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return 0;
    read_job_t job = {.buf = mem, .words = READ_BYTES / sizeof(uint64_t),
                      .parts = tsr_pool_threads(pool)};
    atomic_init(&job.sink, 0);
    tsr_pool_for(pool, job.parts, fill_part, &job);
    double best = 0;
    for (int pass = 0; pass < PASSES; pass++) {
        double t0 = now_s();
        tsr_pool_for(pool, job.parts, read_part, &job);
        double t = now_s() - t0;
        if (t > 0 && (double)READ_BYTES / t / 1e9 > best) best = (double)READ_BYTES / t / 1e9;
    }
    munmap(mem, READ_BYTES);
    return best;
}

#define MM_N 1024   /* the matrix's rows and columns */
#define MM_T 64     /* the batch's rows */

static double matmul_gflops(tsr_pool_t *pool)
{
    size_t nw = tsr_packed_floats(MM_N, MM_N);
    float *w = aligned_alloc(64, (nw * sizeof *w + 63) / 64 * 64);
    float *rows = malloc((size_t)MM_N * MM_N * sizeof *rows);
    float *x = malloc((size_t)MM_T * MM_N * sizeof *x), *y = malloc((size_t)MM_T * MM_N * sizeof *y);
    double best = 0;
    if (w && rows && x && y) {
        for (size_t i = 0; i < (size_t)MM_N * MM_N; i++) rows[i] = (float)(i % 7) * 0.125f;
        for (size_t i = 0; i < (size_t)MM_T * MM_N; i++) x[i] = (float)(i % 5) * 0.25f;
        tsr_pack_rows(w, MM_N, MM_N, 0, rows, MM_N);
        tsr_pack_clear_tail(w, MM_N, MM_N);
        for (int pass = 0; pass < 5; pass++) {
            double t0 = now_s();
            tsr_pool_matmul(pool, y, MM_N, x, w, MM_T, MM_N, MM_N);
            double t = now_s() - t0;
            double g = 2.0 * MM_T * MM_N * MM_N / t / 1e9;
            if (t > 0 && g > best) best = g;
        }
    }
    free(w);
    free(rows);
    free(x);
    free(y);
    return best;
}

void tsr_measure_rates(double *mem_gbs, double *gflops, int *threads)
{
    *threads = 0;
    if (*mem_gbs > 0 && *gflops > 0) return;
    tsr_pool_t *pool = tsr_pool_new(0);
    if (!pool) return;
    *threads = tsr_pool_threads(pool);
    if (!(*mem_gbs > 0)) *mem_gbs = read_gbs(pool);
    if (!(*gflops > 0)) *gflops = matmul_gflops(pool);
    tsr_pool_destroy(&pool);
}
