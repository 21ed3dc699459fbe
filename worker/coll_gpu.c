/* coll_gpu.c: the collectives of a GPU piece's groups: NCCL where the group
 * can have it, the host-staged collectives where it cannot (coll_nccl.h).
 * Plain C; what NCCL is comes from ctx, so tests drive it with a fake. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "worker/coll_nccl.h"

struct tsr_comm {
    const tsr_coll_ops_t *ops;
    tsr_comm_t *inner;
    uint64_t group, epoch;      /* for the log line of an abort */
    bool aborted;
};

/* Why this group cannot use NCCL (written into why), or NULL when it can. */
static const char *no_nccl(const tsr_coll_ctx_t *x, const tsr_rendezvous_t *rv, char *why,
                           size_t len)
{
    if (!x->nccl) {
        snprintf(why, len, "%s", x->nccl_why && *x->nccl_why ? x->nccl_why : "no NCCL");
        return why;
    }
    if (!rv->exchange) return "no relay for NCCL's rendezvous";
    if (!rv->devices) return "the members' GPUs are not known";
    for (int i = 0; i < rv->n; i++) {
        if (!rv->devices[i] || !rv->devices[i][0]) {
            snprintf(why, len,
                     "rank %d cannot use NCCL (its worker has no NCCL, or reported no PCI bus id)",
                     i);
            return why;
        }
        for (int j = 0; j < i; j++)
            if (!strcmp(rv->devices[i], rv->devices[j])) {
                snprintf(why, len,
                         "ranks %d and %d share the GPU %s (NCCL refuses a communicator over "
                         "one device twice)",
                         j, i, rv->devices[i]);
                return why;
            }
    }
    return NULL;
}

static int gpu_create(void *ctx, const tsr_rendezvous_t *rv, tsr_comm_t **out, char *err,
                      size_t errlen)
{
    const tsr_coll_ctx_t *x = ctx;
    if (!x) {
        tsr_set_err(err, errlen, "the GPU collectives were given no context");
        return -1;
    }
    tsr_comm_t *c = calloc(1, sizeof *c);
    if (!c) {
        tsr_set_err(err, errlen, "out of memory");
        return -1;
    }
    c->group = rv->group;
    c->epoch = rv->epoch;
    char why[256];
    const char *no = no_nccl(x, rv, why, sizeof why);
    if (no) {
        c->ops = x->fallback ? x->fallback : &tsr_coll_tcp;
        tsr_info("group %llx (rank %d of %d, epoch %llu): %s collectives: %s",
                 (unsigned long long)rv->group, rv->rank, rv->n, (unsigned long long)rv->epoch,
                 c->ops->name, no);
        if (c->ops->create(ctx, rv, &c->inner, err, errlen) < 0) {
            free(c);
            return -1;
        }
        *out = c;
        return 0;
    }
    /* Rank 0 makes the blob and publishes it; every rank, rank 0 too, forms
     * from the copy the coordinator relayed for this epoch, so a group
     * forms only with what the coordinator let through (a group of one
     * as well). */
    uint8_t made[TSR_NCCL_BLOB_BYTES], blob[TSR_NCCL_BLOB_BYTES];
    size_t len = 0;
    int rc = 0;
    int64_t t0 = tsr_now_ms();
    if (rv->rank == 0) {
        rc = tsr_nccl_blob_make(x->nccl, rv->epoch, rv->group, rv->n, made, err, errlen);
        if (rc == 0)
            rc = rv->exchange(rv->exchange_arg, rv->group, made, sizeof made, NULL, 0, NULL,
                              rv->timeout_ms, err, errlen);
    }
    if (rc == 0)
        rc = rv->exchange(rv->exchange_arg, rv->group, NULL, 0, blob, sizeof blob, &len,
                          rv->timeout_ms, err, errlen);
    if (rc == 0 && rv->rank == 0 && (len != sizeof made || memcmp(blob, made, len))) {
        tsr_set_err(err, errlen,
                    "group %llx (epoch %llu): the coordinator relayed a rendezvous blob that is "
                    "not the one this rank made: refused",
                    (unsigned long long)rv->group, (unsigned long long)rv->epoch);
        rc = -1;
    }
    /* the formation gets what is left of the rendezvous deadline */
    tsr_rendezvous_t r2 = *rv;
    r2.blob = blob;
    r2.blob_len = len;
    int64_t left = rv->timeout_ms - (tsr_now_ms() - t0);
    r2.timeout_ms = left > 1 ? (int)left : 1;
    c->ops = &tsr_coll_nccl;
    if (rc < 0 || tsr_coll_nccl.create(ctx, &r2, &c->inner, err, errlen) < 0) {
        free(c);
        return -1;
    }
    tsr_info("group %llx (rank %d of %d, epoch %llu): NCCL", (unsigned long long)rv->group,
             rv->rank, rv->n, (unsigned long long)rv->epoch);
    *out = c;
    return 0;
}

static int gpu_allreduce(tsr_comm_t *c, tsr_buf_t b, int t, char *err, size_t len)
{
    return c->ops->allreduce_sum(c->inner, b, t, err, len);
}
static int gpu_allgather(tsr_comm_t *c, tsr_buf_t s, tsr_buf_t r, int t, char *err, size_t len)
{
    return c->ops->allgather(c->inner, s, r, t, err, len);
}
static int gpu_broadcast(tsr_comm_t *c, tsr_buf_t b, int root, int t, char *err, size_t len)
{
    return c->ops->broadcast(c->inner, b, root, t, err, len);
}
static int gpu_group(tsr_comm_t *c, const tsr_p2p_t *ops, int n, int t, char *err, size_t len)
{
    return c->ops->group(c->inner, ops, n, t, err, len);
}
static int gpu_settle(tsr_comm_t *c, int t, char *err, size_t len)
{
    return tsr_coll_settle(c->ops, c->inner, t, err, len);
}
static int gpu_poll(tsr_comm_t *c, int peer, int t, char *err, size_t len)
{
    return c->ops->poll(c->inner, peer, t, err, len);
}
/* Every abort is logged once, so an operator sees each epoch's group let
 * go and why (a failure, a newer epoch, a stop). */
static void gpu_abort(tsr_comm_t *c, const char *why)
{
    if (!c->aborted)
        tsr_info("group %llx (rank %d of %d, epoch %llu): %s collectives aborted: %s",
                 (unsigned long long)c->group, c->ops->rank(c->inner), c->ops->size(c->inner),
                 (unsigned long long)c->epoch, c->ops->name, why && *why ? why : "aborted");
    c->aborted = true;
    c->ops->abort(c->inner, why);
}
static int gpu_rank(const tsr_comm_t *c) { return c->ops->rank(c->inner); }
static bool gpu_past_deadline(const tsr_comm_t *c)
{
    return tsr_coll_past_deadline(c->ops, c->inner);
}
static int gpu_size(const tsr_comm_t *c) { return c->ops->size(c->inner); }

static void gpu_destroy(tsr_comm_t **c_p)
{
    if (!c_p || !*c_p) return;
    (*c_p)->ops->destroy(&(*c_p)->inner);
    free(*c_p);
    *c_p = NULL;
}

const char *tsr_coll_gpu_kind(const tsr_comm_t *c) { return c->ops->name; }

const tsr_coll_ops_t tsr_coll_gpu = {
    .name = "gpu",
    .mem = TSR_MEM_DEVICE,  /* the fallback given for GPU pieces is the staged one */
    .create = gpu_create,
    .allreduce_sum = gpu_allreduce,
    .allgather = gpu_allgather,
    .broadcast = gpu_broadcast,
    .group = gpu_group,
    .poll = gpu_poll,
    .settle = gpu_settle,
    .abort = gpu_abort,
    .rank = gpu_rank,
    .size = gpu_size,
    .destroy = gpu_destroy,
    .past_deadline = gpu_past_deadline,
};
