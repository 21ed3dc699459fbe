/* utf8.h: UTF-8 as the tokenizer reads and writes it.
 *
 * Validity follows the Unicode definition (no overlongs, no surrogates, nothing past
 * U+10FFFF).  The inline readers take text already checked, so they trust its lead
 * bytes; they are inline because the BPE and byte-level loops call them per character. */
#ifndef TSR_UTF8_H
#define TSR_UTF8_H

#include <stddef.h>

#include "common/strbuf.h"

/* Offset of the first invalid byte of s[0..n), or n when all of it is valid. */
size_t tsr_utf8_check(const char *s, size_t n);

/* Appends s[0..n) to out with every invalid sequence replaced by U+FFFD, as a lossy
 * UTF-8 conversion does (one per maximal invalid prefix).  -1 when out ran out of
 * memory. */
int tsr_utf8_lossy(tsr_sb_t *out, const char *s, size_t n);

/* The length of the character that starts at s, from its lead byte. */
static inline size_t tsr_utf8_char_len(const char *s)
{
    unsigned b = (unsigned char)s[0];
    return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

/* Writes code point cp at o (room for 4 bytes); returns the bytes written. */
static inline size_t tsr_utf8_put(char *o, unsigned cp)
{
    if (cp < 0x80) return o[0] = (char)cp, 1;
    if (cp < 0x800) return o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 63)), 2;
    if (cp < 0x10000)
        return o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | (cp >> 6 & 63)),
               o[2] = (char)(0x80 | (cp & 63)), 3;
    return o[0] = (char)(0xF0 | cp >> 18), o[1] = (char)(0x80 | (cp >> 12 & 63)),
           o[2] = (char)(0x80 | (cp >> 6 & 63)), o[3] = (char)(0x80 | (cp & 63)), 4;
}

/* The code point that starts at s; its length in bytes in *len. */
static inline unsigned tsr_utf8_get(const char *s, size_t *len)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t l = tsr_utf8_char_len(s);
    unsigned cp = l == 1 ? u[0] : l == 2 ? u[0] & 31u : l == 3 ? u[0] & 15u : u[0] & 7u;
    for (size_t k = 1; k < l; k++) cp = cp << 6 | (u[k] & 63u);
    *len = l;
    return cp;
}

#endif
