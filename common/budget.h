/* budget.h: how much memory a piece takes, in one place.
 *
 * The planner prices pieces with these functions (coordinator, `tessera
 * plan`), the executor sizes a piece's KV pool and step rows with them, and
 * the engines size their KV pools with them, so the planner's model and
 * what the engines allocate cannot drift apart.  The CUDA engine lists its
 * device buffers in worker/cuda/buffers.c; tests/cuda/test_buffers.cu holds
 * that list's sums against tsr_piece_memory for many shapes. */
#ifndef TSR_BUDGET_H
#define TSR_BUDGET_H

#include <stdint.h>
#include "common/deploy.h"
#include "common/modelcfg.h"

#define TSR_KV_BLOCK 16  /* positions per KV block */

/* What a CUDA worker holds besides weights, KV cache and the reserve's
 * buffers: its context, cuBLAS's workspace and the engine's small fixed
 * buffers (the step's metadata, per-sequence sampling arrays). */
#define TSR_CUDA_CONTEXT_BYTES ((uint64_t)768 << 20)
/* cuBLAS's workspace, which the engine allocates itself (so that products
 * can be captured in graphs); part of TSR_CUDA_CONTEXT_BYTES. */
#define TSR_CUDA_WORKSPACE_BYTES ((size_t)32 << 20)

/* Bytes of weights held by one piece (stage `stage` of `stages`, one of
 * `tensor` ranks) as the checkpoint stores them (m->dtype_bytes): its
 * layers' share plus the embedding on stage 0 and the final norm and LM
 * head on the last stage. */
uint64_t tsr_model_piece_bytes(const tsr_model_info_t *m, int stages, int stage, int tensor);

/* Bytes a parameter takes in the engine of deployment d: 2 (BF16) on a
 * GPU; on a CPU 4 (f32), 2 with matmul_dtype bf16, or 1 with weights_dtype
 * int8, whatever the checkpoint's type. */
int tsr_weight_elem_bytes(const tsr_deployment_t *d);

/* Bytes of weights one piece of stage `stage` of deployment d holds in its
 * engine: tsr_model_piece_bytes at tsr_weight_elem_bytes a parameter, and
 * with int8 weights 4 bytes more a matrix row (its scale). */
uint64_t tsr_piece_weight_bytes(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage);

/* The rows a piece's steps are sized for, from a deployment's batching
 * keys (0: the defaults, 32 sequences and prefill chunks of 128): at most
 * *seqs sequences a step, and *tokens rows (a decode row for each, plus one
 * prefill chunk, at most max_seq_len). */
void tsr_step_rows(int max_batch, int prefill_chunk, int max_seq_len, int *seqs, int *tokens);

/* KV cache blocks for a piece: every rank of a replica gets the same count,
 * so the leader's scheduler can plan with its own pool.  A block holds
 * block_positions positions of keys and values for every layer of the
 * piece; the budget is priced at the largest stage's layer count.
 * budget_bytes 0: enough for max_seqs sequences of max_seq_len positions.
 * row_bytes: what one position of one KV head takes, keys or values
 * (tsr_kv_row_bytes of the cache's type). */
int tsr_kv_pool_blocks(const tsr_model_info_t *m, int tp_size, int pp_size,
                       uint64_t budget_bytes, int max_seqs, int max_seq_len,
                       int block_positions, int row_bytes);
/* Bytes of one block of a piece with n_layers layers. */
uint64_t tsr_kv_block_bytes(const tsr_model_info_t *m, int tp_size, int n_layers,
                            int block_positions, int row_bytes);
/* Elements of one of a piece's two pools (keys, or values) of kv_blocks
 * blocks of TSR_KV_BLOCK positions: n_layers x kv_blocks x its KV heads x
 * TSR_KV_BLOCK x head_dim. */
uint64_t tsr_kv_pool_elems(const tsr_model_info_t *m, int tp_size, int n_layers, int kv_blocks);

/* Bytes of one KV block (TSR_KV_BLOCK positions, BF16) of a cuda piece of
 * stage `stage` of deployment d. */
uint64_t tsr_cuda_block_bytes(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage);

/* What one piece of stage `stage` of deployment d holds on its GPU, as the
 * CUDA engine allocates it: its weights in BF16, its KV pool in BF16, and
 * a reserve for the context, the step's activations and, on the last
 * stage, logits and sampling.  The pool is kv_cache_mib's; without it, what
 * gpu_memory_percent of a GPU of gpu_bytes leaves after weights and reserve,
 * at most max_batch sequences of max_seq_len (gpu_bytes 0: that most).  The
 * parts go to *weights, *kv and *reserve (each may be NULL).  0 for a cpu
 * deployment: CPU workers share their machine's memory, which the planner
 * does not divide. */
uint64_t tsr_piece_memory(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage,
                          uint64_t gpu_bytes, uint64_t *weights, uint64_t *kv, uint64_t *reserve);

/* The least GPU memory a piece of that stage can run on: weights, reserve
 * and its KV budget (kv_cache_mib's, or one sequence of max_seq_len),
 * over gpu_memory_percent.  0 for a cpu deployment. */
uint64_t tsr_piece_need(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage);

/* KV blocks (of TSR_KV_BLOCK positions) a cuda piece of that stage gets on
 * a GPU of gpu_bytes (see tsr_piece_memory); every rank of a replica must
 * get the same count, so the coordinator sends the least over the
 * replica. */
int tsr_cuda_kv_blocks(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage,
                       uint64_t gpu_bytes);

#endif
