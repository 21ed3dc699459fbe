/* kvpool.h: the KV cache as a pool of fixed-size blocks.
 *
 * An engine owns one pool per piece: the memory for n_blocks blocks of
 * TSR_KV_BLOCK positions (every layer of the piece, keys and values), and
 * this bookkeeping, which says which blocks each sequence slot holds.  A
 * slot takes blocks as its sequence grows and gives them all back when it
 * finishes or is cancelled.  Allocation is deterministic (a LIFO free
 * list), so every rank of a replica that sees the same steps holds the
 * same blocks, and the leader's scheduler can count on its own pool. */
#ifndef TSR_KVPOOL_H
#define TSR_KVPOOL_H

#include <stdint.h>

#include "common/budget.h"  /* TSR_KV_BLOCK: positions per block */

typedef struct tsr_kvpool tsr_kvpool_t;

/* Caller owns the result (tsr_kvpool_destroy); NULL when out of memory or
 * a size is not positive. */
tsr_kvpool_t *tsr_kvpool_new(int n_blocks, int max_slots, int max_seq_len);
void tsr_kvpool_destroy(tsr_kvpool_t **p_p);

/* Makes slot hold blocks for positions [0, n_pos).  0, or -1 when the pool
 * has too few free blocks or n_pos exceeds max_seq_len (nothing is taken
 * then). */
int tsr_kvpool_grow(tsr_kvpool_t *p, int slot, int n_pos);
/* Gives back every block of slot (nothing when it holds none). */
void tsr_kvpool_release(tsr_kvpool_t *p, int slot);
/* The block ids of slot, in position order (tsr_kvpool_held of them). */
const int32_t *tsr_kvpool_table(const tsr_kvpool_t *p, int slot);
int tsr_kvpool_held(const tsr_kvpool_t *p, int slot);
int tsr_kvpool_used(const tsr_kvpool_t *p);
int tsr_kvpool_total(const tsr_kvpool_t *p);

/* Blocks needed for n_pos positions. */
static inline int tsr_kv_blocks_for(int n_pos)
{
    return (n_pos + TSR_KV_BLOCK - 1) / TSR_KV_BLOCK;
}

#endif
