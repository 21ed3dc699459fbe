/* prefix.h: the keys of cached KV blocks (the prefix cache).
 *
 * A full block of TSR_KV_BLOCK positions is known by a key chained over
 * its parent block's key and its token ids: key(0) = H(0, tokens[0..16)),
 * key(k) = H(key(k-1), tokens[16k..16k+16)).  Equal keys mean the same
 * tokens from the sequence's start, hence the same KV rows.  H is
 * SipHash-2-4 under a 128-bit secret the coordinator derives per deployment,
 * model, weight and cache types and layout (coordinator/assign.c), so keys
 * of different deployments, models, types or layouts do not meet, and a
 * client cannot make up a prompt whose key equals another's.  The
 * coordinator (routing) and a replica's leader (the cache) compute the same
 * keys from the same secret. */
#ifndef TSR_PREFIX_H
#define TSR_PREFIX_H

#include <stddef.h>
#include <stdint.h>

#define TSR_PREFIX_SECRET 16    /* bytes */

/* SipHash-2-4 of msg under a 16-byte key. */
uint64_t tsr_siphash(const uint8_t key[TSR_PREFIX_SECRET], const void *msg, size_t len);

/* The key of the block of TSR_KV_BLOCK tokens after the block keyed parent
 * (0 for the first); never 0. */
uint64_t tsr_prefix_key(const uint8_t secret[TSR_PREFIX_SECRET], uint64_t parent,
                        const int32_t *tokens);

/* The keys of the full blocks of tokens[0..n) into out (room for
 * n / TSR_KV_BLOCK); returns their count. */
int tsr_prefix_keys(const uint8_t secret[TSR_PREFIX_SECRET], const int32_t *tokens, int n,
                    uint64_t *out);

#endif
