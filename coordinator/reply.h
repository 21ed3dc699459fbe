/* reply.h: ControlReply messages to control clients (reply.c): the CLI on the
 * control socket, the HTTP server's threads on the in-process bridge. */
#ifndef TSR_REPLY_H
#define TSR_REPLY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "state.h"

/* Who sent the control message being handled, and so where its answers go.  The
 * pointers are the caller's (the socket reader's buffers): valid while the message is
 * handled; a handler that answers later copies them. */
typedef struct {
    void *sock;                 /* the socket it came in on (control or HTTP bridge) */
    const uint8_t *rid;         /* its routing id there */
    size_t rid_len;
    const char *key_id;         /* its CURVE key id ("" without CURVE or on the bridge) */
} tsr_client_t;

/* What became of a reply.  The control sockets are ROUTERs with
 * ZMQ_ROUTER_MANDATORY, so a client that disconnected is told apart from one
 * that reads slowly: only GONE means nobody will ever read it. */
enum {
    TSR_REPLY_SENT = 0,
    TSR_REPLY_DROPPED = -1,     /* the client's queue is full (high-water mark): this
                                   reply is lost, the client is still there */
    TSR_REPLY_GONE = -2,        /* the client disconnected (EHOSTUNREACH) */
};
#ifdef TSR_TESTING
/* Sends one ControlReply to the client at routing id rid on the control socket; json
 * is the reply's document text (NULL for none).  Returns one of TSR_REPLY_*.  Test
 * builds only: the coordinator answers a client through tsr_control_answer, on the
 * socket the client came from. */
int tsr_control_reply(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, bool ok,
                      const char *error, const char *json);
#endif
/* The same to client `to`, on the socket it came from, with ControlReply.code set
 * (NULL: none). */
int tsr_control_answer(tsr_coord_t *c, const tsr_client_t *to, bool ok, const char *code,
                       const char *error, const char *json);
/* The same on a given socket (a request's client, later). */
int tsr_control_send(tsr_coord_t *c, void *sock, const uint8_t *rid, size_t rid_len, bool ok,
                     const char *code, const char *error, const char *json);

#endif
