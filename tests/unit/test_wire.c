/* test_wire.c: common/wire.c, the one place bytes from the network become
 * trusted messages.  Round trips for every body kind, every way a decode must
 * refuse (size, truncation, garbage, no body, strings over their limits), the
 * endpoint rewrite, and a real ROUTER/DEALER exchange over inproc://. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/wire.h"

/* ---- helpers ------------------------------------------------------------- */

/* Encodes env and decodes it again; the decoded copy is the caller's. */
static tsr_env_t *round_trip(tsr_env_t *env)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    tsr_env_t *out = NULL;
    char err[256] = "";

    assert_int_equal(tsr_wire_encode(env, &buf, &len), 0);
    assert_non_null(buf);
    assert_true(len > 0);
    if (tsr_wire_decode(buf, len, TSR_WIRE_MAX_CONTROL, &out, err, sizeof err) != 0)
        fail_msg("decode of a freshly encoded message failed: %s", err);
    free(buf);
    assert_non_null(out);
    assert_int_equal(out->body_case, env->body_case);
    return out;
}

/* Decodes len bytes, expecting a refusal; returns the reason. */
static void expect_rejected(const uint8_t *buf, size_t len, size_t max, const char *needle)
{
    tsr_env_t *out = (tsr_env_t *)1;   /* decode must reset it */
    char err[256] = "";

    assert_int_equal(tsr_wire_decode(buf, len, max, &out, err, sizeof err), -1);
    assert_null(out);
    assert_true(err[0] != '\0');
    if (needle && !strstr(err, needle))
        fail_msg("reason '%s' does not mention '%s'", err, needle);
}

static void encode(tsr_env_t *env, uint8_t **buf, size_t *len)
{
    assert_int_equal(tsr_wire_encode(env, buf, len), 0);
}

static char *repeat_char(char c, size_t n)
{
    char *s = malloc(n + 1);

    assert_non_null(s);
    memset(s, c, n);
    s[n] = '\0';
    return s;
}

/* A register envelope with every field of it and of its assignment set to a
 * distinct non-default value.  a and reg are filled in place. */
static void make_register(tsr_env_t *env, Tessera__Register *reg, Tessera__Assignment *a)
{
    tessera__assignment__init(a);
    a->deployment = "llama-tiny";
    a->epoch = 0x1122334455ull;
    a->replica = 3;
    a->stage = 1;
    a->tp_rank = 2;
    a->tp_size = 4;
    a->pp_size = 2;
    a->layer_begin = 11;
    a->layer_end = 22;
    a->model_path = "/srv/models/llama-tiny";
    a->max_seq_len = 4096;

    tessera__register__init(reg);
    reg->node = "node-07";
    reg->device = TESSERA__DEVICE_KIND__DEVICE_CUDA;
    reg->device_index = 5;
    reg->device_memory = 80ull * 1024 * 1024 * 1024;
    reg->software_version = "9.8.7";
    reg->pid = 424242;
    reg->assignment = a;
    reg->state = TESSERA__WORKER_STATE__STATE_READY;

    tessera__envelope__init(env);
    env->protocol_version = 3;
    env->epoch = 77;
    env->worker = "worker-a";
    env->body_case = TESSERA__ENVELOPE__BODY_REGISTER;
    env->register_ = reg;
}

static void check_header(const tsr_env_t *out, uint32_t version, uint64_t epoch,
                         const char *worker, const char *kind)
{
    assert_int_equal(out->protocol_version, version);
    assert_int_equal(out->epoch, epoch);
    assert_string_equal(out->worker, worker);
    assert_string_equal(tsr_env_kind(out), kind);
}

/* ---- round trips --------------------------------------------------------- */

static void test_register_with_assignment_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env;
    Tessera__Register reg;
    Tessera__Assignment a;
    make_register(&env, &reg, &a);

    tsr_env_t *out = round_trip(&env);
    check_header(out, 3, 77, "worker-a", "register");
    const Tessera__Register *r = out->register_;
    assert_non_null(r);
    assert_string_equal(r->node, "node-07");
    assert_int_equal(r->device, TESSERA__DEVICE_KIND__DEVICE_CUDA);
    assert_int_equal(r->device_index, 5);
    assert_int_equal(r->device_memory, 80ull * 1024 * 1024 * 1024);
    assert_string_equal(r->software_version, "9.8.7");
    assert_int_equal(r->pid, 424242);
    assert_int_equal(r->state, TESSERA__WORKER_STATE__STATE_READY);
    const Tessera__Assignment *o = r->assignment;
    assert_non_null(o);
    assert_string_equal(o->deployment, "llama-tiny");
    assert_int_equal(o->epoch, 0x1122334455ull);
    assert_int_equal(o->replica, 3);
    assert_int_equal(o->stage, 1);
    assert_int_equal(o->tp_rank, 2);
    assert_int_equal(o->tp_size, 4);
    assert_int_equal(o->pp_size, 2);
    assert_int_equal(o->layer_begin, 11);
    assert_int_equal(o->layer_end, 22);
    assert_string_equal(o->model_path, "/srv/models/llama-tiny");
    assert_int_equal(o->max_seq_len, 4096);
    tsr_env_free(&out);
    assert_null(out);
}

static void test_register_without_assignment_decodes_with_null_assignment(void **state)
{
    (void)state;
    tsr_env_t env;
    Tessera__Register reg;
    Tessera__Assignment a;
    make_register(&env, &reg, &a);
    reg.assignment = NULL;
    reg.state = TESSERA__WORKER_STATE__STATE_IDLE;

    tsr_env_t *out = round_trip(&env);
    assert_null(out->register_->assignment);
    assert_string_equal(out->register_->node, "node-07");
    tsr_env_free(&out);
}

static void test_register_reply_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__RegisterReply rr = TESSERA__REGISTER_REPLY__INIT;
    rr.accepted = 1;
    rr.reason = "welcome back";
    rr.heartbeat_interval_ms = 123;
    rr.lease_ms = 4567;
    rr.adopted = 1;
    rr.coordinator_protocol = 9;
    env.protocol_version = 2;
    env.epoch = 5;
    env.worker = "w1";
    env.body_case = TESSERA__ENVELOPE__BODY_REGISTER_REPLY;
    env.register_reply = &rr;

    tsr_env_t *out = round_trip(&env);
    check_header(out, 2, 5, "w1", "register_reply");
    const Tessera__RegisterReply *o = out->register_reply;
    assert_true(o->accepted);
    assert_string_equal(o->reason, "welcome back");
    assert_int_equal(o->heartbeat_interval_ms, 123);
    assert_int_equal(o->lease_ms, 4567);
    assert_true(o->adopted);
    assert_int_equal(o->coordinator_protocol, 9);
    tsr_env_free(&out);
}

static void test_heartbeat_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Heartbeat hb = TESSERA__HEARTBEAT__INIT;
    hb.state = TESSERA__WORKER_STATE__STATE_LOADING;
    hb.load = 0.75f;
    hb.memory_used = 123456789012ull;
    hb.seq = 0xfffffffffull;
    env.protocol_version = 1;
    env.epoch = 12;
    env.worker = "hb-worker";
    env.body_case = TESSERA__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;

    tsr_env_t *out = round_trip(&env);
    check_header(out, 1, 12, "hb-worker", "heartbeat");
    assert_int_equal(out->heartbeat->state, TESSERA__WORKER_STATE__STATE_LOADING);
    assert_true(out->heartbeat->load == 0.75f);
    assert_int_equal(out->heartbeat->memory_used, 123456789012ull);
    assert_int_equal(out->heartbeat->seq, 0xfffffffffull);
    tsr_env_free(&out);
}

static void test_heartbeat_ack_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__HeartbeatAck ack = TESSERA__HEARTBEAT_ACK__INIT;
    ack.seq = 987654321ull;
    env.epoch = 4;
    env.worker = "w2";
    env.body_case = TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK;
    env.heartbeat_ack = &ack;

    tsr_env_t *out = round_trip(&env);
    check_header(out, TSR_PROTOCOL_VERSION, 4, "w2", "heartbeat_ack");
    assert_int_equal(out->heartbeat_ack->seq, 987654321ull);
    tsr_env_free(&out);
}

static void test_assign_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env;
    Tessera__Register reg;
    Tessera__Assignment a;
    make_register(&env, &reg, &a);   /* reuse its assignment */
    Tessera__Assign as = TESSERA__ASSIGN__INIT;
    as.assignment = &a;
    env.body_case = TESSERA__ENVELOPE__BODY_ASSIGN;
    env.assign = &as;

    tsr_env_t *out = round_trip(&env);
    check_header(out, 3, 77, "worker-a", "assign");
    const Tessera__Assignment *o = out->assign->assignment;
    assert_non_null(o);
    assert_string_equal(o->deployment, "llama-tiny");
    assert_int_equal(o->epoch, 0x1122334455ull);
    assert_int_equal(o->replica, 3);
    assert_int_equal(o->stage, 1);
    assert_int_equal(o->tp_rank, 2);
    assert_int_equal(o->tp_size, 4);
    assert_int_equal(o->pp_size, 2);
    assert_int_equal(o->layer_begin, 11);
    assert_int_equal(o->layer_end, 22);
    assert_string_equal(o->model_path, "/srv/models/llama-tiny");
    assert_int_equal(o->max_seq_len, 4096);
    tsr_env_free(&out);
}

static void test_progress_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Progress pr = TESSERA__PROGRESS__INIT;
    pr.detail = "loading layer 7 of 22";
    pr.percent = 31;
    env.epoch = 8;
    env.worker = "w3";
    env.body_case = TESSERA__ENVELOPE__BODY_PROGRESS;
    env.progress = &pr;

    tsr_env_t *out = round_trip(&env);
    check_header(out, TSR_PROTOCOL_VERSION, 8, "w3", "progress");
    assert_string_equal(out->progress->detail, "loading layer 7 of 22");
    assert_int_equal(out->progress->percent, 31);
    tsr_env_free(&out);
}

/* Ready has no fields: it must still arrive as a body, not as "no body". */
static void test_empty_ready_body_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Ready rd = TESSERA__READY__INIT;
    env.epoch = 9;
    env.worker = "w4";
    env.body_case = TESSERA__ENVELOPE__BODY_READY;
    env.ready = &rd;

    tsr_env_t *out = round_trip(&env);
    check_header(out, TSR_PROTOCOL_VERSION, 9, "w4", "ready");
    assert_non_null(out->ready);
    tsr_env_free(&out);
}

static void test_failed_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Failed f = TESSERA__FAILED__INIT;
    f.reason = "CUDA error: an illegal memory access was encountered";
    f.fatal = 1;
    env.epoch = 10;
    env.worker = "w5";
    env.body_case = TESSERA__ENVELOPE__BODY_FAILED;
    env.failed = &f;

    tsr_env_t *out = round_trip(&env);
    check_header(out, TSR_PROTOCOL_VERSION, 10, "w5", "failed");
    assert_string_equal(out->failed->reason,
                        "CUDA error: an illegal memory access was encountered");
    assert_true(out->failed->fatal);
    tsr_env_free(&out);
}

static void test_unassign_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Unassign u = TESSERA__UNASSIGN__INIT;
    u.reason = "deployment removed";
    env.epoch = 11;
    env.worker = "w6";
    env.body_case = TESSERA__ENVELOPE__BODY_UNASSIGN;
    env.unassign = &u;

    tsr_env_t *out = round_trip(&env);
    check_header(out, TSR_PROTOCOL_VERSION, 11, "w6", "unassign");
    assert_string_equal(out->unassign->reason, "deployment removed");
    tsr_env_free(&out);
}

static void test_drain_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Drain d = TESSERA__DRAIN__INIT;
    d.reason = "operator asked";
    env.epoch = 12;
    env.worker = "w7";
    env.body_case = TESSERA__ENVELOPE__BODY_DRAIN;
    env.drain = &d;

    tsr_env_t *out = round_trip(&env);
    check_header(out, TSR_PROTOCOL_VERSION, 12, "w7", "drain");
    assert_string_equal(out->drain->reason, "operator asked");
    tsr_env_free(&out);
}

static void test_reset_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Reset r = TESSERA__RESET__INIT;
    r.reason = "declared dead";
    r.keep_assignment = 1;
    env.epoch = 13;
    env.worker = "w8";
    env.body_case = TESSERA__ENVELOPE__BODY_RESET;
    env.reset = &r;

    tsr_env_t *out = round_trip(&env);
    check_header(out, TSR_PROTOCOL_VERSION, 13, "w8", "reset");
    assert_string_equal(out->reset->reason, "declared dead");
    assert_true(out->reset->keep_assignment);
    tsr_env_free(&out);
}

static void test_control_request_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__ControlRequest cr = TESSERA__CONTROL_REQUEST__INIT;
    cr.kind = TESSERA__CONTROL_REQUEST__KIND__UNDRAIN;
    cr.worker = "node-3-gpu-1";
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REQUEST;
    env.control_request = &cr;

    tsr_env_t *out = round_trip(&env);
    check_header(out, TSR_PROTOCOL_VERSION, 0, "", "control_request");
    assert_int_equal(out->control_request->kind, TESSERA__CONTROL_REQUEST__KIND__UNDRAIN);
    assert_string_equal(out->control_request->worker, "node-3-gpu-1");
    tsr_env_free(&out);
}

static void test_control_reply_survives_round_trip(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__ControlReply cr = TESSERA__CONTROL_REPLY__INIT;
    cr.ok = 1;
    cr.error = "partial: 2 workers unreachable";
    cr.json = "{\"workers\":[{\"name\":\"a\"}]}";
    env.epoch = 14;
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REPLY;
    env.control_reply = &cr;

    tsr_env_t *out = round_trip(&env);
    check_header(out, TSR_PROTOCOL_VERSION, 14, "", "control_reply");
    assert_true(out->control_reply->ok);
    assert_string_equal(out->control_reply->error, "partial: 2 workers unreachable");
    assert_string_equal(out->control_reply->json, "{\"workers\":[{\"name\":\"a\"}]}");
    tsr_env_free(&out);
}

/* ---- protocol version ---------------------------------------------------- */

static void test_encode_fills_in_protocol_version_when_unset(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Ready rd = TESSERA__READY__INIT;
    env.body_case = TESSERA__ENVELOPE__BODY_READY;
    env.ready = &rd;
    assert_int_equal(env.protocol_version, 0);

    uint8_t *buf = NULL;
    size_t len = 0;
    encode(&env, &buf, &len);
    assert_int_equal(env.protocol_version, TSR_PROTOCOL_VERSION);

    /* The version is on the wire, not only in the struct: decode with the raw
     * unpacker, which applies no defaults of ours. */
    tsr_env_t *raw = tessera__envelope__unpack(NULL, len, buf);
    assert_non_null(raw);
    assert_int_equal(raw->protocol_version, TSR_PROTOCOL_VERSION);
    tessera__envelope__free_unpacked(raw, NULL);
    free(buf);
}

static void test_encode_keeps_an_explicit_protocol_version(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Ready rd = TESSERA__READY__INIT;
    env.protocol_version = TSR_PROTOCOL_VERSION + 41;
    env.body_case = TESSERA__ENVELOPE__BODY_READY;
    env.ready = &rd;

    tsr_env_t *out = round_trip(&env);
    assert_int_equal(out->protocol_version, TSR_PROTOCOL_VERSION + 41);
    tsr_env_free(&out);
}

/* ---- refusals ------------------------------------------------------------ */

/* Offsets where each top-level field of an encoded message ends (protobuf
 * wire format: varint tag, then a varint, fixed64, length-delimited or fixed32
 * value).  A prefix that ends anywhere else cuts a field in half. */
static size_t field_ends(const uint8_t *buf, size_t len, size_t *ends, size_t cap)
{
    size_t i = 0, n = 0;

    while (i < len) {
        uint64_t tag = 0, v = 0;
        int shift = 0;
        do {
            assert_true(i < len);
            tag |= (uint64_t)(buf[i] & 0x7f) << shift;
            shift += 7;
        } while (buf[i++] & 0x80);
        switch (tag & 7) {
        case 0:
            while (buf[i++] & 0x80) assert_true(i < len);
            break;
        case 1: i += 8; break;
        case 5: i += 4; break;
        case 2:
            shift = 0;
            do {
                assert_true(i < len);
                v |= (uint64_t)(buf[i] & 0x7f) << shift;
                shift += 7;
            } while (buf[i++] & 0x80);
            i += (size_t)v;
            break;
        default:
            fail_msg("unexpected wire type %u in our own encoding", (unsigned)(tag & 7));
        }
        assert_true(i <= len);
        assert_true(n < cap);
        ends[n++] = i;
    }
    return n;
}

static void test_every_truncation_of_register_is_rejected_or_differs(void **state)
{
    (void)state;
    tsr_env_t env;
    Tessera__Register reg;
    Tessera__Assignment a;
    uint8_t *buf = NULL;
    size_t len = 0;
    size_t ends[16];
    make_register(&env, &reg, &a);
    encode(&env, &buf, &len);
    size_t n_ends = field_ends(buf, len, ends, 16);
    assert_int_equal(n_ends, 4);           /* version, epoch, worker, register */
    assert_int_equal(ends[n_ends - 1], len);

    size_t inside = 0, rejected = 0;
    for (size_t cut = 1; cut < len; cut++) {
        bool at_boundary = false;
        for (size_t k = 0; k < n_ends; k++) at_boundary |= ends[k] == cut;

        /* A copy of exactly cut bytes, so valgrind/ASan see any overread. */
        uint8_t *pre = malloc(cut);
        assert_non_null(pre);
        memcpy(pre, buf, cut);
        tsr_env_t *out = NULL;
        char err[256] = "";
        int rc = tsr_wire_decode(pre, cut, TSR_WIRE_MAX_WORKER, &out, err, sizeof err);
        if (rc == 0) {
            /* Only a prefix made of whole fields can be a valid message, and
             * then it must not pass for the original. */
            if (!at_boundary) fail_msg("prefix of %zu/%zu bytes cuts a field but decoded", cut, len);
            assert_non_null(out);
            size_t again_len = tessera__envelope__get_packed_size(out);
            uint8_t *again = malloc(again_len + 1);
            assert_non_null(again);
            tessera__envelope__pack(out, again);
            assert_false(again_len == len && memcmp(again, buf, len) == 0);
            free(again);
            tsr_env_free(&out);
        } else {
            assert_int_equal(rc, -1);
            assert_null(out);
            assert_true(err[0] != '\0');
            rejected++;
        }
        if (!at_boundary) inside++;
        free(pre);
    }
    /* Most cuts land inside the register body; they all had to be refused. */
    assert_true(inside > len / 2);
    assert_true(rejected >= inside);
    /* The body is the last field, so no proper prefix has one: all refused. */
    assert_int_equal(rejected, len - 1);
    free(buf);
}

static void test_oversized_message_is_rejected_before_decoding(void **state)
{
    (void)state;
    tsr_env_t env;
    Tessera__Register reg;
    Tessera__Assignment a;
    uint8_t *buf = NULL;
    size_t len = 0;
    make_register(&env, &reg, &a);
    encode(&env, &buf, &len);

    expect_rejected(buf, len, len - 1, "exceeds");

    /* Exactly at the limit is fine. */
    tsr_env_t *out = NULL;
    char err[256] = "";
    assert_int_equal(tsr_wire_decode(buf, len, len, &out, err, sizeof err), 0);
    tsr_env_free(&out);
    free(buf);
}

static void test_message_over_worker_limit_is_rejected(void **state)
{
    (void)state;
    size_t len = TSR_WIRE_MAX_WORKER + 1;
    uint8_t *big = calloc(1, len);
    assert_non_null(big);
    expect_rejected(big, len, TSR_WIRE_MAX_WORKER, "exceeds");
    free(big);
}

static void test_empty_message_is_rejected(void **state)
{
    (void)state;
    static const uint8_t nothing[1] = { 0 };
    expect_rejected(nothing, 0, TSR_WIRE_MAX_WORKER, "empty");
}

static void test_garbage_bytes_are_rejected(void **state)
{
    (void)state;
    /* An over-long varint tag. */
    static const uint8_t ff[16] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff };
    expect_rejected(ff, sizeof ff, TSR_WIRE_MAX_WORKER, NULL);
    /* Wire type 7 does not exist. */
    static const uint8_t badtype[] = { 0x0f, 0x01, 0x02 };
    expect_rejected(badtype, sizeof badtype, TSR_WIRE_MAX_WORKER, NULL);
    /* Field 10 (register) claiming 100 bytes with 2 present. */
    static const uint8_t shortlen[] = { 0x52, 0x64, 0x0a, 0x00 };
    expect_rejected(shortlen, sizeof shortlen, TSR_WIRE_MAX_WORKER, NULL);
    /* Plain text. */
    static const char text[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    expect_rejected((const uint8_t *)text, sizeof text - 1, TSR_WIRE_MAX_WORKER, NULL);
    /* Pseudo-random bytes from a fixed seed: never crash, never a message. */
    uint8_t rnd[64];
    uint32_t x = 0x9e3779b9u;
    for (int round = 0; round < 200; round++) {
        for (size_t i = 0; i < sizeof rnd; i++) {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            rnd[i] = (uint8_t)x;
        }
        tsr_env_t *out = NULL;
        char err[256];
        if (tsr_wire_decode(rnd, sizeof rnd, TSR_WIRE_MAX_WORKER, &out, err, sizeof err) == 0) {
            /* Vanishingly unlikely, but if it decodes it must carry a body. */
            assert_int_not_equal(out->body_case, TESSERA__ENVELOPE__BODY__NOT_SET);
            tsr_env_free(&out);
        }
    }
}

static void test_envelope_without_body_is_rejected(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = 3;
    env.worker = "w";
    uint8_t *buf = NULL;
    size_t len = 0;
    encode(&env, &buf, &len);
    expect_rejected(buf, len, TSR_WIRE_MAX_WORKER, "no body");
    free(buf);

    /* A body from a newer peer (field 99, unknown here) is also "no body". */
    static const uint8_t future[] = { 0x08, 0x01, 0x9a, 0x06, 0x00 };
    expect_rejected(future, sizeof future, TSR_WIRE_MAX_WORKER, "no body");
}

/* An assign that names no assignment would be dereferenced by a worker. */
static void test_assign_without_assignment_is_rejected(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Assign as = TESSERA__ASSIGN__INIT;
    env.body_case = TESSERA__ENVELOPE__BODY_ASSIGN;
    env.assign = &as;
    env.worker = "w";
    uint8_t *buf = NULL;
    size_t len = 0;
    encode(&env, &buf, &len);
    expect_rejected(buf, len, TSR_WIRE_MAX_WORKER, "without an assignment");
    free(buf);
}

static void test_worker_name_over_name_max_is_rejected(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Ready rd = TESSERA__READY__INIT;
    env.body_case = TESSERA__ENVELOPE__BODY_READY;
    env.ready = &rd;
    uint8_t *buf = NULL;
    size_t len = 0;

    char *at_limit = repeat_char('n', TSR_NAME_MAX);
    env.worker = at_limit;
    tsr_env_t *out = round_trip(&env);
    assert_int_equal(strlen(out->worker), TSR_NAME_MAX);
    tsr_env_free(&out);

    char *over = repeat_char('n', TSR_NAME_MAX + 1);
    env.worker = over;
    encode(&env, &buf, &len);
    expect_rejected(buf, len, TSR_WIRE_MAX_WORKER, "worker");
    free(buf);
    free(over);
    free(at_limit);
}

static void test_nested_model_path_over_path_max_is_rejected(void **state)
{
    (void)state;
    tsr_env_t env;
    Tessera__Register reg;
    Tessera__Assignment a;
    uint8_t *buf = NULL;
    size_t len = 0;
    make_register(&env, &reg, &a);

    char *at_limit = repeat_char('p', TSR_PATH_MAX);
    a.model_path = at_limit;
    tsr_env_t *out = round_trip(&env);
    assert_int_equal(strlen(out->register_->assignment->model_path), TSR_PATH_MAX);
    tsr_env_free(&out);

    char *over = repeat_char('p', TSR_PATH_MAX + 1);
    a.model_path = over;
    encode(&env, &buf, &len);
    assert_true(len <= TSR_WIRE_MAX_WORKER);   /* refused for the string, not the size */
    expect_rejected(buf, len, TSR_WIRE_MAX_WORKER, "model_path");
    free(buf);

    /* The same assignment inside an Assign body (a different nesting). */
    Tessera__Assign as = TESSERA__ASSIGN__INIT;
    as.assignment = &a;
    env.body_case = TESSERA__ENVELOPE__BODY_ASSIGN;
    env.assign = &as;
    encode(&env, &buf, &len);
    expect_rejected(buf, len, TSR_WIRE_MAX_WORKER, "model_path");
    free(buf);
    free(over);
    free(at_limit);
}

static void test_nested_name_fields_over_name_max_are_rejected(void **state)
{
    (void)state;
    tsr_env_t env;
    Tessera__Register reg;
    Tessera__Assignment a;
    uint8_t *buf = NULL;
    size_t len = 0;
    char *over = repeat_char('x', TSR_NAME_MAX + 1);

    make_register(&env, &reg, &a);
    reg.node = over;
    encode(&env, &buf, &len);
    expect_rejected(buf, len, TSR_WIRE_MAX_WORKER, "node");
    free(buf);

    make_register(&env, &reg, &a);
    a.deployment = over;
    encode(&env, &buf, &len);
    expect_rejected(buf, len, TSR_WIRE_MAX_WORKER, "deployment");
    free(buf);

    make_register(&env, &reg, &a);
    reg.software_version = over;
    encode(&env, &buf, &len);
    expect_rejected(buf, len, TSR_WIRE_MAX_WORKER, "software_version");
    free(buf);
    free(over);
}

static void test_control_reply_json_longer_than_path_max_is_accepted(void **state)
{
    (void)state;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__ControlReply cr = TESSERA__CONTROL_REPLY__INIT;
    size_t n = 200000;                  /* far over every string limit */
    char *json = repeat_char(' ', n);
    json[0] = '[';
    json[n - 1] = ']';
    cr.ok = 1;
    cr.json = json;
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REPLY;
    env.control_reply = &cr;

    tsr_env_t *out = round_trip(&env);
    assert_int_equal(strlen(out->control_reply->json), n);
    assert_memory_equal(out->control_reply->json, json, n);
    tsr_env_free(&out);
    free(json);
}

/* ---- endpoints ----------------------------------------------------------- */

static void test_connect_endpoint_maps_wildcards_to_loopback(void **state)
{
    (void)state;
    char buf[128];

    assert_string_equal(tsr_connect_endpoint("tcp://0.0.0.0:7400", buf, sizeof buf),
                        "tcp://127.0.0.1:7400");
    assert_string_equal(tsr_connect_endpoint("tcp://*:7400", buf, sizeof buf),
                        "tcp://127.0.0.1:7400");
    assert_string_equal(tsr_connect_endpoint("tcp://*:65535", buf, sizeof buf),
                        "tcp://127.0.0.1:65535");
}

static void test_connect_endpoint_leaves_specific_addresses_alone(void **state)
{
    (void)state;
    char buf[128];
    static const char *same[] = {
        "tcp://10.1.2.3:7400", "tcp://127.0.0.1:7401", "tcp://coord.example:7400",
        "ipc:///run/tessera/workers", "inproc://workers", "tcp://10.0.0.0:7400",
    };
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        const char *r = tsr_connect_endpoint(same[i], buf, sizeof buf);
        assert_ptr_equal(r, buf);
        assert_string_equal(r, same[i]);
    }
}

/* ---- sockets ------------------------------------------------------------- */

typedef struct {
    void *router;
    void *dealer;
} pair_t;

/* Polls sock for input for up to 1 s, then receives one message. */
static int recv_within_1s(void *sock, uint8_t *rid, size_t *rid_len, tsr_env_t **out,
                          char *err, size_t errlen)
{
    zmq_pollitem_t item = { .socket = sock, .events = ZMQ_POLLIN };
    int n = zmq_poll(&item, 1, 1000);
    assert_true(n >= 0);
    if (n == 0) fail_msg("nothing arrived within 1 s");
    return tsr_wire_recv(sock, rid, rid_len, TSR_WIRE_MAX_WORKER, out, err, errlen);
}

static int pair_setup(void **state)
{
    static int seq;
    char ep[64], err[256] = "";
    pair_t *p = calloc(1, sizeof *p);

    if (!p) return -1;
    snprintf(ep, sizeof ep, "inproc://test-wire-%d", seq++);
    p->router = tsr_sock_router(ep, err, sizeof err);
    if (!p->router) {
        fprintf(stderr, "router: %s\n", err);
        free(p);
        return -1;
    }
    p->dealer = tsr_sock_dealer(ep, 0, err, sizeof err);
    if (!p->dealer) {
        fprintf(stderr, "dealer: %s\n", err);
        tsr_sock_close(&p->router);
        free(p);
        return -1;
    }
    *state = p;
    return 0;
}

static int pair_teardown(void **state)
{
    pair_t *p = *state;
    tsr_sock_close(&p->dealer);
    tsr_sock_close(&p->router);
    assert_null(p->dealer);
    assert_null(p->router);
    free(p);
    return 0;
}

static void send_heartbeat(void *sock, const uint8_t *rid, size_t rid_len, uint64_t seq)
{
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    Tessera__Heartbeat hb = TESSERA__HEARTBEAT__INIT;
    hb.seq = seq;
    hb.state = TESSERA__WORKER_STATE__STATE_READY;
    env.worker = "sock-worker";
    env.body_case = TESSERA__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    assert_int_equal(tsr_wire_send(sock, rid, rid_len, &env), 0);
}

static void test_recv_returns_zero_when_nothing_is_waiting(void **state)
{
    pair_t *p = *state;
    uint8_t rid[256];
    size_t rid_len = 0;
    tsr_env_t *out = (tsr_env_t *)1;
    char err[256] = "";

    assert_int_equal(tsr_wire_recv(p->router, rid, &rid_len, TSR_WIRE_MAX_WORKER, &out,
                                   err, sizeof err), 0);
    assert_null(out);
    out = (tsr_env_t *)1;
    assert_int_equal(tsr_wire_recv(p->dealer, NULL, NULL, TSR_WIRE_MAX_WORKER, &out,
                                   err, sizeof err), 0);
    assert_null(out);
}

static void test_router_receives_and_reply_reaches_dealer_by_routing_id(void **state)
{
    pair_t *p = *state;
    uint8_t rid[256];
    size_t rid_len = 0;
    tsr_env_t *out = NULL;
    char err[256] = "";

    /* dealer -> router */
    tsr_env_t env;
    Tessera__Register reg;
    Tessera__Assignment a;
    make_register(&env, &reg, &a);
    assert_int_equal(tsr_wire_send(p->dealer, NULL, 0, &env), 0);
    if (recv_within_1s(p->router, rid, &rid_len, &out, err, sizeof err) != 1)
        fail_msg("router recv failed: %s", err);
    assert_true(rid_len > 0);
    assert_string_equal(tsr_env_kind(out), "register");
    assert_string_equal(out->worker, "worker-a");
    assert_string_equal(out->register_->assignment->model_path, "/srv/models/llama-tiny");
    tsr_env_free(&out);

    /* router -> dealer, addressed with the routing id just received */
    tsr_env_t rep = TESSERA__ENVELOPE__INIT;
    Tessera__RegisterReply rr = TESSERA__REGISTER_REPLY__INIT;
    rr.accepted = 1;
    rr.heartbeat_interval_ms = 100;
    rep.worker = "worker-a";
    rep.body_case = TESSERA__ENVELOPE__BODY_REGISTER_REPLY;
    rep.register_reply = &rr;
    assert_int_equal(tsr_wire_send(p->router, rid, rid_len, &rep), 0);
    if (recv_within_1s(p->dealer, NULL, NULL, &out, err, sizeof err) != 1)
        fail_msg("dealer recv failed: %s", err);
    assert_string_equal(tsr_env_kind(out), "register_reply");
    assert_true(out->register_reply->accepted);
    assert_int_equal(out->register_reply->heartbeat_interval_ms, 100);
    assert_int_equal(out->protocol_version, TSR_PROTOCOL_VERSION);
    tsr_env_free(&out);

    /* A reply to a routing id nobody has is dropped, not delivered to us. */
    uint8_t bogus[5] = { 0, 1, 2, 3, 4 };
    if (rid_len == sizeof bogus && memcmp(rid, bogus, sizeof bogus) == 0) bogus[0] = 9;
    (void)tsr_wire_send(p->router, bogus, sizeof bogus, &rep);
    zmq_pollitem_t item = { .socket = p->dealer, .events = ZMQ_POLLIN };
    assert_int_equal(zmq_poll(&item, 1, 100), 0);
}

static void test_multi_frame_garbage_is_rejected_and_next_message_still_arrives(void **state)
{
    pair_t *p = *state;
    uint8_t rid[256], first_rid[256];
    size_t rid_len = 0, first_len = 0;
    tsr_env_t *out = NULL;
    char err[256] = "";

    assert_int_equal(zmq_send(p->dealer, "\xff\xff\xff", 3, ZMQ_SNDMORE), 3);
    assert_int_equal(zmq_send(p->dealer, "junk", 4, ZMQ_SNDMORE), 4);
    assert_int_equal(zmq_send(p->dealer, "more junk", 9, 0), 9);
    assert_int_equal(recv_within_1s(p->router, rid, &rid_len, &out, err, sizeof err), -1);
    assert_null(out);
    assert_true(err[0] != '\0');
    memcpy(first_rid, rid, rid_len);
    first_len = rid_len;

    /* One garbage frame (the right shape, wrong bytes) is refused too. */
    assert_int_equal(zmq_send(p->dealer, "\x0f\x0f", 2, 0), 2);
    err[0] = '\0';
    assert_int_equal(recv_within_1s(p->router, rid, &rid_len, &out, err, sizeof err), -1);
    assert_null(out);
    assert_true(err[0] != '\0');

    /* The leftover frames were consumed: the next message is a good one. */
    send_heartbeat(p->dealer, NULL, 0, 31337);
    if (recv_within_1s(p->router, rid, &rid_len, &out, err, sizeof err) != 1)
        fail_msg("good message after garbage not received: %s", err);
    assert_string_equal(tsr_env_kind(out), "heartbeat");
    assert_int_equal(out->heartbeat->seq, 31337);
    assert_int_equal(rid_len, first_len);
    assert_memory_equal(rid, first_rid, rid_len);
    tsr_env_free(&out);

    /* Nothing else is queued behind it. */
    assert_int_equal(tsr_wire_recv(p->router, rid, &rid_len, TSR_WIRE_MAX_WORKER, &out,
                                   err, sizeof err), 0);
}

static void test_dealer_rejects_multi_frame_garbage_and_keeps_receiving(void **state)
{
    pair_t *p = *state;
    uint8_t rid[256];
    size_t rid_len = 0;
    tsr_env_t *out = NULL;
    char err[256] = "";

    /* Learn the dealer's routing id. */
    send_heartbeat(p->dealer, NULL, 0, 1);
    assert_int_equal(recv_within_1s(p->router, rid, &rid_len, &out, err, sizeof err), 1);
    tsr_env_free(&out);

    assert_int_equal(zmq_send(p->router, rid, rid_len, ZMQ_SNDMORE), (int)rid_len);
    assert_int_equal(zmq_send(p->router, "a", 1, ZMQ_SNDMORE), 1);
    assert_int_equal(zmq_send(p->router, "b", 1, 0), 1);
    assert_int_equal(recv_within_1s(p->dealer, NULL, NULL, &out, err, sizeof err), -1);
    assert_null(out);

    send_heartbeat(p->router, rid, rid_len, 2);
    if (recv_within_1s(p->dealer, NULL, NULL, &out, err, sizeof err) != 1)
        fail_msg("good message after garbage not received: %s", err);
    assert_int_equal(out->heartbeat->seq, 2);
    tsr_env_free(&out);
}

static void test_oversized_message_on_socket_is_rejected(void **state)
{
    pair_t *p = *state;
    uint8_t rid[256];
    size_t rid_len = 0;
    tsr_env_t *out = NULL;
    char err[256] = "";
    size_t len = TSR_WIRE_MAX_WORKER + 10;
    uint8_t *big = calloc(1, len);

    assert_non_null(big);
    assert_int_equal(zmq_send(p->dealer, big, len, 0), (int)len);
    free(big);
    assert_int_equal(recv_within_1s(p->router, rid, &rid_len, &out, err, sizeof err), -1);
    assert_null(out);
    assert_non_null(strstr(err, "exceeds"));
}

/* Attack 10: a 512 MiB frame was buffered whole before the size check.
 * Every socket now carries ZMQ_MAXMSGSIZE, so ZeroMQ drops the connection
 * as soon as a larger frame is announced. */
static void test_every_socket_limits_its_frame_size(void **state)
{
    (void)state;
    char err[256] = "";
    int64_t max = 0;
    size_t sz = sizeof max;
    void *r = tsr_sock_router("inproc://test-wire-max-r", err, sizeof err);
    void *r2 = tsr_sock_router_max("inproc://test-wire-max-r2", 12345, err, sizeof err);
    void *d = tsr_sock_dealer("inproc://test-wire-max-r", 0, err, sizeof err);
    assert_non_null(r);
    assert_non_null(r2);
    assert_non_null(d);
    assert_int_equal(zmq_getsockopt(r, ZMQ_MAXMSGSIZE, &max, &sz), 0);
    assert_int_equal(max, TSR_WIRE_MAX_WORKER);
    assert_int_equal(zmq_getsockopt(r2, ZMQ_MAXMSGSIZE, &max, &sz), 0);
    assert_int_equal(max, 12345);
    assert_int_equal(zmq_getsockopt(d, ZMQ_MAXMSGSIZE, &max, &sz), 0);
    assert_int_equal(max, TSR_WIRE_MAX_CONTROL);
    tsr_sock_close(&d);
    tsr_sock_close(&r2);
    tsr_sock_close(&r);
}

static void test_an_oversized_frame_over_ipc_never_arrives(void **state)
{
    (void)state;
    char ep[96], err[256] = "";
    snprintf(ep, sizeof ep, "ipc:///tmp/tsr-test-wire-%d.sock", (int)getpid());
    void *r = tsr_sock_router(ep, err, sizeof err);
    assert_non_null(r);
    void *d = tsr_sock_dealer(ep, 0, err, sizeof err);
    assert_non_null(d);
    size_t len = 8u << 20;
    uint8_t *big = calloc(1, len);
    assert_non_null(big);
    assert_int_equal(zmq_send(d, big, len, 0), (int)len);
    free(big);
    zmq_pollitem_t item = {.socket = r, .events = ZMQ_POLLIN};
    assert_int_equal(zmq_poll(&item, 1, 300), 0);  /* cut off, not buffered */
    tsr_sock_close(&d);
    tsr_sock_close(&r);
    unlink(ep + 6);
}

/* A dealer's routing id is random, 16 bytes, and its own: the coordinator
 * binds a worker's name to it. */
static void test_dealers_get_distinct_random_routing_ids(void **state)
{
    (void)state;
    char err[256] = "";
    uint8_t a[256], b[256];
    size_t la = sizeof a, lb = sizeof b;
    void *d1 = tsr_sock_dealer("inproc://test-wire-rid", 0, err, sizeof err);
    void *d2 = tsr_sock_dealer("inproc://test-wire-rid", 0, err, sizeof err);
    assert_non_null(d1);
    assert_non_null(d2);
    assert_int_equal(zmq_getsockopt(d1, ZMQ_ROUTING_ID, a, &la), 0);
    assert_int_equal(zmq_getsockopt(d2, ZMQ_ROUTING_ID, b, &lb), 0);
    assert_int_equal(la, 16);
    assert_int_equal(lb, 16);
    assert_true(a[0] != 0 && b[0] != 0);
    assert_memory_not_equal(a, b, 16);
    tsr_sock_close(&d1);
    tsr_sock_close(&d2);
}

/* A worker cut off by the network reconnects with its routing id: its new
 * connection takes the id over at once, so replies reach it there. */
static void test_a_peer_reconnecting_with_its_routing_id_takes_it_over(void **state)
{
    (void)state;
    char ep[96], err[256] = "";
    snprintf(ep, sizeof ep, "ipc:///tmp/tsr-test-wire-ho-%d.sock", (int)getpid());
    void *r = tsr_sock_router(ep, err, sizeof err);
    assert_non_null(r);
    const uint8_t id[4] = {0x81, 2, 3, 4};
    void *d[2];
    for (int k = 0; k < 2; k++) {
        d[k] = zmq_socket(tsr_zmq_ctx(), ZMQ_DEALER);
        assert_non_null(d[k]);
        int linger = 0;
        zmq_setsockopt(d[k], ZMQ_LINGER, &linger, sizeof linger);
        assert_int_equal(zmq_setsockopt(d[k], ZMQ_ROUTING_ID, id, sizeof id), 0);
        assert_int_equal(zmq_connect(d[k], ep), 0);
        send_heartbeat(d[k], NULL, 0, (uint64_t)k + 1);
        uint8_t rid[256];
        size_t rid_len = 0;
        tsr_env_t *out = NULL;
        assert_int_equal(recv_within_1s(r, rid, &rid_len, &out, err, sizeof err), 1);
        assert_int_equal(out->heartbeat->seq, (uint64_t)k + 1);
        assert_int_equal(rid_len, sizeof id);
        assert_memory_equal(rid, id, sizeof id);
        tsr_env_free(&out);
    }
    send_heartbeat(r, id, sizeof id, 9);
    tsr_env_t *out = NULL;
    assert_int_equal(recv_within_1s(d[1], NULL, NULL, &out, err, sizeof err), 1);
    assert_int_equal(out->heartbeat->seq, 9);
    tsr_env_free(&out);
    zmq_close(d[0]);
    zmq_close(d[1]);
    tsr_sock_close(&r);
    unlink(ep + 6);
}

static int group_teardown(void **state)
{
    (void)state;
    tsr_zmq_term();
    return 0;
}

/* Signals arriving while sockets are made (a reload's SIGHUP, a child's
 * SIGCHLD, a fuzzer's timer) interrupt libzmq's internal waits: a bind or
 * connect that fails with EINTR is tried again, never reported as a
 * failure (fuzz_agent once stopped on "cannot bind inproc://...:
 * Interrupted system call").  A helper thread sends SIGUSR1, whose handler
 * does not restart calls, to this thread while it binds, connects (with a
 * connection monitor) and disconnects (twice: the second is not an error)
 * inproc sockets back to back. */
static volatile sig_atomic_t signals_seen;
static void on_usr1(int sig) { (void)sig; signals_seen++; }

typedef struct {
    pthread_t target, thread;
    atomic_bool stop;
    struct sigaction old;
} storm_t;

static void *storm(void *arg)
{
    storm_t *s = arg;
    while (!atomic_load(&s->stop)) {
        pthread_kill(s->target, SIGUSR1);
        for (volatile int i = 0; i < 200; i++) {}
    }
    return NULL;
}

/* SIGUSR1 (its handler without SA_RESTART) sent to this thread over and
 * over from another, until storm_end. */
static void storm_begin(storm_t *s)
{
    struct sigaction sa = {0};
    sa.sa_handler = on_usr1;
    sigemptyset(&sa.sa_mask);
    assert_int_equal(sigaction(SIGUSR1, &sa, &s->old), 0);
    s->target = pthread_self();
    atomic_init(&s->stop, false);
    assert_int_equal(pthread_create(&s->thread, NULL, storm, s), 0);
}

static void storm_end(storm_t *s)
{
    atomic_store(&s->stop, true);
    pthread_join(s->thread, NULL);
    sigaction(SIGUSR1, &s->old, NULL);
}

static void test_bind_and_connect_survive_a_signal_storm(void **state)
{
    (void)state;
    storm_t s;
    storm_begin(&s);
    char ep[64], err[256];
    int failures = 0;
    for (int i = 0; i < 3000 && !failures; i++) {
        snprintf(ep, sizeof ep, "inproc://eintr-%d", i);
        void *r = tsr_sock_router(ep, err, sizeof err), *mon = NULL;
        void *d = r ? tsr_sock_dealer_sec(ep, 0, NULL, &mon, err, sizeof err) : NULL;
        if (!r || !d) {
            print_error("socket %d: %s\n", i, err);
            failures++;
        } else if (tsr_zmq_disconnect(d, ep) != 0 || tsr_zmq_disconnect(d, ep) != 0) {
            print_error("socket %d: disconnect: %s\n", i, zmq_strerror(errno));
            failures++;
        }
        if (d) tsr_sock_monitor_close(d, &mon), zmq_close(d);
        if (r) zmq_close(r);
    }
    storm_end(&s);
    assert_true(signals_seen > 0);
    assert_int_equal(failures, 0);
}

/* A receive interrupted by a signal is not a rejected message: the message
 * stays queued for the next read (tsr_wire_recv returns 0), and nothing is
 * lost or miscounted.  A DEALER sends heartbeats in bursts to a ROUTER
 * that reads them while SIGUSR1 storms its thread. */
static void test_a_receive_interrupted_by_a_signal_rejects_nothing(void **state)
{
    (void)state;
    char err[256] = "";
    void *r = tsr_sock_router("inproc://eintr-recv", err, sizeof err), *mon = NULL;
    assert_non_null(r);
    void *d = tsr_sock_dealer_sec("inproc://eintr-recv", 0, NULL, &mon, err, sizeof err);
    assert_non_null(d);
    storm_t s;
    storm_begin(&s);
    Tessera__Heartbeat hb = TESSERA__HEARTBEAT__INIT;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.protocol_version = 1, env.worker = "w", env.body_case = TESSERA__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    int got = 0, rejected = 0, sent = 0;
    for (int round = 0; round < 400; round++) {
        for (int k = 0; k < 50; k++, sent++) {
            hb.seq = (uint64_t)sent;
            while (tsr_wire_send(d, NULL, 0, &env) != 0) {}   /* an interrupted send: again */
        }
        for (int idle = 0; got + rejected < sent && idle < 100000;) {
            uint8_t rid[256];
            size_t rl = 0;
            tsr_env_t *out = NULL;
            int rc = tsr_wire_recv(r, rid, &rl, TSR_WIRE_MAX_CONTROL, &out, err, sizeof err);
            if (rc == 1) {
                if (out->heartbeat->seq != (uint64_t)got) fail_msg("heartbeat %d came as %llu", got,
                                                                 (unsigned long long)out->heartbeat->seq);
                got++, idle = 0;
            } else if (rc < 0) {
                print_error("message %d rejected: '%s'\n", got + rejected, err);
                rejected++;
            } else {
                idle++;
            }
            tsr_env_free(&out);
        }
    }
    storm_end(&s);
    tsr_sock_monitor_close(d, &mon);
    zmq_close(d), zmq_close(r);
    assert_int_equal(rejected, 0);
    assert_int_equal(got, sent);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_register_with_assignment_survives_round_trip),
        cmocka_unit_test(test_register_without_assignment_decodes_with_null_assignment),
        cmocka_unit_test(test_register_reply_survives_round_trip),
        cmocka_unit_test(test_heartbeat_survives_round_trip),
        cmocka_unit_test(test_heartbeat_ack_survives_round_trip),
        cmocka_unit_test(test_assign_survives_round_trip),
        cmocka_unit_test(test_progress_survives_round_trip),
        cmocka_unit_test(test_empty_ready_body_survives_round_trip),
        cmocka_unit_test(test_failed_survives_round_trip),
        cmocka_unit_test(test_unassign_survives_round_trip),
        cmocka_unit_test(test_drain_survives_round_trip),
        cmocka_unit_test(test_reset_survives_round_trip),
        cmocka_unit_test(test_control_request_survives_round_trip),
        cmocka_unit_test(test_control_reply_survives_round_trip),
        cmocka_unit_test(test_encode_fills_in_protocol_version_when_unset),
        cmocka_unit_test(test_encode_keeps_an_explicit_protocol_version),
        cmocka_unit_test(test_every_truncation_of_register_is_rejected_or_differs),
        cmocka_unit_test(test_oversized_message_is_rejected_before_decoding),
        cmocka_unit_test(test_bind_and_connect_survive_a_signal_storm),
        cmocka_unit_test(test_a_receive_interrupted_by_a_signal_rejects_nothing),
        cmocka_unit_test(test_message_over_worker_limit_is_rejected),
        cmocka_unit_test(test_empty_message_is_rejected),
        cmocka_unit_test(test_garbage_bytes_are_rejected),
        cmocka_unit_test(test_envelope_without_body_is_rejected),
        cmocka_unit_test(test_assign_without_assignment_is_rejected),
        cmocka_unit_test(test_worker_name_over_name_max_is_rejected),
        cmocka_unit_test(test_nested_model_path_over_path_max_is_rejected),
        cmocka_unit_test(test_nested_name_fields_over_name_max_are_rejected),
        cmocka_unit_test(test_control_reply_json_longer_than_path_max_is_accepted),
        cmocka_unit_test(test_connect_endpoint_maps_wildcards_to_loopback),
        cmocka_unit_test(test_connect_endpoint_leaves_specific_addresses_alone),
        cmocka_unit_test_setup_teardown(test_recv_returns_zero_when_nothing_is_waiting,
                                        pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_router_receives_and_reply_reaches_dealer_by_routing_id,
                                        pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_multi_frame_garbage_is_rejected_and_next_message_still_arrives,
                                        pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_dealer_rejects_multi_frame_garbage_and_keeps_receiving,
                                        pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_oversized_message_on_socket_is_rejected,
                                        pair_setup, pair_teardown),
        cmocka_unit_test(test_every_socket_limits_its_frame_size),
        cmocka_unit_test(test_an_oversized_frame_over_ipc_never_arrives),
        cmocka_unit_test(test_dealers_get_distinct_random_routing_ids),
        cmocka_unit_test(test_a_peer_reconnecting_with_its_routing_id_takes_it_over),
    };
    return cmocka_run_group_tests(tests, NULL, group_teardown);
}
