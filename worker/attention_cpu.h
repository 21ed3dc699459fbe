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

#endif
