/* test_tokload.c: coordinator/tokload.h, the thread that reads a reload's tokenizers off
 * the coordinator's loop: a load comes back through the descriptor, a broken file comes
 * back with its reason, a second request for the same load is not queued, a load no
 * longer wanted is skipped, and destroying the loader mid-load neither hangs nor leaks.
 * (The coordinator's use of it, through real daemons: test_r_slow_reload_keeps_workers.) */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "coordinator/tokload.h"

static char root[PATH_MAX];

/* The wall clock as the code under test reads it (linked with --wrap=clock_gettime):
 * wall_step_s is added to CLOCK_REALTIME, as an NTP or operator's step would. */
static time_t wall_step_s;
int __real_clock_gettime(clockid_t id, struct timespec *ts);
int __wrap_clock_gettime(clockid_t id, struct timespec *ts)
{
    int rc = __real_clock_gettime(id, ts);
    if (!rc && id == CLOCK_REALTIME) ts->tv_sec += wall_step_s;
    return rc;
}

static double mono_s(void)
{
    struct timespec ts;
    __real_clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* dir/tokenizer.json: a byte-level BPE of 256 ids plus `extra` filler tokens. */
static void write_tokenizer(const char *dir, int extra)
{
    assert_int_equal(mkdir(dir, 0755), 0);
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "{\"model\": {\"type\": \"BPE\", \"vocab\": {");
    int id = 0;
    for (int c = 0x100; c < 0x200; c++) fprintf(f, "\"\\u%04x\": %d, ", c, id++);
    for (int i = 0; i < extra; i++) fprintf(f, "\"filler%07d\": %d, ", i, id++);
    fprintf(f, "\"end\": %d}, \"merges\": []}}", id);
    assert_int_equal(fclose(f), 0);
}

static int setup(void **state)
{
    (void)state;
    snprintf(root, sizeof root, "/tmp/tsr-tokload-XXXXXX");
    assert_non_null(mkdtemp(root));
    char d[PATH_MAX];
    snprintf(d, sizeof d, "%s/small", root);
    write_tokenizer(d, 0);
    snprintf(d, sizeof d, "%s/big", root);
    write_tokenizer(d, 400000);
    snprintf(d, sizeof d, "%s/none", root);
    assert_int_equal(mkdir(d, 0755), 0);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[PATH_MAX + 16];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    return system(cmd);
}

static const char *dir(const char *name)
{
    static char d[4][PATH_MAX];
    static int k;
    char *s = d[k++ % 4];
    snprintf(s, PATH_MAX, "%s/%s", root, name);
    return s;
}

static bool readable(int fd, int ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, ms) == 1 && (p.revents & POLLIN);
}

/* Every load asked for, in the order they finished (waits up to 60 s for the last). */
static tsr_tokjob_t *take_all(tsr_tokload_t *l)
{
    tsr_tokjob_t *all = NULL, **tail = &all;
    for (int i = 0; i < 600 && (tsr_tokload_pending(l) || !all); i++) {
        if (!readable(tsr_tokload_fd(l), 100)) continue;
        for (*tail = tsr_tokload_take(l); *tail; tail = &(*tail)->next) {}
    }
    for (*tail = tsr_tokload_take(l); *tail; tail = &(*tail)->next) {}
    return all;
}

static int count(const tsr_tokjob_t *j)
{
    int n = 0;
    for (; j; j = j->next) n++;
    return n;
}

static void test_load_comes_back_through_the_descriptor(void **state)
{
    (void)state;
    tsr_tokload_t *l = tsr_tokload_new();
    assert_non_null(l);
    assert_false(readable(tsr_tokload_fd(l), 0));
    char err[200];
    assert_int_equal(tsr_tokload_request(l, "a", dir("small"), err, sizeof err), 0);
    assert_true(readable(tsr_tokload_fd(l), 30000));
    tsr_tokjob_t *j = tsr_tokload_take(l);
    assert_non_null(j);
    assert_null(j->next);
    assert_string_equal(j->name, "a");
    assert_string_equal(j->dir, dir("small"));
    assert_non_null(j->tok);
    assert_false(j->skipped);
    assert_int_equal(tsr_tok_vocab_size(j->tok), 257);
    /* taken: the descriptor is quiet again, and nothing is left */
    assert_false(readable(tsr_tokload_fd(l), 0));
    assert_null(tsr_tokload_take(l));
    assert_int_equal(tsr_tokload_pending(l), 0);
    tsr_tokjob_free(j);
    tsr_tokload_destroy(&l);
    assert_null(l);
}

static void test_missing_file_comes_back_with_its_reason(void **state)
{
    (void)state;
    tsr_tokload_t *l = tsr_tokload_new();
    char err[200];
    assert_int_equal(tsr_tokload_request(l, "a", dir("none"), err, sizeof err), 0);
    tsr_tokjob_t *j = take_all(l);
    assert_int_equal(count(j), 1);
    assert_null(j->tok);
    assert_non_null(strstr(j->err, "tokenizer.json"));
    tsr_tokjob_free(j);
    tsr_tokload_destroy(&l);
}

static bool not_c(void *arg, const char *name, const char *d)
{
    (void)d;
    ++*(int *)arg;
    return strcmp(name, "c") != 0;
}

/* While the big file is read, b's directory is asked for three times (twice by b, once by
 * b2) and c's once, then c is no longer wanted: b's is read once, c's not at all. */
static void test_same_load_once_and_unwanted_skipped(void **state)
{
    (void)state;
    /* each read held 200 ms first: the later requests surely find the first in progress */
    setenv("TSR_TEST_TOKLOAD_HOLD_MS", "200", 1);
    tsr_tokload_t *l = tsr_tokload_new();
    char err[200];
    assert_int_equal(tsr_tokload_request(l, "big", dir("big"), err, sizeof err), 0);
    assert_int_equal(tsr_tokload_request(l, "b", dir("small"), err, sizeof err), 0);
    assert_int_equal(tsr_tokload_request(l, "b", dir("small"), err, sizeof err), 1);
    assert_int_equal(tsr_tokload_request(l, "big", dir("big"), err, sizeof err), 1);
    /* one read a directory, whichever deployment asks */
    assert_int_equal(tsr_tokload_request(l, "b2", dir("small"), err, sizeof err), 1);
    assert_int_equal(tsr_tokload_request(l, "c", dir("none"), err, sizeof err), 0);
    assert_int_equal(tsr_tokload_pending(l), 3);
    int asked = 0;
    tsr_tokload_prune(l, not_c, &asked);
    assert_true(asked >= 2);  /* b and c at least (big may be being read already) */
    tsr_tokjob_t *all = take_all(l);
    unsetenv("TSR_TEST_TOKLOAD_HOLD_MS");
    assert_int_equal(count(all), 3);
    int seen = 0;
    for (tsr_tokjob_t *j = all; j; j = j->next) {
        if (!strcmp(j->name, "big")) {
            assert_non_null(j->tok);
            assert_int_equal(tsr_tok_vocab_size(j->tok), 400257);
            seen |= 1;
        } else if (!strcmp(j->name, "b")) {
            assert_non_null(j->tok);
            seen |= 2;
        } else {
            assert_string_equal(j->name, "c");
            assert_true(j->skipped);
            assert_null(j->tok);
            seen |= 4;
        }
    }
    assert_int_equal(seen, 7);
    /* in the order asked */
    assert_string_equal(all->name, "big");
    tsr_tokjob_free(all);
    tsr_tokload_destroy(&l);
}

/* A coordinator stopped while a large tokenizer is read waits for that read, then frees
 * it and what is queued behind it; a stop during the test setting's hold ends the hold at
 * once. */
static void test_destroy_mid_load(void **state)
{
    (void)state;
    tsr_tokload_t *l = tsr_tokload_new();
    char err[200];
    assert_int_equal(tsr_tokload_request(l, "big", dir("big"), err, sizeof err), 0);
    assert_int_equal(tsr_tokload_request(l, "b", dir("small"), err, sizeof err), 0);
    tsr_tokload_destroy(&l);
    assert_null(l);
    setenv("TSR_TEST_TOKLOAD_HOLD_MS", "30000", 1);
    l = tsr_tokload_new();
    assert_int_equal(tsr_tokload_request(l, "big", dir("big"), err, sizeof err), 0);
    assert_int_equal(tsr_tokload_request(l, "b", dir("small"), err, sizeof err), 0);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double t0 = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
    tsr_tokload_destroy(&l);
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double took = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9 - t0;
    unsetenv("TSR_TEST_TOKLOAD_HOLD_MS");
    if (took > 5.0) fail_msg("destroy waited %.1f s for a held read", took);
    /* a loader that never started a thread */
    l = tsr_tokload_new();
    tsr_tokload_destroy(&l);
}

/* The test setting's hold of 400 ms lasts 400 ms whatever the wall clock does: with
 * the wall clock an hour behind (a step forward of the real one after the deadline was
 * set) a deadline on it had passed at once.  Timed waits are on the monotonic clock. */
static void test_a_wall_clock_step_neither_cuts_nor_stretches_the_hold(void **state)
{
    (void)state;
    setenv("TSR_TEST_TOKLOAD_HOLD_MS", "400", 1);
    wall_step_s = -3600;
    tsr_tokload_t *l = tsr_tokload_new();
    char err[200];
    double t0 = mono_s();
    assert_int_equal(tsr_tokload_request(l, "b", dir("small"), err, sizeof err), 0);
    tsr_tokjob_t *all = take_all(l);
    double took = mono_s() - t0;
    wall_step_s = 0;
    unsetenv("TSR_TEST_TOKLOAD_HOLD_MS");
    assert_int_equal(count(all), 1);
    tsr_tokjob_free(all);
    tsr_tokload_destroy(&l);
    if (took < 0.39) fail_msg("the 400 ms hold ended after %.0f ms", took * 1000);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_load_comes_back_through_the_descriptor),
        cmocka_unit_test(test_missing_file_comes_back_with_its_reason),
        cmocka_unit_test(test_same_load_once_and_unwanted_skipped),
        cmocka_unit_test(test_destroy_mid_load),
        cmocka_unit_test(test_a_wall_clock_step_neither_cuts_nor_stretches_the_hold),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
