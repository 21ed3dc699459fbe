/* util.h: small helpers every module's error paths share. */
#ifndef TSR_UTIL_H
#define TSR_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Writes a formatted message into err (no-op when err is NULL or errlen 0). */
void tsr_set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* "dir/name", without a doubled slash when dir ends with one.  Caller owns
 * the result (free); NULL when out of memory. */
char *tsr_path_join(const char *dir, const char *name);

/* Opens path for reading (O_CLOEXEC) only when it is a regular file: a FIFO, a device or a
 * directory is refused, without blocking on it.  The fd, or -1 with "PATH: why" in err. */
int tsr_open_regular(const char *path, char *err, size_t errlen);

/* Reads the regular file at path whole (tsr_open_regular), refusing one of more than max
 * bytes.  The buffer is NUL-terminated (not counted in *len); caller frees it.  NULL with
 * "PATH: why" in err. */
char *tsr_read_regular(const char *path, size_t max, size_t *len, char *err, size_t errlen);

/* The same from an fd opened by tsr_open_regular (or tsr_model_open), which it closes;
 * path names the file in errors. */
char *tsr_read_fd(int fd, const char *path, size_t max, size_t *len, char *err, size_t errlen);

/* What tells one version of a file from another: device, inode, size and modification
 * time (all 0: it could not be looked at). */
typedef struct {
    uint64_t dev, ino, size;
    int64_t mtime_ns;
} tsr_file_id_t;

/* Fills *id from path (stat, following links); all 0 when it cannot be looked at. */
void tsr_file_id(const char *path, tsr_file_id_t *id);
/* Whether a and b are the same version of a file (never for an id of all 0). */
bool tsr_file_id_same(const tsr_file_id_t *a, const tsr_file_id_t *b);

/* A test setting: sleeps the milliseconds the environment variable `name` gives (at most
 * max_ms; absent or not positive: not at all), as a slow disk or a large model would.
 * Call it under TSR_TESTING only, so no release binary names a test setting. */
void tsr_test_hold(const char *name, long max_ms);

#endif
