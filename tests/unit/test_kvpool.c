/* test_kvpool.c: the block bookkeeping of worker/kvpool.h.  A slot takes
 * ceil(n/16) blocks and no more, a grow that does not fit takes nothing,
 * release gives everything back, the same operations give the same tables
 * on every rank, and a seeded random workload never loses or duplicates a
 * block.  The prefix cache: published blocks outlive their slot, are shared
 * by the slots that attach them, are evicted only for room, released
 * longest ago first (a chain's deepest block first), and a reset gives the
 * pool every fresh pool's state; the keys (common/prefix.h) are SipHash-2-4,
 * chained, and differ under another secret. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/prefix.h"
#include "worker/kvpool.h"

static uint32_t rng_next(uint32_t *s)
{
    /* xorshift32: deterministic across libcs, unlike rand() */
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

static int rng_range(uint32_t *s, int lo, int hi)
{
    return lo + (int)(rng_next(s) % (uint32_t)(hi - lo + 1));
}

/* Every id of the pool appears once: in a table or not at all, never twice. */
static void assert_tables_disjoint(const tsr_kvpool_t *p, int slots)
{
    int n = tsr_kvpool_total(p), held = 0;
    bool *seen = calloc((size_t)n, sizeof *seen);
    assert_non_null(seen);
    for (int s = 0; s < slots; s++) {
        const int32_t *t = tsr_kvpool_table(p, s);
        for (int i = 0; i < tsr_kvpool_held(p, s); i++) {
            assert_in_range(t[i], 0, n - 1);
            assert_false(seen[t[i]]);
            seen[t[i]] = true;
            held++;
        }
    }
    assert_int_equal(held, tsr_kvpool_used(p));
    free(seen);
}

static void test_grow_takes_ceil_n_over_16_blocks(void **state)
{
    (void)state;
    tsr_kvpool_t *p = tsr_kvpool_new(64, 4, 512);
    assert_non_null(p);
    static const int n_pos[] = {1, 15, 16, 17, 32, 33, 100};
    for (size_t i = 0; i < sizeof n_pos / sizeof n_pos[0]; i++) {
        int slot = (int)(i % 4);
        tsr_kvpool_release(p, slot);
        int before = tsr_kvpool_used(p);
        assert_int_equal(tsr_kvpool_grow(p, slot, n_pos[i]), 0);
        int want = (n_pos[i] + 15) / 16;
        assert_int_equal(tsr_kvpool_held(p, slot), want);
        assert_int_equal(tsr_kvpool_used(p) - before, want);
    }
    assert_int_equal(tsr_kv_blocks_for(0), 0);
    assert_int_equal(tsr_kv_blocks_for(16), 1);
    assert_int_equal(tsr_kv_blocks_for(17), 2);
    assert_tables_disjoint(p, 4);
    tsr_kvpool_destroy(&p);
    assert_null(p);
}

static void test_grow_within_held_blocks_takes_none(void **state)
{
    (void)state;
    tsr_kvpool_t *p = tsr_kvpool_new(8, 2, 128);
    assert_non_null(p);
    assert_int_equal(tsr_kvpool_grow(p, 0, 20), 0);     /* 2 blocks */
    int32_t first[2];
    memcpy(first, tsr_kvpool_table(p, 0), sizeof first);
    for (int n = 0; n <= 32; n++) {                     /* shrinking asks or the same blocks */
        assert_int_equal(tsr_kvpool_grow(p, 0, n), 0);
        assert_int_equal(tsr_kvpool_held(p, 0), 2);
        assert_int_equal(tsr_kvpool_used(p), 2);
    }
    /* Growing past them adds one block and keeps the first two in place. */
    assert_int_equal(tsr_kvpool_grow(p, 0, 33), 0);
    assert_int_equal(tsr_kvpool_held(p, 0), 3);
    assert_memory_equal(tsr_kvpool_table(p, 0), first, sizeof first);
    tsr_kvpool_destroy(&p);
}

static void test_grow_that_does_not_fit_takes_nothing_and_fails(void **state)
{
    (void)state;
    tsr_kvpool_t *p = tsr_kvpool_new(5, 3, 256);
    assert_non_null(p);
    assert_int_equal(tsr_kvpool_grow(p, 0, 48), 0);     /* 3 of 5 */
    assert_int_equal(tsr_kvpool_grow(p, 1, 16), 0);     /* 4 of 5 */
    int32_t t1 = tsr_kvpool_table(p, 1)[0];
    /* Slot 1 needs 2 more, 1 is free: nothing moves. */
    assert_int_equal(tsr_kvpool_grow(p, 1, 48), -1);
    assert_int_equal(tsr_kvpool_held(p, 1), 1);
    assert_int_equal(tsr_kvpool_table(p, 1)[0], t1);
    assert_int_equal(tsr_kvpool_used(p), 4);
    /* A fresh slot that needs 2 fails too, and the last block is still there. */
    assert_int_equal(tsr_kvpool_grow(p, 2, 17), -1);
    assert_int_equal(tsr_kvpool_held(p, 2), 0);
    assert_int_equal(tsr_kvpool_grow(p, 2, 16), 0);
    assert_int_equal(tsr_kvpool_used(p), 5);
    assert_int_equal(tsr_kvpool_grow(p, 2, 17), -1);
    /* Slots outside the pool and negative sizes are refused. */
    assert_int_equal(tsr_kvpool_grow(p, -1, 1), -1);
    assert_int_equal(tsr_kvpool_grow(p, 3, 1), -1);
    assert_int_equal(tsr_kvpool_grow(p, 0, -1), -1);
    assert_tables_disjoint(p, 3);
    tsr_kvpool_destroy(&p);
}

static void test_release_returns_every_block(void **state)
{
    (void)state;
    tsr_kvpool_t *p = tsr_kvpool_new(10, 3, 160);
    assert_non_null(p);
    assert_int_equal(tsr_kvpool_grow(p, 0, 70), 0);     /* 5 */
    assert_int_equal(tsr_kvpool_grow(p, 1, 40), 0);     /* 3 */
    assert_int_equal(tsr_kvpool_used(p), 8);
    tsr_kvpool_release(p, 0);
    assert_int_equal(tsr_kvpool_held(p, 0), 0);
    assert_int_equal(tsr_kvpool_used(p), 3);
    tsr_kvpool_release(p, 0);                           /* holds none: nothing */
    tsr_kvpool_release(p, 2);
    tsr_kvpool_release(p, -1);
    tsr_kvpool_release(p, 3);
    assert_int_equal(tsr_kvpool_used(p), 3);
    /* What slot 0 gave back is free again: 7 blocks fit. */
    assert_int_equal(tsr_kvpool_grow(p, 2, 112), 0);
    assert_int_equal(tsr_kvpool_used(p), 10);
    tsr_kvpool_release(p, 1);
    tsr_kvpool_release(p, 2);
    assert_int_equal(tsr_kvpool_used(p), 0);
    tsr_kvpool_destroy(&p);
}

static void test_used_and_total_count_blocks(void **state)
{
    (void)state;
    tsr_kvpool_t *p = tsr_kvpool_new(7, 2, 64);
    assert_non_null(p);
    assert_int_equal(tsr_kvpool_total(p), 7);
    assert_int_equal(tsr_kvpool_used(p), 0);
    assert_int_equal(tsr_kvpool_grow(p, 0, 64), 0);
    assert_int_equal(tsr_kvpool_grow(p, 1, 33), 0);
    assert_int_equal(tsr_kvpool_used(p), 7);
    assert_int_equal(tsr_kvpool_total(p), 7);
    tsr_kvpool_destroy(&p);
    tsr_kvpool_destroy(&p);                             /* NULL: nothing */
    tsr_kvpool_destroy(NULL);
}

static void test_sizes_that_are_not_positive_give_no_pool(void **state)
{
    (void)state;
    assert_null(tsr_kvpool_new(0, 1, 16));
    assert_null(tsr_kvpool_new(1, 0, 16));
    assert_null(tsr_kvpool_new(1, 1, 0));
}

/* A seeded script of grows and releases, run on several pools at once. */
static void run_script(tsr_kvpool_t **pools, int n_pools, int slots, int max_seq_len,
                       uint32_t seed, int rounds)
{
    for (int r = 0; r < rounds; r++) {
        int slot = rng_range(&seed, 0, slots - 1);
        bool release = rng_range(&seed, 0, 3) == 0;
        int n = rng_range(&seed, 0, max_seq_len);
        for (int k = 0; k < n_pools; k++) {
            if (release) {
                tsr_kvpool_release(pools[k], slot);
            } else {
                int rc = tsr_kvpool_grow(pools[k], slot, n);
                /* Every pool sees the same state, so every pool answers alike. */
                if (k > 0) {
                    int rc0 = tsr_kvpool_held(pools[0], slot) >= tsr_kv_blocks_for(n) ? 0 : -1;
                    assert_int_equal(rc, rc0);
                }
            }
        }
    }
}

static void test_same_operations_give_identical_tables_on_every_rank(void **state)
{
    (void)state;
    enum { SLOTS = 6, LEN = 200, BLOCKS = 40 };
    tsr_kvpool_t *a = tsr_kvpool_new(BLOCKS, SLOTS, LEN), *b = tsr_kvpool_new(BLOCKS, SLOTS, LEN);
    assert_non_null(a);
    assert_non_null(b);
    tsr_kvpool_t *pools[2] = {a, b};
    for (int chunk = 0; chunk < 50; chunk++) {
        run_script(pools, 2, SLOTS, LEN, 0x5eed0000u + (uint32_t)chunk, 40);
        assert_int_equal(tsr_kvpool_used(a), tsr_kvpool_used(b));
        for (int s = 0; s < SLOTS; s++) {
            assert_int_equal(tsr_kvpool_held(a, s), tsr_kvpool_held(b, s));
            assert_memory_equal(tsr_kvpool_table(a, s), tsr_kvpool_table(b, s),
                                (size_t)tsr_kvpool_held(a, s) * sizeof(int32_t));
        }
    }
    tsr_kvpool_destroy(&a);
    tsr_kvpool_destroy(&b);
}

static void test_random_rounds_lose_and_duplicate_no_block(void **state)
{
    (void)state;
    uint32_t seed = 0xb10c5u;
    for (int trial = 0; trial < 200; trial++) {
        int n_blocks = rng_range(&seed, 1, 64), slots = rng_range(&seed, 1, 8);
        /* One slot can hold the whole pool, for the final permutation check. */
        int len = n_blocks * TSR_KV_BLOCK;
        tsr_kvpool_t *p = tsr_kvpool_new(n_blocks, slots, len);
        assert_non_null(p);
        int rounds = rng_range(&seed, 1, 300);
        for (int r = 0; r < rounds; r++) {
            int slot = rng_range(&seed, 0, slots - 1);
            if (rng_range(&seed, 0, 3) == 0) {
                tsr_kvpool_release(p, slot);
                assert_int_equal(tsr_kvpool_held(p, slot), 0);
                continue;
            }
            int n = rng_range(&seed, 0, len), held = tsr_kvpool_held(p, slot);
            int used = tsr_kvpool_used(p), more = tsr_kv_blocks_for(n) - held;
            bool fits = more <= n_blocks - used;
            assert_int_equal(tsr_kvpool_grow(p, slot, n), fits ? 0 : -1);
            if (fits && more > 0) {
                assert_int_equal(tsr_kvpool_held(p, slot), tsr_kv_blocks_for(n));
                assert_int_equal(tsr_kvpool_used(p), used + more);
            } else {
                assert_int_equal(tsr_kvpool_held(p, slot), held);
                assert_int_equal(tsr_kvpool_used(p), used);
            }
            assert_tables_disjoint(p, slots);
        }
        for (int s = 0; s < slots; s++) tsr_kvpool_release(p, s);
        assert_int_equal(tsr_kvpool_used(p), 0);
        /* All free again: one slot takes every block, each id exactly once. */
        assert_int_equal(tsr_kvpool_grow(p, 0, len), 0);
        assert_int_equal(tsr_kvpool_held(p, 0), n_blocks);
        bool seen[64] = {false};
        const int32_t *t = tsr_kvpool_table(p, 0);
        for (int i = 0; i < n_blocks; i++) {
            assert_in_range(t[i], 0, n_blocks - 1);
            assert_false(seen[t[i]]);
            seen[t[i]] = true;
        }
        tsr_kvpool_destroy(&p);
    }
}

static void test_grow_beyond_max_seq_len_fails(void **state)
{
    (void)state;
    /* 100 is not a multiple of 16: the 7th block has room for 112, but
     * positions past 100 are still refused. */
    tsr_kvpool_t *p = tsr_kvpool_new(64, 2, 100);
    assert_non_null(p);
    assert_int_equal(tsr_kvpool_grow(p, 0, 100), 0);
    assert_int_equal(tsr_kvpool_held(p, 0), 7);
    assert_int_equal(tsr_kvpool_grow(p, 0, 101), -1);
    assert_int_equal(tsr_kvpool_grow(p, 1, 101), -1);
    assert_int_equal(tsr_kvpool_grow(p, 1, 113), -1);
    assert_int_equal(tsr_kvpool_held(p, 1), 0);
    assert_int_equal(tsr_kvpool_used(p), 7);
    tsr_kvpool_destroy(&p);
}

/* ---- the prefix cache ---- */

static void test_a_published_block_outlives_its_slot_and_is_shared(void **state)
{
    (void)state;
    tsr_kvpool_t *p = tsr_kvpool_new(8, 3, 128);
    uint64_t keys[3] = {11, 22, 33};
    assert_int_equal(tsr_kvpool_grow(p, 0, 40), 0);        /* 3 blocks */
    assert_int_equal(tsr_kvpool_publish(p, 0, 0, keys[0]), 0);
    assert_int_equal(tsr_kvpool_publish(p, 0, 1, keys[1]), 0);
    assert_int_equal(tsr_kvpool_publish(p, 0, 3, 44), -1);  /* not held */
    assert_int_equal(tsr_kvpool_match(p, keys, 3), 2);
    int32_t b0 = tsr_kvpool_table(p, 0)[0], b1 = tsr_kvpool_table(p, 0)[1];
    /* another slot shares them while the first still holds them */
    assert_int_equal(tsr_kvpool_attach(p, 1, keys, 2), 0);
    assert_int_equal(tsr_kvpool_table(p, 1)[0], b0);
    assert_int_equal(tsr_kvpool_table(p, 1)[1], b1);
    assert_int_equal(tsr_kvpool_used(p), 3);
    tsr_kvpool_release(p, 0);              /* the private third block is free again */
    assert_int_equal(tsr_kvpool_used(p), 2);
    assert_int_equal(tsr_kvpool_cached(p), 0);
    tsr_kvpool_release(p, 1);              /* now held by none: cached */
    assert_int_equal(tsr_kvpool_used(p), 0);
    assert_int_equal(tsr_kvpool_cached(p), 2);
    assert_int_equal(tsr_kvpool_match(p, keys, 3), 2);
    /* a slot that holds blocks, a key not published: nothing attached */
    assert_int_equal(tsr_kvpool_grow(p, 2, 1), 0);
    assert_int_equal(tsr_kvpool_attach(p, 2, keys, 1), -1);
    assert_int_equal(tsr_kvpool_attach(p, 1, keys, 3), -1);
    assert_int_equal(tsr_kvpool_held(p, 1), 0);
    assert_int_equal(tsr_kvpool_cached(p), 2);
    /* attaching takes them out of the cache */
    assert_int_equal(tsr_kvpool_attach(p, 1, keys, 2), 0);
    assert_int_equal(tsr_kvpool_cached(p), 0);
    assert_int_equal(tsr_kvpool_used(p), 3);
    tsr_kvpool_destroy(&p);
}

static void test_a_key_published_twice_stays_with_the_first_block(void **state)
{
    (void)state;
    tsr_kvpool_t *p = tsr_kvpool_new(4, 2, 64);
    uint64_t k = 99;
    assert_int_equal(tsr_kvpool_grow(p, 0, 16), 0);
    assert_int_equal(tsr_kvpool_grow(p, 1, 16), 0);
    assert_int_equal(tsr_kvpool_publish(p, 0, 0, k), 0);
    assert_int_equal(tsr_kvpool_publish(p, 1, 0, k), 0);   /* the same prefix, computed twice */
    tsr_kvpool_release(p, 1);
    assert_int_equal(tsr_kvpool_cached(p), 0);             /* the second stays private: freed */
    tsr_kvpool_release(p, 0);
    assert_int_equal(tsr_kvpool_cached(p), 1);
    assert_int_equal(tsr_kvpool_attach(p, 1, &k, 1), 0);
    tsr_kvpool_destroy(&p);
}

static void test_cached_blocks_are_evicted_only_for_room_oldest_and_deepest_first(void **state)
{
    (void)state;
    tsr_kvpool_t *p = tsr_kvpool_new(6, 2, 96);
    uint64_t a[2] = {1, 2}, b[2] = {3, 4};
    assert_int_equal(tsr_kvpool_grow(p, 0, 32), 0);
    tsr_kvpool_publish(p, 0, 0, a[0]);
    tsr_kvpool_publish(p, 0, 1, a[1]);
    tsr_kvpool_release(p, 0);              /* chain a cached first */
    assert_int_equal(tsr_kvpool_grow(p, 0, 32), 0);
    tsr_kvpool_publish(p, 0, 0, b[0]);
    tsr_kvpool_publish(p, 0, 1, b[1]);
    tsr_kvpool_release(p, 0);              /* then chain b */
    assert_int_equal(tsr_kvpool_cached(p), 4);
    /* two free blocks are taken before any cached one */
    assert_int_equal(tsr_kvpool_grow(p, 1, 32), 0);
    assert_int_equal(tsr_kvpool_cached(p), 4);
    assert_int_equal(tsr_kvpool_evictions(p), 0);
    /* the next one evicts a's deepest block: a keeps its first */
    assert_int_equal(tsr_kvpool_grow(p, 1, 48), 0);
    assert_int_equal(tsr_kvpool_evictions(p), 1);
    assert_int_equal(tsr_kvpool_match(p, a, 2), 1);
    assert_int_equal(tsr_kvpool_match(p, b, 2), 2);
    /* cached and free together bound a grow */
    assert_int_equal(tsr_kvpool_grow(p, 0, 64), -1);     /* 4 blocks: 3 cached, none free */
    assert_int_equal(tsr_kvpool_held(p, 0), 0);
    assert_int_equal(tsr_kvpool_grow(p, 1, 80), 0);
    assert_int_equal(tsr_kvpool_cached(p), 1);
    assert_int_equal(tsr_kvpool_match(p, a, 2), 0);
    assert_int_equal(tsr_kvpool_match(p, b, 2), 1);
    tsr_kvpool_destroy(&p);
}

/* Grows, releases, publishes and attaches at random on two pools with the
 * same history: the same tables and answers; a third pool with another
 * history, reset, then behaves as a fresh one. */
static void cache_script(tsr_kvpool_t **pools, int n, uint32_t seed, int rounds)
{
    enum { SLOTS = 5, LEN = 160 };
    for (int r = 0; r < rounds; r++) {
        int slot = rng_range(&seed, 0, SLOTS - 1), op = rng_range(&seed, 0, 5);
        uint64_t keys[10];
        int chain = rng_range(&seed, 0, 3), nk = rng_range(&seed, 1, 10);
        for (int k = 0; k < nk; k++) keys[k] = (uint64_t)chain * 100 + (uint64_t)k + 1;
        int len = rng_range(&seed, 1, LEN);
        for (int i = 0; i < n; i++) {
            tsr_kvpool_t *p = pools[i];
            int rc = 0;
            if (op == 0) {
                tsr_kvpool_release(p, slot);
            } else if (op == 1) {
                int m = tsr_kvpool_held(p, slot) == 0 ? tsr_kvpool_match(p, keys, nk) : 0;
                rc = m ? tsr_kvpool_attach(p, slot, keys, m) : 0;
            } else if (op == 2) {
                for (int k = 0; k < tsr_kvpool_held(p, slot) && k < nk; k++)
                    tsr_kvpool_publish(p, slot, k, keys[k]);
            } else {
                rc = tsr_kvpool_grow(p, slot, len);
            }
            (void)rc;
        }
        for (int i = 1; i < n; i++) {
            assert_int_equal(tsr_kvpool_used(pools[i]), tsr_kvpool_used(pools[0]));
            assert_int_equal(tsr_kvpool_cached(pools[i]), tsr_kvpool_cached(pools[0]));
            for (int s = 0; s < SLOTS; s++) {
                assert_int_equal(tsr_kvpool_held(pools[i], s), tsr_kvpool_held(pools[0], s));
                assert_memory_equal(tsr_kvpool_table(pools[i], s), tsr_kvpool_table(pools[0], s),
                                    (size_t)tsr_kvpool_held(pools[0], s) * sizeof(int32_t));
            }
        }
        /* no block is lost or held twice by one slot; used + cached + free = total */
        for (int i = 0; i < n; i++) {
            int held = 0;
            int total = tsr_kvpool_total(pools[i]);
            bool *seen = calloc((size_t)total, 1);
            for (int s = 0; s < SLOTS; s++) {
                memset(seen, 0, (size_t)total);
                for (int k = 0; k < tsr_kvpool_held(pools[i], s); k++) {
                    int32_t b = tsr_kvpool_table(pools[i], s)[k];
                    assert_true(b >= 0 && b < total);
                    assert_false(seen[b]);
                    seen[b] = true;
                    held++;
                }
            }
            free(seen);
            assert_true(tsr_kvpool_used(pools[i]) <= held);
            assert_true(tsr_kvpool_used(pools[i]) + tsr_kvpool_cached(pools[i]) <= total);
        }
    }
}

static void test_the_cache_is_the_same_on_every_rank_and_a_reset_makes_a_fresh_pool(void **state)
{
    (void)state;
    tsr_kvpool_t *a = tsr_kvpool_new(30, 5, 160), *b = tsr_kvpool_new(30, 5, 160),
                 *c = tsr_kvpool_new(30, 5, 160);
    tsr_kvpool_t *two[2] = {a, b};
    cache_script(two, 2, 4242, 3000);
    cache_script(&c, 1, 99, 500);              /* another history */
    tsr_kvpool_reset(a);
    tsr_kvpool_reset(c);
    tsr_kvpool_t *fresh = tsr_kvpool_new(30, 5, 160);
    tsr_kvpool_t *three[3] = {fresh, a, c};
    assert_int_equal(tsr_kvpool_cached(a), 0);
    assert_int_equal(tsr_kvpool_used(a), 0);
    assert_int_equal(tsr_kvpool_evictions(a), 0);
    cache_script(three, 3, 7, 2000);
    assert_true(tsr_kvpool_evictions(fresh) > 0);   /* the script did reach eviction */
    tsr_kvpool_destroy(&a);
    tsr_kvpool_destroy(&b);
    tsr_kvpool_destroy(&c);
    tsr_kvpool_destroy(&fresh);
}

static void test_siphash_gives_the_published_vector(void **state)
{
    (void)state;
    uint8_t key[16], msg[15];
    for (int i = 0; i < 16; i++) key[i] = (uint8_t)i;
    for (int i = 0; i < 15; i++) msg[i] = (uint8_t)i;
    /* SipHash-2-4's reference vectors: the empty message and 00..0e */
    assert_int_equal(tsr_siphash(key, msg, 0), 0x726fdb47dd0e0e31ULL);
    assert_int_equal(tsr_siphash(key, msg, 15), 0xa129ca6149be45e5ULL);
}

static void test_prefix_keys_chain_and_differ_under_another_secret(void **state)
{
    (void)state;
    uint8_t s1[16] = "deployment one.", s2[16] = "deployment two.";
    int32_t t[50];
    for (int i = 0; i < 50; i++) t[i] = 1000 + i;
    uint64_t k1[4], k2[4], k3[4];
    assert_int_equal(tsr_prefix_keys(s1, t, 50, k1), 3);     /* full blocks only */
    assert_int_equal(tsr_prefix_keys(s1, t, 15, k3), 0);
    assert_int_equal(tsr_prefix_keys(s2, t, 50, k2), 3);
    for (int i = 0; i < 3; i++) {
        assert_true(k1[i] != 0);
        assert_true(k1[i] != k2[i]);     /* another deployment, model, type or layout */
    }
    assert_int_equal(k1[1], tsr_prefix_key(s1, k1[0], t + 16));
    /* a token changed in the first block changes every later key; one in
     * the second block leaves the first */
    t[3]++;
    assert_int_equal(tsr_prefix_keys(s1, t, 50, k3), 3);
    for (int i = 0; i < 3; i++) assert_true(k3[i] != k1[i]);
    t[3]--;
    t[20]++;
    tsr_prefix_keys(s1, t, 50, k3);
    assert_int_equal(k3[0], k1[0]);
    assert_true(k3[1] != k1[1] && k3[2] != k1[2]);
    /* the same block of tokens after another parent is another key */
    assert_true(tsr_prefix_key(s1, 0, t + 16) != k3[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_grow_takes_ceil_n_over_16_blocks),
        cmocka_unit_test(test_grow_within_held_blocks_takes_none),
        cmocka_unit_test(test_grow_that_does_not_fit_takes_nothing_and_fails),
        cmocka_unit_test(test_release_returns_every_block),
        cmocka_unit_test(test_used_and_total_count_blocks),
        cmocka_unit_test(test_sizes_that_are_not_positive_give_no_pool),
        cmocka_unit_test(test_same_operations_give_identical_tables_on_every_rank),
        cmocka_unit_test(test_random_rounds_lose_and_duplicate_no_block),
        cmocka_unit_test(test_grow_beyond_max_seq_len_fails),
        cmocka_unit_test(test_a_published_block_outlives_its_slot_and_is_shared),
        cmocka_unit_test(test_a_key_published_twice_stays_with_the_first_block),
        cmocka_unit_test(test_cached_blocks_are_evicted_only_for_room_oldest_and_deepest_first),
        cmocka_unit_test(test_the_cache_is_the_same_on_every_rank_and_a_reset_makes_a_fresh_pool),
        cmocka_unit_test(test_siphash_gives_the_published_vector),
        cmocka_unit_test(test_prefix_keys_chain_and_differ_under_another_secret),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
