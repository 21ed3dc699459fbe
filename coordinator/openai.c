/* openai.c: the OpenAI API's documents, read and written; see openai.h.
 *
 * Reading checks every field a request may carry against what Tessera does (n = 1 only;
 * logprobs, echo, tools and the like refused by name) and names the field at fault, as
 * OpenAI's own errors do (param).  Writing follows OpenAI's shapes: text_completion for
 * /v1/completions, chat.completion and chat.completion.chunk for chat, logprobs null. */
#include "openai.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#define MAX_STOP_LEN 256
#define MAX_TOKENS 1000000

/* Reads the sampling and output fields shared by both endpoints into q and c.  NULL on
 * success, else the name of the field at fault with its problem in msg. */
static const char *read_params(json_t *body, bool chat, Tessera__ControlRequest *q,
                               tsr_openai_completion_t *c, char *msg, size_t len)
{
    json_t *v;
    const char *model = json_string_value(json_object_get(body, "model"));
    if (!model || !*model || strlen(model) > TSR_NAME_MAX)
        return snprintf(msg, len, "model: expected the name of a deployment (at most %d "
                        "characters)", TSR_NAME_MAX), "model";
    snprintf(c->model, sizeof c->model, "%s", model);
    q->max_tokens = chat ? MAX_TOKENS : 16;  /* chat: until eos or max_seq_len */
    const char *mt = chat && json_object_get(body, "max_completion_tokens") ? "max_completion_tokens"
                                                                           : "max_tokens";
    if ((v = json_object_get(body, mt)) && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > MAX_TOKENS)
            return snprintf(msg, len, "%s: expected an integer from 1 to %d", mt, MAX_TOKENS), mt;
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
        if (!one && (!json_is_array(v) || n > TSR_OPENAI_MAX_STOPS))
            return snprintf(msg, len, "stop: expected a string or a list of up to %d strings",
                            TSR_OPENAI_MAX_STOPS), "stop";
        for (size_t k = 0; k < n; k++) {
            json_t *s = one ? one : json_array_get(v, k);
            if (!json_is_string(s) || json_string_length(s) == 0 ||
                json_string_length(s) > MAX_STOP_LEN ||
                strlen(json_string_value(s)) != json_string_length(s))
                return snprintf(msg, len, "stop: each stop must be a string of 1 to %d bytes",
                                MAX_STOP_LEN), "stop";
            c->stops[c->n_stops] = strdup(json_string_value(s));
            if (!c->stops[c->n_stops]) return snprintf(msg, len, "out of memory"), "stop";
            if (json_string_length(s) > c->max_stop) c->max_stop = json_string_length(s);
            c->n_stops++;
        }
    }
    if ((v = json_object_get(body, "stream")) && !json_is_null(v)) {
        if (!json_is_boolean(v)) return snprintf(msg, len, "stream: expected true or false"), "stream";
        c->stream = json_is_true(v);
    }
    json_t *so = json_object_get(body, "stream_options");
    if (so && !json_is_null(so)) {
        json_t *iu = json_is_object(so) ? json_object_get(so, "include_usage") : NULL;
        if (!json_is_object(so) || (iu && !json_is_null(iu) && !json_is_boolean(iu)))
            return snprintf(msg, len, "stream_options: expected an object whose include_usage "
                            "is true or false"), "stream_options";
        c->include_usage = json_is_true(iu);
    }
    return NULL;
}

/* A /v1/completions prompt: one string, a list of one string, or a list of token ids. */
static unsigned read_prompt(json_t *body, tsr_openai_prompt_t *p, Tessera__ControlRequest *q,
                            const char **param, char *msg, size_t len)
{
    json_t *v = json_object_get(body, "prompt");
    if (json_is_array(v) && json_array_size(v) == 1 && json_is_string(json_array_get(v, 0)))
        v = json_array_get(v, 0);
    if (json_is_string(v) && json_string_length(v) > 0 &&
        strlen(json_string_value(v)) == json_string_length(v)) {
        p->text = json_string_value(v);
        return 0;
    }
    if (!json_is_array(v) || json_array_size(v) == 0) {
        *param = "prompt";
        snprintf(msg, len, "prompt: expected a non-empty string (without NUL) or a non-empty "
                 "list of token ids");
        return 400;
    }
    size_t n = json_array_size(v);
    if (!(p->ids = malloc(n * sizeof *p->ids))) {
        snprintf(msg, len, "out of memory");
        return 500;
    }
    for (size_t k = 0; k < n; k++) {
        json_t *x = json_array_get(v, k);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX) {
            *param = "prompt";
            snprintf(msg, len, "prompt[%zu]: expected a token id (an integer from 0); a prompt "
                     "is one string, a list of one string, or a list of token ids", k);
            return 400;
        }
        p->ids[k] = (int32_t)json_integer_value(x);
    }
    q->prompt = p->ids;
    q->n_prompt = n;
    return 0;
}

unsigned tsr_openai_read_request(json_t *body, bool chat, tsr_openai_completion_t *c,
                                 tsr_openai_prompt_t *p, Tessera__ControlRequest *q,
                                 const char **param, char *msg, size_t len)
{
    c->chat = chat;
    if ((*param = read_params(body, chat, q, c, msg, len))) return 400;
    if (!chat) return read_prompt(body, p, q, param, msg, len);
    p->messages = json_object_get(body, "messages");
    if (!json_is_array(p->messages) || json_array_size(p->messages) == 0) {
        p->messages = NULL;
        *param = "messages";
        snprintf(msg, len, "messages: expected a non-empty list of messages");
        return 400;
    }
    return 0;
}

void tsr_openai_clear(tsr_openai_completion_t *c)
{
    for (size_t i = 0; i < c->n_stops; i++) free(c->stops[i]);
    c->n_stops = 0;
}

/* ---- answers ----------------------------------------------------------------------- */

static json_t *usage(const tsr_openai_completion_t *c)
{
    return json_pack("{s:I, s:I, s:I, s:{s:I}}", "prompt_tokens", (json_int_t)c->prompt_tokens,
                     "completion_tokens", (json_int_t)c->completion_tokens, "total_tokens",
                     (json_int_t)(c->prompt_tokens + c->completion_tokens),
                     "prompt_tokens_details", "cached_tokens", (json_int_t)c->cached_tokens);
}

json_t *tsr_openai_whole(const tsr_openai_completion_t *c, const char *text, size_t len,
                         const char *finish)
{
    json_t *choice;
    if (c->chat)
        choice = json_pack("{s:i, s:{s:s, s:s%}, s:n}", "index", 0, "message", "role",
                           "assistant", "content", text ? text : "", len, "logprobs");
    else
        choice = json_pack("{s:i, s:s%, s:n}", "index", 0, "text", text ? text : "", len,
                           "logprobs");
    json_object_set_new(choice, "finish_reason", json_string(finish ? finish : "stop"));
    return json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", c->id, "object",
                     c->chat ? "chat.completion" : "text_completion", "created",
                     (json_int_t)c->created, "model", c->model, "choices", choice, "usage",
                     usage(c));
}

json_t *tsr_openai_chunk(const tsr_openai_completion_t *c, const char *text, size_t len,
                         const char *finish, bool role)
{
    json_t *choice;
    if (c->chat) {
        json_t *delta = json_object();
        if (role) json_object_set_new(delta, "role", json_string("assistant"));
        if (len || role) json_object_set_new(delta, "content", json_stringn(text, len));
        choice = json_pack("{s:i, s:o, s:n}", "index", 0, "delta", delta, "logprobs");
    } else {
        choice = json_pack("{s:i, s:s%, s:n}", "index", 0, "text", text, len, "logprobs");
    }
    json_object_set_new(choice, "finish_reason", finish ? json_string(finish) : json_null());
    return json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", c->id, "object",
                     c->chat ? "chat.completion.chunk" : "text_completion", "created",
                     (json_int_t)c->created, "model", c->model, "choices", choice);
}

json_t *tsr_openai_usage_chunk(const tsr_openai_completion_t *c)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", c->id, "object",
                     c->chat ? "chat.completion.chunk" : "text_completion", "created",
                     (json_int_t)c->created, "model", c->model, "choices", "usage", usage(c));
}

json_t *tsr_openai_error(const char *message, const char *type, const char *param,
                         const char *code)
{
    json_t *e = json_pack("{s:s, s:s}", "message", message, "type", type);
    json_object_set_new(e, "param", param ? json_string(param) : json_null());
    json_object_set_new(e, "code", code ? json_string(code) : json_null());
    return json_pack("{s:o}", "error", e);
}

const char *tsr_openai_error_type(unsigned status)
{
    return status == 401   ? "authentication_error"
           : status == 404 ? "not_found_error"
           : status == 503 ? "service_unavailable"
           : status >= 500 ? "server_error"
                           : "invalid_request_error";
}

json_t *tsr_openai_models(json_t *deployments, long long now_s)
{
    json_t *data = json_array();
    long long up = json_integer_value(json_object_get(deployments, "uptime_ms"));
    size_t i;
    json_t *d;
    json_array_foreach(json_object_get(deployments, "deployments"), i, d)
        json_array_append_new(data, json_pack("{s:O, s:s, s:I, s:s}", "id",
                                              json_object_get(d, "name"), "object", "model",
                                              "created", (json_int_t)(now_s - up / 1000),
                                              "owned_by", "tessera"));
    return json_pack("{s:s, s:o}", "object", "list", "data", data);
}
