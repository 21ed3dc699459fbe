/* relay.c: an NCCL group's rendezvous blob passed on to the members of its replica
 * in the same epoch, and to no one else. */
#include "relay.h"

#include "assign.h"
#include "common/log.h"

/* An NCCL group's rendezvous blob, made by the group's rank 0 for its
 * piece's current epoch (checked by the caller), goes to the members of
 * its replica that hold their piece in that same epoch, its maker
 * included (every rank, rank 0 too, forms from the copy this relay
 * fenced), and to no one else: a member of another epoch or replica never
 * sees it, and a blob for a group its sender does not lead (rank 0) is
 * dropped, so one member cannot hand the others a communicator to join. */
void tsr_relay_rendezvous(tsr_coord_t *c, tsr_worker_t *w, const tsr_env_t *env)
{
    const Tessera__RendezvousOffer *o = env->rendezvous_offer;
    if (!o->blob.len || o->blob.len > 256) {
        c->stats.bad_messages++;
        tsr_warn("worker %s sent a rendezvous blob of %zu bytes (1 to 256 allowed): dropped",
                 w->name, o->blob.len);
        return;
    }
    uint64_t led[2];
    int n_led = tsr_piece_led_groups(&w->piece.key, led), k = 0;
    while (k < n_led && led[k] != o->group) k++;
    if (k == n_led) {
        c->stats.bad_messages++;
        tsr_warn("worker %s (stage %d, tp rank %d of %s replica %d) sent a rendezvous blob for "
                 "group %016llx, which it does not lead: dropped",
                 w->name, w->piece.key.stage, w->piece.key.tp, w->piece.key.deployment,
                 w->piece.key.replica, (unsigned long long)o->group);
        return;
    }
    Tessera__Rendezvous r = TESSERA__RENDEZVOUS__INIT;
    r.group = o->group;
    r.blob = o->blob;
    r.from = w->name;
    size_t n;
    tsr_worker_t *const *m =
        tsr_registry_replica(c->reg, w->piece.key.deployment, w->piece.key.replica, &n);
    for (size_t i = 0; i < n; i++) {
        if (m[i]->piece.epoch != env->epoch) continue;
        tsr_env_t out = TESSERA__ENVELOPE__INIT;
        out.epoch = env->epoch;
        out.body_case = TESSERA__ENVELOPE__BODY_RENDEZVOUS;
        out.rendezvous = &r;
        tsr_coord_send_to(c, m[i], &out);
    }
    c->stats.rendezvous_relayed++;
}
