/* matmul.c: the CPU engine's bf16 products (worker/matmul_bf16.c) or its
 * int8 ones (worker/matmul_i8.c) at the batch sizes a serving step has.
 *   matmul [--weights bf16|int8] [--threads N] [--out O --in I]
 *
 * For T = 1, 16, 32, 64, 128 rows it multiplies f32 rows by one packed bf16
 * (default) or int8 matrix (default the 58M serving model's shapes,
 * bench/serve.sh: q,k,v fused 1536 x 512, gate+up fused 2752 x 512, down
 * 512 x 1376), repeated until about 0.2 s have passed, and prints the best
 * call's time and GFLOP/s (the call as the engine makes it: rounding x to
 * bf16, or quantizing it, on the calling thread, then the product on the
 * pool).  The matrices are small
 * enough to stay in L2 and the LLC, so this is the products' rate, not
 * memory's (bench/serve.sh and bench/engine_step measure whole steps).  N defaults to the CPUs this process may use. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "worker/cpu_kernels.h"
#include "worker/cpu_pool.h"
#include "worker/matmul_bf16.h"
#include "worker/matmul_i8.h"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int measure(tsr_pool_t *p, int out, int in, int int8)
{
    static const int Ts[] = {1, 16, 32, 64, 128};
    const size_t bytes = int8 ? tsr_i8_packed_bytes(out, in)
                              : tsr_bf16_packed_elems(out, in) * sizeof(uint16_t);
    void *w = calloc(bytes, 1);
    float *rows = malloc((size_t)in * sizeof *rows);
    if (!w || !rows) {
        fprintf(stderr, "matmul: no memory for a %d x %d matrix\n", out, in);
        free(w), free(rows);
        return -1;
    }
    for (int o = 0; o < out; o++) {
        for (int k = 0; k < in; k++) rows[k] = (float)((o * 31 + k * 17) % 97 - 48) / 256.0f;
        const float scale = tsr_i8_row_scale(rows, in);
        if (int8) tsr_i8_pack_rows(w, out, in, o, rows, in, &scale, 1);
        else tsr_bf16_pack_rows(w, out, in, o, rows, 1);
    }
    for (size_t i = 0; i < sizeof Ts / sizeof *Ts; i++) {
        const int T = Ts[i];
        float *x = malloc((size_t)T * in * sizeof *x), *y = malloc((size_t)T * out * sizeof *y);
        const size_t xbytes = int8 ? tsr_i8_x_bytes(T, in)
                                   : (size_t)T * tsr_bf16_in_padded(in) * sizeof(uint16_t);
        void *xb = aligned_alloc(64, (xbytes + 63) / 64 * 64);
        if (!x || !y || !xb) {
            fprintf(stderr, "matmul: no memory for %d rows of %d x %d\n", T, out, in);
            free(x), free(y), free(xb), free(w), free(rows);
            return -1;
        }
        for (size_t k = 0; k < (size_t)T * in; k++) x[k] = (float)(k % 13) / 13.0f - 0.5f;
        double best = 1e9, start = now_s();
        int calls = 0;
        while (calls < 5 || now_s() - start < 0.2) {
            double t0 = now_s();
            if (int8) tsr_pool_matmul_i8(p, y, out, x, xb, w, T, in, out);
            else tsr_pool_matmul_bf16(p, y, out, x, xb, w, T, in, out);
            double d = now_s() - t0;
            if (d < best) best = d;
            calls++;
        }
        printf("  %5d x %-5d T %3d: best %8.1f us  %7.1f GFLOP/s  (%d calls)\n", out, in, T,
               best * 1e6, 2.0 * T * out * in / best / 1e9, calls);
        free(x), free(y), free(xb);
    }
    free(w), free(rows);
    return 0;
}

int main(int argc, char **argv)
{
    int threads = 0, out = 0, in = 0, int8 = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--in") && i + 1 < argc) in = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--weights") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "bf16") || !strcmp(argv[i + 1], "int8")))
            int8 = !strcmp(argv[++i], "int8");
        else {
            fprintf(stderr, "usage: matmul [--weights bf16|int8] [--threads N] [--out O --in I]\n");
            return 2;
        }
    }
    if (threads <= 0) {
        cpu_set_t set;
        threads = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
    }
    if ((out != 0) != (in != 0) || out < 0 || in < 0 || out > 1 << 20 || in > 1 << 16) {
        fprintf(stderr, "matmul: --out and --in go together, 1 to 1048576 and 1 to 65536\n");
        return 2;
    }
    tsr_pool_t *p = tsr_pool_new(threads);
    if (!p) {
        fprintf(stderr, "matmul: cannot start %d threads\n", threads);
        return 1;
    }
    printf("matmul: %s weights, %d thread(s), %s\n", int8 ? "int8" : "bf16", threads,
           int8 ? tsr_i8_products_name() : tsr_bf16_products_name());
    int rc = out ? measure(p, out, in, int8)
                 : (measure(p, 1536, 512, int8) < 0 || measure(p, 2752, 512, int8) < 0 ||
                    measure(p, 512, 1376, int8) < 0);
    tsr_pool_destroy(&p);
    return rc ? 1 : 0;
}
