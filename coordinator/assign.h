/* assign.h: messages to workers (assign.c).  Every send goes through tsr_coord_send;
 * a piece's Assignment is filled here from the configuration and the registry. */
#ifndef TSR_ASSIGN_H
#define TSR_ASSIGN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "state.h"

/* Sends env to the worker at routing id rid on the workers socket; a send
 * that fails is counted (stats.sends_failed) and logged.  0 or -1. */
int tsr_coord_send(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, tsr_env_t *env);
/* Sends env to w, named, in c->epoch unless env has an epoch. */
void tsr_coord_send_to(tsr_coord_t *c, tsr_worker_t *w, tsr_env_t *env);
/* Sends the worker at rid (named name) a Reset: keep, whether to keep its piece and
 * register again with it. */
void tsr_coord_send_reset(tsr_coord_t *c, const uint8_t *rid, size_t rid_len, const char *name,
                          bool keep, const char *reason);
/* Which of the keys a worker was sent with its piece (a) deployment d no longer has:
 * written into why, or NULL when they all match (the KV budget is not among them). */
const char *tsr_assignment_differs(const tsr_deployment_t *d, const Tessera__Assignment *a,
                                   char *why, size_t len);
/* Whether a reload changes what a deployment's workers were given without
 * changing its layout: they must be sent their pieces again. */
bool tsr_assignment_changed(const tsr_deployment_t *od, const tsr_deployment_t *nd);
/* The data endpoints of every piece of key's replica in key's layout, indexed by slot
 * ("" where a piece has no holder yet), followed by their GPUs' PCI bus ids, their
 * worker names and their nodes in the same order: TSR_PEER_LISTS * *n_out entries
 * (the strings are the registry's).  Caller frees the array; NULL when out of memory. */
#define TSR_PEER_LISTS 4
char **tsr_replica_peers(tsr_coord_t *c, const tsr_piece_key_t *key, size_t *n_out);
/* Sends w its piece (deployment index di) in w->piece.epoch with the replica's peer
 * list (tsr_replica_peers'); peers NULL: looked up.  Records the KV budget sent. */
void tsr_send_assign_peers(tsr_coord_t *c, tsr_worker_t *w, int di, char **peers,
                           size_t n_peers);
void tsr_send_assign(tsr_coord_t *c, tsr_worker_t *w, int di);
/* Sends w piece key of deployment index di in epoch with no peer placed: w loads its
 * weights and serves nothing until the next epoch gives it the same piece with the
 * replica's peers (a standby: it joins without loading again).  0 sent, -1 not. */
int tsr_send_standby(tsr_coord_t *c, tsr_worker_t *w, int di, const tsr_piece_key_t *key,
                     uint64_t epoch);
void tsr_send_unassign(tsr_coord_t *c, tsr_worker_t *w, const char *reason);

#endif
