/* resolve.c: auto layouts (`parallel: auto`; `tensor`, `pipeline` or `replicas:
 * auto`) chosen from the live workers before a plan.  A deployment's cut is
 * layout.c's rule over the workers of its device kind that the deployments
 * before it in the file leave: the fewest devices a replica fits on (memory:
 * the smallest of those workers'), then the fastest per token.  Once chosen it
 * stays until a reload changes what it depends on; auto replicas grow to what
 * the free workers hold (never shrink by themselves).  A restarted coordinator
 * takes the cut of the pieces its workers still hold. */
#include "resolve.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/budget.h"
#include "common/log.h"
#include "layout.h"
#include "topology.h"

/* The live, placeable workers of `kind` (none finishing an old cut's requests or
 * standing by), less `used` of them taken by the deployments before: their count, the smallest memory, the most on one node
 * and in one NVLink domain. */
static void devices_for(tsr_coord_t *c, tsr_device_t kind, int used, tsr_devices_t *v)
{
    memset(v, 0, sizeof *v);
    tsr_devices_defaults(v, kind);
    size_t n = tsr_registry_size(c->reg), k = 0;
    tsr_worker_t **ws = calloc(n ? n : 1, sizeof *ws);
    if (!ws) return;
    for (size_t i = 0; i < n; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        /* an old cut's worker finishing its requests, or a standby loading a piece of a
         * new cut or of a move, is spoken for */
        if (w->state == TSR_W_DEAD || w->finishing || tsr_coord_is_standby(c, w->name)) continue;
        ws[k++] = w;
    }
    tsr_nvlink_domains(ws, k);  /* every live worker's, as the planner sees them */
    size_t m = 0;
    bool given_bw = false, given_fl = false;
    for (size_t i = 0; i < k; i++)
        if (ws[i]->device == kind && !ws[i]->drained) ws[m++] = ws[i];
    for (size_t i = 0; i < m; i++) {
        int on_node = 0, in_domain = 0;
        for (size_t j = 0; j < m; j++) {
            on_node += !strcmp(ws[j]->node, ws[i]->node);
            in_domain += ws[i]->nvlink_domain[0] &&
                         !strcmp(ws[j]->nvlink_domain, ws[i]->nvlink_domain);
        }
        if (on_node > v->per_node) v->per_node = on_node;
        if (in_domain > v->per_domain) v->per_domain = in_domain;
        if (kind == TSR_DEVICE_CUDA && (!v->memory || ws[i]->memory < v->memory))
            v->memory = ws[i]->memory;
        /* the slowest rate a worker gives; the kind's figures where none does */
        if (ws[i]->mem_gbs > 0 && (!given_bw || ws[i]->mem_gbs < v->mem_gbs))
            v->mem_gbs = ws[i]->mem_gbs, given_bw = true;
        if (ws[i]->gflops > 0 && (!given_fl || ws[i]->gflops < v->gflops))
            v->gflops = ws[i]->gflops, given_fl = true;
        /* cpu workers sharing a node's cores: the fewest cores and the most threads said */
        if (ws[i]->cpu_cores > 0 && (!v->cores || ws[i]->cpu_cores < v->cores))
            v->cores = ws[i]->cpu_cores;
        if (ws[i]->cpu_threads > v->threads) v->threads = ws[i]->cpu_threads;
    }
    v->devices = (int)m > used ? (int)m - used : 0;
    free(ws);
}

/* One more than the highest replica of deployment `name` a live worker holds. */
static int held_replicas(tsr_coord_t *c, const char *name)
{
    int most = 0;
    for (size_t i = 0, n = tsr_registry_size(c->reg); i < n; i++) {
        const tsr_worker_t *w = tsr_registry_at(c->reg, i);
        if (w->state != TSR_W_DEAD && w->has_piece && !strcmp(w->piece.key.deployment, name) &&
            w->piece.key.replica + 1 > most)
            most = w->piece.key.replica + 1;
    }
    return most;
}

/* Records d's cut as chosen. */
static void note_choice(tsr_dep_state_t *ds, const tsr_deployment_t *d)
{
    ds->layout_chosen = true;
    tsr_dep_note_cut(ds, d);
}

/* Chooses deployment i's cut over devs (its fixed dimensions kept).  True when
 * one fits; ds->layout_why says how, or why not. */
static bool choose(tsr_coord_t *c, size_t i, const tsr_devices_t *devs)
{
    tsr_deployment_t *d = &c->cfg->deployments[i];
    tsr_dep_state_t *ds = &c->deps[i];
    const tsr_model_info_t *m = &ds->model;
    if (devs->devices < 1) {
        snprintf(ds->layout_why, sizeof ds->layout_why,
                 "its layout is chosen once %s workers are free for it", tsr_device_name(d->device));
        return false;
    }
    char why[256];
    tsr_layout_t cut;
    int k = tsr_layout_choose_auto(m, d, devs, &cut, why, sizeof why);
    if (k >= 0) {
        d->tensor = cut.tensor;
        d->pipeline = cut.pipeline;
        note_choice(ds, d);
        snprintf(ds->layout_why, sizeof ds->layout_why, "chosen over %d %s worker(s): %s",
                 devs->devices, tsr_device_name(d->device), why);
        tsr_info("deployment %s: parallel auto: %s", d->name, ds->layout_why);
    } else {
        snprintf(ds->layout_why, sizeof ds->layout_why, "its layout cannot be chosen yet: %s",
                 why);
    }
    return k >= 0;
}

void tsr_coord_resolve_layouts(tsr_coord_t *c)
{
    int used[2] = {0, 0};
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        tsr_deployment_t *d = &c->cfg->deployments[i];
        tsr_dep_state_t *ds = &c->deps[i];
        if (!ds->model_ok) continue;
        if (!d->auto_tensor && !d->auto_pipeline && !d->auto_replicas) {
            used[d->device] += d->tensor * d->pipeline * d->replicas;
            continue;
        }
        tsr_devices_t devs;
        devices_for(c, d->device, used[d->device], &devs);
        if (!ds->layout_chosen && !choose(c, i, &devs)) continue;
        if (d->auto_replicas) {
            /* what the free workers hold, and at least every replica a live worker
             * still serves (adopted at a restart, before the first plan) */
            int per = d->tensor * d->pipeline, want = devs.devices / per;
            int held = held_replicas(c, d->name);
            if (want < held) want = held;
            if (want > TSR_MAX_PIECES / per) want = TSR_MAX_PIECES / per;
            if (want < 1) want = 1;
            if (want > d->replicas || (want < d->replicas && !ds->replicas_settled)) {
                int was = d->replicas;
                if (tsr_dep_set_replicas(ds, d, want) == 0)
                    tsr_info("deployment %s: %d replica(s) of tp %d x pp %d, from %d: the free "
                             "%s workers hold them", d->name, want, d->tensor, d->pipeline, was,
                             tsr_device_name(d->device));
            }
            ds->replicas_settled = true;
        }
        used[d->device] += d->tensor * d->pipeline * d->replicas;
    }
}

void tsr_coord_adopt_undo(tsr_coord_t *c, int di, const tsr_layout_undo_t *undo)
{
    tsr_deployment_t *d = &c->cfg->deployments[di];
    tsr_dep_state_t *ds = &c->deps[di];
    if (d->replicas != undo->replicas) tsr_dep_set_replicas(ds, d, undo->replicas);
    if (ds->layout_chosen && !undo->layout_chosen) {
        ds->layout_chosen = false;
        d->tensor = undo->tensor;
        d->pipeline = undo->pipeline;
        ds->layout_why[0] = '\0';
    }
}

bool tsr_coord_adopt_layout(tsr_coord_t *c, int di, const tsr_piece_key_t *k, int64_t now,
                            tsr_layout_undo_t *undo)
{
    tsr_deployment_t *d = &c->cfg->deployments[di];
    tsr_dep_state_t *ds = &c->deps[di];
    *undo = (tsr_layout_undo_t){ds->layout_chosen, d->tensor, d->pipeline, d->replicas};
    if (!ds->model_ok) return false;
    /* replicas that followed load: a restart keeps every one its workers still hold,
     * within the range (the first plan places the rest of them) */
    if (d->replicas_max && now < c->plan_after_ms && k->tp_size == d->tensor &&
        k->pp_size == d->pipeline && k->replica >= d->replicas && k->replica < d->replicas_max)
        tsr_dep_set_replicas(ds, d, k->replica + 1);
    if (!d->auto_tensor && !d->auto_pipeline && !d->auto_replicas) return true;
    /* Only while the coordinator waits for its workers to re-attach, and only a
     * cut and a replica count the live workers could hold: a worker's word cannot
     * push the deployment into a layout that does not fit or replicas no one has. */
    if (now >= c->plan_after_ms || k->tp_size < 1 || k->pp_size < 1) return false;
    if (!ds->layout_chosen) {
        /* the cut must fit the live workers' memory; their count does not matter
         * (the others re-attach one by one) */
        tsr_devices_t devs;
        devices_for(c, d->device, 0, &devs);
        devs.devices = TSR_MAX_PIECES;
        tsr_layout_t cut;
        if ((!d->auto_tensor && k->tp_size != d->tensor) ||
            (!d->auto_pipeline && k->pp_size != d->pipeline))
            return false;
        tsr_layout_of(&ds->model, d, &devs, k->tp_size, k->pp_size, &cut);
        if (!cut.valid || !cut.fits) return false;
        d->tensor = k->tp_size;
        d->pipeline = k->pp_size;
        note_choice(ds, d);
        snprintf(ds->layout_why, sizeof ds->layout_why,
                 "tp %d x pp %d, taken from the pieces the workers held at a restart",
                 d->tensor, d->pipeline);
    }
    /* the first plan, at the end of the grace, trims replicas no one holds */
    if (d->auto_replicas && !ds->replicas_settled && k->replica >= d->replicas &&
        k->replica < TSR_MAX_PIECES / (d->tensor * d->pipeline))
        tsr_dep_set_replicas(ds, d, k->replica + 1);
    return true;
}
