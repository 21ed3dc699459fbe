/* tok_tables.h: a loaded tokenizer's layout, private to the tokenizer's files.
 *
 * tokenizer.c builds these tables from tokenizer.json (this is its private header, as
 * tokenizer.h is its public one); tok_encode.c and tok_decode.c only read them (the
 * word cache aside, which is behind the lock).  The lookups are inline here because
 * the BPE loop calls them per symbol pair. */
#ifndef TSR_TOK_TABLES_H
#define TSR_TOK_TABLES_H

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <ctype.h>
#include <pcre2.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/strbuf.h"
#include "common/tokenizer.h"

#define CACHE_SLOTS (1u << 16)       /* word cache: hash slots */

enum { F_SPECIAL = 1, F_ADDED = 2, F_BYTE = 4 };
enum { SCHEME_ALWAYS, SCHEME_FIRST, SCHEME_NEVER };

typedef tsr_sb_t buf_t;

/* Appends; -1 once the buffer ran out of memory (the callers' error flow). */
static inline int buf_put(buf_t *b, const void *s, size_t n)
{
    tsr_sb_putn(b, s, n);
    return b->oom ? -1 : 0;
}

typedef struct {
    int32_t *v;
    size_t n, cap;
} ids_t;

static inline int ids_put(ids_t *a, int32_t id)
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
    char where[96];                  /* split: the pattern's place in the file, for errors */
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

/* GPT-2's byte-level alphabet: every byte as a printable code point.  Filled once, by
 * the first load, before any tokenizer exists to encode or decode with. */
extern unsigned tsr_tok_bl_cp[256];  /* byte -> code point */
extern int tsr_tok_bl_byte[512];     /* code point -> byte, -1 */

/* Runs the normalizers over s[0..n) into out (cleared first); tmp is scratch.  Encoding
 * normalizes each piece of text with it, and the loader each added token whose
 * `normalized` is true, so that both meet in the same form.  -1 when out of memory. */
int tsr_tok_normalize(const tsr_tokenizer_t *t, const char *s, size_t n, buf_t *out,
                      buf_t *tmp);

/* ---- lookups ------------------------------------------------------------------ */

static inline uint64_t hash_bytes(const void *s, size_t n)
{
    const unsigned char *p = s;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static inline uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

static inline int32_t vocab_find(const tsr_tokenizer_t *t, const char *s, size_t n)
{
    for (size_t i = hash_bytes(s, n) & t->vmask;; i = (i + 1) & t->vmask) {
        uint32_t v = t->vmap[i];
        if (!v) return -1;
        int32_t id = (int32_t)v - 1;
        if (t->tlen[id] == n && memcmp(t->text[id], s, n) == 0) return id;
    }
}

static inline const added_t *added_find(const tsr_tokenizer_t *t, const char *s, size_t n)
{
    if (!t->amap) return NULL;
    for (size_t i = hash_bytes(s, n) & t->amask;; i = (i + 1) & t->amask) {
        uint32_t v = t->amap[i];
        if (!v) return NULL;
        const added_t *a = &t->added[v - 1];
        if (a->len == n && memcmp(a->content, s, n) == 0) return a;
    }
}

static inline bool merge_find(const tsr_tokenizer_t *t, int32_t a, int32_t b,
                              uint32_t *rank, int32_t *new_id)
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

static inline uint32_t trie_child(const added_set_t *set, uint32_t node, uint8_t byte)
{
    for (uint32_t c = set->v[node].child; c; c = set->v[c].sibling)
        if (set->v[c].byte == byte) return c;
    return 0;
}

/* The added token with the longest pattern at s[0..n), or NULL. */
static inline const added_t *trie_longest(const tsr_tokenizer_t *t,
                                          const added_set_t *set, const char *s, size_t n)
{
    const added_t *best = NULL;
    uint32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        if (!(node = trie_child(set, node, (uint8_t)s[i]))) break;
        if (set->v[node].token >= 0) best = &t->added[set->v[node].token];
    }
    return best;
}

/* "<0xNN>" (hex digits of either case), a byte-fallback token: its byte in *byte. */
static inline bool is_byte_token(const char *s, size_t n, uint8_t *byte)
{
    if (n != 6 || memcmp(s, "<0x", 3) || s[5] != '>' || !isxdigit((unsigned char)s[3]) ||
        !isxdigit((unsigned char)s[4]))
        return false;
    char hex[3] = {s[3], s[4], 0};
    *byte = (uint8_t)strtoul(hex, NULL, 16);
    return true;
}

#endif
