#include "worker/kvpool.h"

#include <stdlib.h>

struct tsr_kvpool {
    int n_blocks, max_slots, max_seq_len, max_blocks_per_slot;
    int32_t *free_list;         /* stack of free block ids */
    int n_free;
    int32_t *tables;            /* [max_slots][max_blocks_per_slot] */
    int *held;                  /* [max_slots] */
};

tsr_kvpool_t *tsr_kvpool_new(int n_blocks, int max_slots, int max_seq_len)
{
    if (n_blocks < 1 || max_slots < 1 || max_seq_len < 1) return NULL;
    tsr_kvpool_t *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_blocks = n_blocks;
    p->max_slots = max_slots;
    p->max_seq_len = max_seq_len;
    p->max_blocks_per_slot = tsr_kv_blocks_for(max_seq_len);
    p->free_list = malloc((size_t)n_blocks * sizeof *p->free_list);
    p->tables = malloc((size_t)max_slots * p->max_blocks_per_slot * sizeof *p->tables);
    p->held = calloc((size_t)max_slots, sizeof *p->held);
    if (!p->free_list || !p->tables || !p->held) {
        tsr_kvpool_destroy(&p);
        return NULL;
    }
    /* Block 0 on top: the first sequence gets the lowest ids. */
    for (int i = 0; i < n_blocks; i++) p->free_list[i] = n_blocks - 1 - i;
    p->n_free = n_blocks;
    return p;
}

void tsr_kvpool_destroy(tsr_kvpool_t **p_p)
{
    if (!p_p || !*p_p) return;
    tsr_kvpool_t *p = *p_p;
    free(p->free_list);
    free(p->tables);
    free(p->held);
    free(p);
    *p_p = NULL;
}

int tsr_kvpool_grow(tsr_kvpool_t *p, int slot, int n_pos)
{
    /* Positions, not blocks: the last block may have room past max_seq_len. */
    if (slot < 0 || slot >= p->max_slots || n_pos < 0 || n_pos > p->max_seq_len) return -1;
    int need = tsr_kv_blocks_for(n_pos);
    int more = need - p->held[slot];
    if (more <= 0) return 0;
    if (more > p->n_free) return -1;
    int32_t *t = p->tables + (size_t)slot * p->max_blocks_per_slot;
    while (p->held[slot] < need) t[p->held[slot]++] = p->free_list[--p->n_free];
    return 0;
}

void tsr_kvpool_release(tsr_kvpool_t *p, int slot)
{
    if (slot < 0 || slot >= p->max_slots) return;
    int32_t *t = p->tables + (size_t)slot * p->max_blocks_per_slot;
    /* Back in reverse, so a slot that grows again gets the same ids. */
    while (p->held[slot] > 0) p->free_list[p->n_free++] = t[--p->held[slot]];
}

const int32_t *tsr_kvpool_table(const tsr_kvpool_t *p, int slot)
{
    return p->tables + (size_t)slot * p->max_blocks_per_slot;
}

int tsr_kvpool_held(const tsr_kvpool_t *p, int slot)
{
    return slot >= 0 && slot < p->max_slots ? p->held[slot] : 0;
}

int tsr_kvpool_used(const tsr_kvpool_t *p) { return p->n_blocks - p->n_free; }
int tsr_kvpool_total(const tsr_kvpool_t *p) { return p->n_blocks; }
