/* http.h: the coordinator's OpenAI-compatible HTTP API (coordinator.http_endpoint).
 *
 *   GET  /v1/models            the deployments, as models (the id is the deployment name)
 *   POST /v1/completions       prompt (text or token ids) -> text, streamed or not
 *   POST /v1/chat/completions  messages -> text, with the deployment's chat template
 *   GET  /health               200 while every deployment has a ready replica, else 503
 *   GET  /metrics              Prometheus text
 *
 * The server runs in libmicrohttpd's threads, one per connection.  A connection's
 * thread talks to the coordinator's loop as a control client does, over an in-process
 * ZeroMQ endpoint bound on the control socket (the bridge), so the loop never waits on
 * HTTP.  With api keys, /v1/ wants "Authorization: Bearer KEY"; /health and /metrics
 * are open to whoever can reach the port.  The OpenAI documents are openai.h's, the keys
 * apikeys.h's. */
#ifndef TSR_HTTP_H
#define TSR_HTTP_H

#include <stddef.h>

typedef struct tsr_http tsr_http_t;

struct tsr_tokreg;

/* Starts serving on host:port.  bridge: the inproc endpoint of the coordinator's socket
 * for it.  reg: the deployments' tokenizers, with which prompts are encoded in the
 * connections' threads (it must outlive the server).  api_keys_file: the bearer tokens
 * (apikeys.h); NULL for none.  NULL with the reason in err. */
tsr_http_t *tsr_http_start(const char *host, int port, const char *bridge,
                           struct tsr_tokreg *reg, const char *api_keys_file, char *err,
                           size_t errlen);
/* Stops the server: open connections are closed.  Sets *self_p to NULL. */
void tsr_http_stop(tsr_http_t **self_p);

#endif
