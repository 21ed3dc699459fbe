/* engine_cuda.cu: the Llama forward pass on one NVIDIA GPU, BF16, batched.
 *
 * The same piece, sharding and batch as the CPU engine (worker/engine_cpu.c)
 * behind the same table: weights and the KV block pool live in device
 * memory in BF16, hidden states and products accumulate in f32.  Products
 * are cuBLAS GEMMs (BF16 in, f32 out), or a GEMV for a few rows; everything
 * else is one of kernels.cu's kernels: embedding gather, RMSNorm (fused
 * with the residual add before it), RoPE with the KV write into the paged
 * pool, attention over the pool, SwiGLU, and sampling with the CPU
 * engine's (seed, position) draw.
 *
 * What it allocates on the device, and how much, is buffers.c's list, which
 * tests/cuda/test_buffers.cu holds against the planner's budget.
 *
 * A step uploads its metadata (tokens, row and tile tables, block tables)
 * in one copy, then runs on the engine's stream.  Decode-only steps of a
 * single-rank piece are replayed from CUDA graphs, one per batch-size
 * bucket, captured on first use. */
#include <cuda_runtime.h>
#include <cublas_v2.h>

#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "common/log.h"
#include "common/safetensors.h"
#include "common/slice.h"
#include "common/util.h"
#include "worker/cuda/buffers.h"
#include "worker/cuda/cuda.h"
#include "worker/engine.h"
#include "worker/kvpool.h"
}
#include "worker/cuda/kernels.cuh"

#define NBUCKETS 12          /* graph buckets: 1, 2, 4, 8, 16, ..., 72 (tsr_k_graph_bucket) */
#define STAGE_BYTES ((size_t)32 << 20)  /* each of the two pinned load buffers */

/* ---- errors ------------------------------------------------------------------ */

/* Errors after which the context is unusable: the worker must exit and be
 * restarted (illegal address, ECC, a trap, a launch failure). */
static bool sticky(cudaError_t r)
{
    switch (r) {
    case cudaErrorIllegalAddress: case cudaErrorLaunchFailure: case cudaErrorECCUncorrectable:
    case cudaErrorHardwareStackError: case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress: case cudaErrorInvalidAddressSpace: case cudaErrorInvalidPc:
    case cudaErrorAssert: case cudaErrorLaunchTimeout:
        return true;
    default:
        return false;
    }
}

static int cuda_fail(int *fatal, cudaError_t r, const char *what, char *err, size_t errlen)
{
    if (r == cudaSuccess) return 0;
    bool f = sticky(r);
    if (fatal && f) *fatal = 1;
    tsr_set_err(err, errlen, "%s%s: %s (%s)", f ? "fatal device error: " : "", what,
                cudaGetErrorString(r), cudaGetErrorName(r));
    return -1;
}

/* cuBLAS is opened when the first cuda piece loads, not linked: its
 * initialisers make ~150 MB resident in every process that links it, GPU or
 * not (measured: a program that only links libcublas starts at 155 MB of
 * RSS, 1.5 MB without), which a CPU-only worker of a CUDA build would carry
 * for nothing. */
#define TSR_STR2(x) #x
#define TSR_STR(x) TSR_STR2(x)
#define CUBLAS_SONAME "libcublas.so." TSR_STR(CUBLAS_VER_MAJOR)
static struct {
    decltype(&cublasCreate_v2) create;
    decltype(&cublasDestroy_v2) destroy;
    decltype(&cublasSetStream_v2) set_stream;
    decltype(&cublasSetWorkspace_v2) set_workspace;
    /* the C entry point (C++ also sees an inline overload by the same name) */
    cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                              const void *, const void *, cudaDataType, int, const void *,
                              cudaDataType, int, const void *, void *, cudaDataType, int,
                              cublasComputeType_t, cublasGemmAlgo_t);
} B;
static pthread_mutex_t blas_mu = PTHREAD_MUTEX_INITIALIZER;
static int blas_state;          /* 0: not tried, 1: loaded, -1: failed */
static char blas_why[512];

static int blas_load(char *err, size_t errlen)
{
    pthread_mutex_lock(&blas_mu);
    if (!blas_state) {
        void *h = dlopen(CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            /* dlerror names the file and why; say what to do */
            snprintf(blas_why, sizeof blas_why,
                     "cuBLAS: %s (install the CUDA toolkit's cuBLAS %d, or put its directory "
                     "on LD_LIBRARY_PATH, then restart the worker)",
                     dlerror(), CUBLAS_VER_MAJOR);
            blas_state = -1;
        } else {
            blas_state = 1;
            const struct {
                void **fn;
                const char *name;
            } want[] = {{(void **)&B.create, "cublasCreate_v2"},
                        {(void **)&B.destroy, "cublasDestroy_v2"},
                        {(void **)&B.set_stream, "cublasSetStream_v2"},
                        {(void **)&B.set_workspace, "cublasSetWorkspace_v2"},
                        {(void **)&B.gemm_ex, "cublasGemmEx"}};
            for (size_t i = 0; i < sizeof want / sizeof *want && blas_state == 1; i++)
                if (!(*want[i].fn = dlsym(h, want[i].name))) {
                    snprintf(blas_why, sizeof blas_why,
                             "cuBLAS: %s has no %s (older than this build's cuBLAS %d?)",
                             CUBLAS_SONAME, want[i].name, CUBLAS_VER_MAJOR);
                    blas_state = -1;
                }
            if (blas_state < 0) dlclose(h);
        }
    }
    int st = blas_state;
    if (st < 0) tsr_set_err(err, errlen, "%s", blas_why);
    pthread_mutex_unlock(&blas_mu);
    return st > 0 ? 0 : -1;
}

static int blas_fail(cublasStatus_t s, const char *what, char *err, size_t errlen)
{
    if (s == CUBLAS_STATUS_SUCCESS) return 0;
    tsr_set_err(err, errlen, "%s: cuBLAS status %d", what, (int)s);
    return -1;
}

#define CK(call) do { if (cuda_fail(&e->fatal, (call), #call, err, errlen) < 0) return -1; } while (0)
#define LAUNCHED(what) CK(cudaGetLastError())

/* ---- the engine -------------------------------------------------------------- */

typedef struct {
    bf16_t *attn_norm, *mlp_norm, *wqkv, *wo, *wgu, *wd;
} layer_t;

struct tsr_engine {
    tsr_model_info_t m;
    tsr_piece_spec_t spec;
    const tsr_coll_ops_t *ops;
    tsr_comm_t *tp;
    int coll_ms;                /* the deadline of its operations (set_comm) */
    int device, fatal;
    uint64_t *progress;         /* the executor's step count (set_progress), or NULL */
    cudaStream_t st;
    cublasHandle_t blas;
    void *blas_ws;
    int hidden, head_dim, q_heads, kv_heads, inter, n_layers, vocab;
    int v_begin, v_end, v_chunk;
    tsr_cuda_plan_t plan;           /* every device buffer and its size (buffers.c) */
    bf16_t *embed, *lm_head, *final_norm;
    layer_t *layers;                /* host array of device pointers */
    tsr_kvpool_t *kv;
    bf16_t *kpool, *vpool;          /* [n_layers][kv_blocks][kv_heads][TSR_KV_BLOCK][head_dim] */
    float *rope_cos, *rope_sin;     /* [max_seq][head_dim / 2] */
    float *x, *qkv, *proj, *gu, *hin, *hout;
    bf16_t *h, *att, *act;
    float *logits, *gathered;       /* [S][v_chunk], [tp][S][v_chunk] */
    /* sampling scratch: weights and ids, unsorted and sorted, per row */
    float *w, *w_sorted;
    int32_t *ids, *ids_sorted, *seg_begin, *seg_end, *best, *sampled_d;
    double *wsum;
    void *sort_tmp;
    size_t sort_tmp_bytes;
    /* metadata: pinned host and device copies of one buffer */
    void *meta_h, *meta_d;
    cudaEvent_t meta_copied;    /* the stream has copied meta_h out: it may be refilled */
    size_t meta_fixed, meta_bytes;
    tsr_cuda_meta_t mh, md;
    int32_t *sampled_h;
    int first_row[1024];
    int last_sampled;
    cudaGraphExec_t graph[NBUCKETS];
    int graph_rows[NBUCKETS];       /* the rows each graph was captured for */
    int graphs_on;
    int gemv_off;                   /* TSR_CUDA_GEMV=0: cuBLAS for every product */
    /* Tests of the fatal-error path (TSR_TEST_DEVICE_FAULT_AFTER=N): the
     * Nth step first runs a kernel that writes to an invalid address, a real
     * sticky error, as the CPU engine's injection stands in for one. */
    long fault_after, steps;
    uint64_t wbytes, kvbytes;
};

/* y[T][ldy] (f32) = x[T][in] (BF16) * w[out][in]^T (BF16). */
static int gemm(tsr_engine_t *e, float *y, int ldy, const bf16_t *x, const bf16_t *w, int T, int in,
                int out, char *err, size_t errlen)
{
    if (tsr_kern_gemv_fits(T, in) && !e->gemv_off) {
        tsr_kern_gemv(e->st, y, ldy, x, w, T, in, out);
        return cuda_fail(&e->fatal, cudaGetLastError(), "gemv", err, errlen);
    }
    const float one = 1.0f, zero = 0.0f;
    return blas_fail(B.gemm_ex(e->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, T, in, &one, w,
                                  CUDA_R_16BF, in, x, CUDA_R_16BF, in, &zero, y, CUDA_R_32F, ldy,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                     "cublasGemmEx", err, errlen);
}

static int dalloc(tsr_engine_t *e, void **p, size_t bytes, const char *what, char *err,
                  size_t errlen)
{
    cudaError_t r = cudaMalloc(p, bytes ? bytes : 1);
    if (r == cudaSuccess) return 0;
    *p = NULL;
    size_t free_b = 0, total_b = 0;
    cudaGetLastError();
    cudaMemGetInfo(&free_b, &total_b);
    if (r == cudaErrorMemoryAllocation)
        tsr_set_err(err, errlen,
                    "out of device memory for %s: %.1f MiB needed, %.1f MiB free of %.1f MiB on "
                    "cuda device %d",
                    what, bytes / 1048576.0, free_b / 1048576.0, total_b / 1048576.0, e->device);
    else
        cuda_fail(&e->fatal, r, what, err, errlen);
    return -1;
}
#define DALLOC(ptr, bytes, what) \
    do { if (dalloc(e, (void **)&(ptr), (bytes), (what), err, errlen) < 0) return -1; } while (0)

/* ---- loading ---------------------------------------------------------------------- */

/* Streams tensors from the checkpoint through two pinned buffers: while one
 * buffer's copy (and conversion) runs on the stream, the next rows are read
 * into the other. */
typedef struct {
    tsr_engine_t *e;
    const tsr_st_t *st;
    void *pin[2], *dev[2];           /* pinned host staging; device staging for conversion */
    cudaEvent_t done[2];
    int cur;
    unsigned long long dummy_seed;   /* benchmarks: fill from this seed instead of reading */
    bool dummy;
} loader_t;

static int load_tensor(loader_t *ld, tsr_tensor_kind_t t, int li, bf16_t *dst, char *err,
                       size_t errlen)
{
    tsr_engine_t *e = ld->e;
    char name[160];
    tsr_slice_t s;
    if (tsr_slice_named(&e->m, t, li, e->spec.tp_rank, e->spec.tp_size, name, sizeof name, &s,
                        err, errlen) < 0)
        return -1;
    int64_t r0 = s.r0, r1 = s.r1, c0 = s.c0, c1 = s.c1;
    if (!s.cols) c0 = r0, c1 = r1, r0 = 0, r1 = 1;   /* a vector is one row */
    const size_t n = (size_t)((r1 - r0) * (c1 - c0));
    e->wbytes += n * sizeof(bf16_t);
    if (!n) return 0;
    if (ld->dummy) {
        bool norm = t == TSR_T_FINAL_NORM || t == TSR_T_ATTN_NORM || t == TSR_T_MLP_NORM;
        tsr_kern_fill(e->st, dst, n, ld->dummy_seed + (uint64_t)t * 1000003u + li,
                      norm ? 0.0f : 0.02f);
        LAUNCHED("fill");
        return 0;
    }
    int64_t shape[2] = {s.rows, s.cols};
    if (tsr_st_expect(ld->st, name, s.cols ? 2 : 1, shape, err, errlen) < 0) return -1;
    const tsr_tensor_t *ten = tsr_st_find(ld->st, name);
    if (ten->dtype == TSR_DT_I8 || ten->dtype == TSR_DT_F8E4M3) {
        tsr_set_err(err, errlen, "%s: an %s tensor: the CUDA engine reads bf16, f16 and f32 "
                    "checkpoints; an int8 or FP8 checkpoint is served by a cpu deployment", name,
                    tsr_dtype_name(ten->dtype));
        return -1;
    }
    const size_t es = tsr_dtype_size(ten->dtype), width = (size_t)(c1 - c0);
    int64_t rows_per = (int64_t)(STAGE_BYTES / (width * es));
    if (rows_per < 1) {
        tsr_set_err(err, errlen, "%s: a row of %zu bytes is larger than the %zu-byte staging buffer",
                    name, width * es, STAGE_BYTES);
        return -1;
    }
    for (int64_t r = r0; r < r1; r += rows_per) {
        int64_t re = r + rows_per < r1 ? r + rows_per : r1;
        const size_t cnt = (size_t)(re - r) * width;
        int b = ld->cur;
        ld->cur ^= 1;
        CK(cudaEventSynchronize(ld->done[b]));   /* this buffer's last copy has finished */
        if (tsr_st_read_raw(ld->st, ten, r, re, c0, c1, ld->pin[b], err, errlen) < 0) return -1;
        bf16_t *out = dst + (size_t)(r - r0) * width;
        if (ten->dtype == TSR_DT_BF16) {
            CK(cudaMemcpyAsync(out, ld->pin[b], cnt * 2, cudaMemcpyHostToDevice, e->st));
        } else {
            CK(cudaMemcpyAsync(ld->dev[b], ld->pin[b], cnt * es, cudaMemcpyHostToDevice, e->st));
            tsr_kern_convert(e->st, out, ld->dev[b], cnt, ten->dtype);
            LAUNCHED("convert");
        }
        CK(cudaEventRecord(ld->done[b], e->st));
    }
    return 0;
}

static int load_weights(tsr_engine_t *e, const char *dir, char *err, size_t errlen)
{
    loader_t ld = {};
    ld.e = e;
    const char *dummy = NULL;
#ifdef TSR_TESTING
    dummy = getenv("TSR_CUDA_DUMMY_WEIGHTS");
#endif
    int rc = -1;
    if (dummy && *dummy) {
        ld.dummy = true;
        ld.dummy_seed = strtoull(dummy, NULL, 10);
    } else if (tsr_st_open(dir, (tsr_st_t **)&ld.st, err, errlen) < 0) {
        return -1;
    }
    const size_t H = e->hidden, qw = (size_t)e->q_heads * e->head_dim,
                 kvw = (size_t)e->kv_heads * e->head_dim, I = e->inter;
    const tsr_cuda_buf_t *pb = e->plan.buf;
    for (int b = 0; b < 2 && !ld.dummy; b++) {
        if (cuda_fail(&e->fatal, cudaHostAlloc(&ld.pin[b], STAGE_BYTES, cudaHostAllocDefault),
                      "pinned staging buffer", err, errlen) < 0 ||
            dalloc(e, &ld.dev[b], STAGE_BYTES, "the load staging buffer", err, errlen) < 0 ||
            cuda_fail(&e->fatal, cudaEventCreateWithFlags(&ld.done[b], cudaEventDisableTiming),
                      "event", err, errlen) < 0)
            goto out;
        cudaEventRecord(ld.done[b], e->st);
    }
#define PLANNED(ptr, id) dalloc(e, (void **)&(ptr), pb[id].bytes, pb[id].what, err, errlen)
    if (pb[TSR_CB_EMBED].count) {
        if (PLANNED(e->embed, TSR_CB_EMBED) < 0 ||
            load_tensor(&ld, TSR_T_EMBED, 0, e->embed, err, errlen) < 0)
            goto out;
    }
    if (pb[TSR_CB_FINAL_NORM].count) {
        if (PLANNED(e->final_norm, TSR_CB_FINAL_NORM) < 0 ||
            load_tensor(&ld, TSR_T_FINAL_NORM, 0, e->final_norm, err, errlen) < 0)
            goto out;
        if (!pb[TSR_CB_LM_HEAD].count) {   /* tied, on the embedding's stage */
            e->lm_head = e->embed;
        } else if (PLANNED(e->lm_head, TSR_CB_LM_HEAD) < 0 ||
                   load_tensor(&ld, TSR_T_LM_HEAD, 0, e->lm_head, err, errlen) < 0) {
            goto out;
        }
    }
#undef PLANNED
    for (int l = 0; l < e->n_layers; l++) {
        layer_t *L = &e->layers[l];
        int li = e->spec.layer_begin + l;
        char what[64];
        snprintf(what, sizeof what, "the weights of layer %d", li);
#define PLANNED(ptr, id) dalloc(e, (void **)&(ptr), pb[id].bytes, what, err, errlen)
        if (PLANNED(L->attn_norm, TSR_CB_ATTN_NORM) < 0 ||
            PLANNED(L->mlp_norm, TSR_CB_MLP_NORM) < 0 || PLANNED(L->wqkv, TSR_CB_WQKV) < 0 ||
            PLANNED(L->wo, TSR_CB_WO) < 0 || PLANNED(L->wgu, TSR_CB_WGU) < 0 ||
            PLANNED(L->wd, TSR_CB_WD) < 0)
            goto out;
#undef PLANNED
        if (load_tensor(&ld, TSR_T_ATTN_NORM, li, L->attn_norm, err, errlen) ||
            load_tensor(&ld, TSR_T_MLP_NORM, li, L->mlp_norm, err, errlen) ||
            load_tensor(&ld, TSR_T_Q, li, L->wqkv, err, errlen) ||
            load_tensor(&ld, TSR_T_K, li, L->wqkv + qw * H, err, errlen) ||
            load_tensor(&ld, TSR_T_V, li, L->wqkv + (qw + kvw) * H, err, errlen) ||
            load_tensor(&ld, TSR_T_O, li, L->wo, err, errlen) ||
            load_tensor(&ld, TSR_T_GATE, li, L->wgu, err, errlen) ||
            load_tensor(&ld, TSR_T_UP, li, L->wgu + I * H, err, errlen) ||
            load_tensor(&ld, TSR_T_DOWN, li, L->wd, err, errlen))
            goto out;
    }
    rc = cuda_fail(&e->fatal, cudaStreamSynchronize(e->st), "loading the weights", err, errlen);
out:
    cudaStreamSynchronize(e->st);
    for (int b = 0; b < 2; b++) {
        if (ld.pin[b]) cudaFreeHost(ld.pin[b]);
        if (ld.dev[b]) cudaFree(ld.dev[b]);
        if (ld.done[b]) cudaEventDestroy(ld.done[b]);
    }
    tsr_st_close((tsr_st_t **)&ld.st);
    return rc;
}

static void engine_free(tsr_engine_t *e)
{
    if (!e) return;
    if (e->st) cudaStreamSynchronize(e->st);
    for (int i = 0; i < NBUCKETS; i++)
        if (e->graph[i]) cudaGraphExecDestroy(e->graph[i]);
    for (int l = 0; e->layers && l < e->n_layers; l++) {
        layer_t *L = &e->layers[l];
        cudaFree(L->attn_norm), cudaFree(L->mlp_norm), cudaFree(L->wqkv), cudaFree(L->wo);
        cudaFree(L->wgu), cudaFree(L->wd);
    }
    free(e->layers);
    if (e->lm_head != e->embed) cudaFree(e->lm_head);
    void *dev[] = {e->embed, e->final_norm, e->kpool, e->vpool, e->rope_cos, e->rope_sin, e->x,
                   e->qkv, e->proj, e->gu, e->hin, e->hout, e->h, e->att, e->act, e->logits,
                   e->gathered, e->w, e->w_sorted, e->ids, e->ids_sorted, e->seg_begin,
                   e->seg_end, e->best, e->sampled_d, e->wsum, e->sort_tmp, e->meta_d,
                   e->blas_ws};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) cudaFree(dev[i]);
    if (e->meta_h) cudaFreeHost(e->meta_h);
    if (e->meta_copied) cudaEventDestroy(e->meta_copied);
    if (e->sampled_h) cudaFreeHost(e->sampled_h);
    if (e->blas) B.destroy(e->blas);
    if (e->st) cudaStreamDestroy(e->st);
    tsr_kvpool_destroy(&e->kv);
    free(e);
}

/* The buffers after the weights, as the plan lists them: the KV pool, the
 * RoPE tables, the activations, logits and sampling, the metadata. */
static int alloc_all(tsr_engine_t *e, char *err, size_t errlen)
{
    const tsr_cuda_plan_t *p = &e->plan;
    const tsr_cuda_buf_t *pb = p->buf;
    void **to[TSR_CB_COUNT] = {};
    to[TSR_CB_KPOOL] = (void **)&e->kpool, to[TSR_CB_VPOOL] = (void **)&e->vpool;
    to[TSR_CB_ROPE_COS] = (void **)&e->rope_cos, to[TSR_CB_ROPE_SIN] = (void **)&e->rope_sin;
    to[TSR_CB_X] = (void **)&e->x, to[TSR_CB_PROJ] = (void **)&e->proj;
    to[TSR_CB_HIN] = (void **)&e->hin, to[TSR_CB_HOUT] = (void **)&e->hout;
    to[TSR_CB_QKV] = (void **)&e->qkv, to[TSR_CB_GU] = (void **)&e->gu;
    to[TSR_CB_H] = (void **)&e->h, to[TSR_CB_ATT] = (void **)&e->att;
    to[TSR_CB_ACT] = (void **)&e->act, to[TSR_CB_LOGITS] = (void **)&e->logits;
    to[TSR_CB_GATHERED] = (void **)&e->gathered, to[TSR_CB_W] = (void **)&e->w;
    to[TSR_CB_W_SORTED] = (void **)&e->w_sorted, to[TSR_CB_IDS] = (void **)&e->ids;
    to[TSR_CB_IDS_SORTED] = (void **)&e->ids_sorted;
    to[TSR_CB_SEG_BEGIN] = (void **)&e->seg_begin, to[TSR_CB_SEG_END] = (void **)&e->seg_end;
    to[TSR_CB_BEST] = (void **)&e->best;
    to[TSR_CB_SAMPLED] = (void **)&e->sampled_d, to[TSR_CB_WSUM] = (void **)&e->wsum;
    for (int id = TSR_CB_KPOOL; id < TSR_CB_SORT_TMP; id++)
        if (pb[id].count) DALLOC(*to[id], pb[id].bytes, pb[id].what);
    e->kvbytes = pb[TSR_CB_KPOOL].bytes + pb[TSR_CB_VPOOL].bytes;
    if (pb[TSR_CB_SORT_TMP].count) {   /* what cub asks for, on this device */
        const size_t S = e->spec.max_seqs, V = e->vocab;
        size_t tmp = 0;
        tsr_kern_sort_desc(e->st, NULL, &tmp, e->w, e->w_sorted, e->ids, e->ids_sorted,
                           (int)(S * V), (int)S, e->seg_begin, e->seg_end);
        e->sort_tmp_bytes = tmp;
        DALLOC(e->sort_tmp, tmp, pb[TSR_CB_SORT_TMP].what);
    }
    e->meta_fixed = p->meta_fixed;
    e->meta_bytes = pb[TSR_CB_META].bytes;
    CK(cudaHostAlloc(&e->meta_h, e->meta_bytes, cudaHostAllocDefault));
    CK(cudaEventCreateWithFlags(&e->meta_copied, cudaEventDisableTiming));
    DALLOC(e->meta_d, e->meta_bytes, pb[TSR_CB_META].what);
    tsr_cuda_meta_layout((char *)e->meta_h, e->spec.max_tokens, e->spec.max_seqs, p->max_tiles,
                         p->max_blocks_per_seq, &e->mh, NULL);
    tsr_cuda_meta_layout((char *)e->meta_d, e->spec.max_tokens, e->spec.max_seqs, p->max_tiles,
                         p->max_blocks_per_seq, &e->md, NULL);
    CK(cudaHostAlloc((void **)&e->sampled_h, (size_t)e->spec.max_seqs * 4, cudaHostAllocDefault));
    return 0;
}

static int rope_upload(tsr_engine_t *e, char *err, size_t errlen)
{
    const int half = e->head_dim / 2, S = e->spec.max_seq_len;
    tsr_rope_cfg_t rc = tsr_rope_cfg(&e->m);
    float *c = (float *)malloc((size_t)S * half * 4), *s = (float *)malloc((size_t)S * half * 4);
    int ok = c && s;
    for (int i = 0; ok && i < half; i++) {
        double inv = tsr_k_rope_inv_freq(&rc, i, e->head_dim);
        for (int p = 0; p < S; p++) {
            c[(size_t)p * half + i] = (float)cos(p * inv);
            s[(size_t)p * half + i] = (float)sin(p * inv);
        }
    }
    int rc2 = -1;
    if (!ok)
        tsr_set_err(err, errlen, "out of host memory for the RoPE tables");
    else if (cuda_fail(&e->fatal, cudaMemcpy(e->rope_cos, c, (size_t)S * half * 4, cudaMemcpyHostToDevice), "RoPE tables", err, errlen) == 0 &&
             cuda_fail(&e->fatal, cudaMemcpy(e->rope_sin, s, (size_t)S * half * 4, cudaMemcpyHostToDevice), "RoPE tables", err, errlen) == 0)
        rc2 = 0;
    free(c);
    free(s);
    return rc2;
}

/* Whether the switch `name` is set to 0 (off). */
static bool env_off(const char *name)
{
    const char *v = getenv(name);
    return v && !strcmp(v, "0");
}

#ifdef TSR_TESTING
/* The number `name` is set to (0 when unset). */
static long env_long(const char *name)
{
    const char *v = getenv(name);
    return v ? strtol(v, NULL, 10) : 0;
}
#endif

static int cuda_load(const char *dir, const tsr_piece_spec_t *spec, tsr_engine_t **out, char *err,
                     size_t errlen)
{
    tsr_engine_t *e = (tsr_engine_t *)calloc(1, sizeof *e);
    if (!e) return -1;
    e->spec = *spec;
    e->device = spec->device_index;
    if (tsr_kv_dtype_check(spec->kv_dtype, 1u << TSR_KV_BF16, "CUDA", err, errlen) < 0 ||
        tsr_elem_dtype_check("matmul_dtype", spec->matmul_dtype, 1u << TSR_KV_BF16, "CUDA",
                             "multiply in", err, errlen) < 0 ||
        tsr_elem_dtype_check("weights_dtype", spec->weights_dtype, 0, "CUDA", "hold its weights in",
                             err, errlen) < 0) {   /* bf16 weights only (auto) */
        free(e);
        return -1;
    }
    if (spec->seq_size > 1) {
        tsr_set_err(err, errlen, "the CUDA engine cannot split a sequence yet (parallel.sequence "
                    "%d): cpu pieces can", spec->seq_size);
        free(e);
        return -1;
    }
    int n = 0;
    cudaError_t r = cudaGetDeviceCount(&n);
    if (r != cudaSuccess || e->device >= n) {
        if (r != cudaSuccess)
            tsr_set_err(err, errlen, "cuda device %d: the CUDA runtime finds no usable GPU (%s)",
                        e->device, cudaGetErrorString(r));
        else
            tsr_set_err(err, errlen, "cuda device %d not found: the runtime sees %d device(s)",
                        e->device, n);
        free(e);
        return -1;
    }
    const tsr_model_info_t *m = &e->m;
    if (tsr_model_info_load(dir, &e->m, err, errlen) < 0) goto fail;
    if (m->head_dim > TSR_KERN_MAX_HEAD_DIM || m->head_dim % 2) {
        tsr_set_err(err, errlen, "%s/config.json: head_dim %d is not supported by the CUDA engine "
                    "(even, at most %d)", dir, m->head_dim, TSR_KERN_MAX_HEAD_DIM);
        goto fail;
    }
    if (spec->max_seq_len < 1 || spec->max_seqs < 1 || spec->max_seqs > 1024 ||
        spec->max_tokens < 1 || spec->kv_blocks < 1) {
        tsr_set_err(err, errlen, "a piece needs max_seq_len, 1 to 1024 sequence slots, step rows "
                    "and KV blocks (got %d, %d, %d and %d)", spec->max_seq_len, spec->max_seqs,
                    spec->max_tokens, spec->kv_blocks);
        goto fail;
    }
    if (tsr_model_check_piece(m, dir, spec->tp_rank, spec->tp_size, spec->stage, spec->pp_size,
                              spec->layer_begin, spec->layer_end, err, errlen) < 0)
        goto fail;
    /* A blocking stream (cudaStreamCreate's default), and keep it one: the
     * host-staged collectives copy with cudaMemcpy on the legacy default
     * stream (tsr_cuda_copy), which then waits for this stream's queued
     * work, so a step that returned before its kernels ran is not read or
     * overwritten early.  A non-blocking stream, or nvcc's per-thread default
     * stream, would need an explicit synchronisation there. */
    if (cuda_fail(&e->fatal, cudaSetDevice(e->device), "cudaSetDevice", err, errlen) < 0 ||
        cuda_fail(&e->fatal, cudaStreamCreate(&e->st), "cudaStreamCreate", err, errlen) < 0)
        goto fail;
    if (blas_load(err, errlen) < 0 ||
        blas_fail(B.create(&e->blas), "cublasCreate", err, errlen) < 0 ||
        blas_fail(B.set_stream(e->blas, e->st), "cublasSetStream", err, errlen) < 0)
        goto fail;
    if (tsr_cuda_plan(m, spec, &e->plan) < 0) {   /* tsr_model_check_piece passed: not reached */
        tsr_set_err(err, errlen, "%s/config.json: the piece does not divide the model", dir);
        goto fail;
    }
    /* A workspace of our own, so the products can be captured in graphs. */
    if (dalloc(e, &e->blas_ws, e->plan.buf[TSR_CB_WORKSPACE].bytes,
               e->plan.buf[TSR_CB_WORKSPACE].what, err, errlen) < 0 ||
        blas_fail(B.set_workspace(e->blas, e->blas_ws, e->plan.buf[TSR_CB_WORKSPACE].bytes),
                  "cublasSetWorkspace", err, errlen) < 0)
        goto fail;
    e->hidden = m->hidden_size;
    e->head_dim = m->head_dim;
    e->q_heads = m->num_attention_heads / spec->tp_size;
    e->kv_heads = m->num_key_value_heads / spec->tp_size;
    e->inter = m->intermediate_size / spec->tp_size;
    e->n_layers = spec->layer_end - spec->layer_begin;
    e->vocab = m->vocab_size;
#ifdef TSR_TESTING
    e->fault_after = env_long("TSR_TEST_DEVICE_FAULT_AFTER");
#endif
    e->gemv_off = env_off("TSR_CUDA_GEMV");
    e->graphs_on = spec->tp_size == 1 && !env_off("TSR_CUDA_GRAPHS");
    tsr_vocab_range(m, spec->tp_rank, spec->tp_size, &e->v_begin, &e->v_end, &e->v_chunk);
    if (!(e->layers = (layer_t *)calloc(e->n_layers ? e->n_layers : 1, sizeof *e->layers)) ||
        !(e->kv = tsr_kvpool_new(spec->kv_blocks, spec->max_seqs, spec->max_seq_len))) {
        tsr_set_err(err, errlen, "out of host memory");
        goto fail;
    }
    if (load_weights(e, dir, err, errlen) < 0 || alloc_all(e, err, errlen) < 0 ||
        rope_upload(e, err, errlen) < 0)
        goto fail;
    *out = e;
    return 0;
fail:
    engine_free(e);
    return -1;
}

/* ---- the forward pass ------------------------------------------------------------ */

/* Waits for the stream to run the step.  With a TP group its settle waits
 * (collective.h): NCCL's operations return once queued, so a dead peer
 * would otherwise leave the stream, and this wait, stuck for ever; settle
 * ends at the deadline naming the rank and aborts the group. */
static int stream_wait(tsr_engine_t *e, const char *what, char *err, size_t errlen)
{
    if (e->tp && tsr_coll_settle(e->ops, e->tp, e->coll_ms, err, errlen) < 0)
        return -1;
    return cuda_fail(&e->fatal, cudaStreamSynchronize(e->st), what, err, errlen);
}

static int allreduce(tsr_engine_t *e, float *buf, size_t n, char *err, size_t errlen)
{
    if (!e->tp) return 0;   /* tp 1 (a group of one under TSR_TEST_NCCL_SOLO sums too) */
    tsr_buf_t b = {buf, n, TSR_DT_F32, TSR_MEM_DEVICE};
    return e->ops->allreduce_sum(e->tp, b, e->coll_ms, err, errlen);
}

/* The layers, from x (filled) to x; T rows, tiles attention tiles. */
static int layers_forward(tsr_engine_t *e, int T, int tiles, char *err, size_t errlen)
{
    const int H = e->hidden, hd = e->head_dim, qh = e->q_heads, kvh = e->kv_heads, I = e->inter;
    const size_t qw = (size_t)qh * hd, qkvw = qw + 2 * (size_t)kvh * hd;
    const float eps = e->m.rms_norm_eps;
    for (int l = 0; l < e->n_layers; l++) {
        const layer_t *L = &e->layers[l];
        /* attention (the previous layer's MLP output is added here) */
        tsr_kern_add_rmsnorm(e->st, T, e->h, e->x, l ? e->proj : NULL, L->attn_norm, NULL, H,
                             eps);
        if (gemm(e, e->qkv, (int)qkvw, e->h, L->wqkv, T, H, (int)qkvw, err, errlen) < 0) return -1;
        tsr_kern_rope_kv(e->st, T, e->qkv, e->kpool, e->vpool, e->rope_cos, e->rope_sin, e->md, l,
                         e->spec.kv_blocks, qh, kvh, hd);
        /* a step of decodes has one tile a row */
        tsr_kern_attention(e->st, tiles, T == tiles, e->att, e->qkv, e->kpool, e->vpool, e->md, l,
                           e->spec.kv_blocks, qh, kvh, hd);
        LAUNCHED("attention");
        if (gemm(e, e->proj, H, e->att, L->wo, T, (int)qw, H, err, errlen) < 0) return -1;
        if (allreduce(e, e->proj, (size_t)T * H, err, errlen) < 0) return -1;
        /* SwiGLU MLP */
        tsr_kern_add_rmsnorm(e->st, T, e->h, e->x, e->proj, L->mlp_norm, NULL, H, eps);
        if (gemm(e, e->gu, 2 * I, e->h, L->wgu, T, H, 2 * I, err, errlen) < 0) return -1;
        tsr_kern_swiglu(e->st, e->act, e->gu, I, (size_t)T * I);
        if (gemm(e, e->proj, H, e->act, L->wd, T, I, H, err, errlen) < 0) return -1;
        if (allreduce(e, e->proj, (size_t)T * H, err, errlen) < 0) return -1;
        LAUNCHED("layer kernels");
    }
    if (e->n_layers)
        tsr_kern_add(e->st, e->x, e->proj, (size_t)T * H);
    LAUNCHED("residual add");
    return 0;
}

/* The last stage: logits of the sampled rows (ns of them, bucket rows
 * computed), gathered over the TP group. */
static int logits_forward(tsr_engine_t *e, int ns, char *err, size_t errlen)
{
    const int H = e->hidden, C = e->v_chunk, tp = e->spec.tp_size, vs = e->v_end - e->v_begin;
    tsr_kern_add_rmsnorm(e->st, ns, e->h, e->x, NULL, e->final_norm, e->md.samp_row, H,
                         e->m.rms_norm_eps);
    float *lg = tp > 1 ? e->logits : e->gathered;
    if (vs > 0 && gemm(e, lg, C, e->h, e->lm_head, ns, H, vs, err, errlen) < 0) return -1;
    if (vs < C) tsr_kern_pad(e->st, lg, C, vs, ns);
    LAUNCHED("logits");
    return 0;
}

/* Samples the ns entries of b from `rows` rows of logits (rows > ns when
 * a graph padded the batch; the padding rows are greedy and dropped). */
static int sample_forward(tsr_engine_t *e, const tsr_batch_t *b, int rows, int ns,
                          int32_t *sampled, char *err, size_t errlen)
{
    const int C = e->v_chunk, V = e->vocab;
    bool any_cut = false;
    /* A prompt chunk that samples nothing: with a TP group its operations
     * are still settled, or the next step's waits (the metadata event, a
     * staged pipeline copy) would sit behind them with no deadline. */
    if (!rows) return e->tp ? stream_wait(e, "step", err, errlen) : 0;
    for (int i = 0, s = 0; i < b->n_entries; i++)
        if (b->entries[i].sample) {
            any_cut |= !tsr_k_greedy(e->mh.samp_temp[s]) && tsr_k_top_p_cuts(e->mh.samp_top_p[s]);
            s++;
        }
    tsr_kern_sample_prep(e->st, rows, e->gathered, C, V, e->md, e->best, e->w, e->ids, e->wsum,
                         e->seg_begin, e->seg_end);
    LAUNCHED("sampling");
    if (any_cut) {
        size_t tmp = e->sort_tmp_bytes;
        CK(tsr_kern_sort_desc(e->st, e->sort_tmp, &tmp, e->w, e->w_sorted, e->ids, e->ids_sorted,
                              rows * V, rows, e->seg_begin, e->seg_end));
    }
    tsr_kern_sample_pick(e->st, rows, e->w, e->ids, e->w_sorted, e->ids_sorted, e->wsum, e->best,
                         V, e->md, e->sampled_d);
    LAUNCHED("sampling");
    CK(cudaMemcpyAsync(e->sampled_h, e->sampled_d, (size_t)ns * 4, cudaMemcpyDeviceToHost, e->st));
    if (stream_wait(e, "sampling", err, errlen) < 0) return -1;
    memcpy(sampled, e->sampled_h, (size_t)ns * 4);
    return 0;
}

/* Fills the metadata of batch b padded to `rows` rows and `tiles` tiles;
 * returns the bytes to upload, or 0 when the tables do not fit. */
static size_t meta_fill(tsr_engine_t *e, const tsr_batch_t *b, const int32_t *row_pos_in,
                        int rows, int *tiles_out, int *ns_out)
{
    tsr_cuda_meta_t *m = &e->mh;
    int tiles = 0, ns = 0, tbl = 0;
    for (int i = 0; i < b->n_entries; i++) {
        const tsr_entry_t *en = &b->entries[i];
        int held = tsr_kvpool_held(e->kv, en->slot);
        memcpy(m->tables + tbl, tsr_kvpool_table(e->kv, en->slot), (size_t)held * 4);
        for (int r = 0; r < en->n; r++) {
            int row = e->first_row[i] + r;
            m->tokens[row] = b->tokens ? b->tokens[row] : 0;
            m->row_pos[row] = row_pos_in[row];
            m->row_tbl[row] = tbl;
        }
        for (int t = 0; t < tsr_k_att_tiles(en->n); t++, tiles++) {
            int off, n;
            tsr_k_att_tile(en->n, t, &off, &n);
            m->tile_row0[tiles] = e->first_row[i] + off;
            m->tile_n[tiles] = n;
            m->tile_pos0[tiles] = en->pos + off;
            m->tile_tbl[tiles] = tbl;
        }
        if (en->sample) {
            m->samp_row[ns] = e->first_row[i] + en->n - 1;
            m->samp_temp[ns] = en->temperature;
            m->samp_top_p[ns] = en->top_p;
            m->samp_seed[ns] = en->seed;
            m->samp_pos[ns] = (unsigned long long)(en->pos + en->n);
            ns++;
        }
        tbl += held;
    }
    /* Padding up to a graph bucket: rows that touch nothing. */
    for (int r = b->n_tokens; r < rows; r++) m->tokens[r] = 0, m->row_pos[r] = -1, m->row_tbl[r] = 0;
    for (int t = tiles; t < rows && t < e->plan.max_tiles; t++) m->tile_n[t] = 0;
    *tiles_out = tiles;
    *ns_out = ns;
    return e->meta_fixed + (size_t)tbl * 4;
}

/* The step's kernels from the embedding (or the received hidden state) to
 * the logits: what a decode graph holds. */
static int forward(tsr_engine_t *e, int rows, int tiles, int ns_rows, char *err, size_t errlen)
{
    const tsr_piece_spec_t *s = &e->spec;
    if (s->stage == 0) {
        tsr_kern_embed(e->st, rows, e->x, e->embed, e->md.tokens, e->hidden, e->v_begin, e->v_end);
        LAUNCHED("embedding");
        if (allreduce(e, e->x, (size_t)rows * e->hidden, err, errlen) < 0) return -1;
    } else {
        CK(cudaMemcpyAsync(e->x, e->hin, (size_t)rows * e->hidden * 4, cudaMemcpyDeviceToDevice, e->st));
    }
    if (layers_forward(e, rows, tiles, err, errlen) < 0) return -1;
    if (s->stage < s->pp_size - 1) {
        CK(cudaMemcpyAsync(e->hout, e->x, (size_t)rows * e->hidden * 4, cudaMemcpyDeviceToDevice, e->st));
        return 0;
    }
    return ns_rows ? logits_forward(e, ns_rows, err, errlen) : 0;
}

static int bucket_index(int bucket)
{
    if (bucket <= 8) return bucket == 1 ? 0 : bucket == 2 ? 1 : bucket == 4 ? 2 : 3;
    return 3 + bucket / 8 - 1;   /* 16 -> 4, 24 -> 5, ... */
}

static int step_run(tsr_engine_t *e, const tsr_batch_t *b, int32_t *sampled, char *err,
                    size_t errlen)
{
    const tsr_piece_spec_t *s = &e->spec;
    if (e->fatal) {
        tsr_set_err(err, errlen, "fatal device error earlier: this worker must restart");
        return -1;
    }
    int32_t *row_slot = (int32_t *)alloca((size_t)s->max_tokens * 4),
            *row_pos = (int32_t *)alloca((size_t)s->max_tokens * 4);
    if (b->n_entries > s->max_seqs) {
        tsr_set_err(err, errlen, "a batch of %d entries exceeds this piece's %d slots",
                    b->n_entries, s->max_seqs);
        return -1;
    }
    if (tsr_batch_prepare(s, e->kv, b, e->first_row, row_slot, row_pos, err, errlen) < 0) return -1;
    e->last_sampled = 0;
    if (!b->n_tokens) return 0;
#ifdef TSR_TESTING
    if (e->fault_after > 0 && ++e->steps == e->fault_after) {
        tsr_warn("CUDA: injecting an illegal-address fault at step %ld (TSR_TEST_DEVICE_FAULT_AFTER)",
                 e->steps);
        tsr_kern_fault(e->st);
    }
#endif
    if (s->stage == 0)
        for (int i = 0; i < b->n_tokens; i++)
            if (b->tokens[i] < 0 || b->tokens[i] >= e->vocab) {
                tsr_set_err(err, errlen, "token id %d at position %d is outside the vocabulary (%d)",
                            b->tokens[i], row_pos[i], e->vocab);
                return -1;
            }
    /* A decode-only step (one row per entry) runs from a graph of its bucket. */
    bool decode = b->n_tokens == b->n_entries;
    bool last = s->stage == s->pp_size - 1;
    int all_sample = 1;
    for (int i = 0; i < b->n_entries; i++) all_sample &= b->entries[i].sample;
    int bucket = tsr_k_graph_bucket(b->n_entries, 8 * (NBUCKETS - 3));
    /* (not with a TP group: a group of one under TSR_TEST_NCCL_SOLO) */
    bool graph = e->graphs_on && !e->tp && decode && (!last || all_sample) &&
                 b->n_entries <= 8 * (NBUCKETS - 3) && bucket <= s->max_seqs &&
                 bucket <= s->max_tokens && bucket_index(bucket) < NBUCKETS;
    int rows = graph ? bucket : b->n_tokens, tiles, ns;
    /* A step that samples nothing returns once queued, so the last step's
     * copy of meta_h may not have run yet: wait for that copy (early in the
     * last step), not for the step, before writing meta_h again. */
    CK(cudaEventSynchronize(e->meta_copied));
    size_t bytes = meta_fill(e, b, row_pos, rows, &tiles, &ns);
    if (graph)
        for (int i = ns; i < rows; i++) e->mh.samp_row[i] = 0, e->mh.samp_temp[i] = 0;
    CK(cudaMemcpyAsync(e->meta_d, e->meta_h, bytes, cudaMemcpyHostToDevice, e->st));
    CK(cudaEventRecord(e->meta_copied, e->st));
    if (graph) {
        cudaGraphExec_t *g = &e->graph[bucket_index(bucket)];
        if (*g && e->graph_rows[bucket_index(bucket)] != rows) {
            tsr_set_err(err, errlen, "internal: graph bucket %d holds %d rows, not %d",
                        bucket_index(bucket), e->graph_rows[bucket_index(bucket)], rows);
            return -1;
        }
        if (!*g) {
            cudaGraph_t cap;
            CK(cudaStreamBeginCapture(e->st, cudaStreamCaptureModeThreadLocal));
            int rc = forward(e, rows, rows, last ? rows : 0, err, errlen);
            cudaError_t r = cudaStreamEndCapture(e->st, &cap);
            if (rc < 0) {
                if (r == cudaSuccess) cudaGraphDestroy(cap);
                return -1;
            }
            if (r == cudaSuccess) {
                r = cudaGraphInstantiate(g, cap, 0);
                cudaGraphDestroy(cap);
            }
            /* A graph that cannot be made (not a device fault) would fail
             * every step of its size: this step fails, later ones run
             * without graphs. */
            if (r != cudaSuccess && !sticky(r)) e->graphs_on = 0;
            CK(r);
            e->graph_rows[bucket_index(bucket)] = rows;
        }
        CK(cudaGraphLaunch(*g, e->st));
    } else if (forward(e, rows, tiles, last ? ns : 0, err, errlen) < 0) {
        return -1;
    }
    /* A stage that hands its rows on returns once queued (the pipeline
     * send waits for the stream); in a TP group it settles the group here,
     * once per step rather than once per all-reduce. */
    if (!last) return e->tp ? stream_wait(e, "step", err, errlen) : 0;
    if (s->tp_size > 1) {
        tsr_buf_t send = {e->logits, (size_t)ns * e->v_chunk, TSR_DT_F32, TSR_MEM_DEVICE};
        tsr_buf_t recv = {e->gathered, (size_t)s->tp_size * ns * e->v_chunk, TSR_DT_F32,
                          TSR_MEM_DEVICE};
        if (e->ops->allgather(e->tp, send, recv, e->coll_ms, err, errlen) < 0) return -1;
    }
    e->last_sampled = ns;
    if (s->tp_rank != 0) return stream_wait(e, "step", err, errlen);
    /* With padding rows the gathered layout has `rows` rows per rank; only
     * a single rank pads (graphs need tp 1), so rows index directly. */
    return sample_forward(e, b, graph ? rows : ns, ns, sampled, err, errlen);
}

static void cuda_set_comm(tsr_engine_t *e, const tsr_coll_ops_t *ops, tsr_comm_t *tp,
                          int timeout_ms)
{
    e->ops = ops;
    e->tp = tp;
    e->coll_ms = timeout_ms > 0 ? timeout_ms : TSR_COLL_TIMEOUT_MS_CUDA_DEFAULT;
}

static tsr_buf_t cuda_hidden(tsr_engine_t *e, int which)
{
    tsr_buf_t b = {which ? e->hout : e->hin, (size_t)e->spec.max_tokens * e->hidden, TSR_DT_F32,
                   TSR_MEM_DEVICE};
    return b;
}

static int cuda_last_logits(tsr_engine_t *e, float *out, int max_rows)
{
    const int C = e->v_chunk, tp = e->spec.tp_size, ns = e->last_sampled, V = e->vocab;
    int rows = ns < max_rows ? ns : max_rows;
    if (!e->gathered || !rows) return 0;
    size_t n = (size_t)tp * ns * C;
    float *h = (float *)malloc(n * 4);
    if (!h || cudaMemcpy(h, e->gathered, n * 4, cudaMemcpyDeviceToHost) != cudaSuccess) {
        free(h);
        return 0;
    }
    tsr_logits_ungather(h, tp, ns, C, V, rows, out);
    free(h);
    return rows;
}

static void cuda_release(tsr_engine_t *e, int slot) { tsr_kvpool_release(e->kv, slot); }
static tsr_kvpool_t *cuda_kvpool(tsr_engine_t *e) { return e->kv; }
static void cuda_kv_usage(const tsr_engine_t *e, int *used, int *total)
{
    *used = tsr_kvpool_used(e->kv);
    *total = tsr_kvpool_total(e->kv);
}
static const tsr_model_info_t *cuda_model(const tsr_engine_t *e) { return &e->m; }
static uint64_t cuda_weight_bytes(const tsr_engine_t *e) { return e->wbytes; }
static uint64_t cuda_kv_bytes(const tsr_engine_t *e) { return e->kvbytes; }
/* Also asks the stream: a step that samples nothing returns before its
 * kernels run, so an illegal address or ECC error may first show in a
 * collective's copy, which does not mark the engine. */
static int cuda_fatal(const tsr_engine_t *e)
{
    return e->fatal || (e->st && sticky(cudaStreamQuery(e->st)));
}
static void *cuda_stream(const tsr_engine_t *e) { return (void *)e->st; }

/* Runs on a CUDA host thread when the stream reaches it: the step before
 * it has finished on the GPU. */
static void CUDART_CB step_finished(void *count)
{
    __atomic_fetch_add((uint64_t *)count, 1, __ATOMIC_RELAXED);
}

/* A step that samples nothing (a prompt chunk, a stage before the last)
 * returns once it is queued; its count comes when the GPU has run it, so a
 * replica whose GPU hangs shows no progress however many steps it queued. */
static int cuda_step(tsr_engine_t *e, const tsr_batch_t *b, int32_t *sampled, char *err,
                     size_t errlen)
{
    if (step_run(e, b, sampled, err, errlen) < 0) return -1;
    if (!e->progress || b->n_entries == 0) return 0;
    cudaError_t r = cudaLaunchHostFunc(e->st, step_finished, e->progress);
    if (sticky(r)) return cuda_fail(&e->fatal, r, "step", err, errlen);
    /* Otherwise the step itself is done and its tokens are good: only its
     * count for the heartbeat is lost. */
    if (r != cudaSuccess)
        tsr_warn("CUDA: the callback that counts a finished step was refused (%s)",
                 cudaGetErrorName(r));
    return 0;
}

static void cuda_set_progress(tsr_engine_t *e, uint64_t *steps) { e->progress = steps; }
static void cuda_destroy(tsr_engine_t **e_p)
{
    if (!e_p) return;
    engine_free(*e_p);
    *e_p = NULL;
}

extern "C" int tsr_cuda_copy(void *dst, const void *src, size_t bytes, int to_device, char *err,
                             size_t errlen)
{
    return cuda_fail(NULL, cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice
                                                                 : cudaMemcpyDeviceToHost),
                     "staging copy", err, errlen);
}

extern "C" const tsr_engine_ops_t tsr_engine_cuda = {
    /* .name = */ "cuda",
    /* .device = */ TSR_DEVICE_CUDA,
    /* .kv_elem_bytes = */ 2,
    /* .load = */ cuda_load,
    /* .load_from = */ NULL,    /* a new piece reads all its weights again */
    /* .set_comm = */ cuda_set_comm,
    /* .hidden = */ cuda_hidden,
    /* .step = */ cuda_step,
    /* .last_logits = */ cuda_last_logits,
    /* .release = */ cuda_release,
    /* .kv_usage = */ cuda_kv_usage,
    /* .model = */ cuda_model,
    /* .weight_bytes = */ cuda_weight_bytes,
    /* .kv_bytes = */ cuda_kv_bytes,
    /* .fatal = */ cuda_fatal,
    /* .destroy = */ cuda_destroy,
    /* .stream = */ cuda_stream,
    /* .set_progress = */ cuda_set_progress,
    /* .set_alive = */ NULL,     /* its finished steps are its signs of life: a step
                                   must fit in collective_timeout_ms */
    /* .kvpool = */ cuda_kvpool,
    /* .set_seq_comm = */ NULL, /* refuses parallel.sequence above 1 (cuda_load) */
};
