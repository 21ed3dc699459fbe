/* test_sharding.c: the same tokens and logits whatever the layout.
 *
 * For every valid tp x pp in {1,2,4}^2 a replica is formed in this process,
 * one thread per rank, each with its own TCP listener, communicators and CPU
 * engine, driven by the replica runner the worker uses.  Greedy tokens for
 * 32 steps must equal those of tp=1 pp=1 and the logits of every step must
 * be within 1e-4 relative.  Four checkpoints: F32 untied GQA, BF16, tied
 * embeddings, and F16 in two shards with llama3 RoPE scaling.  tp=1 pp=1
 * itself is checked against the independent NumPy reference in
 * tests/reference/ (tokens, first- and last-step logits). */
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
#include <unistd.h>

#include "cli/cli.h"
#include "common/budget.h"
#include "replica_harness.h"

#define STEPS 32
#define MAX_RANKS 16

static const int32_t prompt[] = {1, 17, 42, 99, 5, 250, 3};
#define N_PROMPT ((int)(sizeof prompt / sizeof prompt[0]))

typedef struct {
    int32_t tokens[STEPS];
    float *logits;              /* [STEPS][vocab] */
    int vocab;
} result_t;

/* Runs the prompt through a tp x pp replica of the model in dir. */
static void run_layout(const char *dir, int tp, int pp, result_t *res)
{
    h_req_t q = {.prompt = (int32_t *)prompt, .n_prompt = N_PROMPT, .max_tokens = STEPS};
    h_run_t run = {.dir = dir, .tp = tp, .pp = pp, .reqs = &q, .n_reqs = 1, .max_seq_len = 64};
    tsr_model_info_t m;
    char err[256];
    assert_int_equal(tsr_model_info_load(dir, &m, err, sizeof err), 0);
    run.logits = calloc((size_t)H_MAX_TOKENS * m.vocab_size, sizeof(float));
    h_run(&run);
    /* Each rank read only its slice: its weights are its share of the model
     * (held as f32), within the rounding of the vocabulary split and the
     * norms every rank keeps whole. */
    tsr_model_info_t f32 = m;
    f32.dtype_bytes = 4;
    for (int i = 0; i < tp * pp; i++) {
        double share = (double)tsr_model_piece_bytes(&f32, pp, i / tp, tp);
        double ratio = (double)run.weight_bytes[i] / share;
        if (ratio < 0.97 || ratio > 1.03)
            fail_msg("tp %d pp %d rank %d holds %llu bytes of weights, %.2fx its share", tp, pp,
                     i, (unsigned long long)run.weight_bytes[i], ratio);
    }
    if (q.failed) fail_msg("tp %d pp %d: %s", tp, pp, q.error);
    assert_int_equal(q.n_tokens, STEPS);
    assert_int_equal(run.n_logits, STEPS);
    memcpy(res->tokens, q.tokens, sizeof res->tokens);
    res->logits = run.logits;
    res->vocab = m.vocab_size;
}

static double max_rel_diff(const float *a, const float *b, int n)
{
    double md = 0, scale = 0;
    for (int i = 0; i < n; i++) {
        md = fmax(md, fabs((double)a[i] - b[i]));
        scale = fmax(scale, fabs((double)b[i]));
    }
    return md / (scale > 0 ? scale : 1);
}

/* ---- the model and the layouts ------------------------------------------------ */

static char dirs[4][64];

/* extra: more model-init options (NULL-terminated), e.g. llama3 RoPE. */
static int make_model(int which, const char *dtype, int tied, char *const *extra)
{
    snprintf(dirs[which], sizeof dirs[which], "/tmp/tsr-shard-%d-XXXXXX", which);
    if (!mkdtemp(dirs[which])) return -1;
    /* GQA (8 heads over 4 KV heads), a vocabulary that does not divide by 4,
     * and an intermediate size that divides by 4. */
    char *argv[32] = {"model-init", dirs[which], "--hidden", "128", "--intermediate", "256",
                      "--layers", "4", "--heads", "8", "--kv-heads", "4", "--vocab", "390",
                      "--max-pos", "128", "--seed", "11", "--dtype", (char *)dtype, "--force"};
    int argc = 21;
    if (tied) argv[argc++] = "--tied";
    for (int i = 0; extra && extra[i] && argc < 31; i++) argv[argc++] = extra[i];
    argv[argc] = NULL;
    return tsr_cmd_model_init(argc, argv);
}

static void check_layouts(int which)
{
    result_t base, other;
    run_layout(dirs[which], 1, 1, &base);
    static const int tps[] = {1, 2, 4}, pps[] = {1, 2, 4};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            if (tps[a] == 1 && pps[b] == 1) continue;
            run_layout(dirs[which], tps[a], pps[b], &other);
            for (int s = 0; s < STEPS; s++) {
                double d = max_rel_diff(other.logits + (size_t)s * base.vocab,
                                        base.logits + (size_t)s * base.vocab, base.vocab);
                if (d > 1e-4)
                    fail_msg("tp %d pp %d step %d: logits differ by %.3g relative", tps[a],
                             pps[b], s, d);
                if (other.tokens[s] != base.tokens[s])
                    fail_msg("tp %d pp %d step %d: token %d, tp1 pp1 gave %d", tps[a], pps[b],
                             s, other.tokens[s], base.tokens[s]);
            }
            free(other.logits);
        }
    free(base.logits);
}

static void test_f32_untied_gqa_same_under_every_layout(void **state)
{
    (void)state;
    check_layouts(0);
}
static void test_bf16_checkpoint_same_under_every_layout(void **state)
{
    (void)state;
    check_layouts(1);
}
static void test_tied_embeddings_same_under_every_layout(void **state)
{
    (void)state;
    check_layouts(2);
}
static void test_f16_sharded_llama3_rope_same_under_every_layout(void **state)
{
    (void)state;
    check_layouts(3);
}

/* Reads `count` floats from one line of f (space or newline separated). */
static float *read_floats(FILE *f, int count)
{
    float *v = calloc((size_t)count, sizeof *v);
    for (int i = 0; v && i < count; i++)
        if (fscanf(f, "%f", &v[i]) != 1) {
            free(v);
            return NULL;
        }
    return v;
}

/* tp=1 pp=1 against the NumPy reference: tokens identical, first-step
 * logits within 1e-4 relative. */
static void test_matches_numpy_reference(void **state)
{
    (void)state;
    for (int which = 0; which < 4; which++) {
        result_t base;
        run_layout(dirs[which], 1, 1, &base);
        char cmd[512], path[128], ids[256] = "";
        snprintf(path, sizeof path, "%s/ref-logits.txt", dirs[which]);
        for (int i = 0; i < N_PROMPT; i++)
            snprintf(ids + strlen(ids), sizeof ids - strlen(ids), "%s%d", i ? "," : "", prompt[i]);
        snprintf(cmd, sizeof cmd,
                 "python3 tests/reference/llama_ref.py %s --prompt-ids %s --max-tokens %d "
                 "--logits-out %s",
                 dirs[which], ids, STEPS, path);
        FILE *p = popen(cmd, "r");
        assert_non_null(p);
        char line[4096] = "";
        if (!fgets(line, sizeof line, p)) line[0] = '\0';
        assert_int_equal(pclose(p), 0);
        char *s = line;
        for (int i = 0; i < STEPS; i++) {
            char *end;
            long v = strtol(s, &end, 10);
            if (end == s) fail_msg("reference printed too few tokens: %s", line);
            if (v != base.tokens[i])
                fail_msg("model %d step %d: tessera %d, reference %ld", which, i, base.tokens[i], v);
            s = *end == ',' ? end + 1 : end;
        }
        /* The reference's logits of every step, one line each: compare the
         * first and the last. */
        snprintf(path + strlen(path), sizeof path - strlen(path), ".all");
        FILE *f = fopen(path, "r");
        assert_non_null(f);
        float *first = read_floats(f, base.vocab), *last = NULL, *v;
        assert_non_null(first);
        while ((v = read_floats(f, base.vocab))) {
            free(last);
            last = v;
        }
        fclose(f);
        assert_non_null(last);
        double d0 = max_rel_diff(base.logits, first, base.vocab);
        double d1 = max_rel_diff(base.logits + (size_t)(STEPS - 1) * base.vocab, last, base.vocab);
        printf("    model %d: first- and last-step logits within %.2g and %.2g relative of the "
               "reference\n", which, d0, d1);
        assert_true(d0 <= 1e-4);
        assert_true(d1 <= 1e-4);
        free(first);
        free(last);
        free(base.logits);
    }
}

static int setup(void **state)
{
    (void)state;
    static char *llama3[] = {"--llama3-rope", "--shards", "2", NULL};
    if (make_model(0, "f32", 0, NULL) || make_model(1, "bf16", 0, NULL) ||
        make_model(2, "f32", 1, NULL) || make_model(3, "f16", 0, llama3))
        return -1;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[256];
    for (int i = 0; i < 4; i++) {
        snprintf(cmd, sizeof cmd, "rm -rf %s", dirs[i]);
        if (dirs[i][0] && system(cmd) != 0) return -1;
    }
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f32_untied_gqa_same_under_every_layout),
        cmocka_unit_test(test_bf16_checkpoint_same_under_every_layout),
        cmocka_unit_test(test_tied_embeddings_same_under_every_layout),
        cmocka_unit_test(test_f16_sharded_llama3_rope_same_under_every_layout),
        cmocka_unit_test(test_matches_numpy_reference),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
