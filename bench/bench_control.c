/* bench_control.c: control-plane benchmark for the coordinator.
 *
 * Starts the real tessera-coordinator on free loopback ports and plays N
 * workers over C DEALER connections from this one process (the coordinator
 * knows workers by Envelope.worker, not by connection):
 *
 *   1. registration: time until all N RegisterReply(accepted) are back;
 *   2. steady heartbeats, spread evenly over the interval: the coordinator's
 *      own heartbeat counter, acks received, its CPU time from /proc;
 *   3. status latency under that load: STATUS requests over a fresh DEALER
 *      (as cli/client.c does) and runs of the real `tessera status --json`;
 *   4. failure detection: one worker goes silent, STATUS is polled until it
 *      is "dead".
 *
 * With --http-streams S and --model DIR the coordinator also serves a deployment of
 * that model on one real tessera-worker (started, and ready, before the simulated
 * workers register, so they stay idle spares) through its HTTP API, and S streams
 * (bench/serve --http, a child process) generate through it from the warm-up to the end
 * of the heartbeat window: the heartbeat figures are then taken under that load.
 *
 * Everything runs in one event loop (pump()), so heartbeats keep flowing
 * while the benchmark waits for a status reply or a CLI run.
 *
 * File descriptors: each DEALER costs two here (its TCP connection, owned by
 * the ZeroMQ I/O thread, and its mailbox eventfd) and one in the coordinator
 * (the accepted connection).  C connections thus need about 2C + 64 here and
 * C + 64 there; the coordinator inherits our RLIMIT_NOFILE, which is raised
 * to the hard limit (and beyond it when we are privileged) before the fork.
 *
 * Exit status: 0 when the benchmark ran (whatever the figures), 1 when it
 * could not be set up, 2 on bad usage. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/wire.h"

extern char **environ;

#define FD_PER_CONN 2
#define FD_SPARE 64
#define NS_PER_MS 1000000LL
#define COORD_START_MS 3000        /* coordinator must answer STATUS by then */
#define REGISTER_DEADLINE_MS 12000 /* with the others, bounds a run under 60 s */
#define REGISTER_RETRY_MS 2000     /* re-send Register to workers with no answer */
#define WARMUP_MS 1000             /* let the registration backlog and replans settle */
#define PROBE_TIMEOUT_MS 2000
#define PROBE_GAP_MS 100           /* between status requests in the latency phase */
#define STATUS_PHASE_MAX_MS 14000
#define DETECT_POLL_MS 10
#define CLI_TIMEOUT_MS 5000        /* the CLI gives up after 3 s itself */
#define CTL_TAG UINT32_MAX         /* epoll tag of the control socket */

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

/* ---- state ----------------------------------------------------------------- */

typedef struct {
    int workers, connections, seconds, hb_ms, timeout_ms, status_samples, coord_cpu;
    int connect_window;
    const char *coord_bin, *cli_bin;
    int http_streams;           /* HTTP streams during the heartbeat window (0: none) */
    const char *model, *worker_bin, *serve_bin;
} opts_t;

enum { REG_NONE = 0, REG_ACCEPTED, REG_REFUSED };

typedef struct {
    opts_t o;
    int n, c;                   /* workers and connections actually used */
    char dir[64], yaml[128], log[128];
    char wep[64], cep[64];      /* workers and control endpoints */
    int http_port;              /* --http-streams: the coordinator's HTTP port */
    pid_t worker, serve;        /* --http-streams: the real worker, the load generator */
    char serve_out[128], worker_log[128];
    pid_t coord;
    int epfd;
    void **socks;               /* [c] DEALERs to the workers endpoint */
    uint32_t *touched_at;       /* [c] stamp of the send batch that last used it */
    int *touched;               /* connections used by the current send batch */
    int n_touched;
    uint32_t stamp;
    uint8_t *reg;               /* [n] REG_* */
    uint8_t *conn_answered;     /* [c] had its first RegisterReply */
    int conns_answered;
    long nofile;                /* RLIMIT_NOFILE in force */
    int n_accepted, n_refused;
    char refuse_reason[256];
    /* heartbeats: number k is due at hb_t0 + k * hb_ms / n, for worker k % n */
    bool hb_on;
    int64_t hb_t0;
    uint64_t hb_next, hb_sent, hb_failed, acks, resets, reregisters, others;
    int64_t hb_max_lag;         /* ns; reset at the start of the measured window */
    int silent;                 /* worker that stopped heartbeating, or -1 */
    int64_t last_hb0;           /* ns: last heartbeat sent by worker 0 */
    /* the control request in flight, on its own ZeroMQ context: on the
     * workers' I/O thread a multi-megabyte reply would queue behind this
     * process's own heartbeat traffic, and we would time ourselves */
    void *ctl_ctx;
    void *ctl;
    tsr_env_t *ctl_reply;
    int64_t ctl_reply_at;
} bench_t;

/* One answered control request.  Caller frees json. */
typedef struct {
    char *json;
    int64_t sent_at, reply_at;  /* ns */
} probe_t;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double ms_between(int64_t a, int64_t b) { return (double)(b - a) / 1e6; }

/* ---- /proc and the host ------------------------------------------------------ */

/* utime + stime of all the process's threads, in clock ticks. */
static int proc_cpu_ticks(pid_t pid, uint64_t *ticks)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* The command name may hold spaces and ')': fields start after the last ')'. */
    const char *p = strrchr(buf, ')');
    unsigned long ut, st;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return -1;
    *ticks = (uint64_t)ut + st;
    return 0;
}

static double self_cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
           (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static long proc_rss_kib(pid_t pid)
{
    char path[64], line[256];
    long kib = -1;
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld", &kib) == 1) break;
    fclose(f);
    return kib;
}

/* A TcpExt counter from /proc/net/netstat (a line of names, then a line of
 * values).  ListenOverflows shows connects dropped by a full accept queue. */
static uint64_t netstat_get(const char *name)
{
    static char names[4096], vals[4096];
    uint64_t v = 0;
    FILE *f = fopen("/proc/net/netstat", "r");
    if (!f) return 0;
    while (fgets(names, sizeof names, f) && fgets(vals, sizeof vals, f)) {
        if (strncmp(names, "TcpExt:", 7)) continue;
        char *sn, *sv;
        char *n = strtok_r(names + 7, " \n", &sn), *x = strtok_r(vals + 7, " \n", &sv);
        for (; n && x; n = strtok_r(NULL, " \n", &sn), x = strtok_r(NULL, " \n", &sv))
            if (!strcmp(n, name)) v = strtoull(x, NULL, 10);
    }
    fclose(f);
    return v;
}

static void cpu_model(char *out, size_t len)
{
    char line[512];
    snprintf(out, len, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        char *p = strchr(line, ':');
        if (!strncmp(line, "model name", 10) && p) {
            p += 1 + strspn(p + 1, " \t");
            p[strcspn(p, "\n")] = '\0';
            snprintf(out, len, "%s", p);
            break;
        }
    }
    fclose(f);
}

/* Raises the soft limit to the hard one, and both to `want` when we may.
 * Returns the soft limit now in force. */
static long raise_nofile(long want)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) < 0) return 1024;
    if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < (rlim_t)want) {
        struct rlimit more = {(rlim_t)want, (rlim_t)want};
        if (setrlimit(RLIMIT_NOFILE, &more) == 0) return want;  /* privileged */
    }
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) < 0) getrlimit(RLIMIT_NOFILE, &rl);
    return rl.rlim_cur == RLIM_INFINITY ? 1L << 20 : (long)rl.rlim_cur;
}

/* Two distinct free loopback ports.  Both are held until both are known, so
 * they differ; another process could still take one before the coordinator
 * binds it, in which case the start fails with a clear message. */
static int free_ports(int *p1, int *p2)
{
    int s[2] = {-1, -1}, ports[2], rc = -1;
    for (int i = 0; i < 2; i++) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t al = sizeof a;
        s[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (s[i] < 0 || bind(s[i], (struct sockaddr *)&a, sizeof a) < 0 ||
            getsockname(s[i], (struct sockaddr *)&a, &al) < 0)
            goto out;
        ports[i] = ntohs(a.sin_port);
    }
    *p1 = ports[0];
    *p2 = ports[1];
    rc = 0;
out:
    for (int i = 0; i < 2; i++)
        if (s[i] >= 0) close(s[i]);
    return rc;
}

/* ---- the event loop --------------------------------------------------------- */

static int epoll_add_sock(bench_t *b, void *sock, uint32_t tag)
{
    int fd;
    size_t len = sizeof fd;
    if (zmq_getsockopt(sock, ZMQ_FD, &fd, &len) < 0) return -1;
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = tag};
    return epoll_ctl(b->epfd, EPOLL_CTL_ADD, fd, &ev);
}

static void epoll_del_sock(bench_t *b, void *sock)
{
    int fd;
    size_t len = sizeof fd;
    if (zmq_getsockopt(sock, ZMQ_FD, &fd, &len) == 0) epoll_ctl(b->epfd, EPOLL_CTL_DEL, fd, NULL);
}

static int worker_index(const bench_t *b, const char *name)
{
    if (!name || strncmp(name, "sim-", 4)) return -1;
    char *end;
    long i = strtol(name + 4, &end, 10);
    return (*end || i < 0 || i >= b->n) ? -1 : (int)i;
}

static int send_register(bench_t *b, int w);

static void on_worker_reply(bench_t *b, const tsr_env_t *env)
{
    switch (env->body_case) {
    case TESSERA__ENVELOPE__BODY_HEARTBEAT_ACK:
        b->acks++;
        break;
    case TESSERA__ENVELOPE__BODY_REGISTER_REPLY: {
        int i = worker_index(b, env->worker);
        if (i < 0 || b->reg[i] != REG_NONE) break;  /* a duplicate answer to a retry */
        if (!b->conn_answered[i % b->c]) {
            b->conn_answered[i % b->c] = 1;
            b->conns_answered++;
        }
        if (env->register_reply->accepted) {
            b->reg[i] = REG_ACCEPTED;
            b->n_accepted++;
        } else {
            b->reg[i] = REG_REFUSED;
            b->n_refused++;
            snprintf(b->refuse_reason, sizeof b->refuse_reason, "%s", env->register_reply->reason);
        }
        break;
    }
    case TESSERA__ENVELOPE__BODY_RESET: {
        /* The coordinator declared this worker dead or forgot it: register
         * again, as worker/agent.c does, so one late heartbeat does not
         * silence a worker for the rest of the run. */
        int i = worker_index(b, env->worker);
        b->resets++;
        if (i < 0 || b->reg[i] != REG_ACCEPTED) break;
        b->reg[i] = REG_NONE;
        b->n_accepted--;
        b->reregisters++;
        send_register(b, i);
        break;
    }
    default:
        b->others++;
    }
}

/* Reads until the socket is empty.  The ZMQ_FD is only a hint ("commands
 * waiting"): reading to EAGAIN also processes those commands, which is what
 * re-arms it. */
static void conn_drain(bench_t *b, int ci)
{
    char err[256];
    for (;;) {
        tsr_env_t *env = NULL;
        int rc = tsr_wire_recv(b->socks[ci], NULL, NULL, TSR_WIRE_MAX_WORKER, &env, err, sizeof err);
        if (rc <= 0) {
            if (rc < 0) b->others++;
            return;
        }
        on_worker_reply(b, env);
        tsr_env_free(&env);
    }
}

static void ctl_drain(bench_t *b)
{
    char err[256];
    if (!b->ctl || b->ctl_reply) return;
    tsr_env_t *env = NULL;
    if (tsr_wire_recv(b->ctl, NULL, NULL, TSR_WIRE_MAX_CONTROL, &env, err, sizeof err) == 1) {
        b->ctl_reply = env;
        b->ctl_reply_at = now_ns();
    }
}

/* A send can consume the command that would have woken epoll for a reply
 * already waiting on that socket, so every socket used by a batch of sends
 * is read once afterwards (at most once per batch). */
static void touch(bench_t *b, int ci)
{
    if (b->touched_at[ci] == b->stamp) return;
    b->touched_at[ci] = b->stamp;
    b->touched[b->n_touched++] = ci;
}

static void drain_touched(bench_t *b)
{
    for (int i = 0; i < b->n_touched; i++) conn_drain(b, b->touched[i]);
    b->n_touched = 0;
    b->stamp++;
}

static void worker_name(int w, char *buf, size_t len) { snprintf(buf, len, "sim-%d", w); }

static int send_register(bench_t *b, int w)
{
    char name[32], node[32];
    worker_name(w, name, sizeof name);
    snprintf(node, sizeof node, "simnode-%d", w / 8);  /* 8 workers a node: N/8 nodes */
    Tessera__Register r = TESSERA__REGISTER__INIT;
    r.node = node;
    r.device = TESSERA__DEVICE_KIND__DEVICE_CPU;
    r.device_memory = 8ull << 30;
    r.software_version = TSR_SOFTWARE_VERSION;
    r.pid = (uint32_t)getpid();
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = name;
    env.body_case = TESSERA__ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    touch(b, w % b->c);
    return tsr_wire_send(b->socks[w % b->c], NULL, 0, &env);
}

static void send_heartbeat(bench_t *b, int w, uint64_t seq)
{
    char name[32];
    worker_name(w, name, sizeof name);
    Tessera__Heartbeat hb = TESSERA__HEARTBEAT__INIT;
    hb.state = TESSERA__WORKER_STATE__STATE_IDLE;
    hb.seq = seq;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = name;
    env.body_case = TESSERA__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    touch(b, w % b->c);
    if (tsr_wire_send(b->socks[w % b->c], NULL, 0, &env) < 0) b->hb_failed++;
    else b->hb_sent++;
}

static int64_t hb_due(const bench_t *b, uint64_t k)
{
    return b->hb_t0 + (int64_t)(k * (uint64_t)(b->o.hb_ms * NS_PER_MS) / (uint64_t)b->n);
}

/* Sends every heartbeat whose time has come.  Worker k % n owns heartbeat k,
 * so each worker beats once per interval and the N beats are spread evenly
 * over it; the loop wakes about once a millisecond, which is the only
 * batching. */
static void hb_send_due(bench_t *b)
{
    int64_t now = now_ns();
    while (hb_due(b, b->hb_next) <= now) {
        uint64_t k = b->hb_next++;
        int w = (int)(k % (uint64_t)b->n);
        if (w == b->silent || b->reg[w] != REG_ACCEPTED) continue;
        int64_t lag = now - hb_due(b, k);
        if (lag > b->hb_max_lag) b->hb_max_lag = lag;
        send_heartbeat(b, w, k / (uint64_t)b->n + 1);
        if (w == 0) b->last_hb0 = now;
    }
    drain_touched(b);
}

/* One turn of the loop: waits for replies until `until` or the next
 * heartbeat, whichever is first, then sends what is due. */
static void pump(bench_t *b, int64_t until)
{
    int64_t now = now_ns(), wake = until;
    if (b->hb_on && hb_due(b, b->hb_next) < wake) wake = hb_due(b, b->hb_next);
    int ms = wake > now ? (int)((wake - now + NS_PER_MS - 1) / NS_PER_MS) : 0;
    if (ms > 100) ms = 100;
    struct epoll_event ev[512];
    int k = epoll_wait(b->epfd, ev, 512, ms);
    for (int i = 0; i < k; i++) {
        if (ev[i].data.u32 == CTL_TAG) ctl_drain(b);
        else conn_drain(b, (int)ev[i].data.u32);
    }
    if (b->hb_on) hb_send_due(b);
    ctl_drain(b);
}

static void sleep_pumping(bench_t *b, int ms)
{
    int64_t until = now_ns() + ms * NS_PER_MS;
    while (!stop_flag && now_ns() < until) pump(b, until);
}

/* ---- control requests --------------------------------------------------------- */

/* A DEALER to the control endpoint with the options tsr_sock_dealer sets
 * (no linger, queue until connected), but on the control context. */
static void *ctl_dealer(bench_t *b, char *err, size_t errlen)
{
    int linger = 0, immediate = 0;
    void *s = zmq_socket(b->ctl_ctx, ZMQ_DEALER);
    if (!s) {
        snprintf(err, errlen, "cannot create socket: %s", zmq_strerror(errno));
        return NULL;
    }
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, ZMQ_IMMEDIATE, &immediate, sizeof immediate);
    if (zmq_connect(s, b->cep) != 0) {
        snprintf(err, errlen, "cannot connect to %s: %s", b->cep, zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    return s;
}

/* Sends one control request over a fresh DEALER, as cli/client.c does, and
 * keeps the loop turning until the answer.  Returns 0 with *out filled
 * (caller frees out->json), -1 on timeout or refusal. */
static int control_request(bench_t *b, Tessera__ControlRequest__Kind kind, int timeout_ms,
                           probe_t *out)
{
    char err[256];
    int rc = -1;
    memset(out, 0, sizeof *out);
    b->ctl = ctl_dealer(b, err, sizeof err);
    if (!b->ctl) {
        fprintf(stderr, "bench_control: %s\n", err);
        return -1;
    }
    epoll_add_sock(b, b->ctl, CTL_TAG);
    Tessera__ControlRequest q = TESSERA__CONTROL_REQUEST__INIT;
    q.kind = kind;
    q.worker = "";
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = "";
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REQUEST;
    env.control_request = &q;
    out->sent_at = now_ns();
    if (tsr_wire_send(b->ctl, NULL, 0, &env) < 0) goto out;
    int64_t deadline = out->sent_at + timeout_ms * NS_PER_MS;
    while (!b->ctl_reply && !stop_flag && now_ns() < deadline) pump(b, deadline);
    if (!b->ctl_reply || b->ctl_reply->body_case != TESSERA__ENVELOPE__BODY_CONTROL_REPLY ||
        !b->ctl_reply->control_reply->ok)
        goto out;
    out->json = strdup(b->ctl_reply->control_reply->json);
    out->reply_at = b->ctl_reply_at;
    rc = out->json ? 0 : -1;
out:
    epoll_del_sock(b, b->ctl);
    tsr_env_free(&b->ctl_reply);
    tsr_sock_close(&b->ctl);
    return rc;
}

/* Reads "key":<integer> from a status document, searching after `anchor`.
 * A string scan, not a parse: the document of 10,000 workers is megabytes
 * and parsing it would stall the heartbeats.  jansson keeps key order, so
 * the coordinator's own fields come before any worker's. */
static int scan_i64(const char *doc, const char *anchor, const char *key, int64_t *out)
{
    char pat[64];
    const char *p = anchor ? strstr(doc, anchor) : doc;
    if (!p) return -1;
    snprintf(pat, sizeof pat, "\"%s\":", key);
    p = strstr(p, pat);
    if (!p) return -1;
    *out = strtoll(p + strlen(pat), NULL, 10);
    return 0;
}

/* State of one worker in a status document, and its heartbeat age and time
 * dead (-1 when absent).  A simulated worker holds no assignment, so its
 * object has no nested braces and ends at the first '}'. */
static int scan_worker(const char *doc, const char *name, char *state, size_t len, int64_t *age,
                       int64_t *dead_for)
{
    char pat[96];
    snprintf(pat, sizeof pat, "{\"name\":\"%s\",", name);
    const char *p = strstr(doc, pat);
    if (!p) return -1;
    const char *end = strchr(p, '}');
    const char *s = strstr(p, "\"state\":\"");
    if (!end || !s || s > end) return -1;
    s += 9;
    size_t n = strcspn(s, "\"");
    snprintf(state, len, "%.*s", (int)(n < len ? n : len - 1), s);
    char obj[1024];
    snprintf(obj, sizeof obj, "%.*s", (int)(end - p), p);
    if (scan_i64(obj, NULL, "heartbeat_age_ms", age) < 0) *age = -1;
    if (scan_i64(obj, NULL, "dead_for_ms", dead_for) < 0) *dead_for = -1;
    return 0;
}

/* Runs `tessera --coordinator EP status --json > /dev/null` and returns its
 * wall time in ms, or -1 when it failed or overran.  posix_spawn, not fork:
 * copying the page tables of this process would be charged to the CLI. */
static double cli_run(bench_t *b)
{
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    char *argv[] = {(char *)b->o.cli_bin, "--coordinator", b->cep, "status", "--json", NULL};
    pid_t pid;
    int64_t t0 = now_ns();
    int rc = posix_spawn(&pid, b->o.cli_bin, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) return -1;
    int64_t deadline = t0 + CLI_TIMEOUT_MS * NS_PER_MS;
    int st = 0;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) break;
        if (now_ns() >= deadline || stop_flag) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        pump(b, now_ns() + NS_PER_MS);
    }
    int64_t t1 = now_ns();
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? ms_between(t0, t1) : -1;
}

/* ---- the coordinator ------------------------------------------------------------ */

static int write_yaml(bench_t *b)
{
    FILE *f = fopen(b->yaml, "w");
    if (!f) return -1;
    fprintf(f,
            "# Written by bench_control; removed when it exits.\n"
            "version: 1\n"
            "coordinator:\n"
            "  workers_endpoint: %s\n"
            "  control_endpoint: %s\n"
            "  heartbeat_interval_ms: %d\n"
            "  worker_timeout_ms: %d\n"
            "  security: none\n"
            "  max_workers: 10000\n",
            b->wep, b->cep, b->o.hb_ms, b->o.timeout_ms);
    if (b->o.http_streams)
        /* One deployment, on the real worker that registers before the simulated ones:
         * they stay spares and are never sent work. */
        fprintf(f, "  http_endpoint: 127.0.0.1:%d\n"
                   "deployments:\n"
                   "  - name: m\n"
                   "    model: %s\n"
                   "    max_seq_len: 512\n"
                   "    max_batch: 128\n",
                b->http_port, b->o.model);
    else
        fprintf(f, "# No deployments: the simulated workers must never be sent work.\n"
                   "deployments: []\n");
    return fclose(f) == 0 ? 0 : -1;
}

/* In the child: pin, redirect, exec.  Never returns. */
static void coord_exec(const bench_t *b)
{
    /* Never outlive the benchmark, even when it is killed. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int log = open(b->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int nul = open("/dev/null", O_RDWR);
    if (log < 0 || nul < 0) _exit(127);
    dup2(nul, 0);
    dup2(nul, 1);
    dup2(log, 2);
    if (b->o.coord_cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(b->o.coord_cpu, &set);
        if (sched_setaffinity(0, sizeof set, &set) < 0) {
            dprintf(2, "bench_control: cannot pin the coordinator to cpu %d: %s\n",
                    b->o.coord_cpu, strerror(errno));
            _exit(127);
        }
    }
    execl(b->o.coord_bin, b->o.coord_bin, "--adopt-grace-ms", "0", b->yaml, (char *)NULL);
    dprintf(2, "bench_control: cannot run %s: %s\n", b->o.coord_bin, strerror(errno));
    _exit(127);
}

static void log_tail(const bench_t *b, int lines)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "tail -n %d '%s' >&2", lines, b->log);
    fprintf(stderr, "---- coordinator log (last %d lines) ----\n", lines);
    fflush(stderr);
    if (system(cmd) != 0) fprintf(stderr, "(no log)\n");
}

/* Forks the coordinator and waits until it answers STATUS. */
static int coord_start(bench_t *b)
{
    b->coord = fork();
    if (b->coord < 0) {
        fprintf(stderr, "bench_control: fork: %s\n", strerror(errno));
        return -1;
    }
    if (b->coord == 0) coord_exec(b);
    int64_t deadline = now_ns() + COORD_START_MS * NS_PER_MS;
    while (!stop_flag && now_ns() < deadline) {
        int st;
        if (waitpid(b->coord, &st, WNOHANG) == b->coord) {
            b->coord = 0;
            fprintf(stderr, "bench_control: the coordinator exited at start\n");
            log_tail(b, 10);
            return -1;
        }
        probe_t p;
        if (control_request(b, TESSERA__CONTROL_REQUEST__KIND__STATUS, 300, &p) == 0) {
            free(p.json);
            return 0;
        }
    }
    fprintf(stderr, "bench_control: the coordinator did not answer within %d ms\n",
            COORD_START_MS);
    log_tail(b, 10);
    return -1;
}

/* SIGTERM, then SIGKILL after 2 s. */
static void coord_stop(bench_t *b)
{
    if (b->coord <= 0) return;
    kill(b->coord, SIGTERM);
    int64_t deadline = now_ns() + 2000 * NS_PER_MS;
    int st;
    while (waitpid(b->coord, &st, WNOHANG) == 0) {
        if (now_ns() >= deadline) {
            fprintf(stderr, "bench_control: coordinator ignored SIGTERM for 2 s; killing it\n");
            kill(b->coord, SIGKILL);
            waitpid(b->coord, &st, 0);
            break;
        }
        usleep(10000);
    }
    b->coord = 0;
}

/* Counts WARN and ERROR lines and shows the first of each: a refused
 * registration or a worker declared dead shows up here first. */
static void log_summary(const bench_t *b)
{
    char line[1200], first_warn[300] = "", first_err[300] = "";
    long lines = 0, warns = 0, errs = 0;
    FILE *f = fopen(b->log, "r");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        lines++;
        line[strcspn(line, "\n")] = '\0';
        if (strstr(line, " WARN ") && !warns++) snprintf(first_warn, sizeof first_warn, "%s", line);
        if (strstr(line, " ERROR ") && !errs++) snprintf(first_err, sizeof first_err, "%s", line);
    }
    fclose(f);
    printf("coordinator log: %ld lines, %ld WARN, %ld ERROR\n", lines, warns, errs);
    if (warns) printf("  first WARN: %s\n", first_warn);
    if (errs) printf("  first ERROR: %s\n", first_err);
}

/* ---- setup and teardown --------------------------------------------------------- */

/* Keeps this process (and so its ZeroMQ I/O thread, created later) off the
 * coordinator's core, so the two do not compete for it. */
static void pin_self_away(int cpu, char *desc, size_t len)
{
    cpu_set_t set;
    snprintf(desc, len, "any cpu");
    if (cpu < 0 || sched_getaffinity(0, sizeof set, &set) < 0 || CPU_COUNT(&set) < 2) return;
    CPU_CLR(cpu, &set);
    if (CPU_COUNT(&set) == 0 || sched_setaffinity(0, sizeof set, &set) < 0) return;
    size_t used = 0;
    desc[0] = '\0';
    for (int i = 0; i < CPU_SETSIZE && used < len; i++)
        if (CPU_ISSET(i, &set))
            used += (size_t)snprintf(desc + used, len - used, "%s%d", used ? "," : "cpu ", i);
}

/* Runs argv with stdout and stderr to out, off the coordinator's cpu.  The child dies
 * with this process. */
static pid_t spawn(const bench_t *b, char *const argv[], const char *out)
{
    pid_t pid = fork();
    if (pid != 0) return pid;
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int nul = open("/dev/null", O_RDWR);
    if (fd < 0 || nul < 0) _exit(127);
    dup2(nul, 0);
    dup2(fd, 1);
    dup2(fd, 2);
    (void)b;
    execv(argv[0], argv);
    dprintf(2, "bench_control: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

/* --http-streams: the real worker, and the wait for its deployment to be ready. */
static int start_real_worker(bench_t *b)
{
    char *argv[] = {(char *)b->o.worker_bin, "--coordinator", b->wep, "--name", "real-0", NULL};
    snprintf(b->worker_log, sizeof b->worker_log, "%s/worker.log", b->dir);
    b->worker = spawn(b, argv, b->worker_log);
    if (b->worker < 0) return -1;
    int64_t deadline = now_ns() + 60000 * NS_PER_MS;
    while (!stop_flag && now_ns() < deadline) {
        probe_t p;
        if (control_request(b, TESSERA__CONTROL_REQUEST__KIND__STATUS, 1000, &p) == 0) {
            json_t *doc = json_loads(p.json, 0, NULL);
            free(p.json);
            const char *st = json_string_value(json_object_get(
                json_array_get(json_object_get(doc, "deployments"), 0), "state"));
            bool ready = st && !strcmp(st, "ready");
            json_decref(doc);
            if (ready) return 0;
        }
        sleep_pumping(b, 100);
    }
    fprintf(stderr, "bench_control: the real worker's deployment was not ready within 60 s "
                    "(log %s)\n", b->worker_log);
    return -1;
}

/* --http-streams: the load, for the warm-up and the heartbeat window and a little more. */
static void start_http_load(bench_t *b)
{
    char addr[32], streams[16], secs[16];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", b->http_port);
    snprintf(streams, sizeof streams, "%d", b->o.http_streams);
    snprintf(secs, sizeof secs, "%d", WARMUP_MS / 1000 + b->o.seconds + 2);
    snprintf(b->serve_out, sizeof b->serve_out, "%s/serve.json", b->dir);
    char *argv[] = {(char *)b->o.serve_bin, "--http", addr, "--deployment", "m", "--vocab",
                    "1024", "--concurrency", streams, "--duration", secs, "--min-prompt", "8",
                    "--max-prompt", "64", "--max-tokens", "64", "--json", NULL};
    b->serve = spawn(b, argv, b->serve_out);
}

/* --http-streams: what the load generator saw. */
static void report_http_load(bench_t *b)
{
    if (b->serve <= 0) return;
    int st;
    waitpid(b->serve, &st, 0);
    b->serve = 0;
    FILE *f = fopen(b->serve_out, "r");
    char line[8192] = "";
    json_t *doc = NULL;
    while (f && fgets(line, sizeof line, f))
        if (line[0] == '{') doc = (json_decref(doc), json_loads(line, 0, NULL));
    if (f) fclose(f);
    if (!doc) {
        printf("HTTP load: no result from %s (%s)\n", b->o.serve_bin, line);
        return;
    }
    printf("HTTP load during the window: %d streams, %lld requests done, %lld failed, %.0f "
           "tokens/s, TTFT p50 %.1f ms\n", b->o.http_streams,
           (long long)json_integer_value(json_object_get(doc, "done")),
           (long long)json_integer_value(json_object_get(doc, "failed")),
           json_real_value(json_object_get(doc, "tok_per_s")),
           json_number_value(json_object_get(doc, "ttft_p50_ms")));
    json_decref(doc);
}

static int setup(bench_t *b)
{
    int pw, pc;
    b->n = b->o.workers;
    b->c = b->o.connections > 0 ? b->o.connections : b->n;
    if (b->c > b->n) b->c = b->n;
    long want = (long)FD_PER_CONN * b->c + FD_SPARE;
    long have = raise_nofile(want);
    b->nofile = have;
    if (have < want) {
        int c = (int)((have - FD_SPARE) / FD_PER_CONN);
        fprintf(stderr,
                "bench_control: RLIMIT_NOFILE is %ld, %d connections need %ld; using %d "
                "connections\n",
                have, b->c, want, c);
        b->c = c;
    }
    if (b->c < 1) return -1;

    snprintf(b->dir, sizeof b->dir, "/tmp/tessera-bench-XXXXXX");
    if (!mkdtemp(b->dir)) {
        b->dir[0] = '\0';
        fprintf(stderr, "bench_control: mkdtemp: %s\n", strerror(errno));
        return -1;
    }
    snprintf(b->yaml, sizeof b->yaml, "%s/bench.yaml", b->dir);
    snprintf(b->log, sizeof b->log, "%s/coordinator.log", b->dir);
    if (free_ports(&pw, &pc) < 0) {
        fprintf(stderr, "bench_control: no free loopback port: %s\n", strerror(errno));
        return -1;
    }
    snprintf(b->wep, sizeof b->wep, "tcp://127.0.0.1:%d", pw);
    snprintf(b->cep, sizeof b->cep, "tcp://127.0.0.1:%d", pc);
    if (b->o.http_streams) {
        int ph, unused;
        if (free_ports(&ph, &unused) < 0) return -1;
        b->http_port = ph;
    }
    if (write_yaml(b) < 0) {
        fprintf(stderr, "bench_control: cannot write %s: %s\n", b->yaml, strerror(errno));
        return -1;
    }
    b->epfd = epoll_create1(EPOLL_CLOEXEC);
    b->ctl_ctx = zmq_ctx_new();
    b->socks = calloc((size_t)b->c, sizeof *b->socks);
    b->touched_at = calloc((size_t)b->c, sizeof *b->touched_at);
    b->touched = calloc((size_t)b->c, sizeof *b->touched);
    b->reg = calloc((size_t)b->n, sizeof *b->reg);
    b->conn_answered = calloc((size_t)b->c, sizeof *b->conn_answered);
    if (b->epfd < 0 || !b->ctl_ctx || !b->socks || !b->touched_at || !b->touched || !b->reg ||
        !b->conn_answered) {
        fprintf(stderr, "bench_control: out of memory\n");
        return -1;
    }
    b->stamp = 1;
    b->silent = -1;
    if (coord_start(b) < 0) return -1;
    return b->o.http_streams ? start_real_worker(b) : 0;
}

static void teardown(bench_t *b)
{
    if (b->serve > 0) kill(b->serve, SIGKILL), waitpid(b->serve, NULL, 0);
    if (b->worker > 0) kill(b->worker, SIGKILL), waitpid(b->worker, NULL, 0);
    coord_stop(b);
    for (int i = 0; b->socks && i < b->c; i++) tsr_sock_close(&b->socks[i]);
    tsr_zmq_term();
    if (b->ctl_ctx) zmq_ctx_term(b->ctl_ctx);
    if (b->epfd > 0) close(b->epfd);
    if (b->dir[0]) {
        unlink(b->yaml);
        unlink(b->log);
        if (b->serve_out[0]) unlink(b->serve_out);
        if (b->worker_log[0]) unlink(b->worker_log);
        rmdir(b->dir);
    }
    free(b->socks);
    free(b->touched_at);
    free(b->touched);
    free(b->reg);
    free(b->conn_answered);
}

/* ---- phases ------------------------------------------------------------------------ */

/* Opens connection ci and sends Register for each worker it carries.
 * immediate=0: a Register on a connection still being set up is queued, not
 * dropped, so one send per worker is enough. */
static int open_conn(bench_t *b, int ci)
{
    char err[256];
    b->socks[ci] = tsr_sock_dealer(b->wep, 0, err, sizeof err);
    if (!b->socks[ci] || epoll_add_sock(b, b->socks[ci], (uint32_t)ci) < 0) {
        fprintf(stderr, "bench_control: connection %d of %d: %s\n", ci + 1, b->c,
                b->socks[ci] ? strerror(errno) : err);
        return -1;
    }
    for (int w = ci; w < b->n; w += b->c) send_register(b, w);
    return 0;
}

static void resend_registers(bench_t *b, int opened)
{
    for (int w = 0; w < b->n; w++)
        if (b->reg[w] == REG_NONE && w % b->c < opened) send_register(b, w);
}

/* Opens the C connections, at most --connect-window of them still waiting
 * for their first RegisterReply at any time (0: all at once), and registers
 * the N workers over them.  Each worker starts heartbeating once accepted, as
 * a real one does: waiting for all N would let the first ones time out.
 * Returns -1 only when a socket cannot be made (a setup failure). */
static int phase_register(bench_t *b)
{
    uint64_t ovf0 = netstat_get("ListenOverflows");
    int64_t t0 = now_ns();
    int64_t deadline = t0 + REGISTER_DEADLINE_MS * NS_PER_MS;
    int64_t retry = t0 + REGISTER_RETRY_MS * NS_PER_MS;
    int window = b->o.connect_window > 0 ? b->o.connect_window : b->c, opened = 0;
    b->hb_on = true;
    b->hb_t0 = t0;
    while (!stop_flag && b->n_accepted + b->n_refused < b->n && now_ns() < deadline) {
        for (; opened < b->c && opened - b->conns_answered < window; opened++)
            if (open_conn(b, opened) < 0) return -1;
        drain_touched(b);
        int64_t until = now_ns() + 10 * NS_PER_MS;
        pump(b, until < deadline ? until : deadline);
        if (now_ns() >= retry) {
            resend_registers(b, opened);
            drain_touched(b);
            retry = now_ns() + REGISTER_RETRY_MS * NS_PER_MS;
        }
    }
    double reg_ms = ms_between(t0, now_ns());
    printf("registration time: %.1f ms for %d of %d workers accepted (%.0f registrations/s, "
           "connect window %d)%s\n",
           reg_ms, b->n_accepted, b->n, reg_ms > 0 ? b->n_accepted * 1000.0 / reg_ms : 0.0,
           window, b->n_accepted == b->n ? "" : "  ** INCOMPLETE **");
    if (b->n_refused)
        printf("registration refused: %d workers (last reason: %s)\n", b->n_refused,
               b->refuse_reason);
    printf("listen queue overflows during connect+register: %llu%s\n",
           (unsigned long long)(netstat_get("ListenOverflows") - ovf0),
           netstat_get("ListenOverflows") > ovf0
               ? " (connects dropped by a full accept queue; TCP retries them after 1 s, 3 s, ...)"
               : "");
    return 0;
}

typedef struct {
    int64_t at;                 /* ns */
    uint64_t cpu_ticks;
    double self_cpu;
    uint64_t sent, acks, resets;
} snap_t;

static void snap(bench_t *b, snap_t *s)
{
    s->at = now_ns();
    if (proc_cpu_ticks(b->coord, &s->cpu_ticks) < 0) s->cpu_ticks = 0;
    s->self_cpu = self_cpu_s();
    s->sent = b->hb_sent;
    s->acks = b->acks;
    s->resets = b->resets;
}

/* Coordinator CPU between two snapshots, in % of one core. */
static double coord_cpu_pct(const snap_t *a, const snap_t *z)
{
    double secs = (double)(z->at - a->at) / 1e9;
    return secs > 0 ? 100.0 * (double)(z->cpu_ticks - a->cpu_ticks) / sysconf(_SC_CLK_TCK) / secs
                    : 0.0;
}

/* Reads the coordinator's heartbeat and plan counters and its uptime. */
static int sample_counters(bench_t *b, int64_t *heartbeats, int64_t *plans, int64_t *uptime_ms)
{
    probe_t p;
    if (control_request(b, TESSERA__CONTROL_REQUEST__KIND__STATUS, PROBE_TIMEOUT_MS, &p) < 0)
        return -1;
    int rc = scan_i64(p.json, "\"stats\":{", "heartbeats", heartbeats) == 0 &&
                     scan_i64(p.json, "\"stats\":{", "plans", plans) == 0 &&
                     scan_i64(p.json, NULL, "uptime_ms", uptime_ms) == 0
                 ? 0
                 : -1;
    free(p.json);
    return rc;
}

/* Steady heartbeating for S seconds after a warm-up.  The two counter samples
 * bracket the CPU window from outside, so the cost of building those two
 * status documents stays out of it. */
static void phase_heartbeat(bench_t *b)
{
    if (b->o.http_streams) start_http_load(b);
    sleep_pumping(b, WARMUP_MS);
    int64_t h0 = 0, u0 = 0, h1 = 0, u1 = 0, plans0 = 0, plans1 = 0;
    int ok0 = sample_counters(b, &h0, &plans0, &u0);
    /* Each loop turn that saw a registration replans over all workers. */
    if (ok0 == 0)
        printf("coordinator plans computed during registration: %lld\n", (long long)plans0);
    snap_t a, z;
    b->hb_max_lag = 0;
    snap(b, &a);
    sleep_pumping(b, b->o.seconds * 1000);
    snap(b, &z);
    int ok1 = sample_counters(b, &h1, &plans1, &u1);

    double secs = (double)(z.at - a.at) / 1e9;
    /* Only accepted workers beat, so the simulator is judged against them;
     * an incomplete registration is reported on its own line. */
    int beating = b->n_accepted - (b->silent >= 0);
    double target = beating * 1000.0 / b->o.hb_ms;
    double sent = (double)(z.sent - a.sent) / secs, acks = (double)(z.acks - a.acks) / secs;
    double cpu = coord_cpu_pct(&a, &z), self = 100.0 * (z.self_cpu - a.self_cpu) / secs;
    double lag_ms = (double)b->hb_max_lag / 1e6;
    bool kept_up = sent >= 0.99 * target && lag_ms <= b->o.hb_ms / 2.0;

    printf("heartbeat window: %.2f s (after %d ms warm-up)\n", secs, WARMUP_MS);
    printf("heartbeat target rate: %.0f/s (%d workers every %d ms)%s\n", target, beating,
           b->o.hb_ms, beating < b->n ? "  ** not all N registered **" : "");
    printf("heartbeat send rate: %.0f/s (%.1f%% of target, worst lag %.1f ms, %llu send "
           "failures)\n",
           sent, 100.0 * sent / target, lag_ms, (unsigned long long)b->hb_failed);
    printf("simulator kept up: %s (simulator CPU %.0f%% of one core)\n",
           kept_up ? "yes" : "NO -- the simulator is the bottleneck; the coordinator figures "
                             "below are for the rate actually offered, not the target",
           self);
    if (kept_up && self >= 90.0)
        printf("  note: the simulator is near saturation; a slower coordinator reply path and a "
               "slower simulator cannot be told apart here\n");
    if (ok0 == 0 && ok1 == 0 && u1 > u0)
        printf("heartbeats handled/s (coordinator stats.heartbeats): %.0f\n",
               (double)(h1 - h0) * 1000.0 / (double)(u1 - u0));
    else
        printf("heartbeats handled/s (coordinator stats.heartbeats): unavailable (status failed)\n");
    printf("heartbeat acks received/s: %.0f (%.2f%% of sent)\n", acks,
           sent > 0 ? 100.0 * acks / sent : 0.0);
    if (z.resets > a.resets)
        printf("resets received: %llu (workers declared dead; %llu re-registrations so far)\n",
               (unsigned long long)(z.resets - a.resets), (unsigned long long)b->reregisters);
    printf("coordinator CPU: %.1f%% of one core\n", cpu);
    printf("coordinator CPU per 1,000 workers: %.2f%% of one core\n",
           beating > 0 ? cpu * 1000.0 / beating : 0.0);
    long rss = proc_rss_kib(b->coord);
    if (rss >= 0) printf("coordinator RSS: %.1f MiB\n", rss / 1024.0);
    if (b->o.http_streams) {
        sleep_pumping(b, 2500);  /* the load's last requests end */
        report_http_load(b);
    }
}

static int cmp_double(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

/* Percentiles over all `tried` requests: the ones that got no answer within
 * `timeout_ms` count as slower than every answer, so a p99 is never flattered
 * by dropping them. */
static void print_latency(const char *what, double *v, int n, int tried, int timeout_ms)
{
    char p50[32], p99[32];
    if (n == 0) {
        printf("%s: no answers within %d ms (%d tried)\n", what, timeout_ms, tried);
        return;
    }
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    double q[2] = {50, 99};
    char *out[2] = {p50, p99};
    for (int i = 0; i < 2; i++) {
        int r = (int)((q[i] / 100.0) * tried + 0.999999);
        if (r < 1) r = 1;
        if (r <= n) snprintf(out[i], sizeof p50, "%.2f ms", v[r - 1]);
        else snprintf(out[i], sizeof p50, "> %d ms", timeout_ms);
    }
    printf("%s: p50 %s, p99 %s, max answered %.2f ms (%d requests, %d unanswered within %d ms)\n",
           what, p50, p99, v[n - 1], tried, tried - n, timeout_ms);
}

/* K STATUS requests and K/5 CLI runs while every worker keeps heartbeating;
 * one CLI run after every fifth request, so both see the same load. */
static void phase_status(bench_t *b)
{
    int k = b->o.status_samples, kc = k / 5, nl = 0, nc = 0, tried = 0, tried_c = 0;
    double *lat = calloc((size_t)k + 1, sizeof *lat), *cli = calloc((size_t)kc + 1, sizeof *cli);
    size_t bytes = 0;
    if (!lat || !cli) goto out;
    snap_t a, z;
    snap(b, &a);
    int64_t deadline = a.at + STATUS_PHASE_MAX_MS * NS_PER_MS;
    for (int i = 0; i < k && !stop_flag && now_ns() < deadline; i++) {
        probe_t p;
        tried++;
        if (control_request(b, TESSERA__CONTROL_REQUEST__KIND__STATUS, PROBE_TIMEOUT_MS, &p) == 0) {
            lat[nl++] = ms_between(p.sent_at, p.reply_at);
            bytes = strlen(p.json);
            free(p.json);
        }
        sleep_pumping(b, PROBE_GAP_MS);
        if ((i + 1) % 5 == 0 && tried_c < kc) {
            double ms = cli_run(b);
            tried_c++;
            if (ms >= 0) cli[nc++] = ms;
            sleep_pumping(b, PROBE_GAP_MS);
        }
    }
    snap(b, &z);
    if (tried < k)
        printf("status phase capped at %d s: %d of %d requests and %d of %d CLI runs made\n",
               STATUS_PHASE_MAX_MS / 1000, tried, k, tried_c, kc);
    print_latency("status latency (STATUS over a fresh DEALER)", lat, nl, tried, PROBE_TIMEOUT_MS);
    printf("status reply size: %zu bytes of JSON (%.0f bytes per registered worker)\n", bytes,
           b->n_accepted ? (double)bytes / b->n_accepted : 0.0);
    print_latency("`tessera status --json` wall time (fork/exec)", cli, nc, tried_c, CLI_TIMEOUT_MS);
    printf("coordinator CPU during the status phase: %.1f%% of one core (heartbeats + status)\n",
           coord_cpu_pct(&a, &z));
out:
    free(lat);
    free(cli);
}

/* Silences sim-0 and polls STATUS every 10 ms until it is dead.  T is its
 * last heartbeat actually sent: the most the coordinator could have heard. */
static void phase_detect(bench_t *b)
{
    const int target = b->o.timeout_ms + 2 * b->o.hb_ms;
    b->silent = 0;
    int64_t t = b->last_hb0;
    int64_t deadline = now_ns() + (3LL * b->o.timeout_ms + 2000) * NS_PER_MS;
    char state[32] = "?";
    int64_t age = -1, dead_for = -1, deaths = -1;
    double seen = -1;
    int polls = 0;
    while (!stop_flag && now_ns() < deadline) {
        probe_t p;
        if (control_request(b, TESSERA__CONTROL_REQUEST__KIND__STATUS, PROBE_TIMEOUT_MS, &p) == 0) {
            polls++;
            int found = scan_worker(p.json, "sim-0", state, sizeof state, &age, &dead_for);
            scan_i64(p.json, "\"stats\":{", "deaths", &deaths);
            free(p.json);
            if (found == 0 && !strcmp(state, "dead")) {
                seen = ms_between(t, p.reply_at);
                break;
            }
        }
        sleep_pumping(b, DETECT_POLL_MS);
    }
    if (seen < 0) {
        printf("failure detection: sim-0 not declared dead within %lld ms (last state %s, %d "
               "polls): MISS (target <= %d ms)\n",
               3LL * b->o.timeout_ms + 2000, state, polls, target);
        return;
    }
    printf("failure detection target: %d ms (worker timeout %d + 2 x heartbeat %d)\n", target,
           b->o.timeout_ms, b->o.hb_ms);
    printf("failure detection (as an operator sees it): %.0f ms from sim-0's last heartbeat to "
           "a status poll showing it dead (%d polls): %s\n",
           seen, polls, seen <= target ? "PASS" : "MISS");
    /* The coordinator's own clock: heartbeat age minus time dead is when it
     * acted, free of status latency. */
    if (age >= 0 && dead_for >= 0)
        printf("failure detection (coordinator's clock): declared dead %lld ms after it last "
               "heard sim-0, shown by status %lld ms later: %s\n",
               (long long)(age - dead_for), (long long)dead_for,
               age - dead_for <= target ? "PASS" : "MISS");
    if (deaths >= 0)
        printf("  other workers declared dead during the run: %lld%s\n", (long long)(deaths - 1),
               deaths > 1 ? "  ** heartbeats were late somewhere **" : "");
}

/* ---- main ------------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: bench_control [options]\n"
            "\n"
            "Starts bin/tessera-coordinator on loopback ports and simulates N workers over C\n"
            "connections: registration time, heartbeat throughput and coordinator CPU,\n"
            "`tessera status` latency under load, failure detection time.\n"
            "\n"
            "  --workers N          simulated workers (default 1000)\n"
            "  --connections C      DEALER connections they share (default N: one each, as\n"
            "                       real workers; capped by RLIMIT_NOFILE, 2 fds each)\n"
            "  --seconds S          measured heartbeat window (default 10)\n"
            "  --heartbeat-ms MS    heartbeat interval (default 100)\n"
            "  --timeout-ms MS      worker timeout (default 1000)\n"
            "  --status-samples K   STATUS requests to time (default 50; K/5 CLI runs)\n"
            "  --connect-window W   connections awaiting their first RegisterReply at once\n"
            "                       (default 64, under the coordinator's listen backlog of\n"
            "                       100; 0: all at once, a reconnect storm)\n"
            "  --coordinator-cpu K  pin the coordinator to cpu K, this process off it\n"
            "  --coordinator-bin P  default bin/tessera-coordinator\n"
            "  --cli-bin P          default bin/tessera\n"
            "  --http-streams S     S streams through the HTTP API during the heartbeat\n"
            "                       window, to a deployment of --model on one real worker\n"
            "  --model DIR          its checkpoint (vocabulary 1,024 or more)\n"
            "  --worker-bin P       default bin/tessera-worker\n"
            "  --serve-bin P        default build/bench/serve\n");
}

static int parse_int(const char *opt, const char *s, int lo, int hi, int *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < lo || v > hi) {
        fprintf(stderr, "bench_control: %s: expected %d..%d, got '%s'\n", opt, lo, hi, s);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int parse_opts(int argc, char **argv, opts_t *o)
{
    static const struct option lo[] = {
        {"workers", required_argument, 0, 'n'},    {"connections", required_argument, 0, 'c'},
        {"seconds", required_argument, 0, 's'},    {"heartbeat-ms", required_argument, 0, 'b'},
        {"timeout-ms", required_argument, 0, 't'}, {"status-samples", required_argument, 0, 'k'},
        {"coordinator-cpu", required_argument, 0, 'p'},
        {"coordinator-bin", required_argument, 0, 'B'},
        {"cli-bin", required_argument, 0, 'C'},    {"connect-window", required_argument, 0, 'w'},
        {"http-streams", required_argument, 0, 'H'}, {"model", required_argument, 0, 'm'},
        {"worker-bin", required_argument, 0, 'W'}, {"serve-bin", required_argument, 0, 'S'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    *o = (opts_t){.workers = 1000,
                  .seconds = 10,
                  .hb_ms = 100,
                  .timeout_ms = 1000,
                  .status_samples = 50,
                  .coord_cpu = -1,
                  .connect_window = 64,
                  .coord_bin = "bin/tessera-coordinator",
                  .cli_bin = "bin/tessera",
                  .worker_bin = "bin/tessera-worker",
                  .serve_bin = "build/bench/serve"};
    int c, rc = 0;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1 && rc == 0) {
        switch (c) {
        case 'n': rc = parse_int("--workers", optarg, 1, 100000, &o->workers); break;
        case 'c': rc = parse_int("--connections", optarg, 1, 100000, &o->connections); break;
        case 's': rc = parse_int("--seconds", optarg, 1, 30, &o->seconds); break;
        case 'b': rc = parse_int("--heartbeat-ms", optarg, 1, 10000, &o->hb_ms); break;
        case 't': rc = parse_int("--timeout-ms", optarg, 2, 10000, &o->timeout_ms); break;
        case 'k': rc = parse_int("--status-samples", optarg, 1, 1000, &o->status_samples); break;
        case 'p': rc = parse_int("--coordinator-cpu", optarg, 0, CPU_SETSIZE - 1, &o->coord_cpu); break;
        case 'w': rc = parse_int("--connect-window", optarg, 0, 100000, &o->connect_window); break;
        case 'B': o->coord_bin = optarg; break;
        case 'C': o->cli_bin = optarg; break;
        case 'H': rc = parse_int("--http-streams", optarg, 0, 1000, &o->http_streams); break;
        case 'm': o->model = optarg; break;
        case 'W': o->worker_bin = optarg; break;
        case 'S': o->serve_bin = optarg; break;
        case 'h': usage(stdout); exit(0);
        default: usage(stderr); return -1;
        }
    }
    if (rc == 0 && optind != argc) {
        usage(stderr);
        return -1;
    }
    if (rc == 0 && o->http_streams && !o->model) {
        fprintf(stderr, "bench_control: --http-streams needs --model DIR\n");
        return -1;
    }
    if (rc == 0 && o->timeout_ms <= o->hb_ms) {
        fprintf(stderr, "bench_control: --timeout-ms must exceed --heartbeat-ms (%d <= %d)\n",
                o->timeout_ms, o->hb_ms);
        return -1;
    }
    return rc;
}

static void print_conditions(const bench_t *b, const char *sim_cpus)
{
    char model[256];
    int maj, min, pat;
    cpu_model(model, sizeof model);
    zmq_version(&maj, &min, &pat);
    printf("== tessera control-plane benchmark ==\n");
    printf("workers: %d over %d connections (%.1f per connection), %d nodes, device cpu\n", b->n,
           b->c, (double)b->n / b->c, (b->n + 7) / 8);
    if (b->c < b->o.connections || (b->o.connections == 0 && b->c < b->n))
        printf("connections capped by RLIMIT_NOFILE %ld (%d fds each, here)\n", b->nofile,
               FD_PER_CONN);
    printf("heartbeat: %d ms, worker timeout: %d ms\n", b->o.hb_ms, b->o.timeout_ms);
    printf("host: %s, %ld cpus online, libzmq %d.%d.%d\n", model, sysconf(_SC_NPROCESSORS_ONLN),
           maj, min, pat);
    if (b->o.coord_cpu >= 0)
        printf("coordinator: pid %d pinned to cpu %d; simulator on %s\n", (int)b->coord,
               b->o.coord_cpu, sim_cpus);
    else
        printf("coordinator: pid %d, not pinned\n", (int)b->coord);
    printf("endpoints: workers %s, control %s\n", b->wep, b->cep);
}

int main(int argc, char **argv)
{
    bench_t b;
    memset(&b, 0, sizeof b);
    if (parse_opts(argc, argv, &b.o) < 0) return 2;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IOLBF, 0);

    char sim_cpus[256];
    pin_self_away(b.o.coord_cpu, sim_cpus, sizeof sim_cpus);
    int rc = 1;
    if (setup(&b) < 0) goto out;
    print_conditions(&b, sim_cpus);
    if (phase_register(&b) < 0) goto out;
    rc = 0;
    if (b.n_accepted > 0 && !stop_flag) phase_heartbeat(&b);
    if (b.n_accepted > 0 && !stop_flag) phase_status(&b);
    if (b.n_accepted > 0 && !stop_flag) phase_detect(&b);
    if (stop_flag) printf("interrupted: the figures above may be partial\n");
    if (b.others)
        printf("unexpected or undecodable messages on the workers channel: %llu\n",
               (unsigned long long)b.others);
    log_summary(&b);
out:
    teardown(&b);
    return rc;
}
