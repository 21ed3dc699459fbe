/* loop.c: the coordinator's event loop: its sockets, the dispatch of each message
 * to the layer that handles it, and the periodic work of the tick.  Calls go down
 * from here: control (control.c), requests (router.c), placement (placement.c,
 * register.c, reload.c), state (state.c, assign.c, the registry). */
#include "loop.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "assign.h"
#include "common/log.h"
#include "common/util.h"
#include "control.h"
#include "deptok.h"
#include "health.h"
#include "metrics.h"
#include "placement.h"
#include "register.h"
#include "relay.h"
#include "replan.h"
#include "reply.h"
#include "autoscale.h"
#include "canary.h"
#include "rebalance.h"
#include "reshard.h"
#include "router.h"


/* Clients are asked whether they are still there at most this often. */
#define PROBE_GAP_MS 100

/* Binds the workers and control endpoints and the HTTP server's in-process bridge;
 * the key store's handler is already bound (tsr_state_open). */
static int bind_sockets(tsr_coord_t *c, char *err, size_t errlen)
{
    char e[512];
    c->wsock = tsr_sock_router_sec(c->cfg->workers_endpoint, TSR_WIRE_MAX_WORKER, &c->sec, e,
                                   sizeof e);
    if (!c->wsock) {
        snprintf(err, errlen, "workers_endpoint: %s", e);
        return -1;
    }
    /* Requests up to twice the decoder's limit are read, so one over the
     * limit can be answered with the limit named; ZeroMQ cuts off larger. */
    c->csock = tsr_sock_router_sec(c->cfg->control_endpoint, 2 * (size_t)TSR_WIRE_MAX_REQUEST,
                                   &c->sec, e, sizeof e);
    if (!c->csock) {
        snprintf(err, errlen, "control_endpoint: %s", e);
        return -1;
    }
    /* The HTTP server's threads speak to the loop as control clients, in process, on a
     * socket of their own: no key is needed where nothing outside the process reaches. */
    if (c->cfg->http_endpoint) {
        snprintf(c->bridge, sizeof c->bridge, "inproc://tessera-http-%p", (void *)c);
        c->bsock = tsr_sock_router_sec(c->bridge, 2 * (size_t)TSR_WIRE_MAX_REQUEST, NULL, e,
                                       sizeof e);
        int one = 1;
        if (!c->bsock ||
            zmq_setsockopt(c->bsock, ZMQ_ROUTER_MANDATORY, &one, sizeof one) != 0) {
            snprintf(err, errlen, "http_endpoint: cannot bind %s: %s", c->bridge,
                     c->bsock ? zmq_strerror(errno) : e);
            return -1;
        }
    }
    /* With CURVE, ZeroMQ turns away a plain client, or one whose handshake
     * cannot be read (its coordinator.pub is not ours), before the key
     * handler sees it: only these monitors see those refusals. */
    /* A plain client often sees the mismatch first and closes: ZeroMQ tells
     * this side only that a handshake ended without detail, so that counts
     * too (it is also what a client going away mid-handshake looks like). */
    int refused = c->sec.curve
                      ? ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL
                      : 0;
    c->cmon = tsr_sock_monitor(c->csock, ZMQ_EVENT_DISCONNECTED | refused);
    if (refused) c->wmon = tsr_sock_monitor(c->wsock, refused);
    /* A reply to a client that went away fails (EHOSTUNREACH) instead of
     * vanishing, and one to a slow client fails with EAGAIN: the router
     * cancels a request whose client left, never one that reads slowly. */
    int mandatory = 1;
    if (zmq_setsockopt(c->csock, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory) != 0) {
        snprintf(err, errlen, "control_endpoint: cannot set ZMQ_ROUTER_MANDATORY: %s",
                 zmq_strerror(errno));
        return -1;
    }
    return 0;
}

tsr_coord_t *tsr_coord_new(const char *config_path, int adopt_grace_ms, char *err, size_t errlen)
{
    tsr_coord_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    if (!(c->place = tsr_placement_new()) || !(c->requests = tsr_requests_new())) {
        snprintf(err, errlen, "out of memory");
        tsr_placement_destroy(&c->place);
        free(c);
        return NULL;
    }
    if (tsr_state_open(c, config_path, err, errlen) < 0 || bind_sockets(c, err, errlen) < 0) {
        tsr_coord_destroy(&c);
        return NULL;
    }
    c->started_ms = tsr_now_ms();
    tsr_coord_plan_after(
        c, c->started_ms + (adopt_grace_ms < 0 ? c->cfg->worker_timeout_ms : adopt_grace_ms));
    return c;
}

void tsr_coord_destroy(tsr_coord_t **self_p)
{
    if (!self_p || !*self_p) return;
    tsr_coord_t *c = *self_p;
    if (c->wsock) tsr_sock_monitor_close(c->wsock, &c->wmon);
    tsr_sock_close(&c->wsock);
    if (c->csock) tsr_sock_monitor_close(c->csock, &c->cmon);
    tsr_sock_close(&c->csock);
    tsr_sock_close(&c->bsock);
    /* Each layer frees what it owns, the upper ones first. */
    tsr_requests_destroy(&c->requests);
    tsr_metrics_free(&c->metrics);
    tsr_placement_destroy(&c->place);
    tsr_state_close(c);
    free(c);
    *self_p = NULL;
}

/* A message about a piece is only meaningful for the epoch it was assigned
 * in; anything older was overtaken by a newer plan. */
static bool piece_msg_current(tsr_coord_t *c, tsr_worker_t *w, const tsr_env_t *env)
{
    if (w->has_piece && env->epoch == w->piece.epoch) return true;
    c->stats.stale_dropped++;
    tsr_debug("dropped stale %s from %s (epoch %llu)", tsr_env_kind(env), w->name,
              (unsigned long long)env->epoch);
    return false;
}

/* Worker w is dead for the reason why, now: its replica's requests fail
 * with it and its piece is replanned. */
static void declare_dead(tsr_coord_t *c, tsr_worker_t *w, int64_t now, const char *why)
{
    if (w->has_piece) {
        tsr_requests_fail_replica(c, w->piece.key.deployment, w->piece.key.replica, why);
        tsr_coord_mark_lost(c, tsr_coord_dep_index(c, w->piece.key.deployment),
                            w->piece.key.replica);
    }
    tsr_health_mark_dead(c->reg, w, now, why);
    c->stats.deaths++;
    tsr_coord_mark_dirty(c);
}

static void on_worker_msg(tsr_coord_t *c, const tsr_client_t *from, tsr_env_t *env, int64_t now)
{
    const uint8_t *rid = from->rid;
    size_t rid_len = from->rid_len;
    c->stats.messages++;
    if (env->body_case == TESSERA__ENVELOPE__BODY_REGISTER) {
        tsr_register_worker(c, rid, rid_len, from->key_id, env, now);
        return;
    }
    if (env->protocol_version != TSR_PROTOCOL_VERSION) {
        c->stats.bad_messages++;
        return;
    }
    tsr_worker_t *w = tsr_registry_find(c->reg, env->worker);
    if (!w) {
        /* A worker that was registered with a previous coordinator: ask it to
         * register again with the piece it holds, so it can be adopted. */
        tsr_coord_send_reset(c, rid, rid_len, env->worker, true, "unknown to this coordinator; register");
        return;
    }
    if (w->state == TSR_W_DEAD) {
        char why[600];
        snprintf(why, sizeof why, "declared dead (%s); register again as idle", w->reason);
        tsr_coord_send_reset(c, rid, rid_len, env->worker, false, why);
        return;
    }
    /* The name in a message is a claim; the routing id is the connection it
     * came from.  A worker keeps its routing id across reconnections (see
     * tsr_sock_dealer), so a mismatch is another process using its name:
     * dropped, so it can neither keep the name alive nor speak for it. */
    if (w->rid_len != rid_len || memcmp(w->rid, rid, rid_len) || strcmp(w->key_id, from->key_id)) {
        c->stats.identity_dropped++;
        tsr_debug("dropped %s claiming to be %s from another connection", tsr_env_kind(env),
                  w->name);
        return;
    }
    w->last_seen_ms = now;

    /* a standby assignment's messages are its move's (rebalance.c, reshard.c) */
    if ((env->body_case == TESSERA__ENVELOPE__BODY_READY ||
         env->body_case == TESSERA__ENVELOPE__BODY_PROGRESS ||
         env->body_case == TESSERA__ENVELOPE__BODY_FAILED) &&
        (tsr_rebalance_message(c, w, env) || tsr_reshard_message(c, w, env)))
        return;
    switch (env->body_case) {
    case TESSERA__ENVELOPE__BODY_HEARTBEAT:
        tsr_register_heartbeat(c, w, env, now);
        break;
    case TESSERA__ENVELOPE__BODY_RENDEZVOUS_OFFER:
        if (!piece_msg_current(c, w, env)) break;
        tsr_relay_rendezvous(c, w, env);
        break;
    case TESSERA__ENVELOPE__BODY_PROGRESS:
        if (!piece_msg_current(c, w, env)) break;
        snprintf(w->detail, sizeof w->detail, "%s", env->progress->detail);
        break;
    case TESSERA__ENVELOPE__BODY_READY:
        if (!piece_msg_current(c, w, env)) break;
        if (w->state != TSR_W_READY) {
            tsr_info("worker %s ready with %s r%d s%d t%d", w->name, w->piece.key.deployment,
                     w->piece.key.replica, w->piece.key.stage, w->piece.key.tp);
            w->ready_seq = ++c->ready_seq;
        }
        w->state = TSR_W_READY;
        w->detail[0] = '\0';
        tsr_coord_note_ready(c, w);
        break;
    case TESSERA__ENVELOPE__BODY_FAILED:
        if (!env->failed->fatal && !piece_msg_current(c, w, env)) break;
        if (env->failed->fatal) {
            char why[600];
            snprintf(why, sizeof why, "fatal error: %s", env->failed->reason);
            tsr_error("worker %s is dead: %s", w->name, why);
            declare_dead(c, w, now, why);
        } else {
            tsr_error("worker %s reports %s r%d s%d t%d failed: %s", w->name,
                      w->piece.key.deployment, w->piece.key.replica, w->piece.key.stage, w->piece.key.tp,
                      env->failed->reason);
            w->state = TSR_W_FAILED;
            w->retryable = env->failed->retryable;
            w->past_deadline = env->failed->retryable && env->failed->past_deadline;
            snprintf(w->reason, sizeof w->reason, "%s", env->failed->reason);
            /* Its replica serves nothing until it is rewired: its requests
             * resume on another one now rather than at their next error. */
            char why[600];
            snprintf(why, sizeof why, "worker %s (stage %d tp %d) failed: %s", w->name,
                     w->piece.key.stage, w->piece.key.tp, env->failed->reason);
            tsr_requests_fail_replica(c, w->piece.key.deployment, w->piece.key.replica, why);
            tsr_coord_retry_failed(c, w, now);
        }
        break;
    case TESSERA__ENVELOPE__BODY_TOKEN_EVENT:
        if (!tsr_canary_token(c, w, env->token_event)) tsr_router_token(c, w, env);
        break;
    default:
        c->stats.bad_messages++;
        tsr_warn("unexpected %s from worker %s", tsr_env_kind(env), w->name);
    }
}

/* Reads up to budget messages from one ROUTER and hands each valid one to
 * handle; rejected ones are counted and logged with the channel's name. */
static void drain_one(tsr_coord_t *c, void *sock, const char *channel, size_t max, int budget,
                      void (*handle)(tsr_coord_t *, const tsr_client_t *, tsr_env_t *, int64_t))
{
    uint8_t rid[256];
    size_t rid_len;
    char key[TSR_KEY_ID_MAX];
    tsr_client_t from = {.sock = sock, .rid = rid, .key_id = key};
    char err[256];
    int64_t now = tsr_now_ms();
    for (int i = 0; i < budget; i++) {
        tsr_env_t *env = NULL;
        rid_len = 0;
        key[0] = '\0';
        int rc = tsr_wire_recv_user(sock, rid, &rid_len, key, sizeof key, max,
                                    &env, err, sizeof err);
        if (rc == 0) break;
        /* A session whose key was removed from the store is over, even
         * before the next key check sees it: nothing it says is heard.  (The
         * HTTP bridge is in-process: its callers were checked by the server.) */
        if (c->zap && sock != c->bsock && !tsr_zap_allowed(c->zap, key)) {
            c->stats.key_dropped++;
            tsr_env_free(&env);
            continue;
        }
        if (rc < 0) {
            c->stats.bad_messages++;
            tsr_warn("rejected a message on the %s endpoint: %s", channel, err);
            /* A client waits for an answer: tell it why (the limit, the
             * field over its length) rather than leave it guessing. */
            if (sock != c->wsock && rid_len > 0) {
                char msg[320];
                snprintf(msg, sizeof msg, "request rejected: %s", err);
                from.rid_len = rid_len;
                tsr_control_answer(c, &from, false, "invalid", msg, NULL);
            }
            continue;
        }
        if ((i & 255) == 255) now = tsr_now_ms();
        from.rid_len = rid_len;
        handle(c, &from, env, now);   /* control replies go back where asked */
        tsr_env_free(&env);
    }
}

static void on_control_msg(tsr_coord_t *c, const tsr_client_t *from, tsr_env_t *env,
                           int64_t now)
{
    (void)now;
    c->stats.control_requests++;
    tsr_control_handle(c, from, env);
}

#define HANDSHAKE_LOG_GAP_MS 10000  /* a refused client retries every second or so */

/* A handshake ZeroMQ refused on one of the endpoints (protocol error code
 * value): counted, and logged at most every HANDSHAKE_LOG_GAP_MS per
 * endpoint and cause. */
static void handshake_refused(tsr_coord_t *c, int which, const char *channel, int ev,
                              uint32_t value)
{
    c->stats.handshakes_failed++;
    int cause = ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL              ? 3
                : value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH ? 0
                : value == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC      ? 1
                                                                      : 2;
    uint64_t held;
    if (!tsr_log_limit_pass(&c->hs_log[which][cause], tsr_now_ms(), HANDSHAKE_LOG_GAP_MS, &held))
        return;
    char why[256], more[96] = "";
    if (cause == 0)
        snprintf(why, sizeof why, "the client does not use CURVE (a worker or CLI without "
                 "keys: --keys, TESSERA_KEYS)");
    else if (cause == 1)
        snprintf(why, sizeof why, "its CURVE handshake cannot be read: the client's "
                 "coordinator.pub is not this coordinator's (%s/coordinator.pub)",
                 c->cfg->keys_dir);
    else if (cause == 2)
        snprintf(why, sizeof why, "handshake protocol error 0x%x (not a Tessera client?)",
                 (unsigned)value);
    else
        snprintf(why, sizeof why, "the client closed it during the CURVE handshake (as one "
                 "without keys does: --keys, TESSERA_KEYS; or it went away)");
    if (held)
        snprintf(more, sizeof more, "; %llu more refused there since the last such line",
                 (unsigned long long)held);
    tsr_warn("refused a connection on the %s endpoint: %s%s", channel, why, more);
}

void tsr_coord_drain_sockets(tsr_coord_t *c, int budget)
{
    drain_one(c, c->wsock, "workers", TSR_WIRE_MAX_WORKER, budget, on_worker_msg);
    drain_one(c, c->csock, "control", TSR_WIRE_MAX_REQUEST, budget, on_control_msg);
    /* HTTP requests come in small batches, so heartbeats are read between them however
     * many HTTP clients there are. */
    if (c->bsock)
        drain_one(c, c->bsock, "HTTP bridge", TSR_WIRE_MAX_REQUEST, budget < 64 ? budget : 64,
                  on_control_msg);
    /* A client connection closed: whose it was ZeroMQ does not say, so the
     * clients of the requests in flight are asked (tick), at most every
     * PROBE_GAP_MS, and those that are gone have their requests cancelled. */
    int ev;
    uint32_t value;
    while (c->cmon && (ev = tsr_sock_monitor_event_v(c->cmon, &value)) >= 0) {
        if (ev != ZMQ_EVENT_DISCONNECTED) {
            handshake_refused(c, 1, "control", ev, value);
            continue;
        }
        tsr_debug("a client disconnected; probing %zu request(s)", tsr_requests_count(c));
        if (!c->probe_due_ms) c->probe_due_ms = c->last_probe_ms + PROBE_GAP_MS;
    }
    while (c->wmon && (ev = tsr_sock_monitor_event_v(c->wmon, &value)) >= 0)
        handshake_refused(c, 0, "workers", ev, value);
}

static void on_dead(tsr_worker_t *w, void *arg)
{
    tsr_coord_t *c = arg;
    if (w->has_piece) {
        char why[256];
        snprintf(why, sizeof why, "worker %s (stage %d tp %d) stopped answering", w->name,
                 w->piece.key.stage, w->piece.key.tp);
        tsr_requests_fail_replica(c, w->piece.key.deployment, w->piece.key.replica, why);
        tsr_coord_mark_lost(c, tsr_coord_dep_index(c, w->piece.key.deployment),
                            w->piece.key.replica);
    }
    c->stats.deaths++;
    tsr_coord_mark_dirty(c);
    if (w->has_piece)
        tsr_error("worker %s on %s is dead (no heartbeat for %lld ms); its piece %s r%d s%d t%d "
                  "will move",
                  w->name, w->node, (long long)(c->now_ms - w->last_seen_ms),
                  w->piece.key.deployment, w->piece.key.replica, w->piece.key.stage, w->piece.key.tp);
    else if (w->finishing)
        tsr_error("worker %s on %s, finishing the requests of %s r%d of the old cut, is dead (no "
                  "heartbeat): they resume on the new cut", w->name, w->node,
                  w->finished.key.deployment, w->finished.key.replica);
    else
        tsr_warn("idle worker %s on %s is dead (no heartbeat)", w->name, w->node);
}

/* Ends the sessions of keys removed from the store: their workers are
 * dead (their pieces move), their clients' requests fail. */
static void drop_removed_keys(tsr_coord_t *c, int64_t now)
{
    uint64_t g = tsr_zap_generation(c->zap);
    if (g == c->zap_generation) return;
    c->zap_generation = g;
    size_t n = tsr_registry_size(c->reg);
    for (size_t i = 0; i < n; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        if (w->state == TSR_W_DEAD || tsr_zap_allowed(c->zap, w->key_id)) continue;
        char why[256], name[TSR_NAME_MAX + 1];
        snprintf(why, sizeof why, "its key '%s' was removed from the key store (or replaced)",
                 tsr_key_name(w->key_id, name, sizeof name));
        tsr_warn("worker %s is cut off: %s", w->name, why);
        declare_dead(c, w, now, why);
    }
    tsr_requests_drop_keys(c);
}

int tsr_coord_tick(tsr_coord_t *c, int64_t now_ms)
{
    int scan = tsr_health_scan_interval_ms(c->cfg->heartbeat_interval_ms);
    c->now_ms = now_ms;
    tsr_deptok_collect(c);
    if (c->zap) drop_removed_keys(c, now_ms);
    int64_t deadline = tsr_requests_expire(c, now_ms);
    tsr_coord_run_retries(c, now_ms);
    if (now_ms >= c->next_scan_ms) {
        tsr_health_scan(c->reg, now_ms, c->cfg->worker_timeout_ms, on_dead, c);
        /* Dead workers are shown for a while, then forgotten, so the
         * registry and the status document stay bounded. */
        c->stats.workers_forgotten += tsr_registry_forget_dead(
            c->reg, now_ms - (int64_t)c->cfg->dead_worker_ttl_s * 1000);
        c->next_scan_ms = now_ms + scan;
    }
    int64_t scale = tsr_autoscale_tick(c, now_ms);
    int64_t moving = tsr_rebalance_tick(c, now_ms);
    if (moving && (!scale || moving < scale)) scale = moving;
    moving = tsr_reshard_tick(c, now_ms);
    if (moving && (!scale || moving < scale)) scale = moving;
    if (tsr_coord_plan_ready(c, now_ms)) tsr_coord_plan(c, now_ms);
    if (c->probe_due_ms && now_ms >= c->probe_due_ms) {
        c->probe_due_ms = 0;
        c->last_probe_ms = now_ms;
        tsr_requests_probe_clients(c);
    }
    /* Interrupted requests go to replicas that are ready now. */
    int64_t give_up = tsr_requests_dispatch(c, now_ms);
    if (give_up && (!deadline || give_up < deadline)) deadline = give_up;
    int64_t canary = tsr_canary_tick(c, now_ms);
    if (canary && (!deadline || canary < deadline)) deadline = canary;
    if (scale && (!deadline || scale < deadline)) deadline = scale;
    int64_t next = c->next_scan_ms;
    int64_t due = tsr_coord_plan_due(c);
    if (due && due < next) next = due;
    if (deadline && deadline < next) next = deadline;
    if (c->probe_due_ms && c->probe_due_ms < next) next = c->probe_due_ms;
    int64_t wait = next - now_ms;
    /* A removed key's sessions end within a second: look at least every
     * 100 ms. */
    if (c->zap && wait > 100) wait = 100;
    return wait < 0 ? 0 : (int)wait;
}
