/* test_agent.c: the worker's side of the control protocol (worker/agent.c)
 * against a fake coordinator, a ROUTER on an inproc endpoint in the same
 * process.  Every tsr_agent_step gets its time passed in (t0 + an offset), so
 * backoff, heartbeat and lease timing are checked without sleeping. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include "testutil.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/wire.h"
#include "cli/cli.h"
#include "fake_nccl.h"
#include "worker/agent.h"
#include "worker/device.h"
#include "worker/engine.h"
#include "worker/executor.h"

/* ---- fixture ----------------------------------------------------------------- */

typedef struct {
    char endpoint[64];
    void *router;               /* the fake coordinator */
    tsr_agent_t *a;
    int64_t t0;
    uint8_t rid[256];           /* the agent's routing id, from its first message */
    size_t rid_len;
} fx_t;

static char model_dir[PATH_MAX];
static int endpoint_seq;

static void find_model_dir(void) { tsr_test_tiny_model_dir(model_dir); }

static int setup(void **state)
{
    if (!model_dir[0]) find_model_dir();
    fx_t *fx = calloc(1, sizeof *fx);
    assert_non_null(fx);
    char err[256] = "";
    snprintf(fx->endpoint, sizeof fx->endpoint, "inproc://ta-%d", ++endpoint_seq);
    fx->router = tsr_sock_router(fx->endpoint, err, sizeof err);
    if (!fx->router) fail_msg("router: %s", err);
    tsr_device_info_t dev;
    if (tsr_device_probe(TSR_DEVICE_CPU, 0, &dev, err, sizeof err) < 0)
        fail_msg("device probe: %s", err);
    fx->a = tsr_agent_new("w-test", "node-test", fx->endpoint, NULL, &dev, err, sizeof err);
    if (!fx->a) fail_msg("tsr_agent_new: %s", err);
    fx->t0 = tsr_now_ms();
    *state = fx;
    return 0;
}

static int teardown(void **state)
{
    fx_t *fx = *state;
    tsr_agent_destroy(&fx->a);
    assert_null(fx->a);
    tsr_sock_close(&fx->router);
    free(fx);
    return 0;
}

/* ---- helpers ------------------------------------------------------------------- */

static void step(fx_t *fx, int64_t t)
{
    tsr_agent_step(fx->a, fx->t0 + t);
}

/* The next message the agent sent, or NULL after ms. */
static tsr_env_t *from_agent(fx_t *fx, int ms)
{
    if (!tsr_test_readable(fx->router, ms)) return NULL;
    tsr_env_t *env = NULL;
    char err[256] = "";
    uint8_t rid[256];
    size_t rid_len = 0;
    int rc = tsr_wire_recv(fx->router, rid, &rid_len, TSR_WIRE_MAX_WORKER, &env, err, sizeof err);
    if (rc < 0) fail_msg("bad message from the agent: %s", err);
    assert_int_equal(rc, 1);
    memcpy(fx->rid, rid, rid_len);
    fx->rid_len = rid_len;
    assert_int_equal(env->protocol_version, TSR_PROTOCOL_VERSION);
    assert_string_equal(env->worker, "w-test");
    return env;
}

/* The next message, which must be of `kind`; heartbeats in between are
 * skipped when skip_hb. */
static tsr_env_t *expect_kind(fx_t *fx, Tessera__Envelope__BodyCase kind, bool skip_hb)
{
    for (;;) {
        tsr_env_t *env = from_agent(fx, 500);
        if (!env) fail_msg("no message from the agent (expected body %d)", kind);
        if (skip_hb && kind != TESSERA__ENVELOPE__BODY_HEARTBEAT &&
            env->body_case == TESSERA__ENVELOPE__BODY_HEARTBEAT) {
            tsr_env_free(&env);
            continue;
        }
        if (env->body_case != kind) fail_msg("expected body %d, got %s", kind, tsr_env_kind(env));
        return env;
    }
}

static void expect_nothing(fx_t *fx, bool skip_hb)
{
    tsr_env_t *env;
    while ((env = from_agent(fx, 20)) != NULL) {
        if (skip_hb && env->body_case == TESSERA__ENVELOPE__BODY_HEARTBEAT) {
            tsr_env_free(&env);
            continue;
        }
        char kind[32];
        snprintf(kind, sizeof kind, "%s", tsr_env_kind(env));
        tsr_env_free(&env);
        fail_msg("expected no message from the agent, got %s", kind);
    }
}

/* Sends env to the agent and waits until it can be read there. */
static void to_agent(fx_t *fx, tsr_env_t *env)
{
    assert_true(fx->rid_len > 0);
    assert_int_equal(tsr_wire_send(fx->router, fx->rid, fx->rid_len, env), 0);
    assert_true(tsr_test_readable(fx->a->sock, 500));
}

static void send_register_reply(fx_t *fx, bool accepted, uint32_t hb, uint32_t lease,
                                const char *reason)
{
    Tessera__RegisterReply r = TESSERA__REGISTER_REPLY__INIT;
    r.accepted = accepted;
    r.heartbeat_interval_ms = hb;
    r.lease_ms = lease;
    r.reason = (char *)(reason ? reason : "");
    r.coordinator_protocol = TSR_PROTOCOL_VERSION;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = "w-test";
    env.body_case = TESSERA__ENVELOPE__BODY_REGISTER_REPLY;
    env.register_reply = &r;
    to_agent(fx, &env);
}

static void tiny_piece(Tessera__Assignment *a, uint64_t epoch, const char *model)
{
    Tessera__Assignment init = TESSERA__ASSIGNMENT__INIT;
    *a = init;
    a->deployment = "tiny";
    a->epoch = epoch;
    a->replica = 0;
    a->stage = 0;
    a->tp_rank = 1;
    a->tp_size = 2;
    a->pp_size = 2;
    a->layer_begin = 0;
    a->layer_end = 4;
    a->model_path = (char *)model;
    a->max_seq_len = 256;
}

static void send_assign(fx_t *fx, Tessera__Assignment *a)
{
    Tessera__Assign as = TESSERA__ASSIGN__INIT;
    as.assignment = a;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = "w-test";
    env.epoch = a->epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_ASSIGN;
    env.assign = &as;
    to_agent(fx, &env);
}

static void send_reset(fx_t *fx, bool keep)
{
    Tessera__Reset r = TESSERA__RESET__INIT;
    r.reason = "test";
    r.keep_assignment = keep;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = "w-test";
    env.body_case = TESSERA__ENVELOPE__BODY_RESET;
    env.reset = &r;
    to_agent(fx, &env);
}

static void send_ack(fx_t *fx, uint64_t seq)
{
    Tessera__HeartbeatAck ack = TESSERA__HEARTBEAT_ACK__INIT;
    ack.seq = seq;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = "w-test";
    env.body_case = TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK;
    env.heartbeat_ack = &ack;
    to_agent(fx, &env);
}

/* Brings the agent to REGISTERED at t0+10 (heartbeat 100 ms, lease 1000 ms)
 * and consumes its Register and first heartbeat. */
static void registered(fx_t *fx)
{
    step(fx, 0);
    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false);
    tsr_env_free(&env);
    send_register_reply(fx, true, 100, 1000, NULL);
    step(fx, 10);
    assert_int_equal(fx->a->phase, TSR_A_REGISTERED);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_HEARTBEAT, false);
    tsr_env_free(&env);
}

/* Registered and holding the tiny piece at epoch 5, READY, at t0+20. */
static void holding_epoch_5(fx_t *fx)
{
    registered(fx);
    Tessera__Assignment a;
    tiny_piece(&a, 5, model_dir);
    send_assign(fx, &a);
    step(fx, 20);
    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_PROGRESS, true);
    tsr_env_free(&env);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_READY, true);
    tsr_env_free(&env);
    assert_true(fx->a->has_piece);
    assert_int_equal(fx->a->state, TESSERA__WORKER_STATE__STATE_READY);
}

/* ---- registration ------------------------------------------------------------------- */

static void test_first_step_sends_register_describing_the_worker(void **state)
{
    fx_t *fx = *state;
    expect_nothing(fx, false);  /* nothing before the first step */
    step(fx, 0);
    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false);
    const Tessera__Register *r = env->register_;
    assert_string_equal(r->node, "node-test");
    assert_int_equal(r->device, TESSERA__DEVICE_KIND__DEVICE_CPU);
    assert_int_equal(r->pid, (uint32_t)getpid());
    assert_string_equal(r->software_version, TSR_SOFTWARE_VERSION);
    assert_true(r->device_memory > 0);
    assert_null(r->assignment);
    assert_int_equal(env->epoch, 0);
    tsr_env_free(&env);
    assert_true(fx->rid_len > 0);
    assert_int_equal(fx->a->phase, TSR_A_REGISTERING);
}

static void test_unanswered_register_is_resent_with_growing_backoff(void **state)
{
    fx_t *fx = *state;
    step(fx, 0);
    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false);
    tsr_env_free(&env);

    step(fx, 100);
    step(fx, 249);
    expect_nothing(fx, false);          /* not before 250 ms */
    step(fx, 250);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false);
    tsr_env_free(&env);

    step(fx, 250 + 499);
    expect_nothing(fx, false);          /* the next wait is longer: 500 ms */
    step(fx, 250 + 500);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false);
    tsr_env_free(&env);

    step(fx, 750 + 999);
    expect_nothing(fx, false);          /* then 1000 ms, the cap */
    step(fx, 750 + 1000);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false);
    tsr_env_free(&env);
    step(fx, 1750 + 999);
    expect_nothing(fx, false);
    step(fx, 1750 + 1000);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false);
    tsr_env_free(&env);
}

static void test_accepted_register_reply_starts_heartbeats_at_the_given_interval(void **state)
{
    fx_t *fx = *state;
    step(fx, 0);
    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false);
    tsr_env_free(&env);
    send_register_reply(fx, true, 50, 5000, NULL);
    step(fx, 10);
    assert_int_equal(fx->a->phase, TSR_A_REGISTERED);
    assert_int_equal(fx->a->hb_interval_ms, 50);
    assert_int_equal(fx->a->lease_ms, 5000);
    assert_false(fx->a->stop);

    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_HEARTBEAT, false);
    assert_int_equal(env->heartbeat->seq, 1);
    assert_int_equal(env->heartbeat->state, TESSERA__WORKER_STATE__STATE_IDLE);
    assert_true(env->heartbeat->memory_used > 0);  /* its resident memory */
    assert_true(env->heartbeat->load >= 0.0f && env->heartbeat->load <= 1.0f);
    tsr_env_free(&env);

    step(fx, 59);
    expect_nothing(fx, false);
    step(fx, 60);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_HEARTBEAT, false);
    assert_int_equal(env->heartbeat->seq, 2);
    tsr_env_free(&env);
    step(fx, 110);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_HEARTBEAT, false);
    assert_int_equal(env->heartbeat->seq, 3);
    tsr_env_free(&env);
    /* Registered: no more Register messages, however long it runs. */
    step(fx, 1000);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_HEARTBEAT, false);
    tsr_env_free(&env);
    expect_nothing(fx, false);
}

static void test_refused_register_reply_stops_the_agent_with_exit_code_2(void **state)
{
    fx_t *fx = *state;
    step(fx, 0);
    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false);
    tsr_env_free(&env);
    send_register_reply(fx, false, 100, 1000, "protocol version 1 is not supported");
    step(fx, 10);
    assert_true(fx->a->stop);
    assert_int_equal(fx->a->exit_code, 2);
    assert_int_equal(fx->a->phase, TSR_A_REGISTERING);
    step(fx, 2000);
    expect_nothing(fx, false);  /* a stopped agent sends nothing more */
}

/* ---- assignments ------------------------------------------------------------------------ */

static void test_assign_for_tiny_model_reports_progress_then_ready_with_its_epoch(void **state)
{
    fx_t *fx = *state;
    registered(fx);
    Tessera__Assignment a;
    tiny_piece(&a, 5, model_dir);
    send_assign(fx, &a);
    step(fx, 20);

    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_PROGRESS, true);
    assert_int_equal(env->epoch, 5);
    tsr_env_free(&env);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_READY, true);
    assert_int_equal(env->epoch, 5);
    tsr_env_free(&env);

    assert_true(fx->a->has_piece);
    assert_int_equal(fx->a->state, TESSERA__WORKER_STATE__STATE_READY);
    assert_int_equal(fx->a->piece.epoch, 5);
    assert_string_equal(fx->a->piece.deployment, "tiny");
    assert_string_equal(fx->a->piece.model_path, model_dir);
    assert_int_equal(fx->a->piece.tp_rank, 1);
    assert_int_equal(fx->a->piece.layer_end, 4);

    /* Heartbeats now report the piece's state and epoch. */
    step(fx, 200);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_HEARTBEAT, false);
    assert_int_equal(env->heartbeat->state, TESSERA__WORKER_STATE__STATE_READY);
    assert_int_equal(env->epoch, 5);
    tsr_env_free(&env);
}

static void test_assign_without_config_json_reports_nonfatal_failure_naming_it(void **state)
{
    fx_t *fx = *state;
    char dir[] = "/tmp/tsr-agent-XXXXXX";
    assert_non_null(mkdtemp(dir));
    registered(fx);
    Tessera__Assignment a;
    tiny_piece(&a, 5, dir);
    send_assign(fx, &a);
    step(fx, 20);
    rmdir(dir);

    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_PROGRESS, true);
    tsr_env_free(&env);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_FAILED, true);
    assert_int_equal(env->epoch, 5);
    assert_false(env->failed->fatal);
    assert_non_null(strstr(env->failed->reason, "config.json"));
    tsr_env_free(&env);
    assert_int_equal(fx->a->state, TESSERA__WORKER_STATE__STATE_FAILED);
    assert_non_null(strstr(fx->a->reason, "config.json"));
}

static void test_assign_with_older_epoch_is_dropped_and_counted(void **state)
{
    fx_t *fx = *state;
    holding_epoch_5(fx);
    Tessera__Assignment a;
    tiny_piece(&a, 3, model_dir);
    a.stage = 1;
    a.layer_begin = 4;
    a.layer_end = 8;
    send_assign(fx, &a);
    step(fx, 30);
    expect_nothing(fx, true);   /* no Progress/Ready for a stale piece */
    assert_int_equal(fx->a->stale_dropped, 1);
    assert_true(fx->a->has_piece);
    assert_int_equal(fx->a->piece.epoch, 5);
    assert_int_equal(fx->a->piece.stage, 0);
    assert_int_equal(fx->a->piece.layer_begin, 0);
    assert_int_equal(fx->a->state, TESSERA__WORKER_STATE__STATE_READY);
}

static void test_assign_while_registering_is_ignored(void **state)
{
    fx_t *fx = *state;
    step(fx, 0);
    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false);
    tsr_env_free(&env);
    Tessera__Assignment a;
    tiny_piece(&a, 5, model_dir);
    send_assign(fx, &a);
    step(fx, 10);
    expect_nothing(fx, false);
    assert_false(fx->a->has_piece);
}

static void test_unassign_makes_the_agent_idle(void **state)
{
    fx_t *fx = *state;
    holding_epoch_5(fx);
    Tessera__Unassign u = TESSERA__UNASSIGN__INIT;
    u.reason = "piece no longer in the plan";
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = "w-test";
    env.epoch = 6;
    env.body_case = TESSERA__ENVELOPE__BODY_UNASSIGN;
    env.unassign = &u;
    to_agent(fx, &env);
    step(fx, 30);
    assert_false(fx->a->has_piece);
    assert_int_equal(fx->a->state, TESSERA__WORKER_STATE__STATE_IDLE);

    step(fx, 200);
    tsr_env_t *hb = expect_kind(fx, TESSERA__ENVELOPE__BODY_HEARTBEAT, false);
    assert_int_equal(hb->heartbeat->state, TESSERA__WORKER_STATE__STATE_IDLE);
    assert_int_equal(hb->epoch, 0);
    tsr_env_free(&hb);
}

/* ---- resets ---------------------------------------------------------------------------- */

static void test_reset_keeping_assignment_reregisters_carrying_the_piece(void **state)
{
    fx_t *fx = *state;
    holding_epoch_5(fx);
    send_reset(fx, true);
    step(fx, 30);
    assert_int_equal(fx->a->phase, TSR_A_REGISTERING);
    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, true);
    const Tessera__Register *r = env->register_;
    assert_non_null(r->assignment);
    assert_string_equal(r->assignment->deployment, "tiny");
    assert_int_equal(r->assignment->epoch, 5);
    assert_int_equal(r->assignment->tp_rank, 1);
    assert_int_equal(r->assignment->layer_begin, 0);
    assert_int_equal(r->assignment->layer_end, 4);
    assert_string_equal(r->assignment->model_path, model_dir);
    assert_int_equal(r->state, TESSERA__WORKER_STATE__STATE_READY);
    assert_int_equal(env->epoch, 5);
    tsr_env_free(&env);
    assert_true(fx->a->has_piece);
}

/* A piece that failed because its tensor-parallel group passed a deadline
 * is re-registered saying so (Register.past_deadline, with the reason and
 * retryable), so that a restarted coordinator can name the rank the group
 * waited for. */
static void test_a_failed_piece_reregisters_with_its_reason_and_deadline(void **state)
{
    fx_t *fx = *state;
    holding_epoch_5(fx);
    fx->a->state = TESSERA__WORKER_STATE__STATE_FAILED;
    snprintf(fx->a->reason, sizeof fx->a->reason, "data plane: NCCL all-reduce timed out");
    fx->a->retryable = fx->a->past_deadline = true;
    send_reset(fx, true);
    step(fx, 30);
    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, true);
    const Tessera__Register *r = env->register_;
    assert_non_null(r->assignment);
    assert_int_equal(r->state, TESSERA__WORKER_STATE__STATE_FAILED);
    assert_string_equal(r->reason, "data plane: NCCL all-reduce timed out");
    assert_true(r->retryable);
    assert_true(r->past_deadline);
    tsr_env_free(&env);
}

static void test_reset_dropping_assignment_reregisters_without_a_piece(void **state)
{
    fx_t *fx = *state;
    holding_epoch_5(fx);
    send_reset(fx, false);
    step(fx, 30);
    assert_false(fx->a->has_piece);
    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, true);
    assert_null(env->register_->assignment);
    assert_int_equal(env->epoch, 0);
    tsr_env_free(&env);
}

static void test_reset_while_registering_is_ignored(void **state)
{
    fx_t *fx = *state;
    step(fx, 0);
    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false);
    tsr_env_free(&env);
    send_reset(fx, false);
    step(fx, 10);
    expect_nothing(fx, false);  /* the backoff still holds: no Register at once */
    assert_int_equal(fx->a->next_register_ms, fx->t0 + 250);
    step(fx, 250);
    env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false);
    tsr_env_free(&env);
}

/* ---- lease ----------------------------------------------------------------------------- */

static void test_silence_past_the_lease_detaches_and_reregisters_keeping_the_piece(
    void **state)
{
    fx_t *fx = *state;
    holding_epoch_5(fx);        /* last heard at t0+20 (the Assign) */
    step(fx, 20 + 1000);
    assert_false(fx->a->detached);  /* exactly the lease: still attached */
    assert_int_equal(fx->a->phase, TSR_A_REGISTERED);
    step(fx, 20 + 1001);
    assert_true(fx->a->detached);
    assert_true(fx->a->has_piece);
    step(fx, 20 + 1002);
    tsr_env_t *env = expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, true);
    assert_non_null(env->register_->assignment);
    assert_int_equal(env->register_->assignment->epoch, 5);
    tsr_env_free(&env);
}

static void test_any_message_clears_detached(void **state)
{
    fx_t *fx = *state;
    registered(fx);             /* last heard at t0+10 */
    step(fx, 10 + 1001);
    assert_true(fx->a->detached);
    send_ack(fx, 1);
    step(fx, 10 + 1002);
    assert_false(fx->a->detached);
    assert_int_equal(fx->a->last_heard_ms, fx->t0 + 10 + 1002);
}

/* ---- tsr_agent_check_piece ----------------------------------------------------------------- */

static void test_check_piece_accepts_a_valid_tiny_piece(void **state)
{
    (void)state;
    if (!model_dir[0]) find_model_dir();
    Tessera__Assignment a;
    tiny_piece(&a, 1, model_dir);
    char err[512] = "";
    assert_int_equal(tsr_agent_check_piece(&a, err, sizeof err), 0);
    a.stage = 1;
    a.layer_begin = 4;
    a.layer_end = 8;
    assert_int_equal(tsr_agent_check_piece(&a, err, sizeof err), 0);
}

static void test_check_piece_rejects_layers_beyond_the_models_8(void **state)
{
    (void)state;
    if (!model_dir[0]) find_model_dir();
    Tessera__Assignment a;
    tiny_piece(&a, 1, model_dir);
    a.stage = 1;
    a.layer_begin = 4;
    a.layer_end = 9;
    char err[512] = "";
    assert_int_equal(tsr_agent_check_piece(&a, err, sizeof err), -1);
    assert_non_null(strstr(err, "[4,9)"));
    assert_non_null(strstr(err, "8 layers"));
    assert_non_null(strstr(err, "config.json"));
}

static void test_check_piece_rejects_tp_size_3_for_8_heads(void **state)
{
    (void)state;
    if (!model_dir[0]) find_model_dir();
    Tessera__Assignment a;
    tiny_piece(&a, 1, model_dir);
    a.tp_size = 3;
    char err[512] = "";
    assert_int_equal(tsr_agent_check_piece(&a, err, sizeof err), -1);
    assert_non_null(strstr(err, "8 attention heads"));
    assert_non_null(strstr(err, "split 3 ways"));
}

/* ---- NCCL rendezvous offers --------------------------------------------------------- */

static const tsr_nccl_api_t *fake_nccl_of(char *why, size_t len)
{
    (void)why;
    (void)len;
    return &fake_nccl;
}

/* Rank 0 of a tp=2 group over the (fake) NCCL offers its blob to the
 * coordinator, and again every second while its piece loads (a member that
 * registered late, or a coordinator restart, still gets one); once the group
 * forms and the piece is ready, it stops. */
static void test_a_rank0_offers_its_blob_again_until_its_piece_is_ready(void **state)
{
    fx_t *fx = *state;
    char dir[64], err[256];
    snprintf(dir, sizeof dir, "/tmp/tsr-agent-XXXXXX");
    assert_non_null(mkdtemp(dir));
    char *argv[] = {"model-init", dir, "--hidden", "64", "--intermediate", "128", "--layers", "2",
                    "--heads", "8", "--kv-heads", "4", "--vocab", "256", "--seed", "3", NULL};
    assert_int_equal(tsr_cmd_model_init(16, argv), 0);
    tsr_backend_t b = {&tsr_engine_cpu, &tsr_coll_gpu, &tsr_coll_tcp, fake_nccl_of};
    tsr_backend_test_override(TSR_DEVICE_CPU, &b);
    fx->a->ex = tsr_executor_new("127.0.0.1", "127.0.0.1", err, sizeof err);
    tsr_executor_t *peer = tsr_executor_new("127.0.0.1", "127.0.0.1", err, sizeof err);
    assert_non_null(fx->a->ex);
    assert_non_null(peer);

    step(fx, 0);
    tsr_env_free(&(tsr_env_t *){expect_kind(fx, TESSERA__ENVELOPE__BODY_REGISTER, false)});
    send_register_reply(fx, true, 100, 5000, NULL);
    char *peers[2] = {(char *)tsr_executor_endpoint(fx->a->ex), (char *)tsr_executor_endpoint(peer)};
    char *devices[2] = {"n/00000000:01:00.0", "n/00000000:02:00.0"};
    static uint8_t secret[32] = "agent test data secret.........";
    Tessera__Assignment a = TESSERA__ASSIGNMENT__INIT;
    a.deployment = "tiny";
    a.epoch = 4;
    a.tp_size = 2;
    a.pp_size = 1;
    a.layer_end = 2;
    a.model_path = dir;
    a.max_seq_len = 64;
    a.n_peers = a.n_peer_devices = 2;
    a.peers = peers;
    a.peer_devices = devices;
    a.data_secret = (ProtobufCBinaryData){sizeof secret, secret};
    send_assign(fx, &a);
    a.tp_rank = 1;
    tsr_executor_assign(peer, &a);

    /* about 2.5 s without relaying: the offer comes at least twice, the same */
    int offers = 0;
    uint8_t blob[256];
    size_t blob_len = 0;
    uint64_t group = 0;
    int64_t start = tsr_now_ms();
    while (tsr_now_ms() - start < 2500) {
        tsr_agent_step(fx->a, tsr_now_ms());
        tsr_env_t *env;
        while ((env = from_agent(fx, 10)) != NULL) {
            if (env->body_case == TESSERA__ENVELOPE__BODY_RENDEZVOUS_OFFER) {
                assert_int_equal(env->epoch, 4);
                if (offers++ == 0) {
                    group = env->rendezvous_offer->group;
                    blob_len = env->rendezvous_offer->blob.len;
                    memcpy(blob, env->rendezvous_offer->blob.data, blob_len);
                } else {
                    assert_int_equal(env->rendezvous_offer->group, group);
                    assert_memory_equal(env->rendezvous_offer->blob.data, blob, blob_len);
                }
            }
            tsr_env_free(&env);
        }
    }
    assert_true(offers >= 2);

    /* relayed (to every member, its maker too): the group forms, the piece
     * is ready, and the offers stop */
    tsr_executor_rendezvous(peer, 4, group, blob, blob_len);
    tsr_executor_rendezvous(fx->a->ex, 4, group, blob, blob_len);
    bool ready = false;
    start = tsr_now_ms();
    int after = 0;
    while (tsr_now_ms() - start < 15000 && (!ready || tsr_now_ms() - start < 1500 + 0)) {
        tsr_agent_step(fx->a, tsr_now_ms());
        tsr_env_t *env;
        while ((env = from_agent(fx, 10)) != NULL) {
            if (env->body_case == TESSERA__ENVELOPE__BODY_READY) ready = true, start = tsr_now_ms();
            else if (ready && env->body_case == TESSERA__ENVELOPE__BODY_RENDEZVOUS_OFFER) after++;
            tsr_env_free(&env);
        }
    }
    assert_true(ready);
    assert_int_equal(after, 0);
    tsr_executor_destroy(&peer);
    tsr_executor_destroy(&fx->a->ex);
    tsr_backend_test_override(TSR_DEVICE_CPU, NULL);
    char cmd[96];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    tsr_log_init("test", TSR_LOG_ERROR + 1);
    const struct CMUnitTest tests[] = {
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
        T(test_first_step_sends_register_describing_the_worker),
        T(test_unanswered_register_is_resent_with_growing_backoff),
        T(test_accepted_register_reply_starts_heartbeats_at_the_given_interval),
        T(test_refused_register_reply_stops_the_agent_with_exit_code_2),
        T(test_assign_for_tiny_model_reports_progress_then_ready_with_its_epoch),
        T(test_assign_without_config_json_reports_nonfatal_failure_naming_it),
        T(test_assign_with_older_epoch_is_dropped_and_counted),
        T(test_assign_while_registering_is_ignored),
        T(test_unassign_makes_the_agent_idle),
        T(test_reset_keeping_assignment_reregisters_carrying_the_piece),
        T(test_a_failed_piece_reregisters_with_its_reason_and_deadline),
        T(test_reset_dropping_assignment_reregisters_without_a_piece),
        T(test_reset_while_registering_is_ignored),
        T(test_silence_past_the_lease_detaches_and_reregisters_keeping_the_piece),
        T(test_any_message_clears_detached),
        T(test_a_rank0_offers_its_blob_again_until_its_piece_is_ready),
        cmocka_unit_test(test_check_piece_accepts_a_valid_tiny_piece),
        cmocka_unit_test(test_check_piece_rejects_layers_beyond_the_models_8),
        cmocka_unit_test(test_check_piece_rejects_tp_size_3_for_8_heads),
#undef T
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tsr_zmq_term();
    return rc;
}
