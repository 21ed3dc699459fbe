/* state.c: the coordinator's shared state: the configuration, each deployment's
 * state (its model, tokenizer, shortage, retries, counts), the registry, the key
 * store, and the lookups every layer uses.  Opening it reads the configuration and
 * every model; closing it frees what it opened (the requests layer frees its own
 * table first, see loop.c). */
#include "state.h"

#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/budget.h"
#include "common/log.h"
#include "common/prefix.h"
#include "common/slice.h"
#include "deptok.h"

/* Reads each deployment's config.json and checks its layout.  A deployment
 * whose model cannot be read is kept but never placed; its status says why. */
/* What a reloaded deployment (now at index di) keeps of its state before, for the
 * replicas that remain: requests completed, whether it was ever ready, what the canary
 * found (an unhealthy replica stays out of routing) and the rewiring backoff with the
 * replicas it waits to rewire. */
static void dep_keep(tsr_dep_state_t *s, int di, const tsr_dep_state_t *old)
{
    s->ever_ready = old->ever_ready;
    int n = s->n_completed < old->n_completed ? s->n_completed : old->n_completed;
    for (int r = 0; s->completed && old->completed && r < n; r++)
        s->completed[r] = old->completed[r];
    for (int r = 0; s->canary && old->canary && r < n; r++) s->canary[r] = old->canary[r];
    s->retry_backoff_ms = old->retry_backoff_ms;
    for (size_t t = 0; t < old->retry.n; t++)
        if (old->retry.replica[t] < s->n_completed)
            tsr_replica_set_add(&s->retry, di, old->retry.replica[t]);
    s->retry_at_ms = s->retry.n ? old->retry_at_ms : 0;
}

/* Two models cut alike: what a layout's memory and validity depend on. */
static bool same_shape(const tsr_model_info_t *a, const tsr_model_info_t *b)
{
    return a->hidden_size == b->hidden_size && a->intermediate_size == b->intermediate_size &&
           a->num_hidden_layers == b->num_hidden_layers &&
           a->num_attention_heads == b->num_attention_heads &&
           a->num_key_value_heads == b->num_key_value_heads && a->vocab_size == b->vocab_size &&
           a->dtype_bytes == b->dtype_bytes && a->head_dim == b->head_dim &&
           a->tie_word_embeddings == b->tie_word_embeddings;
}

void tsr_dep_note_cut(tsr_dep_state_t *ds, const tsr_deployment_t *d)
{
    ds->chose.auto_tensor = d->auto_tensor;
    ds->chose.auto_pipeline = d->auto_pipeline;
    ds->chose.auto_replicas = d->auto_replicas;
    ds->chose.ranged = d->replicas_max > 0;
    ds->chose.device = (int)d->device;
    ds->chose.tensor = d->tensor;
    ds->chose.pipeline = d->pipeline;
    ds->chose.replicas = d->replicas;
    ds->chose.latency_target_ms = d->latency_target_ms;
    ds->chose.weight_bytes = tsr_weight_elem_bytes(d);
    ds->chose.kv_dtype = tsr_kv_dtype_on(d->device, d->kv_dtype);
}

/* What a reloaded auto deployment keeps of old's choice: the cut, when nothing it
 * depends on changed (the model's shape, the device, the auto keys, the latency
 * target, the fixed dimension, the bytes of a weight and the KV cache's type); and
 * auto replicas, the count they grew to, while the cut stays. */
static void keep_layout(tsr_dep_state_t *s, tsr_deployment_t *d, const tsr_dep_state_t *old)
{
    if (!old->layout_chosen || !old->model_ok || !s->model_ok) return;
    if (!s->layout_chosen) {
        if (old->chose.auto_tensor != d->auto_tensor ||
            old->chose.auto_pipeline != d->auto_pipeline ||
            old->chose.device != (int)d->device ||
            old->chose.latency_target_ms != d->latency_target_ms ||
            old->chose.weight_bytes != tsr_weight_elem_bytes(d) ||
            old->chose.kv_dtype != tsr_kv_dtype_on(d->device, d->kv_dtype) ||
            (!d->auto_tensor && old->chose.tensor != d->tensor) ||
            (!d->auto_pipeline && old->chose.pipeline != d->pipeline) ||
            !same_shape(&old->model, &s->model))
            return;
        d->tensor = old->chose.tensor;
        d->pipeline = old->chose.pipeline;
        s->layout_chosen = true;
        snprintf(s->layout_why, sizeof s->layout_why, "%s", old->layout_why);
    }
    if (d->auto_replicas && old->chose.auto_replicas && old->chose.device == (int)d->device &&
        old->chose.tensor == d->tensor && old->chose.pipeline == d->pipeline) {
        d->replicas = old->chose.replicas;
        s->replicas_settled = old->replicas_settled;
    }
    /* replicas that followed load keep the count they reached, within the new range; a
     * fixed count that becomes a range starts from it */
    if (d->replicas_max && !old->chose.auto_replicas && old->chose.device == (int)d->device &&
        old->chose.tensor == d->tensor && old->chose.pipeline == d->pipeline) {
        int n = old->chose.replicas;
        d->replicas = n < d->replicas_min ? d->replicas_min
                      : n > d->replicas_max ? d->replicas_max : n;
        s->scale.ups = old->scale.ups;
        s->scale.downs = old->scale.downs;
        s->scale.last_ms = old->scale.last_ms;
        snprintf(s->scale.last, sizeof s->scale.last, "%s", old->scale.last);
    }
}

int tsr_dep_set_replicas(tsr_dep_state_t *ds, tsr_deployment_t *d, int n)
{
    if (n == d->replicas || n < 1) return 0;
    uint64_t *done = calloc((size_t)n, sizeof *done);
    tsr_canary_t *can = calloc((size_t)n, sizeof *can);
    if (!done || !can) {
        free(done);
        free(can);
        return -1;
    }
    for (int r = 0; r < ds->n_completed && r < n; r++) {
        if (ds->completed) done[r] = ds->completed[r];
        if (ds->canary) can[r] = ds->canary[r];
    }
    free(ds->completed);
    free(ds->canary);
    ds->completed = done;
    ds->canary = can;
    ds->n_completed = n;
    d->replicas = n;
    ds->chose.replicas = n;
    return 0;
}

tsr_dep_state_t *tsr_deps_build(tsr_config_t *cfg, const tsr_dep_state_t *old,
                                   size_t n_old, bool later)
{
    tsr_dep_state_t *deps = calloc(cfg->n_deployments ? cfg->n_deployments : 1, sizeof *deps);
    if (!deps) return NULL;
    for (size_t i = 0; i < cfg->n_deployments; i++) {
        tsr_deployment_t *d = &cfg->deployments[i];
        /* Workers get the model directory as an absolute path: they do not
         * share the coordinator's working directory. */
        char *real = realpath(d->model_path, NULL);
        if (real) {
            free(d->model_path);
            d->model_path = real;
        }
        tsr_dep_state_t *s = &deps[i];
        snprintf(s->name, sizeof s->name, "%s", d->name);
        s->scale.draining = -1;
        s->scale.window_wait_ms = -1;
        char err[1024];
        if (tsr_model_load_for(d, (int)i, cfg->path, &s->model, err, sizeof err) < 0) {
            snprintf(s->model_error, sizeof s->model_error, "%s", err);
        } else {
            s->model_ok = true;
        }
        tsr_deptok_choose(s, d->model_path, deps, i, old, n_old, later);
        /* An auto layout is chosen from the workers (resolve.c); a reload that
         * keeps the deployment's model, device and auto keys keeps the choice. */
        s->layout_chosen = !d->auto_tensor && !d->auto_pipeline;
        for (size_t j = 0; j < n_old; j++)
            if (!strcmp(old[j].name, s->name)) keep_layout(s, d, &old[j]);
        tsr_dep_note_cut(s, d);
        /* Requests completed per replica, kept across a reload for the
         * replicas that remain. */
        s->n_completed = d->replicas;
        s->completed = calloc((size_t)d->replicas, sizeof *s->completed);
        s->canary = calloc((size_t)d->replicas, sizeof *s->canary);
        for (size_t j = 0; j < n_old; j++)
            if (!strcmp(old[j].name, s->name)) dep_keep(s, (int)i, &old[j]);
    }
    return deps;
}

void tsr_deps_free(tsr_dep_state_t *deps, size_t n)
{
    for (size_t i = 0; deps && i < n; i++) {
        free(deps[i].retry.di);
        free(deps[i].retry.replica);
        free(deps[i].completed);
        free(deps[i].canary);
        free(deps[i].reshard.standby);
        tsr_tokref_drop(&deps[i].tok);
        free(deps[i].tok_dir);
    }
    free(deps);
}

int tsr_coord_dep_index(const tsr_coord_t *c, const char *name)
{
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        if (!strcmp(c->cfg->deployments[i].name, name)) return (int)i;
    return -1;
}

tsr_dep_state_t *tsr_coord_dep(tsr_coord_t *c, const char *name)
{
    int i = tsr_coord_dep_index(c, name);
    return i < 0 ? NULL : &c->deps[i];
}

tsr_canary_t *tsr_coord_canary(tsr_coord_t *c, const char *deployment, int r)
{
    tsr_dep_state_t *ds = tsr_coord_dep(c, deployment);
    return ds && ds->canary && r >= 0 && r < ds->n_completed ? &ds->canary[r] : NULL;
}

int tsr_coord_server_keys(const tsr_config_t *cfg, tsr_security_t *sec, char *err, size_t errlen)
{
    char e[1024], p[TSR_PATH_MAX + 64], pub[TSR_Z85_KEY];
    if (tsr_security_server(cfg->keys_dir, sec, e, sizeof e) < 0) {
        snprintf(err, errlen,
                 "coordinator.security is curve and its key pair cannot be read: %s "
                 "(create a key store with `tessera keys init %s`, or set "
                 "coordinator.security: none with loopback endpoints)",
                 e, cfg->keys_dir);
        return -1;
    }
    /* The public key handed to workers and clients: one others may rewrite
     * or that is not this key pair's would be refused by them, or mislead them. */
    tsr_keys_path(cfg->keys_dir, "coordinator.pub", p, sizeof p);
    if (access(p, F_OK) == 0) {
        if (tsr_key_read_public(p, pub, e, sizeof e) < 0) goto bad;
        if (strcmp(pub, sec->self.pub)) {
            snprintf(e, sizeof e, "%s is not the public key of the coordinator's key pair", p);
            goto bad;
        }
    }
    /* The allowed keys as the ZAP handler's start reads them. */
    tsr_allowed_key_t *keys = NULL;
    int n = tsr_keys_allowed(cfg->keys_dir, &keys, NULL, e, sizeof e);
    free(keys);
    if (n >= 0) return 0;
bad:
    snprintf(err, errlen, "coordinator.keys_dir: %s", e);
    return -1;
}

int tsr_state_open(tsr_coord_t *c, const char *config_path, char *err, size_t errlen)
{
    c->config_path = strdup(config_path);
    pthread_mutex_init(&c->tokreg.mu, NULL);
    if (!(c->tokload = tsr_tokload_new())) {
        snprintf(err, errlen, "cannot start the tokenizer loader: out of memory or descriptors");
        return -1;
    }
    if (tsr_config_load(config_path, &c->cfg, err, errlen) < 0) return -1;
    c->deps = tsr_deps_build(c->cfg, NULL, 0, false);
    if (c->deps) tsr_deptok_publish(c);
    c->reg = tsr_registry_new();
    if (!c->deps || !c->reg) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        if (!c->deps[i].model_ok) tsr_error("deployment %s will not be placed: %s",
                                            c->deps[i].name, c->deps[i].model_error);
    if (c->cfg->security_none) return 0;
    char e[1024];
    /* The handler must be bound before the sockets: ZeroMQ lets any
     * CURVE client in while no ZAP handler is bound. */
    if (tsr_coord_server_keys(c->cfg, &c->sec, err, errlen) < 0) return -1;
    if (!(c->zap = tsr_zap_start(c->cfg->keys_dir, e, sizeof e))) {
        snprintf(err, errlen, "coordinator.keys_dir: %s", e);
        return -1;
    }
    c->zap_generation = tsr_zap_generation(c->zap);
    return 0;
}

void tsr_state_close(tsr_coord_t *c)
{
    tsr_zap_stop(&c->zap);
    tsr_tokload_destroy(&c->tokload);
    memset(&c->sec, 0, sizeof c->sec);
    tsr_registry_destroy(&c->reg);
    tsr_deps_free(c->deps, c->cfg ? c->cfg->n_deployments : 0);
    c->deps = NULL;
    tsr_config_destroy(&c->cfg);
    free(c->config_path);
    c->config_path = NULL;
    tsr_tokreg_clear(&c->tokreg);
    pthread_mutex_destroy(&c->tokreg.mu);
}

void tsr_replica_set_free(tsr_replica_set_t *t)
{
    free(t->di);
    free(t->replica);
    memset(t, 0, sizeof *t);
}

void tsr_replica_set_add(tsr_replica_set_t *t, int di, int replica)
{
    if (di < 0) return;
    for (size_t i = 0; i < t->n; i++)
        if (t->di[i] == di && t->replica[i] == replica) return;
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 8;
        int *a = realloc(t->di, cap * sizeof *a), *b = a ? realloc(t->replica, cap * sizeof *b) : NULL;
        if (a) t->di = a;
        if (!a || !b) return;
        t->replica = b;
        t->cap = cap;
    }
    t->di[t->n] = di;
    t->replica[t->n++] = replica;
}

/* True when k (with its layout) is one of deployment di's pieces under the
 * current configuration. */
bool tsr_coord_piece_fits(const tsr_coord_t *c, int di, const tsr_piece_key_t *k)
{
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    if (!c->deps[di].model_ok || k->tp_size != d->tensor || k->pp_size != d->pipeline ||
        k->replica < 0 || k->replica >= d->replicas || k->stage < 0 || k->stage >= d->pipeline ||
        k->tp < 0 || k->tp >= d->tensor)
        return false;
    int b, e;
    tsr_layer_split(c->deps[di].model.num_hidden_layers, d->pipeline, k->stage, &b, &e);
    return k->layer_begin == b && k->layer_end == e;
}

bool tsr_coord_is_standby(const tsr_coord_t *c, const char *name)
{
    if (c->rebalance.active && !strcmp(c->rebalance.to, name)) return true;
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        for (int k = 0; c->deps[i].reshard.active && k < c->deps[i].reshard.n; k++)
            if (!strcmp(c->deps[i].reshard.standby[k].worker, name)) return true;
    return false;
}

bool tsr_coord_worker_idle(const tsr_coord_t *c, const tsr_worker_t *w)
{
    return w->state != TSR_W_DEAD && !w->drained && !w->has_piece && !w->finishing &&
           !tsr_coord_is_standby(c, w->name);
}

bool tsr_coord_serving_beside(const tsr_coord_t *c, const tsr_deployment_t *d)
{
    int di = tsr_coord_dep_index(c, d->name);
    return di >= 0 && c->deps[di].reshard.active && c->deps[di].reshard.switching &&
           c->deps[di].reshard.serving > 0;
}

int tsr_coord_idle_count(const tsr_coord_t *c, tsr_device_t kind)
{
    int n = 0;
    for (size_t i = 0, nw = tsr_registry_size(c->reg); i < nw; i++) {
        const tsr_worker_t *w = tsr_registry_at(c->reg, i);
        n += w->device == kind && tsr_coord_worker_idle(c, w);
    }
    return n;
}

bool tsr_coord_prefix_secret(const tsr_coord_t *c, const tsr_deployment_t *d, int tp_size,
                             int pp_size, uint8_t out[TSR_PREFIX_SECRET])
{
    static uint8_t random_key[32];
    static bool have_random;
    const void *key = random_key;
    size_t key_len = sizeof random_key;
    if (!d->prefix_cache) return false;
    if (c->sec.curve) {
        key = c->sec.self.sec;
        key_len = strlen(c->sec.self.sec);
    } else if (!have_random) {
        if (RAND_bytes(random_key, sizeof random_key) != 1) return false;
        have_random = true;
    }
    char msg[3 * TSR_PATH_MAX];
    int n = snprintf(msg, sizeof msg, "tessera prefix cache v1|%s|%s|%d|%d|%d|%d|%d|%d", d->name,
                     d->model_path, (int)d->device, tsr_kv_dtype_on(d->device, d->kv_dtype),
                     tsr_kv_dtype_on(d->device, d->matmul_dtype), d->weights_dtype, tp_size,
                     pp_size);
    if (n < 0 || (size_t)n >= sizeof msg) n = (int)sizeof msg - 1;
    uint8_t mac[32];
    unsigned int mac_len = sizeof mac;
    if (!HMAC(EVP_sha256(), key, (int)key_len, (const uint8_t *)msg, (size_t)n, mac, &mac_len))
        return false;
    memcpy(out, mac, TSR_PREFIX_SECRET);
    return true;
}
