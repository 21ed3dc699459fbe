/* depview.c: each deployment's state, summarised from the registry and the
 * deployments' state without changing either: ready, loading, degraded, waiting or
 * failed, with a message a person can act on. */
#include "depview.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "planner.h"
#include "waited.h"


int tsr_dep_piece_slot(const tsr_deployment_t *d, int r, int s, int t)
{
    return (r * d->pipeline + s) * d->tensor + t;
}

const char *tsr_span_name(tsr_span_t span)
{
    return span == TSR_SPAN_NODES ? "nodes" : span == TSR_SPAN_NVLINK ? "nvlink_domains" : "none";
}

/* A group left across nodes by a failover stays so (the planner moves no ready
 * piece back), and every layer's all-reduce then crosses the network: status and
 * /metrics say so.  A GPU without NVLink beside one with it counts as another
 * domain; a node whose GPUs have none has no domains to span. */
tsr_span_t tsr_dep_group_span(const tsr_deployment_t *d, const tsr_dep_summary_t *sum, int r,
                              int s)
{
    const tsr_worker_t *first = NULL;
    tsr_span_t span = TSR_SPAN_NONE;
    for (int t = 0; sum->at && t < d->tensor; t++) {
        const tsr_worker_t *w = sum->at[tsr_dep_piece_slot(d, r, s, t)];
        if (!w) continue;
        if (!first) {
            first = w;
            continue;
        }
        if (strcmp(w->node, first->node)) return TSR_SPAN_NODES;
        if (strcmp(w->nvlink_domain, first->nvlink_domain)) span = TSR_SPAN_NVLINK;
    }
    return span;
}

void tsr_dep_summarise(const tsr_coord_t *c, size_t i, int64_t now, tsr_dep_summary_t *sum)
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
    if (!ds->layout_chosen) {  /* an auto layout not chosen yet: nothing is placed */
        sum->state = "waiting";
        snprintf(sum->message, sizeof sum->message, "%s", ds->layout_why[0] ? ds->layout_why
                 : "its layout is chosen at the first plan");
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
    for (int r = 0; sum->at && d->tensor > 1 && r < d->replicas; r++)
        for (int s = 0; s < d->pipeline; s++) {
            tsr_span_t span = tsr_dep_group_span(d, sum, r, s);
            sum->spanning_nodes += span == TSR_SPAN_NODES;
            sum->spanning_nvlink += span == TSR_SPAN_NVLINK;
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

char *tsr_coord_deployments_json(const tsr_coord_t *c, int64_t now_ms)
{
    json_t *list = json_array();
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        const tsr_deployment_t *d = &c->cfg->deployments[i];
        const tsr_dep_state_t *ds = &c->deps[i];
        tsr_dep_summary_t sum;
        tsr_dep_summarise(c, i, now_ms, &sum);
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

const char *tsr_coord_dep_state(const tsr_coord_t *c, size_t i, int64_t now_ms)
{
    tsr_dep_summary_t sum;
    tsr_dep_summarise(c, i, now_ms, &sum);
    free(sum.at);
    return sum.state;
}

