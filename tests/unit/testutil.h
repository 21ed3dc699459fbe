/* testutil.h: helpers the socket-driven unit tests share (include after
 * cmocka.h). */
#ifndef TSR_TESTUTIL_H
#define TSR_TESTUTIL_H

#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

/* The repo's configs/models/tiny (config.json only) as an absolute path,
 * found from __FILE__, which is relative to the directory the compiler ran
 * in (the repo root). */
static inline void tsr_test_tiny_model_dir(char out[PATH_MAX])
{
    char guess[PATH_MAX];
    const char *f = __FILE__;
    const char *cut = strstr(f, "tests/unit/");
    int n = cut ? (int)(cut - f) : 0;
    if (f[0] == '/') {
        snprintf(guess, sizeof guess, "%.*sconfigs/models/tiny", n, f);
    } else {
        char cwd[PATH_MAX / 2];
        assert_non_null(getcwd(cwd, sizeof cwd));
        snprintf(guess, sizeof guess, "%s/%.*sconfigs/models/tiny", cwd, n, f);
    }
    if (!realpath(guess, out)) fail_msg("cannot find the tiny model at %s", guess);
}

/* Whether sock has a message within ms. */
static inline bool tsr_test_readable(void *sock, int ms)
{
    zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
    return zmq_poll(&it, 1, ms) > 0 && (it.revents & ZMQ_POLLIN);
}

#endif
