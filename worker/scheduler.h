/* scheduler.h: which sequences run in a replica's next step.
 *
 * Continuous batching, as a pure function of the leader's state: the
 * sequences it runs or holds waiting, and the KV pool's size, give the next
 * batch.  Every step
 *   - feeds each running sequence that is not in the pipeline already: its
 *     last generated token (a decode), or its next prompt chunk;
 *   - admits waiting sequences, first come first served, while a slot is
 *     free and, reserving (kv_admission: reserve), the pool can hold the new
 *     sequence's worst case (prompt plus max_tokens, up to max_seq_len) on
 *     top of what the running ones may still take, so running out of blocks
 *     mid-sequence is impossible; or, on demand (the default), while its
 *     first chunk fits in what the pool can give now with a block left for
 *     each other running sequence to grow into.  On demand the pool may run out:
 *     then the running sequence admitted last (not in the pipeline) is
 *     preempted (the caller frees its blocks and keeps its tokens) and
 *     resumes later by computing its prompt and the tokens it was fed again
 *     (the prefix cache often holds them), which changes none of its tokens;
 *   - spends at most prefill_chunk prompt tokens in all, so a long prompt
 *     is cut into chunks and the running decodes keep flowing;
 *   - with a pipeline of P stages, takes about 1/P of the sequences, so the
 *     P micro-batches in flight keep every stage busy. */
#ifndef TSR_SCHEDULER_H
#define TSR_SCHEDULER_H

#include <stdbool.h>
#include <stdint.h>

typedef struct {
    int max_batch;              /* sequence slots: running sequences at most */
    int prefill_chunk;          /* prompt tokens per step, over all sequences */
    int max_seq_len;
    int total_blocks;           /* the KV pool */
    int micro_batches;          /* pipeline stages (1: no pipeline) */
    bool on_demand;             /* admit by what a sequence needs now, not its worst case */
    int free_blocks;            /* on demand: blocks the pool can give now (free and cached) */
} tsr_sched_cfg_t;

typedef struct {
    int slot;                   /* -1: waiting */
    int n_prompt;
    int n_cached;               /* positions already scheduled into the KV cache; of a
                                   waiting one, those its prefix cache holds (an admission
                                   starts after them) */
    int n_generated;            /* tokens that came back */
    int max_tokens;
    bool in_flight;             /* in a step that has not come back */
    bool cancelled;             /* leaves at the next step (never scheduled again) */
    uint64_t admitted;          /* on demand: when it was admitted (larger: later) */
    int attach_taken;           /* on demand, waiting: cached blocks it would attach that no
                                   sequence holds (attaching takes them from free_blocks) */
} tsr_sched_seq_t;

typedef struct {
    int seq;                    /* index into the seqs array */
    int slot;                   /* the slot it runs in (a new one when admitted) */
    int pos, n;                 /* positions [pos, pos + n) */
    bool sample;                /* ends the prompt or is a decode: a token comes back */
    bool admitted;              /* this step admits it */
} tsr_sched_entry_t;

/* Positions a sequence may need, and the blocks for them. */
int tsr_sched_worst_blocks(const tsr_sched_cfg_t *cfg, const tsr_sched_seq_t *s);

/* The next batch into out[] (room for cfg->max_batch entries); returns the
 * number of entries.  seqs: the running ones (slot >= 0) and the waiting
 * ones (slot -1) in arrival order; slot_used[max_batch] says which slots
 * are taken.  Nothing is changed: the caller applies the entries.  On
 * demand, when the running sequences cannot get the blocks to go on,
 * *preempt is the index of the one to preempt and 0 is returned: the
 * caller preempts it (slot freed, n_cached 0, back to waiting in its place)
 * and asks again; -1 otherwise.  A preempted sequence that had generated
 * tokens computes the positions of all it was fed without sampling, then
 * decodes its last token as before. */
int tsr_sched_next(const tsr_sched_cfg_t *cfg, const tsr_sched_seq_t *seqs, int n_seqs,
                   const bool *slot_used, tsr_sched_entry_t *out, int *preempt);

#endif
