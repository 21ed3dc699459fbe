/* local.c: `tessera local FILE.yaml --workers N`: a coordinator and N CPU
 * workers as child processes on this machine, in the foreground. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "common/keys.h"
#include "common/deploy.h"
#include "common/log.h"

#define MAX_CHILDREN 256

typedef struct {
    char name[64];
    pid_t pid;
} child_t;

static volatile sig_atomic_t local_stop;
static void on_stop(int sig) { (void)sig; local_stop = 1; }

static void local_usage(FILE *f)
{
    fprintf(f,
            "usage: tessera local FILE.yaml [--workers N] [--nodes K] [--log-dir DIR]\n"
            "\n"
            "Runs a coordinator for FILE.yaml and N CPU workers on this machine, in the\n"
            "foreground.  A worker that dies is reported and the rest keep running; if the\n"
            "coordinator dies, everything stops and the exit status is 1.  SIGINT or\n"
            "SIGTERM stops them all (exit status 0); killed any other way, it takes them\n"
            "with it (each gets SIGTERM).\n"
            "  --workers N    CPU workers to start (default 1)\n"
            "  --nodes K      spread the workers over K simulated node names (default 1)\n"
            "  --log-dir DIR  write each child's log to DIR/NAME.log instead of stderr\n"
            "                 (DIR is created if missing)\n"
            "\n"
            "With coordinator.security: curve (the default), the file's keys_dir is the\n"
            "key store: it is created when it does not exist (a throw-away store for\n"
            "this machine), and a key is added for each worker it starts (local-0,\n"
            "local-1, ...) and for the CLI (cli) when missing.  The CLI finds them with\n"
            "`tessera --config FILE.yaml ...` or --keys DIR.\n");
}

static int bin_dir(char *buf, size_t len)
{
    ssize_t n = readlink("/proc/self/exe", buf, len - 1);
    if (n <= 0) return -1;
    buf[n] = '\0';
    char *slash = strrchr(buf, '/');
    if (!slash) return -1;
    *slash = '\0';
    return 0;
}

/* The key store of a local cluster: created when missing, with a key for
 * every worker (local-I) and for the CLI. */
static int ensure_keys(const char *dir, int workers)
{
    char err[1024], p[PATH_MAX + 64];
    snprintf(p, sizeof p, "%s/coordinator.key", dir);
    if (access(p, F_OK) != 0 && tsr_keys_init(dir, err, sizeof err) < 0) {
        fprintf(stderr, "tessera local: cannot create the key store: %s\n", err);
        return -1;
    }
    for (int i = -1; i < workers; i++) {
        char name[64];
        if (i < 0) snprintf(name, sizeof name, "cli");
        else snprintf(name, sizeof name, "local-%d", i);
        snprintf(p, sizeof p, "%s/%s.key", dir, name);
        if (access(p, F_OK) == 0) continue;
        if (tsr_keys_add(dir, name, err, sizeof err) < 0) {
            fprintf(stderr, "tessera local: cannot add a key for %s: %s\n", name, err);
            return -1;
        }
    }
    return 0;
}

/* What a worker would take from the environment that belongs to the caller,
 * not to a worker of this cluster: the caller's own key name (a CLI user's
 * TESSERA_IDENTITY=cli would make every worker present the CLI's key and be
 * refused), key store and data addresses.  The cluster gives each worker
 * its own (its key is named after it: the worker's default identity). */
static const char *const caller_only_env[] = {"TESSERA_IDENTITY", "TESSERA_KEYS",
                                             "TESSERA_DATA_ADDRESS", "TESSERA_DATA_BIND",
                                             "TESSERA_NODE"};

/* worker: clear caller_only_env in the child before it runs argv. */
static pid_t spawn(char *const argv[], const char *log_dir, const char *name, bool worker)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid != 0) return pid;
    /* The children go with this process whatever ends it (kill -9, a closed terminal):
     * a coordinator left behind would keep its ports and serve a cluster nobody runs. */
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) < 0 || getppid() != parent) _exit(127);
    if (log_dir) {
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/%s.log", log_dir, name);
        int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (fd < 0) {
            fprintf(stderr, "tessera local: cannot write %s: %s\n", path, strerror(errno));
            _exit(127);
        }
        dup2(fd, 2);
        dup2(fd, 1);
        close(fd);
    }
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    for (size_t i = 0; worker && i < sizeof caller_only_env / sizeof *caller_only_env; i++)
        unsetenv(caller_only_env[i]);
    execv(argv[0], argv);
    fprintf(stderr, "tessera local: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

static void describe(int status, char *buf, size_t len)
{
    if (WIFEXITED(status)) snprintf(buf, len, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status)) snprintf(buf, len, "was killed by signal %d (%s)",
                                           WTERMSIG(status), strsignal(WTERMSIG(status)));
    else snprintf(buf, len, "stopped");
}

int tsr_cmd_local(int argc, char **argv)
{
    int workers = 1, nodes = 1;
    const char *log_dir = NULL;
    static const struct option opts[] = {{"workers", required_argument, 0, 'w'},
                                         {"nodes", required_argument, 0, 'n'},
                                         {"log-dir", required_argument, 0, 'l'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int o;
    optind = 0;  /* 0 re-initialises GNU getopt (and its argument permutation) */
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        char *end;
        long v;
        switch (o) {
        case 'w':
        case 'n':
            v = strtol(optarg, &end, 10);
            if (*end || v < (o == 'w' ? 0 : 1) || v > MAX_CHILDREN - 1) {
                fprintf(stderr, "tessera local: --%s: expected %d..%d, got '%s'\n",
                        o == 'w' ? "workers" : "nodes", o == 'w' ? 0 : 1, MAX_CHILDREN - 1, optarg);
                return 2;
            }
            if (o == 'w') workers = (int)v;
            else nodes = (int)v;
            break;
        case 'l': log_dir = optarg; break;
        case 'h': local_usage(stdout); return 0;
        default: local_usage(stderr); return 2;
        }
    }
    if (optind != argc - 1) {
        local_usage(stderr);
        return 2;
    }
    const char *path = argv[optind];
    char err[1024], dir[PATH_MAX], coord_bin[PATH_MAX + 32], worker_bin[PATH_MAX + 32];
    struct stat ld;
    if (log_dir && mkdir(log_dir, 0755) < 0 && errno != EEXIST) {
        fprintf(stderr, "tessera local: --log-dir %s: %s\n", log_dir, strerror(errno));
        return 1;
    }
    if (log_dir && (stat(log_dir, &ld) < 0 || !S_ISDIR(ld.st_mode) || access(log_dir, W_OK) < 0)) {
        fprintf(stderr, "tessera local: --log-dir %s: not a directory this user can write to\n",
                log_dir);
        return 1;
    }
    /* A closed standard error (a pipe whose reader went) fails a write; it does not end
     * this process, which still has children to stop. */
    signal(SIGPIPE, SIG_IGN);
    tsr_config_t *cfg = NULL;
    if (tsr_config_load(path, &cfg, err, sizeof err) < 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    char wep[512], cep[512], keys[PATH_MAX];
    tsr_connect_endpoint(cfg->workers_endpoint, wep, sizeof wep);
    tsr_connect_endpoint(cfg->control_endpoint, cep, sizeof cep);
    int curve = !cfg->security_none;
    snprintf(keys, sizeof keys, "%s", cfg->keys_dir);
    tsr_config_destroy(&cfg);
    if (curve && ensure_keys(keys, workers) < 0) return 1;
    if (bin_dir(dir, sizeof dir) < 0) {
        fprintf(stderr, "tessera local: cannot find my own binary directory\n");
        return 1;
    }
    snprintf(coord_bin, sizeof coord_bin, "%s/tessera-coordinator", dir);
    snprintf(worker_bin, sizeof worker_bin, "%s/tessera-worker", dir);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    child_t kids[MAX_CHILDREN];
    int nk = 0;
    /* Everything starts together, so there are no earlier workers to wait
     * for: a short grace lets the first registrations arrive before planning. */
    char *cargv[] = {coord_bin, "--adopt-grace-ms", "300", (char *)path, NULL};
    snprintf(kids[nk].name, sizeof kids[nk].name, "coordinator");
    kids[nk].pid = spawn(cargv, log_dir, "coordinator", false);
    nk++;
    for (int i = 0; i < workers; i++) {
        char name[64], node[64];
        snprintf(name, sizeof name, "local-%d", i);
        snprintf(node, sizeof node, "local-node%d", nodes > 1 ? i % nodes : 0);
        char *wargv[] = {worker_bin, "--coordinator", wep, "--name", name, "--node", node,
                         curve ? "--keys" : NULL, keys, NULL};
        snprintf(kids[nk].name, sizeof kids[nk].name, "worker %s", name);
        kids[nk].pid = spawn(wargv, log_dir, name, true);
        nk++;
    }
    fprintf(stderr,
            "tessera local: coordinator (pid %d) and %d worker(s) started; control endpoint %s\n"
            "tessera local: try `tessera --config %s status`; Ctrl-C stops everything\n",
            (int)kids[0].pid, workers, cep, path);

    int alive = nk, rc = 0;
    while (!local_stop && alive > 0) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid > 0) {
            for (int i = 0; i < nk; i++) {
                if (kids[i].pid != pid) continue;
                char how[128];
                describe(status, how, sizeof how);
                kids[i].pid = 0;
                alive--;
                if (i == 0) {
                    /* Workers without a coordinator serve nobody. */
                    fprintf(stderr, "tessera local: the coordinator (pid %d) %s; stopping the "
                                    "workers (see its log)\n", (int)pid, how);
                    local_stop = 1;
                    rc = 1;
                } else {
                    fprintf(stderr, "tessera local: %s (pid %d) %s; the others keep running\n",
                            kids[i].name, (int)pid, how);
                }
            }
            continue;
        }
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }

    fprintf(stderr, "tessera local: stopping %d process(es)\n", alive);
    for (int i = nk - 1; i >= 0; i--)
        if (kids[i].pid > 0) kill(kids[i].pid, SIGTERM);
    int64_t deadline = tsr_now_ms() + 5000;
    while (alive > 0 && tsr_now_ms() < deadline) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid > 0) {
            for (int i = 0; i < nk; i++)
                if (kids[i].pid == pid) {
                    kids[i].pid = 0;
                    alive--;
                }
            continue;
        }
        if (pid < 0) break;
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    for (int i = 0; i < nk; i++)
        if (kids[i].pid > 0) {
            fprintf(stderr, "tessera local: %s (pid %d) did not stop in 5 s; killing it\n",
                    kids[i].name, (int)kids[i].pid);
            kill(kids[i].pid, SIGKILL);
            waitpid(kids[i].pid, NULL, 0);
        }
    return rc;
}
