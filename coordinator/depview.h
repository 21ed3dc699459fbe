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
} tsr_dep_summary_t;

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
