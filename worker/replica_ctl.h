/* replica_ctl.h: the layout of a step on a replica's control channel, from
 * its leader to every other rank (worker/replica.c), here so that a test can
 * play the leader. */
#ifndef TSR_REPLICA_CTL_H
#define TSR_REPLICA_CTL_H

#include <stdint.h>

#define CTL_MAGIC 0x54535350u   /* "TSSP" */

enum { OP_NOP = 0, OP_STEP = 1, OP_STOP = 2 };

/* A step's header; its payload follows as one message: n_entries entries,
 * n_free slots to release before the step, then n_tokens token ids. */
typedef struct {
    uint32_t magic, op;
    uint64_t step;
    int32_t n_entries, n_free, n_tokens, pad;
} ctl_hdr_t;

typedef struct {
    uint64_t req, seed;
    int32_t slot, pos, n, sample;
    int32_t index, prompt_len, max_tokens, pad;   /* for the finish rule on the last stage */
    float temperature, top_p;
} ctl_entry_t;

#endif
