/* replica_ctl.h: the layout of a step on a replica's control channel, from
 * its leader to every other rank (worker/replica.c), here so that a test can
 * play the leader. */
#ifndef TSR_REPLICA_CTL_H
#define TSR_REPLICA_CTL_H

#include <stdint.h>

#define TSR_CTL_MAGIC 0x54535350u   /* "TSSP" */

enum { TSR_CTL_NOP = 0, TSR_CTL_STEP = 1, TSR_CTL_STOP = 2 };

/* A step's header; its payload follows as one message: n_entries entries,
 * n_free slots to release before the step, then n_tokens token ids. */
typedef struct {
    uint32_t magic, op;
    uint64_t step;
    int32_t n_entries, n_free, n_tokens, pad;
} tsr_ctl_hdr_t;

typedef struct {
    uint64_t req, seed;
    int32_t slot, pos, n, sample;
    int32_t index, prompt_len, max_tokens, pad;   /* for the finish rule on the last stage */
    float temperature, top_p;
} tsr_ctl_entry_t;

/* The layout on the wire, pinned: a change to it is a protocol change. */
_Static_assert(sizeof(tsr_ctl_hdr_t) == 32, "a step header is 32 bytes");
_Static_assert(sizeof(tsr_ctl_entry_t) == 56, "a step entry is 56 bytes");

#endif
