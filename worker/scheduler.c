#include "worker/scheduler.h"

#include "worker/kvpool.h"

int tsr_sched_worst_blocks(const tsr_sched_cfg_t *cfg, const tsr_sched_seq_t *s)
{
    /* The last generated token is never fed back, so it needs no position. */
    long pos = (long)s->n_prompt + (s->max_tokens > 0 ? s->max_tokens - 1 : 0);
    if (pos > cfg->max_seq_len) pos = cfg->max_seq_len;
    return tsr_kv_blocks_for((int)pos);
}

static bool ready(const tsr_sched_seq_t *s)
{
    if (s->slot < 0 || s->in_flight || s->cancelled) return false;
    return s->n_cached < s->n_prompt || s->n_cached == s->n_prompt + s->n_generated - 1;
}

int tsr_sched_next(const tsr_sched_cfg_t *cfg, const tsr_sched_seq_t *seqs, int n_seqs,
                   const bool *slot_used, tsr_sched_entry_t *out)
{
    int n_out = 0, running = 0, reserved = 0, budget = cfg->prefill_chunk;
    for (int i = 0; i < n_seqs; i++)
        if (seqs[i].slot >= 0) {
            running++;
            reserved += tsr_sched_worst_blocks(cfg, &seqs[i]);
        }
    /* Admissions first decide how many run, then the micro-batch share. */
    int free_slots = cfg->max_batch - running, admissible = 0, extra = 0;
    for (int i = 0; i < n_seqs && admissible < free_slots; i++) {
        if (seqs[i].slot >= 0 || seqs[i].cancelled) continue;
        int need = tsr_sched_worst_blocks(cfg, &seqs[i]);
        if (reserved + extra + need > cfg->total_blocks) break;  /* first come, first served */
        extra += need;
        admissible++;
    }
    int mb = cfg->micro_batches > 1 ? cfg->micro_batches : 1;
    int cap = (running + admissible + mb - 1) / mb;
    if (cap < 1) cap = 1;

    /* Decodes: one token each, cheapest and most latency-sensitive. */
    for (int i = 0; i < n_seqs && n_out < cap; i++) {
        const tsr_sched_seq_t *s = &seqs[i];
        if (!ready(s) || s->n_cached < s->n_prompt) continue;
        out[n_out++] = (tsr_sched_entry_t){i, s->slot, s->n_cached, 1, true, false};
    }
    /* Prompt chunks of running sequences, then new ones. */
    for (int i = 0; i < n_seqs && n_out < cap && budget > 0; i++) {
        const tsr_sched_seq_t *s = &seqs[i];
        if (!ready(s) || s->n_cached >= s->n_prompt) continue;
        int n = s->n_prompt - s->n_cached < budget ? s->n_prompt - s->n_cached : budget;
        budget -= n;
        out[n_out++] = (tsr_sched_entry_t){i, s->slot, s->n_cached, n,
                                           s->n_cached + n == s->n_prompt, false};
    }
    int next_slot = 0;
    for (int i = 0; i < n_seqs && admissible > 0 && n_out < cap && budget > 0; i++) {
        const tsr_sched_seq_t *s = &seqs[i];
        if (s->slot >= 0 || s->cancelled) continue;
        while (next_slot < cfg->max_batch && slot_used[next_slot]) next_slot++;
        if (next_slot == cfg->max_batch) break;
        /* a waiting sequence's n_cached: the prefix the cache holds for it */
        int left = s->n_prompt - s->n_cached, n = left < budget ? left : budget;
        budget -= n;
        admissible--;
        out[n_out++] = (tsr_sched_entry_t){i, next_slot++, s->n_cached, n, n == left, true};
    }
    return n_out;
}
