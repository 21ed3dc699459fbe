/* fuzz_dataport.c: the TCP data port's handshake (worker/collective_tcp.c)
 * against a stranger's bytes, over real loopback sockets, since it is
 * reached only through a communicator being formed.  The first input byte
 * picks the side, the rest is what the stranger sends:
 *   even: the stranger connects to a forming rank 0 (the acceptor) and sends
 *         the bytes as its handshake;
 *   odd:  the stranger is the rank 0 that a forming rank 1 (the connector)
 *         dials, and sends the bytes as its challenge and ack.
 * Either way the real rank forms for 10 ms and must give up with a reason:
 * without the replica's secret the bytes cannot prove a handshake, so the
 * sealed frames behind it are not reached (not covered). */
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "common/log.h"
#include "worker/collective.h"

#define FORM_MS 10

static tsr_tcp_listener_t *l;
static char l_ep[64], fake_ep[64];
static int fake_fd = -1;        /* the stranger's listening socket (odd inputs) */
static uint64_t epoch = 7;

static int listen_loopback(char *ep, size_t eplen)
{
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t al = sizeof a;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 16) < 0 ||
        getsockname(fd, (struct sockaddr *)&a, &al) < 0) {
        perror("fuzz_dataport: listen");
        exit(1);
    }
    snprintf(ep, eplen, "127.0.0.1:%d", ntohs(a.sin_port));
    return fd;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc; (void)argv;
    char err[256];
    tsr_log_init("fuzz", TSR_LOG_ERROR + 1);
    l = tsr_tcp_listen("127.0.0.1", 0, err, sizeof err);
    if (!l) { fprintf(stderr, "fuzz_dataport: %s\n", err); exit(1); }
    snprintf(l_ep, sizeof l_ep, "%s", tsr_tcp_listener_endpoint(l));
    fake_fd = listen_loopback(fake_ep, sizeof fake_ep);
    return 0;
}

static void write_all(int fd, const uint8_t *b, size_t n)
{
    while (n > 0) {
        ssize_t k = send(fd, b, n, MSG_NOSIGNAL);
        if (k <= 0) return;     /* the rank hung up: fine */
        b += k;
        n -= (size_t)k;
    }
}

typedef struct { const uint8_t *b; size_t n; } bytes_t;

/* The stranger as rank 0: takes the connector's call, sends the bytes, and
 * hangs up when the connector does (or after the formation's time). */
static void *fake_acceptor(void *arg)
{
    bytes_t *in = arg;
    struct pollfd p = { .fd = fake_fd, .events = POLLIN };
    if (poll(&p, 1, 4 * FORM_MS) <= 0) return NULL;
    int fd = accept4(fake_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) return NULL;
    write_all(fd, in->b, in->n);
    uint8_t sink[512];
    p.fd = fd;
    while (poll(&p, 1, 4 * FORM_MS) > 0 && recv(fd, sink, sizeof sink, 0) > 0) {
    }
    close(fd);
    return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512] = "";
    tsr_comm_t *c = NULL;

    if (size < 1) return 0;
    int connector_side = data[0] & 1;
    bytes_t in = { data + 1, size - 1 };
    epoch++;    /* each input is a new epoch, as a re-formation would be */
    if (!connector_side) {
        const char *eps[2] = { l_ep, "127.0.0.1:9" };
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in a = { .sin_family = AF_INET };
        inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
        a.sin_port = htons((uint16_t)atoi(strrchr(l_ep, ':') + 1));
        if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
            perror("fuzz_dataport: connect");
            exit(1);
        }
        write_all(fd, in.b, in.n);
        c = tsr_tcp_comm_new(l, epoch, 1, 0, 2, eps, FORM_MS, err, sizeof err);
        close(fd);
    } else {
        const char *eps[2] = { fake_ep, l_ep };
        pthread_t t;
        if (pthread_create(&t, NULL, fake_acceptor, &in) != 0) abort();
        c = tsr_tcp_comm_new(l, epoch, 1, 1, 2, eps, FORM_MS, err, sizeof err);
        pthread_join(t, NULL);
    }
    if (c != NULL) {
        fprintf(stderr, "fuzz_dataport: a stranger formed a group\n");
        abort();
    }
    if (err[0] == '\0') abort();    /* giving up says why */
    return 0;
}
