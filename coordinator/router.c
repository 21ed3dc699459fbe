/* router.c: generation requests.  A request goes to the leader of the ready
 * replica with the fewest requests in flight; its tokens come back from the
 * replica's last stage and are streamed to the client that asked.  A
 * request whose replica loses a worker or is rewired fails at once with the
 * reason: it never hangs.
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

#include "common/log.h"
#include "coordinator.h"

#define MAX_TOKENS_LIMIT 1000000
#define TIMEOUT_MS_LIMIT 86400000u  /* a day */

/* Streams one document (or a failure) to the client that sent request q.
 * Returns one of TSR_REPLY_*; a reply lost to a full queue is counted. */
static int reply_json(tsr_coord_t *c, tsr_request_rec_t *q, bool ok, const char *error,
                      json_t *doc)
{
    char *s = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    int rc = tsr_control_reply(c, q->rid, q->rid_len, ok, error, s);
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

static void request_remove(tsr_coord_t *c, size_t i)
{
    c->reqs[i] = c->reqs[--c->n_reqs];
}

static void request_fail(tsr_coord_t *c, size_t i, const char *why)
{
    char msg[768];
    tsr_request_rec_t *q = &c->reqs[i];
    snprintf(msg, sizeof msg, "request %llu on %s replica %d failed after %d token(s): %s",
             (unsigned long long)q->id, q->deployment, q->replica, q->n_tokens, why);
    tsr_warn("%s", msg);
    reply_json(c, q, false, msg, NULL);  /* a client that left needs no answer */
    c->stats.requests_failed++;
    request_remove(c, i);
}

/* Tells the leader request q was sent to that it is over.  A leader that died
 * or was given a new epoch since has dropped the request already (its
 * replica's requests were failed then). */
static void send_cancel(tsr_coord_t *c, const tsr_request_rec_t *q, const char *reason)
{
    tsr_worker_t *w = tsr_registry_find(c->reg, q->leader);
    if (!w || w->state == TSR_W_DEAD || !w->has_piece || w->piece.epoch != q->epoch) return;
    Tessera__Cancel m = TESSERA__CANCEL__INIT;
    m.request_id = q->id;
    m.reason = (char *)reason;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = q->epoch;
    env.worker = w->name;
    env.body_case = TESSERA__ENVELOPE__BODY_CANCEL;
    env.cancel = &m;
    if (tsr_wire_send(c->wsock, w->rid, w->rid_len, &env) < 0)
        tsr_warn("request %llu: could not send Cancel to %s (%s)", (unsigned long long)q->id,
                 w->name, zmq_strerror(errno));
}

/* Ends request i early: the leader is told to drop it, and it is forgotten. */
static void request_cancel(tsr_coord_t *c, size_t i, const char *reason)
{
    tsr_request_rec_t *q = &c->reqs[i];
    tsr_info("request %llu on %s replica %d cancelled after %d token(s): %s",
             (unsigned long long)q->id, q->deployment, q->replica, q->n_tokens, reason);
    send_cancel(c, q, reason);
    c->stats.requests_cancelled++;
    request_remove(c, i);
}

int64_t tsr_requests_expire(tsr_coord_t *c, int64_t now_ms)
{
    int64_t next = 0;
    for (size_t i = c->n_reqs; i-- > 0;) {
        tsr_request_rec_t *q = &c->reqs[i];
        if (!q->deadline_ms) continue;
        if (q->deadline_ms > now_ms) {
            if (!next || q->deadline_ms < next) next = q->deadline_ms;
            continue;
        }
        char msg[512], reason[64];
        snprintf(msg, sizeof msg,
                 "request %llu passed its deadline of %u ms after %d token(s) (%s replica %d)",
                 (unsigned long long)q->id, q->timeout_ms, q->n_tokens, q->deployment,
                 q->replica);
        snprintf(reason, sizeof reason, "deadline of %u ms passed", q->timeout_ms);
        reply_json(c, q, false, msg, NULL);
        c->stats.requests_failed++;
        request_cancel(c, i, reason);
    }
    return next;
}

void tsr_requests_fail_replica(tsr_coord_t *c, const char *deployment, int replica,
                               const char *why)
{
    for (size_t i = c->n_reqs; i-- > 0;)
        if (!strcmp(c->reqs[i].deployment, deployment) && c->reqs[i].replica == replica)
            request_fail(c, i, why);
}

void tsr_requests_drop_keys(tsr_coord_t *c)
{
    for (size_t i = c->n_reqs; i-- > 0;) {
        tsr_request_rec_t *q = &c->reqs[i];
        if (!c->zap || tsr_zap_allowed(c->zap, q->key_id)) continue;
        char msg[256];
        snprintf(msg, sizeof msg, "request %llu ended after %d token(s): the key '%s' was "
                 "removed from the key store", (unsigned long long)q->id, q->n_tokens, q->key_id);
        reply_json(c, q, false, msg, NULL);
        c->stats.requests_failed++;
        request_cancel(c, i, "the client's key was removed from the key store");
    }
}

int tsr_requests_in_flight(const tsr_coord_t *c, const char *deployment, int replica)
{
    int n = 0;
    for (size_t i = 0; i < c->n_reqs; i++)
        n += !strcmp(c->reqs[i].deployment, deployment) &&
             (replica < 0 || c->reqs[i].replica == replica);
    return n;
}

/* The leader of replica r when every piece of it is ready, else NULL. */
static tsr_worker_t *ready_leader(tsr_coord_t *c, const tsr_deployment_t *d, int r)
{
    int ready = 0;
    tsr_worker_t *leader = NULL;
    size_t n = tsr_registry_size(c->reg);
    for (size_t i = 0; i < n; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        if (w->state != TSR_W_READY || !w->has_piece || strcmp(w->piece.deployment, d->name) ||
            w->piece.replica != r || w->piece.tp_size != d->tensor ||
            w->piece.pp_size != d->pipeline)
            continue;
        ready++;
        if (w->piece.stage == 0 && w->piece.tp == 0) leader = w;
    }
    return ready == d->tensor * d->pipeline ? leader : NULL;
}

/* A request id nobody can guess from the ones they saw (63 random bits, so
 * it stays a positive JSON integer), unique among the requests in flight.
 * Returns 0 when the kernel has no random bytes to give. */
static uint64_t new_request_id(const tsr_coord_t *c)
{
    for (;;) {
        uint64_t id;
        if (tsr_random(&id, sizeof id) < 0) return 0;
        id &= (1ull << 63) - 1;
        if (!id) continue;
        size_t i;
        for (i = 0; i < c->n_reqs && c->reqs[i].id != id; i++) {}
        if (i == c->n_reqs) return id;
    }
}

static void refuse(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, const char *msg)
{
    tsr_control_reply(c, rid, rid_len, false, msg, NULL);
}

void tsr_router_generate(tsr_coord_t *c, const uint8_t *rid, size_t rid_len,
                         const Tessera__ControlRequest *q)
{
    char msg[512];
    int di = -1;
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        if (!strcmp(c->cfg->deployments[i].name, q->deployment)) di = (int)i;
    if (di < 0) {
        snprintf(msg, sizeof msg, "no deployment named '%s'", q->deployment);
        refuse(c, rid, rid_len, msg);
        return;
    }
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    const tsr_model_info_t *m = &c->deps[di].model;
    if (q->n_prompt == 0 || q->n_prompt > (size_t)d->max_seq_len) {
        snprintf(msg, sizeof msg, "the prompt has %zu token(s); %s takes 1 to %d (max_seq_len)",
                 q->n_prompt, d->name, d->max_seq_len);
        refuse(c, rid, rid_len, msg);
        return;
    }
    for (size_t i = 0; i < q->n_prompt; i++)
        if (q->prompt[i] < 0 || (c->deps[di].model_ok && q->prompt[i] >= m->vocab_size)) {
            snprintf(msg, sizeof msg, "prompt token %zu is %d, outside the vocabulary of %d", i,
                     q->prompt[i], m->vocab_size);
            refuse(c, rid, rid_len, msg);
            return;
        }
    /* The worker counts tokens in an int: 2^31 would wrap. */
    if (q->max_tokens < 1 || q->max_tokens > MAX_TOKENS_LIMIT) {
        snprintf(msg, sizeof msg, "max_tokens must be 1 to %d, got %u", MAX_TOKENS_LIMIT,
                 q->max_tokens);
        refuse(c, rid, rid_len, msg);
        return;
    }
    if (q->timeout_ms > TIMEOUT_MS_LIMIT) {
        snprintf(msg, sizeof msg, "timeout_ms must be 0 (no deadline) to %u, got %u",
                 TIMEOUT_MS_LIMIT, q->timeout_ms);
        refuse(c, rid, rid_len, msg);
        return;
    }
    if (!(q->temperature >= 0.0f && q->temperature <= 100.0f) ||
        !(q->top_p >= 0.0f && q->top_p <= 1.0f)) {
        refuse(c, rid, rid_len, "temperature must be 0 to 100 and top_p 0 to 1");
        return;
    }
    /* The ready replica with the least work in flight. */
    tsr_worker_t *leader = NULL;
    int replica = -1, best = 0;
    for (int r = 0; r < d->replicas; r++) {
        tsr_worker_t *l = ready_leader(c, d, r);
        int load = tsr_requests_in_flight(c, d->name, r);
        if (l && (!leader || load < best)) leader = l, replica = r, best = load;
    }
    if (!leader) {
        snprintf(msg, sizeof msg, "%s has no ready replica (see `tessera status`)", d->name);
        refuse(c, rid, rid_len, msg);
        return;
    }
    if (c->n_reqs == c->cap_reqs) {
        size_t cap = c->cap_reqs ? c->cap_reqs * 2 : 16;
        tsr_request_rec_t *a = realloc(c->reqs, cap * sizeof *a);
        if (!a) {
            refuse(c, rid, rid_len, "coordinator out of memory");
            return;
        }
        c->reqs = a;
        c->cap_reqs = cap;
    }
    uint64_t id = new_request_id(c);
    if (!id) {
        refuse(c, rid, rid_len, "coordinator cannot read random bytes for a request id");
        return;
    }
    tsr_request_rec_t *rec = &c->reqs[c->n_reqs++];
    memset(rec, 0, sizeof *rec);
    rec->id = id;
    memcpy(rec->rid, rid, rid_len);
    rec->rid_len = rid_len;
    snprintf(rec->key_id, sizeof rec->key_id, "%s", c->msg_key);
    snprintf(rec->deployment, sizeof rec->deployment, "%s", d->name);
    rec->replica = replica;
    snprintf(rec->leader, sizeof rec->leader, "%s", leader->name);
    rec->epoch = leader->piece.epoch;
    rec->started_ms = tsr_now_ms();
    rec->timeout_ms = q->timeout_ms;
    rec->deadline_ms = q->timeout_ms ? rec->started_ms + q->timeout_ms : 0;
    c->stats.requests++;

    /* Tell the client at once that the request is on its way, so it can
     * tell a missing coordinator from a slow prefill.  A client that has
     * already left costs the replica nothing. */
    json_t *ack = json_pack("{s:I, s:i, s:s, s:b}", "request_id", (json_int_t)rec->id,
                            "replica", replica, "leader", leader->name, "accepted", 1);
    int sent = reply_json(c, rec, true, NULL, ack);
    json_decref(ack);
    if (sent == TSR_REPLY_GONE) {
        tsr_info("request %llu: the client left before it was sent", (unsigned long long)rec->id);
        request_remove(c, c->n_reqs - 1);
        return;
    }

    Tessera__Generate g = TESSERA__GENERATE__INIT;
    g.request_id = rec->id;
    g.n_prompt = q->n_prompt;
    g.prompt = q->prompt;
    g.max_tokens = q->max_tokens;
    g.temperature = q->temperature;
    g.top_p = q->top_p;
    g.seed = q->seed;
    g.timeout_ms = q->timeout_ms;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = leader->piece.epoch;
    env.worker = leader->name;
    env.body_case = TESSERA__ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    if (tsr_wire_send(c->wsock, leader->rid, leader->rid_len, &env) < 0) {
        snprintf(msg, sizeof msg, "could not send it to the leader %s (%s)", leader->name,
                 zmq_strerror(errno));
        request_fail(c, c->n_reqs - 1, msg);
        return;
    }
    tsr_debug("request %llu -> %s replica %d (leader %s)", (unsigned long long)rec->id, d->name,
              replica, leader->name);
}

/* Whether w may speak for request q: a member of the replica it was routed
 * to; for a token (not an error), the one that samples: last stage, tp 0.
 * The leader sends refusals and cancellations, the last stage tokens. */
static bool token_sender_ok(const tsr_worker_t *w, const tsr_request_rec_t *q, bool is_error)
{
    if (w->state == TSR_W_DEAD || !w->has_piece || strcmp(w->piece.deployment, q->deployment) ||
        w->piece.replica != q->replica)
        return false;
    return is_error || (w->piece.stage == w->piece.pp_size - 1 && w->piece.tp == 0);
}

void tsr_router_token(tsr_coord_t *c, const tsr_worker_t *w, const tsr_env_t *env)
{
    const Tessera__TokenEvent *t = env->token_event;
    size_t i;
    for (i = 0; i < c->n_reqs; i++)
        if (c->reqs[i].id == t->request_id) break;
    if (i == c->n_reqs) {
        c->stats.stale_dropped++;  /* finished or failed already */
        return;
    }
    tsr_request_rec_t *q = &c->reqs[i];
    if (!token_sender_ok(w, q, t->error[0] != '\0')) {
        c->stats.identity_dropped++;
        tsr_debug("dropped a %s for request %llu from %s, which does not serve it",
                 t->error[0] ? "failure" : "token", (unsigned long long)q->id, w->name);
        return;
    }
    if (t->error[0]) {
        request_fail(c, i, t->error);
        return;
    }
    if ((int)t->index != q->n_tokens) {
        c->stats.stale_dropped++;  /* a repeat */
        return;
    }
    q->n_tokens++;
    json_t *doc = json_pack("{s:I, s:i, s:i, s:b, s:s}", "request_id", (json_int_t)q->id, "token",
                            t->token, "index", (int)t->index, "done", t->done, "finish_reason",
                            t->finish_reason);
    int sent = reply_json(c, q, true, NULL, doc);
    json_decref(doc);
    c->stats.tokens++;
    if (t->done) request_remove(c, i);
    else if (sent == TSR_REPLY_GONE) request_cancel(c, i, "the client went away");
}
