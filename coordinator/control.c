/* control.c: the control API the CLI and the HTTP server talk to: each request
 * (status, workers, reload, drain, generate, cancel, deployments, metrics) handed to
 * the layer that answers it. */
#include "control.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "depview.h"
#include "metrics_text.h"
#include "placement.h"
#include "reload.h"
#include "replan.h"
#include "router.h"
#include "status.h"

static void handle_drain(tsr_coord_t *c, const tsr_client_t *from, const char *name, bool drain)
{
    char msg[512];
    tsr_worker_t *w = tsr_registry_find(c->reg, name);
    if (!w || w->state == TSR_W_DEAD) {
        snprintf(msg, sizeof msg, "no live worker named '%s' (see `tessera workers`)", name);
        tsr_control_answer(c, from, false, NULL, msg, NULL);
        return;
    }
    if (!drain) {
        w->drained = false;
        tsr_coord_mark_dirty(c);
        snprintf(msg, sizeof msg, "{\"worker\":\"%s\",\"drained\":false}", w->name);
        tsr_control_answer(c, from, true, NULL, NULL, msg);
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
        json_object_set_new(o, "piece", tsr_holding_json(&old));
        const tsr_worker_t *x = tsr_registry_holder(c->reg, &old.key, w);
        if (x) json_object_set_new(o, "moved_to", json_string(x->name));
    }
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    tsr_control_answer(c, from, true, NULL, NULL, s);
    free(s);
}

void tsr_control_handle(tsr_coord_t *c, const tsr_client_t *from, tsr_env_t *env)
{
    char err[1024];
    if (env->body_case != TESSERA__ENVELOPE__BODY_CONTROL_REQUEST) {
        tsr_control_answer(c, from, false, NULL, "expected a control request", NULL);
        return;
    }
    if (env->protocol_version != TSR_PROTOCOL_VERSION) {
        snprintf(err, sizeof err, "protocol version %u is not supported: coordinator speaks %u",
                 env->protocol_version, TSR_PROTOCOL_VERSION);
        tsr_control_answer(c, from, false, NULL, err, NULL);
        return;
    }
    Tessera__ControlRequest *q = env->control_request;
    int64_t now = tsr_now_ms();
    switch (q->kind) {
    case TESSERA__CONTROL_REQUEST__KIND__STATUS:
    case TESSERA__CONTROL_REQUEST__KIND__WORKERS: {
        char *s = tsr_coord_status_json(c, now, q->kind == TESSERA__CONTROL_REQUEST__KIND__WORKERS);
        tsr_control_answer(c, from, s != NULL, NULL, s ? NULL : "out of memory", s);
        free(s);
        break;
    }
    case TESSERA__CONTROL_REQUEST__KIND__RELOAD:
        if (tsr_coord_reload(c, err, sizeof err) < 0) {
            tsr_error("reload refused, keeping the current configuration: %s", err);
            tsr_control_answer(c, from, false, NULL, err, NULL);
        } else {
            tsr_coord_plan_now(c, tsr_now_ms());   /* the reply gives the new plan's epoch */
            /* and, per deployment whose cut changes, whether it is built beside the
             * running one or applies at once, and why */
            json_t *doc = json_pack("{s:I, s:I}", "deployments", (json_int_t)c->cfg->n_deployments,
                                    "epoch", (json_int_t)c->epoch);
            json_t *cuts = json_array();
            for (size_t i = 0; i < c->cfg->n_deployments; i++) {
                const char *how = c->deps[i].reshard.doing[0] ? c->deps[i].reshard.doing
                                                               : c->deps[i].reshard.last;
                if (how[0])
                    json_array_append_new(cuts, json_pack("{s:s, s:s}", "deployment",
                                                          c->cfg->deployments[i].name, "layout", how));
            }
            json_object_set_new(doc, "layouts", cuts);
            char *text = json_dumps(doc, JSON_COMPACT);
            json_decref(doc);
            tsr_control_answer(c, from, text != NULL, NULL, text ? NULL : "out of memory", text);
            free(text);
        }
        break;
    case TESSERA__CONTROL_REQUEST__KIND__GENERATE:
        tsr_router_generate(c, from, q);
        break;
    case TESSERA__CONTROL_REQUEST__KIND__CANCEL:
        tsr_router_cancel(c, from, q->request_id, q->stopped);
        break;
    case TESSERA__CONTROL_REQUEST__KIND__DEPLOYMENTS: {
        char *s = tsr_coord_deployments_json(c, now);
        tsr_control_answer(c, from, s != NULL, NULL, s ? NULL : "out of memory", s);
        free(s);
        break;
    }
    case TESSERA__CONTROL_REQUEST__KIND__METRICS: {
        char *s = tsr_coord_metrics_text(c, now);
        tsr_control_answer(c, from, s != NULL, NULL, s ? NULL : "out of memory", s);
        free(s);
        break;
    }
    case TESSERA__CONTROL_REQUEST__KIND__DRAIN:
    case TESSERA__CONTROL_REQUEST__KIND__UNDRAIN:
        handle_drain(c, from, q->worker, q->kind == TESSERA__CONTROL_REQUEST__KIND__DRAIN);
        break;
    default:
        tsr_control_answer(c, from, false, NULL, "unknown control request", NULL);
    }
}
