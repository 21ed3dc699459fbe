/* depview.h: each deployment's state as a read-only view (depview.c): what status,
 * /health, /v1/models and /metrics show. */
#ifndef TSR_DEPVIEW_H
#define TSR_DEPVIEW_H

#include <stddef.h>
#include <stdint.h>
#include "state.h"

/* What status shows of one deployment. */
typedef struct {
    const char *state;          /* ready | loading | degraded | waiting | failed */
    char message[1024];
    int total, ready, placed;
    tsr_worker_t **at;          /* [tsr_dep_piece_slot()] -> holder or NULL; caller frees */
    int spanning_nodes;         /* tensor-parallel groups whose ranks sit on two or more nodes */
    int spanning_nvlink;        /* ...on one node but across NVLink domains */
} tsr_dep_summary_t;

/* Where the ranks of a tensor-parallel group sit, as its all-reduces see them:
 * within one NVLink domain (or on one node without NVLink), across NVLink
 * domains of one node (PCIe between them), or across nodes (the network). */
typedef enum { TSR_SPAN_NONE, TSR_SPAN_NVLINK, TSR_SPAN_NODES } tsr_span_t;

/* "none", "nvlink_domains" or "nodes". */
const char *tsr_span_name(tsr_span_t span);
/* The span of replica r's stage s in sum (its placed ranks only). */
tsr_span_t tsr_dep_group_span(const tsr_deployment_t *d, const tsr_dep_summary_t *sum, int r,
                              int s);

/* Index of (replica r, stage s, tp rank t) of d in tsr_dep_summary_t.at. */
int tsr_dep_piece_slot(const tsr_deployment_t *d, int r, int s, int t);
/* Summarises deployment i at now; caller frees sum->at (NULL when out of memory). */
void tsr_dep_summarise(const tsr_coord_t *c, size_t i, int64_t now, tsr_dep_summary_t *sum);
/* {"deployments": [{"name", "state", "message", "ready_replicas",
 * "replicas"}], "uptime_ms"}: what /health and /v1/models need.  Caller frees. */
char *tsr_coord_deployments_json(const tsr_coord_t *c, int64_t now_ms);
/* Deployment i's state as status shows it ("ready", "degraded", ...). */
const char *tsr_coord_dep_state(const tsr_coord_t *c, size_t i, int64_t now_ms);

#endif
