/* deptok.h: each deployment's tokenizer (deptok.c): found when the deployments'
 * states are built, read off the loop after a reload, published for the HTTP
 * threads. */
#ifndef TSR_DEPTOK_H
#define TSR_DEPTOK_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include "state.h"

/* A flag a signal handler sets: no more tokenizers are read once it is set
 * (a coordinator told to stop while it starts does not read them all first). */
void tsr_coord_stop_flag(volatile sig_atomic_t *flag);
/* Gives s its tokenizer from dir: an earlier state's (one of this configuration's
 * prev[0..n_prev), or the same deployment's before a reload in old[0..n_old) when its
 * file did not change), else read now, or (later: a reload) marked to be read off the
 * loop.  None is not an error (requests then take token ids only); a file that is
 * there but cannot be used is logged. */
void tsr_deptok_choose(tsr_dep_state_t *s, const char *dir, const tsr_dep_state_t *prev,
                       size_t n_prev, const tsr_dep_state_t *old, size_t n_old, bool later);
/* Publishes the current deployments' tokenizers for the HTTP threads (c->tokreg). */
void tsr_deptok_publish(tsr_coord_t *c);
/* Asks the loader for the tokenizers the deployments wait for, and drops the queued
 * loads no deployment waits for any more. */
void tsr_deptok_request(tsr_coord_t *c);
/* Installs the tokenizers the loader has read in the deployments waiting for them
 * (and publishes them). */
void tsr_deptok_collect(tsr_coord_t *c);

#endif
