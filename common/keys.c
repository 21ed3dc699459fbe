/* keys.c: CURVE key stores (see keys.h). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "keys.h"
#include "util.h"

#define KEY_FILE_MAX 4096

/* $CREDENTIALS_DIRECTORY/file into buf when that file exists, else NULL. */
static const char *credential(const char *file, char *buf, size_t len)
{
    const char *cred = getenv("CREDENTIALS_DIRECTORY");
    if (!cred || !cred[0]) return NULL;
    snprintf(buf, len, "%s/%s", cred, file);
    return access(buf, F_OK) == 0 ? buf : NULL;
}

const char *tsr_keys_path(const char *dir, const char *file, char *buf, size_t len)
{
    if (credential(file, buf, len)) return buf;
    snprintf(buf, len, "%s/%s", dir, file);
    return buf;
}

static int z85_key_ok(const char *z, unsigned char bin[32])
{
    unsigned char tmp[32];
    if (strlen(z) != 40) return 0;
    return zmq_z85_decode(bin ? bin : tmp, z) != NULL;
}

/* Reads the whole (small) file; refuses anything over KEY_FILE_MAX. */
static int slurp(const char *path, char *buf, size_t cap, struct stat *st, char *err,
                 size_t errlen)
{
    /* Only a regular file: a FIFO in a key's place must not hang the reader.  A
     * symbolic link is followed (secret stores mount keys that way); the mode checked
     * is the file's. */
    int fd = tsr_open_regular(path, err, errlen);
    if (fd < 0) return -1;
    if (fstat(fd, st) != 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }

    ssize_t n = read(fd, buf, cap - 1);
    close(fd);
    if (n < 0 || (size_t)n >= cap - 1) {
        snprintf(err, errlen, "%s: %s", path, n < 0 ? strerror(errno) : "too large for a key file");
        return -1;
    }
    buf[n] = '\0';
    return 0;
}

/* Parses "public-key = Z" and "secret-key = Z" lines into kp; errors name
 * the file and line. */
static int parse_key_text(const char *path, char *text, tsr_keypair_t *kp, char *err,
                          size_t errlen)
{
    memset(kp, 0, sizeof *kp);
    int line = 0;
    for (char *save = NULL, *l = strtok_r(text, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        line++;
        while (*l == ' ' || *l == '\t') l++;
        size_t n = strlen(l);
        while (n && (l[n - 1] == ' ' || l[n - 1] == '\t' || l[n - 1] == '\r')) l[--n] = '\0';
        if (!n || l[0] == '#') continue;
        char *eq = strchr(l, '=');
        if (!eq) {
            snprintf(err, errlen, "%s:%d: expected 'public-key = ...' or 'secret-key = ...'",
                     path, line);
            return -1;
        }
        char *k = l, *v = eq + 1;
        char *ke = eq;
        while (ke > k && (ke[-1] == ' ' || ke[-1] == '\t')) ke--;
        *ke = '\0';
        while (*v == ' ' || *v == '\t') v++;
        char *dst;
        if (!strcmp(k, "public-key")) dst = kp->pub;
        else if (!strcmp(k, "secret-key")) dst = kp->sec;
        else {
            snprintf(err, errlen, "%s:%d: unknown field '%.40s'", path, line, k);
            return -1;
        }
        if (!z85_key_ok(v, NULL)) {
            snprintf(err, errlen, "%s:%d: %s is not a 40-character Z85 key", path, line, k);
            return -1;
        }
        memcpy(dst, v, 41);
    }
    if (!kp->pub[0]) {
        snprintf(err, errlen, "%s: no public-key line", path);
        return -1;
    }
    return 0;
}

/* Refuses what another user could rewrite (the store, allowed/, a key the
 * coordinator trusts): anything writable by group or others, or owned by
 * someone other than this process's user or root.  what names the kind. */
static int only_owner_writes(const char *path, const struct stat *st, const char *what,
                             int check_owner, char *err, size_t errlen)
{
    if (st->st_mode & 022) {
        snprintf(err, errlen, "%s: %s must not be writable by group or others, but its mode is "
                              "%04o (chmod go-w %s)",
                 path, what, (unsigned)(st->st_mode & 07777), path);
        return -1;
    }
    if (check_owner && st->st_uid != 0 && st->st_uid != geteuid()) {
        snprintf(err, errlen, "%s: %s must be owned by uid %u (this process's user) or root, "
                              "but it is owned by uid %u (chown %u %s)",
                 path, what, (unsigned)geteuid(), (unsigned)st->st_uid, (unsigned)geteuid(),
                 path);
        return -1;
    }
    return 0;
}

/* Reads a public key; check_owner: also refuse a file another user owns. */
static int read_public(const char *path, char pub[TSR_Z85_KEY], int check_owner, char *err,
                       size_t errlen)
{
    char buf[KEY_FILE_MAX];
    struct stat st;
    tsr_keypair_t kp;
    if (slurp(path, buf, sizeof buf, &st, err, errlen) < 0) return -1;
    /* Anyone who can rewrite a public key chooses who is trusted. */
    if (only_owner_writes(path, &st, "a key file", check_owner, err, errlen) < 0) return -1;
    if (parse_key_text(path, buf, &kp, err, errlen) < 0) return -1;
    memcpy(pub, kp.pub, TSR_Z85_KEY);
    return 0;
}

int tsr_key_read_public(const char *path, char pub[TSR_Z85_KEY], char *err, size_t errlen)
{
    return read_public(path, pub, 0, err, errlen);
}

int tsr_key_read_pair(const char *path, tsr_keypair_t *kp, char *err, size_t errlen)
{
    char buf[KEY_FILE_MAX];
    struct stat st;
    if (slurp(path, buf, sizeof buf, &st, err, errlen) < 0) return -1;
    if (st.st_mode & 077) {
        snprintf(err, errlen,
                 "%s: a secret key file must be readable by its owner only, but its mode is "
                 "%04o (chmod 600 %s)",
                 path, (unsigned)(st.st_mode & 07777), path);
        return -1;
    }
    int rc = parse_key_text(path, buf, kp, err, errlen);
    memset(buf, 0, sizeof buf);
    if (rc < 0) return -1;
    if (!kp->sec[0]) {
        snprintf(err, errlen, "%s: no secret-key line (is this a .pub file?)", path);
        return -1;
    }
    char derived[TSR_Z85_KEY];
    if (zmq_curve_public(derived, kp->sec) != 0 || strcmp(derived, kp->pub)) {
        snprintf(err, errlen, "%s: the secret key does not belong to the public key", path);
        return -1;
    }
    return 0;
}

/* Writes text to path, created with mode (refusing an existing file). */
static int write_new(const char *path, const char *text, mode_t mode, char *err, size_t errlen)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, mode);
    if (fd < 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    size_t n = strlen(text);
    int ok = write(fd, text, n) == (ssize_t)n && fchmod(fd, mode) == 0 && fsync(fd) == 0;
    int e = errno;
    if (close(fd) != 0) ok = 0;
    if (!ok) {
        snprintf(err, errlen, "%s: %s", path, strerror(e));
        unlink(path);
        return -1;
    }
    return 0;
}

/* Writes a public key file whole: under a hidden name first (the coordinator's
 * rereads skip names starting with '.'), then linked into place, so a reread
 * never sees it half-written.  Refuses an existing path. */
static int publish_new(const char *path, const char *text, char *err, size_t errlen)
{
    char tmp[TSR_PATH_MAX + 220];
    const char *slash = strrchr(path, '/');
    int dirlen = slash ? (int)(slash - path + 1) : 0;
    snprintf(tmp, sizeof tmp, "%.*s.%s.tmp", dirlen, path, slash ? slash + 1 : path);
    unlink(tmp); /* left by an interrupted run */
    if (write_new(tmp, text, 0644, err, errlen) < 0) return -1;
    int rc = link(tmp, path);
    if (rc != 0) snprintf(err, errlen, "%s: %s", path, strerror(errno));
    unlink(tmp);
    return rc == 0 ? 0 : -1;
}

/* Makes a key pair and writes NAME.key (0600) and the public key to pubpath. */
static int make_pair(const char *dir, const char *name, const char *pubpath, char *err,
                     size_t errlen)
{
    char pub[TSR_Z85_KEY], sec[TSR_Z85_KEY], keypath[TSR_PATH_MAX + 160], text[512];
    if (zmq_curve_keypair(pub, sec) != 0) {
        snprintf(err, errlen, "cannot make a key pair: %s", zmq_strerror(errno));
        return -1;
    }
    snprintf(keypath, sizeof keypath, "%s/%s.key", dir, name);
    snprintf(text, sizeof text,
             "# Tessera CURVE key pair of %s.  Secret: keep it mode 0600, on the machine\n"
             "# that runs %s only.\npublic-key = %s\nsecret-key = %s\n",
             name, name, pub, sec);
    int rc = write_new(keypath, text, 0600, err, errlen);
    memset(text, 0, sizeof text);
    memset(sec, 0, sizeof sec);
    if (rc < 0) return -1;
    snprintf(text, sizeof text, "# Tessera CURVE public key of %s\npublic-key = %s\n", name, pub);
    if (publish_new(pubpath, text, err, errlen) < 0) {
        unlink(keypath);
        return -1;
    }
    return 0;
}

static int mkdir_ok(const char *path, char *err, size_t errlen)
{
    if (mkdir(path, 0755) == 0 || errno == EEXIST) {
        struct stat st;
        if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) return 0;
        errno = ENOTDIR;
    }
    snprintf(err, errlen, "%s: %s", path, strerror(errno));
    return -1;
}

int tsr_keys_init(const char *dir, char *err, size_t errlen)
{
    char p[TSR_PATH_MAX + 64];
    if (strlen(dir) >= TSR_PATH_MAX) {
        snprintf(err, errlen, "key directory path is longer than %d characters", TSR_PATH_MAX);
        return -1;
    }
    if (mkdir_ok(dir, err, errlen) < 0) return -1;
    snprintf(p, sizeof p, "%s/allowed", dir);
    if (mkdir_ok(p, err, errlen) < 0) return -1;
    snprintf(p, sizeof p, "%s/coordinator.key", dir);
    if (access(p, F_OK) == 0) {
        snprintf(err, errlen, "%s already exists: this key store is initialised", p);
        return -1;
    }
    snprintf(p, sizeof p, "%s/coordinator.pub", dir);
    return make_pair(dir, "coordinator", p, err, errlen);
}

static int check_store_name(const char *dir, const char *name, char *err, size_t errlen)
{
    if (!tsr_name_ok(name) || !strcmp(name, "coordinator")) {
        snprintf(err, errlen,
                 "key name '%.64s' must be 1 to %d of A-Z a-z 0-9 . _ - : @ and not "
                 "'coordinator'",
                 name, TSR_NAME_MAX);
        return -1;
    }
    if (strlen(dir) >= TSR_PATH_MAX) {
        snprintf(err, errlen, "key directory path is longer than %d characters", TSR_PATH_MAX);
        return -1;
    }
    char p[TSR_PATH_MAX + 64];
    snprintf(p, sizeof p, "%s/allowed", dir);
    struct stat st;
    if (stat(p, &st) != 0 || !S_ISDIR(st.st_mode)) {
        snprintf(err, errlen, "%s is not a key store (no allowed/ directory; run tessera keys "
                              "init %s)", dir, dir);
        return -1;
    }
    return 0;
}

int tsr_keys_add(const char *dir, const char *name, char *err, size_t errlen)
{
    if (check_store_name(dir, name, err, errlen) < 0) return -1;
    char pub[TSR_PATH_MAX + 200];
    snprintf(pub, sizeof pub, "%s/allowed/%s.pub", dir, name);
    if (access(pub, F_OK) == 0) {
        snprintf(err, errlen, "%s is already allowed (%s); remove it first to make a new key",
                 name, pub);
        return -1;
    }
    return make_pair(dir, name, pub, err, errlen);
}

int tsr_keys_remove(const char *dir, const char *name, char *err, size_t errlen)
{
    if (check_store_name(dir, name, err, errlen) < 0) return -1;
    char pub[TSR_PATH_MAX + 200], key[TSR_PATH_MAX + 200];
    snprintf(pub, sizeof pub, "%s/allowed/%s.pub", dir, name);
    snprintf(key, sizeof key, "%s/%s.key", dir, name);
    if (unlink(pub) != 0) {
        snprintf(err, errlen, "%s: %s", pub,
                 errno == ENOENT ? "no such key is allowed" : strerror(errno));
        return -1;
    }
    if (unlink(key) != 0 && errno != ENOENT) {
        snprintf(err, errlen, "%s: %s (the key is no longer allowed)", key, strerror(errno));
        return -1;
    }
    return 0;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const tsr_allowed_key_t *)a)->name, ((const tsr_allowed_key_t *)b)->name);
}

/* The store and its allowed/ must be directories only their owner (this
 * process's user or root) may change: whoever may add a file there is let in. */
static int store_private(const char *dir, char *err, size_t errlen)
{
    char p[TSR_PATH_MAX + 64];
    const char *paths[2] = {dir, p};
    snprintf(p, sizeof p, "%s/allowed", dir);
    for (int i = 0; i < 2; i++) {
        struct stat st;
        if (stat(paths[i], &st) != 0) {
            snprintf(err, errlen, "%s: %s", paths[i], strerror(errno));
            return -1;
        }
        if (!S_ISDIR(st.st_mode)) {
            snprintf(err, errlen, "%s: not a directory", paths[i]);
            return -1;
        }
        if (only_owner_writes(paths[i], &st, "a key directory", 1, err, errlen) < 0) return -1;
    }
    return 0;
}

/* Notes why file was skipped in sk. */
static void note_skipped(tsr_keys_skipped_t *sk, const char *why)
{
    size_t used = strlen(sk->why);
    if (used + 3 < sizeof sk->why)
        snprintf(sk->why + used, sizeof sk->why - used, "%s%s", used ? "; " : "", why);
    sk->n++;
}

int tsr_keys_allowed(const char *dir, tsr_allowed_key_t **out, tsr_keys_skipped_t *skipped,
                     char *err, size_t errlen)
{
    char p[TSR_PATH_MAX + 64];
    *out = NULL;
    if (skipped) memset(skipped, 0, sizeof *skipped);
    if (store_private(dir, err, errlen) < 0) return -1;
    snprintf(p, sizeof p, "%s/allowed", dir);
    DIR *d = opendir(p);
    if (!d) {
        snprintf(err, errlen, "%s: %s", p, strerror(errno));
        return -1;
    }
    tsr_allowed_key_t *v = NULL;
    size_t n = 0, cap = 0;
    int rc = -1;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (de->d_name[0] == '.' || len < 5 || strcmp(de->d_name + len - 4, ".pub")) continue;
        char name[TSR_NAME_MAX + 1];
        if (len - 4 > TSR_NAME_MAX) continue;
        memcpy(name, de->d_name, len - 4);
        name[len - 4] = '\0';
        if (!tsr_name_ok(name)) continue;
        if (n == cap) {
            size_t nc = cap ? cap * 2 : 16;
            tsr_allowed_key_t *nv = realloc(v, nc * sizeof *nv);
            if (!nv) {
                snprintf(err, errlen, "out of memory");
                goto out;
            }
            v = nv;
            cap = nc;
        }
        char f[TSR_PATH_MAX + 200];
        snprintf(f, sizeof f, "%s/%s", p, de->d_name);
        tsr_allowed_key_t *k = &v[n];
        memset(k, 0, sizeof *k);
        memcpy(k->name, name, len - 3);
        errno = 0;
        if (read_public(f, k->pub, 1, err, errlen) < 0) {
            if (errno == ENOENT) continue; /* removed while we read */
            if (!skipped) goto out;
            note_skipped(skipped, err);
            continue;
        }
        zmq_z85_decode(k->bin, k->pub);
        n++;
    }
    if (n) qsort(v, n, sizeof *v, by_name);
    *out = v;
    v = NULL;
    rc = (int)n;
out:
    closedir(d);
    free(v);
    return rc;
}

int tsr_security_server(const char *dir, tsr_security_t *out, char *err, size_t errlen)
{
    char p[TSR_PATH_MAX + 64];
    memset(out, 0, sizeof *out);
    out->curve = 1;
    snprintf(out->identity, sizeof out->identity, "coordinator");
    snprintf(out->dir, sizeof out->dir, "%s", dir);
    tsr_keys_path(dir, "coordinator.key", p, sizeof p);
    if (tsr_key_read_pair(p, &out->self, err, errlen) < 0) return -1;
    memcpy(out->server_pub, out->self.pub, TSR_Z85_KEY);
    return 0;
}

int tsr_security_client(const char *dir, const char *identity, const char *default_identity,
                        tsr_security_t *out, char *err, size_t errlen)
{
    int asked = (dir && dir[0]) || (identity && identity[0]);
    if (!dir || !dir[0]) dir = TSR_KEYS_DEFAULT_DIR;
    if (!identity || !identity[0]) identity = default_identity;
    memset(out, 0, sizeof *out);
    if (!tsr_name_ok(identity)) {
        snprintf(err, errlen, "identity '%.64s' must be 1 to %d of A-Z a-z 0-9 . _ - : @",
                 identity, TSR_NAME_MAX);
        return -1;
    }
    if (strlen(dir) >= TSR_PATH_MAX) {
        snprintf(err, errlen, "key directory path is longer than %d characters", TSR_PATH_MAX);
        return -1;
    }
    snprintf(out->identity, sizeof out->identity, "%s", identity);
    snprintf(out->dir, sizeof out->dir, "%s", dir);
    char file[TSR_NAME_MAX + 8], p[TSR_PATH_MAX + 200];
    snprintf(file, sizeof file, "%s.key", identity);
    /* systemd units pass the key pair under a fixed name (their identity is
     * the host name, which LoadCredential= cannot put in a name). */
    if (!credential(TSR_KEYS_CREDENTIAL, p, sizeof p)) tsr_keys_path(dir, file, p, sizeof p);
    if (!asked && access(p, F_OK) != 0) return 0; /* plain: security none */
    out->curve = 1;
    if (tsr_key_read_pair(p, &out->self, err, errlen) < 0) return -1;
    tsr_keys_path(dir, "coordinator.pub", p, sizeof p);
    if (tsr_key_read_public(p, out->server_pub, err, errlen) < 0) return -1;
    return 0;
}
