/* openai.h: the OpenAI API's documents, read and written: a /v1/completions or
 * /v1/chat/completions body into a GENERATE control request, and the answers (the whole
 * completion, the chunks of a stream, usage, errors, the /v1/models list).  No I/O here:
 * the HTTP server (http.c) moves the bytes.  Every json_t returned is a new reference. */
#ifndef TSR_OPENAI_H
#define TSR_OPENAI_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/wire.h"

#define TSR_OPENAI_MAX_STOPS 4

/* One completion: what its request asked for, and what its answer's documents say. */
typedef struct {
    bool chat;                        /* /v1/chat/completions */
    bool stream, include_usage;
    char model[256];                  /* the deployment */
    char *stops[TSR_OPENAI_MAX_STOPS];  /* owned; tsr_openai_clear frees them */
    size_t n_stops, max_stop;         /* max_stop: the longest one's length */
    /* set by the caller: */
    char id[48];
    long long created;                /* Unix seconds */
    long long prompt_tokens, completion_tokens;
    long long cached_tokens;    /* of the prompt, taken from the replica's prefix cache */
} tsr_openai_completion_t;

/* A request's prompt: text (/v1/completions), messages (chat), both borrowed from the
 * body, or token ids (the caller frees ids, after a refusal too). */
typedef struct {
    const char *text;
    json_t *messages;
    int32_t *ids;
} tsr_openai_prompt_t;

/* Reads a request body (a JSON object) into c, p and q's sampling fields (max_tokens,
 * temperature, top_p, seed; q->prompt when the prompt is token ids).  0, or the HTTP
 * status of the refusal (400, 500 out of memory) with the reason in msg and, for a 400,
 * the field at fault in *param.  c and p start zeroed; after a refusal too, what they
 * hold is freed by tsr_openai_clear and the caller. */
unsigned tsr_openai_read_request(json_t *body, bool chat, tsr_openai_completion_t *c,
                                 tsr_openai_prompt_t *p, Tessera__ControlRequest *q,
                                 const char **param, char *msg, size_t len);
/* Frees what c owns. */
void tsr_openai_clear(tsr_openai_completion_t *c);

/* The whole answer: text (len bytes) and why it ended ("stop", "length"), with usage. */
json_t *tsr_openai_whole(const tsr_openai_completion_t *c, const char *text, size_t len,
                         const char *finish);
/* One chunk of a stream: len bytes of text, finish (NULL while it runs); role: the chat
 * stream's first chunk, which names the assistant. */
json_t *tsr_openai_chunk(const tsr_openai_completion_t *c, const char *text, size_t len,
                         const char *finish, bool role);
/* The stream's last chunk when stream_options.include_usage: no choices, the usage. */
json_t *tsr_openai_usage_chunk(const tsr_openai_completion_t *c);

/* An error document; type: OpenAI's ("invalid_request_error", ...); param, code or NULL. */
json_t *tsr_openai_error(const char *message, const char *type, const char *param,
                         const char *code);
/* OpenAI's error type for an HTTP status. */
const char *tsr_openai_error_type(unsigned status);

/* The /v1/models list from the coordinator's deployments document (the id of a model is
 * its deployment's name; created: when the coordinator started, now_s: the time now). */
json_t *tsr_openai_models(json_t *deployments, long long now_s);

#endif
