#include "wire.h"
#include "keys.h"

#include <errno.h>
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <zmq.h>

static void *zctx;

void *tsr_zmq_ctx(void)
{
    if (!zctx) {
        zctx = zmq_ctx_new();
        /* The control-plane benchmark holds thousands of sockets in one
         * process; the default cap is 1023. */
        zmq_ctx_set(zctx, ZMQ_MAX_SOCKETS, 65536);
    }
    return zctx;
}

void tsr_zmq_term(void)
{
    if (zctx) zmq_ctx_term(zctx);
    zctx = NULL;
}

/* ---- decoding ------------------------------------------------------------ */

/* Walks every string in a decoded message and checks it against its limit.
 * Generic over the descriptors so a new field cannot slip past unchecked. */
static int check_strings(const ProtobufCMessage *m, char *err, size_t errlen)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        const char *base = (const char *)m + f->offset;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            /* Repeated strings (peer endpoints) are each name-sized. */
            if (f->type != PROTOBUF_C_TYPE_STRING) continue;
            size_t count = *(const size_t *)((const char *)m + f->quantifier_offset);
            char *const *arr = *(char *const *const *)base;
            for (size_t k = 0; k < count; k++) {
                if (arr[k] && strlen(arr[k]) > TSR_NAME_MAX) {
                    snprintf(err, errlen, "%s.%s[%zu] is %zu bytes, limit %d", d->short_name,
                             f->name, k, strlen(arr[k]), TSR_NAME_MAX);
                    return -1;
                }
            }
            continue;
        }
        if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            uint32_t which = *(const uint32_t *)((const char *)m + f->quantifier_offset);
            if (which != f->id) continue;
        }
        if (f->type == PROTOBUF_C_TYPE_STRING) {
            const char *s = *(char *const *)base;
            if (!s) continue;
            size_t limit = TSR_PATH_MAX;
            /* A document and a prompt's text are bounded by the message size. */
            if (!strcmp(f->name, "json") || !strcmp(f->name, "prompt_text")) continue;
            if (!strcmp(f->name, "worker") || !strcmp(f->name, "deployment") ||
                !strcmp(f->name, "node") || !strcmp(f->name, "software_version"))
                limit = TSR_NAME_MAX;
            if (strlen(s) > limit) {
                snprintf(err, errlen, "%s.%s is %zu bytes, limit %zu", d->short_name,
                         f->name, strlen(s), limit);
                return -1;
            }
        } else if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
            const ProtobufCMessage *sub = *(ProtobufCMessage *const *)base;
            if (sub && check_strings(sub, err, errlen) < 0) return -1;
        }
    }
    return 0;
}

int tsr_wire_decode(const uint8_t *buf, size_t len, size_t max, tsr_env_t **out,
                    char *err, size_t errlen)
{
    *out = NULL;
    if (len > max) {
        snprintf(err, errlen, "message of %zu bytes exceeds the limit of %zu", len, max);
        return -1;
    }
    if (len == 0) {
        snprintf(err, errlen, "empty message");
        return -1;
    }
    tsr_env_t *env = tessera__envelope__unpack(NULL, len, buf);
    if (!env) {
        snprintf(err, errlen, "malformed or truncated message (%zu bytes)", len);
        return -1;
    }
    if (env->body_case == TESSERA__ENVELOPE__BODY__NOT_SET) {
        snprintf(err, errlen, "message has no body (unknown kind, or sent by a newer peer)");
        goto bad;
    }
    /* The one body whose nested message is not optional: an assignment. */
    if (env->body_case == TESSERA__ENVELOPE__BODY_ASSIGN && !env->assign->assignment) {
        snprintf(err, errlen, "assign message without an assignment");
        goto bad;
    }
    if (check_strings(&env->base, err, errlen) < 0) goto bad;
    *out = env;
    return 0;
bad:
    tessera__envelope__free_unpacked(env, NULL);
    return -1;
}

float tsr_wire_top_p(double top_p)
{
    return top_p > 0 && top_p < FLT_MIN ? FLT_MIN : (float)top_p;
}

void tsr_env_free(tsr_env_t **env_p)
{
    if (env_p && *env_p) {
        tessera__envelope__free_unpacked(*env_p, NULL);
        *env_p = NULL;
    }
}

int tsr_wire_encode(tsr_env_t *env, uint8_t **buf, size_t *len)
{
    if (env->protocol_version == 0) env->protocol_version = TSR_PROTOCOL_VERSION;
    size_t n = tessera__envelope__get_packed_size(env);
    uint8_t *b = malloc(n ? n : 1);
    if (!b) return -1;
    tessera__envelope__pack(env, b);
    *buf = b;
    *len = n;
    return 0;
}

/* ---- sockets ------------------------------------------------------------- */

/* max: the largest frame a peer may send; ZeroMQ closes a connection that
 * announces a larger one before it buffers it. */
static void sock_common(void *s, size_t max)
{
    int linger = 0, hwm = 100000;
    int64_t maxmsg = (int64_t)max;
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof hwm);
}

/* libzmq's bind, connect, disconnect and send first read the socket's
 * command pipe, which a signal with a handler can interrupt (EINTR) before
 * anything is done: that is not a failure, so they are tried again.
 * Signals come to daemons (SIGHUP reloads the coordinator) and to test and
 * fuzz harnesses (timers). */
int tsr_zmq_bind(void *sock, const char *endpoint)
{
    int rc;
    while ((rc = zmq_bind(sock, endpoint)) != 0 && errno == EINTR) {}
    return rc;
}

int tsr_zmq_connect(void *sock, const char *endpoint)
{
    int rc;
    while ((rc = zmq_connect(sock, endpoint)) != 0 && errno == EINTR) {}
    return rc;
}

int tsr_zmq_disconnect(void *sock, const char *endpoint)
{
    int rc;
    while ((rc = zmq_disconnect(sock, endpoint)) != 0 && errno == EINTR) {}
    return rc != 0 && errno == ENOENT ? 0 : rc;
}

/* One frame; a frame interrupted before it went is sent again, so a
 * routing-id frame is never left without its body. */
static int send_frame(void *sock, const void *buf, size_t len, int flags)
{
    int rc;
    while ((rc = zmq_send(sock, buf, len, flags)) < 0 && errno == EINTR) {}
    return rc;
}

void *tsr_sock_router(const char *endpoint, char *err, size_t errlen)
{
    return tsr_sock_router_sec(endpoint, TSR_WIRE_MAX_WORKER, NULL, err, errlen);
}

void *tsr_sock_router_max(const char *endpoint, size_t max, char *err, size_t errlen)
{
    return tsr_sock_router_sec(endpoint, max, NULL, err, errlen);
}

void *tsr_sock_router_sec(const char *endpoint, size_t max, const tsr_security_t *sec, char *err,
                          size_t errlen)
{
    void *s = zmq_socket(tsr_zmq_ctx(), ZMQ_ROUTER);
    if (!s) {
        snprintf(err, errlen, "cannot create socket: %s", zmq_strerror(errno));
        return NULL;
    }
    sock_common(s, max);
    int mandatory = 0;  /* unroutable replies (peer gone) are dropped silently */
    int backlog = 4096; /* a whole cluster connecting at once must not overflow it */
    zmq_setsockopt(s, ZMQ_BACKLOG, &backlog, sizeof backlog);
    zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory);
    /* A peer that reconnects with its routing id (every tsr_sock_dealer keeps
     * one) takes it over at once, even while the old TCP connection is not
     * yet known to be dead: a worker cut off by the network must not be
     * locked out until the kernel gives up on the old one.  The id is 16
     * random bytes, so only the peer that has it can do this. */
    int handover = 1;
    zmq_setsockopt(s, ZMQ_ROUTER_HANDOVER, &handover, sizeof handover);
    /* A connection that has not finished its handshake within 5 s is
     * dropped, so idle strangers cannot hold file descriptors for long. */
    int hs = 5000;
    zmq_setsockopt(s, ZMQ_HANDSHAKE_IVL, &hs, sizeof hs);
    if (sec && sec->curve) {
        /* Every client is checked by the ZAP handler (coordinator/zap.c),
         * which the caller must have bound before this socket. */
        int server = 1;
        if (zmq_setsockopt(s, ZMQ_CURVE_SERVER, &server, sizeof server) != 0 ||
            zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, sec->self.sec, 40) != 0 ||
            zmq_setsockopt(s, ZMQ_ZAP_DOMAIN, "tessera", 7) != 0) {
            snprintf(err, errlen, "cannot enable CURVE on %s: %s", endpoint,
                     zmq_strerror(errno));
            zmq_close(s);
            return NULL;
        }
    }
    if (tsr_zmq_bind(s, endpoint) != 0) {
        snprintf(err, errlen, "cannot bind %s: %s", endpoint, zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    return s;
}

void *tsr_sock_dealer(const char *endpoint, int immediate, char *err, size_t errlen)
{
    return tsr_sock_dealer_sec(endpoint, immediate, NULL, NULL, err, errlen);
}

void *tsr_sock_dealer_sec(const char *endpoint, int immediate, const tsr_security_t *sec,
                          void **mon, char *err, size_t errlen)
{
    void *s = zmq_socket(tsr_zmq_ctx(), ZMQ_DEALER);
    if (!s) {
        snprintf(err, errlen, "cannot create socket: %s", zmq_strerror(errno));
        return NULL;
    }
    sock_common(s, TSR_WIRE_MAX_CONTROL);
    /* A random routing id, kept across reconnections: the coordinator binds
     * a worker's name to it, and a stranger cannot guess it.  (The leading
     * byte must not be 0: ZeroMQ reserves those ids for itself.) */
    uint8_t id[16];
    if (tsr_random(id, sizeof id) < 0) {
        snprintf(err, errlen, "cannot read random bytes for a routing id: %s", strerror(errno));
        zmq_close(s);
        return NULL;
    }
    id[0] |= 0x80;
    zmq_setsockopt(s, ZMQ_ROUTING_ID, id, sizeof id);
    /* Reconnect fast at first, backing off to 1 s while the peer is away. */
    int ivl = 100, ivl_max = 1000;
    zmq_setsockopt(s, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
    zmq_setsockopt(s, ZMQ_RECONNECT_IVL_MAX, &ivl_max, sizeof ivl_max);
    zmq_setsockopt(s, ZMQ_IMMEDIATE, &immediate, sizeof immediate);
    if (sec && sec->curve &&
        (zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, sec->server_pub, 40) != 0 ||
         zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, sec->self.pub, 40) != 0 ||
         zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, sec->self.sec, 40) != 0)) {
        snprintf(err, errlen, "cannot enable CURVE towards %s: %s", endpoint,
                 zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    /* The monitor comes before the connection, so no event is missed. */
    if (mon && !(*mon = tsr_sock_monitor(s, TSR_SOCK_EVENTS))) {
        snprintf(err, errlen, "cannot watch the connection to %s: %s", endpoint,
                 zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    if (tsr_zmq_connect(s, endpoint) != 0) {
        snprintf(err, errlen, "cannot connect to %s: %s", endpoint, zmq_strerror(errno));
        if (mon) tsr_sock_monitor_close(s, mon);
        zmq_close(s);
        return NULL;
    }
    return s;
}

const char *tsr_handshake_failure(int event, uint32_t value)
{
    switch (event) {
    case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
        return "the coordinator does not allow this key (add it to its key store with "
               "`tessera keys add DIR NAME`, or check --identity)";
    case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if (value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
            return "one side uses CURVE and the other does not (compare coordinator.security "
                   "with this program's keys: --keys, TESSERA_KEYS)";
        if (value == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC)
            return "the CURVE handshake failed (is coordinator.pub the coordinator's current "
                   "public key?)";
        return "the handshake failed with a protocol error (a different program on that port?)";
    default:
        /* ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL: the connection closed during
         * the handshake (the coordinator stopped or restarted); a transient
         * like a disconnection, not a refusal. */
        return NULL;
    }
}

void tsr_sock_close(void **sock_p)
{
    if (sock_p && *sock_p) {
        zmq_close(*sock_p);
        *sock_p = NULL;
    }
}

static void skip_rest(void *sock);

void *tsr_sock_monitor(void *sock, int events)
{
    static int seq;
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://tsr-monitor-%d", ++seq);
    int rc;
    while ((rc = zmq_socket_monitor(sock, ep, events)) != 0 && errno == EINTR) {}
    if (rc != 0) return NULL;
    void *mon = zmq_socket(tsr_zmq_ctx(), ZMQ_PAIR);
    if (mon && tsr_zmq_connect(mon, ep) != 0) {
        zmq_close(mon);
        mon = NULL;
    }
    return mon;
}

int tsr_sock_monitor_event(void *mon)
{
    return tsr_sock_monitor_event_v(mon, NULL);
}

int tsr_sock_monitor_event_v(void *mon, uint32_t *value)
{
    zmq_msg_t m;
    int id = -1;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, mon, ZMQ_DONTWAIT) >= 6) {
        uint16_t ev;
        memcpy(&ev, zmq_msg_data(&m), sizeof ev);
        id = ev;
        if (value) memcpy(value, (const uint8_t *)zmq_msg_data(&m) + 2, sizeof *value);
    }
    zmq_msg_close(&m);
    skip_rest(mon);  /* the endpoint frame */
    return id;
}

void tsr_sock_monitor_close(void *sock, void **mon_p)
{
    if (!mon_p || !*mon_p) return;
    zmq_socket_monitor(sock, NULL, 0);
    zmq_close(*mon_p);
    *mon_p = NULL;
}

int tsr_wire_send(void *sock, const uint8_t *rid, size_t rid_len, tsr_env_t *env)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = -1;
    if (tsr_wire_encode(env, &buf, &len) < 0) goto out;
    if (rid && send_frame(sock, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) goto out;
    if (send_frame(sock, buf, len, ZMQ_DONTWAIT) < 0) goto out;
    rc = 0;
out:
    free(buf);
    return rc;
}

/* Reads and discards the rest of a multipart message. */
static void skip_rest(void *sock)
{
    int more = 1;
    size_t sz = sizeof more;
    while (zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz) == 0 && more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        zmq_msg_recv(&m, sock, 0);
        zmq_msg_close(&m);
    }
}

int tsr_wire_recv(void *sock, uint8_t *rid, size_t *rid_len, size_t max, tsr_env_t **out,
                  char *err, size_t errlen)
{
    return tsr_wire_recv_user(sock, rid, rid_len, NULL, 0, max, out, err, errlen);
}

int tsr_wire_recv_user(void *sock, uint8_t *rid, size_t *rid_len, char *user, size_t userlen,
                       size_t max, tsr_env_t **out, char *err, size_t errlen)
{
    zmq_msg_t m;
    int rc = -1;
    *out = NULL;
    if (rid) {
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
            int e = errno;
            zmq_msg_close(&m);
            /* Interrupted by a signal: nothing was taken, the message stays
             * queued for the next read (it is not a rejected one). */
            if (e == EAGAIN || e == EINTR) return 0;
            snprintf(err, errlen, "receive failed: %s", zmq_strerror(e));
            return -1;
        }
        size_t n = zmq_msg_size(&m);
        if (n > 255) n = 255;
        memcpy(rid, zmq_msg_data(&m), n);
        *rid_len = n;
        int more = zmq_msg_more(&m);
        zmq_msg_close(&m);
        if (!more) {
            snprintf(err, errlen, "message without a body frame");
            return -1;
        }
    }
    zmq_msg_init(&m);
    int got;
    /* The body of a routed message is already here (frames arrive
     * together), so its read is tried again when a signal interrupts it. */
    while ((got = zmq_msg_recv(&m, sock, rid ? 0 : ZMQ_DONTWAIT)) < 0 && errno == EINTR && rid) {}
    if (got < 0) {
        int e = errno;
        zmq_msg_close(&m);
        if ((e == EAGAIN || e == EINTR) && !rid) return 0;
        snprintf(err, errlen, "receive failed: %s", zmq_strerror(e));
        return -1;
    }
    if (user && userlen) {
        /* The ZAP handler's answer for this connection: the key's name. */
        const char *u = zmq_msg_gets(&m, "User-Id");
        snprintf(user, userlen, "%s", u ? u : "");
    }
    int more = zmq_msg_more(&m);
    if (more) {
        snprintf(err, errlen, "message with unexpected extra frames");
        skip_rest(sock);
        goto out;
    }
    if (tsr_wire_decode(zmq_msg_data(&m), zmq_msg_size(&m), max, out, err, errlen) < 0)
        goto out;
    rc = 1;
out:
    zmq_msg_close(&m);
    return rc;
}

const char *tsr_connect_endpoint(const char *bind_ep, char *buf, size_t len)
{
    const char *p;
    if ((p = strstr(bind_ep, "://0.0.0.0:")) != NULL)
        snprintf(buf, len, "%.*s://127.0.0.1:%s", (int)(p - bind_ep), bind_ep, p + 11);
    else if ((p = strstr(bind_ep, "://*:")) != NULL)
        snprintf(buf, len, "%.*s://127.0.0.1:%s", (int)(p - bind_ep), bind_ep, p + 5);
    else
        snprintf(buf, len, "%s", bind_ep);
    return buf;
}

int tsr_random(void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t got = getrandom(p, n, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += got;
        n -= (size_t)got;
    }
    return 0;
}

const char *tsr_env_kind(const tsr_env_t *env)
{
    const ProtobufCFieldDescriptor *f =
        protobuf_c_message_descriptor_get_field(&tessera__envelope__descriptor, env->body_case);
    return f ? f->name : "unknown";
}

int tsr_name_ok(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++) {
        char c = s[n];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-' || c == ':' || c == '@'))
            return 0;
    }
    return n >= 1 && n <= TSR_NAME_MAX;
}
