/* generate.c: `tessera generate DEPLOYMENT`: send token ids, print the
 * generated ids as they stream back. */
#include <ctype.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "cli.h"
#include "common/log.h"

#define MAX_PROMPT 65536

static void gen_usage(FILE *f)
{
    fprintf(f,
            "usage: tessera [--coordinator EP] generate DEPLOYMENT [--prompt TEXT | --prompt-ids 1,2,3]\n"
            "           [--max-tokens N] [--temperature T] [--top-p P] [--seed S] [--ids | --text]\n"
            "           [--timeout MS] [--token-timeout MS]\n"
            "\n"
            "Runs a prompt through a ready replica of DEPLOYMENT and prints what it generates\n"
            "as it arrives: text for a --prompt, token ids for --prompt-ids.  --prompt is\n"
            "encoded by the deployment's tokenizer (its model directory's tokenizer.json,\n"
            "with its bos token).  Without either, token ids are read from standard input\n"
            "(separated by commas, spaces or newlines).  Generation stops at the model's\n"
            "end-of-sequence token, after --max-tokens, or at max_seq_len.\n"
            "  --prompt TEXT       the prompt as text (UTF-8)\n"
            "  --prompt-ids IDS    the prompt as token ids\n"
            "  --max-tokens N      tokens to generate at most (default 16)\n"
            "  --temperature T     0 (default) picks the most likely token; above 0 samples\n"
            "  --top-p P           sample from the smallest set of tokens whose probability\n"
            "                      reaches P (default 1)\n"
            "  --seed S            seed for sampling (default 0)\n"
            "  --ids               print only the ids (no summary line on standard error)\n"
            "  --text              print text, also for a prompt of ids (the deployment\n"
            "                      needs a tokenizer)\n"
            "  --timeout MS        the whole request's deadline, 1 to 86400000 (0 or absent:\n"
            "                      none); when it passes the coordinator ends the request,\n"
            "                      frees its place on the replica and says so (exit 3).  The\n"
            "                      global --timeout before the command is something else:\n"
            "                      the wait for the coordinator to accept the request\n"
            "  --token-timeout MS  give up when no token comes for this long (default 60000)\n"
            "\n"
            "The ids go to standard output on one line, space-separated, as they arrive;\n"
            "text goes there as it streams (a character split across tokens comes whole).\n"
            "If the coordinator goes away mid-request (a crash, a restart), the request is\n"
            "sent again when it is back, with the ids already printed, and goes on from\n"
            "there (up to --token-timeout without a coordinator).\n"
            "exit status: 0 done, 1 no answer or a bad argument value, 2 bad usage,\n"
            "3 the request was refused or failed (the reason is printed).\n");
}

/* Parses "1,2, 3\n4" into ids.  Returns the count, or -1 with a message. */
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
    const char *ids_arg = NULL, *text_arg = NULL;
    long max_tokens = 16, token_timeout = 60000, deadline = 0;
    double temperature = 0, top_p = 1;
    unsigned long long seed = 0;
    int only_ids = 0, want_text = 0, rc = 1;
    static const struct option opts[] = {
        {"prompt-ids", required_argument, 0, 'p'}, {"max-tokens", required_argument, 0, 'm'},
        {"temperature", required_argument, 0, 't'}, {"top-p", required_argument, 0, 'P'},
        {"seed", required_argument, 0, 's'},       {"ids", no_argument, 0, 'i'},
        {"prompt", required_argument, 0, 'x'},     {"text", no_argument, 0, 'X'},
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
        case 'x': text_arg = optarg; break;
        case 'X': want_text = 1; break;
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
    /* Written so that NaN fails every test; the first value out of its range is named. */
    char bad[160] = "";
    if (!(max_tokens >= 1 && max_tokens <= 1000000))
        snprintf(bad, sizeof bad, "--max-tokens: expected 1 to 1000000, got %ld", max_tokens);
    else if (!(temperature >= 0 && temperature <= 100))
        snprintf(bad, sizeof bad, "--temperature: expected 0 to 100, got %g", temperature);
    else if (!(top_p > 0 && top_p <= 1))
        snprintf(bad, sizeof bad, "--top-p: expected above 0, at most 1, got %g", top_p);
    else if (!(token_timeout >= 1 && token_timeout <= 3600000))
        snprintf(bad, sizeof bad, "--token-timeout: expected 1 to 3600000 ms, got %ld",
                 token_timeout);
    else if (!(deadline >= 0 && deadline <= 86400000))
        snprintf(bad, sizeof bad, "--timeout: expected 0 to 86400000 ms, got %ld", deadline);
    if (bad[0]) {
        fprintf(stderr, "tessera generate: %s\n", bad);
        return 2;
    }
    if ((text_arg && ids_arg) || (only_ids && want_text)) {
        fprintf(stderr, "tessera generate: %s\n", text_arg && ids_arg
                ? "give --prompt or --prompt-ids, not both"
                : "give --ids or --text, not both");
        return 2;
    }
    if (text_arg && !*text_arg) {
        fprintf(stderr, "tessera generate: --prompt: the prompt is empty\n");
        return 2;
    }
    /* Text out for a text prompt (unless --ids), or when asked. */
    want_text = want_text || (text_arg && !only_ids);
    const char *deployment = argv[optind];
    int32_t *prompt = malloc(MAX_PROMPT * sizeof *prompt);
    char *in = ids_arg || text_arg ? NULL : read_stdin();
    void *s = NULL, *mon = NULL;
    tsr_env_t *reply = NULL;
    if (!prompt || (!ids_arg && !text_arg && !in)) goto out;
    int n = 0;
    if (!text_arg) {
        size_t got_ids = 0;
        char why[128];
        if (tsr_cli_parse_ids(ids_arg ? ids_arg : in, prompt, MAX_PROMPT, &got_ids, why,
                              sizeof why) < 0) {
            fprintf(stderr, "tessera generate: %s: %s\n",
                    ids_arg ? "--prompt-ids" : "standard input", why);
            goto out;
        }
        n = (int)got_ids;
        if (n == 0) {
            fprintf(stderr, "tessera generate: the prompt is empty\n");
            goto out;
        }
    }

    /* The coordinator answers a larger request only with an error: say so
     * here, with the numbers, without sending it. */
    if (strlen(deployment) > TSR_NAME_MAX) {
        fprintf(stderr, "tessera generate: the deployment name is %zu characters, limit %d\n",
                strlen(deployment), TSR_NAME_MAX);
        goto out;
    }
    /* Room for the prompt and every token: a request is resumed by sending
     * both, so the ids it has are kept. */
    int32_t *grown = realloc(prompt, ((size_t)n + (size_t)max_tokens) * sizeof *prompt);
    if (!grown) goto out;
    prompt = grown;

    char err[512];
    int64_t start = tsr_now_ms(), first = 0;
    long long cached = 0;       /* prompt tokens its replica had in its prefix cache */
    long long prompt_tokens = n;    /* the acceptance says (a text prompt's ids) */
    int64_t resume_until = 0;   /* while the coordinator is away: when to give up */
    int got = 0, resumes = 0;
    uint64_t request_id = 0;    /* the coordinator's id, kept across its restarts */
    uint64_t serving_id = 0;    /* the id of the latest acceptance (the summary's) */
    for (;;) {  /* one attempt per connection to the coordinator */
        Tessera__ControlRequest q = TESSERA__CONTROL_REQUEST__INIT;
        q.kind = TESSERA__CONTROL_REQUEST__KIND__GENERATE;
        q.deployment = (char *)deployment;
        q.worker = "";
        /* The prompt, and on a resumption the tokens already received. */
        q.n_prompt = (size_t)n;
        q.prompt = prompt;
        q.prompt_text = (char *)(text_arg ? text_arg : "");
        q.want_text = want_text;
        q.n_resume = (size_t)got;
        q.resume = prompt + n;
        q.request_id = got ? request_id : 0;
        q.max_tokens = (uint32_t)(max_tokens - got);
        q.temperature = (float)temperature;
        q.top_p = tsr_wire_top_p(top_p);
        q.seed = seed;
        if (deadline) {
            int64_t left = start + deadline - tsr_now_ms();
            if (left <= 0) {
                fprintf(stderr, "%stessera generate: the request's deadline of %ld ms passed "
                                "after %d token(s) while the coordinator was away\n",
                        got ? "\n" : "", deadline, got);
                rc = 3;
                goto out;
            }
            q.timeout_ms = (uint32_t)left;
        }
        tsr_env_t env = TESSERA__ENVELOPE__INIT;
        env.worker = "";
        env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REQUEST;
        env.control_request = &q;
        size_t packed = tessera__envelope__get_packed_size(&env);
        if (packed > TSR_WIRE_MAX_REQUEST) {
            fprintf(stderr, "%stessera generate: the request is %zu bytes, over the "
                            "coordinator's limit of %u\n", got ? "\n" : "", packed,
                    TSR_WIRE_MAX_REQUEST);
            goto out;
        }
        if (!(s = tsr_cli_connect(cli, &mon))) goto out;
        if (tsr_cli_send(cli, s, mon, &env, tsr_now_ms() + cli->timeout_ms) < 0) goto out;
        /* The coordinator numbers this attempt's tokens from 0. */
        int base = got, accepted = 0, lost = 0;
        zmq_pollitem_t items[2] = {{s, 0, ZMQ_POLLIN, 0}, {mon, 0, ZMQ_POLLIN, 0}};
        while (!lost) {
            /* --timeout for the coordinator to accept the request, then
             * --token-timeout for each token (the first includes the prefill). */
            int wait = accepted ? (int)token_timeout : cli->timeout_ms;
            if (resume_until && !accepted) {
                int64_t left = resume_until - tsr_now_ms();
                wait = left < 1 ? 1 : left < wait ? (int)left : wait;
            }
            int ready = zmq_poll(items, 2, wait);
            if (ready > 0 && !(items[0].revents & ZMQ_POLLIN)) {
                int ev;
                if (tsr_cli_handshake_failed(cli, mon, &ev)) goto out;
                /* The coordinator went away (a crash, a restart): the
                 * workers keep their pieces, and a restarted coordinator
                 * takes the request again from the tokens we have. */
                if (ev == ZMQ_EVENT_DISCONNECTED || ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)
                    lost = 1;
                continue;
            }
            if (ready <= 0) {
                if (resume_until) {
                    lost = 1;  /* not back yet: try again until resume_until */
                    continue;
                }
                char hint[320];
                fprintf(stderr, "%stessera generate: no %s from %s within %d ms (%s)\n",
                        got ? "\n" : "", accepted ? "token" : "answer", cli->endpoint, wait,
                        accepted ? "see --token-timeout"
                                 : tsr_cli_unreachable_hint(cli, hint, sizeof hint));
                goto out;
            }
            tsr_env_free(&reply);
            int r = tsr_wire_recv(s, NULL, NULL, TSR_WIRE_MAX_CONTROL, &reply, err, sizeof err);
            if (r <= 0) {
                if (r < 0) fprintf(stderr, "\ntessera generate: bad reply: %s\n", err);
                if (r < 0) goto out;
                continue;
            }
            tsr_cli_heard();
            if (reply->body_case != TESSERA__ENVELOPE__BODY_CONTROL_REPLY) continue;
            if (!reply->control_reply->ok) {
                /* A restarted coordinator has no ready replica until its
                 * workers re-attach: keep asking while resuming. */
                const char *code = reply->control_reply->code;
                if (resume_until && code && !strcmp(code, "unavailable")) {
                    lost = 1;
                    continue;
                }
                fprintf(stderr, "%stessera generate: %s\n", got ? "\n" : "",
                        reply->control_reply->error);
                rc = 3;
                goto out;
            }
            /* A token's text may hold U+0000. */
            json_t *doc = json_loads(reply->control_reply->json, JSON_ALLOW_NUL, NULL);
            if (!doc) continue;
            if (!json_object_get(doc, "token")) {  /* the acceptance, or a resumption */
                accepted = 1;
                serving_id = (uint64_t)json_integer_value(json_object_get(doc, "request_id"));
                /* a text prompt's length is the coordinator's count of its ids */
                if (json_object_get(doc, "prompt_tokens") && !got)
                    prompt_tokens = json_integer_value(json_object_get(doc, "prompt_tokens"));
                if (!request_id) request_id = serving_id;
                if (resume_until) {
                    resume_until = 0;
                    resumes++;
                }
                json_decref(doc);
                continue;
            }
            int token = (int)json_integer_value(json_object_get(doc, "token"));
            long long index = json_integer_value(json_object_get(doc, "index")) + base;
            int done = json_is_true(json_object_get(doc, "done"));
            if (index < got) {
                /* Positions are checked: a resumed request must continue, not
                 * repeat (the coordinator drops repeats; this would be a bug). */
                fprintf(stderr, "%stessera generate: token %lld arrived twice\n", got ? "\n" : "",
                        index);
                json_decref(doc);
                rc = 3;
                goto out;
            }
            if (index != got) {
                /* The coordinator drops replies to a client whose queue is full
                 * rather than block every other client: the ids are incomplete. */
                fprintf(stderr, "%stessera generate: token(s) %d to %lld never arrived (this "
                                "client read too slowly and the coordinator dropped them)\n",
                        got ? "\n" : "", got, index - 1);
                json_decref(doc);
                rc = 3;
                goto out;
            }
            char finish[32];
            snprintf(finish, sizeof finish, "%s",
                     json_string_value(json_object_get(doc, "finish_reason")) ?: "");
            if (!got) {
                first = tsr_now_ms();
                cached = json_integer_value(json_object_get(doc, "cached_tokens"));
            }
            if (want_text) {
                json_t *piece = json_object_get(doc, "text");
                fwrite(json_string_value(piece) ?: "", 1, json_string_length(piece), stdout);
            } else {
                printf("%s%d", got ? " " : "", token);
            }
            json_decref(doc);
            fflush(stdout);
            prompt[n + got] = token;
            got++;
            if (done) {
                printf("\n");
                fflush(stdout);  /* the ids before the summary on stderr */
                if (!only_ids) {
                    int64_t end = tsr_now_ms();
                    fprintf(stderr, "request %llu: %d token(s), finished by %s%s; first token "
                                    "after %lld ms (%lld of the prompt's %lld tokens cached), "
                                    "%.1f tokens/s after it\n",
                            (unsigned long long)serving_id, got, finish,
                            resumes ? " (resumed after the coordinator restarted)" : "",
                            (long long)(first - start), cached, prompt_tokens,
                            got > 1 && end > first ? (got - 1) * 1000.0 / (double)(end - first) : 0.0);
                }
                rc = 0;
                goto out;
            }
        }
        tsr_sock_monitor_close(s, &mon);
        tsr_sock_close(&s);
        int64_t now = tsr_now_ms();
        if (!resume_until) {
            resume_until = now + token_timeout;
            char which[48] = "the request";
            if (got && request_id)   /* resubmitted under its id (see q.request_id) */
                snprintf(which, sizeof which, "request %llu", (unsigned long long)request_id);
            fprintf(stderr, "%stessera generate: lost the connection to the coordinator at %s "
                            "after %d token(s); resuming %s when it is back (up to %ld ms, "
                            "--token-timeout)\n",
                    got ? "\n" : "", cli->endpoint, got, which, token_timeout);
        } else if (now >= resume_until) {
            fprintf(stderr, "%stessera generate: the coordinator at %s did not take the request "
                            "back within %ld ms (--token-timeout) after %d token(s); giving up\n",
                    got ? "\n" : "", cli->endpoint, token_timeout, got);
            goto out;
        }
        struct timespec pause = {0, 200 * 1000000L};
        nanosleep(&pause, NULL);
    }
out:
    tsr_env_free(&reply);
    if (s) tsr_sock_monitor_close(s, &mon);
    tsr_sock_close(&s);
    free(in);
    free(prompt);
    return rc;
}
