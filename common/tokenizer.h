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
 * of threads may encode and decode with it at once.
 *
 * This header is tokenizer.c's: loading and what a loaded tokenizer holds.  Encoding
 * (tok_encode.h) and decoding (tok_decode.h) have their own, included here so that a
 * caller needs this one. */
#ifndef TSR_TOKENIZER_H
#define TSR_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tok_decode.h"
#include "common/tok_encode.h"

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

/* One past the largest id (model vocabulary and added tokens). */
int32_t tsr_tok_vocab_size(const tsr_tokenizer_t *self);
/* Whether the tokenizer covers a model of model_vocab ids (its config.json's vocab_size):
 * a token (of the model's vocabulary or an added one) for each id below it, but at most a
 * sixteenth of them, which a model padded past its tokenizer has none for.  Ids the
 * tokenizer has past model_vocab do not matter here (prompts with them are refused).  0,
 * or -1 with the reason in err ("has tokens for 1024 of the model's 32000 ids ..."). */
int tsr_tok_covers(const tsr_tokenizer_t *self, int32_t model_vocab, char *err, size_t errlen);
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
