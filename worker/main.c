/* tessera-worker: owns one device, registers with the coordinator, holds
 * the piece it is given.  Signal handlers only set a flag. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>
#include <zmq.h>

#include "common/deploy.h"
#include "common/log.h"
#include "common/modelfile.h"
#include "worker/engine.h"
#include "worker/agent.h"
#include "worker/cpu_pool.h"
#include "worker/rates.h"

static volatile sig_atomic_t stop_flag;
static void on_signal(int sig) { (void)sig; stop_flag = 1; }

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tessera-worker [options]\n"
            "\n"
            "Owns one device, registers with the coordinator, heartbeats and serves the\n"
            "piece of a deployment it is assigned.  Keeps its piece if the coordinator goes\n"
            "away and re-attaches with it when the coordinator comes back.\n"
            "\n"
            "options:\n"
            "  -c, --coordinator EP   coordinator workers endpoint\n"
            "                         (default tcp://127.0.0.1:7400, or $TESSERA_COORDINATOR_WORKERS)\n"
            "  -d, --device KIND      cpu | cuda (default cpu)\n"
            "  -i, --device-index N   device index (default 0)\n"
            "  -n, --name NAME        worker name, unique in the cluster\n"
            "                         (default HOSTNAME-KINDINDEX, e.g. gpu01-cuda3)\n"
            "      --node NODE        node name used to keep tensor-parallel groups on one\n"
            "                         machine (default $TESSERA_NODE, else the host name)\n"
            "      --memory-mib MIB   override the device memory it reports\n"
            "      --mem-gbs X        the device's memory bandwidth in GB/s and\n"
            "      --gflops X         its matrix-product rate in GFLOP/s, for the planner's\n"
            "                         estimates (parallel: auto); default $TESSERA_MEM_GBS and\n"
            "                         $TESSERA_GFLOPS; else a cpu worker measures them at\n"
            "                         start with its threads (128 MiB read, a batch of f32\n"
            "                         products: about 0.1 s), a cuda worker leaves them to\n"
            "                         the planner's figures for the kind (tessera plan --help)\n"
            "      --data-address ADDR  address its peers use to reach its data port\n"
            "                         (default $TESSERA_DATA_ADDRESS, else 127.0.0.1 when\n"
            "                         the coordinator is on loopback, else the host name)\n"
            "      --data-bind ADDR   address the data port listens on (default\n"
            "                         $TESSERA_DATA_BIND, else the data address; 0.0.0.0\n"
            "                         listens on every interface)\n"
            "      --keys DIR         key store with this worker's key pair (IDENTITY.key)\n"
            "                         and the coordinator's public key (coordinator.pub)\n"
            "                         (default $TESSERA_KEYS, else /etc/tessera/keys)\n"
            "      --identity NAME    the name of its key (default $TESSERA_IDENTITY, else\n"
            "                         the worker name).  Without --keys, --identity and the\n"
            "                         environment, a worker whose key is not in the default\n"
            "                         store connects without CURVE (coordinator.security:\n"
            "                         none)\n"
            "      --allow-model-links-outside  follow links in a model directory that\n"
            "                         lead out of it (a Hugging Face cache snapshot's); by\n"
            "                         default such a file is refused\n"
#ifdef TSR_TESTING
            "      --protocol-version N  claim another protocol version (test builds only)\n"
#endif
            "  -v, --verbose          debug logging\n"
            "  -h, --help             this text\n"
            "\n"
            "environment: TESSERA_COORDINATOR_WORKERS, TESSERA_NODE, TESSERA_DATA_ADDRESS,\n"
            "TESSERA_DATA_BIND, TESSERA_MEM_GBS, TESSERA_GFLOPS, TESSERA_KEYS and\n"
            "TESSERA_IDENTITY as above (empty: unset);\n"
            "under systemd, files in $CREDENTIALS_DIRECTORY (LoadCredential=) named\n"
            "IDENTITY.key and coordinator.pub take precedence over the key store's.\n"
            "TSR_THREADS caps the CPU engine's threads (default: every CPU the worker may\n"
            "run on).\n"
#ifdef TSR_TESTING
            "This is a test build: TSR_TEST_FAKE_CUDA_MIB makes --device cuda a stand-in\n"
            "GPU of that many MiB, for tests on machines without one (with\n"
            "TSR_TEST_FAKE_CUDA_BUS its PCI bus id, TSR_TEST_FAKE_CUDA_NVLINK its NVLink\n"
            "peers' bus ids, comma-separated); TSR_TEST_NCCL_SOLO=1 forms NCCL groups of\n"
            "one; TSR_TEST_DEVICE_FAULT_AFTER=N, for tests of the exit path: the CPU engine\n"
            "fails as a GPU does on a fatal error from its Nth step on; the CUDA engine\n"
            "writes to an invalid address at its Nth step that carries tokens, a real\n"
            "sticky error; TSR_TEST_LOAD_HOLD_MS=N makes every load of a piece's\n"
            "weights take N ms more (at most 60000), as a large model's would.  A release\n"
            "build (make) ignores these.\n"
#endif
            "\n"
            "%s"
            "\n"
            "exit status: 0 stopped by a signal, 1 could not start, 2 refused by the\n"
            "coordinator (wrong protocol version or duplicate name; do not restart), 75\n"
            "a fatal device error (an illegal address, ECC) or a stuck data plane (the\n"
            "thread that runs the piece did not let go of an epoch within the\n"
            "deployment's collective_timeout_ms): restart it.\n",
#ifdef TSR_HAVE_CUDA
            "This worker was built with CUDA: --device cuda pieces run on the GPU\n"
            "(TSR_CUDA_GRAPHS=0 turns off decode graphs; TSR_CUDA_GEMV=0 multiplies small\n"
            "batches with cuBLAS too"
#ifdef TSR_TESTING
            "; TSR_CUDA_DUMMY_WEIGHTS=SEED fills weights from a\n"
            "seed instead of reading them, for benchmarks only"
#endif
            ").\n"
#else
            "This worker was built without CUDA: it runs cpu pieces only.\n"
#endif
            );
}

static int parse_uint(const char *opt, const char *s, unsigned long max, unsigned long *out)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || *end || !*s || s[0] == '-' || v > max) {
        fprintf(stderr, "tessera-worker: %s: expected an integer 0..%lu, got '%s'\n", opt, max, s);
        return -1;
    }
    *out = v;
    return 0;
}

/* A device rate: a number above 0, at most 10^9. */
static int parse_rate(const char *what, const char *s, double *out)
{
    char *end;
    double v = strtod(s, &end);
    if (*end || !*s || !(v > 0) || v > 1e9) {
        size_t n = strcspn(s, "\r\n");
        fprintf(stderr, "tessera-worker: %s: expected a number above 0 and at most 1e9, got "
                "'%.*s'\n", what, (int)(n > 40 ? 40 : n), s);
        return -1;
    }
    *out = v;
    return 0;
}

/* getenv, with an empty value taken as unset. */
static const char *env_or_null(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

int main(int argc, char **argv)
{
    const char *ep = getenv("TESSERA_COORDINATOR_WORKERS");
    /* first: a log line to a closed pipe (a stopped `tessera local`, a log reader gone)
     * must not end the process before it reaches its own handlers */
    signal(SIGPIPE, SIG_IGN);
    /* What a machine's workers share, from the environment (the unit's EnvironmentFile);
     * a flag wins.  "" counts as unset. */
    const char *name = NULL, *node = env_or_null("TESSERA_NODE"),
               *data_addr = env_or_null("TESSERA_DATA_ADDRESS"),
               *data_bind = env_or_null("TESSERA_DATA_BIND");
    const char *keys = getenv("TESSERA_KEYS"), *identity = getenv("TESSERA_IDENTITY");
    const char *mem_gbs = env_or_null("TESSERA_MEM_GBS"), *gflops = env_or_null("TESSERA_GFLOPS");
    tsr_device_t kind = TSR_DEVICE_CPU;
    unsigned long index = 0, mem_mib = 0, proto = TSR_PROTOCOL_VERSION;
    int level = TSR_LOG_INFO;
    static const struct option opts[] = {
        {"coordinator", required_argument, 0, 'c'}, {"device", required_argument, 0, 'd'},
        {"device-index", required_argument, 0, 'i'}, {"name", required_argument, 0, 'n'},
        {"node", required_argument, 0, 'N'},         {"memory-mib", required_argument, 0, 'm'},
#ifdef TSR_TESTING
        {"protocol-version", required_argument, 0, 'P'},
#endif
        {"verbose", no_argument, 0, 'v'},
        {"data-address", required_argument, 0, 'A'}, {"data-bind", required_argument, 0, 'B'},
        {"keys", required_argument, 0, 'K'},         {"identity", required_argument, 0, 'I'},
        {"allow-model-links-outside", no_argument, 0, 'L'},
        {"mem-gbs", required_argument, 0, 'G'},      {"gflops", required_argument, 0, 'F'},
        {"help", no_argument, 0, 'h'},               {0, 0, 0, 0}};
    int o;
    while ((o = getopt_long(argc, argv, "c:d:i:n:vh", opts, NULL)) != -1) {
        switch (o) {
        case 'c': ep = optarg; break;
        case 'd':
            if (tsr_device_parse(optarg, &kind) < 0) {
                fprintf(stderr, "tessera-worker: --device: expected cpu or cuda, got '%s'\n", optarg);
                return 1;
            }
            break;
        case 'i': if (parse_uint("--device-index", optarg, 1023, &index) < 0) return 1; break;
        case 'n': name = optarg; break;
        case 'N': node = optarg; break;
        case 'm': if (parse_uint("--memory-mib", optarg, 1ul << 40, &mem_mib) < 0) return 1; break;
#ifdef TSR_TESTING
        case 'P': if (parse_uint("--protocol-version", optarg, 1000000, &proto) < 0) return 1; break;
#endif
        case 'A': data_addr = optarg; break;
        case 'B': data_bind = optarg; break;
        case 'K': keys = optarg; break;
        case 'I': identity = optarg; break;
        case 'L': tsr_model_links_outside(true); break;
        case 'G': mem_gbs = optarg; break;
        case 'F': gflops = optarg; break;
        case 'v': level = TSR_LOG_DEBUG; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 1;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "tessera-worker: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 1;
    }
    double bw = 0, fl = 0;
    if ((mem_gbs && parse_rate(mem_gbs == getenv("TESSERA_MEM_GBS") ? "TESSERA_MEM_GBS" : "--mem-gbs",
                               mem_gbs, &bw) < 0) ||
        (gflops && parse_rate(gflops == getenv("TESSERA_GFLOPS") ? "TESSERA_GFLOPS" : "--gflops",
                              gflops, &fl) < 0))
        return 1;
    if (!ep) ep = "tcp://127.0.0.1:7400";
    char why[320];
    if (!tsr_endpoint_check(ep, why, sizeof why)) {
        fprintf(stderr, "tessera-worker: --coordinator '%s': %s\n", ep, why);
        return 1;
    }

    char host[TSR_NAME_MAX + 1] = "localhost", defname[TSR_NAME_MAX + 1];
    gethostname(host, sizeof host - 1);
    if (!node) node = host;
    if (!name) {
        snprintf(defname, sizeof defname, "%s-%s%lu", host, tsr_device_name(kind), index);
        name = defname;
    }
    if (!tsr_name_ok(name) || !tsr_name_ok(node)) {
        bool bad_name = !tsr_name_ok(name);
        const char *what = bad_name ? "--name" : getenv("TESSERA_NODE") == node ? "TESSERA_NODE"
                                                                               : "--node";
        /* %.*s and no raw control characters: the value may be anything */
        const char *v = bad_name ? name : node;
        size_t n = strcspn(v, "\r\n");
        fprintf(stderr, "tessera-worker: %s '%.*s%s' must be 1 to %d of A-Z a-z 0-9 . _ - : @\n",
                what, (int)(n > 64 ? 64 : n), v, n > 64 || v[n] ? "..." : "", TSR_NAME_MAX);
        return 1;
    }

    char logname[TSR_NAME_MAX + 16];
    snprintf(logname, sizeof logname, "worker %s", name);
    tsr_log_init(logname, level);

    char err[512];
    tsr_security_t sec;
    if (tsr_security_client(keys, identity, name, &sec, err, sizeof err) < 0) {
        tsr_error("cannot read this worker's keys: %s", err);
        return 1;
    }
    if (!sec.curve)
        tsr_info("no key for %s in %s: connecting without CURVE (the coordinator must have "
                 "security: none)", name, TSR_KEYS_DEFAULT_DIR);
    tsr_device_info_t dev;
    if (tsr_device_probe(kind, (unsigned)index, &dev, err, sizeof err) < 0) {
        tsr_error("%s", err);
        return 1;
    }
    if (mem_mib) dev.memory = (uint64_t)mem_mib << 20;
    /* not given: a CPU worker measures them with its engine's threads */
    if ((!bw || !fl) && kind == TSR_DEVICE_CPU) {
        int threads;
        double given_bw = bw, given_fl = fl;
        tsr_measure_rates(&bw, &fl, &threads);
        if ((!given_bw && bw > 0) || (!given_fl && fl > 0))
            tsr_info("measured with %d thread(s), for the planner's estimates: %s %.1f GB/s "
                     "memory read, %s %.1f GFLOP/s f32 products (--mem-gbs, --gflops give them)",
                     threads, given_bw ? "given" : "measured", bw, given_fl ? "given" : "measured", fl);
    }
    dev.mem_gbs = bw;
    dev.gflops = fl;
    if (kind == TSR_DEVICE_CPU) dev.cpu_threads = (unsigned)tsr_pool_default_threads();
    /* Whether this worker's GPU groups can use NCCL: the coordinator tells
     * every rank of a group, so they all choose alike. */
    tsr_backend_t be;
    char nccl_why[256] = "";
    if (kind == TSR_DEVICE_CUDA && tsr_backend_for(kind, &be, err, sizeof err) == 0 && be.nccl) {
        dev.nccl = be.nccl(nccl_why, sizeof nccl_why) != NULL;
        if (!dev.nccl)
            tsr_warn("NCCL is not available (%s): this worker's groups will use the host-staged "
                     "collectives", nccl_why);
    }

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    tsr_agent_t *a = tsr_agent_new(name, node, ep, &sec, &dev, err, sizeof err);
    memset(&sec, 0, sizeof sec);  /* the socket has its copy of the secret */
    if (!a) {
        tsr_error("%s", err);
        return 1;
    }
    a->protocol_version = (uint32_t)proto;
    if (!data_addr)
        data_addr = tsr_endpoint_is_local(ep) ? "127.0.0.1" : host;
    /* Only the address peers use: a data port on every interface is more
     * to defend, and asking for that is the operator's choice. */
    if (!data_bind) data_bind = data_addr;
    a->ex = tsr_executor_new(data_bind, data_addr, err, sizeof err);
    if (!a->ex) {
        tsr_error("data plane: %s", err);
        tsr_agent_destroy(&a);
        return 1;
    }
    tsr_executor_set_device(a->ex, (int)index);
    tsr_info("starting: %s, %.1f GiB, node %s, coordinator %s, data %s, pid %d",
             dev.description, (double)dev.memory / (1u << 30), node, ep,
             tsr_executor_endpoint(a->ex), (int)getpid());

    uint64_t wd_usec = 0;
    int watchdog = sd_watchdog_enabled(0, &wd_usec) > 0;
    int64_t wd_every = watchdog ? (int64_t)(wd_usec / 2000) : 0, wd_next = 0;
    sd_notify(0, "READY=1");

    zmq_pollitem_t items[2] = {{a->sock, 0, ZMQ_POLLIN, 0},
                               {NULL, tsr_executor_event_fd(a->ex), ZMQ_POLLIN, 0}};
    int timeout = 0;
    int64_t lost_at = 0;
    while (!stop_flag && !a->stop) {
        if (zmq_poll(items, 2, timeout) < 0 && errno != EINTR) {
            tsr_error("poll failed: %s", zmq_strerror(errno));
            break;
        }
        int64_t now = tsr_now_ms();
        timeout = tsr_agent_step(a, now);
        /* A fatal device error or a stuck data-plane thread: give the
         * agent a moment to send the piece's failure, then exit so that
         * systemd restarts the worker. */
        if (!lost_at && tsr_executor_device_lost(a->ex)) {
            tsr_error("the worker cannot go on (a fatal device error or a stuck data plane): "
                      "exiting so that it is restarted");
            lost_at = now;
        }
        if (lost_at && now - lost_at >= 300) {
            a->exit_code = 75;
            break;
        }
        if (lost_at) timeout = timeout < 50 ? timeout : 50;
        if (watchdog && now >= wd_next) {
            sd_notify(0, "WATCHDOG=1");
            wd_next = now + wd_every;
        }
    }
    int rc = a->exit_code;
    tsr_info("stopping%s", rc == 75   ? " (a fatal device error or a stuck data plane)"
                           : rc ? " (refused by the coordinator)"
                                : "");
    sd_notify(0, "STOPPING=1");
    tsr_executor_destroy(&a->ex);
    tsr_agent_destroy(&a);
    tsr_zmq_term();
    return rc;
}
