/* assign.c: what the coordinator sends to workers: every send goes through
 * tsr_coord_send (counted and logged when it fails), and a piece's assignment is
 * filled here (its keys, KV budget, peers and data-port secret). */
#include "assign.h"

#include <errno.h>
#include <limits.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/budget.h"
#include "common/log.h"
#include "common/prefix.h"
#include "common/util.h"

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

void tsr_coord_send_to(tsr_coord_t *c, tsr_worker_t *w, tsr_env_t *env)
{
    env->worker = w->name;
    if (!env->epoch) env->epoch = c->epoch;
    tsr_coord_send(c, w->rid, w->rid_len, env);
}

void tsr_coord_send_reset(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, const char *name,
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
 * fill_assignment, compared by tsr_assignment_changed (a reload) and
 * tsr_assignment_differs (adoption), so a new key cannot be missed by one.
 * kv_dtype and matmul_dtype go resolved: auto and the type it stands for
 * are the same. */
#define SENT_KEYS(X, d)                                                                       \
    X(max_seq_len, (d)->max_seq_len) X(max_batch, (d)->max_batch)                             \
    X(prefill_chunk, (d)->prefill_chunk) X(max_queue, (d)->max_queue)                         \
    X(kv_dtype, tsr_kv_dtype_on((d)->device, (d)->kv_dtype))                                  \
    X(matmul_dtype, tsr_kv_dtype_on((d)->device, (d)->matmul_dtype))                        \
    X(collective_timeout_ms, (d)->collective_timeout_ms) X(kv_admission, (d)->kv_admission) \
    X(prefix_cache, (d)->prefix_cache) X(weights_dtype, (d)->weights_dtype)

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
const char *tsr_assignment_differs(const tsr_deployment_t *d, const Tessera__Assignment *a,
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
    static uint8_t prefix[TSR_PREFIX_SECRET];
    if (tsr_coord_prefix_secret(c, d, h->key.tp_size, h->key.pp_size, prefix)) {
        a->prefix_secret.data = prefix;
        a->prefix_secret.len = sizeof prefix;
    }
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
bool tsr_assignment_changed(const tsr_deployment_t *od, const tsr_deployment_t *nd)
{
    Tessera__Assignment was = TESSERA__ASSIGNMENT__INIT;
    char why[512];
    was.model_path = od->model_path;
    fill_keys(&was, od);
    return tsr_assignment_differs(nd, &was, why, sizeof why) || od->kv_cache_mib != nd->kv_cache_mib ||
           /* it sizes the KV pool of cuda pieces without kv_cache_mib only */
           (nd->device == TSR_DEVICE_CUDA && !nd->kv_cache_mib &&
            od->gpu_memory_percent != nd->gpu_memory_percent);
}

/* The data endpoints of every piece of key's replica in key's layout,
 * indexed by slot ("" where a piece has no holder yet), followed by their
 * GPUs' PCI bus ids, their worker names and their nodes in the same order:
 * TSR_PEER_LISTS * *n_out entries.  Caller frees. */
char **tsr_replica_peers(tsr_coord_t *c, const tsr_piece_key_t *key, size_t *n_out)
{
    size_t n = (size_t)key->tp_size * (size_t)key->pp_size;
    char **peers = calloc(n ? TSR_PEER_LISTS * n : 1, sizeof *peers);
    if (!peers) return NULL;
    for (size_t k = 0; k < n; k++) {
        tsr_worker_t *o = tsr_registry_at_slot(c->reg, key->deployment, key->replica,
                                               key->tp_size, key->pp_size, (int)k);
        peers[k] = o ? o->data_endpoint : "";
        peers[n + k] = o ? o->nccl_device : "";
        peers[2 * n + k] = o ? o->name : "";
        peers[3 * n + k] = o ? o->node : "";
    }
    *n_out = n;
    return peers;
}

/* Sends w its piece with the replica's peer lists (tsr_replica_peers': endpoints,
 * devices, worker names, nodes); peers NULL: look them up. */
void tsr_send_assign_peers(tsr_coord_t *c, tsr_worker_t *w, int di, char **peers,
                              size_t n_peers)
{
    Tessera__Assignment a = TESSERA__ASSIGNMENT__INIT;
    fill_assignment(c, &w->piece, &a, di);
    w->piece.kv_budget = a.kv_cache_bytes;
    char **own = peers ? NULL : tsr_replica_peers(c, &w->piece.key, &n_peers);
    a.peers = peers ? peers : own;
    a.n_peers = a.peers ? n_peers : 0;
    a.peer_devices = a.peers ? a.peers + n_peers : NULL;
    a.n_peer_devices = a.n_peers;
    a.peer_workers = a.peers ? a.peers + 2 * n_peers : NULL;
    a.n_peer_workers = a.n_peers;
    a.peer_nodes = a.peers ? a.peers + 3 * n_peers : NULL;
    a.n_peer_nodes = a.n_peers;
    Tessera__Assign as = TESSERA__ASSIGN__INIT;
    as.assignment = &a;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = w->piece.epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_ASSIGN;
    env.assign = &as;
    /* The peers' names are for messages only: a replica so large that they would take
     * the assignment past what a worker takes (TSR_WIRE_MAX_WORKER) goes without them. */
    if (tessera__envelope__get_packed_size(&env) > TSR_WIRE_MAX_WORKER) {
        a.n_peer_workers = a.n_peer_nodes = 0;
        tsr_debug("assignment of %s to %s: %zu peers, sent without their names", w->piece.key.deployment,
                  w->name, n_peers);
    }
    tsr_coord_send_to(c, w, &env);
    free(own);
    c->stats.assigns++;
}

int tsr_send_standby(tsr_coord_t *c, tsr_worker_t *w, int di, const tsr_piece_key_t *key,
                     uint64_t epoch)
{
    tsr_holding_t h = {.key = *key, .epoch = epoch};
    Tessera__Assignment a = TESSERA__ASSIGNMENT__INIT;
    fill_assignment(c, &h, &a, di);
    /* no holder for any slot: the worker loads the weights and waits for the next epoch */
    size_t n = (size_t)key->tp_size * (size_t)key->pp_size;
    char **none = calloc(n ? TSR_PEER_LISTS * n : 1, sizeof *none);
    if (!none) {
        tsr_error("out of memory sending %s a standby piece", w->name);
        return -1;
    }
    for (size_t i = 0; i < TSR_PEER_LISTS * n; i++) none[i] = "";
    a.peers = a.peer_devices = none;
    a.n_peers = a.n_peer_devices = n;
    Tessera__Assign as = TESSERA__ASSIGN__INIT;
    as.assignment = &a;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_ASSIGN;
    env.assign = &as;
    env.worker = w->name;
    int rc = tsr_coord_send(c, w->rid, w->rid_len, &env);
    free(none);
    c->stats.assigns++;
    return rc;
}

void tsr_send_assign(tsr_coord_t *c, tsr_worker_t *w, int di)
{
    tsr_send_assign_peers(c, w, di, NULL, 0);
}

void tsr_send_unassign(tsr_coord_t *c, tsr_worker_t *w, const char *reason)
{
    Tessera__Unassign u = TESSERA__UNASSIGN__INIT;
    u.reason = (char *)reason;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.body_case = TESSERA__ENVELOPE__BODY_UNASSIGN;
    env.unassign = &u;
    tsr_coord_send_to(c, w, &env);
    c->stats.unassigns++;
}
