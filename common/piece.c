#include "piece.h"

#include <stdio.h>
#include <string.h>

void tsr_piece_from_wire(tsr_piece_key_t *k, const Tessera__Assignment *a)
{
    snprintf(k->deployment, sizeof k->deployment, "%s", a->deployment ? a->deployment : "");
    k->replica = (int)a->replica;
    k->stage = (int)a->stage;
    k->tp = (int)a->tp_rank;
    k->tp_size = (int)a->tp_size;
    k->pp_size = (int)a->pp_size;
    k->layer_begin = (int)a->layer_begin;
    k->layer_end = (int)a->layer_end;
}

void tsr_piece_to_wire(const tsr_piece_key_t *k, Tessera__Assignment *a)
{
    a->deployment = (char *)k->deployment;
    a->replica = (uint32_t)k->replica;
    a->stage = (uint32_t)k->stage;
    a->tp_rank = (uint32_t)k->tp;
    a->tp_size = (uint32_t)k->tp_size;
    a->pp_size = (uint32_t)k->pp_size;
    a->layer_begin = (uint32_t)k->layer_begin;
    a->layer_end = (uint32_t)k->layer_end;
}

bool tsr_piece_same(const tsr_piece_key_t *a, const tsr_piece_key_t *b)
{
    return a->replica == b->replica && a->stage == b->stage && a->tp == b->tp &&
           !strcmp(a->deployment, b->deployment);
}

bool tsr_piece_equal(const tsr_piece_key_t *a, const tsr_piece_key_t *b)
{
    return tsr_piece_same(a, b) && a->tp_size == b->tp_size && a->pp_size == b->pp_size &&
           a->layer_begin == b->layer_begin && a->layer_end == b->layer_end;
}

int tsr_piece_slot(const tsr_piece_key_t *k) { return k->stage * k->tp_size + k->tp; }

uint64_t tsr_group_id(const char *deployment, int replica, const char *kind, int a, int b)
{
    char key[TSR_NAME_MAX + 64];
    snprintf(key, sizeof key, "%s/%d/%s/%d/%d", deployment, replica, kind, a, b);
    uint64_t h = 1469598103934665603ull;  /* FNV-1a */
    for (const char *p = key; *p; p++) h = (h ^ (uint8_t)*p) * 1099511628211ull;
    return h;
}

int tsr_piece_led_groups(const tsr_piece_key_t *k, uint64_t out[2])
{
    int n = 0;
    if (k->tp == 0)
        out[n++] = tsr_group_id(k->deployment, k->replica, "tp", k->stage, 0);
    if (k->stage < k->pp_size - 1)
        out[n++] = tsr_group_id(k->deployment, k->replica, "pp", k->stage + 1, k->tp);
    return n;
}
