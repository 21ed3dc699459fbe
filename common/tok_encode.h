/* tok_encode.h: text to token ids with a loaded tokenizer (tokenizer.h loads one and
 * includes this header, so callers need only that one). */
#ifndef TSR_TOK_ENCODE_H
#define TSR_TOK_ENCODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The tokenizer, as tokenizer.h declares it (a repeated typedef, so neither header
 * needs to include the other first). */
typedef struct tsr_tokenizer tsr_tokenizer_t;

/* Encodes len bytes of UTF-8 text.  add_special applies the post-processor's template
 * (for Llama models: the bos token in front).  On success *ids (caller owns, free) holds
 * *n ids and 0 is returned; -1 with a message (invalid UTF-8 names the byte offset). */
int tsr_tok_encode(const tsr_tokenizer_t *self, const char *text, size_t len,
                   bool add_special, int32_t **ids, size_t *n, char *err, size_t errlen);

/* The same, giving up (-1, "the text makes more than N tokens") once the ids pass
 * max_ids (0: no bound), so a long text costs no more than a bounded prompt. */
int tsr_tok_encode_max(const tsr_tokenizer_t *self, const char *text, size_t len,
                       bool add_special, size_t max_ids, int32_t **ids, size_t *n, char *err,
                       size_t errlen);

#endif
