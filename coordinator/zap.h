/* zap.h: the coordinator's ZAP handler, which decides who may connect.
 *
 * Every connection to a CURVE socket (tsr_sock_router_sec) is handed by
 * ZeroMQ to this handler, which accepts it only when the client's public key
 * is one of keys_dir/allowed/NAME.pub, and names the connection NAME (its
 * "User-Id", see tsr_wire_recv_user).  The handler runs in its own thread;
 * it rereads the allowed keys within 100 ms of a change to the directory, so
 * the coordinator can drop a removed key's live sessions within a second.
 * A reread leaves out a file that is not a trusted key (logged once) and
 * keeps the last good set while the store cannot be read or others may
 * write it (see tsr_keys_allowed). */
#ifndef TSR_ZAP_H
#define TSR_ZAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct tsr_zap tsr_zap_t;

/* A connection's key id (its ZAP "User-Id"): the key's name, '/', and its
 * public key in Z85, so a key replaced under the same name is another key. */
#define TSR_KEY_ID_MAX (128 + 1 + 40 + 1)

/* The name part of a key id, into buf. */
static inline const char *tsr_key_name(const char *key_id, char *buf, size_t len)
{
    size_t n = 0;
    while (key_id[n] && key_id[n] != '/' && n + 1 < len) n++;
    for (size_t i = 0; i < n; i++) buf[i] = key_id[i];
    if (len) buf[n] = '\0';
    return buf;
}

/* Binds the ZAP endpoint in this process's ZeroMQ context (before any CURVE
 * socket is bound: ZeroMQ lets every client in while no handler is bound)
 * and starts its thread.  NULL with err when keys_dir/allowed cannot be
 * read, others may write it or a file in it is not a trusted key, or the
 * endpoint cannot be bound. */
tsr_zap_t *tsr_zap_start(const char *keys_dir, char *err, size_t errlen);
void tsr_zap_stop(tsr_zap_t **self_p);

/* True while key_id (name/public key) is an allowed key: false once the
 * name is removed or its key replaced.  Thread-safe. */
bool tsr_zap_allowed(tsr_zap_t *self, const char *key_id);
/* Changes whenever the set of allowed keys changes. */
uint64_t tsr_zap_generation(tsr_zap_t *self);

typedef struct {
    uint64_t accepted, refused;  /* handshakes */
    size_t keys;                 /* allowed keys now */
    size_t skipped;              /* files in allowed/ the last reread left out */
} tsr_zap_stats_t;
void tsr_zap_stats(tsr_zap_t *self, tsr_zap_stats_t *out);

#endif
