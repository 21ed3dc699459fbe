/* cuda.h: the CUDA engine and what the rest of the worker needs from the
 * CUDA runtime, declared without its headers so that plain C files and
 * builds without CUDA do not see them. */
#ifndef TSR_CUDA_H
#define TSR_CUDA_H

#include <stddef.h>
#include "worker/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* BF16 weights and KV cache on the GPU, cuBLAS products, Tessera's kernels
 * (worker/cuda/engine_cuda.cu). */
extern const tsr_engine_ops_t tsr_engine_cuda;

/* The TCP collectives over device buffers, staged through host memory:
 * what ranks that share a GPU (or run before NCCL is formed) use. */
extern const tsr_coll_ops_t tsr_coll_staged;

/* Copies between host and device memory (dir 0: to host, 1: to device),
 * waiting for the copy; 0 or -1 with the CUDA error in err. */
int tsr_cuda_copy(void *dst, const void *src, size_t bytes, int to_device, char *err,
                  size_t errlen);
typedef int (*tsr_cuda_copy_fn)(void *dst, const void *src, size_t bytes, int to_device,
                                char *err, size_t errlen);

/* Tests: the host-staged collectives copy with fn instead of the CUDA
 * runtime (NULL: back to it).  Call before any communicator is used. */
void tsr_coll_staged_test_copy(tsr_cuda_copy_fn fn);

#ifdef __cplusplus
}
#endif

#endif
