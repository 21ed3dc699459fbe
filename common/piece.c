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
