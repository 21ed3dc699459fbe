/* stream.c: a STREAM-like copy bandwidth, the bound decode is measured
 * against (each decoded token reads every weight once).  Bytes are counted
 * as STREAM counts them for Copy: read plus written.
 *   stream [--threads N] [--mib M]
 * Prints "copy_bandwidth_gbs X memcpy_gbs Y": STREAM's Copy loop and, for
 * comparison, libc memcpy (which may use non-temporal stores), each the best
 * of 10 passes over two M-MiB arrays split across N threads. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    float *dst;
    const float *src;
    size_t n;
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

int main(int argc, char **argv)
{
    int threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    size_t mib = 512;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--mib")) mib = (size_t)atol(argv[i + 1]);
    }
    if (threads < 1 || threads > 256 || mib < 16) {
        fprintf(stderr, "usage: stream [--threads 1..256] [--mib >=16]\n");
        return 2;
    }
    size_t n = mib * 1024 * 1024 / sizeof(float);
    float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
    if (!a || !b) return 1;
    for (size_t i = 0; i < n; i++) a[i] = (float)i, b[i] = 0;  /* fault the pages in */
    double best[2] = {1e9, 1e9};
    pthread_t th[256];
    part_t parts[256];
    void *(*kernel[2])(void *) = {copy_part, memcpy_part};
    for (int k = 0; k < 2; k++)
        for (int pass = 0; pass < 10; pass++) {
            double t0 = now_s();
            for (int t = 0; t < threads; t++) {
                size_t lo = n * t / threads, hi = n * (t + 1) / threads;
                parts[t] = (part_t){b + lo, a + lo, hi - lo};
                pthread_create(&th[t], NULL, kernel[k], &parts[t]);
            }
            for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
            double dt = now_s() - t0;
            if (dt < best[k]) best[k] = dt;
        }
    printf("copy_bandwidth_gbs %.2f memcpy_gbs %.2f threads %d array_mib %zu check %.0f\n",
           2.0 * n * sizeof(float) / best[0] / 1e9, 2.0 * n * sizeof(float) / best[1] / 1e9,
           threads, mib, (double)b[n / 2]);
    free(a);
    free(b);
    return 0;
}
