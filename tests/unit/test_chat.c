/* test_chat.c: chat templates (coordinator/chat.c) written out by hand for each layout,
 * recognition from a model's Jinja template, the errors for messages a layout cannot
 * take; and the HTTP API's keys file (coordinator/apikeys.c). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "coordinator/chat.h"
#include "coordinator/apikeys.h"

static char *render(tsr_chat_kind_t kind, const char *json, char *err)
{
    json_t *m = json_loads(json, 0, NULL);
    assert_non_null(m);
    char *out = tsr_chat_render(kind, m, err, 300);
    json_decref(m);
    return out;
}

static const char *CONV = "[{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", "
                          "\"content\": \" Hi \"}, {\"role\": \"assistant\", \"content\": \"Hello.\"}, "
                          "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"More\"}]}]";

static void test_each_layout(void **state)
{
    (void)state;
    char err[300];
    char *s = render(TSR_CHAT_LLAMA3, CONV, err);
    assert_string_equal(s, "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                           "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
                           "<|start_header_id|>user<|end_header_id|>\n\nMore<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\n");
    free(s);
    s = render(TSR_CHAT_CHATML, CONV, err);
    assert_string_equal(s, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n"
                           "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nMore<|im_end|>\n"
                           "<|im_start|>assistant\n");
    free(s);
    s = render(TSR_CHAT_LLAMA2, CONV, err);
    assert_string_equal(s, "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello. </s><s>[INST] "
                           "More [/INST]");
    free(s);
    s = render(TSR_CHAT_MISTRAL, CONV, err);
    assert_string_equal(s, "[INST] Be brief.\n\nHi [/INST]Hello.</s>[INST] More [/INST]");
    free(s);
}

static void test_refusals_name_the_message(void **state)
{
    (void)state;
    char err[300];
    assert_null(render(TSR_CHAT_LLAMA2, "[{\"role\": \"assistant\", \"content\": \"x\"}]", err));
    assert_non_null(strstr(err, "messages[0].role"));
    assert_null(render(TSR_CHAT_MISTRAL, "[{\"role\": \"user\", \"content\": \"x\"}, "
                                         "{\"role\": \"assistant\", \"content\": \"y\"}]", err));
    assert_non_null(strstr(err, "last message must be the user's"));
    assert_null(render(TSR_CHAT_LLAMA3, "[{\"role\": \"robot\", \"content\": \"x\"}]", err));
    assert_non_null(strstr(err, "messages[0].role"));
    assert_null(render(TSR_CHAT_CHATML, "[{\"role\": \"user\", \"content\": 5}]", err));
    assert_non_null(strstr(err, "messages[0].content"));
    assert_null(render(TSR_CHAT_CHATML, "[{\"role\": \"user\", \"content\": [{\"type\": "
                                        "\"image_url\"}]}]", err));
    assert_non_null(strstr(err, "messages[0].content[0]"));
    assert_null(render(TSR_CHAT_CHATML, "[]", err));
    assert_null(render(TSR_CHAT_NONE, CONV, err));
}

static void test_recognition(void **state)
{
    (void)state;
    assert_int_equal(tsr_chat_detect("{{ '<|start_header_id|>' + role }}"), TSR_CHAT_LLAMA3);
    assert_int_equal(tsr_chat_detect("{{'<|im_start|>' + m.role}}"), TSR_CHAT_CHATML);
    assert_int_equal(tsr_chat_detect("[INST] <<SYS>>"), TSR_CHAT_LLAMA2);
    assert_int_equal(tsr_chat_detect("{{ '[INST] ' + content }}"), TSR_CHAT_MISTRAL);
    assert_int_equal(tsr_chat_detect("{{ messages }}"), TSR_CHAT_NONE);
    assert_int_equal(tsr_chat_detect(NULL), TSR_CHAT_NONE);
    assert_int_equal(tsr_chat_named("chatml"), TSR_CHAT_CHATML);
    assert_int_equal(tsr_chat_named("jinja"), TSR_CHAT_NONE);
    assert_string_equal(tsr_chat_name(TSR_CHAT_MISTRAL), "mistral");
}

static void write_keys(const char *path, const char *text, mode_t mode)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    chmod(path, mode);
}

static void test_api_keys_file(void **state)
{
    (void)state;
    char dir[] = "/tmp/tsr-chat-XXXXXX", path[64], err[256];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/keys", dir);
    char **keys;
    write_keys(path, "# operators\n  first-key-0123456789  \n\nsecond-key-0123456789\n", 0600);
    assert_int_equal(tsr_apikeys_read(path, &keys, err, sizeof err), 2);
    assert_string_equal(keys[0], "first-key-0123456789");
    assert_string_equal(keys[1], "second-key-0123456789");
    free(keys[0]);
    free(keys[1]);
    free(keys);
    write_keys(path, "first-key-0123456789\n", 0644);  /* others may read it */
    assert_int_equal(tsr_apikeys_read(path, &keys, err, sizeof err), -1);
    assert_non_null(strstr(err, "chmod 600"));
    write_keys(path, "short\n", 0600);
    assert_int_equal(tsr_apikeys_read(path, &keys, err, sizeof err), -1);
    assert_non_null(strstr(err, ":1: a key must be one word of at least 16"));
    write_keys(path, "# nothing\n", 0600);
    assert_int_equal(tsr_apikeys_read(path, &keys, err, sizeof err), -1);
    assert_non_null(strstr(err, "holds no key"));
    unlink(path);
    assert_int_equal(tsr_apikeys_read(path, &keys, err, sizeof err), -1);
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_layout),
        cmocka_unit_test(test_refusals_name_the_message),
        cmocka_unit_test(test_recognition),
        cmocka_unit_test(test_api_keys_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
