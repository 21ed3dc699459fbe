/* util.h: small helpers every module's error paths share. */
#ifndef TSR_UTIL_H
#define TSR_UTIL_H

#include <stddef.h>

/* Writes a formatted message into err (no-op when err is NULL or errlen 0). */
void tsr_set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* "dir/name", without a doubled slash when dir ends with one.  Caller owns
 * the result (free); NULL when out of memory. */
char *tsr_path_join(const char *dir, const char *name);

#endif
