/* wire.h: Tessera's wire messages (proto/tessera.proto) on ZeroMQ sockets.
 *
 * Every message is one tessera.Envelope.  Decoding checks the size limit
 * before protobuf-c sees the bytes, then checks that a body is present and
 * that every string is within its limit, so the rest of the code can trust
 * what it gets.  Sockets are created only here (tsr_sock_*), so transport
 * security (CURVE, common/keys.h) is set in one place. */
#ifndef TSR_WIRE_H
#define TSR_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <zmq.h>
#include "proto/tessera.pb-c.h"

#define TSR_PROTOCOL_VERSION 2
#define TSR_SOFTWARE_VERSION "0.1.0"

/* Largest message a worker or the coordinator accepts on the workers
 * channel, and the largest control reply (a status of 10,000 workers). */
#define TSR_WIRE_MAX_WORKER   (64u * 1024u)
#define TSR_WIRE_MAX_CONTROL  (64u * 1024u * 1024u)
/* Largest control request (CLI -> coordinator): a prompt of 65,536 ids packs
 * into at most 330 KB.  A request over it is answered with an error naming
 * the limit; one over twice it is cut off by ZeroMQ (ZMQ_MAXMSGSIZE), so a
 * peer cannot make the coordinator buffer more than that. */
#define TSR_WIRE_MAX_REQUEST  (1024u * 1024u)
/* Epochs above this are refused wherever they arrive: they stay exact in
 * JSON (2^53) and can never wrap however often they are raised. */
#define TSR_EPOCH_MAX (1ull << 53)
#define TSR_NAME_MAX 128
#define TSR_PATH_MAX 4096

typedef Tessera__Envelope tsr_env_t;

/* Decodes len bytes.  Returns 0 and *out (caller frees with tsr_env_free),
 * or -1 with a reason in err: oversized, truncated or malformed, no body,
 * a string over its limit. */
int tsr_wire_decode(const uint8_t *buf, size_t len, size_t max, tsr_env_t **out,
                    char *err, size_t errlen);
void tsr_env_free(tsr_env_t **env_p);

/* Packs env into a new buffer; caller frees *buf with free().  Sets
 * protocol_version when it is 0. */
int tsr_wire_encode(tsr_env_t *env, uint8_t **buf, size_t *len);

/* A client's top_p (above 0, at most 1) as ControlRequest.top_p, a float where 0 means
 * no cut: one below the smallest normal float becomes that float (the top token alone,
 * as it asks) instead of rounding to 0. */
float tsr_wire_top_p(double top_p);

/* ---- sockets (raw libzmq handles; void * as libzmq uses) ---------------- */

/* zmq_bind / zmq_connect / zmq_disconnect, tried again while a signal
 * interrupts them (EINTR); 0 or -1 with errno as libzmq sets it.  A
 * disconnect from an endpoint not connected (ENOENT) is 0. */
int tsr_zmq_bind(void *sock, const char *endpoint);
int tsr_zmq_connect(void *sock, const char *endpoint);
int tsr_zmq_disconnect(void *sock, const char *endpoint);

/* Creates the process-wide ZeroMQ context on first use. */
void *tsr_zmq_ctx(void);
void tsr_zmq_term(void);
/* A ROUTER bound to endpoint (coordinator side), or NULL with err set.
 * ZeroMQ drops a connection that sends a frame over TSR_WIRE_MAX_WORKER
 * (ZMQ_MAXMSGSIZE), before buffering it.  A peer reconnecting with the
 * routing id of a live connection takes it over (ZMQ_ROUTER_HANDOVER). */
void *tsr_sock_router(const char *endpoint, char *err, size_t errlen);
/* The same with another frame limit (max bytes, > 0). */
void *tsr_sock_router_max(const char *endpoint, size_t max, char *err, size_t errlen);
/* The same, with CURVE when sec->curve (common/keys.h): the socket is a
 * CURVE server with sec's key pair, and every client must pass the ZAP
 * handler, which must be bound in this process first (coordinator/zap.h).
 * sec NULL or curve 0: plain. */
struct tsr_security;
void *tsr_sock_router_sec(const char *endpoint, size_t max, const struct tsr_security *sec,
                          char *err, size_t errlen);
/* A DEALER connected to endpoint.  immediate: queue only on live connections
 * (a worker must not flood a restarted coordinator with stale heartbeats).
 * Its frames are limited to TSR_WIRE_MAX_CONTROL, the largest reply.  It
 * gets a random 16-byte routing id that it keeps across reconnections, so
 * the coordinator can bind a worker's name to its connection. */
void *tsr_sock_dealer(const char *endpoint, int immediate, char *err, size_t errlen);
/* The same, as a CURVE client with sec's key pair towards sec->server_pub
 * when sec->curve; plain when sec is NULL or curve 0.  With mon, *mon gets
 * a monitor (set up before connecting) of TSR_SOCK_EVENTS; close it with
 * tsr_sock_monitor_close before the socket.  (CONNECTED and
 * HANDSHAKE_SUCCEEDED tell a handshake that never completes, as with a
 * wrong coordinator.pub, from a coordinator that is not there.) */
#define TSR_SOCK_EVENTS                                                                    \
    (ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |                      \
     ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |              \
     ZMQ_EVENT_CONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED)
void *tsr_sock_dealer_sec(const char *endpoint, int immediate, const struct tsr_security *sec,
                          void **mon, char *err, size_t errlen);
/* What a failed handshake event (ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL or
 * _AUTH, with its value) means for an operator: a refusal that retrying will
 * not mend.  NULL for any other event, including _NO_DETAIL (the connection
 * closed during the handshake, a transient like a disconnection). */
const char *tsr_handshake_failure(int event, uint32_t value);
void tsr_sock_close(void **sock_p);
/* A PAIR socket that receives sock's connection events (ZMQ_EVENT_* mask);
 * read one with tsr_sock_monitor_event.  Close with tsr_sock_monitor_close. */
void *tsr_sock_monitor(void *sock, int events);
/* Reads one event: returns its ZMQ_EVENT_* id, or -1. */
int tsr_sock_monitor_event(void *mon);
/* The same, with the event's value (an errno, a protocol error code) in
 * *value when value is not NULL. */
int tsr_sock_monitor_event_v(void *mon, uint32_t *value);
void tsr_sock_monitor_close(void *sock, void **mon_p);

/* Sends env, prefixed with routing id rid (ROUTER side) when rid != NULL.
 * Never blocks: a message that cannot be queued is dropped and -1 returned. */
int tsr_wire_send(void *sock, const uint8_t *rid, size_t rid_len, tsr_env_t *env);

/* Receives one message without blocking.  Returns 1 and *out when a valid
 * message was read (with its routing id copied into rid and rid_len when rid is
 * not NULL), 0 when nothing was read (nothing is waiting, or a signal
 * interrupted the read: the message stays queued), -1 when a message was
 * read but rejected (reason in err). */
int tsr_wire_recv(void *sock, uint8_t *rid, size_t *rid_len, size_t max, tsr_env_t **out,
                  char *err, size_t errlen);
/* The same, also copying the connection's authenticated user id (the name
 * of the CURVE key the ZAP handler accepted; "" on a plain socket) into
 * user (userlen bytes). */
int tsr_wire_recv_user(void *sock, uint8_t *rid, size_t *rid_len, char *user, size_t userlen,
                       size_t max, tsr_env_t **out, char *err, size_t errlen);

/* Endpoint a client should connect to for a bind endpoint: the wildcard
 * address 0.0.0.0 / * becomes 127.0.0.1.  Writes into buf. */
const char *tsr_connect_endpoint(const char *bind_ep, char *buf, size_t len);

/* True when s is a usable worker or node name: 1..TSR_NAME_MAX characters
 * of A-Z a-z 0-9 . _ - : @ (they appear in logs, tables and JSON). */
int tsr_name_ok(const char *s);

/* Fills buf with n bytes from the kernel's random source (getrandom).
 * Returns 0, or -1 when none can be had. */
int tsr_random(void *buf, size_t n);

/* "register", "heartbeat", ... for logs. */
const char *tsr_env_kind(const tsr_env_t *env);

#endif
