/* collective_tcp.c: the TCP backend of collective.h, over plain sockets.
 *
 * Plain sockets rather than ZeroMQ because the payloads are large float
 * buffers: we want to read straight into the caller's memory, keep exactly
 * one copy in flight, and see a dead peer as EOF on its own connection.
 *
 * A communicator is a full mesh of TCP connections.  Every socket is
 * non-blocking and every wait is a poll() bounded by the operation's
 * deadline, so a dead or stalled peer turns into an error message naming
 * it, never a hang.  Sends use MSG_NOSIGNAL: a closed peer is an EPIPE we
 * report, not a SIGPIPE that kills the worker.
 *
 * The file reads top to bottom:
 *   wire formats         handshake, ack and frame header (big-endian)
 *   listener             the socket a worker opens once, and its stash
 *   forming              tsr_tcp_comm_new: one poll loop that connects
 *                        down, accepts up, and serves the listener
 *   transfer engine      run_xfers: sends and receives progressed together
 *   operations           allreduce, allgather, broadcast, grouped send/recv, poll
 *
 * Security (issue 7).  The coordinator gives every piece of a replica the
 * same random secret per epoch.  An acceptor opens each connection with a
 * fresh nonce; the connector answers with its handshake, its own nonce and
 * HMAC-SHA256(secret, handshake, both nonces), and the acceptor's ack
 * carries the same proof the other way.  The handshake names the epoch, the
 * group and both ranks, and the nonces are new per connection, so a
 * handshake replayed from another connection or epoch fails.  Every frame
 * after that is sealed with AES-256-GCM: one key per direction from
 * HKDF(secret, nonces, handshake), the frame's sequence number as the
 * nonce and its header as associated data.  A stranger can still connect;
 * it cannot join, read or inject, and a pending handshake is dropped after
 * PENDING_MS (or sooner, when the slots are full and someone else calls).
 *
 * Payload floats travel in host byte order: the ranks of a replica run the
 * same build on the same kind of machine, and swapping megabytes of floats
 * per layer would cost more than it could ever save. */
#include "collective.h"
#include "common/safetensors.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#define HS_MAGIC 0x54535243u    /* "TSRC": challenge, handshake and ack */
#define FRAME_MAGIC 0x54535246u /* "TSRF": data frames */
#define PROTO_VERSION 2u        /* 2: authenticated handshake, sealed frames */
#define NONCE_LEN 16
#define MAC_LEN 32              /* HMAC-SHA256 */
#define KEY_LEN 32              /* AES-256 */
#define TAG_LEN 16              /* GCM tag after every frame's payload */
#define SECRET_MIN 16
#define SECRET_MAX 64
#define CHAL_LEN (8 + NONCE_LEN)            /* magic, version, acceptor's nonce */
#define HS_BODY 36                          /* magic, version, epoch, group, rank, n, peer */
#define HS_LEN (HS_BODY + NONCE_LEN + MAC_LEN) /* + connector's nonce, its proof */
#define ACK_LEN (16 + MAC_LEN)              /* magic, status, detail, the acceptor's proof */
#define HDR_LEN 32              /* magic, kind, epoch, seq, len */
#define CRYPT_CHUNK (1 << 30)   /* EVP lengths are ints */

/* Frames travel sealed.  A build with -DTSR_DATA_PLAIN sends them in the
 * clear (the handshake is still authenticated): for measuring what the
 * sealing costs, never for serving; both ends must be built alike. */
#ifdef TSR_DATA_PLAIN
static const bool data_plain = true;
#else
static const bool data_plain = false;
#endif

#define EP_MAX 300              /* "host:port"; a DNS name is at most 253 */
#define WHO_MAX (EP_MAX + 300)  /* a peer's worker and node names, then its endpoint */
#define STASH_MAX 32            /* connections waiting for another communicator */
#define PENDING_MAX 16          /* accepted connections still sending their handshake */
#define PENDING_MS 2000         /* ... each of which is dropped after this long */
#define SMALL_BYTES (64 * 1024) /* below this, allreduce is all-to-all */
#define INBOX_MAX ((size_t)256 << 20) /* eager receives held per peer */
#define RETRY_MIN_MS 20
#define RETRY_MAX_MS 200

/* Frame kinds: a receiver that expects one kind and gets another knows the
 * ranks disagree on the order of operations, and says so. */
enum { K_ALLREDUCE = 1, K_REDUCE_SCATTER, K_ALL_GATHER, K_BROADCAST, K_P2P, K_BARRIER, K_GATHER };

/* Ack statuses: why an acceptor refused a handshake. */
enum { ACK_OK = 0, ACK_VERSION, ACK_STALE, ACK_SIZE, ACK_RANK, ACK_DUP, ACK_FULL, ACK_EARLY,
       ACK_AUTH };

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void set_nodelay(int fd)
{
    int one = 1;
    /* Small frames (barrier, headers) must not wait for Nagle's 40 ms. */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* ---- wire formats --------------------------------------------------------- */

static void put32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24), p[1] = (uint8_t)(v >> 16), p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static void put64(uint8_t *p, uint64_t v)
{
    put32(p, (uint32_t)(v >> 32));
    put32(p + 4, (uint32_t)v);
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) << 32 | get32(p + 4);
}

/* A connector's handshake: it is rank `rank` of (epoch, group) with n
 * ranks, connecting to rank `peer`. */
typedef struct {
    uint32_t magic, version;
    uint64_t epoch, group;
    uint32_t rank, n, peer;
} hs_t;

static void hs_pack(uint8_t *b, const hs_t *h)
{
    put32(b, h->magic), put32(b + 4, h->version);
    put64(b + 8, h->epoch), put64(b + 16, h->group);
    put32(b + 24, h->rank), put32(b + 28, h->n), put32(b + 32, h->peer);
}

static void hs_unpack(const uint8_t *b, hs_t *h)
{
    h->magic = get32(b), h->version = get32(b + 4);
    h->epoch = get64(b + 8), h->group = get64(b + 16);
    h->rank = get32(b + 24), h->n = get32(b + 28), h->peer = get32(b + 32);
}

/* ---- handshake proofs and frame sealing ------------------------------------- */

/* HMAC-SHA256(secret, who, handshake, acceptor nonce, connector nonce,
 * status): 'C' is the connector's proof, 'A' the acceptor's. */
static bool hs_mac(const uint8_t *secret, size_t slen, char who, const uint8_t *hs,
                   const uint8_t *na, const uint8_t *nc, uint32_t status, uint8_t *out)
{
    uint8_t m[1 + HS_BODY + 2 * NONCE_LEN + 4];
    unsigned int ol = MAC_LEN;
    m[0] = (uint8_t)who;
    memcpy(m + 1, hs, HS_BODY);
    memcpy(m + 1 + HS_BODY, na, NONCE_LEN);
    memcpy(m + 1 + HS_BODY + NONCE_LEN, nc, NONCE_LEN);
    put32(m + 1 + HS_BODY + 2 * NONCE_LEN, status);
    return HMAC(EVP_sha256(), secret, (int)slen, m, sizeof m, out, &ol) != NULL;
}

static bool mac_ok(const uint8_t *secret, size_t slen, char who, const uint8_t *hs,
                   const uint8_t *na, const uint8_t *nc, uint32_t status, const uint8_t *mac)
{
    uint8_t want[MAC_LEN];
    return hs_mac(secret, slen, who, hs, na, nc, status, want) &&
           CRYPTO_memcmp(want, mac, MAC_LEN) == 0;
}

/* HKDF-SHA256 (RFC 5869) with the nonces as salt and the handshake as
 * info: two keys, connector-to-acceptor then acceptor-to-connector. */
static bool derive_keys(const uint8_t *secret, size_t slen, const uint8_t *hs, const uint8_t *na,
                        const uint8_t *nc, uint8_t *c2a, uint8_t *a2c)
{
    static const char label[16] = "tessera-data-v2";
    uint8_t salt[2 * NONCE_LEN], prk[32], m[KEY_LEN + sizeof label + HS_BODY + 1];
    unsigned int ol = 32;
    bool ok;
    memcpy(salt, na, NONCE_LEN);
    memcpy(salt + NONCE_LEN, nc, NONCE_LEN);
    ok = HMAC(EVP_sha256(), salt, sizeof salt, secret, slen, prk, &ol) != NULL;
    memcpy(m, label, sizeof label);
    memcpy(m + sizeof label, hs, HS_BODY);
    m[sizeof label + HS_BODY] = 1;
    ok = ok && HMAC(EVP_sha256(), prk, sizeof prk, m, sizeof label + HS_BODY + 1, c2a, &ol);
    memcpy(m, c2a, KEY_LEN);
    memcpy(m + KEY_LEN, label, sizeof label);
    memcpy(m + KEY_LEN + sizeof label, hs, HS_BODY);
    m[KEY_LEN + sizeof label + HS_BODY] = 2;
    ok = ok && HMAC(EVP_sha256(), prk, sizeof prk, m, sizeof m, a2c, &ol);
    OPENSSL_cleanse(prk, sizeof prk);
    return ok;
}

static EVP_CIPHER_CTX *gcm_new(const uint8_t *key, bool enc)
{
    EVP_CIPHER_CTX *x = EVP_CIPHER_CTX_new();
    if (x && EVP_CipherInit_ex(x, EVP_aes_256_gcm(), NULL, key, NULL, enc ? 1 : 0) != 1)
        EVP_CIPHER_CTX_free(x), x = NULL;
    return x;
}

/* out = AES-256-GCM(payload) then the tag; the header is authenticated
 * too.  The sequence number is the nonce: each key seals each one once. */
static bool seal(EVP_CIPHER_CTX *x, uint64_t seq, const uint8_t *hdr, const uint8_t *src,
                 size_t len, uint8_t *out)
{
    uint8_t iv[12] = {0}, fin[16];
    int ol;
    put64(iv + 4, seq);
    if (EVP_EncryptInit_ex(x, NULL, NULL, NULL, iv) != 1 ||
        EVP_EncryptUpdate(x, NULL, &ol, hdr, HDR_LEN) != 1)
        return false;
    for (size_t off = 0; off < len;) {
        int step = len - off > CRYPT_CHUNK ? CRYPT_CHUNK : (int)(len - off);
        if (EVP_EncryptUpdate(x, out + off, &ol, src + off, step) != 1) return false;
        off += (size_t)step;
    }
    return EVP_EncryptFinal_ex(x, fin, &ol) == 1 &&
           EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_GET_TAG, TAG_LEN, out + len) == 1;
}

/* Decrypts buf in place; false when the tag does not match. */
static bool unseal(EVP_CIPHER_CTX *x, uint64_t seq, const uint8_t *hdr, uint8_t *buf,
                   size_t len, uint8_t *tag)
{
    uint8_t iv[12] = {0}, fin[16];
    int ol;
    put64(iv + 4, seq);
    if (EVP_DecryptInit_ex(x, NULL, NULL, NULL, iv) != 1 ||
        EVP_DecryptUpdate(x, NULL, &ol, hdr, HDR_LEN) != 1)
        return false;
    for (size_t off = 0; off < len;) {
        int step = len - off > CRYPT_CHUNK ? CRYPT_CHUNK : (int)(len - off);
        if (EVP_DecryptUpdate(x, buf + off, &ol, buf + off, step) != 1) return false;
        off += (size_t)step;
    }
    return EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_SET_TAG, TAG_LEN, tag) == 1 &&
           EVP_DecryptFinal_ex(x, fin, &ol) > 0;
}

static const char *kind_name(uint32_t kind)
{
    switch (kind) {
    case K_ALLREDUCE: return "allreduce";
    case K_REDUCE_SCATTER: return "allreduce (reduce-scatter)";
    case K_ALL_GATHER: return "allreduce (all-gather)";
    case K_BROADCAST: return "broadcast";
    case K_P2P: return "point-to-point";
    case K_BARRIER: return "barrier";
    case K_GATHER: return "allgather";
    default: return "unknown";
    }
}

/* The acceptor's reason for a refusal, from the connector's side. */
static void ack_describe(uint32_t status, uint64_t detail, const hs_t *me, char *out,
                         size_t outlen)
{
    switch (status) {
    case ACK_VERSION:
        snprintf(out, outlen, "it speaks protocol version %llu, this rank %u",
                 (unsigned long long)detail, PROTO_VERSION);
        break;
    case ACK_STALE:
        snprintf(out, outlen, "epoch %llu is older than its epoch %llu",
                 (unsigned long long)me->epoch, (unsigned long long)detail);
        break;
    case ACK_SIZE:
        snprintf(out, outlen, "it forms group %llu with %llu ranks, this rank with %u",
                 (unsigned long long)me->group, (unsigned long long)detail, me->n);
        break;
    case ACK_RANK:
        snprintf(out, outlen, "rank %u is not one that connects to it in a group of %u",
                 me->rank, me->n);
        break;
    case ACK_DUP:
        snprintf(out, outlen, "rank %u of group %llu is already connected there", me->rank,
                 (unsigned long long)me->group);
        break;
    case ACK_FULL:
        snprintf(out, outlen, "it holds %d connections for other groups already", STASH_MAX);
        break;
    case ACK_EARLY:
        snprintf(out, outlen, "epoch %llu is newer than the epoch %llu it is forming",
                 (unsigned long long)me->epoch, (unsigned long long)detail);
        break;
    case ACK_AUTH:
        snprintf(out, outlen, "the handshake does not prove the replica's secret for epoch %llu "
                 "(a stranger, a replayed handshake, or a peer given another secret)",
                 (unsigned long long)me->epoch);
        break;
    default: snprintf(out, outlen, "unknown refusal %u", status); break;
    }
}

/* "host:port" or "[v6]:port" -> host, port.  0 or -1. */
static int split_endpoint(const char *ep, char *host, size_t hostlen, char *port, size_t portlen)
{
    const char *colon = ep ? strrchr(ep, ':') : NULL;
    if (!colon || colon == ep || !colon[1]) return -1;
    const char *h = ep;
    size_t hl = (size_t)(colon - ep);
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') h++, hl -= 2;
    if (hl == 0 || hl >= hostlen || strlen(colon + 1) >= portlen) return -1;
    memcpy(host, h, hl);
    host[hl] = '\0';
    snprintf(port, portlen, "%s", colon + 1);
    return 0;
}

/* ---- listener ------------------------------------------------------------------ */

/* A connection that completed its handshake for a communicator of the
 * epoch being formed that this worker was not forming at the time (its
 * pipeline link while it formed its TP group, say).  It was authenticated
 * and acked already; the communicator claims it later, with the keys. */
typedef struct {
    int fd;
    uint64_t epoch, group;
    uint32_t rank, n, peer;
    uint8_t tx_key[KEY_LEN], rx_key[KEY_LEN];
    uint8_t secret[SECRET_MAX]; /* it was proven with: the claimer must hold the same */
    size_t secret_len;
} stash_t;

/* The secret of an epoch this worker formed communicators for. */
typedef struct {
    uint64_t epoch;
    uint8_t secret[SECRET_MAX];
    size_t len;                 /* 0: unused */
} known_t;

#define KNOWN_MAX 2             /* the epoch being formed and the one before */

struct former;

struct tsr_tcp_listener {
    int fd;
    int port;
    char endpoint[EP_MAX];
    pthread_mutex_t mu;         /* guards stash, nstash, formers and known */
    stash_t stash[STASH_MAX];
    int nstash;
    struct former *formers;     /* tsr_tcp_comm_new calls running on it now */
    /* A handshake of another epoch is answered (stale, early) only when it
     * proves one of these: to anyone else every refusal looks alike, so a
     * stranger cannot learn the epoch from the port (issue 38, item 12). */
    known_t known[KNOWN_MAX];
};

static bool is_wildcard(const char *host)
{
    return !host || !*host || !strcmp(host, "0.0.0.0") || !strcmp(host, "::") ||
           !strcmp(host, "*");
}

static void format_endpoint(tsr_tcp_listener_t *l, const char *host)
{
    if (is_wildcard(host)) host = "127.0.0.1";
    if (strchr(host, ':'))
        snprintf(l->endpoint, sizeof l->endpoint, "[%s]:%d", host, l->port);
    else
        snprintf(l->endpoint, sizeof l->endpoint, "%s:%d", host, l->port);
}

/* Binds and listens; returns the fd and the port actually bound. */
static int listen_socket(const char *host, int port, int *bound, char *err, size_t errlen)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    char portstr[16];
    int fd = -1, one = 1;
    snprintf(portstr, sizeof portstr, "%d", port);
    int r = getaddrinfo(host, portstr, &hints, &ai);
    if (r) {
        snprintf(err, errlen, "cannot listen on %s:%d: %s", host, port, gai_strerror(r));
        goto out;
    }
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(err, errlen, "cannot listen on %s:%d: socket: %s", host, port, strerror(errno));
        goto out;
    }
    /* A restarted worker must be able to take its port back at once. */
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) || listen(fd, 128) ||
        getsockname(fd, (struct sockaddr *)&ss, &sl)) {
        snprintf(err, errlen, "cannot listen on %s:%d: %s", host, port, strerror(errno));
        close(fd);
        fd = -1;
        goto out;
    }
    *bound = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                            : ((struct sockaddr_in *)&ss)->sin_port);
out:
    if (ai) freeaddrinfo(ai);
    return fd;
}

tsr_tcp_listener_t *tsr_tcp_listen(const char *bind_host, int port, char *err, size_t errlen)
{
    tsr_tcp_listener_t *l = NULL;
    const char *host = is_wildcard(bind_host) ? "0.0.0.0" : bind_host;
    int bound = 0;
    if (port < 0 || port > 65535) {
        snprintf(err, errlen, "cannot listen on %s:%d: port out of range", host, port);
        return NULL;
    }
    int fd = listen_socket(host, port, &bound, err, errlen);
    if (fd < 0) return NULL;
    if (!(l = calloc(1, sizeof *l))) {
        snprintf(err, errlen, "cannot listen on %s:%d: out of memory", host, port);
        close(fd);
        return NULL;
    }
    l->fd = fd;
    l->port = bound;
    pthread_mutex_init(&l->mu, NULL);
    format_endpoint(l, bind_host);
    return l;
}

int tsr_tcp_listener_advertise(tsr_tcp_listener_t *l, const char *host)
{
    if (!l || !host || !*host || strlen(host) + 8 >= sizeof l->endpoint) return -1;
    format_endpoint(l, host);
    return 0;
}

const char *tsr_tcp_listener_endpoint(const tsr_tcp_listener_t *l)
{
    return l->endpoint;
}

int tsr_tcp_listener_fd(const tsr_tcp_listener_t *l)
{
    return l->fd;
}

void tsr_tcp_listener_destroy(tsr_tcp_listener_t **l_p)
{
    if (!l_p || !*l_p) return;
    tsr_tcp_listener_t *l = *l_p;
    for (int i = 0; i < l->nstash; i++) close(l->stash[i].fd);
    OPENSSL_cleanse(l->stash, sizeof l->stash);
    OPENSSL_cleanse(l->known, sizeof l->known);
    close(l->fd);
    pthread_mutex_destroy(&l->mu);
    free(l);
    *l_p = NULL;
}

/* Keeps the secret of the epoch now formed, in place of the oldest known
 * (an epoch older than both is not kept). */
static void known_put(tsr_tcp_listener_t *l, uint64_t epoch, const uint8_t *secret, size_t len)
{
    pthread_mutex_lock(&l->mu);
    known_t *k = NULL;
    for (int i = 0; i < KNOWN_MAX; i++) {
        known_t *o = &l->known[i];
        if (o->len && o->epoch == epoch) {
            k = o;
            break;
        }
        if (!k || !o->len || (k->len && o->epoch < k->epoch)) k = o;
    }
    if (k->epoch == epoch || !k->len || k->epoch < epoch) {
        k->epoch = epoch;
        memcpy(k->secret, secret, len);
        k->len = len;
    }
    pthread_mutex_unlock(&l->mu);
}

/* A newer epoch retires the old plan: its half-formed links are useless. */
static void stash_drop_older(tsr_tcp_listener_t *l, uint64_t epoch)
{
    pthread_mutex_lock(&l->mu);
    for (int i = 0; i < l->nstash;) {
        if (l->stash[i].epoch < epoch) {
            close(l->stash[i].fd);
            l->stash[i] = l->stash[--l->nstash];
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&l->mu);
}

/* ---- the communicator ------------------------------------------------------ */

/* A message that arrived while this rank was itself sending (see eager
 * receive in run_xfers); recv takes it from here first. */
typedef struct inbox_msg {
    struct inbox_msg *next;
    size_t len;
    bool complete;
    uint8_t data[];
} inbox_msg_t;

/* Where the frame being received on a connection stands.  It lives in the
 * peer, not in an operation, because a frame can start arriving during a
 * send (eagerly, into the inbox) and finish during the matching recv. */
typedef struct {
    uint8_t hdr[HDR_LEN];
    size_t hdr_got;
    bool hdr_ok;                /* complete, and its magic, epoch and seq checked */
    bool placed;                /* the payload has a destination */
    uint32_t kind;
    uint64_t len;
    uint8_t *dst;
    size_t got;
    inbox_msg_t *eager;         /* dst is this inbox entry's data */
    uint64_t seq;
    uint8_t tag[TAG_LEN];       /* follows the payload */
    size_t tag_got;
} rx_t;

typedef struct {
    int fd;
    char endpoint[EP_MAX];
    /* How messages name this peer: "worker NAME on node NODE, host:port"
     * when the rendezvous named it (an operator knows workers, not
     * addresses), else its endpoint. */
    char who[WHO_MAX];
    uint64_t tx_seq, rx_seq;    /* frames sent and received on this connection */
    EVP_CIPHER_CTX *tx_gcm, *rx_gcm; /* this connection's keys, one per direction */
    uint8_t *txbuf;             /* the sealed frame being sent, kept between calls */
    size_t txcap;
    rx_t rx;
    inbox_msg_t *inbox, *inbox_tail;
    size_t inbox_bytes;
} peer_t;

/* One send or receive of one frame, progressed by run_xfers. */
typedef struct {
    int peer;
    bool is_send;
    bool complete;
    uint32_t kind;
    const uint8_t *src;         /* send payload */
    uint8_t *dst;               /* receive destination */
    size_t len;
    size_t done;                /* send: header + payload bytes written */
    uint8_t hdr[HDR_LEN];
} xfer_t;

struct tsr_comm {
    int rank, n;
    uint64_t epoch, group;
    peer_t *peers;              /* n entries; peers[rank].fd stays -1 */
    xfer_t *ops;                /* 2n: at most one send and one receive per peer */
    int *send_op, *recv_op;     /* per peer: its op in the current run, or -1 */
    bool *paused;               /* per peer: eager receive stopped (see rx_place_eager) */
    struct pollfd *pfd;
    int *pfd_peer;
    float *scratch;
    size_t scratch_cap;         /* floats */
    bool broken;
    bool past_deadline;         /* the first failure was an operation's deadline */
    char broken_msg[256];
    /* The rendezvous's cancellation (a newer epoch, a stop): asked whenever
     * an operation has waited CANCEL_CHECK_MS without news, so a wait on a
     * stalled peer ends soon after the epoch does, not at its deadline. */
    int (*cancelled)(void *arg);
    void *cancel_arg;
};

#define CANCEL_CHECK_MS 20

static void comm_free(tsr_comm_t *c)
{
    if (!c) return;
    for (int p = 0; c->peers && p < c->n; p++) {
        if (c->peers[p].fd >= 0) close(c->peers[p].fd);
        EVP_CIPHER_CTX_free(c->peers[p].tx_gcm);
        EVP_CIPHER_CTX_free(c->peers[p].rx_gcm);
        free(c->peers[p].txbuf);
        for (inbox_msg_t *m = c->peers[p].inbox, *next; m; m = next) {
            next = m->next;
            free(m);
        }
    }
    free(c->peers);
    free(c->ops);
    free(c->send_op);
    free(c->recv_op);
    free(c->paused);
    free(c->pfd);
    free(c->pfd_peer);
    free(c->scratch);
    free(c);
}

static tsr_comm_t *comm_alloc(uint64_t epoch, uint64_t group, int rank, int n)
{
    tsr_comm_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->rank = rank, c->n = n, c->epoch = epoch, c->group = group;
    size_t un = (size_t)n;
    c->peers = calloc(un, sizeof *c->peers);
    c->ops = calloc(2 * un, sizeof *c->ops);
    c->send_op = calloc(un, sizeof *c->send_op);
    c->recv_op = calloc(un, sizeof *c->recv_op);
    c->paused = calloc(un, sizeof *c->paused);
    c->pfd = calloc(un, sizeof *c->pfd);
    c->pfd_peer = calloc(un, sizeof *c->pfd_peer);
    if (!c->peers || !c->ops || !c->send_op || !c->recv_op || !c->paused || !c->pfd ||
        !c->pfd_peer) {
        comm_free(c);
        return NULL;
    }
    for (int p = 0; p < n; p++) c->peers[p].fd = -1;
    return c;
}

/* Takes fd as peer p's connection, keyed; false (fd not taken) when out of memory. */
static bool peer_attach(tsr_comm_t *c, int p, int fd, const uint8_t *tx_key,
                        const uint8_t *rx_key)
{
    peer_t *pe = &c->peers[p];
    pe->tx_gcm = gcm_new(tx_key, true);
    pe->rx_gcm = gcm_new(rx_key, false);
    if (!pe->tx_gcm || !pe->rx_gcm) {
        EVP_CIPHER_CTX_free(pe->tx_gcm);
        EVP_CIPHER_CTX_free(pe->rx_gcm);
        pe->tx_gcm = pe->rx_gcm = NULL;
        return false;
    }
    pe->fd = fd;
    return true;
}

/* Scratch floats for an operation, kept between calls: allreduce runs
 * twice per layer and should not allocate each time. */
static float *scratch(tsr_comm_t *c, size_t floats, char *err, size_t errlen)
{
    if (floats <= c->scratch_cap) return c->scratch;
    float *s = realloc(c->scratch, floats * sizeof(float));
    if (!s) {
        snprintf(err, errlen, "out of memory for %zu bytes of allreduce scratch",
                 floats * sizeof(float));
        return NULL;
    }
    c->scratch = s;
    c->scratch_cap = floats;
    return s;
}

/* ---- forming a communicator --------------------------------------------------- */

typedef enum { OUT_WAIT, OUT_CONNECTING, OUT_CHAL, OUT_ACK, OUT_DONE } out_state_t;

/* This rank's connection to one lower rank: connect, read the acceptor's
 * challenge, send the handshake, read the ack. */
typedef struct {
    out_state_t st;
    int fd;
    int64_t next_try;
    int backoff;
    uint8_t chal[CHAL_LEN];     /* the acceptor's challenge (its nonce) */
    uint8_t ack[ACK_LEN];
    uint8_t hello[HS_LEN];      /* what we sent: the ack's proof covers it */
    size_t got;
    char why[200];              /* how the last attempt failed, for the timeout message */
} outgoing_t;

/* An accepted connection whose handshake has not fully arrived.  It was
 * sent our nonce at once; it has until `deadline` to answer. */
typedef struct {
    int fd;
    uint8_t hs[HS_LEN];
    size_t got;
    uint8_t nonce[NONCE_LEN];
    int64_t since, deadline;
} pending_t;

typedef struct former {
    tsr_tcp_listener_t *l;
    tsr_comm_t *c;
    int (*cancelled)(void *arg);  /* asked each turn; NULL: never */
    void *cancel_arg;
    hs_t me;
    const uint8_t *secret;
    size_t secret_len;
    outgoing_t *out;            /* one per lower rank */
    pending_t pend[PENDING_MAX];
    /* Fixed layout: [0] listener, [1] wake_fd, [2..] pending, then one per
     * lower rank; unused entries have fd -1, which poll() skips. */
    struct pollfd *pfd;
    int npfd;
    /* Another thread forming on the same listener may stash a connection
     * for us; it signals this eventfd so our poll wakes (l->formers). */
    int wake_fd;
    struct former *next;
    char refused[300];          /* the last handshake refused here, for the timeout message */
    int64_t deadline;
    int timeout_ms;
} former_t;

#define PFD_PENDING 2
#define PFD_OUT (PFD_PENDING + PENDING_MAX)

/* Whether a handshake for our own (epoch, group) may take a peer slot. */
static uint32_t judge_mine(const former_t *f, const hs_t *h, uint64_t *detail)
{
    const tsr_comm_t *c = f->c;
    if (h->n != (uint32_t)c->n) {
        *detail = (uint64_t)c->n;
        return ACK_SIZE;
    }
    if (h->rank <= (uint32_t)c->rank || h->rank >= (uint32_t)c->n ||
        h->peer != (uint32_t)c->rank)
        return ACK_RANK;
    if (c->peers[h->rank].fd >= 0) return ACK_DUP;
    return ACK_OK;
}

static void note_refusal(former_t *f, const hs_t *h, uint32_t status, uint64_t detail)
{
    char why[200];
    ack_describe(status, detail, h, why, sizeof why);
    snprintf(f->refused, sizeof f->refused,
             "refused a connection from rank %u (epoch %llu, group %llu): %s", h->rank,
             (unsigned long long)h->epoch, (unsigned long long)h->group, why);
}

/* The ack, with the acceptor's proof when it accepts (a refusal carries
 * none: the connector gives up, which a stranger could make it do anyway
 * by closing the connection). */
static bool send_ack(int fd, uint32_t status, uint64_t detail, const former_t *f,
                     const uint8_t *hs, const uint8_t *na, const uint8_t *nc)
{
    uint8_t b[ACK_LEN] = {0};
    put32(b, HS_MAGIC), put32(b + 4, status), put64(b + 8, detail);
    if (status == ACK_OK && !hs_mac(f->secret, f->secret_len, 'A', hs, na, nc, status, b + 16))
        return false;
    /* 48 bytes into a fresh socket's empty buffer: all or nothing. */
    return send(fd, b, sizeof b, MSG_NOSIGNAL) == (ssize_t)sizeof b;
}

/* Takes the connections for this communicator that an earlier (or a
 * concurrent) comm_new on the same listener accepted and stashed. */
static void claim_stash(former_t *f)
{
    tsr_tcp_listener_t *l = f->l;
    pthread_mutex_lock(&l->mu);
    for (int i = 0; i < l->nstash;) {
        stash_t s = l->stash[i];
        if (s.epoch != f->me.epoch || s.group != f->me.group) {
            i++;
            continue;
        }
        l->stash[i] = l->stash[--l->nstash];
        hs_t h = {HS_MAGIC, PROTO_VERSION, s.epoch, s.group, s.rank, s.n, s.peer};
        uint64_t detail = 0;
        uint32_t st = judge_mine(f, &h, &detail);
        if (st == ACK_OK && (s.secret_len != f->secret_len ||
                             CRYPTO_memcmp(s.secret, f->secret, s.secret_len)))
            st = ACK_AUTH;
        if (st == ACK_OK && peer_attach(f->c, (int)s.rank, s.fd, s.tx_key, s.rx_key)) {
            /* taken */
        } else {
            /* It was acked when stashed; closing is the only refusal left. */
            note_refusal(f, &h, st, detail);
            close(s.fd);
        }
        OPENSSL_cleanse(&s, sizeof s);
    }
    pthread_mutex_unlock(&l->mu);
}

/* Stashes an authenticated connection for another communicator of our
 * epoch and acks it.  Returns ACK_OK when fd was taken (stashed, or closed
 * because the connector vanished before the ack), else the refusal. */
static uint32_t stash_put(former_t *f, int fd, const hs_t *h, const pending_t *pd,
                          const uint8_t *c2a, const uint8_t *a2c)
{
    tsr_tcp_listener_t *l = f->l;
    uint32_t st = ACK_OK;
    if (h->n == 0 || h->rank == 0 || h->rank >= h->n || h->peer >= h->rank) return ACK_RANK;
    pthread_mutex_lock(&l->mu);
    for (int i = 0; i < l->nstash && st == ACK_OK; i++)
        if (l->stash[i].epoch == h->epoch && l->stash[i].group == h->group &&
            l->stash[i].rank == h->rank)
            st = ACK_DUP;
    if (st == ACK_OK && l->nstash == STASH_MAX) st = ACK_FULL;
    /* Ack under the lock, so a connection is never stashed unacked. */
    if (st == ACK_OK && send_ack(fd, ACK_OK, 0, f, pd->hs, pd->nonce, pd->hs + HS_BODY)) {
        stash_t *s = &l->stash[l->nstash++];
        *s = (stash_t){fd, h->epoch, h->group, h->rank, h->n, h->peer, {0}, {0}, {0}, 0};
        memcpy(s->tx_key, a2c, KEY_LEN);
        memcpy(s->rx_key, c2a, KEY_LEN);
        memcpy(s->secret, f->secret, f->secret_len);
        s->secret_len = f->secret_len;
        for (former_t *o = l->formers; o; o = o->next)
            if (o != f) eventfd_write(o->wake_fd, 1);
    } else if (st == ACK_OK) {
        close(fd);
    }
    pthread_mutex_unlock(&l->mu);
    return st;
}

/* Whether the handshake proves a secret this rank may answer it under:
 * this epoch's for this epoch, or any epoch's it formed for another epoch
 * (a peer of the replica that is behind, or ahead with a secret it shared).
 * Every known secret is tried, so the work does not tell which matched. */
static bool hs_proven(former_t *f, const hs_t *h, const pending_t *pd)
{
    const uint8_t *nc = pd->hs + HS_BODY, *mac = nc + NONCE_LEN;
    bool mine = mac_ok(f->secret, f->secret_len, 'C', pd->hs, pd->nonce, nc, 0, mac), other = false;
    pthread_mutex_lock(&f->l->mu);
    for (int i = 0; i < KNOWN_MAX; i++) {
        const known_t *k = &f->l->known[i];
        if (k->len && mac_ok(k->secret, k->len, 'C', pd->hs, pd->nonce, nc, 0, mac)) other = true;
    }
    pthread_mutex_unlock(&f->l->mu);
    return h->epoch == f->me.epoch ? mine : mine || other;
}

/* A complete handshake arrived on an accepted connection: take it for
 * this communicator, stash it for another one of this epoch, or refuse
 * it.  Nothing from another epoch is kept: we cannot check its proof (the
 * secret is per epoch), so holding it would let a stranger fill the stash
 * (issue 7, attack 3).  The proof is checked before the epoch: a handshake
 * that proves no secret this rank knows is refused alike at every epoch,
 * with no number in the ack, and only a proven peer learns that it is
 * stale or early.  A connector that is ahead (its secret not known here
 * yet) is refused so and retries. */
static void judge_handshake(former_t *f, int fd, const pending_t *pd)
{
    hs_t h;
    uint32_t st = ACK_OK;
    uint64_t detail = 0;
    uint8_t c2a[KEY_LEN], a2c[KEY_LEN];
    const uint8_t *nc = pd->hs + HS_BODY;
    hs_unpack(pd->hs, &h);
    if (h.magic != HS_MAGIC) {
        snprintf(f->refused, sizeof f->refused,
                 "closed a connection that did not open with the Tessera handshake");
        close(fd);
        return;
    }
    if (h.version != PROTO_VERSION) {
        st = ACK_VERSION, detail = PROTO_VERSION;
    } else if (!hs_proven(f, &h, pd)) {
        st = ACK_AUTH;
    } else if (h.epoch < f->me.epoch) {
        st = ACK_STALE, detail = f->me.epoch;
    } else if (h.epoch > f->me.epoch) {
        st = ACK_EARLY, detail = f->me.epoch;
    } else if (!derive_keys(f->secret, f->secret_len, pd->hs, pd->nonce, nc, c2a, a2c)) {
        st = ACK_AUTH;
    } else if (h.group == f->me.group) {
        st = judge_mine(f, &h, &detail);
        if (st == ACK_OK && peer_attach(f->c, (int)h.rank, fd, a2c, c2a)) {
            if (!send_ack(fd, ACK_OK, 0, f, pd->hs, pd->nonce, nc)) {
                /* It vanished: free the slot for its retry. */
                EVP_CIPHER_CTX_free(f->c->peers[h.rank].tx_gcm);
                EVP_CIPHER_CTX_free(f->c->peers[h.rank].rx_gcm);
                f->c->peers[h.rank].tx_gcm = f->c->peers[h.rank].rx_gcm = NULL;
                f->c->peers[h.rank].fd = -1;
                close(fd);
            }
            goto out;
        }
    } else {
        st = stash_put(f, fd, &h, pd, c2a, a2c);
        if (st == ACK_OK) goto out;
    }
    if (st != ACK_OK) {
        send_ack(fd, st, detail, f, NULL, NULL, NULL);
        note_refusal(f, &h, st, detail);
    }
    close(fd);
out:
    OPENSSL_cleanse(c2a, sizeof c2a);
    OPENSSL_cleanse(a2c, sizeof a2c);
}

/* Accepts what is waiting and sends each its challenge.  With every slot
 * taken, the oldest pending connection makes room: an honest peer answers
 * within a round trip, so idle strangers cannot keep it out. */
static void accept_new(former_t *f)
{
    for (int i = 0; i < 4 * PENDING_MAX; i++) {
        /* EAGAIN: the backlog is empty, or a concurrent comm_new took it. */
        int fd = accept4(f->l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return;
        int k = -1;
        for (int j = 0; j < PENDING_MAX; j++) {
            if (f->pend[j].fd < 0) {
                k = j;
                break;
            }
            if (k < 0 || f->pend[j].since < f->pend[k].since) k = j;
        }
        pending_t *pd = &f->pend[k];
        if (pd->fd >= 0) {
            close(pd->fd);
            /* A refused handshake says more than an idle stranger: keep it. */
            if (!f->refused[0])
                snprintf(f->refused, sizeof f->refused,
                         "dropped a connection that sent no handshake, to make room");
        }
        set_nodelay(fd);
        *pd = (pending_t){.fd = fd, .since = now_ms()};
        pd->deadline = pd->since + PENDING_MS;
        uint8_t chal[CHAL_LEN];
        put32(chal, HS_MAGIC), put32(chal + 4, PROTO_VERSION);
        if (RAND_bytes(pd->nonce, NONCE_LEN) != 1) {
            close(fd);
            pd->fd = -1;
            continue;
        }
        memcpy(chal + 8, pd->nonce, NONCE_LEN);
        if (send(fd, chal, sizeof chal, MSG_NOSIGNAL) != (ssize_t)sizeof chal) {
            close(fd);
            pd->fd = -1;
        }
    }
}

static void read_handshake(former_t *f, int k)
{
    pending_t *pd = &f->pend[k];
    ssize_t r = recv(pd->fd, pd->hs + pd->got, HS_LEN - pd->got, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (r <= 0) {
        close(pd->fd);          /* the connector gave up or died: it will retry */
        pd->fd = -1;
        return;
    }
    pd->got += (size_t)r;
    if (pd->got < HS_LEN) return;
    int fd = pd->fd;
    pd->fd = -1;
    judge_handshake(f, fd, pd);
}

/* A handshake that has not arrived by its deadline is dropped. */
static void expire_pending(former_t *f, int64_t now)
{
    for (int k = 0; k < PENDING_MAX; k++) {
        if (f->pend[k].fd < 0 || now < f->pend[k].deadline) continue;
        close(f->pend[k].fd);
        f->pend[k].fd = -1;
        if (!f->refused[0])
            snprintf(f->refused, sizeof f->refused,
                     "dropped a connection that sent no handshake within %d ms", PENDING_MS);
    }
}

/* Closes the attempt and schedules the next one with a growing backoff:
 * the peer may simply not have started yet. */
static void retry_later(former_t *f, int j, int64_t now, const char *why)
{
    outgoing_t *o = &f->out[j];
    if (o->fd >= 0) close(o->fd);
    o->fd = -1;
    o->st = OUT_WAIT;
    o->next_try = now + o->backoff;
    o->backoff = o->backoff * 2 > RETRY_MAX_MS ? RETRY_MAX_MS : o->backoff * 2;
    snprintf(o->why, sizeof o->why, "%s", why);
}

/* The acceptor's challenge arrived: send our handshake, our nonce and the
 * proof over both. */
static void send_hello(former_t *f, int j, int64_t now)
{
    outgoing_t *o = &f->out[j];
    hs_t h = f->me;
    h.peer = (uint32_t)j;
    hs_pack(o->hello, &h);
    uint8_t *nc = o->hello + HS_BODY;
    if (RAND_bytes(nc, NONCE_LEN) != 1 ||
        !hs_mac(f->secret, f->secret_len, 'C', o->hello, o->chal + 8, nc, 0, nc + NONCE_LEN)) {
        retry_later(f, j, now, "no random nonce or proof for the handshake");
        return;
    }
    if (send(o->fd, o->hello, HS_LEN, MSG_NOSIGNAL) != (ssize_t)HS_LEN) {
        retry_later(f, j, now, strerror(errno));
        return;
    }
    o->st = OUT_ACK;
    o->got = 0;
}

static void start_connect(former_t *f, int j, int64_t now)
{
    outgoing_t *o = &f->out[j];
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    char host[EP_MAX], port[16];
    /* Checked when the communicator was set up, so this cannot fail. */
    split_endpoint(f->c->peers[j].endpoint, host, sizeof host, port, sizeof port);
    int r = getaddrinfo(host, port, &hints, &ai);
    if (r) {
        retry_later(f, j, now, gai_strerror(r));
        goto out;
    }
    o->fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (o->fd < 0) {
        retry_later(f, j, now, strerror(errno));
        goto out;
    }
    set_nodelay(o->fd);
    o->got = 0;
    if (connect(o->fd, ai->ai_addr, ai->ai_addrlen) == 0)
        o->st = OUT_CHAL;
    else if (errno == EINPROGRESS)
        o->st = OUT_CONNECTING;
    else
        retry_later(f, j, now, strerror(errno));
out:
    if (ai) freeaddrinfo(ai);
}

static void finish_connect(former_t *f, int j, int64_t now)
{
    int e = 0;
    socklen_t el = sizeof e;
    if (getsockopt(f->out[j].fd, SOL_SOCKET, SO_ERROR, &e, &el) < 0) e = errno;
    if (e) {
        retry_later(f, j, now, strerror(e));
    } else {
        f->out[j].st = OUT_CHAL;
        f->out[j].got = 0;
    }
}

/* Reads toward want bytes into buf.  1: complete, 0: not yet, -1: the
 * attempt failed and was scheduled for a retry. */
static int out_read(former_t *f, int j, int64_t now, uint8_t *buf, size_t want, const char *what)
{
    outgoing_t *o = &f->out[j];
    ssize_t r = recv(o->fd, buf + o->got, want - o->got, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    if (r <= 0) {
        char why[160];
        if (r == 0) snprintf(why, sizeof why, "it closed the connection before %s", what);
        else snprintf(why, sizeof why, "%s", strerror(errno));
        retry_later(f, j, now, why);
        return -1;
    }
    o->got += (size_t)r;
    return o->got == want;
}

static void read_challenge(former_t *f, int j, int64_t now)
{
    outgoing_t *o = &f->out[j];
    if (out_read(f, j, now, o->chal, CHAL_LEN, "sending its challenge") != 1) return;
    if (get32(o->chal) != HS_MAGIC) {
        retry_later(f, j, now, "it did not open with the Tessera challenge");
        return;
    }
    if (get32(o->chal + 4) != PROTO_VERSION) {
        char why[120];
        snprintf(why, sizeof why, "it speaks data-port protocol version %u, this rank %u",
                 get32(o->chal + 4), PROTO_VERSION);
        retry_later(f, j, now, why);
        return;
    }
    send_hello(f, j, now);
}

/* Reads the acceptor's answer.  A refusal is final (retrying would only be
 * refused again, so comm_new fails now with the reason), except that an
 * acceptor still forming an older epoch will get to ours. */
static int read_ack(former_t *f, int j, int64_t now, char *err, size_t errlen)
{
    outgoing_t *o = &f->out[j];
    if (out_read(f, j, now, o->ack, ACK_LEN, "answering the handshake") != 1) return 0;
    uint32_t magic = get32(o->ack), status = get32(o->ack + 4);
    uint64_t detail = get64(o->ack + 8);
    const uint8_t *nc = o->hello + HS_BODY;
    if (magic != HS_MAGIC) {
        retry_later(f, j, now, "it answered the handshake with something else than an ack");
        return 0;
    }
    if (status == ACK_EARLY) {
        retry_later(f, j, now, "it is still forming an older epoch");
        return 0;
    }
    /* The acceptor may still be forming an older epoch, whose secret is not
     * ours: it cannot tell us from a stranger, so we try again. */
    if (status == ACK_AUTH) {
        retry_later(f, j, now, "the handshake does not prove the replica's secret there (it "
                               "may still be forming an older epoch, or was given another "
                               "secret)");
        return 0;
    }
    if (status != ACK_OK) {
        char why[200];
        ack_describe(status, detail, &f->me, why, sizeof why);
        snprintf(err, errlen, "rank %d (%s) refused rank %d of group %llu, epoch %llu: %s", j,
                 f->c->peers[j].who, f->c->rank, (unsigned long long)f->me.group,
                 (unsigned long long)f->me.epoch, why);
        return -1;
    }
    uint8_t c2a[KEY_LEN], a2c[KEY_LEN];
    if (!mac_ok(f->secret, f->secret_len, 'A', o->hello, o->chal + 8, nc, ACK_OK, o->ack + 16)) {
        retry_later(f, j, now, "it accepted without proof of the replica's secret (not the "
                               "rank the coordinator named, or given another secret)");
        return 0;
    }
    if (!derive_keys(f->secret, f->secret_len, o->hello, o->chal + 8, nc, c2a, a2c) ||
        !peer_attach(f->c, j, o->fd, c2a, a2c)) {
        retry_later(f, j, now, "out of memory for the connection's keys");
        return 0;
    }
    OPENSSL_cleanse(c2a, sizeof c2a);
    OPENSSL_cleanse(a2c, sizeof a2c);
    o->fd = -1;
    o->st = OUT_DONE;
    return 0;
}

static bool form_complete(const former_t *f)
{
    for (int p = 0; p < f->c->n; p++)
        if (p != f->c->rank && f->c->peers[p].fd < 0) return false;
    return true;
}

static void form_timeout_msg(const former_t *f, char *err, size_t errlen)
{
    const tsr_comm_t *c = f->c;
    int missing = 0, first = -1;
    for (int p = 0; p < c->n; p++)
        if (p != c->rank && c->peers[p].fd < 0 && missing++ == 0) first = p;
    char what[300];
    if (first < c->rank) {
        const outgoing_t *o = &f->out[first];
        snprintf(what, sizeof what, "could not connect to rank %d (%s): %s", first,
                 c->peers[first].who,
                 o->st == OUT_ACK          ? "no answer to the handshake"
                 : o->st == OUT_CHAL       ? "no challenge after connecting"
                 : o->st == OUT_CONNECTING ? "the connection did not complete"
                 : o->why[0]               ? o->why
                                           : "no attempt finished");
    } else {
        snprintf(what, sizeof what, "rank %d (%s) did not connect", first,
                 c->peers[first].who);
    }
    snprintf(err, errlen,
             "group %llu epoch %llu rank %d: %s within %d ms (%d of %d peers missing)%s%s",
             (unsigned long long)c->group, (unsigned long long)c->epoch, c->rank, what,
             f->timeout_ms, missing, c->n - 1, f->refused[0] ? "; " : "", f->refused);
}

/* Fills the poll set; returns how long poll may sleep. */
static int form_pollset(former_t *f, int64_t now)
{
    int64_t wake = f->deadline;
    for (int k = 0; k < PENDING_MAX; k++) {
        f->pfd[PFD_PENDING + k] = (struct pollfd){.fd = f->pend[k].fd, .events = POLLIN};
        if (f->pend[k].fd >= 0 && f->pend[k].deadline < wake) wake = f->pend[k].deadline;
    }
    /* The listener is served even by a rank that accepts nobody here: a
     * peer forming another of our communicators may be waiting for its
     * ack.  Served always: accept_new makes room when the slots are full. */
    f->pfd[0] = (struct pollfd){.fd = f->l->fd, .events = POLLIN};
    f->pfd[1] = (struct pollfd){.fd = f->wake_fd, .events = POLLIN};
    for (int j = 0; j < f->c->rank; j++) {
        const outgoing_t *o = &f->out[j];
        short ev = o->st == OUT_CONNECTING                   ? POLLOUT
                   : o->st == OUT_CHAL || o->st == OUT_ACK ? POLLIN
                                                           : 0;
        f->pfd[PFD_OUT + j] = (struct pollfd){.fd = ev ? o->fd : -1, .events = ev};
        if (o->st == OUT_WAIT && o->next_try < wake) wake = o->next_try;
    }
    return wake > now ? (int)(wake - now) : 0;
}

static int form_serve(former_t *f, char *err, size_t errlen)
{
    int64_t now = now_ms();
    eventfd_t ignored;
    /* Reset before the next claim_stash, which will see what was stashed. */
    if (f->pfd[1].revents) eventfd_read(f->wake_fd, &ignored);
    for (int k = 0; k < PENDING_MAX; k++)
        if (f->pfd[PFD_PENDING + k].revents && f->pend[k].fd >= 0) read_handshake(f, k);
    if (f->pfd[0].revents) accept_new(f);
    for (int j = 0; j < f->c->rank; j++) {
        short rev = f->pfd[PFD_OUT + j].revents;
        if (!rev) continue;
        if (f->out[j].st == OUT_CONNECTING) finish_connect(f, j, now);
        else if (f->out[j].st == OUT_CHAL) read_challenge(f, j, now);
        else if (f->out[j].st == OUT_ACK && read_ack(f, j, now, err, errlen)) return -1;
    }
    return 0;
}

static int form_run(former_t *f, char *err, size_t errlen)
{
    for (;;) {
        if (f->cancelled && f->cancelled(f->cancel_arg)) {
            snprintf(err, errlen, "forming group %llu was cancelled (a newer plan replaced it)",
                     (unsigned long long)f->c->group);
            return -1;
        }
        claim_stash(f);
        if (form_complete(f)) return 0;
        int64_t now = now_ms();
        if (now >= f->deadline) {
            form_timeout_msg(f, err, errlen);
            return -1;
        }
        expire_pending(f, now);
        for (int j = 0; j < f->c->rank; j++)
            if (f->out[j].st == OUT_WAIT && now >= f->out[j].next_try) start_connect(f, j, now);
        int wait = form_pollset(f, now);
        int r = poll(f->pfd, (nfds_t)f->npfd, wait);
        if (r < 0 && errno != EINTR) {
            snprintf(err, errlen, "poll failed while forming group %llu: %s",
                     (unsigned long long)f->c->group, strerror(errno));
            return -1;
        }
        if (r > 0 && form_serve(f, err, errlen)) return -1;
    }
}

static int check_args(tsr_tcp_listener_t *l, int rank, int n, const char *const *endpoints,
                      size_t secret_len, char *err, size_t errlen)
{
    char host[EP_MAX], port[16];
    if (n < 1 || rank < 0 || rank >= n) {
        snprintf(err, errlen, "rank %d is not valid in a group of %d", rank, n);
        return -1;
    }
    if (n == 1) return 0;
    if (!l || !endpoints) {
        snprintf(err, errlen, "a group of %d needs a listener and endpoints", n);
        return -1;
    }
    if (secret_len < SECRET_MIN || secret_len > SECRET_MAX) {
        snprintf(err, errlen,
                 "a group of %d needs the replica's data-port secret (%d to %d bytes, from the "
                 "assignment), got %zu bytes: is the coordinator older than this worker?",
                 n, SECRET_MIN, SECRET_MAX, secret_len);
        return -1;
    }
    for (int p = 0; p < n; p++) {
        if (p == rank) continue;
        if (split_endpoint(endpoints[p], host, sizeof host, port, sizeof port)) {
            snprintf(err, errlen, "endpoint of rank %d \"%s\" is not host:port", p,
                     endpoints[p] ? endpoints[p] : "(null)");
            return -1;
        }
    }
    return 0;
}

static void former_release(former_t *f)
{
    for (int k = 0; k < PENDING_MAX; k++)
        if (f->pend[k].fd >= 0) close(f->pend[k].fd);     /* their connectors retry */
    for (int j = 0; f->out && j < f->c->rank; j++)
        if (f->out[j].fd >= 0) close(f->out[j].fd);
    free(f->out);
    free(f->pfd);
    pthread_mutex_lock(&f->l->mu);
    for (former_t **p = &f->l->formers; *p; p = &(*p)->next)
        if (*p == f) {
            *p = f->next;
            break;
        }
    pthread_mutex_unlock(&f->l->mu);
    if (f->wake_fd >= 0) close(f->wake_fd);
}

#ifdef TSR_TESTING
/* The fixed secret of tsr_tcp_comm_new: test builds only (collective.h). */
static const uint8_t test_secret[32] = "tessera test secret, not secret";

tsr_comm_t *tsr_tcp_comm_new(tsr_tcp_listener_t *l, uint64_t epoch, uint64_t group, int rank,
                             int n, const char *const *endpoints, int timeout_ms, char *err,
                             size_t errlen)
{
    return tsr_tcp_comm_new_cancellable(l, epoch, group, rank, n, endpoints, test_secret,
                                        sizeof test_secret, timeout_ms, NULL, NULL, err, errlen);
}
#endif

void tsr_tcp_listener_wake(tsr_tcp_listener_t *l)
{
    pthread_mutex_lock(&l->mu);
    for (former_t *o = l->formers; o; o = o->next) eventfd_write(o->wake_fd, 1);
    pthread_mutex_unlock(&l->mu);
}

/* While forming, a rank also acks and stashes connections for the other
 * communicators of its worker in the same epoch, so a peer that forms those
 * first is not held up.  What this cannot fix: two workers each waiting to
 * *accept* the other in different groups.  Forming every group in one
 * order on all workers (as by ascending group id) never meets that. */
static tsr_comm_t *comm_new(tsr_tcp_listener_t *l, uint64_t epoch, uint64_t group, int rank,
                            int n, const char *const *endpoints, const char *const *names,
                            const void *secret, size_t secret_len, int timeout_ms,
                            int (*cancelled)(void *arg), void *cancel_arg, char *err,
                            size_t errlen);

tsr_comm_t *tsr_tcp_comm_new_cancellable(tsr_tcp_listener_t *l, uint64_t epoch, uint64_t group,
                                         int rank, int n, const char *const *endpoints,
                                         const void *secret, size_t secret_len, int timeout_ms,
                                         int (*cancelled)(void *arg), void *cancel_arg,
                                         char *err, size_t errlen)
{
    return comm_new(l, epoch, group, rank, n, endpoints, NULL, secret, secret_len, timeout_ms,
                    cancelled, cancel_arg, err, errlen);
}

/* names: NULL, or each member's "worker NAME on node NODE" ("" unknown),
 * put before its endpoint wherever a message names it. */
static tsr_comm_t *comm_new(tsr_tcp_listener_t *l, uint64_t epoch, uint64_t group, int rank,
                            int n, const char *const *endpoints, const char *const *names,
                            const void *secret, size_t secret_len, int timeout_ms,
                            int (*cancelled)(void *arg), void *cancel_arg, char *err,
                            size_t errlen)
{
    tsr_comm_t *c = NULL, *ret = NULL;
    if (check_args(l, rank, n, endpoints, secret ? secret_len : 0, err, errlen)) return NULL;
    if (!(c = comm_alloc(epoch, group, rank, n))) {
        snprintf(err, errlen, "out of memory for a group of %d", n);
        return NULL;
    }
    c->cancelled = cancelled;
    c->cancel_arg = cancel_arg;
    if (n == 1) return c;
    for (int p = 0; p < n; p++)
        if (p != rank) {
            peer_t *pe = &c->peers[p];
            snprintf(pe->endpoint, EP_MAX, "%s", endpoints[p]);
            if (names && names[p] && names[p][0])
                snprintf(pe->who, sizeof pe->who, "%.280s, %s", names[p], pe->endpoint);
            else
                snprintf(pe->who, sizeof pe->who, "%s", pe->endpoint);
        }

    former_t f = {.l = l, .c = c, .timeout_ms = timeout_ms, .cancelled = cancelled,
                  .cancel_arg = cancel_arg, .secret = secret, .secret_len = secret_len};
    f.me = (hs_t){HS_MAGIC, PROTO_VERSION, epoch, group, (uint32_t)rank, (uint32_t)n, 0};
    f.deadline = now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    f.npfd = PFD_OUT + rank;
    for (int k = 0; k < PENDING_MAX; k++) f.pend[k].fd = -1;
    f.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (f.wake_fd < 0) {
        snprintf(err, errlen, "cannot form group %llu: eventfd: %s", (unsigned long long)group,
                 strerror(errno));
        goto out;
    }
    pthread_mutex_lock(&l->mu);
    f.next = l->formers;
    l->formers = &f;
    pthread_mutex_unlock(&l->mu);
    f.out = calloc((size_t)rank + 1, sizeof *f.out);
    f.pfd = calloc((size_t)f.npfd, sizeof *f.pfd);
    if (!f.out || !f.pfd) {
        snprintf(err, errlen, "cannot form group %llu: out of memory", (unsigned long long)group);
        goto out;
    }
    for (int j = 0; j < rank; j++) f.out[j] = (outgoing_t){.fd = -1, .backoff = RETRY_MIN_MS};
    stash_drop_older(l, epoch);
    known_put(l, epoch, secret, secret_len);
    if (form_run(&f, err, errlen)) goto out;
    ret = c;
    c = NULL;                   /* transferred */
out:
    former_release(&f);
    comm_free(c);
    return ret;
}

/* ---- transfer engine ------------------------------------------------------------ */

/* The deadline and the words for the error message of one operation. */
typedef struct {
    int64_t deadline;
    int timeout_ms;
    const char *what;
} opctx_t;

static opctx_t op_begin(int timeout_ms, const char *what)
{
    return (opctx_t){now_ms() + (timeout_ms > 0 ? timeout_ms : 0), timeout_ms, what};
}

/* Prepares one frame: the header, and the payload sealed into the peer's
 * send buffer (the header's len is the payload's; the tag follows it). */
static int xfer_send(tsr_comm_t *c, xfer_t *op, int peer, uint32_t kind, const void *src,
                     size_t len, char *err, size_t errlen)
{
    peer_t *pe = &c->peers[peer];
    uint64_t seq = pe->tx_seq++;
    *op = (xfer_t){.peer = peer, .is_send = true, .kind = kind, .src = src, .len = len};
    put32(op->hdr, FRAME_MAGIC), put32(op->hdr + 4, kind);
    put64(op->hdr + 8, c->epoch), put64(op->hdr + 16, seq);
    put64(op->hdr + 24, (uint64_t)len);
    if (data_plain) return 0;
    if (pe->txcap < len + TAG_LEN) {
        uint8_t *b = realloc(pe->txbuf, len + TAG_LEN);
        if (!b) {
            snprintf(err, errlen, "out of memory for a %zu-byte frame to rank %d", len, peer);
            return -1;
        }
        pe->txbuf = b;
        pe->txcap = len + TAG_LEN;
    }
    if (!seal(pe->tx_gcm, seq, op->hdr, src, len, pe->txbuf)) {
        snprintf(err, errlen, "sealing a %zu-byte frame to rank %d (%s) failed", len, peer,
                 pe->who);
        return -1;
    }
    op->src = pe->txbuf;
    op->len = len + TAG_LEN;
    return 0;
}

static void xfer_recv(xfer_t *op, int peer, uint32_t kind, void *dst, size_t len)
{
    *op = (xfer_t){.peer = peer, .kind = kind, .dst = dst, .len = len};
}

static int closed_msg(const tsr_comm_t *c, int p, const opctx_t *x, char *err, size_t errlen)
{
    snprintf(err, errlen, "connection to rank %d (%s) closed during %s", p, c->peers[p].who,
             x->what);
    return -1;
}

/* Writes as much of the frame as the socket takes.  1: all sent, 0: the
 * socket is full, -1: the connection failed. */
static int tx_pump(tsr_comm_t *c, xfer_t *op, const opctx_t *x, char *err, size_t errlen)
{
    peer_t *pe = &c->peers[op->peer];
    while (op->done < HDR_LEN + op->len) {
        struct iovec iov[2];
        int niov = 0;
        if (op->done < HDR_LEN)
            iov[niov++] = (struct iovec){op->hdr + op->done, HDR_LEN - op->done};
        if (op->len) {
            size_t off = op->done > HDR_LEN ? op->done - HDR_LEN : 0;
            iov[niov++] = (struct iovec){(void *)(op->src + off), op->len - off};
        }
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
        ssize_t r = sendmsg(pe->fd, &mh, MSG_NOSIGNAL);
        if (r >= 0) {
            op->done += (size_t)r;
            continue;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        if (errno == EPIPE || errno == ECONNRESET) return closed_msg(c, op->peer, x, err, errlen);
        snprintf(err, errlen, "sending to rank %d (%s) failed during %s: %s", op->peer,
                 pe->who, x->what, strerror(errno));
        return -1;
    }
    op->complete = true;
    return 1;
}

/* Reads until *got == want.  1: done, 0: nothing more for now, -1: failed. */
static int read_some(tsr_comm_t *c, int p, uint8_t *dst, size_t want, size_t *got,
                     const opctx_t *x, char *err, size_t errlen)
{
    while (*got < want) {
        ssize_t r = recv(c->peers[p].fd, dst + *got, want - *got, 0);
        if (r > 0) {
            *got += (size_t)r;
            continue;
        }
        if (r == 0) return closed_msg(c, p, x, err, errlen);
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        if (errno == ECONNRESET) return closed_msg(c, p, x, err, errlen);
        snprintf(err, errlen, "receiving from rank %d (%s) failed during %s: %s", p,
                 c->peers[p].who, x->what, strerror(errno));
        return -1;
    }
    return 1;
}

/* The header is checked before anything else is read: garbage from a peer
 * becomes an error here, never a wild write or a huge allocation. */
static int rx_check_header(tsr_comm_t *c, int p, const opctx_t *x, char *err, size_t errlen)
{
    peer_t *pe = &c->peers[p];
    rx_t *rx = &pe->rx;
    uint32_t magic = get32(rx->hdr);
    uint64_t epoch = get64(rx->hdr + 8), seq = get64(rx->hdr + 16);
    rx->kind = get32(rx->hdr + 4);
    rx->len = get64(rx->hdr + 24);
    if (magic != FRAME_MAGIC) {
        snprintf(err, errlen,
                 "rank %d (%s) sent a frame with bad magic 0x%08x during %s: not a Tessera peer, "
                 "or the stream is out of step",
                 p, pe->who, magic, x->what);
        return -1;
    }
    if (epoch != c->epoch || seq != pe->rx_seq) {
        snprintf(err, errlen,
                 "rank %d (%s) sent frame %llu of epoch %llu during %s; expected frame %llu of "
                 "epoch %llu",
                 p, pe->who, (unsigned long long)seq, (unsigned long long)epoch, x->what,
                 (unsigned long long)pe->rx_seq, (unsigned long long)c->epoch);
        return -1;
    }
    rx->seq = pe->rx_seq++;
    rx->hdr_ok = true;
    return 0;
}

/* The payload and its tag are in: decrypt in place, or fail naming the peer. */
static int rx_unseal(tsr_comm_t *c, int p, const opctx_t *x, char *err, size_t errlen)
{
    peer_t *pe = &c->peers[p];
    rx_t *rx = &pe->rx;
    if (unseal(pe->rx_gcm, rx->seq, rx->hdr, rx->dst, (size_t)rx->len, rx->tag)) return 0;
    snprintf(err, errlen,
             "rank %d (%s) sent frame %llu (%llu bytes) that fails its integrity check during %s: "
             "altered on the way, or not sent by that rank",
             p, pe->who, (unsigned long long)rx->seq, (unsigned long long)rx->len, x->what);
    return -1;
}

static int rx_place_op(tsr_comm_t *c, int p, xfer_t *op, const opctx_t *x, char *err,
                       size_t errlen)
{
    rx_t *rx = &c->peers[p].rx;
    if (rx->kind != op->kind) {
        snprintf(err, errlen,
                 "rank %d (%s) sent %s data where %s data was expected during %s: the ranks "
                 "disagree on the order of operations",
                 p, c->peers[p].who, kind_name(rx->kind), kind_name(op->kind), x->what);
        return -1;
    }
    if (rx->len != (uint64_t)op->len) {
        snprintf(err, errlen, "rank %d (%s) sent a %llu-byte message where %zu bytes were "
                 "expected during %s",
                 p, c->peers[p].who, (unsigned long long)rx->len, op->len, x->what);
        return -1;
    }
    rx->dst = op->dst;
    rx->placed = true;
    return 0;
}

/* A frame arriving while this rank is sending goes to the peer's inbox, so
 * that two ranks sending large messages to each other both make progress.
 * Only point-to-point frames within INBOX_MAX are taken; anything else
 * (a collective's frame, a huge or bogus length) pauses the peer and waits
 * for the operation that expects it.  1: placed, 0: paused, -1: failed. */
static int rx_place_eager(tsr_comm_t *c, int p, char *err, size_t errlen)
{
    peer_t *pe = &c->peers[p];
    rx_t *rx = &pe->rx;
    if (rx->kind != K_P2P || rx->len > INBOX_MAX - pe->inbox_bytes) return 0;
    inbox_msg_t *m = malloc(sizeof *m + (size_t)rx->len);
    if (!m) {
        snprintf(err, errlen, "out of memory for a %llu-byte message from rank %d",
                 (unsigned long long)rx->len, p);
        return -1;
    }
    *m = (inbox_msg_t){.len = (size_t)rx->len};
    if (pe->inbox_tail) pe->inbox_tail->next = m;
    else pe->inbox = m;
    pe->inbox_tail = m;
    pe->inbox_bytes += m->len;
    rx->dst = m->data;
    rx->eager = m;
    rx->placed = true;
    return 1;
}

#define RX_PAUSED 2

/* Progresses the frame coming from peer p: into op's buffer when op is
 * given, else eagerly into the inbox (and on to further frames).  Returns
 * 1 when op completed, 0 when the socket is drained, RX_PAUSED, or -1. */
static int rx_pump(tsr_comm_t *c, int p, xfer_t *op, const opctx_t *x, char *err, size_t errlen)
{
    rx_t *rx = &c->peers[p].rx;
    for (;;) {
        int r;
        if (!rx->hdr_ok) {
            if ((r = read_some(c, p, rx->hdr, HDR_LEN, &rx->hdr_got, x, err, errlen)) <= 0)
                return r;
            if (rx_check_header(c, p, x, err, errlen)) return -1;
        }
        if (!rx->placed) {
            if (op && rx_place_op(c, p, op, x, err, errlen)) return -1;
            if (!op && (r = rx_place_eager(c, p, err, errlen)) <= 0) return r < 0 ? -1 : RX_PAUSED;
        }
        if ((r = read_some(c, p, rx->dst, (size_t)rx->len, &rx->got, x, err, errlen)) <= 0)
            return r;
        if (!data_plain) {
            if ((r = read_some(c, p, rx->tag, TAG_LEN, &rx->tag_got, x, err, errlen)) <= 0)
                return r;
            if (rx_unseal(c, p, x, err, errlen)) return -1;
        }
        if (rx->eager) rx->eager->complete = true;
        memset(rx, 0, sizeof *rx);
        if (op) {
            op->complete = true;
            return 1;
        }
    }
}

/* A receive first takes what arrived eagerly during an earlier send. */
static int recv_from_inbox(tsr_comm_t *c, xfer_t *op, const opctx_t *x, char *err,
                           size_t errlen)
{
    peer_t *pe = &c->peers[op->peer];
    inbox_msg_t *m = pe->inbox;
    if (!m) return 0;
    if (op->kind != K_P2P || m->len != op->len) {
        snprintf(err, errlen, "rank %d (%s) sent a %zu-byte %s message where %zu bytes of %s "
                 "data were expected during %s",
                 op->peer, pe->who, m->len, kind_name(K_P2P), op->len, kind_name(op->kind),
                 x->what);
        return -1;
    }
    /* Only the newest entry can be incomplete, and it is the one rx fills. */
    size_t have = m->complete ? m->len : pe->rx.got;
    if (have) memcpy(op->dst, m->data, have);
    if (m->complete) {
        op->complete = true;
    } else {
        pe->rx.dst = op->dst;   /* the rest goes straight to the caller */
        pe->rx.eager = NULL;
    }
    pe->inbox = m->next;
    if (!pe->inbox) pe->inbox_tail = NULL;
    pe->inbox_bytes -= m->len;
    free(m);
    return 0;
}

/* Which connections to wait on, and for what.  *busy: some op is not done. */
static int xfer_pollset(tsr_comm_t *c, const xfer_t *ops, bool eager, bool *busy)
{
    int nfds = 0;
    *busy = false;
    for (int p = 0; p < c->n; p++) {
        if (p == c->rank) continue;
        int s = c->send_op[p], r = c->recv_op[p];
        short ev = 0;
        if (s >= 0 && !ops[s].complete) ev |= POLLOUT;
        if (r >= 0 && !ops[r].complete) ev |= POLLIN;
        if (ev) *busy = true;
        if (eager && r < 0 && !c->paused[p]) ev |= POLLIN;
        if (!ev) continue;
        c->pfd[nfds] = (struct pollfd){.fd = c->peers[p].fd, .events = ev};
        c->pfd_peer[nfds++] = p;
    }
    return nfds;
}

static void xfer_timeout_msg(const tsr_comm_t *c, const xfer_t *ops, int nops,
                             const opctx_t *x, char *err, size_t errlen)
{
    const xfer_t *stuck = NULL;
    /* A receive names the peer we wait for; a stuck send only a slow reader. */
    for (int i = 0; i < nops && !stuck; i++)
        if (!ops[i].complete && !ops[i].is_send) stuck = &ops[i];
    for (int i = 0; i < nops && !stuck; i++)
        if (!ops[i].complete) stuck = &ops[i];
    if (!stuck) {
        snprintf(err, errlen, "%s timed out after %d ms", x->what, x->timeout_ms);
        return;
    }
    snprintf(err, errlen, "rank %d (%s) did not %s within %d ms during %s", stuck->peer,
             c->peers[stuck->peer].who, stuck->is_send ? "take its data" : "answer",
             x->timeout_ms, x->what);
}

static int xfer_serve(tsr_comm_t *c, xfer_t *ops, int p, short rev, bool eager,
                      const opctx_t *x, char *err, size_t errlen)
{
    int s = c->send_op[p], r = c->recv_op[p];
    bool hup = rev & (POLLERR | POLLHUP | POLLNVAL);
    if (rev & POLLNVAL) {
        snprintf(err, errlen, "connection to rank %d (%s) is not open during %s", p,
                 c->peers[p].who, x->what);
        return -1;
    }
    if (s >= 0 && !ops[s].complete && (rev & POLLOUT || hup) &&
        tx_pump(c, &ops[s], x, err, errlen) < 0)
        return -1;
    if (!(rev & POLLIN) && !hup) return 0;
    if (r >= 0) return !ops[r].complete && rx_pump(c, p, &ops[r], x, err, errlen) < 0 ? -1 : 0;
    if (!eager || c->paused[p]) return 0;
    /* A peer with nothing pending in this run (a rank that finished and
     * closed, say) must not fail it: a send whose data went out would
     * report an error and break the communicator.  Stop reading from it;
     * the rx state keeps the error (an EOF stays an EOF, a bad header
     * stays read), so the operation that next involves it reports it. */
    bool idle = s < 0 || ops[s].complete;
    char ignored[8];
    int k = idle ? rx_pump(c, p, NULL, x, ignored, sizeof ignored)
                 : rx_pump(c, p, NULL, x, err, errlen);
    if (k == RX_PAUSED || (k < 0 && idle)) c->paused[p] = true;
    return k < 0 && !idle ? -1 : 0;
}

/* Runs the sends and receives in ops together until all are done or the
 * deadline passes.  Progressing both directions in one poll loop is what
 * keeps two ranks that send large buffers to each other from deadlocking
 * on full socket buffers.  At most one send and one receive per peer.
 * eager: also read point-to-point frames from the other peers (see
 * rx_place_eager). */
static int run_xfers(tsr_comm_t *c, xfer_t *ops, int nops, bool eager, const opctx_t *x,
                     char *err, size_t errlen)
{
    for (int p = 0; p < c->n; p++) c->send_op[p] = c->recv_op[p] = -1, c->paused[p] = false;
    for (int i = 0; i < nops; i++) {
        if (ops[i].is_send) {
            c->send_op[ops[i].peer] = i;
            continue;
        }
        c->recv_op[ops[i].peer] = i;
        if (recv_from_inbox(c, &ops[i], x, err, errlen)) return -1;
        /* A header read during an earlier send may be all there is (a
         * zero-length message): poll would never wake for it. */
        if (!ops[i].complete && rx_pump(c, ops[i].peer, &ops[i], x, err, errlen) < 0)
            return -1;
    }
    for (;;) {
        bool busy;
        int nfds = xfer_pollset(c, ops, eager, &busy);
        if (!busy) return 0;
        int64_t left = x->deadline - now_ms();
        if (left <= 0) {
            xfer_timeout_msg(c, ops, nops, x, err, errlen);
            if (!c->broken) c->past_deadline = true;
            return -1;
        }
        int wait = c->cancelled && left > CANCEL_CHECK_MS ? CANCEL_CHECK_MS : (int)left;
        int r = poll(c->pfd, (nfds_t)nfds, wait);
        if (r < 0 && errno != EINTR) {
            snprintf(err, errlen, "poll failed during %s: %s", x->what, strerror(errno));
            return -1;
        }
        if (r == 0 && c->cancelled && c->cancelled(c->cancel_arg)) {
            snprintf(err, errlen, "%s (epoch %llu) was abandoned: a newer epoch or a stop",
                     x->what, (unsigned long long)c->epoch);
            return -1;
        }
        for (int i = 0; r > 0 && i < nfds; i++)
            if (c->pfd[i].revents &&
                xfer_serve(c, ops, c->pfd_peer[i], c->pfd[i].revents, eager, x, err, errlen))
                return -1;
    }
}

/* ---- operations ------------------------------------------------------------------ */

static int usable(const tsr_comm_t *c, char *err, size_t errlen)
{
    if (!c) {
        snprintf(err, errlen, "no communicator");
        return -1;
    }
    if (c->broken) {
        snprintf(err, errlen, "communicator unusable after an earlier failure: %s",
                 c->broken_msg);
        return -1;
    }
    return 0;
}

/* After a failed operation the streams are out of step: nothing on this
 * communicator can be trusted again (collective.h). */
static int broken(tsr_comm_t *c, const char *err)
{
    c->broken = true;
    snprintf(c->broken_msg, sizeof c->broken_msg, "%s", err);
    return -1;
}

/* Every rank sends its whole buffer to every other and adds all of them
 * in rank order 0..n-1, so the float result is bit-identical everywhere.
 * For small buffers one round of latency beats the ring's 2(n-1). */
/* Every rank sends its bytes to every other at once, and all[p] gets rank
 * p's (its own included).  One round: with the few ranks of a TP group
 * that beats a ring's n - 1. */
static int exchange_all(tsr_comm_t *c, uint32_t kind, const void *mine, size_t bytes,
                        uint8_t *all, const opctx_t *x, char *err, size_t errlen)
{
    int k = 0;
    for (int p = 0; p < c->n; p++) {
        if (p == c->rank) continue;
        if (xfer_send(c, &c->ops[k++], p, kind, mine, bytes, err, errlen)) return -1;
        xfer_recv(&c->ops[k++], p, kind, all + (size_t)p * bytes, bytes);
    }
    if (run_xfers(c, c->ops, k, false, x, err, errlen)) return -1;
    memmove(all + (size_t)c->rank * bytes, mine, bytes);
    return 0;
}

static int allreduce_small(tsr_comm_t *c, float *buf, size_t count, uint32_t kind,
                           const opctx_t *x, char *err, size_t errlen)
{
    size_t bytes = count * sizeof(float);
    float *all = scratch(c, (size_t)c->n * count, err, errlen);
    if (!all || exchange_all(c, kind, buf, bytes, (uint8_t *)all, x, err, errlen)) return -1;
    memcpy(buf, all, bytes);
    for (int r = 1; r < c->n; r++) {
        const float *src = all + (size_t)r * count;
        for (size_t i = 0; i < count; i++) buf[i] += src[i];
    }
    return 0;
}

/* Segment k of the ring: the first count % n segments are one longer. */
static void ring_segment(size_t count, int n, int k, size_t *off, size_t *len)
{
    size_t base = count / (size_t)n, extra = count % (size_t)n, uk = (size_t)k;
    *off = uk * base + (uk < extra ? uk : extra);
    *len = base + (uk < extra);
}

static int ring_step(tsr_comm_t *c, uint32_t kind, const float *src, size_t slen, float *dst,
                     size_t rlen, const opctx_t *x, char *err, size_t errlen)
{
    int right = (c->rank + 1) % c->n, left = (c->rank + c->n - 1) % c->n;
    if (xfer_send(c, &c->ops[0], right, kind, src, slen * sizeof(float), err, errlen))
        return -1;
    xfer_recv(&c->ops[1], left, kind, dst, rlen * sizeof(float));
    return run_xfers(c, c->ops, 2, false, x, err, errlen);
}

/* Ring reduce-scatter then all-gather: each rank moves 2(n-1)/n of the
 * buffer instead of (n-1) times all of it.  Each segment is summed on one
 * rank only (in ring order) and then copied, so the result is
 * bit-identical on every rank.  Each step overlaps its send and receive;
 * it does not yet overlap the additions with the next step's transfer. */
static int allreduce_ring(tsr_comm_t *c, float *buf, size_t count, const opctx_t *x,
                          char *err, size_t errlen)
{
    int n = c->n, me = c->rank;
    size_t soff, slen, roff, rlen;
    float *tmp = scratch(c, count / (size_t)n + 1, err, errlen);
    if (!tmp) return -1;
    for (int s = 0; s < n - 1; s++) {
        ring_segment(count, n, (me - s + n) % n, &soff, &slen);
        ring_segment(count, n, (me - s - 1 + 2 * n) % n, &roff, &rlen);
        if (ring_step(c, K_REDUCE_SCATTER, buf + soff, slen, tmp, rlen, x, err, errlen))
            return -1;
        float *dst = buf + roff;
        for (size_t i = 0; i < rlen; i++) dst[i] += tmp[i];
    }
    /* Rank r now holds the finished segment r + 1; pass them round. */
    for (int s = 0; s < n - 1; s++) {
        ring_segment(count, n, (me + 1 - s + n) % n, &soff, &slen);
        ring_segment(count, n, (me - s + n) % n, &roff, &rlen);
        if (ring_step(c, K_ALL_GATHER, buf + soff, slen, buf + roff, rlen, x, err, errlen))
            return -1;
    }
    return 0;
}

/* Sums count elements of t in place.  Floats in f32; 16-bit floats are
 * widened, summed in f32 and rounded once, so every rank rounds the same. */
static int allreduce_f32(tsr_comm_t *c, float *buf, size_t n, const opctx_t *x, char *err,
                         size_t errlen)
{
    return n * sizeof(float) < SMALL_BYTES ? allreduce_small(c, buf, n, K_ALLREDUCE, x, err, errlen)
                                           : allreduce_ring(c, buf, n, x, err, errlen);
}

static int allreduce_i32(tsr_comm_t *c, int32_t *buf, size_t count, const opctx_t *x, char *err,
                         size_t errlen)
{
    int32_t *all = (int32_t *)scratch(c, (size_t)c->n * count, err, errlen);
    if (!all ||
        exchange_all(c, K_ALLREDUCE, buf, count * sizeof(int32_t), (uint8_t *)all, x, err, errlen))
        return -1;
    for (size_t i = 0; i < count; i++) {
        uint32_t sum = 0;   /* wraps like two's complement, without UB */
        for (int r = 0; r < c->n; r++) sum += (uint32_t)all[(size_t)r * count + i];
        buf[i] = (int32_t)sum;
    }
    return 0;
}

static int allreduce_half(tsr_comm_t *c, uint16_t *buf, size_t n, bool bf16, const opctx_t *x,
                          char *err, size_t errlen)
{
    float *w = malloc((n ? n : 1) * sizeof *w);
    if (!w) {
        snprintf(err, errlen, "out of memory for %zu elements of allreduce", n);
        return -1;
    }
    for (size_t i = 0; i < n; i++) w[i] = bf16 ? tsr_bf16_to_f32(buf[i]) : tsr_f16_to_f32(buf[i]);
    int rc = allreduce_f32(c, w, n, x, err, errlen);
    for (size_t i = 0; rc == 0 && i < n; i++) buf[i] = bf16 ? tsr_f32_to_bf16(w[i]) : tsr_f32_to_f16(w[i]);
    free(w);
    return rc;
}

static int host_only(const tsr_buf_t *b, const char *what, char *err, size_t errlen)
{
    if (b->mem == TSR_MEM_HOST && (b->ptr || !b->count)) return 0;
    snprintf(err, errlen, "tcp %s: the buffer is %s; this backend moves host memory only", what,
             b->mem == TSR_MEM_HOST ? "missing" : "in device memory");
    return -1;
}

static int tcp_allreduce_sum(tsr_comm_t *c, tsr_buf_t b, int timeout_ms, char *err,
                             size_t errlen)
{
    if (usable(c, err, errlen) || host_only(&b, "allreduce", err, errlen)) return -1;
    if (c->n == 1 || b.count == 0) return 0;
    opctx_t x = op_begin(timeout_ms, "allreduce");
    int rc;
    switch (b.dtype) {
    case TSR_DT_F32: rc = allreduce_f32(c, b.ptr, b.count, &x, err, errlen); break;
    case TSR_DT_I32: rc = allreduce_i32(c, b.ptr, b.count, &x, err, errlen); break;
    case TSR_DT_BF16:
    case TSR_DT_F16: rc = allreduce_half(c, b.ptr, b.count, b.dtype == TSR_DT_BF16, &x, err, errlen); break;
    default:
        snprintf(err, errlen, "allreduce: unknown element type %d", (int)b.dtype);
        return -1;
    }
    return rc ? broken(c, err) : 0;
}

static int tcp_allgather(tsr_comm_t *c, tsr_buf_t send, tsr_buf_t recv, int timeout_ms,
                         char *err, size_t errlen)
{
    if (usable(c, err, errlen) || host_only(&send, "allgather", err, errlen) ||
        host_only(&recv, "allgather", err, errlen))
        return -1;
    size_t es = tsr_dtype_size(send.dtype), part = send.count * es;
    if (recv.dtype != send.dtype || recv.count != send.count * (size_t)c->n) {
        snprintf(err, errlen, "allgather: receive buffer of %zu %s for %d parts of %zu %s",
                 recv.count, tsr_dtype_name(recv.dtype), c->n, send.count,
                 tsr_dtype_name(send.dtype));
        return -1;
    }
    uint8_t *out = recv.ptr;
    if (c->n == 1 || part == 0) {
        memmove(out + (size_t)c->rank * part, send.ptr, part);
        return 0;
    }
    opctx_t x = op_begin(timeout_ms, "allgather");
    return exchange_all(c, K_GATHER, send.ptr, part, out, &x, err, errlen) ? broken(c, err) : 0;
}

/* The root sends to every rank at once: with the few ranks of a TP group
 * a tree would add latency and save little. */
static int tcp_broadcast(tsr_comm_t *c, tsr_buf_t b, int root, int timeout_ms, char *err,
                         size_t errlen)
{
    if (usable(c, err, errlen) || host_only(&b, "broadcast", err, errlen)) return -1;
    if (root < 0 || root >= c->n) {
        snprintf(err, errlen, "broadcast root %d is not a rank of this group of %d", root, c->n);
        return -1;
    }
    if (c->n == 1) return 0;
    size_t len = b.count * tsr_dtype_size(b.dtype);
    opctx_t x = op_begin(timeout_ms, "broadcast");
    int k = 0;
    if (c->rank == root) {
        for (int p = 0; p < c->n; p++)
            if (p != root && xfer_send(c, &c->ops[k++], p, K_BROADCAST, b.ptr, len, err, errlen))
                return broken(c, err);
    } else {
        xfer_recv(&c->ops[k++], root, K_BROADCAST, b.ptr, len);
    }
    return run_xfers(c, c->ops, k, false, &x, err, errlen) ? broken(c, err) : 0;
}

static int check_peer(const tsr_comm_t *c, int peer, const char *what, char *err, size_t errlen)
{
    if (peer < 0 || peer >= c->n || peer == c->rank) {
        snprintf(err, errlen, "%s: peer %d is not another rank of this group of %d (rank %d)",
                 what, peer, c->n, c->rank);
        return -1;
    }
    return 0;
}

/* Sends return once the message is in the kernel's socket buffer.  While
 * waiting, frames other ranks send to this one are read into the inbox,
 * so two ranks exchanging large messages (both send, then both recv)
 * finish. */
static int tcp_group(tsr_comm_t *c, const tsr_p2p_t *ops, int n, int timeout_ms, char *err,
                     size_t errlen)
{
    if (usable(c, err, errlen)) return -1;
    if (n < 0 || n > 2 * c->n) {
        snprintf(err, errlen, "group of %d transfers on a group of %d ranks", n, c->n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (check_peer(c, ops[i].peer, ops[i].is_send ? "send" : "recv", err, errlen) ||
            host_only(&ops[i].buf, ops[i].is_send ? "send" : "recv", err, errlen))
            return -1;
        for (int j = 0; j < i; j++)
            if (ops[j].peer == ops[i].peer && ops[j].is_send == ops[i].is_send) {
                snprintf(err, errlen, "group: two %ss for rank %d", ops[i].is_send ? "send" : "recv",
                         ops[i].peer);
                return -1;
            }
    }
    /* Eager reading from uninvolved peers only while sending alone: a
     * receive must not trip over a peer that has finished and closed. */
    bool eager = true;
    for (int i = 0; i < n; i++) eager &= ops[i].is_send;
    opctx_t x = op_begin(timeout_ms, n == 1 ? (ops[0].is_send ? "send" : "recv") : "send/recv");
    for (int i = 0; i < n; i++) {
        size_t len = ops[i].buf.count * tsr_dtype_size(ops[i].buf.dtype);
        if (ops[i].is_send) {
            if (xfer_send(c, &c->ops[i], ops[i].peer, K_P2P, ops[i].buf.ptr, len, err, errlen))
                return broken(c, err);
        } else {
            xfer_recv(&c->ops[i], ops[i].peer, K_P2P, ops[i].buf.ptr, len);
        }
    }
    return run_xfers(c, c->ops, n, eager, &x, err, errlen) ? broken(c, err) : 0;
}

static int tcp_poll(tsr_comm_t *c, int peer, int timeout_ms, char *err, size_t errlen)
{
    if (usable(c, err, errlen) || check_peer(c, peer, "poll", err, errlen)) return -1;
    peer_t *pe = &c->peers[peer];
    if (pe->inbox || pe->rx.hdr_got) return 1;
    struct pollfd pfd = {.fd = pe->fd, .events = POLLIN};
    int r;
    while ((r = poll(&pfd, 1, timeout_ms)) < 0 && errno == EINTR) {}
    if (r < 0) {
        snprintf(err, errlen, "poll for rank %d failed: %s", peer, strerror(errno));
        return broken(c, err);
    }
    /* Readable covers a closed connection too: the recv that follows names it. */
    return r > 0;
}

static void tcp_abort(tsr_comm_t *c, const char *why)
{
    if (c && !c->broken) broken(c, why ? why : "aborted");
}

static int tcp_create(void *ctx, const tsr_rendezvous_t *rv, tsr_comm_t **out, char *err,
                      size_t errlen)
{
    enum { MAX_MEMBERS = 1024 };
    const tsr_coll_ctx_t *x = ctx;
    if (!x || !x->listener || !rv || rv->n < 1 || rv->n > MAX_MEMBERS || !rv->blob) {
        snprintf(err, errlen, "tcp: a rendezvous needs the listener and 1 to %d endpoints",
                 MAX_MEMBERS);
        return -1;
    }
    /* The blob is the members' endpoints, one per line, in rank order. */
    char *copy = malloc(rv->blob_len + 1);
    const char **eps = calloc((size_t)rv->n, sizeof *eps);
    int rc = -1, k = 0;
    if (!copy || !eps) {
        snprintf(err, errlen, "tcp: out of memory for a rendezvous");
        goto out;
    }
    memcpy(copy, rv->blob, rv->blob_len);
    copy[rv->blob_len] = 0;
    for (char *save = NULL, *t = strtok_r(copy, "\n", &save); t; t = strtok_r(NULL, "\n", &save)) {
        if (k == rv->n) break;
        eps[k++] = t;
    }
    if (k != rv->n) {
        snprintf(err, errlen, "tcp: the rendezvous names %d endpoint(s) for a group of %d", k,
                 rv->n);
        goto out;
    }
    *out = comm_new(x->listener, rv->epoch, rv->group, rv->rank, rv->n, eps, rv->names,
                    rv->secret, rv->secret_len, rv->timeout_ms, rv->cancelled, rv->cancel_arg,
                    err, errlen);
    rc = *out ? 0 : -1;
out:
    free(eps);
    free(copy);
    return rc;
}

static int tcp_rank(const tsr_comm_t *c)
{
    return c->rank;
}

static int tcp_size(const tsr_comm_t *c)
{
    return c->n;
}

static void tcp_destroy(tsr_comm_t **c_p)
{
    if (!c_p || !*c_p) return;
    comm_free(*c_p);
    *c_p = NULL;
}

static bool tcp_past_deadline(const tsr_comm_t *c) { return c->broken && c->past_deadline; }

const tsr_coll_ops_t tsr_coll_tcp = {
    .name = "tcp",
    .mem = TSR_MEM_HOST,
    .create = tcp_create,
    .allreduce_sum = tcp_allreduce_sum,
    .allgather = tcp_allgather,
    .broadcast = tcp_broadcast,
    .group = tcp_group,
    .poll = tcp_poll,
    .abort = tcp_abort,
    .rank = tcp_rank,
    .size = tcp_size,
    .destroy = tcp_destroy,
    .past_deadline = tcp_past_deadline,
};

/* ---- backend-independent helpers ------------------------------------------------ */

int tsr_coll_send(const tsr_coll_ops_t *ops, tsr_comm_t *c, int peer, tsr_buf_t buf,
                  int timeout_ms, char *err, size_t errlen)
{
    tsr_p2p_t op = {peer, true, buf};
    return ops->group(c, &op, 1, timeout_ms, err, errlen);
}

int tsr_coll_recv(const tsr_coll_ops_t *ops, tsr_comm_t *c, int peer, tsr_buf_t buf,
                  int timeout_ms, char *err, size_t errlen)
{
    tsr_p2p_t op = {peer, false, buf};
    return ops->group(c, &op, 1, timeout_ms, err, errlen);
}
