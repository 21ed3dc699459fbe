/* reply.c: ControlReply messages to control clients, on the socket each came
 * from. */
#include "reply.h"

#include <errno.h>
#include <stdio.h>

#ifdef TSR_TESTING
int tsr_control_reply(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, bool ok,
                      const char *error, const char *json)
{
    return tsr_control_send(c, c->csock, rid, rid_len, ok, NULL, error, json);
}
#endif

int tsr_control_answer(tsr_coord_t *c, const tsr_client_t *to, bool ok, const char *code,
                       const char *error, const char *json)
{
    return tsr_control_send(c, to->sock, to->rid, to->rid_len, ok, code, error, json);
}

int tsr_control_send(tsr_coord_t *c, void *sock, const uint8_t *rid, size_t rid_len, bool ok,
                     const char *code, const char *error, const char *json)
{
    Tessera__ControlReply r = TESSERA__CONTROL_REPLY__INIT;
    r.ok = ok;
    r.code = (char *)(code ? code : "");
    r.error = (char *)(error ? error : "");
    r.json = (char *)(json ? json : "");
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.epoch = c->epoch;
    env.body_case = TESSERA__ENVELOPE__BODY_CONTROL_REPLY;
    env.control_reply = &r;
    if (tsr_wire_send(sock, rid, rid_len, &env) == 0) return TSR_REPLY_SENT;
    /* errno is zmq_send's (tsr_wire_send only frees after it, and free keeps
     * errno): EHOSTUNREACH for an unknown routing id (the client
     * disconnected), EAGAIN when its queue is at the high-water mark. */
    return errno == EHOSTUNREACH ? TSR_REPLY_GONE : TSR_REPLY_DROPPED;
}
