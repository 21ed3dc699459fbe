/* metrics.c: what GET /metrics reports, recorded as requests end: requests by
 * deployment and outcome, prompt and generated tokens, histograms of time to first
 * token, inter-token latency and request duration (fed by the router).  The document
 * is metrics_text.c's. */
#include "metrics.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const double tsr_hist_bounds[TSR_HIST_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                 0.1,   0.25,   0.5,   1,    2.5,   5,
                                                 10,    30};
const char *const tsr_outcome_names[5] = {"stop", "length", "failed", "cancelled", "refused"};

void tsr_hist_observe(tsr_hist_t *h, double seconds)
{
    if (!(seconds >= 0)) seconds = 0;
    for (int i = 0; i < TSR_HIST_BUCKETS; i++)
        if (seconds <= tsr_hist_bounds[i]) {
            h->le[i]++;
            break;
        }
    h->count++;
    h->sum += seconds;
}

tsr_dep_metrics_t *tsr_metrics_of(tsr_metrics_t *ms, const char *deployment)
{
    for (size_t i = 0; i < ms->n; i++)
        if (!strcmp(ms->v[i].name, deployment)) return &ms->v[i];
    tsr_dep_metrics_t *m = realloc(ms->v, (ms->n + 1) * sizeof *m);
    if (!m) return NULL;
    ms->v = m;
    m = &ms->v[ms->n++];
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s", deployment);
    return m;
}

void tsr_metrics_outcome(tsr_metrics_t *ms, const char *deployment, const char *outcome)
{
    tsr_dep_metrics_t *m = tsr_metrics_of(ms, deployment);
    for (size_t k = 0; m && k < sizeof tsr_outcome_names / sizeof tsr_outcome_names[0]; k++)
        if (!strcmp(outcome, tsr_outcome_names[k])) m->outcome[k]++;
}

void tsr_metrics_free(tsr_metrics_t *ms)
{
    free(ms->v);
    ms->v = NULL;
    ms->n = 0;
}
