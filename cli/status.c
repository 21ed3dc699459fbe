/* status.c: status, workers, reload, drain and undrain. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "common/log.h"

static const char *jstr(json_t *o, const char *k)
{
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "-";
}
static long long jint(json_t *o, const char *k)
{
    return (long long)json_integer_value(json_object_get(o, k));
}

static void fmt_age(long long ms, char *buf, size_t len)
{
    if (ms < 10000) snprintf(buf, len, "%lldms", ms);
    else if (ms < 600000) snprintf(buf, len, "%llds", ms / 1000);
    else snprintf(buf, len, "%lldm", ms / 60000);
}

/* A piece's KV pool as "used/total" blocks, "used+cached/total" while its prefix
 * cache holds blocks no sequence does; "-" before it reports one. */
static void fmt_kv(json_t *o, char *buf, size_t len)
{
    long long cached = jint(o, "kv_blocks_cached");
    if (jint(o, "kv_blocks_total") <= 0)
        snprintf(buf, len, "-");
    else if (cached > 0)
        snprintf(buf, len, "%lld+%lld/%lld", jint(o, "kv_blocks_used"), cached,
                 jint(o, "kv_blocks_total"));
    else
        snprintf(buf, len, "%lld/%lld", jint(o, "kv_blocks_used"), jint(o, "kv_blocks_total"));
}

static void print_worker_row(json_t *w)
{
    char age[32];
    fmt_age(jint(w, "heartbeat_age_ms"), age, sizeof age);
    json_t *a = json_object_get(w, "assignment"), *f = json_object_get(w, "finishing");
    char piece[192] = "-";
    if (json_is_object(a))
        snprintf(piece, sizeof piece, "%s r%lld s%lld t%lld", jstr(a, "deployment"),
                 jint(a, "replica"), jint(a, "stage"), jint(a, "tp"));
    else if (json_is_object(f))  /* an old cut's piece, until its requests end */
        snprintf(piece, sizeof piece, "%s r%lld s%lld t%lld of tp %lld x pp %lld (old cut%s)",
                 jstr(f, "deployment"), jint(f, "replica"), jint(f, "stage"), jint(f, "tp"),
                 jint(f, "tp_size"), jint(f, "pp_size"),
                 json_is_true(json_object_get(f, "serving")) ? ", serving beside the new"
                 : json_is_true(json_object_get(f, "held")) ? ", held for the new cut's standbys"
                                                              : "");
    const char *state = jstr(w, "state");
    char st[48];
    snprintf(st, sizeof st, "%s%s", state, json_is_true(json_object_get(w, "drained")) ? ",drained" : "");
    char kv[48];
    fmt_kv(w, kv, sizeof kv);
    printf("  %-20s %-14s %-12s %-5s %8lld %9s %11s  %s", jstr(w, "name"), jstr(w, "node"), st,
           jstr(w, "device"), jint(w, "pid"), age, kv, piece);
    if (json_object_get(w, "reason")) printf("  (%s)", jstr(w, "reason"));
    printf("\n");
}

void tsr_print_status(json_t *doc, int workers_only)
{
    json_t *co = json_object_get(doc, "coordinator");
    json_t *workers = json_object_get(doc, "workers");
    size_t i, alive = 0, dead = 0;
    json_t *w;
    json_array_foreach(workers, i, w) {
        if (!strcmp(jstr(w, "state"), "dead")) dead++;
        else alive++;
    }
    /* Epoch 0 is no plan yet: nothing planned or adopted. */
    char epoch[48] = "no plan yet", grace[64] = "";
    if (jint(co, "epoch") > 0) snprintf(epoch, sizeof epoch, "epoch %lld", jint(co, "epoch"));
    if (jint(co, "grace_left_ms") > 0)
        snprintf(grace, sizeof grace, "  adopting workers (grace %.1f s left)",
                 (double)jint(co, "grace_left_ms") / 1000.0);
    printf("coordinator  %s%s  uptime %llds  workers %zu alive, %zu dead\n", epoch, grace,
           jint(co, "uptime_ms") / 1000, alive, dead);
    json_t *rb = json_object_get(co, "rebalance");
    if (json_is_object(rb) && strlen(jstr(rb, "doing")) > 1) printf("  rebalance: %s\n", jstr(rb, "doing"));
    if (json_is_object(rb) && strlen(jstr(rb, "last")) > 1) printf("  last rebalance: %s\n", jstr(rb, "last"));

    if (!workers_only) {
        json_t *d;
        json_array_foreach(json_object_get(doc, "deployments"), i, d) {
            printf("\ndeployment %s  %s  %s  tp %lld x pp %lld x %lld replica(s)  %s\n",
                   jstr(d, "name"), jstr(d, "state"), jstr(d, "device"), jint(d, "tensor"),
                   jint(d, "pipeline"), jint(d, "replicas"), jstr(d, "model"));
            if (strlen(jstr(d, "message")) > 1) printf("  %s\n", jstr(d, "message"));
            /* number formats other than the device's own: which the workers hold (an
             * older coordinator that does not say is taken at its word: nothing) */
            const char *own = !strcmp(jstr(d, "device"), "cuda") ? "bf16" : "f32";
            const int int8_w = !strcmp(jstr(d, "weights_dtype"), "int8");
            if (json_is_string(json_object_get(d, "kv_dtype_used")) &&
                json_is_string(json_object_get(d, "matmul_dtype_used")) &&
                (int8_w || strcmp(jstr(d, "kv_dtype_used"), own) ||
                 strcmp(jstr(d, "matmul_dtype_used"), own)))
                printf("  weights %s, KV cache %s\n",
                       int8_w ? "int8 (a scale a row, integer products)" : jstr(d, "matmul_dtype_used"),
                       jstr(d, "kv_dtype_used"));
            if (json_is_object(json_object_get(d, "parallel_auto")) &&
                json_is_true(json_object_get(d, "layout_chosen")))
                printf("  layout auto: %s\n", jstr(d, "layout_reason"));
            json_t *rs = json_object_get(d, "reshard");
            if (json_is_object(rs) && strlen(jstr(rs, "doing")) > 1)
                printf("  new layout: %s\n", jstr(rs, "doing"));
            else if (json_is_object(rs) && strlen(jstr(rs, "last")) > 1)
                printf("  last change of layout: %s\n", jstr(rs, "last"));
            json_t *as = json_object_get(d, "autoscale");
            if (json_is_object(as)) {
                json_t *qw = json_object_get(as, "queue_wait_ms");
                printf("  replicas follow load: %lld in %lld..%lld, queue wait ", jint(d, "replicas"),
                       jint(as, "min"), jint(as, "max"));
                if (json_is_number(qw)) printf("%.0f ms", json_number_value(qw));
                else printf("not measured yet");
                printf(" over %lld s (scale_up_queue_ms %lld)", jint(as, "scale_up_window_s"),
                       jint(as, "scale_up_queue_ms"));
                if (json_is_integer(json_object_get(as, "draining_replica")))
                    printf(", draining replica %lld", jint(as, "draining_replica"));
                printf("\n");
                if (strlen(jstr(as, "last")) > 1)
                    printf("  last scaled %llds ago: %s\n", jint(as, "last_ms_ago") / 1000,
                           jstr(as, "last"));
                if (strlen(jstr(as, "held_back")) > 1) printf("  held back: %s\n", jstr(as, "held_back"));
            }
            size_t wi;
            json_t *wn;
            json_array_foreach(json_object_get(d, "warnings"), wi, wn)
                printf("  warning: %s\n", json_string_value(wn));
            if (json_is_string(json_object_get(d, "tokenizer_error")))
                printf("  token ids only: its tokenizer cannot be used: %s\n",
                       jstr(d, "tokenizer_error"));
            if (json_is_true(json_object_get(d, "tokenizer_loading")))
                printf("  token ids only until its tokenizer.json is read (in progress)\n");
            printf("  %-7s %-5s %-9s %-3s %-20s %-14s %-9s %8s %9s %11s\n", "REPLICA", "STAGE",
                   "LAYERS", "TP", "WORKER", "NODE", "STATE", "PID", "HEARTBEAT", "KV");
            size_t ri, si, ti;
            json_t *r, *s, *t;
            json_array_foreach(json_object_get(d, "replica_list"), ri, r) {
                json_array_foreach(json_object_get(r, "stages"), si, s) {
                    json_t *ly = json_object_get(s, "layers");
                    char layers[32];
                    snprintf(layers, sizeof layers, "%lld-%lld",
                             (long long)json_integer_value(json_array_get(ly, 0)),
                             (long long)json_integer_value(json_array_get(ly, 1)) - 1);
                    json_array_foreach(json_object_get(s, "ranks"), ti, t) {
                        char age[32] = "-", pid[16] = "-", kv[48] = "-";
                        if (json_is_string(json_object_get(t, "worker"))) {
                            fmt_age(jint(t, "heartbeat_age_ms"), age, sizeof age);
                            snprintf(pid, sizeof pid, "%lld", jint(t, "pid"));
                            fmt_kv(t, kv, sizeof kv);
                        }
                        printf("  %-7lld %-5lld %-9s %-3lld %-20s %-14s %-9s %8s %9s %11s",
                               jint(r, "replica"), jint(s, "stage"), layers, jint(t, "tp"),
                               jstr(t, "worker"), jstr(t, "node"), jstr(t, "state"), pid, age, kv);
                        if (json_object_get(t, "reason")) printf("  %s", jstr(t, "reason"));
                        /* its group's other ranks passed their deadline waiting for it */
                        if (json_is_true(json_object_get(t, "waited_for")))
                            printf("  (its group waited for it past the deadline)");
                        printf("\n");
                    }
                }
            }
        }
    }

    const char *titles[] = {"idle workers", "workers finishing an old cut's requests", "dead workers"};
    for (int pass = 0; pass < (workers_only ? 1 : 3); pass++) {
        int header = 0;
        json_array_foreach(workers, i, w) {
            const char *st = jstr(w, "state");
            int is_dead = !strcmp(st, "dead");
            int show = workers_only ? 1
                       : pass == 0  ? !strcmp(st, "idle") && !json_is_object(json_object_get(w, "assignment"))
                       : pass == 1  ? !strcmp(st, "finishing")
                                    : is_dead;
            if (!show) continue;
            if (!header) {
                printf("\n%s\n  %-20s %-14s %-12s %-5s %8s %9s %11s  %s\n",
                       workers_only ? "workers" : titles[pass], "NAME", "NODE", "STATE",
                       "DEV", "PID", "HEARTBEAT", "KV", "PIECE");
                header = 1;
            }
            print_worker_row(w);
        }
    }
}

/* Prints a status document as JSON (just its workers when workers_only) or
 * as tables. */
static void show(json_t *doc, int as_json, int workers_only)
{
    if (as_json) {
        char *s = json_dumps(workers_only ? json_object_get(doc, "workers") : doc, JSON_INDENT(2));
        if (s) puts(s);
        free(s);
    } else {
        tsr_print_status(doc, workers_only);
    }
}

static int all_ready(json_t *doc)
{
    size_t i;
    json_t *d;
    json_array_foreach(json_object_get(doc, "deployments"), i, d)
        if (strcmp(jstr(d, "state"), "ready")) return 0;
    return 1;
}

static void status_usage(FILE *f)
{
    fprintf(f, "usage: tessera [--coordinator EP] status [--json] [--wait-ready SECONDS]\n"
               "\n"
               "Shows each deployment's replicas, stages and tensor-parallel ranks with the\n"
               "worker holding each piece (node, state, pid, heartbeat age, KV cache blocks\n"
               "of the piece's pool: used/total, or used+cached/total while its prefix cache\n"
               "holds blocks no sequence does), then the idle and dead workers.\n"
               "  --json               print the status document as JSON\n"
               "  --wait-ready SECONDS wait until every deployment is ready; exit 0 when it\n"
               "                       is, 4 when the time runs out (status is printed)\n");
}

int tsr_cmd_status(const tsr_cli_t *cli, int argc, char **argv)
{
    int as_json = 0;
    double wait_s = -1;
    static const struct option opts[] = {{"json", no_argument, 0, 'j'},
                                         {"wait-ready", required_argument, 0, 'w'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int o;
    optind = 0;  /* 0 re-initialises GNU getopt (and its argument permutation) */
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (o) {
        case 'j': as_json = 1; break;
        case 'w': {
            char *end;
            wait_s = strtod(optarg, &end);
            if (*end || wait_s < 0 || wait_s > 86400) {
                fprintf(stderr, "tessera status: --wait-ready: expected seconds (0..86400), got '%s'\n", optarg);
                return 2;
            }
            break;
        }
        case 'h': status_usage(stdout); return 0;
        default: status_usage(stderr); return 2;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "tessera status: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (as_json && wait_s < 0) {
        /* Printed as the coordinator wrote it: parsing and re-indenting a
         * large cluster's document would cost more than fetching it. */
        char *text = NULL;
        int r = tsr_cli_request_text(cli, TESSERA__CONTROL_REQUEST__KIND__STATUS, NULL, &text);
        if (r == 0) puts(text);
        free(text);
        return r;
    }
    int64_t deadline = tsr_now_ms() + (int64_t)(wait_s * 1000);
    json_t *doc = NULL;
    int rc;
    for (;;) {
        tsr_cli_t c = *cli;
        if (wait_s >= 0) {
            /* Keep asking while the coordinator is starting up. */
            int64_t left = deadline - tsr_now_ms();
            if (left < c.timeout_ms) c.timeout_ms = left > 200 ? (int)left : 200;
        }
        rc = tsr_cli_request(&c, TESSERA__CONTROL_REQUEST__KIND__STATUS, NULL, &doc);
        if (wait_s < 0) break;
        if (rc == 0 && all_ready(doc)) break;
        if (tsr_now_ms() >= deadline) {
            if (rc == 0) {
                show(doc, as_json, 0);
                fprintf(stderr, "tessera status: not every deployment is ready after %g s\n", wait_s);
                json_decref(doc);
                return 4;
            }
            return rc;
        }
        json_decref(doc);
        doc = NULL;
        usleep(50 * 1000);
    }
    if (rc) return rc;
    show(doc, as_json, 0);
    json_decref(doc);
    return 0;
}

/* Checks a command's words: --help prints usage (returns 0 via *done); any
 * option not in `allowed` (space-separated, may be NULL) or a count of plain
 * words other than `words` is bad usage, named on stderr. */
static int check_args(const char *cmd, int argc, char **argv, int words, const char *allowed,
                      const char *usage, int *done)
{
    int plain = 0;
    *done = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(usage, stdout);
            *done = 1;
            return 0;
        }
        if (argv[i][0] == '-') {
            char key[64];
            snprintf(key, sizeof key, " %s ", argv[i]);
            char list[128];
            snprintf(list, sizeof list, " %s ", allowed ? allowed : "");
            if (!strstr(list, key)) {
                fprintf(stderr, "tessera %s: unknown option '%s'\n%s", cmd, argv[i], usage);
                return 2;
            }
            continue;
        }
        if (++plain > words) {
            fprintf(stderr, "tessera %s: unexpected argument '%s'\n%s", cmd, argv[i], usage);
            return 2;
        }
    }
    if (plain < words) {
        fprintf(stderr, "tessera %s: missing argument\n%s", cmd, usage);
        return 2;
    }
    return 0;
}

int tsr_cmd_workers(const tsr_cli_t *cli, int argc, char **argv)
{
    int done, as_json = argc > 1 && !strcmp(argv[1], "--json");
    int bad = check_args("workers", argc, argv, 0, "--json",
                         "usage: tessera [--coordinator EP] workers [--json]\n"
                         "\nLists every registered worker: name, node, state, device, pid, "
                         "heartbeat age\nand the piece it holds.\n",
                         &done);
    if (bad || done) return bad;
    json_t *doc = NULL;
    int rc = tsr_cli_request(cli, TESSERA__CONTROL_REQUEST__KIND__WORKERS, NULL, &doc);
    if (rc) return rc;
    show(doc, as_json, 1);
    json_decref(doc);
    return 0;
}

int tsr_cmd_reload(const tsr_cli_t *cli, int argc, char **argv)
{
    int done;
    int bad = check_args("reload", argc, argv, 0, NULL,
                         "usage: tessera [--coordinator EP] reload\n"
                         "\nAsks the coordinator to reread its deployment file and apply the "
                         "new plan.\nA file with errors is refused and the running "
                         "configuration is kept.  The answer\nmay take up to 60 s (or "
                         "--timeout, if longer): the coordinator reads every new\n"
                         "deployment's model files first.\n",
                         &done);
    if (bad || done) return bad;
    json_t *doc = NULL;
    int rc = tsr_cli_request(cli, TESSERA__CONTROL_REQUEST__KIND__RELOAD, NULL, &doc);
    if (rc == 3) fprintf(stderr, "tessera: %s\n", TSR_CLI_RELOAD_REFUSED);
    if (rc) return rc;
    printf("reloaded: %lld deployment(s), epoch %lld\n", jint(doc, "deployments"), jint(doc, "epoch"));
    size_t i;
    json_t *l;
    json_array_foreach(json_object_get(doc, "layouts"), i, l)
        printf("  %s: %s\n", jstr(l, "deployment"), jstr(l, "layout"));
    json_decref(doc);
    return 0;
}

int tsr_cmd_drain(const tsr_cli_t *cli, int argc, char **argv, int drain)
{
    int done;
    int bad = check_args(drain ? "drain" : "undrain", argc, argv, 1, NULL,
                         drain ? "usage: tessera [--coordinator EP] drain WORKER\n"
                                 "\nMoves the worker's piece to an idle worker (or leaves the "
                                 "deployment\ndegraded when there is none), then keeps the "
                                 "worker idle and out of\nplacement until `tessera undrain "
                                 "WORKER`.\n"
                               : "usage: tessera [--coordinator EP] undrain WORKER\n"
                                 "\nMakes a drained worker available for placement again.\n",
                         &done);
    if (bad || done) return bad;
    json_t *doc = NULL;
    int rc = tsr_cli_request(cli, drain ? TESSERA__CONTROL_REQUEST__KIND__DRAIN
                                        : TESSERA__CONTROL_REQUEST__KIND__UNDRAIN,
                             argv[1], &doc);
    if (rc) return rc;
    if (!drain) {
        printf("%s is available for placement again\n", argv[1]);
    } else {
        json_t *p = json_object_get(doc, "piece");
        if (!json_is_object(p))
            printf("%s drained (it held no piece)\n", argv[1]);
        else if (json_object_get(doc, "moved_to"))
            printf("%s drained: %s r%lld s%lld t%lld moved to %s\n", argv[1], jstr(p, "deployment"),
                   jint(p, "replica"), jint(p, "stage"), jint(p, "tp"), jstr(doc, "moved_to"));
        else
            printf("%s drained: %s r%lld s%lld t%lld has no idle worker to go to; the deployment "
                   "is degraded until one registers\n",
                   argv[1], jstr(p, "deployment"), jint(p, "replica"), jint(p, "stage"), jint(p, "tp"));
    }
    json_decref(doc);
    return 0;
}
