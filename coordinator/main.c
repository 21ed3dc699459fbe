/* tessera-coordinator: reads the deployment file, places the pieces on the
 * workers that register, watches their health and moves pieces as needed.
 * Signal handlers only set flags; the loop below does the work. */
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <systemd/sd-daemon.h>
#include <zmq.h>

#include "common/log.h"
#include "common/modelfile.h"
#include "common/wire.h"
#include "apikeys.h"
#include "deptok.h"
#include "loop.h"
#include "reload.h"
#include "http.h"

/* How long a turn of the loop may take before the next one judges no one (see the loop). */
#define LOOP_LATE_MS 200

static volatile sig_atomic_t stop_flag, reload_flag;

static void on_signal(int sig)
{
    if (sig == SIGHUP) reload_flag = 1;
    else stop_flag = 1;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tessera-coordinator [options] DEPLOYMENT.yaml\n"
            "\n"
            "Reads the deployment file, binds its workers and control endpoints, places\n"
            "each deployment's pieces on registered workers, watches their heartbeats and\n"
            "moves pieces when a worker dies.  SIGHUP rereads the file; SIGTERM or SIGINT\n"
            "stops cleanly.  Under systemd (Type=notify) it reports READY=1 and pets the\n"
            "watchdog from its main loop.\n"
            "\n"
            "options:\n"
            "  --adopt-grace-ms MS   wait this long after start before planning, so\n"
            "                        workers of a previous coordinator can re-attach with\n"
            "                        their pieces (default: coordinator.worker_timeout_ms)\n"
            "  --allow-model-links-outside\n"
            "                        follow links in a model directory that lead out of\n"
            "                        it (a Hugging Face cache snapshot's); by default\n"
            "                        such a file is refused\n"
            "  --check               validate the file (and each model's config.json)\n"
            "                        and exit: 0 when valid\n"
            "  -v, --verbose         debug logging (or TESSERA_LOG_LEVEL=debug)\n"
            "  -h, --help            this text\n");
}

int main(int argc, char **argv)
{
    int grace = -1, check = 0, level = TSR_LOG_INFO;
    /* first: a log line to a closed pipe (a stopped `tessera local`, a log reader gone)
     * must not end the process before it reaches its own handlers */
    signal(SIGPIPE, SIG_IGN);
    static const struct option opts[] = {{"adopt-grace-ms", required_argument, 0, 'g'},
                                         {"check", no_argument, 0, 'c'},
                                         {"allow-model-links-outside", no_argument, 0, 'L'},
                                         {"verbose", no_argument, 0, 'v'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int o;
    while ((o = getopt_long(argc, argv, "vh", opts, NULL)) != -1) {
        switch (o) {
        case 'g': {
            char *end;
            long v = strtol(optarg, &end, 10);
            if (*end || v < 0 || v > 3600000) {
                fprintf(stderr, "tessera-coordinator: --adopt-grace-ms: expected 0..3600000, got '%s'\n", optarg);
                return 2;
            }
            grace = (int)v;
            break;
        }
        case 'c': check = 1; break;
        case 'L': tsr_model_links_outside(true); break;
        case 'v': level = TSR_LOG_DEBUG; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc - 1) {
        usage(stderr);
        return 2;
    }
    const char *path = argv[optind];
    tsr_log_init("coordinator", level);

    char err[1024];
    if (check) {
        tsr_config_t *cfg = NULL;
        if (tsr_config_load(path, &cfg, err, sizeof err) < 0) {
            fprintf(stderr, "%s\n", err);
            return 1;
        }
        int bad = 0;
        for (size_t i = 0; i < cfg->n_deployments; i++) {
            tsr_model_info_t m;
            const tsr_deployment_t *d = &cfg->deployments[i];
            if (tsr_model_load_for(d, (int)i, path, &m, err, sizeof err) < 0) {
                fprintf(stderr, "%s\n", err);
                bad = 1;
            }
        }
        /* What a start would refuse (a missing file, one others can read). */
        char **keys = NULL;
        int nk = cfg->api_keys_file ? tsr_apikeys_read(cfg->api_keys_file, &keys, err, sizeof err) : 0;
        if (nk < 0) {
            fprintf(stderr, "%s\n", err);
            bad = 1;
        }
        tsr_apikeys_free(&keys, nk > 0 ? (size_t)nk : 0);
        tsr_security_t sec;
        if (!cfg->security_none && tsr_coord_server_keys(cfg, &sec, err, sizeof err) < 0) {
            fprintf(stderr, "%s\n", err);
            bad = 1;
        }
        if (!bad) printf("%s: valid, %zu deployment(s)\n", path, cfg->n_deployments);
        tsr_config_destroy(&cfg);
        return bad;
    }

    /* Every connection, authenticated or not yet, holds a descriptor: take
     * all the system allows, so a flood of strangers does not starve the
     * key store's rereads or the operator's own connections. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);

    tsr_coord_stop_flag(&stop_flag);
    tsr_coord_t *c = tsr_coord_new(path, grace, err, sizeof err);
    if (!c) {
        tsr_error("%s", err);
        tsr_zmq_term();
        return 1;
    }
    tsr_info("listening: workers %s, control %s; %zu deployment(s) from %s; pid %d",
             c->cfg->workers_endpoint, c->cfg->control_endpoint, c->cfg->n_deployments, path,
             (int)getpid());
    tsr_http_t *http = NULL;
    if (c->cfg->http_endpoint) {
        http = tsr_http_start(c->cfg->http_host, c->cfg->http_port, c->bridge, &c->tokreg,
                              c->cfg->api_keys_file, err, sizeof err);
        if (!http) {
            tsr_error("%s", err);
            tsr_coord_destroy(&c);
            tsr_zmq_term();
            return 1;
        }
        tsr_info("HTTP API on %s%s", c->cfg->http_endpoint,
                 c->cfg->api_keys_file ? " (API keys required on /v1/)" : "");
    }

    uint64_t wd_usec = 0;
    int watchdog = sd_watchdog_enabled(0, &wd_usec) > 0;
    int64_t wd_every = watchdog ? (int64_t)(wd_usec / 2000) : 0, wd_next = 0;
    sd_notifyf(0, "READY=1\nSTATUS=serving %zu deployment(s)\nMAINPID=%d",
               c->cfg->n_deployments, (int)getpid());

    /* The tokenizer loader's descriptor wakes the loop when a reload's new tokenizer is in. */
    zmq_pollitem_t items[6] = {{c->wsock, 0, ZMQ_POLLIN, 0}, {c->csock, 0, ZMQ_POLLIN, 0},
                               {NULL, tsr_tokload_fd(c->tokload), ZMQ_POLLIN, 0}};
    int n_items = 3;
    if (c->cmon) items[n_items++] = (zmq_pollitem_t){c->cmon, 0, ZMQ_POLLIN, 0};
    if (c->wmon) items[n_items++] = (zmq_pollitem_t){c->wmon, 0, ZMQ_POLLIN, 0};
    if (c->bsock) items[n_items++] = (zmq_pollitem_t){c->bsock, 0, ZMQ_POLLIN, 0};
    int timeout = 0;
    bool held = false;
    while (!stop_flag) {
        int rc = zmq_poll(items, n_items, timeout);
        int64_t woke = tsr_now_ms();
        if (rc < 0 && errno != EINTR) {
            tsr_error("poll failed: %s", zmq_strerror(errno));
            break;
        }
        if (rc > 0) tsr_coord_drain_sockets(c, 4096);
        if (reload_flag) {
            reload_flag = 0;
            sd_notify(0, "RELOADING=1");
            if (tsr_coord_reload(c, err, sizeof err) < 0)
                tsr_error("reload refused, keeping the current configuration: %s", err);
            sd_notify(0, "READY=1");
        }
        int64_t now = tsr_now_ms();
        /* The turn took long: the loop was busy (a reload reading model files from a slow
         * disk, an overloaded machine), and the heartbeats of that time wait in the socket.  They are
         * read (one more turn) before anyone is judged silent: a held loop is not a dead
         * worker.  (A process stopped in its poll reads them before this point.) */
        if (!held && now - woke > LOOP_LATE_MS) {
            held = true;
            timeout = 0;
            continue;
        }
        held = false;
        timeout = tsr_coord_tick(c, now);
        if (watchdog && now >= wd_next) {
            sd_notify(0, "WATCHDOG=1");
            wd_next = now + wd_every;
        }
    }
    tsr_info("shutting down (epoch %llu, %zu worker(s) alive)", (unsigned long long)c->epoch,
             tsr_registry_alive(c->reg));
    sd_notify(0, "STOPPING=1");
    tsr_http_stop(&http);  /* its threads close their sockets before the context goes */
    tsr_coord_destroy(&c);
    tsr_zmq_term();
    return 0;
}
