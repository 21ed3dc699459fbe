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

/* The text ids[0..n) add after context[0..n_context) (a prompt): what a decoder primed
 * with the context (tsr_detok_prime) emits for them, flushed.  The context's text and
 * it concatenate to tsr_tok_decode of all the ids, so a SentencePiece completion keeps
 * the space before its first word.  Two cases cannot concatenate, and read: a character
 * the context leaves incomplete comes whole at the start of the result; a context that
 * ends in a byte-fallback run the ids go on into an invalid one gives the ids' own text.
 * Caller owns the NUL-terminated result; NULL only when out of memory. */
char *tsr_tok_decode_after(const tsr_tokenizer_t *self, const int32_t *context, size_t n_context,
                           const int32_t *ids, size_t n, bool skip_special, size_t *len);

/* Streaming decoder: text for ids as they arrive, never a broken UTF-8 character.  A
 * character split across tokens is held back until it is complete; the pieces pushed,
 * then flushed, concatenate to tsr_tok_decode of all the ids (unless 4,096 tokens in a
 * row never complete a character: then what is held is emitted as it stands). */
typedef struct tsr_detok tsr_detok_t;

/* Caller owns the result (tsr_detok_destroy); the tokenizer must outlive it. */
tsr_detok_t *tsr_detok_new(const tsr_tokenizer_t *tok, bool skip_special);
void tsr_detok_destroy(tsr_detok_t **self_p);
/* Starts the stream after context[0..n) (the prompt), as if its ids had been pushed and
 * their text taken: what is pushed next gives the text it adds to the context's, as
 * tsr_tok_decode_after says.  It reads only the context's last few tokens (more when
 * they end in a byte-fallback run).  -1 when out of memory. */
int tsr_detok_prime(tsr_detok_t *self, const int32_t *context, size_t n);
/* Feeds one id.  *text points at the new text (owned by the decoder, valid until the next
 * call), *len its length, possibly 0.  -1 when out of memory. */
int tsr_detok_push(tsr_detok_t *self, int32_t id, const char **text, size_t *len);
/* Ends the stream: whatever is held back, with U+FFFD for an incomplete character. */
int tsr_detok_flush(tsr_detok_t *self, const char **text, size_t *len);

#endif
