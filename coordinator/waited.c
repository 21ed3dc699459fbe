/* waited.c: which member of a replica its tensor-parallel group waited for (it
 * reported nothing while the other ranks of its stage reported a failure past the
 * deadline), read from the registry. */
#include "waited.h"

#include <stdio.h>

/* w, one of the replica's members m, is ready while every other member of
 * its stage (all tp_size - 1 of them: one dead or not yet registered holds
 * no piece and is not among m) has reported a failure in its epoch, one at
 * least that the group's operation passed its deadline.  Until all have, a
 * member that is only slower to report is not told from the one they
 * waited for. */
static bool stage_waited_for(tsr_worker_t *const *m, size_t n, const tsr_worker_t *w)
{
    if (!w->has_piece || w->state != TSR_W_READY) return false;
    bool deadline = false;
    int reported = 0;
    for (size_t i = 0; i < n; i++) {
        const tsr_worker_t *o = m[i];
        if (o == w || o->piece.key.stage != w->piece.key.stage) continue;
        if (o->piece.epoch != w->piece.epoch || o->state != TSR_W_FAILED) return false;
        deadline |= o->past_deadline;
        reported++;
    }
    return deadline && reported == w->piece.key.tp_size - 1;
}

bool tsr_coord_waited_for(const tsr_coord_t *c, const tsr_worker_t *w)
{
    if (!w->has_piece) return false;
    size_t n;
    tsr_worker_t *const *m =
        tsr_registry_replica(c->reg, w->piece.key.deployment, w->piece.key.replica, &n);
    if (!stage_waited_for(m, n, w)) return false;
    /* In a pipeline a rank held up by a hand-off with its neighbour (the
     * same tp rank in the stage before or after) looks the same to its own
     * group: where that neighbour is gone or is itself waited for, which of
     * the two held things up is not known, and neither is named. */
    for (int s = w->piece.key.stage - 1; s <= w->piece.key.stage + 1; s += 2) {
        if (s < 0 || s >= w->piece.key.pp_size) continue;
        const tsr_worker_t *nb = NULL;
        for (size_t i = 0; i < n && !nb; i++)
            if (m[i]->piece.key.stage == s && m[i]->piece.key.tp == w->piece.key.tp) nb = m[i];
        if (!nb || nb->piece.epoch != w->piece.epoch || stage_waited_for(m, n, nb)) return false;
    }
    return true;
}

int tsr_coord_waited_for_text(const tsr_coord_t *c, const tsr_deployment_t *d, int replica, char *buf,
                              size_t len)
{
    enum { NAMED = 4 };   /* then "and N more": the text stays short */
    int count = 0;
    size_t at = 0;
    if (len) buf[0] = '\0';
    for (int k = 0; k < d->pipeline * d->tensor; k++) {
        tsr_worker_t *w = tsr_registry_at_slot(c->reg, d->name, replica, d->tensor, d->pipeline, k);
        if (!w || !tsr_coord_waited_for(c, w)) continue;
        if (count < NAMED && at < len)
            at += (size_t)snprintf(buf + at, len - at, "%s%s (stage %d tp %d)", count ? ", " : "",
                                   w->name, w->piece.key.stage, w->piece.key.tp);
        count++;
    }
    if (count > NAMED && at < len) snprintf(buf + at, len - at, " and %d more", count - NAMED);
    return count;
}
