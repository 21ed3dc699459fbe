/* fuzz_agent.c: the worker's control-protocol handlers (worker/agent.c)
 * driven in process, as tests/unit/test_agent.c drives them: a real agent
 * connected to a fake coordinator, a ROUTER on an inproc endpoint.  The
 * agent has no executor, so the data plane is not reached: what is fuzzed is
 * what a worker does with the coordinator's messages (register replies,
 * acks, assignments, unassign, drain, reset, generate, cancel).
 *
 * An input is a script of records, each [op][len lo][len hi][len bytes]: the
 * bytes are sent to the agent as one message, then the clock moves by
 * op * 10 ms (up to 2.55 s, past leases and register backoffs) and the agent
 * steps.  A fresh agent serves each input.  Assignments name the model
 * directory /tmp/tsr-fuzz-agent-model, which holds a tiny config.json. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/wire.h"
#include "worker/agent.h"
#include "worker/device.h"

#define MODEL_DIR "/tmp/tsr-fuzz-agent-model"

static tsr_device_info_t dev;
static int seq;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc; (void)argv;
    char err[256];
    tsr_log_init("fuzz", TSR_LOG_ERROR + 1);
    if (tsr_device_probe(TSR_DEVICE_CPU, 0, &dev, err, sizeof err) < 0) {
        fprintf(stderr, "fuzz_agent: device probe: %s\n", err);
        exit(1);
    }
    mkdir(MODEL_DIR, 0755);
    FILE *f = fopen(MODEL_DIR "/config.json", "w");
    if (!f) { perror(MODEL_DIR); exit(1); }
    fputs("{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64,\n"
          " \"intermediate_size\": 128, \"num_hidden_layers\": 4, \"num_attention_heads\": 4,\n"
          " \"num_key_value_heads\": 2, \"vocab_size\": 256, \"max_position_embeddings\": 512,\n"
          " \"hidden_act\": \"silu\", \"torch_dtype\": \"float32\", \"eos_token_id\": 2}\n", f);
    fclose(f);
    return 0;
}

/* Throws away what the agent sent, keeping its routing id. */
static void drain(void *router, uint8_t *rid, size_t *rid_len)
{
    for (int i = 0; i < 1000; i++) {
        uint8_t buf[256];
        int n = zmq_recv(router, buf, sizeof buf, ZMQ_DONTWAIT);
        if (n < 0) break;
        int more = 0;
        size_t sz = sizeof more;
        zmq_getsockopt(router, ZMQ_RCVMORE, &more, &sz);
        if (more && n > 0 && (size_t)n <= sizeof buf) {
            memcpy(rid, buf, (size_t)n);
            *rid_len = (size_t)n;
        }
        while (more) {
            zmq_recv(router, buf, sizeof buf, ZMQ_DONTWAIT);
            zmq_getsockopt(router, ZMQ_RCVMORE, &more, &sz);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char ep[64], err[256];
    uint8_t rid[256];
    size_t rid_len = 0;

    snprintf(ep, sizeof ep, "inproc://fuzz-agent-%d", ++seq);
    void *router = tsr_sock_router(ep, err, sizeof err);
    if (!router) { fprintf(stderr, "fuzz_agent: router: %s\n", err); exit(1); }
    tsr_agent_t *a = tsr_agent_new("w0", "node0", ep, NULL, &dev, err, sizeof err);
    if (!a) { fprintf(stderr, "fuzz_agent: tsr_agent_new: %s\n", err); exit(1); }
    int64_t now = tsr_now_ms();
    tsr_agent_step(a, now);     /* it registers: that gives its routing id */
    drain(router, rid, &rid_len);
    while (size >= 3 && rid_len > 0 && !a->stop) {
        uint8_t op = data[0];
        size_t len = (size_t)data[1] | (size_t)data[2] << 8;
        data += 3;
        size -= 3;
        if (len > size) len = size;
        zmq_send(router, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(router, data, len, ZMQ_DONTWAIT);
        data += len;
        size -= len;
        now += op * 10;
        tsr_agent_step(a, now);
        drain(router, rid, &rid_len);
    }
    tsr_agent_destroy(&a);
    tsr_sock_close(&router);
    return 0;
}
