/* fuzz_coordinator.c: the coordinator's message handlers (loop.c's and
 * register.c's worker messages, control.c's requests, router.c's tokens) driven in
 * process, as tests/unit/test_coordinator.c drives them: a real coordinator on
 * inproc endpoints, fake workers and a fake CLI as DEALER sockets.
 *
 * An input is a script of records, each [op][len lo][len hi][len bytes]:
 *   op & 7 in 0..4  the bytes are sent by worker dealer op & 7
 *   op & 7 == 5     the bytes are sent by the CLI's dealer (control endpoint)
 *   op & 7 in 6..7  no message: only the clock moves
 * and after each record the clock moves by (op >> 3) * 50 ms (0 to 1.55 s,
 * so heartbeat timeouts, deadlines and retries are reached), the coordinator
 * reads its sockets and ticks.  The bytes are what the coordinator receives,
 * so they go through tsr_wire_recv / tsr_wire_decode first, as in
 * production.  A fresh coordinator serves each input, so a finding replays
 * alone.  tests/fuzz/mkcorpus.c writes the seeds: registrations,
 * heartbeats, readiness, tokens, failures and every control request. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <jansson.h>
#include <zmq.h>

#include "common/log.h"
#include "common/wire.h"
#include "coordinator/loop.h"
#include "coordinator/status.h"

#define NW 5

static char dir[256], yaml[300], model[300];
static int seq;

/* A tiny Llama (4 layers, 4 heads over 2 KV heads): tp 2 x pp 2 fits it. */
static const char *config_json =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64,\n"
    " \"intermediate_size\": 128, \"num_hidden_layers\": 4, \"num_attention_heads\": 4,\n"
    " \"num_key_value_heads\": 2, \"vocab_size\": 256, \"max_position_embeddings\": 512,\n"
    " \"hidden_act\": \"silu\", \"torch_dtype\": \"float32\", \"eos_token_id\": 2}\n";

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) { perror(path); exit(1); }
}

static void cleanup(void)
{
    char p[400];
    snprintf(p, sizeof p, "%s/config.json", model);
    unlink(p);
    rmdir(model);
    unlink(yaml);
    rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc; (void)argv;
    tsr_log_init("fuzz", TSR_LOG_ERROR + 1);
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/tsr-fuzz-coord-XXXXXX", base ? base : "/tmp");
    if (!mkdtemp(dir)) { perror(dir); exit(1); }
    snprintf(model, sizeof model, "%s/model", dir);
    snprintf(yaml, sizeof yaml, "%s/cluster.yaml", dir);
    if (mkdir(model, 0700) < 0) { perror(model); exit(1); }
    char p[400];
    snprintf(p, sizeof p, "%s/config.json", model);
    write_file(p, config_json);
    atexit(cleanup);
    return 0;
}

/* Writes the deployment file for fresh inproc endpoints (security: none:
 * the messages are driven in process, past the transport). */
static tsr_coord_t *coord_new(char *wep, char *cep, size_t eplen)
{
    char text[1024], err[512] = "";
    tsr_coord_t *c = NULL;
    int id = ++seq;

    snprintf(wep, eplen, "inproc://fuzz-w-%d", id);
    snprintf(cep, eplen, "inproc://fuzz-c-%d", id);
    {
        snprintf(text, sizeof text,
                 "version: 1\n"
                 "coordinator:\n"
                 "  workers_endpoint: %s\n"
                 "  control_endpoint: %s\n"
                 "  heartbeat_interval_ms: 100\n"
                 "  worker_timeout_ms: 1000\n"
                 "  security: none\n"
                 "deployments:\n"
                 "  - name: tiny\n"
                 "    model: model\n"
                 "    parallel: {tensor: 2, pipeline: 2, replicas: 1}\n"
                 "    max_seq_len: 256\n"
                 "    max_queue: 4\n",
                 wep, cep);
        write_file(yaml, text);
        c = tsr_coord_new(yaml, 0, err, sizeof err);
    }
    if (c == NULL) {
        fprintf(stderr, "fuzz_coordinator: tsr_coord_new: %s\n", err);
        exit(1);
    }
    return c;
}

/* Throws away what the coordinator sent, so its queues never fill. */
static void discard(void *sock)
{
    char buf[256];
    for (int i = 0; i < 1000 && zmq_recv(sock, buf, sizeof buf, ZMQ_DONTWAIT) >= 0; i++) {
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char wep[64], cep[64], err[256];
    void *dealer[NW + 1];
    tsr_coord_t *c = coord_new(wep, cep, sizeof wep);
    int64_t now = tsr_now_ms();

    for (int i = 0; i <= NW; i++) {
        dealer[i] = tsr_sock_dealer(i < NW ? wep : cep, 0, err, sizeof err);
        if (!dealer[i]) { fprintf(stderr, "fuzz_coordinator: dealer: %s\n", err); exit(1); }
    }
    tsr_coord_tick(c, now);
    while (size >= 3) {
        uint8_t op = data[0];
        size_t len = (size_t)data[1] | (size_t)data[2] << 8;
        data += 3;
        size -= 3;
        if (len > size) len = size;
        int who = op & 7;
        if (who <= NW)
            zmq_send(dealer[who], data, len, ZMQ_DONTWAIT);
        data += len;
        size -= len;
        now += (op >> 3) * 50;
        tsr_coord_drain_sockets(c, 64);
        tsr_coord_tick(c, now);
        for (int i = 0; i <= NW; i++) discard(dealer[i]);
    }
    /* What an operator asks next must still be answerable, in valid JSON
     * (one NaN once broke every later status). */
    char *s = tsr_coord_status_json(c, now, false);
    json_error_t jerr;
    json_t *doc = s ? json_loads(s, 0, &jerr) : NULL;
    if (doc == NULL) {
        fprintf(stderr, "fuzz_coordinator: status is not valid JSON: %s\n%.2000s\n",
                s ? jerr.text : "(null)", s ? s : "");
        abort();
    }
    json_decref(doc);
    free(s);
    for (int i = 0; i <= NW; i++) tsr_sock_close(&dealer[i]);
    tsr_coord_destroy(&c);
    return 0;
}
