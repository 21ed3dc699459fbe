/* apikeys.h: the HTTP API's keys: the api_keys_file (bearer tokens, one per line, '#'
 * comments, owner-only permissions) and the check of a client's token against them. */
#ifndef TSR_APIKEYS_H
#define TSR_APIKEYS_H

#include <stdbool.h>
#include <stddef.h>

/* Reads a keys file.  Returns the number of keys (at least one) and *keys (caller frees
 * with tsr_apikeys_free), or -1 with the reason (file:line where a line is at fault). */
int tsr_apikeys_read(const char *path, char ***keys, char *err, size_t errlen);
/* Frees n keys read by tsr_apikeys_read and sets *keys to NULL. */
void tsr_apikeys_free(char ***keys, size_t n);
/* Whether token is one of the n keys.  It takes as long whichever key it matches, or
 * none, and however much of one a wrong token gets right. */
bool tsr_apikeys_match(char *const *keys, size_t n, const char *token);

#endif
