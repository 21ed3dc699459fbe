/* collective.h: how the ranks of a replica talk to each other.
 *
 * A table of functions, so the engine and the replica runner cannot tell
 * which backend they have: TCP for CPU pieces (collective_tcp.c), NCCL for
 * CUDA pieces (later).  A communicator is formed per plan epoch from an
 * opaque rendezvous blob the coordinator relays (TCP: the members' data
 * endpoints; NCCL: a unique id).  Buffers are typed and live in the memory
 * space of the backend (host for TCP, the GPU for NCCL).  Every operation
 * has a deadline; a dead or silent peer makes it fail with a message within
 * that time, never hang.  After a failure the communicator is aborted: the
 * caller reports the reason, destroys it and waits for the next epoch's.
 *
 * A newer epoch (the rendezvous's cancelled turning true) also ends an
 * operation's wait soon after, in every backend: a worker lets go of an old
 * epoch at once, whatever its peers do.
 *
 * Host backends finish an operation before it returns.  A device backend
 * (NCCL) may return once the operation is queued on the engine's stream,
 * so a step's all-reduces run without the host waiting on each; the
 * engine settles the communicator where the host needs the results, and
 * that wait carries the deadline and the failure reporting. */
#ifndef TSR_COLLECTIVE_H
#define TSR_COLLECTIVE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"

typedef enum { TSR_MEM_HOST = 0, TSR_MEM_DEVICE } tsr_mem_t;

/* A typed view of memory an engine or a backend owns; count elements. */
typedef struct {
    void *ptr;
    size_t count;
    tsr_dtype_t dtype;
    tsr_mem_t mem;
} tsr_buf_t;

static inline tsr_buf_t tsr_host_buf(void *p, size_t count, tsr_dtype_t t)
{
    return (tsr_buf_t){p, count, t, TSR_MEM_HOST};
}
/* The first count elements of b. */
static inline tsr_buf_t tsr_buf_head(tsr_buf_t b, size_t count)
{
    b.count = count;
    return b;
}

typedef struct tsr_comm tsr_comm_t;

/* What a communicator is formed from: the group (epoch, group id, rank,
 * size) and the backend's rendezvous blob. */
typedef struct {
    uint64_t epoch, group;
    int rank, n;
    const void *blob;           /* TCP: the n members' "host:port", '\n'-separated */
    size_t blob_len;
    int timeout_ms;
    int (*cancelled)(void *arg);/* optional: give up early when it turns true */
    void *cancel_arg;
    /* The replica's secret for this epoch (Assignment.data_secret, 16 to 64
     * bytes): peers prove they know it, and it keys every frame.  TCP
     * refuses to form a group of more than one rank without it. */
    const void *secret;
    size_t secret_len;
    /* Optional (GPU groups): each member's GPU, its PCI bus id ("" unknown),
     * in rank order; ranks that share one cannot share an NCCL group. */
    const char *const *devices;
    /* Optional: each member's "worker NAME on node NODE" ("" unknown), in
     * rank order, for the messages that name a peer. */
    const char *const *names;
    /* Optional: passes a backend's own rendezvous blob through the
     * coordinator.  Rank 0 publishes (mine set: returns at once); then
     * every rank, rank 0 too, receives the blob the coordinator relayed for
     * this epoch and group into out (mine NULL; up to cap bytes, *out_len
     * set), waiting up to timeout_ms and giving up when cancelled.  0, or
     * -1 with the reason. */
    int (*exchange)(void *arg, uint64_t group, const void *mine, size_t len, void *out,
                    size_t cap, size_t *out_len, int timeout_ms, char *err, size_t errlen);
    void *exchange_arg;
} tsr_rendezvous_t;

typedef struct tsr_nccl_api tsr_nccl_api_t;
typedef struct tsr_tcp_listener tsr_tcp_listener_t;

/* What every backend's create gets as ctx: the worker's TCP listener (TCP
 * and the host-staged backend) and, for GPU groups, NCCL's functions, the
 * GPU and the engine's stream. */
typedef struct tsr_coll_ctx {
    tsr_tcp_listener_t *listener;
    const tsr_nccl_api_t *nccl;     /* NULL: no NCCL here (nccl_why says why) */
    const char *nccl_why;
    const struct tsr_coll_ops *fallback;  /* the GPU chooser's host-staged backend */
    int device;                     /* the GPU */
    void *stream;                   /* the engine's stream (NULL: the default) */
    int poll_us;                    /* NCCL's poll interval (0: 1000) */
} tsr_coll_ctx_t;

/* One leg of a grouped send/recv. */
typedef struct {
    int peer;
    bool is_send;
    tsr_buf_t buf;              /* recv: count must equal what the peer sent */
} tsr_p2p_t;

typedef struct tsr_coll_ops {
    const char *name;   /* "tcp", "nccl" */
    tsr_mem_t mem;      /* where its buffers must live */
    /* Forms this rank's communicator; ctx is a tsr_coll_ctx_t, the
     * worker's state.  Caller owns *out (destroy). */
    int (*create)(void *ctx, const tsr_rendezvous_t *rv, tsr_comm_t **out, char *err,
                  size_t errlen);
    /* In-place sum over all ranks; every rank gets the same bits. */
    int (*allreduce_sum)(tsr_comm_t *c, tsr_buf_t buf, int timeout_ms, char *err, size_t errlen);
    /* recv = the n ranks' send buffers in rank order (recv.count = n * send.count). */
    int (*allgather)(tsr_comm_t *c, tsr_buf_t send, tsr_buf_t recv, int timeout_ms, char *err,
                     size_t errlen);
    /* Copies root's buf to every rank. */
    int (*broadcast)(tsr_comm_t *c, tsr_buf_t buf, int root, int timeout_ms, char *err,
                     size_t errlen);
    /* Runs the sends and receives together (at most one of each per peer),
     * so two ranks exchanging large buffers cannot deadlock. */
    int (*group)(tsr_comm_t *c, const tsr_p2p_t *ops, int n, int timeout_ms, char *err,
                 size_t errlen);
    /* 1 when a message from peer is waiting or arriving, or its connection
     * has closed (the recv that follows then fails naming the peer); 0
     * after timeout_ms without either; -1 when the communicator is already
     * broken or poll itself failed. */
    int (*poll)(tsr_comm_t *c, int peer, int timeout_ms, char *err, size_t errlen);
    /* Waits until every operation issued on c has finished (optional: NULL,
     * or returning 0 at once, for backends whose operations finish before
     * they return).  Fails as an operation does: a dead or stalled peer by
     * timeout_ms, an error, a newer epoch; c is then aborted. */
    int (*settle)(tsr_comm_t *c, int timeout_ms, char *err, size_t errlen);
    /* Marks it failed: every later operation fails at once with why. */
    void (*abort)(tsr_comm_t *c, const char *why);
    int (*rank)(const tsr_comm_t *c);
    int (*size)(const tsr_comm_t *c);
    void (*destroy)(tsr_comm_t **c_p);
    /* True when c's first failure was an operation that passed its deadline
     * waiting for the other ranks (not a closed connection, an error, a
     * newer epoch or an abort): the coordinator names the ranks that did not
     * report such a failure as the ones the group waited for.  Optional. */
    bool (*past_deadline)(const tsr_comm_t *c);
} tsr_coll_ops_t;

/* ops->past_deadline(c) where the backend has one; false otherwise. */
static inline bool tsr_coll_past_deadline(const tsr_coll_ops_t *ops, const tsr_comm_t *c)
{
    return ops && c && ops->past_deadline && ops->past_deadline(c);
}

/* ops->settle where the backend has one; 0 otherwise. */
static inline int tsr_coll_settle(const tsr_coll_ops_t *ops, tsr_comm_t *c, int timeout_ms,
                                  char *err, size_t errlen)
{
    return ops->settle ? ops->settle(c, timeout_ms, err, errlen) : 0;
}

/* One send or one receive through ops->group. */
int tsr_coll_send(const tsr_coll_ops_t *ops, tsr_comm_t *c, int peer, tsr_buf_t buf,
                  int timeout_ms, char *err, size_t errlen);
int tsr_coll_recv(const tsr_coll_ops_t *ops, tsr_comm_t *c, int peer, tsr_buf_t buf,
                  int timeout_ms, char *err, size_t errlen);

/* ---- TCP backend ------------------------------------------------------------ */

extern const tsr_coll_ops_t tsr_coll_tcp;

/* A listening socket a worker opens once; its endpoint ("127.0.0.1:40123")
 * is what the coordinator relays to peers.  bind_host "0.0.0.0" or an
 * address; port 0 picks a free one.  The TCP backend's ctx->listener. */
tsr_tcp_listener_t *tsr_tcp_listen(const char *bind_host, int port, char *err, size_t errlen);
/* "host:port" to give to peers (advertise_host replaces a wildcard bind). */
const char *tsr_tcp_listener_endpoint(const tsr_tcp_listener_t *l);
/* Advertises host (the worker's real address) instead of the bind address
 * from now on; for a wildcard bind the default is 127.0.0.1.  0, or -1 when
 * host is empty or too long. */
int tsr_tcp_listener_advertise(tsr_tcp_listener_t *l, const char *host);
int tsr_tcp_listener_fd(const tsr_tcp_listener_t *l);
void tsr_tcp_listener_destroy(tsr_tcp_listener_t **l_p);

/* Forms a group of n ranks for `epoch`: rank i is reachable at endpoints[i].
 * Lower ranks accept connections from higher ones.  The acceptor opens with
 * a nonce, the connector answers (magic, epoch, group id, rank, n, the rank
 * it connects to, its nonce, an HMAC under `secret` over all of it) and the
 * acceptor's ack proves the secret back; every frame is then AES-256-GCM
 * sealed under keys derived from both.  Handshakes from another epoch, or
 * without the proof, are refused and never kept; a connection that sends
 * no handshake is dropped after 2 s, or sooner when others need the room.
 * secret: the replica's 16 to 64 bytes for this epoch (required when
 * n > 1).  Blocks until every peer is connected or timeout_ms passes,
 * giving up early when cancelled(arg) becomes true (checked every turn of
 * the wait; tsr_tcp_listener_wake makes a waiting call look at once).
 * Caller owns the result (ops->destroy). */
tsr_comm_t *tsr_tcp_comm_new_cancellable(tsr_tcp_listener_t *l, uint64_t epoch, uint64_t group,
                                         int rank, int n, const char *const *endpoints,
                                         const void *secret, size_t secret_len, int timeout_ms,
                                         int (*cancelled)(void *arg), void *cancel_arg,
                                         char *err, size_t errlen);
#ifdef TSR_TESTING
/* The same with a fixed, publicly known secret and no cancellation: in test
 * builds only (anyone who reads this code could join such a group). */
tsr_comm_t *tsr_tcp_comm_new(tsr_tcp_listener_t *l, uint64_t epoch, uint64_t group,
                             int rank, int n, const char *const *endpoints, int timeout_ms,
                             char *err, size_t errlen);
#endif
/* Wakes every communicator being formed on l so it re-checks cancellation. */
void tsr_tcp_listener_wake(tsr_tcp_listener_t *l);

#endif
