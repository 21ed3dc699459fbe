#include "registry.h"

#include <stdlib.h>
#include <string.h>
#include <czmq.h>

/* The holders of one (deployment, replica)'s pieces. */
typedef struct {
    char deployment[TSR_NAME_MAX + 1];
    int replica;
    tsr_worker_t **m;
    size_t n, cap;
} replica_entry_t;

struct tsr_registry {
    tsr_worker_t **items;
    size_t n, cap;
    zhashx_t *by_name;          /* name -> tsr_worker_t *, not owning */
    replica_entry_t *reps;      /* the index: one entry per (deployment, replica) held */
    size_t n_reps, cap_reps;
};

const char *tsr_wstate_name(tsr_wstate_t s)
{
    switch (s) {
    case TSR_W_IDLE: return "idle";
    case TSR_W_LOADING: return "loading";
    case TSR_W_READY: return "ready";
    case TSR_W_FAILED: return "failed";
    case TSR_W_DEAD: return "dead";
    }
    return "unknown";
}

tsr_registry_t *tsr_registry_new(void)
{
    tsr_registry_t *self = calloc(1, sizeof *self);
    if (!self) return NULL;
    self->by_name = zhashx_new();
    if (!self->by_name) {
        free(self);
        return NULL;
    }
    return self;
}

void tsr_registry_destroy(tsr_registry_t **self_p)
{
    if (!self_p || !*self_p) return;
    tsr_registry_t *self = *self_p;
    for (size_t i = 0; i < self->n; i++) free(self->items[i]);
    free(self->items);
    for (size_t i = 0; i < self->n_reps; i++) free(self->reps[i].m);
    free(self->reps);
    zhashx_destroy(&self->by_name);
    free(self);
    *self_p = NULL;
}

tsr_worker_t *tsr_registry_find(tsr_registry_t *self, const char *name)
{
    return zhashx_lookup(self->by_name, name);
}

tsr_worker_t *tsr_registry_upsert(tsr_registry_t *self, const char *name)
{
    tsr_worker_t *w = tsr_registry_find(self, name);
    if (w) return w;
    /* A longer name would be stored cut short and never found again. */
    if (strlen(name) > TSR_NAME_MAX) return NULL;
    if (self->n == self->cap) {
        size_t cap = self->cap ? self->cap * 2 : 64;
        tsr_worker_t **items = realloc(self->items, cap * sizeof *items);
        if (!items) return NULL;
        self->items = items;
        self->cap = cap;
    }
    w = calloc(1, sizeof *w);
    if (!w) return NULL;
    snprintf(w->name, sizeof w->name, "%s", name);
    w->state = TSR_W_IDLE;
    if (zhashx_insert(self->by_name, w->name, w) != 0) {
        free(w);
        return NULL;
    }
    self->items[self->n++] = w;
    return w;
}

size_t tsr_registry_size(const tsr_registry_t *self) { return self->n; }

tsr_worker_t *tsr_registry_at(tsr_registry_t *self, size_t i)
{
    return i < self->n ? self->items[i] : NULL;
}

size_t tsr_registry_alive(const tsr_registry_t *self)
{
    size_t k = 0;
    for (size_t i = 0; i < self->n; i++) k += self->items[i]->state != TSR_W_DEAD;
    return k;
}

/* Frees entry i, keeping the others in registration order. */
static void remove_at(tsr_registry_t *self, size_t i)
{
    tsr_worker_t *w = self->items[i];
    tsr_registry_clear_piece(self, w);
    zhashx_delete(self->by_name, w->name);
    free(w);
    memmove(&self->items[i], &self->items[i + 1], (self->n - i - 1) * sizeof *self->items);
    self->n--;
}

size_t tsr_registry_forget_dead(tsr_registry_t *self, int64_t before_ms)
{
    size_t kept = 0, gone = 0;
    for (size_t i = 0; i < self->n; i++) {
        tsr_worker_t *w = self->items[i];
        if (w->state == TSR_W_DEAD && w->dead_since_ms <= before_ms) {
            tsr_registry_clear_piece(self, w);
            zhashx_delete(self->by_name, w->name);
            free(w);
            gone++;
            continue;
        }
        self->items[kept++] = w;
    }
    self->n = kept;
    return gone;
}

bool tsr_registry_forget_oldest_dead(tsr_registry_t *self)
{
    size_t best = self->n;
    for (size_t i = 0; i < self->n; i++) {
        tsr_worker_t *w = self->items[i];
        if (w->state == TSR_W_DEAD &&
            (best == self->n || w->dead_since_ms < self->items[best]->dead_since_ms))
            best = i;
    }
    if (best == self->n) return false;
    remove_at(self, best);
    return true;
}

/* ---- the piece index ------------------------------------------------------ */

static replica_entry_t *find_replica(tsr_registry_t *self, const char *deployment, int replica)
{
    for (size_t i = 0; i < self->n_reps; i++)
        if (self->reps[i].replica == replica && !strcmp(self->reps[i].deployment, deployment))
            return &self->reps[i];
    return NULL;
}

void tsr_registry_clear_piece(tsr_registry_t *self, tsr_worker_t *w)
{
    if (!w->has_piece) return;
    w->has_piece = false;
    replica_entry_t *e = find_replica(self, w->piece.key.deployment, w->piece.key.replica);
    if (!e) return;
    for (size_t i = 0; i < e->n; i++) {
        if (e->m[i] != w) continue;
        memmove(&e->m[i], &e->m[i + 1], (e->n - i - 1) * sizeof *e->m);
        e->n--;
        break;
    }
    if (e->n) return;
    /* the last holder left: the entry goes (the last one takes its place) */
    free(e->m);
    *e = self->reps[--self->n_reps];
}

int tsr_registry_set_piece(tsr_registry_t *self, tsr_worker_t *w, const tsr_piece_key_t *key,
                           uint64_t epoch, uint64_t kv_budget)
{
    tsr_registry_clear_piece(self, w);
    replica_entry_t *e = find_replica(self, key->deployment, key->replica);
    if (!e) {
        if (self->n_reps == self->cap_reps) {
            size_t cap = self->cap_reps ? self->cap_reps * 2 : 16;
            replica_entry_t *r = realloc(self->reps, cap * sizeof *r);
            if (!r) return -1;
            self->reps = r;
            self->cap_reps = cap;
        }
        e = &self->reps[self->n_reps];
        memset(e, 0, sizeof *e);
        snprintf(e->deployment, sizeof e->deployment, "%s", key->deployment);
        e->replica = key->replica;
    }
    if (e->n == e->cap) {
        size_t cap = e->cap ? e->cap * 2 : 8;
        tsr_worker_t **m = realloc(e->m, cap * sizeof *m);
        if (!m) {
            if (!e->n) free(e->m);  /* a new entry that never counted */
            return -1;
        }
        e->m = m;
        e->cap = cap;
    }
    if (e == &self->reps[self->n_reps]) self->n_reps++;
    e->m[e->n++] = w;
    w->piece.key = *key;
    w->piece.epoch = epoch;
    w->piece.kv_budget = kv_budget;
    w->has_piece = true;
    return 0;
}

tsr_worker_t *const *tsr_registry_replica(tsr_registry_t *self, const char *deployment,
                                          int replica, size_t *n)
{
    replica_entry_t *e = find_replica(self, deployment, replica);
    *n = e ? e->n : 0;
    return e ? e->m : NULL;
}

tsr_worker_t *tsr_registry_holder(tsr_registry_t *self, const tsr_piece_key_t *key,
                                  const tsr_worker_t *except)
{
    size_t n;
    tsr_worker_t *const *m = tsr_registry_replica(self, key->deployment, key->replica, &n);
    for (size_t i = 0; i < n; i++)
        if (m[i] != except && tsr_piece_same(&m[i]->piece.key, key)) return m[i];
    return NULL;
}

tsr_worker_t *tsr_registry_at_slot(tsr_registry_t *self, const char *deployment, int replica,
                                   int tp_size, int pp_size, int slot)
{
    size_t n;
    tsr_worker_t *const *m = tsr_registry_replica(self, deployment, replica, &n);
    for (size_t i = 0; i < n; i++) {
        const tsr_piece_key_t *k = &m[i]->piece.key;
        if (k->tp_size == tp_size && k->pp_size == pp_size && tsr_piece_slot(k) == slot)
            return m[i];
    }
    return NULL;
}

tsr_worker_t *tsr_registry_ready_leader(tsr_registry_t *self, const tsr_deployment_t *d, int r)
{
    int slots = d->tensor * d->pipeline;
    for (int k = 0; k < slots; k++) {
        tsr_worker_t *w = tsr_registry_at_slot(self, d->name, r, d->tensor, d->pipeline, k);
        if (!w || w->state != TSR_W_READY) return NULL;
    }
    return tsr_registry_at_slot(self, d->name, r, d->tensor, d->pipeline, 0);
}
