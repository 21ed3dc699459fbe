/* strbuf.h: a growable string buffer, the one every module that builds text uses.
 *
 * Appends never fail in the caller's flow: running out of memory sets `oom`, after
 * which appends do nothing, so a caller checks once at the end.  p is always
 * NUL-terminated once anything was appended; len excludes the NUL. */
#ifndef TSR_STRBUF_H
#define TSR_STRBUF_H

#include <stdbool.h>
#include <stddef.h>

typedef struct {
    char *p;
    size_t len, cap;
    bool oom;
} tsr_sb_t;

void tsr_sb_putn(tsr_sb_t *b, const void *s, size_t n);
void tsr_sb_puts(tsr_sb_t *b, const char *s);
void tsr_sb_printf(tsr_sb_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Frees the text and empties b. */
void tsr_sb_free(tsr_sb_t *b);

#endif
