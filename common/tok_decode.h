/* tok_decode.h: token ids to text with a loaded tokenizer, all at once or streaming
 * (tokenizer.h loads one and includes this header, so callers need only that one). */
#ifndef TSR_TOK_DECODE_H
#define TSR_TOK_DECODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The tokenizer, as tokenizer.h declares it (a repeated typedef, so neither header
 * needs to include the other first). */
typedef struct tsr_tokenizer tsr_tokenizer_t;

/* Decodes n ids the way the tokenizer's decoder does; ids outside the vocabulary are
 * skipped, as are special tokens when skip_special.  Invalid UTF-8 becomes U+FFFD.
 * Caller owns the NUL-terminated result (its length in *len when len is not NULL);
 * NULL only when out of memory. */
char *tsr_tok_decode(const tsr_tokenizer_t *self, const int32_t *ids, size_t n,
                     bool skip_special, size_t *len);

/* Streaming decoder: text for ids as they arrive, never a broken UTF-8 character.  A
 * character split across tokens is held back until it is complete; the pieces pushed,
 * then flushed, concatenate to tsr_tok_decode of all the ids (unless 4,096 tokens in a
 * row never complete a character: then what is held is emitted as it stands). */
typedef struct tsr_detok tsr_detok_t;

/* Caller owns the result (tsr_detok_destroy); the tokenizer must outlive it. */
tsr_detok_t *tsr_detok_new(const tsr_tokenizer_t *tok, bool skip_special);
void tsr_detok_destroy(tsr_detok_t **self_p);
/* Feeds one id.  *text points at the new text (owned by the decoder, valid until the next
 * call), *len its length, possibly 0.  -1 when out of memory. */
int tsr_detok_push(tsr_detok_t *self, int32_t id, const char **text, size_t *len);
/* Ends the stream: whatever is held back, with U+FFFD for an incomplete character. */
int tsr_detok_flush(tsr_detok_t *self, const char **text, size_t *len);

#endif
