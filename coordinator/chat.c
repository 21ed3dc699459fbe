/* chat.c: see chat.h.  The four layouts, as their models' templates write them:
 *   llama3   <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|> per message,
 *            then the assistant's header;
 *   chatml   <|im_start|>ROLE\nCONTENT<|im_end|>\n per message, then <|im_start|>assistant\n;
 *   llama2   [INST] <<SYS>>\nSYSTEM\n<</SYS>>\n\nUSER [/INST] ANSWER </s><s>[INST] USER [/INST]
 *            (the system message inside the first user turn);
 *   mistral  [INST] USER [/INST]ANSWER</s>[INST] USER [/INST] (a system message goes in
 *            front of the first user message).
 * llama2 and mistral need user and assistant turns to alternate, starting with a user. */
#include "chat.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/strbuf.h"
#include "common/util.h"

tsr_chat_kind_t tsr_chat_detect(const char *j)
{
    if (!j) return TSR_CHAT_NONE;
    if (strstr(j, "<|start_header_id|>")) return TSR_CHAT_LLAMA3;
    if (strstr(j, "<|im_start|>")) return TSR_CHAT_CHATML;
    if (strstr(j, "[INST]")) return strstr(j, "<<SYS>>") ? TSR_CHAT_LLAMA2 : TSR_CHAT_MISTRAL;
    return TSR_CHAT_NONE;
}

static const char *const NAMES[] = {"", "llama2", "llama3", "chatml", "mistral"};

tsr_chat_kind_t tsr_chat_named(const char *name)
{
    for (int k = 1; k < 5; k++)
        if (name && !strcmp(name, NAMES[k])) return (tsr_chat_kind_t)k;
    return TSR_CHAT_NONE;
}

const char *tsr_chat_name(tsr_chat_kind_t kind)
{
    return kind > TSR_CHAT_NONE && kind <= TSR_CHAT_MISTRAL ? NAMES[kind] : "none";
}

/* Appends s without leading and trailing whitespace (the templates trim contents). */
static void sb_trim(tsr_sb_t *b, const char *s, size_t n)
{
    while (n && strchr(" \t\r\n", *s)) s++, n--;
    while (n && strchr(" \t\r\n", s[n - 1])) n--;
    tsr_sb_putn(b, s, n);
}

/* A message's content: a string, or the text parts of a list, joined. */
static int content_of(json_t *m, size_t i, tsr_sb_t *out, char *err, size_t errlen)
{
    json_t *c = json_object_get(m, "content");
    if (json_is_string(c)) {
        tsr_sb_putn(out, json_string_value(c), json_string_length(c));
        return 0;
    }
    if (json_is_array(c)) {
        size_t k;
        json_t *part;
        json_array_foreach(c, k, part) {
            const char *type = json_string_value(json_object_get(part, "type"));
            json_t *text = json_object_get(part, "text");
            if (!type || strcmp(type, "text") || !json_is_string(text)) {
                tsr_set_err(err, errlen, "messages[%zu].content[%zu]: only {\"type\": \"text\", "
                            "\"text\": ...} parts are supported", i, k);
                return -1;
            }
            tsr_sb_putn(out, json_string_value(text), json_string_length(text));
        }
        return 0;
    }
    tsr_set_err(err, errlen, "messages[%zu].content: expected a string or a list of text parts", i);
    return -1;
}

char *tsr_chat_render(tsr_chat_kind_t kind, json_t *messages, char *err, size_t errlen)
{
    tsr_sb_t out = {0}, content = {0}, system = {0};
    char *result = NULL;
    if (!json_is_array(messages) || json_array_size(messages) == 0) {
        tsr_set_err(err, errlen, "messages: expected a non-empty list");
        return NULL;
    }
    if (kind == TSR_CHAT_NONE) {
        tsr_set_err(err, errlen, "no chat template");
        return NULL;
    }
    tsr_sb_puts(&out, "");
    bool want_user = true, have_system = false;
    size_t i;
    json_t *m;
    json_array_foreach(messages, i, m) {
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!role || (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant"))) {
            tsr_set_err(err, errlen, "messages[%zu].role: expected system, user or assistant", i);
            goto out;
        }
        content.len = 0;
        tsr_sb_puts(&content, "");
        if (content_of(m, i, &content, err, errlen)) goto out;
        if (kind == TSR_CHAT_LLAMA3 || kind == TSR_CHAT_CHATML) {
            tsr_sb_puts(&out, kind == TSR_CHAT_LLAMA3 ? "<|start_header_id|>" : "<|im_start|>");
            tsr_sb_puts(&out, role);
            tsr_sb_puts(&out, kind == TSR_CHAT_LLAMA3 ? "<|end_header_id|>\n\n" : "\n");
            if (kind == TSR_CHAT_LLAMA3) sb_trim(&out, content.p, content.len);
            else tsr_sb_putn(&out, content.p, content.len);
            tsr_sb_puts(&out, kind == TSR_CHAT_LLAMA3 ? "<|eot_id|>" : "<|im_end|>\n");
            continue;
        }
        /* llama2, mistral */
        if (!strcmp(role, "system")) {
            if (i != 0 || have_system) {
                tsr_set_err(err, errlen, "messages[%zu]: %s takes one system message, first", i,
                            NAMES[kind]);
                goto out;
            }
            have_system = true;
            sb_trim(&system, content.p, content.len);
            continue;
        }
        if (!strcmp(role, "user") != want_user) {
            tsr_set_err(err, errlen, "messages[%zu].role: %s needs user and assistant turns to "
                        "alternate, starting with user", i, NAMES[kind]);
            goto out;
        }
        if (want_user) {
            if (out.len) tsr_sb_puts(&out, kind == TSR_CHAT_LLAMA2 ? "<s>" : "");
            tsr_sb_puts(&out, "[INST] ");
            if (have_system && system.p) {
                if (kind == TSR_CHAT_LLAMA2) {
                    tsr_sb_puts(&out, "<<SYS>>\n");
                    tsr_sb_putn(&out, system.p, system.len);
                    tsr_sb_puts(&out, "\n<</SYS>>\n\n");
                } else {
                    tsr_sb_putn(&out, system.p, system.len);
                    tsr_sb_puts(&out, "\n\n");
                }
                have_system = false;
            }
            sb_trim(&out, content.p, content.len);
            tsr_sb_puts(&out, " [/INST]");
        } else {
            if (kind == TSR_CHAT_LLAMA2) tsr_sb_puts(&out, " ");
            sb_trim(&out, content.p, content.len);
            tsr_sb_puts(&out, kind == TSR_CHAT_LLAMA2 ? " </s>" : "</s>");
        }
        want_user = !want_user;
    }
    if ((kind == TSR_CHAT_LLAMA2 || kind == TSR_CHAT_MISTRAL) && want_user) {
        tsr_set_err(err, errlen, "messages: the last message must be the user's");
        goto out;
    }
    if (kind == TSR_CHAT_LLAMA3) tsr_sb_puts(&out, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    if (kind == TSR_CHAT_CHATML) tsr_sb_puts(&out, "<|im_start|>assistant\n");
    if (out.oom || content.oom || system.oom) {
        tsr_set_err(err, errlen, "out of memory");
        goto out;
    }
    result = out.p;
    out.p = NULL;
out:
    free(out.p);
    free(content.p);
    free(system.p);
    return result;
}
