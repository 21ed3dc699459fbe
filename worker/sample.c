/* sample.c: the next token from the last position's logits. */
#include <math.h>
#include <stdlib.h>

#include "common/draw.h"
#include "worker/engine.h"
#include "worker/kmath.h"
#include "worker/simd.h"

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

/* The first id of the largest logit, as a scan that keeps the first id
 * whose logit beats the best so far would find it: a NaN never beats
 * anything, and a NaN at id 0 is never beaten.  In two passes, 8 lanes at
 * a time: the largest value that is not NaN, then its first id; one row of
 * a large vocabulary in a few microseconds instead of a compare and branch
 * per id.  Batch invariance is untouched: the answer is the scan's. */
/* A ThreadSanitizer build has one version: TSan's runtime is not set up yet when
 * the loader runs an ifunc resolver, and the instrumented resolver crashes. */
#ifdef __SANITIZE_THREAD__
#define ARGMAX_CLONES
#else
#define ARGMAX_CLONES __attribute__((target_clones("avx2", "default")))
#endif
ARGMAX_CLONES static int32_t argmax_first(const float *x, int n)
{
    if (n <= 1 || isnan(x[0])) return 0;
    v8f mv = bcast8(x[0]);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8f v = load8(x + i);
        const v8i gt = v > mv;   /* false for NaN lanes: they keep mv */
        mv = (v8f)(((v8i)v & gt) | ((v8i)mv & ~gt));
    }
    float m = mv[0];
    for (int k = 1; k < 8; k++)
        if (mv[k] > m) m = mv[k];
    for (int k = i; k < n; k++)
        if (x[k] > m) m = x[k];
    const v8f mb = bcast8(m);
    for (i = 0; i + 8 <= n; i += 8) {
        const v8i eq = load8(x + i) == mb;
        if ((eq[0] | eq[1] | eq[2] | eq[3] | eq[4] | eq[5] | eq[6] | eq[7]) == 0) continue;
        for (int k = 0; k < 8; k++)
            if (eq[k]) return i + k;
    }
    for (; i < n; i++)
        if (x[i] == m) return i;
    return 0;   /* not reached: m is one of x */
}

int32_t tsr_sample(const float *logits, int vocab, float temperature, float top_p, uint64_t seed,
                   uint64_t position)
{
    const int32_t best = argmax_first(logits, vocab);
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
