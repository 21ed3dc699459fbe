/* model_init.c: `tessera model-init DIR`, a random Llama checkpoint in
 * Hugging Face layout (config.json + safetensors), for tests and demos that
 * must not depend on downloading real weights.
 *
 * Values are a pure function of (seed, tensor name), so a sharded and a
 * single-file checkpoint with the same seed hold identical weights.  Files
 * are written tensor by tensor through a small buffer: every offset is known
 * from the shapes before the first byte, so the header goes first and the
 * model is never held in memory. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <jansson.h>

#include "cli.h"
#include "common/util.h"
#include "common/safetensors.h"
#include "common/tokenizer.h"

#define MI_CHUNK 65536 /* elements generated and written per step */

typedef struct {
    const char *dir;
    uint64_t seed;
    int hidden, inter, layers, heads, kv_heads, vocab, max_pos, shards;
    tsr_dtype_t dtype;
    int tied, llama3, force, no_tokenizer;
    double rope_theta;
} mi_opts_t;

typedef enum { W_LINEAR, W_EMBED, W_NORM } mi_kind_t;

typedef struct {
    char name[96];
    int ndim;
    int64_t shape[2];
    mi_kind_t kind;
    uint64_t nbytes;
    int shard;
} mi_spec_t;

static void mi_usage(FILE *f)
{
    fprintf(f,
            "usage: tessera model-init DIR [options]\n"
            "\n"
            "Writes a random Llama checkpoint in Hugging Face format: DIR/config.json and\n"
            "DIR/model.safetensors (or N shards plus model.safetensors.index.json).  The\n"
            "weights depend only on the seed and are scaled so activations stay O(1).\n"
            "  --seed S            PRNG seed (default 1)\n"
            "  --hidden H          hidden size (default 256)\n"
            "  --intermediate I    MLP size (default 688)\n"
            "  --layers L          decoder layers (default 8)\n"
            "  --heads N           attention heads, must divide H (default 8)\n"
            "  --kv-heads K        KV heads, must divide N (default 4)\n"
            "  --vocab V           vocabulary size (default 1024)\n"
            "  --max-pos P         max_position_embeddings (default 512)\n"
            "  --dtype T           f32, bf16 or f16 (default f32)\n"
            "  --tied              tie lm_head to the embedding (no lm_head.weight)\n"
            "  --rope-theta T      RoPE base (default 10000)\n"
            "  --llama3-rope       add Llama 3.1 style rope_scaling\n"
            "  --shards N          split the weights over N files (default 1)\n"
            "  --no-tokenizer      write no tokenizer.json (by default the small byte-level\n"
            "                      tokenizer the repository ships, 1,024 ids, is written\n"
            "                      when its ids cover --vocab: 1024 to 1092; else none,\n"
            "                      and model-init says so)\n"
            "  --force             overwrite an existing checkpoint in DIR\n");
}

/* ---- arguments ---------------------------------------------------------- */

static int parse_int(const char *opt, const char *s, long max, int *out)
{
    char *end;
    long v;

    errno = 0;
    v = strtol(s, &end, 10);
    if (errno || *end || !*s || v < 1 || v > max) {
        fprintf(stderr, "tessera model-init: %s: expected an integer 1..%ld, got '%s'\n",
                opt, max, s);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int parse_seed(const char *s, uint64_t *out)
{
    char *end;

    errno = 0;
    *out = strtoull(s, &end, 0);
    if (errno || *end || !*s || *s == '-') {
        fprintf(stderr, "tessera model-init: --seed: expected an unsigned integer, got '%s'\n",
                s);
        return -1;
    }
    return 0;
}

static int parse_theta(const char *s, double *out)
{
    char *end;

    errno = 0;
    *out = strtod(s, &end);
    if (errno || *end || !*s || !(*out > 0) || !isfinite(*out)) {
        fprintf(stderr, "tessera model-init: --rope-theta: expected a positive number, "
                "got '%s'\n", s);
        return -1;
    }
    return 0;
}

static int parse_dtype_opt(const char *s, tsr_dtype_t *out)
{
    if (strcmp(s, "f32") == 0)
        *out = TSR_DT_F32;
    else if (strcmp(s, "bf16") == 0)
        *out = TSR_DT_BF16;
    else if (strcmp(s, "f16") == 0)
        *out = TSR_DT_F16;
    else {
        fprintf(stderr, "tessera model-init: --dtype: expected f32, bf16 or f16, got '%s'\n",
                s);
        return -1;
    }
    return 0;
}

/* One option; returns 0, -1 (bad value) or 1 (--help was printed). */
static int apply_opt(int o, const char *arg, mi_opts_t *m)
{
    switch (o) {
    case 's': return parse_seed(arg, &m->seed);
    case 'H': return parse_int("--hidden", arg, 65536, &m->hidden);
    case 'I': return parse_int("--intermediate", arg, 1 << 20, &m->inter);
    case 'L': return parse_int("--layers", arg, 1024, &m->layers);
    case 'N': return parse_int("--heads", arg, 4096, &m->heads);
    case 'K': return parse_int("--kv-heads", arg, 4096, &m->kv_heads);
    case 'V': return parse_int("--vocab", arg, 1 << 24, &m->vocab);
    case 'P': return parse_int("--max-pos", arg, 1 << 24, &m->max_pos);
    case 'S': return parse_int("--shards", arg, 99999, &m->shards);
    case 'd': return parse_dtype_opt(arg, &m->dtype);
    case 'r': return parse_theta(arg, &m->rope_theta);
    case 't': m->tied = 1; return 0;
    case 'l': m->llama3 = 1; return 0;
    case 'f': m->force = 1; return 0;
    case 'T': m->no_tokenizer = 1; return 0;
    case 'h': mi_usage(stdout); return 1;
    default: mi_usage(stderr); return -1;
    }
}

/* Returns 0 to go on, 1 when --help was served, 2 on bad usage. */
static int parse_args(int argc, char **argv, mi_opts_t *m)
{
    static const struct option opts[] = {
        {"seed", required_argument, 0, 's'},    {"hidden", required_argument, 0, 'H'},
        {"intermediate", required_argument, 0, 'I'}, {"layers", required_argument, 0, 'L'},
        {"heads", required_argument, 0, 'N'},   {"kv-heads", required_argument, 0, 'K'},
        {"vocab", required_argument, 0, 'V'},   {"max-pos", required_argument, 0, 'P'},
        {"dtype", required_argument, 0, 'd'},   {"tied", no_argument, 0, 't'},
        {"rope-theta", required_argument, 0, 'r'}, {"llama3-rope", no_argument, 0, 'l'},
        {"shards", required_argument, 0, 'S'},  {"force", no_argument, 0, 'f'},
        {"no-tokenizer", no_argument, 0, 'T'},  {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    int o, r;

    optind = 0; /* 0 re-initialises GNU getopt (and its argument permutation) */
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        r = apply_opt(o, optarg, m);
        if (r != 0)
            return r > 0 ? 1 : 2;
    }
    if (optind != argc - 1) {
        mi_usage(stderr);
        return 2;
    }
    m->dir = argv[optind];
    return 0;
}

static int n_tensors(const mi_opts_t *m)
{
    return 9 * m->layers + 2 + (m->tied ? 0 : 1);
}

/* The shapes must make a model the forward pass can run. */
static int validate(const mi_opts_t *m)
{
    const char *why = NULL;
    char buf[256];

    if (m->hidden % m->heads != 0)
        snprintf(buf, sizeof buf, "--heads %d does not divide --hidden %d", m->heads,
                 m->hidden), why = buf;
    else if (m->heads % m->kv_heads != 0)
        snprintf(buf, sizeof buf, "--kv-heads %d does not divide --heads %d", m->kv_heads,
                 m->heads), why = buf;
    else if ((m->hidden / m->heads) % 2 != 0) /* rotate-half RoPE pairs dimensions */
        snprintf(buf, sizeof buf, "head dimension %d (--hidden / --heads) must be even",
                 m->hidden / m->heads), why = buf;
    else if (m->shards > n_tensors(m))
        snprintf(buf, sizeof buf, "--shards %d exceeds the %d tensors to shard", m->shards,
                 n_tensors(m)), why = buf;
    if (why == NULL)
        return 0;
    fprintf(stderr, "tessera model-init: %s\n", why);
    return -1;
}

/* ---- tensor list -------------------------------------------------------- */

static void add_spec(mi_spec_t *s, int *n, mi_kind_t kind, int64_t rows, int64_t cols,
                     tsr_dtype_t dt, const char *name)
{
    mi_spec_t *t = &s[(*n)++];

    snprintf(t->name, sizeof t->name, "%s", name);
    t->kind = kind;
    t->ndim = cols > 0 ? 2 : 1;
    t->shape[0] = rows;
    t->shape[1] = cols;
    t->nbytes = (uint64_t)rows * (uint64_t)(cols > 0 ? cols : 1) * tsr_dtype_size(dt);
}

/* One tensor of layer i, "model.layers.{i}.{what}.weight". */
static void add_layer(mi_spec_t *s, int *n, mi_kind_t kind, int64_t rows, int64_t cols,
                      tsr_dtype_t dt, int i, const char *what)
{
    char name[96];

    snprintf(name, sizeof name, "model.layers.%d.%s.weight", i, what);
    add_spec(s, n, kind, rows, cols, dt, name);
}

/* Names and shapes exactly as transformers' LlamaForCausalLM, in its
 * state_dict order. */
static mi_spec_t *build_specs(const mi_opts_t *m, int *n_out)
{
    int64_t h = m->hidden, in = m->inter, hd = m->hidden / m->heads;
    int64_t q = m->heads * hd, kv = m->kv_heads * hd;
    mi_spec_t *s = calloc((size_t)n_tensors(m), sizeof *s);
    tsr_dtype_t dt = m->dtype;
    int n = 0;

    if (s == NULL)
        return NULL;
    add_spec(s, &n, W_EMBED, m->vocab, h, dt, "model.embed_tokens.weight");
    for (int i = 0; i < m->layers; i++) {
        add_layer(s, &n, W_LINEAR, q, h, dt, i, "self_attn.q_proj");
        add_layer(s, &n, W_LINEAR, kv, h, dt, i, "self_attn.k_proj");
        add_layer(s, &n, W_LINEAR, kv, h, dt, i, "self_attn.v_proj");
        add_layer(s, &n, W_LINEAR, h, q, dt, i, "self_attn.o_proj");
        add_layer(s, &n, W_LINEAR, in, h, dt, i, "mlp.gate_proj");
        add_layer(s, &n, W_LINEAR, in, h, dt, i, "mlp.up_proj");
        add_layer(s, &n, W_LINEAR, h, in, dt, i, "mlp.down_proj");
        add_layer(s, &n, W_NORM, h, 0, dt, i, "input_layernorm");
        add_layer(s, &n, W_NORM, h, 0, dt, i, "post_attention_layernorm");
    }
    add_spec(s, &n, W_NORM, h, 0, dt, "model.norm.weight");
    if (!m->tied)
        add_spec(s, &n, W_LINEAR, m->vocab, h, dt, "lm_head.weight");
    *n_out = n;
    return s;
}

/* Contiguous runs of tensors, balanced by bytes, none empty: shard k closes
 * once it holds its share of what is left, or when the remaining tensors
 * are only just enough for one per remaining shard. */
static void assign_shards(mi_spec_t *s, int n, int shards)
{
    uint64_t left = 0, in_shard = 0;
    int shard = 0;

    for (int i = 0; i < n; i++)
        left += s[i].nbytes;
    for (int i = 0; i < n; i++) {
        int shards_after = shards - 1 - shard;
        s[i].shard = shard;
        in_shard += s[i].nbytes;
        left -= s[i].nbytes;
        if (shards_after > 0 &&
            (in_shard * (uint64_t)(shards_after + 1) >= in_shard + left ||
             n - 1 - i == shards_after)) {
            shard++;
            in_shard = 0;
        }
    }
}

/* ---- values ------------------------------------------------------------- */

typedef struct {
    uint64_t state;
    int have_spare;
    double spare;
} mi_rng_t;

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Seeding from the name, not the position, keeps a tensor's values the
 * same however the checkpoint is laid out. */
static void rng_seed(mi_rng_t *r, uint64_t seed, const char *name)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */

    for (const char *p = name; *p; p++)
        h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
    r->state = seed ^ h;
    r->have_spare = 0;
}

/* Uniform in [-1, 1). */
static double rng_uniform(mi_rng_t *r)
{
    return (double)(splitmix64(&r->state) >> 11) * 0x1p-52 - 1.0;
}

/* Standard normal by Box-Muller, both outputs used. */
static double rng_normal(mi_rng_t *r)
{
    double u1, u2, rad;

    if (r->have_spare) {
        r->have_spare = 0;
        return r->spare;
    }
    u1 = ((double)(splitmix64(&r->state) >> 11) + 1.0) * 0x1p-53; /* (0, 1] */
    u2 = (double)(splitmix64(&r->state) >> 11) * 0x1p-53;
    rad = sqrt(-2.0 * log(u1));
    r->spare = rad * sin(2.0 * M_PI * u2);
    r->have_spare = 1;
    return rad * cos(2.0 * M_PI * u2);
}

/* Linear weights have variance 1/fan_in so x @ W.T keeps unit scale. */
static float next_value(const mi_spec_t *t, mi_rng_t *r)
{
    switch (t->kind) {
    case W_LINEAR: return (float)(rng_uniform(r) * sqrt(3.0 / (double)t->shape[1]));
    case W_EMBED: return (float)rng_normal(r);
    case W_NORM: return (float)(1.0 + 0.1 * rng_uniform(r));
    }
    return 0;
}

static void encode(tsr_dtype_t dt, const float *v, size_t n, uint8_t *out)
{
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        if (dt == TSR_DT_F32) {
            memcpy(out + 4 * i, &v[i], 4); /* little-endian host, as the reader */
            continue;
        }
        h = dt == TSR_DT_BF16 ? tsr_f32_to_bf16(v[i]) : tsr_f32_to_f16(v[i]);
        out[2 * i] = (uint8_t)h;
        out[2 * i + 1] = (uint8_t)(h >> 8);
    }
}

/* ---- files -------------------------------------------------------------- */

static int write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;

    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int write_tensor(int fd, const mi_spec_t *t, tsr_dtype_t dt, uint64_t seed,
                        float *vals, uint8_t *bytes)
{
    uint64_t left = t->nbytes / tsr_dtype_size(dt);
    mi_rng_t r;

    rng_seed(&r, seed, t->name);
    while (left > 0) {
        size_t k = left < MI_CHUNK ? (size_t)left : MI_CHUNK;
        for (size_t i = 0; i < k; i++)
            vals[i] = next_value(t, &r);
        encode(dt, vals, k, bytes);
        if (write_all(fd, bytes, k * tsr_dtype_size(dt)) < 0)
            return -1;
        left -= k;
    }
    return 0;
}

/* The safetensors header of one shard, padded with spaces to a multiple of
 * 8 bytes so the data area stays aligned (as the reference writer does).
 * Caller frees. */
static char *shard_header(const mi_spec_t *s, int n, int shard, tsr_dtype_t dt,
                          size_t *len_out)
{
    json_t *root = json_object(), *e;
    uint64_t off = 0;
    char *text = NULL, *padded = NULL;
    size_t len, plen;

    json_object_set_new(root, "__metadata__", json_pack("{s:s}", "format", "pt"));
    for (int i = 0; i < n; i++) {
        if (s[i].shard != shard)
            continue;
        e = json_pack("{s:s, s:[I], s:[I, I]}", "dtype", tsr_dtype_name(dt), "shape",
                      (json_int_t)s[i].shape[0], "data_offsets", (json_int_t)off,
                      (json_int_t)(off + s[i].nbytes));
        if (s[i].ndim == 2)
            json_array_append_new(json_object_get(e, "shape"), json_integer(s[i].shape[1]));
        json_object_set_new(root, s[i].name, e);
        off += s[i].nbytes;
    }
    text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    if (text == NULL)
        goto out;
    len = strlen(text);
    plen = (len + 7) & ~(size_t)7;
    padded = malloc(plen);
    if (padded == NULL)
        goto out;
    memcpy(padded, text, len);
    memset(padded + len, ' ', plen - len);
    *len_out = plen;
out:
    free(text);
    json_decref(root);
    return padded;
}

/* The shard being written, for the signal handler: an interrupt (Ctrl-C, SIGTERM)
 * removes it, then ends the process as the signal would. */
static char *volatile writing_tmp;

static void remove_tmp_and_die(int sig)
{
    char *t = writing_tmp;
    if (t) unlink(t);
    signal(sig, SIG_DFL);
    raise(sig);
}

/* Written under a temporary name and renamed, so an interrupted run never
 * leaves a plausible-looking truncated file. */
static int write_shard(const mi_opts_t *m, const mi_spec_t *s, int n, int shard,
                       const char *fname)
{
    char *path = tsr_path_join(m->dir, fname), *tmp = NULL, *hdr = NULL;
    float *vals = malloc(MI_CHUNK * sizeof *vals);
    uint8_t *bytes = malloc(MI_CHUNK * 4), len8[8];
    size_t hlen = 0;
    int fd = -1, rc = -1;

    if (path == NULL || vals == NULL || bytes == NULL || asprintf(&tmp, "%s.tmp", path) < 0 ||
        (hdr = shard_header(s, n, shard, m->dtype, &hlen)) == NULL) {
        fprintf(stderr, "tessera model-init: out of memory\n");
        goto out;
    }
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    writing_tmp = tmp;
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || write_all(fd, len8, 8) < 0 || write_all(fd, hdr, hlen) < 0)
        goto io_err;
    for (int i = 0; i < n; i++)
        if (s[i].shard == shard && write_tensor(fd, &s[i], m->dtype, m->seed, vals, bytes) < 0)
            goto io_err;
    if (close(fd) < 0) {
        fd = -1;
        goto io_err;
    }
    fd = -1;
    if (rename(tmp, path) < 0)
        goto io_err;
    rc = 0;
    goto out;
io_err:
    fprintf(stderr, "tessera model-init: %s: %s\n", path, strerror(errno));
    unlink(tmp);
out:
    writing_tmp = NULL;
    if (fd >= 0)
        close(fd);
    free(path);
    free(tmp);
    free(hdr);
    free(vals);
    free(bytes);
    return rc;
}

static int dump_json(const mi_opts_t *m, const char *fname, json_t *doc)
{
    char *path = tsr_path_join(m->dir, fname);
    int rc = -1;

    if (path == NULL || doc == NULL) {
        fprintf(stderr, "tessera model-init: out of memory\n");
        goto out;
    }
    /* Ten digits print 1e-05 and 500000.0, not 1.0000000000000001e-05. */
    if (json_dump_file(doc, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER |
                       JSON_REAL_PRECISION(10)) < 0) {
        fprintf(stderr, "tessera model-init: %s: cannot write\n", path);
        goto out;
    }
    rc = 0;
out:
    free(path);
    json_decref(doc);
    return rc;
}

static void shard_name(char *buf, size_t len, int shard, int shards)
{
    if (shards == 1)
        snprintf(buf, len, "model.safetensors");
    else
        snprintf(buf, len, "model-%05d-of-%05d.safetensors", shard + 1, shards);
}

static int write_index(const mi_opts_t *m, const mi_spec_t *s, int n, uint64_t total)
{
    json_t *wm = json_object();
    char fname[64];

    for (int i = 0; i < n; i++) {
        shard_name(fname, sizeof fname, s[i].shard, m->shards);
        json_object_set_new(wm, s[i].name, json_string(fname));
    }
    return dump_json(m, "model.safetensors.index.json",
                     json_pack("{s:{s:I}, s:o}", "metadata", "total_size", (json_int_t)total,
                               "weight_map", wm));
}

static json_t *rope_scaling(const mi_opts_t *m)
{
    if (!m->llama3)
        return json_null();
    /* Llama 3.1's values, with the original context a fraction of ours so
     * the scaling actually bends some frequencies. */
    return json_pack("{s:s, s:f, s:f, s:f, s:i}", "rope_type", "llama3", "factor", 8.0,
                     "low_freq_factor", 1.0, "high_freq_factor", 4.0,
                     "original_max_position_embeddings", m->max_pos >= 8 ? m->max_pos / 8 : 1);
}

static int write_config(const mi_opts_t *m)
{
    static const char *torch[] = { "float32", "float16", "bfloat16" };

    return dump_json(m, "config.json", json_pack(
        "{s:[s], s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:o, s:b, s:s,"
        " s:b, s:b, s:i, s:i, s:s}",
        "architectures", "LlamaForCausalLM", "model_type", "llama",
        "hidden_size", m->hidden, "intermediate_size", m->inter,
        "num_hidden_layers", m->layers, "num_attention_heads", m->heads,
        "num_key_value_heads", m->kv_heads, "head_dim", m->hidden / m->heads,
        "vocab_size", m->vocab, "max_position_embeddings", m->max_pos,
        "rms_norm_eps", 1e-5, "rope_theta", m->rope_theta, "rope_scaling", rope_scaling(m),
        "tie_word_embeddings", m->tied, "hidden_act", "silu",
        "attention_bias", 0, "mlp_bias", 0, "bos_token_id", 1, "eos_token_id", 2,
        "torch_dtype", torch[m->dtype]));
}

/* ---- directory ---------------------------------------------------------- */

/* mkdir -p */
static int make_dir(const char *dir)
{
    char *p = strdup(dir);
    int rc = -1;

    if (p == NULL)
        goto out;
    for (char *s = p + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = '\0';
        if (mkdir(p, 0755) < 0 && errno != EEXIST)
            goto out;
        *s = '/';
    }
    if (mkdir(p, 0755) < 0 && errno != EEXIST)
        goto out;
    rc = 0;
out:
    if (rc < 0)
        fprintf(stderr, "tessera model-init: %s: %s\n", p ? p : dir, strerror(errno));
    free(p);
    return rc;
}

/* Refuses to clobber a checkpoint unless forced; when forced, removes the
 * other layout's files, since an old index would win over a new single
 * file at load time. */
static int prepare_dir(const mi_opts_t *m)
{
    char *cfg = NULL, *idx = NULL, *single = NULL;
    int rc = -1;

    if (make_dir(m->dir) < 0)
        return -1;
    cfg = tsr_path_join(m->dir, "config.json");
    idx = tsr_path_join(m->dir, "model.safetensors.index.json");
    single = tsr_path_join(m->dir, "model.safetensors");
    if (cfg == NULL || idx == NULL || single == NULL) {
        fprintf(stderr, "tessera model-init: out of memory\n");
        goto out;
    }
    if (!m->force && access(cfg, F_OK) == 0) {
        fprintf(stderr, "tessera model-init: %s exists (use --force to overwrite)\n", cfg);
        goto out;
    }
    unlink(m->shards == 1 ? idx : single);
    rc = 0;
out:
    free(cfg);
    free(idx);
    free(single);
    return rc;
}

/* ---- tokenizer ------------------------------------------------------------ */

/* configs/tokenizer/, compiled in (the Makefile makes build/gen/shipped_tokenizer.c). */
extern const unsigned char tsr_shipped_tokenizer[], tsr_shipped_tokenizer_config[];
extern const unsigned long tsr_shipped_tokenizer_len, tsr_shipped_tokenizer_config_len;

static int write_file(const char *dir, const char *name, const unsigned char *data, size_t len)
{
    char *path = tsr_path_join(dir, name);
    int rc = -1;
    FILE *f = path ? fopen(path, "wb") : NULL;
    if (f && fwrite(data, 1, len, f) == len && fclose(f) == 0)
        rc = 0;
    else if (f)
        fclose(f);
    if (rc < 0)
        fprintf(stderr, "tessera model-init: %s: %s\n", path ? path : name, strerror(errno));
    free(path);
    return rc;
}

/* Removes DIR/name, if there. */
static void remove_file(const char *dir, const char *name)
{
    char *path = tsr_path_join(dir, name);
    if (path) unlink(path);
    free(path);
}

/* Whether the shipped tokenizer fits a model of m->vocab ids: it covers them
 * (tsr_tok_covers, as the coordinator asks at load) and has none past them.  Else why
 * not, in why. */
static bool shipped_fits(const mi_opts_t *m, char *why, size_t len)
{
    char err[300];
    tsr_tokenizer_t *t = tsr_tok_load_text((const char *)tsr_shipped_tokenizer,
                                           tsr_shipped_tokenizer_len,
                                           (const char *)tsr_shipped_tokenizer_config,
                                           tsr_shipped_tokenizer_config_len, "tokenizer.json",
                                           err, sizeof err);
    bool fits = false;
    if (!t) snprintf(why, len, "the shipped tokenizer cannot be read: %s", err);
    else if (tsr_tok_vocab_size(t) > m->vocab)
        snprintf(why, len, "the shipped tokenizer has %d ids, more than --vocab %d",
                 tsr_tok_vocab_size(t), m->vocab);
    else if (tsr_tok_covers(t, m->vocab, err, sizeof err) < 0)
        snprintf(why, len, "the shipped tokenizer has %d ids, too few for --vocab %d",
                 tsr_tok_vocab_size(t), m->vocab);
    else fits = true;
    tsr_tok_destroy(&t);
    return fits;
}

/* The shipped tokenizer, when it fits the vocabulary; else none, said on stderr (an old
 * one is removed, so that a directory never pairs weights with a tokenizer they do not
 * fit: generated ids it has no token for would decode to nothing). */
static int write_tokenizer(const mi_opts_t *m)
{
    char why[400];
    if (m->no_tokenizer || !shipped_fits(m, why, sizeof why)) {
        remove_file(m->dir, "tokenizer.json");
        remove_file(m->dir, "tokenizer_config.json");
        if (!m->no_tokenizer)
            fprintf(stderr, "tessera model-init: %s: no tokenizer.json: %s; the model takes "
                    "token ids only (copy in a tokenizer.json whose ids cover %d for text)\n",
                    m->dir, why, m->vocab);
        return 0;
    }
    if (write_file(m->dir, "tokenizer.json", tsr_shipped_tokenizer, tsr_shipped_tokenizer_len) < 0 ||
        write_file(m->dir, "tokenizer_config.json", tsr_shipped_tokenizer_config,
                   tsr_shipped_tokenizer_config_len) < 0)
        return -1;
    return 0;
}

/* ---- command ------------------------------------------------------------ */

static int write_model(const mi_opts_t *m, const mi_spec_t *s, int n, uint64_t total)
{
    char fname[64];

    for (int k = 0; k < m->shards; k++) {
        shard_name(fname, sizeof fname, k, m->shards);
        if (write_shard(m, s, n, k, fname) < 0)
            return -1;
    }
    if (m->shards > 1 && write_index(m, s, n, total) < 0)
        return -1;
    if (write_tokenizer(m) < 0)
        return -1;
    /* config.json last: its presence means the checkpoint is complete. */
    return write_config(m);
}

int tsr_cmd_model_init(int argc, char **argv)
{
    mi_opts_t m = { .seed = 1, .hidden = 256, .inter = 688, .layers = 8, .heads = 8,
                    .kv_heads = 4, .vocab = 1024, .max_pos = 512, .shards = 1,
                    .dtype = TSR_DT_F32, .rope_theta = 10000.0 };
    mi_spec_t *s = NULL;
    uint64_t total = 0;
    int n = 0, rc;

    rc = parse_args(argc, argv, &m);
    if (rc != 0)
        return rc == 1 ? 0 : 2;
    if (validate(&m) < 0)
        return 2;
    rc = 1;
    if ((s = build_specs(&m, &n)) == NULL) {
        fprintf(stderr, "tessera model-init: out of memory\n");
        goto out;
    }
    assign_shards(s, n, m.shards);
    for (int i = 0; i < n; i++)
        total += s[i].nbytes;
    /* Each value is in range, but together they can ask for terabytes: the disk (of the
     * directory, or of where it will be made) says, before anything is written. */
    struct statvfs fs;
    char *where = strdup(m.dir), *slash = where ? strrchr(where, '/') : NULL;
    if (where && access(where, F_OK) != 0) {
        if (slash && slash != where) *slash = '\0';
        else if (slash) slash[1] = '\0';
        else strcpy(where, ".");
    }
    if (where && statvfs(where, &fs) == 0 &&
        total + (1u << 20) > (uint64_t)fs.f_bavail * (uint64_t)fs.f_frsize) {
        fprintf(stderr, "tessera model-init: the model needs %.1f GiB; the filesystem of %s has "
                "%.1f GiB free\n", (double)total / (1u << 30), where,
                (double)fs.f_bavail * (double)fs.f_frsize / (1u << 30));
        free(where);
        goto out;
    }
    free(where);
    if (prepare_dir(&m) < 0)
        goto out;
    /* (a signal this process ignores, under nohup or in a script's background, stays so) */
    struct sigaction on_int = {.sa_handler = remove_tmp_and_die}, old_int, old_term;
    sigaction(SIGINT, NULL, &old_int);
    sigaction(SIGTERM, NULL, &old_term);
    if (old_int.sa_handler != SIG_IGN) sigaction(SIGINT, &on_int, NULL);
    if (old_term.sa_handler != SIG_IGN) sigaction(SIGTERM, &on_int, NULL);
    int wrote = write_model(&m, s, n, total);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (wrote < 0)
        goto out;
    printf("model-init: %s: %llu parameters, %llu bytes of %s in %d file%s\n", m.dir,
           (unsigned long long)(total / tsr_dtype_size(m.dtype)), (unsigned long long)total,
           tsr_dtype_name(m.dtype), m.shards, m.shards == 1 ? "" : "s");
    rc = 0;
out:
    free(s);
    return rc;
}
