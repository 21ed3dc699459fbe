#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void tsr_set_err(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    if (err == NULL || errlen == 0) return;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

char *tsr_path_join(const char *dir, const char *name)
{
    size_t dlen = strlen(dir);
    char *p = NULL;
    /* No "dir//file" in messages when dir ends with a slash. */
    if (asprintf(&p, "%s%s%s", dir, dlen > 0 && dir[dlen - 1] == '/' ? "" : "/", name) < 0)
        return NULL;
    return p;
}

int tsr_open_regular(const char *path, char *err, size_t errlen)
{
    /* O_NONBLOCK: opening a FIFO without a writer would otherwise wait for one. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    struct stat sb;
    if (fd < 0) {
        tsr_set_err(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    if (fstat(fd, &sb) < 0) {
        tsr_set_err(err, errlen, "%s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    if (!S_ISREG(sb.st_mode)) {
        tsr_set_err(err, errlen, "%s: not a regular file (%s)", path,
                    S_ISDIR(sb.st_mode)    ? "a directory"
                    : S_ISFIFO(sb.st_mode) ? "a FIFO"
                    : S_ISCHR(sb.st_mode) || S_ISBLK(sb.st_mode) ? "a device"
                    : S_ISSOCK(sb.st_mode) ? "a socket" : "not a file");
        close(fd);
        return -1;
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    return fd;
}

char *tsr_read_regular(const char *path, size_t max, size_t *len, char *err, size_t errlen)
{
    int fd = tsr_open_regular(path, err, errlen);
    return fd < 0 ? NULL : tsr_read_fd(fd, path, max, len, err, errlen);
}

char *tsr_read_fd(int fd, const char *path, size_t max, size_t *len, char *err, size_t errlen)
{
    struct stat sb;
    char *buf = NULL;
    size_t n = 0, cap;
    /* Read up to max + 1 bytes whatever the size said, since the file may grow. */
    if (fstat(fd, &sb) < 0) sb.st_size = 0;   /* (read what there is) */
    if ((uint64_t)sb.st_size > max) goto too_big;
    cap = (size_t)sb.st_size + 1 < max + 1 ? (size_t)sb.st_size + 1 : max + 1;
    if (!(buf = malloc(cap + 1))) {
        tsr_set_err(err, errlen, "%s: out of memory", path);
        close(fd);
        return NULL;
    }
    for (;;) {
        if (n == cap) {
            if (cap > max) goto too_big;
            size_t ncap = cap * 2 < max + 1 ? cap * 2 : max + 1;
            char *nb = realloc(buf, ncap + 1);
            if (!nb) {
                tsr_set_err(err, errlen, "%s: out of memory", path);
                goto fail;
            }
            buf = nb;
            cap = ncap;
        }
        ssize_t got = read(fd, buf + n, cap - n);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            tsr_set_err(err, errlen, "%s: %s", path, strerror(errno));
            goto fail;
        }
        if (got == 0) break;
        n += (size_t)got;
    }
    if (n > max) goto too_big;
    close(fd);
    buf[n] = '\0';
    *len = n;
    return buf;
too_big:
    tsr_set_err(err, errlen, "%s: too large (more than %zu bytes)", path, max);
fail:
    free(buf);
    close(fd);
    return NULL;
}

void tsr_file_id(const char *path, tsr_file_id_t *id)
{
    struct stat st;
    memset(id, 0, sizeof *id);
    if (stat(path, &st) < 0) return;
    id->dev = (uint64_t)st.st_dev;
    id->ino = (uint64_t)st.st_ino;
    id->size = (uint64_t)st.st_size;
    id->mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
}

bool tsr_file_id_same(const tsr_file_id_t *a, const tsr_file_id_t *b)
{
    return (a->dev || a->ino) && a->dev == b->dev && a->ino == b->ino && a->size == b->size &&
           a->mtime_ns == b->mtime_ns;
}

void tsr_test_hold(const char *name, long max_ms)
{
    const char *v = getenv(name);
    long ms = v ? strtol(v, NULL, 10) : 0;
    if (ms <= 0) return;
    if (ms > max_ms) ms = max_ms;
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {}
}
