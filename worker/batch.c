/* batch.c: what every engine checks and takes before it runs a batch. */
#include <stdio.h>
#include <string.h>

#include "common/util.h"
#include "worker/engine.h"
#include "worker/kvpool.h"

/* The batch must fit what the engine was sized for; blocks are taken for
 * every entry before anything runs, and given back when that fails. */
int tsr_batch_prepare(const tsr_piece_spec_t *s, tsr_kvpool_t *kv, const tsr_batch_t *b,
                      int *first_row, int32_t *row_slot, int32_t *row_pos, char *err,
                      size_t errlen)
{
    int rows = 0;
    if (b->n_entries < 0 || b->n_entries > s->max_seqs || b->n_tokens > s->max_tokens) {
        tsr_set_err(err, errlen, "a batch of %d entries and %d rows exceeds this piece's %d and %d",
                    b->n_entries, b->n_tokens, s->max_seqs, s->max_tokens);
        return -1;
    }
    for (int i = 0; i < b->n_entries; i++) {
        const tsr_entry_t *en = &b->entries[i];
        if (en->slot < 0 || en->slot >= s->max_seqs || en->pos < 0 || en->n < 1 ||
            en->pos + en->n > s->max_seq_len || en->n > s->max_tokens - rows) {
            tsr_set_err(err, errlen,
                        "entry %d: positions [%d,%d) of slot %d do not fit (max_seq_len %d, %d slots, "
                        "%d rows a step)",
                        i, en->pos, en->pos + en->n, en->slot, s->max_seq_len, s->max_seqs,
                        s->max_tokens);
            return -1;
        }
        for (int j = 0; j < i; j++)
            if (b->entries[j].slot == en->slot) {
                tsr_set_err(err, errlen, "entries %d and %d both run slot %d", j, i, en->slot);
                return -1;
            }
        first_row[i] = rows;
        for (int r = 0; r < en->n; r++) row_slot[rows + r] = en->slot, row_pos[rows + r] = en->pos + r;
        rows += en->n;
    }
    if (rows != b->n_tokens) {
        tsr_set_err(err, errlen, "the entries cover %d rows, the batch says %d", rows, b->n_tokens);
        return -1;
    }
    int need = 0;
    for (int i = 0; i < b->n_entries; i++) {
        const tsr_entry_t *en = &b->entries[i];
        int more = tsr_kv_blocks_for(en->pos + en->n) - tsr_kvpool_held(kv, en->slot);
        need += more > 0 ? more : 0;
    }
    if (need > tsr_kvpool_total(kv) - tsr_kvpool_used(kv)) {
        tsr_set_err(err, errlen, "the KV pool has %d free blocks, this step needs %d",
                    tsr_kvpool_total(kv) - tsr_kvpool_used(kv), need);
        return -1;
    }
    for (int i = 0; i < b->n_entries; i++)
        tsr_kvpool_grow(kv, b->entries[i].slot, b->entries[i].pos + b->entries[i].n);
    return 0;
}


void tsr_logits_ungather(const float *gathered, int tp, int ns, int chunk, int vocab, int rows,
                         float *out)
{
    for (int s = 0; s < rows; s++)
        for (int r = 0; r < tp; r++) {
            int w = vocab - r * chunk < chunk ? vocab - r * chunk : chunk;
            if (w > 0)
                memcpy(out + (size_t)s * vocab + (size_t)r * chunk,
                       gathered + ((size_t)r * ns + s) * chunk, (size_t)w * sizeof(float));
        }
}
