/* zap.c: the ZAP handler (ZeroMQ RFC 27) in its own thread (see zap.h). */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zmq.h>

#include "common/keys.h"
#include "common/log.h"
#include "common/wire.h"
#include "zap.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01"
#define RESCAN_MS 100        /* how often the directory's mtime is checked */
/* Reread even without a visible change: two changes within one tick of the
 * file system's clock leave the directory's mtime as it was. */
#define FULL_RELOAD_MS 500

struct tsr_zap {
    char dir[TSR_PATH_MAX];
    void *rep;
    pthread_t thread;
    int running;
    int stop;                    /* set by tsr_zap_stop (atomic) */
    pthread_mutex_t mu;          /* guards keys, n_keys, generation, stats */
    tsr_allowed_key_t *keys;
    size_t n_keys;
    uint64_t generation;
    uint64_t accepted, refused;
    struct timespec mtime;
    int64_t loaded_ms;
    size_t skipped;              /* files in allowed/ left out of the set */
    tsr_log_limit_t refusals;    /* the handler thread's own */
    char reported[1100];         /* the store's problem last logged ("": none) */
};

#define REFUSAL_LOG_GAP_MS 10000  /* a refused stranger retries every second or so */

static struct timespec dir_mtime(const char *dir)
{
    char p[TSR_PATH_MAX + 16];
    struct stat st;
    struct timespec t = {0, 0};
    snprintf(p, sizeof p, "%s/allowed", dir);
    if (stat(p, &st) == 0) t = st.st_mtim;
    return t;
}

static bool same_keys(const tsr_allowed_key_t *a, size_t na, const tsr_allowed_key_t *b,
                      size_t nb)
{
    if (na != nb) return false;
    for (size_t i = 0; i < na; i++)
        if (strcmp(a[i].name, b[i].name) || memcmp(a[i].bin, b[i].bin, 32)) return false;
    return true;
}

/* Logs the store's problem once, when it changes (a bad file stays bad for
 * every reread), and when it is gone.  The handler thread's own. */
static void report(tsr_zap_t *z, const char *problem)
{
    if (!strcmp(problem, z->reported)) return;
    if (problem[0]) tsr_warn("%s", problem);
    else tsr_info("the allowed keys in %s/allowed are all read again", z->dir);
    snprintf(z->reported, sizeof z->reported, "%s", problem);
}

/* Rereads the allowed keys.  strict (the start): any file that is not a
 * trusted key fails.  Otherwise such a file is left out, named in the log,
 * and the rest applied, so a removal takes effect; a store that cannot be
 * read, or that others may write, keeps the last good set (a directory
 * mid-rename must not lock everyone out, nor a stranger's file let them in). */
static int reload(tsr_zap_t *z, bool strict, char *err, size_t errlen)
{
    tsr_allowed_key_t *keys = NULL;
    tsr_keys_skipped_t sk;
    char problem[sizeof z->reported];
    struct timespec mt = dir_mtime(z->dir);
    int n = tsr_keys_allowed(z->dir, &keys, strict ? NULL : &sk, err, errlen);
    if (n < 0) {
        if (!strict) {
            snprintf(problem, sizeof problem,
                     "not applying the allowed keys just read, keeping the last good set: %s",
                     err);
            report(z, problem);
        }
        return -1;
    }
    pthread_mutex_lock(&z->mu);
    if (!same_keys(z->keys, z->n_keys, keys, (size_t)n)) {
        free(z->keys);
        z->keys = keys;
        z->n_keys = (size_t)n;
        z->generation++;
        keys = NULL;
    }
    z->skipped = strict ? 0 : sk.n;
    z->mtime = mt;
    z->loaded_ms = tsr_now_ms();
    pthread_mutex_unlock(&z->mu);
    free(keys);
    if (strict || !sk.n) problem[0] = '\0';
    else snprintf(problem, sizeof problem, "left %zu file(s) in %s/allowed out of the allowed "
                  "keys (the others apply): %s", sk.n, z->dir, sk.why);
    if (!strict) report(z, problem);
    return 0;
}

/* The key id ("name/public key") of the allowed key bin (32 bytes) into
 * user; false when it is not allowed. */
static bool find_key(tsr_zap_t *z, const void *bin, char *user, size_t len)
{
    bool found = false;
    pthread_mutex_lock(&z->mu);
    for (size_t i = 0; i < z->n_keys && !found; i++)
        if (!memcmp(z->keys[i].bin, bin, 32)) {
            snprintf(user, len, "%s/%s", z->keys[i].name, z->keys[i].pub);
            found = true;
        }
    pthread_mutex_unlock(&z->mu);
    return found;
}

/* Whether the store may have changed since it was read: its directory's
 * mtime moved, or FULL_RELOAD_MS passed. */
static bool reload_due(tsr_zap_t *z)
{
    struct timespec mt = dir_mtime(z->dir);
    pthread_mutex_lock(&z->mu);
    bool due = mt.tv_sec != z->mtime.tv_sec || mt.tv_nsec != z->mtime.tv_nsec ||
               tsr_now_ms() - z->loaded_ms >= FULL_RELOAD_MS;
    pthread_mutex_unlock(&z->mu);
    return due;
}

static void send_frame(void *s, const void *p, size_t n, int more)
{
    zmq_send(s, p, n, more ? ZMQ_SNDMORE : 0);
}

/* Reads one ZAP request and answers it. */
static void answer(tsr_zap_t *z)
{
    zmq_msg_t f[8];
    int n = 0, more = 1;
    while (more && n < 8) {
        zmq_msg_init(&f[n]);
        if (zmq_msg_recv(&f[n], z->rep, 0) < 0) {
            zmq_msg_close(&f[n]);
            break;
        }
        more = zmq_msg_more(&f[n]);
        n++;
    }
    while (more) { /* more frames than any request has: drain them */
        zmq_msg_t x;
        zmq_msg_init(&x);
        if (zmq_msg_recv(&x, z->rep, 0) < 0) more = 0;
        else more = zmq_msg_more(&x);
        zmq_msg_close(&x);
    }
    /* version, request id, domain, address, routing id, mechanism, key */
    const char *status = "400", *text = "key not allowed";
    char user[TSR_KEY_ID_MAX] = "";
    if (n == 7 && zmq_msg_size(&f[0]) == 3 && !memcmp(zmq_msg_data(&f[0]), "1.0", 3) &&
        zmq_msg_size(&f[5]) == 5 && !memcmp(zmq_msg_data(&f[5]), "CURVE", 5) &&
        zmq_msg_size(&f[6]) == 32) {
        /* A key added a moment ago may not be in the set yet: an unknown
         * key rereads the store first when it may have changed, so a
         * worker started right after `tessera keys add` gets in (ZeroMQ
         * does not retry a connection refused here). */
        char err[1024];
        if (!find_key(z, zmq_msg_data(&f[6]), user, sizeof user) && reload_due(z) &&
            reload(z, false, err, sizeof err) == 0)
            find_key(z, zmq_msg_data(&f[6]), user, sizeof user);
        pthread_mutex_lock(&z->mu);
        if (user[0]) z->accepted++;
        else z->refused++;
        pthread_mutex_unlock(&z->mu);
        if (user[0]) {
            status = "200";
            text = "OK";
        } else {
            char addr[64] = "", z85[41];
            size_t al = zmq_msg_size(&f[3]) < sizeof addr - 1 ? zmq_msg_size(&f[3]) : sizeof addr - 1;
            memcpy(addr, zmq_msg_data(&f[3]), al);
            uint64_t held;
            if (tsr_log_limit_pass(&z->refusals, tsr_now_ms(), REFUSAL_LOG_GAP_MS, &held)) {
                char more[96] = "";
                if (held)
                    snprintf(more, sizeof more, "; %llu more refused since the last such line",
                             (unsigned long long)held);
                zmq_z85_encode(z85, zmq_msg_data(&f[6]), 32);
                tsr_warn("refused a connection from %s: its key %s is not in %s/allowed (a "
                         "removed key, or one never added: `tessera keys add`)%s",
                         addr, z85, z->dir, more);
            }
        }
    } else {
        pthread_mutex_lock(&z->mu);
        z->refused++;
        pthread_mutex_unlock(&z->mu);
        text = "only CURVE is accepted";
    }
    send_frame(z->rep, "1.0", 3, 1);
    if (n >= 2) send_frame(z->rep, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), 1);
    else send_frame(z->rep, "", 0, 1);
    send_frame(z->rep, status, 3, 1);
    send_frame(z->rep, text, strlen(text), 1);
    send_frame(z->rep, user, strlen(user), 1);
    send_frame(z->rep, "", 0, 0);
    for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
}

static void *run(void *arg)
{
    tsr_zap_t *z = arg;
    zmq_pollitem_t item = {z->rep, 0, ZMQ_POLLIN, 0};
    while (!__atomic_load_n(&z->stop, __ATOMIC_ACQUIRE)) {
        int rc = zmq_poll(&item, 1, RESCAN_MS);
        if (rc < 0 && zmq_errno() == ETERM) break;  /* the context is going away */
        if (rc > 0 && (item.revents & ZMQ_POLLIN)) answer(z);
        char err[1024];
        if (reload_due(z) && reload(z, false, err, sizeof err) < 0) {
            struct timespec mt = dir_mtime(z->dir);
            pthread_mutex_lock(&z->mu);
            z->mtime = mt; /* retry at the next change or FULL_RELOAD_MS, not every 100 ms */
            z->loaded_ms = tsr_now_ms();
            pthread_mutex_unlock(&z->mu);
        }
    }
    zmq_close(z->rep);
    z->rep = NULL;
    return NULL;
}

tsr_zap_t *tsr_zap_start(const char *keys_dir, char *err, size_t errlen)
{
    tsr_zap_t *z = calloc(1, sizeof *z);
    if (!z) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&z->mu, NULL);
    snprintf(z->dir, sizeof z->dir, "%s", keys_dir);
    if (reload(z, true, err, errlen) < 0) goto fail;
    z->rep = zmq_socket(tsr_zmq_ctx(), ZMQ_REP);
    int linger = 0;
    if (!z->rep || zmq_setsockopt(z->rep, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        tsr_zmq_bind(z->rep, ZAP_ENDPOINT) != 0) {
        snprintf(err, errlen, "cannot bind the ZAP handler: %s", zmq_strerror(errno));
        goto fail;
    }
    if (pthread_create(&z->thread, NULL, run, z) != 0) {
        snprintf(err, errlen, "cannot start the ZAP thread");
        goto fail;
    }
    z->running = 1;
    return z;
fail:
    tsr_zap_stop(&z);
    return NULL;
}

void tsr_zap_stop(tsr_zap_t **self_p)
{
    if (!self_p || !*self_p) return;
    tsr_zap_t *z = *self_p;
    if (z->running) {
        __atomic_store_n(&z->stop, 1, __ATOMIC_RELEASE);
        pthread_join(z->thread, NULL);
    }
    if (z->rep) zmq_close(z->rep);
    pthread_mutex_destroy(&z->mu);
    free(z->keys);
    free(z);
    *self_p = NULL;
}

static int cmp_name(const void *key, const void *elem)
{
    return strcmp(key, ((const tsr_allowed_key_t *)elem)->name);
}

bool tsr_zap_allowed(tsr_zap_t *z, const char *key_id)
{
    if (!key_id || !key_id[0]) return false;
    const char *slash = strchr(key_id, '/');
    char name[TSR_NAME_MAX + 1];
    tsr_key_name(key_id, name, sizeof name);
    pthread_mutex_lock(&z->mu);
    const tsr_allowed_key_t *k =
        z->n_keys ? bsearch(name, z->keys, z->n_keys, sizeof *z->keys, cmp_name) : NULL;
    bool ok = k && (!slash || !strcmp(slash + 1, k->pub));
    pthread_mutex_unlock(&z->mu);
    return ok;
}

uint64_t tsr_zap_generation(tsr_zap_t *z)
{
    pthread_mutex_lock(&z->mu);
    uint64_t g = z->generation;
    pthread_mutex_unlock(&z->mu);
    return g;
}

void tsr_zap_stats(tsr_zap_t *z, tsr_zap_stats_t *out)
{
    pthread_mutex_lock(&z->mu);
    out->accepted = z->accepted;
    out->refused = z->refused;
    out->keys = z->n_keys;
    out->skipped = z->skipped;
    pthread_mutex_unlock(&z->mu);
}
