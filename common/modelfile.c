#include "modelfile.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util.h"

static bool links_outside;

void tsr_model_links_outside(bool allow)
{
    links_outside = allow;
}

/* Whether the resolved path real is inside the resolved directory dir. */
static bool inside(const char *real, const char *dir)
{
    size_t n = strlen(dir);
    if (n == 1 && dir[0] == '/') return true;
    return strncmp(real, dir, n) == 0 && real[n] == '/';
}

/* Whether the file open as fd, opened by a path that resolved to rfile, is inside the
 * resolved directory rdir.  The path was checked before it was opened, and a link
 * swapped in between (renamed over it) would lead out after all; so what was actually
 * opened is asked of the kernel, by the link /proc keeps for each descriptor.  Without
 * /proc (not mounted, or another system), the opened file must be the one rfile names
 * without following a link at its end: lstat, as stat would follow a link swapped back
 * in.  (That fallback cannot see a directory above the file replaced in between; /proc
 * can.) */
static bool opened_inside(int fd, const char *rdir, const char *rfile)
{
    char proc[64], real[PATH_MAX + 1];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(proc, real, sizeof real - 1);
    if (n >= 0) {
        real[n] = '\0';
        return (size_t)n < sizeof real - 1 && inside(real, rdir);
    }
    struct stat a, b;
    return !fstat(fd, &a) && !lstat(rfile, &b) && S_ISREG(b.st_mode) && a.st_dev == b.st_dev &&
           a.st_ino == b.st_ino;
}

int tsr_model_open(const char *dir, const char *name, char *err, size_t errlen)
{
    char *path = tsr_path_join(dir, name), *rdir = NULL, *rfile = NULL;
    int fd = -1;
    if (!path) {
        tsr_set_err(err, errlen, "%s/%s: out of memory", dir, name);
        return -1;
    }
    if (!links_outside) {
        if (!(rdir = realpath(dir, NULL)) || !(rfile = realpath(path, NULL))) {
            tsr_set_err(err, errlen, "%s: %s", path, strerror(errno));
            goto out;
        }
        if (!inside(rfile, rdir)) {
            tsr_set_err(err, errlen,
                        "%s: a link that leads out of the model directory (links are followed "
                        "only inside it unless the coordinator and the workers are started "
                        "with --allow-model-links-outside)",
                        path);
            goto out;
        }
    }
    fd = tsr_open_regular(path, err, errlen);
    if (fd >= 0 && rdir && !opened_inside(fd, rdir, rfile)) {
        tsr_set_err(err, errlen,
                    "%s: replaced while it was being opened, by a link that leads out of the "
                    "model directory",
                    path);
        close(fd);
        fd = -1;
    }
out:
    free(path);
    free(rdir);
    free(rfile);
    return fd;
}

char *tsr_model_read(const char *dir, const char *name, size_t max, size_t *len, char *err,
                     size_t errlen)
{
    char *path = tsr_path_join(dir, name), *text = NULL;
    if (!path) {
        tsr_set_err(err, errlen, "%s/%s: out of memory", dir, name);
        return NULL;
    }
    int fd = tsr_model_open(dir, name, err, errlen);
    if (fd >= 0) text = tsr_read_fd(fd, path, max, len, err, errlen);
    free(path);
    return text;
}

const char *tsr_json_error_what(const json_error_t *e)
{
    switch (json_error_code(e)) {
    case json_error_premature_end_of_input: return "the text ends inside a value";
    case json_error_end_of_input_expected: return "more text after the value, which must be all";
    case json_error_invalid_utf8: return "bytes that are not UTF-8";
    case json_error_null_character: return "a NUL byte";
    case json_error_duplicate_key: return "a key repeated in one object";
    case json_error_numeric_overflow: return "a number too large";
    case json_error_out_of_memory: return "out of memory";
    case json_error_stack_overflow: return "values nested too deep";
    default: return "not JSON syntax (a value, ',', ':', a quote or a bracket expected)";
    }
}
