/* serve.c: a serving load generator in the style of vLLM's benchmark_serving.
 *
 * Runs C concurrent streams against a coordinator's control endpoint.  Each
 * stream owns one DEALER socket (the coordinator routes replies by the
 * socket's identity) and sends its next GENERATE as soon as the previous one
 * finished, so C requests are in flight at all times.  All sockets are
 * polled from this one thread; every timestamp is CLOCK_MONOTONIC.
 *
 * A request is: a prompt of random length in [--min-prompt, --max-prompt]
 * with random ids below --vocab, --max-tokens, greedy.  The k-th request
 * sent (whichever stream sends it) draws from a PRNG seeded with --seed and
 * k, so runs at different concurrency with the same number of requests send
 * the same prompts, and their figures compare.  The coordinator answers with an acceptance
 * ({"request_id",...,"accepted":1}), then one document per token
 * ({"token","index","done","finish_reason"}); a refusal or a failure comes as
 * ok=false with the reason.  Both count as a failed request.
 *
 * Figures: requests done and failed, generated tokens, wall time, aggregate
 * generated tokens/s, TTFT (send to first token) and ITL (gap between
 * consecutive tokens of one request) p50/p99, and each request's decode rate
 * ((tokens - 1) / (last - first)) averaged, the speed one stream sees, and
 * the best of them (on a shared host, the one least disturbed).
 *
 * With --http HOST:PORT the same requests go to the coordinator's HTTP API instead
 * (POST /v1/completions, the prompt as token ids, stream: true with usage), one
 * HTTP/1.0 connection per request, polled with the others: TTFT is then the time to the
 * first server-sent event with text, ITL the gap between events (one per token, unless
 * a character split across tokens merges two), and the tokens are the usage's.  The
 * figures of the two modes compare: the same program, clock and prompts.
 *
 * Exit status: 0 every request finished, 1 some failed or could not be sent
 * (the reasons are printed), 2 bad usage. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/wire.h"

/* One DEALER per stream costs two descriptors (its connection and its
 * mailbox), and a ZeroMQ context holds at most 1023 sockets by default. */
#define MAX_STREAMS 1000
#define MAX_PROMPT 65536
#define MAX_ERRORS_SHOWN 5

/* ---- numbers ------------------------------------------------------------- */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* A growable array of samples (milliseconds or rates). */
typedef struct {
    double *v;
    size_t n, cap;
} samples_t;

static int samples_add(samples_t *s, double x)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 1024;
        double *v = realloc(s->v, cap * sizeof *v);
        if (!v) return -1;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = x;
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile of the (sorted) samples; NAN when there are none. */
static double percentile(const samples_t *s, double p)
{
    if (s->n == 0) return NAN;
    size_t rank = (size_t)ceil(p / 100.0 * (double)s->n);
    return s->v[rank ? rank - 1 : 0];
}

static double mean(const samples_t *s)
{
    double sum = 0;
    for (size_t i = 0; i < s->n; i++) sum += s->v[i];
    return s->n ? sum / (double)s->n : NAN;
}

/* splitmix64: small, seedable, good enough for prompt ids. */
static uint64_t rng_next(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint32_t rng_below(uint64_t *state, uint32_t n)
{
    return (uint32_t)(rng_next(state) % n);
}

/* ---- configuration ------------------------------------------------------- */

typedef struct {
    const char *endpoint, *deployment;
    const char *http;          /* HOST:PORT of the HTTP API, or NULL: the control endpoint */
    struct sockaddr_in http_addr;
    int concurrency, per_stream, min_prompt, max_prompt, max_tokens, vocab, json, timeout_ms;
    double duration_s;
    uint64_t seed;
} config_t;

/* ---- streams ------------------------------------------------------------- */

typedef struct {
    void *sock;
    int sent;                  /* requests sent so far */
    int busy;                  /* a request is in flight */
    int accepted;              /* ... and the coordinator took it */
    uint64_t request_id;       /* from the acceptance */
    int tokens;                /* tokens of the request in flight */
    int64_t t_send, t_first, t_last, t_activity;
    int fd;                    /* --http: the request's connection (-1: none) */
    char *in;                  /* --http: bytes received and not yet parsed */
    size_t in_len, in_cap;
    int headers_done, events;
} stream_t;

typedef struct {
    const config_t *cfg;
    stream_t *streams;
    int32_t *prompt;           /* scratch for building a request */
    int64_t t_start, t_stop;   /* t_stop: no new request after it (duration mode) */
    int64_t t_end;             /* last request finished */
    uint64_t sent;             /* requests sent by all streams: the next prompt's index */
    long done, failed, refused, tokens, prompt_tokens;
    long short_done;           /* finished before --max-tokens (eos, max_seq_len) */
    samples_t ttft_ms, itl_ms, decode_rate;
    char *errors[MAX_ERRORS_SHOWN];   /* the first distinct messages ... */
    long error_count[MAX_ERRORS_SHOWN];   /* ... and how often each came */
    int n_errors;
    long other_errors;         /* messages beyond the first MAX_ERRORS_SHOWN kinds */
} bench_t;

static void record_error(bench_t *b, const char *msg)
{
    for (int i = 0; i < b->n_errors; i++)
        if (!strcmp(b->errors[i], msg)) {
            b->error_count[i]++;
            return;
        }
    char *copy = b->n_errors < MAX_ERRORS_SHOWN ? strdup(msg) : NULL;
    if (!copy) {
        b->other_errors++;
        return;
    }
    b->error_count[b->n_errors] = 1;
    b->errors[b->n_errors++] = copy;
}

/* True when stream s may send another request. */
static int stream_wants_more(const bench_t *b, const stream_t *s, int64_t now)
{
    if (b->cfg->duration_s > 0) return now < b->t_stop;
    return s->sent < b->cfg->per_stream;
}

static void stream_finish(bench_t *b, stream_t *s, int64_t now);

/* --http: the request in flight ends (its connection closes). */
static void http_end(bench_t *b, stream_t *s, int64_t now, const char *error)
{
    if (error) {
        record_error(b, error);
        b->failed++;
    }
    if (s->fd >= 0) close(s->fd);
    s->fd = -1;
    s->in_len = 0;
    stream_finish(b, s, now);
}

/* --http: one server-sent event's data. */
static void http_event(bench_t *b, stream_t *s, const char *data, int64_t now)
{
    if (!strcmp(data, "[DONE]")) {
        if (s->tokens > 1 && s->t_last > s->t_first)
            samples_add(&b->decode_rate, (s->tokens - 1) * 1e9 / (double)(s->t_last - s->t_first));
        b->done++;
        http_end(b, s, now, NULL);
        return;
    }
    json_t *doc = json_loads(data, 0, NULL);
    if (!doc) return;
    json_t *err = json_object_get(doc, "error");
    if (err) {
        const char *m = json_string_value(json_object_get(err, "message"));
        json_decref(doc);
        http_end(b, s, now, m ? m : "an error event");
        return;
    }
    json_t *usage = json_object_get(doc, "usage");
    if (json_is_object(usage)) {
        int t = (int)json_integer_value(json_object_get(usage, "completion_tokens"));
        b->tokens += t;
        s->tokens = t;
        b->short_done += t < b->cfg->max_tokens;
    }
    json_t *choice = json_array_get(json_object_get(doc, "choices"), 0);
    const char *text = json_string_value(json_object_get(choice, "text"));
    if (text && *text) {
        if (s->events++ == 0) {
            s->t_first = now;
            samples_add(&b->ttft_ms, (double)(now - s->t_send) / 1e6);
        } else {
            samples_add(&b->itl_ms, (double)(now - s->t_last) / 1e6);
        }
        s->t_last = now;
    }
    json_decref(doc);
}

/* --http: reads what the connection has and takes in the complete events. */
static void http_drain(bench_t *b, stream_t *s)
{
    for (;;) {
        if (s->in_len + 4096 + 1 > s->in_cap) {
            size_t cap = s->in_cap ? s->in_cap * 2 : 16384;
            char *p = realloc(s->in, cap);
            if (!p) {
                http_end(b, s, now_ns(), "out of memory");
                return;
            }
            s->in = p;
            s->in_cap = cap;
        }
        ssize_t r = read(s->fd, s->in + s->in_len, s->in_cap - s->in_len - 1);
        int64_t now = now_ns();
        if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
        if (r <= 0) {
            http_end(b, s, now, r < 0 ? strerror(errno) : "the server closed the connection "
                                                           "before [DONE]");
            return;
        }
        s->in_len += (size_t)r;
        s->in[s->in_len] = '\0';
        s->t_activity = now;
        char *p = s->in;
        if (!s->headers_done) {
            char *end = strstr(p, "\r\n\r\n");
            if (!end) continue;
            if (strncmp(p, "HTTP/1.", 7) || strncmp(p + 9, "200", 3)) {
                char msg[256];
                snprintf(msg, sizeof msg, "HTTP %.3s: %.200s", p + 9, end + 4);
                if (!strncmp(p + 9, "503", 3)) b->refused++;
                http_end(b, s, now, msg);
                return;
            }
            s->headers_done = 1;
            p = end + 4;
        }
        char *ev;
        while (s->fd >= 0 && (ev = strstr(p, "\n\n"))) {
            *ev = '\0';
            if (!strncmp(p, "data: ", 6)) http_event(b, s, p + 6, now);
            p = ev + 2;
        }
        if (s->fd < 0) return;
        s->in_len -= (size_t)(p - s->in);
        memmove(s->in, p, s->in_len);
    }
}

/* --http: the request as an HTTP/1.0 POST on a new connection. */
static int http_send(bench_t *b, stream_t *s, const int32_t *prompt, int n)
{
    const config_t *cfg = b->cfg;
    json_t *ids = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(ids, json_integer(prompt[i]));
    json_t *body = json_pack("{s:s, s:o, s:i, s:i, s:b, s:{s:b}}", "model", cfg->deployment,
                             "prompt", ids, "max_tokens", cfg->max_tokens, "temperature", 0,
                             "stream", 1, "stream_options", "include_usage", 1);
    char *js = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    if (!js) return -1;
    size_t jl = strlen(js);
    char head[256];
    int hl = snprintf(head, sizeof head, "POST /v1/completions HTTP/1.0\r\nHost: %s\r\n"
                      "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                      cfg->http, jl);
    s->headers_done = 0;
    s->events = 0;
    s->in_len = 0;
    s->fd = socket(AF_INET, SOCK_STREAM, 0);
    int rc = -1;
    if (s->fd >= 0 && connect(s->fd, (const struct sockaddr *)&cfg->http_addr,
                              sizeof cfg->http_addr) == 0 &&
        write(s->fd, head, (size_t)hl) == hl && write(s->fd, js, jl) == (ssize_t)jl) {
        fcntl(s->fd, F_SETFL, fcntl(s->fd, F_GETFL) | O_NONBLOCK);
        rc = 0;
    }
    free(js);
    return rc;
}

/* Sends the stream's next request.  Returns 0, or -1 (counted as failed). */
static int stream_send(bench_t *b, stream_t *s)
{
    const config_t *cfg = b->cfg;
    uint64_t rng = cfg->seed * 1000003ULL + b->sent++;
    int n = cfg->min_prompt + (int)rng_below(&rng, (uint32_t)(cfg->max_prompt - cfg->min_prompt + 1));
    for (int i = 0; i < n; i++) b->prompt[i] = (int32_t)rng_below(&rng, (uint32_t)cfg->vocab);

    Tessera__ControlRequest q = TESSERA__CONTROL_REQUEST__INIT;
    q.kind = TESSERA__CONTROL_REQUEST__KIND__GENERATE;
    q.deployment = (char *)cfg->deployment;
    q.worker = "";
    q.n_prompt = (size_t)n;
    q.prompt = b->prompt;
    q.max_tokens = (uint32_t)cfg->max_tokens;
    q.temperature = 0.0f;  /* greedy */
    q.top_p = 1.0f;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = "";
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REQUEST;
    env.control_request = &q;

    s->sent++;
    s->busy = 1;
    s->accepted = 0;
    s->request_id = 0;
    s->tokens = 0;
    s->t_send = s->t_activity = now_ns();
    if (cfg->http) {
        if (http_send(b, s, b->prompt, n) < 0) {
            char msg[300];
            snprintf(msg, sizeof msg, "cannot send to http://%s: %s", cfg->http, strerror(errno));
            record_error(b, msg);
            b->failed++;
            if (s->fd >= 0) close(s->fd);
            s->fd = -1;
            s->busy = 0;
            return -1;
        }
        b->prompt_tokens += n;
        return 0;
    }
    if (tsr_wire_send(s->sock, NULL, 0, &env) < 0) {
        char msg[256];
        snprintf(msg, sizeof msg, "cannot send to %s: %s", cfg->endpoint, zmq_strerror(errno));
        record_error(b, msg);
        b->failed++;
        s->busy = 0;
        return -1;
    }
    b->prompt_tokens += n;
    return 0;
}

/* The request in flight on s is over (done or failed). */
static void stream_finish(bench_t *b, stream_t *s, int64_t now)
{
    s->busy = 0;
    if (now > b->t_end) b->t_end = now;
}

/* Gives up on the request in flight: counts it failed and replaces the
 * socket, so late replies to the old request (routed by the old socket's
 * identity) can never be taken for the next one's. */
static void stream_abandon(bench_t *b, stream_t *s, int64_t now, const char *why)
{
    char err[256];
    if (b->cfg->http) {
        http_end(b, s, now, why);
        return;
    }
    record_error(b, why);
    b->failed++;
    stream_finish(b, s, now);
    tsr_sock_close(&s->sock);
    s->sock = tsr_sock_dealer(b->cfg->endpoint, 0, err, sizeof err);
    if (!s->sock) record_error(b, err);
}

/* One reply for stream s. */
static void stream_reply(bench_t *b, stream_t *s, const Tessera__ControlReply *r, int64_t now)
{
    if (!s->busy) return;  /* nothing asked: a stray */
    s->t_activity = now;
    if (!r->ok) {
        if (!s->accepted) b->refused++;
        record_error(b, r->error && r->error[0] ? r->error : "failed without a reason");
        b->failed++;
        stream_finish(b, s, now);
        return;
    }
    json_t *doc = json_loads(r->json ? r->json : "", 0, NULL);
    if (!doc) return;
    json_t *tok = json_object_get(doc, "token");
    uint64_t id = (uint64_t)json_integer_value(json_object_get(doc, "request_id"));
    if (!tok) {  /* the acceptance */
        s->accepted = 1;
        s->request_id = id;
        json_decref(doc);
        return;
    }
    int done = json_is_true(json_object_get(doc, "done"));
    const char *finish = json_string_value(json_object_get(doc, "finish_reason"));
    int short_finish = done && (!finish || strcmp(finish, "max_tokens"));
    json_decref(doc);
    if (s->accepted && id != s->request_id) return;  /* not ours */
    if (s->tokens == 0) {
        s->t_first = now;
        samples_add(&b->ttft_ms, (double)(now - s->t_send) / 1e6);
    } else {
        samples_add(&b->itl_ms, (double)(now - s->t_last) / 1e6);
    }
    s->t_last = now;
    s->tokens++;
    b->tokens++;
    if (done) {
        b->done++;
        b->short_done += short_finish;
        if (s->tokens > 1 && s->t_last > s->t_first)
            samples_add(&b->decode_rate, (s->tokens - 1) * 1e9 / (double)(s->t_last - s->t_first));
        stream_finish(b, s, now);
    }
}

/* Reads everything waiting on s. */
static void stream_drain(bench_t *b, stream_t *s)
{
    char err[256];
    for (;;) {
        tsr_env_t *env = NULL;
        int r = tsr_wire_recv(s->sock, NULL, NULL, TSR_WIRE_MAX_CONTROL, &env, err, sizeof err);
        if (r == 0) return;
        int64_t now = now_ns();
        if (r < 0) {
            char msg[320];
            snprintf(msg, sizeof msg, "bad reply: %s", err);
            record_error(b, msg);
            continue;
        }
        if (env->body_case == TESSERA__ENVELOPE__BODY_CONTROL_REPLY)
            stream_reply(b, s, env->control_reply, now);
        tsr_env_free(&env);
    }
}

/* ---- the run ------------------------------------------------------------- */

static int run(bench_t *b)
{
    const config_t *cfg = b->cfg;
    int C = cfg->concurrency;
    zmq_pollitem_t *items = calloc((size_t)C, sizeof *items);
    int *index = calloc((size_t)C, sizeof *index);
    int rc = -1;
    if (!items || !index) goto out;
    char err[256];
    for (int i = 0; i < C; i++) {
        stream_t *s = &b->streams[i];
        s->fd = -1;
        if (cfg->http) continue;
        if (!(s->sock = tsr_sock_dealer(cfg->endpoint, 0, err, sizeof err))) {
            fprintf(stderr, "serve: %s\n", err);
            goto out;
        }
    }
    b->t_start = b->t_end = now_ns();
    b->t_stop = b->t_start + (int64_t)(cfg->duration_s * 1e9);
    for (int i = 0; i < C; i++) stream_send(b, &b->streams[i]);

    for (;;) {
        int64_t now = now_ns();
        /* Refill idle streams, and find the nearest timeout. */
        int n = 0;
        int64_t wait_ns = INT64_MAX;
        for (int i = 0; i < C; i++) {
            stream_t *s = &b->streams[i];
            int open = cfg->http ? 1 : s->sock != NULL;
            while (!s->busy && open && stream_wants_more(b, s, now)) stream_send(b, s);
            if (!s->busy || !open) continue;
            int64_t left = s->t_activity + (int64_t)cfg->timeout_ms * 1000000 - now;
            if (left <= 0) {
                char why[160];
                snprintf(why, sizeof why, "no %s within %d ms (see --timeout)",
                         s->accepted ? "token" : "answer from the coordinator", cfg->timeout_ms);
                stream_abandon(b, s, now, why);
                i--;  /* look at it again: it may send its next request */
                continue;
            }
            if (left < wait_ns) wait_ns = left;
            items[n] = cfg->http ? (zmq_pollitem_t){NULL, s->fd, ZMQ_POLLIN, 0}
                                 : (zmq_pollitem_t){s->sock, 0, ZMQ_POLLIN, 0};
            index[n++] = i;
        }
        if (n == 0) break;  /* nothing in flight, nothing more to send */
        long wait_ms = (long)(wait_ns / 1000000) + 1;
        if (zmq_poll(items, n, wait_ms) < 0) {
            if (errno == EINTR) continue;
            fprintf(stderr, "serve: zmq_poll: %s\n", zmq_strerror(errno));
            goto out;
        }
        for (int k = 0; k < n; k++)
            if (items[k].revents & (ZMQ_POLLIN | ZMQ_POLLERR)) {
                if (cfg->http) http_drain(b, &b->streams[index[k]]);
                else stream_drain(b, &b->streams[index[k]]);
            }
    }
    rc = 0;
out:
    for (int i = 0; i < C; i++) {
        tsr_sock_close(&b->streams[i].sock);
        if (b->streams[i].fd >= 0) close(b->streams[i].fd);
        free(b->streams[i].in);
    }
    free(items);
    free(index);
    return rc;
}

/* ---- report -------------------------------------------------------------- */

/* v with prec decimals into buf, or "-" when there were no samples. */
static const char *fig(char *buf, size_t len, double v, int prec)
{
    if (isnan(v)) snprintf(buf, len, "-");
    else snprintf(buf, len, "%.*f", prec, v);
    return buf;
}

static void report(bench_t *b)
{
    const config_t *cfg = b->cfg;
    double wall = (double)(b->t_end - b->t_start) / 1e9;
    double tps = wall > 0 ? (double)b->tokens / wall : 0;
    qsort(b->ttft_ms.v, b->ttft_ms.n, sizeof(double), cmp_double);
    qsort(b->itl_ms.v, b->itl_ms.n, sizeof(double), cmp_double);
    double decode = mean(&b->decode_rate);
    qsort(b->decode_rate.v, b->decode_rate.n, sizeof(double), cmp_double);
    double decode_best = percentile(&b->decode_rate, 100);
    if (cfg->json) {
        /* NaN (no samples) is not JSON: write null. */
        json_t *doc = json_pack("{s:s, s:i, s:i, s:i, s:i, s:I, s:I, s:I, s:I, s:I, s:f, s:f}",
                                "deployment", cfg->deployment, "concurrency", cfg->concurrency,
                                "max_tokens", cfg->max_tokens, "min_prompt", cfg->min_prompt,
                                "max_prompt", cfg->max_prompt, "requests", (json_int_t)(b->done + b->failed),
                                "done", (json_int_t)b->done, "failed", (json_int_t)b->failed,
                                "refused", (json_int_t)b->refused, "tokens", (json_int_t)b->tokens,
                                "wall_s", wall, "tok_per_s", tps);
        json_object_set_new(doc, "prompt_tokens", json_integer(b->prompt_tokens));
        json_object_set_new(doc, "stopped_early", json_integer(b->short_done));
        struct { const char *key; double v; } figs[] = {
            {"ttft_p50_ms", percentile(&b->ttft_ms, 50)}, {"ttft_p99_ms", percentile(&b->ttft_ms, 99)},
            {"itl_p50_ms", percentile(&b->itl_ms, 50)},   {"itl_p99_ms", percentile(&b->itl_ms, 99)},
            {"itl_mean_ms", mean(&b->itl_ms)},            {"itl_max_ms", percentile(&b->itl_ms, 100)},
            {"ttft_max_ms", percentile(&b->ttft_ms, 100)},  {"decode_tok_per_s", decode},
            {"decode_best_tok_per_s", decode_best},
        };
        for (size_t i = 0; i < sizeof figs / sizeof figs[0]; i++)
            json_object_set_new(doc, figs[i].key, isnan(figs[i].v) ? json_null() : json_real(figs[i].v));
        json_t *errs = json_array();
        for (int i = 0; i < b->n_errors; i++)
            json_array_append_new(errs, json_pack("{s:s, s:I}", "error", b->errors[i], "count",
                                                  (json_int_t)b->error_count[i]));
        json_object_set_new(doc, "errors", errs);
        char *s = json_dumps(doc, JSON_COMPACT | JSON_REAL_PRECISION(6));
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(doc);
    } else {
        printf("deployment %s, concurrency %d, prompts %d-%d tokens, max %d new tokens, greedy\n",
               cfg->deployment, cfg->concurrency, cfg->min_prompt, cfg->max_prompt, cfg->max_tokens);
        printf("requests:           %ld done (%ld stopped before max tokens), %ld failed "
               "(%ld refused)\n", b->done, b->short_done, b->failed, b->refused);
        printf("prompt tokens:      %ld\n", b->prompt_tokens);
        printf("generated tokens:   %ld\n", b->tokens);
        printf("wall time:          %.2f s\n", wall);
        printf("aggregate:          %.1f generated tok/s\n", tps);
        char f1[32], f2[32];
        printf("TTFT p50 / p99:     %s / %s ms\n", fig(f1, sizeof f1, percentile(&b->ttft_ms, 50), 1),
               fig(f2, sizeof f2, percentile(&b->ttft_ms, 99), 1));
        printf("ITL p50 / p99:      %s / %s ms\n", fig(f1, sizeof f1, percentile(&b->itl_ms, 50), 2),
               fig(f2, sizeof f2, percentile(&b->itl_ms, 99), 2));
        printf("decode per stream:  %s tok/s (mean over requests), best request %s\n",
               fig(f1, sizeof f1, decode, 1), fig(f2, sizeof f2, decode_best, 1));
    }
    if (b->failed || b->n_errors) {
        fprintf(stderr, "serve: %ld of %ld request(s) failed:\n", b->failed, b->done + b->failed);
        for (int i = 0; i < b->n_errors; i++)
            fprintf(stderr, "  %ld x %s\n", b->error_count[i], b->errors[i]);
        if (b->other_errors) fprintf(stderr, "  and %ld other message(s)\n", b->other_errors);
    }
}

/* ---- main ---------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: serve --deployment NAME --vocab V [options]\n"
            "\n"
            "Serving load generator: C streams, each sending its next GENERATE request as\n"
            "soon as the previous one finished, against a coordinator's control endpoint.\n"
            "  --coordinator EP          control endpoint (default $TESSERA_COORDINATOR,\n"
            "                            else tcp://127.0.0.1:7401)\n"
            "  --http HOST:PORT          send the requests to the HTTP API instead\n"
            "                            (POST /v1/completions, streamed; numeric IPv4 host)\n"
            "  --deployment NAME         deployment to send requests to (required)\n"
            "  --vocab V                 prompt ids are drawn below V (required)\n"
            "  --concurrency C           streams (default 1, at most %d)\n"
            "  --requests-per-stream N   requests each stream sends (default 4)\n"
            "  --duration S              instead: send new requests for S seconds, then let\n"
            "                            those in flight finish\n"
            "  --min-prompt N            shortest prompt (default 8)\n"
            "  --max-prompt N            longest prompt (default 256)\n"
            "  --max-tokens N            tokens to generate per request (default 128)\n"
            "  --seed S                  prompt seed (default 1)\n"
            "  --timeout MS              fail a request that waits this long for its\n"
            "                            acceptance or its next token (default 300000)\n"
            "  --json                    one JSON line instead of the table\n"
            "\n"
            "exit status: 0 every request finished, 1 some failed (reasons printed),\n"
            "2 bad usage.\n",
            MAX_STREAMS);
}

/* Parses a whole number in [lo, hi] into *out; 0 or -1 with a message. */
static int parse_int(const char *opt, const char *s, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "serve: --%s: '%s' is not a whole number in [%ld, %ld]\n", opt, s, lo, hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int parse_args(int argc, char **argv, config_t *cfg)
{
    const char *env_ep = getenv("TESSERA_COORDINATOR");
    *cfg = (config_t){.endpoint = env_ep && env_ep[0] ? env_ep : "tcp://127.0.0.1:7401",
                      .concurrency = 1, .per_stream = 4, .min_prompt = 8, .max_prompt = 256,
                      .max_tokens = 128, .seed = 1, .timeout_ms = 300000};
    static const struct option opts[] = {
        {"coordinator", required_argument, 0, 'c'}, {"deployment", required_argument, 0, 'd'},
        {"concurrency", required_argument, 0, 'C'}, {"requests-per-stream", required_argument, 0, 'n'},
        {"duration", required_argument, 0, 'D'},    {"min-prompt", required_argument, 0, 'p'},
        {"max-prompt", required_argument, 0, 'P'},  {"max-tokens", required_argument, 0, 'm'},
        {"vocab", required_argument, 0, 'v'},       {"seed", required_argument, 0, 's'},
        {"timeout", required_argument, 0, 't'},     {"json", no_argument, 0, 'j'},
        {"http", required_argument, 0, 'H'},
        {"help", no_argument, 0, 'h'},              {0, 0, 0, 0}};
    int o, per_stream_set = 0;
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        char *end;
        int bad = 0;
        switch (o) {
        case 'c': cfg->endpoint = optarg; break;
        case 'd': cfg->deployment = optarg; break;
        case 'C': bad = parse_int("concurrency", optarg, 1, MAX_STREAMS, &cfg->concurrency); break;
        case 'n':
            bad = parse_int("requests-per-stream", optarg, 1, 1000000, &cfg->per_stream);
            per_stream_set = 1;
            break;
        case 'D':
            cfg->duration_s = strtod(optarg, &end);
            if (end == optarg || *end || !(cfg->duration_s > 0 && cfg->duration_s <= 86400)) {
                fprintf(stderr, "serve: --duration: '%s' is not a number of seconds in (0, 86400]\n",
                        optarg);
                bad = -1;
            }
            break;
        case 'p': bad = parse_int("min-prompt", optarg, 1, MAX_PROMPT, &cfg->min_prompt); break;
        case 'P': bad = parse_int("max-prompt", optarg, 1, MAX_PROMPT, &cfg->max_prompt); break;
        case 'm': bad = parse_int("max-tokens", optarg, 1, 1000000, &cfg->max_tokens); break;
        case 'v': bad = parse_int("vocab", optarg, 1, INT32_MAX, &cfg->vocab); break;
        case 's':
            errno = 0;
            cfg->seed = strtoull(optarg, &end, 10);
            if (errno || end == optarg || *end) {
                fprintf(stderr, "serve: --seed: '%s' is not a whole number\n", optarg);
                bad = -1;
            }
            break;
        case 't': bad = parse_int("timeout", optarg, 1, 3600000, &cfg->timeout_ms); break;
        case 'j': cfg->json = 1; break;
        case 'H': {
            cfg->http = optarg;
            char host[64];
            const char *colon = strrchr(optarg, ':');
            size_t hl = colon ? (size_t)(colon - optarg) : 0;
            int port = colon ? atoi(colon + 1) : 0;
            snprintf(host, sizeof host, "%.*s", (int)(hl < sizeof host ? hl : 0), optarg);
            cfg->http_addr.sin_family = AF_INET;
            cfg->http_addr.sin_port = htons((uint16_t)port);
            if (!colon || port < 1 || port > 65535 ||
                inet_pton(AF_INET, host, &cfg->http_addr.sin_addr) != 1) {
                fprintf(stderr, "serve: --http: '%s' is not IPV4:PORT\n", optarg);
                bad = -1;
            }
            break;
        }
        case 'h': usage(stdout); exit(0);
        default: usage(stderr); return -1;
        }
        if (bad) return -1;
    }
    if (optind != argc) {
        fprintf(stderr, "serve: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (!cfg->deployment || !cfg->vocab) {
        fprintf(stderr, "serve: --deployment and --vocab are required (see --help)\n");
        return -1;
    }
    if (cfg->min_prompt > cfg->max_prompt) {
        fprintf(stderr, "serve: --min-prompt %d is above --max-prompt %d\n", cfg->min_prompt,
                cfg->max_prompt);
        return -1;
    }
    if (per_stream_set && cfg->duration_s > 0) {
        fprintf(stderr, "serve: give --requests-per-stream or --duration, not both\n");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    config_t cfg;
    if (parse_args(argc, argv, &cfg) < 0) return 2;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;  /* 2 per stream: a soft limit of 1024 would stop near 500 */
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    bench_t b = {.cfg = &cfg};
    b.streams = calloc((size_t)cfg.concurrency, sizeof *b.streams);
    b.prompt = malloc((size_t)cfg.max_prompt * sizeof *b.prompt);
    int rc = 1;
    if (!b.streams || !b.prompt) {
        fprintf(stderr, "serve: out of memory\n");
        goto out;
    }
    if (run(&b) < 0) goto out;
    report(&b);
    rc = b.failed || b.done == 0 ? 1 : 0;
out:
    for (int i = 0; i < b.n_errors; i++) free(b.errors[i]);
    free(b.ttft_ms.v);
    free(b.itl_ms.v);
    free(b.decode_rate.v);
    free(b.streams);
    free(b.prompt);
    tsr_zmq_term();
    return rc;
}
