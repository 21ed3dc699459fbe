/* tokenizer.h: a model directory's tokenizer.json, in C.
 *
 * Covers the two families of Llama-style tokenizers:
 *   - byte-level BPE (Llama 3, GPT-2): ByteLevel and Split(Regex) pre-tokenizers, the
 *     ByteLevel decoder;
 *   - SentencePiece-style BPE (Llama 2, Mistral, TinyLlama): the Prepend and Replace
 *     normalizers or the Metaspace pre-tokenizer, byte fallback, fuse_unk, and the
 *     Replace/ByteFallback/Fuse/Strip or Metaspace decoders.
 * Added and special tokens are matched before the model, with their lstrip, rstrip,
 * single_word and normalized flags.  A TemplateProcessing post-processor supplies the
 * special tokens that encode adds (bos).  Anything else is refused at load with the JSON
 * path of the field that is not supported.
 *
 * A loaded tokenizer is read-only except for a word cache behind a mutex, so any number
 * of threads may encode and decode with it at once. */
#ifndef TSR_TOKENIZER_H
#define TSR_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* tokenizer.json (and tokenizer_config.json) at most: real ones are 2 to 35 MiB. */
#define TSR_TOKENIZER_MAX_BYTES (64u * 1024u * 1024u)

typedef struct tsr_tokenizer tsr_tokenizer_t;

/* Loads DIR/tokenizer.json and, when present, DIR/tokenizer_config.json (bos, eos, chat
 * template).  NULL with a message naming the file and the JSON path on failure.  Caller
 * owns the result (tsr_tok_destroy). */
tsr_tokenizer_t *tsr_tok_load(const char *dir, char *err, size_t errlen);

/* The same from the files' texts (config may be NULL).  name prefixes messages. */
tsr_tokenizer_t *tsr_tok_load_text(const char *tokenizer_json, size_t len,
                                   const char *config_json, size_t config_len,
                                   const char *name, char *err, size_t errlen);

void tsr_tok_destroy(tsr_tokenizer_t **self_p);

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

/* One past the largest id (model vocabulary and added tokens). */
int32_t tsr_tok_vocab_size(const tsr_tokenizer_t *self);
/* The id of a token's exact text, or -1. */
int32_t tsr_tok_token_id(const tsr_tokenizer_t *self, const char *content);
/* A token's text (NULL for an id outside the vocabulary); *len its length. */
const char *tsr_tok_token_text(const tsr_tokenizer_t *self, int32_t id, size_t *len);
bool tsr_tok_is_special(const tsr_tokenizer_t *self, int32_t id);
/* From tokenizer_config.json (bos_token, eos_token, chat_template), else -1 / NULL. */
int32_t tsr_tok_bos(const tsr_tokenizer_t *self);
int32_t tsr_tok_eos(const tsr_tokenizer_t *self);
const char *tsr_tok_chat_template(const tsr_tokenizer_t *self);

#endif
