/* loop.h: the coordinator's event loop (loop.c): it makes the coordinator, reads its
 * sockets and runs its tick.  main.c owns the poll, the signals and systemd;
 * everything here is callable from tests. */
#ifndef TSR_LOOP_H
#define TSR_LOOP_H

#include <stddef.h>
#include <stdint.h>
#include "state.h"

/* Loads the config and binds both endpoints.  adopt_grace_ms < 0 means one
 * worker timeout.  Returns NULL with a message in err; caller owns the result. */
tsr_coord_t *tsr_coord_new(const char *config_path, int adopt_grace_ms, char *err, size_t errlen);
/* Frees the coordinator (each layer frees its part) and sets *self_p to NULL. */
void tsr_coord_destroy(tsr_coord_t **self_p);
/* Reads every waiting message on both sockets (at most `budget` each). */
void tsr_coord_drain_sockets(tsr_coord_t *c, int budget);
/* Periodic work: health scan, planning when dirty.  Returns the ms until the
 * next tick is due. */
int tsr_coord_tick(tsr_coord_t *c, int64_t now_ms);

#endif
