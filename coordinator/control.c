/* control.c: the control API the CLI talks to (status, workers, reload,
 * drain), and the status document. */
#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "coordinator.h"
#include "common/strbuf.h"


/* ---- deployment summaries ------------------------------------------------- */

typedef struct {
    const char *state;          /* ready | loading | degraded | waiting | failed */
    char message[1024];
    int total, ready, placed;
    tsr_worker_t **at;          /* [(replica * pp + stage) * tp + rank] -> holder or NULL */
} dep_summary_t;

static int piece_slot(const tsr_deployment_t *d, int r, int s, int t)
{
    return (r * d->pipeline + s) * d->tensor + t;
}

/* Summarises deployment i; caller frees sum->at. */
static void dep_summarise(tsr_coord_t *c, size_t i, int64_t now, dep_summary_t *sum)
{
    const tsr_deployment_t *d = &c->cfg->deployments[i];
    tsr_dep_state_t *ds = &c->deps[i];
    memset(sum, 0, sizeof *sum);
    sum->total = d->replicas * d->pipeline * d->tensor;  /* <= TSR_MAX_PIECES: checked at load */
    sum->at = calloc((size_t)sum->total, sizeof *sum->at);
    if (!ds->model_ok) {
        sum->state = "failed";
        snprintf(sum->message, sizeof sum->message, "%s", ds->model_error);
        return;
    }
    const char *failure = NULL;
    tsr_worker_t *failed_w = NULL, *mending = NULL;
    int slots = d->pipeline * d->tensor;
    for (int k = 0; k < sum->total && sum->at; k++) {
        tsr_worker_t *w = tsr_registry_at_slot(c->reg, d->name, k / slots, d->tensor,
                                               d->pipeline, k % slots);
        if (!w) continue;  /* unplaced, or held only in an old layout, about to be replaced */
        sum->at[k] = w;
        sum->placed++;
        if (w->state == TSR_W_READY) sum->ready++;
        /* A data-plane failure (retryable) is being mended by a rewire: the
         * deployment is degraded meanwhile, not failed. */
        if (w->state == TSR_W_FAILED && !w->retryable && !failure) {
            failure = w->reason;
            failed_w = w;
        }
        if (w->state == TSR_W_FAILED && w->retryable && !mending) mending = w;
    }
    /* A missing piece is the cause; failures of its peers follow from it. */
    if (sum->placed < sum->total) {
        sum->state = ds->ever_ready ? "degraded" : "waiting";
        char buf[128] = "";
        if (now < c->plan_after_ms)
            snprintf(sum->message, sizeof sum->message,
                     "waiting %lld ms for workers to re-attach before planning",
                     (long long)(c->plan_after_ms - now));
        else if (ds->short_by)
            snprintf(sum->message, sizeof sum->message, "%s (%d of %d pieces placed)",
                     ds->shortage[0] ? ds->shortage
                                     : tsr_shortage_text(ds->short_by, d->device, buf, sizeof buf),
                     sum->placed, sum->total);
        else
            snprintf(sum->message, sizeof sum->message, "%d of %d pieces placed", sum->placed,
                     sum->total);
    } else if (failure) {
        sum->state = "failed";
        snprintf(sum->message, sizeof sum->message, "replica %d stage %d tp %d on %s: %s",
                 failed_w->piece.key.replica, failed_w->piece.key.stage, failed_w->piece.key.tp,
                 failed_w->name, failure);
    } else if (sum->ready == sum->total) {
        sum->state = "ready";  /* ever_ready was set when the last piece became ready */
        /* Ready pieces that do not generate: the canary's verdict. */
        for (int r = 0; ds->canary && r < ds->n_completed; r++)
            if (ds->canary[r].unhealthy) {
                sum->state = "degraded";
                snprintf(sum->message, sizeof sum->message, "replica %d is unhealthy: %s", r,
                         ds->canary[r].why);
                break;
            }
    } else if (mending) {
        sum->state = ds->ever_ready ? "degraded" : "loading";
        char waited[512];
        int nw = tsr_coord_waited_for_text(c, d, mending->piece.key.replica, waited,
                                           sizeof waited);
        snprintf(sum->message, sizeof sum->message,
                 "%d of %d pieces ready; replica %d is being rewired after: %.400s%s%s%s", sum->ready,
                 sum->total, mending->piece.key.replica, mending->reason,
                 nw ? "; its tensor-parallel group waited for " : "", waited,
                 nw ? ", which reported no failure" : "");
    } else {
        sum->state = ds->ever_ready ? "degraded" : "loading";
        snprintf(sum->message, sizeof sum->message, "%d of %d pieces ready", sum->ready,
                 sum->total);
    }
}

char *tsr_coord_deployments_json(tsr_coord_t *c, int64_t now_ms)
{
    json_t *list = json_array();
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        const tsr_deployment_t *d = &c->cfg->deployments[i];
        const tsr_dep_state_t *ds = &c->deps[i];
        dep_summary_t sum;
        dep_summarise(c, i, now_ms, &sum);
        int ready = 0, per = d->pipeline * d->tensor;
        for (int r = 0; sum.at && r < d->replicas; r++) {
            int k = 0;
            for (int p = 0; p < per; p++) {
                const tsr_worker_t *w = sum.at[r * per + p];
                k += w && w->state == TSR_W_READY;
            }
            bool unhealthy = ds->canary && r < ds->n_completed && ds->canary[r].unhealthy;
            ready += k == per && !unhealthy;
        }
        json_array_append_new(list, json_pack("{s:s, s:s, s:s, s:i, s:i}", "name", d->name, "state",
                                              sum.state, "message", sum.message, "ready_replicas",
                                              ready, "replicas", d->replicas));
        free(sum.at);
    }
    json_t *doc = json_pack("{s:o, s:I}", "deployments", list, "uptime_ms",
                            (json_int_t)(now_ms - c->started_ms));
    char *s = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    return s;
}

const char *tsr_coord_dep_state(tsr_coord_t *c, size_t i, int64_t now_ms)
{
    dep_summary_t sum;
    dep_summarise(c, i, now_ms, &sum);
    free(sum.at);
    return sum.state;
}

/* ---- JSON ------------------------------------------------------------------ */

static json_t *holding_json(const tsr_holding_t *h)
{
    const tsr_piece_key_t *k = &h->key;
    return json_pack("{s:s, s:I, s:i, s:i, s:i, s:i, s:i, s:[i,i]}", "deployment", k->deployment,
                     "epoch", (json_int_t)h->epoch, "replica", k->replica, "stage", k->stage,
                     "tp", k->tp, "tp_size", k->tp_size, "pp_size", k->pp_size, "layers",
                     k->layer_begin, k->layer_end);
}

/* The worker list is most of a large cluster's status document, so it is
 * written straight into a buffer: building it as jansson objects cost a
 * quarter of a second at 10,000 workers. */
/* A JSON string.  Bytes outside printable ASCII (names are ASCII; reasons
 * come from workers) are escaped or replaced, so the document stays valid. */
static void sb_str(tsr_sb_t *b, const char *s)
{
    tsr_sb_putn(b, "\"", 1);
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\') {
            char e[2] = {'\\', (char)*c};
            tsr_sb_putn(b, e, 2);
        } else if (*c < 0x20) {
            tsr_sb_printf(b, "\\u%04x", *c);
        } else if (*c >= 0x7f) {
            tsr_sb_putn(b, "?", 1);
        } else {
            tsr_sb_putn(b, (const char *)c, 1);
        }
    }
    tsr_sb_putn(b, "\"", 1);
}

static void sb_kv_str(tsr_sb_t *b, const char *k, const char *v)
{
    tsr_sb_printf(b, ",\"%s\":", k);
    sb_str(b, v);
}

static void worker_json(tsr_sb_t *b, const tsr_worker_t *w, int64_t now)
{
    tsr_sb_puts(b, "{\"name\":");
    sb_str(b, w->name);
    sb_kv_str(b, "node", w->node);
    tsr_sb_printf(b, ",\"pid\":%u,\"device\":\"%s\",\"device_index\":%u", w->pid,
              tsr_device_name(w->device), w->device_index);
    tsr_sb_printf(b, ",\"memory\":%llu,\"memory_used\":%llu", (unsigned long long)w->memory,
              (unsigned long long)w->memory_used);
    tsr_sb_printf(b, ",\"weight_bytes\":%llu,\"kv_bytes\":%llu,\"load\":%.3f",
              (unsigned long long)w->weight_bytes, (unsigned long long)w->kv_bytes,
              (double)w->load);
    tsr_sb_printf(b, ",\"kv_blocks_used\":%u,\"kv_blocks_total\":%u,\"queued\":%u,\"running\":%u",
              w->kv_blocks_used, w->kv_blocks_total, w->queued, w->running);
    tsr_sb_printf(b, ",\"steps\":%llu", (unsigned long long)w->steps);
    sb_kv_str(b, "version", w->version);
    sb_kv_str(b, "data_endpoint", w->data_endpoint);
    sb_kv_str(b, "pci_bus_id", w->pci_bus_id);
    tsr_sb_printf(b, ",\"nccl\":%s", w->nccl ? "true" : "false");
    sb_kv_str(b, "nvlink_domain", w->nvlink_domain);
    tsr_sb_printf(b, ",\"state\":\"%s\",\"drained\":%s,\"heartbeat_age_ms\":%lld,\"heartbeats\":%llu",
              tsr_wstate_name(w->state), w->drained ? "true" : "false",
              (long long)(now - w->last_seen_ms), (unsigned long long)w->heartbeats);
    if (w->has_piece) {
        const tsr_piece_key_t *k = &w->piece.key;
        tsr_sb_puts(b, ",\"assignment\":{\"deployment\":");
        sb_str(b, k->deployment);
        tsr_sb_printf(b, ",\"epoch\":%llu,\"replica\":%d,\"stage\":%d,\"tp\":%d,\"tp_size\":%d,"
                     "\"pp_size\":%d,\"layers\":[%d,%d]}",
                  (unsigned long long)w->piece.epoch, k->replica, k->stage, k->tp, k->tp_size,
                  k->pp_size, k->layer_begin, k->layer_end);
    } else {
        tsr_sb_puts(b, ",\"assignment\":null");
    }
    if (w->reason[0]) sb_kv_str(b, "reason", w->reason);
    if (w->detail[0]) sb_kv_str(b, "detail", w->detail);
    if (w->state == TSR_W_DEAD)  /* and when, on the wall clock, for scripts */
        tsr_sb_printf(b, ",\"dead_for_ms\":%lld,\"dead_at_ms\":%lld",
                  (long long)(now - w->dead_since_ms),
                  (long long)(tsr_wall_ms() - (tsr_now_ms() - w->dead_since_ms)));
    tsr_sb_puts(b, "}");
}

static json_t *deployment_json(tsr_coord_t *c, size_t i, int64_t now)
{
    const tsr_deployment_t *d = &c->cfg->deployments[i];
    dep_summary_t sum;
    dep_summarise(c, i, now, &sum);
    json_t *o = json_pack("{s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:s, s:s, s:i, s:i, s:i}", "name",
                          d->name, "model", d->model_path, "device", tsr_device_name(d->device),
                          "tensor", d->tensor, "pipeline", d->pipeline, "replicas", d->replicas,
                          "max_seq_len", d->max_seq_len, "state", sum.state, "message",
                          sum.message, "pieces", sum.total, "placed", sum.placed, "ready",
                          sum.ready);
    json_object_set_new(o, "max_batch", json_integer(d->max_batch));
    json_object_set_new(o, "prefill_chunk", json_integer(d->prefill_chunk));
    json_object_set_new(o, "kv_cache_mib", json_integer(d->kv_cache_mib));
    json_object_set_new(o, "max_queue", json_integer(d->max_queue));
    json_object_set_new(o, "collective_timeout_ms", json_integer(d->collective_timeout_ms));
    json_object_set_new(o, "kv_dtype", json_string(tsr_kv_dtype_name(d->kv_dtype)));
    /* the configured type resolved for the deployment's device: what its
     * workers are given (auto is f32 on cpu, bf16 on cuda) */
    json_object_set_new(o, "kv_dtype_used",
                        json_string(tsr_kv_dtype_name(tsr_kv_dtype_on(d->device, d->kv_dtype))));
    json_object_set_new(o, "matmul_dtype", json_string(tsr_kv_dtype_name(d->matmul_dtype)));
    json_object_set_new(o, "matmul_dtype_used",
                        json_string(tsr_kv_dtype_name(tsr_kv_dtype_on(d->device, d->matmul_dtype))));
    json_object_set_new(o, "gpu_memory_percent", json_integer(d->gpu_memory_percent));
    /* text prompts: whether its tokenizer.json serves them, and why not when one is there
     * but cannot be used (a model without one takes token ids, which is no fault) */
    json_object_set_new(o, "text_prompts", json_boolean(c->deps[i].tok != NULL));
    if (c->deps[i].tok_broken)
        json_object_set_new(o, "tokenizer_error", json_string(c->deps[i].tok_error));
    /* a reload's new tokenizer.json being read: text prompts are refused until it is in */
    if (c->deps[i].tok_loading) json_object_set_new(o, "tokenizer_loading", json_true());
    if (c->deps[i].short_by) {
        json_t *needs = json_pack("{s:i, s:s}", "workers", c->deps[i].short_by, "device",
                                  tsr_device_name(d->device));
        /* memory was the cause: what one piece needs per device */
        if (c->deps[i].short_memory)
            json_object_set_new(needs, "memory_bytes", json_integer((json_int_t)c->deps[i].short_memory));
        json_object_set_new(o, "needs", needs);
    }
    json_t *reps = json_array();
    for (int r = 0; r < d->replicas && sum.at; r++) {
        json_t *stages = json_array();
        int rready = 0;
        for (int s = 0; s < d->pipeline; s++) {
            int b = 0, e = 0;
            if (c->deps[i].model_ok)
                tsr_layer_split(c->deps[i].model.num_hidden_layers, d->pipeline, s, &b, &e);
            json_t *ranks = json_array();
            for (int t = 0; t < d->tensor; t++) {
                tsr_worker_t *w = sum.at[piece_slot(d, r, s, t)];
                json_t *rk;
                if (w) {
                    rk = json_pack("{s:i, s:s, s:s, s:i, s:s, s:I, s:I}", "tp", t, "worker",
                                   w->name, "node", w->node, "pid", (int)w->pid, "state",
                                   tsr_wstate_name(w->state), "heartbeat_age_ms",
                                   (json_int_t)(now - w->last_seen_ms), "epoch",
                                   (json_int_t)w->piece.epoch);
                    json_object_set_new(rk, "kv_blocks_used", json_integer(w->kv_blocks_used));
                    json_object_set_new(rk, "kv_blocks_total", json_integer(w->kv_blocks_total));
                    json_object_set_new(rk, "queued", json_integer(w->queued));
                    json_object_set_new(rk, "running", json_integer(w->running));
                    if (w->reason[0]) json_object_set_new(rk, "reason", json_string(w->reason));
                    /* its group's other ranks passed their deadline waiting for it */
                    if (tsr_coord_waited_for(c, w)) json_object_set_new(rk, "waited_for", json_true());
                    rready += w->state == TSR_W_READY;
                } else {
                    rk = json_pack("{s:i, s:n, s:s}", "tp", t, "worker", "state", "unplaced");
                }
                json_array_append_new(ranks, rk);
            }
            json_array_append_new(stages, json_pack("{s:i, s:[i,i], s:o}", "stage", s, "layers",
                                                    b, e, "ranks", ranks));
        }
        const char *rs = rready == d->pipeline * d->tensor ? "ready" : "not ready";
        const tsr_dep_state_t *ds = &c->deps[i];
        json_int_t done = ds->completed && r < ds->n_completed ? (json_int_t)ds->completed[r] : 0;
        const tsr_canary_t *k = ds->canary && r < ds->n_completed ? &ds->canary[r] : NULL;
        if (k && k->unhealthy && rready == d->pipeline * d->tensor) rs = "unhealthy";
        json_t *rep = json_pack("{s:i, s:s, s:i, s:I, s:o}", "replica", r, "state", rs,
                                "in_flight", tsr_requests_in_flight(c, d->name, r),
                                "requests_completed", done, "stages", stages);
        if (k && k->unhealthy) json_object_set_new(rep, "reason", json_string(k->why));
        json_array_append_new(reps, rep);
    }
    json_object_set_new(o, "replica_list", reps);
    json_object_set_new(o, "in_flight", json_integer(tsr_requests_in_flight(c, d->name, -1)));
    free(sum.at);
    return o;
}

char *tsr_coord_status_json(tsr_coord_t *c, int64_t now, bool workers_only)
{
    json_t *root = json_object();
    const tsr_coord_stats_t *st = &c->stats;
    json_object_set_new(
        root, "coordinator",
        json_pack("{s:s, s:I, s:I, s:s, s:s, s:i, s:i, s:b, s:{s:I, s:I, s:I, s:I, s:I, s:I, "
                  "s:I, s:I, s:I, s:I, s:I}}",
                  "config", c->config_path, "epoch", (json_int_t)c->epoch, "uptime_ms",
                  (json_int_t)(now - c->started_ms), "workers_endpoint",
                  c->cfg->workers_endpoint, "control_endpoint", c->cfg->control_endpoint,
                  "heartbeat_interval_ms", c->cfg->heartbeat_interval_ms, "worker_timeout_ms",
                  c->cfg->worker_timeout_ms, "planning", now >= c->plan_after_ms, "stats",
                  "messages", (json_int_t)st->messages, "heartbeats", (json_int_t)st->heartbeats,
                  "registrations", (json_int_t)st->registrations, "refused",
                  (json_int_t)st->refused, "stale_dropped", (json_int_t)st->stale_dropped,
                  "bad_messages", (json_int_t)st->bad_messages, "plans", (json_int_t)st->plans,
                  "assigns", (json_int_t)st->assigns, "unassigns", (json_int_t)st->unassigns,
                  "deaths", (json_int_t)st->deaths, "control_requests",
                  (json_int_t)st->control_requests));
    json_t *stats = json_object_get(json_object_get(root, "coordinator"), "stats");
    json_object_set_new(stats, "requests", json_integer((json_int_t)st->requests));
    json_object_set_new(stats, "requests_failed", json_integer((json_int_t)st->requests_failed));
    json_object_set_new(stats, "requests_cancelled",
                        json_integer((json_int_t)st->requests_cancelled));
    json_object_set_new(stats, "replies_dropped", json_integer((json_int_t)st->replies_dropped));
    json_object_set_new(stats, "tokens", json_integer((json_int_t)st->tokens));
    json_object_set_new(stats, "in_flight", json_integer((json_int_t)c->n_reqs));
    json_object_set_new(stats, "identity_dropped", json_integer((json_int_t)st->identity_dropped));
    json_object_set_new(stats, "workers_forgotten",
                        json_integer((json_int_t)st->workers_forgotten));
    json_object_set_new(stats, "key_dropped", json_integer((json_int_t)st->key_dropped));
    json_object_set_new(stats, "requests_replayed",
                        json_integer((json_int_t)st->requests_replayed));
    json_object_set_new(stats, "orphans_cancelled",
                        json_integer((json_int_t)st->orphans_cancelled));
    json_object_set_new(stats, "sends_failed", json_integer((json_int_t)st->sends_failed));
    json_object_set_new(stats, "canaries", json_integer((json_int_t)st->canaries));
    json_object_set_new(stats, "canaries_failed", json_integer((json_int_t)st->canaries_failed));
    json_object_set_new(stats, "rendezvous_relayed",
                        json_integer((json_int_t)st->rendezvous_relayed));
    json_t *coord = json_object_get(root, "coordinator");
    json_object_set_new(coord, "security", json_string(c->zap ? "curve" : "none"));
    if (c->zap) {
        tsr_zap_stats_t zs;
        tsr_zap_stats(c->zap, &zs);
        json_object_set_new(coord, "keys_dir", json_string(c->cfg->keys_dir));
        json_object_set_new(coord, "allowed_keys", json_integer((json_int_t)zs.keys));
        json_object_set_new(stats, "handshakes_accepted", json_integer((json_int_t)zs.accepted));
        json_object_set_new(stats, "handshakes_refused", json_integer((json_int_t)zs.refused));
    }
    if (!workers_only) {
        json_t *deps = json_array();
        for (size_t i = 0; i < c->cfg->n_deployments; i++)
            json_array_append_new(deps, deployment_json(c, i, now));
        json_object_set_new(root, "deployments", deps);
    }
    char *head = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!head) return NULL;
    tsr_sb_t b = {0};
    tsr_sb_putn(&b, head, strlen(head) - 1);  /* all but the closing brace */
    free(head);
    tsr_sb_puts(&b, ",\"workers\":[");
    size_t n = tsr_registry_size(c->reg);
    for (size_t i = 0; i < n; i++) {
        if (i) tsr_sb_puts(&b, ",");
        worker_json(&b, tsr_registry_at(c->reg, i), now);
    }
    tsr_sb_puts(&b, "],\"idle\":[");
    bool first = true;
    for (size_t i = 0; i < n; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        if (w->state != TSR_W_IDLE || w->has_piece) continue;
        if (!first) tsr_sb_puts(&b, ",");
        sb_str(&b, w->name);
        first = false;
    }
    tsr_sb_puts(&b, "]}");
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

/* ---- requests -------------------------------------------------------------- */

int tsr_control_reply(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, bool ok,
                      const char *error, const char *json)
{
    return tsr_control_reply_code(c, rid, rid_len, ok, NULL, error, json);
}

int tsr_control_reply_code(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, bool ok,
                           const char *code, const char *error, const char *json)
{
    return tsr_control_send(c, c->reply_sock ? c->reply_sock : c->csock, rid, rid_len, ok, code,
                            error, json);
}

int tsr_control_send(tsr_coord_t *c, void *sock, const uint8_t *rid, size_t rid_len, bool ok,
                     const char *code, const char *error, const char *json)
{
    Tessera__ControlReply r = TESSERA__CONTROL_REPLY__INIT;
    r.ok = ok;
    r.code = (char *)(code ? code : "");
    r.error = (char *)(error ? error : "");
    r.json = (char *)(json ? json : "");
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = c->epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REPLY;
    env.control_reply = &r;
    if (tsr_wire_send(sock, rid, rid_len, &env) == 0) return TSR_REPLY_SENT;
    /* errno is zmq_send's (tsr_wire_send only frees after it, and free keeps
     * errno): EHOSTUNREACH for an unknown routing id (the client
     * disconnected), EAGAIN when its queue is at the high-water mark. */
    return errno == EHOSTUNREACH ? TSR_REPLY_GONE : TSR_REPLY_DROPPED;
}

static void handle_drain(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, const char *name,
                         bool drain)
{
    char msg[512];
    tsr_worker_t *w = tsr_registry_find(c->reg, name);
    if (!w || w->state == TSR_W_DEAD) {
        snprintf(msg, sizeof msg, "no live worker named '%s' (see `tessera workers`)", name);
        tsr_control_reply(c, rid, rid_len, false, msg, NULL);
        return;
    }
    if (!drain) {
        w->drained = false;
        c->dirty = true;
        snprintf(msg, sizeof msg, "{\"worker\":\"%s\",\"drained\":false}", w->name);
        tsr_control_reply(c, rid, rid_len, true, NULL, msg);
        return;
    }
    tsr_holding_t old = w->piece;
    bool had = w->has_piece;
    w->drained = true;
    tsr_coord_plan_now(c, tsr_now_ms());
    tsr_info("drained worker %s", w->name);

    /* Say where the piece went, so the operator does not have to look. */
    json_t *o = json_pack("{s:s, s:b}", "worker", w->name, "drained", 1);
    if (had) {
        json_object_set_new(o, "piece", holding_json(&old));
        const tsr_worker_t *x = tsr_registry_holder(c->reg, &old.key, w);
        if (x) json_object_set_new(o, "moved_to", json_string(x->name));
    }
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    tsr_control_reply(c, rid, rid_len, true, NULL, s);
    free(s);
}

void tsr_control_handle(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, tsr_env_t *env)
{
    char err[1024];
    if (env->body_case != TESSERA__ENVELOPE__BODY_CONTROL_REQUEST) {
        tsr_control_reply(c, rid, rid_len, false, "expected a control request", NULL);
        return;
    }
    if (env->protocol_version != TSR_PROTOCOL_VERSION) {
        snprintf(err, sizeof err, "protocol version %u is not supported: coordinator speaks %u",
                 env->protocol_version, TSR_PROTOCOL_VERSION);
        tsr_control_reply(c, rid, rid_len, false, err, NULL);
        return;
    }
    Tessera__ControlRequest *q = env->control_request;
    int64_t now = tsr_now_ms();
    switch (q->kind) {
    case TESSERA__CONTROL_REQUEST__KIND__STATUS:
    case TESSERA__CONTROL_REQUEST__KIND__WORKERS: {
        char *s = tsr_coord_status_json(c, now, q->kind == TESSERA__CONTROL_REQUEST__KIND__WORKERS);
        tsr_control_reply(c, rid, rid_len, s != NULL, s ? NULL : "out of memory", s);
        free(s);
        break;
    }
    case TESSERA__CONTROL_REQUEST__KIND__RELOAD:
        if (tsr_coord_reload(c, err, sizeof err) < 0) {
            tsr_error("reload refused, keeping the current configuration: %s", err);
            tsr_control_reply(c, rid, rid_len, false, err, NULL);
        } else {
            tsr_coord_plan_now(c, tsr_now_ms());   /* the reply gives the new plan's epoch */
            snprintf(err, sizeof err, "{\"deployments\":%zu,\"epoch\":%llu}",
                     c->cfg->n_deployments, (unsigned long long)c->epoch);
            tsr_control_reply(c, rid, rid_len, true, NULL, err);
        }
        break;
    case TESSERA__CONTROL_REQUEST__KIND__GENERATE:
        tsr_router_generate(c, rid, rid_len, q);
        break;
    case TESSERA__CONTROL_REQUEST__KIND__CANCEL:
        tsr_router_cancel(c, rid, rid_len, q->request_id, q->stopped);
        break;
    case TESSERA__CONTROL_REQUEST__KIND__DEPLOYMENTS: {
        char *s = tsr_coord_deployments_json(c, now);
        tsr_control_reply(c, rid, rid_len, s != NULL, s ? NULL : "out of memory", s);
        free(s);
        break;
    }
    case TESSERA__CONTROL_REQUEST__KIND__METRICS: {
        char *s = tsr_coord_metrics_text(c, now);
        tsr_control_reply(c, rid, rid_len, s != NULL, s ? NULL : "out of memory", s);
        free(s);
        break;
    }
    case TESSERA__CONTROL_REQUEST__KIND__DRAIN:
    case TESSERA__CONTROL_REQUEST__KIND__UNDRAIN:
        handle_drain(c, rid, rid_len, q->worker, q->kind == TESSERA__CONTROL_REQUEST__KIND__DRAIN);
        break;
    default:
        tsr_control_reply(c, rid, rid_len, false, "unknown control request", NULL);
    }
}
