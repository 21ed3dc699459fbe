/* sample.c: the next token from the last position's logits. */
#include <math.h>
#include <stdlib.h>

#include "common/draw.h"
#include "worker/engine.h"
#include "worker/kmath.h"

typedef struct {
    float p;
    int32_t id;
} cand_t;

static int cand_desc(const void *a, const void *b)
{
    const cand_t *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? 1 : -1;
    return x->id - y->id;
}

int32_t tsr_sample(const float *logits, int vocab, float temperature, float top_p, uint64_t seed,
                   uint64_t position)
{
    int32_t best = 0;
    for (int i = 1; i < vocab; i++)
        if (logits[i] > logits[best]) best = i;
    /* NaN compares false everywhere: treat anything but a positive finite
     * temperature as greedy, anything outside (0, 1) as no nucleus cut. */
    if (tsr_k_greedy(temperature)) return best;
    bool cut = tsr_k_top_p_cuts(top_p);
    cand_t *c = malloc((size_t)vocab * sizeof *c);
    if (!c) return best;
    double sum = 0;
    for (int i = 0; i < vocab; i++) {
        c[i] = (cand_t){tsr_k_sample_weight(logits[i], logits[best], temperature), i};
        sum += c[i].p;
    }
    /* Without a nucleus cut the draw walks the ids in order: no sort. */
    int k = vocab;
    double keep = sum;
    if (cut) {
        qsort(c, (size_t)vocab, sizeof *c, cand_desc);
        keep = c[0].p;
        k = 1;  /* the most likely token is always kept */
        while (k < vocab && keep < top_p * sum) keep += c[k++].p;
    }
    double r = tsr_draw(seed, position) * keep, acc = 0;
    int32_t pick = best;
    for (int i = 0; i < k; i++) {
        acc += c[i].p;
        if (r < acc && c[i].p > 0) {
            pick = c[i].id;
            break;
        }
    }
    free(c);
    return pick;
}
