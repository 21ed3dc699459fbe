/* layout.c: the candidate cuts of a deployment, their memory and time, and the
 * choice among them (layout.h says the rules). */
#include "layout.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/budget.h"
#include "common/slice.h"

void tsr_devices_defaults(tsr_devices_t *v, tsr_device_t kind)
{
    bool gpu = kind == TSR_DEVICE_CUDA;
    v->mem_gbs = gpu ? 3350 : 20;
    v->gflops = gpu ? 989000 : 200;
    const double gbs[4] = {0, 450, gpu ? 25 : 2, gpu ? 12.5 : 1.25};
    const double us[4] = {0, 10, gpu ? 20 : 50, gpu ? 50 : 100};
    memcpy(v->link_gbs, gbs, sizeof gbs);
    memcpy(v->link_us, us, sizeof us);
}

const char *tsr_link_name(tsr_link_t link)
{
    static const char *const names[] = {"-", "nvlink", "node", "network"};
    return names[link];
}

/* Why the model's weights cannot be cut into `tensor` slices ("" when they can). */
static void tensor_fault(const tsr_model_info_t *m, int tensor, char *why, size_t len)
{
    why[0] = '\0';
    if (m->num_attention_heads % tensor)
        snprintf(why, len, "%d attention heads do not divide by %d", m->num_attention_heads,
                 tensor);
    else if (m->num_key_value_heads % tensor)
        snprintf(why, len, "%d KV heads do not divide by %d", m->num_key_value_heads, tensor);
    else if (m->intermediate_size % tensor)
        snprintf(why, len, "intermediate size %d does not divide by %d", m->intermediate_size,
                 tensor);
    else if (!tsr_model_piece_bytes(m, 1, 0, tensor))
        snprintf(why, len, "the weights do not cut into %d slices", tensor);
}

/* Bytes of KV one position takes on a rank of stage s (keys and values). */
static double kv_position_bytes(const tsr_model_info_t *m, const tsr_deployment_t *d, int s)
{
    int b, e, kvt = d->device == TSR_DEVICE_CUDA ? TSR_KV_BF16 : tsr_kv_dtype_on(d->device,
                                                                                   d->kv_dtype);
    tsr_layer_split(m->num_hidden_layers, d->pipeline, s, &b, &e);
    return (double)tsr_kv_block_bytes(m, d->tensor, e - b, 1, tsr_kv_row_bytes(kvt, m->head_dim));
}

/* Bytes on the fullest device of d's cut: what the engine allocates.  A cuda piece:
 * weights, reserve and the least KV pool it runs with, over gpu_memory_percent
 * (tsr_piece_need, as the coordinator checks).  A cpu piece: weights and its KV pool
 * (kv_cache_mib's, or max_batch sequences of max_seq_len). */
static uint64_t device_need(const tsr_model_info_t *m, const tsr_deployment_t *d,
                            uint64_t *weights)
{
    uint64_t most = 0, most_w = 0;
    int seqs, tokens;
    tsr_step_rows(d->max_batch, d->prefill_chunk, d->max_seq_len, &seqs, &tokens);
    for (int s = 0; s < d->pipeline; s++) {
        uint64_t w = tsr_piece_weight_bytes(m, d, s), need;
        if (d->device == TSR_DEVICE_CUDA) {
            need = tsr_piece_need(m, d, s);
        } else {
            int b, e, row = tsr_kv_row_bytes(tsr_kv_dtype_on(d->device, d->kv_dtype), m->head_dim);
            tsr_layer_split(m->num_hidden_layers, d->pipeline, s, &b, &e);
            int blocks = tsr_kv_pool_blocks(m, d->tensor, d->pipeline,
                                            (uint64_t)d->kv_cache_mib << 20, seqs, d->max_seq_len,
                                            TSR_KV_BLOCK, row);
            need = w + (uint64_t)blocks * tsr_kv_block_bytes(m, d->tensor, e - b, TSR_KV_BLOCK, row);
        }
        if (need > most) most = need;
        if (w > most_w) most_w = w;
    }
    *weights = most_w;
    return most;
}

/* Seconds of one decode step of `batch` sequences of `context` positions each
 * through every stage of d's cut: per stage, the weights and the KV read at the
 * memory bandwidth or the products at the compute rate (whichever is longer),
 * two all-reduces a layer over the group's link, and a hand-off to the next stage. */
static double step_seconds(const tsr_model_info_t *m, const tsr_deployment_t *d,
                           const tsr_devices_t *devs, tsr_link_t link, tsr_link_t handoff,
                           int batch, int context)
{
    double total = 0, H = m->hidden_size, B = batch;
    int elem = tsr_weight_elem_bytes(d);
    for (int s = 0; s < d->pipeline; s++) {
        int b, e;
        tsr_layer_split(m->num_hidden_layers, d->pipeline, s, &b, &e);
        double w = (double)tsr_piece_weight_bytes(m, d, s);
        double kv = B * context * kv_position_bytes(m, d, s);
        double flops = 2.0 * (w / elem) * B +
                       4.0 * B * context * (e - b) * (double)m->num_attention_heads / d->tensor *
                           m->head_dim;
        double t_mem = (w + kv) / (devs->mem_gbs * 1e9), t_flop = flops / (devs->gflops * 1e9);
        total += t_mem > t_flop ? t_mem : t_flop;
        if (d->tensor > 1) {
            double bytes = 2.0 * (d->tensor - 1) / d->tensor * B * H * 4;
            total += 2.0 * (e - b) * (devs->link_us[link] * 1e-6 + bytes / (devs->link_gbs[link] * 1e9));
        }
        if (s + 1 < d->pipeline)
            total += devs->link_us[handoff] * 1e-6 + B * H * 4 / (devs->link_gbs[handoff] * 1e9);
    }
    return total;
}

/* devs as `busy` workers of one replica running at once see them: cpu workers whose
 * threads on a node outnumber its cores each get their share of the cores (a rate a
 * worker was measured at alone is divided among them). */
static tsr_devices_t shared(const tsr_devices_t *devs, int busy)
{
    tsr_devices_t v = *devs;
    int on_node = busy < devs->per_node || devs->per_node < 1 ? busy : devs->per_node;
    /* a worker's default: every CPU it may run on */
    int each = devs->threads > 0 ? devs->threads : devs->cores > 0 ? devs->cores : 1;
    double threads = (double)on_node * each;
    if (devs->cores > 0 && threads > devs->cores) {
        v.mem_gbs *= devs->cores / threads;
        v.gflops *= devs->cores / threads;
    }
    return v;
}

void tsr_layout_of(const tsr_model_info_t *m, const tsr_deployment_t *d,
                   const tsr_devices_t *devs, int t, int p, tsr_layout_t *out)
{
    tsr_layout_t c = {.tensor = t, .pipeline = p, .valid = true};
    tsr_deployment_t dd = *d;
    dd.tensor = t;
    dd.pipeline = p;
    char fault[96] = "";
    if (t < 1 || p < 1)
        snprintf(fault, sizeof fault, "tensor and pipeline must be at least 1");
    else if (p > m->num_hidden_layers)
        snprintf(fault, sizeof fault, "%d stages for %d layers", p, m->num_hidden_layers);
    else
        tensor_fault(m, t, fault, sizeof fault);
    if (fault[0]) {
        c.valid = false;
        snprintf(c.invalid, sizeof c.invalid, "%s", fault);
        *out = c;
        return;
    }
    if (t * p > devs->devices) {
        c.valid = false;
        snprintf(c.invalid, sizeof c.invalid, "needs %d devices, %d free", t * p, devs->devices);
    }
    c.need = device_need(m, &dd, &c.weights);
    c.have = devs->memory;
    c.fits = !devs->memory || c.need <= devs->memory;
    c.link = t == 1                                          ? TSR_LINK_NONE
             : devs->per_domain > 1 && t <= devs->per_domain ? TSR_LINK_NVLINK
             : t <= devs->per_node                           ? TSR_LINK_NODE
                                                             : TSR_LINK_NETWORK;
    /* stages go to other nodes when the replica does not fit on one */
    tsr_link_t handoff = t * p <= devs->per_node ? TSR_LINK_NODE : TSR_LINK_NETWORK;
    int seqs, tokens;
    tsr_step_rows(d->max_batch, d->prefill_chunk, d->max_seq_len, &seqs, &tokens);
    int context = d->max_seq_len / 2 > 0 ? d->max_seq_len / 2 : 1;
    /* one sequence is in one stage at a time; with max_batch in flight every stage is
     * busy at once */
    tsr_devices_t alone = shared(devs, t), all = shared(devs, t * p);
    c.ms_token = 1e3 * step_seconds(m, &dd, &alone, c.link, handoff, 1, context);
    double step = step_seconds(m, &dd, &all, c.link, handoff, seqs, context);
    c.tok_s = step > 0 ? seqs / step : 0;
    c.replicas = c.valid ? devs->devices / (t * p) : 0;
    if (!d->auto_replicas && d->replicas > 0 && c.replicas > d->replicas) c.replicas = d->replicas;
    /* every replica busy: those on one node share its cores too */
    tsr_devices_t every = shared(devs, c.replicas * t * p);
    double step_all = step_seconds(m, &dd, &every, c.link, handoff, seqs, context);
    c.tok_s_all = step_all > 0 ? c.replicas * seqs / step_all : 0;
    *out = c;
}

size_t tsr_layout_candidates(const tsr_model_info_t *m, const tsr_deployment_t *d,
                             const tsr_devices_t *devs, tsr_layout_t *out, size_t max)
{
    size_t n = 0;
    int most_tensor = devs->per_node > 1 ? devs->per_node : 1;
    if (devs->devices < most_tensor) most_tensor = devs->devices;
    for (int t = 1; t <= most_tensor || t == 1; t++) {
        char fault[96];
        tensor_fault(m, t, fault, sizeof fault);
        if (fault[0] && t > 1) continue;  /* only sizes the model divides into are candidates */
        for (int p = 1; p <= m->num_hidden_layers; p++) {
            if (p > 1 && t * p > devs->devices) break;
            if (n < max) tsr_layout_of(m, d, devs, t, p, &out[n]);
            n++;
        }
    }
    return n;
}

static void gib(uint64_t b, char *buf, size_t len)
{
    snprintf(buf, len, "%.2f GiB", (double)b / (1ull << 30));
}

int tsr_layout_choose(const tsr_layout_t *c, size_t n, double latency_ms, char *why,
                      size_t why_len)
{
    int best = -1, smallest = -1, fastest = -1, same = 0;
    for (size_t i = 0; i < n; i++) {
        if (!c[i].valid) continue;
        if (!c[i].fits) {
            if (smallest < 0 || c[i].need < c[smallest].need) smallest = (int)i;
            continue;
        }
        if (fastest < 0 || c[i].ms_token < c[fastest].ms_token) fastest = (int)i;
        if (latency_ms > 0 && c[i].ms_token > latency_ms) continue;
        int dev = c[i].tensor * c[i].pipeline, bdev = best < 0 ? 0 : c[best].tensor * c[best].pipeline;
        if (best < 0 || dev < bdev) {
            best = (int)i;
            same = 1;
        } else if (dev == bdev) {
            same++;
            if (c[i].ms_token < c[best].ms_token) best = (int)i;
        }
    }
    if (!why || !why_len) return best;
    char a[32], b[32];
    if (best >= 0) {
        snprintf(why, why_len, "tp %d x pp %d: the fewest devices a replica fits on (%d)%s%s, "
                 "leaving %d replica(s)", c[best].tensor, c[best].pipeline,
                 c[best].tensor * c[best].pipeline,
                 latency_ms > 0 ? " within the latency target" : "",
                 same > 1 ? "; of the cuts of as many, the fastest per token" : "",
                 c[best].replicas);
    } else if (fastest >= 0) {
        snprintf(why, why_len, "no cut meets %.2f ms per token: the fastest that fits, tp %d x "
                 "pp %d, takes %.2f ms", latency_ms, c[fastest].tensor, c[fastest].pipeline,
                 c[fastest].ms_token);
    } else if (smallest >= 0) {
        gib(c[smallest].need, a, sizeof a);
        gib(c[smallest].have, b, sizeof b);
        snprintf(why, why_len, "no cut fits: the closest, tp %d x pp %d, needs %s per device "
                 "where each has %s", c[smallest].tensor, c[smallest].pipeline, a, b);
    } else {
        snprintf(why, why_len, "no cut can be placed: %s", n ? c[n - 1].invalid : "no devices");
    }
    return best;
}

int tsr_layout_choose_auto(const tsr_model_info_t *m, const tsr_deployment_t *d,
                           const tsr_devices_t *devs, tsr_layout_t *out, char *why,
                           size_t why_len)
{
    int most_t = devs->per_node > 1 ? devs->per_node : 1;
    int t0 = d->auto_tensor ? 1 : d->tensor, t1 = d->auto_tensor ? most_t : d->tensor;
    int p0 = d->auto_pipeline ? 1 : d->pipeline;
    int p1 = d->auto_pipeline ? m->num_hidden_layers : d->pipeline;
    size_t cap = (size_t)(t1 - t0 + 1) * (size_t)(p1 - p0 + 1), n = 0;
    tsr_layout_t *cand = calloc(cap ? cap : 1, sizeof *cand);
    if (!cand) {
        snprintf(why, why_len, "out of memory");
        return -1;
    }
    for (int t = t0; t <= t1; t++)
        for (int p = p0; p <= p1; p++) {
            tsr_layout_of(m, d, devs, t, p, &cand[n]);
            if (cand[n].valid) n++;
        }
    int k = tsr_layout_choose(cand, n, d->latency_target_ms, why, why_len);
    if (k < 0 && !n)
        snprintf(why, why_len, "no cut of it can be placed on the %d %s device(s) free for it",
                 devs->devices, tsr_device_name(d->device));
    if (k >= 0) *out = cand[k];
    free(cand);
    return k >= 0 ? 0 : -1;
}
