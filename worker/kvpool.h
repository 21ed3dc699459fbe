/* kvpool.h: the KV cache as a pool of fixed-size blocks, and the prefix
 * cache in it.
 *
 * An engine owns one pool per piece: the memory for n_blocks blocks of
 * TSR_KV_BLOCK positions (every layer of the piece, keys and values), and
 * this bookkeeping, which says which blocks each sequence slot holds.  A
 * slot takes blocks as its sequence grows and gives them back when it
 * finishes or is cancelled.
 *
 * The prefix cache: a full block can be published under a key (a hash
 * chained over its parent block's key and its token ids, common/prefix.h).
 * A published block is shared: a new sequence attaches the blocks of the
 * longest cached chain matching its prompt (each block counts its
 * holders) and computes only the rest.  When its last holder lets go, a
 * published block stays cached, unreferenced, in least-recently-released
 * order; a block is evicted (its key dropped) only when a sequence grows
 * and no block is free.  A sequence never writes into a block it attached:
 * it attaches full blocks and writes only after them.
 *
 * Every operation is deterministic (a LIFO free list, an LRU list, keys
 * given by the caller), so every rank of a replica that applies the same
 * steps from the same reset holds the same blocks under the same keys, and
 * the leader's scheduler can count on its own pool. */
#ifndef TSR_KVPOOL_H
#define TSR_KVPOOL_H

#include <stdint.h>

#include "common/budget.h"  /* TSR_KV_BLOCK: positions per block */

typedef struct tsr_kvpool tsr_kvpool_t;

/* Caller owns the result (tsr_kvpool_destroy); NULL when out of memory or
 * a size is not positive. */
tsr_kvpool_t *tsr_kvpool_new(int n_blocks, int max_slots, int max_seq_len);
void tsr_kvpool_destroy(tsr_kvpool_t **p_p);

/* Makes slot hold blocks for positions [0, n_pos), taking free blocks
 * first, then evicting cached ones.  0, or -1 when free and cached blocks
 * together are too few or n_pos exceeds max_seq_len (nothing is taken
 * then). */
int tsr_kvpool_grow(tsr_kvpool_t *p, int slot, int n_pos);
/* Lets go of every block of slot (nothing when it holds none): a block no
 * other slot holds goes back to the free list, or to the cache when it is
 * published. */
void tsr_kvpool_release(tsr_kvpool_t *p, int slot);
/* The state every fresh pool has: no slot holds a block, nothing cached,
 * the free list in its first order.  A replica's ranks start each run from
 * it, so a rank that joins holds what the others hold. */
void tsr_kvpool_reset(tsr_kvpool_t *p);
/* The block ids of slot, in position order (tsr_kvpool_held of them). */
const int32_t *tsr_kvpool_table(const tsr_kvpool_t *p, int slot);
int tsr_kvpool_held(const tsr_kvpool_t *p, int slot);
/* Blocks some slot holds; blocks cached and held by none; the pool's size.
 * A sequence can grow into total - used blocks. */
int tsr_kvpool_used(const tsr_kvpool_t *p);
int tsr_kvpool_cached(const tsr_kvpool_t *p);
int tsr_kvpool_total(const tsr_kvpool_t *p);

/* ---- the prefix cache ---- */

/* How many of keys[0..n) (a chain, parent first) are published, counted
 * from the first: the cached prefix, in blocks.  Changes nothing. */
int tsr_kvpool_match(const tsr_kvpool_t *p, const uint64_t *keys, int n);
/* Of the published blocks of keys[0..n), how many no slot holds: attaching
 * them takes them from what the pool can give. */
int tsr_kvpool_match_unheld(const tsr_kvpool_t *p, const uint64_t *keys, int n);
/* Slot, holding no block, attaches the published blocks of keys[0..n).
 * 0, or -1 with nothing attached when slot holds blocks already, n does
 * not fit max_seq_len, or a key is not published (a rank whose cache
 * differs from its leader's). */
int tsr_kvpool_attach(tsr_kvpool_t *p, int slot, const uint64_t *keys, int n);
/* Publishes slot's block `index` (its positions all written) under key
 * (not 0).  Nothing when the block is published already or another block
 * holds key (two sequences computed the same prefix at once: the later one
 * stays private).  -1 when slot does not hold that block. */
int tsr_kvpool_publish(tsr_kvpool_t *p, int slot, int index, uint64_t key);
/* Published blocks evicted since the pool was made or reset. */
uint64_t tsr_kvpool_evictions(const tsr_kvpool_t *p);

/* Blocks needed for n_pos positions. */
static inline int tsr_kv_blocks_for(int n_pos)
{
    return (n_pos + TSR_KV_BLOCK - 1) / TSR_KV_BLOCK;
}

#endif
