/* topology.h: the workers' NVLink domains (topology.c). */
#ifndef TSR_TOPOLOGY_H
#define TSR_TOPOLOGY_H

#include <stddef.h>
#include "registry.h"

/* Sets nvlink_domain of the n live workers ws: on each node, the GPUs that NVLinks
 * join (directly, or through a switch both reach) are one domain, named after the
 * node and its lowest bus id; a GPU without NVLink has none ("").  Out of memory
 * leaves them as they were. */
void tsr_nvlink_domains(tsr_worker_t **ws, size_t n);

#endif
