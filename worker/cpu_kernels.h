/* cpu_kernels.h: which build of the CPU kernels this process runs (the
 * portable one, AVX2 with FMA, or AVX-512), chosen once from the CPU and
 * TSR_CPU_KERNELS. */
#ifndef TSR_CPU_KERNELS_H
#define TSR_CPU_KERNELS_H

/* The build of the CPU kernels this process runs: the f32 products
 * (worker/matmul_f32.h), the engine's attention and row work.  The best
 * the CPU has (AVX-512 for the products of 4 rows or more, with AVX2+FMA
 * for the rest and for attention; AVX2+FMA; the portable build), unless
 * TSR_CPU_KERNELS is "avx2" (no AVX-512) or "plain" (the portable build),
 * for tests and for comparing ("avx512" and "amx" give the best there is
 * here; other values are warned about and ignored).  AMX serves the bf16
 * products alone (worker/matmul_bf16.h): unset or "amx" allows it, any
 * other value, "avx512" included, turns it off.  The AVX-512 and AVX2
 * builds give the same bits (one fused multiply-add chain per output); the
 * portable one rounds each product where the compiler does not fuse them.
 * Asked once per process; the same answer for every caller. */
typedef enum { TSR_KERNELS_PLAIN, TSR_KERNELS_AVX2, TSR_KERNELS_AVX512 } tsr_cpu_kernels_t;
tsr_cpu_kernels_t tsr_cpu_kernels(void);
/* "plain", "avx2" or "avx512". */
const char *tsr_cpu_kernels_name(tsr_cpu_kernels_t k);

#endif
