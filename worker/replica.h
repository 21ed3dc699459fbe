/* replica.h: one rank's part in running requests through a replica.
 *
 * The replica's leader (stage 0, tp rank 0) takes requests one at a time and
 * drives them: a prefill step for the prompt, then one decode step per
 * token.  Each step is broadcast to the leader's tensor-parallel group and
 * handed down the pipeline (stage s rank r to stage s+1 rank r) with the
 * hidden state; the last stage's rank 0 samples, reports the token and
 * sends it back to the leader.  When idle the leader sends no-op steps, so
 * every rank notices a dead upstream peer within peer_timeout_ms. */
#ifndef TSR_REPLICA_H
#define TSR_REPLICA_H

#include <stdint.h>
#include "worker/collective.h"
#include "worker/engine.h"

typedef struct {
    uint64_t request_id;
    int32_t *prompt;            /* owned by the request; freed by the runner */
    int n_prompt;
    int max_tokens;
    float temperature, top_p;
    uint64_t seed;
} tsr_request_t;

typedef struct {
    /* Leader: the next request, waiting up to wait_ms.  Returns 1 with *r
     * filled, 0 when none came. */
    int (*next_request)(void *arg, tsr_request_t *r, int wait_ms);
    /* A generated token (last stage, rank 0), or a request's failure
     * (token -1 and error set; from whichever rank found it). */
    void (*emit)(void *arg, uint64_t request_id, int32_t token, int index, int done,
                 const char *finish_reason, const char *error);
    /* True when this rank should stop (a new plan, shutdown). */
    int (*should_stop)(void *arg);
    void *arg;
} tsr_replica_io_t;

typedef struct {
    const tsr_engine_ops_t *eng_ops;
    tsr_engine_t *eng;
    const tsr_coll_ops_t *ops;
    tsr_comm_t *tp;             /* the stage's TP group, NULL when tp_size 1 */
    tsr_comm_t *prev;           /* link from the previous stage (rank 0 there, 1 here) */
    tsr_comm_t *next;           /* link to the next stage (rank 0 here, 1 there) */
    tsr_comm_t *loop;           /* leader (rank 0) <-> last stage rank 0 (rank 1); pp > 1 */
    tsr_piece_spec_t spec;
    int idle_ms;                /* leader's no-op interval (default 250) */
    int peer_timeout_ms;        /* wait for a step this long at most (default 3000) */
    int token_timeout_ms;       /* leader's wait for a token (default 60000) */
} tsr_replica_rank_t;

/* Runs until io->should_stop, a stop step, or a data-plane failure.
 * Returns 0 on a clean stop, -1 with the reason in err. */
int tsr_replica_run(tsr_replica_rank_t *r, const tsr_replica_io_t *io, char *err, size_t errlen);

/* Whether generation ends after the token with this index: "eos",
 * "max_tokens", "max_seq_len", or NULL to go on. */
const char *tsr_finish_reason(const tsr_model_info_t *m, int32_t token, int index,
                              int prompt_len, int max_tokens, int max_seq_len);

#endif
