/* kernels.cuh: Tessera's CUDA kernels, each behind a host function that
 * launches it on a stream.
 *
 * The engine (engine_cuda.cu) decides what runs when; these decide how a
 * kernel is laid out on the GPU (grid, block, template instance).  A launch
 * returns at once: its error, if any, is the stream's next
 * cudaGetLastError, which the engine checks after each group of launches.
 * The per-element math is worker/kmath.h's, which tests/cuda/test_kmath.cu
 * runs on the CPU. */
#ifndef TSR_CUDA_KERNELS_CUH
#define TSR_CUDA_KERNELS_CUH

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "worker/cuda/buffers.h"   /* tsr_cuda_meta_t */
}

typedef uint16_t bf16_t;     /* raw BF16 bits; worker/kmath.h converts */

/* The largest head_dim the attention kernels take (and it must be even). */
#define TSR_KERN_MAX_HEAD_DIM 256

/* ---- loading -------------------------------------------------------------------- */

/* dst[n] = src[n] (f32 or f16, as dtype says) rounded to BF16. */
void tsr_kern_convert(cudaStream_t st, bf16_t *dst, const void *src, size_t n, int dtype);
/* Benchmark weights from a seed: uniform in [-scale, scale), or 1 for norms
 * (scale 0). */
void tsr_kern_fill(cudaStream_t st, bf16_t *dst, size_t n, unsigned long long seed, float scale);

/* ---- a layer -------------------------------------------------------------------- */

/* Vocabulary-parallel embedding of rows tokens into x[rows][H]: ids outside
 * [v_begin, v_end) give zero rows. */
void tsr_kern_embed(cudaStream_t st, int rows, float *x, const bf16_t *embed,
                    const int32_t *tokens, int H, int v_begin, int v_end);
/* For each of `rows` rows: x += add (add may be NULL), then out =
 * RMSNorm(x) * w in BF16.  Row r of out reads row row_idx[r] of x (row_idx
 * NULL: row r). */
void tsr_kern_add_rmsnorm(cudaStream_t st, int rows, bf16_t *out, float *x, const float *add,
                          const bf16_t *w, const int32_t *row_idx, int H, float eps);
/* x[n] += add[n]. */
void tsr_kern_add(cudaStream_t st, float *x, const float *add, size_t n);
/* RoPE on the query and KV heads of T rows of qkv; each rotated key and
 * its value go into layer l of the pools at the row's position. */
void tsr_kern_rope_kv(cudaStream_t st, int T, float *qkv, bf16_t *kpool, bf16_t *vpool,
                      const float *cosv, const float *sinv, tsr_cuda_meta_t md, int l, int n_blocks,
                      int qh, int kvh, int hd);
/* Causal attention of layer l over `tiles` tiles into att: on the tensor
 * cores for head_dim 64 and 128 (split over the keys in a step of decodes
 * whose query heads per KV head fit one warp), else an f32 kernel. */
void tsr_kern_attention(cudaStream_t st, int tiles, bool decode, bf16_t *att, const float *qkv,
                        const bf16_t *kpool, const bf16_t *vpool, tsr_cuda_meta_t md, int l,
                        int n_blocks, int qh, int kvh, int hd);
/* act[n] = SwiGLU of gu's gate and up halves (rows of 2 I). */
void tsr_kern_swiglu(cudaStream_t st, bf16_t *act, const float *gu, int I, size_t n);

/* Whether tsr_kern_gemv takes a product of T rows of `in` columns. */
bool tsr_kern_gemv_fits(int T, int in);
/* y[T][ldy] (f32) = x[T][in] (BF16) * w[out][in]^T (BF16), for a few rows
 * (tsr_kern_gemv_fits), where cuBLAS's GEMM reads the weights slowly. */
void tsr_kern_gemv(cudaStream_t st, float *y, int ldy, const bf16_t *x, const bf16_t *w, int T,
                   int in, int out);

/* ---- logits and sampling ---------------------------------------------------------- */

/* Pads each of `rows` rows of C logits past this rank's vs with -inf. */
void tsr_kern_pad(cudaStream_t st, float *lg, int C, int vs, int rows);
/* Per sampled row of the gathered logits g ([tp][rows][C], V in all): the
 * first maximum into best; for a sampled (not greedy) row also its
 * weights w and ids, their sum wsum and the segment to sort when top_p
 * cuts. */
void tsr_kern_sample_prep(cudaStream_t st, int rows, const float *g, int C, int V,
                          tsr_cuda_meta_t md, int32_t *best, float *w, int32_t *ids, double *wsum,
                          int32_t *seg_begin, int32_t *seg_end);
/* Sorts the segments of (w, ids) by weight, descending, into (w_sorted,
 * ids_sorted) with cub; with tmp NULL, only sets *tmp_bytes to the
 * scratch it needs. */
cudaError_t tsr_kern_sort_desc(cudaStream_t st, void *tmp, size_t *tmp_bytes, const float *w,
                               float *w_sorted, const int32_t *ids, int32_t *ids_sorted, int n,
                               int segments, int32_t *seg_begin, int32_t *seg_end);
/* Per sampled row: the greedy pick, or the top-p cut and the draw, into
 * out. */
void tsr_kern_sample_pick(cudaStream_t st, int rows, const float *w, const int32_t *ids,
                          const float *w_sorted, const int32_t *ids_sorted, const double *wsum,
                          const int32_t *best, int V, tsr_cuda_meta_t md, int32_t *out);

/* ---- tests -------------------------------------------------------------------------- */

#ifdef TSR_TESTING
/* A write to an address no allocation has: a real sticky device error
 * (TSR_TEST_DEVICE_FAULT_AFTER; test builds only). */
void tsr_kern_fault(cudaStream_t st);
#endif

#endif
