/* coordinator.c: worker events, planning and reconciliation. */
#include "coordinator.h"

#include <errno.h>
#include <math.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/budget.h"
#include "common/log.h"
#include "common/util.h"
#include "health.h"
#include "reconciler.h"

#define PLAN_MIN_GAP_MS 20


/* ---- deployments ----------------------------------------------------------- */

tsr_tokref_t *tsr_tokref_hold(tsr_tokref_t *r)
{
    if (r) atomic_fetch_add(&r->refs, 1);
    return r;
}

void tsr_tokref_drop(tsr_tokref_t **r_p)
{
    if (!r_p || !*r_p) return;
    if (atomic_fetch_sub(&(*r_p)->refs, 1) == 1) {
        tsr_tok_destroy(&(*r_p)->tok);
        free(*r_p);
    }
    *r_p = NULL;
}

/* Whether dir has no tokenizer.json (a model for token ids only, no fault); then the
 * reason goes into s's tok_error. */
static bool tok_absent(tsr_dep_state_t *s, const char *dir)
{
    char *file = tsr_path_join(dir, "tokenizer.json");
    bool present = file && access(file, F_OK) == 0;
    free(file);
    if (!present)
        snprintf(s->tok_error, sizeof s->tok_error, "%s%stokenizer.json does not exist", dir,
                 dir[0] && dir[strlen(dir) - 1] != '/' ? "/" : "");
    return !present;
}

/* Warns when s's tokenizer knows ids its model does not (prompts with them are refused). */
static void tok_vocab_check(const tsr_dep_state_t *s)
{
    int n = s->tok ? tsr_tok_vocab_size(s->tok->tok) : 0;
    if (s->model_ok && n > s->model.vocab_size)
        tsr_warn("deployment %s: the tokenizer has %d ids, the model's vocabulary %d; prompts "
                 "with the others are refused", s->name, n, s->model.vocab_size);
}

/* Gives s the tokenizer t read from dir (taking it); a tokenizer that could not be
 * read (t NULL, the reason in err) is logged, unless the file is simply not there (any
 * more). */
static void dep_tok_install(tsr_dep_state_t *s, const char *dir, tsr_tokenizer_t *t,
                            const char *err, const tsr_file_id_t *file)
{
    s->tok_loading = false;
    if (!t) {
        if (tok_absent(s, dir)) return;
        snprintf(s->tok_error, sizeof s->tok_error, "%s", err);
        s->tok_broken = true;
        tsr_warn("deployment %s takes token ids only: %s", s->name, err);
        return;
    }
    if (!s->tok_dir || strcmp(s->tok_dir, dir)) {
        free(s->tok_dir);
        s->tok_dir = strdup(dir);
    }
    s->tok = calloc(1, sizeof *s->tok);
    if (!s->tok || !s->tok_dir) {
        tsr_tok_destroy(&t);
        free(s->tok);
        s->tok = NULL;
        snprintf(s->tok_error, sizeof s->tok_error, "out of memory");
        return;
    }
    s->tok_error[0] = '\0';
    s->tok->tok = t;
    s->tok->file = *file;
    atomic_init(&s->tok->refs, 1);
    tok_vocab_check(s);
}

/* Why a deployment whose tokenizer is being read refuses text for now (clients see it). */
#define TOK_LOADING_MSG "its tokenizer.json is being read; try again in a moment"

static volatile sig_atomic_t *stop_flag;

void tsr_coord_stop_flag(volatile sig_atomic_t *flag) { stop_flag = flag; }

/* Reads dir's tokenizer.json into s now. */
static void dep_tok_read(tsr_dep_state_t *s, const char *dir)
{
    char err[600];
    tsr_file_id_t id;
    tsr_tokenizer_t *t = tsr_tok_read_dir(dir, &id, err, sizeof err);
    dep_tok_install(s, dir, t, err, &id);
}

/* s takes what another state has of the same directory's tokenizer: a hold on it, or
 * the read in progress, or the reason there is none. */
static void dep_tok_take(tsr_dep_state_t *s, const tsr_dep_state_t *from)
{
    s->tok = tsr_tokref_hold(from->tok);
    s->tok_loading = from->tok_loading;
    s->tok_broken = from->tok_broken;
    snprintf(s->tok_error, sizeof s->tok_error, "%s", from->tok_error);
}

/* Whether an earlier state's tokenizer serves s (from dir): one read or being read from
 * the same directory by a deployment of this configuration (prev, n_prev; a directory is
 * read once however many deployments use it), or by the same deployment before the
 * reload (old, n_old) when its tokenizer.json has not changed since. */
static bool dep_tok_share(tsr_dep_state_t *s, const char *dir, const tsr_dep_state_t *prev,
                          size_t n_prev, const tsr_dep_state_t *old, size_t n_old)
{
    const tsr_dep_state_t *from = NULL;
    for (size_t k = 0; k < n_prev && !from; k++)
        if ((prev[k].tok || prev[k].tok_loading) && prev[k].tok_dir &&
            !strcmp(prev[k].tok_dir, dir))
            from = &prev[k];
    bool fresh = from != NULL;   /* this configuration's: its vocabulary not yet checked */
    tsr_file_id_t now = {0};
    for (size_t j = 0; j < n_old && !from; j++) {
        if (!old[j].tok_dir || strcmp(old[j].tok_dir, dir) || strcmp(old[j].name, s->name))
            continue;
        if (old[j].tok_loading) {
            from = &old[j];
        } else if (old[j].tok) {
            char *file = tsr_path_join(dir, "tokenizer.json");
            if (file) tsr_file_id(file, &now);
            free(file);
            if (tsr_file_id_same(&old[j].tok->file, &now)) from = &old[j];
        }
    }
    if (!from || !(s->tok_dir = strdup(dir))) return false;   /* out of memory: read it */
    dep_tok_take(s, from);
    if (fresh) tok_vocab_check(s);
    return true;
}

/* The deployment's tokenizer: an earlier state's (dep_tok_share), else read now, or
 * (later: true, a reload) marked to be read off the loop.  None is not an error (requests
 * then take token ids only); a file that is there but cannot be used is logged. */
static void dep_tokenizer(tsr_dep_state_t *s, const char *dir, const tsr_dep_state_t *prev,
                          size_t n_prev, const tsr_dep_state_t *old, size_t n_old, bool later)
{
    if (dep_tok_share(s, dir, prev, n_prev, old, n_old) || tok_absent(s, dir)) return;
    if (later && (s->tok_dir = strdup(dir))) {
        s->tok_loading = true;
        snprintf(s->tok_error, sizeof s->tok_error, TOK_LOADING_MSG);
        return;
    }
    if (stop_flag && *stop_flag) {   /* stopping as it starts: not worth the wait */
        snprintf(s->tok_error, sizeof s->tok_error, "not read: the coordinator is stopping");
        return;
    }
    dep_tok_read(s, dir);
}

void tsr_tok_refusal(const char *name, const char *why, bool loading, char *msg, size_t len)
{
    if (loading) snprintf(msg, len, "%s takes text prompts once %s", name, why);
    else snprintf(msg, len, "%s takes token ids only: it has no usable tokenizer (%s)", name, why);
}

static void touch(tsr_replica_set_t *t, int di, int replica);

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
        if (old->retry.replica[t] < s->n_completed) touch(&s->retry, di, old->retry.replica[t]);
    s->retry_at_ms = s->retry.n ? old->retry_at_ms : 0;
}

/* Reads each deployment's config.json and checks its layout.  A deployment
 * whose model cannot be read is kept but never placed; its status says why. */
static tsr_dep_state_t *deps_build(tsr_config_t *cfg, const tsr_dep_state_t *old,
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
        char err[1024];
        if (tsr_model_load_for(d, (int)i, cfg->path, &s->model, err, sizeof err) < 0) {
            snprintf(s->model_error, sizeof s->model_error, "%s", err);
        } else {
            s->model_ok = true;
        }
        dep_tokenizer(s, d->model_path, deps, i, old, n_old, later);
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

static void deps_free(tsr_dep_state_t *deps, size_t n)
{
    for (size_t i = 0; deps && i < n; i++) {
        free(deps[i].retry.di);
        free(deps[i].retry.replica);
        free(deps[i].completed);
        free(deps[i].canary);
        tsr_tokref_drop(&deps[i].tok);
        free(deps[i].tok_dir);
    }
    free(deps);
}

/* ---- the tokenizers the HTTP threads use ---------------------------------------- */

static void tokreg_clear(tsr_tokreg_t *reg)
{
    for (size_t i = 0; i < reg->n; i++) tsr_tokref_drop(&reg->v[i].tok);
    free(reg->v);
    reg->v = NULL;
    reg->n = 0;
}

/* Publishes the current deployments' tokenizers (after a load or a reload). */
static void tokreg_publish(tsr_coord_t *c)
{
    tsr_tokreg_entry_t *v = calloc(c->cfg->n_deployments ? c->cfg->n_deployments : 1, sizeof *v);
    pthread_mutex_lock(&c->tokreg.mu);
    tokreg_clear(&c->tokreg);
    for (size_t i = 0; v && i < c->cfg->n_deployments; i++) {
        const tsr_deployment_t *d = &c->cfg->deployments[i];
        snprintf(v[i].name, sizeof v[i].name, "%s", d->name);
        v[i].tok = tsr_tokref_hold(c->deps[i].tok);
        snprintf(v[i].chat_template, sizeof v[i].chat_template, "%s", d->chat_template);
        v[i].max_seq_len = d->max_seq_len;
        /* for HTTP clients: the reason without the server's directories */
        const char *why = c->deps[i].tok_error, *dir = d->model_path ? d->model_path : "";
        size_t dl = strlen(dir);
        if (dl && !strncmp(why, dir, dl)) why += dl + (why[dl] == '/');
        snprintf(v[i].tok_error, sizeof v[i].tok_error, "%s", why);
        v[i].tok_loading = c->deps[i].tok_loading;
    }
    c->tokreg.v = v;
    c->tokreg.n = v ? c->cfg->n_deployments : 0;
    pthread_mutex_unlock(&c->tokreg.mu);
}

int tsr_tokreg_get(tsr_tokreg_t *reg, const char *name, tsr_tokreg_entry_t *out)
{
    int rc = -1;
    pthread_mutex_lock(&reg->mu);
    for (size_t i = 0; i < reg->n; i++)
        if (!strcmp(reg->v[i].name, name)) {
            *out = reg->v[i];
            out->tok = tsr_tokref_hold(reg->v[i].tok);
            rc = 0;
            break;
        }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

/* Clients are asked whether they are still there at most this often. */
#define PROBE_GAP_MS 100

static int dep_index(const tsr_coord_t *c, const char *name)
{
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        if (!strcmp(c->cfg->deployments[i].name, name)) return (int)i;
    return -1;
}

tsr_dep_state_t *tsr_coord_dep(tsr_coord_t *c, const char *name)
{
    int i = dep_index(c, name);
    return i < 0 ? NULL : &c->deps[i];
}

tsr_coord_t *tsr_coord_new(const char *config_path, int adopt_grace_ms, char *err, size_t errlen)
{
    tsr_coord_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->config_path = strdup(config_path);
    pthread_mutex_init(&c->tokreg.mu, NULL);
    if (!(c->tokload = tsr_tokload_new())) {
        snprintf(err, errlen, "cannot start the tokenizer loader: out of memory or descriptors");
        goto fail;
    }
    if (tsr_config_load(config_path, &c->cfg, err, errlen) < 0) goto fail;
    c->deps = deps_build(c->cfg, NULL, 0, false);
    if (c->deps) tokreg_publish(c);
    c->reg = tsr_registry_new();
    if (!c->deps || !c->reg) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        if (!c->deps[i].model_ok) tsr_error("deployment %s will not be placed: %s",
                                            c->deps[i].name, c->deps[i].model_error);
    char e[512];
    if (!c->cfg->security_none) {
        /* The handler must be bound before the sockets: ZeroMQ lets any
         * CURVE client in while no ZAP handler is bound. */
        if (tsr_security_server(c->cfg->keys_dir, &c->sec, e, sizeof e) < 0) {
            snprintf(err, errlen,
                     "coordinator.security is curve and its key pair cannot be read: %s "
                     "(create a key store with `tessera keys init %s`, or set "
                     "coordinator.security: none with loopback endpoints)",
                     e, c->cfg->keys_dir);
            goto fail;
        }
        if (!(c->zap = tsr_zap_start(c->cfg->keys_dir, e, sizeof e))) {
            snprintf(err, errlen, "coordinator.keys_dir: %s", e);
            goto fail;
        }
        c->zap_generation = tsr_zap_generation(c->zap);
    }
    c->wsock = tsr_sock_router_sec(c->cfg->workers_endpoint, TSR_WIRE_MAX_WORKER, &c->sec, e,
                                   sizeof e);
    if (!c->wsock) {
        snprintf(err, errlen, "workers_endpoint: %s", e);
        goto fail;
    }
    /* Requests up to twice the decoder's limit are read, so one over the
     * limit can be answered with the limit named; ZeroMQ cuts off larger. */
    c->csock = tsr_sock_router_sec(c->cfg->control_endpoint, 2 * (size_t)TSR_WIRE_MAX_REQUEST,
                                   &c->sec, e, sizeof e);
    if (!c->csock) {
        snprintf(err, errlen, "control_endpoint: %s", e);
        goto fail;
    }
    c->reply_sock = c->csock;
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
            goto fail;
        }
    }
    c->cmon = tsr_sock_monitor(c->csock, ZMQ_EVENT_DISCONNECTED);
    /* A reply to a client that went away fails (EHOSTUNREACH) instead of
     * vanishing, and one to a slow client fails with EAGAIN: the router
     * cancels a request whose client left, never one that reads slowly. */
    int mandatory = 1;
    if (zmq_setsockopt(c->csock, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory) != 0) {
        snprintf(err, errlen, "control_endpoint: cannot set ZMQ_ROUTER_MANDATORY: %s",
                 zmq_strerror(errno));
        goto fail;
    }
    c->started_ms = tsr_now_ms();
    c->plan_after_ms =
        c->started_ms + (adopt_grace_ms < 0 ? c->cfg->worker_timeout_ms : adopt_grace_ms);
    c->dirty = true;
    return c;
fail:
    tsr_coord_destroy(&c);
    return NULL;
}

void tsr_coord_destroy(tsr_coord_t **self_p)
{
    if (!self_p || !*self_p) return;
    tsr_coord_t *c = *self_p;
    tsr_sock_close(&c->wsock);
    if (c->csock) tsr_sock_monitor_close(c->csock, &c->cmon);
    tsr_sock_close(&c->csock);
    tsr_sock_close(&c->bsock);
    tsr_zap_stop(&c->zap);
    tsr_tokload_destroy(&c->tokload);
    memset(&c->sec, 0, sizeof c->sec);
    tsr_registry_destroy(&c->reg);
    deps_free(c->deps, c->cfg ? c->cfg->n_deployments : 0);
    tsr_config_destroy(&c->cfg);
    free(c->config_path);
    tokreg_clear(&c->tokreg);
    pthread_mutex_destroy(&c->tokreg.mu);
    for (size_t i = 0; i < c->n_reqs; i++) tsr_request_free(&c->reqs[i]);
    free(c->metrics);
    free(c->reqs);
    free(c->lost.di);
    free(c->lost.replica);
    free(c);
    *self_p = NULL;
}

/* ---- sending --------------------------------------------------------------- */

/* Every send to a worker goes through here: one that cannot be queued (the
 * worker's connection is gone or its queue is full) is counted in
 * stats.sends_failed and logged, at most once a second. */
int tsr_coord_send(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, tsr_env_t *env)
{
    if (tsr_wire_send(c->wsock, rid, rid_len, env) == 0) return 0;
    int e = errno;
    c->stats.sends_failed++;
    int64_t now = tsr_now_ms();
    if (now - c->send_warned_ms >= 1000) {
        c->send_warned_ms = now;
        tsr_warn("could not send %s to %s: %s (%llu send(s) failed so far)", tsr_env_kind(env),
                 env->worker && env->worker[0] ? env->worker : "a worker", zmq_strerror(e),
                 (unsigned long long)c->stats.sends_failed);
    }
    errno = e;
    return -1;
}

static void send_to(tsr_coord_t *c, tsr_worker_t *w, tsr_env_t *env)
{
    env->worker = w->name;
    if (!env->epoch) env->epoch = c->epoch;
    tsr_coord_send(c, w->rid, w->rid_len, env);
}

static void send_reset(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, const char *name,
                       bool keep, const char *reason)
{
    Tessera__Reset r = TESSERA__RESET__INIT;
    r.reason = (char *)reason;
    r.keep_assignment = keep;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = c->epoch;
    env.worker = (char *)name;
    env.body_case = TESSERA__ENVELOPE__BODY_RESET;
    env.reset = &r;
    tsr_coord_send(c, rid, rid_len, &env);
}

/* The data-port secret of h's replica for h's epoch: HMAC-SHA256 under a
 * random key of this process, so it is the same for every piece of the
 * replica within an epoch, new with every epoch, and needs no state.  A
 * restarted coordinator makes new ones; the next epoch carries them.  The
 * result lives in a static buffer until the next call (the assignment is
 * packed before then).  0, or -1 when no random key could be made. */
static int data_secret(const tsr_holding_t *h, uint8_t out[32])
{
    static uint8_t key[32];
    static bool have_key;
    uint8_t msg[TSR_NAME_MAX + 1 + 16];
    size_t dl = strnlen(h->key.deployment, TSR_NAME_MAX), ml = 0;
    unsigned int outl = 32;
    if (!have_key && RAND_bytes(key, sizeof key) != 1) return -1;
    have_key = true;
    memcpy(msg, h->key.deployment, dl);
    ml = dl;
    msg[ml++] = 0;
    for (int i = 7; i >= 0; i--) msg[ml++] = (uint8_t)((uint64_t)h->key.replica >> (8 * i));
    for (int i = 7; i >= 0; i--) msg[ml++] = (uint8_t)(h->epoch >> (8 * i));
    return HMAC(EVP_sha256(), key, sizeof key, msg, ml, out, &outl) ? 0 : -1;
}

/* The KV budget sent with a piece: kv_cache_mib's; for a cuda deployment
 * without it, the blocks gpu_memory_percent leaves for the tightest
 * (stage, GPU) pair of the replica (every rank must hold the same count),
 * priced as the worker prices them (at stage 0's layers); 0: the worker's
 * default (no member's memory is known).  A new budget reloads every
 * member's weights, so what the members hold is kept while the replica is
 * not whole, and is only ever lowered. */
static uint64_t kv_budget(const tsr_coord_t *c, const tsr_holding_t *h, int di)
{
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    const tsr_model_info_t *m = &c->deps[di].model;
    if (d->kv_cache_mib || d->device != TSR_DEVICE_CUDA || !c->deps[di].model_ok)
        return (uint64_t)d->kv_cache_mib << 20;
    int blocks = -1, members = 0;
    uint64_t held = 0;
    size_t n;
    tsr_worker_t *const *ws = tsr_registry_replica(c->reg, h->key.deployment, h->key.replica, &n);
    for (size_t i = 0; i < n; i++) {
        const tsr_worker_t *w = ws[i];
        members++;
        if (w->piece.kv_budget && (!held || w->piece.kv_budget < held)) held = w->piece.kv_budget;
        if (!w->memory) continue;
        int b = tsr_cuda_kv_blocks(m, d, w->piece.key.stage, w->memory);
        if (blocks < 0 || b < blocks) blocks = b;
    }
    /* a member without room still gets one block: the planner moves it;
     * the budget is priced at stage 0, the largest (tsr_kv_pool_blocks) */
    uint64_t fresh = blocks < 0 ? 0
                                : (uint64_t)(blocks > 0 ? blocks : 1) *
                                      tsr_cuda_block_bytes(m, d, 0);
    if (held && (members < d->tensor * d->pipeline || !fresh || fresh >= held)) return held;
    return fresh;
}

/* The deployment keys a piece is sent with besides its model and KV budget,
 * X(Assignment field, its value for deployment d): filled in by
 * fill_assignment, compared by assignment_changed (a reload) and
 * assignment_differs (adoption), so a new key cannot be missed by one.
 * kv_dtype and matmul_dtype go resolved: auto and the type it stands for
 * are the same. */
#define SENT_KEYS(X, d)                                                                       \
    X(max_seq_len, (d)->max_seq_len) X(max_batch, (d)->max_batch)                             \
    X(prefill_chunk, (d)->prefill_chunk) X(max_queue, (d)->max_queue)                         \
    X(kv_dtype, tsr_kv_dtype_on((d)->device, (d)->kv_dtype))                                  \
    X(matmul_dtype, tsr_kv_dtype_on((d)->device, (d)->matmul_dtype))                        \
    X(collective_timeout_ms, (d)->collective_timeout_ms)

static void fill_keys(Tessera__Assignment *a, const tsr_deployment_t *d)
{
#define FILL_KEY(f, v) a->f = (uint32_t)(v);
    SENT_KEYS(FILL_KEY, d)
#undef FILL_KEY
}

/* Which of the keys a worker was sent with its piece the configuration no
 * longer has (a file edited while the coordinator was down): written into
 * why, or NULL when they all match.  The KV budget is not among them (it is
 * kept on purpose, see try_adopt). */
static const char *assignment_differs(const tsr_deployment_t *d, const Tessera__Assignment *a,
                                      char *why, size_t len)
{
    const struct {
        const char *key;
        uint64_t held, now;
    } k[] = {
#define KEY_ENTRY(f, v) {#f, a->f, (uint64_t)(v)},
        SENT_KEYS(KEY_ENTRY, d)
#undef KEY_ENTRY
    };
    if (strcmp(a->model_path ? a->model_path : "", d->model_path)) {
        snprintf(why, len, "it holds model %.200s; the configuration now has %.200s",
                 a->model_path ? a->model_path : "", d->model_path);
        return why;
    }
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
        if (k[i].held != k[i].now) {
            const char *held = NULL, *now = NULL;   /* types by name where they have one */
            if (strstr(k[i].key, "_dtype") && k[i].held <= INT_MAX)
                held = tsr_kv_dtype_name((int)k[i].held), now = tsr_kv_dtype_name((int)k[i].now);
            if (held && now)
                snprintf(why, len, "it was given %s %s; the configuration now has %s", k[i].key,
                         held, now);
            else
                snprintf(why, len, "it was given %s %llu; the configuration now has %llu",
                         k[i].key, (unsigned long long)k[i].held, (unsigned long long)k[i].now);
            return why;
        }
    return NULL;
}

static void fill_assignment(const tsr_coord_t *c, const tsr_holding_t *h,
                            Tessera__Assignment *a, int di)
{
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    static uint8_t secret[32];
    tsr_piece_to_wire(&h->key, a);
    a->epoch = h->epoch;
    a->model_path = d->model_path;
    fill_keys(a, d);
    a->kv_cache_bytes = kv_budget(c, h, di);
    a->device = d->device == TSR_DEVICE_CUDA ? TESSERA__DEVICE_KIND__DEVICE_CUDA
                                             : TESSERA__DEVICE_KIND__DEVICE_CPU;
    /* Without one the workers refuse to form (collective_tcp.c): fail closed. */
    if (data_secret(h, secret) == 0) {
        a->data_secret.data = secret;
        a->data_secret.len = sizeof secret;
    } else {
        tsr_error("no random key for data-port secrets: %s's replica %d cannot form",
                  h->key.deployment, h->key.replica);
    }
}

/* Whether a reload changes what a deployment's workers were given without
 * changing its layout: they must be sent their pieces again. */
static bool assignment_changed(const tsr_deployment_t *od, const tsr_deployment_t *nd)
{
    Tessera__Assignment was = TESSERA__ASSIGNMENT__INIT;
    char why[512];
    was.model_path = od->model_path;
    fill_keys(&was, od);
    return assignment_differs(nd, &was, why, sizeof why) || od->kv_cache_mib != nd->kv_cache_mib ||
           /* it sizes the KV pool of cuda pieces without kv_cache_mib only */
           (nd->device == TSR_DEVICE_CUDA && !nd->kv_cache_mib &&
            od->gpu_memory_percent != nd->gpu_memory_percent);
}

/* The data endpoints of every piece of key's replica in key's layout,
 * indexed by slot ("" where a piece has no holder yet), followed by their
 * GPUs' PCI bus ids in the same order: 2 * *n_out entries.  Caller frees. */
static char **replica_peers(tsr_coord_t *c, const tsr_piece_key_t *key, size_t *n_out)
{
    size_t n = (size_t)key->tp_size * (size_t)key->pp_size;
    char **peers = calloc(n ? 2 * n : 1, sizeof *peers);
    if (!peers) return NULL;
    for (size_t k = 0; k < n; k++) {
        tsr_worker_t *o = tsr_registry_at_slot(c->reg, key->deployment, key->replica,
                                               key->tp_size, key->pp_size, (int)k);
        peers[k] = o ? o->data_endpoint : "";
        peers[n + k] = o ? o->nccl_device : "";
    }
    *n_out = n;
    return peers;
}

/* Sends w its piece with the replica's peer list (replica_peers': endpoints,
 * then devices); peers NULL: look them up. */
static void send_assign_peers(tsr_coord_t *c, tsr_worker_t *w, int di, char **peers,
                              size_t n_peers)
{
    Tessera__Assignment a = TESSERA__ASSIGNMENT__INIT;
    fill_assignment(c, &w->piece, &a, di);
    w->piece.kv_budget = a.kv_cache_bytes;
    char **own = peers ? NULL : replica_peers(c, &w->piece.key, &n_peers);
    a.peers = peers ? peers : own;
    a.n_peers = a.peers ? n_peers : 0;
    a.peer_devices = a.peers ? a.peers + n_peers : NULL;
    a.n_peer_devices = a.n_peers;
    Tessera__Assign as = TESSERA__ASSIGN__INIT;
    as.assignment = &a;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = w->piece.epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_ASSIGN;
    env.assign = &as;
    send_to(c, w, &env);
    free(own);
    c->stats.assigns++;
}

static void send_assign(tsr_coord_t *c, tsr_worker_t *w, int di)
{
    send_assign_peers(c, w, di, NULL, 0);
}

static void send_unassign(tsr_coord_t *c, tsr_worker_t *w, const char *reason)
{
    Tessera__Unassign u = TESSERA__UNASSIGN__INIT;
    u.reason = (char *)reason;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.body_case = TESSERA__ENVELOPE__BODY_UNASSIGN;
    env.unassign = &u;
    send_to(c, w, &env);
    c->stats.unassigns++;
}

/* ---- planning -------------------------------------------------------------- */

typedef tsr_replica_set_t touched_t;

static void touch(touched_t *t, int di, int replica)
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

/* w, one of the replica's members m, is ready while every other member of
 * its stage (all tp_size - 1 of them: one dead or not yet registered holds
 * no piece and is not among m) has reported a failure in its epoch, one at
 * least that the group's operation passed its deadline.  Until all have, a
 * member that is only slower to report is not told from the one they
 * waited for. */
static bool stage_waited_for(tsr_worker_t *const *m, size_t n, const tsr_worker_t *w)
{
    if (!w->has_piece || w->state != TSR_W_READY) return false;
    bool deadline = false;
    int reported = 0;
    for (size_t i = 0; i < n; i++) {
        const tsr_worker_t *o = m[i];
        if (o == w || o->piece.key.stage != w->piece.key.stage) continue;
        if (o->piece.epoch != w->piece.epoch || o->state != TSR_W_FAILED) return false;
        deadline |= o->past_deadline;
        reported++;
    }
    return deadline && reported == w->piece.key.tp_size - 1;
}

bool tsr_coord_waited_for(tsr_coord_t *c, const tsr_worker_t *w)
{
    if (!w->has_piece) return false;
    size_t n;
    tsr_worker_t *const *m =
        tsr_registry_replica(c->reg, w->piece.key.deployment, w->piece.key.replica, &n);
    if (!stage_waited_for(m, n, w)) return false;
    /* In a pipeline a rank held up by a hand-off with its neighbour (the
     * same tp rank in the stage before or after) looks the same to its own
     * group: where that neighbour is gone or is itself waited for, which of
     * the two held things up is not known, and neither is named. */
    for (int s = w->piece.key.stage - 1; s <= w->piece.key.stage + 1; s += 2) {
        if (s < 0 || s >= w->piece.key.pp_size) continue;
        const tsr_worker_t *nb = NULL;
        for (size_t i = 0; i < n && !nb; i++)
            if (m[i]->piece.key.stage == s && m[i]->piece.key.tp == w->piece.key.tp) nb = m[i];
        if (!nb || nb->piece.epoch != w->piece.epoch || stage_waited_for(m, n, nb)) return false;
    }
    return true;
}

int tsr_coord_waited_for_text(tsr_coord_t *c, const tsr_deployment_t *d, int replica, char *buf,
                              size_t len)
{
    enum { NAMED = 4 };   /* then "and N more": the text stays short */
    int count = 0;
    size_t at = 0;
    if (len) buf[0] = '\0';
    for (int k = 0; k < d->pipeline * d->tensor; k++) {
        tsr_worker_t *w = tsr_registry_at_slot(c->reg, d->name, replica, d->tensor, d->pipeline, k);
        if (!w || !tsr_coord_waited_for(c, w)) continue;
        if (count < NAMED && at < len)
            at += (size_t)snprintf(buf + at, len - at, "%s%s (stage %d tp %d)", count ? ", " : "",
                                   w->name, w->piece.key.stage, w->piece.key.tp);
        count++;
    }
    if (count > NAMED && at < len) snprintf(buf + at, len - at, " and %d more", count - NAMED);
    return count;
}

static void rewire(tsr_coord_t *c, int di, int replica)
{
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    char waited[512];
    if (tsr_coord_waited_for_text(c, d, replica, waited, sizeof waited))
        tsr_warn("deployment %s replica %d: its tensor-parallel group waited past "
                 "collective_timeout_ms for %s, which reported no failure while the group's "
                 "other ranks did",
                 d->name, replica, waited);
    tsr_requests_move_replica(c, d->name, replica, "the replica was rewired for a new plan");
    /* One peer list serves every member. */
    tsr_piece_key_t key = {.replica = replica, .tp_size = d->tensor, .pp_size = d->pipeline};
    snprintf(key.deployment, sizeof key.deployment, "%s", d->name);
    size_t n_peers = 0;
    char **peers = replica_peers(c, &key, &n_peers);
    size_t n;
    tsr_worker_t *const *m = tsr_registry_replica(c->reg, d->name, replica, &n);
    for (size_t i = 0; i < n; i++) {
        tsr_worker_t *w = m[i];
        w->piece.epoch = c->epoch;
        w->state = TSR_W_LOADING;
        w->reason[0] = '\0';
        if (peers) send_assign_peers(c, w, di, peers, n_peers);
        else send_assign(c, w, di);
    }
    free(peers);
    tsr_info("rewire %s replica %d (epoch %llu): %zu member(s) form its data plane", d->name,
             replica, (unsigned long long)c->epoch, n);
}

static int by_node(const void *a, const void *b)
{
    return strcmp((*(tsr_worker_t *const *)a)->node, (*(tsr_worker_t *const *)b)->node);
}

static bool linked(const tsr_worker_t *a, const tsr_worker_t *b)
{
    for (int i = 0; i < a->n_nvlink; i++) {
        if (!strcmp(a->nvlink[i], b->pci_bus_id)) return true;
        for (int j = 0; j < b->n_nvlink; j++)
            if (!strcmp(a->nvlink[i], b->nvlink[j])) return true;  /* one NVSwitch */
    }
    for (int j = 0; j < b->n_nvlink; j++)
        if (!strcmp(b->nvlink[j], a->pci_bus_id)) return true;
    return false;
}

/* The NVLink domains of the n live workers ws: on each node, the GPUs that
 * NVLinks join (directly, or through a switch both reach) are one domain,
 * named after the node and its lowest bus id; a GPU without NVLink has none. */
static void nvlink_domains(tsr_worker_t **ws, size_t n)
{
    tsr_worker_t **s = malloc((n ? n : 1) * sizeof *s);
    int *up = malloc((n ? n : 1) * sizeof *up);
    const char **low = calloc(n ? n : 1, sizeof *low);
    if (!s || !up || !low) {
        free(s);
        free(up);
        free(low);
        return;
    }
    memcpy(s, ws, n * sizeof *s);
    qsort(s, n, sizeof *s, by_node);
    for (size_t a = 0, b; a < n; a = b) {
        for (b = a; b < n && !strcmp(s[b]->node, s[a]->node); b++) up[b] = (int)b;
        for (size_t i = a; i < b; i++)
            for (size_t j = a; j < i; j++) {
                if (!s[i]->n_nvlink || !s[j]->n_nvlink || !linked(s[i], s[j])) continue;
                int x = (int)i, y = (int)j;
                while (up[x] != x) x = up[x];
                while (up[y] != y) y = up[y];
                if (x != y) up[x] = y;
            }
        /* each root keeps its component's lowest bus id (up[] then points
         * only at roots, so low[] can live beside it in the root's slot) */
        for (size_t i = a; i < b; i++) {
            int x = (int)i;
            while (up[x] != x) x = up[x];
            up[i] = x;
            if (s[i]->pci_bus_id[0] &&
                (!low[x] || strcmp(s[i]->pci_bus_id, low[x]) < 0))
                low[x] = s[i]->pci_bus_id;
        }
        for (size_t i = a; i < b; i++) {
            s[i]->nvlink_domain[0] = '\0';
            if (s[i]->n_nvlink && s[i]->pci_bus_id[0])
                snprintf(s[i]->nvlink_domain, sizeof s[i]->nvlink_domain, "%s/nvl:%s",
                         s[i]->node, low[up[i]]);
        }
    }
    free(s);
    free(up);
    free(low);
}

void tsr_coord_plan_now(tsr_coord_t *c, int64_t now_ms)
{
    if (now_ms < c->plan_after_ms) {
        c->dirty = true;
        return;
    }
    c->dirty = false;
    c->last_plan_ms = now_ms;
    tsr_coord_replan(c, now_ms);
}

void tsr_coord_replan(tsr_coord_t *c, int64_t now_ms)
{
    (void)now_ms;
    size_t n = tsr_registry_size(c->reg);
    tsr_plan_worker_t *pw = calloc(n ? n : 1, sizeof *pw);
    tsr_worker_t **ws = calloc(n ? n : 1, sizeof *ws);
    tsr_action_t *acts = calloc(n ? n : 1, sizeof *acts);
    int *layers = calloc(c->cfg->n_deployments ? c->cfg->n_deployments : 1, sizeof *layers);
    tsr_config_t view = *c->cfg;
    tsr_deployment_t *placeable = NULL;
    tsr_plan_t *plan = NULL;
    int *map = NULL;    /* planner's deployment index -> config index */
    uint64_t **need = NULL;
    if (!pw || !ws || !acts || !layers) goto out;

    /* Deployments whose model could not be read are hidden from the planner
     * (replicas 0 would be invalid, so they are left out by name instead). */
    placeable = calloc(c->cfg->n_deployments ? c->cfg->n_deployments : 1, sizeof *placeable);
    if (!placeable) goto out;
    view.deployments = placeable;
    view.n_deployments = 0;
    map = calloc(c->cfg->n_deployments ? c->cfg->n_deployments : 1, sizeof *map);
    if (!map) goto out;
    /* What one piece of each stage needs on its GPU (cuda deployments). */
    need = calloc(c->cfg->n_deployments ? c->cfg->n_deployments : 1, sizeof *need);
    if (!need) goto out;
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        if (!c->deps[i].model_ok) continue;
        const tsr_deployment_t *d = &c->cfg->deployments[i];
        if (d->device == TSR_DEVICE_CUDA) {
            uint64_t *st = calloc((size_t)d->pipeline, sizeof *st);
            if (!st) goto out;
            for (int s = 0; s < d->pipeline; s++)
                st[s] = tsr_piece_need(&c->deps[i].model, d, s);
            need[view.n_deployments] = st;
        }
        map[view.n_deployments] = (int)i;
        layers[view.n_deployments] = c->deps[i].model.num_hidden_layers;
        placeable[view.n_deployments++] = c->cfg->deployments[i];
    }

    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        if (w->state == TSR_W_DEAD) continue;
        ws[k] = w;
        pw[k].name = w->name;
        pw[k].node = w->node;
        pw[k].device = w->device;
        pw[k].memory = w->device == TSR_DEVICE_CUDA ? w->memory : 0;
        pw[k].eligible = !w->drained;
        if (w->has_piece) pw[k].current = w->piece.key;
        k++;
    }
    nvlink_domains(ws, k);
    for (size_t i = 0; i < k; i++) {
        pw[i].domain = ws[i]->nvlink_domain;
        pw[i].gpu = ws[i]->pci_bus_id;
    }

    char err[256];
    if (tsr_plan_compute_mem(&view, layers, (const uint64_t *const *)need, pw, k, &plan, err,
                             sizeof err) < 0) {
        tsr_error("planner: %s", err);
        goto out;
    }
    c->stats.plans++;

    size_t na = tsr_reconcile_actions(plan, pw, k, acts);
    /* Epochs never wrap: at the cap nothing more is planned, loudly. */
    if ((na > 0 || c->lost.n > 0) && c->epoch >= TSR_EPOCH_MAX) {
        tsr_error("plan epoch %llu is at its limit %llu: no new plan can be made; restart "
                  "the workers and the coordinator",
                  (unsigned long long)c->epoch, (unsigned long long)TSR_EPOCH_MAX);
        goto out;
    }
    if (na > 0) c->epoch++;
    touched_t touched = {0};
    for (size_t i = 0; i < na; i++) {
        tsr_worker_t *w = ws[acts[i].worker];
        if (acts[i].kind == TSR_ACT_UNASSIGN) {
            tsr_info("unassign %s from %s r%d s%d t%d (epoch %llu)", w->name,
                     w->piece.key.deployment, w->piece.key.replica, w->piece.key.stage, w->piece.key.tp,
                     (unsigned long long)c->epoch);
            touch(&touched, dep_index(c, w->piece.key.deployment), w->piece.key.replica);
            send_unassign(c, w, w->drained ? "drained" : "piece no longer in the plan");
            tsr_registry_clear_piece(c->reg, w);
            w->state = TSR_W_IDLE;
            w->reason[0] = w->detail[0] = '\0';
            continue;
        }
        const tsr_piece_t *p = acts[i].piece;
        int di = map[p->deployment];
        const tsr_deployment_t *d = &c->cfg->deployments[di];
        if (w->has_piece) touch(&touched, dep_index(c, w->piece.key.deployment), w->piece.key.replica);
        tsr_piece_key_t key = {.replica = p->replica, .stage = p->stage, .tp = p->tp,
                               .tp_size = d->tensor, .pp_size = d->pipeline,
                               .layer_begin = p->layer_begin, .layer_end = p->layer_end};
        snprintf(key.deployment, sizeof key.deployment, "%s", d->name);
        if (tsr_registry_set_piece(c->reg, w, &key, c->epoch, 0) < 0) {
            /* the piece stays unplaced; the next plan tries again */
            tsr_error("out of memory assigning %s r%d s%d t%d to %s", d->name, p->replica,
                      p->stage, p->tp, w->name);
            w->state = TSR_W_IDLE;
            c->dirty = true;
            continue;
        }
        w->state = TSR_W_LOADING;
        w->reason[0] = w->detail[0] = '\0';
        tsr_info("assign %s r%d s%d t%d layers [%d,%d) to %s on %s (epoch %llu)", d->name,
                 p->replica, p->stage, p->tp, p->layer_begin, p->layer_end, w->name, w->node,
                 (unsigned long long)c->epoch);
        touch(&touched, di, p->replica);
    }
    /* A replica that lost a worker is rewired even when nobody replaces it:
     * its survivors stop waiting on the dead peer and hold their weights
     * until the replica is whole again. */
    for (size_t t = 0; t < c->lost.n; t++) {
        if (!na && t == 0) c->epoch++;
        touch(&touched, c->lost.di[t], c->lost.replica[t]);
    }
    c->lost.n = 0;
    /* Every replica that changed is rewired as a whole in the new epoch: its
     * members form new communicators from the new peer list (the ones that
     * kept their piece keep their weights). */
    for (size_t t = 0; t < touched.n; t++) rewire(c, touched.di[t], touched.replica[t]);
    free(touched.di);
    free(touched.replica);

    /* What each deployment lacks, for status. */
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        c->deps[i].short_by = 0, c->deps[i].shortage[0] = '\0';
    for (size_t i = 0; i < view.n_deployments; i++) {
        c->deps[map[i]].short_by = plan->deps[i].short_by;
        c->deps[map[i]].short_memory = plan->deps[i].mem_stage >= 0 ? plan->deps[i].mem_need : 0;
        if (plan->deps[i].short_by) {
            tsr_plan_shortage_of(plan, i, pw, c->deps[map[i]].shortage,
                                 sizeof c->deps[map[i]].shortage);
            tsr_warn("deployment %s: %s", c->cfg->deployments[map[i]].name,
                     c->deps[map[i]].shortage);
        }
    }
out:
    tsr_plan_destroy(&plan);
    for (size_t i = 0; need && i < c->cfg->n_deployments; i++) free(need[i]);
    free(need);
    free(map);
    free(placeable);
    free(layers);
    free(acts);
    free(ws);
    free(pw);
}

/* True when k (with its layout) is one of deployment di's pieces under the
 * current configuration. */
static bool piece_fits(const tsr_coord_t *c, int di, const tsr_piece_key_t *k)
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

/* ---- tokenizers read off the loop ------------------------------------------ */

/* A deployment waiting for dir's tokenizer.json, or -1. */
static int tok_waiter(const tsr_coord_t *c, const char *dir)
{
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        if (c->deps[i].tok_loading && !strcmp(c->deps[i].tok_dir, dir)) return (int)i;
    return -1;
}

static bool tok_wanted(void *arg, const char *name, const char *dir)
{
    (void)name;
    return tok_waiter(arg, dir) >= 0;
}

/* Asks the loader for the tokenizers the deployments wait for (one read a directory),
 * and drops the queued loads no deployment waits for any more.  One that cannot be
 * queued is read here. */
static void tokloads_request(tsr_coord_t *c)
{
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        tsr_dep_state_t *s = &c->deps[i];
        if (!s->tok_loading) continue;
        char err[600];
        int rc = tsr_tokload_request(c->tokload, s->name, s->tok_dir, err, sizeof err);
        if (rc == 0)
            tsr_info("deployment %s: reading %s/tokenizer.json off the loop", s->name,
                     s->tok_dir);
        if (rc >= 0) continue;
        tsr_warn("deployment %s: %s; reading its tokenizer.json on the loop", s->name, err);
        dep_tok_read(s, s->tok_dir);
    }
    tsr_tokload_prune(c->tokload, tok_wanted, c);
}

/* Gives the deployments that wait for them the tokenizers the loader has read: the
 * first waiting for a directory takes it, the others hold it too. */
static void tokloads_collect(tsr_coord_t *c)
{
    tsr_tokjob_t *done = tsr_tokload_take(c->tokload);
    bool changed = false;
    for (tsr_tokjob_t *j = done; j; j = j->next) {
        int first = j->skipped ? -1 : tok_waiter(c, j->dir);
        if (first < 0) continue;
        tsr_dep_state_t *s = &c->deps[first];
        if (j->tok) tsr_info("%s/tokenizer.json read (%d ids): deployment %s serves text "
                             "prompts", j->dir, tsr_tok_vocab_size(j->tok), s->name);
        dep_tok_install(s, j->dir, j->tok, j->err, &j->file);
        j->tok = NULL;
        for (int k; (k = tok_waiter(c, j->dir)) >= 0;) {
            tsr_dep_state_t *o = &c->deps[k];
            dep_tok_take(o, s);
            if (s->tok) tsr_info("deployment %s serves text prompts too", o->name);
            tok_vocab_check(o);
        }
        changed = true;
    }
    tsr_tokjob_free(done);
    if (changed) tokreg_publish(c);
}

/* ---- reload ---------------------------------------------------------------- */

/* A test setting: TSR_TEST_RELOAD_HOLD_MS holds the loop that long in each reload (at
 * most 10 s), as a slow disk under the model directories would.  Test builds only. */
static void reload_hold(void)
{
#ifndef TSR_TESTING
    return;
#endif
    const char *v = getenv("TSR_TEST_RELOAD_HOLD_MS");
    long ms = v ? strtol(v, NULL, 10) : 0;
    if (ms <= 0) return;
    if (ms > 10000) ms = 10000;
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {}
}

int tsr_coord_reload(tsr_coord_t *c, char *err, size_t errlen)
{
    reload_hold();
    /* Reads already done are taken first: the new states then keep what they read. */
    tokloads_collect(c);
    tsr_config_t *cfg = NULL;
    if (tsr_config_load(c->config_path, &cfg, err, errlen) < 0) return -1;
    /* The HTTP server was started with the old ones. */
    bool same_http = !cfg->http_endpoint == !c->cfg->http_endpoint &&
                     (!cfg->http_endpoint || !strcmp(cfg->http_endpoint, c->cfg->http_endpoint)) &&
                     !cfg->api_keys_file == !c->cfg->api_keys_file &&
                     (!cfg->api_keys_file || !strcmp(cfg->api_keys_file, c->cfg->api_keys_file));
    if (strcmp(cfg->workers_endpoint, c->cfg->workers_endpoint) ||
        strcmp(cfg->control_endpoint, c->cfg->control_endpoint) || !same_http) {
        snprintf(err, errlen, "%s: changing coordinator endpoints (http_endpoint and "
                 "api_keys_file included) needs a restart", c->config_path);
        tsr_config_destroy(&cfg);
        return -1;
    }
    if (cfg->security_none != c->cfg->security_none || strcmp(cfg->keys_dir, c->cfg->keys_dir)) {
        snprintf(err, errlen, "%s: changing coordinator.security or keys_dir needs a restart "
                              "(keys added to or removed from the store apply at once)",
                 c->config_path);
        tsr_config_destroy(&cfg);
        return -1;
    }
    tsr_dep_state_t *deps = deps_build(cfg, c->deps, c->cfg->n_deployments, true);
    if (!deps) {
        tsr_config_destroy(&cfg);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    /* A reload that would take a running deployment down because its model
     * cannot be read is refused: the old plan keeps serving. */
    for (size_t i = 0; i < cfg->n_deployments; i++) {
        if (deps[i].model_ok) continue;
        snprintf(err, errlen, "%s", deps[i].model_error);
        deps_free(deps, cfg->n_deployments);
        tsr_config_destroy(&cfg);
        return -1;
    }
    /* Replicas already waiting to be rewired keep waiting, under the new
     * configuration's numbering. */
    size_t kept = 0;
    for (size_t t = 0; t < c->lost.n; t++) {
        int ni = -1;
        if (c->lost.di[t] >= 0 && (size_t)c->lost.di[t] < c->cfg->n_deployments) {
            const char *name = c->cfg->deployments[c->lost.di[t]].name;
            for (size_t k = 0; k < cfg->n_deployments; k++)
                if (!strcmp(cfg->deployments[k].name, name)) ni = (int)k;
        }
        if (ni < 0) continue;
        c->lost.di[kept] = ni;
        c->lost.replica[kept++] = c->lost.replica[t];
    }
    c->lost.n = kept;
    /* A deployment that keeps its layout but changes its model, max_seq_len
     * or batching keys keeps its placement; its replicas are rewired so every
     * worker loads the new model, resizes its KV cache or rebuilds its
     * scheduler. */
    for (size_t i = 0; i < cfg->n_deployments; i++) {
        const tsr_deployment_t *nd = &cfg->deployments[i];
        const tsr_deployment_t *od = tsr_config_find(c->cfg, nd->name);
        if (!od || !assignment_changed(od, nd)) continue;
        for (int r = 0; r < nd->replicas; r++) touch(&c->lost, (int)i, r);
    }
    deps_free(c->deps, c->cfg->n_deployments);
    tsr_config_destroy(&c->cfg);
    c->cfg = cfg;
    c->deps = deps;
    tokloads_request(c);
    tokreg_publish(c);
    /* Pieces that failed to load are tried again: the operator may have
     * fixed the model directory.  A piece whose layout the reload changed is
     * left to the planner, which replaces it. */
    /* The failed ranks of one replica are retried in one epoch: they share its
     * data-port secret and form together. */
    size_t n = tsr_registry_size(c->reg);
    touched_t retried = {0};
    uint64_t first = c->epoch + 1;
    for (size_t i = 0; i < n; i++) {
        tsr_worker_t *w = tsr_registry_at(c->reg, i);
        if (w->state != TSR_W_FAILED || !w->has_piece) continue;
        int di = dep_index(c, w->piece.key.deployment);
        if (di < 0 || !piece_fits(c, di, &w->piece.key)) continue;
        size_t t = 0;
        while (t < retried.n && (retried.di[t] != di || retried.replica[t] != w->piece.key.replica))
            t++;
        if (t == retried.n) {
            touch(&retried, di, w->piece.key.replica);
            if (retried.n == t) continue;   /* out of memory: the next reload tries again */
            c->epoch++;
        }
        w->piece.epoch = first + t;
        w->state = TSR_W_LOADING;
        w->reason[0] = '\0';
        send_assign(c, w, di);
    }
    free(retried.di);
    free(retried.replica);
    c->dirty = true;
    tsr_info("reloaded %s: %zu deployment(s)", c->config_path, cfg->n_deployments);
    return 0;
}

/* ---- worker messages ------------------------------------------------------- */

/* "" or up to 31 of 0-9 a-f A-F : . (what NVML writes). */
static bool pci_bus_id_ok(const char *s)
{
    size_t n = strlen(s);
    if (n > 31) return false;
    for (size_t i = 0; i < n; i++)
        if (!strchr("0123456789abcdefABCDEF:.", s[i])) return false;
    return true;
}

/* Takes a piece a (re-)registering worker reports, if it still fits the
 * current deployments and nobody else holds it.  Returns NULL on success or
 * the reason it was not adopted. */
static const char *try_adopt(tsr_coord_t *c, tsr_worker_t *w, const Tessera__Assignment *a,
                             bool *resend, char *why, size_t len)
{
    *resend = false;
    int di = dep_index(c, a->deployment);
    if (di < 0) return "its deployment is not in the current configuration";
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    if (!c->deps[di].model_ok) return "its deployment's model cannot be read";
    if (d->device != w->device) return "device kind does not match the deployment";
    tsr_piece_key_t key;
    tsr_piece_from_wire(&key, a);
    if (!piece_fits(c, di, &key))
        return "the deployment's layout or layer split has changed";
    /* Not adopted: it is assigned again with the configuration's keys.  An
     * older coordinator sent kv_dtype auto itself, and none sent a
     * matmul_dtype (0, auto): each is the type it stands for on this device. */
    Tessera__Assignment held = *a;
    held.kv_dtype = (uint32_t)tsr_kv_dtype_on(d->device, (int)a->kv_dtype);
    held.matmul_dtype = (uint32_t)tsr_kv_dtype_on(d->device, (int)a->matmul_dtype);
    /* Keys the weights and the KV pool do not depend on are adopted and sent
     * again (a rewire, which keeps the weights): a coordinator upgraded to
     * another default, or a file edited meanwhile, reloads nothing for them. */
    *resend = held.max_queue != (uint32_t)d->max_queue ||
              held.collective_timeout_ms != (uint32_t)d->collective_timeout_ms;
    held.max_queue = (uint32_t)d->max_queue;
    held.collective_timeout_ms = (uint32_t)d->collective_timeout_ms;
    if (assignment_differs(d, &held, why, len)) return why;
    /* An adopted epoch raises the coordinator's: a forged one must neither
     * wrap it nor push it so far that the real workers' epochs look stale. */
    if (a->epoch > TSR_EPOCH_MAX || a->epoch > c->epoch + TSR_EPOCH_ADOPT_STEP) {
        snprintf(why, len, "its epoch %llu is more than %llu ahead of the coordinator's %llu",
                 (unsigned long long)a->epoch, (unsigned long long)TSR_EPOCH_ADOPT_STEP,
                 (unsigned long long)c->epoch);
        return why;
    }
    const tsr_worker_t *o = tsr_registry_holder(c->reg, &key, w);
    if (o) {
        snprintf(why, len, "the piece is now held by %s", o->name);
        return why;
    }
    /* the KV budget is kept, so adopting reloads nothing */
    if (tsr_registry_set_piece(c->reg, w, &key, a->epoch, a->kv_cache_bytes) < 0)
        return "the coordinator is out of memory";
    /* Epochs only grow, also across a coordinator restart. */
    if (a->epoch > c->epoch) c->epoch = a->epoch;
    return NULL;
}

/* True when no new name can be registered: the registry is at
 * coordinator.max_workers and has no dead worker left to forget (the one
 * dead longest is forgotten to make room). */
static bool registry_full(tsr_coord_t *c)
{
    if (tsr_registry_size(c->reg) < (size_t)c->cfg->max_workers) return false;
    if (tsr_registry_forget_oldest_dead(c->reg)) {
        c->stats.workers_forgotten++;
        return tsr_registry_size(c->reg) >= (size_t)c->cfg->max_workers;
    }
    return true;
}

static void note_if_ready(tsr_coord_t *c, const tsr_worker_t *w);
static void schedule_retry(tsr_coord_t *c, tsr_worker_t *w, int64_t now);

static bool name_fits_key(const char *name, const char *key_id)
{
    char key[TSR_NAME_MAX + 1];
    tsr_key_name(key_id, key, sizeof key);
    size_t n = strlen(key);
    return n && !strncmp(name, key, n) && (name[n] == '\0' || name[n] == '-');
}

static void on_register(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, tsr_env_t *env,
                        int64_t now)
{
    Tessera__Register *r = env->register_;
    Tessera__RegisterReply rep = TESSERA__REGISTER_REPLY__INIT;
    tsr_env_t out = TESSERA__ENVELOPE__INIT;
    char reason[512] = "";
    out.worker = env->worker;
    out.body_case = TESSERA__ENVELOPE__BODY_REGISTER_REPLY;
    out.register_reply = &rep;
    rep.coordinator_protocol = TSR_PROTOCOL_VERSION;
    rep.heartbeat_interval_ms = (uint32_t)c->cfg->heartbeat_interval_ms;
    rep.lease_ms = (uint32_t)c->cfg->worker_timeout_ms;

    if (env->protocol_version != TSR_PROTOCOL_VERSION) {
        snprintf(reason, sizeof reason,
                 "protocol version %u is not supported: this coordinator speaks version %u "
                 "(upgrade the worker or the coordinator so they match)",
                 env->protocol_version, TSR_PROTOCOL_VERSION);
        tsr_error("refused worker %s (node %s, pid %u, version %s): %s", env->worker, r->node,
                  r->pid, r->software_version, reason);
        goto refuse;
    }
    if (!tsr_name_ok(env->worker) || !tsr_name_ok(r->node)) {
        snprintf(reason, sizeof reason,
                 "worker name '%.64s' and node '%.64s' must be 1 to %d of A-Z a-z 0-9 . _ - : @",
                 env->worker, r->node, TSR_NAME_MAX);
        tsr_error("refused a worker: %s", reason);
        goto refuse;
    }
    size_t bad_link = 0;
    while (bad_link < r->n_nvlink_peers && bad_link < 18 && r->nvlink_peers[bad_link][0] &&
           pci_bus_id_ok(r->nvlink_peers[bad_link]))
        bad_link++;
    if (bad_link < r->n_nvlink_peers) {
        if (bad_link == 18)
            snprintf(reason, sizeof reason, "nvlink_peers: %zu entries, at most 18 allowed",
                     r->n_nvlink_peers);
        else
            snprintf(reason, sizeof reason,
                     "nvlink_peers[%zu] '%.40s' is not a PCI bus id (like 0000:3b:00.0)",
                     bad_link, r->nvlink_peers[bad_link]);
        tsr_error("refused worker %s: %s", env->worker, reason);
        goto refuse;
    }
    if (!pci_bus_id_ok(r->pci_bus_id)) {
        snprintf(reason, sizeof reason,
                 "pci_bus_id '%.40s' is not a PCI bus id (like 0000:3b:00.0, at most 31 of "
                 "0-9 a-f A-F : .)",
                 r->pci_bus_id);
        tsr_error("refused worker %s: %s", env->worker, reason);
        goto refuse;
    }
    tsr_worker_t *w = tsr_registry_find(c->reg, env->worker);
    bool same_conn = w && w->rid_len == rid_len && !memcmp(w->rid, rid, rid_len);
    if (w && w->state != TSR_W_DEAD && strcmp(w->node, r->node)) {
        snprintf(reason, sizeof reason,
                 "worker name %s is already registered from node %s (pid %u); names must be "
                 "unique",
                 env->worker, w->node, w->pid);
        tsr_error("refused worker %s from node %s: %s", env->worker, r->node, reason);
        goto refuse;
    }
    /* A name belongs to the connection it registered from (its routing id)
     * while that connection is heard: another connection under a live name
     * is a duplicate or an impostor, whatever pid it claims.  A restart is
     * a new process whose old connection has gone quiet. */
    if (w && w->state != TSR_W_DEAD && !same_conn &&
        now - w->last_seen_ms < 2 * (int64_t)c->cfg->heartbeat_interval_ms) {
        snprintf(reason, sizeof reason,
                 "worker name %s is in use by pid %u on node %s from another connection "
                 "(heard %lld ms ago); names must be unique",
                 env->worker, w->pid, w->node, (long long)(now - w->last_seen_ms));
        tsr_error("refused worker %s (pid %u): %s", env->worker, r->pid, reason);
        goto refuse;
    }
    /* With CURVE a key NAME may register the worker NAME or NAME-anything
     * (a machine's key, its workers gpu02-cuda0 ...), nothing else: the
     * binding needs no memory, so neither a coordinator restart nor a full
     * registry lets another key take the name. */
    char kname[TSR_NAME_MAX + 1], bound[TSR_NAME_MAX + 1];
    tsr_key_name(c->msg_key, kname, sizeof kname);
    if (c->zap && !name_fits_key(env->worker, c->msg_key)) {
        snprintf(reason, sizeof reason,
                 "worker name %s does not belong to the key '%s', which may register %s or "
                 "%s-* (start it with --identity set to its key's name)",
                 env->worker, kname, kname, kname);
        tsr_error("refused worker %s (pid %u): %s", env->worker, r->pid, reason);
        goto refuse;
    }
    /* A name is bound to the key it first registered with, alive or dead,
     * until it is forgotten: a restart must bring the same key. */
    /* (By name: a key replaced under its name keeps its workers' names.) */
    tsr_key_name(w ? w->key_id : "", bound, sizeof bound);
    if (w && strcmp(bound, kname)) {
        snprintf(reason, sizeof reason,
                 "worker name %s is bound to the key '%s'; this connection uses the key '%s' "
                 "(start the worker with --identity %s, or forget the old one: it is "
                 "forgotten %d s after it dies)",
                 env->worker, bound, kname, bound, c->cfg->dead_worker_ttl_s);
        tsr_error("refused worker %s (pid %u): %s", env->worker, r->pid, reason);
        goto refuse;
    }
    if (w && w->state != TSR_W_DEAD && !same_conn)
        tsr_warn("worker %s restarted (pid %u -> %u, new connection); its old piece is released",
                 w->name, w->pid, r->pid);
    if (!w && registry_full(c)) {
        snprintf(reason, sizeof reason,
                 "the coordinator already knows %zu live workers, its limit "
                 "(coordinator.max_workers %d)",
                 tsr_registry_size(c->reg), c->cfg->max_workers);
        tsr_error("refused worker %s: %s", env->worker, reason);
        goto refuse;
    }
    bool known = w != NULL;
    if (!w) w = tsr_registry_upsert(c->reg, env->worker);
    if (!w) return;
    snprintf(w->node, sizeof w->node, "%s", r->node);
    snprintf(w->version, sizeof w->version, "%s", r->software_version);
    snprintf(w->data_endpoint, sizeof w->data_endpoint, "%s", r->data_endpoint);
    snprintf(w->pci_bus_id, sizeof w->pci_bus_id, "%s", r->pci_bus_id);
    w->nccl = r->nccl;
    w->n_nvlink = (int)r->n_nvlink_peers;
    for (int i = 0; i < w->n_nvlink; i++)
        snprintf(w->nvlink[i], sizeof w->nvlink[i], "%s", r->nvlink_peers[i]);
    if (w->nccl && w->pci_bus_id[0])
        snprintf(w->nccl_device, sizeof w->nccl_device, "%s/%s", w->node, w->pci_bus_id);
    else
        w->nccl_device[0] = '\0';
    w->device = r->device == TESSERA__DEVICE_KIND__DEVICE_CUDA ? TSR_DEVICE_CUDA : TSR_DEVICE_CPU;
    w->device_index = r->device_index;
    w->memory = r->device_memory;
    w->pid = r->pid;
    memcpy(w->rid, rid, rid_len);
    w->rid_len = rid_len;
    snprintf(w->key_id, sizeof w->key_id, "%s", c->msg_key);
    w->state = TSR_W_IDLE;
    tsr_registry_clear_piece(c->reg, w);
    w->reason[0] = w->detail[0] = '\0';
    /* A new process: the old one's figures are not its own. */
    w->load = 0;
    w->kv_blocks_used = w->kv_blocks_total = w->queued = w->running = 0;
    w->steps = 0;
    w->steps_seen = false;
    w->steps_ms = 0;
    w->registered_ms = w->last_seen_ms = now;
    c->stats.registrations++;

    if (r->assignment) {
        char why[256];
        bool resend;
        const char *no = try_adopt(c, w, r->assignment, &resend, why, sizeof why);
        /* Epochs only grow across restarts even when the layout changed and
         * nothing is adopted: a piece's epoch raises the coordinator's
         * (within the step a forged one is allowed). */
        uint64_t e = r->assignment->epoch;
        if (no && e > c->epoch && e <= TSR_EPOCH_MAX && e <= c->epoch + TSR_EPOCH_ADOPT_STEP)
            c->epoch = e;
        if (!no) {
            rep.adopted = true;
            w->state = r->state == TESSERA__WORKER_STATE__STATE_READY     ? TSR_W_READY
                       : r->state == TESSERA__WORKER_STATE__STATE_FAILED ? TSR_W_FAILED
                                                                         : TSR_W_LOADING;
            tsr_info("adopted worker %s with %s r%d s%d t%d (epoch %llu, %s)", w->name,
                     w->piece.key.deployment, w->piece.key.replica, w->piece.key.stage, w->piece.key.tp,
                     (unsigned long long)w->piece.epoch, tsr_wstate_name(w->state));
            if (w->state == TSR_W_READY) note_if_ready(c, w);
            /* Its failure was reported to the coordinator before this one,
             * which would have rewired the replica: this one does. */
            if (w->state == TSR_W_FAILED) {
                snprintf(w->reason, sizeof w->reason, "%s", r->reason);
                w->retryable = r->retryable;
                w->past_deadline = r->retryable && r->past_deadline;
                schedule_retry(c, w, now);
            }
            /* Its replica was rewired in a newer epoch while it was cut off:
             * the others formed (or wait to form) without it.  The replica
             * is rewired again, with it.  New keys for a replica that serves
             * are sent once every member is back and ready (rewiring one
             * still missing a member would stop it until then; a failed one
             * is rewired, or sent its piece again, by its own path, with the
             * file's keys). */
            size_t n;
            tsr_worker_t *const *m =
                tsr_registry_replica(c->reg, w->piece.key.deployment, w->piece.key.replica, &n);
            bool behind = false,
                 whole = n == (size_t)w->piece.key.tp_size * (size_t)w->piece.key.pp_size;
            for (size_t i = 0; i < n; i++) {
                behind |= m[i]->piece.epoch != w->piece.epoch;
                whole &= m[i]->state == TSR_W_READY;
            }
            if (behind || (resend && whole)) {
                touch(&c->lost, dep_index(c, w->piece.key.deployment), w->piece.key.replica);
                c->dirty = true;
            }
        } else {
            tsr_info("worker %s registered; its piece %s r%u s%u t%u was not adopted: %s",
                     w->name, r->assignment->deployment, r->assignment->replica,
                     r->assignment->stage, r->assignment->tp_rank, no);
            snprintf(reason, sizeof reason, "%s", no);
            rep.reason = reason;
        }
    } else {
        tsr_info("worker %s registered%s: node %s, %s %u, %.1f GiB, pid %u, version %s",
                 w->name, known ? " again" : "", w->node, tsr_device_name(w->device),
                 w->device_index, (double)w->memory / (1u << 30), w->pid, w->version);
    }
    rep.accepted = true;
    out.epoch = c->epoch;
    tsr_coord_send(c, rid, rid_len, &out);
    c->dirty = true;
    return;
refuse:
    c->stats.refused++;
    rep.accepted = false;
    rep.reason = reason;
    tsr_coord_send(c, rid, rid_len, &out);
}

/* An NCCL group's rendezvous blob, made by the group's rank 0 for its
 * piece's current epoch (checked by the caller), goes to the members of
 * its replica that hold their piece in that same epoch, its maker
 * included (every rank, rank 0 too, forms from the copy this relay
 * fenced), and to no one else: a member of another epoch or replica never
 * sees it, and a blob for a group its sender does not lead (rank 0) is
 * dropped, so one member cannot hand the others a communicator to join. */
static void relay_rendezvous(tsr_coord_t *c, tsr_worker_t *w, const tsr_env_t *env)
{
    const Tessera__RendezvousOffer *o = env->rendezvous_offer;
    if (!o->blob.len || o->blob.len > 256) {
        c->stats.bad_messages++;
        tsr_warn("worker %s sent a rendezvous blob of %zu bytes (1 to 256 allowed): dropped",
                 w->name, o->blob.len);
        return;
    }
    uint64_t led[2];
    int n_led = tsr_piece_led_groups(&w->piece.key, led), k = 0;
    while (k < n_led && led[k] != o->group) k++;
    if (k == n_led) {
        c->stats.bad_messages++;
        tsr_warn("worker %s (stage %d, tp rank %d of %s replica %d) sent a rendezvous blob for "
                 "group %016llx, which it does not lead: dropped",
                 w->name, w->piece.key.stage, w->piece.key.tp, w->piece.key.deployment,
                 w->piece.key.replica, (unsigned long long)o->group);
        return;
    }
    Tessera__Rendezvous r = TESSERA__RENDEZVOUS__INIT;
    r.group = o->group;
    r.blob = o->blob;
    r.from = w->name;
    size_t n;
    tsr_worker_t *const *m =
        tsr_registry_replica(c->reg, w->piece.key.deployment, w->piece.key.replica, &n);
    for (size_t i = 0; i < n; i++) {
        if (m[i]->piece.epoch != env->epoch) continue;
        tsr_env_t out = TESSERA__ENVELOPE__INIT;
        out.epoch = env->epoch;
        out.body_case = TESSERA__ENVELOPE__BODY_RENDEZVOUS;
        out.rendezvous = &r;
        send_to(c, m[i], &out);
    }
    c->stats.rendezvous_relayed++;
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

/* A replica whose data plane broke without a worker dying (a peer that
 * stalled past its deadline, a dropped connection) is rewired again after a
 * backoff: the workers keep their weights and form new communicators. */
void tsr_coord_rewire_later(tsr_coord_t *c, const char *deployment, int replica,
                            const char *why, int64_t now)
{
    int di = dep_index(c, deployment);
    if (di < 0) return;
    tsr_dep_state_t *ds = &c->deps[di];
    touch(&ds->retry, di, replica);
    if (ds->retry_at_ms) return;
    if (!ds->retry_backoff_ms) ds->retry_backoff_ms = 2000;
    ds->retry_at_ms = now + ds->retry_backoff_ms;
    tsr_warn("deployment %s replica %d: %s; rewiring in %d ms", ds->name, replica, why,
             ds->retry_backoff_ms);
    ds->retry_backoff_ms = ds->retry_backoff_ms * 2 > 60000 ? 60000 : ds->retry_backoff_ms * 2;
}

static void schedule_retry(tsr_coord_t *c, tsr_worker_t *w, int64_t now)
{
    if (!w->retryable) return;  /* load errors need the operator */
    char why[600];
    snprintf(why, sizeof why, "data plane failed (%s)", w->reason);
    tsr_coord_rewire_later(c, w->piece.key.deployment, w->piece.key.replica, why, now);
}

/* Called on every piece that becomes ready.  Once every replica of its
 * deployment is ready, the deployment has been ready (a gap from now on is
 * "degraded", whoever looked).  Once its own replica is whole again, the
 * data plane formed: the rewiring backoff starts over, so that the next
 * failure (a new fault) is retried quickly.  A replica that never forms
 * keeps backing off. */
static void note_if_ready(tsr_coord_t *c, const tsr_worker_t *w)
{
    int di = dep_index(c, w->piece.key.deployment);
    if (di < 0 || (c->deps[di].ever_ready && !c->deps[di].retry_backoff_ms)) return;
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    if (tsr_coord_ready_leader(c, d, w->piece.key.replica)) c->deps[di].retry_backoff_ms = 0;
    int whole = 0;
    for (int r = 0; r < d->replicas; r++) whole += tsr_coord_ready_leader(c, d, r) != NULL;
    if (whole == d->replicas) c->deps[di].ever_ready = true;
}

static void run_retries(tsr_coord_t *c, int64_t now)
{
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        tsr_dep_state_t *ds = &c->deps[i];
        if (!ds->retry_at_ms || now < ds->retry_at_ms) continue;
        for (size_t t = 0; t < ds->retry.n; t++) touch(&c->lost, (int)i, ds->retry.replica[t]);
        ds->retry.n = 0;
        ds->retry_at_ms = 0;
        c->dirty = true;
    }
}

/* Worker w is dead for the reason why, now: its replica's requests fail
 * with it and its piece is replanned. */
static void declare_dead(tsr_coord_t *c, tsr_worker_t *w, int64_t now, const char *why)
{
    if (w->has_piece) {
        tsr_requests_fail_replica(c, w->piece.key.deployment, w->piece.key.replica, why);
        touch(&c->lost, dep_index(c, w->piece.key.deployment), w->piece.key.replica);
    }
    tsr_health_mark_dead(c->reg, w, now, why);
    c->stats.deaths++;
    c->dirty = true;
}

static void on_worker_msg(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, tsr_env_t *env,
                          int64_t now)
{
    c->stats.messages++;
    if (env->body_case == TESSERA__ENVELOPE__BODY_REGISTER) {
        on_register(c, rid, rid_len, env, now);
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
        send_reset(c, rid, rid_len, env->worker, true, "unknown to this coordinator; register");
        return;
    }
    if (w->state == TSR_W_DEAD) {
        char why[600];
        snprintf(why, sizeof why, "declared dead (%s); register again as idle", w->reason);
        send_reset(c, rid, rid_len, env->worker, false, why);
        return;
    }
    /* The name in a message is a claim; the routing id is the connection it
     * came from.  A worker keeps its routing id across reconnections (see
     * tsr_sock_dealer), so a mismatch is another process using its name:
     * dropped, so it can neither keep the name alive nor speak for it. */
    if (w->rid_len != rid_len || memcmp(w->rid, rid, rid_len) || strcmp(w->key_id, c->msg_key)) {
        c->stats.identity_dropped++;
        tsr_debug("dropped %s claiming to be %s from another connection", tsr_env_kind(env),
                  w->name);
        return;
    }
    w->last_seen_ms = now;

    switch (env->body_case) {
    case TESSERA__ENVELOPE__BODY_HEARTBEAT: {
        Tessera__Heartbeat *hb = env->heartbeat;
        c->stats.heartbeats++;
        w->heartbeats++;
        /* A NaN or infinity would make the status document invalid JSON;
         * keep the last good figure instead. */
        if (isfinite(hb->load)) w->load = hb->load < 0 ? 0 : hb->load > 1 ? 1 : hb->load;
        w->memory_used = hb->memory_used;
        w->weight_bytes = hb->weight_bytes;
        w->kv_bytes = hb->kv_bytes;
        w->kv_blocks_used = hb->kv_blocks_used;
        w->kv_blocks_total = hb->kv_blocks_total;
        w->queued = hb->queued;
        w->running = hb->running;
        /* The first count after a registration is a baseline, not a move:
         * the same process may register again (a coordinator restart). */
        if (w->steps_seen && hb->steps != w->steps) w->steps_ms = c->now_ms ? c->now_ms : now;
        w->steps = hb->steps;
        w->steps_seen = true;
        /* The ack only renews the worker's lease, so a few per lease are
         * enough; acking every heartbeat doubled the coordinator's sends. */
        if (now - w->last_ack_ms < c->cfg->worker_timeout_ms / 4) break;
        w->last_ack_ms = now;
        Tessera__HeartbeatAck ack = TESSERA__HEARTBEAT_ACK__INIT;
        ack.seq = hb->seq;
        tsr_env_t out = TESSERA__ENVELOPE__INIT;
        out.epoch = c->epoch;
        out.worker = env->worker;
        out.body_case = TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK;
        out.heartbeat_ack = &ack;
        tsr_coord_send(c, rid, rid_len, &out);
        break;
    }
    case TESSERA__ENVELOPE__BODY_RENDEZVOUS_OFFER:
        if (!piece_msg_current(c, w, env)) break;
        relay_rendezvous(c, w, env);
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
        note_if_ready(c, w);
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
            schedule_retry(c, w, now);
        }
        break;
    case TESSERA__ENVELOPE__BODY_TOKEN_EVENT:
        tsr_router_token(c, w, env);
        break;
    default:
        c->stats.bad_messages++;
        tsr_warn("unexpected %s from worker %s", tsr_env_kind(env), w->name);
    }
}

/* Reads up to budget messages from one ROUTER and hands each valid one to
 * handle; rejected ones are counted and logged with the channel's name. */
static void drain_one(tsr_coord_t *c, void *sock, const char *channel, size_t max, int budget,
                      void (*handle)(tsr_coord_t *, const uint8_t *, size_t, tsr_env_t *, int64_t))
{
    uint8_t rid[256];
    size_t rid_len;
    char err[256];
    int64_t now = tsr_now_ms();
    for (int i = 0; i < budget; i++) {
        tsr_env_t *env = NULL;
        rid_len = 0;
        c->msg_key[0] = '\0';
        int rc = tsr_wire_recv_user(sock, rid, &rid_len, c->msg_key, sizeof c->msg_key, max,
                                    &env, err, sizeof err);
        if (rc == 0) break;
        /* A session whose key was removed from the store is over, even
         * before the next key check sees it: nothing it says is heard.  (The
         * HTTP bridge is in-process: its callers were checked by the server.) */
        if (c->zap && sock != c->bsock && !tsr_zap_allowed(c->zap, c->msg_key)) {
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
                c->reply_sock = sock;
                tsr_control_reply_code(c, rid, rid_len, false, "invalid", msg, NULL);
                c->reply_sock = c->csock;
            }
            continue;
        }
        if ((i & 255) == 255) now = tsr_now_ms();
        if (sock != c->wsock) c->reply_sock = sock;  /* control replies go back where asked */
        handle(c, rid, rid_len, env, now);
        c->reply_sock = c->csock;
        tsr_env_free(&env);
    }
}

static void on_control_msg(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, tsr_env_t *env,
                           int64_t now)
{
    (void)now;
    c->stats.control_requests++;
    tsr_control_handle(c, rid, rid_len, env);
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
    while (c->cmon && tsr_sock_monitor_event(c->cmon) == ZMQ_EVENT_DISCONNECTED) {
        tsr_debug("a client disconnected; probing %zu request(s)", c->n_reqs);
        if (!c->probe_due_ms) c->probe_due_ms = c->last_probe_ms + PROBE_GAP_MS;
    }
}

static void on_dead(tsr_worker_t *w, void *arg)
{
    tsr_coord_t *c = arg;
    if (w->has_piece) {
        char why[256];
        snprintf(why, sizeof why, "worker %s (stage %d tp %d) stopped answering", w->name,
                 w->piece.key.stage, w->piece.key.tp);
        tsr_requests_fail_replica(c, w->piece.key.deployment, w->piece.key.replica, why);
        touch(&c->lost, dep_index(c, w->piece.key.deployment), w->piece.key.replica);
    }
    c->stats.deaths++;
    c->dirty = true;
    if (w->has_piece)
        tsr_error("worker %s on %s is dead (no heartbeat for %lld ms); its piece %s r%d s%d t%d "
                  "will move",
                  w->name, w->node, (long long)(c->now_ms - w->last_seen_ms),
                  w->piece.key.deployment, w->piece.key.replica, w->piece.key.stage, w->piece.key.tp);
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
    tokloads_collect(c);
    if (c->zap) drop_removed_keys(c, now_ms);
    int64_t deadline = tsr_requests_expire(c, now_ms);
    run_retries(c, now_ms);
    if (now_ms >= c->next_scan_ms) {
        tsr_health_scan(c->reg, now_ms, c->cfg->worker_timeout_ms, on_dead, c);
        /* Dead workers are shown for a while, then forgotten, so the
         * registry and the status document stay bounded. */
        c->stats.workers_forgotten += tsr_registry_forget_dead(
            c->reg, now_ms - (int64_t)c->cfg->dead_worker_ttl_s * 1000);
        c->next_scan_ms = now_ms + scan;
    }
    /* Plans at most every PLAN_MIN_GAP_MS: a burst of registrations
     * becomes one plan, not one per message. */
    int64_t due = c->plan_after_ms > c->last_plan_ms + PLAN_MIN_GAP_MS
                      ? c->plan_after_ms : c->last_plan_ms + PLAN_MIN_GAP_MS;
    if (c->dirty && now_ms >= due) {
        c->dirty = false;
        c->last_plan_ms = now_ms;
        tsr_coord_replan(c, now_ms);
    }
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
    int64_t next = c->next_scan_ms;
    if (c->dirty && due < next) next = due;
    if (deadline && deadline < next) next = deadline;
    if (c->probe_due_ms && c->probe_due_ms < next) next = c->probe_due_ms;
    int64_t wait = next - now_ms;
    /* A removed key's sessions end within a second: look at least every
     * 100 ms. */
    if (c->zap && wait > 100) wait = 100;
    return wait < 0 ? 0 : (int)wait;
}
