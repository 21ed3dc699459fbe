/* prefix_route.h: which prompt prefixes each replica is likely to hold in
 * its prefix cache, for routing (router.c).
 *
 * Per (deployment, replica) a bounded index of the block keys
 * (common/prefix.h) of the prompts routed there and the sequences finished
 * there, newest last.  It forgets:
 *   - everything when the replica's leader is in another epoch (a replica's
 *     ranks start each epoch with an empty cache);
 *   - the oldest keys beyond the replica's pool size;
 *   - as many of the oldest keys as the leader reports it evicted since it
 *     was last looked at (its heartbeat's running count).
 * So it is an estimate: a key it holds may be gone (the replica then
 * computes the prefix, as without a cache), never a wrong answer. */
#ifndef TSR_PREFIX_ROUTE_H
#define TSR_PREFIX_ROUTE_H

#include <stdint.h>

typedef struct tsr_prefix_route tsr_prefix_route_t;

/* What the router knows of a replica now: its leader's epoch, its pool's
 * size in blocks (0: not reported yet) and its leader's evictions count. */
typedef struct {
    uint64_t epoch;
    int pool_blocks;
    uint64_t evictions;
} tsr_prefix_replica_t;

/* NULL when out of memory. */
tsr_prefix_route_t *tsr_prefix_route_new(void);
void tsr_prefix_route_free(tsr_prefix_route_t **p_p);

/* How many of keys[0..n) (a chain) replica r of deployment dep holds, from
 * the first.  Applies what rep says first (epoch, size, evictions). */
int tsr_prefix_route_match(tsr_prefix_route_t *p, const char *dep, int r,
                           const tsr_prefix_replica_t *rep, const uint64_t *keys, int n);
/* keys[0..n) were sent to (or finished on) replica r: the newest it holds.
 * Out of memory: remembers less. */
void tsr_prefix_route_add(tsr_prefix_route_t *p, const char *dep, int r,
                          const tsr_prefix_replica_t *rep, const uint64_t *keys, int n);
/* Keys held for replica r of dep (tests). */
int tsr_prefix_route_size(const tsr_prefix_route_t *p, const char *dep, int r);

#endif
