/* reshard.h: a reload's new cut built beside the running one (reshard.c).  When a
 * reload changes a serving deployment's tensor or pipeline and idle workers (or the
 * workers of old replicas let go, while another serves) can hold one replica of the
 * new cut or more, reload.c keeps the old cut in force and records the new one in the
 * deployment's `reshard` state; here the idle workers are given those replicas' pieces
 * as standbys (they load the weights, serve nothing), and once every one is loaded
 * the cut changes and one plan swaps them in: the old replicas serve until then, the
 * new ones are rewired, not loaded, at the switch, and the rest of the new cut's
 * replicas load on the workers the old ones free while those serve. */
#ifndef TSR_RESHARD_H
#define TSR_RESHARD_H

#include <stdbool.h>
#include <stdint.h>
#include "state.h"

/* How a deployment that serves `replicas` replicas of `per_old` pieces each changes to
 * `want` replicas of `per_new` pieces each with `idle` idle workers of its kind:
 * *beside new replicas are built on idle workers while the old cut serves, after
 * *drop old replicas are let go to make room for the first (the others serve
 * meanwhile); the other want - *beside load, once the new cut is swapped in, on the
 * workers the old cut frees, while those serve.  False when not one new replica can
 * be built while an old one serves (a single replica, too few idle workers): the
 * cut then applies at once. */
bool tsr_reshard_choose(int replicas, int per_old, int want, int per_new, int idle,
                        int *beside, int *drop);
/* Moves every change of cut under way one step: places and sends the standbys,
 * switches when all are loaded, ends when the plan has given them their pieces.
 * When the standbys cannot be placed or one is lost (a death, a drain, a failure
 * to load, a plan that gave it another piece), the new cut applies at once, as
 * without idle workers.  Returns when it next needs to run (0: nothing pending). */
int64_t tsr_reshard_tick(tsr_coord_t *c, int64_t now_ms);
/* Idle workers of d's kind, and those let go to make room for d's new cut and held for
 * its standbys. */
int tsr_reshard_free_for(const tsr_coord_t *c, const tsr_deployment_t *d);
/* A Ready, Progress or Failed from worker w: true when it is about one of the
 * standby pieces (it is then taken here), false for the loop to handle. */
bool tsr_reshard_message(tsr_coord_t *c, tsr_worker_t *w, const tsr_env_t *env);

#endif
