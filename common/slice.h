/* slice.h: which part of each tensor a piece holds.
 *
 * One answer to "which rows and columns of tensor T does (tp rank, stage)
 * hold", used by the planner's memory figures, every engine's loader and the
 * tests.  Megatron sharding: q, k, v, gate and up are split by output rows,
 * o and down by input columns; the embedding and the LM head by vocabulary
 * rows, in equal chunks of ceil(vocab / tp) (the last rank's chunk may be
 * short or empty), so every rank's logits have the same width for an
 * all-gather.  Norms are whole on every rank. */
#ifndef TSR_SLICE_H
#define TSR_SLICE_H

#include <stdbool.h>
#include <stdint.h>
#include "common/modelcfg.h"

typedef enum {
    TSR_T_EMBED = 0, TSR_T_LM_HEAD, TSR_T_FINAL_NORM,
    TSR_T_ATTN_NORM, TSR_T_MLP_NORM,
    TSR_T_Q, TSR_T_K, TSR_T_V, TSR_T_O,
    TSR_T_GATE, TSR_T_UP, TSR_T_DOWN,
    TSR_T_COUNT
} tsr_tensor_kind_t;

typedef struct {
    int64_t rows, cols;         /* the full tensor; cols 0 for a vector */
    int64_t r0, r1, c0, c1;     /* held: rows [r0, r1) x cols [c0, c1) (vectors: r0..r1) */
} tsr_slice_t;

/* The Hugging Face name of tensor t (layer for per-layer tensors); the LM
 * head is the embedding when the model ties them.  Writes into buf. */
const char *tsr_tensor_name(const tsr_model_info_t *m, tsr_tensor_kind_t t, int layer, char *buf,
                            size_t len);

/* Fills *out with tp rank r's part of t.  Returns 0, or -1 when the layout
 * does not divide the model (tsr_model_check_piece says why). */
int tsr_slice_of(const tsr_model_info_t *m, tsr_tensor_kind_t t, int tp_rank, int tp_size,
                 tsr_slice_t *out);

/* tsr_tensor_name and tsr_slice_of together, for an engine about to read
 * its slice: the name into name[len], the slice into *out.  Returns 0, or
 * -1 with err naming the tensor when tp_size does not divide it. */
int tsr_slice_named(const tsr_model_info_t *m, tsr_tensor_kind_t t, int layer, int tp_rank,
                    int tp_size, char *name, size_t len, tsr_slice_t *out, char *err,
                    size_t errlen);

/* Whether stage `stage` of pp_size holds t at all (per-layer tensors: only
 * for its layers, which the caller iterates). */
bool tsr_stage_holds(tsr_tensor_kind_t t, int stage, int pp_size);

/* Vocabulary rows [*begin, *end) of tp rank r; *chunk is every rank's
 * padded width, ceil(vocab / tp). */
void tsr_vocab_range(const tsr_model_info_t *m, int tp_rank, int tp_size, int *begin, int *end,
                     int *chunk);

/* Elements of t held by (tp_rank of tp_size): (r1 - r0) * (c1 - c0). */
int64_t tsr_slice_elems(const tsr_slice_t *s);

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

/* What a CUDA worker holds besides weights and KV cache, at least: its
 * context, cuBLAS's workspace and the engine's fixed buffers. */
#define TSR_CUDA_CONTEXT_BYTES ((uint64_t)768 << 20)

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

/* KV blocks (16 positions) a cuda piece of that stage gets on a GPU of
 * gpu_bytes (see tsr_piece_memory); every rank of a replica must get the
 * same count, so the coordinator sends the least over the replica. */
int tsr_cuda_kv_blocks(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage,
                       uint64_t gpu_bytes);

#endif
