/* test_keys.c: key stores (common/keys.c), CURVE sockets and the ZAP
 * handler (coordinator/zap.c): who gets in, under which name, and who is
 * cut off when a key is removed. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/keys.h"
#include "common/log.h"
#include "common/wire.h"
#include "coordinator/zap.h"

static char dir[64];

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/tsr-keys-XXXXXX");
    assert_non_null(mkdtemp(dir));
    unsetenv("CREDENTIALS_DIRECTORY");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
    return 0;
}

static void path(char *buf, size_t len, const char *rel)
{
    snprintf(buf, len, "%s/%s", dir, rel);
}

static void write_text(const char *rel, const char *text, mode_t mode)
{
    char p[256];
    path(p, sizeof p, rel);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    assert_int_equal(chmod(p, mode), 0);
}

/* A key store in the test's directory with the coordinator's pair and w1's. */
static void make_store(char *store, size_t len)
{
    char err[1024];
    path(store, len, "ks");
    if (tsr_keys_init(store, err, sizeof err) < 0 || tsr_keys_add(store, "w1", err, sizeof err) < 0)
        fail_msg("%s", err);
}

static void test_init_add_list_remove(void **state)
{
    (void)state;
    char err[1024] = "", p[256];
    char store[128];
    path(store, sizeof store, "ks");
    assert_int_equal(tsr_keys_init(store, err, sizeof err), 0);
    /* A second init would replace the coordinator's identity: refused. */
    assert_int_equal(tsr_keys_init(store, err, sizeof err), -1);
    assert_non_null(strstr(err, "already exists"));
    assert_int_equal(tsr_keys_add(store, "w1", err, sizeof err), 0);
    assert_int_equal(tsr_keys_add(store, "cli", err, sizeof err), 0);
    assert_int_equal(tsr_keys_add(store, "w1", err, sizeof err), -1);
    assert_non_null(strstr(err, "already allowed"));
    /* Names that are not names, or the coordinator's own. */
    assert_int_equal(tsr_keys_add(store, "../x", err, sizeof err), -1);
    assert_int_equal(tsr_keys_add(store, "coordinator", err, sizeof err), -1);

    struct stat st;
    path(p, sizeof p, "ks/w1.key");
    assert_int_equal(stat(p, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    path(p, sizeof p, "ks/coordinator.key");
    assert_int_equal(stat(p, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);

    tsr_allowed_key_t *keys = NULL;
    assert_int_equal(tsr_keys_allowed(store, &keys, NULL, err, sizeof err), 2);
    assert_string_equal(keys[0].name, "cli");
    assert_string_equal(keys[1].name, "w1");
    tsr_keypair_t kp;
    path(p, sizeof p, "ks/w1.key");
    assert_int_equal(tsr_key_read_pair(p, &kp, err, sizeof err), 0);
    assert_string_equal(kp.pub, keys[1].pub);
    free(keys);

    assert_int_equal(tsr_keys_remove(store, "w1", err, sizeof err), 0);
    assert_int_equal(access(p, F_OK), -1);
    assert_int_equal(tsr_keys_allowed(store, &keys, NULL, err, sizeof err), 1);
    assert_string_equal(keys[0].name, "cli");
    free(keys);
    assert_int_equal(tsr_keys_remove(store, "w1", err, sizeof err), -1);
    assert_non_null(strstr(err, "no such key"));
    assert_int_equal(tsr_keys_add(dir, "w1", err, sizeof err), -1);
    assert_non_null(strstr(err, "not a key store"));
}

static void test_secret_key_files_must_be_private_and_well_formed(void **state)
{
    (void)state;
    char err[1024] = "", p[256], store[128];
    make_store(store, sizeof store);
    tsr_keypair_t kp, good;
    path(p, sizeof p, "ks/w1.key");
    assert_int_equal(tsr_key_read_pair(p, &good, err, sizeof err), 0);

    static const mode_t loose[] = {0604, 0640, 0644, 0660};
    for (size_t i = 0; i < sizeof loose / sizeof loose[0]; i++) {
        assert_int_equal(chmod(p, loose[i]), 0);
        assert_int_equal(tsr_key_read_pair(p, &kp, err, sizeof err), -1);
        assert_non_null(strstr(err, p));
        assert_non_null(strstr(err, "chmod 600"));
    }
    assert_int_equal(chmod(p, 0400), 0);
    assert_int_equal(tsr_key_read_pair(p, &kp, err, sizeof err), 0);

    /* Errors name the file and line. */
    write_text("bad1.key", "# c\npublic-key = short\n", 0600);
    path(p, sizeof p, "bad1.key");
    assert_int_equal(tsr_key_read_pair(p, &kp, err, sizeof err), -1);
    assert_non_null(strstr(err, "bad1.key:2: public-key is not a 40-character Z85 key"));
    write_text("bad2.key", "pubkey = x\n", 0600);
    path(p, sizeof p, "bad2.key");
    assert_int_equal(tsr_key_read_pair(p, &kp, err, sizeof err), -1);
    assert_non_null(strstr(err, "bad2.key:1: unknown field 'pubkey'"));
    /* A secret that is not the public key's. */
    char other_pub[41], other_sec[41], text[256];
    assert_int_equal(zmq_curve_keypair(other_pub, other_sec), 0);
    snprintf(text, sizeof text, "public-key = %s\nsecret-key = %s\n", good.pub, other_sec);
    write_text("bad3.key", text, 0600);
    path(p, sizeof p, "bad3.key");
    assert_int_equal(tsr_key_read_pair(p, &kp, err, sizeof err), -1);
    assert_non_null(strstr(err, "does not belong"));
    /* A public key file where a pair is needed. */
    path(p, sizeof p, "ks/coordinator.pub");
    assert_int_equal(tsr_key_read_pair(p, &kp, err, sizeof err), -1);
    /* A link is followed, and the mode checked is the file's. */
    char link[256], target[256];
    path(link, sizeof link, "link.key");
    path(target, sizeof target, "ks/w1.key");
    assert_int_equal(chmod(target, 0600), 0);
    assert_int_equal(symlink(target, link), 0);
    assert_int_equal(tsr_key_read_pair(link, &kp, err, sizeof err), 0);
    assert_string_equal(kp.pub, good.pub);
    /* A FIFO in a key's place is refused at once, not read forever. */
    path(p, sizeof p, "fifo.key");
    assert_int_equal(mkfifo(p, 0600), 0);
    assert_int_equal(tsr_key_read_pair(p, &kp, err, sizeof err), -1);
    assert_non_null(strstr(err, "not a regular file"));
    /* A public key anyone in the group may rewrite is not trusted. */
    path(p, sizeof p, "ks/coordinator.pub");
    assert_int_equal(chmod(p, 0664), 0);
    char pub[41];
    assert_int_equal(tsr_key_read_public(p, pub, err, sizeof err), -1);
    assert_non_null(strstr(err, "chmod go-w"));
    assert_int_equal(chmod(p, 0644), 0);
    assert_int_equal(tsr_key_read_public(p, pub, err, sizeof err), 0);
    /* A broken file in allowed/ is reported, not skipped. */
    write_text("ks/allowed/typo.pub", "public-key = nope\n", 0644);
    tsr_allowed_key_t *keys = NULL;
    assert_int_equal(tsr_keys_allowed(store, &keys, NULL, err, sizeof err), -1);
    assert_non_null(strstr(err, "typo.pub:1"));
}

static void test_client_keys_come_from_flags_defaults_or_credentials(void **state)
{
    (void)state;
    char err[1024] = "", store[128], p[256];
    make_store(store, sizeof store);
    tsr_security_t sec;
    assert_int_equal(tsr_security_client(store, NULL, "w1", &sec, err, sizeof err), 0);
    assert_int_equal(sec.curve, 1);
    assert_string_equal(sec.identity, "w1");
    char cpub[41];
    path(p, sizeof p, "ks/coordinator.pub");
    assert_int_equal(tsr_key_read_public(p, cpub, err, sizeof err), 0);
    assert_string_equal(sec.server_pub, cpub);
    /* An identity asked for but missing is an error, never plain. */
    assert_int_equal(tsr_security_client(store, "nobody", "w1", &sec, err, sizeof err), -1);
    assert_non_null(strstr(err, "nobody.key"));
    /* Under systemd the pair comes as a credential with a fixed name. */
    char cred[128];
    path(cred, sizeof cred, "cred");
    assert_int_equal(mkdir(cred, 0700), 0);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "cp -p %s/w1.key %s/" TSR_KEYS_CREDENTIAL " && cp %s/coordinator.pub %s/",
             store, cred, store, cred);
    assert_int_equal(system(cmd), 0);
    setenv("CREDENTIALS_DIRECTORY", cred, 1);
    assert_int_equal(tsr_security_client(NULL, "host1", "w9", &sec, err, sizeof err), 0);
    unsetenv("CREDENTIALS_DIRECTORY");
    assert_int_equal(sec.curve, 1);
    assert_string_equal(sec.identity, "host1");
    assert_string_equal(sec.server_pub, cpub);
}

/* ---- CURVE sockets through the ZAP handler ---------------------------------- */

/* Waits up to 3 s for a message on the router; returns 1 with the body's
 * sender key name in user, 0 when none came. */
static int recv_user(void *router, char *user, size_t len)
{
    char err[256];
    for (int i = 0; i < 300; i++) {
        uint8_t rid[256];
        size_t rid_len = 0;
        tsr_env_t *env = NULL;
        int rc = tsr_wire_recv_user(router, rid, &rid_len, user, len, TSR_WIRE_MAX_WORKER, &env,
                                    err, sizeof err);
        if (rc == 1) {
            tsr_env_free(&env);
            return 1;
        }
        usleep(10000);
    }
    return 0;
}

static void send_hb(void *dealer)
{
    Tessera__Heartbeat hb = TESSERA__HEARTBEAT__INIT;
    tsr_env_t env = TESSERA__ENVELOPE__INIT;
    env.worker = "x";
    env.body_case = TESSERA__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    tsr_wire_send(dealer, NULL, 0, &env);
}

/* Waits for a handshake failure on mon; returns the event id or -1. */
static int handshake_event(void *mon)
{
    for (int i = 0; i < 300; i++) {
        uint32_t v;
        int ev = tsr_sock_monitor_event_v(mon, &v);
        if (ev >= 0 && tsr_handshake_failure(ev, v)) return ev;
        if (ev < 0) usleep(10000);
    }
    return -1;
}

static void test_only_allowed_keys_get_in_under_their_names(void **state)
{
    (void)state;
    char err[1024] = "", store[128], ep[64];
    make_store(store, sizeof store);
    assert_int_equal(tsr_keys_add(store, "mallory", err, sizeof err), 0);
    tsr_security_t server, w1, mallory, plain = {0};
    assert_int_equal(tsr_security_server(store, &server, err, sizeof err), 0);
    assert_int_equal(tsr_security_client(store, NULL, "w1", &w1, err, sizeof err), 0);
    assert_int_equal(tsr_security_client(store, NULL, "mallory", &mallory, err, sizeof err), 0);
    /* mallory's key is made, then no longer allowed. */
    assert_int_equal(tsr_keys_remove(store, "mallory", err, sizeof err), 0);

    tsr_zap_t *zap = tsr_zap_start(store, err, sizeof err);
    if (!zap) fail_msg("%s", err);
    void *router = tsr_sock_router_sec("tcp://127.0.0.1:*", TSR_WIRE_MAX_WORKER, &server, err,
                                       sizeof err);
    if (!router) fail_msg("%s", err);
    size_t eplen = sizeof ep;
    assert_int_equal(zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, ep, &eplen), 0);

    void *mon = NULL;
    void *good = tsr_sock_dealer_sec(ep, 0, &w1, &mon, err, sizeof err);
    assert_non_null(good);
    send_hb(good);
    char user[TSR_NAME_MAX + 1] = "?";
    char want[TSR_KEY_ID_MAX];
    snprintf(want, sizeof want, "w1/%s", w1.self.pub);
    assert_int_equal(recv_user(router, user, sizeof user), 1);
    assert_string_equal(user, want);  /* the key's name and public key */
    tsr_sock_monitor_close(good, &mon);

    /* An unknown key and a plain client: nothing arrives, and each side
     * learns why from its own handshake. */
    void *mon2 = NULL, *mon3 = NULL;
    void *bad = tsr_sock_dealer_sec(ep, 0, &mallory, &mon2, err, sizeof err);
    void *none = tsr_sock_dealer_sec(ep, 0, &plain, &mon3, err, sizeof err);
    assert_non_null(bad);
    assert_non_null(none);
    send_hb(bad);
    send_hb(none);
    assert_int_equal(handshake_event(mon2), ZMQ_EVENT_HANDSHAKE_FAILED_AUTH);
    assert_int_equal(handshake_event(mon3), ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL);
    assert_int_equal(recv_user(router, user, sizeof user), 0);
    tsr_zap_stats_t zs;
    tsr_zap_stats(zap, &zs);
    assert_true(zs.refused >= 1);
    assert_true(zs.accepted >= 1);

    /* Replacing w1's key (remove, add) is seen within the handler's
     * rescan: the old key's sessions are no longer allowed, the new key's
     * are. */
    uint64_t g = tsr_zap_generation(zap);
    assert_true(tsr_zap_allowed(zap, user));
    assert_int_equal(tsr_keys_remove(store, "w1", err, sizeof err), 0);
    assert_int_equal(tsr_keys_add(store, "w1", err, sizeof err), 0);
    tsr_security_t w1b;
    assert_int_equal(tsr_security_client(store, NULL, "w1", &w1b, err, sizeof err), 0);
    snprintf(want, sizeof want, "w1/%s", w1b.self.pub);
    for (int i = 0; i < 300 && !tsr_zap_allowed(zap, want); i++) usleep(10000);
    assert_true(tsr_zap_generation(zap) != g);
    assert_false(tsr_zap_allowed(zap, user));
    assert_true(tsr_zap_allowed(zap, want));
    g = tsr_zap_generation(zap);
    assert_int_equal(tsr_keys_remove(store, "w1", err, sizeof err), 0);
    for (int i = 0; i < 300 && tsr_zap_allowed(zap, want); i++) usleep(10000);
    assert_false(tsr_zap_allowed(zap, want));
    assert_false(tsr_zap_allowed(zap, ""));

    tsr_sock_monitor_close(bad, &mon2);
    tsr_sock_monitor_close(none, &mon3);
    tsr_sock_close(&bad);
    tsr_sock_close(&none);
    tsr_sock_close(&good);
    tsr_sock_close(&router);
    tsr_zap_stop(&zap);
    assert_null(zap);
}

/* Waits (up to 3 s) until key_id's admission is want; returns whether it is. */
static bool wait_allowed(tsr_zap_t *zap, const char *key_id, bool want)
{
    for (int i = 0; i < 300 && tsr_zap_allowed(zap, key_id) != want; i++) usleep(10000);
    return tsr_zap_allowed(zap, key_id) == want;
}

/* Anyone who may write into the store, or owns it, chooses who is trusted:
 * such a store is refused at start and its rereads are not applied. */
static void test_a_store_others_may_write_is_refused(void **state)
{
    (void)state;
    char err[1024] = "", store[128], allowed[160], p[256];
    make_store(store, sizeof store);
    snprintf(allowed, sizeof allowed, "%s/allowed", store);
    const struct { const char *what; mode_t mode; } loose[] = {
        {store, 0777}, {store, 0775}, {allowed, 0777}, {allowed, 0757}, {allowed, 01777}};
    for (size_t i = 0; i < sizeof loose / sizeof *loose; i++) {
        assert_int_equal(chmod(loose[i].what, loose[i].mode), 0);
        tsr_zap_t *zap = tsr_zap_start(store, err, sizeof err);
        assert_null(zap);
        char want[256];
        snprintf(want, sizeof want, "%s: ", loose[i].what);
        if (!strstr(err, want) || !strstr(err, "mode") || !strstr(err, "chmod go-w"))
            fail_msg("%s at %04o: %s", loose[i].what, (unsigned)loose[i].mode, err);
        assert_int_equal(chmod(loose[i].what, 0755), 0);
    }
    /* Owned by another user (nobody) than this process's or root. */
    assert_int_equal(chown(allowed, 65534, 65534), 0);
    assert_null(tsr_zap_start(store, err, sizeof err));
    if (!strstr(err, allowed) || !strstr(err, "owned by uid 65534")) fail_msg("%s", err);
    assert_int_equal(chown(allowed, 0, 0), 0);
    path(p, sizeof p, "ks/allowed/w1.pub");
    assert_int_equal(chown(p, 65534, 65534), 0);
    assert_null(tsr_zap_start(store, err, sizeof err));
    if (!strstr(err, p) || !strstr(err, "owned by uid 65534")) fail_msg("%s", err);
    assert_int_equal(chown(p, 0, 0), 0);

    /* Running, then the directory opens up and a stranger's key appears:
     * the reread is not applied. */
    tsr_zap_t *zap = tsr_zap_start(store, err, sizeof err);
    if (!zap) fail_msg("%s", err);
    tsr_security_t w1;
    assert_int_equal(tsr_security_client(store, NULL, "w1", &w1, err, sizeof err), 0);
    char w1id[TSR_KEY_ID_MAX], xid[TSR_KEY_ID_MAX];
    snprintf(w1id, sizeof w1id, "w1/%s", w1.self.pub);
    assert_true(tsr_zap_allowed(zap, w1id));
    assert_int_equal(chmod(allowed, 0777), 0);
    assert_int_equal(tsr_keys_add(store, "intruder", err, sizeof err), 0);
    tsr_security_t x;
    assert_int_equal(tsr_security_client(store, NULL, "intruder", &x, err, sizeof err), 0);
    snprintf(xid, sizeof xid, "intruder/%s", x.self.pub);
    assert_false(wait_allowed(zap, xid, true));
    assert_true(tsr_zap_allowed(zap, w1id));
    /* Made private again, the set is applied. */
    assert_int_equal(chmod(allowed, 0755), 0);
    assert_true(wait_allowed(zap, xid, true));
    /* A .pub others may write is not trusted on reread either. */
    path(p, sizeof p, "ks/allowed/intruder.pub");
    assert_int_equal(chmod(p, 0666), 0);
    assert_true(wait_allowed(zap, xid, false));
    assert_true(tsr_zap_allowed(zap, w1id));
    tsr_zap_stop(&zap);
}

/* A file in allowed/ that is not a key does not stop a removal from taking
 * effect: it is skipped, the rest applied.  A start still refuses it. */
static void test_a_bad_file_does_not_block_removals(void **state)
{
    (void)state;
    char err[1024] = "", store[128];
    make_store(store, sizeof store);
    assert_int_equal(tsr_keys_add(store, "evil", err, sizeof err), 0);
    tsr_security_t evil;
    assert_int_equal(tsr_security_client(store, NULL, "evil", &evil, err, sizeof err), 0);
    char eid[TSR_KEY_ID_MAX];
    snprintf(eid, sizeof eid, "evil/%s", evil.self.pub);
    tsr_zap_t *zap = tsr_zap_start(store, err, sizeof err);
    if (!zap) fail_msg("%s", err);
    assert_true(tsr_zap_allowed(zap, eid));
    /* The log goes to a file meanwhile, to count how often the file is named. */
    char logp[128];
    path(logp, sizeof logp, "zap.log");
    fflush(stderr);
    int saved = dup(2), logfd = open(logp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(saved >= 0 && logfd >= 0);
    assert_int_equal(dup2(logfd, 2), 2);
    write_text("ks/allowed/zz.pub", "garbage\n", 0644);
    assert_int_equal(tsr_keys_remove(store, "evil", err, sizeof err), 0);
    bool removed = wait_allowed(zap, eid, false);
    /* Two later keys applied: rereads went on with zz.pub still there. */
    bool later = true;
    const char *names[2] = {"later1", "later2"};
    for (int i = 0; i < 2 && later; i++) {
        tsr_security_t k;
        char kid[TSR_KEY_ID_MAX];
        later = tsr_keys_add(store, names[i], err, sizeof err) == 0 &&
                tsr_security_client(store, NULL, names[i], &k, err, sizeof err) == 0;
        snprintf(kid, sizeof kid, "%s/%s", names[i], k.self.pub);
        later = later && wait_allowed(zap, kid, true);
    }
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    close(logfd);
    assert_true(removed);
    assert_true(later);
    tsr_zap_stats_t zs;
    tsr_zap_stats(zap, &zs);
    assert_int_equal(zs.skipped, 1);  /* status shows it */
    assert_int_equal(zs.keys, 3);     /* w1, later1, later2 */
    tsr_zap_stop(&zap);
    /* Named once, not at every reread. */
    char text[8192] = "";
    FILE *f = fopen(logp, "r");
    assert_non_null(f);
    size_t got = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[got] = '\0';
    int named = 0;
    for (const char *q = text; (q = strstr(q, "zz.pub")); q++) named++;
    if (named != 1) fail_msg("zz.pub named %d times:\n%s", named, text);
    /* At start the operator hears of it at once. */
    assert_null(tsr_zap_start(store, err, sizeof err));
    if (!strstr(err, "zz.pub")) fail_msg("%s", err);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_init_add_list_remove, setup, teardown),
        cmocka_unit_test_setup_teardown(test_secret_key_files_must_be_private_and_well_formed,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_client_keys_come_from_flags_defaults_or_credentials,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_only_allowed_keys_get_in_under_their_names, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_a_store_others_may_write_is_refused, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_a_bad_file_does_not_block_removals, setup, teardown),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    /* A failed test may have left sockets open, which would make the
     * context's end wait for ever. */
    if (rc == 0) tsr_zmq_term();
    return rc;
}
