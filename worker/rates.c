/* rates.c: a CPU worker's memory read rate, measured once at start. */
#include "rates.h"

#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "cpu_pool.h"

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

double tsr_measure_read_gbs(int *threads)
{
    *threads = 0;
    tsr_pool_t *pool = tsr_pool_new(0);
    if (!pool) return 0;
    void *mem = mmap(NULL, READ_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        tsr_pool_destroy(&pool);
        return 0;
    }
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
    *threads = job.parts;
    munmap(mem, READ_BYTES);
    tsr_pool_destroy(&pool);
    return best;
}
