#include "worker/scheduler.h"

#include "worker/kvpool.h"

int tsr_sched_worst_blocks(const tsr_sched_cfg_t *cfg, const tsr_sched_seq_t *s)
{
    /* The last generated token is never fed back, so it needs no position. */
    long pos = (long)s->n_prompt + (s->max_tokens > 0 ? s->max_tokens - 1 : 0);
    if (pos > cfg->max_seq_len) pos = cfg->max_seq_len;
    return tsr_kv_blocks_for((int)pos);
}

/* Positions whose tokens are known before the next sample: the prompt, and
 * of a sequence preempted after generating, every token fed back before. */
static int known(const tsr_sched_seq_t *s)
{
    return s->n_prompt + (s->n_generated > 0 ? s->n_generated - 1 : 0);
}

static bool ready(const tsr_sched_seq_t *s)
{
    if (s->slot < 0 || s->in_flight || s->cancelled) return false;
    return s->n_cached < known(s) || s->n_cached == s->n_prompt + s->n_generated - 1;
}

/* Blocks positions [pos, pos + n) take beyond those the sequence holds. */
static int grow_blocks(int pos, int n) { return tsr_kv_blocks_for(pos + n) - tsr_kv_blocks_for(pos); }

/* On demand: the running sequence admitted last that is not in the pipeline. */
static int latest_admitted(const tsr_sched_seq_t *seqs, int n_seqs)
{
    int v = -1;
    for (int i = 0; i < n_seqs; i++)
        if (seqs[i].slot >= 0 && !seqs[i].in_flight && !seqs[i].cancelled &&
            (v < 0 || seqs[i].admitted > seqs[v].admitted))
            v = i;
    return v;
}

int tsr_sched_next(const tsr_sched_cfg_t *cfg, const tsr_sched_seq_t *seqs, int n_seqs,
                   const bool *slot_used, tsr_sched_entry_t *out, int *preempt)
{
    int n_out = 0, running = 0, reserved = 0, budget = cfg->prefill_chunk;
    if (preempt) *preempt = -1;
    for (int i = 0; i < n_seqs; i++)
        if (seqs[i].slot >= 0) {
            running++;
            reserved += tsr_sched_worst_blocks(cfg, &seqs[i]);
        }
    /* On demand the blocks are counted as they are taken: room is what the
     * pool can give now, less what this step's entries take. */
    int room = cfg->free_blocks;
    /* Admissions first decide how many run, then the micro-batch share.
     * Reserving, a sequence is admitted when the pool holds its worst case
     * on top of the running ones'; on demand, when its first chunk fits
     * and a block is left for each other running sequence to grow into. */
    int free_slots = cfg->max_batch - running, admissible = 0, extra = 0;
    for (int i = 0; i < n_seqs && admissible < free_slots; i++) {
        const tsr_sched_seq_t *s = &seqs[i];
        if (s->slot >= 0 || s->cancelled) continue;
        int need = cfg->on_demand ? tsr_kv_blocks_for(s->n_cached + 1) + s->attach_taken -
                                        tsr_kv_blocks_for(s->n_cached)
                                  : tsr_sched_worst_blocks(cfg, s);
        int limit = cfg->on_demand ? room - (running + admissible) : cfg->total_blocks - reserved;
        if (extra + need > limit) break;  /* first come, first served */
        extra += need;
        admissible++;
    }
    int mb = cfg->micro_batches > 1 ? cfg->micro_batches : 1;
    int cap = (running + admissible + mb - 1) / mb;
    if (cap < 1) cap = 1;

    /* Decodes: one token each, cheapest and most latency-sensitive. */
    for (int i = 0; i < n_seqs && n_out < cap; i++) {
        const tsr_sched_seq_t *s = &seqs[i];
        if (!ready(s) || s->n_cached < known(s)) continue;
        if (cfg->on_demand) {
            int need = grow_blocks(s->n_cached, 1);
            if (need > room) {      /* the pool ran out: the latest admitted gives way */
                if (preempt) *preempt = latest_admitted(seqs, n_seqs);
                return 0;
            }
            room -= need;
        }
        out[n_out++] = (tsr_sched_entry_t){i, s->slot, s->n_cached, 1, true, false};
    }
    /* Prompt chunks of running sequences (on demand: as much as fits), then new ones. */
    for (int i = 0; i < n_seqs && n_out < cap && budget > 0; i++) {
        const tsr_sched_seq_t *s = &seqs[i];
        if (!ready(s) || s->n_cached >= known(s)) continue;
        int n = known(s) - s->n_cached < budget ? known(s) - s->n_cached : budget;
        if (cfg->on_demand) {
            while (n > 0 && grow_blocks(s->n_cached, n) > room)   /* to where its blocks end */
                n = tsr_kv_blocks_for(s->n_cached + n) * TSR_KV_BLOCK - TSR_KV_BLOCK - s->n_cached;
            if (n <= 0) continue;
            room -= grow_blocks(s->n_cached, n);
        }
        budget -= n;
        out[n_out++] = (tsr_sched_entry_t){i, s->slot, s->n_cached, n,
                                           s->n_generated == 0 && s->n_cached + n == s->n_prompt,
                                           false};
    }
    /* Running sequences that cannot move for want of blocks, and none that
     * could free any: the latest admitted gives way. */
    if (cfg->on_demand && n_out == 0 && running > 0) {
        bool any_in_flight = false;
        for (int i = 0; i < n_seqs; i++) any_in_flight |= seqs[i].slot >= 0 && seqs[i].in_flight;
        if (!any_in_flight) {
            if (preempt) *preempt = latest_admitted(seqs, n_seqs);
            return 0;
        }
    }
    int next_slot = 0, taken = 0;
    for (int i = 0; i < n_seqs && admissible > 0 && n_out < cap && budget > 0; i++) {
        const tsr_sched_seq_t *s = &seqs[i];
        if (s->slot >= 0 || s->cancelled) continue;
        while (next_slot < cfg->max_batch && slot_used[next_slot]) next_slot++;
        if (next_slot == cfg->max_batch) break;
        /* a waiting sequence's n_cached: the prefix the cache holds for it */
        int left = known(s) - s->n_cached, n = left < budget ? left : budget;
        if (cfg->on_demand) {
            int keep = running + taken;   /* a block to grow into for each other */
            while (n > 0 && grow_blocks(s->n_cached, n) + s->attach_taken > room - keep)
                n = tsr_kv_blocks_for(s->n_cached + n) * TSR_KV_BLOCK - TSR_KV_BLOCK - s->n_cached;
            if (n <= 0) break;   /* first come, first served */
            room -= grow_blocks(s->n_cached, n) + s->attach_taken;
        }
        budget -= n;
        admissible--;
        taken++;
        out[n_out++] = (tsr_sched_entry_t){i, next_slot++, s->n_cached, n,
                                           s->n_generated == 0 && s->n_cached + n == s->n_prompt,
                                           true};
    }
    return n_out;
}
