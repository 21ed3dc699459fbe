/* coll_nccl.h: the NCCL collectives backend, over a table of NCCL's functions.
 *
 * The backend (worker/coll_nccl.c) is plain C and knows NCCL only through
 * tsr_nccl_api_t, so that:
 *   - the real table (worker/cuda/nccl_real.c, built with CUDA) binds it to
 *     libnccl and the CUDA runtime;
 *   - a fake table over host memory (tests/unit/fake_nccl.h) drives the
 *     formation, the epoch fencing, cancellation, the deadlines and the
 *     abort paths on machines without a GPU.
 *
 * Formation: the rendezvous blob is what tsr_nccl_blob_make wrote on the
 * group's rank 0 (NCCL's unique id, tagged with the epoch, the group id and
 * the group size).  A blob for another epoch, group or size is refused.  The
 * communicator is created non-blocking (ncclConfig_t.blocking = 0) and
 * polled against the rendezvous deadline and its cancellation callback, so
 * a newer epoch ends a formation within one poll interval (1 ms).
 *
 * Operations are enqueued on the backend's stream and waited for by polling
 * the stream and NCCL's asynchronous error against the operation's deadline
 * and the rendezvous's cancellation (a newer epoch).  A deadline passed, an
 * asynchronous error, a newer epoch or ops->abort aborts the communicator
 * (ncclCommAbort): it never hangs, and every later operation fails at once
 * with the first reason.  An operation returns once NCCL has issued it;
 * the wait for what the stream ran is settle's, once per step. */
#ifndef TSR_COLL_NCCL_H
#define TSR_COLL_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include "worker/collective.h"

#define TSR_NCCL_ID_BYTES 128   /* sizeof(ncclUniqueId) */

/* Status of an NCCL call or of a communicator. */
enum { TSR_NCCL_OK = 0, TSR_NCCL_IN_PROGRESS = 1, TSR_NCCL_ERROR = -1 };

struct tsr_nccl_api {
    const char *name;           /* "nccl", "fake" */
    /* A new unique id (the bootstrap root lives in this process). */
    int (*get_unique_id)(uint8_t id[TSR_NCCL_ID_BYTES]);
    /* ncclCommInitRankConfig with blocking = 0 on device: OK or IN_PROGRESS
     * with *comm set, or ERROR. */
    int (*comm_init)(void **comm, int n, const uint8_t id[TSR_NCCL_ID_BYTES], int rank,
                     int device);
    /* ncclCommGetAsyncError: OK, IN_PROGRESS (still forming, or an
     * operation still being issued) or ERROR. */
    int (*comm_status)(void *comm);
    /* ncclCommAbort: frees the communicator, ending whatever it runs.  The
     * only way a communicator is let go: a finalize could wait on a dead
     * peer. */
    void (*comm_abort)(void *comm);
    /* Enqueue on stream (NULL: the backend's default): OK or ERROR. */
    int (*allreduce_sum)(void *comm, void *buf, size_t count, tsr_dtype_t dt, void *stream);
    int (*allgather)(void *comm, const void *send, void *recv, size_t count, tsr_dtype_t dt,
                     void *stream);
    int (*broadcast)(void *comm, void *buf, size_t count, tsr_dtype_t dt, int root,
                     void *stream);
    int (*send)(void *comm, const void *buf, size_t count, tsr_dtype_t dt, int peer,
                void *stream);
    int (*recv)(void *comm, void *buf, size_t count, tsr_dtype_t dt, int peer, void *stream);
    int (*group_start)(void);
    int (*group_end)(void);
    /* Whether the work enqueued on stream has finished: OK, IN_PROGRESS, or
     * ERROR (a CUDA error). */
    int (*stream_query)(void *stream);
    /* The last error's text for comm (NULL: the last call's). */
    const char *(*last_error)(void *comm);
};

/* The collectives table; its create uses ctx's nccl, device, stream and
 * poll_us.  rv->blob must be tsr_nccl_blob_make's. */
extern const tsr_coll_ops_t tsr_coll_nccl;

/* NCCL where a group can have it, the host-staged collectives where it
 * cannot: ctx has no NCCL (nccl_why), a member's GPU is unknown, two members
 * share a GPU (NCCL refuses a communicator over one device twice), or there
 * is no relay for the blob (rv->exchange).  With NCCL, rank 0 makes the
 * blob and publishes it through rv->exchange; every rank, rank 0 too,
 * forms from the copy the coordinator relays back (rank 0 refuses one
 * that is not what it made).  The
 * fallback is ctx->fallback (NULL: the TCP backend).  Each choice is
 * logged with its reason. */
extern const tsr_coll_ops_t tsr_coll_gpu;
/* The name of the backend c was formed with ("nccl", "staged", "tcp"). */
const char *tsr_coll_gpu_kind(const tsr_comm_t *c);

/* Bytes of a rendezvous blob. */
#define TSR_NCCL_BLOB_BYTES (8 + 8 + 8 + 4 + TSR_NCCL_ID_BYTES)

/* Rank 0 of a group: a new unique id through api, written with the
 * group's epoch, id and size into blob (TSR_NCCL_BLOB_BYTES).  0, or -1
 * with the reason. */
int tsr_nccl_blob_make(const tsr_nccl_api_t *api, uint64_t epoch, uint64_t group, int n,
                       uint8_t blob[TSR_NCCL_BLOB_BYTES], char *err, size_t errlen);

/* The real table (worker/cuda/nccl_real.c), in builds with CUDA.  Usable
 * once tsr_nccl_real_load has opened libnccl.so.2 (0; -1 with the reason,
 * the same on every later call). */
extern const tsr_nccl_api_t tsr_nccl_real;
int tsr_nccl_real_load(char *err, size_t errlen);

#endif
