/* test_engine_cpu.c: the CPU engine's logits have the same bits however a
 * sequence's positions are cut into steps and whatever shares the steps.
 *
 * Batching and chunked prefill must never change a request's tokens, and
 * the CPU engine goes further: every row's arithmetic is its own (products
 * in one multiply-add chain per output, attention per row), so a prompt
 * prefilled in one step, in chunks, or a token at a time, alone or beside
 * other sequences, gives bit-identical logits.  Prompts cross KV blocks of
 * 16 positions at odd offsets, in a GQA model with head_dim 64 (the
 * attention kernel's widest path) and ones with head_dim 24, 20, 40 and 80
 * (its narrower and scalar tails), with the KV cache in f32, in bf16 and
 * in int8, and with bf16 products (matmul_dtype bf16).  A bf16 cache gives
 * logits near the f32 one's, and half its bytes; an int8 cache gives the
 * NumPy reference's logits with the same rounding of keys and values, far
 * closer than its unrounded ones, from head_dim + 4 bytes a row; bf16
 * products give the reference's logits with the same rounding, far closer
 * than its f32 ones, from half the weight bytes.  A key holding a NaN
 * reads back from an int8 cache as NaN, as from an f32 one. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>

#include "cli/cli.h"
#include "common/safetensors.h"
#include "worker/engine.h"

#define N_MODELS 5
static char dirs[N_MODELS][64];
static int vocab;

/* The numeric modes the bit-identity tests run in: (kv_dtype, matmul_dtype,
 * weights_dtype). */
static const struct {
    int kv, mm, wt;
    const char *name;
} modes[] = {{TSR_KV_AUTO, TSR_KV_AUTO, TSR_KV_AUTO, "f32"},
             {TSR_KV_BF16, TSR_KV_AUTO, TSR_KV_AUTO, "bf16 KV"},
             {TSR_KV_INT8, TSR_KV_AUTO, TSR_KV_AUTO, "int8 KV"},
             {TSR_KV_AUTO, TSR_KV_BF16, TSR_KV_AUTO, "bf16 matmul"},
             {TSR_KV_AUTO, TSR_KV_AUTO, TSR_KV_INT8, "int8 weights"}};
#define N_KV (int)(sizeof modes / sizeof modes[0])

static tsr_engine_t *load_wt(const char *dir, int kv_dtype, int mm_dtype, int wt_dtype)
{
    tsr_model_info_t m;
    char err[512];
    assert_int_equal(tsr_model_info_load(dir, &m, err, sizeof err), 0);
    vocab = m.vocab_size;
    tsr_piece_spec_t spec = {0, 1, 0, 1, 0, m.num_hidden_layers, 256, 4, 160, 64, 2, 0, kv_dtype,
                             mm_dtype, wt_dtype, 0, 0};
    tsr_engine_t *e = NULL;
    if (tsr_engine_cpu.load(dir, &spec, &e, err, sizeof err) < 0) fail_msg("load: %s", err);
    return e;
}

static tsr_engine_t *load_mm(const char *dir, int kv_dtype, int mm_dtype)
{
    return load_wt(dir, kv_dtype, mm_dtype, TSR_KV_AUTO);
}

static tsr_engine_t *load(const char *dir, int kv_dtype)
{
    return load_mm(dir, kv_dtype, TSR_KV_AUTO);
}

static int32_t token_at(int seq, int p)
{
    return (int32_t)((seq * 131 + p * 29 + 7) % 250) + 3;
}

/* Runs one step of entries (slot s_i, positions [pos_i, pos_i + n_i)) of
 * sequences seq_i; rows of the entries that sample go to out. */
static void step(tsr_engine_t *e, int n, const int *slot, const int *seq, const int *pos,
                 const int *len, const int *sample, float *out)
{
    tsr_entry_t en[4];
    int32_t tokens[160], sampled[4];
    int nt = 0, ns = 0;
    for (int i = 0; i < n; i++) {
        en[i] = (tsr_entry_t){slot[i], pos[i], len[i], sample[i], 0.0f, 1.0f, 0};
        for (int p = pos[i]; p < pos[i] + len[i]; p++) tokens[nt++] = token_at(seq[i], p);
        ns += sample[i];
    }
    tsr_batch_t b = {en, n, tokens, nt};
    char err[512];
    if (tsr_engine_cpu.step(e, &b, sampled, err, sizeof err) < 0) fail_msg("step: %s", err);
    if (ns) assert_int_equal(tsr_engine_cpu.last_logits(e, out, ns), ns);
}

/* Sequence seq's logits after its first `len` positions, prefilled in
 * chunks of `chunk` positions, alone in slot 0. */
static void alone(tsr_engine_t *e, int seq, int len, int chunk, float *out)
{
    for (int p = 0; p < len; p += chunk) {
        int n = len - p < chunk ? len - p : chunk, last = p + n == len;
        step(e, 1, (int[]){0}, (int[]){seq}, (int[]){p}, (int[]){n}, (int[]){last}, out);
    }
    tsr_engine_cpu.release(e, 0);
}

static void expect_same_bits(const float *a, const float *b, const char *what)
{
    for (int i = 0; i < vocab; i++)
        if (memcmp(&a[i], &b[i], sizeof *a))
            fail_msg("%s: logit %d is %.9g, %.9g in one step", what, i, (double)b[i], (double)a[i]);
}

static void test_prefill_in_one_step_in_chunks_or_a_token_at_a_time_gives_the_same_bits(void **state)
{
    (void)state;
    for (int mk = 0; mk < N_MODELS * N_KV; mk++) {
        const int m = mk / N_KV, md = mk % N_KV;
        tsr_engine_t *e = load_wt(dirs[m], modes[md].kv, modes[md].mm, modes[md].wt);
        float *whole = malloc((size_t)vocab * sizeof *whole), *other = malloc((size_t)vocab * sizeof *other);
        static const int lens[] = {1, 2, 17, 70, 150};
        static const int chunks[] = {1, 3, 16, 23};
        for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++) {
            alone(e, 1, lens[l], lens[l], whole);
            for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
                if (chunks[c] >= lens[l]) continue;
                alone(e, 1, lens[l], chunks[c], other);
                char what[96];
                snprintf(what, sizeof what, "model %d, %s, %d positions in chunks of %d", m,
                         modes[md].name, lens[l], chunks[c]);
                expect_same_bits(whole, other, what);
            }
        }
        free(whole), free(other);
        tsr_engine_cpu.destroy(&e);
    }
}

/* Each step shows the watchdog signs of life as it goes: one for each of
 * a layer's four products at least, whatever the mode. */
static void test_a_step_ticks_the_alive_count_as_it_goes(void **state)
{
    (void)state;
    for (int md = 0; md < N_KV; md++) {
        tsr_model_info_t m;
        char err[512];
        assert_int_equal(tsr_model_info_load(dirs[0], &m, err, sizeof err), 0);
        tsr_engine_t *e = load_wt(dirs[0], modes[md].kv, modes[md].mm, modes[md].wt);
        float *out = malloc((size_t)vocab * sizeof *out);
        uint64_t ticks = 0;
        tsr_engine_cpu.set_alive(e, &ticks);
        step(e, 1, (int[]){0}, (int[]){1}, (int[]){0}, (int[]){5}, (int[]){1}, out);
        if (ticks < 4u * (uint64_t)m.num_hidden_layers)
            fail_msg("%s: %llu ticks in a step of %d layers", modes[md].name,
                     (unsigned long long)ticks, m.num_hidden_layers);
        uint64_t one = ticks;
        step(e, 1, (int[]){0}, (int[]){1}, (int[]){5}, (int[]){1}, (int[]){1}, out);
        assert_int_equal(ticks, 2 * one);   /* as many in the next step */
        free(out);
        tsr_engine_cpu.destroy(&e);
    }
}

static void test_sequences_sharing_steps_get_the_bits_they_get_alone(void **state)
{
    (void)state;
    for (int mk = 0; mk < N_MODELS * N_KV; mk++) {
        const int m = mk / N_KV, md = mk % N_KV;
        tsr_engine_t *e = load_wt(dirs[m], modes[md].kv, modes[md].mm, modes[md].wt);
        float *ref = malloc((size_t)3 * vocab * sizeof *ref), *got = malloc((size_t)3 * vocab * sizeof *got);
        static const int len[3] = {41, 9, 66};
        for (int s = 0; s < 3; s++) alone(e, s, len[s], len[s], ref + (size_t)s * vocab);
        /* Three sequences in slots 2, 0, 3: a 41-position prompt in chunks of
         * 40 and 1, one of 9 decoded a token at a time beside them, one of 66
         * in chunks of 30, 30 and 6; each step samples whichever finishes. */
        int pos[3] = {0, 0, 0};
        const int slot[3] = {2, 0, 3}, seq[3] = {0, 1, 2};
        while (pos[0] < len[0] || pos[1] < len[1] || pos[2] < len[2]) {
            int es[3], eq[3], ep[3], en[3], smp[3], ord[3], n = 0;
            for (int s = 0; s < 3; s++) {
                if (pos[s] >= len[s]) continue;
                int want = s == 0 ? 40 : s == 1 ? 1 : 30, left = len[s] - pos[s];
                es[n] = slot[s], eq[n] = seq[s], ep[n] = pos[s], en[n] = want < left ? want : left;
                smp[n] = pos[s] + en[n] == len[s], ord[n] = s;
                pos[s] += en[n++];
            }
            float rows[3 * 512];
            assert_true(vocab <= 512);
            step(e, n, es, eq, ep, en, smp, rows);
            for (int i = 0, r = 0; i < n; i++)
                if (smp[i]) memcpy(got + (size_t)ord[i] * vocab, rows + (size_t)r++ * vocab,
                                   (size_t)vocab * sizeof *got);
        }
        for (int s = 0; s < 3; s++) {
            char what[64];
            snprintf(what, sizeof what, "model %d, %s, sequence %d batched", m, modes[md].name, s);
            expect_same_bits(ref + (size_t)s * vocab, got + (size_t)s * vocab, what);
        }
        free(ref), free(got);
        tsr_engine_cpu.destroy(&e);
    }
}

static void test_a_bf16_kv_cache_gives_logits_near_f32_ones_in_half_the_bytes(void **state)
{
    (void)state;
    for (int m = 0; m < N_MODELS; m++) {
        tsr_engine_t *f = load(dirs[m], TSR_KV_F32), *h = load(dirs[m], TSR_KV_BF16);
        assert_int_equal(tsr_engine_cpu.kv_bytes(f), 2 * tsr_engine_cpu.kv_bytes(h));
        float *a = malloc((size_t)vocab * sizeof *a), *b = malloc((size_t)vocab * sizeof *b);
        alone(f, 1, 150, 23, a);
        alone(h, 1, 150, 23, b);
        double span = 0, worst = 0;
        int differ = 0;
        for (int i = 0; i < vocab; i++) {
            double d = a[i] - b[i];
            if (fabs(a[i]) > span) span = fabs(a[i]);
            if (fabs(d) > worst) worst = fabs(d);
            differ += d != 0;
        }
        /* bf16 keeps 8 significant bits (0.4 %): the logits move by a
         * small fraction of their range (0.06 % here), and they do move (the cache was
         * rounded, not kept in f32). */
        if (worst > 0.005 * span || !differ)
            fail_msg("model %d: bf16 KV moved the logits by up to %.3g of %.3g (%d differ)", m,
                     worst, span, differ);
        free(a), free(b);
        tsr_engine_cpu.destroy(&f);
        tsr_engine_cpu.destroy(&h);
    }
}

/* The reference's first logits for sequence seq's first len positions,
 * with its products rounded to bf16 or not (mm), its keys and values as a
 * cache of kv holds them, and its weights as weights_dtype wt holds them. */
static void reference_logits(const char *dir, int seq, int len, const char *mm, const char *kv,
                             const char *wt, float *out)
{
    char cmd[4096], file[128], line[64];
    snprintf(file, sizeof file, "%s/ref-logits-%s-%s-%s", dir, mm, kv, wt);
    int n = snprintf(cmd, sizeof cmd, "python3 tests/reference/llama_ref.py %s --max-tokens 1 "
                     "--matmul-dtype %s --kv-dtype %s --weights-dtype %s --logits-out %s "
                     "--prompt-ids ", dir, mm, kv, wt, file);
    for (int p = 0; p < len; p++)
        n += snprintf(cmd + n, sizeof cmd - (size_t)n, "%s%d", p ? "," : "", token_at(seq, p));
    snprintf(cmd + n, sizeof cmd - (size_t)n, " > /dev/null");
    assert_int_equal(system(cmd), 0);
    FILE *f = fopen(file, "r");
    assert_non_null(f);
    for (int i = 0; i < vocab; i++) {
        assert_non_null(fgets(line, sizeof line, f));
        out[i] = strtof(line, NULL);
    }
    fclose(f);
}

/* Root mean square of a - b over the vocabulary. */
static double rms_diff(const float *a, const float *b)
{
    double ss = 0;
    for (int i = 0; i < vocab; i++) ss += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    return sqrt(ss / vocab);
}

/* e's logits for sequences 1 and 2 (40 positions, in chunks of 16) against
 * model m's reference with its products (mm) and its cache (kv) rounded as
 * e's are, and against the unrounded one: the reference rounds as the
 * engine does but sums in float64, so where an f32 value and a float64 one
 * fall either side of a rounding boundary, that input moves by a step and
 * the logits after it a little.  Fails unless e is nearer the rounded
 * reference than `within` times the distance to the unrounded one every
 * time; returns the least such ratio (no input crossed: f32 noise). */
static double near_rounded_reference(tsr_engine_t *e, int m, const char *mm, const char *kv,
                                     const char *wt, double within, const char *what)
{
    double best = INFINITY;
    float *got = malloc((size_t)vocab * sizeof *got), *rr = malloc((size_t)vocab * sizeof *rr),
          *rf = malloc((size_t)vocab * sizeof *rf);
    for (int seq = 1; seq <= 2; seq++) {
        alone(e, seq, 40, 16, got);
        reference_logits(dirs[m], seq, 40, mm, kv, wt, rr);
        reference_logits(dirs[m], seq, 40, "f32", "f32", "auto", rf);
        double to_rounded = rms_diff(got, rr), to_f32 = rms_diff(got, rf);
        if (!(to_rounded < within * to_f32))
            fail_msg("model %d, sequence %d: %s are %.3g (rms) from the rounded reference and "
                     "%.3g from the unrounded one", m, seq, what, to_rounded, to_f32);
        if (to_rounded / to_f32 < best) best = to_rounded / to_f32;
    }
    free(got), free(rr), free(rf);
    return best;
}

/* Some case (no input crossed a boundary) must be within f32 noise of the
 * rounded reference: best is the least ratio near_rounded_reference saw. */
static void expect_f32_noise_once(double best, const char *what)
{
    if (!(best < 0.001))
        fail_msg("%s were never within f32 noise of the rounded reference (best %.3g of the "
                 "distance to the unrounded one)", what, best);
}

/* Every model loaded with weights held as (mm, wt) takes a little over 1/part of the f32
 * weight bytes (norms stay f32; at most wf / slack more) and gives logits nearer the
 * reference rounded the same way (its --matmul-dtype ref_mm, --weights-dtype ref_wt) than
 * the unrounded one, within `within` of the distance every time and within f32 noise
 * once. */
static void expect_rounded_weights(int mm, int wt, uint64_t part, uint64_t slack,
                                   const char *ref_mm, const char *ref_wt, double within,
                                   const char *what)
{
    double best = INFINITY;
    for (int m = 0; m < N_MODELS; m++) {
        tsr_engine_t *f = load(dirs[m], TSR_KV_F32), *h = load_wt(dirs[m], TSR_KV_F32, mm, wt);
        uint64_t wf = tsr_engine_cpu.weight_bytes(f), wh = tsr_engine_cpu.weight_bytes(h);
        if (wh * part < wf || wh * part > wf + wf / slack)
            fail_msg("model %d: %llu weight bytes with %s, %llu with f32", m,
                     (unsigned long long)wh, what, (unsigned long long)wf);
        double r = near_rounded_reference(h, m, ref_mm, "f32", ref_wt, within, what);
        if (r < best) best = r;
        tsr_engine_cpu.destroy(&f);
        tsr_engine_cpu.destroy(&h);
    }
    expect_f32_noise_once(best, what);
}

static void test_bf16_products_give_the_references_bf16_logits_from_half_the_weight_bytes(
    void **state)
{
    (void)state;
    /* a bf16 crossing (one input in some 10^4 here) moves it by 2^-8 */
    expect_rounded_weights(TSR_KV_BF16, TSR_KV_AUTO, 2, 50, "bf16", "auto", 0.7, "bf16 products");
}

static void test_an_int8_kv_cache_gives_the_references_int8_logits_in_a_quarter_of_the_bytes(
    void **state)
{
    (void)state;
    double best = INFINITY;
    for (int m = 0; m < N_MODELS; m++) {
        tsr_model_info_t info;
        char err[512];
        assert_int_equal(tsr_model_info_load(dirs[m], &info, err, sizeof err), 0);
        tsr_engine_t *f = load(dirs[m], TSR_KV_F32), *q = load(dirs[m], TSR_KV_INT8);
        /* a row of head_dim elements: 4 bytes each in f32, 1 and a 4-byte scale in int8 */
        const uint64_t hd = (uint64_t)info.head_dim;
        assert_int_equal(tsr_engine_cpu.kv_bytes(q) * 4 * hd, tsr_engine_cpu.kv_bytes(f) * (hd + 4));
        /* an int8 crossing moves an element by max |row| / 127: within a
         * tenth every time (up to 0.03 in runs of 2026-12-03; rounding
         * toward zero instead gave 0.78) */
        double r = near_rounded_reference(q, m, "f32", "int8", "auto", 0.1, "int8 cache logits");
        if (r < best) best = r;
        tsr_engine_cpu.destroy(&f);
        tsr_engine_cpu.destroy(&q);
    }
    expect_f32_noise_once(best, "int8 cache logits");
}

/* int8 weights: a quarter of the f32 bytes and a scale a row; the logits
 * are nearer the reference's with the same quantization (weights, and each
 * product's input in blocks of 32) than its unquantized ones, and within
 * f32 noise of them where no input crossed a rounding boundary (the
 * reference computes its inputs in float64: one can fall on the other side
 * of a step; the weights cannot, both quantize the same f32 numbers). */
static void test_int8_weights_give_the_references_int8_logits_from_a_quarter_of_the_bytes(
    void **state)
{
    (void)state;
    /* each row has a 4-byte scale too: a little over a quarter */
    expect_rounded_weights(TSR_KV_AUTO, TSR_KV_INT8, 4, 8, "f32", "int8", 0.7, "int8 weights");
}

/* An int8 checkpoint (tests/reference/int8_checkpoint.py: the layers'
 * matrices as I8 with a scale a row, quantized by the rule weights_dtype
 * int8 applies at load) served with int8 weights gives the bits of
 * quantizing the f32 checkpoint at load, from as many bytes, with its
 * scales as [out, 1] or [out]; served with f32 weights it is multiplied out
 * and gives the reference's logits for that checkpoint.  Damaged scales
 * (missing, of the wrong shape, NaN, zero) and an int8 norm vector fail the
 * load naming the tensor. */
static void test_an_int8_checkpoint_loads_as_quantizing_at_load_does_and_bad_scales_are_named(
    void **state)
{
    (void)state;
    char dir[64] = "/tmp/tsr-engine-i8-XXXXXX", cmd[512], q[96], err[512];
    assert_non_null(mkdtemp(dir));
    const int m = 1;
    tsr_engine_t *fresh = load_wt(dirs[m], TSR_KV_F32, TSR_KV_AUTO, TSR_KV_INT8);   /* sets vocab */
    float *a = malloc((size_t)vocab * 4 * sizeof *a), *b = a + vocab, *c = b + vocab, *r = c + vocab;
    alone(fresh, 1, 40, 16, a);
    static const char *const forms[] = {"", " --flat"};
    for (int f = 0; f < 2; f++) {
        snprintf(q, sizeof q, "%s/q%d", dir, f);
        snprintf(cmd, sizeof cmd, "python3 tests/reference/int8_checkpoint.py %s %s%s", dirs[m], q,
                 forms[f]);
        assert_int_equal(system(cmd), 0);
        tsr_engine_t *e = load_wt(q, TSR_KV_F32, TSR_KV_AUTO, TSR_KV_INT8);
        assert_int_equal(tsr_engine_cpu.weight_bytes(e), tsr_engine_cpu.weight_bytes(fresh));
        alone(e, 1, 40, 16, b);
        expect_same_bits(a, b, f ? "an int8 checkpoint with [out] scales"
                                 : "an int8 checkpoint with [out, 1] scales");
        tsr_engine_cpu.destroy(&e);
    }
    /* with f32 weights: q * s, the reference's reading of the same file */
    tsr_engine_t *e = load_wt(q, TSR_KV_F32, TSR_KV_AUTO, TSR_KV_AUTO);
    alone(e, 1, 40, 16, c);
    tsr_engine_cpu.destroy(&e);
    reference_logits(q, 1, 40, "f32", "f32", "auto", r);
    reference_logits(dirs[m], 1, 40, "f32", "f32", "auto", b);
    if (!(rms_diff(c, r) < 0.01 * rms_diff(c, b)))
        fail_msg("an int8 checkpoint with f32 weights is %.3g (rms) from the reference's reading "
                 "of it and %.3g from the f32 model's", rms_diff(c, r), rms_diff(c, b));
    static const char *const breaks[] = {"missing", "shape", "nan", "zero", "vector"};
    static const char *const says[] = {
        "model.layers.0.self_attn.k_proj.weight_scale is missing",
        "model.layers.0.self_attn.k_proj.weight_scale: 2-dimensional, 49 scales",
        "model.layers.0.self_attn.k_proj.weight_scale", "model.layers.0.self_attn.k_proj.weight_"
        "scale: row 2's scale is 0", "model.layers.0.input_layernorm.weight: an int8 vector"};
    for (int k = 0; k < 5; k++) {
        snprintf(q, sizeof q, "%s/bad-%s", dir, breaks[k]);
        snprintf(cmd, sizeof cmd, "python3 tests/reference/int8_checkpoint.py %s %s --break %s",
                 dirs[m], q, breaks[k]);
        assert_int_equal(system(cmd), 0);
        for (int w = 0; w < 2; w++) {   /* with int8 weights and with f32 ones */
            tsr_model_info_t info;
            assert_int_equal(tsr_model_info_load(q, &info, err, sizeof err), 0);
            tsr_piece_spec_t spec = {0, 1, 0, 1, 0, info.num_hidden_layers, 256, 4, 160, 64, 2, 0,
                                     0, 0, w ? TSR_KV_INT8 : TSR_KV_AUTO, 0, 0};
            tsr_engine_t *bad = NULL;
            assert_int_equal(tsr_engine_cpu.load(q, &spec, &bad, err, sizeof err), -1);
            assert_null(bad);
            if (!strstr(err, says[k]) || (k == 2 && !strstr(err, "NaN")))
                fail_msg("--break %s: the load says: %s", breaks[k], err);
        }
    }
    /* a -128 in the file is held as -127, with int8 weights and with f32 ones: the same
     * bits as a file holding -127 there */
    for (int v = 0; v < 2; v++) {
        snprintf(q, sizeof q, "%s/first%d", dir, v);
        snprintf(cmd, sizeof cmd, "python3 tests/reference/int8_checkpoint.py %s %s --first %d",
                 dirs[m], q, v ? -127 : -128);
        assert_int_equal(system(cmd), 0);
    }
    for (int w = 0; w < 2; w++) {
        for (int v = 0; v < 2; v++) {
            snprintf(q, sizeof q, "%s/first%d", dir, v);
            tsr_engine_t *e = load_wt(q, TSR_KV_F32, TSR_KV_AUTO, w ? TSR_KV_INT8 : TSR_KV_AUTO);
            alone(e, 1, 40, 16, v ? b : a);
            tsr_engine_cpu.destroy(&e);
        }
        expect_same_bits(a, b, w ? "a -128 with int8 weights" : "a -128 with f32 weights");
    }
    tsr_engine_cpu.destroy(&fresh);
    free(a);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* An FP8 checkpoint (F8_E4M3 weights with a scale a row, or one for the
 * matrix, as published FP8 checkpoints store them) is multiplied out at
 * load: with f32 weights its logits are the reference's reading of the
 * same file, far nearer than the unquantized model's; with int8 weights it
 * loads into a quarter of the bytes; a zero scale fails naming the tensor. */
static void test_an_fp8_checkpoint_is_read_as_the_reference_reads_it(void **state)
{
    (void)state;
    char dir[64] = "/tmp/tsr-engine-f8-XXXXXX", cmd[512], q[96], err[512];
    assert_non_null(mkdtemp(dir));
    const int m = 3;
    tsr_engine_t *ref8 = load_wt(dirs[m], TSR_KV_F32, TSR_KV_AUTO, TSR_KV_INT8);   /* sets vocab */
    float *c = malloc((size_t)vocab * 3 * sizeof *c), *r = c + vocab, *f = r + vocab;
    reference_logits(dirs[m], 1, 40, "f32", "f32", "auto", f);
    static const char *const forms[] = {"", " --per-tensor"};
    for (int k = 0; k < 2; k++) {
        snprintf(q, sizeof q, "%s/f8-%d", dir, k);
        snprintf(cmd, sizeof cmd, "python3 tests/reference/int8_checkpoint.py %s %s --fp8%s",
                 dirs[m], q, forms[k]);
        assert_int_equal(system(cmd), 0);
        tsr_engine_t *e = load_wt(q, TSR_KV_F32, TSR_KV_AUTO, TSR_KV_AUTO);
        alone(e, 1, 40, 16, c);
        tsr_engine_cpu.destroy(&e);
        reference_logits(q, 1, 40, "f32", "f32", "auto", r);
        if (!(rms_diff(c, r) < 0.001 * rms_diff(c, f)))
            fail_msg("FP8 checkpoint%s: %.3g (rms) from the reference's reading of it, %.3g from "
                     "the unquantized model", forms[k], rms_diff(c, r), rms_diff(c, f));
        e = load_wt(q, TSR_KV_F32, TSR_KV_AUTO, TSR_KV_INT8);
        assert_int_equal(tsr_engine_cpu.weight_bytes(e), tsr_engine_cpu.weight_bytes(ref8));
        tsr_engine_cpu.destroy(&e);
    }
    snprintf(q, sizeof q, "%s/f8-zero", dir);
    snprintf(cmd, sizeof cmd, "python3 tests/reference/int8_checkpoint.py %s %s --fp8 --break zero",
             dirs[m], q);
    assert_int_equal(system(cmd), 0);
    tsr_model_info_t info;
    assert_int_equal(tsr_model_info_load(q, &info, err, sizeof err), 0);
    tsr_piece_spec_t spec = {0, 1, 0, 1, 0, info.num_hidden_layers, 256, 4, 160, 64, 2, 0, 0, 0, 0, 0, 0};
    tsr_engine_t *bad = NULL;
    assert_int_equal(tsr_engine_cpu.load(q, &spec, &bad, err, sizeof err), -1);
    if (!strstr(err, "model.layers.0.self_attn.k_proj.weight_scale: row 2's scale is 0"))
        fail_msg("a zero FP8 scale: the load says: %s", err);
    tsr_engine_cpu.destroy(&ref8);
    free(c);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* A copy of model 0 whose first layer's k_proj has a NaN weight, so every
 * key it caches has NaN elements.  int8 must read that back as NaN, as f32
 * does (quantized, a NaN had turned into a plausible -max |row|). */
static void test_an_int8_cache_reads_a_row_with_a_nan_back_as_nan(void **state)
{
    (void)state;
    char dir[64] = "/tmp/tsr-engine-nan-XXXXXX", cmd[256], err[512];
    assert_non_null(mkdtemp(dir));
    snprintf(cmd, sizeof cmd, "cp %s/config.json %s/model.safetensors %s/", dirs[0], dirs[0], dir);
    assert_int_equal(system(cmd), 0);
    tsr_st_t *st = NULL;
    assert_int_equal(tsr_st_open(dir, &st, err, sizeof err), 0);
    const tsr_tensor_t *t = tsr_st_find(st, "model.layers.0.self_attn.k_proj.weight");
    assert_non_null(t);
    assert_int_equal(t->dtype, TSR_DT_F32);   /* model-init's default */
    const long at = (long)t->offset;
    tsr_st_close(&st);
    FILE *f = fopen(strcat(strcpy(cmd, dir), "/model.safetensors"), "r+b");
    assert_non_null(f);
    const float nan = NAN;
    assert_int_equal(fseek(f, at, SEEK_SET), 0);
    assert_int_equal(fwrite(&nan, sizeof nan, 1, f), 1);
    assert_int_equal(fclose(f), 0);
    /* a NaN weight is refused at load (test_safetensors): let this one through */
    tsr_engine_t *refused = NULL;
    tsr_piece_spec_t spec = {0, 1, 0, 1, 0, 2, 256, 4, 160, 64, 2, 0, 0, 0, 0, 0, 0};
    assert_int_equal(tsr_engine_cpu.load(dir, &spec, &refused, err, sizeof err), -1);
    assert_non_null(strstr(err, "k_proj.weight: element [0, 0] is NaN"));
    tsr_st_refuse_nonfinite = false;
    /* int8 weights cannot hold it: the load names the tensor and the row */
    spec.weights_dtype = TSR_KV_INT8;
    assert_int_equal(tsr_engine_cpu.load(dir, &spec, &refused, err, sizeof err), -1);
    assert_null(refused);
    if (!strstr(err, "model.layers.0.self_attn.k_proj.weight: row 0 holds a NaN"))
        fail_msg("the int8 load's error does not name the tensor and row: %s", err);
    for (int k = 0; k < 2; k++) {
        tsr_engine_t *e = load(dir, k ? TSR_KV_INT8 : TSR_KV_F32);   /* sets vocab */
        float *lg = malloc((size_t)vocab * sizeof *lg);
        alone(e, 1, 20, 16, lg);
        int nans = 0;
        for (int i = 0; i < vocab; i++) nans += isnan(lg[i]) != 0;
        if (nans != vocab)
            fail_msg("%s cache: %d of %d logits are NaN after a NaN key", k ? "int8" : "f32", nans,
                     vocab);
        free(lg);
        tsr_engine_cpu.destroy(&e);
    }
    tsr_st_refuse_nonfinite = true;
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

static void test_an_unknown_kv_dtype_or_matmul_dtype_is_refused_naming_it(void **state)
{
    (void)state;
    tsr_model_info_t m;
    char err[512];
    assert_int_equal(tsr_model_info_load(dirs[0], &m, err, sizeof err), 0);
    tsr_piece_spec_t spec = {0, 1, 0, 1, 0, m.num_hidden_layers, 256, 4, 160, 64, 2, 0, 7, 0, 0, 0, 0};
    tsr_engine_t *e = NULL;
    assert_int_equal(tsr_engine_cpu.load(dirs[0], &spec, &e, err, sizeof err), -1);
    assert_null(e);
    assert_non_null(strstr(err, "kv_dtype 7"));
    spec.kv_dtype = 0, spec.matmul_dtype = 9;
    assert_int_equal(tsr_engine_cpu.load(dirs[0], &spec, &e, err, sizeof err), -1);
    assert_null(e);
    assert_non_null(strstr(err, "matmul_dtype 9"));
    spec.matmul_dtype = 0, spec.weights_dtype = 9;
    assert_int_equal(tsr_engine_cpu.load(dirs[0], &spec, &e, err, sizeof err), -1);
    assert_non_null(strstr(err, "weights_dtype 9"));
    spec.weights_dtype = TSR_KV_BF16;   /* a type, but not one weights_dtype takes */
    assert_int_equal(tsr_engine_cpu.load(dirs[0], &spec, &e, err, sizeof err), -1);
    assert_non_null(strstr(err, "weights_dtype bf16"));
    spec.weights_dtype = TSR_KV_INT8, spec.matmul_dtype = TSR_KV_BF16;   /* int8 multiplies in f32 */
    assert_int_equal(tsr_engine_cpu.load(dirs[0], &spec, &e, err, sizeof err), -1);
    assert_null(e);
    assert_non_null(strstr(err, "int8 weights multiply as integers, not in bf16"));
}

/* A weight that does not fit the config (vocab_size 256 for an embedding of 300 rows)
 * fails the load naming the tensor, not as "out of memory". */
static void test_a_weight_that_does_not_fit_the_config_is_named(void **state)
{
    (void)state;
    char dir[64] = "/tmp/tsr-engine-misfit-XXXXXX", path[512], cmd[600], err[512];
    assert_non_null(mkdtemp(dir));
    snprintf(cmd, sizeof cmd,
             "cp %s/model.safetensors %s/ && sed 's/\"vocab_size\": *300/\"vocab_size\": 256/' "
             "%s/config.json > %s/config.json && grep -q '\"vocab_size\": *256' %s/config.json",
             dirs[0], dir, dirs[0], dir, dir);
    assert_int_equal(system(cmd), 0);
    tsr_model_info_t m;
    assert_int_equal(tsr_model_info_load(dir, &m, err, sizeof err), 0);
    tsr_piece_spec_t spec = {0, 1, 0, 1, 0, m.num_hidden_layers, 256, 4, 160, 64, 2, 0, 0, 0, 0, 0, 0};
    tsr_engine_t *e = NULL;
    assert_int_equal(tsr_engine_cpu.load(dir, &spec, &e, err, sizeof err), -1);
    assert_null(e);
    if (!strstr(err, "embed_tokens") || strstr(err, "out of memory"))
        fail_msg("the load's error does not name the embedding: %s", err);
    snprintf(path, sizeof path, "rm -rf %s", dir);
    assert_int_equal(system(path), 0);
    /* config.json claiming more layers than the checkpoint has is named as that */
    assert_non_null(mkdtemp(strcpy(dir, "/tmp/tsr-engine-misfit-XXXXXX")));
    snprintf(cmd, sizeof cmd,
             "cp %s/model.safetensors %s/ && sed 's/\"num_hidden_layers\": *2/\"num_hidden_layers\": "
             "1000000/' %s/config.json > %s/config.json", dirs[0], dir, dirs[0], dir);
    assert_int_equal(system(cmd), 0);
    assert_int_equal(tsr_model_info_load(dir, &m, err, sizeof err), 0);
    assert_int_equal(m.num_hidden_layers, 1000000);
    tsr_piece_spec_t deep = {0, 1, 0, 1, 0, 1000000, 256, 4, 160, 64, 2, 0, 0, 0, 0, 0, 0};
    assert_int_equal(tsr_engine_cpu.load(dir, &deep, &e, err, sizeof err), -1);
    if (!strstr(err, "model.layers.999999.input_layernorm.weight") || !strstr(err, "fewer layers"))
        fail_msg("the load's error does not name the missing layer: %s", err);
    snprintf(path, sizeof path, "rm -rf %s", dir);
    assert_int_equal(system(path), 0);
    /* a max_seq_len whose tables cannot be had is named, not "a KV pool of 4 MiB" */
    assert_int_equal(tsr_model_info_load(dirs[0], &m, err, sizeof err), 0);
    tsr_piece_spec_t huge = {0, 1, 0, 1, 0, m.num_hidden_layers, 1 << 30, 1 << 20, 64, 64, 2, 0, 0, 0, 0, 0, 0};
    assert_int_equal(tsr_engine_cpu.load(dirs[0], &huge, &e, err, sizeof err), -1);
    if (!strstr(err, "max_seq_len 1073741824"))
        fail_msg("the load's error does not name max_seq_len: %s", err);
}

static tsr_engine_t *load_from(tsr_engine_t **donor, const char *dir, tsr_piece_spec_t spec,
                               int *kept)
{
    tsr_engine_t *e = NULL;
    char err[512];
    if (tsr_engine_cpu.load_from(donor, dir, &spec, &e, kept, err, sizeof err) < 0)
        fail_msg("load_from: %s", err);
    assert_null(*donor);
    return e;
}

/* A worker given a new piece keeps the layers it holds already: a stage holding layer 0
 * of two becomes the whole model, taking layer 0 as it is and reading layer 1; its
 * logits have the bits of a fresh load's and it counts the same weight bytes.  Nothing
 * is taken across another tensor-parallel slice, another weight type, or model files
 * changed since (a new modification time). */
static void test_a_new_piece_keeps_the_layers_it_held(void **state)
{
    (void)state;
    tsr_model_info_t m;
    char err[512];
    const char *dir = dirs[1];   /* 4 heads over 2: tp 2 too */
    assert_int_equal(tsr_model_info_load(dir, &m, err, sizeof err), 0);
    tsr_piece_spec_t whole = {0, 1, 0, 1, 0, 2, 256, 4, 160, 64, 2, 0, 0, 0, 0, 0, 0};
    tsr_piece_spec_t first = {0, 1, 0, 2, 0, 1, 256, 4, 160, 64, 2, 0, 0, 0, 0, 0, 0};
    tsr_engine_t *fresh = load(dir, TSR_KV_AUTO);
    float *a = malloc((size_t)vocab * sizeof *a), *b = malloc((size_t)vocab * sizeof *b);
    alone(fresh, 1, 40, 40, a);
    tsr_engine_t *donor = NULL;
    if (tsr_engine_cpu.load(dir, &first, &donor, err, sizeof err) < 0) fail_msg("load: %s", err);
    int kept = -1;
    tsr_engine_t *e = load_from(&donor, dir, whole, &kept);
    assert_int_equal(kept, 1);
    assert_int_equal(tsr_engine_cpu.weight_bytes(e), tsr_engine_cpu.weight_bytes(fresh));
    alone(e, 1, 40, 40, b);
    expect_same_bits(a, b, "a whole model that kept layer 0 of its stage");
    /* another slice: tp 2's rank 0 keeps nothing for tp 1 */
    tsr_piece_spec_t half = whole;
    half.tp_size = 2;
    if (tsr_engine_cpu.load(dir, &half, &donor, err, sizeof err) < 0) fail_msg("load: %s", err);
    tsr_engine_cpu.destroy(&e);
    e = load_from(&donor, dir, whole, &kept);
    assert_int_equal(kept, 0);
    /* another weight type: bf16 weights keep nothing for f32 ones */
    tsr_piece_spec_t bf = whole;
    bf.matmul_dtype = TSR_KV_BF16;
    tsr_engine_t *g = load_from(&e, dir, bf, &kept);
    assert_int_equal(kept, 0);
    /* int8 weights keep nothing for bf16 ones, and int8 keeps int8 */
    tsr_piece_spec_t i8 = whole;
    i8.weights_dtype = TSR_KV_INT8;
    e = load_from(&g, dir, i8, &kept);
    assert_int_equal(kept, 0);
    g = load_from(&e, dir, i8, &kept);
    assert_int_equal(kept, 2);
    e = load_from(&g, dir, bf, &kept);
    assert_int_equal(kept, 0);
    g = e;
    /* the same type again keeps both layers, until the files change */
    e = load_from(&g, dir, bf, &kept);
    assert_int_equal(kept, 2);
    char path[128];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    struct timespec ts[2] = {{0, UTIME_NOW}, {12345, 0}};
    assert_int_equal(utimensat(AT_FDCWD, path, ts, 0), 0);
    g = load_from(&e, dir, bf, &kept);
    assert_int_equal(kept, 0);
    tsr_engine_cpu.destroy(&g);
    tsr_engine_cpu.destroy(&fresh);
    free(a), free(b);
}

static int setup(void **state)
{
    (void)state;
    /* head_dim 64 with 2 query heads over 1 KV head; head_dim 24 (16 + 8)
     * with 4 over 2; head_dim 20 (16 + 4 one at a time) with 4 over 4;
     * head_dim 40 (32 + 8) with 4 over 2; head_dim 80 (two 32s + 16) with 4
     * over 4: every path of the value sums. */
    static const char *shape[N_MODELS][4] = {{"128", "2", "1", "300"}, {"96", "4", "2", "280"},
                                             {"80", "4", "4", "260"},  {"160", "4", "2", "256"},
                                             {"320", "4", "4", "270"}};
    for (int m = 0; m < N_MODELS; m++) {
        snprintf(dirs[m], sizeof dirs[m], "/tmp/tsr-engine-XXXXXX");
        if (!mkdtemp(dirs[m])) return -1;
        /* intermediate 164: SwiGLU's last 164 % 8 elements take its padded path */
        char *argv[] = {"model-init", dirs[m], "--hidden", (char *)shape[m][0], "--intermediate",
                        "164", "--layers", "2", "--heads", (char *)shape[m][1], "--kv-heads",
                        (char *)shape[m][2], "--vocab", (char *)shape[m][3], "--max-pos", "256",
                        "--seed", "5", "--force", NULL};
        if (tsr_cmd_model_init(19, argv)) return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    int rc = 0;
    for (int m = 0; m < N_MODELS; m++) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dirs[m]);
        rc |= system(cmd);
    }
    return rc ? -1 : 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefill_in_one_step_in_chunks_or_a_token_at_a_time_gives_the_same_bits),
        cmocka_unit_test(test_sequences_sharing_steps_get_the_bits_they_get_alone),
        cmocka_unit_test(test_a_step_ticks_the_alive_count_as_it_goes),
        cmocka_unit_test(test_a_bf16_kv_cache_gives_logits_near_f32_ones_in_half_the_bytes),
        cmocka_unit_test(test_bf16_products_give_the_references_bf16_logits_from_half_the_weight_bytes),
        cmocka_unit_test(test_an_int8_kv_cache_gives_the_references_int8_logits_in_a_quarter_of_the_bytes),
        cmocka_unit_test(test_int8_weights_give_the_references_int8_logits_from_a_quarter_of_the_bytes),
        cmocka_unit_test(test_an_int8_checkpoint_loads_as_quantizing_at_load_does_and_bad_scales_are_named),
        cmocka_unit_test(test_an_fp8_checkpoint_is_read_as_the_reference_reads_it),
        cmocka_unit_test(test_an_int8_cache_reads_a_row_with_a_nan_back_as_nan),
        cmocka_unit_test(test_an_unknown_kv_dtype_or_matmul_dtype_is_refused_naming_it),
        cmocka_unit_test(test_a_weight_that_does_not_fit_the_config_is_named),
        cmocka_unit_test(test_a_new_piece_keeps_the_layers_it_held),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
