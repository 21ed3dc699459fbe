/* control.h: the control API the CLI and the HTTP server talk to (control.c). */
#ifndef TSR_CONTROL_H
#define TSR_CONTROL_H

#include "reply.h"
#include "state.h"

/* Answers one control request (status, workers, reload, drain, generate, cancel,
 * deployments, metrics) from client `from`. */
void tsr_control_handle(tsr_coord_t *c, const tsr_client_t *from, tsr_env_t *env);

#endif
