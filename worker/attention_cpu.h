/* attention_cpu.h: the CPU engine's attention: causal grouped-query
 * attention of a step's rows over the KV cache, on the pool's threads. */
#ifndef TSR_ATTENTION_CPU_H
#define TSR_ATTENTION_CPU_H

#include "worker/cpu_pool.h"
#include "worker/engine.h"
#include "worker/kv_format.h"

/* Attention of layer l for every row of batch b, on the pool's threads.
 * Entry i's rows start at first_row[i]; row r's q_heads query heads (of
 * kv->head_dim) lead its row of qkv (qkv + r * (q_heads + 2 * kv->heads) *
 * head_dim), and its keys and values, with those of the positions before
 * it, are already in the cache.  Writes row r's q_heads heads to att + r *
 * q_heads * head_dim.  Each row's numbers depend on that row alone, bit
 * for bit, whatever it is batched with; the build (worker/cpu_kernels.h)
 * is chosen once per process. */
void tsr_attention_cpu(tsr_pool_t *pool, const tsr_kvf_cache_t *kv, int l, const tsr_batch_t *b,
                       const int *first_row, const float *qkv, int q_heads, float *att);

/* With a sequence split (kv->seq_size > 1) tsr_attention_cpu covers only
 * the positions this rank holds and writes, per row and head, a partial
 * state of hd + 2 floats instead: the running maximum m of the scaled
 * scores, the sum l of exp(score - m), then the sum of exp(score - m) *
 * value (m = -inf, l = 0 and zeros where it holds none of the row's
 * positions).  tsr_attention_merge combines n_parts such arrays (rows *
 * heads * (hd + 2) floats each, part_stride apart, in rank order) into
 * att[rows][heads][hd], the attention over every position; the same order
 * gives every rank the same bits. */
void tsr_attention_merge(const float *parts, int n_parts, size_t part_stride, int rows,
                         int heads, int hd, float *att);

#endif
