/* registry.h: every worker the coordinator has heard of, alive or dead.
 *
 * Entries are individually allocated and never move, so pointers stay valid
 * until they are forgotten (tsr_registry_forget_*) or tsr_registry_destroy;
 * lookups by name go through a hash.  Dead workers stay listed (status shows
 * them) until the same name registers again or they are forgotten. */
#ifndef TSR_REGISTRY_H
#define TSR_REGISTRY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/deploy.h"
#include "common/piece.h"
#include "common/wire.h"
#include "zap.h"

typedef enum {
    TSR_W_IDLE = 0,
    TSR_W_LOADING,
    TSR_W_READY,
    TSR_W_FAILED,
    TSR_W_DEAD,
} tsr_wstate_t;

const char *tsr_wstate_name(tsr_wstate_t s);

/* What a worker holds.  key and has_piece change only through
 * tsr_registry_set_piece and tsr_registry_clear_piece, which keep the index. */
typedef struct {
    tsr_piece_key_t key;
    uint64_t epoch;
    uint64_t kv_budget;         /* the KV budget last sent with it (0: none yet) */
} tsr_holding_t;

typedef struct {
    char name[TSR_NAME_MAX + 1];
    char node[TSR_NAME_MAX + 1];
    char version[TSR_NAME_MAX + 1];
    tsr_device_t device;
    uint32_t device_index;
    uint64_t memory, memory_used;
    uint64_t weight_bytes, kv_bytes;  /* of the piece it holds */
    float load;                 /* 0..1, always finite */
    uint32_t kv_blocks_used, kv_blocks_total;  /* its KV pool (0 of 0: none reported) */
    uint32_t kv_blocks_cached;  /* of them, cached and held by no sequence */
    /* Its process's counts since it started (heartbeats): cached blocks evicted; as a
     * replica's leader, prompt tokens taken from the cache and computed, preemptions. */
    uint64_t kv_evictions, prompt_cached, prompt_computed, preemptions;
    uint32_t queued, running;   /* a replica leader's requests waiting and in the batch */
    uint64_t steps;             /* forward steps its data plane finished (its heartbeat) */
    bool steps_seen;            /* steps holds a figure from this registration's heartbeats */
    int64_t steps_ms;           /* when that count last moved (tick clock; 0: not since it registered) */
    uint32_t pid;
    char data_endpoint[TSR_NAME_MAX + 1];  /* where its replica peers reach it */
    char pci_bus_id[32];        /* its GPU ("" for a CPU worker or when unknown) */
    bool nccl;                  /* it can use NCCL (it could load the library) */
    double mem_gbs, gflops;     /* its device's rates as its operator gave them (0: not given) */
    int cpu_cores, cpu_threads; /* a cpu worker's node's CPUs and its engine's threads (0: not said) */
    char nccl_device[TSR_NAME_MAX + 40];  /* "node/bus id" when nccl and a bus id, else "" */
    char nvlink[18][32];        /* bus ids at the far end of its GPU's NVLinks */
    int n_nvlink;
    char nvlink_domain[TSR_NAME_MAX + 48];  /* "node/nvl:<lowest bus id>" ("" none); set
                                               by each plan from the node's workers */
    uint8_t rid[256];           /* ZeroMQ routing id of its connection */
    size_t rid_len;
    char key_id[TSR_KEY_ID_MAX];  /* the CURVE key id (name/public key, zap.h) it
                                     registered with ("" without CURVE) */

    tsr_wstate_t state;
    bool drained;               /* excluded from placement until undrained */
    bool has_piece;
    tsr_holding_t piece;        /* valid when has_piece */
    /* A member of an old cut's replica that finishes the requests it has in flight after
     * a new cut took its deployment (reshard.c): out of the replicas here (has_piece
     * false), neither idle nor placed, its piece and epoch in `finished`, its requests
     * still its own; it is let go once they end. */
    bool finishing;
    /* ...let go to make room for its deployment's new cut (reshard.c let_go): once its
     * requests end (room_done, its piece unloaded) it stays out of placement, held for
     * that deployment's standbys, until they are sent (or the change of cut ends). */
    bool room, room_done;
    /* ...kept taking new requests after the switch beside the new cut's replicas, while
     * the new cut's other replicas load on the workers the old cut freed (reshard.c):
     * until those serve, stall, or FINISH_MAX_MS passes; then it finishes as above. */
    bool serving;
    bool finish_failed;         /* it reported its old piece failed meanwhile */
    /* Finished with an old cut: it still holds that piece's weights, and is told to let
     * go of them at this time unless a plan or a standby gives it a piece first (it then
     * keeps the layers the new piece holds too).  0: nothing pending. */
    int64_t release_due_ms;
    tsr_holding_t finished;
    uint32_t finished_pid;      /* its process then (another one holds nothing) */
    int64_t finishing_since_ms;
    char reason[512];           /* why it failed or died */
    bool retryable;             /* its piece failed in the data plane (Failed.retryable):
                                   rewiring may mend it; a load error needs the operator */
    bool past_deadline;         /* ...because its TP group waited past its deadline for the
                                   other ranks (Failed.past_deadline) */
    char detail[128];           /* last progress report */

    uint64_t ready_seq;         /* the coordinator's count of READY transitions when this
                                   worker last became ready */
    int64_t registered_ms;      /* monotonic */
    uint64_t reg_note;          /* the last registration line logged for it (a hash) and */
    int64_t reg_note_ms;        /* when: a burst of the same one is logged once */
    int64_t last_seen_ms;       /* monotonic, last message of any kind */
    int64_t dead_since_ms;
    int64_t last_ack_ms;        /* last heartbeat ack sent */
    uint64_t heartbeats;
} tsr_worker_t;

typedef struct tsr_registry tsr_registry_t;

/* Caller owns the result; free with tsr_registry_destroy. */
tsr_registry_t *tsr_registry_new(void);
void tsr_registry_destroy(tsr_registry_t **self_p);

/* Returns the entry with that name, or NULL. */
tsr_worker_t *tsr_registry_find(tsr_registry_t *self, const char *name);
/* Returns the entry for name, creating a zeroed one (state IDLE) if absent;
 * NULL when the name is longer than TSR_NAME_MAX or memory runs out.
 * The registry owns it. */
tsr_worker_t *tsr_registry_upsert(tsr_registry_t *self, const char *name);
size_t tsr_registry_size(const tsr_registry_t *self);
/* Entry i in registration order (0 <= i < size). */
tsr_worker_t *tsr_registry_at(tsr_registry_t *self, size_t i);
/* Forgets (frees) every dead worker that died at or before before_ms;
 * pointers to them become invalid.  Returns how many. */
size_t tsr_registry_forget_dead(tsr_registry_t *self, int64_t before_ms);
/* Forgets the worker dead longest.  Returns false when none is dead. */
bool tsr_registry_forget_oldest_dead(tsr_registry_t *self);
/* Number of workers not dead. */
size_t tsr_registry_alive(const tsr_registry_t *self);

/* The index from deployment to replica to slot to worker.  Every worker
 * holding a piece is in it, under its piece's (deployment, replica); a dead
 * worker holds none.  Gives w the piece (epoch and kv_budget as given);
 * returns -1 when memory runs out, w then holding nothing. */
int tsr_registry_set_piece(tsr_registry_t *self, tsr_worker_t *w, const tsr_piece_key_t *key,
                           uint64_t epoch, uint64_t kv_budget);
/* w holds nothing. */
void tsr_registry_clear_piece(tsr_registry_t *self, tsr_worker_t *w);
/* The workers holding a piece of (deployment, replica), *n of them, in the
 * order they took it (pieces of an older layout among them until they are
 * replaced: compare key.tp_size and key.pp_size).  Valid until the next
 * set, clear or forget; NULL with *n 0 when there are none. */
tsr_worker_t *const *tsr_registry_replica(tsr_registry_t *self, const char *deployment,
                                          int replica, size_t *n);
/* The worker other than `except` that holds the same piece as key (any
 * layout), or NULL. */
tsr_worker_t *tsr_registry_holder(tsr_registry_t *self, const tsr_piece_key_t *key,
                                  const tsr_worker_t *except);
/* The worker holding slot (stage * tp_size + tp) of (deployment, replica) in
 * that layout, or NULL. */
tsr_worker_t *tsr_registry_at_slot(tsr_registry_t *self, const char *deployment, int replica,
                                   int tp_size, int pp_size, int slot);

/* The leader (stage 0, tp rank 0) of deployment d's replica r when every piece
 * of it is ready in d's layout, else NULL. */
tsr_worker_t *tsr_registry_ready_leader(tsr_registry_t *self, const tsr_deployment_t *d, int r);

#endif
