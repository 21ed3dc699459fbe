/* http.c: the OpenAI-compatible HTTP API; see http.h.
 *
 * A generation request goes to the coordinator as a GENERATE control request with the
 * text, token ids or chat messages, and want_text; the coordinator encodes it, routes
 * it, and sends back the acceptance, then one reply per token carrying the text that
 * token completes.  This file turns those into OpenAI's JSON: one document, or
 * server-sent events.  It cuts the text at stop strings (and cancels the rest), and
 * cancels when the client's connection closes.  The response's status is chosen only
 * once the first token (or the failure) is in, so a full queue is a 503 even when
 * streaming. */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/strbuf.h"
#include "common/util.h"
#include "common/wire.h"
#include "coordinator/chat.h"
#include "coordinator/tokref.h"

#define MAX_BODY (1u << 20)          /* request bodies above this get 413 */
#define MAX_STOPS 4
#define MAX_STOP_LEN 256
#define STATUS_WAIT_MS 5000          /* a status or metrics answer */
#define TOKEN_WAIT_MS 300000         /* no word from the coordinator for this long: 504 */
#define POLL_MS 100                  /* how often a waiting thread looks at its client */
#define MAX_REPLY (64u << 20)        /* a reply from the coordinator (metrics can be large) */
#define MAX_DISCARD (16u << 20)      /* a body past MAX_BODY read to answer 413, at most */
#define IDLE_TIMEOUT_S 30            /* a connection that sends nothing for this long closes
                                        (a streaming or waiting request is not idle) */
#define BODY_DEADLINE_MS 30000       /* a body must be in within this, however it trickles */
#define PER_CLIENT_CONNECTIONS 128   /* connections from one address at once */
#define MAX_CONNECTIONS 1024

#define TTL_MS 250                    /* /health, /v1/models and /metrics share one answer
                                         this long */

/* One answer of the loop, shared by every request for TTL_MS (a failure too: NULL). */
typedef struct {
    pthread_mutex_t mu;
    char *text;
    int64_t at;                 /* when it was fetched (0: never) */
} ttl_cache_t;

struct tsr_http {
    struct MHD_Daemon *d;
    tsr_tokreg_t *reg;               /* the deployments' tokenizers (the coordinator's) */
    char bridge[128];
    char **keys;
    size_t n_keys;
    /* The deployments document (/health, /v1/models) and the metrics text, each fetched
     * from the loop at most every TTL_MS whatever the number of requests: /health and
     * /metrics are open, and a flood of them costs the loop nothing. */
    ttl_cache_t deployments, metrics;
};


/* Appends; -1 once the buffer ran out of memory. */
static int hb_put(tsr_sb_t *b, const char *s, size_t n)
{
    tsr_sb_putn(b, s, n);
    return b->oom ? -1 : 0;
}

/* ---- responses ------------------------------------------------------------------- */

static enum MHD_Result respond(struct MHD_Connection *conn, unsigned status, const char *type,
                               const char *body, size_t len, int retry_after)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (retry_after > 0) {
        char v[16];
        snprintf(v, sizeof v, "%d", retry_after);
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, v);
    }
    enum MHD_Result rc = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result respond_json(struct MHD_Connection *conn, unsigned status, json_t *doc,
                                    int retry_after)
{
    char *s = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    if (!s) return MHD_NO;
    enum MHD_Result rc = respond(conn, status, "application/json", s, strlen(s), retry_after);
    free(s);
    return rc;
}

/* OpenAI's error document. */
static json_t *error_doc(const char *message, const char *type, const char *param,
                         const char *code)
{
    json_t *e = json_pack("{s:s, s:s}", "message", message, "type", type);
    json_object_set_new(e, "param", param ? json_string(param) : json_null());
    json_object_set_new(e, "code", code ? json_string(code) : json_null());
    return json_pack("{s:o}", "error", e);
}

static enum MHD_Result respond_error(struct MHD_Connection *conn, unsigned status,
                                     const char *message, const char *param, const char *code)
{
    const char *type = status == 401 ? "authentication_error"
                       : status == 404 ? "not_found_error"
                       : status == 503 ? "service_unavailable"
                       : status >= 500 ? "server_error" : "invalid_request_error";
    return respond_json(conn, status, error_doc(message, type, param, code),
                        status == 503 ? 1 : 0);
}

/* The HTTP status for a coordinator's refusal code (ControlReply.code). */
static unsigned status_of(const char *code)
{
    if (!strcmp(code, "not_found")) return 404;
    if (!strcmp(code, "invalid")) return 400;
    if (!strcmp(code, "unavailable")) return 503;
    return 500;
}

/* ---- the bridge to the coordinator's loop ----------------------------------------- */

static void *bridge_open(const tsr_http_t *h)
{
    void *s = zmq_socket(tsr_zmq_ctx(), ZMQ_DEALER);
    if (!s) return NULL;
    /* A cancel sent just before the socket closes must still reach the loop. */
    int linger = 1000;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    if (tsr_zmq_connect(s, h->bridge) != 0) {
        zmq_close(s);
        return NULL;
    }
    return s;
}

/* The envelope a control request travels in. */
static tsr_env_t control_env(Tessera__ControlRequest *q)
{
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = "";
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REQUEST;
    env.control_request = q;
    return env;
}

static int bridge_send(void *s, Tessera__ControlRequest *q)
{
    tsr_env_t env = control_env(q);
    return tsr_wire_send(s, NULL, 0, &env);
}

/* Waits up to ms for the next reply.  1 with *out (caller frees), 0 on timeout, -1 on
 * a broken message. */
static int bridge_recv(void *s, int ms, tsr_env_t **out)
{
    zmq_pollitem_t it = {s, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, ms) <= 0) return 0;
    char err[256];
    int r = tsr_wire_recv(s, NULL, NULL, MAX_REPLY, out, err, sizeof err);
    if (r < 0) tsr_warn("http: a bad reply from the coordinator: %s", err);
    if (r > 0 && (*out)->body_case != TESSERA__ENVELOPE__BODY_CONTROL_REPLY) {
        tsr_env_free(out);
        return -1;
    }
    return r;
}

/* One request, one answer (deployments, metrics).  Caller owns *reply. */
static int bridge_call(const tsr_http_t *h, Tessera__ControlRequest__Kind kind,
                       tsr_env_t **reply)
{
    Tessera__ControlRequest q = TESSERA__CONTROL_REQUEST__INIT;
    q.kind = kind;
    void *s = bridge_open(h);
    int rc = -1;
    if (s && bridge_send(s, &q) == 0 && bridge_recv(s, STATUS_WAIT_MS, reply) == 1) rc = 0;
    if (s) zmq_close(s);
    return rc;
}

/* Whether the client closed its connection (a read would see the end). */
static bool client_gone(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return true;
    char b;
    ssize_t n = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* ---- a generation ----------------------------------------------------------------- */

typedef struct {
    struct MHD_Connection *conn;
    void *sock;
    uint64_t request_id;
    bool chat, stream, include_usage;
    char model[256], id[48];
    long long created;
    char *stops[MAX_STOPS];
    size_t n_stops, max_stop;
    tsr_sb_t text;                     /* all the text so far (cut at a stop string) */
    size_t sent;                     /* stream: text bytes already sent */
    long long prompt_tokens, completion_tokens;
    const char *finish;              /* "stop", "length"; NULL while it runs */
    bool ended;                      /* finished, failed or cancelled: no more events */
    bool cancel_sent;
    int64_t looked_ms;               /* when gen_step last looked at the client */
    unsigned err_status;             /* a failure: its HTTP status */
    char err[700], err_code[32];
    /* stream */
    tsr_sb_t out;                      /* SSE bytes not yet handed to the server */
    size_t out_pos;
    bool role_sent, tail_sent;
} gen_t;

static void gen_cancel(gen_t *g)
{
    if (g->cancel_sent || !g->sock || !g->request_id) return;
    Tessera__ControlRequest q = TESSERA__CONTROL_REQUEST__INIT;
    q.kind = TESSERA__CONTROL_REQUEST__KIND__CANCEL;
    q.request_id = g->request_id;
    q.stopped = g->finish && !strcmp(g->finish, "stop");
    bridge_send(g->sock, &q);
    g->cancel_sent = true;
}

static void gen_free(gen_t *g)
{
    if (!g) return;
    if (!g->ended) gen_cancel(g);  /* the client left mid-stream */
    /* The socket stays open until the cancel is answered: closed sooner, a token sent to
     * it meanwhile would find the client gone and end the request as cancelled, not as
     * what ended it (a stop string). */
    for (int waited = 0; g->cancel_sent && g->sock && waited < 1000; waited += POLL_MS) {
        tsr_env_t *env = NULL;
        int r = bridge_recv(g->sock, POLL_MS, &env);
        bool answered = r > 0 && (!env->control_reply->ok ||
                                  strstr(env->control_reply->json, "\"cancelled\""));
        tsr_env_free(&env);
        if (answered || r < 0) break;
    }
    if (g->sock) zmq_close(g->sock);
    for (size_t i = 0; i < g->n_stops; i++) free(g->stops[i]);
    free(g->text.p);
    free(g->out.p);
    free(g);
}

static void gen_fail(gen_t *g, unsigned status, const char *code, const char *msg)
{
    g->ended = true;
    g->err_status = status;
    snprintf(g->err, sizeof g->err, "%s", msg);
    snprintf(g->err_code, sizeof g->err_code, "%s", code ? code : "");
}

/* After text grew from `before` bytes: the earliest stop string ends the text there. */
static void check_stops(gen_t *g, size_t before)
{
    if (!g->n_stops) return;
    size_t from = before >= g->max_stop ? before - g->max_stop + 1 : 0;
    size_t best = SIZE_MAX;
    for (size_t k = 0; k < g->n_stops; k++) {
        const char *hit = memmem(g->text.p + from, g->text.len - from, g->stops[k],
                                 strlen(g->stops[k]));
        if (hit && (size_t)(hit - g->text.p) < best) best = (size_t)(hit - g->text.p);
    }
    if (best == SIZE_MAX) return;
    g->text.len = best;
    g->text.p[best] = '\0';
    g->finish = "stop";
    g->ended = true;
    gen_cancel(g);
}

/* Text that may be sent now: all of it once ended, else all but the longest tail
 * that could begin a stop string. */
static size_t sendable(const gen_t *g)
{
    if (g->ended) return g->text.len;
    size_t hold = 0;
    for (size_t k = 0; k < g->n_stops; k++) {
        size_t sl = strlen(g->stops[k]);
        for (size_t l = sl - 1; l > hold; l--)
            if (l <= g->text.len && !memcmp(g->text.p + g->text.len - l, g->stops[k], l)) {
                hold = l;
                break;
            }
    }
    return g->text.len - hold;
}

/* Waits for the next event of the generation and takes it in.  0: something happened
 * (or it ended); -1: the client went away or the coordinator fell silent (ended). */
static int gen_step(gen_t *g)
{
    int waited = 0;
    for (;;) {
        tsr_env_t *env = NULL;
        int r = bridge_recv(g->sock, POLL_MS, &env);
        /* The client is looked at every POLL_MS, whether or not tokens keep coming: a
         * request whose answer is sent whole at its end writes nothing before, so
         * nothing else would notice that its client left. */
        int64_t now = tsr_now_ms();
        if (r == 0 || now - g->looked_ms >= POLL_MS) {
            g->looked_ms = now;
            if (client_gone(g->conn)) {
                tsr_env_free(&env);
                gen_cancel(g);
                g->ended = true;
                return -1;
            }
        }
        if (r == 0) {
            if ((waited += POLL_MS) >= TOKEN_WAIT_MS) {
                gen_cancel(g);
                gen_fail(g, 504, NULL, "no token from the coordinator for 300 s");
                return -1;
            }
            continue;
        }
        if (r < 0) continue;
        Tessera__ControlReply *rep = env->control_reply;
        if (!rep->ok) {
            gen_fail(g, status_of(rep->code), rep->code, rep->error);
            tsr_env_free(&env);
            return 0;
        }
        /* A token's text may hold U+0000. */
        json_t *doc = json_loads(rep->json, JSON_ALLOW_NUL, NULL);
        tsr_env_free(&env);
        if (!doc) {
            gen_cancel(g);
            gen_fail(g, 500, NULL, "an unreadable reply from the coordinator");
            return 0;
        }
        if (json_object_get(doc, "cancelled") || !json_object_get(doc, "token")) {
            json_decref(doc);  /* the acceptance, a probe, our cancel's answer */
            continue;
        }
        if (json_integer_value(json_object_get(doc, "index")) != g->completion_tokens) {
            json_decref(doc);
            gen_cancel(g);
            gen_fail(g, 500, NULL, "tokens were lost between the coordinator and this server");
            return 0;
        }
        g->completion_tokens++;
        json_t *t = json_object_get(doc, "text");
        size_t before = g->text.len;
        if (json_is_string(t) && hb_put(&g->text, json_string_value(t), json_string_length(t))) {
            json_decref(doc);
            gen_cancel(g);
            gen_fail(g, 500, NULL, "out of memory");
            return 0;
        }
        if (json_is_true(json_object_get(doc, "done"))) {
            const char *why = json_string_value(json_object_get(doc, "finish_reason"));
            g->finish = why && !strcmp(why, "eos") ? "stop" : "length";
            g->ended = true;
        }
        json_decref(doc);
        check_stops(g, before);
        return 0;
    }
}

/* ---- request bodies ---------------------------------------------------------------- */

/* Reads the sampling and output fields shared by both endpoints into q and g.  NULL on
 * success, else the name of the field at fault with its problem in msg. */
static const char *read_params(json_t *body, bool chat, Tessera__ControlRequest *q, gen_t *g,
                               char *msg, size_t len)
{
    json_t *v;
    const char *model = json_string_value(json_object_get(body, "model"));
    if (!model || !*model || strlen(model) > TSR_NAME_MAX)
        return snprintf(msg, len, "model: expected the name of a deployment (at most %d "
                        "characters)", TSR_NAME_MAX), "model";
    snprintf(g->model, sizeof g->model, "%s", model);
    q->max_tokens = chat ? 1000000 : 16;  /* chat: until eos or max_seq_len */
    const char *mt = chat && json_object_get(body, "max_completion_tokens") ? "max_completion_tokens"
                                                                           : "max_tokens";
    if ((v = json_object_get(body, mt)) && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > 1000000)
            return snprintf(msg, len, "%s: expected an integer from 1 to 1000000", mt), mt;
        q->max_tokens = (uint32_t)json_integer_value(v);
    }
    double temperature = 1.0, top_p = 1.0;
    if ((v = json_object_get(body, "temperature")) && !json_is_null(v)) {
        if (!json_is_number(v) || !(json_number_value(v) >= 0 && json_number_value(v) <= 2))
            return snprintf(msg, len, "temperature: expected a number from 0 to 2"), "temperature";
        temperature = json_number_value(v);
    }
    if ((v = json_object_get(body, "top_p")) && !json_is_null(v)) {
        if (!json_is_number(v) || !(json_number_value(v) > 0 && json_number_value(v) <= 1))
            return snprintf(msg, len, "top_p: expected a number above 0, at most 1"), "top_p";
        top_p = json_number_value(v);
    }
    q->temperature = (float)temperature;
    q->top_p = tsr_wire_top_p(top_p);
    if ((v = json_object_get(body, "seed")) && !json_is_null(v)) {
        if (!json_is_integer(v)) return snprintf(msg, len, "seed: expected an integer"), "seed";
        q->seed = (uint64_t)json_integer_value(v);
    } else if (getrandom(&q->seed, sizeof q->seed, 0) != (ssize_t)sizeof q->seed) {
        q->seed = (uint64_t)time(NULL);
    }
    if ((v = json_object_get(body, "n")) && !json_is_null(v) &&
        (!json_is_integer(v) || json_integer_value(v) != 1))
        return snprintf(msg, len, "n: only 1 is supported"), "n";
    static const char *const unsupported[] = {"logprobs", "echo", "best_of", "suffix",
                                              "tools", "functions", "logit_bias"};
    for (size_t k = 0; k < sizeof unsupported / sizeof unsupported[0]; k++) {
        v = json_object_get(body, unsupported[k]);
        if (v && !json_is_null(v) && !json_is_false(v) &&
            !(!strcmp(unsupported[k], "best_of") && json_is_integer(v) && json_integer_value(v) == 1))
            return snprintf(msg, len, "%s: is not supported", unsupported[k]), unsupported[k];
    }
    if ((v = json_object_get(body, "stop")) && !json_is_null(v)) {
        json_t *one = json_is_string(v) ? v : NULL;
        size_t n = one ? 1 : json_is_array(v) ? json_array_size(v) : 0;
        if (!one && (!json_is_array(v) || n > MAX_STOPS))
            return snprintf(msg, len, "stop: expected a string or a list of up to %d strings",
                            MAX_STOPS), "stop";
        for (size_t k = 0; k < n; k++) {
            json_t *s = one ? one : json_array_get(v, k);
            if (!json_is_string(s) || json_string_length(s) == 0 ||
                json_string_length(s) > MAX_STOP_LEN ||
                strlen(json_string_value(s)) != json_string_length(s))
                return snprintf(msg, len, "stop: each stop must be a string of 1 to %d bytes",
                                MAX_STOP_LEN), "stop";
            g->stops[g->n_stops] = strdup(json_string_value(s));
            if (!g->stops[g->n_stops]) return snprintf(msg, len, "out of memory"), "stop";
            if (json_string_length(s) > g->max_stop) g->max_stop = json_string_length(s);
            g->n_stops++;
        }
    }
    if ((v = json_object_get(body, "stream")) && !json_is_null(v)) {
        if (!json_is_boolean(v)) return snprintf(msg, len, "stream: expected true or false"), "stream";
        g->stream = json_is_true(v);
    }
    json_t *so = json_object_get(body, "stream_options");
    if (so && !json_is_null(so)) {
        json_t *iu = json_is_object(so) ? json_object_get(so, "include_usage") : NULL;
        if (!json_is_object(so) || (iu && !json_is_null(iu) && !json_is_boolean(iu)))
            return snprintf(msg, len, "stream_options: expected an object whose include_usage "
                            "is true or false"), "stream_options";
        g->include_usage = json_is_true(iu);
    }
    return NULL;
}

/* ---- documents ------------------------------------------------------------------------ */

static json_t *usage_doc(const gen_t *g)
{
    return json_pack("{s:I, s:I, s:I}", "prompt_tokens", (json_int_t)g->prompt_tokens,
                     "completion_tokens", (json_int_t)g->completion_tokens, "total_tokens",
                     (json_int_t)(g->prompt_tokens + g->completion_tokens));
}

static json_t *chunk_doc(const gen_t *g, const char *text, size_t len, const char *finish,
                         bool role)
{
    json_t *choice;
    if (g->chat) {
        json_t *delta = json_object();
        if (role) json_object_set_new(delta, "role", json_string("assistant"));
        if (len || role) json_object_set_new(delta, "content", json_stringn(text, len));
        choice = json_pack("{s:i, s:o, s:n}", "index", 0, "delta", delta, "logprobs");
    } else {
        choice = json_pack("{s:i, s:s%, s:n}", "index", 0, "text", text, len, "logprobs");
    }
    json_object_set_new(choice, "finish_reason", finish ? json_string(finish) : json_null());
    return json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", g->id, "object",
                     g->chat ? "chat.completion.chunk" : "text_completion", "created",
                     (json_int_t)g->created, "model", g->model, "choices", choice);
}

static json_t *whole_doc(const gen_t *g)
{
    json_t *choice;
    if (g->chat)
        choice = json_pack("{s:i, s:{s:s, s:s%}, s:n}", "index", 0, "message", "role",
                           "assistant", "content", g->text.p ? g->text.p : "", g->text.len,
                           "logprobs");
    else
        choice = json_pack("{s:i, s:s%, s:n}", "index", 0, "text", g->text.p ? g->text.p : "",
                           g->text.len, "logprobs");
    json_object_set_new(choice, "finish_reason", json_string(g->finish ? g->finish : "stop"));
    return json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", g->id, "object",
                     g->chat ? "chat.completion" : "text_completion", "created",
                     (json_int_t)g->created, "model", g->model, "choices", choice, "usage",
                     usage_doc(g));
}

static int sse(gen_t *g, json_t *doc)
{
    char *s = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    int rc = !s || hb_put(&g->out, "data: ", 6) || hb_put(&g->out, s, strlen(s)) ||
             hb_put(&g->out, "\n\n", 2);
    free(s);
    return rc ? -1 : 0;
}

/* Streams: fills g->out with the next events; the end is the finish chunk, usage when
 * asked, and [DONE]. */
static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    gen_t *g = cls;
    while (g->out_pos == g->out.len) {
        g->out.len = g->out_pos = 0;
        if (g->tail_sent) return MHD_CONTENT_READER_END_OF_STREAM;
        if (g->chat && !g->role_sent) {
            g->role_sent = true;
            if (sse(g, chunk_doc(g, "", 0, NULL, true))) return MHD_CONTENT_READER_END_WITH_ERROR;
            continue;
        }
        size_t upto = sendable(g);
        if (upto > g->sent) {
            if (sse(g, chunk_doc(g, g->text.p + g->sent, upto - g->sent, NULL, false)))
                return MHD_CONTENT_READER_END_WITH_ERROR;
            g->sent = upto;
            continue;
        }
        if (g->ended) {
            if (g->err_status) {
                if (sse(g, error_doc(g->err, "server_error", NULL, g->err_code[0] ? g->err_code : NULL)))
                    return MHD_CONTENT_READER_END_WITH_ERROR;
            } else {
                if (sse(g, chunk_doc(g, "", 0, g->finish ? g->finish : "stop", false)))
                    return MHD_CONTENT_READER_END_WITH_ERROR;
                if (g->include_usage) {
                    json_t *u = json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", g->id, "object",
                                          g->chat ? "chat.completion.chunk" : "text_completion",
                                          "created", (json_int_t)g->created, "model", g->model,
                                          "choices", "usage", usage_doc(g));
                    if (sse(g, u)) return MHD_CONTENT_READER_END_WITH_ERROR;
                }
            }
            if (hb_put(&g->out, "data: [DONE]\n\n", 14)) return MHD_CONTENT_READER_END_WITH_ERROR;
            g->tail_sent = true;
            continue;
        }
        if (gen_step(g) < 0 && !g->err_status) return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    size_t n = g->out.len - g->out_pos < max ? g->out.len - g->out_pos : max;
    memcpy(buf, g->out.p + g->out_pos, n);
    g->out_pos += n;
    return (ssize_t)n;
}

static void stream_free(void *cls)
{
    gen_free(cls);
}

/* Renders messages (or takes text) and encodes it with the deployment's tokenizer,
 * bounded by its max_seq_len, into q's prompt (*ids, caller frees).  0, or the HTTP
 * status of the refusal with the reason in msg. */
static unsigned encode_here(tsr_http_t *h, const char *model, const char *text,
                            json_t *messages, Tessera__ControlRequest *q, int32_t **ids,
                            char *msg, size_t len)
{
    tsr_tokreg_entry_t e;
    if (tsr_tokreg_get(h->reg, model, &e) < 0) {
        snprintf(msg, len, "no deployment named '%s'", model);
        return 404;
    }
    unsigned st = 400;
    char *rendered = NULL, err[300];
    if (!e.tok) {
        tsr_tok_refusal(model, e.tok_error, e.tok_loading, msg, len);
        if (e.tok_loading) st = 503;
        goto out;
    }
    if (messages) {
        tsr_chat_kind_t kind = e.chat_template[0] ? tsr_chat_named(e.chat_template)
                                                  : tsr_chat_detect(tsr_tok_chat_template(e.tok->tok));
        if (kind == TSR_CHAT_NONE) {
            snprintf(msg, len, "%s has no chat template Tessera recognises (llama2, llama3, "
                     "chatml, mistral): set chat_template: on the deployment", model);
            goto out;
        }
        if (!(rendered = tsr_chat_render(kind, messages, err, sizeof err))) {
            snprintf(msg, len, "%s", err);
            goto out;
        }
        text = rendered;
    }
    size_t n;
    if (tsr_tok_encode_max(e.tok->tok, text, strlen(text), true, (size_t)e.max_seq_len, ids, &n,
                           err, sizeof err)) {
        snprintf(msg, len, "%s: %s", messages ? "messages" : "prompt", err);
        goto out;
    }
    q->prompt = *ids;
    q->n_prompt = n;
    st = 0;
out:
    free(rendered);
    tsr_tokref_drop(&e.tok);
    return st;
}

/* POST /v1/completions and /v1/chat/completions. */
static enum MHD_Result generate(tsr_http_t *h, struct MHD_Connection *conn, const char *body,
                                size_t len, bool chat)
{
    char msg[600];
    json_error_t jerr;
    json_t *doc = json_loadb(body, len, 0, &jerr);
    if (!json_is_object(doc)) {
        snprintf(msg, sizeof msg, "the body is not a JSON object (%s at line %d, column %d)",
                 doc ? "not an object" : jerr.text, jerr.line, jerr.column);
        json_decref(doc);
        return respond_error(conn, 400, msg, NULL, NULL);
    }
    gen_t *g = calloc(1, sizeof *g);
    Tessera__ControlRequest q = TESSERA__CONTROL_REQUEST__INIT;
    json_t *messages = NULL;         /* borrowed from doc */
    const char *text = NULL;         /* borrowed from doc */
    int32_t *ids = NULL;
    enum MHD_Result rc;
    if (!g) {
        json_decref(doc);
        return respond_error(conn, 500, "out of memory", NULL, NULL);
    }
    g->conn = conn;
    g->chat = chat;
    g->created = (long long)time(NULL);
    const char *bad = read_params(doc, chat, &q, g, msg, sizeof msg);
    if (!bad && chat) {
        messages = json_object_get(doc, "messages");
        if (!json_is_array(messages) || json_array_size(messages) == 0) {
            bad = "messages";
            snprintf(msg, sizeof msg, "messages: expected a non-empty list of messages");
        }
    } else if (!bad) {
        json_t *p = json_object_get(doc, "prompt");
        if (json_is_array(p) && json_array_size(p) == 1 && json_is_string(json_array_get(p, 0)))
            p = json_array_get(p, 0);
        if (json_is_string(p) && json_string_length(p) > 0 &&
            strlen(json_string_value(p)) == json_string_length(p)) {
            text = json_string_value(p);
        } else if (json_is_array(p) && json_array_size(p) > 0) {
            size_t n = json_array_size(p);
            ids = malloc(n * sizeof *ids);
            if (!ids) {
                rc = respond_error(conn, 500, "out of memory", NULL, NULL);
                goto out;
            }
            for (size_t k = 0; k < n; k++) {
                json_t *x = json_array_get(p, k);
                if (!json_is_integer(x) || json_integer_value(x) < 0 ||
                    json_integer_value(x) > INT32_MAX) {
                    bad = "prompt";
                    snprintf(msg, sizeof msg, "prompt[%zu]: expected a token id (an integer "
                             "from 0); a prompt is one string, a list of one string, or a "
                             "list of token ids", k);
                    break;
                }
                ids[k] = (int32_t)json_integer_value(x);
            }
            q.prompt = ids;
            q.n_prompt = n;
        } else {
            bad = "prompt";
            snprintf(msg, sizeof msg, "prompt: expected a non-empty string (without NUL) or a "
                     "non-empty list of token ids");
        }
    }
    if (bad) {
        rc = respond_error(conn, 400, msg, bad, NULL);
        goto out;
    }
    /* Text and chats are rendered and encoded here, in this connection's thread, so the
     * coordinator's loop gets token ids only. */
    if (text || messages) {
        unsigned st = encode_here(h, g->model, text, messages, &q, &ids, msg, sizeof msg);
        if (st) {
            rc = respond_error(conn, st, msg, st == 404 ? "model" : chat ? "messages" : "prompt",
                               st == 404 ? "model_not_found" : NULL);
            goto out;
        }
    }
    q.kind = TESSERA__CONTROL_REQUEST__KIND__GENERATE;
    q.deployment = g->model;
    q.worker = "";
    q.want_text = true;
    {
        tsr_env_t env = control_env(&q);
        size_t packed = tessera__envelope__get_packed_size(&env);
        if (packed > TSR_WIRE_MAX_REQUEST) {
            snprintf(msg, sizeof msg, "the prompt makes a request of %zu bytes, over the limit of "
                     "%u", packed, TSR_WIRE_MAX_REQUEST);
            rc = respond_error(conn, 413, msg, chat ? "messages" : "prompt", NULL);
            goto out;
        }
    }
    if (!(g->sock = bridge_open(h)) || bridge_send(g->sock, &q) != 0) {
        rc = respond_error(conn, 500, "cannot reach the coordinator's loop", NULL, NULL);
        goto out;
    }
    /* The acceptance, or the refusal. */
    tsr_env_t *env = NULL;
    int waited = 0, r;
    while ((r = bridge_recv(g->sock, POLL_MS, &env)) == 0 && (waited += POLL_MS) < STATUS_WAIT_MS)
        if (client_gone(conn)) {
            rc = MHD_NO;  /* it left before the acceptance: nothing runs for it yet */
            goto out;
        }
    if (r != 1) {
        rc = respond_error(conn, 504, "the coordinator did not answer", NULL, NULL);
        goto out;
    }
    if (!env->control_reply->ok) {
        unsigned st = status_of(env->control_reply->code);
        /* The coordinator refuses a request for its deployment or its prompt. */
        rc = respond_error(conn, st, env->control_reply->error,
                           st == 404 ? "model" : st == 400 ? (chat ? "messages" : "prompt") : NULL,
                           st == 404 ? "model_not_found" : NULL);
        tsr_env_free(&env);
        goto out;
    }
    json_t *ack = json_loads(env->control_reply->json, 0, NULL);
    tsr_env_free(&env);
    g->request_id = (uint64_t)json_integer_value(json_object_get(ack, "request_id"));
    g->prompt_tokens = json_integer_value(json_object_get(ack, "prompt_tokens"));
    json_decref(ack);
    snprintf(g->id, sizeof g->id, "%s-%016llx", chat ? "chatcmpl" : "cmpl",
             (unsigned long long)g->request_id);
    /* The first token (or the failure) before any status goes out. */
    while (!g->ended && g->completion_tokens == 0)
        if (gen_step(g) < 0 && !g->err_status) {
            rc = MHD_NO;  /* the client left */
            goto out;
        }
    if (g->err_status && g->completion_tokens == 0) {
        rc = respond_error(conn, g->err_status, g->err, NULL, g->err_code[0] ? g->err_code : NULL);
        goto out;
    }
    if (g->stream) {
        struct MHD_Response *resp =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_reader, g, stream_free);
        if (!resp) {
            rc = MHD_NO;
            goto out;
        }
        g = NULL;  /* the response owns it now */
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        rc = MHD_queue_response(conn, MHD_HTTP_OK, resp);
        MHD_destroy_response(resp);
        goto out;
    }
    while (!g->ended)
        if (gen_step(g) < 0 && !g->err_status) {
            rc = MHD_NO;
            goto out;
        }
    if (g->err_status)
        rc = respond_error(conn, g->err_status, g->err, NULL, g->err_code[0] ? g->err_code : NULL);
    else
        rc = respond_json(conn, MHD_HTTP_OK, whole_doc(g), 0);
out:
    gen_free(g);
    free(ids);
    json_decref(doc);
    return rc;
}

/* ---- GET endpoints ---------------------------------------------------------------------- */

/* The text of the loop's answer to kind, from cache: a copy (caller frees), or NULL when
 * the coordinator did not answer (remembered for TTL_MS too, so a flood waits once). */
static char *cached(tsr_http_t *h, ttl_cache_t *c, Tessera__ControlRequest__Kind kind)
{
    pthread_mutex_lock(&c->mu);
    if (!c->at || tsr_now_ms() - c->at >= TTL_MS) {
        tsr_env_t *env = NULL;
        free(c->text);
        c->text = NULL;
        if (bridge_call(h, kind, &env) == 0 && env->control_reply->ok)
            c->text = strdup(env->control_reply->json);
        tsr_env_free(&env);
        c->at = tsr_now_ms();
    }
    char *out = c->text ? strdup(c->text) : NULL;
    pthread_mutex_unlock(&c->mu);
    return out;
}

/* The deployments document (a new reference; NULL when the coordinator is silent). */
static json_t *deployments_doc(tsr_http_t *h)
{
    char *text = cached(h, &h->deployments, TESSERA__CONTROL_REQUEST__KIND__DEPLOYMENTS);
    json_t *doc = text ? json_loads(text, 0, NULL) : NULL;
    free(text);
    return doc;
}

static enum MHD_Result get_models(tsr_http_t *h, struct MHD_Connection *conn)
{
    json_t *st = deployments_doc(h);
    if (!st) return respond_error(conn, 504, "the coordinator did not answer", NULL, NULL);
    json_t *data = json_array();
    long long up = json_integer_value(json_object_get(st, "uptime_ms"));
    size_t i;
    json_t *d;
    json_array_foreach(json_object_get(st, "deployments"), i, d)
        json_array_append_new(data, json_pack("{s:O, s:s, s:I, s:s}", "id",
                                              json_object_get(d, "name"), "object", "model",
                                              "created", (json_int_t)(time(NULL) - up / 1000),
                                              "owned_by", "tessera"));
    json_decref(st);
    return respond_json(conn, MHD_HTTP_OK, json_pack("{s:s, s:o}", "object", "list", "data", data), 0);
}

static enum MHD_Result get_health(tsr_http_t *h, struct MHD_Connection *conn)
{
    json_t *st = deployments_doc(h);
    if (!st)
        return respond_json(conn, 503, json_pack("{s:s, s:[s]}", "status", "unavailable", "reasons",
                                                 "the coordinator did not answer"), 1);
    json_t *reasons = json_array(), *states = json_object();
    size_t i;
    json_t *d;
    json_array_foreach(json_object_get(st, "deployments"), i, d) {
        const char *name = json_string_value(json_object_get(d, "name"));
        const char *state = json_string_value(json_object_get(d, "state"));
        json_object_set_new(states, name ? name : "?", json_string(state ? state : "?"));
        if (json_integer_value(json_object_get(d, "ready_replicas")) < 1) {
            char why[1400];
            const char *m = json_string_value(json_object_get(d, "message"));
            snprintf(why, sizeof why, "%s has no ready replica (%s%s%s)", name ? name : "?",
                     state ? state : "?", m && *m ? ": " : "", m ? m : "");
            json_array_append_new(reasons, json_string(why));
        }
    }
    json_decref(st);
    bool ok = json_array_size(reasons) == 0;
    json_t *out = json_pack("{s:s, s:o}", "status", ok ? "ok" : "unavailable", "deployments", states);
    if (!ok) json_object_set(out, "reasons", reasons);
    json_decref(reasons);
    return respond_json(conn, ok ? MHD_HTTP_OK : 503, out, ok ? 0 : 1);
}

static enum MHD_Result get_metrics(tsr_http_t *h, struct MHD_Connection *conn)
{
    char *text = cached(h, &h->metrics, TESSERA__CONTROL_REQUEST__KIND__METRICS);
    enum MHD_Result rc =
        text ? respond(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text,
                       strlen(text), 0)
             : respond(conn, 503, "text/plain", "the coordinator did not answer\n", 31, 1);
    free(text);
    return rc;
}

/* ---- the server ------------------------------------------------------------------------ */

typedef struct {
    tsr_sb_t body;
    bool too_big;
    size_t discarded;
    int64_t started_ms;              /* when its headers were in */
} conn_t;

/* What the headers say about the request's framing, gathered before any of the body is
 * read. */
typedef struct {
    int content_length, transfer_encoding, host;
    char bad_name[64];          /* the first header name with white space in it */
    char coding[64];            /* the first Transfer-Encoding other than chunked */
} framing_t;

static enum MHD_Result framing_header(void *cls, enum MHD_ValueKind kind, const char *key,
                                      const char *value)
{
    (void)kind;
    framing_t *f = cls;
    /* "Transfer-Encoding : chunked" is not Transfer-Encoding to this server, but may be
     * to a proxy in front of it (RFC 9112, 5.1: refused). */
    if (!f->bad_name[0] && (!key[0] || strpbrk(key, " \t")))
        snprintf(f->bad_name, sizeof f->bad_name, "%s", key);
    if (!strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH)) f->content_length++;
    if (!strcasecmp(key, MHD_HTTP_HEADER_HOST)) f->host++;
    if (!strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING)) {
        f->transfer_encoding++;
        if (!f->coding[0] && (!value || strcasecmp(value, "chunked")))
            snprintf(f->coding, sizeof f->coding, "%s", value ? value : "");
    }
    return MHD_YES;
}

static bool authorized(const tsr_http_t *h, struct MHD_Connection *conn)
{
    if (!h->n_keys) return true;
    const char *a;
    size_t alen;
    if (MHD_lookup_connection_value_n(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION,
                                      strlen(MHD_HTTP_HEADER_AUTHORIZATION), &a, &alen) != MHD_YES ||
        !a || alen != strlen(a) || strncasecmp(a, "Bearer ", 7))  /* a NUL inside: no */
        return false;
    a += 7;
    size_t n = strlen(a);
    bool ok = false;
    for (size_t k = 0; k < h->n_keys; k++) {
        size_t kn = strlen(h->keys[k]);
        unsigned diff = (unsigned)(kn ^ n);
        for (size_t i = 0; i < kn; i++) diff |= (unsigned char)h->keys[k][i] ^ (unsigned char)(i < n ? a[i] : 0);
        ok |= diff == 0;
    }
    return ok;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **con_cls)
{
    tsr_http_t *h = cls;
    conn_t *cc = *con_cls;
    bool post = !strcmp(method, "POST"), get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    bool completions = !strcmp(url, "/v1/completions"), chat = !strcmp(url, "/v1/chat/completions");
    bool known = completions || chat || !strcmp(url, "/v1/models") || !strcmp(url, "/health") ||
                 !strcmp(url, "/metrics");
    if (!cc) {
        /* Key, path, method and framing are checked before any of the body is read: a
         * stranger's body is never held, and /v1/ paths are not told apart without a key. */
        if (!strncmp(url, "/v1", 3) && !authorized(h, conn))
            return respond_error(conn, 401, "a valid API key is needed (Authorization: Bearer "
                                 "KEY)", NULL, "invalid_api_key");
        if (!known) return respond_error(conn, 404, "no such endpoint", NULL, NULL);
        if ((completions || chat) != post || (!post && !get))
            return respond_error(conn, 405, "method not allowed here", NULL, NULL);
        framing_t f = {0};
        char m[160];
        MHD_get_connection_values(conn, MHD_HEADER_KIND, framing_header, &f);
        if (f.bad_name[0]) {
            snprintf(m, sizeof m, "malformed header name '%s': white space before its colon",
                     f.bad_name);
            return respond_error(conn, 400, m, NULL, NULL);
        }
        if (!strcmp(version, MHD_HTTP_VERSION_1_1) && f.host != 1)
            return respond_error(conn, 400, f.host ? "more than one Host header"
                                                   : "an HTTP/1.1 request needs a Host header",
                                 NULL, NULL);
        if (f.content_length > 1 || (f.content_length && f.transfer_encoding))
            return respond_error(conn, 400, "ambiguous framing: more than one Content-Length, or "
                                 "one with Transfer-Encoding", NULL, NULL);
        if (f.transfer_encoding > 1)
            return respond_error(conn, 400, "more than one Transfer-Encoding header", NULL, NULL);
        if (f.coding[0]) {
            snprintf(m, sizeof m, "Transfer-Encoding '%s' is not supported: send the body "
                     "with Content-Length, or with Transfer-Encoding: chunked", f.coding);
            return respond_error(conn, 501, m, NULL, NULL);
        }
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                                     MHD_HTTP_HEADER_CONTENT_LENGTH);
        const char *expect = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
        unsigned long long declared = cl ? strtoull(cl, NULL, 10) : 0;
        /* A body declared too long is refused at once when the client waits to be told
         * (Expect: 100-continue) or is too long to read and drop. */
        if (declared > MAX_BODY && (expect || declared > MAX_DISCARD)) {
            snprintf(m, sizeof m, "the body is over the limit of %u bytes", MAX_BODY);
            return respond_error(conn, 413, m, NULL, NULL);
        }
        if (!(cc = calloc(1, sizeof *cc))) return MHD_NO;
        cc->started_ms = tsr_now_ms();
        *con_cls = cc;
        return MHD_YES;
    }
    if (*upload_size) {
        if (tsr_now_ms() - cc->started_ms > BODY_DEADLINE_MS) return MHD_NO;  /* a trickle */
        if (!cc->too_big && cc->body.len + *upload_size > MAX_BODY) cc->too_big = true;
        if (!cc->too_big && hb_put(&cc->body, upload, *upload_size)) cc->too_big = true;
        /* A body over the limit is read and dropped, so the client (which sends it all
         * before it reads) gets its 413; past MAX_DISCARD the connection just closes. */
        if (cc->too_big && (cc->discarded += *upload_size) > MAX_DISCARD) return MHD_NO;
        *upload_size = 0;
        return MHD_YES;
    }
    if (cc->too_big) {
        char msg[96];
        snprintf(msg, sizeof msg, "the body is over the limit of %u bytes", MAX_BODY);
        return respond_error(conn, 413, msg, NULL, NULL);
    }
    if (completions || chat)
        return generate(h, conn, cc->body.p ? cc->body.p : "", cc->body.len, chat);
    if (!strcmp(url, "/v1/models")) return get_models(h, conn);
    if (!strcmp(url, "/health")) return get_health(h, conn);
    return get_metrics(h, conn);
}

static void completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                      enum MHD_RequestTerminationCode why)
{
    (void)cls;
    (void)conn;
    (void)why;
    conn_t *cc = *con_cls;
    if (cc) free(cc->body.p);
    free(cc);
    *con_cls = NULL;
}

int tsr_http_read_keys(const char *path, char ***keys, char *err, size_t errlen)
{
    struct stat st;
    int fd = tsr_open_regular(path, err, errlen);
    FILE *f = fd < 0 ? NULL : fdopen(fd, "r");
    if (!f) {
        if (fd >= 0) {
            tsr_set_err(err, errlen, "%s: %s", path, strerror(errno));
            close(fd);
        }
        return -1;
    }
    if (fstat(fileno(f), &st) == 0 && (st.st_mode & 077)) {
        tsr_set_err(err, errlen, "%s: mode %03o lets others read the API keys; chmod 600 it", path,
                    (unsigned)(st.st_mode & 0777));
        fclose(f);
        return -1;
    }
    char line[1024];
    char **v = NULL;
    int n = 0, lineno = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (!strchr(line, '\n') && !feof(f)) {
            tsr_set_err(err, errlen, "%s:%d: the line is over %zu bytes", path, lineno,
                        sizeof line - 2);
            goto bad;
        }
        size_t l = strcspn(line, "\r\n");
        line[l] = '\0';
        char *s = line;
        while (*s == ' ' || *s == '\t') s++;
        l = strlen(s);
        while (l && (s[l - 1] == ' ' || s[l - 1] == '\t')) s[--l] = '\0';
        if (!*s || *s == '#') continue;
        if (l < 16 || strpbrk(s, " \t")) {
            tsr_set_err(err, errlen, "%s:%d: a key must be one word of at least 16 characters",
                        path, lineno);
            goto bad;
        }
        char **w = realloc(v, (size_t)(n + 1) * sizeof *w);
        if (!w || !(w[n] = strdup(s))) {
            if (w) v = w;
            tsr_set_err(err, errlen, "out of memory");
            goto bad;
        }
        v = w;
        n++;
    }
    fclose(f);
    if (n == 0) {
        tsr_set_err(err, errlen, "%s: holds no key", path);
        free(v);
        return -1;
    }
    *keys = v;
    return n;
bad:
    fclose(f);
    for (int i = 0; i < n; i++) free(v[i]);
    free(v);
    return -1;
}

tsr_http_t *tsr_http_start(const char *host, int port, const char *bridge,
                           struct tsr_tokreg *reg, const char *api_keys_file, char *err,
                           size_t errlen)
{
    tsr_http_t *h = calloc(1, sizeof *h);
    if (!h) {
        tsr_set_err(err, errlen, "out of memory");
        return NULL;
    }
    h->reg = reg;
    snprintf(h->bridge, sizeof h->bridge, "%s", bridge);
    pthread_mutex_init(&h->deployments.mu, NULL);
    pthread_mutex_init(&h->metrics.mu, NULL);
    if (api_keys_file) {
        int n = tsr_http_read_keys(api_keys_file, &h->keys, err, errlen);
        if (n < 0) {
            free(h);
            return NULL;
        }
        h->n_keys = (size_t)n;
    }
    struct sockaddr_in a4 = {0};
    struct sockaddr_in6 a6 = {0};
    struct sockaddr *addr;
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
    if (inet_pton(AF_INET, host, &a4.sin_addr) == 1) {
        a4.sin_family = AF_INET;
        a4.sin_port = htons((uint16_t)port);
        addr = (struct sockaddr *)&a4;
    } else if (inet_pton(AF_INET6, host, &a6.sin6_addr) == 1) {
        a6.sin6_family = AF_INET6;
        a6.sin6_port = htons((uint16_t)port);
        addr = (struct sockaddr *)&a6;
        flags |= MHD_USE_IPv6;
    } else {
        tsr_set_err(err, errlen, "http_endpoint: '%s' is not a numeric address", host);
        tsr_http_stop(&h);
        return NULL;
    }
    h->d = MHD_start_daemon(flags, (uint16_t)port, NULL, NULL, handle, h, MHD_OPTION_SOCK_ADDR, addr,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)MAX_CONNECTIONS,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)PER_CLIENT_CONNECTIONS,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)IDLE_TIMEOUT_S,
                            MHD_OPTION_NOTIFY_COMPLETED, completed, h, MHD_OPTION_END);
    if (!h->d) {
        tsr_set_err(err, errlen, "http_endpoint %s:%d: cannot listen (in use, or not an address "
                    "of this machine?)", host, port);
        tsr_http_stop(&h);
        return NULL;
    }
    return h;
}

void tsr_http_stop(tsr_http_t **self_p)
{
    if (!self_p || !*self_p) return;
    tsr_http_t *h = *self_p;
    if (h->d) MHD_stop_daemon(h->d);
    free(h->deployments.text);
    pthread_mutex_destroy(&h->deployments.mu);
    free(h->metrics.text);
    pthread_mutex_destroy(&h->metrics.mu);
    for (size_t k = 0; k < h->n_keys; k++) free(h->keys[k]);
    free(h->keys);
    free(h);
    *self_p = NULL;
}
