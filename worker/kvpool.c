#include "worker/kvpool.h"

#include <stdlib.h>

struct tsr_kvpool {
    int n_blocks, max_slots, max_seq_len, max_blocks_per_slot;
    int32_t *free_list;         /* stack of free block ids */
    int n_free;
    int32_t *tables;            /* [max_slots][max_blocks_per_slot] */
    int *held;                  /* [max_slots] */
    /* The prefix cache. */
    int32_t *refs;              /* [n_blocks] slots holding each block */
    uint64_t *key;              /* [n_blocks] 0: not published */
    int32_t *lru_prev, *lru_next;   /* [n_blocks] the cached, unheld blocks */
    int lru_head, lru_tail, n_cached;   /* head: released longest ago */
    int32_t *map;               /* [map_cap] open addressing by key: block id, -1 empty */
    uint32_t map_mask;
    uint64_t evictions;
};

static uint32_t slot_of(const tsr_kvpool_t *p, uint64_t key)
{
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    return (uint32_t)key & p->map_mask;
}

static int map_find(const tsr_kvpool_t *p, uint64_t key)
{
    for (uint32_t i = slot_of(p, key);; i = (i + 1) & p->map_mask) {
        int32_t b = p->map[i];
        if (b < 0) return -1;
        if (p->key[b] == key) return b;
    }
}

static void map_put(tsr_kvpool_t *p, int32_t b)
{
    uint32_t i = slot_of(p, p->key[b]);
    while (p->map[i] >= 0) i = (i + 1) & p->map_mask;
    p->map[i] = b;
}

/* Removes block b's entry, shifting back the ones probed past it. */
static void map_del(tsr_kvpool_t *p, int32_t b)
{
    uint32_t i = slot_of(p, p->key[b]);
    while (p->map[i] != b) i = (i + 1) & p->map_mask;
    for (uint32_t j = (i + 1) & p->map_mask; p->map[j] >= 0; j = (j + 1) & p->map_mask) {
        uint32_t home = slot_of(p, p->key[p->map[j]]);
        /* j's entry may move to i when its home is not in (i, j]. */
        if (((j - home) & p->map_mask) >= ((j - i) & p->map_mask)) {
            p->map[i] = p->map[j];
            i = j;
        }
    }
    p->map[i] = -1;
}

static void lru_unlink(tsr_kvpool_t *p, int32_t b)
{
    int32_t pr = p->lru_prev[b], nx = p->lru_next[b];
    if (pr >= 0) p->lru_next[pr] = nx; else p->lru_head = nx;
    if (nx >= 0) p->lru_prev[nx] = pr; else p->lru_tail = pr;
    p->n_cached--;
}

static void lru_push(tsr_kvpool_t *p, int32_t b)
{
    p->lru_prev[b] = p->lru_tail;
    p->lru_next[b] = -1;
    if (p->lru_tail >= 0) p->lru_next[p->lru_tail] = b; else p->lru_head = b;
    p->lru_tail = b;
    p->n_cached++;
}

void tsr_kvpool_reset(tsr_kvpool_t *p)
{
    /* Block 0 on top: the first sequence gets the lowest ids. */
    for (int i = 0; i < p->n_blocks; i++) {
        p->free_list[i] = p->n_blocks - 1 - i;
        p->refs[i] = 0;
        p->key[i] = 0;
    }
    p->n_free = p->n_blocks;
    for (int s = 0; s < p->max_slots; s++) p->held[s] = 0;
    for (uint32_t i = 0; i <= p->map_mask; i++) p->map[i] = -1;
    p->lru_head = p->lru_tail = -1;
    p->n_cached = 0;
    p->evictions = 0;
}

tsr_kvpool_t *tsr_kvpool_new(int n_blocks, int max_slots, int max_seq_len)
{
    if (n_blocks < 1 || max_slots < 1 || max_seq_len < 1 || n_blocks > (1 << 29)) return NULL;
    tsr_kvpool_t *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_blocks = n_blocks;
    p->max_slots = max_slots;
    p->max_seq_len = max_seq_len;
    p->max_blocks_per_slot = tsr_kv_blocks_for(max_seq_len);
    uint32_t cap = 2;
    while (cap < 2u * (uint32_t)n_blocks) cap <<= 1;   /* at most half full */
    p->map_mask = cap - 1;
    p->free_list = malloc((size_t)n_blocks * sizeof *p->free_list);
    p->tables = malloc((size_t)max_slots * p->max_blocks_per_slot * sizeof *p->tables);
    p->held = calloc((size_t)max_slots, sizeof *p->held);
    p->refs = calloc((size_t)n_blocks, sizeof *p->refs);
    p->key = calloc((size_t)n_blocks, sizeof *p->key);
    p->lru_prev = malloc((size_t)n_blocks * sizeof *p->lru_prev);
    p->lru_next = malloc((size_t)n_blocks * sizeof *p->lru_next);
    p->map = malloc((size_t)cap * sizeof *p->map);
    if (!p->free_list || !p->tables || !p->held || !p->refs || !p->key || !p->lru_prev ||
        !p->lru_next || !p->map) {
        tsr_kvpool_destroy(&p);
        return NULL;
    }
    tsr_kvpool_reset(p);
    return p;
}

void tsr_kvpool_destroy(tsr_kvpool_t **p_p)
{
    if (!p_p || !*p_p) return;
    tsr_kvpool_t *p = *p_p;
    free(p->free_list);
    free(p->tables);
    free(p->held);
    free(p->refs);
    free(p->key);
    free(p->lru_prev);
    free(p->lru_next);
    free(p->map);
    free(p);
    *p_p = NULL;
}

/* A block for a growing slot: a free one, else the cached block released
 * longest ago, its key dropped. */
static int32_t take_block(tsr_kvpool_t *p)
{
    if (p->n_free > 0) return p->free_list[--p->n_free];
    int32_t b = p->lru_head;
    lru_unlink(p, b);
    map_del(p, b);
    p->key[b] = 0;
    p->evictions++;
    return b;
}

int tsr_kvpool_grow(tsr_kvpool_t *p, int slot, int n_pos)
{
    /* Positions, not blocks: the last block may have room past max_seq_len. */
    if (slot < 0 || slot >= p->max_slots || n_pos < 0 || n_pos > p->max_seq_len) return -1;
    int need = tsr_kv_blocks_for(n_pos);
    int more = need - p->held[slot];
    if (more <= 0) return 0;
    if (more > p->n_free + p->n_cached) return -1;
    int32_t *t = p->tables + (size_t)slot * p->max_blocks_per_slot;
    while (p->held[slot] < need) {
        int32_t b = take_block(p);
        p->refs[b] = 1;
        t[p->held[slot]++] = b;
    }
    return 0;
}

void tsr_kvpool_release(tsr_kvpool_t *p, int slot)
{
    if (slot < 0 || slot >= p->max_slots) return;
    int32_t *t = p->tables + (size_t)slot * p->max_blocks_per_slot;
    /* Back in reverse: a slot that grows again gets the same free ids, and
     * of a cached chain the deepest blocks are evicted first. */
    while (p->held[slot] > 0) {
        int32_t b = t[--p->held[slot]];
        if (--p->refs[b] > 0) continue;
        if (p->key[b]) lru_push(p, b);
        else p->free_list[p->n_free++] = b;
    }
}

int tsr_kvpool_match(const tsr_kvpool_t *p, const uint64_t *keys, int n)
{
    int k = 0;
    while (k < n && keys[k] && map_find(p, keys[k]) >= 0) k++;
    return k;
}

int tsr_kvpool_match_unheld(const tsr_kvpool_t *p, const uint64_t *keys, int n)
{
    int k = 0;
    for (int i = 0; i < n; i++) {
        int32_t b = keys[i] ? map_find(p, keys[i]) : -1;
        k += b >= 0 && p->refs[b] == 0;
    }
    return k;
}

int tsr_kvpool_attach(tsr_kvpool_t *p, int slot, const uint64_t *keys, int n)
{
    if (slot < 0 || slot >= p->max_slots || p->held[slot] != 0 || n < 0 ||
        n > p->max_blocks_per_slot || (long)n * TSR_KV_BLOCK > p->max_seq_len)
        return -1;
    if (tsr_kvpool_match(p, keys, n) != n) return -1;
    int32_t *t = p->tables + (size_t)slot * p->max_blocks_per_slot;
    for (int i = 0; i < n; i++) {
        int32_t b = map_find(p, keys[i]);
        if (p->refs[b]++ == 0) lru_unlink(p, b);
        t[i] = b;
    }
    p->held[slot] = n;
    return 0;
}

int tsr_kvpool_publish(tsr_kvpool_t *p, int slot, int index, uint64_t key)
{
    if (slot < 0 || slot >= p->max_slots || index < 0 || index >= p->held[slot] || !key)
        return -1;
    int32_t b = p->tables[(size_t)slot * p->max_blocks_per_slot + index];
    if (p->key[b] || map_find(p, key) >= 0) return 0;
    p->key[b] = key;
    map_put(p, b);
    return 0;
}

const int32_t *tsr_kvpool_table(const tsr_kvpool_t *p, int slot)
{
    return p->tables + (size_t)slot * p->max_blocks_per_slot;
}

int tsr_kvpool_held(const tsr_kvpool_t *p, int slot)
{
    return slot >= 0 && slot < p->max_slots ? p->held[slot] : 0;
}

int tsr_kvpool_used(const tsr_kvpool_t *p) { return p->n_blocks - p->n_free - p->n_cached; }
int tsr_kvpool_cached(const tsr_kvpool_t *p) { return p->n_cached; }
int tsr_kvpool_total(const tsr_kvpool_t *p) { return p->n_blocks; }
uint64_t tsr_kvpool_evictions(const tsr_kvpool_t *p) { return p->evictions; }
