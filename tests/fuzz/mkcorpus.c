/* mkcorpus.c: writes the seed corpus of the wire, coordinator and agent
 * fuzz targets (tests/fuzz/corpus/fuzz_wire/, fuzz_coordinator/, fuzz_agent/):
 * one valid message of every kind, and scripts of a small cluster's life as
 * the coordinator and as a worker see it.  `make fuzz-corpus` runs it; the YAML, config.json
 * and safetensors seeds are plain files kept beside them. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/wire.h"

static const char *out_dir = "tests/fuzz/corpus";

static void put_file(const char *target, const char *name, const uint8_t *b, size_t n)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s/%s", out_dir, target, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(b, 1, n, f) != n || fclose(f) != 0) { perror(path); exit(1); }
}

/* ---- one envelope of each kind ------------------------------------------- */

static Tessera__Assignment piece(int stage, int tp)
{
    static char *peers[] = { "127.0.0.1:7500", "127.0.0.1:7501", "127.0.0.1:7502",
                             "127.0.0.1:7503" };
    Tessera__Assignment a = TESSERA__ASSIGNMENT__INIT;
    a.deployment = "tiny";
    a.epoch = 3;
    a.stage = (uint32_t)stage;
    a.tp_rank = (uint32_t)tp;
    a.tp_size = 2;
    a.pp_size = 2;
    a.layer_begin = (uint32_t)stage * 2;
    a.layer_end = (uint32_t)stage * 2 + 2;
    a.model_path = "/tmp/tsr-fuzz-agent-model";   /* fuzz_agent writes it */
    a.max_seq_len = 256;
    a.n_peers = 4;
    a.peers = peers;
    a.max_batch = 32;
    a.prefill_chunk = 128;
    a.max_queue = 4;
    return a;
}

/* Encodes an envelope of kind `body` from worker `name`; caller frees. */
static uint8_t *make(int body, const char *name, uint64_t epoch, size_t *len)
{
    static int32_t prompt[] = { 1, 5, 9, 3 };
    Tessera__Assignment a = piece(1, 1);
    Tessera__Register reg = TESSERA__REGISTER__INIT;
    Tessera__RegisterReply rr = TESSERA__REGISTER_REPLY__INIT;
    Tessera__Heartbeat hb = TESSERA__HEARTBEAT__INIT;
    Tessera__HeartbeatAck ack = TESSERA__HEARTBEAT_ACK__INIT;
    Tessera__Assign as = TESSERA__ASSIGN__INIT;
    Tessera__Progress pr = TESSERA__PROGRESS__INIT;
    Tessera__Ready rd = TESSERA__READY__INIT;
    Tessera__Failed fl = TESSERA__FAILED__INIT;
    Tessera__Unassign un = TESSERA__UNASSIGN__INIT;
    Tessera__Drain dr = TESSERA__DRAIN__INIT;
    Tessera__Reset rs = TESSERA__RESET__INIT;
    Tessera__ControlRequest cq = TESSERA__CONTROL_REQUEST__INIT;
    Tessera__ControlReply cr = TESSERA__CONTROL_REPLY__INIT;
    Tessera__Generate ge = TESSERA__GENERATE__INIT;
    Tessera__TokenEvent te = TESSERA__TOKEN_EVENT__INIT;
    Tessera__Cancel ca = TESSERA__CANCEL__INIT;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    uint8_t *buf = NULL;

    env.protocol_version = TSR_PROTOCOL_VERSION;
    env.epoch = epoch;
    env.worker = (char *)name;
    env.body_case = body;
    switch (body) {
    case TESSERA__ENVELOPE__BODY_REGISTER:
        reg.node = "node0";
        reg.software_version = TSR_SOFTWARE_VERSION;
        reg.pid = 4242;
        reg.device_memory = 1u << 30;
        reg.data_endpoint = "127.0.0.1:7500";
        env.register_ = &reg; break;
    case TESSERA__ENVELOPE__BODY_REGISTER_REPLY:
        rr.accepted = 1; rr.heartbeat_interval_ms = 100; rr.lease_ms = 1000;
        rr.coordinator_protocol = TSR_PROTOCOL_VERSION;
        env.register_reply = &rr; break;
    case TESSERA__ENVELOPE__BODY_HEARTBEAT:
        hb.state = TESSERA__WORKER_STATE__STATE_READY; hb.load = 0.5f; hb.seq = 7;
        hb.kv_blocks_used = 3; hb.kv_blocks_total = 512;
        env.heartbeat = &hb; break;
    case TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK:
        ack.seq = 7; env.heartbeat_ack = &ack; break;
    case TESSERA__ENVELOPE__BODY_ASSIGN:
        as.assignment = &a; env.assign = &as; break;
    case TESSERA__ENVELOPE__BODY_PROGRESS:
        pr.detail = "loading layer 2 of 4"; pr.percent = 50; env.progress = &pr; break;
    case TESSERA__ENVELOPE__BODY_READY:
        env.ready = &rd; break;
    case TESSERA__ENVELOPE__BODY_FAILED:
        fl.reason = "collective: rank 1 closed the connection"; env.failed = &fl; break;
    case TESSERA__ENVELOPE__BODY_UNASSIGN:
        un.reason = "replanned"; env.unassign = &un; break;
    case TESSERA__ENVELOPE__BODY_DRAIN:
        dr.reason = "operator"; env.drain = &dr; break;
    case TESSERA__ENVELOPE__BODY_RESET:
        rs.reason = "register again"; rs.keep_assignment = 1; env.reset = &rs; break;
    case TESSERA__ENVELOPE__BODY_CONTROL_REQUEST:
        cq.kind = TESSERA__CONTROL_REQUEST__KIND__GENERATE; cq.deployment = "tiny";
        cq.n_prompt = 4; cq.prompt = prompt; cq.max_tokens = 4; cq.temperature = 0.7f;
        cq.top_p = 0.9f; cq.seed = 11; cq.timeout_ms = 500;
        env.control_request = &cq; break;
    case TESSERA__ENVELOPE__BODY_CONTROL_REPLY:
        cr.ok = 1; cr.json = "{\"request_id\": 1}"; env.control_reply = &cr; break;
    case TESSERA__ENVELOPE__BODY_GENERATE:
        ge.request_id = 1; ge.n_prompt = 4; ge.prompt = prompt; ge.max_tokens = 4;
        ge.seed = 11; env.generate = &ge; break;
    case TESSERA__ENVELOPE__BODY_TOKEN_EVENT:
        te.request_id = 1; te.token = 42; te.index = 0; env.token_event = &te; break;
    case TESSERA__ENVELOPE__BODY_CANCEL:
        ca.request_id = 1; ca.reason = "client went away"; env.cancel = &ca; break;
    default:
        abort();
    }
    if (tsr_wire_encode(&env, &buf, len) < 0) abort();
    return buf;
}

/* ---- coordinator scripts ------------------------------------------------- */

typedef struct { uint8_t b[65536]; size_t n; } script_t;

/* One record: op (who, and the clock step in 50 ms units) and the bytes. */
static void rec(script_t *s, int who, int step, const uint8_t *m, size_t n)
{
    if (s->n + 3 + n > sizeof s->b) abort();
    s->b[s->n++] = (uint8_t)(who | step << 3);
    s->b[s->n++] = (uint8_t)(n & 255);
    s->b[s->n++] = (uint8_t)(n >> 8);
    memcpy(s->b + s->n, m, n);
    s->n += n;
}

static void msg(script_t *s, int who, int step, int body, uint64_t epoch)
{
    char name[8];
    size_t n;
    snprintf(name, sizeof name, "w%d", who);
    uint8_t *m = make(body, name, epoch, &n);
    rec(s, who, step, m, n);
    free(m);
}

static void control(script_t *s, int kind, const char *worker, int step)
{
    static int32_t prompt[] = { 1, 2, 3 };
    Tessera__ControlRequest q = TESSERA__CONTROL_REQUEST__INIT;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    uint8_t *m;
    size_t n;
    q.kind = kind;
    q.worker = (char *)worker;
    q.deployment = "tiny";
    q.n_prompt = 3;
    q.prompt = prompt;
    q.max_tokens = 3;
    q.timeout_ms = 200;
    env.protocol_version = TSR_PROTOCOL_VERSION;
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REQUEST;
    env.control_request = &q;
    if (tsr_wire_encode(&env, &m, &n) < 0) abort();
    rec(s, 5, step, m, n);
    free(m);
}

/* Five workers register and heartbeat until the plan is made. */
static void cluster_up(script_t *s)
{
    for (int w = 0; w < 5; w++) msg(s, w, 0, TESSERA__ENVELOPE__BODY_REGISTER, 0);
    for (int w = 0; w < 5; w++) msg(s, w, 1, TESSERA__ENVELOPE__BODY_HEARTBEAT, 0);
}

static void put_script(const char *name, const script_t *s)
{
    put_file("fuzz_coordinator", name, s->b, s->n);
}

int main(int argc, char **argv)
{
    static const struct { int body; const char *name; } kinds[] = {
        { TESSERA__ENVELOPE__BODY_REGISTER, "register" },
        { TESSERA__ENVELOPE__BODY_REGISTER_REPLY, "register_reply" },
        { TESSERA__ENVELOPE__BODY_HEARTBEAT, "heartbeat" },
        { TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK, "heartbeat_ack" },
        { TESSERA__ENVELOPE__BODY_ASSIGN, "assign" },
        { TESSERA__ENVELOPE__BODY_PROGRESS, "progress" },
        { TESSERA__ENVELOPE__BODY_READY, "ready" },
        { TESSERA__ENVELOPE__BODY_FAILED, "failed" },
        { TESSERA__ENVELOPE__BODY_UNASSIGN, "unassign" },
        { TESSERA__ENVELOPE__BODY_DRAIN, "drain" },
        { TESSERA__ENVELOPE__BODY_RESET, "reset" },
        { TESSERA__ENVELOPE__BODY_CONTROL_REQUEST, "control_request" },
        { TESSERA__ENVELOPE__BODY_CONTROL_REPLY, "control_reply" },
        { TESSERA__ENVELOPE__BODY_GENERATE, "generate" },
        { TESSERA__ENVELOPE__BODY_TOKEN_EVENT, "token_event" },
        { TESSERA__ENVELOPE__BODY_CANCEL, "cancel" },
    };
    static script_t s;
    size_t n;

    if (argc > 1) out_dir = argv[1];
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        uint8_t *m = make(kinds[i].body, "w0", 3, &n);
        put_file("fuzz_wire", kinds[i].name, m, n);
        free(m);
    }

    /* Registration, readiness and a request served to the end. */
    s.n = 0;
    cluster_up(&s);
    for (int w = 0; w < 5; w++) msg(&s, w, 0, TESSERA__ENVELOPE__BODY_PROGRESS, 1);
    for (int w = 0; w < 5; w++) msg(&s, w, 0, TESSERA__ENVELOPE__BODY_READY, 1);
    control(&s, TESSERA__CONTROL_REQUEST__KIND__GENERATE, NULL, 0);
    for (int w = 0; w < 5; w++) msg(&s, w, 0, TESSERA__ENVELOPE__BODY_TOKEN_EVENT, 1);
    control(&s, TESSERA__CONTROL_REQUEST__KIND__STATUS, NULL, 1);
    put_script("serve", &s);

    /* A piece fails, then a worker reports a fatal error, then one goes
     * silent past its timeout. */
    s.n = 0;
    cluster_up(&s);
    for (int w = 0; w < 5; w++) msg(&s, w, 0, TESSERA__ENVELOPE__BODY_READY, 1);
    msg(&s, 1, 0, TESSERA__ENVELOPE__BODY_FAILED, 1);
    msg(&s, 2, 0, TESSERA__ENVELOPE__BODY_REGISTER, 0);
    msg(&s, 3, 31, TESSERA__ENVELOPE__BODY_HEARTBEAT, 1);
    msg(&s, 0, 31, TESSERA__ENVELOPE__BODY_HEARTBEAT, 1);
    control(&s, TESSERA__CONTROL_REQUEST__KIND__WORKERS, NULL, 0);
    put_script("failures", &s);

    /* Every control request. */
    s.n = 0;
    cluster_up(&s);
    control(&s, TESSERA__CONTROL_REQUEST__KIND__STATUS, NULL, 0);
    control(&s, TESSERA__CONTROL_REQUEST__KIND__WORKERS, NULL, 0);
    control(&s, TESSERA__CONTROL_REQUEST__KIND__DRAIN, "w1", 1);
    control(&s, TESSERA__CONTROL_REQUEST__KIND__UNDRAIN, "w1", 1);
    control(&s, TESSERA__CONTROL_REQUEST__KIND__RELOAD, NULL, 1);
    control(&s, TESSERA__CONTROL_REQUEST__KIND__GENERATE, NULL, 10);
    control(&s, TESSERA__CONTROL_REQUEST__KIND__STATUS, NULL, 0);
    put_script("control", &s);

    /* Messages the coordinator should never get from a worker. */
    s.n = 0;
    cluster_up(&s);
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        msg(&s, (int)i % 5, 0, kinds[i].body, 1);
    put_script("every_kind", &s);

    /* The worker's side: accepted, acked, assigned, asked to generate and
     * cancel, then unassigned, drained, reset; and one whose lease runs out
     * (records for the agent: [clock step in 10 ms][len][message]). */
    static const int life[] = {
        TESSERA__ENVELOPE__BODY_REGISTER_REPLY, TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK,
        TESSERA__ENVELOPE__BODY_ASSIGN, TESSERA__ENVELOPE__BODY_GENERATE,
        TESSERA__ENVELOPE__BODY_CANCEL, TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK,
        TESSERA__ENVELOPE__BODY_UNASSIGN, TESSERA__ENVELOPE__BODY_ASSIGN,
        TESSERA__ENVELOPE__BODY_DRAIN, TESSERA__ENVELOPE__BODY_RESET,
    };
    s.n = 0;
    for (size_t i = 0; i < sizeof life / sizeof life[0]; i++) {
        uint8_t *m = make(life[i], "w0", 3 + i, &n);
        rec(&s, 10, 0, m, n);
        free(m);
    }
    put_file("fuzz_agent", "life", s.b, s.n);
    s.n = 0;
    for (int i = 0; i < 3; i++) {
        uint8_t *m = make(i ? TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK
                            : TESSERA__ENVELOPE__BODY_REGISTER_REPLY, "w0", 3, &n);
        rec(&s, 0, 0, m, n);
        free(m);
    }
    {
        uint8_t *m = make(TESSERA__ENVELOPE__BODY_ASSIGN, "w0", 4, &n);
        rec(&s, 31, 31, m, n);   /* 255 x 10 ms: past the 1 s lease */
        free(m);
    }
    put_file("fuzz_agent", "lease", s.b, s.n);
    return 0;
}
