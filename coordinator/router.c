/* router.c: generation requests.  A request goes to the leader of the ready
 * replica with the fewest requests in flight; its tokens come back from the
 * replica's last stage and are streamed to the client that asked.
 *
 * A request whose replica loses a worker, breaks or is rewired is resumed:
 * the coordinator keeps its prompt and every token delivered, and sends
 * both as the prompt of a new attempt (with a new worker-side id) to a ready
 * replica, which goes on from the next position.  Sampling draws depend on
 * (seed, position) only and the engine is batch-invariant, so the resumed
 * request produces the tokens the first attempt would have; the client sees
 * one stream with consecutive indexes.  After coordinator.max_replays
 * resumptions in a row without progress (or REPLAYS_IN_ALL times that in
 * all), or coordinator.replay_wait_ms without a ready replica, or at its
 * deadline, it fails with the reason and the count delivered: it never hangs.
 *
 * A request also ends early when its client's deadline passes (the tick
 * checks) or its client disconnects (a reply to it fails with
 * TSR_REPLY_GONE); then the leader is sent a Cancel so the sequence leaves
 * its batch and frees its KV blocks. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/budget.h"
#include "common/log.h"
#include "common/prefix.h"
#include "prefix_route.h"
#include "router.h"
#include "assign.h"
#include "placement.h"

/* The requests in flight: this layer's alone (tsr_coord_t.requests). */
struct tsr_requests {
    tsr_request_rec_t *v;
    size_t n, cap;
    tsr_prefix_route_t *prefixes;   /* what each replica's prefix cache likely holds */
};

#define MAX_TOKENS_LIMIT 1000000
#define TIMEOUT_MS_LIMIT 86400000u  /* a day */

/* Streams one document (or a failure) to the client that sent request q.
 * Returns one of TSR_REPLY_*; a reply lost to a full queue is counted. */
static int reply_json(tsr_coord_t *c, tsr_request_rec_t *q, bool ok, const char *error,
                      json_t *doc)
{
    char *s = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    int rc = tsr_control_send(c, q->sock ? q->sock : c->csock, q->rid, q->rid_len, ok,
                              ok ? NULL : q->fail_code, error, s);
    free(s);
    if (rc == TSR_REPLY_DROPPED) {
        /* The client is slow, not gone: its request keeps running, and the
         * gap in the token indexes tells it what it missed. */
        c->stats.replies_dropped++;
        if (!q->reply_dropped)
            tsr_warn("request %llu: the client's queue is full; replies are being dropped",
                     (unsigned long long)q->id);
        q->reply_dropped = true;
    }
    return rc;
}

/* Frees what a request record owns (its ids, its text decoder and tokenizer hold). */
static void request_free(tsr_request_rec_t *q)
{
    free(q->ids);
    q->ids = NULL;
    tsr_detok_destroy(&q->detok);
    tsr_tokref_drop(&q->tok);
}

static void request_remove(tsr_coord_t *c, size_t i)
{
    request_free(&c->requests->v[i]);
    c->requests->v[i] = c->requests->v[--c->requests->n];
}

/* code: the ControlReply code ("failed", "unavailable"). */
static void request_fail_as(tsr_coord_t *c, size_t i, const char *code, const char *why)
{
    char msg[768];
    tsr_request_rec_t *q = &c->requests->v[i];
    q->fail_code = code;
    if (q->replica >= 0)
        snprintf(msg, sizeof msg, "request %llu on %s replica %d failed after %d token(s): %s",
                 (unsigned long long)q->id, q->deployment, q->replica, q->n_tokens, why);
    else
        snprintf(msg, sizeof msg, "request %llu on %s failed after %d token(s) and %d "
                 "replay(s): %s", (unsigned long long)q->id, q->deployment, q->n_tokens,
                 q->replays, why);
    tsr_warn("%s", msg);
    reply_json(c, q, false, msg, NULL);  /* a client that left needs no answer */
    c->stats.requests_failed++;
    /* Refused for load (a full queue) or for its own size: not a failure of the service. */
    tsr_metrics_outcome(&c->metrics, q->deployment, !strcmp(code, "failed") ? "failed" : "refused");
    request_remove(c, i);
}

static void request_fail(tsr_coord_t *c, size_t i, const char *why)
{
    request_fail_as(c, i, "failed", why);
}

/* The worker named leader while it still holds the piece of that epoch; a
 * leader that died or was given a new epoch since has dropped what it ran
 * (its replica's requests were interrupted then). */
static tsr_worker_t *leader_of_epoch(tsr_coord_t *c, const char *leader, uint64_t epoch)
{
    tsr_worker_t *w = tsr_registry_find(c->reg, leader);
    return w && w->state != TSR_W_DEAD &&
                   ((w->has_piece && w->piece.epoch == epoch) ||
                    (w->finishing && w->finished.epoch == epoch))
               ? w
               : NULL;
}

/* Whether request q runs on an old cut's replica that finishes its requests in place
 * (reshard.c): moving replicas of the new cut leaves it there. */
static bool on_finishing(const tsr_coord_t *c, const tsr_request_rec_t *q)
{
    if (q->replica < 0) return false;
    const tsr_worker_t *w = tsr_registry_find(c->reg, q->leader);
    return w && w->finishing && w->finished.epoch == q->epoch &&
           w->finished.key.replica == q->replica && !strcmp(w->finished.key.deployment, q->deployment);
}

/* Tells replica leader w to drop sequence id (a failed send is counted and
 * logged by tsr_coord_send).  Returns 0 or -1. */
static int cancel_at(tsr_coord_t *c, const tsr_worker_t *w, uint64_t id, const char *reason)
{
    Tessera__Cancel m = TESSERA__CANCEL__INIT;
    m.request_id = id;
    m.reason = (char *)reason;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = w->has_piece ? w->piece.epoch : w->finished.epoch;
    env.worker = (char *)w->name;
    env.body_case = TESSERA__ENVELOPE__BODY_CANCEL;
    env.cancel = &m;
    return tsr_coord_send(c, w->rid, w->rid_len, &env);
}

int tsr_requests_cancel_at(tsr_coord_t *c, const char *leader, uint64_t epoch, uint64_t id,
                           const char *reason)
{
    tsr_worker_t *w = leader_of_epoch(c, leader, epoch);
    return w ? cancel_at(c, w, id, reason) : -1;
}

/* Tells the leader request q's attempt was sent to that it is over. */
static void send_cancel(tsr_coord_t *c, const tsr_request_rec_t *q, const char *reason)
{
    tsr_worker_t *w = q->replica < 0 ? NULL : leader_of_epoch(c, q->leader, q->epoch);
    if (w) cancel_at(c, w, q->wid, reason);
}

/* Ends request i early: the leader is told to drop it, and it is forgotten.  outcome:
 * what the metrics count it as ("cancelled"; "stop" for a client's stop string; "failed"
 * for one ended by the service, its deadline passed or its key removed, whose failure
 * the caller has counted). */
static void request_cancel_as(tsr_coord_t *c, size_t i, const char *reason, const char *outcome)
{
    tsr_request_rec_t *q = &c->requests->v[i];
    tsr_info("request %llu on %s replica %d cancelled after %d token(s): %s",
             (unsigned long long)q->id, q->deployment, q->replica, q->n_tokens, reason);
    send_cancel(c, q, reason);
    if (!strcmp(outcome, "cancelled")) c->stats.requests_cancelled++;
    tsr_dep_metrics_t *mt = tsr_metrics_of(&c->metrics, q->deployment);
    if (mt && !strcmp(outcome, "stop"))
        tsr_hist_observe(&mt->duration, (double)(tsr_now_ms() - q->started_ms) / 1000.0);
    tsr_metrics_outcome(&c->metrics, q->deployment, outcome);
    request_remove(c, i);
}

static void request_cancel(tsr_coord_t *c, size_t i, const char *reason)
{
    request_cancel_as(c, i, reason, "cancelled");
}

void tsr_router_cancel(tsr_coord_t *c, const tsr_client_t *from, uint64_t id, bool stopped)
{
    for (size_t i = 0; i < c->requests->n; i++) {
        tsr_request_rec_t *q = &c->requests->v[i];
        /* Only the client that sent a request may end it. */
        if (q->id != id || q->sock != from->sock || q->rid_len != from->rid_len ||
            memcmp(q->rid, from->rid, from->rid_len))
            continue;
        if (stopped) request_cancel_as(c, i, "the client's stop string came", "stop");
        else request_cancel(c, i, "the client cancelled it");
        tsr_control_answer(c, from, true, NULL, NULL, "{\"cancelled\":true}");
        return;
    }
    tsr_control_answer(c, from, false, "not_found", "no such request of this client in flight "
                       "(it may have ended)", NULL);
}

/* Request i passed its deadline: the client is told, the replica's leader cancels it. */
static void request_expire(tsr_coord_t *c, size_t i)
{
    tsr_request_rec_t *q = &c->requests->v[i];
    char msg[512], reason[64], where[TSR_NAME_MAX + 64];
    if (q->replica >= 0) snprintf(where, sizeof where, "%s replica %d", q->deployment, q->replica);
    else snprintf(where, sizeof where, "%s, waiting for a ready replica", q->deployment);
    snprintf(msg, sizeof msg,
             "request %llu passed its deadline of %u ms after %d token(s) (%s)",
             (unsigned long long)q->id, q->timeout_ms, q->n_tokens, where);
    snprintf(reason, sizeof reason, "deadline of %u ms passed", q->timeout_ms);
    q->fail_code = "failed";
    reply_json(c, q, false, msg, NULL);
    c->stats.requests_failed++;
    request_cancel_as(c, i, reason, "failed");
}

int64_t tsr_requests_expire(tsr_coord_t *c, int64_t now_ms)
{
    int64_t next = 0;
    for (size_t i = c->requests->n; i-- > 0;) {
        tsr_request_rec_t *q = &c->requests->v[i];
        if (!q->deadline_ms) continue;
        if (q->deadline_ms > now_ms) {
            if (!next || q->deadline_ms < next) next = q->deadline_ms;
            continue;
        }
        request_expire(c, i);
    }
    return next;
}

/* An attempt that delivered this many tokens made progress: its first may
 * come from the prefill alone, so a request that breaks its replica at
 * every decode step does not pass for one that progresses. */
#define PROGRESS_TOKENS 2
/* Resumptions of one request in all, as a multiple of max_replays: a bound
 * for a request that breaks replicas now and then however it progresses. */
#define REPLAYS_IN_ALL 4

/* The current attempt of request i broke through no fault of its own (its
 * replica failed, stopped or was rewired): it waits to be resumed, or fails
 * when it has been resumed max_replays times in a row without progress, or
 * REPLAYS_IN_ALL times that in all.  An attempt that progressed starts the
 * count again: a long request outlives unrelated failures, while one that
 * breaks every replica it reaches (a request that crashes them, a cluster
 * that cannot serve) is given up.  A second failure by the same replica in
 * the same epoch, without progress between, is the same fault (the attempt
 * went straight back before the replica's failure was known): it is not
 * counted, once. */
static void request_interrupt_as(tsr_coord_t *c, size_t i, const char *why, bool counts)
{
    tsr_request_rec_t *q = &c->requests->v[i];
    const int max = c->cfg->max_replays;
    const bool progressed = q->replica >= 0 && q->n_tokens - q->base >= PROGRESS_TOKENS;
    /* Failed again by the replica that failed it last, in the same epoch. */
    const bool again = q->replica == q->avoid_replica && q->epoch == q->avoid_epoch;
    if (progressed) q->fruitless = 0;
    if (counts) {
        bool same_fault = again && !progressed && !q->repeat_free;
        q->repeat_free = same_fault;
        if (same_fault) counts = false;
    }
    if (counts && (q->fruitless >= max || q->replays >= REPLAYS_IN_ALL * max)) {
        char msg[512];
        if (q->fruitless >= max)
            snprintf(msg, sizeof msg, "%s (resumed %d time(s) in a row without progress, "
                     "coordinator.max_replays %d)", why, q->fruitless, max);
        else
            snprintf(msg, sizeof msg, "%s (resumed %d time(s) in all, %d times "
                     "coordinator.max_replays %d)", why, q->replays, REPLAYS_IN_ALL, max);
        request_fail(c, i, msg);
        return;
    }
    send_cancel(c, q, "the request moves to another replica");
    tsr_info("request %llu on %s replica %d interrupted after %d token(s): %s; resuming it",
             (unsigned long long)q->id, q->deployment, q->replica, q->n_tokens, why);
    snprintf(q->why, sizeof q->why, "%s", why);
    /* Failed twice by the same replica in the same epoch: the replica is
     * broken though it may still look ready (its pieces' reports are on
     * their way), so the next attempt waits for it to recover instead of
     * burning the request's replays there at once. */
    q->wait_recovery = again;
    /* an old cut's replica (reshard.c) is not the new cut's of the same index */
    q->avoid = on_finishing(c, q) ? -1 : q->replica;
    q->avoid_replica = q->replica;
    q->avoid_epoch = q->epoch;
    q->avoid_seq = c->ready_seq;
    q->replica = -1;
    q->leader[0] = '\0';
    q->waiting_since_ms = tsr_now_ms();
    if (counts) q->replays++, q->fruitless++;
    c->stats.requests_replayed++;
}

static void request_interrupt(tsr_coord_t *c, size_t i, const char *why)
{
    request_interrupt_as(c, i, why, true);
}

static void interrupt_replica(tsr_coord_t *c, const char *deployment, int replica,
                              const char *why, bool counts)
{
    for (size_t i = c->requests->n; i-- > 0;)
        if (!strcmp(c->requests->v[i].deployment, deployment) && c->requests->v[i].replica == replica &&
            !on_finishing(c, &c->requests->v[i]))
            request_interrupt_as(c, i, why, counts);
}

int tsr_requests_of_attempt(tsr_coord_t *c, const char *deployment, int replica,
                            uint64_t epoch, const char *move_why)
{
    int n = 0;
    for (size_t i = c->requests->n; i-- > 0;) {
        const tsr_request_rec_t *q = &c->requests->v[i];
        if (q->replica != replica || q->epoch != epoch || strcmp(q->deployment, deployment))
            continue;
        n++;
        if (move_why) request_interrupt_as(c, i, move_why, false);
    }
    return n;
}

void tsr_requests_fail_replica(tsr_coord_t *c, const char *deployment, int replica,
                               const char *why)
{
    interrupt_replica(c, deployment, replica, why, true);
}

void tsr_requests_move_off(tsr_coord_t *c, const char *deployment, int replica, const char *why)
{
    interrupt_replica(c, deployment, replica, why, false);
}

int64_t tsr_requests_waiting(const tsr_coord_t *c, const char *deployment, int64_t now_ms,
                             int *n, int64_t *sum_ms)
{
    int64_t most = 0, sum = 0;
    int k = 0;
    for (size_t i = 0; i < c->requests->n; i++) {
        const tsr_request_rec_t *q = &c->requests->v[i];
        if (strcmp(q->deployment, deployment)) continue;
        int64_t since = q->replica < 0 ? q->waiting_since_ms
                        : q->n_tokens == q->base ? q->attempt_ms : 0;
        if (!since) continue;
        int64_t w = now_ms > since ? now_ms - since : 0;
        if (w > most) most = w;
        sum += w;
        k++;
    }
    if (n) *n = k;
    if (sum_ms) *sum_ms = sum;
    return most;
}

void tsr_requests_follow_moves(tsr_coord_t *c)
{
    const tsr_replica_set_t *m = tsr_coord_rewiring(c);
    for (size_t t = 0; t < m->n; t++)
        interrupt_replica(c, c->cfg->deployments[m->di[t]].name, m->replica[t],
                          "the replica was rewired for a new plan", false);
}

tsr_requests_t *tsr_requests_new(void)
{
    tsr_requests_t *t = calloc(1, sizeof *t);
    if (t && !(t->prefixes = tsr_prefix_route_new())) {
        free(t);
        t = NULL;
    }
    return t;
}

void tsr_requests_destroy(tsr_requests_t **self_p)
{
    if (!self_p || !*self_p) return;
    tsr_requests_t *t = *self_p;
    for (size_t i = 0; i < t->n; i++) request_free(&t->v[i]);
    free(t->v);
    tsr_prefix_route_free(&t->prefixes);
    free(t);
    *self_p = NULL;
}

const tsr_request_rec_t *tsr_requests_at(const tsr_coord_t *c, size_t i)
{
    return i < c->requests->n ? &c->requests->v[i] : NULL;
}

void tsr_requests_probe_clients(tsr_coord_t *c)
{
    for (size_t i = c->requests->n; i-- > 0;) {
        tsr_request_rec_t *q = &c->requests->v[i];
        json_t *doc = json_pack("{s:I, s:b}", "request_id", (json_int_t)q->id, "alive", 1);
        int sent = reply_json(c, q, true, NULL, doc);
        json_decref(doc);
        if (sent == TSR_REPLY_GONE) request_cancel(c, i, "the client went away");
    }
}

void tsr_requests_drop_keys(tsr_coord_t *c)
{
    for (size_t i = c->requests->n; i-- > 0;) {
        tsr_request_rec_t *q = &c->requests->v[i];
        if (!c->zap || q->sock == c->bsock || tsr_zap_allowed(c->zap, q->key_id)) continue;
        char msg[300], name[TSR_NAME_MAX + 1];
        snprintf(msg, sizeof msg, "request %llu ended after %d token(s): the key '%s' was "
                 "removed from the key store (or replaced)", (unsigned long long)q->id,
                 q->n_tokens, tsr_key_name(q->key_id, name, sizeof name));
        q->fail_code = "failed";
        reply_json(c, q, false, msg, NULL);
        c->stats.requests_failed++;
        request_cancel_as(c, i, "the client's key was removed from the key store", "failed");
    }
}

int64_t tsr_requests_progress_ms(const tsr_coord_t *c, const tsr_deployment_t *d, int replica)
{
    int64_t last = 0;
    for (size_t i = 0; i < c->requests->n; i++) {
        const tsr_request_rec_t *q = &c->requests->v[i];
        if (q->replica != replica || strcmp(q->deployment, d->name) || on_finishing(c, q)) continue;
        int64_t t = q->progress_ms > q->attempt_ms ? q->progress_ms : q->attempt_ms;
        if (t > last) last = t;
    }
    if (!last) return 0;
    /* One member that stopped holds the whole replica; an empty slot too. */
    int64_t all = INT64_MAX;
    for (int k = 0; k < d->tensor * d->pipeline; k++) {
        const tsr_worker_t *w =
            tsr_registry_at_slot(c->reg, d->name, replica, d->tensor, d->pipeline, k);
        int64_t s = w ? w->steps_ms : 0;
        if (s < all) all = s;
    }
    return all > last ? all : last;
}

size_t tsr_requests_count(const tsr_coord_t *c) { return c->requests->n; }

int tsr_requests_in_flight(const tsr_coord_t *c, const char *deployment, int replica)
{
    int n = 0;
    for (size_t i = 0; i < c->requests->n; i++)   /* an old cut's finishing replica is not r */
        n += !strcmp(c->requests->v[i].deployment, deployment) &&
             (replica < 0 ||
              (c->requests->v[i].replica == replica && !on_finishing(c, &c->requests->v[i])));
    return n;
}

uint64_t tsr_requests_new_id(const tsr_coord_t *c)
{
    for (;;) {
        uint64_t id;
        if (tsr_random(&id, sizeof id) < 0) return 0;
        id &= (1ull << 63) - 1;
        if (!id) continue;
        size_t i;
        for (i = 0; i < c->requests->n && c->requests->v[i].id != id && c->requests->v[i].wid != id; i++) {}
        if (i == c->requests->n) return id;
    }
}

/* The requests in flight on the old cut's replica that w leads (reshard.c). */
static int old_in_flight(const tsr_coord_t *c, const tsr_worker_t *w)
{
    int n = 0;
    for (size_t i = 0; i < c->requests->n; i++) {
        const tsr_request_rec_t *q = &c->requests->v[i];
        n += q->epoch == w->finished.epoch && q->replica == w->finished.key.replica &&
             !strcmp(q->leader, w->name) && !strcmp(q->deployment, w->finished.key.deployment);
    }
    return n;
}

/* Whether w leads an old cut's replica of d that still takes requests beside the new
 * cut's (reshard.c), every member of it ready. */
static bool old_serving_leader(const tsr_coord_t *c, const tsr_deployment_t *d,
                               const tsr_worker_t *w)
{
    const tsr_piece_key_t *k = &w->finished.key;
    if (!w->serving || w->state != TSR_W_READY || k->stage || k->tp ||
        strcmp(k->deployment, d->name) || !tsr_coord_serving_beside(c, d))
        return false;
    int members = 0;
    for (size_t i = 0, nw = tsr_registry_size(c->reg); i < nw; i++) {
        const tsr_worker_t *m = tsr_registry_at(c->reg, i);
        if (!m->finishing || m->finished.epoch != w->finished.epoch ||
            m->finished.key.replica != k->replica || strcmp(m->finished.key.deployment, d->name))
            continue;
        if (!m->serving || m->state != TSR_W_READY || m->drained || m->finish_failed) return false;
        members++;
    }
    return members == k->tp_size * k->pp_size;
}

/* The ready replica of d with the fewest requests in flight, or -1.  A
 * replica whose canary failed gets none.  With old (non-NULL), an old cut's
 * replica serving beside the new cut's is one too, unless request q (may be
 * NULL) was interrupted there: *old is its leader when it is chosen (NULL when
 * a replica of the cut is). */
/* ---- routing by prefix ---- */

#define PREFIX_KEYS_MAX 65536   /* blocks of a prompt looked up (a million positions) */

/* The block keys of a prompt of n ids as replicas of d's current layout key them,
 * short of its last position (always computed): *keys (caller frees), or 0 with
 * *keys NULL (prefix_cache off, nothing whole, out of memory). */
static int prompt_keys(const tsr_coord_t *c, const tsr_deployment_t *d, const int32_t *ids,
                       int n, uint64_t **keys)
{
    uint8_t secret[TSR_PREFIX_SECRET];
    int blocks = n > 0 ? (n - 1) / TSR_KV_BLOCK : 0;
    *keys = NULL;
    if (blocks > PREFIX_KEYS_MAX) blocks = PREFIX_KEYS_MAX;
    if (blocks < 1 || !tsr_coord_prefix_secret(c, d, d->tensor, d->pipeline, secret) ||
        !(*keys = malloc((size_t)blocks * sizeof **keys)))
        return 0;
    return tsr_prefix_keys(secret, ids, blocks * TSR_KV_BLOCK, *keys);
}

/* What the router knows of replica r's cache now, from its leader. */
static tsr_prefix_replica_t prefix_replica(const tsr_worker_t *leader)
{
    return (tsr_prefix_replica_t){leader->piece.epoch, (int)leader->kv_blocks_total,
                                  leader->kv_evictions};
}

/* Replica r of d was sent (or finished) the n ids: their whole blocks are in its cache. */
static void prefix_routed(tsr_coord_t *c, const tsr_deployment_t *d, int r, const int32_t *ids,
                          int n)
{
    const tsr_worker_t *l = tsr_registry_ready_leader(c->reg, d, r);
    uint64_t *keys;
    int nk = l ? prompt_keys(c, d, ids, n + 1, &keys) : 0;  /* every whole block counts */
    if (nk > 0) {
        tsr_prefix_replica_t rep = prefix_replica(l);
        tsr_prefix_route_add(c->requests->prefixes, d->name, r, &rep, keys, nk);
    }
    if (l) free(keys);
}

/* Requests in flight as a cost: one past max_batch (a queue) weighs two. */
static double load_cost(int load, const tsr_deployment_t *d)
{
    return load + (load >= d->max_batch ? load - d->max_batch + 1 : 0);
}

/* The replica for a request whose prompt is ids[0..n) (NULL: any): the one with the
 * least work counting what its cache saves, in "requests in flight": each
 * prefill_chunk of prompt it must compute weighs one request, and one past max_batch
 * (a queue) weighs two.  So a long cached prefix draws a request to the replica that
 * holds it, but not onto one far busier than another.  Old cut replicas serving
 * beside the new cut (other keys) count their load alone. */
static int pick_replica_but(tsr_coord_t *c, const tsr_deployment_t *d, int avoid,
                            const tsr_request_rec_t *q, tsr_worker_t **old,
                            const int32_t *ids, int n)
{
    int replica = -1, draining = -1;
    double best = 0;
    if (old) *old = NULL;
    const tsr_dep_state_t *ds = tsr_coord_dep(c, d->name);
    uint64_t *keys = NULL;
    int nk = -1;                /* the prompt's keys, made for the first candidate */
    double chunk = d->prefill_chunk > 0 ? d->prefill_chunk : 128, unmatched = n / chunk;
    for (int r = 0; r < d->replicas; r++) {
        tsr_canary_t *k = tsr_coord_canary(c, d->name, r);
        const tsr_worker_t *l = tsr_registry_ready_leader(c->reg, d, r);
        if (r == avoid || (k && k->unhealthy) || !l) continue;
        /* one being drained to be removed takes nothing new while another serves */
        if (ds && ds->scale.draining == r) {
            draining = r;
            continue;
        }
        int load = tsr_requests_in_flight(c, d->name, r), m = 0;
        if (nk < 0) nk = ids ? prompt_keys(c, d, ids, n, &keys) : 0;
        if (nk > 0) {
            tsr_prefix_replica_t rep = prefix_replica(l);
            m = tsr_prefix_route_match(c->requests->prefixes, d->name, r, &rep, keys, nk);
        }
        double cost = load_cost(load, d) + (n - (double)m * TSR_KV_BLOCK) / chunk;
        if (replica < 0 || cost < best) replica = r, best = cost;
    }
    free(keys);
    for (size_t i = 0, nw = tsr_registry_size(c->reg); old && i < nw; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        if (!old_serving_leader(c, d, w) ||
            (q && q->avoid_epoch == w->finished.epoch && q->avoid_replica == w->finished.key.replica))
            continue;
        double cost = load_cost(old_in_flight(c, w), d) + unmatched;
        if (replica < 0 || cost < best) replica = w->finished.key.replica, best = cost, *old = w;
    }
    return replica >= 0 ? replica : draining;
}

bool tsr_requests_another_serves(tsr_coord_t *c, const tsr_deployment_t *d, int r)
{
    const tsr_dep_state_t *ds = tsr_coord_dep(c, d->name);
    int other = pick_replica_but(c, d, r, NULL, NULL, NULL, 0);
    return other >= 0 && !(ds && ds->scale.draining == other);
}

static int pick_replica(tsr_coord_t *c, const tsr_deployment_t *d,
                        const tsr_request_rec_t *q, tsr_worker_t **old, const int32_t *ids, int n)
{
    return pick_replica_but(c, d, -1, q, old, ids, n);
}

/* Sends request i's next attempt to the leader of replica r of d (ready), or
 * to old, the leader of an old cut's replica r serving beside the new cut's:
 * the prompt and the tokens delivered so far, for the tokens still to come,
 * under a new worker-side id.  A send that fails interrupts it again. */
static void send_attempt(tsr_coord_t *c, size_t i, const tsr_deployment_t *d, int r,
                         tsr_worker_t *old)
{
    tsr_request_rec_t *q = &c->requests->v[i];
    tsr_worker_t *leader = old ? old : tsr_registry_ready_leader(c->reg, d, r);
    uint64_t epoch = old ? old->finished.epoch : leader->piece.epoch;
    uint64_t wid;
    do wid = tsr_requests_new_id(c);
    while (wid && wid == q->id);
    if (!wid) {
        request_fail(c, i, "coordinator cannot read random bytes for a request id");
        return;
    }
    q->wid = wid;
    q->replica = r;
    q->attempt_ms = c->now_ms ? c->now_ms : tsr_now_ms();
    q->base = q->n_tokens;
    snprintf(q->leader, sizeof q->leader, "%s", leader->name);
    q->epoch = epoch;
    Tessera__Generate g = TESSERA__GENERATE__INIT;
    g.request_id = q->wid;
    g.n_prompt = (size_t)(q->n_prompt + q->n_tokens);
    g.prompt = q->ids;
    g.max_tokens = q->max_tokens - (uint32_t)q->n_tokens;
    g.temperature = q->temperature;
    g.top_p = q->top_p;
    g.seed = q->seed;
    if (q->deadline_ms && !q->waiting_since_ms) {
        g.timeout_ms = q->timeout_ms;  /* sent as it arrived */
    } else if (q->deadline_ms) {
        int64_t left = q->deadline_ms - tsr_now_ms();  /* what is left of it */
        g.timeout_ms = left < 1 ? 1 : (uint32_t)left;
    }
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = epoch;
    env.worker = leader->name;
    env.body_case = TESSERA__ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    /* A worker drops a message over its limit: say so instead of waiting. */
    env.protocol_version = TSR_PROTOCOL_VERSION;
    size_t packed = tessera__envelope__get_packed_size(&env);
    if (packed > TSR_WIRE_MAX_WORKER) {
        char msg[300];
        snprintf(msg, sizeof msg, "its prompt and tokens (%zu ids) make a message of %zu bytes, "
                 "over the workers' limit of %u", g.n_prompt, packed, TSR_WIRE_MAX_WORKER);
        /* Before any token it is the request's own size that is wrong. */
        request_fail_as(c, i, q->n_tokens ? "failed" : "invalid", msg);
        return;
    }
    if (tsr_coord_send(c, leader->rid, leader->rid_len, &env) < 0) {
        char msg[300];
        snprintf(msg, sizeof msg, "could not send it to the leader %s (%s)", leader->name,
                 zmq_strerror(errno));
        request_interrupt(c, i, msg);
        return;
    }
    if (!old) prefix_routed(c, d, r, q->ids, q->n_prompt + q->n_tokens);
    tsr_debug("request %llu (attempt %d, id %llu at the workers) -> %s replica %d (leader %s), "
              "from token %d", (unsigned long long)q->id, q->replays + 1,
              (unsigned long long)q->wid, d->name, r, leader->name, q->n_tokens);
}

/* How long a replica that failed a request twice, but whose pieces report
 * nothing wrong, must stay ready before the request goes back to it: its
 * pieces' failure reports, when it is broken, come within milliseconds. */
#define RECOVERY_GRACE_MS 500

/* Whether replica r, which interrupted q, has recovered since: its leader
 * is of a newer epoch, one of its pieces has become ready again, or it has
 * stayed ready for RECOVERY_GRACE_MS. */
static bool replica_recovered(tsr_coord_t *c, const tsr_deployment_t *d, int r,
                              const tsr_request_rec_t *q)
{
    const tsr_worker_t *l = tsr_registry_ready_leader(c->reg, d, r);
    if (!l) return false;
    if (l->piece.epoch != q->avoid_epoch) return true;
    if (tsr_now_ms() - q->waiting_since_ms >= RECOVERY_GRACE_MS) return true;
    size_t n;
    tsr_worker_t *const *m = tsr_registry_replica(c->reg, d->name, r, &n);
    for (size_t i = 0; i < n; i++)
        if (m[i]->ready_seq > q->avoid_seq) return true;
    return false;
}

int64_t tsr_requests_dispatch(tsr_coord_t *c, int64_t now_ms)
{
    int64_t next = 0;
    for (size_t i = c->requests->n; i-- > 0;) {
        tsr_request_rec_t *q = &c->requests->v[i];
        if (q->replica >= 0) continue;
        const tsr_deployment_t *d = tsr_config_find(c->cfg, q->deployment);
        if (!d) {
            request_fail(c, i, "its deployment was removed from the file");
            continue;
        }
        /* Not straight back to the replica that just failed it, while
         * another can take it. */
        tsr_worker_t *old;
        int r = pick_replica_but(c, d, q->avoid, q, &old, q->ids, q->n_prompt + q->n_tokens);
        if (r < 0) {
            r = pick_replica(c, d, q, &old, q->ids, q->n_prompt + q->n_tokens);
            /* Back to a replica that failed it twice only once it has
             * recovered (rewired, or a piece ready again). */
            if (r >= 0 && !old && r == q->avoid && q->wait_recovery &&
                !replica_recovered(c, d, r, q))
                r = -1;
        }
        if (r >= 0) {
            q->avoid = -1;
            q->wait_recovery = false;
            if (q->base < q->n_tokens || q->replays) {
                json_t *doc = json_pack("{s:I, s:b, s:i, s:i}", "request_id", (json_int_t)q->id,
                                        "resumed", 1, "replica", r, "from_index", q->n_tokens);
                reply_json(c, q, true, NULL, doc);
                json_decref(doc);
            }
            send_attempt(c, i, d, r, old);
            continue;
        }
        int64_t give_up = q->waiting_since_ms + c->cfg->replay_wait_ms;
        if (now_ms >= give_up) {
            char msg[512];
            snprintf(msg, sizeof msg, "no replica could take it within %d ms "
                     "(coordinator.replay_wait_ms) after: %s", c->cfg->replay_wait_ms, q->why);
            request_fail(c, i, msg);
            continue;
        }
        /* Looked at again on every tick; the wait bounds it. */
        if (!next || give_up < next) next = give_up;
    }
    return next;
}

/* code: "not_found", "invalid" or "unavailable" (ControlReply.code). */
static void refuse(tsr_coord_t *c, const tsr_client_t *from, const char *code, const char *msg)
{
    tsr_control_answer(c, from, false, code, msg, NULL);
}

/* A refusal of a request for deployment d, counted in its metrics. */
static void refuse_counted(tsr_coord_t *c, const tsr_deployment_t *d, const tsr_client_t *from,
                           const char *code, const char *msg)
{
    tsr_metrics_outcome(&c->metrics, d->name, "refused");
    refuse(c, from, code, msg);
}

void tsr_router_generate(tsr_coord_t *c, const tsr_client_t *from,
                         const Tessera__ControlRequest *q)
{
    char msg[512];
    int di = -1;
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        if (!strcmp(c->cfg->deployments[i].name, q->deployment)) di = (int)i;
    if (di < 0) {
        snprintf(msg, sizeof msg, "no deployment named '%s'", q->deployment);
        refuse(c, from, "not_found", msg);
        return;
    }
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    tsr_dep_state_t *ds = &c->deps[di];
    const tsr_model_info_t *m = &ds->model;
    bool text = q->prompt_text && q->prompt_text[0];
    if (text && q->n_prompt) {
        refuse_counted(c, d, from, "invalid", "give the prompt as text or as token ids, "
                       "not both");
        return;
    }
    if ((text || q->want_text) && !ds->tok) {
        tsr_tok_refusal(d->name, ds->tok_error, ds->tok_loading, msg, sizeof msg);
        refuse_counted(c, d, from, ds->tok_loading ? "unavailable" : "invalid", msg);
        return;
    }
    /* The prompt's ids: as sent, or the text's; then the tokens a resumed client has. */
    int32_t *pids = q->prompt;
    size_t n_pids = q->n_prompt;
    if (text) {
        char err[300];
        /* Bounded by max_seq_len: a long text costs no more than the longest prompt. */
        if (tsr_tok_encode_max(ds->tok->tok, q->prompt_text, strlen(q->prompt_text), true,
                               (size_t)d->max_seq_len, &pids, &n_pids, err, sizeof err)) {
            snprintf(msg, sizeof msg, "the prompt: %s", err);
            refuse_counted(c, d, from, "invalid", msg);
            return;
        }
    }
    size_t total = n_pids + q->n_resume;
    int32_t *ids = NULL;
    const char *code = "invalid";
    if (n_pids == 0 || total > (size_t)d->max_seq_len) {
        snprintf(msg, sizeof msg, "the prompt has %zu token(s)%s; %s takes 1 to %d (max_seq_len)",
                 total, q->n_resume ? " with the resumed ones" : "", d->name, d->max_seq_len);
        goto refused;
    }
    for (size_t i = 0; i < total; i++) {
        int32_t v = i < n_pids ? pids[i] : q->resume[i - n_pids];
        if (v < 0 || (ds->model_ok && v >= m->vocab_size)) {
            snprintf(msg, sizeof msg, "%s token %zu is %d, outside the vocabulary of %d",
                     i < n_pids ? "prompt" : "resumed", i < n_pids ? i : i - n_pids, v,
                     m->vocab_size);
            goto refused;
        }
    }
    /* The worker counts tokens in an int: 2^31 would wrap. */
    if (q->max_tokens < 1 || q->max_tokens > MAX_TOKENS_LIMIT) {
        snprintf(msg, sizeof msg, "max_tokens must be 1 to %d, got %u", MAX_TOKENS_LIMIT,
                 q->max_tokens);
        goto refused;
    }
    if (q->timeout_ms > TIMEOUT_MS_LIMIT) {
        snprintf(msg, sizeof msg, "timeout_ms must be 0 (no deadline) to %u, got %u",
                 TIMEOUT_MS_LIMIT, q->timeout_ms);
        goto refused;
    }
    if (!(q->temperature >= 0.0f && q->temperature <= 100.0f) ||
        !(q->top_p >= 0.0f && q->top_p <= 1.0f)) {
        snprintf(msg, sizeof msg, "temperature must be 0 to 100 and top_p 0 to 1");
        goto refused;
    }
    /* The ready replica with the least work in flight.  When none is ready
     * but the deployment was ready before (a replica is being rewired or
     * replaced) or the coordinator has just started (its workers are
     * re-attaching), the request waits like an interrupted one; a
     * deployment that never became ready refuses at once. */
    tsr_worker_t *old;
    int replica = pick_replica(c, d, NULL, &old, pids, (int)n_pids);
    int64_t now = tsr_now_ms();
    if (replica < 0 && !c->deps[di].ever_ready && now >= c->plan_after_ms) {
        snprintf(msg, sizeof msg, "%s has no ready replica (see `tessera status`)", d->name);
        code = "unavailable";
        goto refused;
    }
    if (c->requests->n == c->requests->cap) {
        size_t cap = c->requests->cap ? c->requests->cap * 2 : 16;
        tsr_request_rec_t *a = realloc(c->requests->v, cap * sizeof *a);
        if (!a) {
            snprintf(msg, sizeof msg, "coordinator out of memory");
            code = "unavailable";
            goto refused;
        }
        c->requests->v = a;
        c->requests->cap = cap;
    }
    /* A client resuming after a coordinator restart keeps its request's id,
     * unless another request in flight has it. */
    uint64_t id = 0;
    if (q->n_resume && q->request_id) {
        id = q->request_id;
        for (size_t i = 0; i < c->requests->n && id; i++)
            if (c->requests->v[i].id == id) id = 0;
    }
    if (!id) id = tsr_requests_new_id(c);
    /* Room for the prompt and the first tokens; it grows as tokens come. */
    int cap_ids = (int)total + 64;
    ids = id ? malloc((size_t)cap_ids * sizeof *ids) : NULL;
    /* The text is what the tokens add to the prompt's: a SentencePiece tokenizer's first
     * word keeps its space (prompt text + completion text = the decode of all the ids). */
    tsr_detok_t *detok = q->want_text ? tsr_detok_new(ds->tok->tok, true) : NULL;
    if (detok && tsr_detok_prime(detok, pids, n_pids) < 0) tsr_detok_destroy(&detok);
    if (!ids || (q->want_text && !detok)) {
        tsr_detok_destroy(&detok);
        snprintf(msg, sizeof msg, "%s", id ? "coordinator out of memory"
                                           : "coordinator cannot read random bytes for a request id");
        code = "unavailable";
        goto refused;
    }
    memcpy(ids, pids, n_pids * sizeof *ids);
    if (q->n_resume) memcpy(ids + n_pids, q->resume, q->n_resume * sizeof *ids);
    if (text) free(pids);
    /* The client has printed the text of the tokens it resumes with, up to what the
     * decoder held back: the decoder starts where that left off. */
    for (size_t k = 0; detok && k < q->n_resume; k++) {
        const char *piece;
        size_t plen;
        tsr_detok_push(detok, q->resume[k], &piece, &plen);
    }
    tsr_request_rec_t *rec = &c->requests->v[c->requests->n++];
    memset(rec, 0, sizeof *rec);
    rec->id = id;
    memcpy(rec->rid, from->rid, from->rid_len);
    rec->rid_len = from->rid_len;
    snprintf(rec->key_id, sizeof rec->key_id, "%s", from->key_id);
    rec->sock = from->sock;
    snprintf(rec->deployment, sizeof rec->deployment, "%s", d->name);
    rec->replica = -1;
    rec->avoid = rec->avoid_replica = -1;
    rec->ids = ids;
    rec->n_prompt = (int)total;
    rec->detok = detok;
    rec->tok = detok ? tsr_tokref_hold(ds->tok) : NULL;
    rec->cap_ids = cap_ids;
    rec->max_tokens = q->max_tokens;
    rec->temperature = q->temperature;
    rec->top_p = q->top_p;
    rec->seed = q->seed;
    rec->started_ms = tsr_now_ms();
    rec->timeout_ms = q->timeout_ms;
    rec->deadline_ms = q->timeout_ms ? rec->started_ms + q->timeout_ms : 0;
    c->stats.requests++;
    tsr_dep_metrics_t *mt = tsr_metrics_of(&c->metrics, d->name);
    if (mt) mt->prompt_tokens += n_pids;

    /* Tell the client at once that the request is on its way, so it can
     * tell a missing coordinator from a slow prefill.  A client that has
     * already left costs the replica nothing. */
    tsr_worker_t *leader = old ? old : replica >= 0 ? tsr_registry_ready_leader(c->reg, d, replica) : NULL;
    json_t *ack = json_pack("{s:I, s:i, s:s, s:b, s:b, s:I}", "request_id", (json_int_t)rec->id,
                            "replica", replica, "leader", leader ? leader->name : "",
                            "accepted", 1, "queued", replica < 0, "prompt_tokens",
                            (json_int_t)n_pids);
    int sent = reply_json(c, rec, true, NULL, ack);
    json_decref(ack);
    if (sent == TSR_REPLY_GONE) {
        tsr_info("request %llu: the client left before it was sent", (unsigned long long)rec->id);
        request_remove(c, c->requests->n - 1);
        return;
    }
    if (replica >= 0) {
        send_attempt(c, c->requests->n - 1, d, replica, old);
        return;
    }
    rec->waiting_since_ms = now;
    snprintf(rec->why, sizeof rec->why, "no replica of %s was ready when it arrived", d->name);
    return;
refused:
    if (text) free(pids);
    free(ids);
    refuse_counted(c, d, from, code, msg);
}

/* Whether w may speak for request q: a member of the replica it was routed
 * to, in the epoch it was sent in; for a token (not an error), the one that samples:
 * last stage, tp 0.
 * The leader sends refusals and cancellations, the last stage tokens. */
static bool token_sender_ok(const tsr_worker_t *w, const tsr_request_rec_t *q, bool is_error)
{
    /* in the attempt's epoch: a replica of the same index in another epoch (a new cut's,
     * while an old cut's replica finishes in place) does not speak for it */
    const tsr_piece_key_t *k = w->has_piece && w->piece.epoch == q->epoch ? &w->piece.key
                               : w->finishing && w->finished.epoch == q->epoch ? &w->finished.key
                                                                             : NULL;
    if (w->state == TSR_W_DEAD || !k || strcmp(k->deployment, q->deployment) ||
        k->replica != q->replica)
        return false;
    return is_error || (k->stage == k->pp_size - 1 && k->tp == 0);
}

static void cancel_orphan(tsr_coord_t *c, const tsr_worker_t *last, uint64_t id)
{
    const tsr_piece_key_t *k = &last->piece.key;
    tsr_worker_t *l = tsr_registry_at_slot(c->reg, k->deployment, k->replica, k->tp_size,
                                           k->pp_size, 0);
    if (l && cancel_at(c, l, id, "nobody waits for it") == 0) c->stats.orphans_cancelled++;
}

void tsr_router_token(tsr_coord_t *c, const tsr_worker_t *w, const tsr_env_t *env)
{
    const Tessera__TokenEvent *t = env->token_event;
    size_t i;
    for (i = 0; i < c->requests->n; i++)
        if (c->requests->v[i].replica >= 0 && c->requests->v[i].wid == t->request_id) break;
    if (i == c->requests->n) {
        c->stats.stale_dropped++;  /* finished, failed or resumed already */
        /* A sequence nobody waits for (a previous coordinator's request, an
         * attempt that was given up) would run to its end: tell its
         * replica's leader to drop it, so its slot serves someone. */
        if (!t->done && !t->error[0] && w->has_piece && w->piece.key.tp == 0 &&
            w->piece.key.stage == w->piece.key.pp_size - 1)
            cancel_orphan(c, w, t->request_id);
        return;
    }
    tsr_request_rec_t *q = &c->requests->v[i];
    if (!token_sender_ok(w, q, t->error[0] != '\0')) {
        c->stats.identity_dropped++;
        tsr_debug("dropped a %s for request %llu from %s, which does not serve it",
                 t->error[0] ? "failure" : "token", (unsigned long long)q->id, w->name);
        return;
    }
    if (t->error[0]) {
        /* The leader keeps the deadline too, and may see it pass before this loop's
         * tick: one outcome either way. */
        if (q->deadline_ms && tsr_now_ms() >= q->deadline_ms) request_expire(c, i);
        /* The replica's failure, not the request's: resume it elsewhere. */
        else if (t->retryable) request_interrupt(c, i, t->error);
        else request_fail_as(c, i, t->busy ? "unavailable" : "failed", t->error);
        return;
    }
    int64_t at = (int64_t)t->index + q->base;
    if (at > q->n_tokens) {
        /* A token was lost between the worker and here: go on from the ones
         * the client has rather than leave a gap. */
        char why[128];
        snprintf(why, sizeof why, "token %d was lost on its way from the replica", q->n_tokens);
        request_interrupt(c, i, why);
        return;
    }
    if (at < q->n_tokens) {
        c->stats.stale_dropped++;  /* a repeat */
        return;
    }
    if (q->n_prompt + q->n_tokens >= q->cap_ids) {
        int cap = q->cap_ids * 2;
        int32_t *ids = realloc(q->ids, (size_t)cap * sizeof *ids);
        if (!ids) {
            request_fail(c, i, "coordinator out of memory for the request's tokens");
            return;
        }
        q->ids = ids;
        q->cap_ids = cap;
    }
    q->ids[q->n_prompt + q->n_tokens] = t->token;
    int index = q->n_tokens++;
    json_t *doc = json_pack("{s:I, s:i, s:i, s:b, s:s}", "request_id", (json_int_t)q->id, "token",
                            t->token, "index", index, "done", t->done, "finish_reason",
                            t->finish_reason);
    /* the first token tells how much of the prompt its replica had cached (a resumed
     * attempt's prompt holds tokens the client got: not counted) */
    int cached = index == 0 && t->cached_tokens <= (uint32_t)q->n_prompt ? (int)t->cached_tokens : 0;
    if (index == 0 && doc) json_object_set_new(doc, "cached_tokens", json_integer(cached));
    if (q->detok && doc) {
        /* The text this token completes; the last one also flushes what is held back. */
        const char *piece;
        size_t plen;
        json_t *str = NULL;
        if (tsr_detok_push(q->detok, t->token, &piece, &plen) == 0) {
            char *all = malloc(plen + 1);
            size_t have = plen;
            if (all) memcpy(all, piece, plen);
            if (all && t->done && tsr_detok_flush(q->detok, &piece, &plen) == 0) {
                char *more = realloc(all, have + plen + 1);
                if (more) memcpy(more + have, piece, plen), have += plen;
                else free(all);
                all = more;
            }
            if (all) str = json_stringn(all, have);
            free(all);
        }
        json_object_set_new(doc, "text", str ? str : json_string(""));
    }
    int sent = reply_json(c, q, true, NULL, doc);
    json_decref(doc);
    c->stats.tokens++;
    int64_t now = tsr_now_ms();
    tsr_dep_metrics_t *mt = tsr_metrics_of(&c->metrics, q->deployment);
    if (mt) {
        mt->generated_tokens++;
        mt->prompt_cached += (uint64_t)cached;
        if (index == 0) tsr_hist_observe(&mt->ttft, (double)(now - q->started_ms) / 1000.0);
        else tsr_hist_observe(&mt->itl, (double)(now - q->last_token_ms) / 1000.0);
    }
    q->last_token_ms = now;
    q->progress_ms = c->now_ms ? c->now_ms : now;
    if (t->done) {
        tsr_dep_state_t *ds = tsr_coord_dep(c, q->deployment);
        /* its answer's blocks too (the last token was never fed): a next turn resends them */
        const tsr_deployment_t *d = tsr_config_find(c->cfg, q->deployment);
        if (d && !on_finishing(c, q)) prefix_routed(c, d, q->replica, q->ids, q->n_prompt + q->n_tokens - 1);
        if (ds && ds->completed && q->replica < ds->n_completed && !on_finishing(c, q))
            ds->completed[q->replica]++;
        if (mt) tsr_hist_observe(&mt->duration, (double)(now - q->started_ms) / 1000.0);
        tsr_metrics_outcome(&c->metrics, q->deployment, !strcmp(t->finish_reason, "eos") ? "stop" : "length");
        request_remove(c, i);
    }
    else if (sent == TSR_REPLY_GONE) request_cancel(c, i, "the client went away");
}
