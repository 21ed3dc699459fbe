/* apikeys.c: the HTTP API's keys; see apikeys.h. */
#include "apikeys.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

int tsr_apikeys_read(const char *path, char ***keys, char *err, size_t errlen)
{
    struct stat st;
    int fd = tsr_open_regular(path, err, errlen);
    FILE *f = fd < 0 ? NULL : fdopen(fd, "r");
    if (!f) {
        if (fd >= 0) {
            tsr_set_err(err, errlen, "%s: %s", path, strerror(errno));
            close(fd);
        }
        return -1;
    }
    if (fstat(fileno(f), &st) == 0 && (st.st_mode & 077)) {
        tsr_set_err(err, errlen, "%s: mode %03o lets others read the API keys; chmod 600 it", path,
                    (unsigned)(st.st_mode & 0777));
        fclose(f);
        return -1;
    }
    char line[1024];
    char **v = NULL;
    int n = 0, lineno = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (!strchr(line, '\n') && !feof(f)) {
            tsr_set_err(err, errlen, "%s:%d: the line is over %zu bytes", path, lineno,
                        sizeof line - 2);
            goto bad;
        }
        size_t l = strcspn(line, "\r\n");
        line[l] = '\0';
        char *s = line;
        while (*s == ' ' || *s == '\t') s++;
        l = strlen(s);
        while (l && (s[l - 1] == ' ' || s[l - 1] == '\t')) s[--l] = '\0';
        if (!*s || *s == '#') continue;
        if (l < 16 || strpbrk(s, " \t")) {
            tsr_set_err(err, errlen, "%s:%d: a key must be one word of at least 16 characters",
                        path, lineno);
            goto bad;
        }
        char **w = realloc(v, (size_t)(n + 1) * sizeof *w);
        if (!w || !(w[n] = strdup(s))) {
            if (w) v = w;
            tsr_set_err(err, errlen, "out of memory");
            goto bad;
        }
        v = w;
        n++;
    }
    fclose(f);
    if (n == 0) {
        tsr_set_err(err, errlen, "%s: holds no key", path);
        free(v);
        return -1;
    }
    *keys = v;
    return n;
bad:
    fclose(f);
    for (int i = 0; i < n; i++) free(v[i]);
    free(v);
    return -1;
}

void tsr_apikeys_free(char ***keys, size_t n)
{
    if (!keys || !*keys) return;
    for (size_t i = 0; i < n; i++) free((*keys)[i]);
    free(*keys);
    *keys = NULL;
}

bool tsr_apikeys_match(char *const *keys, size_t n, const char *token)
{
    size_t tn = strlen(token);
    bool ok = false;
    /* Every byte of every key is compared, and no comparison stops early: how long this
     * takes says nothing about which key, or how much of one, the token matches. */
    for (size_t k = 0; k < n; k++) {
        size_t kn = strlen(keys[k]);
        unsigned diff = (unsigned)(kn ^ tn);
        for (size_t i = 0; i < kn; i++)
            diff |= (unsigned char)keys[k][i] ^ (unsigned char)(i < tn ? token[i] : 0);
        ok |= diff == 0;
    }
    return ok;
}
