/* register.c: a worker joining and staying: its registration (checked, bound to its
 * name and key, its piece adopted when it still fits) and its heartbeats. */
#include "register.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "assign.h"
#include "common/log.h"
#include "resolve.h"
#include "placement.h"

/* Registrations a worker queued while its link was down arrive together
 * when it comes back (3 to 5 in one millisecond): each is handled, but the
 * same line for the same worker within this long is logged once. */
#define REG_NOTE_QUIET_MS 1000

static void reg_note(tsr_worker_t *w, int64_t now, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void reg_note(tsr_worker_t *w, int64_t now, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    uint64_t h = 1469598103934665603ull;  /* FNV-1a */
    for (const char *p = msg; *p; p++) h = (h ^ (uint8_t)*p) * 1099511628211ull;
    bool again = h == w->reg_note && now - w->reg_note_ms < REG_NOTE_QUIET_MS;
    w->reg_note = h;
    w->reg_note_ms = now;
    if (again) tsr_debug("%s (again)", msg);
    else tsr_info("%s", msg);
}

/* "" or up to 31 of 0-9 a-f A-F : . (what NVML writes). */
static bool pci_bus_id_ok(const char *s)
{
    size_t n = strlen(s);
    if (n > 31) return false;
    for (size_t i = 0; i < n; i++)
        if (!strchr("0123456789abcdefABCDEF:.", s[i])) return false;
    return true;
}

static const char *adopt_piece(tsr_coord_t *c, tsr_worker_t *w, const Tessera__Assignment *a,
                               int di, const tsr_piece_key_t *k, bool *resend, char *why,
                               size_t len);

/* Takes a piece a (re-)registering worker reports, if it still fits the
 * current deployments and nobody else holds it.  Returns NULL on success or
 * the reason it was not adopted.  An auto deployment not chosen yet takes the
 * piece's cut only when the piece is adopted. */
static const char *try_adopt(tsr_coord_t *c, tsr_worker_t *w, const Tessera__Assignment *a,
                             int64_t now, bool *resend, char *why, size_t len)
{
    *resend = false;
    int di = tsr_coord_dep_index(c, a->deployment);
    if (di < 0) return "its deployment is not in the current configuration";
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    if (!c->deps[di].model_ok) return "its deployment's model cannot be read";
    if (d->device != w->device) return "device kind does not match the deployment";
    tsr_piece_key_t key;
    tsr_piece_from_wire(&key, a);
    tsr_layout_undo_t undo;
    tsr_coord_adopt_layout(c, di, &key, now, &undo);
    const char *no = adopt_piece(c, w, a, di, &key, resend, why, len);
    if (no) tsr_coord_adopt_undo(c, di, &undo);
    else if (!undo.layout_chosen && c->deps[di].layout_chosen)
        tsr_info("deployment %s: parallel auto: %s", d->name, c->deps[di].layout_why);
    return no;
}

static const char *adopt_piece(tsr_coord_t *c, tsr_worker_t *w, const Tessera__Assignment *a,
                               int di, const tsr_piece_key_t *k, bool *resend, char *why,
                               size_t len)
{
    const tsr_deployment_t *d = &c->cfg->deployments[di];
    tsr_piece_key_t key = *k;
    if (!tsr_coord_piece_fits(c, di, &key))
        return "the deployment's layout or layer split has changed";
    /* A standby (every peer empty: rebalance.c, reshard.c) serves nothing: the worker
     * that does hold the piece keeps it. */
    bool standby = a->n_peers > 0;
    for (size_t i = 0; i < a->n_peers && standby; i++) standby = !a->peers[i] || !a->peers[i][0];
    if (standby) return "it was a standby of a move the coordinator restart ended";
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
              held.collective_timeout_ms != (uint32_t)d->collective_timeout_ms ||
              held.kv_admission != (uint32_t)d->kv_admission ||
              (bool)held.prefix_cache != d->prefix_cache;
    held.max_queue = (uint32_t)d->max_queue;
    held.collective_timeout_ms = (uint32_t)d->collective_timeout_ms;
    held.kv_admission = (uint32_t)d->kv_admission;
    held.prefix_cache = d->prefix_cache;
    if (tsr_assignment_differs(d, &held, why, len)) return why;
    /* An adopted epoch raises the coordinator's: a forged one must neither
     * wrap it nor push it so far that the real workers' epochs look stale. */
    if (a->epoch > c->epoch && a->epoch > TSR_EPOCH_ADOPT_MAX) {
        snprintf(why, len,
                 "its epoch %llu is over %llu, the most a registration may raise the "
                 "coordinator's epoch (%llu) to",
                 (unsigned long long)a->epoch, (unsigned long long)TSR_EPOCH_ADOPT_MAX,
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

static bool name_fits_key(const char *name, const char *key_id)
{
    char key[TSR_NAME_MAX + 1];
    tsr_key_name(key_id, key, sizeof key);
    size_t n = strlen(key);
    return n && !strncmp(name, key, n) && (name[n] == '\0' || name[n] == '-');
}

void tsr_register_worker(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, const char *key_id,
                         tsr_env_t *env, int64_t now)
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
    /* non-finite or absurd rates are never stored (0 is "not given") */
    if (r->cpu_cores > 65536 || r->cpu_threads > 65536) {
        snprintf(reason, sizeof reason, "cpu_cores %u and cpu_threads %u must be at most 65536",
                 r->cpu_cores, r->cpu_threads);
        tsr_error("refused worker %s: %s", env->worker, reason);
        goto refuse;
    }
    if (!(r->mem_gbs >= 0 && r->mem_gbs <= 1e9) || !(r->gflops >= 0 && r->gflops <= 1e9)) {
        snprintf(reason, sizeof reason,
                 "mem_gbs %g and gflops %g must be rates from 0 (not given) to 1e9",
                 r->mem_gbs, r->gflops);
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
    tsr_key_name(key_id, kname, sizeof kname);
    if (c->zap && !name_fits_key(env->worker, key_id)) {
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
    w->mem_gbs = r->mem_gbs;
    w->gflops = r->gflops;
    w->cpu_cores = (int)r->cpu_cores;
    w->cpu_threads = (int)r->cpu_threads;
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
    snprintf(w->key_id, sizeof w->key_id, "%s", key_id);
    w->state = TSR_W_IDLE;
    tsr_registry_clear_piece(c->reg, w);
    w->reason[0] = w->detail[0] = '\0';
    /* A new process: the old one's figures are not its own. */
    w->load = 0;
    w->kv_blocks_used = w->kv_blocks_total = w->kv_blocks_cached = w->queued = w->running = 0;
    w->kv_evictions = w->prompt_cached = w->prompt_computed = w->preemptions = 0;
    w->steps = 0;
    w->steps_seen = false;
    w->steps_ms = 0;
    w->registered_ms = w->last_seen_ms = now;
    c->stats.registrations++;

    if (r->assignment) {
        char why[256];
        bool resend;
        const char *no = try_adopt(c, w, r->assignment, now, &resend, why, sizeof why);
        /* Epochs only grow across restarts even when the layout changed and
         * nothing is adopted: a piece's epoch raises the coordinator's, up to
         * the bound that keeps repeated forged registrations from moving it
         * towards TSR_EPOCH_MAX. */
        uint64_t e = r->assignment->epoch;
        if (no && e > c->epoch && e <= TSR_EPOCH_ADOPT_MAX) c->epoch = e;
        if (!no) {
            rep.adopted = true;
            w->state = r->state == TESSERA__WORKER_STATE__STATE_READY     ? TSR_W_READY
                       : r->state == TESSERA__WORKER_STATE__STATE_FAILED ? TSR_W_FAILED
                                                                         : TSR_W_LOADING;
            reg_note(w, now, "adopted worker %s with %s r%d s%d t%d (epoch %llu, %s)", w->name,
                     w->piece.key.deployment, w->piece.key.replica, w->piece.key.stage, w->piece.key.tp,
                     (unsigned long long)w->piece.epoch, tsr_wstate_name(w->state));
            if (w->state == TSR_W_READY) tsr_coord_note_ready(c, w);
            /* Its failure was reported to the coordinator before this one,
             * which would have rewired the replica: this one does. */
            if (w->state == TSR_W_FAILED) {
                snprintf(w->reason, sizeof w->reason, "%s", r->reason);
                w->retryable = r->retryable;
                w->past_deadline = r->retryable && r->past_deadline;
                tsr_coord_retry_failed(c, w, now);
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
                tsr_coord_mark_lost(c, tsr_coord_dep_index(c, w->piece.key.deployment),
                                    w->piece.key.replica);
                c->dirty = true;
            }
        } else {
            reg_note(w, now, "worker %s registered; its piece %s r%u s%u t%u was not adopted: %s",
                     w->name, r->assignment->deployment, r->assignment->replica,
                     r->assignment->stage, r->assignment->tp_rank, no);
            snprintf(reason, sizeof reason, "%s", no);
            rep.reason = reason;
        }
    } else {
        reg_note(w, now, "worker %s registered%s: node %s, %s %u, %.1f GiB, pid %u, version %s",
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

void tsr_register_heartbeat(tsr_coord_t *c, tsr_worker_t *w, const tsr_env_t *env, int64_t now)
{
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
    w->kv_blocks_cached = hb->kv_blocks_cached;
    w->kv_evictions = hb->kv_evictions;
    w->prompt_cached = hb->prompt_tokens_cached;
    w->prompt_computed = hb->prompt_tokens_computed;
    w->preemptions = hb->preemptions;
    w->queued = hb->queued;
    w->running = hb->running;
    /* The first count after a registration is a baseline, not a move:
     * the same process may register again (a coordinator restart). */
    if (w->steps_seen && hb->steps != w->steps) w->steps_ms = c->now_ms ? c->now_ms : now;
    w->steps = hb->steps;
    w->steps_seen = true;
    /* The ack only renews the worker's lease, so a few per lease are
     * enough; acking every heartbeat doubled the coordinator's sends. */
    if (now - w->last_ack_ms < c->cfg->worker_timeout_ms / 4) return;
    w->last_ack_ms = now;
    Tessera__HeartbeatAck ack = TESSERA__HEARTBEAT_ACK__INIT;
    ack.seq = hb->seq;
    tsr_env_t out = TESSERA__ENVELOPE__INIT;
    out.epoch = c->epoch;
    out.worker = env->worker;
    out.body_case = TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK;
    out.heartbeat_ack = &ack;
    tsr_coord_send(c, w->rid, w->rid_len, &out);
}
