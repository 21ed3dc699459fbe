/* generate.c: `tessera generate DEPLOYMENT`: send token ids, print the
 * generated ids as they stream back. */
#include <ctype.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "cli.h"
#include "common/log.h"

#define MAX_PROMPT 65536

static void gen_usage(FILE *f)
{
    fprintf(f,
            "usage: tessera [--coordinator EP] generate DEPLOYMENT [--prompt-ids 1,2,3]\n"
            "           [--max-tokens N] [--temperature T] [--top-p P] [--seed S] [--ids]\n"
            "           [--timeout MS] [--token-timeout MS]\n"
            "\n"
            "Runs the prompt's token ids through a ready replica of DEPLOYMENT and prints\n"
            "the generated ids as they arrive.  Without --prompt-ids the ids are read from\n"
            "standard input (separated by commas, spaces or newlines).  Generation stops at\n"
            "the model's end-of-sequence token, after --max-tokens, or at max_seq_len.\n"
            "  --max-tokens N      tokens to generate at most (default 16)\n"
            "  --temperature T     0 (default) picks the most likely token; above 0 samples\n"
            "  --top-p P           sample from the smallest set of tokens whose probability\n"
            "                      reaches P (default 1)\n"
            "  --seed S            seed for sampling (default 0)\n"
            "  --ids               print only the ids (no summary line on standard error)\n"
            "  --timeout MS        the whole request's deadline, 1 to 86400000 (0 or absent:\n"
            "                      none); when it passes the coordinator ends the request,\n"
            "                      frees its place on the replica and says so (exit 3).  The\n"
            "                      global --timeout before the command is something else:\n"
            "                      the wait for the coordinator to accept the request\n"
            "  --token-timeout MS  give up when no token comes for this long (default 60000)\n"
            "\n"
            "The ids go to standard output on one line, space-separated, as they arrive.\n"
            "exit status: 0 done, 1 no answer or a bad argument value, 2 bad usage,\n"
            "3 the request was refused or failed (the reason is printed).\n");
}

/* Parses "1,2, 3\n4" into ids.  Returns the count, or -1 with a message. */
static int parse_ids(const char *s, int32_t *ids, int max, const char *what)
{
    int n = 0;
    const char *p = s;
    while (*p) {
        while (*p && (isspace((unsigned char)*p) || *p == ',')) p++;
        if (!*p) break;
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v > INT32_MAX) {
            fprintf(stderr, "tessera generate: %s: '%.20s' is not a token id\n", what, p);
            return -1;
        }
        if (n == max) {
            fprintf(stderr, "tessera generate: %s: more than %d ids\n", what, max);
            return -1;
        }
        ids[n++] = (int32_t)v;
        p = end;
    }
    return n;
}

static char *read_stdin(void)
{
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + len, 1, cap - len - 1, stdin)) > 0) {
        len += got;
        if (len + 1 == cap) {
            char *b = realloc(buf, cap *= 2);
            if (!b) break;
            buf = b;
        }
    }
    if (buf) buf[len] = '\0';
    return buf;
}

int tsr_cmd_generate(const tsr_cli_t *cli, int argc, char **argv)
{
    const char *ids_arg = NULL;
    long max_tokens = 16, token_timeout = 60000, deadline = 0;
    double temperature = 0, top_p = 1;
    unsigned long long seed = 0;
    int only_ids = 0, rc = 1;
    static const struct option opts[] = {
        {"prompt-ids", required_argument, 0, 'p'}, {"max-tokens", required_argument, 0, 'm'},
        {"temperature", required_argument, 0, 't'}, {"top-p", required_argument, 0, 'P'},
        {"seed", required_argument, 0, 's'},       {"ids", no_argument, 0, 'i'},
        {"token-timeout", required_argument, 0, 'T'}, {"timeout", required_argument, 0, 'D'},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int o;
    optind = 0;  /* 0 re-initialises GNU getopt (and its argument permutation) */
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        char *end = NULL;
        switch (o) {
        case 'p': ids_arg = optarg; break;
        case 'm': max_tokens = strtol(optarg, &end, 10); break;
        case 't': temperature = strtod(optarg, &end); break;
        case 'P': top_p = strtod(optarg, &end); break;
        case 's': seed = strtoull(optarg, &end, 10); break;
        case 'T': token_timeout = strtol(optarg, &end, 10); break;
        case 'D': deadline = strtol(optarg, &end, 10); break;
        case 'i': only_ids = 1; break;
        case 'h': gen_usage(stdout); return 0;
        default: gen_usage(stderr); return 2;
        }
        if (end && (*end || end == optarg)) {
            const char *name = "?";
            for (const struct option *op = opts; op->name; op++)
                if (op->val == o) name = op->name;
            fprintf(stderr, "tessera generate: --%s: '%s' is not a number\n", name, optarg);
            return 2;
        }
    }
    if (optind != argc - 1) {
        gen_usage(stderr);
        return 2;
    }
    /* Written so that NaN fails every test. */
    if (!(max_tokens >= 1 && max_tokens <= 1000000) || !(temperature >= 0 && temperature <= 100) ||
        !(top_p > 0 && top_p <= 1) || !(token_timeout >= 1 && token_timeout <= 3600000) ||
        !(deadline >= 0 && deadline <= 86400000)) {
        fprintf(stderr, "tessera generate: need 1 <= --max-tokens <= 1000000, "
                        "0 <= --temperature <= 100, 0 < --top-p <= 1, "
                        "1 <= --token-timeout <= 3600000, 0 <= --timeout <= 86400000\n");
        return 2;
    }
    const char *deployment = argv[optind];
    int32_t *prompt = malloc(MAX_PROMPT * sizeof *prompt);
    char *in = ids_arg ? NULL : read_stdin();
    void *s = NULL, *mon = NULL;
    tsr_env_t *reply = NULL;
    if (!prompt || (!ids_arg && !in)) goto out;
    int n = parse_ids(ids_arg ? ids_arg : in, prompt, MAX_PROMPT,
                      ids_arg ? "--prompt-ids" : "standard input");
    if (n < 0) goto out;
    if (n == 0) {
        fprintf(stderr, "tessera generate: the prompt is empty\n");
        goto out;
    }

    char err[512];
    if (!(s = tsr_cli_connect(cli, &mon))) goto out;
    Tessera__ControlRequest q = TESSERA__CONTROL_REQUEST__INIT;
    q.kind = TESSERA__CONTROL_REQUEST__KIND__GENERATE;
    q.deployment = (char *)deployment;
    q.worker = "";
    q.n_prompt = (size_t)n;
    q.prompt = prompt;
    q.max_tokens = (uint32_t)max_tokens;
    q.temperature = (float)temperature;
    q.top_p = (float)top_p;
    q.seed = seed;
    q.timeout_ms = (uint32_t)deadline;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = "";
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REQUEST;
    env.control_request = &q;
    /* The coordinator answers a larger request only with an error: say so
     * here, with the numbers, without sending it. */
    if (strlen(deployment) > TSR_NAME_MAX) {
        fprintf(stderr, "tessera generate: the deployment name is %zu characters, limit %d\n",
                strlen(deployment), TSR_NAME_MAX);
        goto out;
    }
    size_t packed = tessera__envelope__get_packed_size(&env);
    if (packed > TSR_WIRE_MAX_REQUEST) {
        fprintf(stderr, "tessera generate: the request is %zu bytes, over the coordinator's "
                        "limit of %u\n", packed, TSR_WIRE_MAX_REQUEST);
        goto out;
    }
    if (tsr_wire_send(s, NULL, 0, &env) < 0) {
        fprintf(stderr, "tessera: cannot send to %s\n", cli->endpoint);
        goto out;
    }
    int64_t start = tsr_now_ms(), first = 0;
    int got = 0, accepted = 0;
    /* A coordinator that goes away mid-request (crash, restart) takes the
     * request with it: say so at once instead of waiting out the timeout. */
    zmq_pollitem_t items[2] = {{s, 0, ZMQ_POLLIN, 0}, {mon, 0, ZMQ_POLLIN, 0}};
    for (;;) {
        /* --timeout for the coordinator to accept the request, then
         * --token-timeout for each token (the first includes the prefill). */
        int wait = accepted ? (int)token_timeout : cli->timeout_ms;
        int ready = zmq_poll(items, mon ? 2 : 1, wait);
        if (ready > 0 && !(items[0].revents & ZMQ_POLLIN)) {
            int ev;
            if (tsr_cli_handshake_failed(cli, mon, &ev)) goto out;
            if (ev == ZMQ_EVENT_DISCONNECTED) {
                fprintf(stderr, "%stessera generate: lost the connection to the coordinator at %s "
                                "after %d token(s); the request is gone (did it restart?)\n",
                        got ? "\n" : "", cli->endpoint, got);
                goto out;
            }
            continue;
        }
        if (ready <= 0) {
            fprintf(stderr, "%stessera generate: no %s from %s within %d ms%s\n", got ? "\n" : "",
                    accepted ? "token" : "answer", cli->endpoint, wait,
                    accepted ? " (see --token-timeout)" : " (is it running? see --coordinator)");
            goto out;
        }
        tsr_env_free(&reply);
        int r = tsr_wire_recv(s, NULL, NULL, TSR_WIRE_MAX_CONTROL, &reply, err, sizeof err);
        if (r <= 0) {
            if (r < 0) fprintf(stderr, "\ntessera generate: bad reply: %s\n", err);
            if (r < 0) goto out;
            continue;
        }
        if (reply->body_case != TESSERA__ENVELOPE__BODY_CONTROL_REPLY) continue;
        if (!reply->control_reply->ok) {
            fprintf(stderr, "%stessera generate: %s\n", got ? "\n" : "", reply->control_reply->error);
            rc = 3;
            goto out;
        }
        json_t *doc = json_loads(reply->control_reply->json, 0, NULL);
        if (!doc) continue;
        if (!json_object_get(doc, "token")) {  /* the acceptance */
            accepted = 1;
            json_decref(doc);
            continue;
        }
        int token = (int)json_integer_value(json_object_get(doc, "token"));
        long long index = json_integer_value(json_object_get(doc, "index"));
        int done = json_is_true(json_object_get(doc, "done"));
        if (index != got) {
            /* The coordinator drops replies to a client whose queue is full
             * rather than block every other client: the ids are incomplete. */
            fprintf(stderr, "%stessera generate: token(s) %d to %lld never arrived (this client "
                            "read too slowly and the coordinator dropped them)\n",
                    got ? "\n" : "", got, index - 1);
            json_decref(doc);
            rc = 3;
            goto out;
        }
        char finish[32];
        snprintf(finish, sizeof finish, "%s", json_string_value(json_object_get(doc, "finish_reason")) ?: "");
        json_decref(doc);
        if (!got) first = tsr_now_ms();
        printf("%s%d", got ? " " : "", token);
        fflush(stdout);
        got++;
        if (done) {
            printf("\n");
            fflush(stdout);  /* the ids before the summary on stderr */
            if (!only_ids) {
                int64_t end = tsr_now_ms();
                fprintf(stderr, "%d token(s), finished by %s; first token after %lld ms, %.1f tokens/s after it\n",
                        got, finish, (long long)(first - start),
                        got > 1 && end > first ? (got - 1) * 1000.0 / (double)(end - first) : 0.0);
            }
            rc = 0;
            goto out;
        }
    }
out:
    tsr_env_free(&reply);
    if (s) tsr_sock_monitor_close(s, &mon);
    tsr_sock_close(&s);
    free(in);
    free(prompt);
    return rc;
}
