/* tokref.h: a tokenizer held by the deployment it belongs to and by the requests
 * decoding with it (tokref.c), and the deployments' tokenizers as the HTTP threads
 * see them. */
#ifndef TSR_TOKREF_H
#define TSR_TOKREF_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include "common/tokenizer.h"
#include "common/util.h"
#include "common/wire.h"

/* A deployment's tokenizer, shared by the deployment and the requests decoding with it,
 * so that a reload that drops it frees it only after its last request. */
typedef struct {
    tsr_tokenizer_t *tok;
    atomic_int refs;
    tsr_file_id_t file;         /* the tokenizer.json it was read from, as it was then */
} tsr_tokref_t;

/* One more holder of r (NULL-safe); returns r. */
tsr_tokref_t *tsr_tokref_hold(tsr_tokref_t *r);
/* Drops one hold; the last frees the tokenizer.  Sets *r_p to NULL. */
void tsr_tokref_drop(tsr_tokref_t **r_p);

/* What the HTTP server needs to encode a deployment's prompts in its own threads: a
 * copy of each deployment's tokenizer hold and keys, kept current by the loop (on load
 * and reload) under a mutex. */
typedef struct {
    char name[TSR_NAME_MAX + 1];
    tsr_tokref_t *tok;          /* held; NULL: the deployment has no usable tokenizer */
    char chat_template[16];     /* the deployment's chat_template key ("": recognise) */
    int max_seq_len;
    char tok_error[300];        /* with no tokenizer: why (paths in the model's directory
                                   relative to it: HTTP clients see it) */
    bool tok_loading;           /* none yet: it is being read (try again shortly) */
} tsr_tokreg_entry_t;

typedef struct tsr_tokreg {
    pthread_mutex_t mu;
    tsr_tokreg_entry_t *v;
    size_t n;
} tsr_tokreg_t;

/* Copies deployment name's entry into *out, its tokenizer held for the caller (drop it
 * with tsr_tokref_drop(&out->tok)).  -1 when there is no such deployment. */
int tsr_tokreg_get(tsr_tokreg_t *reg, const char *name, tsr_tokreg_entry_t *out);
/* The refusal of a text prompt (or text output) by deployment name without a tokenizer:
 * why is its tok_error; loading, whether its tokenizer.json is being read (retryable). */
void tsr_tok_refusal(const char *name, const char *why, bool loading, char *msg, size_t len);

/* Empties reg (drops every hold); the caller holds reg->mu or is its only user. */
void tsr_tokreg_clear(tsr_tokreg_t *reg);

#endif
