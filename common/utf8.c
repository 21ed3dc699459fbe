/* utf8.c: checking UTF-8 and repairing it (invalid sequences become U+FFFD). */
#include "common/utf8.h"

/* Length of the valid UTF-8 sequence at s[0..n), 0 when invalid, -k when it is a valid
 * start cut short by the end (k bytes present). */
static int utf8_seq(const unsigned char *s, size_t n)
{
    unsigned b = s[0];
    if (b < 0x80) return 1;
    int need;
    unsigned lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) need = 1;
    else if (b == 0xE0) need = 2, lo = 0xA0;
    else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) need = 2;
    else if (b == 0xED) need = 2, hi = 0x9F;
    else if (b == 0xF0) need = 3, lo = 0x90;
    else if (b >= 0xF1 && b <= 0xF3) need = 3;
    else if (b == 0xF4) need = 3, hi = 0x8F;
    else return 0;
    for (int k = 1; k <= need; k++) {
        if ((size_t)k >= n) return -k;
        unsigned c = s[k];
        if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) return 0;
    }
    return need + 1;
}

/* Number of bytes of the first bad sequence's maximal valid prefix (at least 1). */
static size_t utf8_bad_len(const unsigned char *s, size_t n)
{
    size_t k = 1;
    while (k < n && k < 4) {
        int r = utf8_seq(s, k + 1);
        if (r >= 0) break;           /* the prefix s[0..k+1) is no longer a valid start */
        k++;
    }
    return k;
}

int tsr_utf8_lossy(tsr_sb_t *out, const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n && !out->oom) {
        int r = utf8_seq(u + i, n - i);
        if (r > 0) {
            tsr_sb_putn(out, u + i, (size_t)r);
            i += (size_t)r;
        } else {
            size_t k = r < 0 ? (size_t)-r : utf8_bad_len(u + i, n - i);
            tsr_sb_putn(out, "\xEF\xBF\xBD", 3);
            i += k;
        }
    }
    return out->oom ? -1 : 0;
}

size_t tsr_utf8_check(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        int r = utf8_seq(u + i, n - i);
        if (r <= 0) return i;
        i += (size_t)r;
    }
    return n;
}
