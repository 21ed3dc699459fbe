/* chat.h: chat messages rendered into a prompt, for the common chat templates.
 *
 * There is no Jinja here.  A model's tokenizer_config.json chat_template is recognised
 * by its markers as one of four layouts, or the deployment names one (chat_template:
 * in the YAML); anything else is refused.  The text has no bos: the tokenizer adds it. */
#ifndef TSR_CHAT_H
#define TSR_CHAT_H

#include <jansson.h>
#include <stddef.h>

typedef enum { TSR_CHAT_NONE, TSR_CHAT_LLAMA2, TSR_CHAT_LLAMA3, TSR_CHAT_CHATML,
               TSR_CHAT_MISTRAL } tsr_chat_kind_t;

/* The layout a Jinja chat template is written for, or TSR_CHAT_NONE. */
tsr_chat_kind_t tsr_chat_detect(const char *jinja);
/* From a deployment's chat_template name ("" or unknown: TSR_CHAT_NONE). */
tsr_chat_kind_t tsr_chat_named(const char *name);
const char *tsr_chat_name(tsr_chat_kind_t kind);

/* Renders messages (a JSON array of {"role": system|user|assistant, "content": string or
 * [{"type": "text", "text": ...}]}) followed by the assistant's turn.  Caller owns the
 * result; NULL with a message naming the message and field at fault. */
char *tsr_chat_render(tsr_chat_kind_t kind, json_t *messages, char *err, size_t errlen);

#endif
