/* relay.h: NCCL rendezvous blobs passed on (relay.c). */
#ifndef TSR_RELAY_H
#define TSR_RELAY_H

#include "state.h"

/* An NCCL group's rendezvous blob, made by the group's rank 0 for its
 * piece's current epoch (checked by the caller), goes to the members of
 * its replica that hold their piece in that same epoch, its maker
 * included (every rank, rank 0 too, forms from the copy this relay
 * fenced), and to no one else: a member of another epoch or replica never
 * sees it, and a blob for a group its sender does not lead (rank 0) is
 * dropped, so one member cannot hand the others a communicator to join. */
void tsr_relay_rendezvous(tsr_coord_t *c, tsr_worker_t *w, const tsr_env_t *env);

#endif
