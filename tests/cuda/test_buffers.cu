/* test_buffers.cu: what the CUDA engine allocates against what the planner
 * counts, on the host.
 *
 * nvcc builds this as a host program, so it runs on machines without a
 * GPU.  The engine allocates exactly the buffers worker/cuda/buffers.c
 * lists; the planner prices a piece with common/budget.c's
 * tsr_piece_memory.  For many model shapes, tp/pp layouts, checkpoint
 * types, batching keys and KV budgets, each piece's list must add up to the
 * planner's weights, KV pool and reserve, so a change to either side that
 * the other does not follow fails here. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <string.h>

extern "C" {
#include <cmocka.h>
#include "common/budget.h"
#include "worker/cuda/buffers.h"
}

static tsr_model_info_t model(int H, int I, int L, int N, int K, int hd, int V, int tied,
                              int dtype_bytes)
{
    tsr_model_info_t m;
    memset(&m, 0, sizeof m);
    m.hidden_size = H, m.intermediate_size = I, m.num_hidden_layers = L;
    m.num_attention_heads = N, m.num_key_value_heads = K, m.head_dim = hd;
    m.vocab_size = V, m.tie_word_embeddings = tied, m.dtype_bytes = dtype_bytes;
    return m;
}

/* Llama 3 8B (BF16), Llama 3.2 1B (tied, head_dim 64), and two small ones:
 * an f32 checkpoint with a tied head, an odd layer count and a vocabulary
 * no tp divides, and an f16 one with head_dim 256. */
static tsr_model_info_t shape(int i)
{
    switch (i) {
    case 0: return model(4096, 14336, 32, 32, 8, 128, 128256, 0, 2);
    case 1: return model(2048, 8192, 16, 32, 8, 64, 128256, 1, 2);
    case 2: return model(64, 176, 5, 8, 4, 8, 1001, 1, 4);
    default: return model(1024, 2816, 7, 4, 4, 256, 32003, 0, 2);
    }
}

/* The piece the executor builds for (stage, rank) of d (worker/executor.c's
 * piece_spec), with the KV budget the coordinator sends for a GPU of
 * gpu_bytes (coordinator.c's kv_budget: the replica's tightest stage,
 * priced at stage 0).  Returns the replica's blocks, or 0 when a stage
 * does not fit that GPU (the planner places no piece there). */
static int piece(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage, int rank,
                 uint64_t gpu_bytes, tsr_piece_spec_t *spec)
{
    uint64_t kv_bytes = (uint64_t)d->kv_cache_mib << 20;
    int blocks = -1;
    if (!d->kv_cache_mib && gpu_bytes) {
        for (int s = 0; s < d->pipeline; s++) {
            int b = tsr_cuda_kv_blocks(m, d, s, gpu_bytes);
            if (blocks < 0 || b < blocks) blocks = b;
        }
        if (blocks < 1) return 0;
        kv_bytes = (uint64_t)blocks * tsr_cuda_block_bytes(m, d, 0);
    }
    memset(spec, 0, sizeof *spec);
    spec->tp_rank = rank, spec->tp_size = d->tensor, spec->stage = stage;
    spec->pp_size = d->pipeline, spec->max_seq_len = d->max_seq_len;
    tsr_layer_split(m->num_hidden_layers, d->pipeline, stage, &spec->layer_begin,
                    &spec->layer_end);
    tsr_step_rows(d->max_batch, d->prefill_chunk, d->max_seq_len, &spec->max_seqs,
                  &spec->max_tokens);
    spec->kv_blocks = tsr_kv_pool_blocks(m, d->tensor, d->pipeline, kv_bytes, spec->max_seqs,
                                         d->max_seq_len, TSR_KV_BLOCK,
                                         tsr_kv_row_bytes(TSR_KV_BF16, m->head_dim));
    if (blocks > 0) assert_int_equal(spec->kv_blocks, blocks);   /* bytes back to blocks */
    return spec->kv_blocks;
}

/* One piece's buffers against the planner's figures for its stage. */
static void check_piece(const tsr_model_info_t *m, const tsr_deployment_t *d, int stage,
                        int rank, uint64_t gpu_bytes, int *pieces)
{
    tsr_piece_spec_t spec;
    tsr_cuda_plan_t plan;
    if (!piece(m, d, stage, rank, gpu_bytes, &spec)) return;
    assert_int_equal(tsr_cuda_plan(m, &spec, &plan), 0);
    uint64_t w, k, r;
    tsr_piece_memory(m, d, stage, gpu_bytes, &w, &k, &r);
    const uint64_t pw = tsr_cuda_plan_bytes(&plan, TSR_CB_WEIGHTS),
                   pk = tsr_cuda_plan_bytes(&plan, TSR_CB_KV),
                   pr = tsr_cuda_plan_bytes(&plan, TSR_CB_RESERVE),
                   pc = tsr_cuda_plan_bytes(&plan, TSR_CB_CONTEXT);
    /* weights: rank 0 holds the widest vocabulary chunk, the one priced */
    if (rank == 0) assert_int_equal(pw, w);
    else assert_true(pw <= w);
    /* the reserve's buffers: all of the reserve but the context */
    assert_true(r >= TSR_CUDA_CONTEXT_BYTES);
    assert_int_equal(pr, r - TSR_CUDA_CONTEXT_BYTES);
    /* the pool: the replica's blocks of this stage's layers, at most what
     * the planner counted for the stage, and that when the count is the
     * same on every stage (a fixed budget, or no GPU size known) */
    assert_int_equal(pk, (uint64_t)spec.kv_blocks * tsr_cuda_block_bytes(m, d, stage));
    if (d->kv_cache_mib || !gpu_bytes) assert_int_equal(pk, k);
    else assert_true(pk <= k);
    /* the engine's small buffers on the context's share: cuBLAS's workspace
     * and, at these shapes, under 4 MiB of metadata and sampling arrays */
    assert_true(pc >= TSR_CUDA_WORKSPACE_BYTES);
    assert_true(pc - TSR_CUDA_WORKSPACE_BYTES < ((uint64_t)4 << 20));
    assert_true(pw + pk + pr + pc <= w + k + r);
    /* nothing is listed twice or left out: the parts are the whole */
    assert_int_equal(tsr_cuda_plan_bytes(&plan, -1), pw + pk + pr + pc);
    (*pieces)++;
}

static void test_cuda_buffers_add_up_to_the_planners_budget(void **state)
{
    (void)state;
    /* max_batch, prefill_chunk, max_seq_len: the defaults; a long context;
     * a chunk longer than max_seq_len (capped); many short sequences */
    static const int batching[][3] = {{0, 0, 4096}, {32, 512, 8192}, {7, 1000, 300},
                                      {256, 64, 2048}};
    static const uint64_t gpus[] = {0, (uint64_t)24 << 30, (uint64_t)80 << 30};
    int pieces = 0;
    for (int mi = 0; mi < 4; mi++) {
        const tsr_model_info_t m = shape(mi);
        for (int tp = 1; tp <= 8; tp *= 2) {
            if (m.num_attention_heads % tp || m.num_key_value_heads % tp ||
                m.intermediate_size % tp)
                continue;
            for (int pp = 1; pp <= 4 && pp <= m.num_hidden_layers; pp++)
                for (int bi = 0; bi < 4; bi++)
                    for (int kv = 0; kv < 2; kv++) {
                        tsr_deployment_t d;
                        memset(&d, 0, sizeof d);
                        d.device = TSR_DEVICE_CUDA, d.tensor = tp, d.pipeline = pp;
                        d.replicas = 1, d.gpu_memory_percent = 90;
                        d.max_batch = batching[bi][0], d.prefill_chunk = batching[bi][1];
                        d.max_seq_len = batching[bi][2];
                        d.kv_cache_mib = kv ? 512 : 0;
                        for (size_t g = 0; g < sizeof gpus / sizeof gpus[0]; g++)
                            for (int s = 0; s < pp; s++)
                                for (int r = 0; r < tp; r++)
                                    check_piece(&m, &d, s, r, gpus[g], &pieces);
                    }
        }
    }
    assert_true(pieces > 1000);   /* the loops reached the checks */
}

/* The list as the engine reads it: a tied head is the embedding on a
 * single stage and a buffer of its own on a pipeline; the last stage alone
 * holds logits and sampling; the metadata holds every block table. */
static void test_cuda_buffers_follow_the_piece(void **state)
{
    (void)state;
    const tsr_model_info_t m = shape(2);   /* tied */
    tsr_piece_spec_t spec;
    memset(&spec, 0, sizeof spec);
    spec.tp_size = 1, spec.pp_size = 1, spec.layer_end = m.num_hidden_layers;
    spec.max_seq_len = 100, spec.max_seqs = 3, spec.max_tokens = 19, spec.kv_blocks = 21;
    tsr_cuda_plan_t p;
    assert_int_equal(tsr_cuda_plan(&m, &spec, &p), 0);
    assert_int_equal(p.buf[TSR_CB_EMBED].count, 1);
    assert_int_equal(p.buf[TSR_CB_LM_HEAD].count, 0);
    assert_int_equal(p.buf[TSR_CB_WQKV].count, m.num_hidden_layers);
    assert_int_equal(p.buf[TSR_CB_SORT_TMP].count, 1);
    assert_int_equal(p.max_blocks_per_seq, 7);   /* 100 positions in blocks of 16 */
    assert_true(p.buf[TSR_CB_META].bytes >= p.meta_fixed + 3 * 7 * 4);

    spec.pp_size = 2, spec.layer_end = 3;          /* stage 0 of 2: no head, no logits */
    assert_int_equal(tsr_cuda_plan(&m, &spec, &p), 0);
    assert_int_equal(p.buf[TSR_CB_EMBED].count, 1);
    assert_int_equal(p.buf[TSR_CB_FINAL_NORM].count, 0);
    assert_int_equal(p.buf[TSR_CB_LM_HEAD].count, 0);
    assert_int_equal(tsr_cuda_plan_bytes(&p, TSR_CB_CONTEXT),
                     p.buf[TSR_CB_META].bytes + TSR_CUDA_WORKSPACE_BYTES);
    for (int id = TSR_CB_LOGITS; id <= TSR_CB_SORT_TMP; id++) assert_int_equal(p.buf[id].count, 0);

    spec.stage = 1, spec.layer_begin = 3, spec.layer_end = 5;   /* the last: its own head */
    assert_int_equal(tsr_cuda_plan(&m, &spec, &p), 0);
    assert_int_equal(p.buf[TSR_CB_EMBED].count, 0);
    assert_int_equal(p.buf[TSR_CB_LM_HEAD].count, 1);
    assert_int_equal(p.buf[TSR_CB_LM_HEAD].bytes, (size_t)m.vocab_size * m.hidden_size * 2);
    assert_int_equal(p.buf[TSR_CB_WQKV].count, 2);

    spec.tp_size = 3;                              /* 8 heads: no such piece */
    assert_int_equal(tsr_cuda_plan(&m, &spec, &p), -1);
}

/* The metadata's arrays lie in order, each on 16 bytes, the tables last. */
static void test_cuda_meta_layout(void **state)
{
    (void)state;
    static char base[4096] __attribute__((aligned(16)));
    tsr_cuda_meta_t md;
    size_t fixed;
    size_t n = tsr_cuda_meta_layout(base, 5, 3, 9, 4, &md, &fixed);
    assert_int_equal(tsr_cuda_meta_layout(NULL, 5, 3, 9, 4, NULL, NULL), n);
    assert_ptr_equal(md.tokens, base);
    assert_ptr_equal(md.row_pos, base + 32);       /* 5 ints, rounded up to 32 bytes */
    assert_ptr_equal(md.tile_row0, base + 96);
    assert_ptr_equal(md.samp_seed, base + 96 + 4 * 48 + 3 * 16);
    assert_ptr_equal(md.tables, base + fixed);
    assert_int_equal(fixed % 16, 0);
    assert_int_equal(n, fixed + 3 * 4 * 4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_buffers_add_up_to_the_planners_budget),
        cmocka_unit_test(test_cuda_buffers_follow_the_piece),
        cmocka_unit_test(test_cuda_meta_layout),
    };
    return cmocka_run_group_tests_name("buffers (the CUDA engine's allocations against budget.c)",
                                       tests, NULL, NULL);
}
