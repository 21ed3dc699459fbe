/* rates.h: what a CPU worker measures of its machine at start, for the planner's
 * estimates (coordinator/layout.c) when its operator gives no --mem-gbs or --gflops. */
#ifndef TSR_RATES_H
#define TSR_RATES_H

/* Measures, with the threads the CPU engine would run ($TSR_THREADS, else every CPU
 * the worker may run on), each rate left 0: *mem_gbs, the GB/s at which they read
 * memory as decoding reads its weights (the best of three passes over 128 MiB, taken
 * and given back), and *gflops, the GFLOP/s of the engine's f32 products on a batch
 * (64 rows through a 1024 x 1024 matrix, the best of five).  A rate that cannot be
 * measured (no memory, no thread) stays 0.  *threads gets the threads used. */
void tsr_measure_rates(double *mem_gbs, double *gflops, int *threads);

#endif
