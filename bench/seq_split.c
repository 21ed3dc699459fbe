/* seq_split.c: the CPU engine's sequence split alone (tsr_piece_spec_t.seq_size,
 * no daemons): time to first token and decode speed of one long prompt at
 * split 1 and 2, each rank one thread pinned to a core of its own, the
 * ranks talking over loopback TCP as a replica's would.
 *   seq_split MODEL_DIR [--prompts P1,P2,...] [--decodes N] [--chunk C]
 *
 * For each prompt length P and split S (1, then 2 where this process may
 * use 2 CPUs): S fresh engines (max_seq_len P + N, one sequence, a pool of
 * exactly its blocks) prefill P token ids in chunks of C (default 128, the
 * deployment default prefill_chunk), sampling after the last one: the time
 * to first token; then N decode steps (default 16) at that context: tokens
 * per second.  Prints both for each, and split 2 against split 1. */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/util.h"
#include "worker/collective.h"
#include "worker/engine.h"

#define MAXS 2

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

typedef struct {
    const char *dir;
    int rank, n, prompt, decodes, chunk;
    int cpu;                    /* the CPU its thread is pinned to */
    tsr_tcp_listener_t *l;
    const char *const *eps;
    double ttft, decode_s;
    int rc;
    char err[512];
} rank_t;

static const uint8_t SECRET[32] = "bench/seq_split loopback secret";

static void *rank_main(void *arg)
{
    rank_t *k = arg;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(k->cpu, &one);
    k->rc = -1;
    if (pthread_setaffinity_np(pthread_self(), sizeof one, &one)) {
        snprintf(k->err, sizeof k->err, "cannot pin to CPU %d", k->cpu);
        return NULL;
    }
    tsr_model_info_t m;
    tsr_engine_t *e = NULL;
    tsr_comm_t *seq = NULL;
    if (tsr_model_info_load(k->dir, &m, k->err, sizeof k->err) < 0) return NULL;
    const int len = k->prompt + k->decodes;
    tsr_piece_spec_t spec = {.tp_size = 1, .pp_size = 1, .layer_end = m.num_hidden_layers,
                             .max_seq_len = len, .max_seqs = 1, .max_tokens = k->chunk,
                             .kv_blocks = tsr_kv_blocks_for(len) + k->n, .threads = 1,
                             .seq_rank = k->rank, .seq_size = k->n};
    if (tsr_engine_cpu.load(k->dir, &spec, &e, k->err, sizeof k->err) < 0) return NULL;
    tsr_engine_cpu.set_comm(e, &tsr_coll_tcp, NULL, 0);
    if (k->n > 1) {
        if (!(seq = tsr_tcp_comm_new_cancellable(k->l, 1, 1, k->rank, k->n, k->eps, SECRET,
                                                 sizeof SECRET, 60000, NULL, NULL, k->err,
                                                 sizeof k->err)))
            goto out;
        tsr_engine_cpu.set_seq_comm(e, seq);
    }
    int32_t *tokens = malloc(sizeof(int32_t) * (size_t)k->chunk), sampled;
    if (!tokens) goto out;
    double t0 = now_s();
    for (int p = 0; p < len; ) {
        const int n = p < k->prompt ? (k->prompt - p < k->chunk ? k->prompt - p : k->chunk) : 1;
        const int last = p + n >= k->prompt;
        for (int i = 0; i < n; i++) tokens[i] = (int32_t)((p + i) * 29 % (m.vocab_size - 3)) + 3;
        tsr_entry_t en = {0, p, n, last, 0.0f, 1.0f, 0};
        tsr_batch_t b = {&en, 1, tokens, n};
        if (tsr_engine_cpu.step(e, &b, &sampled, k->err, sizeof k->err) < 0) {
            free(tokens);
            goto out;
        }
        p += n;
        if (p == k->prompt) k->ttft = now_s() - t0, t0 = now_s();
    }
    k->decode_s = now_s() - t0;
    free(tokens);
    k->rc = 0;
out:
    tsr_engine_cpu.destroy(&e);
    if (seq) tsr_coll_tcp.destroy(&seq);
    return NULL;
}

/* One run at split n, rank i pinned to cpus[i]: rank 0's time to first
 * token and decode time. */
static int run(const char *dir, int n, const int *cpus, int prompt, int decodes, int chunk,
               double *ttft, double *decode_s)
{
    tsr_tcp_listener_t *l[MAXS];
    const char *eps[MAXS];
    rank_t k[MAXS];
    pthread_t th[MAXS];
    char err[256];
    int rc = 0, started = 0;
    for (int i = 0; i < n; i++) l[i] = NULL;
    for (int i = 0; i < n && !rc; i++) {
        if (!(l[i] = tsr_tcp_listen("127.0.0.1", 0, err, sizeof err))) {
            fprintf(stderr, "seq_split: %s\n", err);
            rc = -1;
        } else {
            eps[i] = tsr_tcp_listener_endpoint(l[i]);
        }
    }
    for (int i = 0; i < n && !rc; i++) {
        k[i] = (rank_t){.dir = dir, .rank = i, .n = n, .prompt = prompt, .decodes = decodes,
                        .chunk = chunk, .cpu = cpus[i], .l = l[i], .eps = eps};
        if (pthread_create(&th[i], NULL, rank_main, &k[i])) {
            fprintf(stderr, "seq_split: cannot start rank %d's thread\n", i);
            rc = -1;
        } else {
            started++;
        }
    }
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    if (rc) {
        for (int i = 0; i < n; i++) tsr_tcp_listener_destroy(&l[i]);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (k[i].rc < 0) {
            fprintf(stderr, "seq_split: split %d, rank %d: %s\n", n, i, k[i].err);
            rc = -1;
        }
        tsr_tcp_listener_destroy(&l[i]);
    }
    *ttft = k[0].ttft;
    *decode_s = k[0].decode_s;
    return rc;
}

int main(int argc, char **argv)
{
    const char *dir = NULL, *prompts = "2048,8192,16384";
    int decodes = 16, chunk = 128;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--prompts") && i + 1 < argc) prompts = argv[++i];
        else if (!strcmp(argv[i], "--decodes") && i + 1 < argc) decodes = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--chunk") && i + 1 < argc) chunk = atoi(argv[++i]);
        else if (argv[i][0] != '-' && !dir) dir = argv[i];
        else dir = NULL, i = argc;
    }
    if (!dir || decodes < 1 || chunk < 1 || chunk > 4096) {
        fprintf(stderr, "usage: seq_split MODEL_DIR [--prompts P1,P2,...] [--decodes N (>= 1)] "
                        "[--chunk C (1..4096)]\n");
        return 2;
    }
    cpu_set_t set;
    int cpus[MAXS] = {0}, ncpu = 0;   /* the first CPUs this process may use */
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        for (int c = 0; c < CPU_SETSIZE && ncpu < MAXS; c++)
            if (CPU_ISSET(c, &set)) cpus[ncpu++] = c;
    if (!ncpu) ncpu = 1;
    const int splits = ncpu >= 2 ? 2 : 1;
    tsr_model_info_t m;
    char err[512];
    if (tsr_model_info_load(dir, &m, err, sizeof err) < 0) {
        fprintf(stderr, "seq_split: %s\n", err);
        return 1;
    }
    printf("seq_split: %s (hidden %d, %d layers, %d heads over %d KV heads of %d), one thread "
           "per rank pinned to a core, prefill chunks of %d, %d decode steps%s\n",
           dir, m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads,
           m.head_dim, chunk, decodes, splits < 2 ? "; one CPU: split 2 not measured" : "");
    char *list = strdup(prompts), *save = NULL;
    int rc = 0;
    for (char *tok = strtok_r(list, ",", &save); tok && !rc; tok = strtok_r(NULL, ",", &save)) {
        const int P = atoi(tok);
        if (P < 1 || P + decodes > m.max_position_embeddings) {
            fprintf(stderr, "seq_split: prompt %s: must be 1 to %d (max_position_embeddings less "
                            "the decodes)\n", tok, m.max_position_embeddings - decodes);
            rc = 2;
            break;
        }
        double ttft[MAXS + 1], dec[MAXS + 1];
        for (int s = 1; s <= splits && !rc; s++) {
            if (run(dir, s, cpus, P, decodes, chunk, &ttft[s], &dec[s]) < 0) rc = 1;
            else
                printf("prompt %6d, split %d: time to first token %8.1f ms, decode %7.1f "
                       "tokens/s\n", P, s, ttft[s] * 1e3, decodes / dec[s]);
        }
        if (!rc && splits == 2)
            printf("prompt %6d: split 2 against 1: time to first token %.2fx, decode %.2fx\n", P,
                   ttft[2] / ttft[1], dec[1] / dec[2]);
    }
    free(list);
    return rc;
}
