/* test_layout.c: the candidate cuts of a deployment (coordinator/layout.c): their
 * memory against hand-computed figures, and the choice among them. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "common/budget.h"
#include "coordinator/layout.h"

#define GIB (1ull << 30)

/* A small model whose figures are easy to add up by hand. */
static tsr_model_info_t small_model(void)
{
    tsr_model_info_t m = {0};
    m.hidden_size = 64;
    m.intermediate_size = 128;
    m.num_hidden_layers = 4;
    m.num_attention_heads = 4;
    m.num_key_value_heads = 2;
    m.vocab_size = 256;
    m.head_dim = 16;
    m.dtype_bytes = 2;
    return m;
}

/* Llama-3-70B's shape. */
static tsr_model_info_t big_model(void)
{
    tsr_model_info_t m = {0};
    m.hidden_size = 8192;
    m.intermediate_size = 28672;
    m.num_hidden_layers = 80;
    m.num_attention_heads = 64;
    m.num_key_value_heads = 8;
    m.vocab_size = 128256;
    m.head_dim = 128;
    m.dtype_bytes = 2;
    return m;
}

static tsr_deployment_t deployment(tsr_device_t dev)
{
    tsr_deployment_t d = {0};
    d.device = dev;
    d.tensor = d.pipeline = d.replicas = 1;
    d.max_seq_len = 64;
    d.max_batch = 2;
    d.prefill_chunk = 16;
    d.gpu_memory_percent = 90;
    return d;
}

static tsr_devices_t gpus(int devices, int per_node, uint64_t memory)
{
    tsr_devices_t v = {.devices = devices, .per_node = per_node, .per_domain = per_node,
                       .memory = memory, .mem_gbs = 2000, .gflops = 400000,
                       .link_gbs = {0, 300, 20, 12}, .link_us = {0, 10, 20, 50}};
    return v;
}

static const tsr_layout_t *find(const tsr_layout_t *c, size_t n, int t, int p)
{
    for (size_t i = 0; i < n; i++)
        if (c[i].tensor == t && c[i].pipeline == p) return &c[i];
    return NULL;
}

/* A cpu piece holds its weights at 4 bytes (f32 products) and a KV pool of max_batch
 * sequences of max_seq_len at f32: added up by hand. */
static void test_cpu_memory_is_weights_and_kv_added_by_hand(void **state)
{
    (void)state;
    tsr_model_info_t m = small_model();
    tsr_deployment_t d = deployment(TSR_DEVICE_CPU);
    tsr_devices_t devs = {.devices = 1, .per_node = 1, .mem_gbs = 10, .gflops = 100,
                          .link_gbs = {0, 1, 1, 1}, .link_us = {0, 1, 1, 1}};
    tsr_layout_t c[8];
    size_t n = tsr_layout_candidates(&m, &d, &devs, c, 8);
    assert_int_equal(n, 1);  /* one device: one cut */
    /* a layer: two norms (64 each), q and o (64x64), k and v (64x32), gate, up and
     * down (64x128): 36,992; four of them, the embedding and head (256x64 each) and
     * the final norm: 180,800 parameters at 4 bytes */
    assert_int_equal(c[0].weights, 180800u * 4);
    /* KV: 2 sequences x 64 positions (4 blocks of 16 each) x 4 layers x 2 KV heads
     * x 16 dims x 4 bytes, keys and values */
    assert_int_equal(c[0].need, 180800u * 4 + 2u * 64 * 4 * 2 * 16 * 4 * 2);
    assert_true(c[0].valid);
    assert_true(c[0].fits);  /* no memory given: not checked */
    assert_int_equal(c[0].replicas, 1);
}

/* A cuda cut needs what the coordinator checks a GPU for: tsr_piece_need of its
 * fullest stage (weights, reserve and one sequence's KV over gpu_memory_percent). */
static void test_cuda_memory_is_the_engines_need(void **state)
{
    (void)state;
    tsr_model_info_t m = big_model();
    tsr_deployment_t d = deployment(TSR_DEVICE_CUDA);
    d.max_seq_len = 8192;
    tsr_devices_t devs = gpus(8, 8, 80 * GIB);
    tsr_layout_t c[256];
    size_t n = tsr_layout_candidates(&m, &d, &devs, c, 256);
    assert_true(n <= 256);
    const tsr_layout_t *x = find(c, n, 2, 2);
    assert_non_null(x);
    tsr_deployment_t dd = d;
    dd.tensor = dd.pipeline = 2;
    uint64_t most = 0;
    for (int s = 0; s < 2; s++)
        if (tsr_piece_need(&m, &dd, s) > most) most = tsr_piece_need(&m, &dd, s);
    assert_int_equal(x->need, most);
    /* and by hand, roughly: 70.6 G parameters in BF16 over four GPUs, plus the
     * reserve, over 90% */
    assert_true(x->need > 36 * GIB && x->need < 42 * GIB);
    assert_null(find(c, n, 3, 1));   /* 64 heads do not divide by 3 */
    assert_non_null(find(c, n, 8, 1));
    assert_null(find(c, n, 16, 1));  /* more than a node */
}

/* A model that fits one GPU gets tensor 1 pipeline 1, and every GPU is a replica. */
static void test_a_model_that_fits_one_device_gets_one_and_replicas(void **state)
{
    (void)state;
    tsr_model_info_t m = big_model();
    m.num_hidden_layers = 8;  /* about 10 GB */
    tsr_deployment_t d = deployment(TSR_DEVICE_CUDA);
    d.replicas = 0;  /* as many as the devices hold */
    tsr_devices_t devs = gpus(8, 8, 80 * GIB);
    tsr_layout_t c[128];
    size_t n = tsr_layout_candidates(&m, &d, &devs, c, 128);
    char why[256];
    int k = tsr_layout_choose(c, n, 0, why, sizeof why);
    assert_true(k >= 0);
    assert_int_equal(c[k].tensor, 1);
    assert_int_equal(c[k].pipeline, 1);
    assert_int_equal(c[k].replicas, 8);
    assert_non_null(strstr(why, "fewest devices"));
}

/* A model that needs four GPUs on nodes of two gets tensor 2 (inside a node) and
 * pipeline 2 (across them): not pipeline 4, slower per token, nor tensor 4, which
 * would span nodes. */
static void test_a_model_that_needs_four_gpus_on_two_gpu_nodes_gets_tp2_pp2(void **state)
{
    (void)state;
    tsr_model_info_t m = big_model();
    tsr_deployment_t d = deployment(TSR_DEVICE_CUDA);
    d.max_seq_len = 8192;
    d.replicas = 0;
    tsr_devices_t devs = gpus(8, 2, 40 * GIB);
    tsr_layout_t c[256];
    size_t n = tsr_layout_candidates(&m, &d, &devs, c, 256);
    char why[256];
    int k = tsr_layout_choose(c, n, 0, why, sizeof why);
    assert_true(k >= 0);
    assert_int_equal(c[k].tensor, 2);
    assert_int_equal(c[k].pipeline, 2);
    assert_int_equal(c[k].replicas, 2);
    assert_int_equal(c[k].link, TSR_LINK_NVLINK);
    const tsr_layout_t *p4 = find(c, n, 1, 4);
    assert_non_null(p4);
    assert_true(p4->fits);
    assert_true(p4->ms_token > c[k].ms_token);
    assert_null(find(c, n, 4, 1));
    assert_non_null(strstr(why, "fastest per token"));
    /* an explicit tp 2 x pp 1 does not fit, and says by how much */
    const tsr_layout_t *t2 = find(c, n, 2, 1);
    assert_non_null(t2);
    assert_false(t2->fits);
    assert_true(t2->need > t2->have + 30 * GIB);
}

/* Nothing fits: -1, and the reason names the closest cut and its need. */
static void test_nothing_fits_says_what_the_closest_needs(void **state)
{
    (void)state;
    tsr_model_info_t m = big_model();
    tsr_deployment_t d = deployment(TSR_DEVICE_CUDA);
    tsr_devices_t devs = gpus(4, 4, 16 * GIB);
    tsr_layout_t c[256];
    size_t n = tsr_layout_candidates(&m, &d, &devs, c, 256);
    char why[256];
    assert_int_equal(tsr_layout_choose(c, n, 0, why, sizeof why), -1);
    assert_non_null(strstr(why, "no cut fits"));
    assert_non_null(strstr(why, "where each has 16.00 GiB"));
}

/* A latency target rules out the cuts too slow for it: the model fits one GPU, but
 * only a tensor group of four meets the target. */
static void test_a_latency_target_takes_more_devices(void **state)
{
    (void)state;
    tsr_model_info_t m = big_model();
    m.num_hidden_layers = 8;
    tsr_deployment_t d = deployment(TSR_DEVICE_CUDA);
    d.replicas = 0;
    tsr_devices_t devs = gpus(8, 8, 80 * GIB);
    tsr_layout_t c[128];
    size_t n = tsr_layout_candidates(&m, &d, &devs, c, 128);
    const tsr_layout_t *one = find(c, n, 1, 1), *four = find(c, n, 4, 1);
    assert_non_null(one);
    assert_non_null(four);
    assert_true(four->ms_token < one->ms_token);
    double target = (four->ms_token + find(c, n, 2, 1)->ms_token) / 2;
    char why[256];
    int k = tsr_layout_choose(c, n, target, why, sizeof why);
    assert_true(k >= 0);
    assert_int_equal(c[k].tensor * c[k].pipeline, 4);
    assert_int_equal(c[k].tensor, 4);
    assert_int_equal(c[k].replicas, 2);
    assert_non_null(strstr(why, "latency target"));
    assert_int_equal(tsr_layout_choose(c, n, four->ms_token / 100, why, sizeof why), -1);
    assert_non_null(strstr(why, "no cut meets"));
}

/* CPU workers sharing a node's cores: tp 2 x pp 2 of single-thread workers on 2 cores.
 * One sequence keeps one stage (2 threads) busy at a time: its estimate is as without the
 * limit; max_batch sequences keep all four busy, each getting half a core: the replica's
 * tokens/s is half.  On 4 cores nothing changes. */
static void test_cpu_workers_sharing_cores_get_their_share(void **state)
{
    (void)state;
    tsr_model_info_t m = small_model();
    tsr_deployment_t d = deployment(TSR_DEVICE_CPU);
    tsr_devices_t devs = {.devices = 4, .per_node = 4, .mem_gbs = 10, .gflops = 100,
                          .link_gbs = {0, 1e9, 1e9, 1e9}, .link_us = {0, 0, 0, 0}};  /* links: free */
    tsr_layout_t alone, two, four;
    tsr_layout_of(&m, &d, &devs, 2, 2, &alone);
    devs.cores = 2, devs.threads = 1;
    tsr_layout_of(&m, &d, &devs, 2, 2, &two);
    devs.cores = 4;
    tsr_layout_of(&m, &d, &devs, 2, 2, &four);
    assert_true(alone.valid && two.valid && four.valid);
    assert_true(fabs(two.ms_token - alone.ms_token) < 1e-9 * alone.ms_token);
    assert_true(fabs(two.tok_s - alone.tok_s / 2) < 1e-6 * alone.tok_s);
    assert_true(fabs(four.tok_s - alone.tok_s) < 1e-9 * alone.tok_s);
    /* two threads a worker on 2 cores: one stage's two workers already want 4 */
    devs.cores = 2, devs.threads = 2;
    tsr_layout_t fat;
    tsr_layout_of(&m, &d, &devs, 2, 2, &fat);
    assert_true(fabs(fat.ms_token - 2 * alone.ms_token) < 1e-6 * alone.ms_token);
    /* threads not given: a worker's default, every core */
    devs.threads = 0;
    tsr_layout_t deflt;
    tsr_layout_of(&m, &d, &devs, 2, 2, &deflt);
    assert_true(fabs(deflt.ms_token - fat.ms_token) < 1e-9 * fat.ms_token);
    /* every replica of a node busy: tp 1 x pp 1 on 4 single-thread workers of 2 cores
     * gives each replica half a core in the total, not in one replica's own figure */
    d.replicas = 4;
    devs.threads = 1;
    tsr_layout_t four_reps;
    tsr_layout_of(&m, &d, &devs, 1, 1, &four_reps);
    assert_int_equal(four_reps.replicas, 4);
    assert_true(fabs(four_reps.tok_s_all - 2 * four_reps.tok_s) < 1e-6 * four_reps.tok_s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_memory_is_weights_and_kv_added_by_hand),
        cmocka_unit_test(test_cuda_memory_is_the_engines_need),
        cmocka_unit_test(test_a_model_that_fits_one_device_gets_one_and_replicas),
        cmocka_unit_test(test_a_model_that_needs_four_gpus_on_two_gpu_nodes_gets_tp2_pp2),
        cmocka_unit_test(test_nothing_fits_says_what_the_closest_needs),
        cmocka_unit_test(test_a_latency_target_takes_more_devices),
        cmocka_unit_test(test_cpu_workers_sharing_cores_get_their_share),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
