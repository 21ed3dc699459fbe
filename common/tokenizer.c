/* tokenizer.c: tokenizer.json (BPE) in C; see tokenizer.h for what is covered.
 *
 * Encoding runs the same stages as the reference implementation:
 *   1. added tokens whose `normalized` is false are cut out of the raw text;
 *   2. each remaining piece is normalized, and added tokens whose `normalized` is true
 *      are cut out of it (matched in their normalized form);
 *   3. each remaining piece is pre-tokenized into words;
 *   4. each word goes through the BPE model (a word cache saves most of this work);
 *   5. the post-processor's template adds its special tokens.
 * Added tokens are found leftmost-longest, a match consuming its text even when the
 * single_word rule then discards it.
 *
 * Decoding runs the decoder chain over token strings.  The streaming decoder decodes a
 * short window of recent tokens and emits what the newest one adds, holding it back
 * while it ends in an incomplete character (U+FFFD) or, for byte-fallback tokenizers,
 * while a run of <0xNN> byte tokens may still go on: such a run decodes as a whole. */
#include "common/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <pcre2.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "common/strbuf.h"
#include "common/util.h"

#define TOK_MAX_ID (1 << 24)         /* ids beyond this are refused at load */
#define CACHE_SLOTS (1u << 16)       /* word cache: hash slots */
#define CACHE_BYTES (4u << 20)       /* ... bytes of words kept */
#define CACHE_IDS (1u << 20)         /* ... ids kept */
#define CACHE_MAX_WORD 256           /* longer words are not cached */
#define CACHE_MAX_PROBE 16           /* slots looked at per lookup: a word beyond is uncached */
/* Tokens the streaming decoder holds at most.  A character split across tokens, or a
 * byte-fallback run, is held until it is complete; past this many tokens (only garbage
 * gets there: 4,096 tokens that never complete a character) the text is emitted as it
 * is, and may then differ from the whole decode. */
#define DETOK_MAX_WINDOW 4096

/* GPT-2's split, used by ByteLevel when use_regex is true. */
static const char GPT2_SPLIT[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

enum { F_SPECIAL = 1, F_ADDED = 2, F_BYTE = 4 };
enum { SCHEME_ALWAYS, SCHEME_FIRST, SCHEME_NEVER };

typedef tsr_sb_t buf_t;

/* Appends; -1 once the buffer ran out of memory (the callers' error flow). */
static int buf_put(buf_t *b, const void *s, size_t n)
{
    tsr_sb_putn(b, s, n);
    return b->oom ? -1 : 0;
}

typedef struct {
    int32_t *v;
    size_t n, cap;
} ids_t;

static int ids_put(ids_t *a, int32_t id)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 64;
        int32_t *v = realloc(a->v, cap * sizeof *v);
        if (!v) return -1;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = id;
    return 0;
}

/* ---- stages ---------------------------------------------------------------- */

typedef struct {
    enum { NORM_PREPEND, NORM_REPLACE } kind;
    char *a, *b;                     /* prepend: a; replace: a -> b */
    size_t alen, blen;
} norm_t;

typedef struct {
    /* ByteLevel becomes PRE_PREFIX_SPACE (add_prefix_space), PRE_SPLIT (use_regex) and
     * PRE_BYTEMAP, in that order. */
    enum { PRE_METASPACE, PRE_PREFIX_SPACE, PRE_SPLIT, PRE_BYTEMAP } kind;
    char repl[8];                    /* metaspace replacement, UTF-8 */
    size_t repl_len;
    int scheme;
    bool split;                      /* metaspace: split on the replacement */
    pcre2_code *re;                  /* split pattern (owned) */
} pre_t;

typedef struct {
    enum { DEC_REPLACE, DEC_BYTEFALLBACK, DEC_FUSE, DEC_STRIP, DEC_BYTELEVEL, DEC_METASPACE } kind;
    char *a, *b;                     /* replace: a -> b */
    size_t alen, blen;
    char ch[8];                      /* strip: the character; metaspace: replacement */
    size_t ch_len;
    int start, stop;                 /* strip counts */
    int scheme;                      /* metaspace */
} dec_t;

typedef struct {
    char *content;
    size_t len;
    char *pattern;                   /* what is matched: content, normalized if `normalized` */
    size_t pattern_len;
    int32_t id;
    bool special, lstrip, rstrip, single_word, normalized;
} added_t;

/* Added tokens' patterns as a byte trie (node 0 the root; children in a sibling list),
 * so finding the longest one at a position costs its length, not the number of tokens. */
typedef struct {
    uint32_t child, sibling;         /* 0: none (the root is nobody's child) */
    int32_t token;                   /* index into added, or -1 */
    uint8_t byte;
} tnode_t;

typedef struct {
    tnode_t *v;
    size_t n, cap;
    size_t count;                    /* patterns */
} added_set_t;

typedef struct {
    uint64_t h;
    uint32_t key_off, key_len, ids_off, n_ids;
} centry_t;

struct tsr_tokenizer {
    char name[256];
    int32_t n_ids;                   /* one past the largest id */
    char **text;                     /* per id, NULL when unused */
    uint32_t *tlen;
    uint8_t *flags;
    uint8_t *byte_of;                /* F_BYTE tokens: their byte */
    uint32_t *vmap;                  /* model vocab: slot -> id + 1 */
    size_t vmask;
    uint32_t *amap;                  /* added tokens by content: slot -> index + 1 */
    size_t amask;
    uint64_t *mkey, *mval;           /* merges: (a << 32 | b) + 1 -> rank << 32 | new id */
    size_t mmask;
    int32_t byte_id[256];
    int32_t unk_id;
    bool byte_fallback, fuse_unk, ignore_merges;
    added_t *added;
    size_t n_added;
    added_set_t raw_set, norm_set;
    pcre2_code *word_re;             /* \w, for single_word */
    norm_t *norms;
    size_t n_norms;
    pre_t *pres;
    size_t n_pres;
    dec_t *decs;
    size_t n_decs;
    bool dec_bytefallback;
    int32_t *tmpl;                   /* template: ids, with -1 for the sequence */
    size_t n_tmpl;
    int32_t bos, eos;
    char *chat_template;
    pthread_mutex_t lock;            /* the word cache */
    uint64_t cache_key;              /* random: keys the cache's hash */
    size_t max_token_bytes;          /* the longest vocabulary or added token */
    bool unbounded_tokens;           /* a token can cover any length of text (fuse_unk, an
                                        lstrip or rstrip added token): no length bound */
    bool shrinking_norm;             /* a Replace normalizer shortens the text */
    centry_t *cslots;
    size_t cused;
    buf_t ckeys;
    ids_t cids;
};

/* ---- hashing ----------------------------------------------------------------- */

static uint64_t hash_bytes(const void *s, size_t n)
{
    const unsigned char *p = s;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

static size_t table_size(size_t n)
{
    size_t s = 16;
    while (s < n * 2) s *= 2;
    return s;
}

static int32_t vocab_find(const tsr_tokenizer_t *t, const char *s, size_t n)
{
    for (size_t i = hash_bytes(s, n) & t->vmask;; i = (i + 1) & t->vmask) {
        uint32_t v = t->vmap[i];
        if (!v) return -1;
        int32_t id = (int32_t)v - 1;
        if (t->tlen[id] == n && memcmp(t->text[id], s, n) == 0) return id;
    }
}

static const added_t *added_find(const tsr_tokenizer_t *t, const char *s, size_t n)
{
    if (!t->amap) return NULL;
    for (size_t i = hash_bytes(s, n) & t->amask;; i = (i + 1) & t->amask) {
        uint32_t v = t->amap[i];
        if (!v) return NULL;
        const added_t *a = &t->added[v - 1];
        if (a->len == n && memcmp(a->content, s, n) == 0) return a;
    }
}

static bool merge_find(const tsr_tokenizer_t *t, int32_t a, int32_t b, uint32_t *rank,
                       int32_t *new_id)
{
    if (!t->mkey) return false;
    uint64_t key = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) + 1;
    for (size_t i = hash_u64(key) & t->mmask;; i = (i + 1) & t->mmask) {
        if (t->mkey[i] == 0) return false;
        if (t->mkey[i] == key) {
            *rank = (uint32_t)(t->mval[i] >> 32);
            *new_id = (int32_t)(uint32_t)t->mval[i];
            return true;
        }
    }
}

/* ---- UTF-8 --------------------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s[0..n), 0 when invalid, -k when it is a valid
 * start cut short by the end (k bytes present). */
static int utf8_seq(const unsigned char *s, size_t n)
{
    unsigned b = s[0];
    if (b < 0x80) return 1;
    int need;
    unsigned lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) need = 1;
    else if (b == 0xE0) need = 2, lo = 0xA0;
    else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) need = 2;
    else if (b == 0xED) need = 2, hi = 0x9F;
    else if (b == 0xF0) need = 3, lo = 0x90;
    else if (b >= 0xF1 && b <= 0xF3) need = 3;
    else if (b == 0xF4) need = 3, hi = 0x8F;
    else return 0;
    for (int k = 1; k <= need; k++) {
        if ((size_t)k >= n) return -k;
        unsigned c = s[k];
        if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) return 0;
    }
    return need + 1;
}

/* Number of bytes of the first bad sequence's maximal valid prefix (at least 1). */
static size_t utf8_bad_len(const unsigned char *s, size_t n)
{
    size_t k = 1;
    while (k < n && k < 4) {
        int r = utf8_seq(s, k + 1);
        if (r >= 0) break;           /* the prefix s[0..k+1) is no longer a valid start */
        k++;
    }
    return k;
}

/* Appends s with every invalid sequence replaced by U+FFFD, as a lossy UTF-8 conversion
 * does (one per maximal invalid prefix). */
static int utf8_lossy(buf_t *out, const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        int r = utf8_seq(u + i, n - i);
        if (r > 0) {
            if (buf_put(out, u + i, (size_t)r)) return -1;
            i += (size_t)r;
        } else {
            size_t k = r < 0 ? (size_t)-r : utf8_bad_len(u + i, n - i);
            if (buf_put(out, "\xEF\xBF\xBD", 3)) return -1;
            i += k;
        }
    }
    return 0;
}

/* Offset of the first invalid byte, or n. */
static size_t utf8_check(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        int r = utf8_seq(u + i, n - i);
        if (r <= 0) return i;
        i += (size_t)r;
    }
    return n;
}

static size_t utf8_char_len(const char *s)
{
    unsigned b = (unsigned char)s[0];
    return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

static size_t put_utf8(char *o, unsigned cp)
{
    if (cp < 0x80) return o[0] = (char)cp, 1;
    if (cp < 0x800) return o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 63)), 2;
    if (cp < 0x10000)
        return o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | (cp >> 6 & 63)),
               o[2] = (char)(0x80 | (cp & 63)), 3;
    return o[0] = (char)(0xF0 | cp >> 18), o[1] = (char)(0x80 | (cp >> 12 & 63)),
           o[2] = (char)(0x80 | (cp >> 6 & 63)), o[3] = (char)(0x80 | (cp & 63)), 4;
}

static unsigned get_utf8(const char *s, size_t *len)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t l = utf8_char_len(s);
    unsigned cp = l == 1 ? u[0] : l == 2 ? u[0] & 31u : l == 3 ? u[0] & 15u : u[0] & 7u;
    for (size_t k = 1; k < l; k++) cp = cp << 6 | (u[k] & 63u);
    *len = l;
    return cp;
}

/* Unicode White_Space, the `\s` of the reference's strip rules. */
static bool is_space_cp(unsigned c)
{
    return (c >= 9 && c <= 13) || c == 32 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

/* ---- byte-level alphabet ------------------------------------------------------ */

static unsigned bl_cp[256];         /* byte -> code point */
static int bl_byte[512];            /* code point -> byte, -1 */
static pthread_once_t bl_once = PTHREAD_ONCE_INIT;

static void bl_init(void)
{
    for (int i = 0; i < 512; i++) bl_byte[i] = -1;
    unsigned next = 256;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        bl_cp[b] = printable ? (unsigned)b : next++;
        bl_byte[bl_cp[b]] = b;
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
    if (!s || n == 0 || n > 4 || utf8_char_len(s) != n || utf8_check(s, n) != n) {
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

/* "<0xNN>" (hex digits of either case), a byte-fallback token: its byte in *byte. */
static bool is_byte_token(const char *s, size_t n, uint8_t *byte)
{
    if (n != 6 || memcmp(s, "<0x", 3) || s[5] != '>' || !isxdigit((unsigned char)s[3]) ||
        !isxdigit((unsigned char)s[4]))
        return false;
    char hex[3] = {s[3], s[4], 0};
    *byte = (uint8_t)strtoul(hex, NULL, 16);
    return true;
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

/* Normalizes s into out (cleared first). */
static int normalize(const tsr_tokenizer_t *t, const char *s, size_t n, buf_t *out, buf_t *tmp)
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

static uint32_t trie_child(const added_set_t *set, uint32_t node, uint8_t byte)
{
    for (uint32_t c = set->v[node].child; c; c = set->v[c].sibling)
        if (set->v[c].byte == byte) return c;
    return 0;
}

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

/* The added token with the longest pattern at s[0..n), or NULL. */
static const added_t *trie_longest(const tsr_tokenizer_t *t, const added_set_t *set,
                                   const char *s, size_t n)
{
    const added_t *best = NULL;
    uint32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        if (!(node = trie_child(set, node, (uint8_t)s[i]))) break;
        if (set->v[node].token >= 0) best = &t->added[set->v[node].token];
    }
    return best;
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
            if (normalize(t, content, len, &nb, &tmp)) goto oom;
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
        tsr_set_err(err, errlen, "%s: tokenizer_config.json, line %d: %s", t->name, jerr.line,
                    cfg ? "not a JSON object" : jerr.text);
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
        else fail(t, err, errlen, "line %d, column %d: %s", jerr.line, jerr.column, jerr.text);
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
    if (!(text = tsr_read_regular(path, TSR_TOKENIZER_MAX_BYTES, &len, err, errlen))) goto out;
    if (access(cpath, F_OK) == 0 &&
        !(ctext = tsr_read_regular(cpath, TSR_TOKENIZER_MAX_BYTES, &clen, err, errlen)))
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

/* ---- encoding ------------------------------------------------------------------- */

/* Scratch for one encode call. */
typedef struct {
    ids_t *out;
    buf_t *stage;                    /* one per pre-tokenizer stage */
    int32_t *sym_id;                 /* BPE work arrays */
    int32_t *sym_prev, *sym_next;
    uint64_t *heap;
    size_t sym_cap;
    size_t max_ids;                  /* stop past this many ids (0: no bound) */
    bool over;                       /* ... and it was passed */
} enc_t;

static int enc_grow(enc_t *e, size_t n)
{
    if (n <= e->sym_cap) return 0;
    size_t cap = e->sym_cap ? e->sym_cap : 64;
    while (cap < n) cap *= 2;
    int32_t *a = realloc(e->sym_id, cap * sizeof *a);
    if (a) e->sym_id = a;
    int32_t *b = realloc(e->sym_prev, cap * sizeof *b);
    if (b) e->sym_prev = b;
    int32_t *c = realloc(e->sym_next, cap * sizeof *c);
    if (c) e->sym_next = c;
    uint64_t *h = realloc(e->heap, 2 * cap * sizeof *h);
    if (h) e->heap = h;
    if (!a || !b || !c || !h) return -1;
    e->sym_cap = cap;
    return 0;
}

static void heap_push(uint64_t *h, size_t *n, uint64_t v)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p] <= v) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n)
{
    uint64_t top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && h[c + 1] < h[c]) c++;
        if (h[c] >= last) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

/* The pair starting at symbol i, queued when it has a merge. */
static void queue_pair(const tsr_tokenizer_t *t, enc_t *e, size_t *nh, int32_t i)
{
    int32_t j = e->sym_next[i];
    uint32_t rank;
    int32_t nid;
    if (j >= 0 && merge_find(t, e->sym_id[i], e->sym_id[j], &rank, &nid))
        heap_push(e->heap, nh, (uint64_t)rank << 32 | (uint32_t)i);
}

/* BPE over one word; appends its ids to dst. */
static int bpe_word(const tsr_tokenizer_t *t, enc_t *e, const char *w, size_t n, ids_t *dst)
{
    if (t->ignore_merges) {
        int32_t id = vocab_find(t, w, n);
        if (id >= 0) return ids_put(dst, id);
    }
    if (enc_grow(e, n + 1)) return -1;
    int32_t ns = 0, unk_pending = 0;  /* unk_pending: a fused unk not yet added */
    for (size_t i = 0; i < n;) {
        size_t cl = utf8_char_len(w + i);
        int32_t id = vocab_find(t, w + i, cl);
        if (id >= 0) {
            if (unk_pending) e->sym_id[ns++] = t->unk_id, unk_pending = 0;
            e->sym_id[ns++] = id;
        } else {
            bool done = false;
            if (t->byte_fallback) {
                done = true;
                for (size_t k = 0; k < cl; k++)
                    if (t->byte_id[(unsigned char)w[i + k]] < 0) done = false;
                if (done)
                    for (size_t k = 0; k < cl; k++) e->sym_id[ns++] = t->byte_id[(unsigned char)w[i + k]];
            }
            if (!done && t->unk_id >= 0) {
                if (unk_pending && !t->fuse_unk) e->sym_id[ns++] = t->unk_id;
                unk_pending = 1;
            }
        }
        i += cl;
    }
    if (unk_pending) e->sym_id[ns++] = t->unk_id;
    for (int32_t i = 0; i < ns; i++) {
        e->sym_prev[i] = i - 1;
        e->sym_next[i] = i + 1 < ns ? i + 1 : -1;
    }
    size_t nh = 0;
    for (int32_t i = 0; i + 1 < ns; i++) queue_pair(t, e, &nh, i);
    while (nh) {
        uint64_t top = heap_pop(e->heap, &nh);
        int32_t i = (int32_t)(uint32_t)top, j = e->sym_next[i];
        uint32_t rank;
        int32_t nid;
        if (e->sym_id[i] < 0 || j < 0 || !merge_find(t, e->sym_id[i], e->sym_id[j], &rank, &nid) ||
            rank != (uint32_t)(top >> 32))
            continue;  /* stale: one side was merged since */
        e->sym_id[i] = nid;
        e->sym_id[j] = -1;
        e->sym_next[i] = e->sym_next[j];
        if (e->sym_next[i] >= 0) e->sym_prev[e->sym_next[i]] = i;
        if (e->sym_prev[i] >= 0) queue_pair(t, e, &nh, e->sym_prev[i]);
        queue_pair(t, e, &nh, i);
    }
    for (int32_t i = ns ? 0 : -1; i >= 0; i = e->sym_next[i])
        if (ids_put(dst, e->sym_id[i])) return -1;
    return 0;
}

/* A word through the cache, then BPE. */
static int model_word(const tsr_tokenizer_t *tc, enc_t *e, const char *w, size_t n)
{
    tsr_tokenizer_t *t = (tsr_tokenizer_t *)tc;  /* the cache is the one mutable part */
    if (n == 0) return 0;
    /* Enough: the rest is not worth encoding.  A word needs at least n / (longest token)
     * tokens, so one that cannot fit is not encoded either. */
    if (e->max_ids && (e->out->n > e->max_ids ||
                       (!t->unbounded_tokens &&
                        n > (e->max_ids + 1 - e->out->n) * t->max_token_bytes))) {
        e->over = true;
        return -1;
    }
    if (n > CACHE_MAX_WORD) return bpe_word(t, e, w, n, e->out);
    /* Keyed: the words of a prompt cannot be chosen to collide in the cache. */
    uint64_t h = hash_u64(hash_bytes(w, n) ^ t->cache_key);
    pthread_mutex_lock(&t->lock);
    size_t s = h & (CACHE_SLOTS - 1);
    for (int probe = 0; probe < CACHE_MAX_PROBE; probe++, s = (s + 1) & (CACHE_SLOTS - 1)) {
        centry_t *c = &t->cslots[s];
        if (c->key_len == 0) break;
        if (c->h == h && c->key_len == n && !memcmp(t->ckeys.p + c->key_off, w, n)) {
            int rc = 0;
            for (uint32_t k = 0; k < c->n_ids && !rc; k++)
                rc = ids_put(e->out, t->cids.v[c->ids_off + k]);
            pthread_mutex_unlock(&t->lock);
            return rc;
        }
    }
    pthread_mutex_unlock(&t->lock);
    size_t before = e->out->n;
    if (bpe_word(t, e, w, n, e->out)) return -1;
    size_t got = e->out->n - before;
    pthread_mutex_lock(&t->lock);
    if (t->cused * 2 >= CACHE_SLOTS || t->ckeys.len + n > CACHE_BYTES ||
        t->cids.n + got > CACHE_IDS) {  /* full: start over */
        memset(t->cslots, 0, CACHE_SLOTS * sizeof *t->cslots);
        t->cused = 0;
        t->ckeys.len = 0;
        t->ckeys.oom = false;
        t->cids.n = 0;
    }
    s = h & (CACHE_SLOTS - 1);
    bool present = false;
    int probe = 0;
    for (; probe < CACHE_MAX_PROBE && t->cslots[s].key_len; probe++, s = (s + 1) & (CACHE_SLOTS - 1))
        if (t->cslots[s].h == h && t->cslots[s].key_len == n &&
            !memcmp(t->ckeys.p + t->cslots[s].key_off, w, n))
            present = true;  /* another thread cached it meanwhile */
    if (!present && probe < CACHE_MAX_PROBE) {
        size_t koff = t->ckeys.len, ioff = t->cids.n;
        bool ok = buf_put(&t->ckeys, w, n) == 0;
        for (size_t k = 0; ok && k < got; k++) ok = ids_put(&t->cids, e->out->v[before + k]) == 0;
        if (ok) {
            t->cslots[s] = (centry_t){h, (uint32_t)koff, (uint32_t)n, (uint32_t)ioff, (uint32_t)got};
            t->cused++;
        } else {
            t->ckeys.len = koff;
            t->cids.n = ioff;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return 0;
}

static int pretok(const tsr_tokenizer_t *t, enc_t *e, size_t stage, const char *s, size_t n,
                  bool first);

/* Runs re over s, handing every match and every gap between matches to the next stage. */
static int split_re(const tsr_tokenizer_t *t, enc_t *e, size_t stage, pcre2_code *re,
                    const char *s, size_t n, bool first)
{
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    if (!md) return -1;
    int rc = 0;
    size_t last = 0, at = 0;
    while (at <= n && !rc) {
        int m = pcre2_match(re, (PCRE2_SPTR)s, n, at, PCRE2_NO_UTF_CHECK, md, NULL);
        if (m == PCRE2_ERROR_JIT_STACKLIMIT)
            m = pcre2_match(re, (PCRE2_SPTR)s, n, at, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, NULL);
        if (m < 0) break;  /* no more matches (or a match limit: the rest is one piece) */
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) {  /* empty: no piece; step one character */
            at = ms < n ? ms + utf8_char_len(s + ms) : n + 1;
            continue;
        }
        if (ms > last) rc = pretok(t, e, stage + 1, s + last, ms - last, first && last == 0);
        if (!rc) rc = pretok(t, e, stage + 1, s + ms, me - ms, first && ms == 0);
        last = at = me;
    }
    if (!rc && last < n) rc = pretok(t, e, stage + 1, s + last, n - last, first && last == 0);
    pcre2_match_data_free(md);
    return rc;
}

/* Pre-tokenizer stage `stage` over one piece; past the last stage, the model. */
static int pretok(const tsr_tokenizer_t *t, enc_t *e, size_t stage, const char *s, size_t n,
                  bool first)
{
    if (n == 0) return 0;
    if (stage == t->n_pres) return model_word(t, e, s, n);
    const pre_t *p = &t->pres[stage];
    buf_t *b = &e->stage[stage];
    b->len = 0;
    if (p->kind == PRE_SPLIT) return split_re(t, e, stage, p->re, s, n, first);
    if (p->kind == PRE_METASPACE) {
        /* Whether it starts with the replacement once spaces are replaced. */
        bool starts = s[0] == ' ' || (n >= p->repl_len && !memcmp(s, p->repl, p->repl_len));
        if (!starts && (p->scheme == SCHEME_ALWAYS || (p->scheme == SCHEME_FIRST && first)) &&
            buf_put(b, p->repl, p->repl_len))
            return -1;
        for (size_t i = 0; i < n; i++)
            if (s[i] == ' ' ? buf_put(b, p->repl, p->repl_len) : buf_put(b, s + i, 1)) return -1;
        if (!p->split) return pretok(t, e, stage + 1, b->p, b->len, first);
        /* Each replacement starts a piece (merged with what follows it). */
        size_t from = 0;
        for (size_t i = p->repl_len; i + p->repl_len <= b->len; i++)
            if (!memcmp(b->p + i, p->repl, p->repl_len)) {
                if (pretok(t, e, stage + 1, b->p + from, i - from, first && from == 0)) return -1;
                from = i;
            }
        return pretok(t, e, stage + 1, b->p + from, b->len - from, first && from == 0);
    }
    if (p->kind == PRE_PREFIX_SPACE) {
        if (s[0] == ' ') return pretok(t, e, stage + 1, s, n, first);
        if (buf_put(b, " ", 1) || buf_put(b, s, n)) return -1;
        return pretok(t, e, stage + 1, b->p, b->len, first);
    }
    for (size_t i = 0; i < n; i++) {  /* PRE_BYTEMAP */
        char u[4];
        if (buf_put(b, u, put_utf8(u, bl_cp[(unsigned char)s[i]]))) return -1;
    }
    return pretok(t, e, stage + 1, b->p, b->len, first);
}

typedef struct {
    size_t off, len;
    int32_t id;                      /* -1: text */
} seg_t;

typedef struct {
    seg_t *v;
    size_t n, cap;
} segs_t;

static int seg_put(segs_t *a, size_t off, size_t len, int32_t id)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 16;
        seg_t *v = realloc(a->v, cap * sizeof *v);
        if (!v) return -1;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = (seg_t){off, len, id};
    return 0;
}

static bool word_char_at(const tsr_tokenizer_t *t, const char *s, size_t at, size_t len)
{
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(t->word_re, NULL);
    if (!md) return false;
    int m = pcre2_match(t->word_re, (PCRE2_SPTR)s + at, len, 0,
                        PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, md, NULL);
    pcre2_match_data_free(md);
    return m >= 0;
}

/* Splits s[0..n) into text and added-token segments (appended to out). */
static int find_added(const tsr_tokenizer_t *t, const added_set_t *set, const char *s, size_t n,
                      segs_t *out)
{
    size_t start_offset = 0, pos = 0;
    while (set->count && pos < n) {
        const added_t *hit = trie_longest(t, set, s + pos, n - pos);
        if (!hit) {
            pos++;
            continue;
        }
        size_t start = pos, stop = pos + hit->pattern_len;
        pos = stop;  /* the next match is looked for after this one, used or not */
        if (start < start_offset) continue;
        if (hit->single_word) {
            size_t b = start;
            while (b > 0 && ((unsigned char)s[b - 1] & 0xC0) == 0x80) b--;
            if (start > 0 && b > 0) b--;
            while (b > 0 && ((unsigned char)s[b] & 0xC0) == 0x80) b--;
            bool word_before = start > 0 && word_char_at(t, s, b, start - b);
            bool word_after = stop < n && word_char_at(t, s, stop, utf8_char_len(s + stop));
            if (word_before || word_after) continue;
        }
        if (hit->lstrip) {
            size_t b = start;
            while (b > start_offset) {
                size_t c = b - 1;
                while (c > 0 && ((unsigned char)s[c] & 0xC0) == 0x80) c--;
                size_t cl;
                if (!is_space_cp(get_utf8(s + c, &cl))) break;
                b = c;
            }
            start = b;
        }
        if (hit->rstrip) {
            while (stop < n) {
                size_t cl;
                if (!is_space_cp(get_utf8(s + stop, &cl))) break;
                stop += cl;
            }
        }
        if (start_offset < start && seg_put(out, start_offset, start - start_offset, -1)) return -1;
        if (seg_put(out, start, stop - start, hit->id)) return -1;
        start_offset = stop;
    }
    if (start_offset < n && seg_put(out, start_offset, n - start_offset, -1)) return -1;
    return 0;
}

int tsr_tok_encode(const tsr_tokenizer_t *t, const char *text, size_t len, bool add_special,
                   int32_t **ids, size_t *n, char *err, size_t errlen)
{
    return tsr_tok_encode_max(t, text, len, add_special, 0, ids, n, err, errlen);
}

int tsr_tok_encode_max(const tsr_tokenizer_t *t, const char *text, size_t len, bool add_special,
                       size_t max_ids, int32_t **ids, size_t *n, char *err, size_t errlen)
{
    *ids = NULL;
    *n = 0;
    size_t bad = utf8_check(text, len);
    if (bad < len) {
        tsr_set_err(err, errlen, "the text is not valid UTF-8 at byte %zu (0x%02X)", bad,
                    (unsigned char)text[bad]);
        return -1;
    }
    ids_t out = {0};
    enc_t e = {.out = &out, .max_ids = max_ids};
    /* Every token covers at most max_token_bytes of the text (unless one can absorb any
     * length): a text longer than the bound cannot fit and is not looked at. */
    if (max_ids && !t->unbounded_tokens && !t->shrinking_norm &&
        len / t->max_token_bytes > max_ids + 2) {
        tsr_set_err(err, errlen, "the text makes more than %zu tokens", max_ids);
        return -1;
    }
    segs_t raw = {0}, norm = {0};
    buf_t nb = {0}, tmp = {0};
    int rc = -1;
    e.stage = calloc(t->n_pres + 1, sizeof *e.stage);
    if (!e.stage || find_added(t, &t->raw_set, text, len, &raw)) goto oom;
    size_t tmpl_seq = 0;
    if (add_special && t->tmpl) {
        while (t->tmpl[tmpl_seq] >= 0)
            if (ids_put(&out, t->tmpl[tmpl_seq++])) goto oom;
    }
    for (size_t i = 0; i < raw.n; i++) {
        const seg_t *r = &raw.v[i];
        if (r->id >= 0) {
            if (ids_put(&out, r->id)) goto oom;
            if (max_ids && out.n > max_ids) {
                e.over = true;
                goto oom;
            }
            continue;
        }
        if (normalize(t, text + r->off, r->len, &nb, &tmp)) goto oom;
        norm.n = 0;
        if (find_added(t, &t->norm_set, nb.p, nb.len, &norm)) goto oom;
        for (size_t k = 0; k < norm.n; k++) {
            const seg_t *g = &norm.v[k];
            if (g->id >= 0 ? ids_put(&out, g->id)
                           : pretok(t, &e, 0, nb.p + g->off, g->len, r->off == 0 && g->off == 0))
                goto oom;
        }
        if (max_ids && out.n > max_ids) {
            e.over = true;
            goto oom;
        }
    }
    if (add_special && t->tmpl)
        for (size_t k = tmpl_seq + 1; k < t->n_tmpl; k++)
            if (ids_put(&out, t->tmpl[k])) goto oom;
    *ids = out.v ? out.v : malloc(sizeof(int32_t));
    if (!*ids) goto oom;
    *n = out.n;
    out.v = NULL;
    rc = 0;
    goto out;
oom:
    if (e.over) tsr_set_err(err, errlen, "the text makes more than %zu tokens", max_ids);
    else tsr_set_err(err, errlen, "out of memory");
out:
    for (size_t i = 0; e.stage && i <= t->n_pres; i++) free(e.stage[i].p);
    free(e.stage);
    free(e.sym_id);
    free(e.sym_prev);
    free(e.sym_next);
    free(e.heap);
    free(out.v);
    free(raw.v);
    free(norm.v);
    free(nb.p);
    free(tmp.p);
    return rc;
}

/* ---- decoding ------------------------------------------------------------------- */

/* A list of strings in one buffer. */
typedef struct {
    buf_t b;
    size_t *off, *len;
    size_t n, cap;
} tlist_t;

static int tl_add(tlist_t *l, const char *s, size_t n)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        size_t *o = realloc(l->off, cap * sizeof *o);
        if (!o) return -1;
        l->off = o;
        size_t *m = realloc(l->len, cap * sizeof *m);
        if (!m) return -1;
        l->len = m;
        l->cap = cap;
    }
    l->off[l->n] = l->b.len;
    l->len[l->n] = n;
    if (buf_put(&l->b, s, n)) return -1;
    l->n++;
    return 0;
}

/* Appends to the last string of l. */
static int tl_append(tlist_t *l, const char *s, size_t n)
{
    if (buf_put(&l->b, s, n)) return -1;
    l->len[l->n - 1] += n;
    return 0;
}

static void tl_clear(tlist_t *l)
{
    l->n = 0;
    l->b.len = 0;
}

static void tl_free(tlist_t *l)
{
    free(l->b.p);
    free(l->off);
    free(l->len);
}

#define TL_S(l, i) ((l)->b.p + (l)->off[i])

/* One decoder over the list in, into out. */
static int run_decoder(const dec_t *d, const tlist_t *in, tlist_t *out)
{
    tl_clear(out);
    if (d->kind == DEC_FUSE || d->kind == DEC_BYTELEVEL) {
        if (tl_add(out, "", 0)) return -1;
        if (d->kind == DEC_FUSE) return tl_append(out, in->b.p, in->b.len) ? -1 : 0;
        buf_t raw = {0};
        int rc = 0;
        for (size_t i = 0; i < in->n && !rc; i++) {
            const char *s = TL_S(in, i);
            size_t n = in->len[i], mark = raw.len;
            for (size_t k = 0; k < n && !rc;) {
                size_t cl;
                unsigned cp = get_utf8(s + k, &cl);
                if (cp >= 512 || bl_byte[cp] < 0) {  /* not byte-level: the raw text */
                    raw.len = mark;
                    rc = buf_put(&raw, s, n);
                    break;
                }
                char c = (char)bl_byte[cp];
                rc = buf_put(&raw, &c, 1);
                k += cl;
            }
        }
        buf_t fixed = {0};
        if (!rc) rc = utf8_lossy(&fixed, raw.p ? raw.p : "", raw.len);
        if (!rc) rc = tl_append(out, fixed.p ? fixed.p : "", fixed.len);
        free(raw.p);
        free(fixed.p);
        return rc;
    }
    if (d->kind == DEC_BYTEFALLBACK) {
        buf_t run = {0};
        size_t run_tokens = 0;
        int rc = 0;
        for (size_t i = 0; i <= in->n && !rc; i++) {
            uint8_t byte;
            if (i < in->n && is_byte_token(TL_S(in, i), in->len[i], &byte)) {
                rc = buf_put(&run, &byte, 1);
                run_tokens++;
                continue;
            }
            if (run_tokens) {  /* a run ends: its bytes if valid UTF-8, else U+FFFD each */
                if (utf8_check(run.p, run.len) == run.len) rc = tl_add(out, run.p, run.len);
                else
                    for (size_t k = 0; k < run_tokens && !rc; k++)
                        rc = tl_add(out, "\xEF\xBF\xBD", 3);
                run.len = 0;
                run_tokens = 0;
            }
            if (i < in->n && !rc) rc = tl_add(out, TL_S(in, i), in->len[i]);
        }
        free(run.p);
        return rc;
    }
    for (size_t i = 0; i < in->n; i++) {
        const char *s = TL_S(in, i);
        size_t n = in->len[i];
        if (tl_add(out, "", 0)) return -1;
        if (d->kind == DEC_STRIP) {
            size_t a = 0, z = n;
            for (int k = 0; k < d->start && z - a >= d->ch_len && !memcmp(s + a, d->ch, d->ch_len); k++)
                a += d->ch_len;
            for (int k = 0; k < d->stop && z - a >= d->ch_len &&
                            !memcmp(s + z - d->ch_len, d->ch, d->ch_len); k++)
                z -= d->ch_len;
            if (tl_append(out, s + a, z - a)) return -1;
            continue;
        }
        /* Replace, Metaspace: substitute a pattern. */
        const char *pat = d->kind == DEC_REPLACE ? d->a : d->ch;
        size_t plen = d->kind == DEC_REPLACE ? d->alen : d->ch_len;
        const char *with = d->kind == DEC_REPLACE ? d->b : " ";
        size_t wlen = d->kind == DEC_REPLACE ? d->blen : 1;
        if (d->kind == DEC_METASPACE && i == 0 && d->scheme != SCHEME_NEVER) wlen = 0;
        for (size_t k = 0; k < n;) {
            if (n - k >= plen && !memcmp(s + k, pat, plen)) {
                if (tl_append(out, with, wlen)) return -1;
                k += plen;
            } else {
                if (tl_append(out, s + k, 1)) return -1;
                k++;
            }
        }
    }
    return 0;
}

static bool token_kept(const tsr_tokenizer_t *t, int32_t id, bool skip_special)
{
    return id >= 0 && id < t->n_ids && t->text[id] && !(skip_special && (t->flags[id] & F_SPECIAL));
}

/* Decodes ids (already filtered) into out (cleared first). */
static int decode_into(const tsr_tokenizer_t *t, const int32_t *ids, size_t n, buf_t *out)
{
    tlist_t a = {0}, b = {0};
    int rc = -1;
    for (size_t i = 0; i < n; i++)
        if (tl_add(&a, t->text[ids[i]], t->tlen[ids[i]])) goto out;
    for (size_t k = 0; k < t->n_decs; k++) {
        if (run_decoder(&t->decs[k], &a, &b)) goto out;
        tlist_t swap = a;
        a = b;
        b = swap;
    }
    out->len = 0;
    if (buf_put(out, "", 0)) goto out;
    for (size_t i = 0; i < a.n; i++)
        if (buf_put(out, TL_S(&a, i), a.len[i])) goto out;
    rc = 0;
out:
    tl_free(&a);
    tl_free(&b);
    return rc;
}

char *tsr_tok_decode(const tsr_tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special,
                     size_t *len)
{
    int32_t *kept = malloc((n ? n : 1) * sizeof *kept);
    buf_t out = {0};
    if (!kept) return NULL;
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (token_kept(t, ids[i], skip_special)) kept[m++] = ids[i];
    int rc = decode_into(t, kept, m, &out);
    free(kept);
    if (rc) {
        free(out.p);
        return NULL;
    }
    if (len) *len = out.len;
    return out.p;
}

struct tsr_detok {
    const tsr_tokenizer_t *tok;
    bool skip_special;
    int32_t *win;                    /* DETOK_MAX_WINDOW + 1 ids */
    size_t n;                        /* ids in the window */
    size_t next_try;                 /* a long window that ends incomplete is decoded again
                                        only when it has doubled: linear, not quadratic */
    buf_t prefix;                    /* decode of win[0] when emitted_one, else empty */
    bool has_prefix;
    buf_t full, emit;
};

tsr_detok_t *tsr_detok_new(const tsr_tokenizer_t *tok, bool skip_special)
{
    tsr_detok_t *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->win = malloc((DETOK_MAX_WINDOW + 1) * sizeof *d->win);
    if (!d->win) {
        free(d);
        return NULL;
    }
    d->tok = tok;
    d->skip_special = skip_special;
    return d;
}

void tsr_detok_destroy(tsr_detok_t **self_p)
{
    if (!self_p || !*self_p) return;
    tsr_detok_t *d = *self_p;
    free(d->win);
    free(d->prefix.p);
    free(d->full.p);
    free(d->emit.p);
    free(d);
    *self_p = NULL;
}

static bool ends_incomplete(const buf_t *b)
{
    return b->len >= 3 && !memcmp(b->p + b->len - 3, "\xEF\xBF\xBD", 3);
}

/* Emits what the window adds to its prefix; keeps the window's last id as the next
 * prefix.  force: emit even when the text ends incomplete. */
static int detok_emit(tsr_detok_t *d, bool force, const char **text, size_t *len)
{
    d->emit.len = 0;
    if (buf_put(&d->emit, "", 0)) return -1;
    *text = d->emit.p;
    *len = 0;
    if (d->n == 0 || (d->has_prefix && d->n == 1)) return 0;
    if (!force && d->n < d->next_try) return 0;
    if (decode_into(d->tok, d->win, d->n, &d->full)) return -1;
    if (!force && ends_incomplete(&d->full)) {
        if (d->n > 16) d->next_try = 2 * d->n;
        return 0;
    }
    d->next_try = 0;
    size_t p = d->has_prefix ? d->prefix.len : 0;
    if (p > d->full.len || memcmp(d->full.p, d->prefix.p ? d->prefix.p : "", p) != 0)
        p = 0;  /* cannot happen with the supported decoders; never drop text */
    if (buf_put(&d->emit, d->full.p + p, d->full.len - p)) return -1;
    d->win[0] = d->win[d->n - 1];
    d->n = 1;
    if (decode_into(d->tok, d->win, 1, &d->prefix)) return -1;
    d->has_prefix = true;
    *text = d->emit.p;
    *len = d->emit.len;
    return 0;
}

int tsr_detok_push(tsr_detok_t *d, int32_t id, const char **text, size_t *len)
{
    d->emit.len = 0;
    if (buf_put(&d->emit, "", 0)) return -1;
    *text = d->emit.p;
    *len = 0;
    if (!token_kept(d->tok, id, d->skip_special)) return 0;
    d->win[d->n++] = id;
    /* A byte-fallback run decodes as a whole: wait for its end. */
    bool in_run = d->tok->dec_bytefallback && (d->tok->flags[id] & F_BYTE);
    if (in_run && d->n < DETOK_MAX_WINDOW) return 0;
    int rc = detok_emit(d, d->n >= DETOK_MAX_WINDOW, text, len);
    if (rc || d->n >= DETOK_MAX_WINDOW) {  /* out of memory: start over rather than overrun */
        d->n = 0;
        d->has_prefix = false;
        d->next_try = 0;
    }
    return rc;
}

int tsr_detok_flush(tsr_detok_t *d, const char **text, size_t *len)
{
    int rc = detok_emit(d, true, text, len);
    d->n = 0;
    d->has_prefix = false;
    d->next_try = 0;
    return rc;
}

/* ---- accessors ---------------------------------------------------------------------- */

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
