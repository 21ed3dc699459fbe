/* safetensors.c: validated reading of Hugging Face safetensors checkpoints.
 *
 * Layout of one file: u64 little-endian N, N bytes of JSON header, then the
 * data area.  Nothing in a header is trusted: every length, offset and shape
 * is checked against the file before a byte of data is read, so a truncated
 * download or a hand-edited header fails at open with a message naming the
 * file and the tensor, never later as a short read or a wrong weight. */
#include "safetensors.h"
#include "modelfile.h"
#include "util.h"
#include "fp8.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <jansson.h>

/* Tensor bytes are reinterpreted in place (f32 read straight into the
 * caller's buffer, halves assembled from byte pairs in host order). */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c assumes a little-endian host"
#endif

#define ST_CHUNK (4u << 20) /* bytes per pread when converting halves */

struct tsr_st {
    char *dir;
    size_t n_files;
    char **paths;            /* dir + "/" + file name, as used in messages */
    int *fds;
    tsr_tensor_t *tensors;   /* sorted by name for tsr_st_find */
    size_t n_tensors;
};


/* ---- dtypes ------------------------------------------------------------- */

size_t tsr_dtype_size(tsr_dtype_t t)
{
    return t == TSR_DT_F32 || t == TSR_DT_I32 ? 4 : t == TSR_DT_I8 || t == TSR_DT_F8E4M3 ? 1 : 2;
}

const char *tsr_dtype_name(tsr_dtype_t t)
{
    switch (t) {
    case TSR_DT_F32: return "F32";
    case TSR_DT_F16: return "F16";
    case TSR_DT_BF16: return "BF16";
    case TSR_DT_I32: return "I32";
    case TSR_DT_I8: return "I8";
    case TSR_DT_F8E4M3: return "F8_E4M3";
    }
    return "?";
}

static uint32_t f32_bits(float f)
{
    uint32_t u;

    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;

    memcpy(&f, &u, sizeof f);
    return f;
}

float tsr_bf16_to_f32(uint16_t h)
{
    return bits_f32((uint32_t)h << 16);
}

uint16_t tsr_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);

    /* Truncating a NaN could clear every mantissa bit left and make it an
     * infinity; force the quiet bit instead. */
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    /* Round to nearest even: add just under half, plus the lsb that will be
     * kept.  A carry out of the mantissa correctly bumps the exponent (and
     * turns values above the largest bf16 into infinity). */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float tsr_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;

    if (exp == 0x1f) /* inf or NaN, payload kept */
        return bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp != 0)
        return bits_f32(sign | ((exp + 127 - 15) << 23) | (mant << 13));
    if (mant == 0)
        return bits_f32(sign);
    /* Subnormal: mant * 2^-24, exact in f32. */
    return sign ? -(float)mant * 0x1p-24f : (float)mant * 0x1p-24f;
}

/* Rounds m >> shift to nearest, ties to even. */
static uint32_t round_shift(uint32_t m, unsigned shift)
{
    uint32_t q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);

    if (rem > half || (rem == half && (q & 1u)))
        q++;
    return q;
}

uint16_t tsr_f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t x = u & 0x7fffffffu;
    uint32_t e;

    if (x >= 0x7f800000u) /* inf, or NaN kept quiet with the top payload bits */
        return sign | 0x7c00u | (x > 0x7f800000u ? 0x0200u | ((x >> 13) & 0x3ffu) : 0);
    /* 65520 is halfway between 65504 (largest half) and 65536; the tie goes
     * to the even side, which is infinity. */
    if (x >= 0x477ff000u)
        return sign | 0x7c00u;
    if (x >= 0x38800000u) { /* normal half; a mantissa carry bumps the exponent */
        e = (x >> 23) - 127 + 15;
        return sign | (uint16_t)round_shift((e << 23 | (x & 0x7fffffu)), 13);
    }
    /* 2^-25 or less rounds to zero (exactly 2^-25 ties to the even zero). */
    if (x <= 0x33000000u)
        return sign;
    /* Subnormal half: units of 2^-24.  The value is mant * 2^(e-150), so
     * shift = 126 - e (14..24); rounding up to 0x400 gives the smallest
     * normal, which is right. */
    e = x >> 23;
    return sign | (uint16_t)round_shift((x & 0x7fffffu) | 0x800000u, 126 - e);
}

/* ---- header parsing ----------------------------------------------------- */

void tsr_tensors_free(tsr_tensor_t *t, size_t n)
{
    if (t == NULL)
        return;
    for (size_t i = 0; i < n; i++)
        free(t[i].name);
    free(t);
}

static int parse_dtype(const char *s, tsr_dtype_t *out)
{
    if (strcmp(s, "F32") == 0)
        *out = TSR_DT_F32;
    else if (strcmp(s, "F16") == 0)
        *out = TSR_DT_F16;
    else if (strcmp(s, "BF16") == 0)
        *out = TSR_DT_BF16;
    else if (strcmp(s, "I8") == 0)
        *out = TSR_DT_I8;
    else if (strcmp(s, "F8_E4M3") == 0)
        *out = TSR_DT_F8E4M3;
    else
        return -1;
    return 0;
}

/* Shared context of one header's checks, so each check is a small function
 * that can name the file and the tensor. */
typedef struct {
    const char *fname;
    uint64_t data_start;     /* 8 + N */
    uint64_t data_size;      /* file size - data_start */
    char *err;
    size_t errlen;
} hdr_ctx_t;

static int parse_shape(const hdr_ctx_t *c, const char *name, json_t *v, tsr_tensor_t *t)
{
    size_t i;
    json_t *d;

    if (!json_is_array(v) || json_array_size(v) > TSR_ST_MAX_DIMS) {
        tsr_set_err(c->err, c->errlen, "%s: tensor %s: shape must be an array of at most %d "
                "dimensions", c->fname, name, TSR_ST_MAX_DIMS);
        return -1;
    }
    t->ndim = (int)json_array_size(v);
    json_array_foreach(v, i, d) {
        if (!json_is_integer(d) || json_integer_value(d) < 0) {
            tsr_set_err(c->err, c->errlen, "%s: tensor %s: shape[%zu] is not a non-negative "
                    "integer", c->fname, name, i);
            return -1;
        }
        t->shape[i] = (int64_t)json_integer_value(d);
    }
    return 0;
}

/* Bytes the shape calls for, or -1 on overflow (a header can claim any
 * dimensions; the product must not wrap into a plausible count). */
static int shape_bytes(const tsr_tensor_t *t, uint64_t *out)
{
    uint64_t n = tsr_dtype_size(t->dtype);

    for (int i = 0; i < t->ndim; i++) {
        uint64_t d = (uint64_t)t->shape[i];
        if (d != 0 && n > UINT64_MAX / d)
            return -1;
        n *= d;
    }
    *out = n;
    return 0;
}

static int parse_offsets(const hdr_ctx_t *c, const char *name, json_t *v, tsr_tensor_t *t)
{
    json_t *jb = json_array_get(v, 0), *je = json_array_get(v, 1);
    uint64_t begin, end, want;

    if (!json_is_array(v) || json_array_size(v) != 2 || !json_is_integer(jb) ||
        !json_is_integer(je) || json_integer_value(jb) < 0 || json_integer_value(je) < 0) {
        tsr_set_err(c->err, c->errlen, "%s: tensor %s: data_offsets must be [begin, end] with "
                "non-negative integers", c->fname, name);
        return -1;
    }
    begin = (uint64_t)json_integer_value(jb);
    end = (uint64_t)json_integer_value(je);
    if (begin > end || end > c->data_size) {
        tsr_set_err(c->err, c->errlen, "%s: tensor %s: data [%llu, %llu) is outside the data "
                "area of %llu bytes", c->fname, name, (unsigned long long)begin,
                (unsigned long long)end, (unsigned long long)c->data_size);
        return -1;
    }
    if (shape_bytes(t, &want) < 0) {
        tsr_set_err(c->err, c->errlen, "%s: tensor %s: shape overflows a 64-bit byte count",
                c->fname, name);
        return -1;
    }
    if (want != end - begin) {
        tsr_set_err(c->err, c->errlen, "%s: tensor %s: data [%llu, %llu) holds %llu bytes but "
                "shape and dtype %s call for %llu", c->fname, name,
                (unsigned long long)begin, (unsigned long long)end,
                (unsigned long long)(end - begin), tsr_dtype_name(t->dtype),
                (unsigned long long)want);
        return -1;
    }
    t->offset = c->data_start + begin;
    t->nbytes = end - begin;
    return 0;
}

static int parse_metadata(const hdr_ctx_t *c, json_t *v)
{
    const char *k;
    json_t *s;

    if (!json_is_object(v)) {
        tsr_set_err(c->err, c->errlen, "%s: __metadata__ must be an object", c->fname);
        return -1;
    }
    json_object_foreach(v, k, s) {
        if (!json_is_string(s)) {
            tsr_set_err(c->err, c->errlen, "%s: __metadata__.%s must be a string", c->fname, k);
            return -1;
        }
    }
    return 0;
}

static int parse_entry(const hdr_ctx_t *c, const char *name, json_t *v, tsr_tensor_t *t)
{
    json_t *jd = json_object_get(v, "dtype");
    json_t *js = json_object_get(v, "shape");
    json_t *jo = json_object_get(v, "data_offsets");

    if (!json_is_object(v) || json_object_size(v) != 3 || jd == NULL || js == NULL ||
        jo == NULL) {
        tsr_set_err(c->err, c->errlen, "%s: tensor %s: expected an object with exactly dtype, "
                "shape and data_offsets", c->fname, name);
        return -1;
    }
    if (!json_is_string(jd)) {
        tsr_set_err(c->err, c->errlen, "%s: tensor %s: dtype is not a string", c->fname, name);
        return -1;
    }
    if (parse_dtype(json_string_value(jd), &t->dtype) < 0) {
        tsr_set_err(c->err, c->errlen, "%s: tensor %s: dtype %s not supported (expected F32, F16, "
                "BF16, I8 or F8_E4M3)", c->fname, name, json_string_value(jd));
        return -1;
    }
    if (parse_shape(c, name, js, t) < 0 || parse_offsets(c, name, jo, t) < 0)
        return -1;
    t->name = strdup(name);
    if (t->name == NULL) {
        tsr_set_err(c->err, c->errlen, "%s: out of memory", c->fname);
        return -1;
    }
    return 0;
}

static int cmp_offset(const void *a, const void *b)
{
    const tsr_tensor_t *x = a, *y = b;

    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Two tensors sharing bytes would alias weights: a corrupt or malicious
 * header, never something a writer produces.  Sorts t by offset. */
static int check_overlap(const hdr_ctx_t *c, tsr_tensor_t *t, size_t n)
{
    const tsr_tensor_t *prev = NULL;

    qsort(t, n, sizeof *t, cmp_offset);
    for (size_t i = 0; i < n; i++) {
        if (t[i].nbytes == 0)
            continue;
        if (prev != NULL && t[i].offset < prev->offset + prev->nbytes) {
            tsr_set_err(c->err, c->errlen, "%s: tensor %s: data overlaps tensor %s", c->fname,
                    t[i].name, prev->name);
            return -1;
        }
        prev = &t[i];
    }
    return 0;
}

static int parse_root(const hdr_ctx_t *c, json_t *root, tsr_tensor_t **out, size_t *n_out)
{
    tsr_tensor_t *t = NULL;
    size_t n = 0;
    const char *key;
    json_t *v;
    int rc = -1;

    if (!json_is_object(root)) {
        tsr_set_err(c->err, c->errlen, "%s: header is not a JSON object", c->fname);
        goto out;
    }
    t = calloc(json_object_size(root) + 1, sizeof *t);
    if (t == NULL) {
        tsr_set_err(c->err, c->errlen, "%s: out of memory", c->fname);
        goto out;
    }
    json_object_foreach(root, key, v) {
        if (strcmp(key, "__metadata__") == 0) {
            if (parse_metadata(c, v) < 0)
                goto out;
            continue;
        }
        if (parse_entry(c, key, v, &t[n]) < 0)
            goto out;
        n++;
    }
    if (check_overlap(c, t, n) < 0)
        goto out;
    *out = t;
    *n_out = n;
    t = NULL; /* transferred */
    rc = 0;
out:
    tsr_tensors_free(t, n);
    return rc;
}

int tsr_st_parse_header(const uint8_t *buf, size_t len, uint64_t file_size, const char *fname,
                        tsr_tensor_t **out, size_t *n_out, char *err, size_t errlen)
{
    hdr_ctx_t c = { fname, 0, 0, err, errlen };
    json_error_t jerr;
    json_t *root = NULL;
    uint64_t hlen = 0;
    int rc = -1;

    *out = NULL;
    *n_out = 0;
    if (file_size < 8 || len < 8) {
        tsr_set_err(err, errlen, "%s: truncated: %llu bytes, shorter than the 8-byte header "
                "length", fname, (unsigned long long)(file_size < len ? file_size : len));
        goto out;
    }
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | buf[i];
    /* The length is not shown: in a file that is not a checkpoint its 8 bytes are
     * whatever the file starts with. */
    if (hlen > TSR_ST_MAX_HEADER || hlen > file_size - 8) {
        tsr_set_err(err, errlen, "%s: the header length (bytes 0 to 7) is larger than %s (%llu "
                "bytes): not a safetensors file, or a truncated one", fname,
                hlen > TSR_ST_MAX_HEADER ? "the limit" : "the file",
                hlen > TSR_ST_MAX_HEADER ? (unsigned long long)TSR_ST_MAX_HEADER
                                         : (unsigned long long)file_size);
        goto out;
    }
    if (len - 8 < hlen) {
        tsr_set_err(err, errlen, "%s: truncated: header of %llu bytes but only %zu read", fname,
                (unsigned long long)hlen, len - 8);
        goto out;
    }
    c.data_start = 8 + hlen;
    c.data_size = file_size - c.data_start;
    root = json_loadb((const char *)buf + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL) {
        tsr_set_err(err, errlen, "%s: header is not valid JSON at byte %d of the file: %s",
                fname, 8 + jerr.position, tsr_json_error_what(&jerr));
        goto out;
    }
    rc = parse_root(&c, root, out, n_out);
out:
    json_decref(root);
    return rc;
}

/* ---- opening a checkpoint ----------------------------------------------- */

/* pread until n bytes or EOF/error; returns bytes read or -1 (errno set). */
static ssize_t pread_full(int fd, void *buf, size_t n, uint64_t off)
{
    size_t got = 0;

    while (got < n) {
        ssize_t r = pread(fd, (char *)buf + got, n - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -1;
        if (r == 0)
            break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* Reads the header of an open file.  Only the 8-byte length is read before
 * it is checked, so a corrupt length cannot make us allocate gigabytes. */
static int read_header(int fd, const char *path, tsr_tensor_t **out, size_t *n_out,
                       char *err, size_t errlen)
{
    struct stat sb;
    uint8_t head[8], *buf = NULL;
    uint64_t hlen = 0, size;
    ssize_t got;
    int rc = -1;

    if (fstat(fd, &sb) < 0) {
        tsr_set_err(err, errlen, "%s: %s", path, strerror(errno));
        goto out;
    }
    size = (uint64_t)sb.st_size;
    got = pread_full(fd, head, sizeof head, 0);
    if (got < 0) {
        tsr_set_err(err, errlen, "%s: read: %s", path, strerror(errno));
        goto out;
    }
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | head[i];
    /* Let the parser word the error for a short file or a bad length. */
    if (got < 8 || hlen > TSR_ST_MAX_HEADER || hlen > size - 8) {
        rc = tsr_st_parse_header(head, (size_t)got, size, path, out, n_out, err, errlen);
        goto out;
    }
    buf = malloc(8 + hlen);
    if (buf == NULL) {
        tsr_set_err(err, errlen, "%s: out of memory for a %llu-byte header", path,
                (unsigned long long)hlen);
        goto out;
    }
    got = pread_full(fd, buf, 8 + hlen, 0);
    if (got < 0) {
        tsr_set_err(err, errlen, "%s: read: %s", path, strerror(errno));
        goto out;
    }
    rc = tsr_st_parse_header(buf, (size_t)got, size, path, out, n_out, err, errlen);
out:
    free(buf);
    return rc;
}

/* Index of file `name` in st, adding (and opening) it when new. */
static int add_file(tsr_st_t *st, const char *name, char *err, size_t errlen)
{
    char *path;
    char **np;
    int *nf;
    int fd;

    for (size_t i = 0; i < st->n_files; i++)
        if (strcmp(strrchr(st->paths[i], '/') + 1, name) == 0)
            return (int)i;
    path = tsr_path_join(st->dir, name);
    np = realloc(st->paths, (st->n_files + 1) * sizeof *np);
    if (np != NULL)
        st->paths = np;
    nf = realloc(st->fds, (st->n_files + 1) * sizeof *nf);
    if (nf != NULL)
        st->fds = nf;
    if (path == NULL || np == NULL || nf == NULL) {
        tsr_set_err(err, errlen, "%s: out of memory", st->dir);
        free(path);
        return -1;
    }
    fd = tsr_model_open(st->dir, name, err, errlen);  /* a FIFO would block the load for ever */
    if (fd < 0) {
        free(path);
        return -1;
    }
    st->paths[st->n_files] = path;
    st->fds[st->n_files] = fd;
    return (int)st->n_files++;
}

/* Parses file fi's header and appends its tensors to st. */
static int load_file_tensors(tsr_st_t *st, int fi, char *err, size_t errlen)
{
    tsr_tensor_t *t = NULL, *all;
    size_t n = 0;
    int rc = -1;

    if (read_header(st->fds[fi], st->paths[fi], &t, &n, err, errlen) < 0)
        goto out;
    all = realloc(st->tensors, (st->n_tensors + n + 1) * sizeof *all);
    if (all == NULL) {
        tsr_set_err(err, errlen, "%s: out of memory", st->paths[fi]);
        goto out;
    }
    st->tensors = all;
    for (size_t i = 0; i < n; i++) {
        t[i].file = fi;
        all[st->n_tensors++] = t[i];
    }
    free(t); /* names now belong to st->tensors */
    t = NULL;
    n = 0;
    rc = 0;
out:
    tsr_tensors_free(t, n);
    return rc;
}

/* A file name from the index must stay inside dir. */
static int plain_name(const char *s)
{
    return s[0] != '\0' && strchr(s, '/') == NULL && strcmp(s, ".") != 0 &&
           strcmp(s, "..") != 0;
}

static int load_index_json(const char *dir, const char *path, json_t **wm_out,
                           json_t **root_out, char *err, size_t errlen)
{
    json_error_t jerr;
    size_t len = 0;
    char *text = tsr_model_read(dir, "model.safetensors.index.json", TSR_ST_INDEX_MAX_BYTES,
                                &len, err, errlen);
    if (text == NULL)
        return -1;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    json_t *wm = json_object_get(root, "weight_map");
    free(text);

    if (root == NULL) {
        tsr_set_err(err, errlen, "%s:%d:%d: invalid JSON (byte %d): %s", path, jerr.line,
                jerr.column, jerr.position, tsr_json_error_what(&jerr));
        return -1;
    }
    *root_out = root;
    if (!json_is_object(wm) || json_object_size(wm) == 0) {
        tsr_set_err(err, errlen, "%s: weight_map missing or not a non-empty object", path);
        return -1;
    }
    *wm_out = wm;
    return 0;
}

/* Opens every file weight_map names (each once) and parses its header. */
static int open_index_files(tsr_st_t *st, const char *ipath, json_t *wm, char *err,
                            size_t errlen)
{
    const char *tname;
    json_t *v;
    size_t before;
    int fi;

    json_object_foreach(wm, tname, v) {
        const char *fname = json_string_value(v);
        if (fname == NULL || !plain_name(fname)) {
            tsr_set_err(err, errlen, "%s: weight_map: tensor %s: file name %s must be a plain "
                    "name inside the checkpoint directory", ipath, tname,
                    fname ? fname : "(not a string)");
            return -1;
        }
        before = st->n_files;
        fi = add_file(st, fname, err, errlen);
        if (fi < 0)
            return -1;
        if (st->n_files > before && load_file_tensors(st, fi, err, errlen) < 0)
            return -1;
    }
    return 0;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(((const tsr_tensor_t *)a)->name, ((const tsr_tensor_t *)b)->name);
}

/* Sorts for tsr_st_find; a name in two files would make the weight depend
 * on which one we happened to pick. */
static int sort_tensors(tsr_st_t *st, char *err, size_t errlen)
{
    qsort(st->tensors, st->n_tensors, sizeof *st->tensors, cmp_name);
    for (size_t i = 1; i < st->n_tensors; i++) {
        const tsr_tensor_t *a = &st->tensors[i - 1], *b = &st->tensors[i];
        if (strcmp(a->name, b->name) == 0) {
            tsr_set_err(err, errlen, "%s: tensor %s: also present in %s", st->paths[b->file],
                    b->name, st->paths[a->file]);
            return -1;
        }
    }
    return 0;
}

/* Each weight_map entry must be where the index says it is. */
static int check_weight_map(const tsr_st_t *st, const char *ipath, json_t *wm, char *err,
                            size_t errlen)
{
    const char *tname;
    json_t *v;

    json_object_foreach(wm, tname, v) {
        const tsr_tensor_t *t = tsr_st_find(st, tname);
        const char *fname = json_string_value(v);
        if (t == NULL || strcmp(strrchr(st->paths[t->file], '/') + 1, fname) != 0) {
            char *path = tsr_path_join(st->dir, fname);
            tsr_set_err(err, errlen, "%s: tensor %s: listed in %s but not present in that file",
                    path ? path : fname, tname, ipath);
            free(path);
            return -1;
        }
    }
    return 0;
}

static int open_index(tsr_st_t *st, const char *ipath, char *err, size_t errlen)
{
    json_t *root = NULL, *wm = NULL;
    int rc = -1;

    if (load_index_json(st->dir, ipath, &wm, &root, err, errlen) < 0 ||
        open_index_files(st, ipath, wm, err, errlen) < 0 ||
        sort_tensors(st, err, errlen) < 0 || check_weight_map(st, ipath, wm, err, errlen) < 0)
        goto out;
    rc = 0;
out:
    json_decref(root);
    return rc;
}

static int open_single(tsr_st_t *st, char *err, size_t errlen)
{
    int fi = add_file(st, "model.safetensors", err, errlen);

    if (fi < 0 || load_file_tensors(st, fi, err, errlen) < 0)
        return -1;
    return sort_tensors(st, err, errlen);
}

int tsr_st_open(const char *dir, tsr_st_t **out, char *err, size_t errlen)
{
    tsr_st_t *st = calloc(1, sizeof *st);
    char *ipath = NULL;
    int rc = -1;

    *out = NULL;
    if (dir[0] == '\0') /* "" would otherwise resolve to "/model.safetensors" */
        dir = ".";
    if (st == NULL || (st->dir = strdup(dir)) == NULL ||
        (ipath = tsr_path_join(dir, "model.safetensors.index.json")) == NULL) {
        tsr_set_err(err, errlen, "%s: out of memory", dir);
        goto out;
    }
    if (access(ipath, F_OK) == 0 ? open_index(st, ipath, err, errlen) < 0
                                 : open_single(st, err, errlen) < 0)
        goto out;
    *out = st;
    st = NULL; /* transferred */
    rc = 0;
out:
    tsr_st_close(&st);
    free(ipath);
    return rc;
}

void tsr_st_close(tsr_st_t **self_p)
{
    tsr_st_t *st = *self_p;

    if (st == NULL)
        return;
    for (size_t i = 0; i < st->n_files; i++) {
        close(st->fds[i]);
        free(st->paths[i]);
    }
    free(st->fds);
    free(st->paths);
    tsr_tensors_free(st->tensors, st->n_tensors);
    free(st->dir);
    free(st);
    *self_p = NULL;
}

/* ---- lookups ------------------------------------------------------------ */

const tsr_tensor_t *tsr_st_find(const tsr_st_t *st, const char *name)
{
    tsr_tensor_t key = { .name = (char *)name };

    if (st == NULL || st->n_tensors == 0)
        return NULL;
    return bsearch(&key, st->tensors, st->n_tensors, sizeof key, cmp_name);
}

static void fmt_shape(char *buf, size_t len, int ndim, const int64_t *shape)
{
    size_t used = 0;

    used += (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < ndim && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, "%s%lld", i ? ", " : "",
                                 (long long)shape[i]);
    if (used < len)
        snprintf(buf + used, len - used, "]");
}

int tsr_st_expect(const tsr_st_t *st, const char *name, int ndim, const int64_t *shape,
                  char *err, size_t errlen)
{
    const tsr_tensor_t *t = tsr_st_find(st, name);
    char have[128], want[128];
    int same;

    if (t == NULL) {
        tsr_set_err(err, errlen, "%s: tensor %s: missing", st->dir, name);
        return -1;
    }
    same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++)
        same = t->shape[i] == shape[i];
    if (same)
        return 0;
    fmt_shape(have, sizeof have, t->ndim, t->shape);
    fmt_shape(want, sizeof want, ndim, shape);
    tsr_set_err(err, errlen, "%s: tensor %s: shape %s does not match the config's %s",
            st->paths[t->file], name, have, want);
    return -1;
}

/* ---- reading data ------------------------------------------------------- */

/* A tensor seen as rows x cols: 1-D is one row, 0-D one element, and
 * higher ranks fold their trailing dimensions into the row. */
static void as_matrix(const tsr_tensor_t *t, int64_t *rows, int64_t *cols)
{
    *rows = t->ndim >= 2 ? t->shape[0] : 1;
    *cols = 1;
    for (int i = t->ndim >= 2 ? 1 : 0; i < t->ndim; i++)
        *cols *= t->shape[i];
}

/* Halves, int8 or E4M3 (each value exactly a float). */
static void convert_halves(tsr_dtype_t dt, const uint8_t *src, float *dst, size_t n)
{
    if (dt == TSR_DT_I8) {
        for (size_t i = 0; i < n; i++) dst[i] = (float)(int8_t)src[i];
        return;
    }
    if (dt == TSR_DT_F8E4M3) {
        for (size_t i = 0; i < n; i++) dst[i] = tsr_e4m3_to_f32(src[i]);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        uint16_t h = (uint16_t)(src[2 * i] | src[2 * i + 1] << 8);
        dst[i] = dt == TSR_DT_BF16 ? tsr_bf16_to_f32(h) : tsr_f16_to_f32(h);
    }
}

bool tsr_st_refuse_nonfinite = true;

/* n elements of t read raw from element `first` on: fails naming the first that is NaN
 * or infinite (a damaged checkpoint; served, it would make every logit NaN and every
 * token 0, silently).  One pass that only ORs while all is well. */
static int check_finite(const tsr_st_t *st, const tsr_tensor_t *t, const void *raw,
                        uint64_t first, size_t n, char *err, size_t errlen)
{
    if (!tsr_st_refuse_nonfinite || t->dtype == TSR_DT_I8) return 0;   /* integers are finite */
    if (t->dtype == TSR_DT_F8E4M3) {   /* no infinities; S.1111.111 is NaN */
        const unsigned char *b8 = raw;
        for (size_t i = 0; i < n; i++)
            if ((b8[i] & 0x7fu) == 0x7fu) {
                int64_t rows, cols;
                as_matrix(t, &rows, &cols);
                const uint64_t at = first + i;
                tsr_set_err(err, errlen, "%s: tensor %s: element [%llu, %llu] is NaN: the "
                            "checkpoint is damaged", st->paths[t->file], t->name,
                            (unsigned long long)(at / (uint64_t)cols),
                            (unsigned long long)(at % (uint64_t)cols));
                return -1;
            }
        return 0;
    }
    const bool f32 = t->dtype == TSR_DT_F32;
    /* the exponent field, all ones for NaN and Inf; the sign bit */
    const uint32_t expo = f32 ? 0x7F800000u : t->dtype == TSR_DT_BF16 ? 0x7F80u : 0x7C00u;
    const uint32_t sign = f32 ? 0x80000000u : 0x8000u;
    /* the bytes are read through memcpy: raw may be a float buffer */
    const unsigned char *b = raw;
    unsigned any = 0;
    if (f32)
        for (size_t i = 0; i < n; i++) {
            uint32_t w;
            memcpy(&w, b + 4 * i, 4);
            any |= (w & expo) == expo;
        }
    else
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, b + 2 * i, 2);
            any |= (h & expo) == expo;
        }
    if (!any) return 0;
    size_t i = 0;
    uint32_t v = 0;
    for (; i < n; i++) {
        uint16_t h = 0;
        if (f32) memcpy(&v, b + 4 * i, 4);
        else memcpy(&h, b + 2 * i, 2), v = h;
        if ((v & expo) == expo) break;
    }
    int64_t rows, cols;
    as_matrix(t, &rows, &cols);
    const uint64_t at = first + i;
    char where[48];
    if (t->ndim == 1)
        snprintf(where, sizeof where, "[%llu]", (unsigned long long)at);
    else
        snprintf(where, sizeof where, "[%llu, %llu]", (unsigned long long)(at / (uint64_t)cols),
                 (unsigned long long)(at % (uint64_t)cols));
    tsr_set_err(err, errlen, "%s: tensor %s: element %s is %s: the checkpoint is damaged",
                st->paths[t->file], t->name, where,
                (v & ~(expo | sign)) ? "NaN" : (v & sign) ? "-Inf" : "Inf");
    return -1;
}

/* Reads n contiguous elements of t starting at element `first` into dst.
 * f32 goes straight into dst; halves go through bounce (ST_CHUNK bytes),
 * one pread per chunk. */
static int read_elems(const tsr_st_t *st, const tsr_tensor_t *t, uint64_t first, size_t n,
                      float *dst, uint8_t *bounce, char *err, size_t errlen)
{
    size_t es = tsr_dtype_size(t->dtype);
    int fd = st->fds[t->file];

    while (n > 0) {
        size_t k = t->dtype == TSR_DT_F32 ? n : (n < ST_CHUNK / es ? n : ST_CHUNK / es);
        void *buf = t->dtype == TSR_DT_F32 ? (void *)dst : (void *)bounce;
        ssize_t got = pread_full(fd, buf, k * es, t->offset + first * es);
        if (got < 0 || (size_t)got != k * es) {
            tsr_set_err(err, errlen, "%s: tensor %s: %s", st->paths[t->file], t->name,
                    got < 0 ? strerror(errno) : "short read (file truncated since open?)");
            return -1;
        }
        if (check_finite(st, t, buf, first, k, err, errlen) < 0)
            return -1;
        if (t->dtype != TSR_DT_F32)
            convert_halves(t->dtype, bounce, dst, k);
        dst += k;
        first += k;
        n -= k;
    }
    return 0;
}

static int check_range(const tsr_st_t *st, const tsr_tensor_t *t, int64_t r0, int64_t r1,
                       int64_t c0, int64_t c1, char *err, size_t errlen)
{
    int64_t rows, cols;

    if (t->file < 0 || (size_t)t->file >= st->n_files) {
        tsr_set_err(err, errlen, "%s: tensor %s: not from this checkpoint", st->dir, t->name);
        return -1;
    }
    as_matrix(t, &rows, &cols);
    if (r0 < 0 || r0 > r1 || r1 > rows || c0 < 0 || c0 > c1 || c1 > cols) {
        tsr_set_err(err, errlen, "%s: tensor %s: slice rows [%lld, %lld) x columns [%lld, %lld) "
                "is outside its %lld x %lld", st->paths[t->file], t->name, (long long)r0,
                (long long)r1, (long long)c0, (long long)c1, (long long)rows,
                (long long)cols);
        return -1;
    }
    return 0;
}

int tsr_st_read_f32(const tsr_st_t *st, const tsr_tensor_t *t, int64_t r0, int64_t r1,
                    int64_t c0, int64_t c1, float *dst, char *err, size_t errlen)
{
    int64_t rows, cols;
    uint64_t width = (uint64_t)(c1 - c0);
    uint8_t *bounce = NULL;
    size_t blen;
    int rc = -1;

    if (check_range(st, t, r0, r1, c0, c1, err, errlen) < 0)
        goto out;
    as_matrix(t, &rows, &cols);
    if (r0 == r1 || c0 == c1) {
        rc = 0;
        goto out;
    }
    /* Only halves and int8 need a bounce buffer, at most a chunk and no
     * more than the slice itself. */
    blen = width * (uint64_t)(r1 - r0) * 2;
    blen = blen < ST_CHUNK ? blen : ST_CHUNK;
    if (t->dtype != TSR_DT_F32 && (bounce = malloc(blen)) == NULL) {
        tsr_set_err(err, errlen, "%s: tensor %s: out of memory", st->paths[t->file], t->name);
        goto out;
    }
    if (c0 == 0 && c1 == cols) {
        /* Whole rows are one contiguous block: chunked reads, no per-row cost. */
        rc = read_elems(st, t, (uint64_t)r0 * (uint64_t)cols, (size_t)(width * (uint64_t)(r1 - r0)),
                        dst, bounce, err, errlen);
        goto out;
    }
    for (int64_t r = r0; r < r1; r++) {
        if (read_elems(st, t, (uint64_t)r * (uint64_t)cols + (uint64_t)c0, (size_t)width,
                       dst + (uint64_t)(r - r0) * width, bounce, err, errlen) < 0)
            goto out;
    }
    rc = 0;
out:
    free(bounce);
    return rc;
}

int tsr_st_read_raw(const tsr_st_t *st, const tsr_tensor_t *t, int64_t r0, int64_t r1,
                    int64_t c0, int64_t c1, void *dst, char *err, size_t errlen)
{
    int64_t rows, cols;
    if (check_range(st, t, r0, r1, c0, c1, err, errlen) < 0) return -1;
    as_matrix(t, &rows, &cols);
    const size_t es = tsr_dtype_size(t->dtype), width = (size_t)(c1 - c0) * es;
    /* Whole rows are one read; a column slice is one read per row. */
    const bool whole = c0 == 0 && c1 == cols;
    for (int64_t r = r0; r < r1; r += whole ? r1 - r0 : 1) {
        size_t len = whole ? width * (size_t)(r1 - r0) : width;
        uint64_t at = t->offset + ((uint64_t)r * (uint64_t)cols + (uint64_t)c0) * es;
        ssize_t got = pread_full(st->fds[t->file], (uint8_t *)dst + (size_t)(r - r0) * width, len, at);
        if (got < 0 || (size_t)got != len) {
            tsr_set_err(err, errlen, "%s: tensor %s: %s", st->paths[t->file], t->name,
                        got < 0 ? strerror(errno) : "short read (file truncated since open?)");
            return -1;
        }
        if (check_finite(st, t, (uint8_t *)dst + (size_t)(r - r0) * width,
                         (uint64_t)r * (uint64_t)cols + (uint64_t)c0, len / es, err, errlen) < 0)
            return -1;
    }
    return 0;
}
