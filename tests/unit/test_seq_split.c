/* test_seq_split.c: the CPU engine's sequence split (parallel.sequence,
 * tsr_piece_spec_t.seq_size): N ranks each hold the KV blocks whose ids
 * are theirs (id % N), attend over those, and merge their partial softmax
 * states through a TCP communicator (loopback, one thread per rank).
 * Against the same piece unsplit: every sampled row's logits within 1e-4
 * of the row's largest, for prompts of 1 to 1,500 positions prefilled in
 * chunks and then decoded, two sequences sharing steps, at split 2 and 3,
 * alone, beside tensor parallelism of 2 and in both stages of a pipeline
 * of 2, with f32, bf16 and int8 KV caches and bf16 products; every rank of a split gets the
 * same bits; each holds 1/N of the KV bytes; and a context longer than one
 * rank's blocks is served by the split where the unsplit piece with the
 * same blocks cannot hold it. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "worker/collective.h"
#include "worker/engine.h"

#define MAXR 8
#define MAX_SEQ 1600
#define CHUNK 128
#define FORM_MS 10000

static char dir[64];
static int vocab;

static int32_t token_at(int seq, int p)
{
    return (int32_t)((seq * 131 + p * 29 + 7) % 250) + 3;
}

/* What one run does: two sequences (slots 0 and 1) with prompts of len[0]
 * and len[1] positions, prefilled CHUNK at a time in shared steps, then
 * `decodes` steps of one position each (the next position's token is
 * token_at's, not the sample, so every layout sees the same inputs).
 * Every step samples each sequence whose prompt is done: its logits rows
 * go to out, step after step. */
typedef struct {
    int len[2], decodes, kv_blocks;
    int kv_dtype, matmul_dtype;     /* tsr_kv_dtype_t's values; 0: f32 */
} script_t;

/* The rows a script samples (run_script's loop without an engine). */
static int script_rows(const script_t *s)
{
    int p[2] = {0, 0}, rows = 0;
    for (int d = 0;;) {
        int ne = 0;
        for (int q = 0; q < 2; q++) {
            const int end = s->len[q] + d;
            if (p[q] >= end) continue;
            const int n = end - p[q] < CHUNK ? end - p[q] : CHUNK;
            p[q] += n;
            rows += p[q] == end;
            ne++;
        }
        if (!ne) {
            if (d == s->decodes) break;
            d++;
        }
    }
    return rows;
}

/* Runs the script on e, a piece of stage `stage` of pp: a stage after the
 * first takes each step's hidden rows from prev, one before the last hands
 * its rows to next (both links of two, this piece's rank given); on the
 * last stage's tp rank 0 the logits go to out (rows * vocab).  0, or -1
 * with err. */
static int run_script(tsr_engine_t *e, const script_t *s, int tp_rank, int stage, int pp,
                      tsr_comm_t *prev, tsr_comm_t *next, float *out, char *err, size_t errlen)
{
    const int H = tsr_engine_cpu.model(e)->hidden_size, last_stage = stage == pp - 1;
    int p[2] = {0, 0}, rows = 0;
    for (int d = 0;;) {
        tsr_entry_t en[2];
        int32_t tokens[2 * CHUNK], sampled[2];
        int ne = 0, nt = 0, ns = 0;
        for (int q = 0; q < 2; q++) {
            const int end = s->len[q] + d;
            if (p[q] >= end) continue;
            const int n = end - p[q] < CHUNK ? end - p[q] : CHUNK, last = p[q] + n == end;
            en[ne++] = (tsr_entry_t){q, p[q], n, last, 0.0f, 1.0f, 0};
            for (int k = p[q]; k < p[q] + n; k++) tokens[nt++] = token_at(q, k);
            p[q] += n;
            ns += last;
        }
        if (!ne) {
            if (d == s->decodes) break;
            d++;
            continue;
        }
        tsr_batch_t b = {en, ne, tokens, nt};
        const tsr_buf_t in = tsr_buf_head(tsr_engine_cpu.hidden(e, 0), (size_t)nt * H),
                        out_rows = tsr_buf_head(tsr_engine_cpu.hidden(e, 1), (size_t)nt * H);
        if ((prev && tsr_coll_recv(&tsr_coll_tcp, prev, 0, in, FORM_MS, err, errlen) < 0) ||
            tsr_engine_cpu.step(e, &b, sampled, err, errlen) < 0 ||
            (next && tsr_coll_send(&tsr_coll_tcp, next, 1, out_rows, FORM_MS, err, errlen) < 0))
            return -1;
        if (ns && tp_rank == 0 && last_stage) {
            if (tsr_engine_cpu.last_logits(e, out + (size_t)rows * vocab, ns) != ns) {
                snprintf(err, errlen, "last_logits gave fewer than %d rows", ns);
                return -1;
            }
        }
        rows += ns;
    }
    return 0;
}

/* One rank of a layout of pp stages of tp x seq ranks. */
typedef struct {
    int tp_rank, tp, seq_rank, seq, stage, pp;
    const script_t *s;
    tsr_tcp_listener_t *l;
    const char *const *eps;     /* every rank's endpoint, rank = (stage * seq + seq_rank) *
                                   tp + tp_rank */
    float *out;                 /* the last stage's tp rank 0: the script's logits */
    uint64_t kv_bytes;
    int rc;
    char err[512];
} rank_t;

static void *rank_main(void *arg)
{
    rank_t *k = arg;
    tsr_model_info_t m;
    tsr_comm_t *tpc = NULL, *seqc = NULL, *prev = NULL, *next = NULL;
    tsr_engine_t *e = NULL;
    k->rc = -1;
    if (tsr_model_info_load(dir, &m, k->err, sizeof k->err) < 0) return NULL;
    tsr_piece_spec_t spec = {.tp_rank = k->tp_rank, .tp_size = k->tp, .stage = k->stage,
                             .pp_size = k->pp,
                             .max_seq_len = MAX_SEQ, .max_seqs = 2, .max_tokens = 2 * CHUNK,
                             .kv_blocks = k->s->kv_blocks, .threads = 1,
                             .kv_dtype = k->s->kv_dtype, .matmul_dtype = k->s->matmul_dtype,
                             .seq_rank = k->seq_rank, .seq_size = k->seq};
    tsr_layer_split(m.num_hidden_layers, k->pp, k->stage, &spec.layer_begin, &spec.layer_end);
    if (tsr_engine_cpu.load(dir, &spec, &e, k->err, sizeof k->err) < 0) goto out;
    const char *peers[MAXR];
    const int w = k->seq * k->tp, base = k->stage * w;   /* this stage's ranks */
    const uint64_t sg = 100 * (uint64_t)k->stage;
    if (k->tp > 1) {   /* the tp ranks of this seq rank */
        for (int t = 0; t < k->tp; t++) peers[t] = k->eps[base + k->seq_rank * k->tp + t];
        if (!(tpc = tsr_tcp_comm_new(k->l, 1, sg + 10 + (uint64_t)k->seq_rank, k->tp_rank, k->tp,
                                     peers, FORM_MS, k->err, sizeof k->err)))
            goto out;
    }
    tsr_engine_cpu.set_comm(e, &tsr_coll_tcp, tpc, 0);
    if (k->seq > 1) {   /* the seq ranks of this tp rank */
        for (int q = 0; q < k->seq; q++) peers[q] = k->eps[base + q * k->tp + k->tp_rank];
        if (!(seqc = tsr_tcp_comm_new(k->l, 1, sg + 20 + (uint64_t)k->tp_rank, k->seq_rank, k->seq,
                                      peers, FORM_MS, k->err, sizeof k->err)))
            goto out;
        tsr_engine_cpu.set_seq_comm(e, seqc);
    }
    const int me = base + k->seq_rank * k->tp + k->tp_rank;
    if (k->stage > 0) {   /* the same (seq, tp) rank of the stage before */
        peers[0] = k->eps[me - w], peers[1] = k->eps[me];
        if (!(prev = tsr_tcp_comm_new(k->l, 1, 1000 + (uint64_t)(me - w), 1, 2, peers, FORM_MS,
                                      k->err, sizeof k->err)))
            goto out;
    }
    if (k->stage < k->pp - 1) {
        peers[0] = k->eps[me], peers[1] = k->eps[me + w];
        if (!(next = tsr_tcp_comm_new(k->l, 1, 1000 + (uint64_t)me, 0, 2, peers, FORM_MS, k->err,
                                      sizeof k->err)))
            goto out;
    }
    k->kv_bytes = tsr_engine_cpu.kv_bytes(e);
    k->rc = run_script(e, k->s, k->tp_rank, k->stage, k->pp, prev, next, k->out, k->err,
                       sizeof k->err);
out:
    tsr_engine_cpu.destroy(&e);
    if (tpc) tsr_coll_tcp.destroy(&tpc);
    if (seqc) tsr_coll_tcp.destroy(&seqc);
    if (prev) tsr_coll_tcp.destroy(&prev);
    if (next) tsr_coll_tcp.destroy(&next);
    return NULL;
}

/* Runs script s on pp stages of tp x seq ranks; the logits of the last
 * stage's seq rank r's tp rank 0 go to outs[r] (rows * vocab each); the
 * first stage's ranks' KV bytes to kv_bytes.  -1 (and the first rank's
 * error in err) when a rank failed. */
static int run_layout(const script_t *s, int tp, int seq, int pp, float **outs,
                      uint64_t *kv_bytes, char *err, size_t errlen)
{
    const int n = tp * seq * pp, w = tp * seq;
    tsr_tcp_listener_t *l[MAXR];
    const char *eps[MAXR];
    rank_t k[MAXR];
    pthread_t th[MAXR];
    char lerr[256];
    for (int i = 0; i < n; i++) {
        l[i] = tsr_tcp_listen("127.0.0.1", 0, lerr, sizeof lerr);
        if (!l[i]) fail_msg("%s", lerr);
        eps[i] = tsr_tcp_listener_endpoint(l[i]);
    }
    for (int i = 0; i < n; i++) {
        k[i] = (rank_t){.tp_rank = i % tp, .tp = tp, .seq_rank = i % w / tp, .seq = seq,
                        .stage = i / w, .pp = pp, .s = s, .l = l[i], .eps = eps,
                        .out = outs[i % w / tp]};
        assert_int_equal(pthread_create(&th[i], NULL, rank_main, &k[i]), 0);
    }
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    int rc = 0;
    for (int i = 0; i < n; i++) {
        if (k[i].rc < 0 && !rc) {
            snprintf(err, errlen, "tp rank %d, seq rank %d: %s", k[i].tp_rank, k[i].seq_rank,
                     k[i].err);
            rc = -1;
        }
        if (kv_bytes && i < w) kv_bytes[i] = k[i].kv_bytes;
        tsr_tcp_listener_destroy(&l[i]);
    }
    return rc;
}

/* Largest |a - b| over a row against the row's largest |b|. */
static double worst_rel(const float *a, const float *b, int rows)
{
    double worst = 0;
    for (int r = 0; r < rows; r++) {
        double big = 0, d = 0;
        for (int v = 0; v < vocab; v++) {
            const double x = fabs((double)b[(size_t)r * vocab + v]),
                         y = fabs((double)a[(size_t)r * vocab + v] - b[(size_t)r * vocab + v]);
            big = x > big ? x : big;
            d = y > d ? y : d;
        }
        if (d / big > worst) worst = d / big;
    }
    return worst;
}

/* The script at split 2 and 3 (with tp) against the unsplit piece (with
 * the same tp): logits within 1e-4 of each row's largest, every seq rank
 * the same bits, each holding its share of the KV bytes. */
static void check_splits(const script_t *s, int tp, int pp)
{
    const int rows = script_rows(s);
    char err[512];
    float *base = calloc((size_t)rows * vocab, sizeof(float));
    uint64_t base_kv[MAXR], kv[MAXR];
    assert_non_null(base);
    if (run_layout(s, tp, 1, 1, &base, base_kv, err, sizeof err) < 0) fail_msg("unsplit: %s", err);
    for (int seq = 2; seq <= 3; seq++) {
        float *outs[3];
        for (int q = 0; q < seq; q++) assert_non_null(outs[q] = calloc((size_t)rows * vocab, sizeof(float)));
        if (run_layout(s, tp, seq, pp, outs, kv, err, sizeof err) < 0)
            fail_msg("tp %d, pp %d, sequence %d, prompts %d and %d: %s", tp, pp, seq, s->len[0],
                     s->len[1], err);
        const double w = worst_rel(outs[0], base, rows);
        printf("tp %d, pp %d, sequence %d, prompts %d and %d, %d decodes, kv_dtype %d, "
               "matmul_dtype %d: %d rows, worst logit difference %.2e of the row's largest\n", tp,
               pp, seq, s->len[0], s->len[1], s->decodes, s->kv_dtype, s->matmul_dtype, rows, w);
        if (!(w <= 1e-4))
            fail_msg("tp %d, sequence %d, prompts %d and %d: logits differ by %.3g of the row's "
                     "largest from the unsplit piece's", tp, seq, s->len[0], s->len[1], w);
        for (int q = 1; q < seq; q++)
            if (memcmp(outs[q], outs[0], (size_t)rows * vocab * sizeof(float)))
                fail_msg("tp %d, sequence %d: seq rank %d's logits are not seq rank 0's bits", tp,
                         seq, q);
        /* each holds ceil(blocks / seq) of the blocks */
        const uint64_t want = base_kv[0] / (uint64_t)s->kv_blocks *
                              (uint64_t)((s->kv_blocks + seq - 1) / seq);
        const uint64_t per_stage = pp > 1 ? 2 : 1;   /* base_kv: every layer; a stage: half */
        for (int i = 0; i < tp * seq; i++)
            if (kv[i] * per_stage != want)
                fail_msg("tp %d, sequence %d: rank %d holds %llu KV bytes, not %llu", tp, seq, i,
                         (unsigned long long)kv[i], (unsigned long long)want);
        for (int q = 0; q < seq; q++) free(outs[q]);
    }
    free(base);
}

static void test_a_split_sequence_gives_the_unsplit_logits(void **state)
{
    (void)state;
    static const script_t scripts[] = {{{1, 2}, 3, 64, 0, 0},
                                       {{17, 40}, 4, 64, 0, 0},
                                       {{300, 129}, 3, 64, 0, 0},
                                       {{1500, 33}, 2, 200, 0, 0}};
    for (size_t i = 0; i < sizeof scripts / sizeof *scripts; i++) check_splits(&scripts[i], 1, 1);
}

/* The KV cache in bf16 and in int8 (a scale per row: the holder writes
 * it), and bf16 products, split as f32 is. */
static void test_a_split_in_each_number_format_gives_the_unsplit_logits(void **state)
{
    (void)state;
    static const script_t scripts[] = {{{150, 37}, 3, 64, TSR_KV_BF16, 0},
                                       {{150, 37}, 3, 64, TSR_KV_INT8, 0},
                                       {{150, 37}, 3, 64, 0, TSR_KV_BF16}};
    for (size_t i = 0; i < sizeof scripts / sizeof *scripts; i++) check_splits(&scripts[i], 1, 1);
}

static void test_a_split_beside_tensor_parallelism_gives_the_unsplit_logits(void **state)
{
    (void)state;
    static const script_t s = {{200, 45}, 3, 64, 0, 0};
    check_splits(&s, 2, 1);
}

/* Two pipeline stages (a layer each), each split: the second stage's
 * ranks take the first's rows from the same (seq, tp) rank. */
static void test_split_stages_of_a_pipeline_give_the_unsplit_logits(void **state)
{
    (void)state;
    static const script_t s = {{170, 60}, 3, 64, 0, 0};
    check_splits(&s, 1, 2);
}

/* 40 blocks hold 640 positions: one sequence of 900 does not fit the
 * unsplit piece's pool; split in 2, with 40 blocks each (80 in all), it
 * is served, and its logits are those of an unsplit piece of 80 blocks. */
static void test_a_context_longer_than_one_ranks_pool_is_served_split(void **state)
{
    (void)state;
    const script_t small = {{900, 1}, 1, 40, 0, 0}, split = {{900, 1}, 1, 80, 0, 0};
    const int rows = script_rows(&split);
    char err[512];
    float *a = calloc((size_t)rows * vocab, sizeof(float)),
          *b[2] = {calloc((size_t)rows * vocab, sizeof(float)),
                   calloc((size_t)rows * vocab, sizeof(float))};
    assert_true(a && b[0] && b[1]);
    uint64_t kv_small[MAXR], kv_split[MAXR];
    assert_int_equal(run_layout(&small, 1, 1, 1, &a, kv_small, err, sizeof err), -1);
    printf("unsplit, 40 blocks: %s\n", err);
    assert_non_null(strstr(err, "KV"));
    assert_int_equal(run_layout(&split, 1, 2, 1, b, kv_split, err, sizeof err), 0);
    assert_true(kv_split[0] == kv_small[0] && kv_split[1] == kv_small[0]);
    assert_int_equal(run_layout(&split, 1, 1, 1, &a, NULL, err, sizeof err), 0);
    assert_true(worst_rel(b[0], a, rows) <= 1e-4);
    free(a), free(b[0]), free(b[1]);
}

/* Ranks out of the split and a split without a communicator are named. */
static void test_a_bad_split_is_refused_naming_it(void **state)
{
    (void)state;
    tsr_model_info_t m;
    char err[512];
    assert_int_equal(tsr_model_info_load(dir, &m, err, sizeof err), 0);
    tsr_piece_spec_t spec = {.tp_size = 1, .pp_size = 1, .layer_end = m.num_hidden_layers,
                             .max_seq_len = 64, .max_seqs = 1, .max_tokens = 16, .kv_blocks = 8,
                             .threads = 1, .seq_rank = 2, .seq_size = 2};
    tsr_engine_t *e = NULL;
    assert_int_equal(tsr_engine_cpu.load(dir, &spec, &e, err, sizeof err), -1);
    assert_non_null(strstr(err, "sequence rank 2 of 2"));
    spec.seq_rank = 1;
    assert_int_equal(tsr_engine_cpu.load(dir, &spec, &e, err, sizeof err), 0);
    tsr_engine_cpu.set_comm(e, &tsr_coll_tcp, NULL, 0);
    tsr_entry_t en = {0, 0, 3, 1, 0.0f, 1.0f, 0};
    int32_t tokens[3] = {5, 6, 7}, sampled;
    tsr_batch_t b = {&en, 1, tokens, 3};
    assert_int_equal(tsr_engine_cpu.step(e, &b, &sampled, err, sizeof err), -1);
    assert_non_null(strstr(err, "no communicator"));
    tsr_engine_cpu.destroy(&e);
}

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/tsr-seq-XXXXXX");
    if (!mkdtemp(dir)) return -1;
    char *argv[] = {"model-init", dir, "--hidden", "64", "--intermediate", "96", "--layers", "2",
                    "--heads", "4", "--kv-heads", "2", "--vocab", "260", "--max-pos", "2048",
                    "--seed", "9", "--force", NULL};
    if (tsr_cmd_model_init(19, argv)) return -1;
    tsr_model_info_t m;
    char err[256];
    if (tsr_model_info_load(dir, &m, err, sizeof err) < 0) return -1;
    vocab = m.vocab_size;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    return system(cmd) ? -1 : 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_split_sequence_gives_the_unsplit_logits),
        cmocka_unit_test(test_a_split_in_each_number_format_gives_the_unsplit_logits),
        cmocka_unit_test(test_a_split_beside_tensor_parallelism_gives_the_unsplit_logits),
        cmocka_unit_test(test_split_stages_of_a_pipeline_give_the_unsplit_logits),
        cmocka_unit_test(test_a_context_longer_than_one_ranks_pool_is_served_split),
        cmocka_unit_test(test_a_bad_split_is_refused_naming_it),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
