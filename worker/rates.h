/* rates.h: what a CPU worker measures of its machine at start, for the planner's
 * estimates (coordinator/layout.c) when its operator gives no --mem-gbs. */
#ifndef TSR_RATES_H
#define TSR_RATES_H

/* The rate, in GB/s, at which the worker's engine threads ($TSR_THREADS, else every
 * CPU it may run on: the pool the CPU engine would start) read memory, as decoding
 * reads its weights: the best of three passes over a buffer larger than the caches
 * (128 MiB, taken and given back).  *threads gets the threads that read.  0 when it
 * could not be measured (no memory, no thread). */
double tsr_measure_read_gbs(int *threads);

#endif
