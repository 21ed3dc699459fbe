/* register.h: a worker joining and staying (register.c): registration, adoption
 * of the piece it holds, heartbeats. */
#ifndef TSR_REGISTER_H
#define TSR_REGISTER_H

#include <stddef.h>
#include <stdint.h>
#include "state.h"

/* Handles a Register from the connection at rid, whose CURVE key is key_id ("":
 * none): refuses it with the reason, or records the worker (adopting the piece it
 * reports when that still fits) and accepts it. */
void tsr_register_worker(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, const char *key_id,
                         tsr_env_t *env, int64_t now);
/* Takes the figures of a Heartbeat from registered worker w (already matched to its
 * connection) and acks it now and then to renew its lease. */
void tsr_register_heartbeat(tsr_coord_t *c, tsr_worker_t *w, const tsr_env_t *env, int64_t now);

#endif
