/* replica.h: one rank's part in running requests through a replica.
 *
 * The replica's leader (stage 0, tp rank 0) runs continuous batching
 * (worker/scheduler.h): every step it admits waiting requests, feeds the
 * running ones a token or a prompt chunk, and sends the step's composition
 * (which sequences, positions, sampling parameters, slots to free) to every
 * rank on the control channel, a small host communicator beside the tensor
 * channels.  Stage 0 runs the step and hands its hidden state down the
 * pipeline; the last stage samples, its tp rank 0 reports each token and
 * sends the step's tokens back to the leader.  With P stages the leader
 * keeps up to P steps in flight, each with its own sequences, so no stage
 * waits for a token to travel back.  When idle the leader sends no-op
 * steps, so every rank notices a dead leader within peer_timeout_ms. */
#ifndef TSR_REPLICA_H
#define TSR_REPLICA_H

#include <stdint.h>
#include "worker/collective.h"
#include "worker/engine.h"

/* How a request failed (the emit callback's retryable argument). */
enum { TSR_FAIL_FINAL = 0, TSR_FAIL_RETRYABLE = 1, TSR_FAIL_BUSY = 2 };

typedef struct {
    uint64_t request_id;
    int32_t *prompt;            /* owned by the request; freed by the runner */
    int n_prompt;
    int max_tokens;
    float temperature, top_p;
    uint64_t seed;
    int timeout_ms;             /* from arrival; 0: none */
} tsr_request_t;

/* Figures for the heartbeat. */
typedef struct {
    int queued, running;        /* leader: requests waiting, sequences running (0 elsewhere) */
    int kv_used, kv_cached, kv_total;   /* this piece's KV pool: blocks held by sequences,
                                           cached and held by none, all */
    uint64_t evictions;         /* cached blocks evicted from this pool (a running count) */
    uint64_t prompt_cached;     /* leader: prompt tokens taken from the prefix cache, */
    uint64_t prompt_computed;   /*   and computed (running counts over this run) */
    uint64_t preemptions;       /* leader: sequences preempted (a running count) */
} tsr_replica_stats_t;

typedef struct {
    /* Leader: the next request, waiting up to wait_ms.  Returns 1 with *r
     * filled, 0 when none came. */
    int (*next_request)(void *arg, tsr_request_t *r, int wait_ms);
    /* Leader: a request to cancel.  1 with *id and reason, 0 when none. */
    int (*next_cancel)(void *arg, uint64_t *id, char *reason, size_t len);
    /* A generated token (last stage, tp rank 0), or a request's failure
     * (token -1 and error set; from whichever rank found it).  retryable:
     * TSR_FAIL_RETRYABLE when the failure is the replica's (it broke or
     * stopped), not the request's, so the request may be resumed on another
     * replica; TSR_FAIL_BUSY when the replica's queue is full (try later);
     * TSR_FAIL_FINAL otherwise. */
    void (*emit)(void *arg, uint64_t request_id, int32_t token, int index, int done, int retryable,
                 const char *finish_reason, const char *error);
    /* True when this rank should stop (a new plan, shutdown). */
    int (*should_stop)(void *arg);
    /* Figures for the heartbeat. */
    void (*report)(void *arg, const tsr_replica_stats_t *s);
    /* Hands on the tokens emitted so far: emit may hold tokens (never a
     * failure) until flush, which the runner calls right after each step's
     * tokens, so none is held between steps or when it returns.  NULL: emit
     * hands them on itself. */
    void (*flush)(void *arg);
    /* Optional (last stage, tp rank 0): the request's prompt positions taken
     * from the prefix cache, called on the emitting thread right before
     * emit hands on the request's first token. */
    void (*cached)(void *arg, uint64_t request_id, int tokens);
    void *arg;
} tsr_replica_io_t;

typedef struct {
    const tsr_engine_ops_t *eng_ops;
    tsr_engine_t *eng;
    const tsr_coll_ops_t *ops;  /* tensor channel */
    tsr_comm_t *tp;             /* the stage's TP group, NULL when tp_size 1 */
    tsr_comm_t *prev;           /* link from the previous stage (rank 0 there, 1 here) */
    tsr_comm_t *next;           /* link to the next stage (rank 0 here, 1 there) */
    const tsr_coll_ops_t *ctl_ops;  /* control channel (host memory) */
    tsr_comm_t *ctl;            /* every rank, numbered stage * tp_size + tp_rank; NULL for one rank */
    tsr_piece_spec_t spec;
    int prefill_chunk;          /* prompt tokens per step (default 128) */
    int max_queue;              /* requests waiting at the leader (default 256; 0 allowed) */
    int idle_ms;                /* leader's no-op interval (default 250) */
    int peer_timeout_ms;        /* wait for a step this long at most (default 3000) */
    int token_timeout_ms;       /* wait for a step's data or tokens (default 60000) */
    uint64_t *steps;            /* forward steps this rank finished, advanced with __atomic
                                   builtins (or NULL); by the engine when it has set_progress */
    /* Leader: the prefix cache's secret (common/prefix.h), NULL: no cache.
     * The other ranks follow the leader's steps whatever theirs says. */
    const uint8_t *prefix_secret;
    /* Leader: admit a sequence only when the pool holds its worst case
     * (kv_admission: reserve); false: by what it needs now, preempting when
     * the pool runs out (worker/scheduler.h), with an engine whose pool's
     * bookkeeping it can see (the kvpool op; without it, it reserves). */
    bool kv_reserve;
} tsr_replica_rank_t;

/* Runs until io->should_stop, a stop step, or a data-plane failure.
 * Returns 0 on a clean stop, -1 with the reason in err (every request in
 * the leader's hands has then been failed with it). */
int tsr_replica_run(tsr_replica_rank_t *r, const tsr_replica_io_t *io, char *err, size_t errlen);

/* Whether generation ends after the token with this index: "eos",
 * "max_tokens", "max_seq_len", or NULL to go on. */
const char *tsr_finish_reason(const tsr_model_info_t *m, int32_t token, int index,
                              int prompt_len, int max_tokens, int max_seq_len);

#endif
