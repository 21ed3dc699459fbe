/* engine_step.c: the CPU engine's decode step alone, no daemons: how its
 * time grows with the context, with the KV cache in f32, bf16 and int8.
 *   engine_step MODEL_DIR [--seqs S] [--contexts C1,C2,...] [--steps N] [--threads T]
 *               [--matmul-dtype f32|bf16] [--weights-dtype int8] [--kv-dtype f32|bf16|int8]
 *
 * For each context C, a fresh engine (max_batch S, the pool exactly S
 * sequences of C + N positions) prefills S sequences of C tokens, then runs
 * N decode steps of all S together; it prints the best and the median step,
 * and, against the step at the smallest context, what the growth costs per
 * KV byte read (the decode's attention and cache reads: weights and
 * products are the same at every context), and the prefill's rate (S
 * prompts of C tokens, one sequence a step in chunks of 128, on a fresh
 * pool: its first writes fault its pages in).  Defaults: 32 sequences,
 * contexts 16,200,400, 20 steps, every KV type (--kv-dtype: that one alone),
 * every CPU, f32 weights (--matmul-dtype bf16:
 * the weights in bf16, on AMX where the CPU has it; --weights-dtype int8: in
 * int8 with a scale a row, integer products). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/util.h"
#include "worker/cpu_kernels.h"
#include "worker/engine.h"
#include "worker/matmul_bf16.h"
#include "worker/matmul_i8.h"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Best and median decode step of S sequences at context ctx; -1 on error. */
static int measure(const char *dir, const tsr_model_info_t *m, int S, int ctx, int steps,
                   int threads, int kv_dtype, int mm_dtype, int wt_dtype, double *best, double *median,
                   double *prefill)
{
    char err[512];
    const int chunk = 128, len = ctx + steps;
    tsr_piece_spec_t spec = {0, 1, 0, 1, 0, m->num_hidden_layers, len, S, S + chunk,
                             S * tsr_kv_blocks_for(len), threads, 0, kv_dtype, mm_dtype, wt_dtype, 0, 1};
    tsr_engine_t *e = NULL;
    if (tsr_engine_cpu.load(dir, &spec, &e, err, sizeof err) < 0) {
        fprintf(stderr, "engine_step: %s\n", err);
        return -1;
    }
    int32_t *tok = malloc(sizeof *tok * (size_t)(S + chunk)), *sampled = malloc(sizeof *sampled * (size_t)S);
    tsr_entry_t *en = malloc(sizeof *en * (size_t)S);
    double *t = malloc(sizeof *t * (size_t)steps);
    int rc = -1;
    double p0 = now_s();
    for (int s = 0; s < S; s++)
        for (int p = 0; p < ctx; p += chunk) {
            int n = ctx - p < chunk ? ctx - p : chunk;
            en[0] = (tsr_entry_t){s, p, n, p + n == ctx, 0.0f, 1.0f, 0};
            for (int i = 0; i < n; i++) tok[i] = 3 + (s * 7 + p + i) % 250;
            tsr_batch_t b = {en, 1, tok, n};
            if (tsr_engine_cpu.step(e, &b, sampled, err, sizeof err) < 0) goto out;
        }
    *prefill = now_s() - p0;
    for (int k = 0; k < steps; k++) {
        for (int s = 0; s < S; s++) en[s] = (tsr_entry_t){s, ctx + k, 1, 1, 0.0f, 1.0f, 0}, tok[s] = 5;
        tsr_batch_t b = {en, S, tok, S};
        double t0 = now_s();
        if (tsr_engine_cpu.step(e, &b, sampled, err, sizeof err) < 0) goto out;
        t[k] = now_s() - t0;
    }
    qsort(t, (size_t)steps, sizeof *t, cmp_double);
    *best = t[0], *median = t[steps / 2];
    rc = 0;
out:
    if (rc) fprintf(stderr, "engine_step: %s\n", err);
    tsr_engine_cpu.destroy(&e);
    free(tok), free(sampled), free(en), free(t);
    return rc;
}

int main(int argc, char **argv)
{
    int S = 32, steps = 20, threads = 0, n_ctx = 0, ctxs[16], mm = TSR_KV_F32, wt = TSR_KV_AUTO,
        only_kv = -1;
    const char *dir = NULL, *list = "16,200,400";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--seqs") && i + 1 < argc) S = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--contexts") && i + 1 < argc) list = argv[++i];
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--matmul-dtype") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "f32") || !strcmp(argv[i + 1], "bf16")))
            mm = !strcmp(argv[++i], "bf16") ? TSR_KV_BF16 : TSR_KV_F32;
        else if (!strcmp(argv[i], "--weights-dtype") && i + 1 < argc && !strcmp(argv[i + 1], "int8"))
            wt = TSR_KV_INT8, i++;
        else if (!strcmp(argv[i], "--kv-dtype") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "f32") || !strcmp(argv[i + 1], "bf16") ||
                  !strcmp(argv[i + 1], "int8")))
            only_kv = !strcmp(argv[i + 1], "f32") ? TSR_KV_F32 : !strcmp(argv[i + 1], "bf16") ? TSR_KV_BF16
                                                                                     : TSR_KV_INT8,
            i++;
        else if (argv[i][0] != '-' && !dir) dir = argv[i];
        else {
            fprintf(stderr, "usage: engine_step MODEL_DIR [--seqs S] [--contexts C1,C2,...] "
                            "[--steps N] [--threads T] [--matmul-dtype f32|bf16] "
                            "[--weights-dtype int8] [--kv-dtype f32|bf16|int8]\n");
            return 2;
        }
    }
    for (const char *p = list; *p && n_ctx < 16; p = strchr(p, ',') ? strchr(p, ',') + 1 : "")
        ctxs[n_ctx++] = atoi(p);
    if (!dir || S < 1 || S > 1024 || steps < 1 || n_ctx < 1) {
        fprintf(stderr, "engine_step: need a model directory, 1 to 1024 sequences, steps >= 1 "
                        "and contexts\n");
        return 2;
    }
    tsr_model_info_t m;
    char err[512];
    if (tsr_model_info_load(dir, &m, err, sizeof err) < 0) {
        fprintf(stderr, "engine_step: %s\n", err);
        return 1;
    }
    for (int i = 0; i < n_ctx; i++)
        if (ctxs[i] < 1 || ctxs[i] + steps > m.max_position_embeddings) {
            fprintf(stderr, "engine_step: context %d: must be 1 to %d (max_position_embeddings "
                            "less the steps)\n", ctxs[i], m.max_position_embeddings - steps);
            return 2;
        }
    char th[16];
    snprintf(th, sizeof th, "%d", threads);
    printf("engine_step: %s (hidden %d, %d layers, %d KV heads of %d), %d sequences, %d decode "
           "steps at each context, %s threads, %s kernels, %s weights%s%s\n", dir, m.hidden_size,
           m.num_hidden_layers, m.num_key_value_heads, m.head_dim, S, steps, threads ? th : "all",
           tsr_cpu_kernels_name(tsr_cpu_kernels()), tsr_kv_dtype_name(wt == TSR_KV_INT8 ? wt : mm),
           mm == TSR_KV_BF16 || wt == TSR_KV_INT8 ? ", products: " : "",
           mm == TSR_KV_BF16 ? tsr_bf16_products_name()
           : wt == TSR_KV_INT8 ? tsr_i8_products_name() : "");
    static const int kinds[3] = {TSR_KV_F32, TSR_KV_BF16, TSR_KV_INT8};
    for (int k = 0; k < 3; k++) {
        if (only_kv >= 0 && kinds[k] != only_kv) continue;
        double base = 0;
        for (int i = 0; i < n_ctx; i++) {
            double best, med, pre;
            if (measure(dir, &m, S, ctxs[i], steps, threads, kinds[k], mm, wt, &best, &med, &pre) < 0)
                return 1;
            /* K and V of every layer at the steps' middle position */
            double pos = ctxs[i] + steps / 2.0,
                   kv = (double)S * pos * m.num_hidden_layers * 2 * m.num_key_value_heads *
                        tsr_kv_row_bytes(kinds[k], m.head_dim);
            printf("  kv %-4s context %4d: step best %7.2f ms, median %7.2f ms; KV read %6.1f MB",
                   tsr_kv_dtype_name(kinds[k]), ctxs[i], best * 1e3, med * 1e3, kv / 1e6);
            if (i == 0) base = best;
            else printf("; over context %d: +%.2f ms", ctxs[0], (best - base) * 1e3);
            printf("; prefill %.0f tok/s\n", (double)S * ctxs[i] / pre);
        }
    }
    return 0;
}
