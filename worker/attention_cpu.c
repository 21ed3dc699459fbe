/* attention_cpu.c: causal grouped-query attention on the CPU, each row of a
 * step against its sequence's positions in the KV cache (worker/kv_format.h),
 * an online softmax block by block, on the pool's threads. */
#include "worker/attention_cpu.h"

#include <math.h>
#include <string.h>

#include "worker/cpu_kernels.h"
#include "worker/kmath.h"
#include "worker/simd.h"

/* Attention work is cut into (entry, query head, 16 rows) tasks, so a long
 * prompt chunk spreads over the threads like the decodes around it. */
#define ATT_ROWS 16

typedef struct {
    const tsr_kvf_cache_t *kv;
    const tsr_batch_t *b;
    const int *first_row;       /* per entry: its first row */
    const int *first_task;      /* per entry: its first task; [n_entries] = the total */
    const float *qkv;
    float *att;
    int q_heads, l;
} att_job_t;

/* Scores of q against the 4 keys at k (rows of hd floats), over the
 * first hd & ~7 dimensions, half-reduced: lanes 0-3 hold each key's sum of
 * its vector lanes 0-3, lanes 4-7 that of lanes 4-7 (att_scores finishes
 * them).  The four multiply-add chains run side by side. */
static inline __attribute__((always_inline)) v8f dot4_part(const float *q, const void *k,
                                                           size_t hd, int kt)
{
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    size_t d = 0;
    for (; d + 16 <= hd; d += 16) {
        const v8f x = load8(q + d), y = load8(q + d + 8);
        v8f l0, h0, l1, h1, l2, h2, l3, h3;
        tsr_kvf_load16(k, d, kt, &l0, &h0), tsr_kvf_load16(k, hd + d, kt, &l1, &h1);
        tsr_kvf_load16(k, 2 * hd + d, kt, &l2, &h2), tsr_kvf_load16(k, 3 * hd + d, kt, &l3, &h3);
        a0 += x * l0, a1 += x * l1, a2 += x * l2, a3 += x * l3;
        a0 += y * h0, a1 += y * h1, a2 += y * h2, a3 += y * h3;
    }
    if (d + 8 <= hd) {
        const v8f x = load8(q + d);
        a0 += x * tsr_kvf_load8(k, d, kt), a1 += x * tsr_kvf_load8(k, hd + d, kt);
        a2 += x * tsr_kvf_load8(k, 2 * hd + d, kt), a3 += x * tsr_kvf_load8(k, 3 * hd + d, kt);
    }
    return hadd8(hadd8(a0, a1), hadd8(a2, a3));
}

/* dot4_part for two query rows at once, each key line loaded once for
 * both; every sum is formed exactly as dot4_part forms it. */
static inline __attribute__((always_inline)) void dot4x2_part(const float *q0, const float *q1,
                                                              const void *k, size_t hd, int kt,
                                                              v8f *out0, v8f *out1)
{
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    size_t d = 0;
    /* a key at a time (14 vector registers), each accumulator in the same
     * order as dot4_part's: the 8 dimensions of d, then those of d + 8 */
#define KEY16(j, aj, bj)                                                                          \
    do {                                                                                          \
        v8f l, h;                                                                                 \
        tsr_kvf_load16(k, (j) * hd + d, kt, &l, &h);                                              \
        aj += x * l, bj += y * l;                                                                 \
        aj += x2 * h, bj += y2 * h;                                                               \
    } while (0)
    for (; d + 16 <= hd; d += 16) {
        const v8f x = load8(q0 + d), x2 = load8(q0 + d + 8), y = load8(q1 + d),
                  y2 = load8(q1 + d + 8);
        KEY16(0, a0, b0);
        KEY16(1, a1, b1);
        KEY16(2, a2, b2);
        KEY16(3, a3, b3);
    }
#undef KEY16
    if (d + 8 <= hd) {
        const v8f x = load8(q0 + d), y = load8(q1 + d);
        const v8f l0 = tsr_kvf_load8(k, d, kt), l1 = tsr_kvf_load8(k, hd + d, kt),
                  l2 = tsr_kvf_load8(k, 2 * hd + d, kt), l3 = tsr_kvf_load8(k, 3 * hd + d, kt);
        a0 += x * l0, a1 += x * l1, a2 += x * l2, a3 += x * l3;
        b0 += y * l0, b1 += y * l1, b2 += y * l2, b3 += y * l3;
    }
    *out0 = hadd8(hadd8(a0, a1), hadd8(a2, a3));
    *out1 = hadd8(hadd8(b0, b1), hadd8(b2, b3));
}

/* The 8 scores of two dot4_part results (keys 0-3, keys 4-7), each
 * ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) over its vector lanes,
 * then the dimensions past hd & ~7 added one by one.  The same for every
 * row whatever its neighbours, so rows taken in pairs and alone agree. */
static inline __attribute__((always_inline)) v8f att_scores(v8f lo, v8f hi, const float *q,
                                                            const void *k, int hd, int kt)
{
    const v8i first = {0, 1, 2, 3, 8, 9, 10, 11}, second = {4, 5, 6, 7, 12, 13, 14, 15};
    v8f s = __builtin_shuffle(lo, hi, first) + __builtin_shuffle(lo, hi, second);
    for (int d = hd & ~7; d < hd; d++)
        for (int p = 0; p < 8; p++)
            s[p] = fmaf(q[d], tsr_kvf_load1(k, (size_t)p * hd + d, kt), s[p]);
    return s;
}

/* One row's running attention for one head: the softmax state and the
 * accumulator (hd floats, in v8f; the last hd % 8 in tail). */
typedef struct {
    tsr_osm_t st;
    float tail[8];
} att_row_t;

/* A block's scores s[0..1] (positions 0-7, 8-15; those from np on are
 * not the sequence's and count for nothing) turned into weights
 * exp(score - max) in sc, merged into the row's running softmax
 * (worker/kmath.h's tsr_k_osm_merge); the accumulator then becomes
 * ca * acc + cb * (sum of weight * value).  All in vectors: the scalar
 * exponentials were most of attention's time at decode. */
static inline __attribute__((always_inline)) void att_weights(const v8f *s, int np, float scale,
                                                              float *sc, att_row_t *r, float *ca,
                                                              float *cb)
{
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const v8i in0 = lane < np, in1 = lane + 8 < np;
    const v8f ninf = bcast8(-INFINITY);
    v8f s0 = s[0] * bcast8(scale), s1 = s[1] * bcast8(scale);
    s0 = (v8f)((in0 & (v8i)s0) | (~in0 & (v8i)ninf));
    s1 = (v8f)((in1 & (v8i)s1) | (~in1 & (v8i)ninf));
    v8i gt = s1 > s0;
    v8f mx = (v8f)((gt & (v8i)s1) | (~gt & (v8i)s0));
    float m = mx[0];
    for (int k = 1; k < 8; k++) m = mx[k] > m ? mx[k] : m;
    const v8f w0 = (v8f)(in0 & (v8i)exp8(s0 - bcast8(m))),
              w1 = (v8f)(in1 & (v8i)exp8(s1 - bcast8(m)));
    memcpy(sc, &w0, sizeof w0);
    memcpy(sc + 8, &w1, sizeof w1);
    tsr_osm_t bs = {m, hsum8(w0 + w1)};
    tsr_k_osm_merge(&r->st, bs, ca, cb);
}

/* The values of a block weighted by sc into a row, columns [d, hd): 32 at
 * a time in registers, then 8, then one. */
static inline __attribute__((always_inline)) void att_values(const float *sc, const void *vb,
                                                             int kt, int np, int hd, int d,
                                                             float ca, float cb, att_row_t *r,
                                                             v8f *acc)
{
    const int hd8 = hd & ~7, hd16 = hd & ~15;
    const v8f cav = bcast8(ca), cbv = bcast8(cb);
    for (; d + 32 <= hd16; d += 32) {
        v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        for (int p = 0; p < np; p++) {
            const size_t v = (size_t)p * hd + d;
            const v8f wv = bcast8(sc[p]);
            v8f l0, h0, l1, h1;
            tsr_kvf_load16(vb, v, kt, &l0, &h0), tsr_kvf_load16(vb, v + 16, kt, &l1, &h1);
            s0 += wv * l0, s1 += wv * h0, s2 += wv * l1, s3 += wv * h1;
        }
        acc[d / 8] = acc[d / 8] * cav + s0 * cbv;
        acc[d / 8 + 1] = acc[d / 8 + 1] * cav + s1 * cbv;
        acc[d / 8 + 2] = acc[d / 8 + 2] * cav + s2 * cbv;
        acc[d / 8 + 3] = acc[d / 8 + 3] * cav + s3 * cbv;
    }
    for (; d + 16 <= hd16; d += 16) {
        v8f s0 = {0}, s1 = {0};
        for (int p = 0; p < np; p++) {
            const v8f wv = bcast8(sc[p]);
            v8f l, h;
            tsr_kvf_load16(vb, (size_t)p * hd + d, kt, &l, &h);
            s0 += wv * l, s1 += wv * h;
        }
        acc[d / 8] = acc[d / 8] * cav + s0 * cbv;
        acc[d / 8 + 1] = acc[d / 8 + 1] * cav + s1 * cbv;
    }
    if (d + 8 <= hd8) {
        v8f s0 = {0};
        for (int p = 0; p < np; p++)
            s0 += bcast8(sc[p]) * tsr_kvf_load8(vb, (size_t)p * hd + d, kt);
        acc[d / 8] = acc[d / 8] * cav + s0 * cbv;
        d += 8;
    }
    for (; d < hd; d++) {
        float s0 = 0;
        for (int p = 0; p < np; p++)
            s0 = fmaf(sc[p], tsr_kvf_load1(vb, (size_t)p * hd + d, kt), s0);
        r->tail[d - hd8] = fmaf(s0, cb, r->tail[d - hd8] * ca);
    }
}

/* An int8 block's row scales: the keys' onto the 8 scores s (keys 8g to
 * 8g + 7), and the values' onto the softmax weights sc (16), into wv: the
 * weights att_values takes.  Nothing for the other kinds (wv is sc). */
static inline __attribute__((always_inline)) v8f key_scale(v8f s, const float *ks, int g, int kt)
{
    return tsr_kvf_is_i8(kt) ? s * load8(ks + 8 * g) : s;
}

static inline __attribute__((always_inline)) const float *value_weights(const float *sc,
                                                                       const float *vs, int kt,
                                                                       float *wv)
{
    if (!tsr_kvf_is_i8(kt)) return sc;
    const v8f w0 = load8(sc) * load8(vs), w1 = load8(sc + 8) * load8(vs + 8);
    memcpy(wv, &w0, sizeof w0);
    memcpy(wv + 8, &w1, sizeof w1);
    return wv;
}

/* Takes np cached positions (keys kb, values vb: np rows of hd, in a block
 * of TSR_KV_BLOCK; for int8 their row scales ks, vs) into a row's state:
 * the block's scores (all 16 keys are read, those from np on are masked),
 * att_weights, att_values. */
static inline __attribute__((always_inline)) void att_block(const float *q, const void *kb,
                                                            const void *vb, const float *ks,
                                                            const float *vs, int kt, int np,
                                                            int hd, float scale, att_row_t *r,
                                                            v8f *acc)
{
    _Static_assert(TSR_KV_BLOCK == 16, "att_block scores blocks of 16 positions");
    float sc[TSR_KV_BLOCK], wv[TSR_KV_BLOCK], ca, cb;
    const size_t h = (size_t)hd;
    v8f s[2];
    for (int g = 0; g < 2; g++) {
        const void *k0 = tsr_kvf_ptr(kb, 8 * g * h, kt), *k4 = tsr_kvf_ptr(kb, (8 * g + 4) * h, kt);
        s[g] = key_scale(
            att_scores(dot4_part(q, k0, h, kt), dot4_part(q, k4, h, kt), q, k0, hd, kt), ks, g,
            kt);
    }
    att_weights(s, np, scale, sc, r, &ca, &cb);
    att_values(value_weights(sc, vs, kt, wv), vb, kt, np, hd, 0, ca, cb, r, acc);
}

/* att_block of a whole block for two rows of a prompt, with bits equal to
 * two att_block calls: each key and value line is loaded once for both
 * rows, which halves what a long prompt's attention reads from the cache
 * hierarchy (it reads every earlier position once per row). */
static inline __attribute__((always_inline)) void att_block2(const float *q0, const float *q1,
                                                             const void *kb, const void *vb,
                                                             const float *ks, const float *vs,
                                                             int kt, int hd, float scale,
                                                             att_row_t *r0, v8f *acc0,
                                                             att_row_t *r1, v8f *acc1)
{
    enum { NP = TSR_KV_BLOCK };
    float sc0[NP], sc1[NP], wv0[NP], wv1[NP], ca0, cb0, ca1, cb1;
    const size_t h = (size_t)hd;
    v8f s0[2], s1[2];
    for (int g = 0; g < 2; g++) {
        v8f lo0, lo1, hi0, hi1;
        const void *k0 = tsr_kvf_ptr(kb, 8 * g * h, kt), *k4 = tsr_kvf_ptr(kb, (8 * g + 4) * h, kt);
        dot4x2_part(q0, q1, k0, h, kt, &lo0, &lo1);
        dot4x2_part(q0, q1, k4, h, kt, &hi0, &hi1);
        s0[g] = key_scale(att_scores(lo0, hi0, q0, k0, hd, kt), ks, g, kt);
        s1[g] = key_scale(att_scores(lo1, hi1, q1, k0, hd, kt), ks, g, kt);
    }
    att_weights(s0, NP, scale, sc0, r0, &ca0, &cb0);
    att_weights(s1, NP, scale, sc1, r1, &ca1, &cb1);
    const float *w0p = value_weights(sc0, vs, kt, wv0), *w1p = value_weights(sc1, vs, kt, wv1);
    const int hd8 = hd & ~7;
    const v8f ca0v = bcast8(ca0), cb0v = bcast8(cb0), ca1v = bcast8(ca1), cb1v = bcast8(cb1);
    int d = 0;
    for (; d + 16 <= hd8; d += 16) {
        v8f s0 = {0}, s1 = {0}, t0 = {0}, t1 = {0};
        for (int p = 0; p < NP; p++) {
            const v8f w0 = bcast8(w0p[p]), w1 = bcast8(w1p[p]);
            v8f v0, v1;
            tsr_kvf_load16(vb, (size_t)p * hd + d, kt, &v0, &v1);
            s0 += w0 * v0, s1 += w0 * v1, t0 += w1 * v0, t1 += w1 * v1;
        }
        acc0[d / 8] = acc0[d / 8] * ca0v + s0 * cb0v;
        acc0[d / 8 + 1] = acc0[d / 8 + 1] * ca0v + s1 * cb0v;
        acc1[d / 8] = acc1[d / 8] * ca1v + t0 * cb1v;
        acc1[d / 8 + 1] = acc1[d / 8 + 1] * ca1v + t1 * cb1v;
    }
    att_values(w0p, vb, kt, NP, hd, d, ca0, cb0, r0, acc0);
    att_values(w1p, vb, kt, NP, hd, d, ca1, cb1, r1, acc1);
}

static inline void att_row_init(att_row_t *r, v8f *acc, int hd)
{
    r->st = tsr_k_osm_init();
    memset(r->tail, 0, sizeof r->tail);
    memset(acc, 0, (size_t)(hd / 8) * sizeof *acc);
}

/* The row's output: acc / l, or with part (a sequence split's partial
 * state, tsr_attention_merge) m, l and acc as they are. */
static inline void att_row_out(const att_row_t *r, const v8f *acc, int hd, float *out, int part)
{
    const int hd8 = hd & ~7;
    const float div = part ? 1.0f : r->st.l;
    if (part) out[0] = r->st.m, out[1] = r->st.l, out += 2;
    for (int d = 0; d < hd8; d += 8)
        for (int k = 0; k < 8; k++) out[d + k] = acc[d / 8][k] / div;
    for (int d = hd8; d < hd; d++) out[d] = r->tail[d - hd8] / div;
}

/* Asks for a block's keys and values of one head: two 4 KiB runs
 * elsewhere in the pool, where the hardware's stream prefetch does not
 * follow (a block table, page-sized runs), so asked for while the block
 * before computes they are there when it is done.  Into L2 (locality 1,
 * prefetcht2, which AMD's cores fill into L2): 32 sequences
 * at context 400 took 38-42 ms a step against 40-62 ms with the lines
 * asked into L1 (bench/engine_step, alternating runs, 2-core EPYC VM). */
static inline __attribute__((always_inline)) void kv_prefetch(const tsr_kvf_cache_t *kv,
                                                               int l, int slot, int pos,
                                                               size_t run, int kt)
{
    const size_t off = tsr_kvf_off(kv, l, slot, pos) + run;
    const char *kn = tsr_kvf_ptr(kv->k, off, kt), *vn = tsr_kvf_ptr(kv->v, off, kt);
    for (size_t i = 0; i < (size_t)TSR_KV_BLOCK * kv->head_dim * tsr_kvf_esize(kt); i += 64)
        __builtin_prefetch(kn + i, 0, 1), __builtin_prefetch(vn + i, 0, 1);
    if (tsr_kvf_is_i8(kt))   /* the block's 16 scales: one line each */
        __builtin_prefetch(kv->kscale + off / kv->head_dim, 0, 1),
            __builtin_prefetch(kv->vscale + off / kv->head_dim, 0, 1);
}

/* With a sequence split, the first block from position pos on (pos a
 * block's first) that this rank holds, before limit; -1 when none.  What
 * a split's kernels prefetch instead of the next block, which is mostly
 * another rank's. */
static inline int held_from(const tsr_kvf_cache_t *kv, int slot, int pos, int limit)
{
    for (; pos < limit; pos += TSR_KV_BLOCK)
        if (tsr_kvf_holds(kv, slot, pos)) return pos;
    return -1;
}

/* Causal grouped-query attention of some rows of one entry for one query
 * head, over its sequence's cached positions block by block.  Rows go in
 * pairs through the blocks both see whole (att_block2), then one by one
 * through the rest (att_block), in block order either way, so a row's
 * result depends on that row alone, bit for bit, whatever its neighbours
 * (test_engine_cpu).  Compiled twice, for AVX2 with FMA and for any x86-64
 * (att_task_for picks), as the products are. */
static inline __attribute__((always_inline)) void att_task_body(void *arg, int t, int kt)
{
    const att_job_t *j = arg;
    const tsr_kvf_cache_t *kv = j->kv;
    int ei = 0;
    while (j->first_task[ei + 1] <= t) ei++;
    const int qh = j->q_heads, kvh = kv->heads, hd = kv->head_dim, group = qh / kvh,
              B = TSR_KV_BLOCK;
    const tsr_entry_t *en = &j->b->entries[ei];
    const float scale = 1.0f / sqrtf((float)hd);
    const int part = kv->seq_size > 1;   /* partial states: out rows of hd + 2 */
    const int local = t - j->first_task[ei], h = local % qh, r0 = local / qh * ATT_ROWS;
    /* run: the KV head's offset in a block (tsr_kvf_off) */
    const size_t qkvw = (size_t)(qh + 2 * kvh) * hd, run = (size_t)(h / group) * B * hd;
    const int r1 = en->n < r0 + ATT_ROWS ? en->n : r0 + ATT_ROWS;
    v8f acc[2][64];
    att_row_t rs[2];
    /* an int8 block's key and value scales (tsr_kvf_cache_t.kscale) */
#define KV_SCALES(off)                                                                            \
    tsr_kvf_is_i8(kt) ? kv->kscale + (off) / (size_t)hd : NULL,                                   \
        tsr_kvf_is_i8(kt) ? kv->vscale + (off) / (size_t)hd : NULL
    for (int r = r0; r < r1;) {
        const int pair = r + 1 < r1, visible = en->pos + r + 1;   /* row r + 1 sees one more */
        const float *q[2];
        for (int k = 0; k <= pair; k++) {
            q[k] = j->qkv + ((size_t)j->first_row[ei] + r + k) * qkvw + (size_t)h * hd;
            att_row_init(&rs[k], acc[k], hd);
        }
        int b0 = 0;
        if (pair)
            for (; b0 + B <= visible; b0 += B) {
                if (!part) {
                    kv_prefetch(kv, j->l, en->slot, b0 + B, run, kt);   /* row r + 1 sees b0 + B */
                } else {
                    if (!tsr_kvf_holds(kv, en->slot, b0)) continue;   /* another rank's */
                    const int nx = held_from(kv, en->slot, b0 + B, visible + 1);
                    if (nx >= 0) kv_prefetch(kv, j->l, en->slot, nx, run, kt);
                }
                const size_t off = tsr_kvf_off(kv, j->l, en->slot, b0) + run;
                att_block2(q[0], q[1], tsr_kvf_ptr(kv->k, off, kt), tsr_kvf_ptr(kv->v, off, kt),
                           KV_SCALES(off), kt, hd, scale, &rs[0], acc[0], &rs[1], acc[1]);
            }
        for (int k = 0; k <= pair; k++) {
            const int vis = visible + k;
            /* two blocks ahead: 32 sequences at context 400 with bf16 KV and
             * bf16 products took 16.3-16.6 ms a step against 16.7-16.9 ms
             * one block ahead (three alternating runs, 2-core Xeon VM; on
             * the EPYC VM two or three ahead were within noise) */
            if (!part && b0 + B < vis) kv_prefetch(kv, j->l, en->slot, b0 + B, run, kt);
            for (int c0 = b0; c0 < vis; c0 += B) {
                if (!part) {
                    if (c0 + 2 * B < vis) kv_prefetch(kv, j->l, en->slot, c0 + 2 * B, run, kt);
                } else {
                    if (!tsr_kvf_holds(kv, en->slot, c0)) continue;
                    const int nx = held_from(kv, en->slot, c0 + B, vis);
                    if (nx >= 0) kv_prefetch(kv, j->l, en->slot, nx, run, kt);
                }
                const size_t off = tsr_kvf_off(kv, j->l, en->slot, c0) + run;
                att_block(q[k], tsr_kvf_ptr(kv->k, off, kt), tsr_kvf_ptr(kv->v, off, kt),
                          KV_SCALES(off), kt, vis - c0 < B ? vis - c0 : B, hd, scale, &rs[k],
                          acc[k]);
            }
            const size_t w = (size_t)hd + (part ? 2 : 0);
            att_row_out(&rs[k], acc[k], hd,
                        j->att + (((size_t)j->first_row[ei] + r + k) * qh + (size_t)h) * w, part);
        }
        r += 1 + pair;
    }
#undef KV_SCALES
}

#define ATT_TASK(name, target, kt)                                                               \
    target static void name(void *arg, int t) { att_task_body(arg, t, kt); }
ATT_TASK(att_task_fma, __attribute__((target("avx2,fma"))), TSR_KVF_F32)
ATT_TASK(att_task_fma_bf16, __attribute__((target("avx2,fma"))), TSR_KVF_BF16)
ATT_TASK(att_task_fma_i8, __attribute__((target("avx2,fma"))), TSR_KVF_I8_AVX2)
ATT_TASK(att_task_plain, , TSR_KVF_F32)
ATT_TASK(att_task_plain_bf16, , TSR_KVF_BF16)
ATT_TASK(att_task_plain_i8, , TSR_KVF_I8)
#undef ATT_TASK

/* The attention kernel this CPU runs for a pool of kind kt: one choice for
 * the process, so every step of every sequence computes the same way. */
static void (*att_task_for(int kt))(void *, int)
{
    static void (*const fma[])(void *, int) = {att_task_fma, att_task_fma_bf16, att_task_fma_i8};
    static void (*const plain[])(void *, int) = {att_task_plain, att_task_plain_bf16,
                                                 att_task_plain_i8};
    return tsr_cpu_kernels() != TSR_KERNELS_PLAIN ? fma[kt] : plain[kt];
}

void tsr_attention_cpu(tsr_pool_t *pool, const tsr_kvf_cache_t *kv, int l, const tsr_batch_t *b,
                       const int *first_row, const float *qkv, int q_heads, float *att)
{
    int first_task[b->n_entries + 1];
    first_task[0] = 0;
    for (int i = 0; i < b->n_entries; i++)
        first_task[i + 1] = first_task[i] + q_heads * ((b->entries[i].n + ATT_ROWS - 1) / ATT_ROWS);
    att_job_t aj = {kv, b, first_row, first_task, qkv, att, q_heads, l};
    tsr_pool_for(pool, first_task[b->n_entries], att_task_for(kv->kind), &aj);
}

void tsr_attention_merge(const float *parts, int n_parts, size_t part_stride, int rows,
                         int heads, int hd, float *att)
{
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            const size_t at = ((size_t)r * heads + h) * ((size_t)hd + 2);
            float *out = att + ((size_t)r * heads + h) * hd;
            tsr_osm_t st = tsr_k_osm_init();
            for (int d = 0; d < hd; d++) out[d] = 0.0f;
            for (int i = 0; i < n_parts; i++) {
                const float *p = parts + (size_t)i * part_stride + at;
                float ca, cb;
                tsr_k_osm_merge(&st, (tsr_osm_t){p[0], p[1]}, &ca, &cb);
                for (int d = 0; d < hd; d++) out[d] = out[d] * ca + p[2 + d] * cb;
            }
            for (int d = 0; d < hd; d++) out[d] /= st.l;
        }
}
