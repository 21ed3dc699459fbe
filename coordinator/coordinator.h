/* coordinator.h: the coordinator's state and the events that change it.
 *
 * Events: a worker message, a control request, a timer tick, a reload.  Each
 * one that may change the desired placement sets `dirty`; the next tick runs
 * the planner and applies the reconciler's actions.  main.c owns the loop,
 * the signals and systemd; everything here is callable from tests. */
#ifndef TSR_COORDINATOR_H
#define TSR_COORDINATOR_H

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include "common/deploy.h"
#include "common/modelcfg.h"
#include "common/tokenizer.h"
#include "tokload.h"
#include "common/wire.h"
#include "common/keys.h"
#include "zap.h"
#include "planner.h"
#include "registry.h"

/* The most an adopted piece may raise the plan epoch: far more plans than a
 * cluster makes between coordinator restarts, far less than TSR_EPOCH_MAX. */
#define TSR_EPOCH_ADOPT_STEP (1ull << 24)

/* A set of (deployment index, replica) pairs. */
typedef struct {
    int *di, *replica;
    size_t n, cap;
} tsr_replica_set_t;

/* What the canary knows of one replica: a one-token request sent when the
 * replica is idle, every canary_interval_ms (router.c). */
typedef struct {
    int64_t next_ms;            /* when the next canary is due */
    int64_t sent_ms;            /* when the one in flight was sent */
    uint64_t wid;               /* its id at the workers (0: none in flight) */
    char leader[TSR_NAME_MAX + 1];
    uint64_t epoch;
    bool unhealthy;             /* its last canary failed: no requests go to it */
    char why[256];
} tsr_canary_t;

/* A deployment's tokenizer, shared by the deployment and the requests decoding with it,
 * so that a reload that drops it frees it only after its last request. */
typedef struct {
    tsr_tokenizer_t *tok;
    atomic_int refs;
    tsr_file_id_t file;         /* the tokenizer.json it was read from, as it was then */
} tsr_tokref_t;

/* One more holder of r (NULL-safe); returns r. */
tsr_tokref_t *tsr_tokref_hold(tsr_tokref_t *r);
/* Drops one hold; the last frees the tokenizer.  Sets *r_p to NULL. */
void tsr_tokref_drop(tsr_tokref_t **r_p);

/* What the HTTP server needs to encode a deployment's prompts in its own threads: a
 * copy of each deployment's tokenizer hold and keys, kept current by the loop (on load
 * and reload) under a mutex. */
typedef struct {
    char name[TSR_NAME_MAX + 1];
    tsr_tokref_t *tok;          /* held; NULL: the deployment has no usable tokenizer */
    char chat_template[16];     /* the deployment's chat_template key ("": recognise) */
    int max_seq_len;
    char tok_error[300];        /* with no tokenizer: why (paths in the model's directory
                                   relative to it: HTTP clients see it) */
    bool tok_loading;           /* none yet: it is being read (try again shortly) */
} tsr_tokreg_entry_t;

typedef struct tsr_tokreg {
    pthread_mutex_t mu;
    tsr_tokreg_entry_t *v;
    size_t n;
} tsr_tokreg_t;

/* Copies deployment name's entry into *out, its tokenizer held for the caller (drop it
 * with tsr_tokref_drop(&out->tok)).  -1 when there is no such deployment. */
int tsr_tokreg_get(tsr_tokreg_t *reg, const char *name, tsr_tokreg_entry_t *out);
/* The refusal of a text prompt (or text output) by deployment name without a tokenizer:
 * why is its tok_error; loading, whether its tokenizer.json is being read (retryable). */
void tsr_tok_refusal(const char *name, const char *why, bool loading, char *msg, size_t len);

typedef struct {
    char name[TSR_NAME_MAX + 1];
    bool model_ok;
    tsr_tokref_t *tok;          /* its model directory's tokenizer.json (NULL: none) */
    char tok_error[600];        /* why there is none */
    bool tok_broken;            /* a tokenizer.json is there but cannot be used (a fault;
                                   none at all is a model for token ids only) */
    char *tok_dir;              /* the directory it was (or is being) read from */
    bool tok_loading;           /* tok_dir's tokenizer.json is being read off the loop (a
                                   reload's new model): text requests wait for it */
    tsr_model_info_t model;
    char model_error[1024];
    bool ever_ready;            /* was fully ready once: a gap now is "degraded" */
    int short_by;               /* workers of its device kind the last plan lacked */
    uint64_t short_memory;      /* when memory was the cause: bytes one piece needs */
    char shortage[256];         /* the planner's text for it ("" when nothing lacks) */
    /* Data-plane failures are retried by rewiring the replica, with backoff
     * (2 s, doubling to 60 s, reset once the deployment is ready again). */
    int64_t retry_at_ms;        /* 0: nothing scheduled */
    int retry_backoff_ms;
    tsr_replica_set_t retry;    /* replicas to rewire at retry_at_ms */
    uint64_t *completed;        /* requests finished by each replica (n_completed of them;
                                   NULL when out of memory) */
    int n_completed;
    tsr_canary_t *canary;       /* one per replica (n_completed of them; NULL: none) */
} tsr_dep_state_t;

/* A generation request in flight.  It is kept until its last token is
 * delivered: when its replica fails it is resumed on another from the
 * prompt and the tokens delivered so far (router.c). */
typedef struct {
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

typedef struct {
    uint64_t requests, requests_failed, requests_cancelled, replies_dropped, tokens;
    uint64_t messages, heartbeats, registrations, refused, stale_dropped, bad_messages,
        plans, assigns, unassigns, deaths, control_requests;
    uint64_t identity_dropped;  /* a message whose worker name is not its connection's */
    uint64_t workers_forgotten; /* dead workers dropped after dead_worker_ttl_s or at the cap */
    uint64_t key_dropped;       /* a message from a connection whose key was removed */
    uint64_t requests_replayed; /* attempts resumed on another replica after a failure */
    uint64_t orphans_cancelled; /* Cancels sent for tokens of requests nobody waits for */
    uint64_t sends_failed;      /* messages to workers that could not be queued */
    uint64_t canaries, canaries_failed;
    uint64_t rendezvous_relayed; /* NCCL rendezvous blobs passed on to a replica's members */
} tsr_coord_stats_t;

/* A Prometheus histogram in seconds over fixed bucket bounds (metrics.c). */
#define TSR_HIST_BUCKETS 14
typedef struct {
    uint64_t le[TSR_HIST_BUCKETS];  /* observations <= each bound (not cumulative) */
    uint64_t count;
    double sum;
} tsr_hist_t;

/* What /metrics reports per deployment; kept across reloads, by name. */
typedef struct {
    char name[TSR_NAME_MAX + 1];
    uint64_t outcome[5];        /* TSR_OUTCOME_*: requests that ended so */
    uint64_t prompt_tokens, generated_tokens;
    tsr_hist_t ttft, itl, duration;
} tsr_dep_metrics_t;
enum { TSR_OUTCOME_STOP, TSR_OUTCOME_LENGTH, TSR_OUTCOME_FAILED, TSR_OUTCOME_CANCELLED,
       TSR_OUTCOME_REFUSED };

typedef struct {
    char *config_path;
    tsr_config_t *cfg;
    tsr_dep_metrics_t *metrics; /* per deployment name, in order of first use */
    size_t n_metrics;
    tsr_dep_state_t *deps;      /* one per cfg->deployments */
    tsr_registry_t *reg;
    void *wsock;                /* ROUTER, workers endpoint */
    void *csock;                /* ROUTER, control endpoint */
    uint64_t epoch;             /* plan epoch; only grows */
    uint64_t ready_seq;         /* counts workers becoming ready (tsr_worker_t.ready_seq) */
    bool dirty;
    int64_t started_ms;
    int64_t plan_after_ms;      /* no planning before this: workers re-attach first */
    int64_t next_scan_ms;
    int64_t now_ms;             /* the clock of the tick in progress */
    int64_t last_plan_ms;
    tsr_coord_stats_t stats;
    tsr_replica_set_t lost;     /* replicas that lost a worker since the last plan */
    tsr_request_rec_t *reqs;    /* in flight */
    size_t n_reqs, cap_reqs;
    tsr_security_t sec;         /* the coordinator's key pair (sec.curve 0: security none) */
    tsr_zap_t *zap;             /* who may connect (NULL without CURVE) */
    uint64_t zap_generation;    /* the allowed set the live sessions were checked against */
    /* The CURVE key of the connection whose message is being handled ("":
     * none), set by the socket reader for the handlers. */
    char msg_key[TSR_KEY_ID_MAX];
    int64_t send_warned_ms;     /* the last warning about a failed send */
    void *cmon;                 /* the control socket's disconnections */
    char bridge[64];            /* the HTTP server's inproc endpoint ("" without
                                   http_endpoint) and its ROUTER (plain, in-process) */
    void *bsock;
    void *reply_sock;           /* where the control message being handled came from */
    tsr_tokreg_t tokreg;        /* the deployments' tokenizers, for the HTTP threads */
    tsr_tokload_t *tokload;     /* reads a reload's new tokenizers off the loop */
    int64_t probe_due_ms, last_probe_ms;  /* when to ask the clients next (0: no need) */
} tsr_coord_t;

/* Loads the config and binds both endpoints.  adopt_grace_ms < 0 means one
 * worker timeout.  Returns NULL with a message in err. */
tsr_coord_t *tsr_coord_new(const char *config_path, int adopt_grace_ms, char *err, size_t errlen);
void tsr_coord_destroy(tsr_coord_t **self_p);
/* A flag a signal handler sets: tsr_coord_new reads no more tokenizers once it is set
 * (a coordinator told to stop while it starts does not read them all first). */
void tsr_coord_stop_flag(volatile sig_atomic_t *flag);

/* router.c: the leader (stage 0, tp rank 0) of deployment d's replica r when
 * every piece of it is ready in d's layout, else NULL. */
tsr_worker_t *tsr_coord_ready_leader(tsr_coord_t *c, const tsr_deployment_t *d, int r);
/* The state of the deployment with that name, or NULL. */
tsr_dep_state_t *tsr_coord_dep(tsr_coord_t *c, const char *name);
/* True when w's tensor-parallel group waited for it: w is ready while every
 * other member of its stage has reported a failure in the same epoch, one
 * at least that a group operation passed its deadline (Failed.past_deadline),
 * and its pipeline hand-off neighbours (the same tp rank in the adjacent
 * stages) are there, in its epoch, and not so marked themselves.  The other
 * ranks' failures name no one in a group of more than two; the one that
 * reported nothing is the one they waited for. */
bool tsr_coord_waited_for(tsr_coord_t *c, const tsr_worker_t *w);
/* "g1 (stage 0 tp 1), g5 (stage 1 tp 0)": the members of deployment d's
 * replica their groups waited for, into buf ("" none); how many. */
int tsr_coord_waited_for_text(tsr_coord_t *c, const tsr_deployment_t *d, int replica, char *buf,
                              size_t len);
/* Sends env to the worker at routing id rid on the workers socket; a send
 * that fails is counted (stats.sends_failed) and logged.  0 or -1. */
int tsr_coord_send(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, tsr_env_t *env);
/* Reads every waiting message on both sockets (at most `budget` each). */
void tsr_coord_drain_sockets(tsr_coord_t *c, int budget);
/* Periodic work: health scan, planning when dirty.  Returns the ms until the
 * next tick is due. */
int tsr_coord_tick(tsr_coord_t *c, int64_t now_ms);
/* Rereads the YAML.  On any error nothing changes and -1 is returned with the
 * reason in err. */
int tsr_coord_reload(tsr_coord_t *c, char *err, size_t errlen);
/* Runs the planner now and applies its actions. */
void tsr_coord_replan(tsr_coord_t *c, int64_t now_ms);
/* Plans at once where planning may run now (past plan_after_ms), so a
 * control request answers with the new plan; else leaves it to the tick
 * (dirty). */
void tsr_coord_plan_now(tsr_coord_t *c, int64_t now_ms);
/* Rewires replica of deployment (a new epoch on the same workers, unless
 * the plan moves a piece) after the deployment's backoff: 2 s, doubling up
 * to 60 s, back to 2 s once the replica is whole again.  why is logged. */
void tsr_coord_rewire_later(tsr_coord_t *c, const char *deployment, int replica,
                            const char *why, int64_t now_ms);

/* metrics.c.  The deployment's metrics (created on first use; NULL when out of memory). */
tsr_dep_metrics_t *tsr_metrics_of(tsr_coord_t *c, const char *deployment);
/* Counts one request of that deployment ending as outcome ("stop", "length", "failed",
 * "cancelled", "refused"). */
void tsr_metrics_outcome(tsr_coord_t *c, const char *deployment, const char *outcome);
void tsr_hist_observe(tsr_hist_t *h, double seconds);
/* The Prometheus text exposition of the coordinator's metrics (GET /metrics).  Caller
 * owns the string; NULL when out of memory. */
char *tsr_coord_metrics_text(tsr_coord_t *c, int64_t now_ms);
/* control.c: {"deployments": [{"name", "state", "message", "ready_replicas",
 * "replicas"}], "uptime_ms"}: what /health and /v1/models need.  Caller frees. */
char *tsr_coord_deployments_json(tsr_coord_t *c, int64_t now_ms);
/* control.c: a deployment's state as status shows it ("ready", "degraded", ...). */
const char *tsr_coord_dep_state(tsr_coord_t *c, size_t i, int64_t now_ms);

/* The status document (what `tessera status --json` prints).  Caller owns
 * the string (free()). */
char *tsr_coord_status_json(tsr_coord_t *c, int64_t now_ms, bool workers_only);

/* control.c: answers one control request (status, workers, reload, drain,
 * generate) from the client at routing id rid. */
void tsr_control_handle(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, tsr_env_t *env);
/* What became of a reply.  The control socket is a ROUTER with
 * ZMQ_ROUTER_MANDATORY, so a client that disconnected is told apart from one
 * that reads slowly: only GONE means nobody will ever read it. */
enum {
    TSR_REPLY_SENT = 0,
    TSR_REPLY_DROPPED = -1,     /* the client's queue is full (high-water mark): this
                                   reply is lost, the client is still there */
    TSR_REPLY_GONE = -2,        /* the client disconnected (EHOSTUNREACH) */
};
/* Sends one ControlReply to that client; json is the reply's document text
 * (NULL for none).  Returns one of TSR_REPLY_*. */
int tsr_control_reply(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, bool ok,
                      const char *error, const char *json);
/* The same with ControlReply.code set (NULL: none).  Both answer on the socket the
 * message being handled came from (c->reply_sock). */
int tsr_control_reply_code(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, bool ok,
                           const char *code, const char *error, const char *json);
/* The same on a given socket (a request's client, later). */
int tsr_control_send(tsr_coord_t *c, void *sock, const uint8_t *rid, size_t rid_len, bool ok,
                     const char *code, const char *error, const char *json);

/* router.c */
void tsr_router_generate(tsr_coord_t *c, const uint8_t *rid, size_t rid_len,
                         const Tessera__ControlRequest *q);
/* A TokenEvent from worker w (already matched to its connection): a token is
 * taken only from the last stage, tp rank 0, of the request's replica, an
 * error from any member of it; anything else is dropped and counted. */
void tsr_router_token(tsr_coord_t *c, const tsr_worker_t *w, const tsr_env_t *env);
/* Replica `replica` of deployment broke or was rewired: its requests are
 * resumed elsewhere (within coordinator.max_replays, router.c), or fail
 * with why. */
void tsr_requests_fail_replica(tsr_coord_t *c, const char *deployment, int replica,
                               const char *why);
/* The same for a replica rewired by a new plan (a reload, a drain): its
 * requests resume elsewhere without it counting against max_replays, since
 * nothing failed. */
void tsr_requests_move_replica(tsr_coord_t *c, const char *deployment, int replica,
                               const char *why);
/* Sends a canary to every idle ready replica that is due one, and marks a
 * replica whose canary got no token in time unhealthy.  Returns when it next
 * needs to run (0: never). */
int64_t tsr_canary_tick(tsr_coord_t *c, int64_t now_ms);
/* Sends each request's client a no-op reply; a request whose client is gone
 * (the reply fails as unroutable) is cancelled at its leader. */
void tsr_requests_probe_clients(tsr_coord_t *c);
/* Ends every request whose client's key is no longer allowed: the client is
 * told why, once, and the leader is sent a Cancel. */
void tsr_requests_drop_keys(tsr_coord_t *c);
/* Requests in flight on a deployment's replica (replica < 0: all). */
int tsr_requests_in_flight(const tsr_coord_t *c, const char *deployment, int replica);
/* Ends the request id that the client at rid sent (ControlRequest CANCEL); stopped: the
 * client's stop string ended it (counted as finished, outcome "stop"). */
void tsr_router_cancel(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, uint64_t id,
                       bool stopped);
/* Frees what a request record owns (its ids, its text decoder and tokenizer hold). */
void tsr_request_free(tsr_request_rec_t *q);
/* Fails every request whose deadline is at or before now_ms (the client gets
 * the reason, the leader a Cancel).  Returns the earliest deadline still
 * ahead, or 0 when no request has one. */
int64_t tsr_requests_expire(tsr_coord_t *c, int64_t now_ms);
/* Resumes the requests waiting for a replica on ready ones; fails those that
 * waited coordinator.replay_wait_ms.  Returns when it next needs to run (0:
 * nothing waits). */
int64_t tsr_requests_dispatch(tsr_coord_t *c, int64_t now_ms);

#endif
