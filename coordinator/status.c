/* status.c: the status document (`tessera status`, `tessera workers`), read from
 * the coordinator's state through a const pointer. */
#include "status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/strbuf.h"
#include "common/util.h"
#include "depview.h"
#include "router.h"
#include "waited.h"

json_t *tsr_holding_json(const tsr_holding_t *h)
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
    tsr_sb_printf(b, ",\"kv_blocks_used\":%u,\"kv_blocks_total\":%u,\"kv_blocks_cached\":%u"
              ",\"queued\":%u,\"running\":%u",
              w->kv_blocks_used, w->kv_blocks_total, w->kv_blocks_cached, w->queued, w->running);
    tsr_sb_printf(b, ",\"steps\":%llu", (unsigned long long)w->steps);
    sb_kv_str(b, "version", w->version);
    sb_kv_str(b, "data_endpoint", w->data_endpoint);
    sb_kv_str(b, "pci_bus_id", w->pci_bus_id);
    tsr_sb_printf(b, ",\"nccl\":%s", w->nccl ? "true" : "false");
    sb_kv_str(b, "nvlink_domain", w->nvlink_domain);
    tsr_sb_printf(b, ",\"mem_gbs\":%g,\"gflops\":%g,\"cpu_cores\":%d,\"cpu_threads\":%d",
                  w->mem_gbs, w->gflops, w->cpu_cores, w->cpu_threads);
    tsr_sb_printf(b, ",\"state\":\"%s\",\"drained\":%s,\"heartbeat_age_ms\":%lld,\"heartbeats\":%llu",
              w->finishing ? "finishing" : tsr_wstate_name(w->state), w->drained ? "true" : "false",
              (long long)(now - w->last_seen_ms), (unsigned long long)w->heartbeats);
    if (w->finishing) { /* an old cut's piece whose requests it finishes (reshard.c) */
        tsr_sb_puts(b, ",\"finishing\":{\"deployment\":");
        sb_str(b, w->finished.key.deployment);
        tsr_sb_printf(b, ",\"replica\":%d,\"stage\":%d,\"tp\":%d,\"tp_size\":%d,"
                         "\"pp_size\":%d,\"epoch\":%llu,\"serving\":%s,\"held\":%s}",
                      w->finished.key.replica, w->finished.key.stage, w->finished.key.tp,
                      w->finished.key.tp_size, w->finished.key.pp_size,
                      (unsigned long long)w->finished.epoch, w->serving ? "true" : "false",
                      w->room_done ? "true" : "false");
    }
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

/* Where w sits, as far as a group spanning `span` is concerned. */
static const char *place_of(const tsr_worker_t *w, tsr_span_t span)
{
    if (span == TSR_SPAN_NODES) return w->node;
    return w->nvlink_domain[0] ? w->nvlink_domain : "(no NVLink)";
}

/* "replica 0 stage 1: its tensor-parallel group spans nodes node1, node2: ..." */
static json_t *span_warning(const tsr_deployment_t *d, const tsr_dep_summary_t *sum, int r, int s,
                            tsr_span_t span)
{
    tsr_sb_t b = {0};
    tsr_sb_printf(&b, "replica %d stage %d: its tensor-parallel group spans %s", r, s,
                  span == TSR_SPAN_NODES ? "nodes" : "NVLink domains");
    int named = 0;
    for (int t = 0; t < d->tensor; t++) {
        const tsr_worker_t *w = sum->at[tsr_dep_piece_slot(d, r, s, t)];
        if (!w) continue;
        bool seen = false;  /* each place once, in rank order */
        for (int u = 0; u < t && !seen; u++) {
            const tsr_worker_t *x = sum->at[tsr_dep_piece_slot(d, r, s, u)];
            seen = x && !strcmp(place_of(x, span), place_of(w, span));
        }
        if (!seen) tsr_sb_printf(&b, "%s%s", named++ ? ", " : " ", place_of(w, span));
    }
    tsr_sb_puts(&b, span == TSR_SPAN_NODES ? ": every layer's all-reduce crosses the network"
                                           : ": every layer's all-reduce crosses PCIe");
    json_t *j = json_string(b.oom || !b.p ? "its tensor-parallel group spans places" : b.p);
    free(b.p);
    return j;
}

static json_t *deployment_json(const tsr_coord_t *c, size_t i, int64_t now)
{
    const tsr_deployment_t *d = &c->cfg->deployments[i];
    tsr_dep_summary_t sum;
    tsr_dep_summarise(c, i, now, &sum);
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
    /* auto: the weights are held in matmul_dtype_used */
    json_object_set_new(o, "weights_dtype", json_string(tsr_kv_dtype_name(d->weights_dtype)));
    json_object_set_new(o, "gpu_memory_percent", json_integer(d->gpu_memory_percent));
    json_object_set_new(o, "prefix_cache", json_boolean(d->prefix_cache));
    json_object_set_new(o, "kv_admission",
                        json_string(d->kv_admission == TSR_KV_ADMIT_RESERVE ? "reserve" : "on_demand"));
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
    /* parallel: auto (or one dimension auto): what was chosen and why, or why not yet */
    if (d->auto_tensor || d->auto_pipeline || d->auto_replicas) {
        json_object_set_new(o, "parallel_auto",
                            json_pack("{s:b, s:b, s:b}", "tensor", d->auto_tensor, "pipeline",
                                      d->auto_pipeline, "replicas", d->auto_replicas));
        json_object_set_new(o, "layout_chosen", json_boolean(c->deps[i].layout_chosen));
        json_object_set_new(o, "layout_reason", json_string(c->deps[i].layout_why));
    }
    if (d->latency_target_ms > 0)
        json_object_set_new(o, "latency_target_ms_per_token", json_real(d->latency_target_ms));
    /* replicas that follow load: the range, the rule's inputs and its last decision */
    if (d->replicas_max) {
        const tsr_dep_state_t *ds = &c->deps[i];
        json_t *a = json_pack("{s:i, s:i, s:i, s:i, s:i, s:I, s:I, s:I, s:s, s:s}",
                              "min", d->replicas_min, "max", d->replicas_max,
                              "scale_up_queue_ms", d->scale_up_queue_ms,
                              "scale_up_window_s", d->scale_up_window_s,
                              "scale_down_idle_s", d->scale_down_idle_s,
                              "oldest_wait_ms", (json_int_t)ds->scale.queue_wait_ms,
                              "ups", (json_int_t)ds->scale.ups, "downs", (json_int_t)ds->scale.downs,
                              "last", ds->scale.last, "held_back", ds->scale.blocked);
        /* the rule's input: the last whole window's mean wait for a first token */
        json_object_set_new(a, "queue_wait_ms", ds->scale.window_wait_ms >= 0
                                                    ? json_real(ds->scale.window_wait_ms)
                                                    : json_null());
        json_object_set_new(a, "last_ms_ago", ds->scale.last_ms
                                                  ? json_integer((json_int_t)(now - ds->scale.last_ms))
                                                  : json_null());
        json_object_set_new(a, "draining_replica", ds->scale.draining >= 0
                                                       ? json_integer(ds->scale.draining)
                                                       : json_null());
        json_object_set_new(o, "autoscale", a);
    }
    /* a change of cut built beside the running one (reshard.c), or how the last went */
    if (c->deps[i].reshard.doing[0] || c->deps[i].reshard.last[0])
        json_object_set_new(o, "reshard", json_pack("{s:s, s:s}", "doing", c->deps[i].reshard.doing,
                                                    "last", c->deps[i].reshard.last));
    json_object_set_new(o, "tp_groups_spanning_nodes", json_integer(sum.spanning_nodes));
    json_object_set_new(o, "tp_groups_spanning_nvlink_domains", json_integer(sum.spanning_nvlink));
    json_t *warnings = json_array();
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
                tsr_worker_t *w = sum.at[tsr_dep_piece_slot(d, r, s, t)];
                json_t *rk;
                if (w) {
                    rk = json_pack("{s:i, s:s, s:s, s:i, s:s, s:I, s:I}", "tp", t, "worker",
                                   w->name, "node", w->node, "pid", (int)w->pid, "state",
                                   tsr_wstate_name(w->state), "heartbeat_age_ms",
                                   (json_int_t)(now - w->last_seen_ms), "epoch",
                                   (json_int_t)w->piece.epoch);
                    json_object_set_new(rk, "kv_blocks_used", json_integer(w->kv_blocks_used));
                    json_object_set_new(rk, "kv_blocks_total", json_integer(w->kv_blocks_total));
                    json_object_set_new(rk, "kv_blocks_cached", json_integer(w->kv_blocks_cached));
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
            tsr_span_t span = tsr_dep_group_span(d, &sum, r, s);
            json_array_append_new(stages, json_pack("{s:i, s:[i,i], s:o, s:s}", "stage", s,
                                                    "layers", b, e, "ranks", ranks, "tp_span",
                                                    tsr_span_name(span)));
            if (span != TSR_SPAN_NONE) json_array_append_new(warnings, span_warning(d, &sum, r, s, span));
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
    json_object_set_new(o, "warnings", warnings);
    json_object_set_new(o, "in_flight", json_integer(tsr_requests_in_flight(c, d->name, -1)));
    free(sum.at);
    return o;
}

char *tsr_coord_status_json(const tsr_coord_t *c, int64_t now, bool workers_only)
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
    json_object_set_new(stats, "in_flight", json_integer((json_int_t)tsr_requests_count(c)));
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
    /* Before the first plan after a start, workers of a previous coordinator
     * re-attach with their pieces: how much of that grace is left. */
    json_object_set_new(coord, "grace_left_ms",
                        json_integer(now < c->plan_after_ms ? (json_int_t)(c->plan_after_ms - now) : 0));
    /* moving pieces back (rebalance.c): the move under way and the last one */
    json_object_set_new(coord, "rebalance",
                        json_pack("{s:i, s:I, s:I, s:s, s:s}", "interval_s",
                                  c->cfg->rebalance_interval_s, "moves",
                                  (json_int_t)c->rebalance.moves, "abandoned",
                                  (json_int_t)c->rebalance.abandoned, "doing", c->rebalance.doing,
                                  "last", c->rebalance.last));
    json_object_set_new(coord, "security", json_string(c->zap ? "curve" : "none"));
    if (c->zap) {
        tsr_zap_stats_t zs;
        tsr_zap_stats(c->zap, &zs);
        json_object_set_new(coord, "keys_dir", json_string(c->cfg->keys_dir));
        json_object_set_new(coord, "allowed_keys", json_integer((json_int_t)zs.keys));
        /* files in allowed/ that are not trusted keys (the log names them) */
        json_object_set_new(coord, "allowed_keys_skipped", json_integer((json_int_t)zs.skipped));
        json_object_set_new(stats, "handshakes_accepted", json_integer((json_int_t)zs.accepted));
        /* the key handler's refusals and those ZeroMQ made before it */
        json_object_set_new(stats, "handshakes_refused",
                            json_integer((json_int_t)(zs.refused + st->handshakes_failed)));
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
