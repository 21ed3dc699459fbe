/* router.h: generation requests (router.c): routing to a ready replica, replay on
 * another after a failure, cancellation.  The request table (tsr_coord_t.requests) is
 * this layer's alone: opaque to the others, who count it (tsr_requests_count,
 * tsr_requests_in_flight). */
#ifndef TSR_ROUTER_H
#define TSR_ROUTER_H

#include <stdbool.h>
#include <stdint.h>
#include "common/tokenizer.h"
#include "reply.h"
#include "state.h"

/* A generation request in flight.  It is kept until its last token is
 * delivered: when its replica fails it is resumed on another from the
 * prompt and the tokens delivered so far (router.c). */
typedef struct tsr_request_rec {
    uint64_t id;                /* the client's request id */
    uint64_t wid;               /* the current attempt's id at the workers: a new one per
                                   attempt, so a broken attempt's late tokens are dropped */
    uint8_t rid[256];           /* the client's routing id on the control socket */
    size_t rid_len;
    char deployment[TSR_NAME_MAX + 1];
    int replica;                /* -1: waiting for a ready replica to resume it */
    char leader[TSR_NAME_MAX + 1];  /* the worker it was sent to: Cancel goes there */
    uint64_t epoch;             /* the leader's piece epoch when it was sent */
    int n_tokens;               /* tokens delivered to the client */
    int base;                   /* tokens delivered when this attempt started (its index 0) */
    int replays;                /* attempts after the first, for a failure */
    int fruitless;              /* of those, the ones in a row since an attempt that
                                   progressed (router.c): bounded by max_replays */
    bool repeat_free;           /* the last interruption was a repeat of the fault
                                   before it, not counted */
    int64_t waiting_since_ms;   /* replica -1: since when */
    int avoid;                  /* the replica whose error interrupted it (-1: none): the
                                   next attempt goes elsewhere when it can, and back
                                   there only after it is rewired */
    int avoid_replica;          /* the replica that failed its last attempt (kept) */
    uint64_t avoid_epoch;       /* that replica's leader epoch when it failed */
    uint64_t avoid_seq;         /* the coordinator's ready_seq when it failed */
    bool wait_recovery;         /* failed twice there in one epoch: wait for it to recover */
    char why[256];              /* what interrupted the last attempt */
    /* What a replay needs: the prompt followed by every delivered token. */
    int32_t *ids;
    int n_prompt, cap_ids;
    uint32_t max_tokens;
    float temperature, top_p;
    uint64_t seed;
    int64_t started_ms;
    uint32_t timeout_ms;        /* the client's deadline; 0: none */
    int64_t deadline_ms;        /* started_ms + timeout_ms; 0: none */
    bool reply_dropped;         /* a reply was lost to a full client queue (warned once) */
    char key_id[TSR_KEY_ID_MAX];  /* the client's CURVE key id ("" without CURVE) */
    tsr_tokref_t *tok;          /* want_text: the tokenizer held for it, and its decoder */
    tsr_detok_t *detok;
    const char *fail_code;      /* ControlReply.code of its failure ("failed", "unavailable") */
    void *sock;                 /* the socket its client is on (control or HTTP bridge) */
    int64_t last_token_ms;      /* when its last token was delivered (inter-token latency) */
    /* On the coordinator's tick clock (c->now_ms), for the canary's "busy
     * but silent" test: when its current attempt was sent to a replica, and
     * when a token of it last arrived. */
    int64_t attempt_ms, progress_ms;
} tsr_request_rec_t;

void tsr_router_generate(tsr_coord_t *c, const tsr_client_t *from,
                         const Tessera__ControlRequest *q);
/* A TokenEvent from worker w (already matched to its connection): a token is
 * taken only from the last stage, tp rank 0, of the request's replica, an
 * error from any member of it; anything else is dropped and counted. */
void tsr_router_token(tsr_coord_t *c, const tsr_worker_t *w, const tsr_env_t *env);
/* Replica `replica` of deployment broke: its requests are resumed elsewhere (within
 * coordinator.max_replays), or fail with why. */
void tsr_requests_fail_replica(tsr_coord_t *c, const char *deployment, int replica,
                               const char *why);
/* The replicas a new plan rewires (c->rewiring, marked by placement, not yet given
 * their new epoch): their requests resume elsewhere without it counting against
 * max_replays, since nothing failed; their leaders are told to drop them in the epoch
 * they ran in.  Leaves the marks to placement. */
void tsr_requests_follow_moves(tsr_coord_t *c);
/* The last sign of life of replica r of d while requests are on it: the latest
 * token, the latest attempt sent to it, or the latest time every member of its
 * current layout had been seen to finish a forward step (their heartbeats' counts):
 * steps show it computes when no token comes (prompt chunks sample none).  0 when no
 * request is on it (the canary's "busy but silent" test). */
int64_t tsr_requests_progress_ms(const tsr_coord_t *c, const tsr_deployment_t *d, int replica);
/* A worker-side request id nobody can guess from the ones they saw (63 random bits,
 * so it stays a positive JSON integer), unique among the requests in flight.  0 when
 * the kernel has no random bytes to give. */
uint64_t tsr_requests_new_id(const tsr_coord_t *c);
/* Tells the worker named leader, while it still holds its piece of that epoch, to
 * drop sequence id.  0 sent, -1 not (no such leader any more, or the send failed). */
int tsr_requests_cancel_at(tsr_coord_t *c, const char *leader, uint64_t epoch, uint64_t id,
                           const char *reason);
/* Sends each request's client a no-op reply; a request whose client is gone
 * (the reply fails as unroutable) is cancelled at its leader. */
void tsr_requests_probe_clients(tsr_coord_t *c);
/* Ends every request whose client's key is no longer allowed: the client is
 * told why, once, and the leader is sent a Cancel. */
void tsr_requests_drop_keys(tsr_coord_t *c);
/* The deployment's requests waiting for their first token in their current attempt
 * (in a worker's queue, for their prompt's prefill, or for a ready replica) at
 * now_ms: how long the oldest has waited (0: none waits), and when n and sum_ms are
 * not NULL, how many wait and their waits' sum. */
int64_t tsr_requests_waiting(const tsr_coord_t *c, const char *deployment, int64_t now_ms,
                             int *n, int64_t *sum_ms);
/* Moves the requests on a deployment's replica to the others (their leader is told
 * to drop them), without it counting against max_replays: nothing failed. */
void tsr_requests_move_off(tsr_coord_t *c, const char *deployment, int replica, const char *why);
/* The requests whose attempt runs on a deployment's replica in that epoch (an old
 * cut's replica finishing in place: reshard.c); with move_why, they are moved to the
 * others, not counted against max_replays.  Returns how many there were. */
int tsr_requests_of_attempt(tsr_coord_t *c, const char *deployment, int replica,
                            uint64_t epoch, const char *move_why);
/* Whether a replica of d other than r takes new requests now (ready, healthy, not
 * being drained): what a change that stops replica r must leave standing. */
bool tsr_requests_another_serves(tsr_coord_t *c, const tsr_deployment_t *d, int r);
/* Requests in flight, all deployments. */
size_t tsr_requests_count(const tsr_coord_t *c);
/* Requests in flight on a deployment's replica (replica < 0: all). */
int tsr_requests_in_flight(const tsr_coord_t *c, const char *deployment, int replica);
/* Ends the request id that client from sent (ControlRequest CANCEL); stopped: the
 * client's stop string ended it (counted as finished, outcome "stop"). */
void tsr_router_cancel(tsr_coord_t *c, const tsr_client_t *from, uint64_t id, bool stopped);
/* An empty request table; NULL when out of memory.  The coordinator owns it
 * (tsr_requests_destroy). */
tsr_requests_t *tsr_requests_new(void);
/* Frees every request record and the table (the coordinator is going away: nobody
 * is answered); sets *self_p to NULL. */
void tsr_requests_destroy(tsr_requests_t **self_p);
/* Request i of the table (0 .. tsr_requests_count - 1), read-only; NULL past the end
 * (tests and views look, only this file writes). */
const tsr_request_rec_t *tsr_requests_at(const tsr_coord_t *c, size_t i);
/* Fails every request whose deadline is at or before now_ms (the client gets
 * the reason, the leader a Cancel).  Returns the earliest deadline still
 * ahead, or 0 when no request has one. */
int64_t tsr_requests_expire(tsr_coord_t *c, int64_t now_ms);
/* Resumes the requests waiting for a replica on ready ones; fails those that
 * waited coordinator.replay_wait_ms.  Returns when it next needs to run (0:
 * nothing waits). */
int64_t tsr_requests_dispatch(tsr_coord_t *c, int64_t now_ms);

#endif
