/* tok_encode.c: text to token ids, the stages in the reference implementation's order.
 *
 *   1. added tokens whose `normalized` is false are cut out of the raw text;
 *   2. each remaining piece is normalized, and added tokens whose `normalized` is true
 *      are cut out of it (matched in their normalized form);
 *   3. each remaining piece is pre-tokenized into words;
 *   4. each word goes through the BPE model (a word cache saves most of this work);
 *   5. the post-processor's template adds its special tokens.
 * Added tokens are found leftmost-longest, a match consuming its text even when the
 * single_word rule then discards it. */
#include "common/tok_encode.h"

#include "common/tok_tables.h"
#include "common/utf8.h"
#include "common/util.h"

/* The word cache's bounds (CACHE_SLOTS, its slots, is in tok_tables.h). */
#define CACHE_BYTES (4u << 20)       /* bytes of words kept */
#define CACHE_IDS (1u << 20)         /* ids kept */
#define CACHE_MAX_WORD 256           /* longer words are not cached */
#define CACHE_MAX_PROBE 16           /* slots looked at per lookup: a word beyond is uncached */

/* The pattern-matching budget of one encode call, in PCRE2's match-limit units (about
 * one per backtracking step; JIT or not, a unit costs a few nanoseconds to a few tens).
 * PCRE2's own limit holds per match only, so a pattern that backtracks exponentially
 * within it, over many short runs, once cost 90 times a single run.  Each match is
 * first allowed MATCH_FIRST units, then twice as many until it ends or the budget is
 * spent; the units it was allowed are charged, so what a text may cost is bounded by
 * its length (the retries at most double it).  The GPT-2 and Llama 3 patterns need 1 to
 * 16 units a match on the test corpus (64 once), and are charged 1 to 16 a byte on any
 * text (16 when every match is one byte, 1.3 on a run of 100,000 spaces, whose one match
 * is allowed what is left); 64 a byte for each Split stage (each matches over the whole
 * text again) and a floor of 2^20 leave four times that.
 * What the units do not count, the characters a repeat scans and a backreference
 * compares, the loader bounds: it refuses backreferences and unbounded repeats inside
 * lookarounds (tokenizer.c). */
#define MATCH_FLOOR (1u << 20)
#define MATCH_PER_BYTE 64u
#define MATCH_FIRST 16u

/* ---- the BPE model ------------------------------------------------------------ */

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
    pcre2_match_context *mctx;       /* the per-match limit, within ... */
    uint64_t match_left;             /* ... what is left of the budget */
    const pre_t *spent;              /* the Split pattern that went past it */
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
        size_t cl = tsr_utf8_char_len(w + i);
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

/* ---- pre-tokenizers ----------------------------------------------------------- */

static int pretok(const tsr_tokenizer_t *t, enc_t *e, size_t stage, const char *s, size_t n,
                  bool first);

/* One pcre2_match from `at` within what is left of the encode call's budget: the
 * match's result, or PCRE2_ERROR_MATCHLIMIT with e->spent set once the budget is gone. */
static int match_budgeted(enc_t *e, const pre_t *p, pcre2_match_data *md, const char *s,
                          size_t n, size_t at)
{
    for (uint64_t allow = MATCH_FIRST;; allow *= 2) {
        uint64_t lim = allow < e->match_left ? allow : e->match_left;
        pcre2_set_match_limit(e->mctx, (uint32_t)(lim < UINT32_MAX ? lim : UINT32_MAX));
        int m = pcre2_match(p->re, (PCRE2_SPTR)s, n, at, PCRE2_NO_UTF_CHECK, md, e->mctx);
        if (m == PCRE2_ERROR_JIT_STACKLIMIT)
            m = pcre2_match(p->re, (PCRE2_SPTR)s, n, at, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md,
                            e->mctx);
        if (m != PCRE2_ERROR_MATCHLIMIT || lim == e->match_left) {
            e->match_left -= lim;
            if (m == PCRE2_ERROR_MATCHLIMIT) e->spent = p;
            return m;
        }
    }
}

/* Runs the stage's pattern over s, handing every match and every gap between matches to
 * the next stage. */
static int split_re(const tsr_tokenizer_t *t, enc_t *e, size_t stage, const char *s, size_t n,
                    bool first)
{
    const pre_t *p = &t->pres[stage];
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(p->re, NULL);
    if (!md) return -1;
    int rc = 0;
    size_t last = 0, at = 0;
    /* at == n is not tried: a match there would be empty, which makes no piece */
    while (at < n && !rc) {
        int m = match_budgeted(e, p, md, s, n, at);
        if (e->spent) rc = -1;
        if (m < 0) break;  /* no more matches (or another PCRE2 limit: the rest is one piece) */
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) {  /* empty: no piece; step one character */
            at = ms < n ? ms + tsr_utf8_char_len(s + ms) : n + 1;
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
    if (p->kind == PRE_SPLIT) return split_re(t, e, stage, s, n, first);
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
        if (buf_put(b, u, tsr_utf8_put(u, tsr_tok_bl_cp[(unsigned char)s[i]]))) return -1;
    }
    return pretok(t, e, stage + 1, b->p, b->len, first);
}

/* ---- added tokens ------------------------------------------------------------- */

/* Unicode White_Space, the `\s` of the reference's strip rules. */
static bool is_space_cp(unsigned c)
{
    return (c >= 9 && c <= 13) || c == 32 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
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
            bool word_after = stop < n && word_char_at(t, s, stop, tsr_utf8_char_len(s + stop));
            if (word_before || word_after) continue;
        }
        if (hit->lstrip) {
            size_t b = start;
            while (b > start_offset) {
                size_t c = b - 1;
                while (c > 0 && ((unsigned char)s[c] & 0xC0) == 0x80) c--;
                size_t cl;
                if (!is_space_cp(tsr_utf8_get(s + c, &cl))) break;
                b = c;
            }
            start = b;
        }
        if (hit->rstrip) {
            while (stop < n) {
                size_t cl;
                if (!is_space_cp(tsr_utf8_get(s + stop, &cl))) break;
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

/* ---- the pipeline ------------------------------------------------------------- */

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
    size_t bad = tsr_utf8_check(text, len);
    if (bad < len) {
        tsr_set_err(err, errlen, "the text is not valid UTF-8 at byte %zu (0x%02X)", bad,
                    (unsigned char)text[bad]);
        return -1;
    }
    ids_t out = {0};
    /* every Split stage matches over the whole text again: each gets the per-byte share */
    uint64_t splits = 0;
    for (size_t k = 0; k < t->n_pres; k++) splits += t->pres[k].kind == PRE_SPLIT;
    uint64_t budget = MATCH_FLOOR + (uint64_t)MATCH_PER_BYTE * len * (splits ? splits : 1);
    enc_t e = {.out = &out, .max_ids = max_ids, .match_left = budget};
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
    e.mctx = pcre2_match_context_create(NULL);
    if (!e.stage || !e.mctx || find_added(t, &t->raw_set, text, len, &raw)) goto oom;
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
        if (tsr_tok_normalize(t, text + r->off, r->len, &nb, &tmp)) goto oom;
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
    if (e.over)
        tsr_set_err(err, errlen, "the text makes more than %zu tokens", max_ids);
    else if (e.spent)
        tsr_set_err(err, errlen,
                    "the tokenizer's pattern %s needs more matching work for these %zu bytes "
                    "than an encode may take (%llu units; a pattern that backtracks "
                    "heavily on this text)",
                    e.spent->where, len,
                    (unsigned long long)budget);
    else
        tsr_set_err(err, errlen, "out of memory");
out:
    for (size_t i = 0; e.stage && i <= t->n_pres; i++) free(e.stage[i].p);
    free(e.stage);
    pcre2_match_context_free(e.mctx);
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
