/* metrics.h: what /metrics counts, recorded as requests end (metrics.c); the
 * document is written by metrics_text.c.  Kept across reloads, by deployment name. */
#ifndef TSR_METRICS_H
#define TSR_METRICS_H

#include <stddef.h>
#include <stdint.h>
#include "common/wire.h"

/* A Prometheus histogram in seconds over fixed bucket bounds (metrics.c). */
#define TSR_HIST_BUCKETS 14
typedef struct {
    uint64_t le[TSR_HIST_BUCKETS];  /* observations <= each bound (not cumulative) */
    uint64_t count;
    double sum;
} tsr_hist_t;

/* What /metrics reports per deployment; kept across reloads, by name. */
typedef struct {
    char name[TSR_NAME_MAX + 1];
    uint64_t outcome[5];        /* TSR_OUTCOME_*: requests that ended so */
    uint64_t prompt_tokens, generated_tokens;
    uint64_t prompt_cached;     /* prompt tokens replicas took from their prefix caches
                                   (told with each request's first token) */
    tsr_hist_t ttft, itl, duration;
    uint64_t scale_ups, scale_downs;  /* replicas added and removed by load (autoscale.c) */
} tsr_dep_metrics_t;
enum { TSR_OUTCOME_STOP, TSR_OUTCOME_LENGTH, TSR_OUTCOME_FAILED, TSR_OUTCOME_CANCELLED,
       TSR_OUTCOME_REFUSED };


/* Every deployment's metrics, in order of first use.  Owned by whoever holds it (the
 * coordinator); freed with tsr_metrics_free. */
typedef struct {
    tsr_dep_metrics_t *v;
    size_t n;
} tsr_metrics_t;

/* The bucket bounds, in seconds, and the outcomes' names (TSR_OUTCOME_* order). */
extern const double tsr_hist_bounds[TSR_HIST_BUCKETS];
extern const char *const tsr_outcome_names[5];

/* The deployment's metrics (created on first use; NULL when out of memory). */
tsr_dep_metrics_t *tsr_metrics_of(tsr_metrics_t *m, const char *deployment);
/* Counts one request of that deployment ending as outcome ("stop", "length", "failed",
 * "cancelled", "refused"). */
void tsr_metrics_outcome(tsr_metrics_t *m, const char *deployment, const char *outcome);
void tsr_hist_observe(tsr_hist_t *h, double seconds);
/* Frees what m holds and empties it. */
void tsr_metrics_free(tsr_metrics_t *m);

#endif
