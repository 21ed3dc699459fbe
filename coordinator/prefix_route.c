#include "prefix_route.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/wire.h"    /* TSR_NAME_MAX */

#define DEFAULT_BLOCKS 4096     /* a replica whose pool size is not known yet */
#define MAX_BLOCKS (1 << 20)

/* One replica's index: a hash map of key -> stamp, and a FIFO of (key,
 * stamp) in the order they were added; a FIFO entry whose stamp is not the
 * map's is stale (the key was added again since) and is skipped. */
typedef struct {
    uint64_t key, stamp;
} entry_t;

typedef struct {
    char dep[TSR_NAME_MAX + 1];
    int replica;
    uint64_t epoch, evictions;
    entry_t *map;               /* key 0: empty */
    uint32_t map_mask;
    int live, cap;              /* keys held, and at most */
    entry_t *fifo;
    uint32_t fifo_cap, head, count;
    uint64_t next_stamp;
} index_t;

struct tsr_prefix_route {
    index_t *v;
    size_t n, alloc;
};

static uint32_t home(const index_t *x, uint64_t key)
{
    key ^= key >> 31;
    key *= 0x9e3779b97f4a7c15ULL;
    return (uint32_t)(key >> 32) & x->map_mask;
}

static entry_t *find(const index_t *x, uint64_t key)
{
    if (!x->map) return NULL;
    for (uint32_t i = home(x, key);; i = (i + 1) & x->map_mask) {
        if (!x->map[i].key) return NULL;
        if (x->map[i].key == key) return &x->map[i];
    }
}

static void del(index_t *x, entry_t *e)
{
    uint32_t i = (uint32_t)(e - x->map);
    for (uint32_t j = (i + 1) & x->map_mask; x->map[j].key; j = (j + 1) & x->map_mask) {
        uint32_t h = home(x, x->map[j].key);
        if (((j - h) & x->map_mask) >= ((j - i) & x->map_mask)) {
            x->map[i] = x->map[j];
            i = j;
        }
    }
    x->map[i].key = 0;
    x->live--;
}

static void clear(index_t *x)
{
    free(x->map);
    free(x->fifo);
    x->map = NULL;
    x->fifo = NULL;
    x->map_mask = 0;
    x->live = 0;
    x->fifo_cap = x->head = x->count = 0;
}

/* Takes the FIFO's oldest entry out; true when it was live (its key goes). */
static bool pop_front(index_t *x)
{
    entry_t f = x->fifo[x->head];
    x->head = (x->head + 1) % x->fifo_cap;
    x->count--;
    entry_t *e = find(x, f.key);
    if (!e || e->stamp != f.stamp) return false;
    del(x, e);
    return true;
}

/* Drops the oldest live key (stale FIFO entries on the way go too). */
static bool drop_oldest(index_t *x)
{
    while (x->count > 0)
        if (pop_front(x)) return true;
    return false;
}

/* Sizes x for cap keys (the map at most half full, the FIFO twice cap). */
static bool make_room(index_t *x, int cap)
{
    if (x->map) return true;
    clear(x);
    uint32_t m = 16;
    while (m < 2u * (uint32_t)cap) m <<= 1;
    x->map = calloc(m, sizeof *x->map);
    x->fifo = malloc(2u * (size_t)cap * sizeof *x->fifo);
    if (!x->map || !x->fifo) {
        clear(x);
        return false;
    }
    x->map_mask = m - 1;
    x->fifo_cap = 2u * (uint32_t)cap;
    x->cap = cap;
    return true;
}

static index_t *index_of(tsr_prefix_route_t *p, const char *dep, int r, bool make)
{
    for (size_t i = 0; i < p->n; i++)
        if (p->v[i].replica == r && !strcmp(p->v[i].dep, dep)) return &p->v[i];
    if (!make) return NULL;
    if (p->n == p->alloc) {
        size_t a = p->alloc ? 2 * p->alloc : 8;
        index_t *v = realloc(p->v, a * sizeof *v);
        if (!v) return NULL;
        p->v = v;
        p->alloc = a;
    }
    index_t *x = &p->v[p->n++];
    memset(x, 0, sizeof *x);
    strncpy(x->dep, dep, TSR_NAME_MAX);
    x->replica = r;
    return x;
}

/* What the replica says now: another epoch empties it, another pool size
 * resizes it, evictions drop as many of the oldest keys. */
static void apply(index_t *x, const tsr_prefix_replica_t *rep)
{
    /* a size not reported (0: a worker just registered or marked) keeps the index's */
    int cap = rep->pool_blocks > 0 ? rep->pool_blocks : x->cap > 0 ? x->cap : DEFAULT_BLOCKS;
    if (cap > MAX_BLOCKS) cap = MAX_BLOCKS;
    if (x->epoch != rep->epoch || x->cap != cap) {
        clear(x);
        x->epoch = rep->epoch;
        x->evictions = rep->evictions;
        x->cap = cap;
    }
    if (rep->evictions < x->evictions) x->evictions = rep->evictions;   /* a new process */
    for (uint64_t k = x->evictions; k < rep->evictions && x->live > 0; k++) drop_oldest(x);
    x->evictions = rep->evictions;
}

tsr_prefix_route_t *tsr_prefix_route_new(void) { return calloc(1, sizeof(tsr_prefix_route_t)); }

void tsr_prefix_route_free(tsr_prefix_route_t **p_p)
{
    if (!p_p || !*p_p) return;
    for (size_t i = 0; i < (*p_p)->n; i++) clear(&(*p_p)->v[i]);
    free((*p_p)->v);
    free(*p_p);
    *p_p = NULL;
}

int tsr_prefix_route_match(tsr_prefix_route_t *p, const char *dep, int r,
                           const tsr_prefix_replica_t *rep, const uint64_t *keys, int n)
{
    index_t *x = index_of(p, dep, r, false);
    if (!x) return 0;
    apply(x, rep);
    int k = 0;
    while (k < n && find(x, keys[k])) k++;
    return k;
}

void tsr_prefix_route_add(tsr_prefix_route_t *p, const char *dep, int r,
                          const tsr_prefix_replica_t *rep, const uint64_t *keys, int n)
{
    index_t *x = index_of(p, dep, r, true);
    if (!x) return;
    apply(x, rep);
    if (!make_room(x, x->cap)) return;
    /* deepest first, so a prefix's first block is its newest: the replica evicts a
     * chain from its end, and so does this index */
    for (int i = n; i-- > 0;) {
        if (!keys[i]) continue;
        if (x->count == x->fifo_cap) pop_front(x);  /* mostly stale: the oldest goes */
        entry_t *e = find(x, keys[i]);
        if (!e) {
            if (x->live >= x->cap) drop_oldest(x);
            uint32_t j = home(x, keys[i]);
            while (x->map[j].key) j = (j + 1) & x->map_mask;
            e = &x->map[j];
            e->key = keys[i];
            x->live++;
        }
        e->stamp = ++x->next_stamp;
        x->fifo[(x->head + x->count++) % x->fifo_cap] = *e;
    }
}

int tsr_prefix_route_size(const tsr_prefix_route_t *p, const char *dep, int r)
{
    for (size_t i = 0; i < p->n; i++)
        if (p->v[i].replica == r && !strcmp(p->v[i].dep, dep)) return p->v[i].live;
    return 0;
}
