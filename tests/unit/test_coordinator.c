/* test_coordinator.c: a real coordinator (coordinator/loop.c and the layers
 * below it, control.c included) driven in-process.  Fake workers and a fake CLI are
 * DEALER sockets on inproc endpoints in the same ZeroMQ context; the test
 * drains the coordinator's sockets and calls its tick itself, passing the
 * time in, so nothing here waits on a real timer. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include "testutil.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/budget.h"
#include "common/slice.h"
#include "common/wire.h"
#include "coordinator/depview.h"
#include "coordinator/loop.h"
#include "coordinator/layout.h"
#include "coordinator/metrics_text.h"
#include "coordinator/reply.h"
#include "coordinator/router.h"
#include "coordinator/status.h"
#include "coordinator/waited.h"
#include "coordinator/deptok.h"
#include "coordinator/reload.h"
#include "coordinator/autoscale.h"
#include "coordinator/placement.h"
#include "cli/cli.h"

#define NW 5            /* fake workers: four pieces (tp 2 x pp 2) and a spare */
#define TIMEOUT_MS 1000

/* ---- fixture ----------------------------------------------------------------- */

typedef struct {
    char dir[64];
    char path[128];
    char wep[64], cep[64];
    tsr_coord_t *c;
    void *dealer[NW];
    char name[NW][16];
    void *ctl;                  /* fake CLI on the control endpoint */
    /* after cluster_up: */
    bool holds[NW];
    Tessera__Assignment piece[NW];  /* copied scalars; strings not kept */
    int spare;
    uint64_t last_id;           /* the client's id of the last start_request */
} fx_t;

static char model_dir[PATH_MAX];
static int endpoint_seq;

static void find_model_dir(void) { tsr_test_tiny_model_dir(model_dir); }

/* The deployment's parallel layout (a test may change it before it writes
 * the file). */
static const char *layout;
/* The deployment's device and the fake workers' (cuda with its memory per
 * worker, 0: 1 GiB), for the GPU memory tests. */
static const char *dep_device = "cpu";
static bool reg_cuda;
static uint64_t reg_memory[8];
static const char *reg_bus[8];  /* each fake worker's PCI bus id (NULL: none) */
static bool reg_nccl;           /* the fake workers say they can use NCCL */
static char *reg_links[8][2];   /* each fake worker's NVLink peers (NULL: none) */
static const char *reg_reason;  /* a held failed piece: why, and whether rewiring may mend it */
static bool reg_retryable;
static bool reg_past_deadline;  /* ...and whether it was a deadline */
static double reg_rate;         /* the fake workers' mem_gbs and gflops (0: not given) */
static int reg_cores, reg_threads;  /* their cpu_cores and cpu_threads (0: not said) */
static const char *gen_deployment = "tiny";  /* where send_generate sends */
#define LAYOUT_TP2_PP2 "      tensor: 2\n      pipeline: 2\n      replicas: 1\n"

/* extra: lines for the coordinator mapping; dep_extra: lines for the
 * deployment (after max_seq_len).  Either may be NULL. */
static void write_yaml_dep(const char *path, const char *wep, const char *cep, const char *extra,
                           const char *dep_extra)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f,
            "version: 1\n"
            "coordinator:\n"
            "  workers_endpoint: %s\n"
            "  control_endpoint: %s\n"
            "  heartbeat_interval_ms: 100\n"
            "  worker_timeout_ms: %d\n"
            "  security: none\n"
            "%s"
            "%s"
            "deployments:\n"
            "  - name: tiny\n"
            "    model: %s\n"
            "    device: %s\n"
            "    parallel:\n"
            "%s"
            "    max_seq_len: 256\n"
            "%s",
            wep, cep, TIMEOUT_MS, extra ? extra : "",
            /* Canaries only where a test asks for them (they would add
             * Generate messages to every exchange). */
            extra && strstr(extra, "canary_interval_ms") ? "" : "  canary_interval_ms: 0\n",
            model_dir, dep_device, layout, dep_extra ? dep_extra : "");
    fclose(f);
}

static void write_yaml(const char *path, const char *wep, const char *cep, const char *extra)
{
    write_yaml_dep(path, wep, cep, extra, NULL);
}

static int setup(void **state)
{
    if (!model_dir[0]) find_model_dir();
    layout = LAYOUT_TP2_PP2;
    dep_device = "cpu";
    reg_cuda = false;
    memset(reg_memory, 0, sizeof reg_memory);
    memset(reg_bus, 0, sizeof reg_bus);
    memset(reg_links, 0, sizeof reg_links);
    reg_nccl = false;
    reg_rate = 0;
    reg_cores = reg_threads = 0;
    fx_t *fx = calloc(1, sizeof *fx);
    assert_non_null(fx);
    snprintf(fx->dir, sizeof fx->dir, "/tmp/tsr-coord-XXXXXX");
    assert_non_null(mkdtemp(fx->dir));
    snprintf(fx->path, sizeof fx->path, "%s/cluster.yaml", fx->dir);
    int id = ++endpoint_seq;
    snprintf(fx->wep, sizeof fx->wep, "inproc://tw-%d", id);
    snprintf(fx->cep, sizeof fx->cep, "inproc://tc-%d", id);
    write_yaml(fx->path, fx->wep, fx->cep, NULL);

    char err[512] = "";
    fx->c = tsr_coord_new(fx->path, 0, err, sizeof err);
    if (!fx->c) fail_msg("tsr_coord_new: %s", err);
    for (int i = 0; i < NW; i++) {
        snprintf(fx->name[i], sizeof fx->name[i], "w%d", i);
        fx->dealer[i] = tsr_sock_dealer(fx->wep, 0, err, sizeof err);
        if (!fx->dealer[i]) fail_msg("dealer: %s", err);
    }
    fx->ctl = tsr_sock_dealer(fx->cep, 0, err, sizeof err);
    if (!fx->ctl) fail_msg("control dealer: %s", err);
    fx->spare = -1;
    *state = fx;
    return 0;
}

static int teardown(void **state)
{
    fx_t *fx = *state;
    for (int i = 0; i < NW; i++) tsr_sock_close(&fx->dealer[i]);
    tsr_sock_close(&fx->ctl);
    tsr_coord_destroy(&fx->c);
    assert_null(fx->c);
    unlink(fx->path);
    rmdir(fx->dir);
    free(fx);
    return 0;
}

/* ---- messaging helpers --------------------------------------------------------- */

/* Lets the coordinator read what was sent to it (waiting for it to arrive). */
static void pump(fx_t *fx)
{
    zmq_pollitem_t it[2] = {{fx->c->wsock, 0, ZMQ_POLLIN, 0}, {fx->c->csock, 0, ZMQ_POLLIN, 0}};
    zmq_poll(it, 2, 500);
    tsr_coord_drain_sockets(fx->c, 1000);
}

/* The next message on a fake worker or CLI socket, or NULL after ms. */
static tsr_env_t *recv_env(void *sock, size_t max, int ms)
{
    if (!tsr_test_readable(sock, ms)) return NULL;
    tsr_env_t *env = NULL;
    char err[256] = "";
    int rc = tsr_wire_recv(sock, NULL, NULL, max, &env, err, sizeof err);
    if (rc < 0) fail_msg("bad message from the coordinator: %s", err);
    return env;
}

/* The next message, which must be of `kind`. */
static tsr_env_t *expect_kind(void *sock, Tessera__Envelope__BodyCase kind)
{
    tsr_env_t *env = recv_env(sock, TSR_WIRE_MAX_CONTROL, 500);
    if (!env) fail_msg("no message arrived (expected body %d)", kind);
    if (env->body_case != kind)
        fail_msg("expected body %d, got %s", kind, tsr_env_kind(env));
    return env;
}

static void expect_nothing(void *sock, int ms)
{
    tsr_env_t *env = recv_env(sock, TSR_WIRE_MAX_CONTROL, ms);
    if (env) {
        char kind[32];
        snprintf(kind, sizeof kind, "%s", tsr_env_kind(env));
        tsr_env_free(&env);
        fail_msg("expected no message, got %s", kind);
    }
}

static void send_env(void *sock, tsr_env_t *env)
{
    assert_int_equal(tsr_wire_send(sock, NULL, 0, env), 0);
}

static void send_register(fx_t *fx, int i, const char *name, const char *node, uint32_t proto,
                          Tessera__Assignment *held, Tessera__WorkerState held_state)
{
    Tessera__Register r = TESSERA__REGISTER__INIT;
    r.node = (char *)node;
    r.device = reg_cuda ? TESSERA__DEVICE_KIND__DEVICE_CUDA : TESSERA__DEVICE_KIND__DEVICE_CPU;
    r.device_memory = reg_memory[i] ? reg_memory[i] : 1ull << 30;
    r.software_version = TSR_SOFTWARE_VERSION;
    r.pid = 1000u + (uint32_t)i;
    r.assignment = held;
    r.state = held_state;
    if (reg_reason) r.reason = (char *)reg_reason;
    r.retryable = reg_retryable;
    r.past_deadline = reg_past_deadline;
    if (reg_bus[i]) r.pci_bus_id = (char *)reg_bus[i];
    r.nccl = reg_nccl;
    r.mem_gbs = r.gflops = reg_rate;
    r.cpu_cores = (uint32_t)reg_cores;
    r.cpu_threads = (uint32_t)reg_threads;
    r.nvlink_peers = reg_links[i];
    r.n_nvlink_peers = (size_t)(reg_links[i][0] != NULL) + (reg_links[i][1] != NULL);
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.protocol_version = proto;
    env.worker = (char *)name;
    env.epoch = held ? held->epoch : 0;
    env.body_case = TESSERA__ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    send_env(fx->dealer[i], &env);
}

/* hb from fake worker i, claiming to be name. */
static void send_hb(fx_t *fx, int i, const char *name, Tessera__Heartbeat *hb)
{
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = (char *)name;
    env.body_case = TESSERA__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = hb;
    send_env(fx->dealer[i], &env);
}

static void send_heartbeat(fx_t *fx, int i, const char *name, uint64_t seq)
{
    Tessera__Heartbeat hb = TESSERA__HEARTBEAT__INIT;
    hb.seq = seq;
    hb.load = 0.25f;
    hb.memory_used = 123456789;
    send_hb(fx, i, name, &hb);
}

/* A heartbeat with the batching figures of the new data plane. */
static void send_heartbeat_pool(fx_t *fx, int i, float load, uint32_t used, uint32_t total,
                                uint32_t queued, uint32_t running)
{
    Tessera__Heartbeat hb = TESSERA__HEARTBEAT__INIT;
    hb.seq = 1;
    hb.load = load;
    hb.kv_blocks_used = used;
    hb.kv_blocks_total = total;
    hb.queued = queued;
    hb.running = running;
    send_hb(fx, i, fx->name[i], &hb);
}

static void send_ready(fx_t *fx, int i, uint64_t epoch)
{
    Tessera__Ready r = TESSERA__READY__INIT;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = fx->name[i];
    env.epoch = epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_READY;
    env.ready = &r;
    send_env(fx->dealer[i], &env);
}

static void send_progress(fx_t *fx, int i, uint64_t epoch, const char *detail)
{
    Tessera__Progress p = TESSERA__PROGRESS__INIT;
    p.detail = (char *)detail;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = fx->name[i];
    env.epoch = epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_PROGRESS;
    env.progress = &p;
    send_env(fx->dealer[i], &env);
}

static void send_failed_full(fx_t *fx, int i, uint64_t epoch, const char *reason, bool fatal,
                             bool retryable, bool past_deadline)
{
    Tessera__Failed f = TESSERA__FAILED__INIT;
    f.reason = (char *)reason;
    f.fatal = fatal;
    f.retryable = retryable;
    f.past_deadline = past_deadline;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = fx->name[i];
    env.epoch = epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_FAILED;
    env.failed = &f;
    send_env(fx->dealer[i], &env);
}

static void send_failed_as(fx_t *fx, int i, uint64_t epoch, const char *reason, bool fatal,
                           bool retryable)
{
    send_failed_full(fx, i, epoch, reason, fatal, retryable, false);
}

static void send_failed(fx_t *fx, int i, uint64_t epoch, const char *reason, bool fatal)
{
    send_failed_as(fx, i, epoch, reason, fatal, false);
}

static tsr_env_t *control(fx_t *fx, Tessera__ControlRequest__Kind kind, const char *worker)
{
    Tessera__ControlRequest q = TESSERA__CONTROL_REQUEST__INIT;
    q.kind = kind;
    q.worker = (char *)(worker ? worker : "");
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REQUEST;
    env.control_request = &q;
    send_env(fx->ctl, &env);
    pump(fx);
    return expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
}

/* A tick the health scan will run in: not before the scan that is due. */
static int64_t scan_time(fx_t *fx)
{
    int64_t now = tsr_now_ms();
    return now > fx->c->next_scan_ms ? now : fx->c->next_scan_ms;
}

/* Registers all five workers, checks each reply, and runs the first plan;
 * records who got which piece and who is the spare. */
static void cluster_up(fx_t *fx)
{
    for (int i = 0; i < NW; i++) {
        char node[16];
        snprintf(node, sizeof node, "node%d", i);
        send_register(fx, i, fx->name[i], node, TSR_PROTOCOL_VERSION, NULL, 0);
    }
    pump(fx);
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        assert_true(env->register_reply->accepted);
        tsr_env_free(&env);
    }
    tsr_coord_tick(fx->c, tsr_now_ms());
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env = recv_env(fx->dealer[i], TSR_WIRE_MAX_WORKER, 50);
        if (!env) {
            assert_int_equal(fx->spare, -1);  /* exactly one worker gets nothing */
            fx->spare = i;
            continue;
        }
        assert_int_equal(env->body_case, TESSERA__ENVELOPE__BODY_ASSIGN);
        assert_non_null(env->assign->assignment);
        fx->holds[i] = true;
        fx->piece[i] = *env->assign->assignment;
        fx->piece[i].deployment = fx->piece[i].model_path = NULL;
        fx->piece[i].peers = NULL;
        fx->piece[i].n_peers = 0;
        fx->piece[i].peer_devices = NULL;
        fx->piece[i].n_peer_devices = 0;
        fx->piece[i].peer_workers = fx->piece[i].peer_nodes = NULL;
        fx->piece[i].n_peer_workers = fx->piece[i].n_peer_nodes = 0;
        fx->piece[i].data_secret = (ProtobufCBinaryData){0, NULL};
        fx->piece[i].prefix_secret = (ProtobufCBinaryData){0, NULL};   /* as a worker keeps it */
        assert_int_equal(env->epoch, env->assign->assignment->epoch);
        tsr_env_free(&env);
    }
    assert_int_not_equal(fx->spare, -1);
}

static int first_holder(const fx_t *fx)
{
    for (int i = 0; i < NW; i++)
        if (fx->holds[i]) return i;
    fail_msg("no holder");
    return -1;
}

static json_t *status(fx_t *fx)
{
    char *s = tsr_coord_status_json(fx->c, tsr_now_ms(), false);
    assert_non_null(s);
    json_error_t je;
    json_t *root = json_loads(s, 0, &je);
    free(s);
    if (!root) fail_msg("status is not JSON: %s", je.text);
    return root;
}

/* ---- registration ---------------------------------------------------------------- */

static void test_register_is_accepted_with_heartbeat_interval_and_lease(void **state)
{
    fx_t *fx = *state;
    for (int i = 0; i < NW; i++)
        send_register(fx, i, fx->name[i], "node0", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        const Tessera__RegisterReply *r = env->register_reply;
        assert_true(r->accepted);
        assert_false(r->adopted);
        assert_int_equal(r->heartbeat_interval_ms, 100);
        assert_int_equal(r->lease_ms, TIMEOUT_MS);
        assert_int_equal(r->coordinator_protocol, TSR_PROTOCOL_VERSION);
        assert_string_equal(env->worker, fx->name[i]);
        tsr_env_free(&env);

        tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[i]);
        assert_non_null(w);
        assert_int_equal(w->state, TSR_W_IDLE);
        assert_int_equal(w->pid, 1000 + i);
        assert_string_equal(w->node, "node0");
    }
    assert_int_equal(fx->c->stats.registrations, NW);
    assert_int_equal(tsr_registry_alive(fx->c->reg), NW);
}

static void test_first_tick_assigns_four_distinct_pieces_and_leaves_one_spare(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    unsigned seen = 0;
    int holders = 0;
    for (int i = 0; i < NW; i++) {
        if (!fx->holds[i]) continue;
        holders++;
        const Tessera__Assignment *a = &fx->piece[i];
        assert_true(a->epoch >= 1);
        assert_int_equal(a->tp_size, 2);
        assert_int_equal(a->pp_size, 2);
        assert_int_equal(a->replica, 0);
        assert_true(a->stage < 2 && a->tp_rank < 2);
        assert_int_equal(a->layer_begin, a->stage == 0 ? 0 : 4);
        assert_int_equal(a->layer_end, a->stage == 0 ? 4 : 8);
        unsigned bit = 1u << (a->stage * 2 + a->tp_rank);
        assert_false(seen & bit);  /* no piece handed out twice */
        seen |= bit;

        tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[i]);
        assert_true(w->has_piece);
        assert_int_equal(w->state, TSR_W_LOADING);
        assert_int_equal(w->piece.epoch, a->epoch);
    }
    assert_int_equal(holders, 4);
    assert_int_equal(seen, 0xf);
    assert_false(tsr_registry_find(fx->c->reg, fx->name[fx->spare])->has_piece);
    assert_int_equal(fx->c->stats.assigns, 4);
}

static void test_assign_carries_the_model_path_and_deployment(void **state)
{
    fx_t *fx = *state;
    for (int i = 0; i < NW; i++)
        send_register(fx, i, fx->name[i], "node0", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        tsr_env_free(&env);
    }
    tsr_coord_tick(fx->c, tsr_now_ms());
    int got = 0;
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env = recv_env(fx->dealer[i], TSR_WIRE_MAX_WORKER, 50);
        if (!env) continue;
        got++;
        assert_int_equal(env->body_case, TESSERA__ENVELOPE__BODY_ASSIGN);
        assert_string_equal(env->assign->assignment->deployment, "tiny");
        assert_string_equal(env->assign->assignment->model_path, model_dir);
        assert_int_equal(env->assign->assignment->max_seq_len, 256);
        /* The batching keys' defaults, and the deployment's device kind. */
        assert_int_equal(env->assign->assignment->max_batch, 32);
        assert_int_equal(env->assign->assignment->prefill_chunk, 128);
        assert_int_equal(env->assign->assignment->max_queue, 256);
        assert_int_equal(env->assign->assignment->collective_timeout_ms, 30000);
        assert_int_equal(env->assign->assignment->kv_cache_bytes, 0);
        assert_int_equal(env->assign->assignment->device, TESSERA__DEVICE_KIND__DEVICE_CPU);
        assert_string_equal(env->worker, fx->name[i]);
        /* the prefix cache on (the default), with the deployment's secret */
        assert_true(env->assign->assignment->prefix_cache);
        assert_int_equal(env->assign->assignment->prefix_secret.len, 16);
        uint8_t want[16];
        assert_true(tsr_coord_prefix_secret(fx->c, &fx->c->cfg->deployments[0], 2, 2, want));
        assert_memory_equal(env->assign->assignment->prefix_secret.data, want, 16);
        assert_int_equal(env->assign->assignment->kv_admission, 0);
        tsr_env_free(&env);
    }
    assert_int_equal(got, 4);
}

static void test_register_with_protocol_version_99_is_refused(void **state)
{
    fx_t *fx = *state;
    send_register(fx, 0, "future", "node0", 99, NULL, 0);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_false(env->register_reply->accepted);
    assert_non_null(strstr(env->register_reply->reason, "protocol version 99"));
    tsr_env_free(&env);
    assert_int_equal(fx->c->stats.refused, 1);
    assert_int_equal(fx->c->stats.registrations, 0);
    assert_null(tsr_registry_find(fx->c->reg, "future"));
    assert_int_equal(tsr_registry_size(fx->c->reg), 0);
}

static void test_same_name_from_another_node_while_alive_is_refused_as_duplicate(void **state)
{
    fx_t *fx = *state;
    send_register(fx, 0, "w0", "node-a", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_true(env->register_reply->accepted);
    tsr_env_free(&env);

    send_register(fx, 1, "w0", "node-b", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    env = expect_kind(fx->dealer[1], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_false(env->register_reply->accepted);
    assert_non_null(strstr(env->register_reply->reason, "already registered from node node-a"));
    tsr_env_free(&env);

    assert_int_equal(fx->c->stats.refused, 1);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, "w0");
    assert_string_equal(w->node, "node-a");  /* the first one keeps the name */
    assert_int_equal(w->pid, 1000);
    assert_int_equal(tsr_registry_size(fx->c->reg), 1);
}

/* ---- piece messages and epochs ------------------------------------------------------ */

static void test_ready_with_current_epoch_makes_worker_ready(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    send_ready(fx, h, fx->piece[h].epoch);
    pump(fx);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[h]);
    assert_int_equal(w->state, TSR_W_READY);
    assert_int_equal(fx->c->stats.stale_dropped, 0);
}

static void test_piece_messages_with_older_epoch_are_dropped_and_counted(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    uint64_t old = fx->piece[h].epoch - 1;
    send_ready(fx, h, old);
    send_progress(fx, h, old, "stale progress");
    send_failed(fx, h, old, "stale failure", false);
    pump(fx);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[h]);
    assert_int_equal(fx->c->stats.stale_dropped, 3);
    assert_int_equal(w->state, TSR_W_LOADING);
    assert_string_equal(w->detail, "");
    assert_string_equal(w->reason, "");
    assert_true(w->has_piece);

    /* The same messages with the current epoch do count. */
    send_progress(fx, h, fx->piece[h].epoch, "loading layers");
    pump(fx);
    assert_string_equal(w->detail, "loading layers");
    assert_int_equal(fx->c->stats.stale_dropped, 3);
}

static void test_heartbeat_is_acked_with_same_seq_and_counted(void **state)
{
    fx_t *fx = *state;
    send_register(fx, 0, "w0", "node0", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    tsr_env_free(&env);

    /* Acks only renew the lease: the first heartbeat is acked, one right
     * after it is counted but not acked, and one after a quarter of the
     * lease is acked again. */
    send_heartbeat(fx, 0, "w0", 41);
    send_heartbeat(fx, 0, "w0", 42);
    pump(fx);
    env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK);
    assert_int_equal(env->heartbeat_ack->seq, 41);
    tsr_env_free(&env);
    expect_nothing(fx->dealer[0], 20);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, "w0");
    w->last_ack_ms -= TIMEOUT_MS / 4;
    send_heartbeat(fx, 0, "w0", 43);
    pump(fx);
    env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK);
    assert_int_equal(env->heartbeat_ack->seq, 43);
    tsr_env_free(&env);
    assert_int_equal(fx->c->stats.heartbeats, 3);
    assert_int_equal(w->heartbeats, 3);
    assert_true(w->load > 0.24f && w->load < 0.26f);
    assert_int_equal(w->memory_used, 123456789);
}

/* Attack 1: heartbeats under a live worker's name from another connection
 * took over its routing.  They are dropped and counted; its messages still
 * go to the connection it registered from. */
static void test_heartbeats_under_a_live_workers_name_from_another_connection_are_dropped(
    void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    char err[256] = "";
    void *impostor = tsr_sock_dealer(fx->wep, 0, err, sizeof err);
    assert_non_null(impostor);
    void *real = fx->dealer[h];
    fx->dealer[h] = impostor;
    for (uint64_t k = 1; k <= 3; k++) send_heartbeat(fx, h, fx->name[h], k);
    fx->dealer[h] = real;
    pump(fx);
    expect_nothing(impostor, 20);
    assert_int_equal(fx->c->stats.identity_dropped, 3);
    assert_int_equal(fx->c->stats.heartbeats, 0);

    /* An Unassign (from a drain) goes to the real worker, not the impostor. */
    tsr_env_t *env = control(fx, TESSERA__CONTROL_REQUEST__KIND__DRAIN, fx->name[h]);
    assert_true(env->control_reply->ok);
    tsr_env_free(&env);
    env = expect_kind(real, TESSERA__ENVELOPE__BODY_UNASSIGN);
    tsr_env_free(&env);
    expect_nothing(impostor, 20);
    tsr_sock_close(&impostor);
}

/* Attack 6: a second process registering under a live name with the pid
 * copied from status was taken as a restart. */
static void test_registration_under_a_live_name_from_another_connection_is_refused_whatever_pid(
    void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    char err[256] = "";
    void *impostor = tsr_sock_dealer(fx->wep, 0, err, sizeof err);
    assert_non_null(impostor);
    void *real = fx->dealer[h];
    char node[16];
    snprintf(node, sizeof node, "node%d", h);
    fx->dealer[h] = impostor;
    send_register(fx, h, fx->name[h], node, TSR_PROTOCOL_VERSION, NULL, 0);  /* same pid */
    fx->dealer[h] = real;
    pump(fx);
    tsr_env_t *env = expect_kind(impostor, TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_false(env->register_reply->accepted);
    assert_non_null(strstr(env->register_reply->reason, "another connection"));
    tsr_env_free(&env);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[h]);
    assert_true(w->has_piece);
    assert_int_equal(w->state, TSR_W_LOADING);
    tsr_sock_close(&impostor);

    /* The real worker, re-registering on its own connection, is accepted. */
    send_register(fx, h, fx->name[h], node, TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    env = expect_kind(real, TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_true(env->register_reply->accepted);
    tsr_env_free(&env);
}

/* Attack 4: anyone could send a fatal Failed for any worker. */
static void test_a_failure_sent_for_another_worker_is_dropped(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    void *real = fx->dealer[h];
    fx->dealer[h] = fx->dealer[fx->spare];  /* the spare speaks for the holder */
    send_failed(fx, h, fx->piece[h].epoch, "forged", true);
    send_failed(fx, h, fx->piece[h].epoch, "forged", false);
    send_ready(fx, h, fx->piece[h].epoch);
    fx->dealer[h] = real;
    pump(fx);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[h]);
    assert_int_equal(w->state, TSR_W_LOADING);
    assert_true(w->has_piece);
    assert_int_equal(fx->c->stats.deaths, 0);
    assert_int_equal(fx->c->stats.identity_dropped, 3);
}

static void test_heartbeat_from_unknown_name_gets_reset_keeping_assignment(void **state)
{
    fx_t *fx = *state;
    send_heartbeat(fx, 0, "stranger", 1);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_RESET);
    assert_true(env->reset->keep_assignment);
    assert_string_equal(env->worker, "stranger");
    tsr_env_free(&env);
    assert_null(tsr_registry_find(fx->c->reg, "stranger"));
    assert_int_equal(fx->c->stats.heartbeats, 0);
}

/* ---- deaths and moves --------------------------------------------------------------- */

static void test_worker_silent_past_timeout_is_dead_and_its_heartbeat_gets_reset_dropping_piece(
    void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[h]);

    /* Exactly at the timeout it is still alive. */
    int64_t now = scan_time(fx);
    w->last_seen_ms = now - TIMEOUT_MS;
    tsr_coord_tick(fx->c, now);
    assert_int_not_equal(w->state, TSR_W_DEAD);

    now = scan_time(fx);
    w->last_seen_ms = now - TIMEOUT_MS - 1;
    tsr_coord_tick(fx->c, now);
    assert_int_equal(w->state, TSR_W_DEAD);
    assert_false(w->has_piece);
    assert_int_equal(fx->c->stats.deaths, 1);
    assert_int_equal(tsr_registry_alive(fx->c->reg), NW - 1);

    send_heartbeat(fx, h, fx->name[h], 7);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[h], TESSERA__ENVELOPE__BODY_RESET);
    assert_false(env->reset->keep_assignment);
    assert_non_null(strstr(env->reset->reason, "dead"));
    tsr_env_free(&env);
    assert_int_equal(fx->c->stats.heartbeats, 0);
    assert_int_equal(w->state, TSR_W_DEAD);  /* a heartbeat does not revive it */
}

/* Each slot of a's peer list names its holder's worker and node (cluster_up
 * registers worker i on node i), so that a worker's messages about a peer
 * can say which worker on which machine; the receiver holds its own slot. */
static void expect_peers_named(fx_t *fx, const Tessera__Assignment *a)
{
    assert_int_equal(a->n_peer_workers, a->n_peers);
    assert_int_equal(a->n_peer_nodes, a->n_peers);
    for (size_t k = 0; k < a->n_peers; k++) {
        tsr_worker_t *w = tsr_registry_find(fx->c->reg, a->peer_workers[k]);
        assert_non_null(w);
        assert_string_equal(a->peers[k], w->data_endpoint);
        int i = 0;
        while (i < NW && strcmp(fx->name[i], w->name)) i++;
        char node[16];
        snprintf(node, sizeof node, "node%d", i);
        assert_string_equal(a->peer_nodes[k], node);
    }
    assert_string_equal(a->peer_workers[a->stage * a->tp_size + a->tp_rank], fx->name[fx->spare]);
}

static void expect_piece_moved_to_spare(fx_t *fx, int from)
{
    tsr_env_t *env = expect_kind(fx->dealer[fx->spare], TESSERA__ENVELOPE__BODY_ASSIGN);
    const Tessera__Assignment *a = env->assign->assignment;
    assert_int_equal(a->stage, fx->piece[from].stage);
    assert_int_equal(a->tp_rank, fx->piece[from].tp_rank);
    assert_int_equal(a->layer_begin, fx->piece[from].layer_begin);
    assert_int_equal(a->layer_end, fx->piece[from].layer_end);
    assert_true(a->epoch > fx->piece[from].epoch);
    assert_int_equal(a->n_peers, 4);
    expect_peers_named(fx, a);
    uint64_t epoch = a->epoch;
    tsr_env_free(&env);
    tsr_worker_t *s = tsr_registry_find(fx->c->reg, fx->name[fx->spare]);
    assert_true(s->has_piece);
    assert_int_equal(s->state, TSR_W_LOADING);
    /* The other holders keep their pieces (no move), but the replica is
     * rewired: each gets its own piece again in the new epoch. */
    for (int i = 0; i < NW; i++) {
        if (i == from || i == fx->spare || !fx->holds[i]) continue;
        tsr_env_t *re = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_ASSIGN);
        const Tessera__Assignment *b = re->assign->assignment;
        assert_int_equal(b->stage, fx->piece[i].stage);
        assert_int_equal(b->tp_rank, fx->piece[i].tp_rank);
        assert_int_equal(b->layer_begin, fx->piece[i].layer_begin);
        assert_int_equal(b->epoch, epoch);
        tsr_env_free(&re);
        expect_nothing(fx->dealer[i], 10);
    }
}

static void test_dead_holders_piece_moves_to_the_spare(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[h]);
    int64_t now = scan_time(fx);
    w->last_seen_ms = now - TIMEOUT_MS - 1;
    tsr_coord_tick(fx->c, now);
    assert_int_equal(w->state, TSR_W_DEAD);
    expect_piece_moved_to_spare(fx, h);
}

static void test_fatal_failure_kills_the_worker_at_once_and_its_piece_moves(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    send_failed(fx, h, fx->piece[h].epoch, "device lost", true);
    pump(fx);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[h]);
    assert_int_equal(w->state, TSR_W_DEAD);
    assert_false(w->has_piece);
    assert_non_null(strstr(w->reason, "device lost"));
    assert_int_equal(fx->c->stats.deaths, 1);
    assert_true(fx->c->dirty);

    tsr_coord_tick(fx->c, tsr_now_ms());
    expect_piece_moved_to_spare(fx, h);
}

static void test_nonfatal_failure_marks_worker_failed_and_deployment_failed_in_status(
    void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    send_failed(fx, h, fx->piece[h].epoch, "weights missing for layer 3", false);
    pump(fx);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[h]);
    assert_int_equal(w->state, TSR_W_FAILED);
    assert_true(w->has_piece);  /* not dead: it keeps the piece until a reload */
    assert_string_equal(w->reason, "weights missing for layer 3");

    json_t *root = status(fx);
    json_t *d = json_array_get(json_object_get(root, "deployments"), 0);
    assert_non_null(d);
    assert_string_equal(json_string_value(json_object_get(d, "state")), "failed");
    const char *msg = json_string_value(json_object_get(d, "message"));
    assert_non_null(msg);
    assert_non_null(strstr(msg, "weights missing for layer 3"));
    assert_non_null(strstr(msg, fx->name[h]));
    json_decref(root);
}

/* ---- adoption after a coordinator restart --------------------------------------------- */

static void held_piece(Tessera__Assignment *a, uint32_t begin, uint32_t end)
{
    Tessera__Assignment init = TESSERA__ASSIGNMENT__INIT;
    *a = init;
    a->deployment = "tiny";
    a->epoch = 7;
    a->replica = 0;
    a->stage = 1;
    a->tp_rank = 1;
    a->tp_size = 2;
    a->pp_size = 2;
    a->layer_begin = begin;
    a->layer_end = end;
    a->model_path = model_dir;
    a->max_seq_len = 256;
    a->max_batch = 32;        /* the deployment's keys, as a worker echoes them */
    a->prefill_chunk = 128;
    a->max_queue = 256;
    a->collective_timeout_ms = 30000;
}

static void test_fresh_coordinator_adopts_a_piece_matching_the_layout(void **state)
{
    fx_t *fx = *state;
    Tessera__Assignment a;
    held_piece(&a, 4, 8);
    send_register(fx, 0, "w0", "node0", TSR_PROTOCOL_VERSION, &a,
                  TESSERA__WORKER_STATE__STATE_READY);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_true(env->register_reply->accepted);
    assert_true(env->register_reply->adopted);
    tsr_env_free(&env);

    tsr_worker_t *w = tsr_registry_find(fx->c->reg, "w0");
    assert_true(w->has_piece);
    assert_int_equal(w->state, TSR_W_READY);
    assert_string_equal(w->piece.key.deployment, "tiny");
    assert_int_equal(w->piece.key.stage, 1);
    assert_int_equal(w->piece.key.tp, 1);
    assert_int_equal(w->piece.epoch, 7);
    assert_true(fx->c->epoch >= 7);  /* epochs only grow across a restart */

    /* The next plan keeps it where it is: no Assign or Unassign for it. */
    tsr_coord_tick(fx->c, tsr_now_ms());
    expect_nothing(fx->dealer[0], 30);
    assert_true(w->has_piece);
    assert_int_equal(w->piece.epoch, 7);
}

/* Runs fn(fx) with the log at INFO into a file; returns how many lines hold
 * needle. */
static int log_lines_with(fx_t *fx, void (*fn)(fx_t *), const char *needle)
{
    char path[] = "/tmp/tsr-test-log.XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    tsr_log_init("test", TSR_LOG_INFO);
    fn(fx);
    fflush(stderr);
    tsr_log_init("test", TSR_LOG_ERROR + 1);
    dup2(saved, 2);
    close(saved);
    close(fd);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[2048];
    int n = 0;
    while (fgets(line, sizeof line, f)) n += strstr(line, needle) != NULL;
    fclose(f);
    unlink(path);
    return n;
}

/* The registrations a worker queued while its link was down, delivered at
 * once when it comes back. */
static void register_three_times(fx_t *fx)
{
    Tessera__Assignment a;
    held_piece(&a, 4, 8);
    for (int i = 0; i < 3; i++)
        send_register(fx, 0, "w0", "node0", TSR_PROTOCOL_VERSION, &a,
                      TESSERA__WORKER_STATE__STATE_READY);
    for (int got = 0; got < 3; got++) {
        pump(fx);
        tsr_env_t *env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        assert_true(env->register_reply->adopted);
        tsr_env_free(&env);
    }
}

static void test_a_burst_of_the_same_registration_is_logged_once(void **state)
{
    fx_t *fx = *state;
    assert_int_equal(log_lines_with(fx, register_three_times, "adopted worker w0"), 1);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, "w0");
    assert_true(w->has_piece);
    assert_int_equal(w->state, TSR_W_READY);
}

/* A coordinator that restarts between a piece's failure report and the
 * rewiring it would have done: the worker registers holding the failed
 * piece, with its reason and whether rewiring may mend it.  A data-plane
 * failure is adopted failed and its replica rewired after the backoff; a
 * load error (not retryable) is left to the operator. */
static void test_a_fresh_coordinator_rewires_an_adopted_failed_piece(void **state)
{
    fx_t *fx = *state;
    tsr_dep_state_t *ds = &fx->c->deps[0];
    Tessera__Assignment a, b;
    held_piece(&a, 4, 8);
    held_piece(&b, 4, 8);
    b.tp_rank = 0;
    reg_reason = "tiny.safetensors: truncated";
    reg_retryable = false;
    send_register(fx, 1, "w1", "node1", TSR_PROTOCOL_VERSION, &b,
                  TESSERA__WORKER_STATE__STATE_FAILED);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[1], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_true(env->register_reply->adopted);
    tsr_env_free(&env);
    tsr_worker_t *w1 = tsr_registry_find(fx->c->reg, "w1");
    assert_int_equal(w1->state, TSR_W_FAILED);
    assert_string_equal(w1->reason, "tiny.safetensors: truncated");
    assert_int_equal(ds->retry_at_ms, 0);

    reg_reason = "data plane: NCCL all-reduce (rank 0 of 2, epoch 7) did not complete within "
                 "1000 ms: rank 1 is dead or stalled";
    reg_retryable = true;
    int64_t t0 = tsr_now_ms();
    send_register(fx, 0, "w0", "node0", TSR_PROTOCOL_VERSION, &a,
                  TESSERA__WORKER_STATE__STATE_FAILED);
    pump(fx);
    reg_reason = NULL;
    reg_retryable = false;
    env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_true(env->register_reply->adopted);
    tsr_env_free(&env);
    tsr_worker_t *w0 = tsr_registry_find(fx->c->reg, "w0");
    assert_int_equal(w0->state, TSR_W_FAILED);
    assert_non_null(strstr(w0->reason, "rank 1 is dead or stalled"));
    assert_true(ds->retry_at_ms >= t0 + 2000 && ds->retry_at_ms <= tsr_now_ms() + 2000);
}

static void test_fresh_coordinator_does_not_adopt_a_wrong_layer_range(void **state)
{
    fx_t *fx = *state;
    Tessera__Assignment a;
    held_piece(&a, 4, 7);
    send_register(fx, 0, "w0", "node0", TSR_PROTOCOL_VERSION, &a,
                  TESSERA__WORKER_STATE__STATE_READY);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_true(env->register_reply->accepted);
    assert_false(env->register_reply->adopted);
    assert_non_null(strstr(env->register_reply->reason, "layer split"));
    tsr_env_free(&env);

    tsr_worker_t *w = tsr_registry_find(fx->c->reg, "w0");
    assert_false(w->has_piece);
    assert_int_equal(w->state, TSR_W_IDLE);
    /* its epoch still raises the coordinator's: epochs only grow across restarts */
    assert_true(fx->c->epoch >= 7);
}

/* A piece given keys the file no longer has (edited while the coordinator
 * was down) is not adopted, naming the key: it is assigned again with the
 * configuration's, instead of serving with the old ones. */
static void test_fresh_coordinator_does_not_adopt_a_piece_with_other_keys(void **state)
{
    fx_t *fx = *state;
    static const char *const keys[] = {"kv_dtype bf16; the configuration now has f32", "max_batch 64",
                                       "model /elsewhere",
                                       "matmul_dtype bf16; the configuration now has f32",
                                       "weights_dtype int8; the configuration now has auto"};
    for (int k = 0; k < 5; k++) {
        Tessera__Assignment a;
        held_piece(&a, 4, 8);
        if (k == 0) a.kv_dtype = TSR_KV_BF16;
        if (k == 3) a.matmul_dtype = TSR_KV_BF16;
        if (k == 4) a.weights_dtype = TSR_KV_INT8;
        if (k == 1) a.max_batch = 64;
        if (k == 2) a.model_path = "/elsewhere";
        char name[8];
        snprintf(name, sizeof name, "w%d", k);
        send_register(fx, k, name, "node0", TSR_PROTOCOL_VERSION, &a,
                      TESSERA__WORKER_STATE__STATE_READY);
        pump(fx);
        tsr_env_t *env = expect_kind(fx->dealer[k], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        assert_true(env->register_reply->accepted);
        assert_false(env->register_reply->adopted);
        if (!strstr(env->register_reply->reason, keys[k]))
            fail_msg("reason: %s", env->register_reply->reason);
        tsr_env_free(&env);
        assert_false(tsr_registry_find(fx->c->reg, name)->has_piece);
    }
}

/* The piece of stage s, tp rank t in the default tp=2 pp=2 layout, as a
 * worker holding it since epoch 7 reports it. */
static void held_piece_at(Tessera__Assignment *a, int s, int t)
{
    held_piece(a, s ? 4 : 0, s ? 8 : 4);
    a->stage = (uint32_t)s;
    a->tp_rank = (uint32_t)t;
}

/* Fake worker i registers holding a in state st; its piece must be adopted. */
static void register_adopted(fx_t *fx, int i, Tessera__Assignment *a, Tessera__WorkerState st)
{
    send_register(fx, i, fx->name[i], "node0", TSR_PROTOCOL_VERSION, a, st);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_true(env->register_reply->adopted);
    tsr_env_free(&env);
}

/* A piece given another collective_timeout_ms or max_queue (a coordinator
 * whose default changed, a file edited while it was down) is adopted, not
 * reloaded: the weights do not depend on them.  Once every member of its
 * replica is back and ready, the replica is sent the file's values in a new
 * epoch; while one is missing it is left serving. */
static void test_a_piece_with_another_timeout_or_queue_is_adopted_and_sent_the_files(void **state)
{
    fx_t *fx = *state;
    for (int k = 0; k < 4; k++) {
        Tessera__Assignment a;
        held_piece_at(&a, k / 2, k % 2);
        a.collective_timeout_ms = 10000;
        a.max_queue = 100;
        register_adopted(fx, k, &a, TESSERA__WORKER_STATE__STATE_READY);
        assert_int_equal(tsr_registry_find(fx->c->reg, fx->name[k])->piece.epoch, 7);
        if (k == 2) {   /* one member still missing: nothing is sent yet */
            tsr_coord_tick(fx->c, tsr_now_ms());
            for (int i = 0; i <= k; i++) expect_nothing(fx->dealer[i], 30);
        }
    }
    tsr_coord_tick(fx->c, tsr_now_ms());
    for (int k = 0; k < 4; k++) {
        tsr_env_t *env = expect_kind(fx->dealer[k], TESSERA__ENVELOPE__BODY_ASSIGN);
        Tessera__Assignment *got = env->assign->assignment;
        assert_true(got->epoch > 7);
        assert_int_equal(got->stage, (uint32_t)(k / 2));
        assert_int_equal(got->tp_rank, (uint32_t)(k % 2));
        assert_int_equal(got->collective_timeout_ms, 30000);
        assert_int_equal(got->max_queue, 256);
        tsr_env_free(&env);
    }
}

/* ---- status document ------------------------------------------------------------------ */

static void test_status_json_has_the_documented_fields(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    send_ready(fx, h, fx->piece[h].epoch);
    pump(fx);

    json_t *root = status(fx);
    json_t *d = json_array_get(json_object_get(root, "deployments"), 0);
    assert_non_null(d);
    assert_string_equal(json_string_value(json_object_get(d, "name")), "tiny");
    assert_int_equal(json_integer_value(json_object_get(d, "pieces")), 4);
    assert_int_equal(json_integer_value(json_object_get(d, "placed")), 4);
    assert_int_equal(json_integer_value(json_object_get(d, "ready")), 1);
    assert_string_equal(json_string_value(json_object_get(d, "state")), "loading");

    json_t *reps = json_object_get(d, "replica_list");
    assert_int_equal(json_array_size(reps), 1);
    json_t *stages = json_object_get(json_array_get(reps, 0), "stages");
    assert_int_equal(json_array_size(stages), 2);
    int ranks_seen = 0;
    for (size_t s = 0; s < 2; s++) {
        json_t *st = json_array_get(stages, s);
        json_t *layers = json_object_get(st, "layers");
        assert_int_equal(json_integer_value(json_array_get(layers, 0)), s == 0 ? 0 : 4);
        assert_int_equal(json_integer_value(json_array_get(layers, 1)), s == 0 ? 4 : 8);
        json_t *ranks = json_object_get(st, "ranks");
        assert_int_equal(json_array_size(ranks), 2);
        for (size_t t = 0; t < 2; t++) {
            json_t *rk = json_array_get(ranks, t);
            const char *wn = json_string_value(json_object_get(rk, "worker"));
            assert_non_null(wn);
            tsr_worker_t *w = tsr_registry_find(fx->c->reg, wn);
            assert_non_null(w);
            assert_int_equal(w->piece.key.stage, (int)s);
            assert_int_equal(w->piece.key.tp, (int)t);
            assert_string_equal(json_string_value(json_object_get(rk, "node")), w->node);
            assert_int_equal(json_integer_value(json_object_get(rk, "pid")), w->pid);
            assert_string_equal(json_string_value(json_object_get(rk, "state")),
                                tsr_wstate_name(w->state));
            assert_true(json_is_integer(json_object_get(rk, "heartbeat_age_ms")));
            assert_true(json_integer_value(json_object_get(rk, "heartbeat_age_ms")) >= 0);
            ranks_seen++;
        }
    }
    assert_int_equal(ranks_seen, 4);

    json_t *workers = json_object_get(root, "workers");
    assert_int_equal(json_array_size(workers), NW);
    for (size_t i = 0; i < NW; i++) {
        json_t *o = json_array_get(workers, i);
        assert_string_equal(json_string_value(json_object_get(o, "name")), fx->name[i]);
        char node[16];
        snprintf(node, sizeof node, "node%zu", i);
        assert_string_equal(json_string_value(json_object_get(o, "node")), node);
        assert_int_equal(json_integer_value(json_object_get(o, "pid")), 1000 + i);
        assert_non_null(json_string_value(json_object_get(o, "state")));
        json_t *as = json_object_get(o, "assignment");
        assert_non_null(as);
        if (fx->holds[i]) {
            assert_true(json_is_object(as));
            assert_string_equal(json_string_value(json_object_get(as, "deployment")), "tiny");
            assert_int_equal(json_integer_value(json_object_get(as, "stage")),
                             fx->piece[i].stage);
        } else {
            assert_true(json_is_null(as));
        }
    }
    assert_string_equal(json_string_value(json_object_get(json_array_get(workers, h), "state")),
                        "ready");

    json_t *idle = json_object_get(root, "idle");
    assert_int_equal(json_array_size(idle), 1);
    assert_string_equal(json_string_value(json_array_get(idle, 0)), fx->name[fx->spare]);
    json_decref(root);
}

/* The rank object of worker i's piece in the status document. */
static json_t *rank_of(json_t *root, const fx_t *fx, int i)
{
    json_t *d = json_array_get(json_object_get(root, "deployments"), 0);
    json_t *r = json_array_get(json_object_get(d, "replica_list"), fx->piece[i].replica);
    json_t *st = json_array_get(json_object_get(r, "stages"), fx->piece[i].stage);
    json_t *rk = json_array_get(json_object_get(st, "ranks"), fx->piece[i].tp_rank);
    assert_non_null(rk);
    assert_string_equal(json_string_value(json_object_get(rk, "worker")), fx->name[i]);
    return rk;
}

static void test_status_shows_each_pieces_kv_pool_and_queue_from_its_heartbeat(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    send_heartbeat_pool(fx, h, 0.5f, 12, 480, 3, 7);
    pump(fx);

    json_t *root = status(fx);
    json_t *w = json_array_get(json_object_get(root, "workers"), h);
    json_t *rk = rank_of(root, fx, h);
    json_t *objs[2] = {w, rk};
    for (int k = 0; k < 2; k++) {
        assert_int_equal(json_integer_value(json_object_get(objs[k], "kv_blocks_used")), 12);
        assert_int_equal(json_integer_value(json_object_get(objs[k], "kv_blocks_total")), 480);
        assert_int_equal(json_integer_value(json_object_get(objs[k], "queued")), 3);
        assert_int_equal(json_integer_value(json_object_get(objs[k], "running")), 7);
    }
    assert_true(json_real_value(json_object_get(w, "load")) == 0.5);
    /* Workers that reported nothing show zeros, not missing fields. */
    json_t *spare = json_array_get(json_object_get(root, "workers"), fx->spare);
    assert_true(json_is_integer(json_object_get(spare, "kv_blocks_total")));
    assert_int_equal(json_integer_value(json_object_get(spare, "kv_blocks_total")), 0);
    /* The deployment shows its batching keys. */
    json_t *d = json_array_get(json_object_get(root, "deployments"), 0);
    assert_int_equal(json_integer_value(json_object_get(d, "max_batch")), 32);
    assert_int_equal(json_integer_value(json_object_get(d, "prefill_chunk")), 128);
    assert_int_equal(json_integer_value(json_object_get(d, "kv_cache_mib")), 0);
    assert_int_equal(json_integer_value(json_object_get(d, "max_queue")), 256);
    assert_int_equal(json_integer_value(json_object_get(d, "collective_timeout_ms")), 30000);
    assert_string_equal(json_string_value(json_object_get(d, "kv_dtype")), "auto");
    assert_string_equal(json_string_value(json_object_get(d, "kv_dtype_used")), "f32");
    assert_string_equal(json_string_value(json_object_get(d, "matmul_dtype")), "auto");
    assert_string_equal(json_string_value(json_object_get(d, "matmul_dtype_used")), "f32");
    assert_string_equal(json_string_value(json_object_get(d, "weights_dtype")), "auto");
    json_decref(root);
}

static void test_a_heartbeat_with_a_nan_or_infinite_load_keeps_the_status_valid_json(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    send_heartbeat_pool(fx, h, 0.25f, 1, 2, 0, 0);
    send_heartbeat_pool(fx, h, NAN, 3, 4, 0, 0);
    send_heartbeat_pool(fx, h, -INFINITY, 3, 4, 0, 0);
    pump(fx);
    json_t *root = status(fx);  /* fails unless the document parses */
    json_t *w = json_array_get(json_object_get(root, "workers"), h);
    assert_true(json_real_value(json_object_get(w, "load")) == 0.25);  /* the last good one */
    assert_int_equal(json_integer_value(json_object_get(w, "kv_blocks_used")), 3);
    json_decref(root);

    send_heartbeat_pool(fx, h, 7.0f, 3, 4, 0, 0);  /* out of 0..1: clamped */
    pump(fx);
    root = status(fx);
    w = json_array_get(json_object_get(root, "workers"), h);
    assert_true(json_real_value(json_object_get(w, "load")) == 1.0);
    json_decref(root);
}

/* ---- reload ------------------------------------------------------------------------------ */

static void test_reload_of_broken_yaml_is_refused_with_position_and_keeps_config(void **state)
{
    fx_t *fx = *state;
    tsr_config_t *before = fx->c->cfg;
    tsr_dep_state_t *deps_before = fx->c->deps;
    write_yaml(fx->path, fx->wep, fx->cep, "  heartbeat_intervall_ms: 50\n");
    /* The extra line lands inside the coordinator mapping: an unknown key. */
    char err[1024] = "";
    assert_int_equal(tsr_coord_reload(fx->c, err, sizeof err), -1);

    regex_t re;
    assert_int_equal(regcomp(&re, ":[0-9]+:[0-9]+: ", REG_EXTENDED), 0);
    int m = regexec(&re, err, 0, NULL, 0);
    regfree(&re);
    if (m != 0) fail_msg("no line:col in '%s'", err);
    assert_non_null(strstr(err, "heartbeat_intervall_ms"));
    assert_non_null(strstr(err, fx->path));

    assert_ptr_equal(fx->c->cfg, before);
    assert_ptr_equal(fx->c->deps, deps_before);
    assert_int_equal(fx->c->cfg->heartbeat_interval_ms, 100);
    assert_int_equal(fx->c->cfg->worker_timeout_ms, TIMEOUT_MS);
    assert_int_equal(fx->c->cfg->n_deployments, 1);
    assert_string_equal(fx->c->cfg->deployments[0].name, "tiny");
}

static void test_reload_that_changes_an_endpoint_is_refused(void **state)
{
    fx_t *fx = *state;
    tsr_config_t *before = fx->c->cfg;
    char other[96];
    snprintf(other, sizeof other, "%s-moved", fx->wep);
    write_yaml(fx->path, other, fx->cep, NULL);
    char err[1024] = "";
    assert_int_equal(tsr_coord_reload(fx->c, err, sizeof err), -1);
    assert_non_null(strstr(err, "restart"));
    assert_ptr_equal(fx->c->cfg, before);
    assert_string_equal(fx->c->cfg->workers_endpoint, fx->wep);
}

static void test_reload_retries_pieces_that_failed_to_load_with_a_new_epoch(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    send_failed(fx, h, fx->piece[h].epoch, "weights missing", false);
    pump(fx);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[h]);
    assert_int_equal(w->state, TSR_W_FAILED);

    char err[1024] = "";
    if (tsr_coord_reload(fx->c, err, sizeof err) != 0) fail_msg("reload: %s", err);
    tsr_env_t *env = expect_kind(fx->dealer[h], TESSERA__ENVELOPE__BODY_ASSIGN);
    const Tessera__Assignment *a = env->assign->assignment;
    assert_true(a->epoch > fx->piece[h].epoch);
    assert_int_equal(env->epoch, a->epoch);
    assert_int_equal(a->stage, fx->piece[h].stage);
    assert_int_equal(a->tp_rank, fx->piece[h].tp_rank);
    tsr_env_free(&env);
    assert_int_equal(w->state, TSR_W_LOADING);
    assert_string_equal(w->reason, "");
    /* Pieces that did not fail are left alone. */
    for (int i = 0; i < NW; i++)
        if (i != h) expect_nothing(fx->dealer[i], 10);
}

/* Every rank of the replica failed (retryably): the reload retries them all in one
 * new epoch, so they share one data-port secret and can form.  (Each once took an
 * epoch of its own, E+1, E+2, ...: nothing formed until the forming deadline.) */
static void test_reload_retries_a_replicas_failed_ranks_in_one_epoch(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    for (int i = 0; i < NW; i++)
        if (fx->holds[i]) send_failed_as(fx, i, fx->piece[i].epoch, "peer closed", false, true);
    pump(fx);
    for (int i = 0; i < NW; i++)
        if (fx->holds[i])
            assert_int_equal(tsr_registry_find(fx->c->reg, fx->name[i])->state, TSR_W_FAILED);

    char err[1024] = "";
    if (tsr_coord_reload(fx->c, err, sizeof err) != 0) fail_msg("reload: %s", err);
    uint64_t epoch = 0;
    int resent = 0;
    for (int i = 0; i < NW; i++) {
        if (!fx->holds[i]) continue;
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_ASSIGN);
        uint64_t e = env->assign->assignment->epoch;
        tsr_env_free(&env);
        assert_true(e > fx->piece[i].epoch);
        if (!epoch) epoch = e;
        if (e != epoch) fail_msg("rank %d was retried in epoch %llu, another in %llu", i,
                                 (unsigned long long)e, (unsigned long long)epoch);
        resent++;
    }
    assert_int_equal(resent, 4);
}

/* The next tick that may plan: the last plan was at most a moment ago. */
static int64_t plan_time(fx_t *fx)
{
    int64_t now = tsr_now_ms();
    return now > fx->c->last_plan_ms + 50 ? now : fx->c->last_plan_ms + 50;
}

static void test_assign_carries_the_batching_keys_from_the_file(void **state)
{
    fx_t *fx = *state;
    write_yaml_dep(fx->path, fx->wep, fx->cep, NULL,
                   "    max_batch: 8\n    prefill_chunk: 64\n    kv_cache_mib: 48\n"
                   "    max_queue: 0\n    collective_timeout_ms: 2500\n");
    char err[1024] = "";
    if (tsr_coord_reload(fx->c, err, sizeof err) != 0) fail_msg("reload: %s", err);
    cluster_up(fx);
    for (int i = 0; i < NW; i++) {
        if (!fx->holds[i]) continue;
        assert_int_equal(fx->piece[i].max_batch, 8);
        assert_int_equal(fx->piece[i].prefill_chunk, 64);
        assert_int_equal(fx->piece[i].kv_cache_bytes, 48ull << 20);
        assert_int_equal(fx->piece[i].max_queue, 0);
        assert_int_equal(fx->piece[i].collective_timeout_ms, 2500);
    }
}

/* Each of the four keys alone re-sends every piece of the deployment, in a
 * new epoch and with the new value, without moving any piece. */
static void test_reload_that_changes_a_batching_key_resends_every_assignment(void **state)
{
    static const struct {
        const char *yaml;
        size_t field;       /* offset in Tessera__Assignment */
        bool wide;          /* uint64_t field */
        uint64_t want;
    } changes[] = {
        {"    max_batch: 4\n", offsetof(Tessera__Assignment, max_batch), false, 4},
        {"    prefill_chunk: 16\n", offsetof(Tessera__Assignment, prefill_chunk), false, 16},
        {"    kv_cache_mib: 100\n", offsetof(Tessera__Assignment, kv_cache_bytes), true,
         100ull << 20},
        {"    max_queue: 7\n", offsetof(Tessera__Assignment, max_queue), false, 7},
        {"    kv_dtype: bf16\n", offsetof(Tessera__Assignment, kv_dtype), false, TSR_KV_BF16},
        /* int8 weights cannot go with the bf16 products next: the next reload drops it */
        {"    weights_dtype: int8\n", offsetof(Tessera__Assignment, weights_dtype), false, TSR_KV_INT8},
        {"    matmul_dtype: bf16\n", offsetof(Tessera__Assignment, matmul_dtype), false, TSR_KV_BF16},
        {"    collective_timeout_ms: 1000\n", offsetof(Tessera__Assignment, collective_timeout_ms),
         false, 1000},
    };
    fx_t *fx = *state;
    char keys[256] = "";
    cluster_up(fx);
    /* auto to the type it stands for on a cpu deployment (f32) changes
     * nothing the workers hold: nothing is sent. */
    write_yaml_dep(fx->path, fx->wep, fx->cep, NULL, "    kv_dtype: f32\n");
    char err0[1024] = "";
    if (tsr_coord_reload(fx->c, err0, sizeof err0) != 0) fail_msg("reload: %s", err0);
    tsr_coord_tick(fx->c, plan_time(fx));
    for (int i = 0; i < NW; i++) expect_nothing(fx->dealer[i], 10);
    for (size_t k = 0; k < sizeof changes / sizeof changes[0]; k++) {
        /* The keys changed so far stay: each reload changes one key (and
         * undoes weights_dtype once it has been checked). */
        if (k > 0 && changes[k - 1].field == offsetof(Tessera__Assignment, weights_dtype))
            *strstr(keys, changes[k - 1].yaml) = 0;
        strcat(keys, changes[k].yaml);
        write_yaml_dep(fx->path, fx->wep, fx->cep, NULL, keys);
        char err[1024] = "";
        if (tsr_coord_reload(fx->c, err, sizeof err) != 0) fail_msg("reload: %s", err);
        uint64_t before = fx->c->epoch;
        tsr_coord_tick(fx->c, plan_time(fx));
        for (int i = 0; i < NW; i++) {
            if (!fx->holds[i]) continue;
            tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_ASSIGN);
            const Tessera__Assignment *a = env->assign->assignment;
            const char *f = (const char *)a + changes[k].field;
            uint64_t got = changes[k].wide ? *(const uint64_t *)f : *(const uint32_t *)f;
            if (got != changes[k].want)
                fail_msg("after '%s' worker %d got %llu", changes[k].yaml, i,
                         (unsigned long long)got);
            assert_true(a->epoch > before);
            assert_int_equal(a->stage, fx->piece[i].stage);  /* nothing moved */
            assert_int_equal(a->tp_rank, fx->piece[i].tp_rank);
            tsr_env_free(&env);
        }
        expect_nothing(fx->dealer[fx->spare], 10);
    }
    /* The same file again changes nothing and sends nothing. */
    char err[1024] = "";
    if (tsr_coord_reload(fx->c, err, sizeof err) != 0) fail_msg("reload: %s", err);
    tsr_coord_tick(fx->c, plan_time(fx));
    for (int i = 0; i < NW; i++) expect_nothing(fx->dealer[i], 10);
}

/* ---- control API ------------------------------------------------------------------------- */

static void test_control_status_returns_ok_with_the_status_json(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    tsr_env_t *env = control(fx, TESSERA__CONTROL_REQUEST__KIND__STATUS, NULL);
    assert_true(env->control_reply->ok);
    json_error_t je;
    json_t *root = json_loads(env->control_reply->json, 0, &je);
    if (!root) fail_msg("reply is not JSON: %s", je.text);
    assert_int_equal(json_array_size(json_object_get(root, "deployments")), 1);
    assert_int_equal(json_array_size(json_object_get(root, "workers")), NW);
    json_decref(root);
    tsr_env_free(&env);
    assert_int_equal(fx->c->stats.control_requests, 1);
}

static void test_control_drain_of_unknown_worker_fails_with_a_message(void **state)
{
    fx_t *fx = *state;
    tsr_env_t *env = control(fx, TESSERA__CONTROL_REQUEST__KIND__DRAIN, "nobody");
    assert_false(env->control_reply->ok);
    assert_non_null(strstr(env->control_reply->error, "nobody"));
    tsr_env_free(&env);
}

static void test_control_drain_of_a_holder_moves_its_piece_to_the_spare(void **state)
{
    fx_t *fx = *state;
    cluster_up(fx);
    int h = first_holder(fx);
    tsr_env_t *env = control(fx, TESSERA__CONTROL_REQUEST__KIND__DRAIN, fx->name[h]);
    assert_true(env->control_reply->ok);
    json_error_t je;
    json_t *o = json_loads(env->control_reply->json, 0, &je);
    if (!o) fail_msg("reply is not JSON: %s", je.text);
    assert_true(json_is_true(json_object_get(o, "drained")));
    assert_string_equal(json_string_value(json_object_get(o, "moved_to")), fx->name[fx->spare]);
    json_decref(o);
    tsr_env_free(&env);

    tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[h]);
    assert_true(w->drained);
    assert_false(w->has_piece);
    env = expect_kind(fx->dealer[h], TESSERA__ENVELOPE__BODY_UNASSIGN);
    tsr_env_free(&env);
    expect_piece_moved_to_spare(fx, h);
}

static void test_non_control_envelope_on_control_socket_is_refused(void **state)
{
    fx_t *fx = *state;
    Tessera__Heartbeat hb = TESSERA__HEARTBEAT__INIT;
    tsr_env_t out = TESSERA__ENVELOPE__INIT;
    out.worker = "w0";
    out.body_case = TESSERA__ENVELOPE__BODY_HEARTBEAT;
    out.heartbeat = &hb;
    send_env(fx->ctl, &out);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_false(env->control_reply->ok);
    assert_non_null(strstr(env->control_reply->error, "control request"));
    tsr_env_free(&env);
    assert_int_equal(fx->c->stats.heartbeats, 0);
}

/* ---- generation: deadlines, cancellation, limits -------------------------------------- */

/* Brings the cluster up with every piece ready; returns the replica's leader
 * (stage 0, tp rank 0). */
/* Every holder reports ready; returns the leader. */
static int pieces_ready(fx_t *fx)
{
    int leader = -1;
    for (int i = 0; i < NW; i++) {
        if (!fx->holds[i]) continue;
        send_ready(fx, i, fx->piece[i].epoch);
        if (fx->piece[i].stage == 0 && fx->piece[i].tp_rank == 0) leader = i;
    }
    pump(fx);
    assert_int_not_equal(leader, -1);
    return leader;
}

/* A holder other than the leader. */
static int a_member(const fx_t *fx, int leader)
{
    for (int i = 0; i < NW; i++)
        if (fx->holds[i] && i != leader) return i;
    fail_msg("no member");
    return -1;
}

static int cluster_ready(fx_t *fx)
{
    cluster_up(fx);
    int leader = pieces_ready(fx);
    for (int i = 0; i < NW; i++)
        if (fx->holds[i])
            assert_int_equal(tsr_registry_find(fx->c->reg, fx->name[i])->state, TSR_W_READY);
    return leader;
}

/* The worker that samples: last stage, tp rank 0. */
static int sampler(const fx_t *fx)
{
    for (int i = 0; i < NW; i++)
        if (fx->holds[i] && fx->piece[i].stage == fx->piece[i].pp_size - 1 &&
            fx->piece[i].tp_rank == 0)
            return i;
    fail_msg("no last stage");
    return -1;
}

/* Sends a generate of prompt[0..n) to gen_deployment from client. */
static void send_generate_ids(fx_t *fx, void *client, const int32_t *prompt, int n,
                              uint32_t max_tokens, uint32_t timeout_ms)
{
    Tessera__ControlRequest q = TESSERA__CONTROL_REQUEST__INIT;
    q.kind = TESSERA__CONTROL_REQUEST__KIND__GENERATE;
    q.deployment = (char *)gen_deployment;
    q.worker = "";
    q.n_prompt = (size_t)n;
    q.prompt = (int32_t *)prompt;
    q.max_tokens = max_tokens;
    q.top_p = 1.0f;
    q.timeout_ms = timeout_ms;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = "";
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REQUEST;
    env.control_request = &q;
    send_env(client, &env);
    pump(fx);
}

static void send_generate(fx_t *fx, void *client, uint32_t max_tokens, uint32_t timeout_ms)
{
    static const int32_t prompt[3] = {1, 2, 3};
    send_generate_ids(fx, client, prompt, 3, max_tokens, timeout_ms);
}

/* Sends a generate request from client and checks that it is accepted and
 * reaches the leader; returns the id the workers know it by (the client's
 * is in fx->last_id: each attempt has its own at the workers). */
static uint64_t start_request(fx_t *fx, void *client, int leader, uint32_t timeout_ms)
{
    send_generate(fx, client, 16, timeout_ms);
    tsr_env_t *env = expect_kind(client, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    if (!env->control_reply->ok) fail_msg("refused: %s", env->control_reply->error);
    json_t *ack = json_loads(env->control_reply->json, 0, NULL);
    assert_non_null(ack);
    assert_true(json_is_true(json_object_get(ack, "accepted")));
    uint64_t id = (uint64_t)json_integer_value(json_object_get(ack, "request_id"));
    json_decref(ack);
    tsr_env_free(&env);
    env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_GENERATE);
    uint64_t wid = env->generate->request_id;
    assert_true(wid != id && wid != 0);
    assert_int_equal(env->generate->timeout_ms, timeout_ms);  /* forwarded to the leader */
    assert_int_equal(env->epoch, fx->piece[leader].epoch);
    tsr_env_free(&env);
    fx->last_id = id;
    return wid;
}

/* retryable: the replica's failure, not the request's (it is resumed). */
static void send_token_error_as(fx_t *fx, int from, uint64_t id, const char *error,
                                bool retryable)
{
    Tessera__TokenEvent t = TESSERA__TOKEN_EVENT__INIT;
    t.request_id = id;
    t.done = true;
    t.error = (char *)error;
    t.retryable = retryable;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = fx->name[from];
    env.epoch = fx->piece[from].epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_TOKEN_EVENT;
    env.token_event = &t;
    send_env(fx->dealer[from], &env);
}

static void send_token_error(fx_t *fx, int from, uint64_t id, const char *error)
{
    send_token_error_as(fx, from, id, error, false);
}

static void send_token(fx_t *fx, int from, uint64_t id, uint32_t index, bool done)
{
    Tessera__TokenEvent t = TESSERA__TOKEN_EVENT__INIT;
    t.request_id = id;
    t.token = 40 + (int32_t)index;
    t.index = index;
    t.done = done;
    t.finish_reason = done ? "max_tokens" : "";
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = fx->name[from];
    env.epoch = fx->piece[from].epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_TOKEN_EVENT;
    env.token_event = &t;
    send_env(fx->dealer[from], &env);
}

static void test_a_request_past_its_deadline_fails_and_is_cancelled_at_the_leader(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    uint64_t id = start_request(fx, fx->ctl, leader, 500);
    assert_int_equal(tsr_requests_count(fx->c), 1);
    int64_t deadline = tsr_requests_at(fx->c, 0)->deadline_ms;
    assert_int_equal(deadline, tsr_requests_at(fx->c, 0)->started_ms + 500);
    for (uint32_t k = 0; k < 2; k++) send_token(fx, sampler(fx), id, k, false);
    pump(fx);
    for (int k = 0; k < 2; k++) {
        tsr_env_t *env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
        assert_true(env->control_reply->ok);
        tsr_env_free(&env);
    }

    /* Before the deadline nothing happens, and the tick asks to be woken
     * no later than the deadline. */
    int wait = tsr_coord_tick(fx->c, deadline - 100);
    assert_true(wait <= 100);
    assert_int_equal(tsr_requests_count(fx->c), 1);
    expect_nothing(fx->ctl, 10);
    expect_nothing(fx->dealer[leader], 10);

    tsr_coord_tick(fx->c, deadline);
    tsr_env_t *env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_false(env->control_reply->ok);
    char want[128];
    snprintf(want, sizeof want, "request %llu passed its deadline of 500 ms after 2 token(s)",
             (unsigned long long)fx->last_id);
    if (!strstr(env->control_reply->error, want))
        fail_msg("'%s' lacks '%s'", env->control_reply->error, want);
    tsr_env_free(&env);

    env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_CANCEL);
    assert_int_equal(env->cancel->request_id, id);
    assert_non_null(strstr(env->cancel->reason, "deadline"));
    assert_int_equal(env->epoch, fx->piece[leader].epoch);
    assert_string_equal(env->worker, fx->name[leader]);
    tsr_env_free(&env);
    assert_int_equal(tsr_requests_count(fx->c), 0);
    /* A request the service ended is a failure, not a cancellation, in status and in
     * /metrics (it was once counted both, and /metrics showed a timeout as cancelled). */
    assert_int_equal(fx->c->stats.requests_failed, 1);
    assert_int_equal(fx->c->stats.requests_cancelled, 0);
    tsr_dep_metrics_t *mt = tsr_metrics_of(&fx->c->metrics, fx->c->cfg->deployments[0].name);
    assert_non_null(mt);
    assert_int_equal(mt->outcome[TSR_OUTCOME_FAILED], 1);
    assert_int_equal(mt->outcome[TSR_OUTCOME_CANCELLED], 0);
    char *text = tsr_coord_metrics_text(fx->c, tsr_now_ms());
    assert_non_null(text);
    assert_non_null(strstr(text, "outcome=\"failed\"} 1\n"));
    assert_null(strstr(text, "outcome=\"cancelled\"} 1\n"));
    free(text);

    /* A token that was already on its way is dropped, not forwarded. */
    send_token(fx, sampler(fx), id, 2, false);
    pump(fx);
    expect_nothing(fx->ctl, 10);
}

static void test_a_request_without_a_deadline_never_expires(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    start_request(fx, fx->ctl, leader, 0);
    assert_int_equal(tsr_requests_at(fx->c, 0)->deadline_ms, 0);
    assert_int_equal(tsr_requests_expire(fx->c, tsr_now_ms() + 86400000), 0);
    assert_int_equal(tsr_requests_count(fx->c), 1);
    expect_nothing(fx->dealer[leader], 10);
}

static void test_a_client_that_goes_away_mid_stream_gets_its_request_cancelled(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    char err[256] = "";
    void *client = tsr_sock_dealer(fx->cep, 0, err, sizeof err);
    assert_non_null(client);
    uint64_t id = start_request(fx, client, leader, 0);
    send_token(fx, sampler(fx), id, 0, false);
    pump(fx);
    tsr_env_t *env = expect_kind(client, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    tsr_env_free(&env);
    tsr_sock_close(&client);

    /* The router learns of the disconnect asynchronously: the next tokens
     * find the client gone. */
    tsr_env_t *cancel = NULL;
    for (uint32_t k = 1; k < 200 && !cancel; k++) {
        send_token(fx, sampler(fx), id, k, false);
        pump(fx);
        cancel = recv_env(fx->dealer[leader], TSR_WIRE_MAX_WORKER, 10);
    }
    if (!cancel) fail_msg("no Cancel reached the leader");
    assert_int_equal(cancel->body_case, TESSERA__ENVELOPE__BODY_CANCEL);
    assert_int_equal(cancel->cancel->request_id, id);
    assert_non_null(strstr(cancel->cancel->reason, "client"));
    tsr_env_free(&cancel);
    assert_int_equal(tsr_requests_count(fx->c), 0);
    assert_int_equal(fx->c->stats.requests_cancelled, 1);
    assert_int_equal(fx->c->stats.requests_failed, 0);
}

static void test_a_slow_client_is_not_taken_for_a_gone_one(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    /* A client that reads nothing: once the router's queue to it is at its
     * high-water mark, replies fail with EAGAIN, not EHOSTUNREACH. */
    int hwm = 1, linger = 0;
    void *client = zmq_socket(tsr_zmq_ctx(), ZMQ_DEALER);
    assert_non_null(client);
    assert_int_equal(zmq_setsockopt(client, ZMQ_RCVHWM, &hwm, sizeof hwm), 0);
    assert_int_equal(zmq_setsockopt(client, ZMQ_LINGER, &linger, sizeof linger), 0);
    assert_int_equal(zmq_connect(client, fx->cep), 0);
    send_generate(fx, client, 16, 0);
    tsr_env_t *env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_GENERATE);
    uint64_t id = env->generate->request_id;
    tsr_env_free(&env);
    assert_int_equal(tsr_requests_count(fx->c), 1);
    const tsr_request_rec_t *q = tsr_requests_at(fx->c, 0);
    int rc = TSR_REPLY_SENT;
    for (int k = 0; k < 400000 && rc == TSR_REPLY_SENT; k++)
        rc = tsr_control_reply(fx->c, q->rid, q->rid_len, true, NULL, "{}");
    assert_int_equal(rc, TSR_REPLY_DROPPED);

    send_token(fx, sampler(fx), id, 0, false);
    pump(fx);
    assert_int_equal(fx->c->stats.replies_dropped, 1);
    assert_int_equal(tsr_requests_count(fx->c), 1);  /* still running */
    assert_int_equal(tsr_requests_at(fx->c, 0)->n_tokens, 1);
    assert_int_equal(fx->c->stats.requests_cancelled, 0);
    expect_nothing(fx->dealer[leader], 20);
    zmq_close(client);
}

static void test_a_reply_to_an_unknown_client_is_reported_gone(void **state)
{
    fx_t *fx = *state;
    const uint8_t rid[5] = {0, 1, 2, 3, 4};
    assert_int_equal(tsr_control_reply(fx->c, rid, sizeof rid, true, NULL, "{}"), TSR_REPLY_GONE);
}

/* The reply to a generate request that must be refused before it reaches a
 * replica. */
static void expect_generate_refused(fx_t *fx, int leader, uint32_t max_tokens,
                                    uint32_t timeout_ms, const char *detail)
{
    send_generate(fx, fx->ctl, max_tokens, timeout_ms);
    tsr_env_t *env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_false(env->control_reply->ok);
    if (!strstr(env->control_reply->error, detail))
        fail_msg("'%s' lacks '%s'", env->control_reply->error, detail);
    tsr_env_free(&env);
    expect_nothing(fx->dealer[leader], 10);
    assert_int_equal(tsr_requests_count(fx->c), 0);
}

static void test_max_tokens_and_timeout_out_of_range_are_refused(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    expect_generate_refused(fx, leader, 0, 0, "max_tokens must be 1 to 1000000, got 0");
    expect_generate_refused(fx, leader, 1000001, 0, "max_tokens must be 1 to 1000000, got 1000001");
    expect_generate_refused(fx, leader, 2147483648u, 0, "got 2147483648");
    expect_generate_refused(fx, leader, UINT32_MAX, 0, "got 4294967295");
    expect_generate_refused(fx, leader, 16, 86400001, "timeout_ms must be 0 (no deadline) to 86400000");
    assert_int_equal(fx->c->stats.requests, 0);
    /* Both ends of the ranges are accepted. */
    start_request(fx, fx->ctl, leader, 86400000);
    send_generate(fx, fx->ctl, 1000000, 0);
    tsr_env_t *env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_true(env->control_reply->ok);
    tsr_env_free(&env);
}

/* Attack 2: any registered worker could send tokens for any request. */
static void test_tokens_only_from_the_last_stage_errors_only_from_the_replica(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    uint64_t id = start_request(fx, fx->ctl, leader, 0);
    send_token(fx, leader, id, 0, true);        /* stage 0 does not sample */
    send_token(fx, fx->spare, id, 0, true);     /* not in the replica */
    send_token_error(fx, fx->spare, id, "forged failure");
    pump(fx);
    expect_nothing(fx->ctl, 20);
    assert_int_equal(fx->c->stats.identity_dropped, 3);
    assert_int_equal(tsr_requests_count(fx->c), 1);
    /* The last stage's token reaches the client. */
    send_token(fx, sampler(fx), id, 0, false);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_true(env->control_reply->ok);
    assert_non_null(strstr(env->control_reply->json, "\"token\":40"));
    tsr_env_free(&env);
    /* The leader's refusals (a full queue) still end the request. */
    send_token_error(fx, leader, id, "the replica's queue is full");
    pump(fx);
    env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_false(env->control_reply->ok);
    assert_non_null(strstr(env->control_reply->error, "queue is full"));
    tsr_env_free(&env);
    assert_int_equal(tsr_requests_count(fx->c), 0);
}

static void test_request_ids_are_random_not_sequential(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    uint64_t wa = start_request(fx, fx->ctl, leader, 0), a = fx->last_id;
    uint64_t wb = start_request(fx, fx->ctl, leader, 0), b = fx->last_id;
    /* The clients' ids and the workers' alike. */
    uint64_t ids[2][2] = {{a, b}, {wa, wb}};
    for (int k = 0; k < 2; k++) {
        a = ids[k][0];
        b = ids[k][1];
        assert_true(a != b);
        assert_true(b != a + 1);
        assert_true(a > (1ull << 24) || b > (1ull << 24));  /* 2^-39 chance of a false alarm */
        assert_true(a < (1ull << 63) && b < (1ull << 63));  /* positive in JSON */
    }
}

/* "degraded" is a fact about events: a deployment that was ready and lost a
 * worker before anyone asked for status is degraded, not waiting. */
static void test_a_deployment_that_was_ready_is_degraded_even_if_nobody_looked(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);  /* no status request on the way */
    send_failed(fx, leader, fx->piece[leader].epoch, "device lost", true);
    pump(fx);
    tsr_coord_tick(fx->c, tsr_now_ms());
    json_t *root = status(fx);
    json_t *dep = json_array_get(json_object_get(root, "deployments"), 0);
    const char *st = json_string_value(json_object_get(dep, "state"));
    /* Without a spare left placed it is degraded; with one it may be
     * loading again, but never "waiting" or "loading" as if new. */
    if (strcmp(st, "degraded")) fail_msg("state %s, expected degraded", st);
    json_decref(root);
}

/* Rewrites the file with extra coordinator lines (and the current layout)
 * and reloads it, before the workers register. */
static void reconfigure(fx_t *fx, const char *extra)
{
    char err[512];
    write_yaml(fx->path, fx->wep, fx->cep, extra);
    if (tsr_coord_reload(fx->c, err, sizeof err) < 0) fail_msg("%s", err);
}

/* The same with extra lines for the deployment (dep_extra) instead. */
/* reconfigure_dep with the deployment's model at dir (NULL: the fixture's; its own
 * again after). */
static void reconfigure_model(fx_t *fx, const char *dir, const char *dep_extra)
{
    char saved[PATH_MAX], err[1024] = "";
    memcpy(saved, model_dir, sizeof saved);
    if (dir) snprintf(model_dir, sizeof model_dir, "%s", dir);
    write_yaml_dep(fx->path, fx->wep, fx->cep, NULL, dep_extra);
    memcpy(model_dir, saved, sizeof saved);
    if (tsr_coord_reload(fx->c, err, sizeof err) != 0) fail_msg("reload: %s", err);
}

static void reconfigure_dep(fx_t *fx, const char *dep_extra)
{
    reconfigure_model(fx, NULL, dep_extra);
}

/* Reads the client's next reply: a token document, checked for its index
 * and token, or (want_ok false) a failure containing want. */
static void expect_client_token(fx_t *fx, int index, int token)
{
    tsr_env_t *env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    if (!env->control_reply->ok) fail_msg("failed: %s", env->control_reply->error);
    json_t *doc = json_loads(env->control_reply->json, 0, NULL);
    assert_non_null(doc);
    assert_int_equal(json_integer_value(json_object_get(doc, "request_id")), fx->last_id);
    assert_int_equal(json_integer_value(json_object_get(doc, "index")), index);
    assert_int_equal(json_integer_value(json_object_get(doc, "token")), token);
    json_decref(doc);
    tsr_env_free(&env);
}

/* A cuda deployment without kv_cache_mib: every rank gets the KV budget of
 * the replica's tightest (stage, GPU) pair, priced as the worker prices it;
 * when that member dies and a roomier spare replaces it, the budget the
 * members hold is kept (a new one would reload their weights). */
static void test_cuda_kv_budget_is_the_replicas_tightest_and_is_kept(void **state)
{
    fx_t *fx = *state;
    dep_device = "cuda";
    reg_cuda = true;
    reconfigure(fx, NULL);
    tsr_model_info_t m;
    char err[512];
    assert_int_equal(tsr_model_info_load(model_dir, &m, err, sizeof err), 0);
    const tsr_deployment_t *d = &fx->c->cfg->deployments[0];
    uint64_t need = tsr_piece_need(&m, d, 0) > tsr_piece_need(&m, d, 1) ? tsr_piece_need(&m, d, 0)
                                                                         : tsr_piece_need(&m, d, 1);
    for (int i = 0; i < NW; i++) reg_memory[i] = need + (uint64_t)(i + 1) * (4u << 20);
    cluster_up(fx);
    assert_int_equal(fx->spare, NW - 1);   /* one worker a node: the last node is left over */
    int blocks = -1, tight = -1;
    for (int i = 0; i < NW; i++) {
        if (!fx->holds[i]) continue;
        int b = tsr_cuda_kv_blocks(&m, d, (int)fx->piece[i].stage, reg_memory[i]);
        if (blocks < 0 || b < blocks) blocks = b, tight = i;
    }
    assert_true(blocks >= 1 && blocks < tsr_cuda_kv_blocks(&m, d, 0, 0));   /* memory binds */
    int b0, e0;
    tsr_layer_split(m.num_hidden_layers, 2, 0, &b0, &e0);
    uint64_t want = (uint64_t)blocks * tsr_kv_block_bytes(&m, 2, e0 - b0, 16, tsr_kv_row_bytes(TSR_KV_BF16, m.head_dim));
    for (int i = 0; i < NW; i++)
        if (fx->holds[i]) assert_int_equal(fx->piece[i].kv_cache_bytes, want);
    /* the tightest member dies; the roomiest spare takes its piece */
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[tight]);
    int64_t now = scan_time(fx);
    w->last_seen_ms = now - TIMEOUT_MS - 1;
    tsr_coord_tick(fx->c, now);
    for (int i = 0; i < NW; i++) {
        if (i == tight || (!fx->holds[i] && i != fx->spare)) continue;
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_ASSIGN);
        assert_int_equal(env->assign->assignment->kv_cache_bytes, want);
        tsr_env_free(&env);
    }
}

/* A replica that breaks mid-request (a member reports a data-plane failure)
 * does not fail the request: once a replica is ready again, the request
 * goes on from the prompt plus the tokens delivered, under a new id at the
 * workers, and the client's stream continues at the next index. */
static void test_a_request_whose_replica_breaks_is_resumed_from_its_delivered_tokens(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    uint64_t wid1 = start_request(fx, fx->ctl, leader, 0);
    for (uint32_t k = 0; k < 2; k++) send_token(fx, sampler(fx), wid1, k, false);
    pump(fx);
    expect_client_token(fx, 0, 40);
    expect_client_token(fx, 1, 41);

    int member = a_member(fx, leader);
    send_failed_as(fx, member, fx->piece[member].epoch, "data plane: peer gone", false, true);
    pump(fx);
    tsr_coord_tick(fx->c, tsr_now_ms());
    /* Not failed: waiting for a replica, the old attempt cancelled. */
    expect_nothing(fx->ctl, 10);
    assert_int_equal(tsr_requests_count(fx->c), 1);
    assert_int_equal(tsr_requests_at(fx->c, 0)->replica, -1);
    assert_int_equal(fx->c->stats.requests_replayed, 1);
    tsr_env_t *env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_CANCEL);
    assert_int_equal(env->cancel->request_id, wid1);
    tsr_env_free(&env);
    /* A late token of the broken attempt is dropped, and its leader is
     * told (again) that nobody waits for that sequence. */
    send_token(fx, sampler(fx), wid1, 2, false);
    pump(fx);
    expect_nothing(fx->ctl, 10);
    env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_CANCEL);
    assert_int_equal(env->cancel->request_id, wid1);
    tsr_env_free(&env);
    assert_int_equal(fx->c->stats.orphans_cancelled, 1);

    /* The replica is ready again: the request resumes there. */
    send_ready(fx, member, fx->piece[member].epoch);
    pump(fx);
    tsr_coord_tick(fx->c, tsr_now_ms());
    env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_true(env->control_reply->ok);
    assert_non_null(strstr(env->control_reply->json, "\"resumed\":true"));
    assert_non_null(strstr(env->control_reply->json, "\"from_index\":2"));
    tsr_env_free(&env);
    env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_GENERATE);
    uint64_t wid2 = env->generate->request_id;
    assert_true(wid2 != wid1 && wid2 != fx->last_id);
    int32_t want[5] = {1, 2, 3, 40, 41};
    assert_int_equal(env->generate->n_prompt, 5);
    assert_memory_equal(env->generate->prompt, want, sizeof want);
    assert_int_equal(env->generate->max_tokens, 14);
    tsr_env_free(&env);
    /* Its index 0 is the client's index 2; the end removes the request. */
    send_token(fx, sampler(fx), wid2, 0, false);
    send_token(fx, sampler(fx), wid2, 0, false);  /* a repeat: dropped */
    send_token(fx, sampler(fx), wid2, 1, true);
    pump(fx);
    expect_client_token(fx, 2, 40);
    expect_client_token(fx, 3, 41);
    expect_nothing(fx->ctl, 10);
    assert_int_equal(tsr_requests_count(fx->c), 0);
    assert_int_equal(fx->c->stats.requests_failed, 0);
}

/* A ready cluster whose replica is canaried every 100 ms (a canary must
 * answer within 50), ticked once at *t, the time it is seen ready; returns
 * the leader. */
static int canary_cluster(fx_t *fx, int64_t *t)
{
    reconfigure(fx, "  canary_interval_ms: 100\n  canary_timeout_ms: 50\n");
    int leader = cluster_ready(fx);
    *t = tsr_now_ms();
    tsr_coord_tick(fx->c, *t);
    return leader;
}

/* A canary (a one-token request) at the leader: its worker-side id. */
static uint64_t expect_canary(fx_t *fx, int leader)
{
    tsr_env_t *env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_GENERATE);
    assert_int_equal(env->generate->max_tokens, 1);
    uint64_t wid = env->generate->request_id;
    tsr_env_free(&env);
    return wid;
}

/* A replica whose pieces are all ready but which does not generate is found
 * by its canary, marked unhealthy in status and sent no requests, until a
 * canary answers again. */
static void test_a_silent_replica_is_found_by_its_canary(void **state)
{
    fx_t *fx = *state;
    int64_t t;
    int leader = canary_cluster(fx, &t); /* the pieces are seen ready: first canary in 100 ms */
    expect_nothing(fx->dealer[leader], 10);
    tsr_coord_tick(fx->c, t + 100);
    expect_canary(fx, leader);
    assert_int_equal(fx->c->stats.canaries, 1);

    /* A request arrives while the canary is out, and goes to the replica. */
    send_generate(fx, fx->ctl, 4, 0);
    tsr_env_t *env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_true(env->control_reply->ok);
    tsr_env_free(&env);
    env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_GENERATE);
    assert_int_equal(env->generate->max_tokens, 4);
    tsr_env_free(&env);

    /* No token within 50 ms: unhealthy, and says why; the request on it
     * leaves it (cancelled there) to wait for a healthy replica. */
    tsr_coord_tick(fx->c, t + 160);
    for (int k = 0; k < 2; k++) {
        env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_CANCEL);
        tsr_env_free(&env);
    }
    assert_int_equal(tsr_requests_count(fx->c), 1);
    assert_int_equal(tsr_requests_at(fx->c, 0)->replica, -1);
    json_t *root = status(fx);
    json_t *dep = json_array_get(json_object_get(root, "deployments"), 0);
    assert_string_equal(json_string_value(json_object_get(dep, "state")), "degraded");
    json_t *rep = json_array_get(json_object_get(dep, "replica_list"), 0);
    assert_string_equal(json_string_value(json_object_get(rep, "state")), "unhealthy");
    assert_non_null(strstr(json_string_value(json_object_get(rep, "reason")), "canary"));
    json_decref(root);
    expect_nothing(fx->dealer[leader], 10);

    /* The next canary answers: healthy again, and the request goes out. */
    tsr_coord_tick(fx->c, t + 260);
    uint64_t wid = expect_canary(fx, leader);
    send_token(fx, sampler(fx), wid, 0, true);
    pump(fx);
    tsr_coord_tick(fx->c, t + 270);
    env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_GENERATE);
    assert_int_equal(env->generate->max_tokens, 4);
    assert_int_equal(env->generate->n_prompt, 3);
    tsr_env_free(&env);
    assert_int_equal(tsr_requests_at(fx->c, 0)->replica, 0);
    assert_int_equal(fx->c->stats.canaries_failed, 1);
    root = status(fx);
    dep = json_array_get(json_object_get(root, "deployments"), 0);
    rep = json_array_get(json_object_get(dep, "replica_list"), 0);
    assert_string_equal(json_string_value(json_object_get(rep, "state")), "ready");
    json_decref(root);
}

/* A replica that its canary finds unhealthy is rewired after the backoff
 * (2 s): every member gets its piece again in a newer epoch, so whatever
 * hangs is let go of, and a member that cannot let go reports itself
 * stuck.  Nothing is re-sent before the backoff. */
static void test_an_unhealthy_replica_is_rewired_after_the_backoff(void **state)
{
    fx_t *fx = *state;
    int64_t t;
    int leader = canary_cluster(fx, &t);
    tsr_coord_tick(fx->c, t + 100);
    expect_canary(fx, leader);
    uint64_t before = fx->c->epoch;
    tsr_dep_state_t *ds = &fx->c->deps[0];
    assert_int_equal(ds->retry_at_ms, 0);
    tsr_coord_tick(fx->c, t + 160);     /* no token within 50 ms: unhealthy */
    assert_int_equal(ds->retry_at_ms, t + 160 + 2000);
    tsr_coord_tick(fx->c, t + 170);     /* within the backoff */
    assert_int_equal(fx->c->epoch, before);
    ds->retry_at_ms = t + 175;          /* the backoff has passed (the fake workers do
                                           not heartbeat for 2 s of tick time) */
    tsr_coord_tick(fx->c, t + 180);
    assert_true(fx->c->epoch > before);
    int resent = 0;
    for (int i = 0; i < NW; i++) {
        if (!fx->holds[i]) continue;
        tsr_env_t *env;
        while ((env = recv_env(fx->dealer[i], TSR_WIRE_MAX_CONTROL, 200))) {
            bool assign = env->body_case == TESSERA__ENVELOPE__BODY_ASSIGN;
            if (assign) assert_true(env->assign->assignment->epoch > before);
            tsr_env_free(&env);
            if (assign) {
                resent++;
                break;
            }
        }
    }
    assert_int_equal(resent, 4);    /* the replica's four pieces */
}

/* A reload (the same file) keeps what the canary found and the rewiring backoff: the
 * unhealthy replica still gets no requests and is rewired when its backoff ends, not
 * sooner.  (A reload once dropped both: the replica got requests again.) */
static void test_a_reload_keeps_an_unhealthy_replica_unhealthy_and_its_backoff(void **state)
{
    fx_t *fx = *state;
    int64_t t;
    int leader = canary_cluster(fx, &t);
    tsr_coord_tick(fx->c, t + 100);
    expect_canary(fx, leader);
    tsr_coord_tick(fx->c, t + 160);     /* no token within 50 ms: unhealthy */
    int64_t retry_at = fx->c->deps[0].retry_at_ms;
    int backoff = fx->c->deps[0].retry_backoff_ms;
    assert_int_equal(retry_at, t + 160 + 2000);

    char err[1024] = "";
    if (tsr_coord_reload(fx->c, err, sizeof err) != 0) fail_msg("reload: %s", err);
    assert_int_equal(fx->c->deps[0].retry_at_ms, retry_at);
    assert_int_equal(fx->c->deps[0].retry_backoff_ms, backoff);
    json_t *root = status(fx);
    json_t *dep = json_array_get(json_object_get(root, "deployments"), 0);
    json_t *rep = json_array_get(json_object_get(dep, "replica_list"), 0);
    assert_string_equal(json_string_value(json_object_get(rep, "state")), "unhealthy");
    json_decref(root);

    /* A request waits instead of going to the unhealthy replica. */
    send_generate(fx, fx->ctl, 4, 0);
    tsr_env_t *env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_true(env->control_reply->ok);
    tsr_env_free(&env);
    tsr_coord_tick(fx->c, t + 170);
    while ((env = recv_env(fx->dealer[leader], TSR_WIRE_MAX_CONTROL, 50))) {
        if (env->body_case == TESSERA__ENVELOPE__BODY_GENERATE)
            assert_int_equal(env->generate->max_tokens, 1);  /* a canary, not the request */
        tsr_env_free(&env);
    }
    assert_int_equal(tsr_requests_count(fx->c), 1);
    assert_int_equal(tsr_requests_at(fx->c, 0)->replica, -1);
    /* The rewiring it waits for is still scheduled, in the reloaded state (the ticks
     * are a planning gap apart: the reload's own plan ran at t + 170). */
    uint64_t before = fx->c->epoch;
    fx->c->deps[0].retry_at_ms = t + 175;
    tsr_coord_tick(fx->c, t + 200);
    assert_true(fx->c->epoch > before);
}

/* A busy replica that streams tokens skips its canary (its tokens show it
 * works) without making the coordinator spin: the tick asks to be called
 * again later, not at once, for as long as the replica is busy.  (It once
 * returned 0 on every tick while a replica served: the coordinator's loop
 * then took a third of a core from the workers beside it.)  Once idle, the
 * replica gets its canary at the next tick. */
static void test_a_busy_replica_past_its_canary_does_not_make_the_loop_spin(void **state)
{
    fx_t *fx = *state;
    int64_t t;
    int leader = canary_cluster(fx, &t); /* first canary due at t + 100 */
    uint64_t wid = start_request(fx, fx->ctl, leader, 0);
    uint32_t index = 0;
    for (int64_t at = t + 2; at < t + 400; at += 7) {   /* due from t + 100 on */
        int wait = tsr_coord_tick(fx->c, at);
        if (wait <= 0) fail_msg("tick at +%lld ms with the replica busy asks for %d ms", (long long)(at - t), wait);
        if ((at - t) % 35 == 2) {   /* a token every 35 ms */
            send_token(fx, sampler(fx), wid, index++, false);
            pump(fx);
            expect_client_token(fx, index - 1, 40 + (int)index - 1);
        }
    }
    expect_nothing(fx->dealer[leader], 10);   /* no canary while it streams */
    assert_int_equal(fx->c->stats.canaries, 0);
    send_token(fx, sampler(fx), wid, index, true);
    pump(fx);
    tsr_coord_tick(fx->c, t + 401);    /* the first tick once idle: no interval to wait */
    expect_canary(fx, leader);
    assert_int_equal(fx->c->stats.canaries, 1);
}

/* A replica whose requests get no token for a canary interval (a step that
 * hangs while serving) gets its canary although it is busy; when that goes
 * unanswered the replica is unhealthy and its request leaves it to wait for
 * a healthy one, instead of hanging there with the replica shown ready. */
static void test_a_busy_replica_that_stops_streaming_is_found_by_its_canary(void **state)
{
    fx_t *fx = *state;
    int64_t t;
    int leader = canary_cluster(fx, &t);
    (void)start_request(fx, fx->ctl, leader, 0);   /* sent at t, then silence */
    tsr_coord_tick(fx->c, t + 60);
    expect_nothing(fx->dealer[leader], 10);        /* silent for less than an interval */
    int wait = tsr_coord_tick(fx->c, t + 99);
    assert_true(wait > 0 && wait <= 1);            /* woken when the interval ends */
    expect_nothing(fx->dealer[leader], 10);
    tsr_coord_tick(fx->c, t + 100);
    expect_canary(fx, leader);
    assert_int_equal(fx->c->stats.canaries, 1);
    tsr_coord_tick(fx->c, t + 160);                /* no token within 50 ms */
    for (int k = 0; k < 2; k++) {                  /* the canary and the request, cancelled */
        tsr_env_t *env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_CANCEL);
        tsr_env_free(&env);
    }
    assert_int_equal(fx->c->stats.canaries_failed, 1);
    assert_int_equal(tsr_requests_count(fx->c), 1);
    assert_int_equal(tsr_requests_at(fx->c, 0)->replica, -1);  /* waiting for a healthy replica */
    json_t *root = status(fx);
    json_t *rep = json_array_get(
        json_object_get(json_array_get(json_object_get(root, "deployments"), 0), "replica_list"), 0);
    assert_string_equal(json_string_value(json_object_get(rep, "state")), "unhealthy");
    json_decref(root);
}

/* Heartbeats from every member of the replica but `except` (-1: none)
 * saying their data planes have finished `steps` forward steps, handled at
 * the last tick's time; the acks they may get are read away. */
static void send_steps(fx_t *fx, uint64_t steps, int except)
{
    for (int i = 0; i < NW; i++) {
        if (!fx->holds[i] || i == except) continue;
        Tessera__Heartbeat hb = TESSERA__HEARTBEAT__INIT;
        hb.seq = steps;
        hb.steps = steps;
        send_hb(fx, i, fx->name[i], &hb);
    }
    uint64_t before = fx->c->stats.heartbeats;
    int want = 0;
    for (int i = 0; i < NW; i++) want += fx->holds[i] && i != except;
    for (int k = 0; fx->c->stats.heartbeats < before + (uint64_t)want; k++) {
        if (k == 20) fail_msg("%d heartbeats sent, %llu handled", want,
                              (unsigned long long)(fx->c->stats.heartbeats - before));
        pump(fx);
    }
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env;
        while (fx->holds[i] && (env = recv_env(fx->dealer[i], TSR_WIRE_MAX_WORKER, 5))) {
            assert_int_equal(env->body_case, TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK);
            tsr_env_free(&env);
        }
    }
}

/* A busy replica that sends no token but whose every member keeps finishing
 * steps (a long prompt in chunks, a long step) is computing: it is not
 * canaried, so a step longer than canary_timeout_ms does not make it
 * unhealthy.  Once one member's count stops, the replica is silent from
 * that member's last step, and an interval later it gets its canary. */
static void test_a_busy_replica_whose_steps_advance_without_tokens_is_not_canaried(void **state)
{
    fx_t *fx = *state;
    int64_t t;
    int leader = canary_cluster(fx, &t);
    send_steps(fx, 0, -1);                         /* the counts' baseline */
    (void)start_request(fx, fx->ctl, leader, 0);   /* sent at t; no token ever comes */
    tsr_coord_tick(fx->c, t + 60);
    send_steps(fx, 1, -1);                         /* every member moved at t + 60 */
    tsr_coord_tick(fx->c, t + 100);                /* the request alone: silent an interval */
    tsr_coord_tick(fx->c, t + 150);
    send_steps(fx, 2, -1);
    tsr_coord_tick(fx->c, t + 200);
    assert_int_equal(fx->c->stats.canaries, 0);
    int other = -1;                                /* a member that is not the leader */
    for (int i = 0; i < NW && other < 0; i++)
        if (fx->holds[i] && i != leader) other = i;
    assert_true(other >= 0);
    tsr_coord_tick(fx->c, t + 240);
    send_steps(fx, 3, other);                      /* `other` is stuck since t + 150 */
    tsr_coord_tick(fx->c, t + 249);
    assert_int_equal(fx->c->stats.canaries, 0);
    tsr_coord_tick(fx->c, t + 250);
    assert_int_equal(fx->c->stats.canaries, 1);
    expect_canary(fx, leader);
}

/* The counts speak only for a replica with requests on it: an idle one
 * whose workers just finished steps gets its canary on time. */
static void test_an_idle_replica_whose_workers_finished_steps_gets_its_canary(void **state)
{
    fx_t *fx = *state;
    int64_t t;
    int leader = canary_cluster(fx, &t); /* idle: its first canary at t + 100 */
    send_steps(fx, 3, -1);
    tsr_coord_tick(fx->c, t + 50);
    send_steps(fx, 4, -1);                         /* moved at t + 50 */
    tsr_coord_tick(fx->c, t + 100);
    assert_int_equal(fx->c->stats.canaries, 1);
    expect_canary(fx, leader);
}

/* The first count a worker reports after registering is where it stands,
 * not a step it finished (the same process registers again after a
 * coordinator restart): a busy replica whose only counts are first ones has
 * shown nothing, and is canaried an interval after its request went out. */
static void test_a_workers_first_step_count_is_not_a_step(void **state)
{
    fx_t *fx = *state;
    int64_t t;
    int leader = canary_cluster(fx, &t);
    (void)start_request(fx, fx->ctl, leader, 0);
    tsr_coord_tick(fx->c, t + 60);
    send_steps(fx, 9, -1);
    tsr_coord_tick(fx->c, t + 100);
    assert_int_equal(fx->c->stats.canaries, 1);
    expect_canary(fx, leader);
}

/* A token lost between the replica and the coordinator leaves no gap: the
 * request goes on from the tokens the client has. */
static void test_a_lost_token_makes_the_request_resume_not_skip(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    uint64_t wid = start_request(fx, fx->ctl, leader, 0);
    send_token(fx, sampler(fx), wid, 0, false);
    send_token(fx, sampler(fx), wid, 2, false);  /* 1 never came */
    pump(fx);
    expect_client_token(fx, 0, 40);
    expect_nothing(fx->ctl, 10);
    assert_int_equal(fx->c->stats.requests_replayed, 1);
    tsr_coord_tick(fx->c, tsr_now_ms());
    tsr_env_t *env;
    while ((env = recv_env(fx->dealer[leader], TSR_WIRE_MAX_WORKER, 50)) &&
           env->body_case != TESSERA__ENVELOPE__BODY_GENERATE)
        tsr_env_free(&env);
    assert_non_null(env);
    assert_int_equal(env->generate->n_prompt, 4);  /* the prompt and token 0 */
    assert_int_equal(env->generate->prompt[3], 40);
    tsr_env_free(&env);
}

/* Next generate the leader is sent, skipping cancels; NULL when none comes
 * within 100 ms. */
static tsr_env_t *next_generate(fx_t *fx, int leader)
{
    tsr_env_t *e;
    while ((e = recv_env(fx->dealer[leader], TSR_WIRE_MAX_WORKER, 100)) &&
           e->body_case != TESSERA__ENVELOPE__BODY_GENERATE)
        tsr_env_free(&e);
    return e;
}

/* The replica led by leader recovers (one of its pieces fails and is ready
 * again); returns the id of the attempt the waiting request is sent there. */
static uint64_t recover_replica(fx_t *fx, int leader)
{
    int member = a_member(fx, leader);
    send_failed_as(fx, member, fx->piece[member].epoch, "data plane: peer gone", false, true);
    pump(fx);
    send_ready(fx, member, fx->piece[member].epoch);
    pump(fx);
    tsr_coord_tick(fx->c, tsr_now_ms());
    tsr_env_t *e = next_generate(fx, leader);
    assert_non_null(e);
    uint64_t wid = e->generate->request_id;
    tsr_env_free(&e);
    return wid;
}

/* A replica that fails a request twice in one epoch is broken, though it
 * may still look ready: the third attempt waits until it recovers instead
 * of using up the request's replays there at once. */
static void test_a_replica_that_fails_a_request_twice_is_waited_for(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    uint64_t wid = start_request(fx, fx->ctl, leader, 0);
    const char *why = "connection to rank 1 closed during recv";
    send_token_error_as(fx, leader, wid, why, true);
    pump(fx);
    tsr_coord_tick(fx->c, tsr_now_ms());
    tsr_env_t *e = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);   /* resumed */
    tsr_env_free(&e);
    e = next_generate(fx, leader);         /* the first failure: straight back */
    assert_non_null(e);
    wid = e->generate->request_id;
    tsr_env_free(&e);
    send_token_error_as(fx, leader, wid, why, true);
    pump(fx);
    tsr_coord_tick(fx->c, tsr_now_ms());
    assert_null(next_generate(fx, leader));   /* the second: it waits */
    assert_int_equal(tsr_requests_count(fx->c), 1);
    assert_int_equal(tsr_requests_at(fx->c, 0)->replica, -1);
    /* The second failure, there in the same epoch with no token between, is
     * the same fault: counted once. */
    assert_int_equal(tsr_requests_at(fx->c, 0)->replays, 1);
    /* The replica recovers (a piece fails and is ready again): resumed. */
    wid = recover_replica(fx, leader);
    assert_int_equal(fx->c->stats.requests_failed, 0);
    /* Only one repeat goes free: a third failure there counts. */
    send_token_error_as(fx, leader, wid, why, true);
    pump(fx);
    assert_int_equal(tsr_requests_count(fx->c), 1);
    assert_int_equal(tsr_requests_at(fx->c, 0)->replays, 2);
}

/* The attempt after a replica's error goes to another replica while one is
 * ready, not straight back to the one that failed it (it would likely fail
 * again, using up the request's replays). */
static void test_the_next_attempt_avoids_the_replica_that_failed_it(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: 1\n      pipeline: 2\n      replicas: 2\n";
    reconfigure(fx, NULL);
    cluster_up(fx);
    pieces_ready(fx);
    int lead[2] = {-1, -1};
    for (int i = 0; i < NW; i++)
        if (fx->holds[i] && fx->piece[i].stage == 0) lead[fx->piece[i].replica] = i;
    assert_true(lead[0] >= 0 && lead[1] >= 0);
    /* Both idle: the first goes to replica 0. */
    uint64_t wid = start_request(fx, fx->ctl, lead[0], 0);
    send_token_error_as(fx, lead[0], wid, "this worker holds no piece to serve it", true);
    pump(fx);
    tsr_coord_tick(fx->c, tsr_now_ms());
    tsr_env_t *e = expect_kind(fx->dealer[lead[1]], TESSERA__ENVELOPE__BODY_GENERATE);
    assert_int_equal(e->generate->n_prompt, 3);
    tsr_env_free(&e);
    e = expect_kind(fx->dealer[lead[0]], TESSERA__ENVELOPE__BODY_CANCEL);
    assert_int_equal(e->cancel->request_id, wid);
    tsr_env_free(&e);
    expect_nothing(fx->dealer[lead[0]], 10);
    assert_int_equal(tsr_requests_at(fx->c, 0)->replica, 1);
}

/* A member cut off long enough to be declared dead comes back with its old
 * piece while its replica, rewired without it (no spare), waits in a newer
 * epoch: it is adopted, and the whole replica is rewired again with it.
 * Otherwise its peers would wait for it until their formation deadline. */
static void test_a_member_adopted_back_into_a_rewired_replica_rewires_it(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    int h = a_member(fx, leader);
    int64_t now = scan_time(fx);
    tsr_registry_find(fx->c->reg, fx->name[h])->last_seen_ms = now - TIMEOUT_MS - 1;
    tsr_registry_find(fx->c->reg, fx->name[fx->spare])->last_seen_ms = now - TIMEOUT_MS - 1;
    tsr_coord_tick(fx->c, now);
    tsr_coord_tick(fx->c, plan_time(fx));
    uint64_t moved_on = 0;
    for (int i = 0; i < NW; i++) {
        if (i == h || !fx->holds[i]) continue;
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_ASSIGN);
        assert_true(env->epoch > fx->piece[i].epoch);
        moved_on = env->epoch;
        tsr_env_free(&env);
    }

    char node[16];
    snprintf(node, sizeof node, "node%d", h);
    Tessera__Assignment held = fx->piece[h];
    held.deployment = "tiny";
    held.model_path = model_dir;
    send_register(fx, h, fx->name[h], node, TSR_PROTOCOL_VERSION, &held,
                  TESSERA__WORKER_STATE__STATE_READY);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[h], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_true(env->register_reply->adopted);
    tsr_env_free(&env);
    tsr_coord_tick(fx->c, plan_time(fx));
    for (int i = 0; i < NW; i++) {
        if (!fx->holds[i]) continue;
        env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_ASSIGN);
        assert_true(env->epoch > moved_on);
        assert_int_equal(env->assign->assignment->n_peers, 4);
        tsr_env_free(&env);
    }
}

/* ---- NCCL rendezvous relay -------------------------------------------------------- */

static void send_offer(fx_t *fx, int i, uint64_t epoch, uint64_t group, const char *blob,
                       size_t len)
{
    Tessera__RendezvousOffer o = TESSERA__RENDEZVOUS_OFFER__INIT;
    o.group = group;
    o.blob = (ProtobufCBinaryData){len, (uint8_t *)blob};
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = fx->name[i];
    env.epoch = epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_RENDEZVOUS_OFFER;
    env.rendezvous_offer = &o;
    send_env(fx->dealer[i], &env);
}

/* A member's blob for its current epoch and a group it leads reaches every
 * member of its replica in that epoch, its maker included (rank 0 forms
 * from the relayed copy too), naming its maker, and no one else; one for
 * an old epoch, an empty or oversized one, or one for a group its sender
 * is not rank 0 of reaches no one. */
static void test_a_rendezvous_blob_is_relayed_to_the_replicas_members_in_its_epoch(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    /* tp=2 pp=2: the leader (stage 0, tp rank 0) leads its stage's TP group */
    const uint64_t tp0 = tsr_group_id("tiny", 0, "tp", 0, 0);
    send_offer(fx, leader, fx->piece[leader].epoch, tp0, "nccl-id-bytes", 13);
    pump(fx);
    for (int i = 0; i < NW; i++) {
        if (!fx->holds[i]) continue;
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_RENDEZVOUS);
        assert_int_equal(env->epoch, fx->piece[i].epoch);
        assert_int_equal(env->rendezvous->group, tp0);
        assert_int_equal(env->rendezvous->blob.len, 13);
        assert_memory_equal(env->rendezvous->blob.data, "nccl-id-bytes", 13);
        assert_string_equal(env->rendezvous->from, fx->name[leader]);
        tsr_env_free(&env);
    }
    expect_nothing(fx->dealer[fx->spare], 20);
    assert_int_equal(fx->c->stats.rendezvous_relayed, 1);

    uint64_t stale = fx->c->stats.stale_dropped, bad = fx->c->stats.bad_messages;
    send_offer(fx, leader, fx->piece[leader].epoch - 1, tp0, "old", 3);
    static char big[1025];
    send_offer(fx, leader, fx->piece[leader].epoch, tp0, big, sizeof big);
    send_offer(fx, leader, fx->piece[leader].epoch, tp0, "", 0);
    send_offer(fx, leader, fx->piece[leader].epoch, 0xabc, "any", 3);   /* no such group */
    /* stage 0's tp rank 1 leads only its link to stage 1, not the TP group */
    int other = -1;
    for (int i = 0; i < NW; i++)
        if (fx->holds[i] && fx->piece[i].stage == 0 && fx->piece[i].tp_rank == 1) other = i;
    assert_true(other >= 0);
    send_offer(fx, other, fx->piece[other].epoch, tp0, "forged", 6);
    pump(fx);
    for (int i = 0; i < NW; i++) expect_nothing(fx->dealer[i], 5);
    assert_int_equal(fx->c->stats.stale_dropped, stale + 1);
    assert_int_equal(fx->c->stats.bad_messages, bad + 4);
    send_offer(fx, other, fx->piece[other].epoch, tsr_group_id("tiny", 0, "pp", 1, 1), "link", 4);
    pump(fx);
    for (int i = 0; i < NW; i++) {
        if (!fx->holds[i]) continue;
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_RENDEZVOUS);
        assert_string_equal(env->rendezvous->from, fx->name[other]);
        tsr_env_free(&env);
    }
    assert_int_equal(fx->c->stats.rendezvous_relayed, 2);
    /* the spare holds no piece: its offer goes nowhere */
    send_offer(fx, fx->spare, fx->piece[leader].epoch, tp0, "x", 1);
    pump(fx);
    for (int i = 0; i < NW; i++) expect_nothing(fx->dealer[i], 5);
    assert_int_equal(fx->c->stats.rendezvous_relayed, 2);
}

/* The groups a piece may publish a blob for: its stage's TP group at tp
 * rank 0, a group of one included (TSR_TEST_NCCL_SOLO forms it on one
 * GPU), and its link to the next stage; nothing at another tp rank of a
 * last stage. */
static void test_a_piece_leads_its_stage_tp_group_at_rank_0_even_alone(void **state)
{
    (void)state;
    uint64_t led[2];
    tsr_piece_key_t k = {.tp = 0, .tp_size = 1, .stage = 0, .pp_size = 1, .replica = 2};
    snprintf(k.deployment, sizeof k.deployment, "solo");
    assert_int_equal(tsr_piece_led_groups(&k, led), 1);
    assert_true(led[0] == tsr_group_id("solo", 2, "tp", 0, 0));
    k.pp_size = 2;
    assert_int_equal(tsr_piece_led_groups(&k, led), 2);
    assert_true(led[1] == tsr_group_id("solo", 2, "pp", 1, 0));
    k = (tsr_piece_key_t){.tp = 1, .tp_size = 2, .stage = 1, .pp_size = 2};
    snprintf(k.deployment, sizeof k.deployment, "solo");
    assert_int_equal(tsr_piece_led_groups(&k, led), 0);
}

/* Each assignment lists the replica's GPUs beside its peers, as node/bus id
 * for members that can use NCCL; a registration with something else as its
 * bus id is refused. */
static void test_assignments_carry_the_peers_gpus_and_a_bad_bus_id_is_refused(void **state)
{
    fx_t *fx = *state;
    static const char *const bus[NW] = {"00000000:1A:00.0", "00000000:1B:00.0",
                                        "00000000:1C:00.0", "00000000:1D:00.0",
                                        "00000000:1E:00.0"};
    for (int i = 0; i < NW; i++) reg_bus[i] = bus[i];
    reg_nccl = true;
    cluster_up(fx);
    tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[0]);
    assert_string_equal(w->pci_bus_id, bus[0]);
    /* a rewire sends every member its assignment again, with the lists */
    int h = first_holder(fx);
    send_failed_as(fx, h, fx->piece[h].epoch, "data plane: peer gone", false, true);
    pump(fx);
    fx->c->deps[0].retry_at_ms = tsr_now_ms();
    tsr_coord_tick(fx->c, plan_time(fx));
    tsr_env_t *env = expect_kind(fx->dealer[h], TESSERA__ENVELOPE__BODY_ASSIGN);
    const Tessera__Assignment *a = env->assign->assignment;
    assert_int_equal(a->n_peer_devices, 4);
    for (int i = 0; i < NW; i++) {
        if (!fx->holds[i]) continue;
        int slot = (int)(fx->piece[i].stage * 2 + fx->piece[i].tp_rank);
        char want[64];
        snprintf(want, sizeof want, "node%d/%s", i, bus[i]);
        assert_string_equal(a->peer_devices[slot], want);
    }
    tsr_env_free(&env);

    /* a worker without NCCL is listed as "" (its groups are staged) */
    reg_nccl = false;
    char spare_node[16];
    snprintf(spare_node, sizeof spare_node, "node%d", fx->spare);
    send_register(fx, fx->spare, fx->name[fx->spare], spare_node, TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    env = expect_kind(fx->dealer[fx->spare], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    tsr_env_free(&env);
    assert_string_equal(tsr_registry_find(fx->c->reg, fx->name[fx->spare])->nccl_device, "");
    reg_bus[0] = "0000:3b:00.0; rm -rf /";
    send_register(fx, 0, "newcomer", "node9", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_false(env->register_reply->accepted);
    assert_non_null(strstr(env->register_reply->reason, "is not a PCI bus id"));
    tsr_env_free(&env);
    assert_null(tsr_registry_find(fx->c->reg, "newcomer"));
    /* so is one whose NVLink peer list holds something else, named */
    static char not_a_bus[] = "../../etc";
    reg_bus[0] = "0000:3b:00.0";
    reg_links[0][0] = not_a_bus;
    send_register(fx, 0, "newcomer", "node9", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_false(env->register_reply->accepted);
    assert_non_null(strstr(env->register_reply->reason, "nvlink_peers[0] '../../etc' is not"));
    tsr_env_free(&env);
}

/* Registers every fake worker on node "n" with bus[i] as its PCI bus id, checks each is
 * accepted, and lets the coordinator plan. */
static void register_on_gpus(fx_t *fx, const char *const bus[NW])
{
    for (int i = 0; i < NW; i++) {
        reg_bus[i] = bus[i];
        send_register(fx, i, fx->name[i], "n", TSR_PROTOCOL_VERSION, NULL, 0);
    }
    pump(fx);
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        assert_true(env->register_reply->accepted);
        tsr_env_free(&env);
    }
    tsr_coord_tick(fx->c, plan_time(fx));
}

/* Five GPUs of one node: w0 and w2 joined by an NVLink, w1 and w3 through
 * one NVSwitch, w4 without NVLink.  They form two NVLink domains (status
 * shows them) and each tp=2 group is placed inside one of them. */
static void test_nvlink_domains_come_from_registrations_and_hold_the_tp_groups(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: 2\n      pipeline: 1\n      replicas: 2\n";
    reconfigure(fx, NULL);
    static const char *bus[NW] = {"0000:10:00.0", "0000:11:00.0", "0000:12:00.0",
                                  "0000:13:00.0", "0000:14:00.0"};
    static char b0[] = "0000:10:00.0", b2[] = "0000:12:00.0", sw[] = "0000:f0:00.0";
    reg_links[0][0] = b2;
    reg_links[2][0] = b0;
    reg_links[1][0] = reg_links[3][0] = sw;
    register_on_gpus(fx, bus);
    tsr_worker_t *w[NW];
    for (int i = 0; i < NW; i++) w[i] = tsr_registry_find(fx->c->reg, fx->name[i]);
    assert_string_equal(w[0]->nvlink_domain, "n/nvl:0000:10:00.0");
    assert_string_equal(w[2]->nvlink_domain, "n/nvl:0000:10:00.0");
    assert_string_equal(w[1]->nvlink_domain, "n/nvl:0000:11:00.0");
    assert_string_equal(w[3]->nvlink_domain, "n/nvl:0000:11:00.0");
    assert_string_equal(w[4]->nvlink_domain, "");
    for (int r = 0; r < 2; r++) {
        tsr_worker_t *a = tsr_registry_at_slot(fx->c->reg, "tiny", r, 2, 1, 0);
        tsr_worker_t *b = tsr_registry_at_slot(fx->c->reg, "tiny", r, 2, 1, 1);
        assert_non_null(a);
        assert_non_null(b);
        assert_string_equal(a->nvlink_domain, b->nvlink_domain);
        assert_string_not_equal(a->nvlink_domain, "");
    }
    json_t *root = status(fx);
    json_t *ws = json_object_get(root, "workers");
    bool seen = false;
    for (size_t i = 0; i < json_array_size(ws); i++) {
        json_t *x = json_array_get(ws, i);
        if (!strcmp(json_string_value(json_object_get(x, "name")), fx->name[2]))
            seen = !strcmp(json_string_value(json_object_get(x, "nvlink_domain")),
                           "n/nvl:0000:10:00.0");
    }
    assert_true(seen);
    json_decref(root);
}

/* Worker i is past its lease: the next ticks declare it dead and plan around it. */
static void expire_worker(fx_t *fx, int i)
{
    int64_t now = scan_time(fx);
    tsr_registry_find(fx->c->reg, fx->name[i])->last_seen_ms = now - TIMEOUT_MS - 1;
    tsr_coord_tick(fx->c, now);
    tsr_coord_tick(fx->c, plan_time(fx));
}

/* Deployment "tiny"'s status, with its tensor-parallel groups' spans read out: the
 * deployment's counts, the stages' tp_span fields and the warnings must agree. */
static void expect_spans(fx_t *fx, int nodes, int nvlink, const char *place_a,
                         const char *place_b)
{
    json_t *root = status(fx);
    json_t *d = json_array_get(json_object_get(root, "deployments"), 0);
    assert_int_equal(json_integer_value(json_object_get(d, "tp_groups_spanning_nodes")), nodes);
    assert_int_equal(json_integer_value(json_object_get(d, "tp_groups_spanning_nvlink_domains")),
                     nvlink);
    int seen_nodes = 0, seen_nvlink = 0;
    size_t ri, si;
    json_t *r, *st;
    json_array_foreach(json_object_get(d, "replica_list"), ri, r)
        json_array_foreach(json_object_get(r, "stages"), si, st) {
            const char *span = json_string_value(json_object_get(st, "tp_span"));
            assert_non_null(span);
            seen_nodes += !strcmp(span, "nodes");
            seen_nvlink += !strcmp(span, "nvlink_domains");
        }
    assert_int_equal(seen_nodes, nodes);
    assert_int_equal(seen_nvlink, nvlink);
    json_t *warnings = json_object_get(d, "warnings");
    assert_int_equal(json_array_size(warnings), nodes + nvlink);
    if (place_a) {
        const char *w = json_string_value(json_array_get(warnings, 0));
        if (!strstr(w, place_a) || !strstr(w, place_b))
            fail_msg("warning '%s' names not both '%s' and '%s'", w, place_a, place_b);
    }
    /* `tessera status` prints each warning under its deployment */
    char text_path[PATH_MAX];
    snprintf(text_path, sizeof text_path, "%s/status.txt", fx->dir);
    fflush(stdout);
    int saved = dup(1);
    FILE *out = fopen(text_path, "w");
    assert_non_null(out);
    dup2(fileno(out), 1);
    tsr_print_status(root, 0);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    fclose(out);
    char printed[8192] = "";
    out = fopen(text_path, "r");
    assert_non_null(out);
    printed[fread(printed, 1, sizeof printed - 1, out)] = '\0';
    fclose(out);
    const char *line = strstr(printed, "  warning: replica ");
    assert_int_equal(line != NULL, nodes + nvlink > 0);
    json_decref(root);

    char *text = tsr_coord_metrics_text(fx->c, tsr_now_ms());
    assert_non_null(text);
    char want[160];
    snprintf(want, sizeof want, "tessera_tp_groups_spanning{deployment=\"tiny\",across=\"nodes\"} %d\n",
             nodes);
    assert_non_null(strstr(text, want));
    snprintf(want, sizeof want,
             "tessera_tp_groups_spanning{deployment=\"tiny\",across=\"nvlink_domains\"} %d\n", nvlink);
    assert_non_null(strstr(text, want));
    free(text);
}

/* Two nodes of two workers and a spare on a third: each tp=2 group is placed on one
 * node.  When a worker dies the spare takes its place beside the survivor on the
 * other node: status, its text and /metrics say that group spans nodes A and C. */
static void test_a_tp_group_left_across_nodes_by_a_failover_is_shown(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: 2\n      pipeline: 1\n      replicas: 2\n";
    reconfigure(fx, NULL);
    static const char *node[NW] = {"nodeA", "nodeA", "nodeB", "nodeB", "nodeC"};
    for (int i = 0; i < NW; i++)
        send_register(fx, i, fx->name[i], node[i], TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        assert_true(env->register_reply->accepted);
        tsr_env_free(&env);
    }
    tsr_coord_tick(fx->c, plan_time(fx));
    assert_false(tsr_registry_find(fx->c->reg, fx->name[4])->has_piece);
    expect_spans(fx, 0, 0, NULL, NULL);

    expire_worker(fx, 0);
    assert_true(tsr_registry_find(fx->c->reg, fx->name[4])->has_piece);
    expect_spans(fx, 1, 0, "nodeA", "nodeC");

    /* w0 is back, idle: draining the outlier sends its piece home to nodeA */
    tsr_env_t *env;
    while ((env = recv_env(fx->dealer[0], TSR_WIRE_MAX_WORKER, 20)))  /* what the dead one got */
        tsr_env_free(&env);
    send_register(fx, 0, fx->name[0], "nodeA", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_true(env->register_reply->accepted);
    tsr_env_free(&env);
    env = control(fx, TESSERA__CONTROL_REQUEST__KIND__DRAIN, fx->name[4]);
    assert_true(env->control_reply->ok);
    tsr_env_free(&env);
    tsr_coord_tick(fx->c, plan_time(fx));
    assert_true(tsr_registry_find(fx->c->reg, fx->name[0])->has_piece);
    expect_spans(fx, 0, 0, NULL, NULL);
}

/* The same on one node of GPUs: w0+w2 and w1+w3 are NVLink domains, w4 has no
 * NVLink.  When w0 dies, w4 joins w2: that group spans NVLink domains. */
static void test_a_tp_group_left_across_nvlink_domains_is_shown(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: 2\n      pipeline: 1\n      replicas: 2\n";
    reconfigure(fx, NULL);
    static const char *bus[NW] = {"0000:10:00.0", "0000:11:00.0", "0000:12:00.0",
                                  "0000:13:00.0", "0000:14:00.0"};
    static char b0[] = "0000:10:00.0", b2[] = "0000:12:00.0", sw[] = "0000:f0:00.0";
    reg_links[0][0] = b2;
    reg_links[2][0] = b0;
    reg_links[1][0] = reg_links[3][0] = sw;
    register_on_gpus(fx, bus);
    expect_spans(fx, 0, 0, NULL, NULL);

    expire_worker(fx, 0);
    assert_true(tsr_registry_find(fx->c->reg, fx->name[4])->has_piece);
    expect_spans(fx, 0, 1, "n/nvl:0000:12:00.0", "(no NVLink)");
}

/* ---- auto layouts ------------------------------------------------------------------ */

/* Registers the five fake workers on nodes "a" (w0, w1) and "b" (w2..w4), checks each
 * is accepted, and plans. */
static void register_two_nodes(fx_t *fx)
{
    for (int i = 0; i < NW; i++)
        send_register(fx, i, fx->name[i], i < 2 ? "a" : "b", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        assert_true(env->register_reply->accepted);
        tsr_env_free(&env);
    }
    tsr_coord_tick(fx->c, plan_time(fx));
}

/* How many workers hold a piece of tp_size t and pp_size p. */
static int holders_of(fx_t *fx, int t, int p)
{
    int n = 0;
    for (int i = 0; i < NW; i++) {
        tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[i]);
        n += w->has_piece && w->piece.key.tp_size == t && w->piece.key.pp_size == p;
    }
    return n;
}

static json_t *dep_status(fx_t *fx, json_t **root)
{
    *root = status(fx);
    return json_array_get(json_object_get(*root, "deployments"), 0);
}

/* parallel auto on cpu workers (memory not divided): the model fits one, so tensor 1
 * pipeline 1, and every worker is a replica; status says it was chosen and why.  A
 * reload of the same file keeps the choice and moves nothing. */
static void test_parallel_auto_on_cpu_gives_every_worker_a_replica(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: auto\n      pipeline: auto\n";
    reconfigure(fx, NULL);
    register_two_nodes(fx);
    const tsr_deployment_t *d = &fx->c->cfg->deployments[0];
    assert_int_equal(d->tensor, 1);
    assert_int_equal(d->pipeline, 1);
    assert_int_equal(d->replicas, NW);
    assert_int_equal(holders_of(fx, 1, 1), NW);
    json_t *root, *dj = dep_status(fx, &root);
    assert_true(json_is_true(json_object_get(dj, "layout_chosen")));
    assert_true(json_is_true(json_object_get(json_object_get(dj, "parallel_auto"), "tensor")));
    assert_non_null(strstr(json_string_value(json_object_get(dj, "layout_reason")),
                           "fewest devices a replica fits on (1)"));
    assert_int_equal(json_integer_value(json_object_get(dj, "replicas")), NW);
    json_decref(root);

    uint64_t epoch = fx->c->epoch;
    char err[512];
    assert_int_equal(tsr_coord_reload(fx->c, err, sizeof err), 0);
    tsr_coord_tick(fx->c, plan_time(fx));
    assert_int_equal(fx->c->cfg->deployments[0].replicas, NW);
    assert_int_equal(holders_of(fx, 1, 1), NW);
    assert_int_equal(fx->c->epoch, epoch);
}

/* Five GPUs on two nodes whose memory holds half the model's weights and not all:
 * tensor auto (pipeline 1) gives tensor 2 inside a node, and replicas auto two of
 * them, one GPU left a spare.  GPUs too small for any cut leave the deployment
 * waiting, with the reason, and nothing placed. */
static void test_tensor_auto_cuts_the_model_as_little_as_the_gpus_need(void **state)
{
    fx_t *fx = *state;
    dep_device = "cuda";
    reg_cuda = true;
    layout = "      tensor: auto\n      pipeline: 1\n";
    reconfigure(fx, NULL);
    tsr_model_info_t m;
    char err[512];
    assert_int_equal(tsr_model_info_load(model_dir, &m, err, sizeof err), 0);
    tsr_deployment_t dd = fx->c->cfg->deployments[0];
    dd.tensor = 2;
    dd.pipeline = 1;
    uint64_t need2 = tsr_piece_need(&m, &dd, 0);
    dd.tensor = 1;
    uint64_t need1 = tsr_piece_need(&m, &dd, 0);
    assert_true(need2 < need1);
    for (int i = 0; i < NW; i++) reg_memory[i] = need2 + (need1 - need2) / 2;
    register_two_nodes(fx);
    const tsr_deployment_t *d = &fx->c->cfg->deployments[0];
    assert_int_equal(d->tensor, 2);
    assert_int_equal(d->pipeline, 1);
    assert_int_equal(d->replicas, 2);
    assert_int_equal(holders_of(fx, 2, 1), 4);
    for (int r = 0; r < 2; r++) {  /* each group on one node */
        tsr_worker_t *a = tsr_registry_at_slot(fx->c->reg, "tiny", r, 2, 1, 0);
        tsr_worker_t *b = tsr_registry_at_slot(fx->c->reg, "tiny", r, 2, 1, 1);
        assert_non_null(a);
        assert_non_null(b);
        assert_string_equal(a->node, b->node);
    }
}

/* A latency target no cut meets by the estimate leaves the deployment waiting, saying
 * how fast the fastest would be. */
static void test_auto_with_a_latency_target_no_cut_meets_waits(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: auto\n      pipeline: auto\n";
    reconfigure_dep(fx, "    latency_target_ms_per_token: 0.000001\n");
    register_two_nodes(fx);
    assert_int_equal(holders_of(fx, 1, 1), 0);
    json_t *root, *dj = dep_status(fx, &root);
    assert_string_equal(json_string_value(json_object_get(dj, "state")), "waiting");
    assert_non_null(strstr(json_string_value(json_object_get(dj, "message")),
                           "no cut meets 0.00 ms per token: the fastest that fits"));
    json_decref(root);
}

/* The same target with workers that say their devices are fast (--mem-gbs, --gflops):
 * the estimate uses the slowest rate they give, meets the target, and the cut is chosen.
 * A rate that is not a number is refused at registration. */
static void test_auto_estimates_use_the_rates_the_workers_give(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: auto\n      pipeline: auto\n";
    reconfigure_dep(fx, "    latency_target_ms_per_token: 0.000001\n");
    reg_rate = 1e9;
    register_two_nodes(fx);
    assert_true(fx->c->deps[0].layout_chosen);
    assert_int_equal(holders_of(fx, 1, 1), NW);
    json_t *root = status(fx);
    json_t *w0 = json_array_get(json_object_get(root, "workers"), 0);
    assert_true(json_number_value(json_object_get(w0, "mem_gbs")) == 1e9);
    json_decref(root);

    reg_rate = NAN;
    send_register(fx, 0, "nan-rate", "node9", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    tsr_env_t *env;
    do {
        env = recv_env(fx->dealer[0], TSR_WIRE_MAX_WORKER, 500);
        assert_non_null(env);
        if (env->body_case == TESSERA__ENVELOPE__BODY_REGISTER_REPLY) break;
        tsr_env_free(&env);
    } while (1);
    assert_false(env->register_reply->accepted);
    assert_non_null(strstr(env->register_reply->reason, "must be rates from 0"));
    tsr_env_free(&env);
}

/* cpu workers that say their node's cores and their threads: a latency target halfway
 * between one replica's estimate alone and twice it is met by workers of 2 threads on 2
 * cores (the cut is chosen) and missed by workers of 4 threads on 2 cores, each of which
 * gets half the rates (the deployment waits); status shows what they said. */
static void auto_target_with_threads(fx_t *fx, int threads, bool met)
{
    layout = "      tensor: auto\n      pipeline: auto\n";
    reconfigure_dep(fx, NULL);
    tsr_devices_t v;
    memset(&v, 0, sizeof v);
    tsr_devices_defaults(&v, TSR_DEVICE_CPU);
    v.devices = v.per_node = 1;
    v.mem_gbs = v.gflops = 1000;
    tsr_layout_t one;
    tsr_layout_of(&fx->c->deps[0].model, &fx->c->cfg->deployments[0], &v, 1, 1, &one);
    char extra[96];
    snprintf(extra, sizeof extra, "    latency_target_ms_per_token: %.9f\n", one.ms_token * 1.5);
    reconfigure_dep(fx, extra);
    reg_rate = 1000;
    reg_cores = 2;
    reg_threads = threads;
    register_two_nodes(fx);
    assert_int_equal(fx->c->deps[0].layout_chosen, met);
    json_t *root, *dj = dep_status(fx, &root);
    if (!met)
        assert_non_null(strstr(json_string_value(json_object_get(dj, "message")), "no cut meets"));
    json_t *w0 = json_array_get(json_object_get(root, "workers"), 0);
    assert_int_equal(json_integer_value(json_object_get(w0, "cpu_cores")), 2);
    assert_int_equal(json_integer_value(json_object_get(w0, "cpu_threads")), threads);
    json_decref(root);
}

static void test_auto_estimates_meet_a_target_with_a_core_per_thread(void **state)
{
    auto_target_with_threads(*state, 2, true);
}

static void test_auto_estimates_share_a_nodes_cores_among_the_threads(void **state)
{
    auto_target_with_threads(*state, 4, false);
}

/* An auto cut is chosen again when a reload changes the bytes of a weight.  On an 8B
 * model's shape (its config.json alone: the coordinator plans from it) with a latency
 * target that f32 weights meet only on two devices and int8 weights meet on one, the
 * f32 cut spans two workers, and the reload to int8 weights cuts the deployment onto one
 * (a kept cut would have stayed on two). */
static void test_a_reload_to_int8_weights_chooses_the_auto_cut_again(void **state)
{
    fx_t *fx = *state;
    char big[PATH_MAX], path[PATH_MAX + 32];
    snprintf(big, sizeof big, "%s/big", fx->dir);
    assert_int_equal(mkdir(big, 0755), 0);
    snprintf(path, sizeof path, "%s/config.json", big);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 4096, "
          "\"intermediate_size\": 14336, \"num_hidden_layers\": 32, \"num_attention_heads\": 32, "
          "\"num_key_value_heads\": 8, \"vocab_size\": 128256, \"max_position_embeddings\": 8192, "
          "\"rms_norm_eps\": 1e-5, \"torch_dtype\": \"bfloat16\"}\n", f);
    assert_int_equal(fclose(f), 0);
    layout = "      tensor: auto\n      pipeline: auto\n";
    reconfigure_model(fx, big, NULL);
    assert_true(fx->c->deps[0].model_ok);
    tsr_devices_t v;
    memset(&v, 0, sizeof v);
    tsr_devices_defaults(&v, TSR_DEVICE_CPU);
    v.devices = NW, v.per_node = 2;
    v.mem_gbs = v.gflops = 1000;
    tsr_deployment_t d = fx->c->cfg->deployments[0];
    tsr_layout_t f32, f32_two, i8;
    tsr_layout_of(&fx->c->deps[0].model, &d, &v, 1, 1, &f32);
    tsr_layout_of(&fx->c->deps[0].model, &d, &v, 2, 1, &f32_two);
    d.weights_dtype = TSR_KV_INT8;
    tsr_layout_of(&fx->c->deps[0].model, &d, &v, 1, 1, &i8);
    const double met = i8.ms_token > f32_two.ms_token ? i8.ms_token : f32_two.ms_token;
    if (!(met < f32.ms_token))
        fail_msg("no target between: f32 on one device %.3f ms, on two %.3f, int8 on one %.3f",
                 f32.ms_token, f32_two.ms_token, i8.ms_token);
    char extra[160];
    const double target = (met + f32.ms_token) / 2;
    snprintf(extra, sizeof extra, "    latency_target_ms_per_token: %.6f\n", target);
    reconfigure_model(fx, big, extra);
    reg_rate = 1000;
    register_two_nodes(fx);
    const tsr_deployment_t *now = &fx->c->cfg->deployments[0];
    assert_true(fx->c->deps[0].layout_chosen);
    if (now->tensor * now->pipeline < 2)
        fail_msg("f32 weights were cut onto %d x %d", now->tensor, now->pipeline);
    snprintf(extra, sizeof extra, "    latency_target_ms_per_token: %.6f\n    weights_dtype: int8\n",
             target);
    reconfigure_model(fx, big, extra);
    tsr_coord_tick(fx->c, plan_time(fx));
    now = &fx->c->cfg->deployments[0];
    assert_true(fx->c->deps[0].layout_chosen);
    assert_int_equal(now->tensor * now->pipeline, 1);
}

static void test_auto_with_gpus_too_small_waits_and_says_why(void **state)
{
    fx_t *fx = *state;
    dep_device = "cuda";
    reg_cuda = true;
    layout = "      tensor: auto\n      pipeline: auto\n";
    reconfigure(fx, NULL);
    for (int i = 0; i < NW; i++) reg_memory[i] = 1u << 20;  /* 1 MiB GPUs */
    register_two_nodes(fx);
    assert_int_equal(holders_of(fx, 1, 1) + holders_of(fx, 2, 1), 0);
    json_t *root, *dj = dep_status(fx, &root);
    assert_string_equal(json_string_value(json_object_get(dj, "state")), "waiting");
    assert_false(json_is_true(json_object_get(dj, "layout_chosen")));
    const char *msg = json_string_value(json_object_get(dj, "message"));
    assert_non_null(strstr(msg, "cannot be chosen yet"));
    assert_non_null(strstr(msg, "where each has 0.00 GiB"));
    json_decref(root);
}

/* replicas: auto with a fixed cut: five replicas on five workers; a reload that changes
 * a batching key keeps the five and sends every one of them the new keys (a new epoch
 * for all five holders, not just replica 0's). */
static void test_a_reload_of_auto_replicas_rewires_every_replica(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: 1\n      pipeline: 1\n      replicas: auto\n";
    reconfigure(fx, NULL);
    register_two_nodes(fx);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, NW);
    assert_int_equal(holders_of(fx, 1, 1), NW);
    for (int i = 0; i < NW; i++) {  /* what the first plan sent */
        tsr_env_t *env;
        while ((env = recv_env(fx->dealer[i], TSR_WIRE_MAX_WORKER, 20))) tsr_env_free(&env);
    }
    uint64_t before = fx->c->epoch;
    reconfigure_dep(fx, "    max_batch: 8\n");
    assert_int_equal(fx->c->cfg->deployments[0].replicas, NW);
    tsr_coord_tick(fx->c, plan_time(fx));
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_ASSIGN);
        assert_true(env->epoch > before);
        assert_int_equal(env->assign->assignment->max_batch, 8);
        tsr_env_free(&env);
    }
}

/* ---- replicas that follow load ------------------------------------------------- */

#define LAYOUT_RANGE "      tensor: 1\n      pipeline: 1\n      replicas: {min: 1, max: 3}\n"
#define SCALE_KEYS "    max_batch: 4\n    scale_up_queue_ms: 200\n    scale_up_window_s: 1\n" \
                   "    scale_down_idle_s: 2\n"

/* Reads the assignments and unassignments waiting at the fake workers into fx->holds
 * and fx->piece; returns how many assignments there were. */
static int take_assigns(fx_t *fx)
{
    int n = 0;
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env;
        while ((env = recv_env(fx->dealer[i], TSR_WIRE_MAX_WORKER, 20))) {
            if (env->body_case == TESSERA__ENVELOPE__BODY_ASSIGN) {
                fx->holds[i] = true;
                fx->piece[i].replica = env->assign->assignment->replica;
                fx->piece[i].stage = env->assign->assignment->stage;
                fx->piece[i].tp_rank = env->assign->assignment->tp_rank;
                fx->piece[i].pp_size = env->assign->assignment->pp_size;
                fx->piece[i].epoch = env->assign->assignment->epoch;
                n++;
            } else if (env->body_case == TESSERA__ENVELOPE__BODY_UNASSIGN) {
                fx->holds[i] = false;
            }
            tsr_env_free(&env);
        }
    }
    return n;
}

/* The fake worker leading replica r (stage 0, tp rank 0; -1: none). */
static int holder_of_replica(const fx_t *fx, int r)
{
    for (int i = 0; i < NW; i++)
        if (fx->holds[i] && fx->piece[i].replica == (uint32_t)r && fx->piece[i].stage == 0 &&
            fx->piece[i].tp_rank == 0)
            return i;
    return -1;
}

/* Every holder reports ready in its epoch. */
static void all_ready(fx_t *fx)
{
    for (int i = 0; i < NW; i++)
        if (fx->holds[i]) send_ready(fx, i, fx->piece[i].epoch);
    pump(fx);
}

/* The load windows of every deployment start at the next tick. */
static void windows_restart(fx_t *fx)
{
    for (size_t i = 0; i < fx->c->cfg->n_deployments; i++) fx->c->deps[i].scale.window_ms = 0;
}

/* A tick at now, every worker just heard from (the clock runs ahead of the wall). */
static void tick_alive(fx_t *fx, int64_t now)
{
    for (int i = 0; i < NW; i++) {
        tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[i]);
        if (w) w->last_seen_ms = now;
    }
    tsr_coord_tick(fx->c, now);
}

/* The fake worker leading replica r of deployment dep, by the registry (-1: none). */
static int holder_in(fx_t *fx, const char *dep, int r)
{
    for (int i = 0; i < NW; i++) {
        const tsr_worker_t *w = tsr_registry_find(fx->c->reg, fx->name[i]);
        if (w && w->has_piece && !strcmp(w->piece.key.deployment, dep) && w->piece.key.replica == r &&
            w->piece.key.stage == 0 && w->piece.key.tp == 0)
            return i;
    }
    return -1;
}

/* Sends a request to deployment dep and returns its id at the replica's leader,
 * which must be the holder of replica r. */
static uint64_t request_to_dep(fx_t *fx, const char *dep, int r)
{
    gen_deployment = dep;
    send_generate(fx, fx->ctl, 16, 0);
    gen_deployment = "tiny";
    tsr_env_t *env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    if (!env->control_reply->ok) fail_msg("refused: %s", env->control_reply->error);
    tsr_env_free(&env);
    int h = holder_in(fx, dep, r);
    assert_int_not_equal(h, -1);
    env = expect_kind(fx->dealer[h], TESSERA__ENVELOPE__BODY_GENERATE);
    uint64_t wid = env->generate->request_id;
    tsr_env_free(&env);
    return wid;
}

static uint64_t request_to(fx_t *fx, int r) { return request_to_dep(fx, "tiny", r); }

/* Drops the replies the client has had so far. */
static int client_replies(fx_t *fx)
{
    int n = 0;
    tsr_env_t *env;
    while ((env = recv_env(fx->ctl, TSR_WIRE_MAX_CONTROL, 20))) {
        assert_true(env->control_reply->ok);
        n++;
        tsr_env_free(&env);
    }
    return n;
}

static json_t *autoscale_status(fx_t *fx, json_t **root)
{
    json_t *dj = dep_status(fx, root);
    json_t *a = json_object_get(dj, "autoscale");
    assert_true(json_is_object(a));
    return a;
}

/* replicas {min 1, max 3}: a window of scale_up_window_s whose mean wait for a first
 * token is above scale_up_queue_ms adds a replica on an idle worker (not before the
 * window ends, and no second while the new one loads); status and /metrics show the
 * decision and why.  A reload keeps the count (nothing moves),
 * within a new range. */
static void test_replicas_grow_when_the_queue_wait_stays_above_the_threshold(void **state)
{
    fx_t *fx = *state;
    layout = LAYOUT_RANGE;
    reconfigure_dep(fx, SCALE_KEYS);
    register_two_nodes(fx);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 1);
    assert_int_equal(take_assigns(fx), 1);
    all_ready(fx);
    int64_t t = plan_time(fx);
    windows_restart(fx);
    tick_alive(fx, t);                      /* a 1 s window starts */
    request_to(fx, 0);                      /* no token comes: it waits */
    tick_alive(fx, t + 300);
    tick_alive(fx, t + 1000);               /* one request alone is no queue */
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 1);
    t += 1000;
    request_to(fx, 0);                      /* a second one waits with it */
    tick_alive(fx, t + 950);                /* the window is not over */
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 1);
    assert_int_equal(take_assigns(fx), 0);
    tick_alive(fx, t + 1000);               /* its mean wait: 1000 ms, above 200 */
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 2);
    tick_alive(fx, t + 1100);               /* the plan, past its gap */
    assert_int_equal(take_assigns(fx), 1);
    assert_int_not_equal(holder_of_replica(fx, 1), -1);
    json_t *root, *a = autoscale_status(fx, &root);
    assert_int_equal(json_integer_value(json_object_get(a, "ups")), 1);
    /* the two waited 2000 and 1000 ms (the second came at the window's start) */
    assert_true(json_number_value(json_object_get(a, "queue_wait_ms")) == 1500.0);
    assert_non_null(strstr(json_string_value(json_object_get(a, "last")),
                           "the queue wait was 1500 ms over 1 s, above scale_up_queue_ms 200"));
    json_decref(root);
    char *text = tsr_coord_metrics_text(fx->c, t + 1100);
    assert_non_null(strstr(text, "tessera_replicas_scaled_total{deployment=\"tiny\",direction=\"up\"} 1\n"));
    assert_non_null(strstr(text, "tessera_replicas{deployment=\"tiny\"} 2\n"));
    assert_non_null(strstr(text, "tessera_queue_wait_seconds{deployment=\"tiny\"} 1.500\n"));
    free(text);

    /* the new replica loads: the queue still waits, but no third is added meanwhile */
    tick_alive(fx, t + 2000);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 2);
    a = autoscale_status(fx, &root);
    assert_non_null(strstr(json_string_value(json_object_get(a, "held_back")), "every replica serves"));
    json_decref(root);

    /* a reload of the same file keeps the two (no plan moves anything); a range whose
     * max is 1 takes it back to 1 */
    uint64_t epoch = fx->c->epoch;
    reconfigure_dep(fx, SCALE_KEYS);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 2);
    tick_alive(fx, t + 2200);
    assert_int_equal(fx->c->epoch, epoch);
    layout = "      tensor: 1\n      pipeline: 1\n      replicas: {min: 1, max: 1}\n";
    reconfigure_dep(fx, SCALE_KEYS);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 1);
}

/* replicas {min 1, max 3} brought to two, both ready, the load windows from *t (the
 * tick clock; room counts from *t + 100); the holders of replicas 0 and 1. */
static void two_replicas_ready(fx_t *fx, int64_t *t, int *r0, int *r1)
{
    layout = LAYOUT_RANGE;
    reconfigure_dep(fx, SCALE_KEYS);
    register_two_nodes(fx);
    take_assigns(fx);
    all_ready(fx);
    *t = plan_time(fx);
    windows_restart(fx);
    tick_alive(fx, *t);
    assert_int_equal(tsr_dep_set_replicas(&fx->c->deps[0], &fx->c->cfg->deployments[0], 2), 0);
    tsr_coord_mark_dirty(fx->c);
    tick_alive(fx, *t + 100);
    assert_int_equal(take_assigns(fx), 1);
    all_ready(fx);
    *r0 = holder_of_replica(fx, 0);
    *r1 = holder_of_replica(fx, 1);
}

/* Two replicas and load that one holds: after scale_down_idle_s the last is drained
 * (a new request goes to the other though it has fewer), removed once its request
 * ends (nothing failed), and its worker let go. */
static void test_replicas_shrink_after_idle_draining_the_last_first(void **state)
{
    fx_t *fx = *state;
    int64_t t;
    int r0, r1;
    two_replicas_ready(fx, &t, &r0, &r1);
    uint64_t a = request_to(fx, 0), b = request_to(fx, 1), c2 = request_to(fx, 0);
    send_token(fx, r0, a, 0, false);
    send_token(fx, r1, b, 0, false);
    send_token(fx, r0, c2, 0, false);
    pump(fx);
    tick_alive(fx, t + 200);                /* room since t + 100: 3 requests fit one
                                               replica's 4 */
    tick_alive(fx, t + 2050);
    assert_int_equal(fx->c->deps[0].scale.draining, -1);
    tick_alive(fx, t + 2150);               /* 2 s of room: replica 1 drains */
    assert_int_equal(fx->c->deps[0].scale.draining, 1);
    uint64_t d = request_to(fx, 0);         /* replica 1 has fewer, but drains */
    send_token(fx, r0, d, 0, false);
    pump(fx);
    tick_alive(fx, t + 2400);               /* b is still on it */
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 2);
    send_token(fx, r1, b, 1, true);
    pump(fx);
    tick_alive(fx, t + 2500);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 1);
    tick_alive(fx, t + 2600);
    take_assigns(fx);
    assert_false(fx->holds[r1]);            /* its worker was let go */
    assert_true(fx->holds[r0]);
    assert_int_equal(fx->c->stats.requests_failed, 0);
    assert_int_equal(client_replies(fx), 5);  /* 4 first tokens and b's last, none failed */
    json_t *root, *as = autoscale_status(fx, &root);
    assert_int_equal(json_integer_value(json_object_get(as, "downs")), 1);
    assert_non_null(strstr(json_string_value(json_object_get(as, "last")), "scale_down_idle_s"));
    json_decref(root);
}

/* Room for a replica fewer, but the other replica does not serve (its piece failed):
 * the last one is not drained, since it is the one serving, and it takes requests. */
static void test_the_replica_that_serves_alone_is_not_drained(void **state)
{
    fx_t *fx = *state;
    int64_t t;
    int r0, r1;
    two_replicas_ready(fx, &t, &r0, &r1);
    send_failed(fx, r0, fx->piece[r0].epoch, "the data plane broke", false);
    pump(fx);
    tick_alive(fx, t + 200);
    tick_alive(fx, t + 2500);               /* past scale_down_idle_s */
    assert_int_equal(fx->c->deps[0].scale.draining, -1);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 2);
    uint64_t id = request_to(fx, 1);        /* the one that serves takes requests */
    send_token(fx, r1, id, 0, true);
    pump(fx);
}

/* A restarted coordinator keeps the replicas a range grew to: a worker that
 * re-attaches with replica 2 of {min 1, max 3} is adopted and the count is 3, not
 * min; a fixed count that becomes a range by a reload starts from that count. */
static void test_a_range_keeps_its_count_across_a_restart_and_from_a_fixed_count(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: 2\n      pipeline: 2\n      replicas: {min: 1, max: 3}\n";
    reconfigure(fx, NULL);
    fx->c->plan_after_ms = tsr_now_ms() + 60000;  /* the re-attach grace of a restart */
    Tessera__Assignment a;
    held_piece(&a, 4, 8);
    a.replica = 2;
    register_adopted(fx, 0, &a, TESSERA__WORKER_STATE__STATE_READY);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 3);
    a.replica = 3;                          /* past max: not adopted */
    send_register(fx, 1, fx->name[1], "node0", TSR_PROTOCOL_VERSION, &a,
                  TESSERA__WORKER_STATE__STATE_READY);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[1], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_false(env->register_reply->adopted);
    tsr_env_free(&env);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 3);

    layout = "      tensor: 2\n      pipeline: 2\n      replicas: 2\n";
    reconfigure(fx, NULL);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 2);
    layout = "      tensor: 2\n      pipeline: 2\n      replicas: {min: 1, max: 3}\n";
    reconfigure(fx, NULL);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 2);
}

/* A request still on the drained replica after TSR_SCALE_DRAIN_MAX_MS resumes on
 * the other, from the tokens it had: nothing fails. */
static void test_a_drain_that_outlasts_its_limit_moves_the_requests_not_fails_them(void **state)
{
    fx_t *fx = *state;
    int64_t t;
    int r0, r1;
    two_replicas_ready(fx, &t, &r0, &r1);
    uint64_t a = request_to(fx, 0), b = request_to(fx, 1);
    send_token(fx, r0, a, 0, false);
    send_token(fx, r1, b, 0, false);
    pump(fx);
    tick_alive(fx, t + 200);
    tick_alive(fx, t + 2250);
    assert_int_equal(fx->c->deps[0].scale.draining, 1);
    tick_alive(fx, t + 2250 + TSR_SCALE_DRAIN_MAX_MS - 100);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 2);
    tick_alive(fx, t + 2250 + TSR_SCALE_DRAIN_MAX_MS);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 1);
    /* b went on at replica 0 from its prompt and the token it had */
    tsr_env_t *env = expect_kind(fx->dealer[r0], TESSERA__ENVELOPE__BODY_GENERATE);
    assert_int_equal(env->generate->n_prompt, 4);
    tsr_env_free(&env);
    assert_int_equal(fx->c->stats.requests_failed, 0);
    assert_non_null(strstr(fx->c->deps[0].scale.last, "resumed on the others"));
}

/* Two deployments whose replicas follow load, both queued, one idle worker beyond
 * coordinator.reserve_spares 2: the one earlier in the file gets it, the other is
 * held back and says why.  Then the second is short of a worker (its own died, the
 * idle ones are drained): the first gives its replica above min back for it. */
static void test_idle_workers_go_to_the_first_deployment_and_spares_stay_for_failover(void **state)
{
    fx_t *fx = *state;
    layout = LAYOUT_RANGE;
    char extra[1024];
    snprintf(extra, sizeof extra, SCALE_KEYS "  - name: second\n    model: %s\n    parallel:\n"
             LAYOUT_RANGE SCALE_KEYS, model_dir);
    write_yaml_dep(fx->path, fx->wep, fx->cep, "  reserve_spares: 2\n", extra);
    char err[1024] = "";
    if (tsr_coord_reload(fx->c, err, sizeof err) != 0) fail_msg("reload: %s", err);
    register_two_nodes(fx);
    assert_int_equal(take_assigns(fx), 2);
    all_ready(fx);
    int64_t t = plan_time(fx);
    windows_restart(fx);
    tick_alive(fx, t);
    for (int k = 0; k < 2; k++) {           /* two wait in each: a queue */
        request_to_dep(fx, "second", 0);
        request_to_dep(fx, "tiny", 0);
    }
    tick_alive(fx, t + 300);
    tick_alive(fx, t + 1350);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 2);
    assert_int_equal(fx->c->cfg->deployments[1].replicas, 1);
    assert_non_null(strstr(fx->c->deps[1].scale.blocked, "beyond coordinator.reserve_spares"));
    tick_alive(fx, t + 1450);               /* the plan */
    assert_int_equal(take_assigns(fx), 1);
    all_ready(fx);
    int given = holder_in(fx, "tiny", 1), lost = holder_in(fx, "second", 0);
    assert_int_not_equal(given, -1);
    for (int i = 0; i < NW; i++) {
        if (fx->holds[i]) continue;
        tsr_env_t *env = control(fx, TESSERA__CONTROL_REQUEST__KIND__DRAIN, fx->name[i]);
        assert_true(env->control_reply->ok);
        tsr_env_free(&env);
    }
    /* second's only worker dies: second is short, and tiny's queue still waits */
    int64_t now = t + 1600;
    for (int step = 0; step < 6; step++, now += 100) {
        for (int i = 0; i < NW; i++)
            tsr_registry_find(fx->c->reg, fx->name[i])->last_seen_ms =
                i == lost ? t - TIMEOUT_MS - 1 : now;
        tsr_coord_tick(fx->c, now);
    }
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 1);
    assert_non_null(strstr(fx->c->deps[0].scale.last, "deployment second needs cpu workers"));
    assert_int_equal(holder_in(fx, "second", 0), given);
    assert_int_equal(fx->c->stats.requests_failed, 0);
}

/* ---- moving back ----------------------------------------------------------------- */

/* tp 2 x 2 replicas on nodes A A B B C, every piece ready, rebalance_interval_s 5 (or
 * what `extra` says); w0 dies and the spare on C takes its piece, so a group spans A
 * and C; w0 registers again, idle.  Returns the replica that spans. */
static int group_left_across_nodes(fx_t *fx, const char *extra, int replicas)
{
    layout = replicas == 2 ? "      tensor: 2\n      pipeline: 1\n      replicas: 2\n"
                           : "      tensor: 2\n      pipeline: 1\n      replicas: 1\n";
    reconfigure(fx, extra);
    static const char *node[NW] = {"nodeA", "nodeA", "nodeB", "nodeB", "nodeC"};
    for (int i = 0; i < NW; i++)
        send_register(fx, i, fx->name[i], node[i], TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        assert_true(env->register_reply->accepted);
        tsr_env_free(&env);
    }
    tsr_coord_tick(fx->c, plan_time(fx));
    take_assigns(fx);
    all_ready(fx);
    assert_true(fx->holds[0]);
    expire_worker(fx, 0);
    fx->holds[0] = false;
    take_assigns(fx);
    assert_true(fx->holds[4]);
    all_ready(fx);
    expect_spans(fx, 1, 0, "nodeA", "nodeC");
    tsr_env_t *env;
    while ((env = recv_env(fx->dealer[0], TSR_WIRE_MAX_WORKER, 20))) tsr_env_free(&env);
    send_register(fx, 0, fx->name[0], "nodeA", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_true(env->register_reply->accepted);
    tsr_env_free(&env);
    return (int)fx->piece[4].replica;
}

static json_t *rebalance_status(fx_t *fx, json_t **root)
{
    *root = status(fx);
    json_t *rb = json_object_get(json_object_get(*root, "coordinator"), "rebalance");
    assert_true(json_is_object(rb));
    return rb;
}

/* When w0 is back on node A, the piece w4 holds on C moves to it make before break:
 * w0 is first sent the piece with no peer placed (it loads, the group keeps serving
 * as it is), and only after w0 says ready does one plan give it the piece with its
 * peers, let w4 go and rewire its partner, all in one new epoch.  Status and
 * /metrics count the move; the group is on one node again. */
static void test_a_group_left_across_nodes_moves_back_make_before_break(void **state)
{
    fx_t *fx = *state;
    int r = group_left_across_nodes(fx, "  rebalance_interval_s: 5\n", 2);
    int partner = -1;
    for (int i = 1; i < 4; i++)
        if (fx->holds[i] && (int)fx->piece[i].replica == r) partner = i;
    assert_int_not_equal(partner, -1);
    int64_t t = plan_time(fx);
    tick_alive(fx, t);
    tsr_env_t *env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_ASSIGN);
    const Tessera__Assignment *a = env->assign->assignment;
    assert_int_equal(a->replica, r);
    assert_int_equal(a->tp_rank, fx->piece[4].tp_rank);
    assert_int_equal(a->n_peers, 2);        /* no peer placed: a standby */
    assert_string_equal(a->peers[0], "");
    assert_string_equal(a->peers[1], "");
    assert_int_equal(a->n_peer_workers, 0);
    uint64_t standby = env->epoch;
    tsr_env_free(&env);
    expect_nothing(fx->dealer[4], 50);
    expect_nothing(fx->dealer[partner], 20);
    assert_false(tsr_registry_find(fx->c->reg, fx->name[0])->has_piece);
    json_t *root, *rb = rebalance_status(fx, &root);
    char want[128];
    snprintf(want, sizeof want, "moving tiny r%d s0 t%u from w4 (node nodeC) to w0 (node nodeA)", r,
             fx->piece[4].tp_rank);
    assert_non_null(strstr(json_string_value(json_object_get(rb, "doing")), want));
    json_decref(root);

    tick_alive(fx, t + 200);                /* not loaded yet: nothing switches */
    expect_nothing(fx->dealer[4], 20);
    send_ready(fx, 0, standby);
    pump(fx);
    assert_false(tsr_registry_find(fx->c->reg, fx->name[0])->has_piece);  /* not a piece yet */
    tick_alive(fx, t + 300);                /* the other replica serves: it switches */
    env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_ASSIGN);
    a = env->assign->assignment;
    uint64_t epoch = env->epoch;
    assert_true(epoch > standby);
    assert_int_equal(a->n_peer_workers, 2);  /* with both peers placed: w0 and its partner */
    assert_string_equal(a->peer_workers[a->tp_rank], "w0");
    assert_string_equal(a->peer_workers[1 - a->tp_rank], fx->name[partner]);
    tsr_env_free(&env);
    env = expect_kind(fx->dealer[4], TESSERA__ENVELOPE__BODY_UNASSIGN);
    tsr_env_free(&env);
    env = expect_kind(fx->dealer[partner], TESSERA__ENVELOPE__BODY_ASSIGN);
    assert_int_equal(env->epoch, epoch);
    tsr_env_free(&env);
    tick_alive(fx, t + 400);
    expect_spans(fx, 0, 0, NULL, NULL);
    rb = rebalance_status(fx, &root);
    assert_int_equal(json_integer_value(json_object_get(rb, "moves")), 1);
    assert_string_equal(json_string_value(json_object_get(rb, "doing")), "");
    assert_non_null(strstr(json_string_value(json_object_get(rb, "last")), "moved tiny"));
    json_decref(root);
    char *text = tsr_coord_metrics_text(fx->c, t + 400);
    assert_non_null(strstr(text, "tessera_rebalance_moves_total{outcome=\"moved\"} 1\n"));
    free(text);
}

/* One replica: the standby loads, but the switch waits while a request is on the
 * replica (no replica that serves stops) and comes once it ended. */
static void test_moving_back_waits_for_an_idle_replica(void **state)
{
    fx_t *fx = *state;
    int r = group_left_across_nodes(fx, "  rebalance_interval_s: 5\n", 1);
    assert_int_equal(r, 0);
    int64_t t = plan_time(fx);
    tick_alive(fx, t);
    tsr_env_t *env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_ASSIGN);
    uint64_t standby = env->epoch;
    tsr_env_free(&env);
    int leader = -1;
    for (int i = 1; i < NW; i++)
        if (fx->holds[i] && fx->piece[i].tp_rank == 0) leader = i;
    uint64_t id = request_to(fx, 0);
    send_ready(fx, 0, standby);
    pump(fx);
    tick_alive(fx, t + 200);
    tick_alive(fx, t + 300);
    expect_nothing(fx->dealer[4], 30);      /* the request is on it: no switch */
    assert_false(tsr_registry_find(fx->c->reg, fx->name[0])->has_piece);
    send_token(fx, leader, id, 0, true);
    pump(fx);
    tick_alive(fx, t + 400);
    env = expect_kind(fx->dealer[4], TESSERA__ENVELOPE__BODY_UNASSIGN);
    tsr_env_free(&env);
    assert_true(tsr_registry_find(fx->c->reg, fx->name[0])->has_piece);
    assert_int_equal(fx->c->stats.requests_failed, 0);
}

/* A restarted coordinator does not adopt a standby (a piece held with no peer
 * placed): the worker that serves the piece keeps it. */
static void test_a_standby_is_not_adopted_by_a_restarted_coordinator(void **state)
{
    fx_t *fx = *state;
    fx->c->plan_after_ms = tsr_now_ms() + 60000;
    Tessera__Assignment a;
    held_piece(&a, 4, 8);
    char *none[4] = {"", "", "", ""};
    a.peers = none;
    a.n_peers = 4;
    send_register(fx, 0, fx->name[0], "node0", TSR_PROTOCOL_VERSION, &a,
                  TESSERA__WORKER_STATE__STATE_READY);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_false(env->register_reply->adopted);
    tsr_env_free(&env);
    assert_false(tsr_registry_find(fx->c->reg, fx->name[0])->has_piece);
    char *some[4] = {"", "", "", "127.0.0.1:9"};  /* its own slot: a piece it serves */
    a.peers = some;
    register_adopted(fx, 1, &a, TESSERA__WORKER_STATE__STATE_READY);
}

/* With rebalance_interval_s 0 nothing moves. */
static void test_moving_back_is_off_at_interval_0(void **state)
{
    fx_t *fx = *state;
    group_left_across_nodes(fx, "  rebalance_interval_s: 0\n", 2);
    int64_t t = plan_time(fx);
    tick_alive(fx, t);
    tick_alive(fx, t + 1000);
    expect_nothing(fx->dealer[0], 50);
    expect_spans(fx, 1, 0, "nodeA", "nodeC");
    /* turned on by a reload, the same cluster begins the move at once */
    reconfigure(fx, "  rebalance_interval_s: 5\n");
    tick_alive(fx, t + 1100);
    tsr_env_t *env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_ASSIGN);
    assert_int_equal(env->assign->assignment->n_peer_workers, 0);  /* a standby */
    tsr_env_free(&env);
}

/* ---- a new cut built beside the running one ------------------------------------- */

/* tp 1 x 1 replica on w-something, every piece ready, four idle workers; the file then
 * asks for tp 2.  Returns the worker serving the old replica. */
static int one_replica_then_tp2(fx_t *fx)
{
    layout = "      tensor: 1\n      pipeline: 1\n      replicas: 1\n";
    reconfigure(fx, NULL);
    register_two_nodes(fx);
    assert_int_equal(take_assigns(fx), 1);
    all_ready(fx);
    int old = holder_of_replica(fx, 0);
    layout = "      tensor: 2\n      pipeline: 1\n      replicas: 1\n";
    reconfigure(fx, NULL);
    return old;
}

/* The standbys the fake workers were sent: their indices (at most NW) and epoch. */
static int take_standbys(fx_t *fx, int *who, uint64_t *epoch)
{
    int n = 0;
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env = recv_env(fx->dealer[i], TSR_WIRE_MAX_WORKER, 20);
        if (!env) continue;
        assert_int_equal(env->body_case, TESSERA__ENVELOPE__BODY_ASSIGN);
        const Tessera__Assignment *a = env->assign->assignment;
        assert_int_equal(a->tp_size, 2);
        for (size_t k = 0; k < a->n_peers; k++) assert_string_equal(a->peers[k], "");
        *epoch = env->epoch;
        who[n++] = i;
        tsr_env_free(&env);
    }
    return n;
}

/* A reload from tp 1 to tp 2 with idle workers for the new layout: the old replica
 * keeps the old cut and serves (a request goes to it) while two idle workers load the
 * new pieces as standbys; once both say ready the cut changes and one plan gives them
 * their pieces with their peers and lets the old worker go; the request resumes on
 * the new replica, nothing failed; status shows each step. */
static void test_a_new_cut_is_built_beside_the_running_one(void **state)
{
    fx_t *fx = *state;
    int old = one_replica_then_tp2(fx);
    const tsr_deployment_t *d = &fx->c->cfg->deployments[0];
    assert_int_equal(d->tensor, 1);         /* the old cut serves until the switch */
    int64_t t = plan_time(fx);
    tick_alive(fx, t);
    int sb[NW];
    uint64_t epoch = 0;
    assert_int_equal(take_standbys(fx, sb, &epoch), 2);
    json_t *root, *dj = dep_status(fx, &root);
    assert_non_null(strstr(json_string_value(json_object_get(json_object_get(dj, "reshard"), "doing")),
                           "tp 2 x pp 1 x 1 loads on 2 idle worker(s) while tp 1 x pp 1 x 1 serves"));
    json_decref(root);
    /* a reload of the same file keeps the build going: the standbys are not let go */
    reconfigure(fx, NULL);
    assert_true(fx->c->deps[0].reshard.active);
    assert_int_equal(fx->c->cfg->deployments[0].tensor, 1);
    d = &fx->c->cfg->deployments[0];
    tick_alive(fx, t + 50);
    expect_nothing(fx->dealer[sb[0]], 20);
    expect_nothing(fx->dealer[sb[1]], 20);
    uint64_t id = request_to(fx, 0);        /* the old replica serves meanwhile */
    assert_int_equal(holder_of_replica(fx, 0), old);
    send_token(fx, old, id, 0, false);
    send_ready(fx, sb[0], epoch);
    pump(fx);
    tick_alive(fx, t + 100);
    assert_int_equal(d->tensor, 1);         /* one standby is still loading */
    expect_nothing(fx->dealer[old], 20);
    send_ready(fx, sb[1], epoch);
    pump(fx);
    tick_alive(fx, t + 200);
    assert_int_equal(d->tensor, 2);
    uint64_t switched = 0;
    int leader = -1;
    for (int k = 0; k < 2; k++) {
        tsr_env_t *env = expect_kind(fx->dealer[sb[k]], TESSERA__ENVELOPE__BODY_ASSIGN);
        assert_true(env->epoch > epoch);
        switched = env->epoch;
        assert_int_equal(env->assign->assignment->n_peer_workers, 2);  /* both placed */
        if (env->assign->assignment->tp_rank == 0) leader = sb[k];
        tsr_env_free(&env);
    }
    /* the old replica has a request in flight: it finishes it in place, taking no new
     * one, and is let go after; nothing moves, nothing is prefilled again */
    expect_nothing(fx->dealer[old], 50);
    for (int k = 0; k < 2; k++) send_ready(fx, sb[k], switched);
    pump(fx);
    tick_alive(fx, t + 300);
    json_t *st = status(fx), *wj = NULL, *ws;
    size_t wi;
    json_array_foreach(json_object_get(st, "workers"), wi, ws)
        if (!strcmp(json_string_value(json_object_get(ws, "name")), fx->name[old])) wj = ws;
    assert_non_null(wj);
    assert_string_equal(json_string_value(json_object_get(wj, "state")), "finishing");
    json_decref(st);
    client_replies(fx);
    expect_nothing(fx->dealer[leader], 20);       /* the request was not moved */
    /* the new replica of the same index, in another epoch, does not speak for it */
    uint64_t dropped = fx->c->stats.identity_dropped;
    send_token(fx, leader, id, 1, false);
    pump(fx);
    assert_int_equal(fx->c->stats.identity_dropped, dropped + 1);
    assert_int_equal(client_replies(fx), 0);
    send_token(fx, old, id, 1, false);
    send_token(fx, old, id, 2, true);
    pump(fx);
    assert_int_equal(client_replies(fx), 2);      /* the old replica's tokens reach the client */
    assert_true(fx->c->deps[0].reshard.active);   /* until the old workers are let go */
    tick_alive(fx, t + 400);
    expect_nothing(fx->dealer[old], 10);          /* it keeps its weights a moment */
    tick_alive(fx, t + 500);
    assert_false(fx->c->deps[0].reshard.active);
    tick_alive(fx, t + 1450);                     /* no plan gave it a piece: it lets go */
    tsr_env_t *env = expect_kind(fx->dealer[old], TESSERA__ENVELOPE__BODY_UNASSIGN);
    tsr_env_free(&env);
    assert_int_equal(fx->c->stats.requests_failed, 0);
    assert_int_equal(fx->c->stats.requests_replayed, 0);
    dj = dep_status(fx, &root);
    json_t *rs = json_object_get(dj, "reshard");
    assert_string_equal(json_string_value(json_object_get(rs, "doing")), "");
    assert_non_null(strstr(json_string_value(json_object_get(rs, "last")),
                           "tp 2 x pp 1 x 1 replaced tp 1 x pp 1 x 1 after its pieces loaded beside it"));
    json_decref(root);
}

static int switch_standbys(fx_t *fx, const int *sb, int n_sb, uint64_t epoch, int64_t t);

/* An old worker finishing its requests in place dies: they resume on the new cut from
 * their tokens (nothing fails), and it is let go. */
static void test_a_finishing_old_worker_that_dies_moves_its_requests_to_the_new_cut(void **state)
{
    fx_t *fx = *state;
    int old = one_replica_then_tp2(fx);
    int64_t t = plan_time(fx);
    tick_alive(fx, t);
    int sb[NW];
    uint64_t epoch = 0;
    assert_int_equal(take_standbys(fx, sb, &epoch), 2);
    uint64_t id = request_to(fx, 0);
    send_token(fx, old, id, 0, false);
    pump(fx);
    assert_int_equal(switch_standbys(fx, sb, 2, epoch, t + 100), 0);
    assert_true(tsr_registry_find(fx->c->reg, fx->name[old])->finishing);
    int leader = -1;
    for (int k = 0; k < 2; k++) {
        send_ready(fx, sb[k], fx->c->epoch);
        if (tsr_registry_find(fx->c->reg, fx->name[sb[k]])->piece.key.tp == 0) leader = sb[k];
    }
    pump(fx);
    for (int i = 0; i < NW; i++)
        tsr_registry_find(fx->c->reg, fx->name[i])->last_seen_ms = i == old ? t - 5000 : t + 2000;
    tsr_coord_tick(fx->c, t + 2000);
    tick_alive(fx, t + 2100);
    tsr_env_t *env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_GENERATE);
    assert_int_equal(env->generate->n_prompt, 4);   /* resumed from its token */
    tsr_env_free(&env);
    assert_false(tsr_registry_find(fx->c->reg, fx->name[old])->finishing);
    assert_int_equal(fx->c->stats.requests_failed, 0);
}

/* A standby lost before the switch (it dies): the new cut applies at once, as
 * without idle workers, and status says why. */
static void test_a_lost_standby_makes_the_new_cut_apply_at_once(void **state)
{
    fx_t *fx = *state;
    one_replica_then_tp2(fx);
    int64_t t = plan_time(fx);
    tick_alive(fx, t);
    int sb[NW];
    uint64_t epoch = 0;
    assert_int_equal(take_standbys(fx, sb, &epoch), 2);
    for (int i = 0; i < NW; i++)
        tsr_registry_find(fx->c->reg, fx->name[i])->last_seen_ms = i == sb[0] ? t - 5000 : t + 2000;
    tsr_coord_tick(fx->c, t + 2000);
    tick_alive(fx, t + 2100);
    assert_int_equal(fx->c->cfg->deployments[0].tensor, 2);
    char want[64];
    snprintf(want, sizeof want, "standby %s died", fx->name[sb[0]]);
    assert_non_null(strstr(fx->c->deps[0].reshard.last, want));
    assert_false(fx->c->deps[0].reshard.active);
}

/* Without idle workers for one replica of the new cut, and no second replica to make
 * room, the cut applies at once (the old behaviour) and status says why, with the
 * counts. */
static void test_a_new_cut_without_idle_workers_for_it_applies_at_once(void **state)
{
    fx_t *fx = *state;
    cluster_ready(fx);                      /* tp 2 x pp 2: four busy, one idle */
    layout = "      tensor: 2\n      pipeline: 1\n      replicas: 1\n";
    reconfigure(fx, NULL);
    assert_int_equal(fx->c->cfg->deployments[0].tensor, 2);
    assert_int_equal(fx->c->cfg->deployments[0].pipeline, 1);
    assert_false(fx->c->deps[0].reshard.active);
    assert_non_null(strstr(fx->c->deps[0].reshard.last,
                           "needs more idle workers (2, 1 idle, and 1 replica(s) serving)"));
}

/* Registers every fake worker on node "a" and has the first plan place tp 1 x n
 * replicas, all ready. */
/* Every fake worker registers on node a; the first plan places `pieces` pieces, which
 * load. */
static void register_all_and_load(fx_t *fx, int pieces)
{
    for (int i = 0; i < NW; i++) send_register(fx, i, fx->name[i], "a", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    for (int i = 0; i < NW; i++) {
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        tsr_env_free(&env);
    }
    tsr_coord_tick(fx->c, plan_time(fx));
    assert_int_equal(take_assigns(fx), pieces);
    all_ready(fx);
}

static void one_node_tp1_replicas(fx_t *fx, int n)
{
    static char lay[96];
    snprintf(lay, sizeof lay, "      tensor: 1\n      pipeline: 1\n      replicas: %d\n", n);
    layout = lay;
    reconfigure(fx, NULL);
    register_all_and_load(fx, n);
}

/* The standbys say ready; the tick after switches: each gets its piece with its peers
 * in a new epoch.  Returns how many workers other than the standbys were sent a piece
 * of the new cut (they load it after the switch). */
static int switched_other[NW];          /* switch_standbys' others: worker index */
static uint64_t switched_epoch;         /* and the epoch they were sent */

static int switch_standbys(fx_t *fx, const int *sb, int n_sb, uint64_t epoch, int64_t t)
{
    for (int k = 0; k < n_sb; k++) send_ready(fx, sb[k], epoch);
    pump(fx);
    tick_alive(fx, t);
    int others = 0;
    for (int i = 0; i < NW; i++) {
        bool standby = false;
        for (int k = 0; k < n_sb; k++) standby |= sb[k] == i;
        tsr_env_t *env;
        while ((env = recv_env(fx->dealer[i], TSR_WIRE_MAX_WORKER, 30))) {
            if (env->body_case == TESSERA__ENVELOPE__BODY_ASSIGN) {
                const Tessera__Assignment *a = env->assign->assignment;
                assert_true(env->epoch > epoch);
                assert_int_equal(a->tp_size, 2);
                if (standby) {
                    assert_int_equal(a->replica, 0);   /* the replica built beside */
                } else {
                    switched_epoch = env->epoch;
                    switched_other[others++] = i;
                }
                assert_int_equal(a->n_peer_workers, 2);
            }
            tsr_env_free(&env);
        }
    }
    return others;
}

/* A reload to layout lay; the next tick sends two standbys (sb, their epoch).  Returns
 * that tick's time. */
static int64_t standbys_for(fx_t *fx, const char *lay, int *sb, uint64_t *epoch)
{
    layout = lay;
    reconfigure(fx, NULL);
    int64_t t = plan_time(fx);
    tick_alive(fx, t);
    *epoch = 0;
    assert_int_equal(take_standbys(fx, sb, epoch), 2);
    return t;
}

/* Idle workers for one replica of the new cut but not both: tp 1 x 2 on five workers
 * (three idle) to tp 2 x 2.  One replica of the new cut is built beside the two old
 * ones, which serve meanwhile; at the switch it is swapped in and the other replica
 * of the new cut loads on workers the old cut frees; nothing fails; status says so. */
static void test_a_new_cut_is_built_one_replica_beside_when_idle_workers_hold_one(void **state)
{
    fx_t *fx = *state;
    one_node_tp1_replicas(fx, 2);
    layout = "      tensor: 2\n      pipeline: 1\n      replicas: 2\n";
    reconfigure(fx, NULL);
    const tsr_deployment_t *d = &fx->c->cfg->deployments[0];
    assert_int_equal(d->tensor, 1);
    assert_int_equal(d->replicas, 2);
    int64_t t = plan_time(fx);
    tick_alive(fx, t);
    int sb[NW];
    uint64_t epoch = 0;
    assert_int_equal(take_standbys(fx, sb, &epoch), 2);   /* one replica of tp 2 */
    json_t *root, *dj = dep_status(fx, &root);
    assert_non_null(strstr(json_string_value(json_object_get(json_object_get(dj, "reshard"), "doing")),
                           "1 of the 2 replicas of tp 2 x pp 1 load on 2 idle worker(s) while "
                           "tp 1 x pp 1 x 2 serves"));
    json_decref(root);
    int old0 = holder_of_replica(fx, 0);
    uint64_t id = request_to(fx, 0);        /* the old replicas serve meanwhile */
    send_token(fx, old0, id, 0, false);
    pump(fx);
    assert_int_equal(switch_standbys(fx, sb, 2, epoch, t + 100), 2);  /* replica 1 loads */
    assert_int_equal(d->tensor, 2);
    assert_int_equal(d->replicas, 2);
    /* the old replica 0 (busy; replica 1's workers are needed) serves on beside the new
     * cut until its other replica serves, then finishes its requests and is let go */
    tsr_worker_t *w0 = tsr_registry_find(fx->c->reg, fx->name[old0]);
    assert_true(w0->finishing && w0->serving);
    assert_int_equal(fx->c->deps[0].reshard.serving, 1);
    send_token(fx, old0, id, 1, true);
    pump(fx);
    tick_alive(fx, t + 200);
    expect_nothing(fx->dealer[old0], 10);   /* it serves still */
    for (int k = 0; k < 2; k++) send_ready(fx, sb[k], switched_epoch);  /* rewired */
    pump(fx);
    /* a new request: the new replica 0 and the old one are both idle, the new one takes
     * it; a second goes to the old one (fewer in flight than the new replica 0) */
    client_replies(fx);                     /* the first request's */
    int n0 = holder_in(fx, "tiny", 0);
    uint64_t a = request_to(fx, 0);
    uint64_t b = start_request(fx, fx->ctl, old0, 0);   /* in its old epoch */
    send_token(fx, old0, b, 0, false);      /* its token reaches the client */
    pump(fx);
    expect_client_token(fx, 0, 40);
    for (int k = 0; k < 2; k++) send_ready(fx, switched_other[k], switched_epoch);
    pump(fx);
    tick_alive(fx, t + 250);                /* the new cut serves whole: old 0 stops */
    assert_false(w0->serving);
    assert_true(w0->finishing);
    send_token(fx, old0, b, 1, true);
    fx->piece[n0].epoch = switched_epoch;
    send_token(fx, n0, a, 0, true);
    pump(fx);
    tick_alive(fx, t + 280);
    assert_false(w0->finishing);
    assert_int_equal(fx->c->stats.requests_failed, 0);
    assert_int_equal(fx->c->stats.requests_replayed, 0);
    tick_alive(fx, t + 300);
    dj = dep_status(fx, &root);
    assert_non_null(strstr(json_string_value(json_object_get(json_object_get(dj, "reshard"), "last")),
                           "after 1 of its replicas loaded beside it"));
    json_decref(root);
    assert_false(fx->c->deps[0].reshard.active);
    tick_alive(fx, t + 1300);               /* no plan gave old 0 a piece: it lets go */
    tsr_env_t *env = expect_kind(fx->dealer[old0], TESSERA__ENVELOPE__BODY_UNASSIGN);
    tsr_env_free(&env);
}

/* As above, with both old replicas busy at the switch: one serves on beside the new
 * cut, the other finishes its request first; plans that run meanwhile cannot place the
 * new cut's other replica, and the one serving goes on (it stops only once that replica
 * loads and serves). */
static void test_an_old_replica_serves_on_while_the_other_finishes(void **state)
{
    fx_t *fx = *state;
    one_node_tp1_replicas(fx, 2);
    int sb[NW];
    uint64_t epoch;
    int64_t t = standbys_for(fx, "      tensor: 2\n      pipeline: 1\n      replicas: 2\n", sb, &epoch);
    int old0 = holder_of_replica(fx, 0), old1 = holder_of_replica(fx, 1);
    uint64_t id0 = request_to(fx, 0), id1 = request_to(fx, 1);
    /* the idle worker takes one rank of the other replica; the other waits for a worker */
    assert_int_equal(switch_standbys(fx, sb, 2, epoch, t + 100), 1);
    tsr_worker_t *w0 = tsr_registry_find(fx->c->reg, fx->name[old0]);
    tsr_worker_t *w1 = tsr_registry_find(fx->c->reg, fx->name[old1]);
    assert_true(w0->serving != w1->serving);
    tsr_worker_t *kept = w0->serving ? w0 : w1, *done = w0->serving ? w1 : w0;
    int hd = w0->serving ? old1 : old0;
    uint64_t idd = w0->serving ? id1 : id0;
    for (int k = 1; k <= 3; k++) {         /* plans run: nothing to place the rest on */
        tick_alive(fx, t + 100 + 100 * k);
        assert_true(kept->serving);
    }
    send_token(fx, hd, idd, 0, true);       /* the other's request ends: it is let go */
    pump(fx);
    tick_alive(fx, t + 500);
    tick_alive(fx, t + 600);
    assert_false(done->finishing);
    assert_true(kept->serving);             /* the rest loads on its worker */
    int loads = 0, unassigns = 0;
    for (int i = 0; i < NW; i++) {          /* every piece says ready in its epoch */
        tsr_env_t *env;
        while ((env = recv_env(fx->dealer[i], TSR_WIRE_MAX_WORKER, 20))) {
            if (env->body_case == TESSERA__ENVELOPE__BODY_ASSIGN) {
                loads += i == hd;
                fx->piece[i].epoch = env->epoch;
            }
            unassigns += i == hd && env->body_case == TESSERA__ENVELOPE__BODY_UNASSIGN;
            tsr_env_free(&env);
        }
    }
    assert_int_equal(loads, 1);
    /* its new piece replaces the old one directly, so the layers both hold stay loaded */
    assert_int_equal(unassigns, 0);
    for (int k = 0; k < 2; k++) send_ready(fx, sb[k], switched_epoch);   /* replica 0 */
    send_ready(fx, switched_other[0], fx->piece[switched_other[0]].epoch);   /* replica 1 */
    send_ready(fx, hd, fx->piece[hd].epoch);
    pump(fx);
    assert_true(kept->serving);
    tick_alive(fx, t + 700);                /* the new cut serves whole */
    assert_false(kept->serving);
    assert_int_equal(fx->c->stats.requests_failed, 0);
    assert_int_equal(fx->c->stats.requests_replayed, 0);
}

/* tp 1 x 2 to tp 2 x 2 with three idle workers: one new replica built beside, and at
 * the switch old replica 0 (a request in flight) serves on beside it.  Returns old
 * replica 0's holder; *id its request, *t the switch's time. */
static int switch_with_an_old_replica_serving(fx_t *fx, uint64_t *id, int64_t *t)
{
    one_node_tp1_replicas(fx, 2);
    int sb[NW];
    uint64_t epoch;
    *t = standbys_for(fx, "      tensor: 2\n      pipeline: 1\n      replicas: 2\n", sb, &epoch);
    int old0 = holder_of_replica(fx, 0);
    *id = request_to(fx, 0);
    assert_int_equal(switch_standbys(fx, sb, 2, epoch, *t + 100), 2);
    for (int k = 0; k < 2; k++) send_ready(fx, sb[k], switched_epoch);
    pump(fx);
    assert_true(tsr_registry_find(fx->c->reg, fx->name[old0])->serving);
    return old0;
}

/* An old replica serving beside a new cut whose piece reports a failure stops at once,
 * its request resumed on the new cut (nothing failed). */
static void test_an_old_replica_serving_beside_stops_when_it_fails(void **state)
{
    fx_t *fx = *state;
    uint64_t id;
    int64_t t;
    int old0 = switch_with_an_old_replica_serving(fx, &id, &t);
    tsr_worker_t *w0 = tsr_registry_find(fx->c->reg, fx->name[old0]);
    send_failed_as(fx, old0, fx->piece[old0].epoch, "a collective broke", false, true);
    pump(fx);
    tick_alive(fx, t + 200);
    assert_false(w0->serving);
    assert_false(w0->finishing);            /* let go: its request moved */
    assert_int_equal(fx->c->stats.requests_replayed, 1);
    assert_int_equal(fx->c->stats.requests_failed, 0);
    (void)id;
}

/* A reload that replaces the change of cut stops the old replicas serving beside it:
 * they finish their requests, taking no new one. */
static void test_old_replicas_serving_beside_stop_on_a_reload(void **state)
{
    fx_t *fx = *state;
    uint64_t id;
    int64_t t;
    int old0 = switch_with_an_old_replica_serving(fx, &id, &t);
    tsr_worker_t *w0 = tsr_registry_find(fx->c->reg, fx->name[old0]);
    layout = "      tensor: 2\n      pipeline: 1\n      replicas: 1\n";
    reconfigure(fx, NULL);                  /* another count: the change of cut ends */
    tick_alive(fx, t + 200);
    assert_false(w0->serving);
    assert_true(w0->finishing);             /* it finishes its request, taking no new one */
    send_token(fx, old0, id, 0, true);
    pump(fx);
    tick_alive(fx, t + 300);
    assert_false(w0->finishing);
    assert_int_equal(fx->c->stats.requests_failed, 0);
    assert_int_equal(fx->c->stats.requests_replayed, 0);
}

/* No idle worker at all, but replicas to spare: tp 1 x 5 to tp 2 x 2, a request on each
 * replica.  Two old replicas are let go (three serve): they take no new request and
 * finish theirs in place (not moved: no replay); once they have, their workers are sent
 * the standbys of one new replica in the same tick, and at the switch the other new
 * replica loads on workers the old cut frees: a replica serves throughout. */
static void test_a_new_cut_lets_old_replicas_go_to_make_room_while_one_serves(void **state)
{
    fx_t *fx = *state;
    one_node_tp1_replicas(fx, NW);
    uint64_t id[NW];
    int holder[NW];
    for (int r = 0; r < NW; r++) {
        id[r] = request_to(fx, r);
        holder[r] = holder_of_replica(fx, r);
    }
    layout = "      tensor: 2\n      pipeline: 1\n      replicas: 2\n";
    reconfigure(fx, NULL);
    const tsr_deployment_t *d = &fx->c->cfg->deployments[0];
    assert_int_equal(d->tensor, 1);
    int64_t t = plan_time(fx);
    tick_alive(fx, t);                      /* two let go, the others serve */
    assert_int_equal(d->replicas, NW - 2);
    for (int r = 0; r < NW; r++) {
        assert_int_equal(tsr_registry_find(fx->c->reg, fx->name[holder[r]])->finishing, r >= NW - 2);
        expect_nothing(fx->dealer[holder[r]], 10);   /* nothing released, nothing cancelled */
        if (r < NW - 2) assert_non_null(tsr_registry_ready_leader(fx->c->reg, d, r));
    }
    tick_alive(fx, t + 100);
    int sb[NW];
    uint64_t epoch = 0;
    assert_int_equal(take_standbys(fx, sb, &epoch), 0);  /* they still finish */
    for (int r = NW - 2; r < NW; r++) {                  /* their requests end */
        send_token(fx, holder[r], id[r], 0, true);
        pump(fx);
    }
    tick_alive(fx, t + 200);                /* let go, and sent the standbys at once */
    for (int r = NW - 2; r < NW; r++) {     /* the standby replaces the old piece directly:
                                               no unassign first, so the layers both hold
                                               stay loaded */
        tsr_env_t *env = expect_kind(fx->dealer[holder[r]], TESSERA__ENVELOPE__BODY_ASSIGN);
        sb[r - (NW - 2)] = holder[r];
        epoch = env->epoch;
        tsr_env_free(&env);
    }
    /* at the switch the three old replicas finish their requests too: the other new
     * replica loads on their workers once they have */
    assert_int_equal(switch_standbys(fx, sb, 2, epoch, t + 300), 0);
    assert_int_equal(d->tensor, 2);
    assert_int_equal(d->replicas, 2);
    for (int r = 0; r < NW - 2; r++) {
        assert_true(tsr_registry_find(fx->c->reg, fx->name[holder[r]])->finishing);
        send_token(fx, holder[r], id[r], 0, true);
        pump(fx);
    }
    tick_alive(fx, t + 400);
    int loads = 0;
    for (int r = 0; r < NW - 2; r++) {
        tsr_env_t *env;
        while ((env = recv_env(fx->dealer[holder[r]], TSR_WIRE_MAX_WORKER, 20))) {
            loads += env->body_case == TESSERA__ENVELOPE__BODY_ASSIGN;
            tsr_env_free(&env);
        }
    }
    assert_int_equal(loads, 2);             /* new replica 1 on two of them */
    assert_int_equal(fx->c->stats.requests_failed, 0);
    assert_int_equal(fx->c->stats.requests_replayed, 0);
    assert_non_null(strstr(fx->c->deps[0].reshard.last, "old replicas let go to make room"));
}

/* Workers let go to make room are held for the new cut's standbys: tiny tp 1 x 4 and
 * `other` (one replica) on five workers, other's worker drained (other is short of
 * one); tiny goes to tp 2 x 2, letting replicas 2 and 3 go, each with a request.  The
 * first to finish waits, out of placement, for the second (other does not take it);
 * then both get the standbys, and other takes neither while they load. */
static void test_workers_let_go_for_a_new_cut_are_held_for_its_standbys(void **state)
{
    fx_t *fx = *state;
    static char other[512];
    snprintf(other, sizeof other, "  - name: other\n    model: %s\n    device: cpu\n"
             "    parallel:\n      tensor: 1\n      pipeline: 1\n      replicas: 1\n"
             "    max_seq_len: 256\n", model_dir);
    char err[1024] = "";
    tsr_env_t *env;
    layout = "      tensor: 1\n      pipeline: 1\n      replicas: 4\n";
    write_yaml_dep(fx->path, fx->wep, fx->cep, "  reserve_spares: 0\n", other);
    if (tsr_coord_reload(fx->c, err, sizeof err) != 0) fail_msg("reload: %s", err);
    register_all_and_load(fx, NW);
    int ho = holder_in(fx, "other", 0);
    assert_int_not_equal(ho, -1);
    env = control(fx, TESSERA__CONTROL_REQUEST__KIND__DRAIN, fx->name[ho]);
    assert_true(env->control_reply->ok);
    tsr_env_free(&env);
    tick_alive(fx, plan_time(fx));          /* other is short of a worker now */
    take_assigns(fx);
    assert_int_equal(holder_in(fx, "other", 0), -1);
    int h2 = holder_in(fx, "tiny", 2), h3 = holder_in(fx, "tiny", 3);
    request_to(fx, 0);                      /* the least loaded replica takes each */
    request_to(fx, 1);
    uint64_t id2 = request_to(fx, 2), id3 = request_to(fx, 3);
    layout = "      tensor: 2\n      pipeline: 1\n      replicas: 2\n";
    write_yaml_dep(fx->path, fx->wep, fx->cep, "  reserve_spares: 0\n", other);
    if (tsr_coord_reload(fx->c, err, sizeof err) != 0) fail_msg("reload: %s", err);
    int64_t t = plan_time(fx);
    tick_alive(fx, t);                      /* replicas 2 and 3 let go */
    assert_true(tsr_registry_find(fx->c->reg, fx->name[h2])->finishing);
    assert_true(tsr_registry_find(fx->c->reg, fx->name[h3])->finishing);
    send_token(fx, h2, id2, 0, true);       /* replica 2's request ends */
    pump(fx);
    tick_alive(fx, t + 100);
    for (int k = 1; k <= 3; k++) {          /* plans run: other does not take it */
        tick_alive(fx, t + 100 + 100 * k);
        expect_nothing(fx->dealer[h2], 10);
    }
    assert_int_equal(holder_in(fx, "other", 0), -1);
    assert_true(tsr_registry_find(fx->c->reg, fx->name[h2])->finishing);
    send_token(fx, h3, id3, 0, true);       /* replica 3's ends: both get the standbys */
    pump(fx);
    tick_alive(fx, t + 600);
    int sb[NW];
    uint64_t epoch = 0;
    assert_int_equal(take_standbys(fx, sb, &epoch), 2);
    for (int k = 0; k < 2; k++) assert_true(sb[k] == h2 || sb[k] == h3);
    tick_alive(fx, t + 700);                /* sent: no longer held, but standbys */
    assert_false(tsr_registry_find(fx->c->reg, fx->name[h2])->finishing);
    for (int k = 1; k <= 3; k++) {          /* loading: other takes neither */
        tick_alive(fx, t + 700 + 100 * k);
        expect_nothing(fx->dealer[h2], 10);
        expect_nothing(fx->dealer[h3], 10);
    }
    assert_int_equal(holder_in(fx, "other", 0), -1);
    assert_int_equal(fx->c->stats.requests_failed, 0);
}

/* A finishing old replica whose requests do not end within 30 s: they move to the new
 * cut (resumed from their tokens, nothing failed) and its worker is let go; one whose
 * worker registers again (its lease lapsed) moves them at once. */
static void test_a_finishing_old_replica_moves_its_requests_after_30_s_or_when_it_registers_again(
    void **state)
{
    fx_t *fx = *state;
    one_node_tp1_replicas(fx, 2);
    uint64_t id0 = request_to(fx, 0), id1 = request_to(fx, 1);
    int h0 = holder_of_replica(fx, 0), h1 = holder_of_replica(fx, 1);
    send_token(fx, h0, id0, 0, false);
    send_token(fx, h1, id1, 0, false);
    pump(fx);
    int sb[NW];
    uint64_t epoch;
    int64_t t = standbys_for(fx, "      tensor: 2\n      pipeline: 1\n      replicas: 1\n", sb, &epoch);
    switch_standbys(fx, sb, 2, epoch, t + 100);
    assert_true(tsr_registry_find(fx->c->reg, fx->name[h0])->finishing);
    assert_true(tsr_registry_find(fx->c->reg, fx->name[h1])->finishing);
    for (int k = 0; k < 2; k++) send_ready(fx, sb[k], fx->c->epoch);
    pump(fx);
    /* h1 registers again from the same process (a lapsed lease): its request moves now */
    send_register(fx, h1, fx->name[h1], "a", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    tick_alive(fx, t + 200);
    assert_false(tsr_registry_find(fx->c->reg, fx->name[h1])->finishing);
    assert_true(tsr_registry_find(fx->c->reg, fx->name[h0])->finishing);
    assert_int_equal(fx->c->stats.requests_replayed, 1);
    /* h0's does not end: 30 s after the switch it moves too */
    tick_alive(fx, t + 100 + 30000 + 100);
    assert_false(tsr_registry_find(fx->c->reg, fx->name[h0])->finishing);
    assert_int_equal(fx->c->stats.requests_replayed, 2);
    assert_int_equal(fx->c->stats.requests_failed, 0);
    assert_false(fx->c->deps[0].reshard.active);
}

/* A piece that is not adopted (its keys differ from the file's) does not choose the
 * cut of an auto deployment: it stays to be chosen. */
static void test_a_piece_not_adopted_does_not_choose_the_auto_cut(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: auto\n      pipeline: auto\n";
    reconfigure(fx, NULL);
    fx->c->plan_after_ms = tsr_now_ms() + 60000;
    Tessera__Assignment a;
    held_piece(&a, 4, 8);
    a.max_seq_len = 128;  /* the file says 256 */
    send_register(fx, 0, "w0", "node0", TSR_PROTOCOL_VERSION, &a, TESSERA__WORKER_STATE__STATE_READY);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[0], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_false(env->register_reply->adopted);
    tsr_env_free(&env);
    assert_false(fx->c->deps[0].layout_chosen);
    assert_int_equal(fx->c->cfg->deployments[0].tensor, 1);
    assert_int_equal(fx->c->cfg->deployments[0].replicas, 1);
}

/* A restarted coordinator with an auto layout takes the cut its workers still hold
 * (adopting their pieces) rather than choosing anew: tp 2 x pp 2 here, where its own
 * rule would give tp 1; a piece of replica 3 makes room for four replicas, and the
 * first plan trims the ones no one holds. */
static void test_a_restarted_auto_deployment_adopts_the_cut_its_workers_hold(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: auto\n      pipeline: auto\n";
    reconfigure(fx, NULL);
    fx->c->plan_after_ms = tsr_now_ms() + 60000;  /* the re-attach grace of a restart */
    Tessera__Assignment a;
    held_piece(&a, 4, 8);
    send_register(fx, 0, "w0", "node0", TSR_PROTOCOL_VERSION, &a, TESSERA__WORKER_STATE__STATE_READY);
    a.replica = 3;
    send_register(fx, 1, "w1", "node0", TSR_PROTOCOL_VERSION, &a, TESSERA__WORKER_STATE__STATE_READY);
    pump(fx);
    for (int i = 0; i < 2; i++) {
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        assert_true(env->register_reply->adopted);
        tsr_env_free(&env);
    }
    const tsr_deployment_t *d = &fx->c->cfg->deployments[0];
    assert_int_equal(d->tensor, 2);
    assert_int_equal(d->pipeline, 2);
    assert_int_equal(d->replicas, 4);
    json_t *root, *dj = dep_status(fx, &root);
    assert_non_null(strstr(json_string_value(json_object_get(dj, "layout_reason")),
                           "taken from the pieces the workers held"));
    json_decref(root);
    /* w1 is gone by the end of the grace: replica 3 is trimmed, replica 0 stays
     * (w0 holds it); the other three workers cannot hold a second replica */
    tsr_registry_find(fx->c->reg, "w1")->state = TSR_W_DEAD;
    for (int i = 2; i < NW; i++)
        send_register(fx, i, fx->name[i], "node1", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    fx->c->plan_after_ms = tsr_now_ms();
    tsr_coord_tick(fx->c, plan_time(fx));
    assert_int_equal(d->replicas, 1);
    assert_true(tsr_registry_find(fx->c->reg, "w0")->has_piece);
}

/* A coordinator told to stop while it starts (the flag a signal handler sets) reads no
 * tokenizer.json: it exits after the read in progress instead of reading them all first.
 * Without the flag the same configuration's tokenizer is read. */
static void test_a_coordinator_stopped_as_it_starts_reads_no_tokenizer(void **state)
{
    fx_t *fx = *state;
    char saved[PATH_MAX], cmd[3 * PATH_MAX], err[512] = "";
    memcpy(saved, model_dir, sizeof saved);
    snprintf(cmd, sizeof cmd, "mkdir %s/tok && cp %s/config.json %s/tok/ && "
             "cp %s/../../tokenizer/tokenizer.json %s/tok/", fx->dir, saved, fx->dir, saved,
             fx->dir);
    assert_int_equal(system(cmd), 0);
    snprintf(model_dir, sizeof model_dir, "%s/tok", fx->dir);
    char path[2][PATH_MAX + 16];
    for (int stop = 0; stop < 2; stop++) {   /* endpoints of their own: inproc names linger */
        char wep[64], cep[64];
        snprintf(wep, sizeof wep, "inproc://stop-w-%d-%d", ++endpoint_seq, stop);
        snprintf(cep, sizeof cep, "inproc://stop-c-%d-%d", endpoint_seq, stop);
        snprintf(path[stop], sizeof path[stop], "%s/stop%d.yaml", fx->dir, stop);
        write_yaml(path[stop], wep, cep, NULL);
    }
    memcpy(model_dir, saved, sizeof saved);
    static volatile sig_atomic_t flag;
    tsr_coord_stop_flag(&flag);
    for (int stop = 0; stop < 2; stop++) {
        flag = stop;
        tsr_coord_t *c = tsr_coord_new(path[stop], 0, err, sizeof err);
        if (!c) fail_msg("tsr_coord_new: %s", err);
        tsr_dep_state_t *d = tsr_coord_dep(c, "tiny");
        assert_non_null(d);
        if (stop) {
            assert_null(d->tok);
            assert_non_null(strstr(d->tok_error, "stopping"));
        } else {
            assert_non_null(d->tok);
        }
        tsr_coord_destroy(&c);
    }
    tsr_coord_stop_flag(NULL);
}

/* Workers that registered the same PCI bus id share a GPU, and NCCL refuses a
 * communicator over one GPU twice: each TP group gets two GPUs (by name alone, the first
 * two workers, on one GPU, would form it). */
static void test_a_tp_group_is_given_distinct_gpus_from_the_registrations(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: 2\n      pipeline: 1\n      replicas: 2\n";
    reconfigure(fx, NULL);
    static const char *bus[NW] = {"0000:10:00.0", "0000:10:00.0", "0000:12:00.0",
                                  "0000:12:00.0", "0000:14:00.0"};
    register_on_gpus(fx, bus);
    for (int r = 0; r < 2; r++) {
        tsr_worker_t *a = tsr_registry_at_slot(fx->c->reg, "tiny", r, 2, 1, 0);
        tsr_worker_t *b = tsr_registry_at_slot(fx->c->reg, "tiny", r, 2, 1, 1);
        assert_non_null(a);
        assert_non_null(b);
        assert_string_not_equal(a->pci_bus_id, b->pci_bus_id);
    }
}

/* A piece of a ready deployment whose data plane broke (a retryable
 * failure, being rewired) leaves the deployment degraded, naming the
 * replica and the reason, not failed: failed is for load errors. */
static void test_a_data_plane_failure_after_ready_is_degraded_not_failed(void **state)
{
    fx_t *fx = *state;
    int leader = cluster_ready(fx);
    int member = a_member(fx, leader);
    send_failed_as(fx, member, fx->piece[member].epoch,
                   "data plane: rank 0 (127.0.0.1:1) did not answer within 3000 ms", false, true);
    pump(fx);
    assert_string_equal(tsr_coord_dep_state(fx->c, 0, tsr_now_ms()), "degraded");
    json_t *root = status(fx);
    json_t *d = json_array_get(json_object_get(root, "deployments"), 0);
    const char *msg = json_string_value(json_object_get(d, "message"));
    assert_non_null(msg);
    assert_non_null(strstr(msg, "replica 0 is being rewired after: data plane: rank 0"));
    json_decref(root);
}

/* The cluster up and every piece ready, in layout lay (NULL: the fixture's
 * tp=2 pp=2); at[stage * tp + tp rank] = the fake worker holding it. */
static void ready_by_place(fx_t *fx, const char *lay, int *at, int pieces)
{
    if (lay) {
        layout = lay;
        reconfigure(fx, NULL);
    }
    cluster_up(fx);
    pieces_ready(fx);
    for (int k = 0; k < pieces; k++) at[k] = -1;
    for (int i = 0; i < NW; i++)
        if (fx->holds[i])
            at[fx->piece[i].stage * (int)fx->piece[i].tp_size + fx->piece[i].tp_rank] = i;
    for (int k = 0; k < pieces; k++) assert_int_not_equal(at[k], -1);
}

/* Fake worker i reports that its group's operation passed its deadline. */
static void send_deadline(fx_t *fx, int i, const char *reason)
{
    send_failed_full(fx, i, fx->piece[i].epoch, reason ? reason : "data plane: deadline", false,
                     true, true);
}

#define TP4 "      tensor: 4\n      pipeline: 1\n      replicas: 1\n"

/* Whether worker i's rank is marked as the one its group waited for. */
static bool waited_for(fx_t *fx, int i)
{
    json_t *root = status(fx);
    bool w = json_is_true(json_object_get(rank_of(root, fx, i), "waited_for"));
    json_decref(root);
    return w;
}

/* A tensor-parallel group of four whose rank 2 stalls: its peers' failures cannot name it
 * (NCCL says "one of the other 3 ranks"), but each reports that an operation passed its
 * deadline (Failed.past_deadline), and the member of the stage that reported nothing is the
 * one they waited for: status marks its rank and the message names its worker.  A failure
 * that is not a deadline (a closed connection) marks no one, and a member that reported one
 * is not marked; the rewire clears the mark. */
static void test_the_rank_a_tp_group_waited_for_is_the_one_that_reported_nothing(void **state)
{
    fx_t *fx = *state;
    int m[4];
    ready_by_place(fx, TP4, m, 4);

    send_failed_full(fx, m[0], fx->piece[m[0]].epoch,
                     "data plane: connection to rank 2 (127.0.0.1:1) closed", false, true, false);
    pump(fx);
    for (int t = 0; t < 4; t++) assert_false(waited_for(fx, m[t]));

    /* until every other member has reported, one only slower to report is not told apart */
    for (int t = 1; t < 4; t += 2) {
        send_deadline(fx, m[t],
                      "data plane: NCCL all-reduce (rank 1 of 4, epoch 3) did not complete "
                      "within 1000 ms: one of the other 3 ranks is dead or stalled");
        pump(fx);
        for (int u = 0; u < 4; u++) assert_int_equal(waited_for(fx, m[u]), t == 3 && u == 2);
    }
    json_t *root = status(fx);
    const char *msg = json_string_value(
        json_object_get(json_array_get(json_object_get(root, "deployments"), 0), "message"));
    char want[128];
    snprintf(want, sizeof want, "its tensor-parallel group waited for %s (stage 0 tp 2), which "
             "reported no failure", fx->name[m[2]]);
    if (!msg || !strstr(msg, want)) fail_msg("message: %s", msg ? msg : "(none)");
    json_decref(root);

    /* the rewire: every member forms again, no one is waited for */
    fx->c->deps[0].retry_at_ms = tsr_now_ms();
    tsr_coord_tick(fx->c, plan_time(fx));
    pump(fx);
    for (int t = 0; t < 4; t++) assert_false(waited_for(fx, m[t]));
}

/* In a pipeline the mark is for a stage's own group: tp=2 pp=2, stage 1's
 * rank 0 reports a deadline and its rank 1 is marked, stage 0 is not.  When
 * stage 0's rank 1, the hand-off neighbour of stage 1's rank 1, is also
 * one its group waited for, either may have held the other up (a rank
 * blocked on a pipeline hand-off looks the same to its group): neither is
 * marked. */
static void test_a_pipeline_marks_only_within_a_stage_and_not_across_a_hand_off(void **state)
{
    fx_t *fx = *state;
    int m[2][2];   /* [stage][tp] */
    ready_by_place(fx, NULL, &m[0][0], 4);
    send_deadline(fx, m[1][0], NULL);
    pump(fx);
    assert_true(waited_for(fx, m[1][1]));
    assert_false(waited_for(fx, m[0][0]));
    assert_false(waited_for(fx, m[0][1]));
    send_deadline(fx, m[0][0], NULL);
    pump(fx);
    assert_false(waited_for(fx, m[1][1]));
    assert_false(waited_for(fx, m[0][1]));
}

/* A member gone (its worker declared dead: no piece, as one not yet
 * registered) is not one that reported: with it missing, the member that
 * has not reported yet is not marked.  tp=4: ranks 0 and 1 report a
 * deadline, rank 3's worker dies; rank 2 stays unmarked. */
static void test_no_mark_while_a_member_of_the_stage_is_gone(void **state)
{
    fx_t *fx = *state;
    int m[4];
    ready_by_place(fx, TP4, m, 4);
    for (int t = 0; t < 2; t++) send_deadline(fx, m[t], NULL);
    send_failed(fx, m[3], fx->piece[m[3]].epoch, "fatal device error: ECC", true);
    pump(fx);
    assert_false(tsr_registry_find(fx->c->reg, fx->name[m[3]])->has_piece);
    assert_false(waited_for(fx, m[2]));
}

/* tp=2 pp=2: stage 1's rank 1 is not marked while its hand-off neighbour,
 * stage 0's rank 1, is gone (it may be what held rank 1 up). */
static void test_no_mark_while_a_hand_off_neighbour_is_gone(void **state)
{
    fx_t *fx = *state;
    int p[2][2];   /* [stage][tp] */
    ready_by_place(fx, NULL, &p[0][0], 4);
    send_failed(fx, p[0][1], fx->piece[p[0][1]].epoch, "fatal device error: ECC", true);
    send_deadline(fx, p[1][0], NULL);
    pump(fx);
    assert_false(waited_for(fx, p[1][1]));
}

/* A coordinator restarted before it rewired learns of a deadline from the
 * registrations (Register.past_deadline): the member of the stage that
 * reported nothing is marked. */
static void test_a_fresh_coordinator_marks_from_the_registrations(void **state)
{
    fx_t *fx = *state;
    for (int k = 0; k < 4; k++) {
        Tessera__Assignment a;
        held_piece_at(&a, k / 2, k % 2);
        bool failed = k == 2;   /* stage 1, tp 0 */
        reg_reason = failed ? "data plane: NCCL all-reduce (rank 0 of 2, epoch 7) did not "
                              "complete within 30000 ms: rank 1 is dead or stalled"
                            : NULL;
        reg_retryable = reg_past_deadline = failed;
        register_adopted(fx, k, &a,
                         failed ? TESSERA__WORKER_STATE__STATE_FAILED
                                : TESSERA__WORKER_STATE__STATE_READY);
    }
    reg_reason = NULL;
    reg_retryable = reg_past_deadline = false;
    for (int k = 0; k < 4; k++)
        assert_int_equal(tsr_coord_waited_for(fx->c, tsr_registry_find(fx->c->reg, fx->name[k])),
                         k == 3);
}

/* The rewiring backoff starts over once the replica it mended is whole
 * again, even while another replica is down: a later fault there is a new
 * one, retried after 2 s, not after a backoff grown by unrelated faults. */
static void test_a_mended_replica_resets_the_rewiring_backoff(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: 1\n      pipeline: 2\n      replicas: 2\n";
    reconfigure(fx, NULL);
    cluster_up(fx);
    pieces_ready(fx);
    int m[2][2] = {{-1, -1}, {-1, -1}};   /* [replica][stage] */
    for (int i = 0; i < NW; i++)
        if (fx->holds[i]) m[fx->piece[i].replica][fx->piece[i].stage] = i;
    tsr_dep_state_t *ds = &fx->c->deps[0];
    assert_int_equal(ds->retry_backoff_ms, 0);

    /* replica 0 breaks in its data plane: rewired in 2 s, the next wait 4 s */
    int64_t t0 = tsr_now_ms();
    send_failed_as(fx, m[0][1], fx->piece[m[0][1]].epoch, "data plane: peer stalled", false, true);
    pump(fx);
    assert_true(ds->retry_at_ms >= t0 + 2000 && ds->retry_at_ms <= tsr_now_ms() + 2000);
    assert_int_equal(ds->retry_backoff_ms, 4000);
    /* replica 1 fails to load (not retried): the deployment stays short */
    send_failed(fx, m[1][0], fx->piece[m[1][0]].epoch, "weights missing", false);
    pump(fx);
    /* the 2 s pass (ticking 2 s ahead would let every heartbeat lapse) */
    ds->retry_at_ms = tsr_now_ms();
    tsr_coord_tick(fx->c, plan_time(fx));
    for (int s = 0; s < 2; s++) {
        tsr_env_t *env = expect_kind(fx->dealer[m[0][s]], TESSERA__ENVELOPE__BODY_ASSIGN);
        assert_true(env->epoch > fx->piece[m[0][s]].epoch);
        send_ready(fx, m[0][s], env->epoch);
        tsr_env_free(&env);
    }
    pump(fx);
    /* replica 0 is whole again: the backoff starts over */
    assert_int_equal(ds->retry_backoff_ms, 0);
    assert_string_equal(tsr_coord_dep_state(fx->c, 0, tsr_now_ms()), "failed");
}

/* A request that arrives while the deployment's only replica is being
 * mended waits for it instead of being refused; one for a deployment that
 * never became ready is refused at once. */
static void test_a_request_arriving_during_an_outage_waits_for_a_replica(void **state)
{
    fx_t *fx = *state;
    /* Never ready: refused with the reason. */
    cluster_up(fx);
    tsr_coord_tick(fx->c, tsr_now_ms());
    send_generate(fx, fx->ctl, 4, 0);
    tsr_env_t *env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_false(env->control_reply->ok);
    assert_non_null(strstr(env->control_reply->error, "has no ready replica"));
    tsr_env_free(&env);

    int leader = pieces_ready(fx);
    int member = a_member(fx, leader);
    send_failed_as(fx, member, fx->piece[member].epoch, "data plane: peer gone", false, true);
    pump(fx);
    send_generate(fx, fx->ctl, 4, 0);
    env = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_true(env->control_reply->ok);
    assert_non_null(strstr(env->control_reply->json, "\"queued\":true"));
    tsr_env_free(&env);
    tsr_coord_tick(fx->c, tsr_now_ms());
    expect_nothing(fx->dealer[leader], 20);
    send_ready(fx, member, fx->piece[member].epoch);
    pump(fx);
    tsr_coord_tick(fx->c, tsr_now_ms());
    env = expect_kind(fx->dealer[leader], TESSERA__ENVELOPE__BODY_GENERATE);
    assert_int_equal(env->generate->n_prompt, 3);
    assert_int_equal(env->generate->max_tokens, 4);
    tsr_env_free(&env);
    assert_int_equal(fx->c->stats.requests_replayed, 0);
}

/* Breaks request wid, on replica r (leader lead[r], last stage last[r]),
 * after its attempt delivered n tokens; returns the next attempt's id at the
 * other replica, or 0 when the request was given up. */
static uint64_t break_after(fx_t *fx, const int *lead, const int *last, int r, uint64_t wid,
                            int n)
{
    for (int k = 0; k < n; k++) send_token(fx, last[r], wid, (uint32_t)k, false);
    pump(fx);
    send_token_error_as(fx, lead[r], wid, "connection to rank 1 closed during recv", true);
    pump(fx);
    tsr_coord_tick(fx->c, tsr_now_ms());
    tsr_env_t *e = next_generate(fx, lead[1 - r]);
    if (!e) return 0;
    uint64_t next = e->generate->request_id;
    tsr_env_free(&e);
    return next;
}

/* The failure the client was sent last (its token replies skipped). */
static void expect_failure(fx_t *fx, const char *what)
{
    tsr_env_t *e;
    while ((e = recv_env(fx->ctl, TSR_WIRE_MAX_WORKER, 200)) && e->control_reply->ok)
        tsr_env_free(&e);
    assert_non_null(e);
    if (!strstr(e->control_reply->error, what)) fail_msg("the failure: %s", e->control_reply->error);
    tsr_env_free(&e);
}

/* max_replays bounds the resumptions in a row without progress: an attempt
 * that delivered two tokens or more (the first may come from the prefill
 * alone) starts the count again, up to four times max_replays in all. */
static void test_max_replays_counts_the_resumptions_since_the_last_progress(void **state)
{
    fx_t *fx = *state;
    layout = "      tensor: 1\n      pipeline: 2\n      replicas: 2\n";
    reconfigure(fx, "  max_replays: 1\n  replay_wait_ms: 0\n");
    cluster_up(fx);
    pieces_ready(fx);
    int lead[2] = {-1, -1}, last[2] = {-1, -1};
    for (int i = 0; i < NW; i++) {
        if (!fx->holds[i]) continue;
        if (fx->piece[i].stage == 0) lead[fx->piece[i].replica] = i;
        else last[fx->piece[i].replica] = i;
    }
    assert_true(lead[0] >= 0 && lead[1] >= 0 && last[0] >= 0 && last[1] >= 0);

    /* Four breaks, each after two new tokens: each is resumed on the other
     * replica; a fifth is one too many in all. */
    uint64_t wid = start_request(fx, fx->ctl, lead[0], 0);   /* both idle: replica 0 */
    for (int k = 0; k < 4; k++) {
        wid = break_after(fx, lead, last, k % 2, wid, 2);
        if (!wid) fail_msg("break %d after two new tokens was not resumed", k + 1);
    }
    assert_int_equal(tsr_requests_at(fx->c, 0)->replays, 4);
    assert_int_equal(tsr_requests_at(fx->c, 0)->n_tokens, 8);
    assert_int_equal(break_after(fx, lead, last, 0, wid, 2), 0);
    assert_int_equal(tsr_requests_count(fx->c), 0);
    expect_failure(fx, "resumed 4 time(s) in all, 4 times coordinator.max_replays 1");

    /* One token, as a prefill gives, is no progress: the second such
     * break is one too many in a row. */
    wid = start_request(fx, fx->ctl, lead[0], 0);
    wid = break_after(fx, lead, last, 0, wid, 1);
    assert_true(wid != 0);
    assert_int_equal(break_after(fx, lead, last, 1, wid, 1), 0);
    assert_int_equal(tsr_requests_count(fx->c), 0);
    expect_failure(fx, "resumed 1 time(s) in a row without progress, coordinator.max_replays 1");
}

/* A failure that is the request's own (a refusal) is not replayed; one that
 * is the replica's is, at most max_replays times. */
static void test_replays_are_bounded_and_refusals_are_not_replayed(void **state)
{
    fx_t *fx = *state;
    reconfigure(fx, "  max_replays: 1\n");
    int leader = cluster_ready(fx);
    uint64_t wid = start_request(fx, fx->ctl, leader, 0);
    const char *stopped = "the replica stopped before serving it";
    send_token_error_as(fx, leader, wid, stopped, true);
    pump(fx);
    /* Resumed at once on the replica, which is still ready. */
    tsr_coord_tick(fx->c, tsr_now_ms());
    tsr_env_t *e = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_true(e->control_reply->ok);
    tsr_env_free(&e);
    while ((e = recv_env(fx->dealer[leader], TSR_WIRE_MAX_WORKER, 50)) &&
           e->body_case != TESSERA__ENVELOPE__BODY_GENERATE)
        tsr_env_free(&e);
    assert_non_null(e);
    wid = e->generate->request_id;
    tsr_env_free(&e);
    /* The second break there in the same epoch is the same fault, not
     * counted: the request waits for the replica to recover (a piece fails
     * and is ready again), and goes back. */
    send_token_error_as(fx, leader, wid, stopped, true);
    pump(fx);
    tsr_coord_tick(fx->c, tsr_now_ms());
    assert_null(next_generate(fx, leader));
    assert_int_equal(tsr_requests_count(fx->c), 1);
    wid = recover_replica(fx, leader);
    while ((e = recv_env(fx->ctl, TSR_WIRE_MAX_WORKER, 50))) tsr_env_free(&e);  /* "resumed" */
    /* The third is one too many. */
    send_token_error_as(fx, leader, wid, stopped, true);
    pump(fx);
    e = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_false(e->control_reply->ok);
    assert_non_null(strstr(e->control_reply->error, "coordinator.max_replays 1"));
    tsr_env_free(&e);
    assert_int_equal(tsr_requests_count(fx->c), 0);

    /* A refusal fails at once. */
    wid = start_request(fx, fx->ctl, leader, 0);
    send_token_error(fx, leader, wid, "the request needs 13 KV blocks");
    pump(fx);
    e = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_false(e->control_reply->ok);
    tsr_env_free(&e);
    assert_int_equal(fx->c->stats.requests_replayed, 2);   /* the repeat included */

    /* With no ready replica, replay_wait_ms 0 gives up at the next tick and
     * says how many tokens were delivered. */
    fx->c->cfg->replay_wait_ms = 0;
    wid = start_request(fx, fx->ctl, leader, 0);
    send_token(fx, sampler(fx), wid, 0, false);
    pump(fx);
    expect_client_token(fx, 0, 40);
    send_failed_as(fx, leader, fx->piece[leader].epoch, "data plane: x", false, true);
    pump(fx);
    tsr_coord_tick(fx->c, tsr_now_ms());
    e = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_false(e->control_reply->ok);
    assert_non_null(strstr(e->control_reply->error, "failed after 1 token(s)"));
    assert_non_null(strstr(e->control_reply->error, "no replica could take it within 0 ms"));
    tsr_env_free(&e);
    assert_int_equal(tsr_requests_count(fx->c), 0);
}

/* Attack 5: a held piece at epoch 2^64-1 wrapped the coordinator's epoch. */
static void test_an_adopted_piece_cannot_wrap_or_leap_the_epoch(void **state)
{
    fx_t *fx = *state;
    uint64_t bad[] = {UINT64_MAX, TSR_EPOCH_MAX + 1, TSR_EPOCH_ADOPT_MAX + 1};
    for (int k = 0; k < 3; k++) {
        Tessera__Assignment a;
        held_piece(&a, 4, 8);
        a.epoch = bad[k];
        send_register(fx, k, fx->name[k], "node0", TSR_PROTOCOL_VERSION, &a,
                      TESSERA__WORKER_STATE__STATE_READY);
        pump(fx);
        tsr_env_t *env = expect_kind(fx->dealer[k], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        assert_true(env->register_reply->accepted);
        assert_false(env->register_reply->adopted);
        assert_non_null(strstr(env->register_reply->reason, "the most a registration may raise"));
        tsr_env_free(&env);
        assert_int_equal(fx->c->epoch, 0);
    }
    /* Up to the bound it is adopted, as after a coordinator restart. */
    Tessera__Assignment a;
    held_piece(&a, 4, 8);
    a.epoch = TSR_EPOCH_ADOPT_MAX;
    send_register(fx, 3, fx->name[3], "node0", TSR_PROTOCOL_VERSION, &a,
                  TESSERA__WORKER_STATE__STATE_READY);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[3], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_true(env->register_reply->adopted);
    tsr_env_free(&env);
    assert_int_equal(fx->c->epoch, TSR_EPOCH_ADOPT_MAX);
}

/* A key holder registering a name of its own again and again from one
 * connection, each time holding a piece at the coordinator's epoch + 2^24,
 * raised the plan epoch 2^24 each time (2,000 registrations: past 2^34)
 * until at 2^53 no plan could be made.  Registrations raise the epoch to at
 * most TSR_EPOCH_ADOPT_MAX in all, adopted pieces or not, and plans go on. */
static void test_registrations_cannot_ratchet_the_epoch(void **state)
{
    fx_t *fx = *state;
    for (int k = 0; k < 200; k++) {
        /* odd k: a layer split the deployment does not have (not adopted);
         * even k: the piece stage 1 tp 1, adopted each time */
        Tessera__Assignment a;
        held_piece(&a, 4, k % 2 ? 7 : 8);
        a.epoch = fx->c->epoch + TSR_EPOCH_ADOPT_MAX;
        send_register(fx, 4, fx->name[4], "node4", TSR_PROTOCOL_VERSION, &a,
                      TESSERA__WORKER_STATE__STATE_READY);
        pump(fx);
        tsr_env_t *env = expect_kind(fx->dealer[4], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        assert_true(env->register_reply->accepted);
        tsr_env_free(&env);
    }
    assert_true(fx->c->epoch <= TSR_EPOCH_ADOPT_MAX);
    /* The others register and are given the remaining pieces in a new epoch. */
    uint64_t before = fx->c->epoch;
    for (int i = 0; i < 3; i++) {
        send_register(fx, i, fx->name[i], "node0", TSR_PROTOCOL_VERSION, NULL, 0);
        pump(fx);
        tsr_env_t *rep = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        tsr_env_free(&rep);
    }
    tsr_coord_tick(fx->c, tsr_now_ms());
    tsr_env_t *env = recv_env(fx->dealer[0], TSR_WIRE_MAX_WORKER, 500);
    assert_non_null(env);
    assert_int_equal(env->body_case, TESSERA__ENVELOPE__BODY_ASSIGN);
    assert_true(env->assign->assignment->epoch > before);
    assert_true(env->assign->assignment->epoch < TSR_EPOCH_MAX);
    tsr_env_free(&env);
}

/* Attack 11: a control request over the size limit, or with a name over its
 * length, got no answer at all. */
static void test_an_oversized_control_request_is_answered_with_the_limit(void **state)
{
    fx_t *fx = *state;
    size_t n = 400000;  /* 3 bytes each packed: over 1 MiB */
    int32_t *prompt = malloc(n * sizeof *prompt);
    assert_non_null(prompt);
    for (size_t i = 0; i < n; i++) prompt[i] = 100000;
    Tessera__ControlRequest q = TESSERA__CONTROL_REQUEST__INIT;
    q.kind = TESSERA__CONTROL_REQUEST__KIND__GENERATE;
    q.deployment = "tiny";
    q.n_prompt = n;
    q.prompt = prompt;
    q.max_tokens = 1;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REQUEST;
    env.control_request = &q;
    send_env(fx->ctl, &env);
    free(prompt);
    pump(fx);
    tsr_env_t *r = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_false(r->control_reply->ok);
    assert_non_null(strstr(r->control_reply->error, "exceeds the limit of 1048576"));
    tsr_env_free(&r);

    /* A 65,536-id prompt (what the CLI allows) is read and refused by rule. */
    n = 65536;
    prompt = calloc(n, sizeof *prompt);
    q.n_prompt = n;
    q.prompt = prompt;
    send_env(fx->ctl, &env);
    free(prompt);
    pump(fx);
    r = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_false(r->control_reply->ok);
    assert_non_null(strstr(r->control_reply->error, "max_seq_len"));
    tsr_env_free(&r);

    char name[201];
    memset(name, 'd', 200);
    name[200] = '\0';
    q.n_prompt = 0;
    q.prompt = NULL;
    q.deployment = name;
    send_env(fx->ctl, &env);
    pump(fx);
    r = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    assert_false(r->control_reply->ok);
    assert_non_null(strstr(r->control_reply->error, "limit 128"));
    tsr_env_free(&r);
}

/* Attack 9: every registration was kept for good; the registry and status
 * grew without bound. */
static void test_workers_are_capped_and_dead_ones_forgotten(void **state)
{
    fx_t *fx = *state;
    char err[512] = "";
    write_yaml(fx->path, fx->wep, fx->cep, "  max_workers: 4\n  dead_worker_ttl_s: 1\n");
    if (tsr_coord_reload(fx->c, err, sizeof err) < 0) fail_msg("reload: %s", err);
    for (int i = 0; i < 4; i++)
        send_register(fx, i, fx->name[i], "node0", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    for (int i = 0; i < 4; i++) {
        tsr_env_t *env = expect_kind(fx->dealer[i], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
        assert_true(env->register_reply->accepted);
        tsr_env_free(&env);
    }
    send_register(fx, 4, fx->name[4], "node0", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    tsr_env_t *env = expect_kind(fx->dealer[4], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_false(env->register_reply->accepted);
    assert_non_null(strstr(env->register_reply->reason, "coordinator.max_workers 4"));
    tsr_env_free(&env);
    assert_int_equal(tsr_registry_size(fx->c->reg), 4);

    /* All four die; a new name takes the place of the one dead longest. */
    int64_t t = scan_time(fx) + TIMEOUT_MS + 500;
    tsr_coord_tick(fx->c, t);
    assert_int_equal(tsr_registry_alive(fx->c->reg), 0);
    send_register(fx, 4, fx->name[4], "node0", TSR_PROTOCOL_VERSION, NULL, 0);
    pump(fx);
    env = expect_kind(fx->dealer[4], TESSERA__ENVELOPE__BODY_REGISTER_REPLY);
    assert_true(env->register_reply->accepted);
    tsr_env_free(&env);
    assert_int_equal(tsr_registry_size(fx->c->reg), 4);
    json_t *st = status(fx);  /* correct at the cap */
    assert_int_equal(json_array_size(json_object_get(st, "workers")), 4);
    json_decref(st);

    /* After dead_worker_ttl_s the dead are forgotten. */
    send_heartbeat(fx, 4, fx->name[4], 1);
    pump(fx);
    tsr_worker_t *w4 = tsr_registry_find(fx->c->reg, fx->name[4]);
    w4->last_seen_ms = t + 1500;  /* alive on the fake clock */
    tsr_coord_tick(fx->c, t + 1500 > fx->c->next_scan_ms ? t + 1500 : fx->c->next_scan_ms);
    assert_int_equal(tsr_registry_size(fx->c->reg), 1);
    assert_non_null(tsr_registry_find(fx->c->reg, fx->name[4]));
    assert_null(tsr_registry_find(fx->c->reg, fx->name[0]));
    st = status(fx);
    assert_int_equal(json_array_size(json_object_get(st, "workers")), 1);
    assert_int_equal(json_integer_value(json_object_get(
                         json_object_get(json_object_get(st, "coordinator"), "stats"),
                         "workers_forgotten")),
                     4);
    json_decref(st);
}

/* The prefix cache's secret differs with the deployment, its model, device, number formats
 * and layout, is the same when asked again, and there is none with prefix_cache: false. */
static void test_prefix_secrets_differ_across_deployments_models_types_and_layouts(void **state)
{
    fx_t *fx = *state;
    tsr_deployment_t d = fx->c->cfg->deployments[0], v;
    uint8_t base[16], again[16], other[16];
    assert_true(tsr_coord_prefix_secret(fx->c, &d, 1, 1, base));
    assert_true(tsr_coord_prefix_secret(fx->c, &d, 1, 1, again));
    assert_memory_equal(base, again, 16);
    for (int k = 0; k < 8; k++) {
        v = d;
        int tp = 1, pp = 1;
        switch (k) {
        case 7: v.weights_dtype = TSR_KV_INT8; break;
        case 0: v.name = "other"; break;
        case 1: v.model_path = "/models/another"; break;
        case 2: v.kv_dtype = TSR_KV_BF16; break;
        case 3: v.matmul_dtype = TSR_KV_BF16; break;
        case 4: tp = 2; break;
        case 5: pp = 2; break;
        default: v.device = TSR_DEVICE_CUDA; break;
        }
        assert_true(tsr_coord_prefix_secret(fx->c, &v, tp, pp, other));
        if (!memcmp(base, other, 16)) fail_msg("change %d gives the same secret", k);
    }
    v = d;
    v.kv_dtype = TSR_KV_F32;    /* auto is the type it stands for on cpu: the same cache */
    d.kv_dtype = TSR_KV_AUTO;
    assert_true(tsr_coord_prefix_secret(fx->c, &d, 1, 1, base));
    assert_true(tsr_coord_prefix_secret(fx->c, &v, 1, 1, other));
    assert_memory_equal(base, other, 16);
    v.prefix_cache = false;
    assert_false(tsr_coord_prefix_secret(fx->c, &v, 1, 1, other));
}

/* ---- routing by prefix ---- */

/* Sends a generate of ids[0..n) to tiny and returns the replica whose leader got it
 * (nrep replicas of tp 1), its id there in *wid. */
static int route_prompt(fx_t *fx, int nrep, const int32_t *ids, int n, uint32_t max_tokens,
                        uint64_t *wid)
{
    send_generate_ids(fx, fx->ctl, ids, n, max_tokens, 0);   /* to gen_deployment, tiny */
    tsr_env_t *e = expect_kind(fx->ctl, TESSERA__ENVELOPE__BODY_CONTROL_REPLY);
    if (!e->control_reply->ok) fail_msg("refused: %s", e->control_reply->error);
    tsr_env_free(&e);
    for (int r = 0; r < nrep; r++) {
        int h = holder_in(fx, "tiny", r);
        assert_int_not_equal(h, -1);
        if ((e = next_generate(fx, h))) {
            *wid = e->generate->request_id;
            tsr_env_free(&e);
            return r;
        }
    }
    fail_msg("no leader got the request");
    return -1;
}

static void prompt_ids(int32_t *ids, int n, int base)
{
    for (int i = 0; i < n; i++) ids[i] = base + i % 200;
}

/* Two replicas: a long prompt goes to the replica that was sent it before, though
 * that one is busier, until it is busier by more than the prefill the cache saves;
 * a prompt that shares nothing goes to the least loaded; with prefix_cache: false the
 * load alone decides. */
static void test_a_request_goes_where_its_prefix_is_cached_unless_that_replica_is_far_busier(
    void **state)
{
    fx_t *fx = *state;
    one_node_tp1_replicas(fx, 2);
    int32_t a[240], b[200];
    uint64_t wid;
    prompt_ids(a, 240, 10);
    prompt_ids(b, 200, 300);
    assert_int_equal(route_prompt(fx, 2, a, 200, 8, &wid), 0);   /* both idle: the first */
    /* r0: load 1, 12 of 13 blocks cached, 0.2 chunks to compute; r1: 1.7 chunks */
    assert_int_equal(route_prompt(fx, 2, a, 220, 8, &wid), 0);
    /* r0: load 2 and 0.4 chunks against load 0 and 1.9: the idle one takes it */
    assert_int_equal(route_prompt(fx, 2, a, 240, 8, &wid), 1);
    /* nothing shared: the least loaded (r0 2, r1 1) */
    assert_int_equal(route_prompt(fx, 2, b, 200, 8, &wid), 1);
}

static void test_with_prefix_cache_off_the_load_alone_routes(void **state)
{
    fx_t *fx = *state;
    static char lay[96];
    snprintf(lay, sizeof lay, "      tensor: 1\n      pipeline: 1\n      replicas: 2\n");
    layout = lay;
    reconfigure_dep(fx, "    prefix_cache: false\n");
    register_all_and_load(fx, 2);
    int32_t a[240];
    uint64_t wid;
    prompt_ids(a, 240, 10);
    assert_int_equal(route_prompt(fx, 2, a, 200, 8, &wid), 0);
    assert_int_equal(route_prompt(fx, 2, a, 220, 8, &wid), 1);
}

/* A finished request's answer is cached where it ran: the next turn (its prompt, its
 * answer and more) goes there though the other replica is idle; after that replica's
 * leader is in a new epoch (its cache starts empty) the load decides again. */
static void test_a_next_turn_goes_where_the_answer_was_computed_until_that_replica_rewires(
    void **state)
{
    fx_t *fx = *state;
    static char lay[96];
    snprintf(lay, sizeof lay, "      tensor: 1\n      pipeline: 1\n      replicas: 2\n");
    layout = lay;
    reconfigure_dep(fx, "    prefill_chunk: 16\n");
    register_all_and_load(fx, 2);
    int32_t turn[60], other[20];
    uint64_t wid, busy;
    prompt_ids(turn, 10, 10);               /* 10 ids: no whole block of its own */
    prompt_ids(other, 20, 400);
    assert_int_equal(route_prompt(fx, 2, turn, 10, 40, &wid), 0);
    int h0 = holder_in(fx, "tiny", 0);
    for (uint32_t k = 0; k < 40; k++) send_token(fx, h0, wid, k, k == 39);   /* 40 .. 79 */
    pump(fx);
    client_replies(fx);
    assert_int_equal(route_prompt(fx, 2, other, 20, 8, &busy), 0);   /* r0 busy: load 1 */
    for (int k = 0; k < 40; k++) turn[10 + k] = 40 + k;              /* the answer */
    for (int k = 50; k < 58; k++) turn[k] = 7;                       /* and more */
    /* r0: 1 + 10/16 chunks (3 blocks of the answer cached); r1: 0 + 58/16 */
    assert_int_equal(route_prompt(fx, 2, turn, 58, 4, &wid), 0);
    /* r0's leader in a new epoch: nothing of it is cached any more */
    tsr_worker_t *l = tsr_registry_find(fx->c->reg, fx->name[h0]);
    l->piece.epoch++;
    assert_int_equal(route_prompt(fx, 2, turn, 58, 4, &wid), 1);
}

int main(void)
{
    tsr_log_init("test", TSR_LOG_ERROR + 1);
    const struct CMUnitTest tests[] = {
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
        T(test_register_is_accepted_with_heartbeat_interval_and_lease),
        T(test_first_tick_assigns_four_distinct_pieces_and_leaves_one_spare),
        T(test_assign_carries_the_model_path_and_deployment),
        T(test_register_with_protocol_version_99_is_refused),
        T(test_same_name_from_another_node_while_alive_is_refused_as_duplicate),
        T(test_ready_with_current_epoch_makes_worker_ready),
        T(test_piece_messages_with_older_epoch_are_dropped_and_counted),
        T(test_heartbeat_is_acked_with_same_seq_and_counted),
        T(test_heartbeat_from_unknown_name_gets_reset_keeping_assignment),
        T(test_heartbeats_under_a_live_workers_name_from_another_connection_are_dropped),
        T(test_registration_under_a_live_name_from_another_connection_is_refused_whatever_pid),
        T(test_a_failure_sent_for_another_worker_is_dropped),
        T(test_worker_silent_past_timeout_is_dead_and_its_heartbeat_gets_reset_dropping_piece),
        T(test_dead_holders_piece_moves_to_the_spare),
        T(test_fatal_failure_kills_the_worker_at_once_and_its_piece_moves),
        T(test_nonfatal_failure_marks_worker_failed_and_deployment_failed_in_status),
        T(test_fresh_coordinator_adopts_a_piece_matching_the_layout),
        T(test_a_burst_of_the_same_registration_is_logged_once),
        T(test_a_fresh_coordinator_rewires_an_adopted_failed_piece),
        T(test_fresh_coordinator_does_not_adopt_a_wrong_layer_range),
        T(test_fresh_coordinator_does_not_adopt_a_piece_with_other_keys),
        T(test_a_piece_with_another_timeout_or_queue_is_adopted_and_sent_the_files),
        T(test_status_json_has_the_documented_fields),
        T(test_status_shows_each_pieces_kv_pool_and_queue_from_its_heartbeat),
        T(test_a_heartbeat_with_a_nan_or_infinite_load_keeps_the_status_valid_json),
        T(test_a_request_whose_replica_breaks_is_resumed_from_its_delivered_tokens),
        T(test_a_deployment_that_was_ready_is_degraded_even_if_nobody_looked),
        T(test_replays_are_bounded_and_refusals_are_not_replayed),
        T(test_a_request_arriving_during_an_outage_waits_for_a_replica),
        T(test_a_lost_token_makes_the_request_resume_not_skip),
        T(test_a_mended_replica_resets_the_rewiring_backoff),
        T(test_a_data_plane_failure_after_ready_is_degraded_not_failed),
        T(test_the_rank_a_tp_group_waited_for_is_the_one_that_reported_nothing),
        T(test_a_pipeline_marks_only_within_a_stage_and_not_across_a_hand_off),
        T(test_a_fresh_coordinator_marks_from_the_registrations),
        T(test_no_mark_while_a_member_of_the_stage_is_gone),
        T(test_no_mark_while_a_hand_off_neighbour_is_gone),
        T(test_nvlink_domains_come_from_registrations_and_hold_the_tp_groups),
        T(test_a_tp_group_left_across_nodes_by_a_failover_is_shown),
        T(test_parallel_auto_on_cpu_gives_every_worker_a_replica),
        T(test_tensor_auto_cuts_the_model_as_little_as_the_gpus_need),
        T(test_auto_with_gpus_too_small_waits_and_says_why),
        T(test_auto_with_a_latency_target_no_cut_meets_waits),
        T(test_auto_estimates_use_the_rates_the_workers_give),
        T(test_auto_estimates_meet_a_target_with_a_core_per_thread),
        T(test_auto_estimates_share_a_nodes_cores_among_the_threads),
        T(test_a_restarted_auto_deployment_adopts_the_cut_its_workers_hold),
        T(test_a_reload_of_auto_replicas_rewires_every_replica),
        T(test_a_reload_to_int8_weights_chooses_the_auto_cut_again),
        T(test_replicas_grow_when_the_queue_wait_stays_above_the_threshold),
        T(test_replicas_shrink_after_idle_draining_the_last_first),
        T(test_a_drain_that_outlasts_its_limit_moves_the_requests_not_fails_them),
        T(test_the_replica_that_serves_alone_is_not_drained),
        T(test_a_range_keeps_its_count_across_a_restart_and_from_a_fixed_count),
        T(test_idle_workers_go_to_the_first_deployment_and_spares_stay_for_failover),
        T(test_a_group_left_across_nodes_moves_back_make_before_break),
        T(test_moving_back_waits_for_an_idle_replica),
        T(test_moving_back_is_off_at_interval_0),
        T(test_a_standby_is_not_adopted_by_a_restarted_coordinator),
        T(test_a_new_cut_is_built_beside_the_running_one),
        T(test_a_lost_standby_makes_the_new_cut_apply_at_once),
        T(test_a_finishing_old_worker_that_dies_moves_its_requests_to_the_new_cut),
        T(test_a_new_cut_without_idle_workers_for_it_applies_at_once),
        T(test_a_new_cut_is_built_one_replica_beside_when_idle_workers_hold_one),
        T(test_an_old_replica_serves_on_while_the_other_finishes),
        T(test_an_old_replica_serving_beside_stops_when_it_fails),
        T(test_old_replicas_serving_beside_stop_on_a_reload),
        T(test_a_new_cut_lets_old_replicas_go_to_make_room_while_one_serves),
        T(test_workers_let_go_for_a_new_cut_are_held_for_its_standbys),
        T(test_a_finishing_old_replica_moves_its_requests_after_30_s_or_when_it_registers_again),
        T(test_a_piece_not_adopted_does_not_choose_the_auto_cut),
        T(test_a_tp_group_left_across_nvlink_domains_is_shown),
        T(test_a_tp_group_is_given_distinct_gpus_from_the_registrations),
        T(test_a_coordinator_stopped_as_it_starts_reads_no_tokenizer),
        T(test_a_rendezvous_blob_is_relayed_to_the_replicas_members_in_its_epoch),
        cmocka_unit_test(test_a_piece_leads_its_stage_tp_group_at_rank_0_even_alone),
        T(test_assignments_carry_the_peers_gpus_and_a_bad_bus_id_is_refused),
        T(test_a_member_adopted_back_into_a_rewired_replica_rewires_it),
        T(test_the_next_attempt_avoids_the_replica_that_failed_it),
        T(test_max_replays_counts_the_resumptions_since_the_last_progress),
        T(test_a_replica_that_fails_a_request_twice_is_waited_for),
        T(test_cuda_kv_budget_is_the_replicas_tightest_and_is_kept),
        T(test_a_silent_replica_is_found_by_its_canary),
        T(test_an_unhealthy_replica_is_rewired_after_the_backoff),
        T(test_a_busy_replica_past_its_canary_does_not_make_the_loop_spin),
        T(test_a_busy_replica_that_stops_streaming_is_found_by_its_canary),
        T(test_a_busy_replica_whose_steps_advance_without_tokens_is_not_canaried),
        T(test_an_idle_replica_whose_workers_finished_steps_gets_its_canary),
        T(test_a_workers_first_step_count_is_not_a_step),
        T(test_reload_of_broken_yaml_is_refused_with_position_and_keeps_config),
        T(test_reload_that_changes_an_endpoint_is_refused),
        T(test_reload_retries_pieces_that_failed_to_load_with_a_new_epoch),
        T(test_reload_retries_a_replicas_failed_ranks_in_one_epoch),
        T(test_a_reload_keeps_an_unhealthy_replica_unhealthy_and_its_backoff),
        T(test_assign_carries_the_batching_keys_from_the_file),
        T(test_reload_that_changes_a_batching_key_resends_every_assignment),
        T(test_control_status_returns_ok_with_the_status_json),
        T(test_control_drain_of_unknown_worker_fails_with_a_message),
        T(test_control_drain_of_a_holder_moves_its_piece_to_the_spare),
        T(test_non_control_envelope_on_control_socket_is_refused),
        T(test_a_request_past_its_deadline_fails_and_is_cancelled_at_the_leader),
        T(test_a_request_without_a_deadline_never_expires),
        T(test_a_client_that_goes_away_mid_stream_gets_its_request_cancelled),
        T(test_a_slow_client_is_not_taken_for_a_gone_one),
        T(test_a_reply_to_an_unknown_client_is_reported_gone),
        T(test_max_tokens_and_timeout_out_of_range_are_refused),
        T(test_tokens_only_from_the_last_stage_errors_only_from_the_replica),
        T(test_request_ids_are_random_not_sequential),
        T(test_an_adopted_piece_cannot_wrap_or_leap_the_epoch),
        T(test_registrations_cannot_ratchet_the_epoch),
        T(test_an_oversized_control_request_is_answered_with_the_limit),
        T(test_workers_are_capped_and_dead_ones_forgotten),
        T(test_a_request_goes_where_its_prefix_is_cached_unless_that_replica_is_far_busier),
        T(test_with_prefix_cache_off_the_load_alone_routes),
        T(test_prefix_secrets_differ_across_deployments_models_types_and_layouts),
        T(test_a_next_turn_goes_where_the_answer_was_computed_until_that_replica_rewires),
#undef T
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tsr_zmq_term();
    return rc;
}
