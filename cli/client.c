#include <ctype.h>
#include <errno.h>
#include <netdb.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "cli.h"
#include "common/deploy.h"
#include "common/log.h"

#define RELOAD_ANSWER_MS 60000   /* how long a sent reload may take to answer */

int tsr_cli_parse_ids(const char *s, int32_t *ids, size_t max, size_t *n_out, char *why,
                      size_t len)
{
    size_t n = 0;
    const char *p = s;
    for (;;) {
        /* between two ids: white space and at most one comma (a last one may trail) */
        int commas = 0;
        const char *sep = p;
        for (; *p && (isspace((unsigned char)*p) || *p == ','); p++) commas += *p == ',';
        if (!*p) break;
        if (commas > 1 || (commas && n == 0)) {
            snprintf(why, len, "an empty id at '%.20s' (give 1,2,3)", sep);
            return -1;
        }
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX ||
            (*end && *end != ',' && !isspace((unsigned char)*end))) {
            snprintf(why, len, "'%.20s' is not a token id", p);
            return -1;
        }
        if (n == max) {
            snprintf(why, len, "more than %zu ids", max);
            return -1;
        }
        ids[n++] = (int32_t)v;
        p = end;
    }
    *n_out = n;
    return 0;
}

const char *tsr_cli_unreachable_hint(const tsr_cli_t *cli, char *buf, size_t len)
{
    /* a host name that does not resolve is the likeliest cause; ZeroMQ only retries it */
    char host[256];
    if (tsr_endpoint_host(cli->endpoint, host, sizeof host, NULL) && host[0] != '[' &&
        !strchr(host, ':') && strspn(host, "0123456789.") < strlen(host)) {
        struct addrinfo *ai = NULL, hints = {.ai_socktype = SOCK_STREAM};
        int rc = getaddrinfo(host, NULL, &hints, &ai);
        if (ai) freeaddrinfo(ai);
        if (rc) {
            snprintf(buf, len, "the host '%s' does not resolve: %s", host, gai_strerror(rc));
            return buf;
        }
    }
    snprintf(buf, len, "is it running? see --coordinator");
    return buf;
}

int tsr_cli_request(const tsr_cli_t *cli, Tessera__ControlRequest__Kind kind, const char *worker,
                    json_t **out)
{
    char *text = NULL;
    *out = NULL;
    int rc = tsr_cli_request_text(cli, kind, worker, &text);
    if (rc == 0 && text && text[0]) {
        json_error_t je;
        *out = json_loads(text, 0, &je);
        if (!*out) {
            fprintf(stderr, "tessera: reply is not valid JSON: %s\n", je.text);
            rc = 1;
        }
    }
    free(text);
    return rc;
}

int tsr_cli_request_text(const tsr_cli_t *cli, Tessera__ControlRequest__Kind kind,
                         const char *worker, char **out)
{
    int rc = 1;
    char err[512];
    tsr_env_t *reply = NULL;
    *out = NULL;
    void *mon = NULL;
    void *s = tsr_cli_connect(cli, &mon);
    if (!s) return 1;
    Tessera__ControlRequest q = TESSERA__CONTROL_REQUEST__INIT;
    q.kind = kind;
    q.worker = (char *)(worker ? worker : "");
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REQUEST;
    env.control_request = &q;
    env.worker = "";
    if (strlen(q.worker) > TSR_NAME_MAX) {
        fprintf(stderr, "tessera: worker name is %zu characters, limit %d\n", strlen(q.worker),
                TSR_NAME_MAX);
        goto out;
    }

    /* The request is queued until the connection is up; the deadline
     * covers connecting and answering. */
    int64_t deadline = tsr_now_ms() + cli->timeout_ms;
    if (tsr_cli_send(cli, s, mon, &env, deadline) < 0) goto out;
    /* A reload reads every deployment's config.json (and the safetensors index) before it
     * answers, which a slow disk can make long: once sent, it is given RELOAD_ANSWER_MS.
     * (New tokenizers are read afterwards, off the coordinator's loop.) */
    int waited_ms = cli->timeout_ms;
    if (kind == TESSERA__CONTROL_REQUEST__KIND__RELOAD && waited_ms < RELOAD_ANSWER_MS) {
        deadline = tsr_now_ms() + RELOAD_ANSWER_MS;
        waited_ms = RELOAD_ANSWER_MS;
    }
    zmq_pollitem_t items[2] = {{s, 0, ZMQ_POLLIN, 0}, {mon, 0, ZMQ_POLLIN, 0}};
    for (;;) {
        int64_t left = deadline - tsr_now_ms();
        if (left <= 0) {
            char hint[320];
            fprintf(stderr, "tessera: no answer from the coordinator at %s within %d ms (%s)\n",
                    cli->endpoint, waited_ms, tsr_cli_unreachable_hint(cli, hint, sizeof hint));
            goto out;
        }
        if (zmq_poll(items, 2, (long)left) <= 0) continue;
        if (items[1].revents & ZMQ_POLLIN) {
            int ev;
            if (tsr_cli_handshake_failed(cli, mon, &ev)) goto out;
        }
        if (!(items[0].revents & ZMQ_POLLIN)) continue;
        int r = tsr_wire_recv(s, NULL, NULL, TSR_WIRE_MAX_CONTROL, &reply, err, sizeof err);
        if (r == 0) continue;
        if (r < 0) {
            fprintf(stderr, "tessera: bad reply from %s: %s\n", cli->endpoint, err);
            goto out;
        }
        break;
    }
    if (reply->body_case != TESSERA__ENVELOPE__BODY_CONTROL_REPLY) {
        fprintf(stderr, "tessera: unexpected %s from %s\n", tsr_env_kind(reply), cli->endpoint);
        goto out;
    }
    if (!reply->control_reply->ok) {
        fprintf(stderr, "tessera: %s\n", reply->control_reply->error);
        rc = 3;
        goto out;
    }
    *out = strdup(reply->control_reply->json);
    rc = *out ? 0 : 1;
out:
    tsr_env_free(&reply);
    tsr_sock_monitor_close(s, &mon);
    tsr_sock_close(&s);
    return rc;
}

int tsr_cli_send(const tsr_cli_t *cli, void *s, void *mon, tsr_env_t *env, int64_t deadline)
{
    for (;;) {
        if (tsr_wire_send(s, NULL, 0, env) == 0) return 0;
        const int64_t left = deadline - tsr_now_ms();
        if (left <= 0 || !mon) break;
        zmq_pollitem_t it = {mon, 0, ZMQ_POLLIN, 0};
        zmq_poll(&it, 1, left < 50 ? (long)left : 50L);
        int ev;
        if ((it.revents & ZMQ_POLLIN) && tsr_cli_handshake_failed(cli, mon, &ev)) return -1;
    }
    char hint[320];
    fprintf(stderr,
            "tessera: cannot send to %s: no connection to the coordinator took the request "
            "within %d ms (%s)\n",
            cli->endpoint, cli->timeout_ms, tsr_cli_unreachable_hint(cli, hint, sizeof hint));
    return -1;
}

void *tsr_cli_connect(const tsr_cli_t *cli, void **mon)
{
    char err[512];
    void *s = tsr_sock_dealer_sec(cli->endpoint, 0, &cli->sec, mon, err, sizeof err);
    if (!s) fprintf(stderr, "tessera: %s\n", err);
    return s;
}

/* Handshakes the coordinator closed since the CLI last heard from it.  One
 * is a transient (it stopped or restarted mid-handshake); a CURVE endpoint
 * closes every handshake of a plain client, often before the client has
 * read enough to name the mismatch, so several in a row are a refusal. */
static int closed_in_handshake;
#define CLOSED_IN_HANDSHAKE_MAX 3

void tsr_cli_heard(void) { closed_in_handshake = 0; }

int tsr_cli_handshake_failed(const tsr_cli_t *cli, void *mon, int *event)
{
    uint32_t value = 0;
    *event = -1;
    int ev;
    while ((ev = tsr_sock_monitor_event_v(mon, &value)) >= 0) {
        const char *why = tsr_handshake_failure(ev, value);
        if (!why && ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL &&
            ++closed_in_handshake >= CLOSED_IN_HANDSHAKE_MAX)
            why = "it closed the connection during the handshake 3 times in a row, as a "
                  "CURVE endpoint does with a plain client or a key it does not allow "
                  "(compare coordinator.security with this program's keys: --keys, "
                  "TESSERA_KEYS), or as a server that is not a Tessera coordinator does "
                  "(check the endpoint's port)";
        if (why) {
            fprintf(stderr, "tessera: the coordinator at %s refused the connection: %s "
                            "(identity '%s', %s)\n",
                    cli->endpoint, why, cli->sec.curve ? cli->sec.identity : "-",
                    cli->sec.curve ? cli->sec.dir : "no keys: plain ZeroMQ");
            return 1;
        }
        /* the last event that can mean the coordinator went away */
        if (ev != ZMQ_EVENT_CONNECTED && ev != ZMQ_EVENT_HANDSHAKE_SUCCEEDED) *event = ev;
    }
    return 0;
}
