/* fake_nccl_tcp.h: NCCL's function table (worker/coll_nccl.h) across
 * processes, over loopback TCP, for integration tests of workers on a
 * machine without a GPU (tests/integration/fake_nccl_worker.c).
 *
 * The unique id names a listening socket that rank 0's process opened
 * (127.0.0.1 and its port); the other ranks connect to it.  Every
 * operation goes through rank 0 (a star): an all-reduce adds the ranks'
 * buffers in rank order 0..n-1, as Tessera's TCP collectives do, so the
 * sums have the same bits.  Each communicator has a thread that carries
 * out its operations in order; enqueueing returns at once, as NCCL's do.
 * A peer that dies leaves the operation waiting for ever, as NCCL's may:
 * only the caller's deadline, a newer epoch or an abort ends the wait.
 * F32 and I32 sums only; send/recv only in groups of two, and the legs of
 * one group run one after another (NCCL runs them together: two ranks that
 * both send first would wait on each other once the data outgrows the
 * sockets' buffers; Tessera's pipeline links send one way per group). */
#ifndef TSR_FAKE_NCCL_TCP_H
#define TSR_FAKE_NCCL_TCP_H

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "worker/coll_nccl.h"

#define FT_MAX_RANKS 8
#define FT_QUEUE 64
#define FT_LEGS 4
/* The id: "FTCP", rank 0's port, and a nonce every rank proves it has. */
#define FT_NONCE_AT 8
#define FT_NONCE_BYTES 16

enum { FT_AR, FT_AG, FT_BC, FT_SEND, FT_RECV };

typedef struct {
    int kind;
    void *a, *b;                /* AR, BC, SEND, RECV: the buffer; AG: send, recv */
    size_t count;
    tsr_dtype_t dt;
    int peer;                   /* SEND/RECV: the peer; BC: the root */
} ft_leg_t;

typedef struct {
    int n_legs;
    ft_leg_t legs[FT_LEGS];
} ft_op_t;

typedef struct ft_comm {
    int n, rank, port, listen_fd;
    uint8_t nonce[FT_NONCE_BYTES];
    int fd[FT_MAX_RANKS];       /* rank 0: one per other rank; others: fd[0], rank 0 */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state;                  /* TSR_NCCL_IN_PROGRESS, _OK or _ERROR */
    bool stop;
    uint64_t issued, done;
    ft_op_t ops[FT_QUEUE];
    struct ft_comm *next_live;
} ft_comm_t;

static pthread_mutex_t ft_mu = PTHREAD_MUTEX_INITIALIZER;
static ft_comm_t *ft_live;      /* every communicator of this process (ft_mu) */
static struct {
    int port, fd;
} ft_listeners[16];             /* ids made here, until rank 0 takes its socket */


static _Thread_local struct {
    int depth, n;
    ft_comm_t *comm;
    ft_leg_t legs[FT_LEGS];
} ft_gs;

static int ft_get_unique_id(uint8_t id[TSR_NCCL_ID_BYTES])
{
    /* A worker forms its groups one after another: an id made before and
     * never taken by rank 0's comm_init (its formation was cancelled or
     * refused) is dropped. */
    pthread_mutex_lock(&ft_mu);
    for (int k = 0; k < 16; k++)
        if (ft_listeners[k].port) close(ft_listeners[k].fd), ft_listeners[k].port = 0;
    pthread_mutex_unlock(&ft_mu);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, FT_MAX_RANKS) < 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) < 0) {
        if (fd >= 0) close(fd);
        return TSR_NCCL_ERROR;
    }
    int port = ntohs(a.sin_port), k = 0;
    pthread_mutex_lock(&ft_mu);
    while (k < 16 && ft_listeners[k].port) k++;
    if (k < 16) ft_listeners[k].port = port, ft_listeners[k].fd = fd;
    pthread_mutex_unlock(&ft_mu);
    if (k == 16) {
        close(fd);
        return TSR_NCCL_ERROR;
    }
    memset(id, 0, TSR_NCCL_ID_BYTES);
    memcpy(id, "FTCP", 4);
    id[4] = (uint8_t)(port >> 8), id[5] = (uint8_t)port;
    int u = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    bool got = u >= 0 && read(u, id + FT_NONCE_AT, FT_NONCE_BYTES) == FT_NONCE_BYTES;
    if (u >= 0) close(u);
    return got ? TSR_NCCL_OK : TSR_NCCL_ERROR;
}

/* All of len bytes, or false (a closed or broken connection, or a stop). */
static bool ft_io(ft_comm_t *c, int fd, void *p, size_t len, bool out)
{
    uint8_t *b = p;
    while (len) {
        if (__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) return false;
        ssize_t k = out ? send(fd, b, len, MSG_NOSIGNAL) : recv(fd, b, len, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return false;
        b += k, len -= (size_t)k;
    }
    return true;
}

static void ft_add(void *acc, const void *x, size_t count, tsr_dtype_t dt)
{
    if (dt == TSR_DT_F32)
        for (size_t i = 0; i < count; i++) ((float *)acc)[i] += ((const float *)x)[i];
    else
        for (size_t i = 0; i < count; i++) ((int32_t *)acc)[i] += ((const int32_t *)x)[i];
}

static bool ft_leg(ft_comm_t *c, const ft_leg_t *l)
{
    size_t bytes = l->count * tsr_dtype_size(l->dt);
    int n = c->n;
    switch (l->kind) {
    case FT_AR:
        if (c->rank) return ft_io(c, c->fd[0], l->a, bytes, true) && ft_io(c, c->fd[0], l->a, bytes, false);
        {
            uint8_t *tmp = malloc(bytes ? bytes : 1);
            bool ok = tmp != NULL;
            for (int r = 1; ok && r < n; r++)
                ok = ft_io(c, c->fd[r], tmp, bytes, false), ok = ok && (ft_add(l->a, tmp, l->count, l->dt), true);
            for (int r = 1; ok && r < n; r++) ok = ft_io(c, c->fd[r], l->a, bytes, true);
            free(tmp);
            return ok;
        }
    case FT_AG:
        if (c->rank)
            return ft_io(c, c->fd[0], l->a, bytes, true) &&
                   ft_io(c, c->fd[0], l->b, bytes * (size_t)n, false);
        memmove(l->b, l->a, bytes);
        for (int r = 1; r < n; r++)
            if (!ft_io(c, c->fd[r], (uint8_t *)l->b + bytes * (size_t)r, bytes, false)) return false;
        for (int r = 1; r < n; r++)
            if (!ft_io(c, c->fd[r], l->b, bytes * (size_t)n, true)) return false;
        return true;
    case FT_BC:
        if (c->rank == l->peer && c->rank) return ft_io(c, c->fd[0], l->a, bytes, true);
        if (c->rank) return ft_io(c, c->fd[0], l->a, bytes, false);
        if (l->peer && !ft_io(c, c->fd[l->peer], l->a, bytes, false)) return false;
        for (int r = 1; r < n; r++)
            if (r != l->peer && !ft_io(c, c->fd[r], l->a, bytes, true)) return false;
        return true;
    default:                    /* a pair: each rank's one connection */
        return ft_io(c, c->fd[c->rank ? 0 : 1], l->a, bytes, l->kind == FT_SEND);
    }
}

static void *ft_main(void *arg)
{
    ft_comm_t *c = arg;
    bool ok = true;
    if (c->rank == 0) {
        for (int got = 1; ok && got < c->n;) {
            struct pollfd p = {c->listen_fd, POLLIN, 0};
            if (__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) ok = false;
            else if (poll(&p, 1, 20) == 1) {
                int fd = accept4(c->listen_fd, NULL, NULL, SOCK_CLOEXEC);
                struct {
                    int32_t rank;
                    uint8_t nonce[FT_NONCE_BYTES];
                } h = {-1, {0}};
                /* a peer that connects and says nothing is not waited for */
                struct timeval tv = {1, 0}, none = {0, 0};
                if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
                bool mine = fd >= 0 && ft_io(c, fd, &h, sizeof h, false) && h.rank > 0 &&
                            h.rank < c->n && !memcmp(h.nonce, c->nonce, FT_NONCE_BYTES);
                int32_t r = h.rank;
                if (mine) setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof none);
                pthread_mutex_lock(&c->mu);
                if (mine && c->fd[r] < 0) c->fd[r] = fd, got++;
                else if (fd >= 0) close(fd);
                pthread_mutex_unlock(&c->mu);
            }
        }
    } else {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)c->port),
                                .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        struct {
            int32_t rank;
            uint8_t nonce[FT_NONCE_BYTES];
        } h = {c->rank, {0}};
        memcpy(h.nonce, c->nonce, FT_NONCE_BYTES);
        for (;;) {
            if (__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) {
                ok = false;
                break;
            }
            int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
            if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
                pthread_mutex_lock(&c->mu);
                c->fd[0] = fd;
                pthread_mutex_unlock(&c->mu);
                ok = ft_io(c, fd, &h, sizeof h, true);
                break;
            }
            if (fd >= 0) close(fd);
            usleep(20000);
        }
    }
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < FT_MAX_RANKS; i++)
        if (c->fd[i] >= 0) setsockopt(c->fd[i], IPPROTO_TCP, TCP_NODELAY, &(int){1}, sizeof(int));
    c->state = ok ? TSR_NCCL_OK : TSR_NCCL_ERROR;
    while (ok) {
        while (!c->stop && c->done == c->issued) pthread_cond_wait(&c->cv, &c->mu);
        if (c->stop) break;
        ft_op_t op = c->ops[c->done % FT_QUEUE];
        pthread_mutex_unlock(&c->mu);
        for (int i = 0; ok && i < op.n_legs; i++) ok = ft_leg(c, &op.legs[i]);
        pthread_mutex_lock(&c->mu);
        if (ok) c->done++;
    }
    /* A peer gone: this operation never ends (NCCL's may not either). */
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static int ft_comm_init(void **comm, int n, const uint8_t id[TSR_NCCL_ID_BYTES], int rank,
                        int device)
{
    (void)device;
    if (memcmp(id, "FTCP", 4) || n < 1 || n > FT_MAX_RANKS || rank < 0 || rank >= n)
        return TSR_NCCL_ERROR;
    ft_comm_t *c = calloc(1, sizeof *c);
    if (!c) return TSR_NCCL_ERROR;
    c->n = n, c->rank = rank, c->port = id[4] << 8 | id[5], c->listen_fd = -1;
    memcpy(c->nonce, id + FT_NONCE_AT, FT_NONCE_BYTES);
    c->state = TSR_NCCL_IN_PROGRESS;
    for (int i = 0; i < FT_MAX_RANKS; i++) c->fd[i] = -1;
    pthread_mutex_lock(&ft_mu);
    for (int k = 0; rank == 0 && k < 16; k++)
        if (ft_listeners[k].port == c->port) {
            c->listen_fd = ft_listeners[k].fd;
            ft_listeners[k].port = 0;
        }
    pthread_mutex_unlock(&ft_mu);
    if (rank == 0 && c->listen_fd < 0) {    /* rank 0 must be the id's maker */
        free(c);
        return TSR_NCCL_ERROR;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    if (pthread_create(&c->thread, NULL, ft_main, c) != 0) {
        if (c->listen_fd >= 0) close(c->listen_fd);
        free(c);
        return TSR_NCCL_ERROR;
    }
    pthread_mutex_lock(&ft_mu);
    c->next_live = ft_live;
    ft_live = c;
    pthread_mutex_unlock(&ft_mu);
    *comm = c;
    return TSR_NCCL_IN_PROGRESS;
}

/* Set by the worker to make a communicator report an asynchronous error. */
static void ft_inject_error(void *comm)
{
    ft_comm_t *c = comm;
    pthread_mutex_lock(&c->mu);
    c->state = TSR_NCCL_ERROR;
    pthread_mutex_unlock(&c->mu);
}

static int ft_comm_status(void *comm)
{
    ft_comm_t *c = comm;
    pthread_mutex_lock(&c->mu);
    int s = c->state;
    pthread_mutex_unlock(&c->mu);
    return s;
}

static void ft_release(void *comm)
{
    ft_comm_t *c = comm;
    pthread_mutex_lock(&ft_mu);
    for (ft_comm_t **p = &ft_live; *p; p = &(*p)->next_live)
        if (*p == c) {
            *p = c->next_live;
            break;
        }
    pthread_mutex_unlock(&ft_mu);
    pthread_mutex_lock(&c->mu);
    __atomic_store_n(&c->stop, true, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&c->cv);
    for (int i = 0; i < FT_MAX_RANKS; i++)   /* ends a send or receive under way */
        if (c->fd[i] >= 0) shutdown(c->fd[i], SHUT_RDWR);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->thread, NULL);
    for (int i = 0; i < FT_MAX_RANKS; i++)
        if (c->fd[i] >= 0) close(c->fd[i]);
    if (c->listen_fd >= 0) close(c->listen_fd);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
}

static int ft_submit(ft_comm_t *c, const ft_leg_t *legs, int n)
{
    pthread_mutex_lock(&c->mu);
    int rc = TSR_NCCL_ERROR;
    if (c->state == TSR_NCCL_OK && c->issued - c->done < FT_QUEUE && n <= FT_LEGS) {
        ft_op_t *op = &c->ops[c->issued % FT_QUEUE];
        op->n_legs = n;
        memcpy(op->legs, legs, (size_t)n * sizeof *legs);
        c->issued++;
        pthread_cond_broadcast(&c->cv);
        rc = TSR_NCCL_OK;
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static int ft_one(void *comm, ft_leg_t leg)
{
    if (ft_gs.depth) {
        if (ft_gs.n == FT_LEGS) return TSR_NCCL_ERROR;
        ft_gs.comm = comm;
        ft_gs.legs[ft_gs.n++] = leg;
        return TSR_NCCL_OK;
    }
    return ft_submit(comm, &leg, 1);
}

static int ft_allreduce(void *comm, void *buf, size_t count, tsr_dtype_t dt, void *stream)
{
    (void)stream;
    if (dt != TSR_DT_F32 && dt != TSR_DT_I32) return TSR_NCCL_ERROR;
    return ft_one(comm, (ft_leg_t){FT_AR, buf, NULL, count, dt, 0});
}
static int ft_allgather(void *comm, const void *send, void *recv, size_t count, tsr_dtype_t dt,
                        void *stream)
{
    (void)stream;
    return ft_one(comm, (ft_leg_t){FT_AG, (void *)send, recv, count, dt, 0});
}
static int ft_broadcast(void *comm, void *buf, size_t count, tsr_dtype_t dt, int root, void *stream)
{
    (void)stream;
    return ft_one(comm, (ft_leg_t){FT_BC, buf, NULL, count, dt, root});
}
static int ft_send(void *comm, const void *buf, size_t count, tsr_dtype_t dt, int peer, void *stream)
{
    (void)stream;
    if (((ft_comm_t *)comm)->n != 2) return TSR_NCCL_ERROR;
    return ft_one(comm, (ft_leg_t){FT_SEND, (void *)buf, NULL, count, dt, peer});
}
static int ft_recv(void *comm, void *buf, size_t count, tsr_dtype_t dt, int peer, void *stream)
{
    (void)stream;
    if (((ft_comm_t *)comm)->n != 2) return TSR_NCCL_ERROR;
    return ft_one(comm, (ft_leg_t){FT_RECV, buf, NULL, count, dt, peer});
}
static int ft_group_start(void)
{
    if (!ft_gs.depth++) ft_gs.n = 0;
    return TSR_NCCL_OK;
}
static int ft_group_end(void)
{
    if (ft_gs.depth <= 0) return TSR_NCCL_ERROR;
    if (--ft_gs.depth || !ft_gs.n) return TSR_NCCL_OK;
    return ft_submit(ft_gs.comm, ft_gs.legs, ft_gs.n);
}

/* The stream is the process's (the CPU engine has none): done when every
 * live communicator has carried out all it was given. */
static int ft_stream_query(void *stream)
{
    (void)stream;
    int r = TSR_NCCL_OK;
    pthread_mutex_lock(&ft_mu);
    for (ft_comm_t *c = ft_live; c; c = c->next_live) {
        pthread_mutex_lock(&c->mu);
        if (c->done != c->issued) r = TSR_NCCL_IN_PROGRESS;
        pthread_mutex_unlock(&c->mu);
    }
    pthread_mutex_unlock(&ft_mu);
    return r;
}

static const char *ft_last_error(void *comm)
{
    return comm ? "fake tcp: the communicator was told to fail" : "fake tcp: no error";
}

static const tsr_nccl_api_t fake_nccl_tcp = {
    .name = "fake-tcp",
    .get_unique_id = ft_get_unique_id,
    .comm_init = ft_comm_init,
    .comm_status = ft_comm_status,
    .comm_abort = ft_release,
    .allreduce_sum = ft_allreduce,
    .allgather = ft_allgather,
    .broadcast = ft_broadcast,
    .send = ft_send,
    .recv = ft_recv,
    .group_start = ft_group_start,
    .group_end = ft_group_end,
    .stream_query = ft_stream_query,
    .last_error = ft_last_error,
};

#endif
