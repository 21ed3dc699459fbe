/* fuzz_tokenizer.c: common/tokenizer.h on arbitrary bytes.  The first byte picks:
 *   even: the rest is a tokenizer.json; one that loads encodes a few texts and decodes
 *         the ids it made and some that it did not;
 *   odd:  the rest is text for one of two fixed tokenizers (byte-level with the Llama 3
 *         split and added tokens; SentencePiece-style with byte fallback), then read
 *         again as little-endian ids for the streaming decoder, whose pieces must
 *         concatenate to the whole decode. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer.h"

static tsr_tokenizer_t *fixed[2];

static char *byte_level_json(void)
{
    size_t cap = 1 << 16, n = 0;
    char *s = malloc(cap);
    if (!s) abort();
    n += (size_t)snprintf(s + n, cap - n, "{\"model\": {\"type\": \"BPE\", \"ignore_merges\": true, "
                          "\"vocab\": {");
    unsigned next = 256;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
        unsigned cp = printable ? (unsigned)b : next++;
        if (cp == '"' || cp == '\\') n += (size_t)snprintf(s + n, cap - n, "\"\\%c\": %d, ", cp, b);
        else n += (size_t)snprintf(s + n, cap - n, "\"\\u%04x\": %d, ", cp, b);
    }
    n += (size_t)snprintf(s + n, cap - n,
        "\"th\": 256, \"the\": 257, \"\\u0120t\": 258, \"\\u0120the\": 259}, \"merges\": [\"t h\", "
        "\"th e\", \"\\u0120 t\", \"\\u0120 the\"]}, \"added_tokens\": [{\"id\": 260, \"content\": "
        "\"<|eot_id|>\", \"special\": true}, {\"id\": 261, \"content\": \"<t>\", \"lstrip\": true, "
        "\"rstrip\": true, \"normalized\": false}, {\"id\": 262, \"content\": \"magic\", "
        "\"single_word\": true}], \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": "
        "[{\"type\": \"Split\", \"behavior\": \"Isolated\", \"pattern\": {\"Regex\": "
        "\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}{1,3}| "
        "?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"}}, "
        "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": false}]}, "
        "\"decoder\": {\"type\": \"ByteLevel\"}, \"post_processor\": {\"type\": "
        "\"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<|eot_id|>\"}}, "
        "{\"Sequence\": {\"id\": \"A\"}}], \"special_tokens\": {\"<|eot_id|>\": {\"ids\": [260]}}}}");
    return s;
}

static char *sentencepiece_json(void)
{
    size_t cap = 16384, n = 0;
    char *s = malloc(cap);
    if (!s) abort();
    n += (size_t)snprintf(s + n, cap - n, "{\"normalizer\": {\"type\": \"Sequence\", \"normalizers\": "
        "[{\"type\": \"Prepend\", \"prepend\": \"\\u2581\"}, {\"type\": \"Replace\", \"pattern\": "
        "{\"String\": \" \"}, \"content\": \"\\u2581\"}]}, \"decoder\": {\"type\": \"Sequence\", "
        "\"decoders\": [{\"type\": \"Replace\", \"pattern\": {\"String\": \"\\u2581\"}, \"content\": "
        "\" \"}, {\"type\": \"ByteFallback\"}, {\"type\": \"Fuse\"}, {\"type\": \"Strip\", "
        "\"content\": \" \", \"start\": 1, \"stop\": 0}]}, \"added_tokens\": [{\"id\": 1, "
        "\"content\": \"<s>\", \"special\": true}, {\"id\": 263, \"content\": \"[INST]\", "
        "\"special\": true, \"normalized\": true}], \"model\": {\"type\": \"BPE\", \"byte_fallback\": "
        "true, \"fuse_unk\": true, \"unk_token\": \"<unk>\", \"merges\": [\"\\u2581 a\", \"a a\"], "
        "\"vocab\": {\"<unk>\": 0, \"<s>\": 1, \"</s>\": 2, \"\\u2581\": 259, \"a\": 260, "
        "\"\\u2581a\": 261, \"aa\": 262");
    for (int b = 0; b < 256; b++) n += (size_t)snprintf(s + n, cap - n, ", \"<0x%02X>\": %d", b, 3 + b);
    snprintf(s + n, cap - n, "}}}");
    return s;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    char err[512];
    char *a = byte_level_json(), *b = sentencepiece_json();
    fixed[0] = tsr_tok_load_text(a, strlen(a), NULL, 0, "fixed", err, sizeof err);
    fixed[1] = tsr_tok_load_text(b, strlen(b), NULL, 0, "fixed", err, sizeof err);
    free(a);
    free(b);
    if (!fixed[0] || !fixed[1]) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", err);
        abort();
    }
    return 0;
}

/* Decodes ids whole and streamed; the two must agree. */
static void decode_both(const tsr_tokenizer_t *t, const int32_t *ids, size_t n, bool skip)
{
    size_t len;
    char *whole = tsr_tok_decode(t, ids, n, skip, &len);
    if (!whole) return;
    tsr_detok_t *d = tsr_detok_new(t, skip);
    char *cat = malloc(len + 1);
    size_t got = 0;
    for (size_t i = 0; d && cat && i <= n; i++) {
        const char *p;
        size_t pl;
        if ((i < n ? tsr_detok_push(d, ids[i], &p, &pl) : tsr_detok_flush(d, &p, &pl)) != 0) break;
        if (got + pl > len || memcmp(whole + got, p, pl)) abort();  /* not a prefix */
        memcpy(cat + got, p, pl);
        got += pl;
    }
    if (d && cat && got != len) abort();
    tsr_detok_destroy(&d);
    free(cat);
    free(whole);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    const char *rest = (const char *)data + 1;
    size_t n = size - 1;
    char err[512];
    if (!(data[0] & 1)) {
        err[0] = '\0';
        tsr_tokenizer_t *t = tsr_tok_load_text(rest, n, NULL, 0, "fuzz", err, sizeof err);
        if (!t) {
            if (!err[0]) abort();  /* a refusal always says why */
            return 0;
        }
        static const char *const texts[] = {"", "Hello world", "  a\n\nb  ", "<s>x</s>",
                                            "\xe4\xb8\xad\xf0\x9f\x9a\x80", "magic <|eot_id|>"};
        for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
            int32_t *ids;
            size_t m;
            if (tsr_tok_encode(t, texts[k], strlen(texts[k]), k & 1, &ids, &m, err, sizeof err))
                continue;
            decode_both(t, ids, m, k & 2);
            free(ids);
        }
        int32_t some[64];
        for (int k = 0; k < 64; k++) some[k] = (int32_t)((k * 2654435761u) % (unsigned)(tsr_tok_vocab_size(t) + 3)) - 1;
        decode_both(t, some, 64, false);
        tsr_tok_destroy(&t);
        return 0;
    }
    const tsr_tokenizer_t *t = fixed[(data[0] >> 1) & 1];
    int32_t *ids;
    size_t m;
    if (tsr_tok_encode(t, rest, n, (data[0] >> 2) & 1, &ids, &m, err, sizeof err) == 0) {
        decode_both(t, ids, m, (data[0] >> 3) & 1);
        free(ids);
    }
    size_t k = n / 2;
    int32_t *raw = malloc((k ? k : 1) * sizeof *raw);
    if (!raw) return 0;
    for (size_t i = 0; i < k; i++)
        raw[i] = (int32_t)(((unsigned char)rest[2 * i] | (unsigned char)rest[2 * i + 1] << 8) % 300) - 2;
    decode_both(t, raw, k, (data[0] >> 3) & 1);
    free(raw);
    return 0;
}
