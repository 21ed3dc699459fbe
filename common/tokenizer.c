/* tokenizer.c: loading tokenizer.json into the tables that encoding and decoding read.
 *
 * See tokenizer.h for what is covered and tok_tables.h for the layout.  Every field that
 * is not understood is refused here, with its JSON path, so that encoding and decoding
 * never meet a setting they cannot follow.  Running the normalizers lives here, below
 * encoding, because the loader needs it first: added tokens marked `normalized` are
 * matched in their normalized form. */
#include "common/tokenizer.h"

#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/random.h>
#include <unistd.h>

#include "common/modelfile.h"
#include "common/tok_tables.h"
#include "common/utf8.h"
#include "common/util.h"

#define TOK_MAX_ID (1 << 24)         /* ids beyond this are refused at load */

/* GPT-2's split, used by ByteLevel when use_regex is true. */
static const char GPT2_SPLIT[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ---- byte-level alphabet ------------------------------------------------------ */

unsigned tsr_tok_bl_cp[256];
int tsr_tok_bl_byte[512];
static pthread_once_t bl_once = PTHREAD_ONCE_INIT;

static void bl_init(void)
{
    for (int i = 0; i < 512; i++) tsr_tok_bl_byte[i] = -1;
    unsigned next = 256;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        tsr_tok_bl_cp[b] = printable ? (unsigned)b : next++;
        tsr_tok_bl_byte[tsr_tok_bl_cp[b]] = b;
    }
}

/* ---- errors and JSON ----------------------------------------------------------- */

static void fail(const tsr_tokenizer_t *t, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void fail(const tsr_tokenizer_t *t, char *err, size_t errlen, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    tsr_set_err(err, errlen, "%s: %s", t->name, msg);
}

/* A string member (NULL when absent or not a string). */
static const char *jstr(json_t *o, const char *key, size_t *len)
{
    json_t *v = json_object_get(o, key);
    if (!json_is_string(v)) return NULL;
    if (len) *len = json_string_length(v);
    return json_string_value(v);
}

static bool jbool(json_t *o, const char *key, bool def)
{
    json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : def;
}

static char *dup_bytes(const char *s, size_t n)
{
    char *p = malloc(n + 1);
    if (!p) return NULL;
    memcpy(p, s, n);
    p[n] = '\0';
    return p;
}

/* Where in the pattern a lookaround (lookahead or lookbehind) holds an unbounded repeat
 * (*, +, {n,}), or -1 when none does.  PCRE2's match limit counts backtracking, not the
 * characters a repeat scans, so such a lookaround rescans the rest of the text from
 * each position at little cost in the encode's budget: `(?=(\w+)+\W)` took 0.98 s on
 * 30,000 letters.  Real tokenizers look ahead one character (`\s+(?!\S)`). */
static long unbounded_lookaround(const char *pat, size_t len)
{
    int depth = 0, look = 0;  /* open groups; the depth of the outermost lookaround */
    bool in_class = false;
    for (size_t i = 0; i < len; i++) {
        char c = pat[i];
        if (c == '\\') {
            if (i + 1 < len && pat[i + 1] == 'Q') {  /* \Q...\E: literal */
                const char *e = memmem(pat + i + 2, len - i - 2, "\\E", 2);
                i = e ? (size_t)(e - pat) + 1 : len;
            } else {
                i++;
            }
        } else if (in_class) {
            if (c == ']') in_class = false;
        } else if (c == '[') {
            in_class = true;
            if (i + 1 < len && pat[i + 1] == '^') i++;
            if (i + 1 < len && pat[i + 1] == ']') i++;  /* a leading ] is literal */
        } else if (c == '(') {
            depth++;
            if (!look && (!strncmp(pat + i, "(?=", 3) || !strncmp(pat + i, "(?!", 3) ||
                          !strncmp(pat + i, "(?<=", 4) || !strncmp(pat + i, "(?<!", 4) ||
                          (!strncmp(pat + i, "(*", 2) && i + 2 < len &&
                           (pat[i + 2] == 'p' || pat[i + 2] == 'n'))))  /* (*pla: etc. */
                look = depth;
        } else if (c == ')') {
            if (depth-- == look) look = 0;
        } else if (look && (c == '*' || c == '+')) {
            return (long)i;
        } else if (look && c == '{') {  /* {n,}: no upper bound */
            size_t d = i + 1;
            while (d < len && pat[d] >= '0' && pat[d] <= '9') d++;
            if (d > i + 1 && d + 1 < len && pat[d] == ',' && pat[d + 1] == '}') return (long)i;
        }
    }
    return -1;
}

static pcre2_code *compile_re(const tsr_tokenizer_t *t, const char *pat, size_t len,
                              const char *path, char *err, size_t errlen)
{
    int code;
    PCRE2_SIZE at;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, len, PCRE2_UTF | PCRE2_UCP, &code, &at, NULL);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(code, msg, sizeof msg);
        fail(t, err, errlen, "%s: the pattern does not compile at offset %zu: %s", path,
             (size_t)at, (const char *)msg);
        return NULL;
    }
    /* A backreference is compared character by character outside PCRE2's match limit,
     * so an encode's budget would not bound it (`(?=(\w*)\1b)` on 10,000 letters took
     * 25 s within it); no real tokenizer's split uses one. */
    uint32_t backrefs = 0;
    if (pcre2_pattern_info(re, PCRE2_INFO_BACKREFMAX, &backrefs) == 0 && backrefs > 0) {
        pcre2_code_free(re);
        fail(t, err, errlen, "%s: a backreference (to group %u) is not supported: the work of "
             "matching one is not bounded", path, backrefs);
        return NULL;
    }
    long un = unbounded_lookaround(pat, len);
    if (un >= 0) {
        pcre2_code_free(re);
        fail(t, err, errlen, "%s: an unbounded repeat inside a lookaround (at offset %ld) is not "
             "supported: the work of matching it is not bounded", path, un);
        return NULL;
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  /* the interpreter serves when JIT cannot */
    return re;
}

/* A Replace's {"String": s} pattern. */
static int replace_pattern(const tsr_tokenizer_t *t, json_t *o, const char *path, char **a,
                           size_t *alen, char **b, size_t *blen, char *err, size_t errlen)
{
    json_t *pat = json_object_get(o, "pattern");
    size_t n;
    const char *s = json_is_object(pat) ? jstr(pat, "String", &n) : NULL;
    if (!s || n == 0) {
        fail(t, err, errlen, "%s.pattern: only a non-empty {\"String\": ...} pattern is supported",
             path);
        return -1;
    }
    size_t cn;
    const char *c = jstr(o, "content", &cn);
    if (!c) {
        fail(t, err, errlen, "%s.content: missing or not a string", path);
        return -1;
    }
    *a = dup_bytes(s, n);
    *b = dup_bytes(c, cn);
    *alen = n;
    *blen = cn;
    return *a && *b ? 0 : (fail(t, err, errlen, "out of memory"), -1);
}

static int one_char(const tsr_tokenizer_t *t, const char *s, size_t n, char *out, size_t *out_len,
                    const char *path, char *err, size_t errlen)
{
    if (!s || n == 0 || n > 4 || tsr_utf8_char_len(s) != n || tsr_utf8_check(s, n) != n) {
        fail(t, err, errlen, "%s: must be one character", path);
        return -1;
    }
    memcpy(out, s, n);
    *out_len = n;
    return 0;
}

static int parse_scheme(const tsr_tokenizer_t *t, json_t *o, const char *path, int *scheme,
                        char *err, size_t errlen)
{
    const char *s = jstr(o, "prepend_scheme", NULL);
    if (!s) {  /* older files: add_prefix_space */
        *scheme = jbool(o, "add_prefix_space", true) ? SCHEME_ALWAYS : SCHEME_NEVER;
        return 0;
    }
    if (!strcmp(s, "always")) *scheme = SCHEME_ALWAYS;
    else if (!strcmp(s, "first")) *scheme = SCHEME_FIRST;
    else if (!strcmp(s, "never")) *scheme = SCHEME_NEVER;
    else {
        fail(t, err, errlen, "%s.prepend_scheme: \"%s\" is not always, first or never", path, s);
        return -1;
    }
    return 0;
}

/* ---- normalizer, pre-tokenizer, decoder, post-processor ------------------------ */

/* Flattens Sequence nodes: calls one(node, path) for every leaf in order. */
typedef int (*leaf_fn)(tsr_tokenizer_t *t, json_t *node, const char *path, char *err,
                       size_t errlen);

static int walk(tsr_tokenizer_t *t, json_t *node, const char *path, const char *list_key,
                leaf_fn one, int depth, char *err, size_t errlen)
{
    if (!node || json_is_null(node)) return 0;  /* absent or null: no such stage */
    const char *type = json_is_object(node) ? jstr(node, "type", NULL) : NULL;
    if (!type) {
        fail(t, err, errlen, "%s.type: missing", path);
        return -1;
    }
    if (strcmp(type, "Sequence") != 0) return one(t, node, path, err, errlen);
    json_t *list = json_object_get(node, list_key);
    if (!json_is_array(list) || depth > 8) {
        fail(t, err, errlen, "%s.%s: missing, not a list, or nested too deep", path, list_key);
        return -1;
    }
    size_t i;
    json_t *v;
    json_array_foreach(list, i, v) {
        char sub[256];
        snprintf(sub, sizeof sub, "%s.%s[%zu]", path, list_key, i);
        if (walk(t, v, sub, list_key, one, depth + 1, err, errlen)) return -1;
    }
    return 0;
}

static int add_norm(tsr_tokenizer_t *t, json_t *o, const char *path, char *err, size_t errlen)
{
    const char *type = jstr(o, "type", NULL);
    norm_t n = {0};
    if (!strcmp(type, "Prepend")) {
        size_t len = 0;
        const char *s = jstr(o, "prepend", &len);
        if (!s) {
            fail(t, err, errlen, "%s.prepend: missing or not a string", path);
            return -1;
        }
        n.kind = NORM_PREPEND;
        n.a = dup_bytes(s, len);
        n.alen = len;
        if (!n.a) return fail(t, err, errlen, "out of memory"), -1;
    } else if (!strcmp(type, "Replace")) {
        n.kind = NORM_REPLACE;
        if (replace_pattern(t, o, path, &n.a, &n.alen, &n.b, &n.blen, err, errlen)) {
            free(n.a);
            free(n.b);
            return -1;
        }
    } else {
        fail(t, err, errlen, "%s.type: normalizer \"%s\" is not supported (Prepend, Replace, "
             "Sequence)", path, type);
        return -1;
    }
    norm_t *v = realloc(t->norms, (t->n_norms + 1) * sizeof *v);
    if (!v) {
        free(n.a);
        free(n.b);
        return fail(t, err, errlen, "out of memory"), -1;
    }
    t->norms = v;
    t->norms[t->n_norms++] = n;
    return 0;
}

static int push_pre(tsr_tokenizer_t *t, pre_t p)
{
    pre_t *v = realloc(t->pres, (t->n_pres + 1) * sizeof *v);
    if (!v) return -1;
    t->pres = v;
    t->pres[t->n_pres++] = p;
    return 0;
}

static int add_pre(tsr_tokenizer_t *t, json_t *o, const char *path, char *err, size_t errlen)
{
    const char *type = jstr(o, "type", NULL);
    pre_t p = {0};
    char sub[300];
    if (!strcmp(type, "Metaspace")) {
        size_t n = 0;
        const char *r = jstr(o, "replacement", &n);
        snprintf(sub, sizeof sub, "%s.replacement", path);
        if (one_char(t, r, n, p.repl, &p.repl_len, sub, err, errlen)) return -1;
        if (parse_scheme(t, o, path, &p.scheme, err, errlen)) return -1;
        p.kind = PRE_METASPACE;
        p.split = jbool(o, "split", true);
    } else if (!strcmp(type, "ByteLevel")) {
        if (jbool(o, "add_prefix_space", true) && push_pre(t, (pre_t){.kind = PRE_PREFIX_SPACE}))
            return fail(t, err, errlen, "out of memory"), -1;
        if (jbool(o, "use_regex", true)) {
            pre_t sp = {.kind = PRE_SPLIT};
            snprintf(sp.where, sizeof sp.where, "%s (ByteLevel's pattern)", path);
            sp.re = compile_re(t, GPT2_SPLIT, sizeof GPT2_SPLIT - 1, path, err, errlen);
            if (!sp.re) return -1;
            if (push_pre(t, sp)) {
                pcre2_code_free(sp.re);
                return fail(t, err, errlen, "out of memory"), -1;
            }
        }
        p.kind = PRE_BYTEMAP;
    } else if (!strcmp(type, "Split")) {
        p.kind = PRE_SPLIT;
        const char *behavior = jstr(o, "behavior", NULL);
        if (!behavior || strcmp(behavior, "Isolated") != 0) {
            fail(t, err, errlen, "%s.behavior: \"%s\" is not supported (Isolated)", path,
                 behavior ? behavior : "(missing)");
            return -1;
        }
        if (jbool(o, "invert", false)) {
            fail(t, err, errlen, "%s.invert: true is not supported", path);
            return -1;
        }
        json_t *pat = json_object_get(o, "pattern");
        size_t n = 0;
        const char *re = json_is_object(pat) ? jstr(pat, "Regex", &n) : NULL;
        const char *lit = json_is_object(pat) ? jstr(pat, "String", &n) : NULL;
        snprintf(sub, sizeof sub, "%s.pattern", path);
        snprintf(p.where, sizeof p.where, "%s", sub);
        if (re) {
            p.re = compile_re(t, re, n, sub, err, errlen);
        } else if (lit && n > 0) {
            /* A literal: quote it for the regex engine. */
            char *q = malloc(n + 5);
            if (!q) return fail(t, err, errlen, "out of memory"), -1;
            snprintf(q, n + 5, "\\Q%.*s\\E", (int)n, lit);
            if (memchr(lit, '\\', n) && strstr(q + 2, "\\E") != q + n + 2) {
                free(q);
                fail(t, err, errlen, "%s: a String pattern containing \\E is not supported", sub);
                return -1;
            }
            p.re = compile_re(t, q, n + 4, sub, err, errlen);
            free(q);
        } else {
            fail(t, err, errlen, "%s: only {\"Regex\": ...} or {\"String\": ...} is supported", sub);
            return -1;
        }
        if (!p.re) return -1;
    } else {
        fail(t, err, errlen, "%s.type: pre-tokenizer \"%s\" is not supported (ByteLevel, Split, "
             "Metaspace, Sequence)", path, type);
        return -1;
    }
    if (push_pre(t, p)) {
        pcre2_code_free(p.re);
        return fail(t, err, errlen, "out of memory"), -1;
    }
    return 0;
}

static int add_dec(tsr_tokenizer_t *t, json_t *o, const char *path, char *err, size_t errlen)
{
    const char *type = jstr(o, "type", NULL);
    dec_t d = {0};
    char sub[300];
    if (!strcmp(type, "Replace")) {
        d.kind = DEC_REPLACE;
        if (replace_pattern(t, o, path, &d.a, &d.alen, &d.b, &d.blen, err, errlen)) {
            free(d.a);
            free(d.b);
            return -1;
        }
    } else if (!strcmp(type, "ByteFallback")) {
        d.kind = DEC_BYTEFALLBACK;
        t->dec_bytefallback = true;
    } else if (!strcmp(type, "Fuse")) {
        d.kind = DEC_FUSE;
    } else if (!strcmp(type, "Strip")) {
        d.kind = DEC_STRIP;
        size_t n = 0;
        const char *c = jstr(o, "content", &n);
        snprintf(sub, sizeof sub, "%s.content", path);
        if (one_char(t, c, n, d.ch, &d.ch_len, sub, err, errlen)) return -1;
        json_t *start = json_object_get(o, "start"), *stop = json_object_get(o, "stop");
        if (!json_is_integer(start) || !json_is_integer(stop) || json_integer_value(start) < 0 ||
            json_integer_value(stop) < 0 || json_integer_value(start) > 1024 ||
            json_integer_value(stop) > 1024) {
            fail(t, err, errlen, "%s.start, .stop: must be integers in 0..1024", path);
            return -1;
        }
        d.start = (int)json_integer_value(start);
        d.stop = (int)json_integer_value(stop);
    } else if (!strcmp(type, "ByteLevel")) {
        d.kind = DEC_BYTELEVEL;
    } else if (!strcmp(type, "Metaspace")) {
        d.kind = DEC_METASPACE;
        size_t n = 0;
        const char *r = jstr(o, "replacement", &n);
        snprintf(sub, sizeof sub, "%s.replacement", path);
        if (one_char(t, r, n, d.ch, &d.ch_len, sub, err, errlen)) return -1;
        if (parse_scheme(t, o, path, &d.scheme, err, errlen)) return -1;
    } else {
        fail(t, err, errlen, "%s.type: decoder \"%s\" is not supported (ByteLevel, Metaspace, "
             "Replace, ByteFallback, Fuse, Strip, Sequence)", path, type);
        return -1;
    }
    dec_t *v = realloc(t->decs, (t->n_decs + 1) * sizeof *v);
    if (!v) {
        free(d.a);
        free(d.b);
        return fail(t, err, errlen, "out of memory"), -1;
    }
    t->decs = v;
    t->decs[t->n_decs++] = d;
    return 0;
}

static int add_post(tsr_tokenizer_t *t, json_t *o, const char *path, char *err, size_t errlen)
{
    const char *type = jstr(o, "type", NULL);
    if (!strcmp(type, "ByteLevel")) return 0;  /* offsets only */
    if (strcmp(type, "TemplateProcessing") != 0) {
        fail(t, err, errlen, "%s.type: post-processor \"%s\" is not supported "
             "(TemplateProcessing, ByteLevel, Sequence)", path, type);
        return -1;
    }
    if (t->tmpl) {
        fail(t, err, errlen, "%s: only one TemplateProcessing is supported", path);
        return -1;
    }
    json_t *single = json_object_get(o, "single"), *specials = json_object_get(o, "special_tokens");
    if (!json_is_array(single)) {
        fail(t, err, errlen, "%s.single: missing or not a list", path);
        return -1;
    }
    ids_t out = {0};
    size_t i;
    json_t *item;
    bool seen_seq = false;
    json_array_foreach(single, i, item) {
        json_t *st = json_object_get(item, "SpecialToken"), *sq = json_object_get(item, "Sequence");
        if (json_is_object(sq)) {
            const char *which = jstr(sq, "id", NULL);
            if (!which || strcmp(which, "A") != 0 || seen_seq) {
                fail(t, err, errlen, "%s.single[%zu].Sequence.id: only one sequence \"A\" is "
                     "supported", path, i);
                goto bad;
            }
            seen_seq = true;
            if (ids_put(&out, -1)) goto oom;
        } else if (json_is_object(st)) {
            const char *name = jstr(st, "id", NULL);
            json_t *spec = name ? json_object_get(specials, name) : NULL;
            json_t *ids = json_object_get(spec, "ids");
            if (!json_is_array(ids)) {
                fail(t, err, errlen, "%s.special_tokens.%s.ids: missing or not a list", path,
                     name ? name : "(no id)");
                goto bad;
            }
            size_t k;
            json_t *idv;
            json_array_foreach(ids, k, idv) {
                json_int_t id = json_is_integer(idv) ? json_integer_value(idv) : -1;
                if (id < 0 || id >= t->n_ids || !t->text[id]) {
                    fail(t, err, errlen, "%s.special_tokens.%s.ids[%zu]: not a token id of this "
                         "vocabulary", path, name, k);
                    goto bad;
                }
                if (ids_put(&out, (int32_t)id)) goto oom;
            }
        } else {
            fail(t, err, errlen, "%s.single[%zu]: neither SpecialToken nor Sequence", path, i);
            goto bad;
        }
    }
    if (!seen_seq) {
        fail(t, err, errlen, "%s.single: has no Sequence", path);
        goto bad;
    }
    t->tmpl = out.v;
    t->n_tmpl = out.n;
    return 0;
oom:
    fail(t, err, errlen, "out of memory");
bad:
    free(out.v);
    return -1;
}

/* ---- loading the model --------------------------------------------------------- */

static size_t table_size(size_t n)
{
    size_t s = 16;
    while (s < n * 2) s *= 2;
    return s;
}

static int set_token(tsr_tokenizer_t *t, int32_t id, const char *s, size_t n)
{
    if (t->text[id]) return 0;
    t->text[id] = dup_bytes(s, n);
    if (!t->text[id]) return -1;
    t->tlen[id] = (uint32_t)n;
    uint8_t byte;
    if (is_byte_token(s, n, &byte)) {
        t->flags[id] |= F_BYTE;
        t->byte_of[id] = byte;
    }
    return 0;
}

static int load_model(tsr_tokenizer_t *t, json_t *root, char *err, size_t errlen)
{
    json_t *model = json_object_get(root, "model");
    if (!json_is_object(model)) {
        fail(t, err, errlen, "model: missing or not an object");
        return -1;
    }
    const char *type = jstr(model, "type", NULL);
    if (!type || strcmp(type, "BPE") != 0) {
        fail(t, err, errlen, "model.type: \"%s\" is not supported (BPE)", type ? type : "(missing)");
        return -1;
    }
    json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout)) {
        fail(t, err, errlen, "model.dropout: must be null (dropout is for training)");
        return -1;
    }
    static const char *const unsupported[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < 2; i++) {
        size_t n = 0;
        json_t *v = json_object_get(model, unsupported[i]);
        if (v && !json_is_null(v) && (!jstr(model, unsupported[i], &n) || n > 0)) {
            fail(t, err, errlen, "model.%s: is not supported (must be null)", unsupported[i]);
            return -1;
        }
    }
    t->byte_fallback = jbool(model, "byte_fallback", false);
    t->fuse_unk = jbool(model, "fuse_unk", false);
    t->ignore_merges = jbool(model, "ignore_merges", false);

    json_t *vocab = json_object_get(model, "vocab");
    if (!json_is_object(vocab)) {
        fail(t, err, errlen, "model.vocab: missing or not an object");
        return -1;
    }
    /* The id space: the vocabulary's and the added tokens' ids. */
    json_int_t max_id = -1;
    const char *key;
    json_t *v;
    json_object_foreach(vocab, key, v) {
        json_int_t id = json_is_integer(v) ? json_integer_value(v) : -1;
        if (id < 0 || id >= TOK_MAX_ID) {
            fail(t, err, errlen, "model.vocab[\"%.60s\"]: id must be an integer in 0..%d", key,
                 TOK_MAX_ID - 1);
            return -1;
        }
        if (id > max_id) max_id = id;
    }
    json_t *added = json_object_get(root, "added_tokens");
    if (added && !json_is_null(added) && !json_is_array(added)) {
        fail(t, err, errlen, "added_tokens: not a list");
        return -1;
    }
    size_t i;
    json_array_foreach(added, i, v) {
        json_t *idv = json_object_get(v, "id");
        json_int_t id = json_is_integer(idv) ? json_integer_value(idv) : -1;
        size_t n = 0;
        if (id < 0 || id >= TOK_MAX_ID || !jstr(v, "content", &n) || n == 0) {
            fail(t, err, errlen, "added_tokens[%zu]: needs an id in 0..%d and a non-empty "
                 "content", i, TOK_MAX_ID - 1);
            return -1;
        }
        if (id > max_id) max_id = id;
    }
    t->n_ids = (int32_t)(max_id + 1);
    size_t nid = (size_t)t->n_ids;
    t->text = calloc(nid ? nid : 1, sizeof *t->text);
    t->tlen = calloc(nid ? nid : 1, sizeof *t->tlen);
    t->flags = calloc(nid ? nid : 1, 1);
    t->byte_of = calloc(nid ? nid : 1, 1);
    size_t nv = json_object_size(vocab);
    t->vmask = table_size(nv) - 1;
    t->vmap = calloc(t->vmask + 1, sizeof *t->vmap);
    if (!t->text || !t->tlen || !t->flags || !t->byte_of || !t->vmap) goto oom;
    json_object_foreach(vocab, key, v) {
        int32_t id = (int32_t)json_integer_value(v);
        size_t n = strlen(key);  /* jansson keys cannot hold NUL */
        if (t->text[id]) {
            fail(t, err, errlen, "model.vocab[\"%.60s\"]: id %d is used twice", key, id);
            return -1;
        }
        if (set_token(t, id, key, n)) goto oom;
        size_t s = hash_bytes(key, n) & t->vmask;
        while (t->vmap[s]) s = (s + 1) & t->vmask;
        t->vmap[s] = (uint32_t)id + 1;
    }
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        t->byte_id[b] = vocab_find(t, name, 6);
    }
    t->unk_id = -1;
    json_t *unk = json_object_get(model, "unk_token");
    if (json_is_string(unk)) {
        t->unk_id = vocab_find(t, json_string_value(unk), json_string_length(unk));
        if (t->unk_id < 0) {
            fail(t, err, errlen, "model.unk_token: \"%s\" is not in model.vocab",
                 json_string_value(unk));
            return -1;
        }
    }

    json_t *merges = json_object_get(model, "merges");
    if (!json_is_array(merges)) {
        fail(t, err, errlen, "model.merges: missing or not a list");
        return -1;
    }
    size_t nm = json_array_size(merges);
    t->mmask = table_size(nm) - 1;
    t->mkey = calloc(t->mmask + 1, sizeof *t->mkey);
    t->mval = calloc(t->mmask + 1, sizeof *t->mval);
    if (!t->mkey || !t->mval) goto oom;
    buf_t joined = {0};
    json_array_foreach(merges, i, v) {
        const char *a, *b;
        size_t alen, blen;
        if (json_is_string(v)) {  /* "a b" */
            const char *s = json_string_value(v);
            const char *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                fail(t, err, errlen, "model.merges[%zu]: \"%.60s\" is not two tokens separated "
                     "by one space", i, s);
                goto bad_merge;
            }
            a = s, alen = (size_t)(sp - s), b = sp + 1, blen = strlen(b);
        } else if (json_is_array(v) && json_array_size(v) == 2 &&
                   json_is_string(json_array_get(v, 0)) && json_is_string(json_array_get(v, 1))) {
            a = json_string_value(json_array_get(v, 0));
            alen = json_string_length(json_array_get(v, 0));
            b = json_string_value(json_array_get(v, 1));
            blen = json_string_length(json_array_get(v, 1));
        } else {
            fail(t, err, errlen, "model.merges[%zu]: neither \"a b\" nor [\"a\", \"b\"]", i);
            goto bad_merge;
        }
        int32_t ia = vocab_find(t, a, alen), ib = vocab_find(t, b, blen);
        joined.len = 0;
        if (buf_put(&joined, a, alen) || buf_put(&joined, b, blen)) {
            free(joined.p);
            goto oom;
        }
        int32_t ij = vocab_find(t, joined.p, joined.len);
        if (ia < 0 || ib < 0 || ij < 0) {
            fail(t, err, errlen, "model.merges[%zu]: \"%.*s\" is not in model.vocab", i,
                 (int)(ia < 0 ? alen : ib < 0 ? blen : joined.len > 120 ? 120 : joined.len),
                 ia < 0 ? a : ib < 0 ? b : joined.p);
            goto bad_merge;
        }
        uint64_t k = ((uint64_t)(uint32_t)ia << 32 | (uint32_t)ib) + 1;
        size_t s = hash_u64(k) & t->mmask;
        while (t->mkey[s] && t->mkey[s] != k) s = (s + 1) & t->mmask;
        t->mkey[s] = k;  /* a repeated pair keeps its last rank */
        t->mval[s] = (uint64_t)i << 32 | (uint32_t)ij;
    }
    free(joined.p);
    return 0;
bad_merge:
    free(joined.p);
    return -1;
oom:
    fail(t, err, errlen, "out of memory");
    return -1;
}

/* ---- normalizers ------------------------------------------------------------- */

/* Parsed by add_norm; run here for added tokens and by tok_encode.c for text. */
int tsr_tok_normalize(const tsr_tokenizer_t *t, const char *s, size_t n, buf_t *out,
                      buf_t *tmp)
{
    out->len = 0;
    if (buf_put(out, s, n)) return -1;
    for (size_t k = 0; k < t->n_norms; k++) {
        const norm_t *m = &t->norms[k];
        tmp->len = 0;
        if (m->kind == NORM_PREPEND) {
            if (out->len == 0) continue;
            if (buf_put(tmp, m->a, m->alen) || buf_put(tmp, out->p, out->len)) return -1;
        } else {
            size_t i = 0;
            while (i < out->len) {
                if (out->len - i >= m->alen && !memcmp(out->p + i, m->a, m->alen)) {
                    if (buf_put(tmp, m->b, m->blen)) return -1;
                    i += m->alen;
                } else {
                    if (buf_put(tmp, out->p + i, 1)) return -1;
                    i++;
                }
            }
        }
        buf_t swap = *out;
        *out = *tmp;
        *tmp = swap;
    }
    return 0;
}

/* ---- added tokens ------------------------------------------------------------- */

static int trie_add(added_set_t *set, const char *p, size_t len, int32_t token)
{
    uint32_t node = 0;
    for (size_t i = 0; i < len; i++) {
        uint32_t c = trie_child(set, node, (uint8_t)p[i]);
        if (!c) {
            if (set->n == set->cap) {
                size_t cap = set->cap * 2;
                tnode_t *v = realloc(set->v, cap * sizeof *v);
                if (!v) return -1;
                set->v = v;
                set->cap = cap;
            }
            c = (uint32_t)set->n++;
            set->v[c] = (tnode_t){0, set->v[node].child, -1, (uint8_t)p[i]};
            set->v[node].child = c;
        }
        node = c;
    }
    if (set->v[node].token < 0) {  /* two tokens with one pattern: the first wins */
        set->v[node].token = token;
        set->count++;
    }
    return 0;
}

static int build_set(tsr_tokenizer_t *t, added_set_t *set, bool normalized)
{
    set->cap = 64;
    set->n = 1;
    if (!(set->v = malloc(set->cap * sizeof *set->v))) return -1;
    set->v[0] = (tnode_t){0, 0, -1, 0};
    for (size_t i = 0; i < t->n_added; i++) {
        const added_t *a = &t->added[i];
        if (a->normalized != normalized || a->pattern_len == 0) continue;
        if (trie_add(set, a->pattern, a->pattern_len, (int32_t)i)) return -1;
    }
    return 0;
}

static int load_added(tsr_tokenizer_t *t, json_t *root, char *err, size_t errlen)
{
    json_t *list = json_object_get(root, "added_tokens");
    size_t n = json_array_size(list);
    if (n == 0) return 0;
    t->added = calloc(n, sizeof *t->added);
    t->amask = table_size(n) - 1;
    t->amap = calloc(t->amask + 1, sizeof *t->amap);
    if (!t->added || !t->amap) return fail(t, err, errlen, "out of memory"), -1;
    buf_t nb = {0}, tmp = {0};
    size_t i;
    json_t *v;
    int rc = -1;
    json_array_foreach(list, i, v) {
        size_t len = 0;
        const char *content = jstr(v, "content", &len);
        int32_t id = (int32_t)json_integer_value(json_object_get(v, "id"));
        if (added_find(t, content, len)) continue;  /* the first wins */
        if (t->text[id] && (t->tlen[id] != len || memcmp(t->text[id], content, len))) {
            fail(t, err, errlen, "added_tokens[%zu]: id %d is already \"%.60s\" in model.vocab", i,
                 id, t->text[id]);
            goto out;
        }
        added_t *a = &t->added[t->n_added];
        a->content = dup_bytes(content, len);
        if (!a->content || set_token(t, id, content, len)) goto oom;
        a->len = len;
        a->id = id;
        a->special = jbool(v, "special", false);
        a->lstrip = jbool(v, "lstrip", false);
        a->rstrip = jbool(v, "rstrip", false);
        a->single_word = jbool(v, "single_word", false);
        a->normalized = jbool(v, "normalized", !a->special);
        t->flags[id] |= F_ADDED | (a->special ? F_SPECIAL : 0);
        if (a->normalized) {
            if (tsr_tok_normalize(t, content, len, &nb, &tmp)) goto oom;
            a->pattern = dup_bytes(nb.p, nb.len);
            a->pattern_len = nb.len;
        } else {
            a->pattern = dup_bytes(content, len);
            a->pattern_len = len;
        }
        if (!a->pattern) goto oom;
        size_t s = hash_bytes(content, len) & t->amask;
        while (t->amap[s]) s = (s + 1) & t->amask;
        t->amap[s] = (uint32_t)t->n_added + 1;
        t->n_added++;
        if (a->single_word && !t->word_re) {
            t->word_re = compile_re(t, "\\w", 2, "added_tokens", err, errlen);
            if (!t->word_re) goto out;
        }
    }
    if (build_set(t, &t->raw_set, false) || build_set(t, &t->norm_set, true)) goto oom;
    rc = 0;
    goto out;
oom:
    fail(t, err, errlen, "out of memory");
out:
    free(nb.p);
    free(tmp.p);
    return rc;
}

/* ---- tokenizer_config.json ---------------------------------------------------- */

/* bos_token / eos_token: a string or {"content": ...}. */
static int32_t config_token(const tsr_tokenizer_t *t, json_t *cfg, const char *key)
{
    json_t *v = json_object_get(cfg, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    if (!json_is_string(v)) return -1;
    const added_t *a = added_find(t, json_string_value(v), json_string_length(v));
    return a ? a->id : vocab_find(t, json_string_value(v), json_string_length(v));
}

static int load_config(tsr_tokenizer_t *t, const char *text, size_t len, char *err, size_t errlen)
{
    json_error_t jerr;
    json_t *cfg = json_loadb(text, len, 0, &jerr);
    if (!json_is_object(cfg)) {
        tsr_set_err(err, errlen, "%s: tokenizer_config.json, line %d, column %d (byte %d): %s",
                    t->name, jerr.line, jerr.column, jerr.position,
                    cfg ? "not a JSON object" : tsr_json_error_what(&jerr));
        json_decref(cfg);
        return -1;
    }
    t->bos = config_token(t, cfg, "bos_token");
    t->eos = config_token(t, cfg, "eos_token");
    json_t *tmpl = json_object_get(cfg, "chat_template");
    const char *s = NULL;
    if (json_is_string(tmpl)) s = json_string_value(tmpl);
    else if (json_is_array(tmpl)) {  /* [{"name": ..., "template": ...}]: the default one */
        size_t i;
        json_t *v;
        json_array_foreach(tmpl, i, v) {
            const char *name = jstr(v, "name", NULL);
            if (name && !strcmp(name, "default")) s = jstr(v, "template", NULL);
        }
    }
    int rc = 0;
    if (s && !(t->chat_template = strdup(s))) rc = -1, tsr_set_err(err, errlen, "out of memory");
    json_decref(cfg);
    return rc;
}

/* ---- load and destroy ---------------------------------------------------------- */

tsr_tokenizer_t *tsr_tok_load_text(const char *tokenizer_json, size_t len,
                                   const char *config_json, size_t config_len,
                                   const char *name, char *err, size_t errlen)
{
    pthread_once(&bl_once, bl_init);
    tsr_tokenizer_t *t = calloc(1, sizeof *t), *result = NULL;
    json_t *root = NULL;
    if (!t) {
        tsr_set_err(err, errlen, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&t->lock, NULL);
    if (getrandom(&t->cache_key, sizeof t->cache_key, 0) != (ssize_t)sizeof t->cache_key)
        t->cache_key = (uint64_t)(uintptr_t)t ^ 0x9e3779b97f4a7c15ull;
    snprintf(t->name, sizeof t->name, "%s", name ? name : "tokenizer.json");
    t->bos = t->eos = -1;
    json_error_t jerr;
    root = json_loadb(tokenizer_json, len, 0, &jerr);
    if (!json_is_object(root)) {
        if (root) fail(t, err, errlen, "not a JSON object");
        else fail(t, err, errlen, "line %d, column %d (byte %d): invalid JSON: %s", jerr.line,
                  jerr.column, jerr.position, tsr_json_error_what(&jerr));
        goto out;
    }
    json_t *trunc = json_object_get(root, "truncation"), *pad = json_object_get(root, "padding");
    if ((trunc && !json_is_null(trunc)) || (pad && !json_is_null(pad))) {
        fail(t, err, errlen, "%s: must be null (Tessera bounds prompts itself)",
             trunc && !json_is_null(trunc) ? "truncation" : "padding");
        goto out;
    }
    if (load_model(t, root, err, errlen)) goto out;
    /* Normalizers before added tokens: normalized added tokens match their normalized form. */
    if (walk(t, json_object_get(root, "normalizer"), "normalizer", "normalizers", add_norm, 0,
             err, errlen) ||
        load_added(t, root, err, errlen) ||
        walk(t, json_object_get(root, "pre_tokenizer"), "pre_tokenizer", "pretokenizers",
             add_pre, 0, err, errlen) ||
        walk(t, json_object_get(root, "decoder"), "decoder", "decoders", add_dec, 0, err,
             errlen) ||
        walk(t, json_object_get(root, "post_processor"), "post_processor", "processors",
             add_post, 0, err, errlen))
        goto out;
    if (config_json && load_config(t, config_json, config_len, err, errlen)) goto out;
    for (int32_t i = 0; i < t->n_ids; i++)
        if (t->text[i] && t->tlen[i] > t->max_token_bytes) t->max_token_bytes = t->tlen[i];
    t->unbounded_tokens = (t->fuse_unk && t->unk_id >= 0) || t->max_token_bytes == 0;
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].lstrip || t->added[i].rstrip) t->unbounded_tokens = true;
    for (size_t i = 0; i < t->n_norms; i++)
        if (t->norms[i].kind == NORM_REPLACE && t->norms[i].blen < t->norms[i].alen)
            t->shrinking_norm = true;
    t->cslots = calloc(CACHE_SLOTS, sizeof *t->cslots);
    if (!t->cslots) {
        fail(t, err, errlen, "out of memory");
        goto out;
    }
    result = t;
    t = NULL;
out:
    json_decref(root);
    tsr_tok_destroy(&t);
    return result;
}

tsr_tokenizer_t *tsr_tok_load(const char *dir, char *err, size_t errlen)
{
    char *path = tsr_path_join(dir, "tokenizer.json");
    char *cpath = tsr_path_join(dir, "tokenizer_config.json");
    char *text = NULL, *ctext = NULL;
    tsr_tokenizer_t *t = NULL;
    size_t len = 0, clen = 0;
    if (!path || !cpath) {
        tsr_set_err(err, errlen, "out of memory");
        goto out;
    }
    if (!(text = tsr_model_read(dir, "tokenizer.json", TSR_TOKENIZER_MAX_BYTES, &len, err,
                                errlen)))
        goto out;
    if (faccessat(AT_FDCWD, cpath, F_OK, AT_SYMLINK_NOFOLLOW) == 0 &&
        !(ctext = tsr_model_read(dir, "tokenizer_config.json", TSR_TOKENIZER_MAX_BYTES, &clen,
                                 err, errlen)))
        goto out;
    t = tsr_tok_load_text(text, len, ctext, clen, path, err, errlen);
out:
    free(path);
    free(cpath);
    free(text);
    free(ctext);
    return t;
}

void tsr_tok_destroy(tsr_tokenizer_t **self_p)
{
    if (!self_p || !*self_p) return;
    tsr_tokenizer_t *t = *self_p;
    for (int32_t i = 0; t->text && i < t->n_ids; i++) free(t->text[i]);
    free(t->text);
    free(t->tlen);
    free(t->flags);
    free(t->byte_of);
    free(t->vmap);
    free(t->amap);
    free(t->mkey);
    free(t->mval);
    for (size_t i = 0; i < t->n_added; i++) {
        free(t->added[i].content);
        free(t->added[i].pattern);
    }
    free(t->added);
    free(t->raw_set.v);
    free(t->norm_set.v);
    pcre2_code_free(t->word_re);
    for (size_t i = 0; i < t->n_norms; i++) {
        free(t->norms[i].a);
        free(t->norms[i].b);
    }
    free(t->norms);
    for (size_t i = 0; i < t->n_pres; i++) pcre2_code_free(t->pres[i].re);
    free(t->pres);
    for (size_t i = 0; i < t->n_decs; i++) {
        free(t->decs[i].a);
        free(t->decs[i].b);
    }
    free(t->decs);
    free(t->tmpl);
    free(t->chat_template);
    free(t->cslots);
    free(t->ckeys.p);
    free(t->cids.v);
    pthread_mutex_destroy(&t->lock);
    free(t);
    *self_p = NULL;
}

/* ---- accessors ---------------------------------------------------------------------- */

/* A model's ids the tokenizer has no token for decode to nothing, so a few are allowed
 * only: some models pad their embedding past their tokenizer (to a multiple of 64, 128
 * or more), and a trained model never generates a padding id. */
#define TOK_PADDING_DIV 16

int tsr_tok_covers(const tsr_tokenizer_t *t, int32_t model_vocab, char *err, size_t errlen)
{
    int32_t have = 0;
    for (int32_t i = 0; i < model_vocab && i < t->n_ids; i++) have += t->text[i] != NULL;
    if (model_vocab - have <= model_vocab / TOK_PADDING_DIV) return 0;
    tsr_set_err(err, errlen, "has tokens for %d of the model's %d ids (its vocab_size): the "
                "others would decode to nothing (at most a sixteenth may lack one, as padding)",
                have, model_vocab);
    return -1;
}

int32_t tsr_tok_vocab_size(const tsr_tokenizer_t *t)
{
    return t->n_ids;
}

int32_t tsr_tok_token_id(const tsr_tokenizer_t *t, const char *content)
{
    size_t n = strlen(content);
    const added_t *a = added_find(t, content, n);
    return a ? a->id : vocab_find(t, content, n);
}

const char *tsr_tok_token_text(const tsr_tokenizer_t *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_ids || !t->text[id]) return NULL;
    if (len) *len = t->tlen[id];
    return t->text[id];
}

bool tsr_tok_is_special(const tsr_tokenizer_t *t, int32_t id)
{
    return id >= 0 && id < t->n_ids && (t->flags[id] & F_SPECIAL);
}

int32_t tsr_tok_bos(const tsr_tokenizer_t *t)
{
    return t->bos;
}

int32_t tsr_tok_eos(const tsr_tokenizer_t *t)
{
    return t->eos;
}

const char *tsr_tok_chat_template(const tsr_tokenizer_t *t)
{
    return t->chat_template;
}
