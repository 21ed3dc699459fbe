/* tokenize: encodes a file of texts with a model directory's tokenizer.json on one
 * thread and prints the throughput; bench/tokenize.sh runs it beside the reference.
 *
 *   build/bench/tokenize MODEL_DIR TEXTS [PASSES]
 *
 * TEXTS holds the texts separated by 0x1E (record separator).  Each pass encodes every
 * text (no special tokens); the figure is the median pass.  Prints one line:
 *   bytes=B texts=N tokens=T passes=P median_s=S mb_per_s=M first_pass_s=F */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/tokenizer.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: tokenize MODEL_DIR TEXTS [PASSES]\n");
        return 2;
    }
    int passes = argc == 4 ? atoi(argv[3]) : 5;
    if (passes < 1 || passes > 100) passes = 5;
    char err[1024];
    tsr_tokenizer_t *tok = tsr_tok_load(argv[1], err, sizeof err);
    if (!tok) {
        fprintf(stderr, "tokenize: %s\n", err);
        return 1;
    }
    FILE *f = fopen(argv[2], "rb");
    if (!f) {
        perror(argv[2]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *all = malloc((size_t)size + 1);
    if (!all || fread(all, 1, (size_t)size, f) != (size_t)size) {
        fprintf(stderr, "tokenize: cannot read %s\n", argv[2]);
        return 1;
    }
    fclose(f);
    all[size] = '\x1e';
    double times[100];
    size_t tokens = 0, texts = 0;
    for (int p = 0; p < passes; p++) {
        tokens = texts = 0;
        double t0 = now_s();
        for (char *s = all; s < all + size;) {
            char *end = memchr(s, '\x1e', (size_t)(all + size - s) + 1);
            int32_t *ids;
            size_t n;
            if (tsr_tok_encode(tok, s, (size_t)(end - s), false, &ids, &n, err, sizeof err)) {
                fprintf(stderr, "tokenize: text %zu: %s\n", texts, err);
                return 1;
            }
            tokens += n;
            texts++;
            free(ids);
            s = end + 1;
        }
        times[p] = now_s() - t0;
    }
    double first = times[0];
    qsort(times, (size_t)passes, sizeof times[0], cmp_double);
    double med = times[passes / 2];
    printf("bytes=%ld texts=%zu tokens=%zu passes=%d median_s=%.4f mb_per_s=%.2f "
           "first_pass_s=%.4f\n", size, texts, tokens, passes, med, size / med / 1e6, first);
    free(all);
    tsr_tok_destroy(&tok);
    return 0;
}
