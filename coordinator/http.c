/* http.c: the HTTP server of the OpenAI-compatible API; see http.h.
 *
 * Over libmicrohttpd, one thread per connection: the key and the request's framing are
 * checked before its body is read; a generation's body is read into a GENERATE control
 * request (openai.c), its text or chat prompt encoded here with the deployment's
 * tokenizer, and sent to the coordinator's loop over the bridge.  The loop routes it and
 * sends back the acceptance, then one reply per token carrying the text that token
 * completes.  This file gathers those into one answer or server-sent events (the
 * documents are openai.c's), cuts the text at stop strings (and cancels the rest), and
 * cancels when the client goes away.  The response's status is chosen only once the
 * first token (or the failure) is in, so a full queue is a 503 even when streaming. */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <zmq.h>

#include "common/log.h"
#include "common/strbuf.h"
#include "common/util.h"
#include "common/wire.h"
#include "coordinator/apikeys.h"
#include "coordinator/chat.h"
#include "coordinator/openai.h"
#include "coordinator/tokref.h"

#define MAX_BODY (1u << 20)          /* request bodies above this get 413 */
#define STATUS_WAIT_MS 5000          /* a status or metrics answer */
#define TOKEN_WAIT_MS 300000         /* no word from the coordinator for this long: 504 */
#define POLL_MS 100                  /* how often a waiting thread looks at its client */
#define PROBE_MS 1000                /* how often a half-closed client is written to while
                                        its answer is made (client_gone) */
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

static enum MHD_Result respond_error(struct MHD_Connection *conn, unsigned status,
                                     const char *message, const char *param, const char *code)
{
    return respond_json(conn, status,
                        tsr_openai_error(message, tsr_openai_error_type(status), param, code),
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

/* ---- a generation ----------------------------------------------------------------- */

typedef struct {
    struct MHD_Connection *conn;
    void *sock;
    uint64_t request_id;
    tsr_openai_completion_t c;       /* what was asked for; what the documents say */
    tsr_sb_t text;                     /* all the text so far (cut at a stop string) */
    size_t sent;                     /* stream: text bytes already sent */
    const char *finish;              /* "stop", "length"; NULL while it runs */
    bool ended;                      /* finished, failed or cancelled: no more events */
    bool cancel_sent;
    int64_t looked_ms;               /* when gen_step last looked at the client */
    bool http11;                     /* the client speaks HTTP/1.1 (it takes 1xx answers) */
    bool responded;                  /* the response is queued: only the server writes now */
    int64_t probed_ms;               /* when client_gone last wrote to a half-closed client */
    unsigned err_status;             /* a failure: its HTTP status */
    char err[700], err_code[32];
    /* stream */
    tsr_sb_t out;                      /* SSE bytes not yet handed to the server */
    size_t out_pos;
    bool role_sent, tail_sent;
} gen_t;

/* Whether the client went away.  The end of its request stream (a read sees EOF) is not
 * that: a client may shut down its writing side and still read (shutdown(SHUT_WR)), and
 * on the wire that FIN is the same as a close().  Only a write tells them apart: to a
 * closed socket the client's kernel answers with a reset, seen here as POLLHUP or
 * POLLERR.  While nothing is written yet (no status chosen), a client whose side ended
 * is sent an interim "102 Processing" every PROBE_MS, which an HTTP/1.1 client takes
 * before its answer (RFC 9110, 15.2); once the answer streams, its events are the writes.
 * An HTTP/1.0 client must not be sent a 1xx: one that closes before its whole answer is
 * found out only when the answer is written. */
static bool client_gone(gen_t *g)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(g->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return true;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLIN | POLLOUT | POLLRDHUP};
    if (poll(&p, 1, 0) < 0) return false;  /* interrupted: the next look sees it */
    if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) return true;
    /* POLLOUT: room for the probe whole, so that it cannot be cut in two. */
    if (!(p.revents & POLLRDHUP) || !(p.revents & POLLOUT) || g->responded || !g->http11)
        return false;
    int64_t now = tsr_now_ms();
    if (g->probed_ms && now - g->probed_ms < PROBE_MS) return false;
    g->probed_ms = now;
    static const char probe[] = "HTTP/1.1 102 Processing\r\n\r\n";
    ssize_t n = send(p.fd, probe, sizeof probe - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

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
    tsr_openai_clear(&g->c);
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
    if (!g->c.n_stops) return;
    size_t from = before >= g->c.max_stop ? before - g->c.max_stop + 1 : 0;
    size_t best = SIZE_MAX;
    for (size_t k = 0; k < g->c.n_stops; k++) {
        const char *hit = memmem(g->text.p + from, g->text.len - from, g->c.stops[k],
                                 strlen(g->c.stops[k]));
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
    for (size_t k = 0; k < g->c.n_stops; k++) {
        size_t sl = strlen(g->c.stops[k]);
        for (size_t l = sl - 1; l > hold; l--)
            if (l <= g->text.len && !memcmp(g->text.p + g->text.len - l, g->c.stops[k], l)) {
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
            if (client_gone(g)) {
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
        if (json_integer_value(json_object_get(doc, "index")) != g->c.completion_tokens) {
            json_decref(doc);
            gen_cancel(g);
            gen_fail(g, 500, NULL, "tokens were lost between the coordinator and this server");
            return 0;
        }
        if (g->c.completion_tokens == 0)
            g->c.cached_tokens = json_integer_value(json_object_get(doc, "cached_tokens"));
        g->c.completion_tokens++;
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
        if (g->c.chat && !g->role_sent) {
            g->role_sent = true;
            if (sse(g, tsr_openai_chunk(&g->c, "", 0, NULL, true))) return MHD_CONTENT_READER_END_WITH_ERROR;
            continue;
        }
        size_t upto = sendable(g);
        if (upto > g->sent) {
            if (sse(g, tsr_openai_chunk(&g->c, g->text.p + g->sent, upto - g->sent, NULL, false)))
                return MHD_CONTENT_READER_END_WITH_ERROR;
            g->sent = upto;
            continue;
        }
        if (g->ended) {
            if (g->err_status) {
                if (sse(g, tsr_openai_error(g->err, "server_error", NULL,
                                         g->err_code[0] ? g->err_code : NULL)))
                    return MHD_CONTENT_READER_END_WITH_ERROR;
            } else {
                if (sse(g, tsr_openai_chunk(&g->c, "", 0, g->finish ? g->finish : "stop", false)))
                    return MHD_CONTENT_READER_END_WITH_ERROR;
                if (g->c.include_usage && sse(g, tsr_openai_usage_chunk(&g->c)))
                    return MHD_CONTENT_READER_END_WITH_ERROR;
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
static enum MHD_Result generate(tsr_http_t *h, struct MHD_Connection *conn, bool http11,
                                const char *body, size_t len, bool chat)
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
    tsr_openai_prompt_t prompt = {0};
    const char *param = NULL;
    enum MHD_Result rc;
    if (!g) {
        json_decref(doc);
        return respond_error(conn, 500, "out of memory", NULL, NULL);
    }
    g->conn = conn;
    g->http11 = http11;
    g->c.created = (long long)time(NULL);
    unsigned st = tsr_openai_read_request(doc, chat, &g->c, &prompt, &q, &param, msg, sizeof msg);
    if (st) {
        rc = respond_error(conn, st, msg, st == 400 ? param : NULL, NULL);
        goto out;
    }
    /* Text and chats are rendered and encoded here, in this connection's thread, so the
     * coordinator's loop gets token ids only. */
    if (prompt.text || prompt.messages) {
        st = encode_here(h, g->c.model, prompt.text, prompt.messages, &q, &prompt.ids, msg,
                         sizeof msg);
        if (st) {
            rc = respond_error(conn, st, msg, st == 404 ? "model" : chat ? "messages" : "prompt",
                               st == 404 ? "model_not_found" : NULL);
            goto out;
        }
    }
    q.kind = TESSERA__CONTROL_REQUEST__KIND__GENERATE;
    q.deployment = g->c.model;
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
        if (client_gone(g)) {
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
    g->c.prompt_tokens = json_integer_value(json_object_get(ack, "prompt_tokens"));
    json_decref(ack);
    snprintf(g->c.id, sizeof g->c.id, "%s-%016llx", chat ? "chatcmpl" : "cmpl",
             (unsigned long long)g->request_id);
    /* The first token (or the failure) before any status goes out. */
    while (!g->ended && g->c.completion_tokens == 0)
        if (gen_step(g) < 0 && !g->err_status) {
            rc = MHD_NO;  /* the client left */
            goto out;
        }
    if (g->err_status && g->c.completion_tokens == 0) {
        rc = respond_error(conn, g->err_status, g->err, NULL, g->err_code[0] ? g->err_code : NULL);
        goto out;
    }
    if (g->c.stream) {
        struct MHD_Response *resp =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_reader, g, stream_free);
        if (!resp) {
            rc = MHD_NO;
            goto out;
        }
        g->responded = true;
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
        rc = respond_json(conn, MHD_HTTP_OK, tsr_openai_whole(&g->c, g->text.p, g->text.len, g->finish), 0);
out:
    gen_free(g);
    free(prompt.ids);
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
    json_t *doc = tsr_openai_models(st, (long long)time(NULL));
    json_decref(st);
    return respond_json(conn, MHD_HTTP_OK, doc, 0);
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
    return tsr_apikeys_match(h->keys, h->n_keys, a + 7);
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
        return generate(h, conn, !strcmp(version, MHD_HTTP_VERSION_1_1),
                        cc->body.p ? cc->body.p : "", cc->body.len, chat);
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
        int n = tsr_apikeys_read(api_keys_file, &h->keys, err, errlen);
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
    tsr_apikeys_free(&h->keys, h->n_keys);
    free(h);
    *self_p = NULL;
}
