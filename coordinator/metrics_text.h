/* metrics_text.h: the /metrics document (metrics_text.c). */
#ifndef TSR_METRICS_TEXT_H
#define TSR_METRICS_TEXT_H

#include <stdint.h>
#include "state.h"

/* The Prometheus text exposition of the coordinator's metrics (GET /metrics).  Caller
 * owns the string; NULL when out of memory. */
char *tsr_coord_metrics_text(const tsr_coord_t *c, int64_t now_ms);

#endif
