/* tessera tokenize: a model directory's tokenizer from the command line. */
#include <errno.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "common/tokenizer.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tessera tokenize MODEL_DIR [--no-special] TEXT\n"
            "       tessera tokenize MODEL_DIR --decode IDS [--keep-special]\n"
            "       tessera tokenize MODEL_DIR --jsonl\n"
            "\n"
            "Encodes TEXT with MODEL_DIR/tokenizer.json and prints the ids, comma-separated;\n"
            "--no-special leaves out the special tokens the tokenizer adds (bos).  --decode\n"
            "prints the text of the ids (1,2,3); special tokens are left out unless\n"
            "--keep-special.  --jsonl reads one JSON object per line from stdin and answers\n"
            "each with one line: {\"text\": S, \"special\": B} gives {\"ids\": [...]};\n"
            "{\"ids\": [...], \"skip_special\": B} gives {\"text\": S, \"stream\": [pieces]},\n"
            "the pieces a streaming decoder emits, and with \"after\": [ids] (a prompt) the\n"
            "text the ids add to the prompt's; a bad line gives {\"error\": S}.\n");
}

/* "1,2,3" into ids (caller frees). */
static int parse_ids(const char *s, int32_t **ids, size_t *n)
{
    size_t max = strlen(s) / 2 + 1;   /* an id is a digit at least, then a separator */
    int32_t *v = malloc(max * sizeof *v);
    char why[128];
    if (!v) return -1;
    if (tsr_cli_parse_ids(s, v, max, n, why, sizeof why) < 0) {
        fprintf(stderr, "tessera tokenize: --decode: %s\n", why);
        free(v);
        return -1;
    }
    *ids = v;
    return 0;
}

/* The index of the first of ids[n] outside tok's vocabulary, or n. */
static size_t first_unknown(const tsr_tokenizer_t *tok, const int32_t *ids, size_t n)
{
    size_t k = 0;
    while (k < n && ids[k] >= 0 && ids[k] < tsr_tok_vocab_size(tok)) k++;
    return k;
}

static json_t *jsonl_answer(const tsr_tokenizer_t *tok, json_t *in)
{
    char err[512];
    json_t *text = json_object_get(in, "text"), *ids = json_object_get(in, "ids");
    if (json_is_string(text)) {
        int32_t *out;
        size_t n;
        json_t *sp = json_object_get(in, "special");
        if (tsr_tok_encode(tok, json_string_value(text), json_string_length(text),
                           sp ? json_is_true(sp) : true, &out, &n, err, sizeof err))
            return json_pack("{ss}", "error", err);
        json_t *arr = json_array();
        for (size_t i = 0; i < n; i++) json_array_append_new(arr, json_integer(out[i]));
        free(out);
        return json_pack("{so}", "ids", arr);
    }
    if (!json_is_array(ids)) return json_pack("{ss}", "error", "neither \"text\" nor \"ids\"");
    json_t *after = json_object_get(in, "after");
    size_t n = json_array_size(ids), n_ctx = json_array_size(after);
    int32_t *v = malloc((n + n_ctx + 1) * sizeof *v), *ctx = v + n;
    if (!v) return NULL;
    for (size_t i = 0; i < n + n_ctx; i++) {
        json_t *x = i < n ? json_array_get(ids, i) : json_array_get(after, i - n);
        json_int_t id = json_is_integer(x) ? json_integer_value(x) : -1;
        v[i] = id >= 0 && id <= INT32_MAX ? (int32_t)id : -1;
    }
    size_t bad = first_unknown(tok, v, n + n_ctx);
    if (bad < n + n_ctx) {
        free(v);
        snprintf(err, sizeof err, "%s[%zu]: not a token id of the tokenizer's vocabulary "
                 "(0 to %d)", bad < n ? "ids" : "after", bad < n ? bad : bad - n,
                 tsr_tok_vocab_size(tok) - 1);
        return json_pack("{ss}", "error", err);
    }
    json_t *skip = json_object_get(in, "skip_special");
    bool skip_special = skip ? json_is_true(skip) : true;
    size_t len;
    char *s = after ? tsr_tok_decode_after(tok, ctx, n_ctx, v, n, skip_special, &len)
                    : tsr_tok_decode(tok, v, n, skip_special, &len);
    json_t *stream = json_array();
    tsr_detok_t *d = tsr_detok_new(tok, skip_special);
    const char *piece;
    size_t plen;
    if (d && tsr_detok_prime(d, ctx, n_ctx) < 0) tsr_detok_destroy(&d);
    for (size_t i = 0; d && i <= n; i++) {
        int rc = i < n ? tsr_detok_push(d, v[i], &piece, &plen) : tsr_detok_flush(d, &piece, &plen);
        if (rc) break;
        if (plen) json_array_append_new(stream, json_stringn(piece, plen));
    }
    tsr_detok_destroy(&d);
    free(v);
    json_t *r = s ? json_pack("{s:s%,s:o}", "text", s, len, "stream", stream) : NULL;
    free(s);
    return r;
}

int tsr_cmd_tokenize(int argc, char **argv)
{
    static const struct option opts[] = {{"decode", required_argument, 0, 'd'},
                                         {"keep-special", no_argument, 0, 'k'},
                                         {"no-special", no_argument, 0, 'n'},
                                         {"jsonl", no_argument, 0, 'j'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *decode = NULL;
    bool keep = false, no_special = false, jsonl = false;
    int o;
    optind = 0;  /* 0 re-initialises GNU getopt (and its argument permutation) */
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (o) {
        case 'd': decode = optarg; break;
        case 'k': keep = true; break;
        case 'n': no_special = true; break;
        case 'j': jsonl = true; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    int want = jsonl || decode ? 1 : 2;
    if (argc - optind != want) {
        usage(stderr);
        return 2;
    }
    char err[1024];
    tsr_tokenizer_t *tok = tsr_tok_load(argv[optind], err, sizeof err);
    if (!tok) {
        fprintf(stderr, "tessera tokenize: %s\n", err);
        return 1;
    }
    int rc = 1;
    if (jsonl) {
        char *line = NULL;
        size_t cap = 0;
        ssize_t got;
        while ((got = getline(&line, &cap, stdin)) > 0) {
            json_error_t jerr;
            json_t *in = json_loadb(line, (size_t)got, JSON_ALLOW_NUL, &jerr);
            json_t *out = in ? jsonl_answer(tok, in) : json_pack("{ss}", "error", jerr.text);
            json_decref(in);
            if (!out) break;
            char *s = json_dumps(out, JSON_COMPACT);
            json_decref(out);
            if (!s) break;
            puts(s);
            free(s);
        }
        free(line);
        rc = fflush(stdout) == 0 && !ferror(stdin) ? 0 : 1;
    } else if (decode) {
        int32_t *ids = NULL;
        size_t n = 0, k = 0;
        rc = 1;   /* a bad value, as the README's exit statuses say */
        if (parse_ids(decode, &ids, &n) == 0 && (k = first_unknown(tok, ids, n)) < n)
            fprintf(stderr, "tessera tokenize: --decode: id %d (number %zu) is not in the "
                    "tokenizer's vocabulary of %d ids\n", ids[k], k + 1, tsr_tok_vocab_size(tok));
        if (ids && k == n) {
            size_t len;
            char *s = tsr_tok_decode(tok, ids, n, !keep, &len);
            if (s) {
                fwrite(s, 1, len, stdout);
                putchar('\n');
                rc = 0;
            }
            free(s);
        }
        free(ids);
    } else {
        int32_t *ids;
        size_t n;
        const char *text = argv[optind + 1];
        if (tsr_tok_encode(tok, text, strlen(text), !no_special, &ids, &n, err, sizeof err)) {
            fprintf(stderr, "tessera tokenize: %s\n", err);
        } else {
            for (size_t i = 0; i < n; i++) printf(i ? ",%d" : "%d", ids[i]);
            putchar('\n');
            free(ids);
            rc = 0;
        }
    }
    tsr_tok_destroy(&tok);
    return rc;
}
