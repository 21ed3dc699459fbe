/* stream.c: a STREAM-like copy bandwidth, the bound decode is measured
 * against (each decoded token reads every weight once).  Bytes are counted
 * as STREAM counts them for Copy: read plus written.
 *   stream [--threads N] [--mib M]
 * Prints "copy_bandwidth_gbs X memcpy_gbs Y": STREAM's Copy loop and, for
 * comparison, libc memcpy (which may use non-temporal stores), each the best
 * of 10 passes over two M-MiB arrays split across N threads.
 *   stream --read [--threads N] [--mib M]
 * Prints "read_bandwidth_gbs X": bytes read per second by N threads summing
 * their share of one M-MiB array (default 1024, far beyond any last-level
 * cache), best of 10 passes, for 1, 2, 4 and 8 streams per thread
 * over adjacent 32 KiB blocks (all printed); X is the fastest.  Decode only reads its weights, so this is the
 * closer bound (bench/serve.sh); a copy also pays for the writes. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    float *dst;
    const float *src;
    size_t n;
    uint64_t sum;               /* read_part's result, so the reads are kept */
} part_t;

/* STREAM's Copy kernel, c[j] = a[j], as a plain loop: kept a loop (not
 * turned into memcpy, whose non-temporal stores would measure something
 * else) so it moves data the way compiled code does. */
__attribute__((optimize("O3", "no-tree-loop-distribute-patterns")))
static void *copy_part(void *arg)
{
    part_t *p = arg;
    float *restrict d = p->dst;
    const float *restrict s = p->src;
    for (size_t i = 0; i < p->n; i++) d[i] = s[i];
    return NULL;
}

/* Streams each read_part thread reads at once (set before a pass). */
static int g_streams = 1;
#define READ_BLOCK_WORDS 4096   /* 32 KiB: about a weight panel of the CPU engine */

/* Sums 64-bit words with independent accumulators: integer adds vectorise
 * without -ffast-math and never limit the loop, so memory does.  The share
 * is read in groups of g_streams adjacent 32 KiB blocks, side by side, a
 * cache line of each per turn, the way the CPU engine's decode kernel
 * reads four weight panels at once: a core keeps more reads in flight over
 * several sequential streams than over one, so a one-stream read would
 * understate what the machine can read. */
/* 4 words, one 32-byte load (two 16-byte halves without AVX); never passed
 * across a call that is not inlined, so GCC's ABI note is moot. */
#pragma GCC diagnostic ignored "-Wpsabi"
typedef uint64_t v4u __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v4u load4u(const uint64_t *p)
{
    v4u v;
    memcpy(&v, p, sizeof v);
    return v;
}

__attribute__((optimize("O3"), target_clones("avx2", "default")))
static void *read_part(void *arg)
{
    part_t *p = arg;
    const uint64_t *restrict s = (const uint64_t *)p->src;
    size_t n = p->n * sizeof(float) / sizeof(uint64_t);
    const size_t B = READ_BLOCK_WORDS, group = B * (size_t)g_streams;
    v4u acc[8] = {{0}};
    size_t g = 0;
    for (; g + group <= n; g += group)
        for (size_t i = 0; i < B; i += 8)
            for (int j = 0; j < g_streams; j++) {
                const uint64_t *line = s + g + (size_t)j * B + i;
                acc[2 * (j & 3)] += load4u(line);
                acc[2 * (j & 3) + 1] += load4u(line + 4);
            }
    uint64_t sum = 0;
    for (; g < n; g++) sum += s[g];
    for (int k = 0; k < 8; k++) sum += acc[k][0] + acc[k][1] + acc[k][2] + acc[k][3];
    p->sum = sum;
    return NULL;
}

/* Each thread faults in its own share, so on a NUMA machine the pages sit
 * next to the thread that reads them (first touch). */
static void *fill_part(void *arg)
{
    part_t *p = arg;
    for (size_t i = 0; i < p->n; i++) p->dst[i] = (float)i;
    return NULL;
}

static void *memcpy_part(void *arg)
{
    part_t *p = arg;
    memcpy(p->dst, p->src, p->n * sizeof(float));
    return NULL;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Best time of 10 passes of kernel over the n floats at src (into dst, when
 * it copies), split across threads; adds the kernels' sums to *sum. */
static double best_of_10(void *(*kernel)(void *), float *dst, float *src, size_t n, int threads,
                         uint64_t *sum)
{
    pthread_t th[256];
    part_t parts[256];
    double best = 1e9;
    for (int pass = 0; pass < 10; pass++) {
        double t0 = now_s();
        for (int t = 0; t < threads; t++) {
            size_t lo = n * t / threads, hi = n * (t + 1) / threads;
            parts[t] = (part_t){dst ? dst + lo : NULL, src + lo, hi - lo, 0};
            pthread_create(&th[t], NULL, kernel, &parts[t]);
        }
        for (int t = 0; t < threads; t++) {
            pthread_join(th[t], NULL);
            if (sum) *sum += parts[t].sum;
        }
        double dt = now_s() - t0;
        if (dt < best) best = dt;
    }
    return best;
}

static int read_mode(int threads, size_t mib)
{
    size_t n = mib * 1024 * 1024 / sizeof(float);
    n -= n % (2 * (size_t)threads);  /* every share a whole number of 64-bit words */
    float *a = malloc(n * sizeof *a);
    if (!a) return 1;
    pthread_t th[256];
    part_t parts[256];
    for (int t = 0; t < threads; t++) {
        size_t lo = n * t / threads, hi = n * (t + 1) / threads;
        parts[t] = (part_t){a + lo, a + lo, hi - lo, 0};
        pthread_create(&th[t], NULL, fill_part, &parts[t]);
    }
    for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
    uint64_t sum = 0;
    static const int streams[] = {1, 2, 4, 8};
    double gbs[4], top = 0;
    int top_s = 1;
    for (int i = 0; i < 4; i++) {
        g_streams = streams[i];
        gbs[i] = (double)n * sizeof(float) / best_of_10(read_part, NULL, a, n, threads, &sum) / 1e9;
        if (gbs[i] > top) top = gbs[i], top_s = streams[i];
    }
    printf("read_bandwidth_gbs %.2f threads %d array_mib %zu streams %d (1: %.2f, 2: %.2f, "
           "4: %.2f, 8: %.2f) check %llu\n", top, threads, mib, top_s, gbs[0], gbs[1], gbs[2],
           gbs[3], (unsigned long long)(sum % 1000003));
    free(a);
    return 0;
}

int main(int argc, char **argv)
{
    int threads = (int)sysconf(_SC_NPROCESSORS_ONLN), read = 0;
    size_t mib = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--read")) read = 1;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = (size_t)atol(argv[++i]);
        else threads = 0;  /* unknown: usage below */
    }
    if (!mib) mib = read ? 1024 : 512;
    if (threads < 1 || threads > 256 || mib < 16) {
        fprintf(stderr, "usage: stream [--read] [--threads 1..256] [--mib >=16]\n");
        return 2;
    }
    if (read) return read_mode(threads, mib);
    size_t n = mib * 1024 * 1024 / sizeof(float);
    float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
    if (!a || !b) return 1;
    for (size_t i = 0; i < n; i++) a[i] = (float)i, b[i] = 0;  /* fault the pages in */
    double best[2];
    best[0] = best_of_10(copy_part, b, a, n, threads, NULL);
    best[1] = best_of_10(memcpy_part, b, a, n, threads, NULL);
    printf("copy_bandwidth_gbs %.2f memcpy_gbs %.2f threads %d array_mib %zu check %.0f\n",
           2.0 * n * sizeof(float) / best[0] / 1e9, 2.0 * n * sizeof(float) / best[1] / 1e9,
           threads, mib, (double)b[n / 2]);
    free(a);
    free(b);
    return 0;
}
