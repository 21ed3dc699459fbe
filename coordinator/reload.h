/* reload.h: rereading the configuration (reload.c). */
#ifndef TSR_RELOAD_H
#define TSR_RELOAD_H

#include <stddef.h>
#include "state.h"

/* Rereads the YAML.  On any error nothing changes and -1 is returned with the
 * reason in err.  It plans nothing itself: it sets dirty. */
int tsr_coord_reload(tsr_coord_t *c, char *err, size_t errlen);

#endif
