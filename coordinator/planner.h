/* planner.h: a pure function from (deployments, workers, current placement)
 * to the desired placement.  It performs no I/O and keeps no state; the
 * reconciler is the only thing that acts on its result.
 *
 * Rules, in order of priority:
 *  1. every piece (deployment, replica, stage, tp rank) is placed at most once
 *     and every worker holds at most one piece;
 *  2. a piece whose current worker is still eligible, of the right device kind,
 *     and whose layout (tp size, pp size, layer range) is unchanged stays put:
 *     the fewest possible moves;
 *  3. new pieces go to eligible idle workers of the deployment's device kind;
 *     a TP group shares one node when some node has room for it, and one
 *     NVLink domain of that node when one has room (the tightest); its ranks
 *     take distinct GPUs when there is a choice (workers sharing a GPU cannot
 *     share an NCCL communicator): a node and a domain with a free GPU per
 *     rank come first, and a distinct GPU before keeping to the domain; the stages
 *     of a replica go to different nodes when there is a choice;
 *  4. a deployment that has no piece placed yet and cannot be placed whole
 *     gets nothing (it waits, holding no workers); one that is partly placed
 *     is filled as far as workers allow.  Either way short_by says how many
 *     more workers of its device kind it needs.
 * Deployments are served in file order; ties are broken by node name, then
 * worker name, so the result is deterministic. */
#ifndef TSR_PLANNER_H
#define TSR_PLANNER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "../common/deploy.h"
#include "../common/piece.h"

typedef struct {
    const char *name;
    const char *node;
    tsr_device_t device;
    uint64_t memory;              /* device memory in bytes (0: unknown, fits anything) */
    const char *domain;           /* its NVLink domain on the node (NULL or "": none) */
    const char *gpu;              /* its GPU on the node, the PCI bus id (NULL or "": not
                                     known); workers may share one */
    bool eligible;                /* alive and not drained */
    tsr_piece_key_t current;      /* what it holds; current.deployment "" when idle */
} tsr_plan_worker_t;

typedef struct {
    int deployment;               /* index into cfg->deployments */
    int replica, stage, tp;
    int layer_begin, layer_end;   /* [begin, end) */
    int worker;                   /* index into the workers array, -1 unplaced */
    bool kept;                    /* the worker already held exactly this piece */
} tsr_piece_t;

typedef struct {
    int n_pieces;                 /* replicas * pipeline * tensor */
    int placed;
    int short_by;                 /* more workers of `device` needed; 0 if none */
    tsr_device_t device;
    /* When memory is what is short: the stage whose pieces lack a worker
     * with room (mem_stage, -1 when memory is not the cause), the bytes one
     * of its pieces needs, and the roomiest eligible worker of the kind. */
    int mem_stage;
    uint64_t mem_need, mem_largest;
    int mem_largest_worker;       /* index into the workers array, -1 none */
} tsr_plan_deployment_t;

typedef struct {
    tsr_piece_t *pieces;          /* ordered by deployment, replica, stage, tp */
    size_t n_pieces;
    tsr_plan_deployment_t *deps;  /* one per cfg deployment, same order */
    size_t n_deps;
    int *worker_piece;            /* [worker index] -> index into pieces, -1 none */
    size_t n_workers;
} tsr_plan_t;

/* Computes the desired plan.  layers[i] is the layer count of deployment i's
 * model (from its config.json).  Returns 0 and *out (caller owns; free with
 * tsr_plan_destroy), or -1 with a message in err (only for invalid input such
 * as a non-positive layer count or more stages than layers). */
int tsr_plan_compute(const tsr_config_t *cfg, const int *layers,
                     const tsr_plan_worker_t *workers, size_t n_workers,
                     tsr_plan_t **out, char *err, size_t errlen);

/* The same, knowing memory: need[i] (NULL: no check for deployment i; need
 * itself may be NULL) holds the device bytes one piece of each of
 * deployment i's stages needs (weights plus KV budget plus reserve:
 * tsr_piece_memory), and a piece goes only to a worker whose memory is 0
 * (unknown) or at least that.  A deployment that cannot be placed for lack
 * of memory says so in tsr_plan_shortage ("stage 0 needs 21.3 GiB per
 * device; the largest cuda worker, gpu03-cuda1, has 15.8 GiB"). */
int tsr_plan_compute_mem(const tsr_config_t *cfg, const int *layers,
                         const uint64_t *const *need, const tsr_plan_worker_t *workers,
                         size_t n_workers, tsr_plan_t **out, char *err, size_t errlen);

/* Frees a plan and sets *self_p to NULL.  Safe on NULL. */
void tsr_plan_destroy(tsr_plan_t **self_p);

/* The piece of worker index w in plan p, or NULL when it gets none. */
const tsr_piece_t *tsr_plan_piece_of(const tsr_plan_t *p, int w);

/* "needs 3 more cuda workers" style text for deployment i, or "" when
 * nothing is short; when memory is the cause, that with the numbers.
 * Writes into buf and returns it.  workers: the array the plan was made
 * from (for the roomiest worker's name; may be NULL). */
const char *tsr_plan_shortage(const tsr_plan_t *p, size_t i, char *buf, size_t len);
const char *tsr_plan_shortage_of(const tsr_plan_t *p, size_t i, const tsr_plan_worker_t *workers,
                                 char *buf, size_t len);

/* The same text for a count and a device kind ("" when short_by <= 0). */
const char *tsr_shortage_text(int short_by, tsr_device_t device, char *buf, size_t len);

#endif
