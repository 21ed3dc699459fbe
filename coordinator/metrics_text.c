/* metrics_text.c: the /metrics document in the Prometheus text format: what
 * metrics.c recorded (requests by deployment and outcome, tokens, histograms of time
 * to first token, inter-token latency and request duration), and gauges read from
 * the registry and the deployments when the text is asked for. */
#include "metrics_text.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/strbuf.h"
#include "depview.h"

static void family(tsr_sb_t *o, const char *name, const char *type, const char *help)
{
    tsr_sb_printf(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* Names in the registry are [A-Za-z0-9._-] (checked at registration and load), so
 * label values need no escaping; this escapes anyway, as the format asks. */
static const char *esc(const char *s, char *buf, size_t len)
{
    size_t k = 0;
    for (; *s && k + 3 < len; s++) {
        if (*s == '\\' || *s == '"') buf[k++] = '\\', buf[k++] = *s;
        else if (*s == '\n') buf[k++] = '\\', buf[k++] = 'n';
        else buf[k++] = *s;
    }
    buf[k] = '\0';
    return buf;
}

static void histogram(tsr_sb_t *o, const char *name, const char *help, const tsr_coord_t *c,
                      size_t which)
{
    family(o, name, "histogram", help);
    char e[2 * TSR_NAME_MAX + 8];
    for (size_t i = 0; i < c->metrics.n; i++) {
        const tsr_dep_metrics_t *m = &c->metrics.v[i];
        const tsr_hist_t *h = which == 0 ? &m->ttft : which == 1 ? &m->itl : &m->duration;
        uint64_t cum = 0;
        esc(m->name, e, sizeof e);
        for (int b = 0; b < TSR_HIST_BUCKETS; b++) {
            cum += h->le[b];
            tsr_sb_printf(o, "%s_bucket{deployment=\"%s\",le=\"%g\"} %llu\n", name, e, tsr_hist_bounds[b],
                (unsigned long long)cum);
        }
        tsr_sb_printf(o, "%s_bucket{deployment=\"%s\",le=\"+Inf\"} %llu\n", name, e,
            (unsigned long long)h->count);
        tsr_sb_printf(o, "%s_sum{deployment=\"%s\"} %.6f\n", name, e, h->sum);
        tsr_sb_printf(o, "%s_count{deployment=\"%s\"} %llu\n", name, e, (unsigned long long)h->count);
    }
}

char *tsr_coord_metrics_text(const tsr_coord_t *c, int64_t now_ms)
{
    tsr_sb_t o = {0};
    tsr_sb_puts(&o, "");
    char e[2 * TSR_NAME_MAX + 8], w[2 * TSR_NAME_MAX + 8];

    family(&o, "tessera_requests_total", "counter",
           "Generation requests that ended, by deployment and outcome (stop: end of sequence "
           "or a stop string, length: max_tokens or max_seq_len).");
    for (size_t i = 0; i < c->metrics.n; i++)
        for (size_t k = 0; k < sizeof tsr_outcome_names / sizeof tsr_outcome_names[0]; k++)
            tsr_sb_printf(&o, "tessera_requests_total{deployment=\"%s\",outcome=\"%s\"} %llu\n",
                esc(c->metrics.v[i].name, e, sizeof e), tsr_outcome_names[k],
                (unsigned long long)c->metrics.v[i].outcome[k]);
    family(&o, "tessera_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.");
    for (size_t i = 0; i < c->metrics.n; i++)
        tsr_sb_printf(&o, "tessera_prompt_tokens_total{deployment=\"%s\"} %llu\n",
            esc(c->metrics.v[i].name, e, sizeof e), (unsigned long long)c->metrics.v[i].prompt_tokens);
    family(&o, "tessera_prompt_tokens_cached_total", "counter",
           "Prompt tokens of requests that started, taken from a replica's prefix cache.");
    for (size_t i = 0; i < c->metrics.n; i++)
        tsr_sb_printf(&o, "tessera_prompt_tokens_cached_total{deployment=\"%s\"} %llu\n",
            esc(c->metrics.v[i].name, e, sizeof e), (unsigned long long)c->metrics.v[i].prompt_cached);
    family(&o, "tessera_generated_tokens_total", "counter", "Tokens delivered to clients.");
    for (size_t i = 0; i < c->metrics.n; i++)
        tsr_sb_printf(&o, "tessera_generated_tokens_total{deployment=\"%s\"} %llu\n",
            esc(c->metrics.v[i].name, e, sizeof e),
            (unsigned long long)c->metrics.v[i].generated_tokens);
    histogram(&o, "tessera_time_to_first_token_seconds",
              "From a request's arrival to its first token.", c, 0);
    histogram(&o, "tessera_inter_token_latency_seconds",
              "Between two tokens of one request, as delivered.", c, 1);
    histogram(&o, "tessera_request_duration_seconds",
              "From a request's arrival to its last token.", c, 2);

    family(&o, "tessera_replicas_scaled_total", "counter",
           "Replicas added (direction=\"up\") and removed (\"down\") as load changed, for "
           "deployments whose replicas are a range.");
    for (size_t i = 0; i < c->metrics.n; i++) {
        esc(c->metrics.v[i].name, e, sizeof e);
        tsr_sb_printf(&o, "tessera_replicas_scaled_total{deployment=\"%s\",direction=\"up\"} %llu\n",
            e, (unsigned long long)c->metrics.v[i].scale_ups);
        tsr_sb_printf(&o, "tessera_replicas_scaled_total{deployment=\"%s\",direction=\"down\"} %llu\n",
            e, (unsigned long long)c->metrics.v[i].scale_downs);
    }
    family(&o, "tessera_replicas", "gauge", "Replicas each deployment has now.");
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        tsr_sb_printf(&o, "tessera_replicas{deployment=\"%s\"} %d\n",
            esc(c->cfg->deployments[i].name, e, sizeof e), c->cfg->deployments[i].replicas);
    family(&o, "tessera_queue_wait_seconds", "gauge",
           "Each deployment's mean wait for a first token over its last whole "
           "scale_up_window_s (deployments whose replicas are a range, once a window ended).");
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        if (c->cfg->deployments[i].replicas_max && c->deps[i].scale.window_wait_ms >= 0)
            tsr_sb_printf(&o, "tessera_queue_wait_seconds{deployment=\"%s\"} %.3f\n",
                esc(c->cfg->deployments[i].name, e, sizeof e),
                c->deps[i].scale.window_wait_ms / 1000.0);

    family(&o, "tessera_deployment_state", "gauge",
           "1 for the state each deployment is in (ready, loading, degraded, waiting, failed).");
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        const char *st = tsr_coord_dep_state(c, i, now_ms);
        static const char *const states[] = {"ready", "loading", "degraded", "waiting", "failed"};
        for (size_t k = 0; k < 5; k++)
            tsr_sb_printf(&o, "tessera_deployment_state{deployment=\"%s\",state=\"%s\"} %d\n",
                esc(c->cfg->deployments[i].name, e, sizeof e), states[k], !strcmp(st, states[k]));
    }

    family(&o, "tessera_tp_groups_spanning", "gauge",
           "Tensor-parallel groups whose ranks sit on more than one node (across=\"nodes\") "
           "or in more than one NVLink domain of a node (across=\"nvlink_domains\").");
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        tsr_dep_summary_t sum;
        tsr_dep_summarise(c, i, now_ms, &sum);
        free(sum.at);
        esc(c->cfg->deployments[i].name, e, sizeof e);
        tsr_sb_printf(&o, "tessera_tp_groups_spanning{deployment=\"%s\",across=\"nodes\"} %d\n", e,
            sum.spanning_nodes);
        tsr_sb_printf(&o, "tessera_tp_groups_spanning{deployment=\"%s\",across=\"nvlink_domains\"} %d\n",
            e, sum.spanning_nvlink);
    }

    /* Per worker: pieces' queues, batches and KV pools; counts by state. */
    size_t n = tsr_registry_size(c->reg);
    uint64_t by_state[TSR_W_DEAD + 1] = {0}, finishing = 0;
    family(&o, "tessera_replica_queued_requests", "gauge",
           "Requests waiting at a replica's leader.");
    for (size_t k = 0; k < n; k++) {
        tsr_worker_t *x = tsr_registry_at(c->reg, k);
        if (x->finishing) finishing++;   /* an old cut's requests (reshard.c) */
        else if (x->state <= TSR_W_DEAD) by_state[x->state]++;
    }
    for (int running = 0; running < 2; running++) {
        if (running)
            family(&o, "tessera_replica_running_sequences", "gauge",
                   "Sequences in a replica's running batch.");
        for (size_t i = 0; i < c->cfg->n_deployments; i++) {
            const tsr_deployment_t *d = &c->cfg->deployments[i];
            for (int r = 0; r < d->replicas; r++) {
                /* the replica's leader: stage 0, tp rank 0 */
                tsr_worker_t *x = tsr_registry_at_slot(c->reg, d->name, r, d->tensor, d->pipeline, 0);
                if (!x) continue;
                tsr_sb_printf(&o, "%s{deployment=\"%s\",replica=\"%d\"} %u\n",
                    running ? "tessera_replica_running_sequences" : "tessera_replica_queued_requests",
                    esc(d->name, e, sizeof e), r, running ? x->running : x->queued);
            }
        }
    }
    /* per piece: its pool's blocks, and its process's evictions */
    static const struct {
        const char *name, *type, *help;
    } per_piece[] = {
        {"tessera_kv_blocks_used", "gauge", "KV cache blocks in use, per piece."},
        {"tessera_kv_blocks_total", "gauge", "KV cache blocks in the pool, per piece."},
        {"tessera_kv_blocks_cached", "gauge",
         "KV cache blocks of the prefix cache held by no sequence, per piece."},
        {"tessera_kv_evictions_total", "counter",
         "Prefix cache blocks evicted for room, by the worker process holding the piece."},
    };
    for (size_t f = 0; f < sizeof per_piece / sizeof per_piece[0]; f++) {
        family(&o, per_piece[f].name, per_piece[f].type, per_piece[f].help);
        for (size_t k = 0; k < n; k++) {
            tsr_worker_t *x = tsr_registry_at(c->reg, k);
            if (x->state == TSR_W_DEAD || !x->has_piece) continue;
            uint64_t v = f == 0 ? x->kv_blocks_used : f == 1 ? x->kv_blocks_total
                         : f == 2 ? x->kv_blocks_cached : x->kv_evictions;
            tsr_sb_printf(&o, "%s{deployment=\"%s\",replica=\"%d\",stage=\"%d\",tp=\"%d\",worker=\"%s\"} %llu\n",
                per_piece[f].name, esc(x->piece.key.deployment, e, sizeof e), x->piece.key.replica,
                x->piece.key.stage, x->piece.key.tp, esc(x->name, w, sizeof w), (unsigned long long)v);
        }
    }
    /* per replica, from its leader: prompt tokens cached and computed, preemptions */
    static const struct {
        const char *name, *help;
    } per_leader[] = {
        {"tessera_replica_prompt_tokens_cached_total",
         "Prompt tokens a replica took from its prefix cache (its leader's process)."},
        {"tessera_replica_prompt_tokens_computed_total",
         "Prompt tokens a replica computed (its leader's process)."},
        {"tessera_replica_preemptions_total",
         "Sequences a replica preempted for KV room and resumed later (its leader's process)."},
    };
    for (size_t f = 0; f < sizeof per_leader / sizeof per_leader[0]; f++) {
        family(&o, per_leader[f].name, "counter", per_leader[f].help);
        for (size_t i = 0; i < c->cfg->n_deployments; i++) {
            const tsr_deployment_t *d = &c->cfg->deployments[i];
            for (int r = 0; r < d->replicas; r++) {
                tsr_worker_t *x = tsr_registry_at_slot(c->reg, d->name, r, d->tensor, d->pipeline, 0);
                if (!x || x->state == TSR_W_DEAD) continue;
                uint64_t v = f == 0 ? x->prompt_cached : f == 1 ? x->prompt_computed : x->preemptions;
                tsr_sb_printf(&o, "%s{deployment=\"%s\",replica=\"%d\",worker=\"%s\"} %llu\n",
                    per_leader[f].name, esc(d->name, e, sizeof e), r, esc(x->name, w, sizeof w),
                    (unsigned long long)v);
            }
        }
    }
    family(&o, "tessera_workers", "gauge", "Registered workers by state.");
    for (int s = 0; s <= TSR_W_DEAD; s++)
        tsr_sb_printf(&o, "tessera_workers{state=\"%s\"} %llu\n", tsr_wstate_name((tsr_wstate_t)s),
            (unsigned long long)by_state[s]);
    tsr_sb_printf(&o, "tessera_workers{state=\"finishing\"} %llu\n", (unsigned long long)finishing);
    family(&o, "tessera_heartbeats_total", "counter", "Worker heartbeats received.");
    tsr_sb_printf(&o, "tessera_heartbeats_total %llu\n", (unsigned long long)c->stats.heartbeats);
    family(&o, "tessera_registrations_total", "counter", "Worker registrations accepted.");
    tsr_sb_printf(&o, "tessera_registrations_total %llu\n", (unsigned long long)c->stats.registrations);
    family(&o, "tessera_worker_deaths_total", "counter",
           "Workers declared dead (missed heartbeats or a removed key).");
    tsr_sb_printf(&o, "tessera_worker_deaths_total %llu\n", (unsigned long long)c->stats.deaths);
    family(&o, "tessera_requests_replayed_total", "counter",
           "Request attempts resumed on another replica: after a failure, or moved off one "
           "that a plan rewired, a drain removed or a move changed.");
    tsr_sb_printf(&o, "tessera_requests_replayed_total %llu\n", (unsigned long long)c->stats.requests_replayed);
    family(&o, "tessera_rebalance_moves_total", "counter",
           "Pieces moved back where they belong, make before break (outcome=\"moved\"), and "
           "moves given up (\"abandoned\").");
    tsr_sb_printf(&o, "tessera_rebalance_moves_total{outcome=\"moved\"} %llu\n",
                  (unsigned long long)c->rebalance.moves);
    tsr_sb_printf(&o, "tessera_rebalance_moves_total{outcome=\"abandoned\"} %llu\n",
                  (unsigned long long)c->rebalance.abandoned);
    family(&o, "tessera_plan_epoch", "gauge", "The plan epoch (grows with every new plan).");
    tsr_sb_printf(&o, "tessera_plan_epoch %llu\n", (unsigned long long)c->epoch);
    if (o.oom) {
        free(o.p);
        return NULL;
    }
    return o.p;
}

