/* replica.c: the step loop of every rank, and the leader's scheduler
 * state.  Reads top to bottom:
 *   control messages    what travels on the control channel
 *   the leader          requests in, steps out, tokens back
 *   the other ranks     steps in, tensors through, tokens out */
#include "worker/replica.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/prefix.h"
#include "worker/kvpool.h"
#include "worker/replica_ctl.h"
#include "worker/scheduler.h"

#define BACK_MAGIC 0x5453544bu  /* "TSTK" */

/* ---- control messages (their layout: worker/replica_ctl.h) ------------------------- */

/* Sized for the largest step the leader can send. */
typedef struct {
    tsr_ctl_hdr_t hdr;
    tsr_ctl_entry_t *entries;
    uint64_t *keys;
    int32_t *frees, *tokens;
    uint8_t *payload;
    size_t payload_cap;
    tsr_entry_t *eng_entries;
    int32_t *sampled, *back;
} step_buf_t;

static size_t payload_bytes(const tsr_ctl_hdr_t *h)
{
    return (size_t)h->n_entries * sizeof(tsr_ctl_entry_t) + (size_t)h->n_keys * sizeof(uint64_t) +
           ((size_t)h->n_free + (size_t)h->n_tokens) * sizeof(int32_t);
}

/* The most block keys one step carries: every entry attaching a whole
 * sequence's blocks, and the blocks its rows fill. */
static int max_keys(const tsr_piece_spec_t *s)
{
    return s->max_seqs * (tsr_kv_blocks_for(s->max_seq_len) + 1) + s->max_tokens / TSR_KV_BLOCK;
}

static int step_buf_init(step_buf_t *b, const tsr_piece_spec_t *s)
{
    memset(b, 0, sizeof *b);
    b->payload_cap = (size_t)s->max_seqs * sizeof(tsr_ctl_entry_t) +
                     (size_t)max_keys(s) * sizeof(uint64_t) +
                     ((size_t)s->max_seqs + (size_t)s->max_tokens) * sizeof(int32_t);
    b->payload = malloc(b->payload_cap);
    b->eng_entries = calloc((size_t)s->max_seqs, sizeof *b->eng_entries);
    b->sampled = calloc((size_t)s->max_seqs, sizeof *b->sampled);
    b->back = calloc((size_t)s->max_seqs + 4, sizeof *b->back);
    b->entries = (tsr_ctl_entry_t *)b->payload;
    return b->payload && b->eng_entries && b->sampled && b->back ? 0 : -1;
}

static void step_buf_free(step_buf_t *b)
{
    free(b->payload);
    free(b->eng_entries);
    free(b->sampled);
    free(b->back);
}

/* Points entries/frees/tokens into the payload for the header's counts. */
static void step_buf_layout(step_buf_t *b)
{
    b->entries = (tsr_ctl_entry_t *)b->payload;
    b->keys = (uint64_t *)(b->payload + (size_t)b->hdr.n_entries * sizeof(tsr_ctl_entry_t));
    b->frees = (int32_t *)(b->keys + b->hdr.n_keys);
    b->tokens = b->frees + b->hdr.n_free;
}

static tsr_buf_t payload_buf(step_buf_t *b)
{
    return tsr_host_buf(b->payload, payload_bytes(&b->hdr) / sizeof(int32_t), TSR_DT_I32);
}

static tsr_buf_t hdr_buf(tsr_ctl_hdr_t *h)
{
    return tsr_host_buf(h, sizeof *h / sizeof(int32_t), TSR_DT_I32);
}

/* A step from the leader is checked before its payload is read: the
 * payload's size comes from it. */
static int hdr_ok(const tsr_replica_rank_t *r, const tsr_ctl_hdr_t *h, char *err, size_t errlen)
{
    if (h->magic == TSR_CTL_MAGIC && h->op <= TSR_CTL_STOP && h->n_entries >= 0 &&
        h->n_entries <= r->spec.max_seqs && h->n_free >= 0 && h->n_free <= r->spec.max_seqs &&
        h->n_tokens >= 0 && h->n_tokens <= r->spec.max_tokens && h->n_keys >= 0 &&
        h->n_keys <= max_keys(&r->spec))
        return 0;
    snprintf(err, errlen,
             "malformed step from the leader: magic 0x%08x (expected 0x%08x), op %u, %d "
             "entries, %d frees, %d tokens, %d keys (limits %d, %d, %d, %d)",
             h->magic, TSR_CTL_MAGIC, h->op, h->n_entries, h->n_free, h->n_tokens, h->n_keys,
             r->spec.max_seqs, r->spec.max_seqs, r->spec.max_tokens, max_keys(&r->spec));
    return -1;
}

const char *tsr_finish_reason(const tsr_model_info_t *m, int32_t token, int index,
                              int prompt_len, int max_tokens, int max_seq_len)
{
    for (int i = 0; i < m->n_eos; i++)
        if (token == m->eos_ids[i]) return "eos";
    if (index + 1 >= max_tokens) return "max_tokens";
    if (prompt_len + index >= max_seq_len) return "max_seq_len";  /* no room for the next */
    return NULL;
}

static int is_first(const tsr_replica_rank_t *r) { return r->spec.stage == 0; }
static int is_last(const tsr_replica_rank_t *r) { return r->spec.stage == r->spec.pp_size - 1; }
static int is_leader(const tsr_replica_rank_t *r) { return is_first(r) && r->spec.tp_rank == 0; }
static int last_rank(const tsr_replica_rank_t *r) { return (r->spec.pp_size - 1) * r->spec.tp_size; }
static int n_ranks(const tsr_replica_rank_t *r) { return r->spec.pp_size * r->spec.tp_size; }
static int hidden_size(const tsr_replica_rank_t *r) { return r->eng_ops->model(r->eng)->hidden_size; }

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A pipeline link's failure, told as the link's: its own message numbers
 * the pair's ranks (0 the earlier stage, 1 the later), which read like TP
 * ranks without it. */
static int link_failed(char *err, size_t errlen, const char *dir, int stage)
{
    char inner[512];
    snprintf(inner, sizeof inner, "%s", err);
    snprintf(err, errlen, "the pipeline link %s stage %d (its rank 0 is the earlier stage): %s",
             dir, stage, inner);
    return -1;
}

/* Runs the step in b on this rank: frees, the hidden state in, the engine,
 * the hidden state out or (last stage, tp rank 0) the tokens reported and,
 * with a pipeline, sent back to the leader. */
static tsr_kvpool_t *pool_of(const tsr_replica_rank_t *r)
{
    return r->eng_ops->kvpool ? r->eng_ops->kvpool(r->eng) : NULL;
}

/* The step's keys must be what its entries say, and a rank without a pool
 * cannot follow a leader that caches. */
static int keys_ok(const tsr_replica_rank_t *r, const step_buf_t *b, char *err, size_t errlen)
{
    long want = 0;
    for (int i = 0; i < b->hdr.n_entries; i++) {
        const tsr_ctl_entry_t *c = &b->entries[i];
        int filled = c->pos >= 0 && c->n >= 0 ? (c->pos + c->n) / TSR_KV_BLOCK - c->pos / TSR_KV_BLOCK : 0;
        if (c->n_attach < 0 || c->n_publish < 0 || c->n_publish > filled ||
            (c->n_attach > 0 && c->pos != c->n_attach * TSR_KV_BLOCK)) {
            snprintf(err, errlen,
                     "malformed step from the leader: entry %d attaches %d and publishes %d "
                     "block(s) for positions [%d,%d)",
                     i, c->n_attach, c->n_publish, c->pos, c->pos + c->n);
            return -1;
        }
        want += (long)c->n_attach + c->n_publish;
    }
    if (want != b->hdr.n_keys || (want > 0 && !pool_of(r))) {
        snprintf(err, errlen, "malformed step from the leader: %d keys for entries that take %ld%s",
                 b->hdr.n_keys, want, pool_of(r) ? "" : " (this engine keeps no prefix cache)");
        return -1;
    }
    return 0;
}

/* Each admitted entry's cached blocks, before the step. */
static int attach_cached(tsr_replica_rank_t *r, step_buf_t *b, char *err, size_t errlen)
{
    const uint64_t *k = b->keys;
    for (int i = 0; i < b->hdr.n_entries; i++) {
        const tsr_ctl_entry_t *c = &b->entries[i];
        if (c->n_attach > 0 &&
            tsr_kvpool_attach(pool_of(r), c->slot, k, c->n_attach) < 0) {
            snprintf(err, errlen,
                     "slot %d cannot take the %d cached block(s) the leader named: this rank's "
                     "prefix cache differs from the leader's, or the slot is in use",
                     c->slot, c->n_attach);
            return -1;
        }
        k += c->n_attach + c->n_publish;
    }
    return 0;
}

/* The blocks the step filled, under the leader's keys, after it. */
static void publish_filled(tsr_replica_rank_t *r, step_buf_t *b)
{
    const uint64_t *k = b->keys;
    for (int i = 0; i < b->hdr.n_entries; i++) {
        const tsr_ctl_entry_t *c = &b->entries[i];
        k += c->n_attach;
        for (int j = 0; j < c->n_publish; j++)
            tsr_kvpool_publish(pool_of(r), c->slot, c->pos / TSR_KV_BLOCK + j, k[j]);
        k += c->n_publish;
    }
}

static int run_step(tsr_replica_rank_t *r, const tsr_replica_io_t *io, step_buf_t *b, char *err,
                    size_t errlen)
{
    const tsr_model_info_t *m = r->eng_ops->model(r->eng);
    const size_t rows = (size_t)b->hdr.n_tokens * hidden_size(r);
    for (int i = 0; i < b->hdr.n_free; i++) r->eng_ops->release(r->eng, b->frees[i]);
    if (b->hdr.n_entries == 0) return 0;
    if (keys_ok(r, b, err, errlen) < 0 || attach_cached(r, b, err, errlen) < 0) return -1;
    for (int i = 0; i < b->hdr.n_entries; i++) {
        const tsr_ctl_entry_t *c = &b->entries[i];
        b->eng_entries[i] = (tsr_entry_t){c->slot, c->pos, c->n, c->sample, c->temperature,
                                          c->top_p, c->seed};
    }
    tsr_batch_t batch = {b->eng_entries, b->hdr.n_entries, b->tokens, b->hdr.n_tokens};
    if (!is_first(r) &&
        tsr_coll_recv(r->ops, r->prev, 0, tsr_buf_head(r->eng_ops->hidden(r->eng, 0), rows),
                      r->token_timeout_ms, err, errlen) < 0)
        return link_failed(err, errlen, "from", r->spec.stage - 1);
    if (r->eng_ops->step(r->eng, &batch, b->sampled, err, errlen) < 0) return -1;
    if (b->hdr.n_keys > 0) publish_filled(r, b);
    if (r->steps && !r->eng_ops->set_progress) __atomic_fetch_add(r->steps, 1, __ATOMIC_RELAXED);
    if (!is_last(r))
        return tsr_coll_send(r->ops, r->next, 1, tsr_buf_head(r->eng_ops->hidden(r->eng, 1), rows),
                             r->token_timeout_ms, err, errlen) < 0
                   ? link_failed(err, errlen, "to", r->spec.stage + 1)
                   : 0;
    if (r->spec.tp_rank != 0) return 0;
    int ns = 0;
    for (int i = 0; i < b->hdr.n_entries; i++) {
        const tsr_ctl_entry_t *c = &b->entries[i];
        if (!c->sample) continue;
        int32_t tok = b->sampled[ns++];
        const char *fin = tsr_finish_reason(m, tok, c->index, c->prompt_len, c->max_tokens,
                                            r->spec.max_seq_len);
        if (c->index == 0 && io->cached) io->cached(io->arg, c->req, c->cached);
        io->emit(io->arg, c->req, tok, c->index, fin != NULL, 0, fin, NULL);
    }
    if (ns > 0 && io->flush) io->flush(io->arg);
    if (is_first(r) || ns == 0) return 0;   /* the leader has them already, or expects none */
    b->back[0] = (int32_t)BACK_MAGIC;
    b->back[1] = (int32_t)(uint32_t)b->hdr.step;
    b->back[2] = ns;
    memcpy(b->back + 3, b->sampled, (size_t)ns * sizeof *b->sampled);
    return tsr_coll_send(r->ctl_ops, r->ctl, 0, tsr_host_buf(b->back, 3 + (size_t)ns, TSR_DT_I32),
                         r->token_timeout_ms, err, errlen);
}

/* ---- the leader --------------------------------------------------------------------- */

typedef struct {
    tsr_request_t q;            /* with the prefix cache, q.prompt has room for every
                                   position fed: the prompt, then the tokens fed back */
    int64_t deadline;           /* monotonic ms; 0: none */
    int32_t last_token;
    bool done;
    char why[160];              /* cancelled: the reason */
    uint64_t *keys;             /* prefix cache: the keys of its full blocks so far */
    int n_keys;
    int attach;                 /* waiting: cached blocks it would start with */
    int cached;                 /* prompt positions it took from the cache */
} lseq_t;

typedef struct {
    uint64_t step;
    int n;
    uint64_t *req;              /* [max_seqs] */
} flight_t;

typedef struct {
    tsr_sched_cfg_t cfg;
    tsr_sched_seq_t *s;         /* scheduler view, arrival order */
    lseq_t *l;                  /* the rest, same index */
    int n, cap;
    bool *slot_used;
    int32_t *frees;
    int n_frees;
    tsr_sched_entry_t *plan;
    flight_t *flight;           /* ring of pp */
    int fl_head, fl_count;
    uint64_t next_step;
    tsr_kvpool_t *pool;         /* the leader's own: the cache every rank holds too */
    const uint8_t *secret;      /* the prefix cache's (NULL: off) */
    uint64_t prompt_cached, prompt_computed, preemptions;
    uint64_t admissions;        /* sequences admitted so far (tsr_sched_seq_t.admitted) */
} leader_t;

static int find_seq(const leader_t *L, uint64_t req)
{
    for (int i = 0; i < L->n; i++)
        if (L->l[i].q.request_id == req) return i;
    return -1;
}

/* Sequence i gives its slot back: the other ranks free it at the next step; the
 * leader's own pool at once (nothing touches it in between, so it is the same), so
 * the scheduler counts those blocks as free now. */
static void free_slot(leader_t *L, int i)
{
    int slot = L->s[i].slot;
    if (slot < 0) return;
    L->slot_used[slot] = false;
    L->frees[L->n_frees++] = slot;
    if (L->pool) tsr_kvpool_release(L->pool, slot);
    L->s[i].slot = -1;
}

static void seq_remove(leader_t *L, int i)
{
    free(L->l[i].q.prompt);
    free(L->l[i].keys);
    free_slot(L, i);
    memmove(L->s + i, L->s + i + 1, (size_t)(L->n - i - 1) * sizeof *L->s);
    memmove(L->l + i, L->l + i + 1, (size_t)(L->n - i - 1) * sizeof *L->l);
    L->n--;
}

static int waiting_count(const leader_t *L)
{
    int w = 0;
    for (int i = 0; i < L->n; i++) w += L->s[i].slot < 0;
    return w;
}

/* retryable: the request failed because the replica broke or stopped, not
 * because of anything in it, so it may be resumed on another replica. */
static void fail_request(const tsr_replica_io_t *io, const tsr_request_t *q, int index,
                         int retryable, const char *why)
{
    io->emit(io->arg, q->request_id, -1, index, 1, retryable, NULL, why);
}

/* The prompt's array also holds the tokens fed back (the keys of generated
 * blocks hash them, and a preempted sequence computes them again): room for
 * every position. */
static int cache_room(const tsr_replica_rank_t *r, tsr_request_t *q)
{
    long cap = (long)q->n_prompt + q->max_tokens;
    if (cap > r->spec.max_seq_len) cap = r->spec.max_seq_len;
    if (cap <= q->n_prompt) return 0;
    int32_t *p = realloc(q->prompt, (size_t)cap * sizeof *p);
    if (!p) return -1;
    q->prompt = p;
    return 0;
}

/* Takes a new request into the queue, or refuses it at once with why. */
static void intake(tsr_replica_rank_t *r, const tsr_replica_io_t *io, leader_t *L,
                   tsr_request_t *q)
{
    char why[200];
    tsr_sched_seq_t s = {.slot = -1, .n_prompt = q->n_prompt, .max_tokens = q->max_tokens};
    int need = q->n_prompt >= 1 ? tsr_sched_worst_blocks(&L->cfg, &s) : 0;
    int waiting = waiting_count(L);
    if (q->n_prompt < 1 || q->n_prompt > r->spec.max_seq_len) {
        snprintf(why, sizeof why, "prompt of %d tokens does not fit max_seq_len %d", q->n_prompt,
                 r->spec.max_seq_len);
    } else if (q->max_tokens < 1) {
        snprintf(why, sizeof why, "max_tokens must be at least 1");
    } else if (need > L->cfg.total_blocks) {
        snprintf(why, sizeof why,
                 "the request needs %d KV blocks of %d positions and the pool has %d "
                 "(raise kv_cache_mib)",
                 need, TSR_KV_BLOCK, L->cfg.total_blocks);
    } else if (L->n >= L->cap || waiting - (L->cfg.max_batch - (L->n - waiting)) >= r->max_queue) {
        /* Free slots take arrivals at the next step; max_queue counts the
         * requests that must wait beyond them. */
        snprintf(why, sizeof why, "the replica's queue is full (max_queue %d, max_batch %d)",
                 r->max_queue, L->cfg.max_batch);
        fail_request(io, q, 0, TSR_FAIL_BUSY, why);
        free(q->prompt);
        q->prompt = NULL;
        return;
    } else if (cache_room(r, q) < 0) {
        snprintf(why, sizeof why, "out of memory for the sequence's tokens");
    } else {
        int i = L->n++;
        L->s[i] = s;
        L->l[i] = (lseq_t){.q = *q, .deadline = q->timeout_ms > 0 ? now_ms() + q->timeout_ms : 0,
                           .last_token = -1};
        if (L->secret) {
            L->l[i].keys = malloc(((size_t)tsr_kv_blocks_for(r->spec.max_seq_len) + 1) *
                                  sizeof(uint64_t));
            if (!L->l[i].keys) {
                L->n--;
                snprintf(why, sizeof why, "out of memory for the prompt's prefix cache keys");
                goto refuse;
            }
            L->l[i].n_keys = tsr_prefix_keys(L->secret, q->prompt, q->n_prompt, L->l[i].keys);
        }
        q->prompt = NULL;   /* transferred */
        return;
    }
refuse:
    fail_request(io, q, 0, 0, why);
    free(q->prompt);
    q->prompt = NULL;
}

static void cancel(const tsr_replica_io_t *io, leader_t *L, int i, const char *why)
{
    if (L->s[i].cancelled) return;
    L->s[i].cancelled = true;
    snprintf(L->l[i].why, sizeof L->l[i].why, "%s", why);
    fail_request(io, &L->l[i].q, L->s[i].n_generated, 0, why);
}

/* Cancellations and deadlines; finished or cancelled sequences that are
 * not in the pipeline leave, and their slots are freed at the next step. */
static void housekeep(const tsr_replica_io_t *io, leader_t *L)
{
    uint64_t id;
    char reason[128], why[200];
    while (io->next_cancel(io->arg, &id, reason, sizeof reason)) {
        int i = find_seq(L, id);
        if (i >= 0) {
            snprintf(why, sizeof why, "cancelled: %s", reason[0] ? reason : "by the coordinator");
            cancel(io, L, i, why);
        }
    }
    int64_t now = now_ms();
    for (int i = 0; i < L->n; i++)
        if (L->l[i].deadline && now >= L->l[i].deadline && !L->l[i].done) {
            snprintf(why, sizeof why, "deadline of %d ms passed after %d token(s)",
                     L->l[i].q.timeout_ms, L->s[i].n_generated);
            cancel(io, L, i, why);
        }
    for (int i = L->n; i-- > 0;)
        if ((L->s[i].cancelled || L->l[i].done) && !L->s[i].in_flight) seq_remove(L, i);
}

/* Tokens of a step came back: each sampling sequence advances or ends. */
static void apply_tokens(tsr_replica_rank_t *r, leader_t *L, const flight_t *f,
                         const int32_t *toks)
{
    const tsr_model_info_t *m = r->eng_ops->model(r->eng);
    for (int k = 0; k < f->n; k++) {
        int i = find_seq(L, f->req[k]);
        if (i < 0) continue;
        tsr_sched_seq_t *s = &L->s[i];
        s->in_flight = false;
        s->n_generated++;
        L->l[i].last_token = toks[k];
        if (tsr_finish_reason(m, toks[k], s->n_generated - 1, s->n_prompt, s->max_tokens,
                              r->spec.max_seq_len))
            L->l[i].done = true;
    }
}

static void send_report(tsr_replica_rank_t *r, const tsr_replica_io_t *io, const leader_t *L,
                        int queued, int running)
{
    if (!io->report) return;
    tsr_replica_stats_t st = {.queued = queued, .running = running};
    r->eng_ops->kv_usage(r->eng, &st.kv_used, &st.kv_total);
    tsr_kvpool_t *p = pool_of(r);
    if (p) {
        st.kv_cached = tsr_kvpool_cached(p);
        st.evictions = tsr_kvpool_evictions(p);
    }
    if (L) {
        st.prompt_cached = L->prompt_cached;
        st.prompt_computed = L->prompt_computed;
        st.preemptions = L->preemptions;
    }
    io->report(io->arg, &st);
}

/* On demand the pool ran out: sequence i gives its blocks back and waits in its
 * place, with every token it has; it computes them again when admitted. */
static void preempt(leader_t *L, int i)
{
    free_slot(L, i);
    L->s[i].n_cached = 0;
    L->preemptions++;
}

/* What the pool can give now: free blocks and cached ones no sequence holds. */
static int pool_room(tsr_replica_rank_t *r)
{
    int used, total;
    r->eng_ops->kv_usage(r->eng, &used, &total);
    return total - used;
}

/* The cached prefix each waiting sequence that may be admitted now would
 * start with: the longest chain of its prompt's blocks in the cache, short
 * of the prompt's last position (its logits must be computed).  The
 * scheduler starts an admitted sequence there. */
static void match_waiting(leader_t *L)
{
    if (!L->secret) return;
    int running = 0;
    for (int i = 0; i < L->n; i++) running += L->s[i].slot >= 0;
    int room = L->cfg.max_batch - running;
    for (int i = 0; i < L->n; i++) {
        tsr_sched_seq_t *s = &L->s[i];
        lseq_t *l = &L->l[i];
        if (s->slot >= 0 || s->cancelled) continue;
        /* short of its last known position, so an admission always has positions to
         * compute (a preempted sequence's known ones: all it was fed) */
        int known = s->n_prompt + (s->n_generated > 0 ? s->n_generated - 1 : 0);
        int limit = (known - 1) / TSR_KV_BLOCK;
        if (limit > l->n_keys) limit = l->n_keys;
        l->attach = room-- > 0 ? tsr_kvpool_match(L->pool, l->keys, limit) : 0;
        s->n_cached = l->attach * TSR_KV_BLOCK;
        s->attach_taken = tsr_kvpool_match_unheld(L->pool, l->keys, l->attach);
    }
}

/* A decode feeds the last token back at the position after every one known. */
static bool is_decode(const tsr_sched_seq_t *s, const tsr_sched_entry_t *pe)
{
    return s->n_generated > 0 && pe->pos == s->n_prompt + s->n_generated - 1;
}

/* Keys of sequence l's blocks filled by positions [pos, pos + n), which
 * it now holds (tokens fed back were written to its array as fed). */
static int publish_count(const leader_t *L, lseq_t *l, int pos, int n)
{
    if (!L->secret) return 0;
    int end = (pos + n) / TSR_KV_BLOCK;
    for (; l->n_keys < end; l->n_keys++)
        l->keys[l->n_keys] =
            tsr_prefix_key(L->secret, l->n_keys ? l->keys[l->n_keys - 1] : 0,
                           l->q.prompt + (size_t)l->n_keys * TSR_KV_BLOCK);
    return end - pos / TSR_KV_BLOCK;
}

/* Sends the step in b to every other rank (one grouped send). */
static int broadcast_step(tsr_replica_rank_t *r, step_buf_t *b, char *err, size_t errlen)
{
    int n = n_ranks(r);
    if (n == 1) return 0;
    tsr_p2p_t ops[2 * 1024];
    if (n > 1024) {
        snprintf(err, errlen, "a replica of %d ranks is more than the control channel takes", n);
        return -1;
    }
    for (int p = 1; p < n; p++) ops[p - 1] = (tsr_p2p_t){p, true, hdr_buf(&b->hdr)};
    if (r->ctl_ops->group(r->ctl, ops, n - 1, r->peer_timeout_ms, err, errlen) < 0) return -1;
    if (b->hdr.op != TSR_CTL_STEP) return 0;
    for (int p = 1; p < n; p++) ops[p - 1] = (tsr_p2p_t){p, true, payload_buf(b)};
    return r->ctl_ops->group(r->ctl, ops, n - 1, r->peer_timeout_ms, err, errlen);
}

static int send_simple(tsr_replica_rank_t *r, step_buf_t *b, uint32_t op, char *err,
                       size_t errlen)
{
    b->hdr = (tsr_ctl_hdr_t){TSR_CTL_MAGIC, op, 0, 0, 0, 0, 0};
    return broadcast_step(r, b, err, errlen);
}

/* Builds the next step from the plan, sends it and runs it here. */
static int lead_step(tsr_replica_rank_t *r, const tsr_replica_io_t *io, leader_t *L,
                     step_buf_t *b, int n_plan, char *err, size_t errlen)
{
    int n_tok = 0, ns = 0, n_keys = 0;
    for (int k = 0; k < n_plan; k++) {
        const tsr_sched_entry_t *pe = &L->plan[k];
        lseq_t *l = &L->l[pe->seq];
        n_tok += pe->n;
        /* a decode feeds its last token: the keys of its block hash it */
        if (is_decode(&L->s[pe->seq], pe)) l->q.prompt[pe->pos] = l->last_token;
        n_keys += (pe->admitted ? l->attach : 0) + publish_count(L, l, pe->pos, pe->n);
    }
    b->hdr = (tsr_ctl_hdr_t){TSR_CTL_MAGIC, TSR_CTL_STEP, L->next_step++, n_plan, L->n_frees,
                             n_tok, n_keys};
    step_buf_layout(b);
    uint64_t *key = b->keys;
    memcpy(b->frees, L->frees, (size_t)L->n_frees * sizeof *b->frees);
    L->n_frees = 0;
    flight_t *f = &L->flight[(L->fl_head + L->fl_count) % r->spec.pp_size];
    f->step = b->hdr.step;
    int t = 0;
    for (int k = 0; k < n_plan; k++) {
        const tsr_sched_entry_t *pe = &L->plan[k];
        tsr_sched_seq_t *s = &L->s[pe->seq];
        lseq_t *l = &L->l[pe->seq];
        int attach = 0, publish = publish_count(L, l, pe->pos, pe->n);
        if (pe->admitted) {
            s->slot = pe->slot;
            L->slot_used[pe->slot] = true;
            attach = l->attach;
            s->admitted = ++L->admissions;
            /* what its client is told: the admission that makes its first token */
            if (s->n_generated == 0) l->cached = attach * TSR_KV_BLOCK;
            /* prompt positions only (a preempted one also takes back what it generated) */
            L->prompt_cached += (uint64_t)(attach * TSR_KV_BLOCK < s->n_prompt
                                               ? attach * TSR_KV_BLOCK
                                               : s->n_prompt);
            if (attach > 0) memcpy(key, l->keys, (size_t)attach * sizeof *key);
            key += attach;
        }
        if (publish > 0) memcpy(key, l->keys + pe->pos / TSR_KV_BLOCK, (size_t)publish * sizeof *key);
        key += publish;
        if (pe->pos < s->n_prompt)
            L->prompt_computed += (uint64_t)((pe->pos + pe->n < s->n_prompt ? pe->pos + pe->n : s->n_prompt) - pe->pos);
        b->entries[k] = (tsr_ctl_entry_t){l->q.request_id, l->q.seed, pe->slot, pe->pos, pe->n,
                                          pe->sample, s->n_generated, s->n_prompt, s->max_tokens,
                                          attach, l->q.temperature, l->q.top_p, publish,
                                          l->cached};
        /* a decode's token was written to the array above: every entry reads it */
        memcpy(b->tokens + t, l->q.prompt + pe->pos, (size_t)pe->n * sizeof(int32_t));
        t += pe->n;
        s->n_cached += pe->n;
        if (pe->sample) {
            s->in_flight = true;
            f->req[ns++] = l->q.request_id;
        }
    }
    f->n = ns;
    if (broadcast_step(r, b, err, errlen) < 0 || run_step(r, io, b, err, errlen) < 0) return -1;
    if (r->spec.pp_size == 1) {
        if (r->spec.tp_rank == 0) apply_tokens(r, L, f, b->sampled);
    } else if (ns > 0) {
        L->fl_count++;
    }
    return 0;
}

/* Receives the oldest step's tokens from the last stage. */
static int take_tokens(tsr_replica_rank_t *r, leader_t *L, step_buf_t *b, char *err,
                       size_t errlen)
{
    flight_t *f = &L->flight[L->fl_head];
    if (tsr_coll_recv(r->ctl_ops, r->ctl, last_rank(r),
                      tsr_host_buf(b->back, 3 + (size_t)f->n, TSR_DT_I32), r->token_timeout_ms,
                      err, errlen) < 0)
        return -1;
    if ((uint32_t)b->back[0] != BACK_MAGIC || (uint32_t)b->back[1] != (uint32_t)f->step ||
        b->back[2] != f->n) {
        snprintf(err, errlen,
                 "the last stage sent tokens out of step: magic 0x%08x, step %u, %d tokens; "
                 "expected step %u with %d",
                 (uint32_t)b->back[0], (uint32_t)b->back[1], b->back[2], (uint32_t)f->step, f->n);
        return -1;
    }
    apply_tokens(r, L, f, b->back + 3);
    L->fl_head = (L->fl_head + 1) % r->spec.pp_size;
    L->fl_count--;
    return 0;
}

static int leader_init(tsr_replica_rank_t *r, leader_t *L)
{
    memset(L, 0, sizeof *L);
    int used, total;
    r->eng_ops->kv_usage(r->eng, &used, &total);
    L->cfg = (tsr_sched_cfg_t){r->spec.max_seqs, r->prefill_chunk, r->spec.max_seq_len, total,
                               r->spec.pp_size, !r->kv_reserve && pool_of(r), total};
    L->cap = r->spec.max_seqs + (r->max_queue > 0 ? r->max_queue : 1);
    L->s = calloc((size_t)L->cap, sizeof *L->s);
    L->l = calloc((size_t)L->cap, sizeof *L->l);
    L->slot_used = calloc((size_t)r->spec.max_seqs, sizeof *L->slot_used);
    L->frees = calloc((size_t)r->spec.max_seqs, sizeof *L->frees);
    L->plan = calloc((size_t)r->spec.max_seqs, sizeof *L->plan);
    L->flight = calloc((size_t)r->spec.pp_size, sizeof *L->flight);
    L->pool = pool_of(r);
    L->secret = L->pool ? r->prefix_secret : NULL;
    if (!L->s || !L->l || !L->slot_used || !L->frees || !L->plan || !L->flight) return -1;
    for (int i = 0; i < r->spec.pp_size; i++)
        if (!(L->flight[i].req = calloc((size_t)r->spec.max_seqs, sizeof(uint64_t)))) return -1;
    return 0;
}

static void leader_free(tsr_replica_rank_t *r, leader_t *L)
{
    for (int i = 0; i < L->n; i++) free(L->l[i].q.prompt), free(L->l[i].keys);
    for (int i = 0; L->flight && i < r->spec.pp_size; i++) free(L->flight[i].req);
    free(L->s), free(L->l), free(L->slot_used), free(L->frees), free(L->plan), free(L->flight);
}

static int lead(tsr_replica_rank_t *r, const tsr_replica_io_t *io, step_buf_t *b, leader_t *L,
                char *err, size_t errlen)
{
    int64_t last_sent = now_ms();
    for (;;) {
        if (io->should_stop(io->arg)) {
            send_simple(r, b, TSR_CTL_STOP, err, errlen);
            return 0;
        }
        tsr_request_t q;
        while (io->next_request(io->arg, &q, 0)) intake(r, io, L, &q);
        housekeep(io, L);
        /* Tokens that came back already: take them without waiting. */
        while (L->fl_count > 0) {
            int k = r->ctl_ops->poll(r->ctl, last_rank(r), 0, err, errlen);
            if (k < 0 || (k > 0 && take_tokens(r, L, b, err, errlen) < 0)) return -1;
            if (k == 0) break;
        }
        housekeep(io, L);
        int running = L->n - waiting_count(L);
        send_report(r, io, L, L->n - running, running);
        int n_plan = 0;
        while (L->fl_count < r->spec.pp_size) {
            int victim;
            match_waiting(L);
            L->cfg.free_blocks = pool_room(r);
            n_plan = tsr_sched_next(&L->cfg, L->s, L->n, L->slot_used, L->plan, &victim);
            if (n_plan > 0 || victim < 0) break;
            preempt(L, victim);
        }
        if (n_plan > 0 || (L->n_frees > 0 && L->fl_count == 0)) {
            if (lead_step(r, io, L, b, n_plan, err, errlen) < 0) return -1;
            last_sent = now_ms();
            continue;
        }
        if (L->fl_count > 0) {          /* the pipeline is full or nothing else can run */
            if (take_tokens(r, L, b, err, errlen) < 0) return -1;
            continue;
        }
        /* Nothing runs: wait for a request (briefly when some wait for room). */
        if (io->next_request(io->arg, &q, L->n == 0 ? r->idle_ms : 1)) {
            intake(r, io, L, &q);
            continue;
        }
        if (now_ms() - last_sent >= r->idle_ms) {   /* keep-alive for the other ranks */
            if (send_simple(r, b, TSR_CTL_NOP, err, errlen) < 0) return -1;
            last_sent = now_ms();
        }
    }
}

/* ---- the other ranks ------------------------------------------------------------------ */

static int follow(tsr_replica_rank_t *r, const tsr_replica_io_t *io, step_buf_t *b, char *err,
                  size_t errlen)
{
    for (;;) {
        /* A new plan or a shutdown of this worker ends it here too, without
         * waiting for the leader's stop (the leader sends a no-op at least
         * every idle_ms, so this is looked at that often). */
        if (io->should_stop(io->arg)) return 0;
        if (tsr_coll_recv(r->ctl_ops, r->ctl, 0, hdr_buf(&b->hdr), r->peer_timeout_ms, err,
                          errlen) < 0 ||
            hdr_ok(r, &b->hdr, err, errlen) < 0)
            return -1;
        if (b->hdr.op == TSR_CTL_STOP) return 0;
        if (b->hdr.op == TSR_CTL_NOP) continue;
        step_buf_layout(b);
        if (tsr_coll_recv(r->ctl_ops, r->ctl, 0, payload_buf(b), r->peer_timeout_ms, err,
                          errlen) < 0)
            return -1;
        for (int i = 0; i < b->hdr.n_free; i++)
            if (b->frees[i] < 0 || b->frees[i] >= r->spec.max_seqs) {
                snprintf(err, errlen, "the leader freed slot %d of %d", b->frees[i],
                         r->spec.max_seqs);
                return -1;
            }
        if (run_step(r, io, b, err, errlen) < 0) {
            /* The last stage reports what it was running. */
            if (is_last(r) && r->spec.tp_rank == 0)
                for (int i = 0; i < b->hdr.n_entries; i++)
                    if (b->entries[i].sample)
                        io->emit(io->arg, b->entries[i].req, -1, b->entries[i].index, 1, 1, NULL,
                                 err);
            return -1;
        }
        send_report(r, io, NULL, 0, 0);
    }
}

int tsr_replica_run(tsr_replica_rank_t *r, const tsr_replica_io_t *io, char *err, size_t errlen)
{
    if (!r->idle_ms) r->idle_ms = 250;
    if (!r->peer_timeout_ms) r->peer_timeout_ms = 3000;
    if (!r->token_timeout_ms) r->token_timeout_ms = 60000;
    if (r->prefill_chunk < 1) r->prefill_chunk = 128;
    if (r->max_queue < 0) r->max_queue = 256;
    if (n_ranks(r) > 1 && !r->ctl) {
        snprintf(err, errlen, "a replica of %d ranks needs a control channel", n_ranks(r));
        return -1;
    }
    /* The engine outlives a run when the piece stays (a rewired replica, a
     * new epoch): sequences of the last run may still hold KV blocks that
     * no leader will free, and this run's leader counts on a whole pool. */
    if (pool_of(r))
        tsr_kvpool_reset(pool_of(r));   /* and every rank's prefix cache starts empty */
    else if (r->eng_ops->release)
        for (int s = 0; s < r->spec.max_seqs; s++) r->eng_ops->release(r->eng, s);
    step_buf_t b;
    leader_t L;
    memset(&L, 0, sizeof L);
    int rc = -1;
    if (step_buf_init(&b, &r->spec) < 0 || (is_leader(r) && leader_init(r, &L) < 0)) {
        snprintf(err, errlen, "out of memory for the step buffers");
        goto out;
    }
    send_report(r, io, NULL, 0, 0);
    if (!is_leader(r)) {
        rc = follow(r, io, &b, err, errlen);
        goto out;
    }
    rc = lead(r, io, &b, &L, err, errlen);
    /* Every request in hand fails with the reason: none is left waiting. */
    for (int i = 0; i < L.n; i++)
        if (!L.s[i].cancelled && !L.l[i].done)
            fail_request(io, &L.l[i].q, L.s[i].n_generated, 1,
                         rc < 0 ? err : "the replica was stopped (a new plan or shutdown)");
    {
        tsr_request_t q;
        while (io->next_request(io->arg, &q, 0)) {
            fail_request(io, &q, 0, 1, rc < 0 ? err : "the replica stopped before serving it");
            free(q.prompt);
        }
    }
out:
    if (is_leader(r)) leader_free(r, &L);
    step_buf_free(&b);
    return rc;
}
