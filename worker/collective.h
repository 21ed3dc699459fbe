/* collective.h: how the ranks of a replica talk to each other.
 *
 * A table of functions, so the engine and the agent cannot tell which
 * backend they have: TCP for CPU workers (collective_tcp.c), NCCL for CUDA
 * workers (later).  A communicator is formed per plan epoch from the
 * endpoints the coordinator relays; every operation has a deadline, and a
 * dead or silent peer makes it fail with a message within that time, never
 * hang.  After a failure the communicator is unusable: the caller destroys
 * it and waits for the next epoch's. */
#ifndef TSR_COLLECTIVE_H
#define TSR_COLLECTIVE_H

#include <stddef.h>
#include <stdint.h>

typedef struct tsr_comm tsr_comm_t;

typedef struct {
    const char *name;   /* "tcp", "nccl" */
    /* In-place sum over all ranks of the group; every rank gets the result. */
    int (*allreduce_sum)(tsr_comm_t *c, float *buf, size_t n, int timeout_ms, char *err,
                         size_t errlen);
    /* Copies len bytes from rank root to every rank. */
    int (*broadcast)(tsr_comm_t *c, void *buf, size_t len, int root, int timeout_ms, char *err,
                     size_t errlen);
    /* Point-to-point; the message boundaries are kept (recv's len must equal
     * the sent len, else an error). */
    int (*send)(tsr_comm_t *c, int peer, const void *buf, size_t len, int timeout_ms, char *err,
                size_t errlen);
    int (*recv)(tsr_comm_t *c, int peer, void *buf, size_t len, int timeout_ms, char *err,
                size_t errlen);
    int (*barrier)(tsr_comm_t *c, int timeout_ms, char *err, size_t errlen);
    int (*rank)(const tsr_comm_t *c);
    int (*size)(const tsr_comm_t *c);
    void (*destroy)(tsr_comm_t **c_p);
} tsr_coll_ops_t;

/* ---- TCP backend ------------------------------------------------------------ */

extern const tsr_coll_ops_t tsr_coll_tcp;

/* A listening socket a worker opens once; its endpoint ("127.0.0.1:40123")
 * is what the coordinator relays to peers.  bind_host "0.0.0.0" or an
 * address; port 0 picks a free one. */
typedef struct tsr_tcp_listener tsr_tcp_listener_t;
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
 * Lower ranks accept connections from higher ones, each connection opens
 * with (magic, epoch, group id, rank) and anything from another epoch or
 * group is refused.  Blocks until every peer is connected or timeout_ms
 * passes.  Caller owns the result (ops->destroy). */
tsr_comm_t *tsr_tcp_comm_new(tsr_tcp_listener_t *l, uint64_t epoch, uint64_t group,
                             int rank, int n, const char *const *endpoints, int timeout_ms,
                             char *err, size_t errlen);

/* The same, giving up early when cancelled(arg) becomes true (checked every
 * turn of the wait; tsr_tcp_listener_wake makes a waiting call look at once):
 * a worker whose replica is rewired again while it still waits for peers
 * moves on to the new epoch instead of waiting out the timeout. */
tsr_comm_t *tsr_tcp_comm_new_cancellable(tsr_tcp_listener_t *l, uint64_t epoch, uint64_t group,
                                         int rank, int n, const char *const *endpoints,
                                         int timeout_ms, int (*cancelled)(void *arg),
                                         void *cancel_arg, char *err, size_t errlen);
/* Wakes every communicator being formed on l so it re-checks cancellation. */
void tsr_tcp_listener_wake(tsr_tcp_listener_t *l);

#endif
