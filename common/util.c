#include "util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
