/* nccl_real.c: NCCL's function table (worker/coll_nccl.h) bound to libnccl
 * and the CUDA runtime.  Built only with CUDA; one-rank communicators have
 * run on one H200 (the device check), groups of several ranks on no GPU
 * yet (see the README's GPU section).
 *
 * libnccl.so.2 is opened when a worker first needs it (tsr_nccl_real_load),
 * not linked: a worker on a machine without NCCL still starts, and its
 * cuda pieces use the host-staged collectives, saying why. */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "worker/coll_nccl.h"

_Static_assert(sizeof(ncclUniqueId) == TSR_NCCL_ID_BYTES, "ncclUniqueId size");

#define FN(name) __typeof__(name) *name
static struct {
    FN(ncclGetUniqueId);
    FN(ncclCommInitRankConfig);
    FN(ncclCommGetAsyncError);
    FN(ncclCommAbort);
    FN(ncclAllReduce);
    FN(ncclAllGather);
    FN(ncclBroadcast);
    FN(ncclSend);
    FN(ncclRecv);
    FN(ncclGroupStart);
    FN(ncclGroupEnd);
    FN(ncclGetLastError);
} N;
#undef FN
static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static int load_state;          /* 0: not tried, 1: loaded, -1: failed */
static char load_why[512];

int tsr_nccl_real_load(char *err, size_t errlen)
{
    pthread_mutex_lock(&load_mu);
    if (!load_state) {
        void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            snprintf(load_why, sizeof load_why, "cannot load libnccl.so.2: %s", dlerror());
            load_state = -1;
        } else {
            load_state = 1;
#define LOAD(name)                                                                         \
    if (load_state == 1 && !(*(void **)&N.name = dlsym(h, #name))) {                       \
        snprintf(load_why, sizeof load_why, "libnccl.so.2 has no %s (too old?)", #name);   \
        load_state = -1;                                                                   \
    }
            LOAD(ncclGetUniqueId) LOAD(ncclCommInitRankConfig) LOAD(ncclCommGetAsyncError)
            LOAD(ncclCommAbort)
            LOAD(ncclAllReduce) LOAD(ncclAllGather) LOAD(ncclBroadcast) LOAD(ncclSend)
            LOAD(ncclRecv) LOAD(ncclGroupStart) LOAD(ncclGroupEnd) LOAD(ncclGetLastError)
#undef LOAD
        }
    }
    int st = load_state;
    if (st < 0) snprintf(err, errlen, "%s", load_why);
    pthread_mutex_unlock(&load_mu);
    return st > 0 ? 0 : -1;
}

static int status_of(ncclResult_t r)
{
    return r == ncclSuccess ? TSR_NCCL_OK : r == ncclInProgress ? TSR_NCCL_IN_PROGRESS
                                                                 : TSR_NCCL_ERROR;
}

static ncclDataType_t dtype_of(tsr_dtype_t t)
{
    switch (t) {
    case TSR_DT_F16: return ncclFloat16;
    case TSR_DT_BF16: return ncclBfloat16;
    case TSR_DT_I32: return ncclInt32;
    case TSR_DT_I8: return ncclInt8;
    case TSR_DT_F8E4M3: return ncclUint8;   /* bytes: no collective sums them */
    case TSR_DT_F32: break;
    }
    return ncclFloat32;
}

static int real_get_unique_id(uint8_t id[TSR_NCCL_ID_BYTES])
{
    ncclUniqueId u;
    int st = status_of(N.ncclGetUniqueId(&u));
    memcpy(id, &u, TSR_NCCL_ID_BYTES);
    return st;
}

/* The last error the binding saw itself (a CUDA call's), for last_error. */
static __thread char own_error[160];

static int real_comm_init(void **comm, int n, const uint8_t id[TSR_NCCL_ID_BYTES], int rank,
                          int device)
{
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        snprintf(own_error, sizeof own_error, "cudaSetDevice(%d): %s", device,
                 cudaGetErrorString(e));
        return TSR_NCCL_ERROR;
    }
    own_error[0] = '\0';
    ncclUniqueId u;
    memcpy(&u, id, TSR_NCCL_ID_BYTES);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;  /* formation is polled against a deadline and cancellation */
    ncclComm_t c = NULL;
    int st = status_of(N.ncclCommInitRankConfig(&c, n, u, rank, &cfg));
    *comm = c;
    return st;
}

static int real_comm_status(void *comm)
{
    ncclResult_t async = ncclSuccess;
    if (N.ncclCommGetAsyncError((ncclComm_t)comm, &async) != ncclSuccess) return TSR_NCCL_ERROR;
    return status_of(async);
}

static void real_comm_abort(void *comm) { N.ncclCommAbort((ncclComm_t)comm); }

static int real_allreduce(void *comm, void *buf, size_t count, tsr_dtype_t dt, void *stream)
{
    return status_of(N.ncclAllReduce(buf, buf, count, dtype_of(dt), ncclSum, (ncclComm_t)comm,
                                   (cudaStream_t)stream));
}

static int real_allgather(void *comm, const void *send, void *recv, size_t count, tsr_dtype_t dt,
                          void *stream)
{
    return status_of(N.ncclAllGather(send, recv, count, dtype_of(dt), (ncclComm_t)comm,
                                   (cudaStream_t)stream));
}

static int real_broadcast(void *comm, void *buf, size_t count, tsr_dtype_t dt, int root,
                          void *stream)
{
    return status_of(N.ncclBroadcast(buf, buf, count, dtype_of(dt), root, (ncclComm_t)comm,
                                   (cudaStream_t)stream));
}

static int real_send(void *comm, const void *buf, size_t count, tsr_dtype_t dt, int peer,
                     void *stream)
{
    return status_of(
        N.ncclSend(buf, count, dtype_of(dt), peer, (ncclComm_t)comm, (cudaStream_t)stream));
}

static int real_recv(void *comm, void *buf, size_t count, tsr_dtype_t dt, int peer, void *stream)
{
    return status_of(
        N.ncclRecv(buf, count, dtype_of(dt), peer, (ncclComm_t)comm, (cudaStream_t)stream));
}

/* A non-blocking communicator may answer ncclInProgress to a call that was
 * issued: the wait that follows polls it. */
static int real_group_start(void)
{
    return N.ncclGroupStart() == ncclSuccess ? TSR_NCCL_OK : TSR_NCCL_ERROR;
}

static int real_group_end(void)
{
    ncclResult_t r = N.ncclGroupEnd();
    return r == ncclSuccess || r == ncclInProgress ? TSR_NCCL_OK : TSR_NCCL_ERROR;
}

static int real_stream_query(void *stream)
{
    cudaError_t e = cudaStreamQuery((cudaStream_t)stream);
    return e == cudaSuccess ? TSR_NCCL_OK : e == cudaErrorNotReady ? TSR_NCCL_IN_PROGRESS
                                                                    : TSR_NCCL_ERROR;
}

/* NCCL keeps its last error per thread; errors raised on its own threads
 * (a communicator forming in the background) often leave none here. */
static const char *real_last_error(void *comm)
{
    if (!comm && own_error[0]) return own_error;
    const char *s = N.ncclGetLastError((ncclComm_t)comm);
    return s && *s ? s : "no detail from NCCL (see NCCL_DEBUG=WARN in the worker's log)";
}

const tsr_nccl_api_t tsr_nccl_real = {
    .name = "nccl",
    .get_unique_id = real_get_unique_id,
    .comm_init = real_comm_init,
    .comm_status = real_comm_status,
    .comm_abort = real_comm_abort,
    .allreduce_sum = real_allreduce,
    .allgather = real_allgather,
    .broadcast = real_broadcast,
    .send = real_send,
    .recv = real_recv,
    .group_start = real_group_start,
    .group_end = real_group_end,
    .stream_query = real_stream_query,
    .last_error = real_last_error,
};
