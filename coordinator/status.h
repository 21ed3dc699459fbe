/* status.h: the status document (status.c). */
#ifndef TSR_STATUS_H
#define TSR_STATUS_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include "state.h"

/* The status document (what `tessera status --json` prints).  Caller owns
 * the string (free()). */
char *tsr_coord_status_json(const tsr_coord_t *c, int64_t now_ms, bool workers_only);
/* A piece as status shows it ({"deployment", "replica", ...}).  Caller owns it. */
json_t *tsr_holding_json(const tsr_holding_t *h);

#endif
