/* test_safetensors.c: the checkpoint reader (common/safetensors.c), the
 * model writer (cli/model_init.c) and the forward-pass fields of the model
 * config (common/modelcfg.c). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "common/modelcfg.h"
#include "common/modelfile.h"
#include "common/fp8.h"
#include "common/safetensors.h"
#include "common/tokenizer.h"

/* ---- helpers ------------------------------------------------------------ */

static char *make_tmpdir(void)
{
    char *dir = strdup("/tmp/tsr_test_st.XXXXXX");

    assert_non_null(dir);
    assert_non_null(mkdtemp(dir));
    return dir;
}

/* Removes dir and the files in it (the tests never make subdirectories). */
static void rm_dir(char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[512];

    if (d != NULL) {
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
                continue;
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
        closedir(d);
    }
    rmdir(dir);
    free(dir);
}

static void write_bytes(const char *dir, const char *name, const void *buf, size_t len)
{
    char path[512];
    FILE *f;

    snprintf(path, sizeof path, "%s/%s", dir, name);
    f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

/* A safetensors file: length prefix, header text, data_len bytes of data. */
static uint8_t *st_bytes(const char *hdr, size_t data_len, size_t *len_out)
{
    size_t hlen = strlen(hdr), len = 8 + hlen + data_len;
    uint8_t *b = calloc(1, len);

    assert_non_null(b);
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    memcpy(b + 8, hdr, hlen);
    for (size_t i = 0; i < data_len; i++)
        b[8 + hlen + i] = (uint8_t)(i * 7);
    *len_out = len;
    return b;
}

static void write_st(const char *dir, const char *name, const char *hdr, size_t data_len)
{
    size_t len;
    uint8_t *b = st_bytes(hdr, data_len, &len);

    write_bytes(dir, name, b, len);
    free(b);
}

/* Runs `tessera model-init DIR ARGS...` (NULL-terminated) in process. */
static int model_init(const char *dir, ...)
{
    char *argv[40];
    int argc = 0;
    va_list ap;
    const char *a;

    argv[argc++] = "model-init";
    argv[argc++] = (char *)dir;
    va_start(ap, dir);
    while ((a = va_arg(ap, const char *)) != NULL && argc < 39)
        argv[argc++] = (char *)a;
    va_end(ap);
    argv[argc] = NULL;
    return tsr_cmd_model_init(argc, argv);
}

#define SMALL "--hidden", "64", "--intermediate", "96", "--layers", "2", "--heads", "4", \
              "--kv-heads", "2", "--vocab", "50", "--max-pos", "128"

/* Opens dir, which must fail with a message containing each of the given
 * strings (NULL-terminated). */
static void expect_open_error(const char *dir, ...)
{
    tsr_st_t *st = NULL;
    char err[1024] = "";
    const char *want;
    va_list ap;

    assert_int_equal(tsr_st_open(dir, &st, err, sizeof err), -1);
    assert_null(st);
    va_start(ap, dir);
    while ((want = va_arg(ap, const char *)) != NULL)
        if (strstr(err, want) == NULL)
            fail_msg("message '%s' does not contain '%s'", err, want);
    va_end(ap);
}

/* dir + "/" + name, in a static buffer (one use per statement). */
static const char *at(const char *dir, const char *name)
{
    static char buf[4][512];
    static int k;

    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    return buf[k];
}

static float *read_all(const tsr_st_t *st, const tsr_tensor_t *t, int64_t *rows, int64_t *cols)
{
    char err[512];
    float *v;

    *rows = t->ndim == 2 ? t->shape[0] : 1;
    *cols = t->ndim == 2 ? t->shape[1] : t->shape[0];
    v = malloc((size_t)(*rows * *cols) * sizeof *v);
    assert_non_null(v);
    if (tsr_st_read_f32(st, t, 0, *rows, 0, *cols, v, err, sizeof err) < 0)
        fail_msg("%s", err);
    return v;
}

static tsr_st_t *open_ok(const char *dir)
{
    tsr_st_t *st = NULL;
    char err[1024];

    if (tsr_st_open(dir, &st, err, sizeof err) < 0)
        fail_msg("%s", err);
    return st;
}

/* ---- model-init round trip ---------------------------------------------- */

static void expect_shape(const tsr_st_t *st, const char *name, int ndim, int64_t a, int64_t b)
{
    int64_t shape[2] = { a, b };
    char err[512];

    if (tsr_st_expect(st, name, ndim, shape, err, sizeof err) < 0)
        fail_msg("%s", err);
}

static void test_model_init_writes_hf_llama_names_shapes_and_dtype(void **state)
{
    char *dir = make_tmpdir(), name[128];
    tsr_st_t *st;

    (void)state;
    assert_int_equal(model_init(dir, SMALL, "--dtype", "bf16", NULL), 0);
    st = open_ok(dir);
    expect_shape(st, "model.embed_tokens.weight", 2, 50, 64);
    for (int i = 0; i < 2; i++) {
        static const struct { const char *n; int nd; int64_t a, b; } l[] = {
            { "input_layernorm", 1, 64, 0 }, { "post_attention_layernorm", 1, 64, 0 },
            { "self_attn.q_proj", 2, 64, 64 }, { "self_attn.k_proj", 2, 32, 64 },
            { "self_attn.v_proj", 2, 32, 64 }, { "self_attn.o_proj", 2, 64, 64 },
            { "mlp.gate_proj", 2, 96, 64 }, { "mlp.up_proj", 2, 96, 64 },
            { "mlp.down_proj", 2, 64, 96 } };
        for (size_t k = 0; k < sizeof l / sizeof l[0]; k++) {
            snprintf(name, sizeof name, "model.layers.%d.%s.weight", i, l[k].n);
            expect_shape(st, name, l[k].nd, l[k].a, l[k].b);
            assert_int_equal(tsr_st_find(st, name)->dtype, TSR_DT_BF16);
        }
    }
    expect_shape(st, "model.norm.weight", 1, 64, 0);
    expect_shape(st, "lm_head.weight", 2, 50, 64);
    assert_null(tsr_st_find(st, "model.layers.2.mlp.up_proj.weight"));
    assert_int_equal(tsr_dtype_size(tsr_st_find(st, "lm_head.weight")->dtype), 2);
    assert_string_equal(tsr_dtype_name(tsr_st_find(st, "lm_head.weight")->dtype), "BF16");
    tsr_st_close(&st);
    assert_null(st);
    rm_dir(dir);
}

static void test_model_init_tied_has_no_lm_head(void **state)
{
    char *dir = make_tmpdir();
    tsr_st_t *st;

    (void)state;
    assert_int_equal(model_init(dir, SMALL, "--tied", NULL), 0);
    st = open_ok(dir);
    assert_null(tsr_st_find(st, "lm_head.weight"));
    assert_non_null(tsr_st_find(st, "model.embed_tokens.weight"));
    tsr_st_close(&st);
    rm_dir(dir);
}

/* Every slice shape reads the same elements as the full tensor holds. */
static void check_slices(const tsr_st_t *st, const char *name)
{
    const tsr_tensor_t *t = tsr_st_find(st, name);
    int64_t rows, cols;
    float *full, *part;
    char err[512];
    static const int64_t cuts[][4] = { /* r0, r1, c0, c1 as fractions of 8 */
        { 0, 8, 0, 8 }, { 2, 5, 0, 8 }, { 0, 8, 3, 4 }, { 1, 7, 2, 6 }, { 7, 8, 5, 8 },
        { 3, 3, 0, 8 } };

    assert_non_null(t);
    full = read_all(st, t, &rows, &cols);
    part = malloc((size_t)(rows * cols) * sizeof *part);
    assert_non_null(part);
    for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
        int64_t r0 = cuts[k][0] * rows / 8, r1 = cuts[k][1] * rows / 8;
        int64_t c0 = cuts[k][2] * cols / 8, c1 = cuts[k][3] * cols / 8;
        if (rows == 1) {
            r0 = 0;
            r1 = 1;
        }
        if (tsr_st_read_f32(st, t, r0, r1, c0, c1, part, err, sizeof err) < 0)
            fail_msg("%s", err);
        for (int64_t r = r0; r < r1; r++)
            for (int64_t c = c0; c < c1; c++)
                if (memcmp(&part[(r - r0) * (c1 - c0) + (c - c0)], &full[r * cols + c], 4))
                    fail_msg("%s [%lld,%lld) x [%lld,%lld): element (%lld, %lld) differs",
                             name, (long long)r0, (long long)r1, (long long)c0,
                             (long long)c1, (long long)r, (long long)c);
    }
    free(full);
    free(part);
}

static void test_slices_equal_the_full_read_for_every_dtype(void **state)
{
    static const char *dts[] = { "f32", "bf16", "f16" };

    (void)state;
    for (size_t d = 0; d < 3; d++) {
        char *dir = make_tmpdir();
        tsr_st_t *st;
        assert_int_equal(model_init(dir, SMALL, "--dtype", dts[d], NULL), 0);
        st = open_ok(dir);
        check_slices(st, "model.embed_tokens.weight");
        check_slices(st, "model.layers.1.self_attn.k_proj.weight");
        check_slices(st, "model.layers.0.mlp.down_proj.weight");
        check_slices(st, "model.norm.weight");
        tsr_st_close(&st);
        rm_dir(dir);
    }
}

/* A bf16 tensor over 4 MiB is read in several chunks; the chunk seams must
 * not shift or drop elements. */
static void test_large_read_across_chunks_matches_row_reads(void **state)
{
    char *dir = make_tmpdir(), err[512];
    const tsr_tensor_t *t;
    tsr_st_t *st;
    int64_t rows, cols;
    float *full, *row;

    (void)state;
    assert_int_equal(model_init(dir, "--hidden", "256", "--intermediate", "64", "--layers", "1",
                                "--vocab", "9000", "--dtype", "bf16", "--tied", NULL), 0);
    st = open_ok(dir);
    t = tsr_st_find(st, "model.embed_tokens.weight");
    assert_true(t->nbytes > 4u << 20);
    full = read_all(st, t, &rows, &cols);
    row = malloc((size_t)cols * sizeof *row);
    assert_non_null(row);
    for (int64_t r = 0; r < rows; r += 997) {
        assert_int_equal(tsr_st_read_f32(st, t, r, r + 1, 0, cols, row, err, sizeof err), 0);
        assert_memory_equal(row, full + r * cols, (size_t)cols * sizeof *row);
    }
    assert_int_equal(tsr_st_read_f32(st, t, rows - 1, rows, 0, cols, row, err, sizeof err), 0);
    assert_memory_equal(row, full + (rows - 1) * cols, (size_t)cols * sizeof *row);
    free(full);
    free(row);
    tsr_st_close(&st);
    rm_dir(dir);
}

static void test_read_outside_the_shape_is_refused(void **state)
{
    char *dir = make_tmpdir(), err[512];
    const tsr_tensor_t *t;
    tsr_st_t *st;
    float v[64 * 64];

    (void)state;
    assert_int_equal(model_init(dir, SMALL, NULL), 0);
    st = open_ok(dir);
    t = tsr_st_find(st, "model.layers.0.self_attn.k_proj.weight");
    assert_int_equal(tsr_st_read_f32(st, t, 0, 33, 0, 64, v, err, sizeof err), -1);
    assert_non_null(strstr(err, "tensor model.layers.0.self_attn.k_proj.weight: slice"));
    assert_int_equal(tsr_st_read_f32(st, t, 0, 1, 10, 65, v, err, sizeof err), -1);
    assert_int_equal(tsr_st_read_f32(st, t, 5, 4, 0, 1, v, err, sizeof err), -1);
    assert_int_equal(tsr_st_read_f32(st, t, -1, 1, 0, 1, v, err, sizeof err), -1);
    tsr_st_close(&st);
    rm_dir(dir);
}

static void test_model_init_values_are_deterministic_and_scaled(void **state)
{
    char *a = make_tmpdir(), *b = make_tmpdir(), *c = make_tmpdir();
    tsr_st_t *sa, *sb, *sc;
    int64_t rows, cols;
    float *va, *vb, *vc;
    double sum2 = 0, bound = sqrt(3.0 / 96.0);

    (void)state;
    assert_int_equal(model_init(a, SMALL, "--seed", "7", NULL), 0);
    assert_int_equal(model_init(b, SMALL, "--seed", "7", NULL), 0);
    assert_int_equal(model_init(c, SMALL, "--seed", "8", NULL), 0);
    sa = open_ok(a);
    sb = open_ok(b);
    sc = open_ok(c);
    va = read_all(sa, tsr_st_find(sa, "model.layers.1.mlp.down_proj.weight"), &rows, &cols);
    vb = read_all(sb, tsr_st_find(sb, "model.layers.1.mlp.down_proj.weight"), &rows, &cols);
    vc = read_all(sc, tsr_st_find(sc, "model.layers.1.mlp.down_proj.weight"), &rows, &cols);
    assert_memory_equal(va, vb, (size_t)(rows * cols) * sizeof *va);
    assert_memory_not_equal(va, vc, (size_t)(rows * cols) * sizeof *va);
    /* Same shape, same seed, another tensor: other values. */
    free(vc);
    vc = read_all(sa, tsr_st_find(sa, "model.layers.0.mlp.down_proj.weight"), &rows, &cols);
    assert_memory_not_equal(va, vc, (size_t)(rows * cols) * sizeof *va);
    for (int64_t i = 0; i < rows * cols; i++) {
        assert_true(fabsf(va[i]) <= bound); /* uniform in +-sqrt(3/fan_in), fan_in 96 */
        sum2 += (double)va[i] * va[i];
    }
    assert_true(fabs(sum2 / (double)(rows * cols) * 96.0 - 1.0) < 0.1); /* variance 1/fan_in */
    free(va);
    free(vb);
    free(vc);
    va = read_all(sa, tsr_st_find(sa, "model.norm.weight"), &rows, &cols);
    for (int64_t i = 0; i < cols; i++)
        assert_true(va[i] >= 0.9f && va[i] <= 1.1f);
    free(va);
    va = read_all(sa, tsr_st_find(sa, "model.embed_tokens.weight"), &rows, &cols);
    sum2 = 0;
    for (int64_t i = 0; i < rows * cols; i++)
        sum2 += (double)va[i] * va[i];
    assert_true(fabs(sqrt(sum2 / (double)(rows * cols)) - 1.0) < 0.1); /* std 1 */
    free(va);
    tsr_st_close(&sa);
    tsr_st_close(&sb);
    tsr_st_close(&sc);
    rm_dir(a);
    rm_dir(b);
    rm_dir(c);
}

static void test_sharded_checkpoint_reads_identically_to_single_file(void **state)
{
    char *one = make_tmpdir(), *three = make_tmpdir();
    tsr_st_t *s1, *s3;
    int files[3] = { 0 };
    char name[128];
    static const char *suffix[] = { "self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj",
                                    "input_layernorm" };

    (void)state;
    assert_int_equal(model_init(one, SMALL, "--dtype", "f16", "--seed", "42", NULL), 0);
    assert_int_equal(model_init(three, SMALL, "--dtype", "f16", "--seed", "42", "--shards",
                                "3", NULL), 0);
    assert_int_equal(access(at(three, "model.safetensors.index.json"), F_OK), 0);
    assert_int_equal(access(at(three, "model-00003-of-00003.safetensors"), F_OK), 0);
    assert_int_not_equal(access(at(three, "model.safetensors"), F_OK), 0);
    s1 = open_ok(one);
    s3 = open_ok(three);
    for (int i = 0; i < 2 * 4 + 3; i++) {
        const tsr_tensor_t *t1, *t3;
        int64_t r, c;
        float *v1, *v3;
        if (i < 8)
            snprintf(name, sizeof name, "model.layers.%d.%s.weight", i / 4, suffix[i % 4]);
        else
            snprintf(name, sizeof name, "%s", (const char *[]){ "model.embed_tokens.weight",
                     "model.norm.weight", "lm_head.weight" }[i - 8]);
        t1 = tsr_st_find(s1, name);
        t3 = tsr_st_find(s3, name);
        assert_non_null(t1);
        assert_non_null(t3);
        assert_true(t3->file >= 0 && t3->file < 3);
        files[t3->file] = 1;
        v1 = read_all(s1, t1, &r, &c);
        v3 = read_all(s3, t3, &r, &c);
        assert_memory_equal(v1, v3, (size_t)(r * c) * sizeof *v1);
        free(v1);
        free(v3);
    }
    assert_true(files[0] && files[1] && files[2]); /* the tensors really are spread out */
    tsr_st_close(&s1);
    tsr_st_close(&s3);
    rm_dir(one);
    rm_dir(three);
}

/* ---- dtype conversions -------------------------------------------------- */

static void test_bf16_conversion_is_exact_and_rounds_to_nearest_even(void **state)
{
    (void)state;
    assert_true(tsr_bf16_to_f32(0x3f80) == 1.0f);
    assert_true(tsr_bf16_to_f32(0xc000) == -2.0f);
    assert_true(isinf(tsr_bf16_to_f32(0x7f80)));
    assert_true(isnan(tsr_bf16_to_f32(0x7fc0)));
    assert_int_equal(tsr_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(tsr_f32_to_bf16(-INFINITY), 0xff80);
    assert_true(isnan(tsr_bf16_to_f32(tsr_f32_to_bf16(NAN))));
    /* A NaN whose payload sits only in the low 16 bits must stay NaN. */
    {
        uint32_t u = 0x7f800001u;
        float f;
        memcpy(&f, &u, 4);
        assert_true(isnan(tsr_bf16_to_f32(tsr_f32_to_bf16(f))));
    }
    /* Every finite positive bf16 h: h round trips; the midpoint to h+1 goes
     * to the even one; one f32 ulp either side of it goes to the nearer. */
    for (uint32_t h = 0; h < 0x7f80; h++) {
        uint32_t mid = h << 16 | 0x8000u, even = (h & 1) ? h + 1 : h;
        float f;
        assert_int_equal(tsr_f32_to_bf16(tsr_bf16_to_f32((uint16_t)h)), h);
        memcpy(&f, &mid, 4);
        assert_int_equal(tsr_f32_to_bf16(f), even);
        assert_int_equal(tsr_f32_to_bf16(-f), even | 0x8000u);
        mid++;
        memcpy(&f, &mid, 4);
        assert_int_equal(tsr_f32_to_bf16(f), h + 1);
        mid -= 2;
        memcpy(&f, &mid, 4);
        assert_int_equal(tsr_f32_to_bf16(f), h);
    }
    assert_int_equal(tsr_f32_to_bf16(3.4e38f), 0x7f80); /* above the largest bf16 */
}

static void test_f16_decodes_normals_subnormals_inf_and_nan(void **state)
{
    (void)state;
    assert_true(tsr_f16_to_f32(0x3c00) == 1.0f);
    assert_true(tsr_f16_to_f32(0xc000) == -2.0f);
    assert_true(tsr_f16_to_f32(0x7bff) == 65504.0f);
    assert_true(tsr_f16_to_f32(0x0400) == 0x1p-14f);        /* smallest normal */
    assert_true(tsr_f16_to_f32(0x0001) == 0x1p-24f);        /* smallest subnormal */
    assert_true(tsr_f16_to_f32(0x03ff) == 1023 * 0x1p-24f); /* largest subnormal */
    assert_true(tsr_f16_to_f32(0x8001) == -0x1p-24f);
    assert_true(tsr_f16_to_f32(0x0000) == 0.0f && !signbit(tsr_f16_to_f32(0x0000)));
    assert_true(tsr_f16_to_f32(0x8000) == 0.0f && signbit(tsr_f16_to_f32(0x8000)));
    assert_true(isinf(tsr_f16_to_f32(0x7c00)) && tsr_f16_to_f32(0x7c00) > 0);
    assert_true(isinf(tsr_f16_to_f32(0xfc00)) && tsr_f16_to_f32(0xfc00) < 0);
    assert_true(isnan(tsr_f16_to_f32(0x7e00)));
    assert_true(isnan(tsr_f16_to_f32(0x7c01)));
}

static void test_f16_encoding_is_correctly_rounded(void **state)
{
    (void)state;
    assert_int_equal(tsr_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(tsr_f32_to_f16(-0.0f), 0x8000);
    assert_int_equal(tsr_f32_to_f16(INFINITY), 0x7c00);
    assert_int_equal(tsr_f32_to_f16(-INFINITY), 0xfc00);
    assert_true(isnan(tsr_f16_to_f32(tsr_f32_to_f16(NAN))));
    assert_int_equal(tsr_f32_to_f16(65519.99f), 0x7bff);
    assert_int_equal(tsr_f32_to_f16(65520.0f), 0x7c00); /* tie to even is infinity */
    assert_int_equal(tsr_f32_to_f16(1e6f), 0x7c00);
    assert_int_equal(tsr_f32_to_f16(0x1p-25f), 0x0000);  /* tie between 0 and 2^-24 */
    assert_int_equal(tsr_f32_to_f16(0x1.000002p-25f), 0x0001);
    assert_int_equal(tsr_f32_to_f16(0x1.8p-24f), 0x0002); /* 1.5 units ties to 2 */
    assert_int_equal(tsr_f32_to_f16(1e-30f), 0x0000);
    /* Every finite half round trips, and the midpoint between consecutive
     * halves (exact in f32) goes to the even one, its neighbours to the
     * nearer: across subnormals, the normal boundary and exponent steps. */
    for (uint32_t h = 0; h < 0x7bff; h++) {
        float lo = tsr_f16_to_f32((uint16_t)h), hi = tsr_f16_to_f32((uint16_t)(h + 1));
        float mid = (lo + hi) / 2;
        uint32_t even = (h & 1) ? h + 1 : h;
        assert_int_equal(tsr_f32_to_f16(lo), h);
        assert_int_equal(tsr_f32_to_f16(-lo), h | 0x8000u);
        assert_true(mid > lo && mid < hi);
        assert_int_equal(tsr_f32_to_f16(mid), even);
        assert_int_equal(tsr_f32_to_f16(nextafterf(mid, INFINITY)), h + 1);
        assert_int_equal(tsr_f32_to_f16(nextafterf(mid, 0)), h);
    }
}

/* ---- header validation -------------------------------------------------- */

static void test_missing_checkpoint_names_model_safetensors(void **state)
{
    char *dir = make_tmpdir();

    (void)state;
    expect_open_error(dir, at(dir, "model.safetensors"), "No such file", NULL);
    rm_dir(dir);
}

/* A model's files are read only when they are regular files of a sane size: a FIFO
 * would block the reader for ever, /dev/zero never ends, a huge JSON stalls the
 * coordinator's loop.  Each is refused at once, naming the file and why. */
static void test_model_files_must_be_regular_and_bounded(void **state)
{
    char *dir = make_tmpdir();
    char err[1024];
    tsr_st_t *st = NULL;
    tsr_model_info_t m;

    (void)state;
    assert_int_equal(mkfifo(at(dir, "model.safetensors"), 0600), 0);
    expect_open_error(dir, at(dir, "model.safetensors: not a regular file (a FIFO)"), NULL);
    assert_int_equal(tsr_st_open(dir, &st, err, sizeof err), -1);

    assert_int_equal(mkdir(at(dir, "config.json"), 0700), 0);
    assert_int_equal(tsr_model_info_load(dir, &m, err, sizeof err), -1);
    assert_non_null(strstr(err, "config.json: not a regular file (a directory)"));
    assert_int_equal(rmdir(at(dir, "config.json")), 0);
    assert_int_equal(symlink("/dev/zero", at(dir, "config.json")), 0);
    tsr_model_links_outside(true);  /* a link out of the directory is refused before */
    assert_int_equal(tsr_model_info_load(dir, &m, err, sizeof err), -1);
    tsr_model_links_outside(false);
    assert_non_null(strstr(err, "config.json: not a regular file (a device)"));
    unlink(at(dir, "config.json"));
    write_bytes(dir, "config.json", "{}", 2);   /* made sparse: no disk is spent */
    assert_int_equal(truncate(at(dir, "config.json"), TSR_MODEL_CONFIG_MAX_BYTES + 1), 0);
    assert_int_equal(tsr_model_info_load(dir, &m, err, sizeof err), -1);
    assert_non_null(strstr(err, "config.json: too large"));

    assert_int_equal(mkfifo(at(dir, "tokenizer.json"), 0600), 0);
    assert_null(tsr_tok_load(dir, err, sizeof err));
    assert_non_null(strstr(err, "tokenizer.json: not a regular file (a FIFO)"));
    unlink(at(dir, "tokenizer.json"));
    write_bytes(dir, "tokenizer.json", "{}", 2);
    assert_int_equal(truncate(at(dir, "tokenizer.json"), TSR_TOKENIZER_MAX_BYTES + 1), 0);
    assert_null(tsr_tok_load(dir, err, sizeof err));
    assert_non_null(strstr(err, "tokenizer.json: too large"));
    rm_dir(dir);
}

/* err must not hold a byte of the secret file's text. */
static void expect_no_secret(const char *err)
{
    if (strstr(err, "root") || strstr(err, "SECRET") || strstr(err, "19000"))
        fail_msg("the message quotes the file: %s", err);
}

/* Issue 38, item 10: tokenizer.json -> /etc/shadow put "'[' or '{' expected near 'root'"
 * into status, which every API key reads: links were followed out of the model
 * directory, and the parser's message quoted the file.  Each file a model is read from
 * (config.json, tokenizer.json, tokenizer_config.json, model.safetensors, its index) is
 * refused when a link leads it out of the directory, naming the file; links inside are
 * followed, also when the directory itself is reached through one; and with links out
 * allowed, a file that is not what it should be is described by its place, none of its
 * bytes quoted (the header length of a safetensors file is its first 8 bytes). */
static void test_links_out_of_the_model_directory_are_refused_and_never_quoted(void **state)
{
    char *dir = make_tmpdir(), *out = make_tmpdir();
    static const char secret[] = "root:SECRET$6$hash:19000:0:99999:7:::\n";
    static const char tok[] = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, "
                              "\"merges\": []}}";
    char err[1024], real[600], link[600], num[32];
    tsr_model_info_t m;
    tsr_st_t *st = NULL;
    tsr_tokenizer_t *t;
    uint64_t hlen = 0;

    (void)state;
    write_bytes(out, "secret", secret, sizeof secret - 1);
    snprintf(real, sizeof real, "%s/secret", out);
    assert_int_equal(model_init(dir, SMALL, NULL), 0);
    write_bytes(dir, "tok.json", tok, sizeof tok - 1);

    /* Inside the directory a link is followed, also through a linked directory. */
    assert_int_equal(rename(at(dir, "config.json"), at(dir, "config-real.json")), 0);
    assert_int_equal(symlink("config-real.json", at(dir, "config.json")), 0);
    assert_int_equal(symlink("tok.json", at(dir, "tokenizer.json")), 0);
    assert_int_equal(rename(at(dir, "model.safetensors"), at(dir, "model-real.safetensors")), 0);
    assert_int_equal(symlink("model-real.safetensors", at(dir, "model.safetensors")), 0);
    snprintf(link, sizeof link, "%s/model", out);
    assert_int_equal(symlink(dir, link), 0);
    if (tsr_model_info_load(link, &m, err, sizeof err) < 0) fail_msg("%s", err);
    if (tsr_st_open(link, &st, err, sizeof err) < 0) fail_msg("%s", err);
    tsr_st_close(&st);
    t = tsr_tok_load(link, err, sizeof err);
    if (!t) fail_msg("%s", err);
    tsr_tok_destroy(&t);

    /* Out of it, each file is refused by name; allowed out, nothing is quoted. */
    static const char *const names[] = {"config.json", "tokenizer.json", "tokenizer_config.json",
                                        "model.safetensors", "model.safetensors.index.json"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        unlink(at(dir, names[i]));
        assert_int_equal(symlink(real, at(dir, names[i])), 0);
        for (int allow = 0; allow < 2; allow++) {
            tsr_model_links_outside(allow);
            err[0] = '\0';
            int rc = i == 0   ? tsr_model_info_load(dir, &m, err, sizeof err)
                     : i < 3 ? (t = tsr_tok_load(dir, err, sizeof err)) ? 0 : -1
                             : tsr_st_open(dir, &st, err, sizeof err);
            tsr_model_links_outside(false);
            assert_int_equal(rc, -1);
            if (!strstr(err, allow ? names[i] : at(dir, names[i])))
                fail_msg("%s: the message does not name the file: %s", names[i], err);
            if (!allow && !strstr(err, "leads out of the model directory"))
                fail_msg("%s: followed out of the directory: %s", names[i], err);
            expect_no_secret(err);
        }
        unlink(at(dir, names[i]));
        if (i == 0) assert_int_equal(symlink("config-real.json", at(dir, names[i])), 0);
        if (i == 1) assert_int_equal(symlink("tok.json", at(dir, names[i])), 0);
        if (i == 3) assert_int_equal(symlink("model-real.safetensors", at(dir, names[i])), 0);
    }
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | (uint8_t)secret[i];
    snprintf(num, sizeof num, "%llu", (unsigned long long)hlen);
    tsr_model_links_outside(true);
    unlink(at(dir, "model.safetensors"));
    assert_int_equal(symlink(real, at(dir, "model.safetensors")), 0);
    assert_int_equal(tsr_st_open(dir, &st, err, sizeof err), -1);
    tsr_model_links_outside(false);
    if (strstr(err, num)) fail_msg("the header length shows the file's first bytes: %s", err);
    unlink(link);
    rm_dir(dir);
    rm_dir(out);
}

/* The swapper of the race below: config.json becomes, over and over, a link to a file
 * outside the directory and then the regular file again, each by an atomic rename.  Its
 * paths are made beforehand, at() not being thread-safe. */
typedef struct {
    char outside[600], link[600], file[600], inside[600], config[600];
    atomic_bool stop;
} swap_t;

static void *swap_config(void *arg)
{
    swap_t *s = arg;
    while (!atomic_load(&s->stop)) {
        unlink(s->link);
        if (symlink(s->outside, s->link) == 0) rename(s->link, s->config);
        unlink(s->file);
        if (link(s->inside, s->file) == 0) rename(s->file, s->config);
    }
    return NULL;
}

/* Issue 38, item 10, attacked: the path was checked (realpath), then opened, then the
 * opened file compared with a stat of the checked path, which follows a link swapped in
 * between, so a loop renaming config.json between a regular file and a link out of the
 * directory got the outside file read 11 times in 200.  Whatever is swapped in, what is
 * opened must be inside the directory: every read gives the inside file or fails. */
static void test_a_link_swapped_in_while_opening_never_leads_out(void **state)
{
    char *dir = make_tmpdir(), *out = make_tmpdir();
    char err[1024];
    static swap_t s;
    pthread_t th;

    (void)state;
    write_bytes(out, "secret", "OUTSIDE", 7);
    snprintf(s.outside, sizeof s.outside, "%s/secret", out);
    snprintf(s.link, sizeof s.link, "%s/swap-link", dir);
    snprintf(s.file, sizeof s.file, "%s/swap-file", dir);
    snprintf(s.inside, sizeof s.inside, "%s/inside.json", dir);
    snprintf(s.config, sizeof s.config, "%s/config.json", dir);
    atomic_store(&s.stop, false);
    write_bytes(dir, "inside.json", "INSIDE", 6);
    assert_int_equal(link(at(dir, "inside.json"), at(dir, "config.json")), 0);
    assert_int_equal(pthread_create(&th, NULL, swap_config, &s), 0);
    for (int i = 0; i < 20000; i++) {
        size_t len = 0;
        char *text = tsr_model_read(dir, "config.json", 64, &len, err, sizeof err);
        if (!text) continue;  /* refused, or caught between unlink and rename */
        if (len != 6 || memcmp(text, "INSIDE", 6) != 0) {
            atomic_store(&s.stop, true);
            pthread_join(th, NULL);
            fail_msg("read %zu bytes from outside the directory (\"%.*s\") after %d reads",
                     len, (int)len, text, i);
        }
        free(text);
    }
    atomic_store(&s.stop, true);
    assert_int_equal(pthread_join(th, NULL), 0);
    rm_dir(dir);
    rm_dir(out);
}

/* A NaN or infinite weight is a damaged checkpoint: each read refuses it, naming the
 * tensor, the element and what it is, in every dtype, converted or raw. */
static void test_a_weight_that_is_not_finite_is_refused(void **state)
{
    static const struct { const char *dtype; unsigned bytes; uint32_t bits; const char *want; } c[] = {
        {"F32", 4, 0x7FC00000u, "element [1, 2] is NaN"},
        {"F32", 4, 0xFF800000u, "element [1, 2] is -Inf"},
        {"BF16", 2, 0x7F80u, "element [1, 2] is Inf"},
        {"BF16", 2, 0x7FC1u, "element [1, 2] is NaN"},
        {"F16", 2, 0xFC00u, "element [1, 2] is -Inf"},
    };
    (void)state;
    for (size_t k = 0; k < sizeof c / sizeof c[0]; k++) {
        char *dir = make_tmpdir(), hdr[128], err[512];
        snprintf(hdr, sizeof hdr, "{\"w\":{\"dtype\":\"%s\",\"shape\":[2,4],"
                 "\"data_offsets\":[0,%u]}}", c[k].dtype, 8 * c[k].bytes);
        size_t hlen = strlen(hdr), len = 8 + hlen + 8 * c[k].bytes;
        uint8_t *b = calloc(1, len);
        assert_non_null(b);
        for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
        memcpy(b + 8, hdr, hlen);
        for (unsigned i = 0; i < c[k].bytes; i++)   /* element 6: row 1, column 2 */
            b[8 + hlen + 6 * c[k].bytes + i] = (uint8_t)(c[k].bits >> (8 * i));
        write_bytes(dir, "model.safetensors", b, len);
        free(b);
        tsr_st_t *st = NULL;
        assert_int_equal(tsr_st_open(dir, &st, err, sizeof err), 0);
        const tsr_tensor_t *t = tsr_st_find(st, "w");
        float f[8];
        uint8_t raw[32];
        assert_int_equal(tsr_st_read_f32(st, t, 0, 1, 0, 4, f, err, sizeof err), 0);  /* row 0 */
        assert_int_equal(tsr_st_read_f32(st, t, 0, 2, 0, 4, f, err, sizeof err), -1);
        if (!strstr(err, "tensor w: ") || !strstr(err, c[k].want))
            fail_msg("%s: '%s' does not say '%s'", c[k].dtype, err, c[k].want);
        assert_int_equal(tsr_st_read_raw(st, t, 1, 2, 2, 3, raw, err, sizeof err), -1);
        if (!strstr(err, c[k].want))
            fail_msg("%s raw: '%s' does not say '%s'", c[k].dtype, err, c[k].want);
        assert_int_equal(tsr_st_read_raw(st, t, 0, 2, 3, 4, raw, err, sizeof err), 0);
        tsr_st_close(&st);
        rm_dir(dir);
    }
}

static void test_file_cut_in_the_header_is_reported(void **state)
{
    char *dir = make_tmpdir();
    const char *hdr = "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    size_t len;
    uint8_t *b = st_bytes(hdr, 8, &len);

    (void)state;
    write_bytes(dir, "model.safetensors", b, 20); /* length prefix + 12 header bytes */
    expect_open_error(dir, at(dir, "model.safetensors: the header length"),
                      "is larger than the file (20 bytes)", NULL);
    write_bytes(dir, "model.safetensors", b, 5);  /* not even the length prefix */
    expect_open_error(dir, at(dir, "model.safetensors: truncated"), NULL);
    free(b);
    rm_dir(dir);
}

static void test_file_cut_in_the_data_names_the_tensor(void **state)
{
    char *dir = make_tmpdir();
    struct stat sb;

    (void)state;
    assert_int_equal(model_init(dir, SMALL, NULL), 0);
    assert_int_equal(stat(at(dir, "model.safetensors"), &sb), 0);
    /* lm_head is written last; cutting 100 bytes leaves it short. */
    assert_int_equal(truncate(at(dir, "model.safetensors"), sb.st_size - 100), 0);
    expect_open_error(dir, at(dir, "model.safetensors: tensor lm_head.weight: data ["),
                      "is outside the data area", NULL);
    rm_dir(dir);
}

static void test_bad_header_json_is_reported(void **state)
{
    char *dir = make_tmpdir();

    (void)state;
    write_st(dir, "model.safetensors", "{\"w\": {\"dtype\": \"F32\", ", 16);
    expect_open_error(dir, at(dir, "model.safetensors: header is not valid JSON"), NULL);
    write_st(dir, "model.safetensors", "[1, 2]", 16);
    expect_open_error(dir, at(dir, "model.safetensors: header is not a JSON object"), NULL);
    rm_dir(dir);
}

static void test_header_length_larger_than_file_is_reported(void **state)
{
    char *dir = make_tmpdir();
    uint8_t b[64] = { 0 };

    (void)state;
    b[0] = 0x00;
    b[1] = 0x10; /* 4096-byte header in a 64-byte file */
    write_bytes(dir, "model.safetensors", b, sizeof b);
    expect_open_error(dir, at(dir, "model.safetensors: the header length (bytes 0 to 7) is "
                                   "larger than the file (64 bytes)"), NULL);
    b[1] = 0;
    b[4] = 1; /* 4 GiB: over the limit, never allocated */
    write_bytes(dir, "model.safetensors", b, sizeof b);
    expect_open_error(dir, "the header length (bytes 0 to 7) is larger than the limit", NULL);
    rm_dir(dir);
}

static void test_offsets_outside_the_file_name_the_tensor(void **state)
{
    char *dir = make_tmpdir();

    (void)state;
    write_st(dir, "model.safetensors",
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"model.layers.0.mlp.up_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4],"
             "\"data_offsets\":[8,24]}}", 16);
    expect_open_error(dir, at(dir, "model.safetensors: tensor model.layers.0.mlp.up_proj.weight:"
                                   " data [8, 24) is outside the data area of 16 bytes"), NULL);
    write_st(dir, "model.safetensors",
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", 16);
    expect_open_error(dir, "tensor a: data [8, 4) is outside", NULL);
    rm_dir(dir);
}

static void test_byte_count_not_matching_shape_names_the_tensor(void **state)
{
    char *dir = make_tmpdir();

    (void)state;
    write_st(dir, "model.safetensors",
             "{\"w\":{\"dtype\":\"BF16\",\"shape\":[3,2],\"data_offsets\":[0,16]}}", 16);
    expect_open_error(dir, at(dir, "model.safetensors: tensor w: data [0, 16) holds 16 bytes "
                                   "but shape and dtype BF16 call for 12"), NULL);
    /* A shape whose byte count wraps 64 bits must not pass as small. */
    write_st(dir, "model.safetensors",
             "{\"w\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],"
             "\"data_offsets\":[0,0]}}", 16);
    expect_open_error(dir, "tensor w: shape overflows", NULL);
    rm_dir(dir);
}

static void test_unsupported_dtype_names_tensor_and_dtype(void **state)
{
    char *dir = make_tmpdir();

    (void)state;
    write_st(dir, "model.safetensors",
             "{\"__metadata__\":{\"format\":\"pt\"},\"pos_ids\":{\"dtype\":\"I64\","
             "\"shape\":[2],\"data_offsets\":[0,16]}}", 16);
    expect_open_error(dir, at(dir, "model.safetensors: tensor pos_ids: dtype I64 not "
                                   "supported"), NULL);
    rm_dir(dir);
}

/* Malformed entries, each refused with the tensor named (pure parser). */
static void test_malformed_entries_are_refused_by_the_parser(void **state)
{
    static const struct { const char *hdr, *want; } cases[] = {
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}",
          "f: tensor w: expected an object with exactly dtype, shape and data_offsets" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", "tensor w: expected an object" },
        { "{\"w\":[1,2,3]}", "tensor w: expected an object" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1],\"data_offsets\":[0,4]}}",
          "tensor w: shape must be an array of at most 4" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}",
          "tensor w: shape[0] is not a non-negative integer" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}",
          "tensor w: shape[0]" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}",
          "tensor w: data_offsets must be" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}",
          "tensor w: data_offsets must be" },
        { "{\"w\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}",
          "tensor w: dtype is not a string" },
        { "{\"__metadata__\":{\"n\":1}}", "f: __metadata__.n must be a string" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
          "\"v\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
          "data overlaps tensor" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
          "\"w\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[4,8]}}",
          "f: header is not valid JSON" }, /* duplicate key */
    };

    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t len;
        uint8_t *b = st_bytes(cases[i].hdr, 16, &len);
        tsr_tensor_t *t = (tsr_tensor_t *)1;
        size_t n = 99;
        char err[512] = "";
        assert_int_equal(tsr_st_parse_header(b, len, len, "f", &t, &n, err, sizeof err), -1);
        assert_null(t);
        assert_int_equal(n, 0);
        if (strstr(err, cases[i].want) == NULL)
            fail_msg("case %zu: '%s' does not contain '%s'", i, err, cases[i].want);
        free(b);
    }
}

static void test_valid_header_parses_with_absolute_offsets(void **state)
{
    const char *hdr = "{\"__metadata__\":{\"format\":\"pt\"},"
                      "\"b\":{\"dtype\":\"F16\",\"shape\":[2,3],\"data_offsets\":[4,16]},"
                      "\"a\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
                      "\"z\":{\"dtype\":\"BF16\",\"shape\":[0,5],\"data_offsets\":[16,16]}}";
    size_t len, n;
    uint8_t *b = st_bytes(hdr, 16, &len);
    tsr_tensor_t *t;
    char err[512];

    (void)state;
    assert_int_equal(tsr_st_parse_header(b, len, len, "f", &t, &n, err, sizeof err), 0);
    assert_int_equal(n, 3);
    for (size_t i = 0; i < n; i++) {
        if (strcmp(t[i].name, "b") == 0) {
            assert_int_equal(t[i].dtype, TSR_DT_F16);
            assert_int_equal(t[i].ndim, 2);
            assert_int_equal(t[i].shape[1], 3);
            assert_int_equal(t[i].offset, 8 + strlen(hdr) + 4);
            assert_int_equal(t[i].nbytes, 12);
        } else if (strcmp(t[i].name, "a") == 0) {
            assert_int_equal(t[i].ndim, 0);
            assert_int_equal(t[i].nbytes, 4);
        }
    }
    tsr_tensors_free(t, n);
    free(b);
}

/* ---- expect ------------------------------------------------------------- */

static void test_expect_reports_a_missing_tensor(void **state)
{
    char *dir = make_tmpdir(), err[512], *want = NULL;
    int64_t shape[2] = { 50, 64 };
    tsr_st_t *st;

    (void)state;
    assert_int_equal(model_init(dir, SMALL, "--tied", NULL), 0);
    st = open_ok(dir);
    assert_int_equal(tsr_st_expect(st, "lm_head.weight", 2, shape, err, sizeof err), -1);
    assert_true(asprintf(&want, "%s: tensor lm_head.weight: missing", dir) > 0);
    assert_string_equal(err, want);
    assert_int_equal(tsr_st_expect(st, "model.embed_tokens.weight", 2, shape, err,
                                   sizeof err), 0);
    free(want);
    tsr_st_close(&st);
    rm_dir(dir);
}

static void test_expect_reports_a_shape_mismatch(void **state)
{
    char *dir = make_tmpdir(), err[512];
    int64_t shape[2] = { 64, 64 };
    tsr_st_t *st;

    (void)state;
    assert_int_equal(model_init(dir, SMALL, NULL), 0);
    st = open_ok(dir);
    assert_int_equal(tsr_st_expect(st, "model.layers.1.self_attn.k_proj.weight", 2, shape,
                                   err, sizeof err), -1);
    assert_non_null(strstr(err, at(dir, "model.safetensors: tensor "
                                        "model.layers.1.self_attn.k_proj.weight: shape [32, 64] "
                                        "does not match the config's [64, 64]")));
    assert_int_equal(tsr_st_expect(st, "model.norm.weight", 2, shape, err, sizeof err), -1);
    assert_non_null(strstr(err, "shape [64] does not match the config's [64, 64]"));
    tsr_st_close(&st);
    rm_dir(dir);
}

/* ---- index files -------------------------------------------------------- */

static const char one_tensor[] =
    "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";

static void write_index(const char *dir, const char *weight_map)
{
    char buf[1024];

    snprintf(buf, sizeof buf, "{\"metadata\":{\"total_size\":8},\"weight_map\":%s}",
             weight_map);
    write_bytes(dir, "model.safetensors.index.json", buf, strlen(buf));
}

static void test_index_pointing_at_a_missing_file_names_it(void **state)
{
    char *dir = make_tmpdir();

    (void)state;
    write_st(dir, "a.safetensors", one_tensor, 8);
    write_index(dir, "{\"w\":\"a.safetensors\",\"v\":\"b.safetensors\"}");
    expect_open_error(dir, at(dir, "b.safetensors: No such file"), NULL);
    rm_dir(dir);
}

static void test_index_file_names_must_stay_in_the_directory(void **state)
{
    char *dir = make_tmpdir();

    (void)state;
    write_st(dir, "a.safetensors", one_tensor, 8);
    write_index(dir, "{\"w\":\"../a.safetensors\"}");
    expect_open_error(dir, at(dir, "model.safetensors.index.json: weight_map: tensor w: "
                                   "file name ../a.safetensors must be a plain name"), NULL);
    write_index(dir, "{\"w\":\"sub/a.safetensors\"}");
    expect_open_error(dir, "file name sub/a.safetensors must be a plain name", NULL);
    write_index(dir, "{\"w\":\"..\"}");
    expect_open_error(dir, "file name .. must be a plain name", NULL);
    write_index(dir, "{\"w\":3}");
    expect_open_error(dir, "file name (not a string)", NULL);
    write_index(dir, "{}");
    expect_open_error(dir, "weight_map missing or not a non-empty object", NULL);
    rm_dir(dir);
}

static void test_index_tensor_absent_from_its_file_is_reported(void **state)
{
    char *dir = make_tmpdir();

    (void)state;
    write_st(dir, "a.safetensors", one_tensor, 8);
    write_st(dir, "b.safetensors",
             "{\"v\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8);
    /* v exists, but in b, not in a where the index says */
    write_index(dir, "{\"w\":\"a.safetensors\",\"v\":\"a.safetensors\","
                     "\"x\":\"b.safetensors\"}");
    expect_open_error(dir, at(dir, "a.safetensors: tensor v: listed in "),
                      "model.safetensors.index.json but not present in that file", NULL);
    rm_dir(dir);
}

static void test_tensor_in_two_files_is_rejected(void **state)
{
    char *dir = make_tmpdir();

    (void)state;
    write_st(dir, "a.safetensors", one_tensor, 8);
    write_st(dir, "b.safetensors", one_tensor, 8);
    write_index(dir, "{\"w\":\"a.safetensors\",\"x\":\"b.safetensors\"}");
    expect_open_error(dir, "safetensors: tensor w: also present in ", NULL);
    rm_dir(dir);
}

/* As many shards as tensors: the byte balancing must still leave no file
 * empty (an empty shard is in no weight_map entry, so nothing reads it). */
static void test_every_shard_holds_a_tensor(void **state)
{
    char *dir = make_tmpdir();
    int seen[12] = { 0 }, n = 0;
    tsr_st_t *st;
    char name[128];
    static const char *all[] = { "model.embed_tokens.weight", "model.norm.weight",
                                 "lm_head.weight" };
    static const char *layer[] = { "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                   "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                   "mlp.down_proj", "input_layernorm",
                                   "post_attention_layernorm" };

    (void)state;
    assert_int_equal(model_init(dir, SMALL, "--layers", "1", "--shards", "12", NULL), 0);
    st = open_ok(dir);
    for (int i = 0; i < 12; i++) {
        const tsr_tensor_t *t;
        if (i < 3)
            snprintf(name, sizeof name, "%s", all[i]);
        else
            snprintf(name, sizeof name, "model.layers.0.%s.weight", layer[i - 3]);
        t = tsr_st_find(st, name);
        assert_non_null(t);
        assert_true(t->file >= 0 && t->file < 12);
        n += !seen[t->file];
        seen[t->file] = 1;
    }
    assert_int_equal(n, 12);
    tsr_st_close(&st);
    rm_dir(dir);
}

static void test_bad_shard_header_names_the_shard(void **state)
{
    char *dir = make_tmpdir();

    (void)state;
    assert_int_equal(model_init(dir, SMALL, "--shards", "3", NULL), 0);
    write_st(dir, "model-00002-of-00003.safetensors",
             "{\"model.layers.1.mlp.up_proj.weight\":{\"dtype\":\"U8\",\"shape\":[1],"
             "\"data_offsets\":[0,1]}}", 1);
    expect_open_error(dir, at(dir, "model-00002-of-00003.safetensors: tensor "
                                   "model.layers.1.mlp.up_proj.weight: dtype U8"), NULL);
    rm_dir(dir);
}

/* ---- FP8 E4M3 (common/fp8.h) ---------------------------------------------- */

/* Every pattern widens to sign x 2^(e-7) x 1.m (e > 0) or sign x m x 2^-9,
 * S.1111.111 to NaN; every value narrows back to its own pattern; any
 * float narrows to the nearest value (ties to the even pattern), beyond 448
 * to 448, a NaN to NaN. */
static void test_e4m3_widens_exactly_and_narrows_to_the_nearest_even(void **state)
{
    (void)state;
    float val[256];
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        const float sign = b & 0x80 ? -1.0f : 1.0f;
        const float want = e == 15 && m == 7 ? NAN
                           : e ? sign * ldexpf(1.0f + (float)m / 8.0f, e - 7)
                               : sign * ldexpf((float)m, -9);
        val[b] = tsr_e4m3_to_f32((uint8_t)b);
        if (isnan(want) ? !isnan(val[b]) : memcmp(&want, &val[b], sizeof want))
            fail_msg("E4M3 0x%02x widens to %g, not %g", b, val[b], want);
        if (!isnan(want)) assert_int_equal(tsr_f32_to_e4m3(val[b]), b);
    }
    assert_true(val[0x7e] == 448.0f && val[0x01] == 0.001953125f);
    uint64_t r = 11;
    for (int i = 0; i < 200000; i++) {
        r = r * 6364136223846793005ULL + 1442695040888963407ULL;
        const float x = ldexpf((float)((r >> 40) & 0xffffff) / 16777216.0f, (int)((r >> 20) % 24) - 14) *
                        (r & 1 ? -1.0f : 1.0f);
        const int got = tsr_f32_to_e4m3(x);
        int best = -1;
        double bd = INFINITY;
        for (int b = 0; b < 256; b++) {   /* the nearest finite value of x's sign, ties to even */
            if (isnan(val[b]) || ((b & 0x80) != 0) != (signbit(x) != 0) || (x == 0 && (b & 0x7f)))
                continue;
            const double d = fabs((double)val[b] - (fabs(x) > 448 ? copysign(448, x) : x));
            if (d < bd || (d == bd && (b & 1) == 0)) bd = d, best = b;
        }
        if (got != best)
            fail_msg("%.9g narrows to 0x%02x (%g), the nearest even is 0x%02x (%g)", x, got,
                     val[got], best, val[best]);
    }
    assert_int_equal(tsr_f32_to_e4m3(1e9f), 0x7e);
    assert_int_equal(tsr_f32_to_e4m3(-460.0f), 0xfe);
    assert_int_equal(tsr_f32_to_e4m3(NAN) & 0x7f, 0x7f);
    assert_int_equal(tsr_f32_to_e4m3(0.0009765625f), 0x00);   /* half the least: to even, 0 */
    assert_int_equal(tsr_f32_to_e4m3(0.0029296875f), 0x02);   /* 1.5 steps: to even, 2 */
}

/* ---- fuzz ----------------------------------------------------------------- */

static uint64_t fuzz_rng = 0x2545f4914f6cdd1dull;

static uint32_t fuzz_next(void)
{
    fuzz_rng ^= fuzz_rng << 13;
    fuzz_rng ^= fuzz_rng >> 7;
    fuzz_rng ^= fuzz_rng << 17;
    return (uint32_t)(fuzz_rng >> 32);
}

/* Parses buf; whatever is accepted must be self-consistent. */
static void fuzz_one(const uint8_t *buf, size_t len, uint64_t file_size)
{
    tsr_tensor_t *t = NULL;
    size_t n = 0;
    char err[256];

    if (tsr_st_parse_header(buf, len, file_size, "fuzz", &t, &n, err, sizeof err) < 0) {
        assert_null(t);
        assert_true(strncmp(err, "fuzz: ", 6) == 0);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        uint64_t want = tsr_dtype_size(t[i].dtype);
        for (int d = 0; d < t[i].ndim; d++)
            want *= (uint64_t)t[i].shape[d];
        assert_true(t[i].offset + t[i].nbytes <= file_size);
        assert_int_equal(t[i].nbytes, want);
    }
    tsr_tensors_free(t, n);
}

static void test_parser_survives_random_and_mutated_headers(void **state)
{
    const char *hdr = "{\"__metadata__\":{\"format\":\"pt\"},"
                      "\"a.weight\":{\"dtype\":\"F16\",\"shape\":[2,3],\"data_offsets\":[0,12]},"
                      "\"b\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[12,16]},"
                      "\"c\":{\"dtype\":\"F32\",\"shape\":[1,1,1,2],\"data_offsets\":[16,24]}}";
    static const char tokens[] = "{}[],:\"0123456789-e.FBI";
    size_t base_len, len;
    uint8_t *base = st_bytes(hdr, 24, &base_len), *buf = malloc(base_len + 64);

    (void)state;
    assert_non_null(buf);
    {   /* the base must be valid, or every mutation tests only the error path */
        tsr_tensor_t *t;
        size_t n;
        char err[256];
        assert_int_equal(tsr_st_parse_header(base, base_len, base_len, "f", &t, &n, err,
                                             sizeof err), 0);
        assert_int_equal(n, 3);
        tsr_tensors_free(t, n);
    }
    for (int iter = 0; iter < 6000; iter++) {
        uint32_t mode = fuzz_next() % 4;
        memcpy(buf, base, base_len);
        len = base_len;
        if (mode == 0) { /* pure noise, with a plausible length prefix half the time */
            for (size_t i = 0; i < len; i++)
                buf[i] = (uint8_t)fuzz_next();
            if (fuzz_next() & 1)
                memcpy(buf, base, 8);
        } else if (mode == 1) { /* flip a few bytes of the header */
            for (int k = 0; k < 1 + (int)(fuzz_next() % 4); k++)
                buf[8 + fuzz_next() % (len - 8)] = (uint8_t)fuzz_next();
        } else if (mode == 2) { /* swap in JSON-ish characters */
            for (int k = 0; k < 1 + (int)(fuzz_next() % 3); k++)
                buf[8 + fuzz_next() % (len - 8)] = (uint8_t)tokens[fuzz_next() % (sizeof tokens - 1)];
        } else { /* truncate anywhere, or lie about the file size or length */
            len = fuzz_next() % (base_len + 1);
            if (fuzz_next() & 1)
                buf[fuzz_next() % 8] = (uint8_t)fuzz_next();
        }
        fuzz_one(buf, len, (fuzz_next() % 8) ? len : fuzz_next() % (2 * base_len));
    }
    free(base);
    free(buf);
}

/* ---- model config: forward-pass fields ----------------------------------- */

static const char *cfg_base =
    "\"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, "
    "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 100, "
    "\"max_position_embeddings\": 64";

/* Writes {cfg_base, extra} as DIR/config.json and loads it. */
static int load_cfg(const char *extra, tsr_model_info_t *m, char *err, size_t errlen)
{
    char *dir = make_tmpdir(), *text = NULL;
    int rc;

    assert_true(asprintf(&text, "{%s%s%s}", cfg_base, extra[0] ? ", " : "", extra) > 0);
    write_bytes(dir, "config.json", text, strlen(text));
    err[0] = '\0';
    rc = tsr_model_info_load(dir, m, err, errlen);
    free(text);
    rm_dir(dir);
    return rc;
}

static void test_model_config_reads_forward_pass_fields(void **state)
{
    tsr_model_info_t m;
    char err[512];

    (void)state;
    assert_int_equal(load_cfg("\"architectures\": [\"LlamaForCausalLM\"], \"hidden_act\": "
                              "\"silu\", \"rms_norm_eps\": 1e-05, \"rope_theta\": 500000, "
                              "\"bos_token_id\": 128000, "
                              "\"eos_token_id\": [128001, 128008, 128009], "
                              "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, "
                              "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                              "\"original_max_position_embeddings\": 8192}",
                              &m, err, sizeof err), 0);
    assert_true(m.rms_norm_eps == 1e-5f);
    assert_true(m.rope_theta == 500000.0f);
    assert_int_equal(m.head_dim, 16);
    assert_int_equal(m.bos_token_id, 128000);
    assert_int_equal(m.eos_token_id, 128001);
    assert_int_equal(m.n_eos, 3);
    assert_int_equal(m.eos_ids[2], 128009);
    assert_int_equal(m.rope_llama3, 1);
    assert_true(m.rope_factor == 8.0f);
    assert_true(m.rope_low_freq_factor == 1.0f);
    assert_true(m.rope_high_freq_factor == 4.0f);
    assert_int_equal(m.rope_original_max_pos, 8192);

    /* "type" is the older spelling; head_dim may be explicit (Mistral Nemo). */
    assert_int_equal(load_cfg("\"eos_token_id\": 2, \"head_dim\": 32, \"rope_scaling\": "
                              "{\"type\": \"llama3\", \"factor\": 32.0, \"low_freq_factor\": 1, "
                              "\"high_freq_factor\": 4, \"original_max_position_embeddings\": "
                              "8192.0}", &m, err, sizeof err), 0);
    assert_int_equal(m.head_dim, 32);
    assert_int_equal(m.eos_token_id, 2);
    assert_int_equal(m.n_eos, 1);
    assert_int_equal(m.eos_ids[0], 2);
    assert_int_equal(m.rope_llama3, 1);
    assert_true(m.rope_factor == 32.0f);
}

static void test_model_config_forward_fields_default_like_transformers(void **state)
{
    tsr_model_info_t m;
    char err[512];

    (void)state;
    assert_int_equal(load_cfg("\"rope_scaling\": null, \"bos_token_id\": null", &m, err,
                              sizeof err), 0);
    assert_true(m.rms_norm_eps == 1e-6f);
    assert_true(m.rope_theta == 10000.0f);
    assert_int_equal(m.head_dim, 16);
    assert_int_equal(m.bos_token_id, -1);
    assert_int_equal(m.eos_token_id, -1);
    assert_int_equal(m.n_eos, 0);
    assert_int_equal(m.rope_llama3, 0);
}

/* Each refusal names the field and the value found. */
static void test_model_config_refusals_name_the_field(void **state)
{
    static const struct { const char *extra, *want; } cases[] = {
        { "\"architectures\": [\"GPT2LMHeadModel\"]",
          "config.json: architectures[0] 'GPT2LMHeadModel' not supported" },
        { "\"architectures\": []", "config.json: architectures must be" },
        { "\"hidden_act\": \"gelu\"", "config.json: hidden_act 'gelu' not supported" },
        { "\"attention_bias\": true", "config.json: attention_bias true not supported" },
        { "\"mlp_bias\": true", "config.json: mlp_bias true not supported" },
        { "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}",
          "config.json: rope_scaling type 'yarn' not supported" },
        { "\"rope_scaling\": {\"factor\": 4.0}", "rope_scaling type '(missing)'" },
        { "\"rope_scaling\": {\"rope_type\": \"llama3\", \"low_freq_factor\": 1, "
          "\"high_freq_factor\": 4, \"original_max_position_embeddings\": 8192}",
          "config.json: rope_scaling.factor missing" },
        { "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": -8, \"low_freq_factor\": 1, "
          "\"high_freq_factor\": 4, \"original_max_position_embeddings\": 8192}",
          "rope_scaling.factor must be a positive number" },
        { "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1, "
          "\"high_freq_factor\": 4}", "rope_scaling.original_max_position_embeddings missing" },
        { "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 4, "
          "\"high_freq_factor\": 1, \"original_max_position_embeddings\": 8192}",
          "rope_scaling.high_freq_factor must exceed low_freq_factor" },
        { "\"rms_norm_eps\": 0", "config.json: rms_norm_eps must be a positive number" },
        { "\"rope_theta\": \"big\"", "config.json: rope_theta must be a positive number" },
        { "\"eos_token_id\": [1, \"x\"]", "config.json: eos_token_id must be" },
        { "\"eos_token_id\": [1,2,3,4,5,6,7,8,9]", "eos_token_id lists 9 ids" },
        { "\"bos_token_id\": -3", "config.json: bos_token_id must be" },
        { "\"head_dim\": 0", "config.json: head_dim missing or not a positive integer" },
    };
    tsr_model_info_t m;
    char err[512];

    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_int_equal(load_cfg(cases[i].extra, &m, err, sizeof err), -1);
        if (strstr(err, cases[i].want) == NULL)
            fail_msg("case %zu: '%s' does not contain '%s'", i, err, cases[i].want);
    }
    /* Mistral is the same architecture. */
    assert_int_equal(load_cfg("\"architectures\": [\"MistralForCausalLM\"]", &m, err,
                              sizeof err), 0);
}

static void test_model_init_config_loads_back(void **state)
{
    char *dir = make_tmpdir();
    tsr_model_info_t m;
    char err[512];

    (void)state;
    assert_int_equal(model_init(dir, SMALL, "--dtype", "bf16", "--tied", "--llama3-rope",
                                "--rope-theta", "500000", NULL), 0);
    if (tsr_model_info_load(dir, &m, err, sizeof err) < 0)
        fail_msg("%s", err);
    assert_int_equal(m.hidden_size, 64);
    assert_int_equal(m.intermediate_size, 96);
    assert_int_equal(m.num_hidden_layers, 2);
    assert_int_equal(m.num_attention_heads, 4);
    assert_int_equal(m.num_key_value_heads, 2);
    assert_int_equal(m.vocab_size, 50);
    assert_int_equal(m.max_position_embeddings, 128);
    assert_int_equal(m.tie_word_embeddings, 1);
    assert_int_equal(m.dtype_bytes, 2);
    assert_int_equal(m.head_dim, 16);
    assert_true(m.rms_norm_eps == 1e-5f);
    assert_true(m.rope_theta == 500000.0f);
    assert_int_equal(m.bos_token_id, 1);
    assert_int_equal(m.eos_token_id, 2);
    assert_int_equal(m.rope_llama3, 1);
    assert_int_equal(m.rope_original_max_pos, 16);
    rm_dir(dir);
}

static void test_model_init_rejects_bad_arguments_and_overwrites(void **state)
{
    char *dir = make_tmpdir();

    (void)state;
    assert_int_equal(model_init(dir, "--hidden", "60", "--heads", "8", NULL), 2);
    assert_int_equal(model_init(dir, "--heads", "8", "--kv-heads", "3", NULL), 2);
    assert_int_equal(model_init(dir, "--hidden", "24", "--heads", "8", "--kv-heads", "1",
                                NULL), 2); /* odd head_dim */
    assert_int_equal(model_init(dir, "--dtype", "int8", NULL), 2);
    assert_int_equal(model_init(dir, "--layers", "0", NULL), 2);
    assert_int_equal(model_init(dir, "--layers", "1", "--shards", "13", NULL), 2);
    assert_int_equal(access(at(dir, "config.json"), F_OK), -1); /* nothing written */
    assert_int_equal(model_init(dir, SMALL, NULL), 0);
    assert_int_equal(model_init(dir, SMALL, NULL), 1);
    /* Forcing a sharded layout over a single file must not leave the old
     * file shadowing, nor an old index shadowing a new single file. */
    assert_int_equal(model_init(dir, SMALL, "--force", "--shards", "2", NULL), 0);
    assert_int_not_equal(access(at(dir, "model.safetensors"), F_OK), 0);
    assert_int_equal(model_init(dir, SMALL, "--force", NULL), 0);
    assert_int_not_equal(access(at(dir, "model.safetensors.index.json"), F_OK), 0);
    rm_dir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_init_writes_hf_llama_names_shapes_and_dtype),
        cmocka_unit_test(test_model_init_tied_has_no_lm_head),
        cmocka_unit_test(test_slices_equal_the_full_read_for_every_dtype),
        cmocka_unit_test(test_large_read_across_chunks_matches_row_reads),
        cmocka_unit_test(test_read_outside_the_shape_is_refused),
        cmocka_unit_test(test_model_init_values_are_deterministic_and_scaled),
        cmocka_unit_test(test_sharded_checkpoint_reads_identically_to_single_file),
        cmocka_unit_test(test_bf16_conversion_is_exact_and_rounds_to_nearest_even),
        cmocka_unit_test(test_f16_decodes_normals_subnormals_inf_and_nan),
        cmocka_unit_test(test_f16_encoding_is_correctly_rounded),
        cmocka_unit_test(test_missing_checkpoint_names_model_safetensors),
        cmocka_unit_test(test_file_cut_in_the_header_is_reported),
        cmocka_unit_test(test_file_cut_in_the_data_names_the_tensor),
        cmocka_unit_test(test_bad_header_json_is_reported),
        cmocka_unit_test(test_header_length_larger_than_file_is_reported),
        cmocka_unit_test(test_offsets_outside_the_file_name_the_tensor),
        cmocka_unit_test(test_byte_count_not_matching_shape_names_the_tensor),
        cmocka_unit_test(test_unsupported_dtype_names_tensor_and_dtype),
        cmocka_unit_test(test_malformed_entries_are_refused_by_the_parser),
        cmocka_unit_test(test_valid_header_parses_with_absolute_offsets),
        cmocka_unit_test(test_expect_reports_a_missing_tensor),
        cmocka_unit_test(test_expect_reports_a_shape_mismatch),
        cmocka_unit_test(test_index_pointing_at_a_missing_file_names_it),
        cmocka_unit_test(test_index_file_names_must_stay_in_the_directory),
        cmocka_unit_test(test_index_tensor_absent_from_its_file_is_reported),
        cmocka_unit_test(test_tensor_in_two_files_is_rejected),
        cmocka_unit_test(test_every_shard_holds_a_tensor),
        cmocka_unit_test(test_bad_shard_header_names_the_shard),
        cmocka_unit_test(test_e4m3_widens_exactly_and_narrows_to_the_nearest_even),
        cmocka_unit_test(test_parser_survives_random_and_mutated_headers),
        cmocka_unit_test(test_model_config_reads_forward_pass_fields),
        cmocka_unit_test(test_model_config_forward_fields_default_like_transformers),
        cmocka_unit_test(test_model_config_refusals_name_the_field),
        cmocka_unit_test(test_model_init_config_loads_back),
        cmocka_unit_test(test_model_files_must_be_regular_and_bounded),
        cmocka_unit_test(test_links_out_of_the_model_directory_are_refused_and_never_quoted),
        cmocka_unit_test(test_a_link_swapped_in_while_opening_never_leads_out),
        cmocka_unit_test(test_a_weight_that_is_not_finite_is_refused),
        cmocka_unit_test(test_model_init_rejects_bad_arguments_and_overwrites),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
