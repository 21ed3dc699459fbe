/* coll_staged.c: the TCP collectives for buffers in device memory.
 *
 * Each operation copies its device buffers to host memory, runs the TCP
 * backend's operation there, and copies the result back.  What ranks use
 * until NCCL forms their group, and always when ranks share one GPU (NCCL
 * refuses a communicator with the same device twice).  The communicator
 * is the TCP backend's own, wrapped with the staging buffers. */
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "worker/collective.h"
#include "worker/cuda/cuda.h"

/* The copies between device and host; tests put a plain memcpy here
 * (tsr_coll_staged_test_copy), since no GPU is needed to check the
 * staging itself. */
static tsr_cuda_copy_fn copy_fn = tsr_cuda_copy;

void tsr_coll_staged_test_copy(tsr_cuda_copy_fn fn) { copy_fn = fn ? fn : tsr_cuda_copy; }

struct tsr_comm {
    tsr_comm_t *tcp;
    void *host[2];
    size_t cap[2];
};

static int staged_create(void *ctx, const tsr_rendezvous_t *rv, tsr_comm_t **out, char *err,
                         size_t errlen)
{
    tsr_comm_t *c = calloc(1, sizeof *c);
    if (!c) {
        tsr_set_err(err, errlen, "out of memory");
        return -1;
    }
    if (tsr_coll_tcp.create(ctx, rv, &c->tcp, err, errlen) < 0) {
        free(c);
        return -1;
    }
    *out = c;
    return 0;
}

/* Host memory for staging buffer i of at least bytes. */
static void *stage(tsr_comm_t *c, int i, size_t bytes, char *err, size_t errlen)
{
    if (c->cap[i] < bytes) {
        void *p = realloc(c->host[i], bytes);
        if (!p) {
            tsr_set_err(err, errlen, "out of memory for a %zu-byte staging buffer", bytes);
            return NULL;
        }
        c->host[i] = p;
        c->cap[i] = bytes;
    }
    return c->host[i];
}

/* b's host view: b itself when it is in host memory, else staging buffer
 * i, filled from the device when fill. */
static int to_host(tsr_comm_t *c, int i, tsr_buf_t b, bool fill, tsr_buf_t *h, char *err,
                   size_t errlen)
{
    *h = b;
    if (b.mem == TSR_MEM_HOST) return 0;
    size_t bytes = b.count * tsr_dtype_size(b.dtype);
    if (!(h->ptr = stage(c, i, bytes, err, errlen))) return -1;
    h->mem = TSR_MEM_HOST;
    return fill && bytes ? copy_fn(h->ptr, b.ptr, bytes, 0, err, errlen) : 0;
}

static int back(tsr_buf_t b, tsr_buf_t h, char *err, size_t errlen)
{
    if (b.mem == TSR_MEM_HOST || !b.count) return 0;
    return copy_fn(b.ptr, h.ptr, b.count * tsr_dtype_size(b.dtype), 1, err, errlen);
}

static int staged_allreduce(tsr_comm_t *c, tsr_buf_t buf, int timeout_ms, char *err, size_t errlen)
{
    tsr_buf_t h;
    if (to_host(c, 0, buf, true, &h, err, errlen) < 0 ||
        tsr_coll_tcp.allreduce_sum(c->tcp, h, timeout_ms, err, errlen) < 0)
        return -1;
    return back(buf, h, err, errlen);
}

static int staged_allgather(tsr_comm_t *c, tsr_buf_t send, tsr_buf_t recv, int timeout_ms,
                            char *err, size_t errlen)
{
    tsr_buf_t hs, hr;
    if (to_host(c, 0, send, true, &hs, err, errlen) < 0 ||
        to_host(c, 1, recv, false, &hr, err, errlen) < 0 ||
        tsr_coll_tcp.allgather(c->tcp, hs, hr, timeout_ms, err, errlen) < 0)
        return -1;
    return back(recv, hr, err, errlen);
}

static int staged_broadcast(tsr_comm_t *c, tsr_buf_t buf, int root, int timeout_ms, char *err,
                            size_t errlen)
{
    tsr_buf_t h;
    if (to_host(c, 0, buf, true, &h, err, errlen) < 0 ||
        tsr_coll_tcp.broadcast(c->tcp, h, root, timeout_ms, err, errlen) < 0)
        return -1;
    return back(buf, h, err, errlen);
}

/* At most one send and one receive per peer: stage each leg separately. */
static int staged_group(tsr_comm_t *c, const tsr_p2p_t *ops, int n, int timeout_ms, char *err,
                        size_t errlen)
{
    tsr_p2p_t *legs = calloc(n > 0 ? (size_t)n : 1, sizeof *legs);
    void **own = calloc(n > 0 ? (size_t)n : 1, sizeof *own);
    int rc = -1;
    if (!legs || !own) {
        tsr_set_err(err, errlen, "out of memory");
        goto out;
    }
    for (int k = 0; k < n; k++) {
        legs[k] = ops[k];
        if (ops[k].buf.mem == TSR_MEM_HOST) continue;
        size_t bytes = ops[k].buf.count * tsr_dtype_size(ops[k].buf.dtype);
        if (!(own[k] = malloc(bytes ? bytes : 1))) {
            tsr_set_err(err, errlen, "out of memory for a %zu-byte staging buffer", bytes);
            goto out;
        }
        legs[k].buf.ptr = own[k];
        legs[k].buf.mem = TSR_MEM_HOST;
        if (ops[k].is_send && bytes &&
            copy_fn(own[k], ops[k].buf.ptr, bytes, 0, err, errlen) < 0)
            goto out;
    }
    if (tsr_coll_tcp.group(c->tcp, legs, n, timeout_ms, err, errlen) < 0) goto out;
    for (int i = 0; i < n; i++)
        if (own[i] && !ops[i].is_send && back(ops[i].buf, legs[i].buf, err, errlen) < 0) goto out;
    rc = 0;
out:
    for (int i = 0; own && i < n; i++) free(own[i]);
    free(own);
    free(legs);
    return rc;
}

static int staged_poll(tsr_comm_t *c, int peer, int timeout_ms, char *err, size_t errlen)
{
    return tsr_coll_tcp.poll(c->tcp, peer, timeout_ms, err, errlen);
}
static void staged_abort(tsr_comm_t *c, const char *why) { tsr_coll_tcp.abort(c->tcp, why); }
static int staged_rank(const tsr_comm_t *c) { return tsr_coll_tcp.rank(c->tcp); }
static bool staged_past_deadline(const tsr_comm_t *c)
{
    return tsr_coll_past_deadline(&tsr_coll_tcp, c->tcp);
}
static int staged_size(const tsr_comm_t *c) { return tsr_coll_tcp.size(c->tcp); }
static void staged_destroy(tsr_comm_t **c_p)
{
    if (!c_p || !*c_p) return;
    tsr_coll_tcp.destroy(&(*c_p)->tcp);
    free((*c_p)->host[0]);
    free((*c_p)->host[1]);
    free(*c_p);
    *c_p = NULL;
}

const tsr_coll_ops_t tsr_coll_staged = {
    .name = "tcp (staged from device memory)",
    .mem = TSR_MEM_DEVICE,
    .create = staged_create,
    .allreduce_sum = staged_allreduce,
    .allgather = staged_allgather,
    .broadcast = staged_broadcast,
    .group = staged_group,
    .poll = staged_poll,
    .abort = staged_abort,
    .rank = staged_rank,
    .size = staged_size,
    .destroy = staged_destroy,
    .past_deadline = staged_past_deadline,
};
