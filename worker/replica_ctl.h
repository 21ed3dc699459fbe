/* replica_ctl.h: the layout of a step on a replica's control channel, from
 * its leader to every other rank (worker/replica.c), here so that a test can
 * play the leader. */
#ifndef TSR_REPLICA_CTL_H
#define TSR_REPLICA_CTL_H

#include <stdint.h>

#define TSR_CTL_MAGIC 0x54535332u   /* "TSS2": with the prefix cache's keys */

enum { TSR_CTL_NOP = 0, TSR_CTL_STEP = 1, TSR_CTL_STOP = 2 };

/* A step's header; its payload follows as one message: n_entries entries,
 * n_keys block keys (each entry's n_attach, then its n_publish, in entry
 * order), n_free slots to release before the step, then n_tokens token ids.
 * Every rank applies a step's KV pool changes in one order: the frees, each
 * entry's attach (an admitted sequence takes the cached blocks of those keys
 * before it runs), the step (blocks grow), then each entry's publishes (its
 * blocks [pos / 16, pos / 16 + n_publish), all written now, get those keys). */
typedef struct {
    uint32_t magic, op;
    uint64_t step;
    int32_t n_entries, n_free, n_tokens, n_keys;
} tsr_ctl_hdr_t;

typedef struct {
    uint64_t req, seed;
    int32_t slot, pos, n, sample;
    int32_t index, prompt_len, max_tokens;   /* for the finish rule on the last stage */
    int32_t n_attach;           /* cached blocks the admitted sequence starts with */
    float temperature, top_p;
    int32_t n_publish;          /* blocks this entry fills, published after the step */
    int32_t cached;             /* prompt positions the sequence took from the cache */
} tsr_ctl_entry_t;

/* The layout on the wire, pinned: a change to it is a protocol change. */
_Static_assert(sizeof(tsr_ctl_hdr_t) == 32, "a step header is 32 bytes");
_Static_assert(sizeof(tsr_ctl_entry_t) == 64, "a step entry is 64 bytes");

#endif
