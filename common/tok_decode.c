/* tok_decode.c: token ids to text, all at once or streaming.
 *
 * Decoding runs the decoder chain over token strings.  The streaming decoder decodes a
 * short window of recent tokens and emits what the newest one adds, holding it back
 * while it ends in an incomplete character (U+FFFD) or, for byte-fallback tokenizers,
 * while a run of <0xNN> byte tokens may still go on: such a run decodes as a whole.
 *
 * The text is what the ids add to the text before them, never what they read as alone:
 * a SentencePiece decoder drops the word space of the first token it sees (Metaspace,
 * Strip), so a completion decoded on its own loses the space between the prompt's last
 * word and its first.  A decoder primed with the prompt (tsr_detok_prime) starts with the
 * prompt's last tokens in its window, emitted already. */
#include "common/tok_decode.h"

#include "common/tok_tables.h"
#include "common/utf8.h"

/* Kept tokens of a prompt a primed decoder starts from (more when they end in a
 * byte-fallback run, which decodes as a whole): enough for any decoder here, whose
 * output depends on the token before and on the characters a few bytes hold. */
#define PRIME_TOKENS 8

/* Tokens the streaming decoder holds at most.  A character split across tokens, or a
 * byte-fallback run, is held until it is complete; past this many tokens (only garbage
 * gets there: 4,096 tokens that never complete a character) the text is emitted as it
 * is, and may then differ from the whole decode. */
#define DETOK_MAX_WINDOW 4096

/* ---- the decoder chain --------------------------------------------------------- */

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
                unsigned cp = tsr_utf8_get(s + k, &cl);
                if (cp >= 512 || tsr_tok_bl_byte[cp] < 0) {  /* not byte-level: the raw text */
                    raw.len = mark;
                    rc = buf_put(&raw, s, n);
                    break;
                }
                char c = (char)tsr_tok_bl_byte[cp];
                rc = buf_put(&raw, &c, 1);
                k += cl;
            }
        }
        buf_t fixed = {0};
        if (!rc) rc = tsr_utf8_lossy(&fixed, raw.p ? raw.p : "", raw.len);
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
                if (tsr_utf8_check(run.p, run.len) == run.len) rc = tl_add(out, run.p, run.len);
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

/* ---- streaming ---------------------------------------------------------------- */

struct tsr_detok {
    const tsr_tokenizer_t *tok;
    bool skip_special;
    int32_t *win;                    /* DETOK_MAX_WINDOW + 1 ids */
    size_t n;                        /* ids in the window */
    size_t n_prefix;                 /* the first of them, whose text is out already */
    size_t next_try;                 /* a long window that ends incomplete is decoded again
                                        only when it has doubled: linear, not quadratic */
    buf_t prefix;                    /* decode of win[0..n_prefix) */
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

/* Forgets the window: the next id starts a text. */
static void detok_reset(tsr_detok_t *d)
{
    d->n = d->n_prefix = 0;
    d->prefix.len = 0;
    d->next_try = 0;
}

/* Emits what the window adds to its prefix; keeps the window's last id as the next
 * prefix.  force: emit even when the text ends incomplete. */
static int detok_emit(tsr_detok_t *d, bool force, const char **text, size_t *len)
{
    d->emit.len = 0;
    if (buf_put(&d->emit, "", 0)) return -1;
    *text = d->emit.p;
    *len = 0;
    if (d->n == d->n_prefix) return 0;
    if (!force && d->n < d->next_try) return 0;
    if (decode_into(d->tok, d->win, d->n, &d->full)) return -1;
    if (!force && ends_incomplete(&d->full)) {
        if (d->n > 16) d->next_try = 2 * d->n;
        return 0;
    }
    d->next_try = 0;
    size_t p = d->prefix.len;
    if (p <= d->full.len && memcmp(d->full.p, d->prefix.p ? d->prefix.p : "", p) == 0) {
        if (buf_put(&d->emit, d->full.p + p, d->full.len - p)) return -1;
    } else {
        /* The prefix reads differently now: a prompt's byte-fallback run that the new
         * ids go on into an invalid one (or a window cut at its limit).  The new ids'
         * own text then, never the prompt's again. */
        if (decode_into(d->tok, d->win + d->n_prefix, d->n - d->n_prefix, &d->full) ||
            buf_put(&d->emit, d->full.p, d->full.len))
            return -1;
    }
    d->win[0] = d->win[d->n - 1];
    d->n = d->n_prefix = 1;
    if (decode_into(d->tok, d->win, 1, &d->prefix)) return -1;
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
    if (rc || d->n >= DETOK_MAX_WINDOW) detok_reset(d);  /* out of memory: start over
                                                            rather than overrun */
    return rc;
}

int tsr_detok_flush(tsr_detok_t *d, const char **text, size_t *len)
{
    int rc = detok_emit(d, true, text, len);
    detok_reset(d);
    return rc;
}

int tsr_detok_prime(tsr_detok_t *d, const int32_t *context, size_t n)
{
    /* From PRIME_TOKENS kept ids before the end, or further back to the token before a
     * byte-fallback run they are in, as if the whole prompt had been streamed. */
    size_t s = n, kept = 0;
    while (s > 0 && kept < DETOK_MAX_WINDOW / 2) {
        int32_t id = context[--s];
        if (!token_kept(d->tok, id, d->skip_special)) continue;
        kept++;
        if (kept >= PRIME_TOKENS && !(d->tok->dec_bytefallback && (d->tok->flags[id] & F_BYTE)))
            break;
    }
    detok_reset(d);
    const char *text;
    size_t len;
    for (size_t i = s; i < n; i++)
        if (tsr_detok_push(d, context[i], &text, &len)) return -1;
    /* What is still held and reads complete (a byte run that may have gone on) is the
     * prompt's text too; a character the prompt leaves incomplete stays held, and comes
     * whole with the first ids that complete it. */
    if (d->n > d->n_prefix) {
        if (decode_into(d->tok, d->win, d->n, &d->full)) return -1;
        if (!ends_incomplete(&d->full)) {
            d->prefix.len = 0;
            if (buf_put(&d->prefix, d->full.p, d->full.len)) return -1;
            d->n_prefix = d->n;
        }
    }
    return 0;
}

char *tsr_tok_decode_after(const tsr_tokenizer_t *t, const int32_t *context, size_t n_context,
                           const int32_t *ids, size_t n, bool skip_special, size_t *len)
{
    tsr_detok_t *d = tsr_detok_new(t, skip_special);
    buf_t out = {0};
    int rc = d && !buf_put(&out, "", 0) ? tsr_detok_prime(d, context, n_context) : -1;
    for (size_t i = 0; i <= n && !rc; i++) {
        const char *piece;
        size_t plen;
        rc = i < n ? tsr_detok_push(d, ids[i], &piece, &plen) : tsr_detok_flush(d, &piece, &plen);
        if (!rc) rc = buf_put(&out, piece, plen);
    }
    tsr_detok_destroy(&d);
    if (rc) {
        free(out.p);
        return NULL;
    }
    if (len) *len = out.len;
    return out.p;
}

