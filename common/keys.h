/* keys.h: CURVE key stores and what each process uses to authenticate.
 *
 * A key store is a directory:
 *   coordinator.key    the coordinator's key pair (secret: mode 0600)
 *   coordinator.pub    its public key, which workers and clients need
 *   NAME.key           the key pair made for worker or client NAME, to be
 *                      copied to the machine that runs it (mode 0600)
 *   allowed/NAME.pub   the public keys the coordinator lets in
 * `tessera keys init|add|remove|list` manage it.  The coordinator reads
 * coordinator.key and allowed/; a worker or client reads coordinator.pub and
 * its own IDENTITY.key.  Under systemd, a file of the same name in
 * $CREDENTIALS_DIRECTORY (LoadCredential=) takes precedence over the store's,
 * and a worker's or client's key pair may also come as the credential
 * TSR_KEYS_CREDENTIAL.
 *
 * Key files are text: "public-key = <Z85>" and, in .key files,
 * "secret-key = <Z85>" lines; '#' starts a comment. */
#ifndef TSR_KEYS_H
#define TSR_KEYS_H

#include <stddef.h>
#include "common/wire.h"

#define TSR_KEYS_DEFAULT_DIR "/etc/tessera/keys"
#define TSR_Z85_KEY 41 /* 40 Z85 characters and the NUL */
#define TSR_KEYS_CREDENTIAL "tessera-identity.key"

typedef struct {
    char pub[TSR_Z85_KEY];
    char sec[TSR_Z85_KEY]; /* "" when only the public key is known */
} tsr_keypair_t;

/* What one process's sockets use.  curve 0: plain ZeroMQ (security: none). */
typedef struct tsr_security {
    int curve;
    tsr_keypair_t self;                /* own key pair */
    char server_pub[TSR_Z85_KEY];      /* a client's: the coordinator's key */
    char identity[TSR_NAME_MAX + 1];   /* the key's name, for messages */
    char dir[TSR_PATH_MAX];            /* where the keys came from */
} tsr_security_t;

/* Creates dir (and dir/allowed) and the coordinator's key pair.  Refuses
 * when a coordinator key is already there. */
int tsr_keys_init(const char *dir, char *err, size_t errlen);
/* Makes a key pair for name: dir/NAME.key, and allows it (allowed/NAME.pub).
 * Refuses a name already allowed. */
int tsr_keys_add(const char *dir, const char *name, char *err, size_t errlen);
/* Stops allowing name: removes allowed/NAME.pub and NAME.key. */
int tsr_keys_remove(const char *dir, const char *name, char *err, size_t errlen);

/* The allowed keys of a store, sorted by name. */
typedef struct {
    char name[TSR_NAME_MAX + 1];
    char pub[TSR_Z85_KEY];
    unsigned char bin[32];
} tsr_allowed_key_t;
/* Why files in allowed/ were skipped. */
typedef struct {
    size_t n;          /* files skipped */
    char why[1024];    /* each one's reason, "; " between them (cut short when long) */
} tsr_keys_skipped_t;
/* Reads dir/allowed/ as the coordinator trusts it.  dir and dir/allowed must
 * be directories, and each key file a regular file, that neither group nor
 * others may write and that this process's user or root owns: otherwise
 * anyone could choose who is let in.  Returns the count and *out (caller
 * frees), or -1 with err naming the path at fault.  With skipped NULL a file
 * that is not a trusted public key is an error (a start: the operator who
 * mistyped one must hear of it); otherwise it is left out and named in
 * *skipped, and the rest is returned (a reread: a stray file must not keep
 * a removal from taking effect). */
int tsr_keys_allowed(const char *dir, tsr_allowed_key_t **out, tsr_keys_skipped_t *skipped,
                     char *err, size_t errlen);

/* Reads a key pair from a .key file: its mode must allow no one but the
 * owner (0600 or 0400), its secret must match its public key. */
int tsr_key_read_pair(const char *path, tsr_keypair_t *kp, char *err, size_t errlen);
/* Reads the public key of a .pub (or .key) file. */
int tsr_key_read_public(const char *path, char pub[TSR_Z85_KEY], char *err, size_t errlen);

/* Where file (e.g. "coordinator.key") is read from: $CREDENTIALS_DIRECTORY/
 * file when that exists, else dir/file.  Writes into buf. */
const char *tsr_keys_path(const char *dir, const char *file, char *buf, size_t len);

/* The coordinator's side: its key pair from dir. */
int tsr_security_server(const char *dir, tsr_security_t *out, char *err, size_t errlen);

/* A worker's or client's side.  dir and identity come from flags or the
 * environment (NULL: unset; the defaults are TSR_KEYS_DEFAULT_DIR and
 * default_identity).  When neither a directory nor an identity was given and
 * the default store has no key for the identity, the result is plain
 * (curve 0), for a coordinator with security: none.  Otherwise the key pair
 * and the coordinator's public key must be there.  Returns 0 or -1. */
int tsr_security_client(const char *dir, const char *identity, const char *default_identity,
                        tsr_security_t *out, char *err, size_t errlen);

#endif
