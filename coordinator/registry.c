#include "registry.h"

#include <stdlib.h>
#include <string.h>
#include <czmq.h>

struct tsr_registry {
    tsr_worker_t **items;
    size_t n, cap;
    zhashx_t *by_name;          /* name -> tsr_worker_t *, not owning */
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
