/* cli.h: the subcommands of `tessera`, one file each. */
#ifndef TSR_CLI_H
#define TSR_CLI_H

#include <jansson.h>
#include "common/wire.h"
#include "common/keys.h"

typedef struct {
    const char *endpoint;   /* coordinator control endpoint */
    int timeout_ms;         /* how long to wait for an answer */
    tsr_security_t sec;     /* its CURVE keys (sec.curve 0: plain) */
} tsr_cli_t;

/* Token ids written "1,2,3" (commas and/or white space between them; a last comma may
 * trail) into ids, at most max; *n_out how many.  0, or -1 with what is wrong in why. */
int tsr_cli_parse_ids(const char *s, int32_t *ids, size_t max, size_t *n_out, char *why,
                      size_t len);

/* Why the coordinator may not have answered, for a "no answer" message: its host name
 * does not resolve, else "is it running? see --coordinator".  Written into buf. */
const char *tsr_cli_unreachable_hint(const tsr_cli_t *cli, char *buf, size_t len);

/* A socket to the control endpoint with the CLI's keys, and a monitor of its
 * connection (*mon).  NULL with the reason printed. */
void *tsr_cli_connect(const tsr_cli_t *cli, void **mon);
/* When mon reports a failed handshake (or the third handshake in a row the
 * coordinator closed without a reason), prints why (naming the endpoint and
 * the CLI's identity) and returns 1; for other events (or none) returns 0
 * and the event id in *event (-1: none). */
int tsr_cli_handshake_failed(const tsr_cli_t *cli, void *mon, int *event);
/* Sends env on s.  A socket with no connection left to queue it on (the
 * coordinator closed the handshake before the send, as a CURVE endpoint does
 * with a plain client or a key it does not allow) refuses it at once: then
 * mon is read for the refusal, and the send tried again as the socket
 * reconnects, until deadline (tsr_now_ms's clock).  0, or -1 with the
 * reason printed. */
int tsr_cli_send(const tsr_cli_t *cli, void *s, void *mon, tsr_env_t *env, int64_t deadline);
/* A message arrived from the coordinator: handshakes it closed before no
 * longer count towards calling it a refusal. */
void tsr_cli_heard(void);

/* What a refused reload leaves as it was, said after the reason. */
#define TSR_CLI_RELOAD_REFUSED \
    "not reloaded: the coordinator keeps its running configuration (fix the file, then reload again)"

/* Sends one control request; on success returns 0 and *out (caller owns,
 * json_decref) with the reply's JSON document (NULL when it has none).  On
 * failure prints the reason to stderr and returns 1 (no answer) or 3 (the
 * coordinator said no). */
int tsr_cli_request(const tsr_cli_t *cli, Tessera__ControlRequest__Kind kind, const char *worker,
                    json_t **out);
/* The same, handing back the reply's JSON text as it came (caller frees). */
int tsr_cli_request_text(const tsr_cli_t *cli, Tessera__ControlRequest__Kind kind,
                         const char *worker, char **out);

int tsr_cmd_status(const tsr_cli_t *cli, int argc, char **argv);
int tsr_cmd_workers(const tsr_cli_t *cli, int argc, char **argv);
int tsr_cmd_reload(const tsr_cli_t *cli, int argc, char **argv);
int tsr_cmd_drain(const tsr_cli_t *cli, int argc, char **argv, int drain);
int tsr_cmd_plan(const tsr_cli_t *cli, int argc, char **argv);
/* `tessera plan FILE --diff`: what a reload of FILE would do to the running cluster
 * (cli/plan_diff.c).  0, 1 (an error, no answer) or 3 (refused). */
int tsr_plan_diff(const tsr_cli_t *cli, const char *path);
int tsr_cmd_generate(const tsr_cli_t *cli, int argc, char **argv);
int tsr_cmd_local(int argc, char **argv);
/* `tessera keys init|add|remove|list` (cli/keys.c). */
int tsr_cmd_keys(int argc, char **argv);
/* `tessera model-init DIR`: writes a random Llama checkpoint (cli/model_init.c). */
int tsr_cmd_model_init(int argc, char **argv);

/* `tessera tokenize DIR`: encode and decode with a tokenizer.json (cli/tokenize.c). */
int tsr_cmd_tokenize(int argc, char **argv);

/* Renders a status document as tables on stdout. */
void tsr_print_status(json_t *doc, int workers_only);

#endif
