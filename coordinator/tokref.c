/* tokref.c: a tokenizer shared by holds (a deployment and the requests decoding
 * with it), and the copy of the deployments' tokenizers the HTTP threads read. */
#include "tokref.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

tsr_tokref_t *tsr_tokref_hold(tsr_tokref_t *r)
{
    if (r) atomic_fetch_add(&r->refs, 1);
    return r;
}

void tsr_tokref_drop(tsr_tokref_t **r_p)
{
    if (!r_p || !*r_p) return;
    if (atomic_fetch_sub(&(*r_p)->refs, 1) == 1) {
        tsr_tok_destroy(&(*r_p)->tok);
        free(*r_p);
    }
    *r_p = NULL;
}

void tsr_tok_refusal(const char *name, const char *why, bool loading, char *msg, size_t len)
{
    if (loading) snprintf(msg, len, "%s takes text prompts once %s", name, why);
    else snprintf(msg, len, "%s takes token ids only: it has no usable tokenizer (%s)", name, why);
}

void tsr_tokreg_clear(tsr_tokreg_t *reg)
{
    for (size_t i = 0; i < reg->n; i++) tsr_tokref_drop(&reg->v[i].tok);
    free(reg->v);
    reg->v = NULL;
    reg->n = 0;
}

int tsr_tokreg_get(tsr_tokreg_t *reg, const char *name, tsr_tokreg_entry_t *out)
{
    int rc = -1;
    pthread_mutex_lock(&reg->mu);
    for (size_t i = 0; i < reg->n; i++)
        if (!strcmp(reg->v[i].name, name)) {
            *out = reg->v[i];
            out->tok = tsr_tokref_hold(reg->v[i].tok);
            rc = 0;
            break;
        }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}
