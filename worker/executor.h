/* executor.h: the worker's data plane, on its own thread.
 *
 * The agent (control plane, main thread) hands it assignments and requests;
 * it loads the piece's weights, forms the replica's communicators from the
 * peer endpoints the coordinator relayed, and runs the replica.  What it has
 * to say (ready, failed, tokens) it queues as events and signals on a pipe
 * the agent polls, so heartbeats never wait for a forward pass. */
#ifndef TSR_EXECUTOR_H
#define TSR_EXECUTOR_H

#include <stdint.h>
#include "common/wire.h"
#include "worker/replica.h"

typedef enum {
    TSR_EV_PROGRESS = 0,
    TSR_EV_READY,
    TSR_EV_FAILED,
    TSR_EV_TOKEN,
    TSR_EV_RENDEZVOUS,          /* rank 0 of an NCCL group made its blob: relay it */
} tsr_event_kind_t;

typedef struct {
    tsr_event_kind_t kind;
    uint64_t epoch;             /* of the assignment it is about */
    uint64_t request_id;        /* TOKEN */
    int32_t token;
    int index, done;
    int retryable;              /* FAILED, TOKEN with an error: the replica's fault, not the
                                   request's or the weights'; rewiring or resuming may help.
                                   TOKEN: a TSR_FAIL_* value (worker/replica.h) */
    int fatal;                  /* FAILED: the device is lost and the worker exits */
    int past_deadline;          /* FAILED: an operation of the piece's tensor-parallel group
                                   passed its deadline waiting for the other ranks */
    char finish[16];
    int cached;                 /* TOKEN index 0: prompt positions taken from the prefix cache */
    char text[512];             /* progress detail, failure reason, request error */
    uint64_t group;             /* RENDEZVOUS: the group and its blob */
    uint8_t blob[256];
    size_t blob_len;
} tsr_event_t;

typedef struct tsr_executor tsr_executor_t;

/* Listens for peers on bind_host (port 0: any free port) and advertises
 * advertise_host:port to them.  Returns NULL with err set. */
tsr_executor_t *tsr_executor_new(const char *bind_host, const char *advertise_host, char *err,
                                 size_t errlen);
void tsr_executor_destroy(tsr_executor_t **ex_p);
/* The GPU index CUDA pieces run on (the worker's --device-index). */
void tsr_executor_set_device(tsr_executor_t *ex, int index);
/* True after a fatal device error (an illegal address, ECC), or once
 * tsr_executor_watch found the thread stuck: the piece was reported failed
 * (fatal), and the worker should exit to be restarted. */
bool tsr_executor_device_lost(tsr_executor_t *ex);
/* The watchdog of the data-plane thread, for the agent's thread to call
 * often (now: tsr_now_ms).  A serving thread lets go of its epoch soon
 * after the next assignment or unassignment: every wait of a replica ends
 * when the epoch does, and a step fits in the collective deadline.  One
 * that has not after the running job's collective_timeout_ms, at least 2 s
 * (weight loading aside), is stuck where no deadline reaches (a driver call, a
 * wedged device, a collective that ignores its abort): this logs why,
 * reports the piece failed, fatal, and returns true once; from then on
 * tsr_executor_device_lost is true and destroy does not wait for the
 * thread.  Gaps of over 500 ms between calls are taken for time the
 * process was stopped and not counted. */
bool tsr_executor_watch(tsr_executor_t *ex, int64_t now);

/* "host:port" its peers connect to. */
const char *tsr_executor_endpoint(const tsr_executor_t *ex);
/* Readable when events are waiting. */
int tsr_executor_event_fd(const tsr_executor_t *ex);
/* Pops one event; returns 1, or 0 when none is waiting. */
int tsr_executor_pop_event(tsr_executor_t *ex, tsr_event_t *ev);

/* Serve this piece (copied).  Stops whatever runs now; the weights are kept
 * when only the epoch or the peers changed. */
void tsr_executor_assign(tsr_executor_t *ex, const Tessera__Assignment *as);
/* Stop serving and free the weights. */
void tsr_executor_unassign(tsr_executor_t *ex);
/* Queue a request (takes ownership of r->prompt).  Only a leader serves
 * requests; anywhere else it fails at once with an error event. */
void tsr_executor_submit(tsr_executor_t *ex, tsr_request_t *r);
/* A rendezvous blob the coordinator relayed for epoch and group (copied).
 * One for another epoch than the piece's is dropped; one that arrives before
 * its group starts forming waits for it. */
void tsr_executor_rendezvous(tsr_executor_t *ex, uint64_t epoch, uint64_t group,
                             const void *blob, size_t len);
/* Stop request_id at the next step (client gone, deadline passed); a
 * request this worker does not hold is ignored. */
void tsr_executor_cancel(tsr_executor_t *ex, uint64_t request_id, const char *reason);

typedef struct {
    int queued, running;        /* the leader's requests waiting, sequences running */
    int kv_used, kv_total;      /* KV pool blocks */
    uint64_t steps;             /* forward steps finished since the executor started */
    int kv_cached;              /* blocks cached and held by no sequence */
    uint64_t evictions, prompt_cached, prompt_computed, preemptions;   /* since it started */
} tsr_executor_stats_t;
void tsr_executor_stats(tsr_executor_t *ex, tsr_executor_stats_t *out);
/* Tests: event nodes come from alloc (NULL: calloc again), so an allocation
 * failure can be injected. */
void tsr_executor_test_set_event_alloc(void *(*alloc)(size_t, size_t));

/* Bytes of weights and of KV cache the loaded engine holds (0 when none). */
void tsr_executor_bytes(tsr_executor_t *ex, uint64_t *weights, uint64_t *kv);

#endif
