#include "agent.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "common/log.h"
#include "common/modelcfg.h"

#define REGISTER_BACKOFF_MIN_MS 250
#define REGISTER_BACKOFF_MAX_MS 1000  /* keeps re-attach after a coordinator restart under 2 s */

tsr_agent_t *tsr_agent_new(const char *name, const char *node, const char *endpoint,
                           const tsr_security_t *sec, const tsr_device_info_t *dev, char *err,
                           size_t errlen)
{
    tsr_agent_t *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    snprintf(a->name, sizeof a->name, "%s", name);
    snprintf(a->node, sizeof a->node, "%s", node);
    snprintf(a->endpoint, sizeof a->endpoint, "%s", endpoint);
    a->device = *dev;
    if (sec && sec->curve) {
        snprintf(a->identity, sizeof a->identity, "%s", sec->identity);
        snprintf(a->keys_dir, sizeof a->keys_dir, "%s", sec->dir);
    }
    a->protocol_version = TSR_PROTOCOL_VERSION;
    a->sock = tsr_sock_dealer_sec(endpoint, 1, sec, &a->mon, err, errlen);
    if (!a->sock) {
        free(a);
        return NULL;
    }
    a->phase = TSR_A_REGISTERING;
    a->register_backoff_ms = REGISTER_BACKOFF_MIN_MS;
    a->hb_interval_ms = 100;
    a->lease_ms = 1000;
    a->last_heard_ms = tsr_now_ms();
    return a;
}

void tsr_agent_destroy(tsr_agent_t **self_p)
{
    if (!self_p || !*self_p) return;
    tsr_sock_monitor_close((*self_p)->sock, &(*self_p)->mon);
    tsr_sock_close(&(*self_p)->sock);
    free(*self_p);
    *self_p = NULL;
}

static int send_env(tsr_agent_t *a, tsr_env_t *env)
{
    env->protocol_version = a->protocol_version;
    env->worker = a->name;
    if (tsr_wire_send(a->sock, NULL, 0, env) == 0) return 0;
    /* No connection to the coordinator (it is away: ZMQ_IMMEDIATE) or a
     * full queue.  Counted; what matters comes again (heartbeats,
     * registration) or is recovered by the coordinator (a lost token or
     * report makes its request resume, see router.c). */
    a->sends_failed++;
    tsr_debug("could not send %s to the coordinator (%llu so far)", tsr_env_kind(env),
              (unsigned long long)a->sends_failed);
    return -1;
}

static void drop_piece(tsr_agent_t *a, const char *why)
{
    if (a->has_piece)
        tsr_info("dropping piece %s r%u s%u t%u: %s", a->deployment, a->piece.replica,
                 a->piece.stage, a->piece.tp_rank, why);
    if (a->has_piece && a->ex) tsr_executor_unassign(a->ex);
    a->has_piece = false;
    a->state = TESSERA__WORKER_STATE__STATE_IDLE;
    a->reason[0] = '\0';
}

static void send_register(tsr_agent_t *a)
{
    Tessera__Register r = TESSERA__REGISTER__INIT;
    r.node = a->node;
    r.device = a->device.kind == TSR_DEVICE_CUDA ? TESSERA__DEVICE_KIND__DEVICE_CUDA
                                                 : TESSERA__DEVICE_KIND__DEVICE_CPU;
    r.device_index = a->device.index;
    r.device_memory = a->device.memory;
    r.software_version = TSR_SOFTWARE_VERSION;
    r.pid = (uint32_t)getpid();
    r.data_endpoint = a->ex ? (char *)tsr_executor_endpoint(a->ex) : "";
    r.pci_bus_id = a->device.pci_bus_id;
    r.nccl = a->device.nccl;
    r.mem_gbs = a->device.mem_gbs;
    r.gflops = a->device.gflops;
    r.cpu_cores = a->device.cpu_cores;
    r.cpu_threads = a->device.cpu_threads;
    char *links[TSR_NVLINK_MAX];
    for (int i = 0; i < a->device.n_nvlink; i++) links[i] = a->device.nvlink[i];
    r.n_nvlink_peers = (size_t)a->device.n_nvlink;
    r.nvlink_peers = links;
    if (a->has_piece) {
        r.assignment = &a->piece;
        r.state = a->state;
        if (a->state == TESSERA__WORKER_STATE__STATE_FAILED) {
            r.reason = a->reason;
            r.retryable = a->retryable;
            r.past_deadline = a->past_deadline;
        }
    }
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = a->has_piece ? a->piece.epoch : 0;
    env.body_case = TESSERA__ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    send_env(a, &env);
}

/* A Progress, Ready or Failed about the piece held; a Failed says what the
 * agent's state says of it (retryable, past_deadline), and whether fatal. */
static void send_piece_msg(tsr_agent_t *a, Tessera__Envelope__BodyCase kind, const char *text,
                           bool fatal)
{
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Progress p = TESSERA__PROGRESS__INIT;
    Tessera__Ready r = TESSERA__READY__INIT;
    Tessera__Failed f = TESSERA__FAILED__INIT;
    env.epoch = a->piece.epoch;
    env.body_case = kind;
    if (kind == TESSERA__ENVELOPE__BODY_PROGRESS) {
        p.detail = (char *)text;
        env.progress = &p;
    } else if (kind == TESSERA__ENVELOPE__BODY_READY) {
        env.ready = &r;
    } else {
        f.reason = (char *)text;
        f.fatal = fatal;
        f.retryable = a->retryable;
        f.past_deadline = a->past_deadline;
        env.failed = &f;
    }
    send_env(a, &env);
}

/* Resident memory of this process, in bytes (0 if unknown). */
static uint64_t resident_bytes(void)
{
    unsigned long size = 0, rss = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return 0;
    if (fscanf(f, "%lu %lu", &size, &rss) != 2) rss = 0;
    fclose(f);
    return (uint64_t)rss * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* Share of the machine's cores this process kept busy since the last call. */
static float cpu_load(tsr_agent_t *a, int64_t now)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    int64_t cpu_us = (int64_t)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000 +
                     ru.ru_utime.tv_usec + ru.ru_stime.tv_usec;
    float load = 0;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (a->load_wall_ms && now > a->load_wall_ms && cores > 0)
        load = (float)(cpu_us - a->load_cpu_us) / 1000.0f / (float)(now - a->load_wall_ms) /
               (float)cores;
    a->load_cpu_us = cpu_us;
    a->load_wall_ms = now;
    return load < 0 ? 0 : load > 1 ? 1 : load;
}

static void send_heartbeat(tsr_agent_t *a, int64_t now)
{
    Tessera__Heartbeat hb = TESSERA__HEARTBEAT__INIT;
    hb.load = cpu_load(a, now);
    hb.memory_used = resident_bytes();
    if (a->ex) {
        tsr_executor_stats_t st;
        tsr_executor_bytes(a->ex, &hb.weight_bytes, &hb.kv_bytes);
        tsr_executor_stats(a->ex, &st);
        hb.kv_blocks_used = (uint32_t)st.kv_used;
        hb.kv_blocks_total = (uint32_t)st.kv_total;
        hb.queued = (uint32_t)st.queued;
        hb.running = (uint32_t)st.running;
        hb.steps = st.steps;
        hb.kv_blocks_cached = (uint32_t)st.kv_cached;
        hb.kv_evictions = st.evictions;
        hb.prompt_tokens_cached = st.prompt_cached;
        hb.prompt_tokens_computed = st.prompt_computed;
        hb.preemptions = st.preemptions;
    }
    hb.state = a->has_piece ? a->state : TESSERA__WORKER_STATE__STATE_IDLE;
    hb.seq = ++a->seq;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = a->has_piece ? a->piece.epoch : 0;
    env.body_case = TESSERA__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    send_env(a, &env);
}

int tsr_agent_check_piece(const Tessera__Assignment *as, char *err, size_t errlen)
{
    tsr_model_info_t m;
    if (tsr_model_info_load(as->model_path, &m, err, errlen) < 0) return -1;
    /* Values past INT_MAX become negative and fail the checks. */
    return tsr_model_check_piece(&m, as->model_path, (int)as->tp_rank, (int)as->tp_size,
                                 (int)as->stage, (int)as->pp_size, (int)as->layer_begin,
                                 (int)as->layer_end, err, errlen);
}

static void take_assignment(tsr_agent_t *a, const Tessera__Assignment *as)
{
    snprintf(a->deployment, sizeof a->deployment, "%s", as->deployment);
    snprintf(a->model_path, sizeof a->model_path, "%s", as->model_path);
    a->piece = *as;
    a->piece.base = (ProtobufCMessage)PROTOBUF_C_MESSAGE_INIT(&tessera__assignment__descriptor);
    a->piece.deployment = a->deployment;
    a->piece.model_path = a->model_path;
    a->piece.n_peers = 0;  /* the executor keeps its own copy */
    a->piece.peers = NULL;
    a->piece.n_peer_devices = 0;
    a->piece.peer_devices = NULL;
    a->piece.n_peer_workers = a->piece.n_peer_nodes = 0;
    a->piece.peer_workers = a->piece.peer_nodes = NULL;
    /* The replica's secret too: it points into the message being freed, and
     * a re-registration must not send it back over the wire. */
    a->piece.data_secret = (ProtobufCBinaryData){0, NULL};
    a->piece.prefix_secret = (ProtobufCBinaryData){0, NULL};   /* the same (prefix_cache says) */
    a->has_piece = true;
    a->state = TESSERA__WORKER_STATE__STATE_LOADING;
    tsr_info("assigned %s r%u s%u t%u/%u layers [%u,%u) from %s (epoch %llu)", a->deployment,
             as->replica, as->stage, as->tp_rank, as->tp_size, as->layer_begin, as->layer_end,
             a->model_path, (unsigned long long)as->epoch);
    send_piece_msg(a, TESSERA__ENVELOPE__BODY_PROGRESS, "checking config.json", false);

    char err[512];
    if (tsr_agent_check_piece(&a->piece, err, sizeof err) < 0) {
        a->state = TESSERA__WORKER_STATE__STATE_FAILED;
        snprintf(a->reason, sizeof a->reason, "%s", err);
        a->retryable = a->past_deadline = false;
        tsr_error("cannot load %s r%u s%u t%u: %s", a->deployment, as->replica, as->stage,
                  as->tp_rank, err);
        send_piece_msg(a, TESSERA__ENVELOPE__BODY_FAILED, err, false);
        return;
    }
    if (a->ex) {
        /* Ready when the executor has the weights and the replica is wired. */
        tsr_executor_assign(a->ex, as);
        return;
    }
    a->state = TESSERA__WORKER_STATE__STATE_READY;
    tsr_info("ready: %s r%u s%u t%u", a->deployment, as->replica, as->stage, as->tp_rank);
    send_piece_msg(a, TESSERA__ENVELOPE__BODY_READY, NULL, false);
}

static void send_token_event(tsr_agent_t *a, uint64_t epoch, uint64_t req, int32_t token,
                             int index, int done, const char *finish, const char *error,
                             int retryable, int cached)
{
    Tessera__TokenEvent t = TESSERA__TOKEN_EVENT__INIT;
    t.cached_tokens = cached > 0 ? (uint32_t)cached : 0;
    t.request_id = req;
    t.token = token;
    t.index = (uint32_t)index;
    t.done = done;
    t.finish_reason = (char *)(finish ? finish : "");
    t.error = (char *)(error ? error : "");
    t.retryable = retryable == TSR_FAIL_RETRYABLE;
    t.busy = retryable == TSR_FAIL_BUSY;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_TOKEN_EVENT;
    env.token_event = &t;
    send_env(a, &env);
}

static void on_generate(tsr_agent_t *a, const Tessera__Generate *g)
{
    if (!a->ex || !a->has_piece) {
        send_token_event(a, a->piece.epoch, g->request_id, -1, 0, 1, NULL,
                         "this worker holds no piece to serve it", true, 0);
        return;
    }
    tsr_request_t r = {.request_id = g->request_id, .n_prompt = (int)g->n_prompt,
                       .max_tokens = (int)g->max_tokens, .temperature = g->temperature,
                       .top_p = g->top_p, .seed = g->seed,
                       .timeout_ms = g->timeout_ms > 86400000u ? 86400000 : (int)g->timeout_ms};
    /* Counts past INT_MAX would turn negative: the leader refuses those. */
    if (g->max_tokens > 1000000u) r.max_tokens = 0;
    if (g->n_prompt > 1000000u) r.n_prompt = 0;
    r.prompt = malloc((r.n_prompt ? (size_t)r.n_prompt : 1) * sizeof *r.prompt);
    if (!r.prompt) {
        send_token_event(a, a->piece.epoch, g->request_id, -1, 0, 1, NULL,
                         "worker out of memory for the prompt", true, 0);
        return;
    }
    memcpy(r.prompt, g->prompt, (size_t)r.n_prompt * sizeof *r.prompt);
    tsr_executor_submit(a->ex, &r);
}

static void send_offer(tsr_agent_t *a, int i)
{
    Tessera__RendezvousOffer o = TESSERA__RENDEZVOUS_OFFER__INIT;
    o.group = a->offers[i].group;
    o.blob = (ProtobufCBinaryData){a->offers[i].len, a->offers[i].blob};
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = a->offers[i].epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_RENDEZVOUS_OFFER;
    env.rendezvous_offer = &o;
    send_env(a, &env);
}

/* Passes on what the data plane has to say.  Reports about an older
 * assignment than the one held are dropped here already. */
static void drain_executor(tsr_agent_t *a)
{
    tsr_event_t ev;
    while (a->ex && tsr_executor_pop_event(a->ex, &ev)) {
        if (ev.kind == TSR_EV_TOKEN) {
            send_token_event(a, ev.epoch, ev.request_id, ev.token, ev.index, ev.done, ev.finish,
                             ev.text[0] ? ev.text : NULL, ev.retryable, ev.cached);
            continue;
        }
        if (!a->has_piece || ev.epoch != a->piece.epoch) {
            a->stale_dropped++;
            continue;
        }
        if (ev.kind == TSR_EV_RENDEZVOUS) {
            /* rank 0 of an NCCL group: the coordinator relays the blob;
             * it is kept to be offered again while the piece loads */
            int k = 0;
            for (int i = 0; i < a->n_offers; i++)
                if (a->offers[i].epoch == ev.epoch) a->offers[k++] = a->offers[i];
            a->n_offers = k;
            while (k > 0 && a->offers[k - 1].group != ev.group) k--;
            if (k == 0) k = a->n_offers < 3 ? ++a->n_offers : 3;
            a->offers[k - 1].epoch = ev.epoch;
            a->offers[k - 1].group = ev.group;
            memcpy(a->offers[k - 1].blob, ev.blob, ev.blob_len);
            a->offers[k - 1].len = ev.blob_len;
            send_offer(a, k - 1);
            a->next_offer_ms = tsr_now_ms() + 1000;
        } else if (ev.kind == TSR_EV_PROGRESS) {
            send_piece_msg(a, TESSERA__ENVELOPE__BODY_PROGRESS, ev.text, false);
        } else if (ev.kind == TSR_EV_READY) {
            a->state = TESSERA__WORKER_STATE__STATE_READY;
            tsr_info("ready: %s r%u s%u t%u (epoch %llu)", a->deployment, a->piece.replica,
                     a->piece.stage, a->piece.tp_rank, (unsigned long long)ev.epoch);
            send_piece_msg(a, TESSERA__ENVELOPE__BODY_READY, NULL, false);
        } else {
            a->state = TESSERA__WORKER_STATE__STATE_FAILED;
            snprintf(a->reason, sizeof a->reason, "%s", ev.text);
            a->retryable = ev.retryable && !ev.fatal;
            a->past_deadline = ev.past_deadline && a->retryable;
            tsr_error("%s r%u s%u t%u failed: %s", a->deployment, a->piece.replica,
                      a->piece.stage, a->piece.tp_rank, ev.text);
            send_piece_msg(a, TESSERA__ENVELOPE__BODY_FAILED, ev.text, ev.fatal);
        }
    }
}

static void on_register_reply(tsr_agent_t *a, const tsr_env_t *env, int64_t now)
{
    const Tessera__RegisterReply *r = env->register_reply;
    if (a->phase != TSR_A_REGISTERING) return;  /* a duplicate answer */
    if (!r->accepted) {
        tsr_error("coordinator at %s refused registration: %s", a->endpoint, r->reason);
        a->stop = true;
        a->exit_code = 2;
        return;
    }
    a->phase = TSR_A_REGISTERED;
    a->register_backoff_ms = REGISTER_BACKOFF_MIN_MS;
    if (r->heartbeat_interval_ms) a->hb_interval_ms = (int)r->heartbeat_interval_ms;
    if (r->lease_ms) a->lease_ms = (int)r->lease_ms;
    a->registered_once = true;
    a->next_hb_ms = now;
    if (a->has_piece && !r->adopted) drop_piece(a, r->reason[0] ? r->reason : "not adopted");
    tsr_info("registered with coordinator at %s%s (heartbeat %d ms, lease %d ms)", a->endpoint,
             a->has_piece ? ", piece adopted" : "", a->hb_interval_ms, a->lease_ms);
}

static void on_message(tsr_agent_t *a, tsr_env_t *env, int64_t now)
{
    a->last_heard_ms = now;
    if (a->detached) {
        tsr_info("coordinator is back after the lease expired");
        a->detached = false;
    }
    switch (env->body_case) {
    case TESSERA__ENVELOPE__BODY_REGISTER_REPLY:
        on_register_reply(a, env, now);
        break;
    case TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK:
        break;
    case TESSERA__ENVELOPE__BODY_ASSIGN:
        if (a->phase != TSR_A_REGISTERED) break;
        if (a->has_piece && env->assign->assignment->epoch < a->piece.epoch) {
            a->stale_dropped++;
            tsr_warn("dropped a stale assignment (epoch %llu < %llu)",
                     (unsigned long long)env->assign->assignment->epoch,
                     (unsigned long long)a->piece.epoch);
            break;
        }
        take_assignment(a, env->assign->assignment);
        break;
    case TESSERA__ENVELOPE__BODY_UNASSIGN:
    case TESSERA__ENVELOPE__BODY_DRAIN:
        if (a->has_piece && env->epoch < a->piece.epoch) {
            a->stale_dropped++;
            break;
        }
        drop_piece(a, env->body_case == TESSERA__ENVELOPE__BODY_UNASSIGN ? env->unassign->reason
                                                                         : env->drain->reason);
        break;
    case TESSERA__ENVELOPE__BODY_GENERATE:
        on_generate(a, env->generate);
        break;
    case TESSERA__ENVELOPE__BODY_CANCEL:
        if (a->ex) tsr_executor_cancel(a->ex, env->cancel->request_id, env->cancel->reason);
        break;
    case TESSERA__ENVELOPE__BODY_RENDEZVOUS:
        /* only for the piece held now; the executor checks the epoch again */
        if (!a->has_piece || env->epoch != a->piece.epoch) {
            a->stale_dropped++;
            break;
        }
        if (a->ex)
            tsr_executor_rendezvous(a->ex, env->epoch, env->rendezvous->group,
                                    env->rendezvous->blob.data, env->rendezvous->blob.len);
        break;
    case TESSERA__ENVELOPE__BODY_RESET:
        /* Resets answer messages sent before the last registration; while a
         * registration is in flight they carry no news. */
        if (a->phase == TSR_A_REGISTERING) break;
        /* After a fatal device error the coordinator's reset is its answer
         * to our report: the report arrived, so the worker exits now (to
         * be restarted) instead of registering a broken device again. */
        if (a->ex && tsr_executor_device_lost(a->ex)) {
            a->exit_code = 75;
            a->stop = true;
            break;
        }
        tsr_warn("coordinator asks to register again: %s", env->reset->reason);
        if (!env->reset->keep_assignment) drop_piece(a, "declared dead by the coordinator");
        a->phase = TSR_A_REGISTERING;
        a->next_register_ms = now;
        break;
    default:
        tsr_warn("unexpected %s from the coordinator", tsr_env_kind(env));
    }
}

#define HANDSHAKE_RETRY_MS 1000
#define HANDSHAKES_CUT_MAX 3
#define CURVE_NEVER_COMPLETED                                                                 \
    "the CURVE handshake never completed (the coordinator closed it each time): likely a "  \
    "wrong coordinator.pub (it must be the coordinator's current public key, from its key " \
    "store), or a server that is not a Tessera coordinator on that port"

/* Says why the coordinator will not talk to us (a key it does not allow,
 * CURVE on one side only), once per cause and then every 10 s: the worker
 * keeps trying, since an operator may be adding the key right now. */
static void watch_handshakes(tsr_agent_t *a, int64_t now)
{
    int ev;
    uint32_t value = 0;
    while (a->mon && (ev = tsr_sock_monitor_event_v(a->mon, &value)) >= 0) {
        if (ev == ZMQ_EVENT_CONNECTED) a->tcp_connected = true;
        if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            a->handshake_ok = true;
            a->handshakes_cut = 0;
        }
        const char *why = tsr_handshake_failure(ev, value);
        /* A CURVE server closes, without a word, the handshake of a client
         * that does not have its public key: several in a row and never one
         * completed is that, not a restart. */
        if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL &&
            ++a->handshakes_cut >= HANDSHAKES_CUT_MAX && !a->handshake_ok && a->identity[0])
            why = CURVE_NEVER_COMPLETED;
        /* A handshake cut short (the coordinator restarting) is retried
         * like a refusal, without an alarm. */
        if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL && !a->reconnect_at_ms)
            a->reconnect_at_ms = now + HANDSHAKE_RETRY_MS;
        if (!why) continue;
        a->handshake_failures++;
        /* ZeroMQ gives up on a connection whose handshake failed: connect
         * again later, so a key added or a coordinator fixed meanwhile is
         * picked up (the routing id stays the socket's). */
        if (!a->reconnect_at_ms) a->reconnect_at_ms = now + HANDSHAKE_RETRY_MS;
        if (why == a->handshake_why && now - a->handshake_logged_ms < 10000) continue;
        tsr_error("the coordinator at %s refused the connection: %s (identity '%s'%s%s)",
                  a->endpoint, why, a->identity[0] ? a->identity : "-",
                  a->identity[0] ? ", keys in " : ", no keys", a->keys_dir);
        a->handshake_why = why;
        a->handshake_logged_ms = now;
    }
}

/* What the connection's events say about a silence before the first
 * registration ("" when they say nothing more). */
static void silence_cause(const tsr_agent_t *a, char *out, size_t len)
{
    out[0] = '\0';
    if (a->registered_once) return;
    if (a->handshake_why)
        snprintf(out, len, "it refused the connection: %s", a->handshake_why);
    else if (!a->tcp_connected)
        snprintf(out, len, "nothing accepted a connection there (is the coordinator running, "
                 "and is that its workers endpoint?)");
    else if (!a->handshake_ok && a->identity[0])
        snprintf(out, len, "%s (identity '%s', keys in %s)", CURVE_NEVER_COMPLETED,
                 a->identity, a->keys_dir);
    else if (!a->handshake_ok)
        snprintf(out, len, "the handshake never completed: does the coordinator use CURVE "
                 "(coordinator.security) while this worker has no keys?");
}

int tsr_agent_step(tsr_agent_t *a, int64_t now)
{
    char err[256];
    watch_handshakes(a, now);
    if (a->reconnect_at_ms && now >= a->reconnect_at_ms) {
        a->reconnect_at_ms = 0;
        tsr_zmq_disconnect(a->sock, a->endpoint);
        if (tsr_zmq_connect(a->sock, a->endpoint) != 0)
            tsr_warn("cannot connect to %s again: %s", a->endpoint, zmq_strerror(errno));
    }
    for (int i = 0; i < 1024 && !a->stop; i++) {
        tsr_env_t *env = NULL;
        int rc = tsr_wire_recv(a->sock, NULL, NULL, TSR_WIRE_MAX_WORKER, &env, err, sizeof err);
        if (rc == 0) break;
        if (rc < 0) {
            tsr_warn("rejected a message from the coordinator: %s", err);
            continue;
        }
        if (env->protocol_version != TSR_PROTOCOL_VERSION &&
            env->body_case != TESSERA__ENVELOPE__BODY_REGISTER_REPLY)
            tsr_warn("dropped %s with protocol version %u", tsr_env_kind(env),
                     env->protocol_version);
        else
            on_message(a, env, now);
        tsr_env_free(&env);
    }
    if (a->stop) return 0;
    if (a->ex) tsr_executor_watch(a->ex, now);
    drain_executor(a);

    if (a->phase == TSR_A_REGISTERED && a->n_offers && now >= a->next_offer_ms) {
        a->next_offer_ms = now + 1000;
        if (a->has_piece && a->state == TESSERA__WORKER_STATE__STATE_LOADING)
            for (int i = 0; i < a->n_offers; i++)
                if (a->offers[i].epoch == a->piece.epoch) send_offer(a, i);
    }
    if (a->phase == TSR_A_REGISTERING && now >= a->next_register_ms) {
        send_register(a);
        a->next_register_ms = now + a->register_backoff_ms;
        a->register_backoff_ms *= 2;
        if (a->register_backoff_ms > REGISTER_BACKOFF_MAX_MS)
            a->register_backoff_ms = REGISTER_BACKOFF_MAX_MS;
    }
    if (a->phase == TSR_A_REGISTERED && now >= a->next_hb_ms) {
        send_heartbeat(a, now);
        a->next_hb_ms = now + a->hb_interval_ms;
    }
    if (!a->detached && now - a->last_heard_ms > a->lease_ms) {
        a->detached = true;
        char lease[96], cause[512];
        if (a->registered_once)
            snprintf(lease, sizeof lease, "lease %d ms, the coordinator's", a->lease_ms);
        else
            snprintf(lease, sizeof lease, "lease %d ms: this worker's default until a "
                     "coordinator answers", a->lease_ms);
        silence_cause(a, cause, sizeof cause);
        tsr_warn("no word from the coordinator at %s for %lld ms (%s): %s, taking no new "
                 "work until it is back%s%s",
                 a->endpoint, (long long)(now - a->last_heard_ms), lease,
                 a->has_piece ? "keeping my piece" : "idle", cause[0] ? "; " : "", cause);
    }
    /* A silent coordinator may have restarted without our connection
     * noticing; registering again is harmless and re-attaches us. */
    if (a->detached && a->phase == TSR_A_REGISTERED) {
        a->phase = TSR_A_REGISTERING;
        a->next_register_ms = now;
    }
    int64_t next = a->phase == TSR_A_REGISTERING ? a->next_register_ms : a->next_hb_ms;
    int64_t wait = next - now;
    if (wait > 100) wait = 100;
    return wait < 0 ? 0 : (int)wait;
}
