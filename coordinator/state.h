/* state.h: the coordinator's shared state (state.c) and the lookups every layer uses.
 *
 * The layers, top to bottom, and what each owns in tsr_coord_t:
 *   loop (loop.c)            the sockets, the tick's clocks (next_scan_ms, now_ms,
 *                            probe_due_ms, last_probe_ms) and the dispatch of messages;
 *   control (control.c ...)  nothing: it reads through const pointers (depview.c,
 *                            status.c, metrics_text.c) and calls the layers below;
 *   requests (router.c, canary.c)
 *                            requests, router.c's (opaque: the others count it with
 *                            tsr_requests_count and tsr_requests_in_flight), and the
 *                            canary state of each replica, canary.c's (deps[].canary:
 *                            the others only read it);
 *   metrics (metrics.c)      metrics (tsr_metrics_free frees it);
 *   placement (placement.c, register.c, reload.c)
 *                            epoch (it only grows), dirty, plan_after_ms, last_plan_ms,
 *                            place (its own, opaque) and the retry fields of deps[];
 *   state (this file, assign.c, deptok.c, the registry)
 *                            config_path, cfg, deps, reg, sec, zap, tokreg, tokload,
 *                            ready_seq, send_warned_ms.
 * stats holds every layer's counters; each layer counts its own.  A layer writes only
 * its own fields; calls go down only (tests/integration/test_no_call_cycles.sh checks
 * that no two files call each other, directly or round a circle). */
#ifndef TSR_STATE_H
#define TSR_STATE_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include "common/deploy.h"
#include "common/keys.h"
#include "common/log.h"
#include "common/modelcfg.h"
#include "common/wire.h"
#include "metrics.h"
#include "registry.h"
#include "tokload.h"
#include "tokref.h"
#include "zap.h"

/* The highest plan epoch a registering worker's piece may raise the
 * coordinator's to, adopted or not.  A coordinator starts at epoch 0 and
 * learns its predecessor's from the pieces its workers hold; far more plans
 * than a cluster makes, far less than TSR_EPOCH_MAX.  A bound on the epoch,
 * not on each raise: registrations repeated with ever higher epochs would
 * otherwise push it up a step at a time until no plan could be made. */
#define TSR_EPOCH_ADOPT_MAX (1ull << 24)

/* A set of (deployment index, replica) pairs. */
typedef struct {
    int *di, *replica;
    size_t n, cap;
} tsr_replica_set_t;

/* Adds (di, replica) unless it is there (di < 0: nothing); out of memory drops it. */
void tsr_replica_set_add(tsr_replica_set_t *t, int di, int replica);
/* Frees what the set holds and empties it. */
void tsr_replica_set_free(tsr_replica_set_t *t);

/* What the canary knows of one replica: a one-token request sent when the
 * replica is idle, every canary_interval_ms (canary.c). */
typedef struct {
    int64_t next_ms;            /* when the next canary is due */
    int64_t sent_ms;            /* when the one in flight was sent */
    uint64_t wid;               /* its id at the workers (0: none in flight) */
    char leader[TSR_NAME_MAX + 1];
    uint64_t epoch;
    bool unhealthy;             /* its last canary failed: no requests go to it */
    char why[256];
} tsr_canary_t;

/* A piece an idle worker loads before it is its (a standby: reshard.c). */
typedef struct {
    char worker[TSR_NAME_MAX + 1];
    uint32_t pid;               /* its process when sent (another: it restarted, lost) */
    tsr_piece_key_t key;
    bool loaded;                /* it said ready in the standby's epoch */
    bool failed;                /* it could not load it */
} tsr_standby_t;

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
    /* An auto layout (parallel: auto, tensor/pipeline/replicas: auto), chosen from the
     * workers by resolve.c: until it is, the deployment is not planned. */
    bool layout_chosen;         /* tensor and pipeline are known (given, or chosen) */
    bool replicas_settled;      /* auto replicas were planned once: from then on they only
                                   grow (a failure must not take a replica away) */
    char layout_why[320];       /* how they were chosen, or why they cannot be yet */
    /* Replicas that follow load (replicas: {min, max}; autoscale.c's fields: the
     * requests layer reads draining, the views the rest). */
    struct {
        int64_t queue_wait_ms;  /* the oldest request's wait for its first token, now */
        int64_t window_ms;      /* when the window in progress began (0: none yet) */
        double window_sum0;     /* the deployment's first-token waits then: their sum
                                   (s) and count (metrics' ttft) */
        uint64_t window_n0;
        double window_wait_ms;  /* the last whole window's mean wait for a first token
                                   (-1: none ended yet) */
        bool window_above;      /* ...was above scale_up_queue_ms */
        int64_t room_since_ms;  /* since when the other replicas could hold every
                                   request in flight (0: they cannot) */
        int draining;           /* the replica being drained to be removed (-1: none):
                                   no new request goes to it */
        int64_t drain_since_ms;
        bool give_back;         /* it drains for another deployment's shortage, not for
                                   want of load: queue wait does not call it off */
        uint64_t ups, downs;    /* decisions made */
        int64_t last_ms;        /* when the last was made (0: none yet) */
        char last[256];         /* what it was and why */
        char why[200];          /* why the replica draining is removed */
        char blocked[160];      /* why the replica more the queue asks for is not added
                                   ("": nothing is held back) */
    } scale;
    /* A reload's new cut built beside the running one (reload.c defers the cut,
     * reshard.c's the rest): the idle workers load the new layout's pieces as
     * standbys while the old replicas serve, then one plan swaps them in. */
    struct {
        bool active;            /* d keeps the old cut until the switch */
        int tensor, pipeline, replicas;  /* the file's, to switch to */
        int beside;             /* replicas of it built on idle workers before the switch
                                   (the others load on the workers the old cut frees) */
        int dropped;            /* old replicas let go to make room for them */
        bool let_go;            /* they were (reshard.c's first step) */
        int finishing;          /* old workers that finish their requests after the switch */
        int serving;            /* old replicas that take requests after it too */
        int64_t switched_ms;    /* when the cut switched */
        int64_t freed_ms;       /* when an old worker was last let go after it */
        bool sent, switching;
        uint64_t epoch;         /* the standby assignments' */
        tsr_standby_t *standby; /* n of them (NULL until sent) */
        int n;
        int64_t since_ms;
        char doing[320];        /* the step it is at ("" when none) */
        char last[320];         /* how the last change of cut went */
    } reshard;
    struct {                    /* what was chosen, for a reload that keeps it */
        bool ranged;            /* replicas followed load (a range) */
        bool auto_tensor, auto_pipeline, auto_replicas;
        int device, tensor, pipeline, replicas;
        int weight_bytes, kv_dtype; /* a weight's bytes, the KV cache's type, resolved */
        double latency_target_ms;
    } chose;
} tsr_dep_state_t;

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
    uint64_t handshakes_failed; /* refused by ZeroMQ before the key check: a client
                                   without CURVE, a handshake that cannot be read or
                                   that the client closed */
} tsr_coord_stats_t;

typedef struct tsr_requests tsr_requests_t;    /* the request table (router.c) */

typedef struct tsr_coord {
    /* state */
    char *config_path;
    tsr_config_t *cfg;
    tsr_dep_state_t *deps;      /* one per cfg->deployments */
    tsr_registry_t *reg;
    uint64_t ready_seq;         /* counts workers becoming ready (tsr_worker_t.ready_seq) */
    tsr_security_t sec;         /* the coordinator's key pair (sec.curve 0: security none) */
    tsr_zap_t *zap;             /* who may connect (NULL without CURVE) */
    uint64_t zap_generation;    /* the allowed set the live sessions were checked against */
    int64_t send_warned_ms;     /* the last warning about a failed send */
    tsr_tokreg_t tokreg;        /* the deployments' tokenizers, for the HTTP threads */
    tsr_tokload_t *tokload;     /* reads a reload's new tokenizers off the loop */
    tsr_coord_stats_t stats;
    /* placement */
    uint64_t epoch;             /* plan epoch; only grows */
    bool dirty;
    int64_t plan_after_ms;      /* no planning before this: workers re-attach first */
    int64_t last_plan_ms;
    struct tsr_placement *place; /* the replicas to rewire (placement.h: only placement.c
                                    reads and writes it) */
    /* moving back (rebalance.c's) */
    struct {
        int64_t last_ms;        /* when the last move began (0: none yet) */
        bool active;            /* a move is under way */
        bool switching;         /* the plans put the piece on `to` (a hint to placement) */
        tsr_piece_key_t key;    /* the piece that moves */
        char from[TSR_NAME_MAX + 1], to[TSR_NAME_MAX + 1];
        uint64_t epoch;         /* the standby assignment's, to `to` */
        bool loaded;            /* `to` has the piece's weights (it said ready) */
        char what[300];         /* the move: piece, from where, to where */
        uint64_t moves, abandoned;
        char failed_worker[TSR_NAME_MAX + 1];  /* the last standby that could not load */
        tsr_piece_key_t failed_key;            /* ...its piece: not asked again before */
        int64_t failed_until_ms;
        char doing[400];        /* the move under way, at which step ("" when none) */
        char last[400];         /* the last move done or given up, and why */
    } rebalance;
    /* metrics */
    tsr_metrics_t metrics;      /* per deployment name, in order of first use */
    /* requests */
    tsr_requests_t *requests;   /* in flight (router.c's, opaque) */
    /* loop */
    void *wsock;                /* ROUTER, workers endpoint */
    void *csock;                /* ROUTER, control endpoint */
    void *cmon;                 /* the control socket's disconnections and, with CURVE,
                                   handshakes ZeroMQ refused */
    void *wmon;                 /* with CURVE: the workers socket's refused handshakes */
    tsr_log_limit_t hs_log[2][4];  /* those refusals' log lines: by endpoint (workers,
                                      control) and cause (no CURVE, unreadable, other,
                                      closed by the client) */
    char bridge[64];            /* the HTTP server's inproc endpoint ("" without
                                   http_endpoint) and its ROUTER (plain, in-process) */
    void *bsock;
    int64_t started_ms;
    int64_t next_scan_ms;
    int64_t now_ms;             /* the clock of the tick in progress */
    int64_t probe_due_ms, last_probe_ms;  /* when to ask the clients next (0: no need) */
} tsr_coord_t;

/* Reads the configuration and every deployment's model and tokenizer, makes the
 * registry and, with CURVE, reads the key pair and binds the key store's handler
 * (before any socket: ZeroMQ lets any CURVE client in while none is bound).  c is
 * zeroed memory.  -1 with the reason in err; tsr_state_close frees what was made. */
int tsr_state_open(tsr_coord_t *c, const char *config_path, char *err, size_t errlen);
/* Reads cfg's coordinator key pair into *sec and checks the key store as a
 * start does (a secret key file others can read, a coordinator.pub others
 * may write or of another key, a store or allowed/ others may write or
 * another user owns, a file in allowed/ that is not a trusted key are
 * refused): 0, or -1 with the reason in err.  A start and --check both come
 * here, so --check passes what a start takes. */
int tsr_coord_server_keys(const tsr_config_t *cfg, tsr_security_t *sec, char *err, size_t errlen);
/* Frees everything tsr_state_open made (not c). */
void tsr_state_close(tsr_coord_t *c);

/* Reads each deployment's config.json and checks its layout, and finds its tokenizer
 * (deptok.h; later: a reload, which reads new ones off the loop).  What the old states
 * (n_old of them, by name) had is carried over where it still applies.  NULL when out
 * of memory; free with tsr_deps_free. */
tsr_dep_state_t *tsr_deps_build(tsr_config_t *cfg, const tsr_dep_state_t *old, size_t n_old,
                                bool later);
void tsr_deps_free(tsr_dep_state_t *deps, size_t n);

/* Whether worker `name` is loading or holds a piece it does not serve yet, a standby
 * of a move back (rebalance.c) or of a new cut (reshard.c): not idle for anyone else. */
bool tsr_coord_is_standby(const tsr_coord_t *c, const char *name);
/* Whether w is free for a new piece or standby: alive, not drained, holding nothing and
 * no standby's. */
bool tsr_coord_worker_idle(const tsr_coord_t *c, const tsr_worker_t *w);
/* Whether d's old replicas serving beside its new cut may take requests: its change of
 * cut is switching and has not stopped them (reshard.c). */
bool tsr_coord_serving_beside(const tsr_coord_t *c, const tsr_deployment_t *d);
/* How many workers of that kind are idle (tsr_coord_worker_idle). */
int tsr_coord_idle_count(const tsr_coord_t *c, tsr_device_t kind);
/* The prefix cache's secret (common/prefix.h) for deployment d's replicas of
 * tp_size x pp_size: HMAC-SHA256 of the deployment, its model, device, types
 * and layout under the coordinator's secret key (or, with security: none, a
 * random key of this process), cut to 16 bytes.  So keys differ across
 * deployments, models, types and layouts; a restarted coordinator with the
 * same key store derives the same.  false: d has prefix_cache off, or no
 * key could be made. */
bool tsr_coord_prefix_secret(const tsr_coord_t *c, const tsr_deployment_t *d, int tp_size,
                             int pp_size, uint8_t out[16]);
/* The index in cfg->deployments of the deployment with that name, or -1. */
int tsr_coord_dep_index(const tsr_coord_t *c, const char *name);
/* The state of the deployment with that name, or NULL. */
tsr_dep_state_t *tsr_coord_dep(tsr_coord_t *c, const char *name);
/* The canary state of replica r of the deployment with that name, or NULL
 * (canary.c keeps it; the router reads whether the replica is unhealthy). */
tsr_canary_t *tsr_coord_canary(tsr_coord_t *c, const char *deployment, int r);
/* Records d's cut (its auto keys and what they stand for now) in ds->chose, what the
 * next reload compares to keep an auto choice. */
void tsr_dep_note_cut(tsr_dep_state_t *ds, const tsr_deployment_t *d);
/* Gives deployment d (state ds) n replicas (n >= 1): the per-replica counts follow
 * (those of replicas that remain are kept).  Only resolve.c changes an auto
 * deployment's count so.  -1 when out of memory (nothing changes). */
int tsr_dep_set_replicas(tsr_dep_state_t *ds, tsr_deployment_t *d, int n);
/* True when k (with its layout) is one of deployment di's pieces under the
 * current configuration. */
bool tsr_coord_piece_fits(const tsr_coord_t *c, int di, const tsr_piece_key_t *k);

#endif
