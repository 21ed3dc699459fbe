/* gpu_bench.cu: the device check's programs (scripts/gpu-check.sh).
 *
 *   gpu_bench compare DIR      the CUDA engine against the CPU engine on the
 *                              checkpoint in DIR: logits of a mixed batch
 *                              (prompt chunks and decodes), then 32 greedy
 *                              tokens of three sequences, and a sampled one
 *   gpu_bench speed DIR        decode tokens/s at batch 1, 8, 32 and 64 and
 *                              prefill tokens/s for a 2,048-token prompt,
 *                              each next to its bound: bytes per step over
 *                              the copy bandwidth measured here, FLOPs over
 *                              the bf16 GEMM rate measured here
 *   gpu_bench nccl             the NCCL backend with the real library on this
 *                              GPU: a 1-rank communicator formed from its
 *                              epoch's blob, an all-reduce of device memory,
 *                              a blob of another epoch refused, an abort and
 *                              a fresh communicator (one GPU allows no more
 *                              ranks), with the formation and operation times
 *   gpu_bench allreduce N      N ranks on GPUs 0..N-1 (one thread each) form
 *                              one NCCL group through the backend, check a
 *                              sum, then time in-place all-reduces of bf16
 *                              buffers from 64 KiB to 1 GiB: time, algorithm
 *                              and bus bandwidth as nccl-tests defines them
 *                              (bus = algorithm x 2(N-1)/N, comparable with
 *                              the link's peak in one direction)
 *
 * Both engines come from the backend table (tsr_backend_for), as in the
 * worker.  `speed` is meant for TSR_CUDA_DUMMY_WEIGHTS=SEED, which fills
 * the weights on the device from a seed, so DIR needs only config.json.
 * Exit status: 0 when every check passed, 1 otherwise. */
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

extern "C" {
#include "common/modelcfg.h"
#include "worker/coll_nccl.h"
#include "worker/engine.h"
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static tsr_engine_t *load(tsr_device_t d, const char *dir, const tsr_piece_spec_t *spec,
                          const tsr_engine_ops_t **ops)
{
    tsr_backend_t be;
    char err[512];
    tsr_engine_t *e = NULL;
    if (tsr_backend_for(d, &be, err, sizeof err) < 0 || be.engine->load(dir, spec, &e, err, sizeof err) < 0) {
        fprintf(stderr, "%s engine: %s\n", d == TSR_DEVICE_CUDA ? "cuda" : "cpu", err);
        return NULL;
    }
    *ops = be.engine;
    return e;
}

/* ---- compare ------------------------------------------------------------------ */

static int compare(const char *dir)
{
    tsr_model_info_t m;
    char err[512];
    if (tsr_model_info_load(dir, &m, err, sizeof err) < 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    tsr_piece_spec_t spec = {0, 1, 0, 1, 0, m.num_hidden_layers, 256, 4, 4 + 192, 64, 0, 0, TSR_KV_AUTO, TSR_KV_AUTO, TSR_KV_AUTO, 0, 1};
    const tsr_engine_ops_t *cpu_ops, *gpu_ops;
    tsr_engine_t *cpu = load(TSR_DEVICE_CPU, dir, &spec, &cpu_ops);
    tsr_engine_t *gpu = load(TSR_DEVICE_CUDA, dir, &spec, &gpu_ops);
    if (!cpu || !gpu) return 1;
    printf("compare: %s, %d layers, hidden %d, vocab %d; cuda holds %.1f MiB of weights, %.1f MiB of KV\n",
           dir, m.num_hidden_layers, m.hidden_size, m.vocab_size,
           gpu_ops->weight_bytes(gpu) / 1048576.0, gpu_ops->kv_bytes(gpu) / 1048576.0);
    const int V = m.vocab_size, NS = 3;
    int len[NS] = {5, 70, 120}, pos[NS] = {0, 0, 0};
    int32_t last[NS], toks[200];
    float *lc = (float *)malloc(sizeof(float) * NS * V), *lg = (float *)malloc(sizeof(float) * NS * V);
    int fails = 0, mismatches = 0, near_ties = 0, kernel_wrong = 0;
    double worst_rel = 0;
    /* A prompt chunk that samples nothing (slot 3), alone in its step. */
    {
        tsr_entry_t en = {3, 0, 16, 0, 0.0f, 1.0f, 0};
        int32_t t16[16] = {0}, none[1];
        tsr_batch_t b = {&en, 1, t16, 16};
        if (cpu_ops->step(cpu, &b, none, err, sizeof err) < 0 || gpu_ops->step(gpu, &b, none, err, sizeof err) < 0) {
            fprintf(stderr, "a step that samples nothing: %s\n", err);
            return 1;
        }
    }
    /* step 0: three prompts in one batch; then 32 decode steps of all
     * three, except step 5, where sequence 0 takes a 12-token chunk beside
     * the others' decodes (a mixed batch) */
    for (int step = 0; step <= 32; step++) {
        tsr_entry_t en[NS];
        int n = 0;
        for (int s = 0; s < NS; s++) {
            int cnt = step == 0 ? len[s] : step == 5 && s == 0 ? 12 : 1;
            en[s] = (tsr_entry_t){s, pos[s], cnt, 1, 0.0f, 1.0f, 0};
            for (int i = 0; i < cnt; i++)
                toks[n++] = step == 0 ? (int32_t)((s * 7919 + i * 104729) % V)
                                      : i == 0 ? last[s] : (int32_t)((i * 31) % V);
        }
        tsr_batch_t b = {en, NS, toks, n};
        int32_t sc[NS], sg[NS];
        if (cpu_ops->step(cpu, &b, sc, err, sizeof err) < 0 || gpu_ops->step(gpu, &b, sg, err, sizeof err) < 0) {
            fprintf(stderr, "step %d: %s\n", step, err);
            return 1;
        }
        cpu_ops->last_logits(cpu, lc, NS);
        gpu_ops->last_logits(gpu, lg, NS);
        for (int s = 0; s < NS; s++) {
            const float *c = lc + (size_t)s * V, *g = lg + (size_t)s * V;
            double mx = 0, d = 0;
            for (int v = 0; v < V; v++) {
                mx = fmax(mx, fabs(c[v]));
                d = fmax(d, fabs(c[v] - g[v]));
            }
            worst_rel = fmax(worst_rel, d / (mx > 0 ? mx : 1));
            /* the GPU's pick is its own logits' first maximum, exactly */
            kernel_wrong += sg[s] != tsr_sample(g, V, 0.0f, 1.0f, 0, 0);
            if (sc[s] != sg[s]) {
                /* a near tie: the CPU's two best differ by less than the
                 * largest logit difference seen in this row */
                double top = -INFINITY, second = -INFINITY;
                for (int v = 0; v < V; v++) {
                    if (c[v] > top) second = top, top = c[v];
                    else if (c[v] > second) second = c[v];
                }
                mismatches++;
                near_ties += top - second <= d;
            }
        }
        for (int s = 0; s < NS; s++) pos[s] += en[s].n, last[s] = sc[s];  /* follow the CPU */
    }
    /* the BF16 tolerance: every logit within 3% of the row's largest magnitude */
    const double tol = 0.03;
    printf("compare: logits of 3 rows x 33 steps: largest difference %.4f of the row's largest "
           "logit (tolerance %.2f)\n", worst_rel, tol);
    printf("compare: greedy tokens of 3 sequences x 33 steps: %d differ from the CPU engine's "
           "(%d of them at a near tie, within the logits' difference); %d differ from the GPU's "
           "own logits' first maximum\n", mismatches, near_ties, kernel_wrong);
    fails += worst_rel > tol;
    fails += mismatches > near_ties;
    fails += kernel_wrong > 0;
    /* sampled: the same (seed, position) draw on both */
    int same_sampled = 0, same_as_rule = 0;
    float *row = (float *)malloc(sizeof(float) * V);
    for (int s = 0; s < NS; s++) cpu_ops->release(cpu, s), gpu_ops->release(gpu, s);
    int p = 0;
    int32_t t = 1;
    for (int step = 0; step < 16; step++) {
        tsr_entry_t en = {0, p, 1, 1, 0.8f, 0.9f, 4242};
        tsr_batch_t b = {&en, 1, &t, 1};
        int32_t a, g;
        if (cpu_ops->step(cpu, &b, &a, err, sizeof err) < 0 || gpu_ops->step(gpu, &b, &g, err, sizeof err) < 0) {
            fprintf(stderr, "sampled step %d: %s\n", step, err);
            return 1;
        }
        same_sampled += a == g;
        /* the GPU's draw is tsr_sample's on the GPU's logits, exactly */
        gpu_ops->last_logits(gpu, row, 1);
        same_as_rule += g == tsr_sample(row, V, 0.8f, 0.9f, 4242, (uint64_t)(p + 1));
        t = a;
        p++;
    }
    printf("compare: sampled tokens (temperature 0.8, top_p 0.9, one seed): the GPU's draw equals "
           "tsr_sample on its own logits in %d of 16 steps, the CPU engine's token in %d\n",
           same_as_rule, same_sampled);
    fails += same_as_rule < 16;
    free(row);
    cpu_ops->destroy(&cpu);
    gpu_ops->destroy(&gpu);
    free(lc);
    free(lg);
    printf("compare: %s\n", fails ? "FAILED" : "passed");
    return fails ? 1 : 0;
}

/* ---- speed ----------------------------------------------------------------------- */

/* Device-to-device copy bandwidth, bytes read plus written per second. */
static double copy_bandwidth(void)
{
    const size_t n = (size_t)2 << 30;
    void *a, *b;
    if (cudaMalloc(&a, n) != cudaSuccess || cudaMalloc(&b, n) != cudaSuccess) return 0;
    cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
    double t = now_s();
    for (int i = 0; i < 10; i++) cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
    double bw = 2.0 * n * 10 / (now_s() - t);
    cudaFree(a);
    cudaFree(b);
    return bw;
}

/* Random BF16 in [-1, 1): zeros would draw less power than real data. */
__global__ void k_random(uint16_t *p, size_t n, unsigned long long seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = tsr_k_f32_to_bf16((float)(tsr_draw(seed, i) * 2 - 1));
}

/* The bf16 GEMM rate (BF16 in, f32 out, as the engine multiplies). */
static double gemm_rate(void)
{
    const int N = 8192;
    void *a, *b, *c;
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return 0;
    cudaMalloc(&a, (size_t)N * N * 2);
    cudaMalloc(&b, (size_t)N * N * 2);
    cudaMalloc(&c, (size_t)N * N * 4);
    k_random<<<1024, 256>>>((uint16_t *)a, (size_t)N * N, 1);
    k_random<<<1024, 256>>>((uint16_t *)b, (size_t)N * N, 2);
    const float one = 1, zero = 0;
    double best = 0;
    for (int i = 0; i < 6; i++) {
        cudaDeviceSynchronize();
        double t = now_s();
        if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, N, N, &one, a, CUDA_R_16BF, N, b,
                         CUDA_R_16BF, N, &zero, c, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "gemm_rate: cublasGemmEx failed\n");
            best = 0;
            break;
        }
        cudaDeviceSynchronize();
        double r = 2.0 * N * N * (double)N / (now_s() - t);
        if (i && r > best) best = r;
    }
    cudaFree(a), cudaFree(b), cudaFree(c);
    cublasDestroy(h);
    return best;
}

static int speed(const char *dir)
{
    tsr_model_info_t m;
    char err[512];
    if (tsr_model_info_load(dir, &m, err, sizeof err) < 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    double bw = copy_bandwidth(), rate = gemm_rate();
    printf("speed: %s (%d SMs); measured copy bandwidth %.0f GB/s, bf16 GEMM %.0f TFLOPS\n",
           prop.name, prop.multiProcessorCount, bw / 1e9, rate / 1e12);
    const int MAXB = 64, PROMPT = 2048, CTX = 128;
    tsr_piece_spec_t spec = {0, 1, 0, 1, 0, m.num_hidden_layers, 4096, MAXB, PROMPT, 0, 0, 0, TSR_KV_AUTO, TSR_KV_AUTO, TSR_KV_AUTO, 0, 1};
    spec.kv_blocks = MAXB * tsr_kv_blocks_for(CTX + 64) + tsr_kv_blocks_for(PROMPT) + 8;
    const tsr_engine_ops_t *ops;
    double t = now_s();
    tsr_engine_t *e = load(TSR_DEVICE_CUDA, dir, &spec, &ops);
    if (!e) return 1;
    const double wbytes = (double)ops->weight_bytes(e);
    printf("speed: %s: %d layers, hidden %d, %.2f B parameters in BF16 (%.1f GiB), loaded in %.1f s\n",
           dir, m.num_hidden_layers, m.hidden_size, wbytes / 2e9, wbytes / (1 << 30), now_s() - t);
    const int H = m.hidden_size, L = m.num_hidden_layers, hd = m.head_dim;
    const double kv_per_pos = 2.0 * L * m.num_key_value_heads * hd * 2;   /* bytes */
    /* parameters multiplied by every prompt row: all but the embedding
     * (a lookup) and the LM head (run for the sampled row only) */
    const double VH = (double)m.vocab_size * H;
    const double mm_params = wbytes / 2 - (m.tie_word_embeddings ? VH : 2 * VH);
    /* bytes a decode step streams: all but an untied embedding */
    const double step_wbytes = wbytes - (m.tie_word_embeddings ? 0 : 2 * VH);
    int32_t *toks = (int32_t *)calloc(PROMPT, 4), out[MAXB];
    tsr_entry_t en[MAXB];
    int batches[] = {1, 8, 32, 64}, fails = 0;
    const bool profile = getenv("TSR_PROFILE") && !strcmp(getenv("TSR_PROFILE"), "1");
    double tps1 = 0, tps64 = 0;
    for (size_t bi = 0; bi < sizeof batches / sizeof batches[0]; bi++) {
        int B = batches[bi];
        for (int s = 0; s < B; s++) ops->release(e, s);
        /* fill each sequence's context, 64 rows at a time */
        for (int p = 0; p < CTX; p += 64)
            for (int s0 = 0; s0 < B; s0++) {
                en[0] = (tsr_entry_t){s0, p, 64, 0, 0, 1, 0};
                tsr_batch_t b = {en, 1, toks, 64};
                if (ops->step(e, &b, out, err, sizeof err) < 0) {
                    fprintf(stderr, "prefill: %s\n", err);
                    return 1;
                }
            }
        const int steps = 40, warm = 4;
        double t0 = 0;
        for (int k = 0; k < steps + warm; k++) {
            if (k == warm) t0 = now_s();
            for (int s = 0; s < B; s++) en[s] = (tsr_entry_t){s, CTX + k, 1, 1, 0, 1, 0};
            tsr_batch_t b = {en, B, toks, B};
            /* TSR_PROFILE=1: one decode step of each batch size between
             * cudaProfilerStart and Stop, for ncu --profile-from-start off */
            bool prof = profile && k == warm - 1;
            if (prof) cudaProfilerStart();
            if (ops->step(e, &b, out, err, sizeof err) < 0) {
                fprintf(stderr, "decode: %s\n", err);
                return 1;
            }
            if (prof) cudaDeviceSynchronize(), cudaProfilerStop();
        }
        double dt = (now_s() - t0) / steps, tps = B / dt;
        double bytes = step_wbytes + B * (CTX + steps / 2.0 + warm) * kv_per_pos;
        double bound = B / (bytes / bw);
        printf("speed: decode batch %2d: %8.1f tokens/s (%.2f ms a step); bandwidth bound %8.1f "
               "tokens/s: %4.1f%%\n", B, tps, dt * 1e3, bound, 100 * tps / bound);
        if (B == 1) tps1 = tps;
        if (B == 64) tps64 = tps;
    }
    printf("speed: decode at batch 64 is %.1fx batch 1 (target 20x)\n", tps64 / tps1);
    for (int s = 0; s < MAXB; s++) ops->release(e, s);
    /* prefill: one 2,048-token prompt in one step */
    double best = 1e9;
    for (int k = 0; k < 4; k++) {
        ops->release(e, 0);
        en[0] = (tsr_entry_t){0, 0, PROMPT, 1, 0, 1, 0};
        tsr_batch_t b = {en, 1, toks, PROMPT};
        double t1 = now_s();
        if (profile && k == 1) cudaProfilerStart();
        if (ops->step(e, &b, out, err, sizeof err) < 0) {
            fprintf(stderr, "prefill: %s\n", err);
            return 1;
        }
        if (k) best = fmin(best, now_s() - t1);
        if (profile && k == 1) cudaDeviceSynchronize(), cudaProfilerStop();
    }
    double flops = 2.0 * mm_params * PROMPT + 2.0 * VH +
                   2.0 * L * m.num_attention_heads * hd * (double)PROMPT * PROMPT;  /* QK^T and PV, causal */
    printf("speed: prefill of %d tokens: %.0f tokens/s (%.1f ms); %.0f TFLOPS achieved, %.1f%% of "
           "the measured bf16 rate\n", PROMPT, PROMPT / best, best * 1e3, flops / best / 1e12,
           100 * flops / best / rate);
    ops->destroy(&e);
    free(toks);
    return fails;
}

/* ---- nccl -------------------------------------------------------------------- */

static int nccl_check(void)
{
    char err[512];
    if (tsr_nccl_real_load(err, sizeof err) < 0) {
        fprintf(stderr, "nccl: %s\n", err);
        return 1;
    }
    cudaStream_t st;
    if (cudaSetDevice(0) != cudaSuccess || cudaStreamCreate(&st) != cudaSuccess) {
        fprintf(stderr, "nccl: no CUDA device\n");
        return 1;
    }
    tsr_coll_ctx_t ctx = {};
    ctx.nccl = &tsr_nccl_real;
    ctx.stream = st;
    const int N = 1 << 20;
    float *d = NULL, *h = (float *)malloc(sizeof(float) * N);
    if (cudaMalloc(&d, sizeof(float) * N) != cudaSuccess || !h) return 1;
    for (int i = 0; i < N; i++) h[i] = (float)(i % 1000);
    int fails = 0;
    for (uint64_t epoch = 1; epoch <= 2; epoch++) {
        uint8_t blob[TSR_NCCL_BLOB_BYTES];
        if (tsr_nccl_blob_make(&tsr_nccl_real, epoch, 7, 1, blob, err, sizeof err) < 0) {
            fprintf(stderr, "nccl: %s\n", err);
            return 1;
        }
        tsr_rendezvous_t rv = {};
        rv.epoch = epoch + 100;  /* another epoch's blob: refused */
        rv.group = 7;
        rv.n = 1;
        rv.blob = blob;
        rv.blob_len = sizeof blob;
        rv.timeout_ms = 30000;
        tsr_comm_t *c = NULL;
        if (tsr_coll_nccl.create(&ctx, &rv, &c, err, sizeof err) == 0 || !strstr(err, "refused")) {
            fprintf(stderr, "nccl: a blob of another epoch was not refused\n");
            fails++;
        }
        rv.epoch = epoch;
        double t0 = now_s();
        if (tsr_coll_nccl.create(&ctx, &rv, &c, err, sizeof err) < 0) {
            fprintf(stderr, "nccl: %s\n", err);
            return 1;
        }
        double formed = now_s() - t0;
        cudaMemcpy(d, h, sizeof(float) * N, cudaMemcpyHostToDevice);
        tsr_buf_t b = {d, (size_t)N, TSR_DT_F32, TSR_MEM_DEVICE};
        t0 = now_s();
        int rc = tsr_coll_nccl.allreduce_sum(c, b, 10000, err, sizeof err);
        if (rc == 0) rc = tsr_coll_nccl.settle(c, 10000, err, sizeof err);   /* queued, then run */
        double took = now_s() - t0;
        float back[4];
        cudaMemcpy(back, d + 1000 * 7 + 3, sizeof back, cudaMemcpyDeviceToHost);
        bool same = rc == 0 && back[0] == 3.0f && back[3] == 6.0f;
        printf("nccl: epoch %llu: 1-rank communicator formed in %.1f ms; all-reduce of %d floats "
               "in %.3f ms: %s\n",
               (unsigned long long)epoch, formed * 1e3, N, took * 1e3,
               same ? "ok" : rc ? err : "WRONG");
        fails += !same;
        tsr_coll_nccl.abort(c, "gpu_bench: an abort, as after a peer's failure");
        if (tsr_coll_nccl.allreduce_sum(c, b, 1000, err, sizeof err) == 0) {
            fprintf(stderr, "nccl: an aborted communicator still ran an operation\n");
            fails++;
        }
        tsr_coll_nccl.destroy(&c);
    }
    cudaFree(d);
    free(h);
    cudaStreamDestroy(st);
    printf("nccl: %s\n", fails ? "FAILED" : "abort and re-formation ok");
    return fails ? 1 : 0;
}

/* ---- allreduce: N ranks, one thread each ----------------------------------- */

#define AR_SIZES 6
static const size_t ar_bytes[AR_SIZES] = {64u << 10, 1u << 20, 16u << 20, 64u << 20,
                                          256u << 20, 1024u << 20};
#define AR_WARMUP 5
#define AR_ITERS 20

typedef struct {
    int rank, n;
    const uint8_t *blob;
    pthread_barrier_t *bar;
    double secs[AR_SIZES];      /* rank 0: the mean time of one all-reduce */
    int fails;
    char err[512];
} ar_rank_t;

/* One rank: forms the group through the backend's create, checks that the
 * sum of the ranks' (rank + 1) is right everywhere, then times AR_ITERS
 * all-reduces of each size after AR_WARMUP, every rank starting together
 * (the barrier) and settling once at the end, as a step does. */
static void *ar_rank(void *arg)
{
    ar_rank_t *a = (ar_rank_t *)arg;
    cudaStream_t st = NULL;
    void *d = NULL;
    tsr_comm_t *c = NULL;
    const size_t most = ar_bytes[AR_SIZES - 1];
    /* Every rank meets every barrier, a failed one too: it skips the work, and its peers'
     * formation or operations fail at their deadline, naming it. */
    if (cudaSetDevice(a->rank) != cudaSuccess || cudaStreamCreate(&st) != cudaSuccess ||
        cudaMalloc(&d, most) != cudaSuccess) {
        snprintf(a->err, sizeof a->err, "rank %d: cannot set up GPU %d", a->rank, a->rank);
        a->fails++;
    }
    pthread_barrier_wait(a->bar);
    tsr_coll_ctx_t ctx = {};
    ctx.nccl = &tsr_nccl_real;
    ctx.device = a->rank;
    ctx.stream = st;
    tsr_rendezvous_t rv = {};
    rv.epoch = 1;
    rv.group = 11;
    rv.rank = a->rank;
    rv.n = a->n;
    rv.blob = a->blob;
    rv.blob_len = TSR_NCCL_BLOB_BYTES;
    rv.timeout_ms = 60000;
    if (!a->fails && tsr_coll_nccl.create(&ctx, &rv, &c, a->err, sizeof a->err) < 0)
        a->fails++;
    if (!a->fails) {
        const size_t n_check = 1 << 16;
        float *h = (float *)malloc(n_check * sizeof(float));
        for (size_t i = 0; i < n_check; i++) h[i] = (float)(a->rank + 1) * (float)(i % 7);
        cudaMemcpy(d, h, n_check * sizeof(float), cudaMemcpyHostToDevice);
        tsr_buf_t b = {d, n_check, TSR_DT_F32, TSR_MEM_DEVICE};
        int rc = tsr_coll_nccl.allreduce_sum(c, b, 30000, a->err, sizeof a->err);
        if (rc == 0) rc = tsr_coll_nccl.settle(c, 30000, a->err, sizeof a->err);
        cudaMemcpy(h, d, n_check * sizeof(float), cudaMemcpyDeviceToHost);
        const float total = (float)(a->n * (a->n + 1) / 2);
        for (size_t i = 0; rc == 0 && i < n_check; i++)
            if (h[i] != total * (float)(i % 7)) {
                snprintf(a->err, sizeof a->err, "rank %d: element %zu is %g, not %g", a->rank, i,
                         h[i], total * (float)(i % 7));
                rc = -1;
            }
        free(h);
        a->fails += rc < 0;
    }
    if (d) cudaMemset(d, 0, most);
    for (int k = 0; k < AR_SIZES; k++) {
        tsr_buf_t b = {d, ar_bytes[k] / 2, TSR_DT_BF16, TSR_MEM_DEVICE};
        int rc = a->fails ? -1 : 0;
        for (int i = 0; rc == 0 && i < AR_WARMUP; i++)
            rc = tsr_coll_nccl.allreduce_sum(c, b, 30000, a->err, sizeof a->err);
        if (rc == 0) rc = tsr_coll_nccl.settle(c, 30000, a->err, sizeof a->err);
        pthread_barrier_wait(a->bar);
        double t0 = now_s();
        for (int i = 0; rc == 0 && i < AR_ITERS; i++)
            rc = tsr_coll_nccl.allreduce_sum(c, b, 30000, a->err, sizeof a->err);
        if (rc == 0) rc = tsr_coll_nccl.settle(c, 30000, a->err, sizeof a->err);
        a->secs[k] = (now_s() - t0) / AR_ITERS;
        pthread_barrier_wait(a->bar);
        if (rc < 0 && !a->fails) a->fails++;
    }
    if (c) tsr_coll_nccl.destroy(&c);
    if (d) cudaFree(d);
    if (st) cudaStreamDestroy(st);
    return NULL;
}

static int allreduce_bench(const char *arg)
{
    char err[512];
    int n = atoi(arg), have = 0;
    cudaGetDeviceCount(&have);
    if (n < 2 || n > have) {
        fprintf(stderr, "allreduce: %s ranks: give 2 to %d, one per GPU of this machine\n", arg,
                have);
        return 2;
    }
    if (tsr_nccl_real_load(err, sizeof err) < 0) {
        fprintf(stderr, "allreduce: %s\n", err);
        return 1;
    }
    uint8_t blob[TSR_NCCL_BLOB_BYTES];
    if (tsr_nccl_blob_make(&tsr_nccl_real, 1, 11, n, blob, err, sizeof err) < 0) {
        fprintf(stderr, "allreduce: %s\n", err);
        return 1;
    }
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)n);
    ar_rank_t *r = (ar_rank_t *)calloc((size_t)n, sizeof *r);
    pthread_t *th = (pthread_t *)calloc((size_t)n, sizeof *th);
    double t0 = now_s();
    for (int i = 0; i < n; i++) {
        r[i].rank = i;
        r[i].n = n;
        r[i].blob = blob;
        r[i].bar = &bar;
        pthread_create(&th[i], NULL, ar_rank, &r[i]);
    }
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    int fails = 0;
    for (int i = 0; i < n; i++)
        if (r[i].fails) {
            fprintf(stderr, "allreduce: rank %d: %s\n", i, r[i].err);
            fails++;
        }
    if (!fails) {
        printf("allreduce: %d ranks on GPUs 0-%d, one NCCL group formed through the backend, "
               "sums right (%.1f s in all); in place, bf16, %d after %d warm-up, settled once:\n",
               n, n - 1, now_s() - t0, AR_ITERS, AR_WARMUP);
        printf("allreduce: %12s %12s %14s %14s\n", "bytes", "time (us)", "algbw (GB/s)",
               "busbw (GB/s)");
        for (int k = 0; k < AR_SIZES; k++) {
            double alg = ar_bytes[k] / r[0].secs[k] / 1e9;
            printf("allreduce: %12zu %12.1f %14.2f %14.2f\n", ar_bytes[k], r[0].secs[k] * 1e6,
                   alg, alg * 2.0 * (n - 1) / n);
        }
    }
    pthread_barrier_destroy(&bar);
    free(r);
    free(th);
    printf("allreduce: %s\n", fails ? "FAILED" : "ok");
    return fails ? 1 : 0;
}

int main(int argc, char **argv)
{
    int n = 0;
    cudaError_t r = cudaGetDeviceCount(&n);
    if (argc == 3 && (r != cudaSuccess || n < 1)) {
        fprintf(stderr, "gpu_bench: no usable GPU: %s\n",
                r != cudaSuccess ? cudaGetErrorString(r) : "the runtime sees no device");
        return 1;
    }
    if (argc == 3 && !strcmp(argv[1], "compare")) return compare(argv[2]);
    if (argc == 3 && !strcmp(argv[1], "speed")) return speed(argv[2]);
    if (argc == 2 && !strcmp(argv[1], "nccl")) return nccl_check();
    if (argc == 3 && !strcmp(argv[1], "allreduce")) return allreduce_bench(argv[2]);
    fprintf(stderr, "usage: gpu_bench compare DIR | gpu_bench speed DIR | gpu_bench nccl | "
                    "gpu_bench allreduce N\n");
    return 2;
}
