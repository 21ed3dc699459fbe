/* test_replica.c: when generation stops, how the next token is picked, and how a
 * run ends on a bad step or a broken pipeline link. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "worker/engine.h"
#include "worker/replica.h"
#include "worker/kvpool.h"
#include "worker/replica_ctl.h"

static tsr_model_info_t model_with_eos(int n, const int *ids)
{
    tsr_model_info_t m;
    memset(&m, 0, sizeof m);
    m.n_eos = n;
    for (int i = 0; i < n; i++) m.eos_ids[i] = ids[i];
    return m;
}

static void test_any_eos_id_ends_generation(void **state)
{
    (void)state;
    int ids[] = {2, 128001};
    tsr_model_info_t m = model_with_eos(2, ids);
    assert_string_equal(tsr_finish_reason(&m, 2, 0, 5, 100, 256), "eos");
    assert_string_equal(tsr_finish_reason(&m, 128001, 3, 5, 100, 256), "eos");
    assert_null(tsr_finish_reason(&m, 7, 3, 5, 100, 256));
}

static void test_max_tokens_counts_the_generated_tokens(void **state)
{
    (void)state;
    tsr_model_info_t m = model_with_eos(0, NULL);
    assert_null(tsr_finish_reason(&m, 7, 8, 5, 10, 256));          /* 9th of 10 */
    assert_string_equal(tsr_finish_reason(&m, 7, 9, 5, 10, 256), "max_tokens");  /* 10th */
    assert_string_equal(tsr_finish_reason(&m, 7, 0, 5, 1, 256), "max_tokens");
}

static void test_max_seq_len_stops_when_no_position_is_left(void **state)
{
    (void)state;
    tsr_model_info_t m = model_with_eos(0, NULL);
    /* prompt 250, max_seq_len 256: tokens 0..5 are fed back at positions
     * 250..255; after the 7th (index 6) the next would need position 256. */
    assert_null(tsr_finish_reason(&m, 7, 5, 250, 100, 256));
    assert_string_equal(tsr_finish_reason(&m, 7, 6, 250, 100, 256), "max_seq_len");
    /* a prompt that fills the sequence still gets its one token */
    assert_string_equal(tsr_finish_reason(&m, 7, 0, 256, 100, 256), "max_seq_len");
}

static void test_greedy_picks_the_first_maximum(void **state)
{
    (void)state;
    float logits[] = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f};
    assert_int_equal(tsr_sample(logits, 5, 0.0f, 1.0f, 1, 0), 1);
    assert_int_equal(tsr_sample(logits, 5, -1.0f, 0.5f, 99, 7), 1);
}

/* Greedy is the scan "keep the first id whose logit beats the best so far"
 * whatever the length, ties, NaNs, signed zeros and infinities; the sampler
 * finds it 8 lanes at a time, so lengths around and past the lanes, and
 * every special value at the start, in the middle and in the tail. */
static int32_t first_max_scan(const float *x, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static void test_greedy_is_the_first_maximum_scan(void **state)
{
    (void)state;
    enum { N = 32000 };
    static float x[N];
    const float special[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, 1.0f};
    uint64_t r = 12345;
    for (int trial = 0; trial < 3000; trial++) {
        int n = trial < 2000 ? 1 + trial % 40 : trial < 2990 ? 1 + (int)(r % 300) : N;
        for (int i = 0; i < n; i++) {
            r = r * 6364136223846793005ULL + 1442695040888963407ULL;
            /* few distinct values, so ties are common */
            x[i] = (float)((int)(r >> 33) % 7) - 3.0f;
            if ((r >> 20) % 11 == 0) x[i] = special[(r >> 40) % 8];
        }
        assert_int_equal(tsr_sample(x, n, 0.0f, 1.0f, 1, 0), first_max_scan(x, n));
    }
    float nan_first[] = {NAN, 5.0f, 7.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 9.0f};
    assert_int_equal(tsr_sample(nan_first, 10, 0.0f, 1.0f, 1, 0), 0);
    float zeros[] = {-0.0f, 0.0f, -1.0f, -2.0f, -3.0f, -4.0f, -5.0f, -6.0f, 0.0f};
    assert_int_equal(tsr_sample(zeros, 9, 0.0f, 1.0f, 1, 0), 0);
    static float last[N];
    for (int i = 0; i < N; i++) last[i] = -1.0f;
    last[N - 1] = 2.0f;   /* the last lane of the last group of 8 */
    assert_int_equal(tsr_sample(last, N, 0.0f, 1.0f, 1, 0), N - 1);
    assert_int_equal(tsr_sample(last, N - 3, 0.0f, 1.0f, 1, 0), 0);
}

static void test_top_p_keeps_only_the_nucleus(void **state)
{
    (void)state;
    /* Probabilities about 0.29, 0.26, 0.24, 0.21: without the cut every
     * token comes up; with top_p 0.25 the nucleus is token 0 alone, and with
     * 0.5 it is tokens 0 and 1. */
    float logits[] = {1.0f, 0.9f, 0.8f, 0.7f};
    int seen[4] = {0, 0, 0, 0}, seen_half[4] = {0, 0, 0, 0}, seen_all[4] = {0, 0, 0, 0};
    for (uint64_t pos = 0; pos < 400; pos++) {
        seen[tsr_sample(logits, 4, 1.0f, 0.25f, 5, pos)]++;
        seen_half[tsr_sample(logits, 4, 1.0f, 0.5f, 5, pos)]++;
        seen_all[tsr_sample(logits, 4, 1.0f, 1.0f, 5, pos)]++;
    }
    assert_int_equal(seen[0], 400);
    assert_true(seen_half[0] > 0 && seen_half[1] > 0);
    assert_int_equal(seen_half[2] + seen_half[3], 0);
    for (int i = 0; i < 4; i++) assert_true(seen_all[i] > 40);
}

static void test_nan_parameters_fall_back_safely(void **state)
{
    (void)state;
    float logits[] = {1.0f, 1.0f, 1.0f};
    assert_int_equal(tsr_sample(logits, 3, NAN, 0.9f, 3, 0), 0);  /* greedy: the first maximum */
    /* A NaN top_p means no cut, not "the top token only": all three come up. */
    int seen[3] = {0, 0, 0};
    for (uint64_t pos = 0; pos < 300; pos++) seen[tsr_sample(logits, 3, 1.0f, NAN, 3, pos)]++;
    for (int i = 0; i < 3; i++) assert_true(seen[i] > 50);
}

static void test_the_draw_depends_on_seed_and_position_only(void **state)
{
    (void)state;
    /* Two equally likely tokens: a fair draw gives both in about equal
     * numbers; the token at a position is the same whatever was drawn
     * before it (so batching and resuming cannot change it), and another
     * seed gives another sequence. */
    float logits[] = {1.0f, 1.0f, -30.0f};
    int counts[3] = {0, 0, 0}, same_other_seed = 0;
    int32_t fwd[2000];
    for (int i = 0; i < 2000; i++) {
        fwd[i] = tsr_sample(logits, 3, 1.0f, 1.0f, 42, (uint64_t)i);
        counts[fwd[i]]++;
        same_other_seed += fwd[i] == tsr_sample(logits, 3, 1.0f, 1.0f, 43, (uint64_t)i);
    }
    for (int i = 1999; i >= 0; i--)
        assert_int_equal(fwd[i], tsr_sample(logits, 3, 1.0f, 1.0f, 42, (uint64_t)i));
    assert_int_equal(counts[2], 0);
    assert_true(counts[0] > 850 && counts[1] > 850);
    assert_true(same_other_seed < 1200);
}

static void test_low_temperature_sharpens(void **state)
{
    (void)state;
    float logits[] = {1.0f, 1.5f};
    int top = 0;
    for (uint64_t pos = 0; pos < 1000; pos++) top += tsr_sample(logits, 2, 0.05f, 1.0f, 9, pos) == 1;
    assert_true(top > 990);
}

/* ---- a garbage step from the leader ---------------------------------------------- */

static tsr_model_info_t fake_model = {.hidden_size = 4, .vocab_size = 8};
static const tsr_model_info_t *fake_model_of(const tsr_engine_t *e)
{
    (void)e;
    return &fake_model;
}
static void fake_kv_usage(const tsr_engine_t *e, int *used, int *total)
{
    (void)e;
    *used = 0;
    *total = 1;
}
static int garbage_group(tsr_comm_t *c, const tsr_p2p_t *ops, int n, int timeout_ms, char *err,
                         size_t errlen)
{
    (void)c, (void)timeout_ms, (void)err, (void)errlen;
    for (int i = 0; i < n; i++)   /* no magic, an op and counts from nowhere */
        if (!ops[i].is_send) memset(ops[i].buf.ptr, 0xab, ops[i].buf.count * tsr_dtype_size(ops[i].buf.dtype));
    return 0;
}
static int never_stop(void *arg)
{
    (void)arg;
    return 0;
}
static int released[8];
static void fake_release(tsr_engine_t *e, int slot)
{
    (void)e;
    if (slot >= 0 && slot < 8) released[slot]++;
}

static void test_a_run_frees_every_slot_and_refuses_a_garbage_step_naming_what_is_wrong(void **state)
{
    (void)state;
    static const tsr_coll_ops_t ops = {.name = "fake", .group = garbage_group};
    static const tsr_engine_ops_t eng = {.name = "fake", .model = fake_model_of,
                                         .kv_usage = fake_kv_usage, .release = fake_release};
    tsr_replica_rank_t r = {.eng_ops = &eng, .ops = &ops, .ctl_ops = &ops,
                            .ctl = (tsr_comm_t *)&r, .prev = (tsr_comm_t *)&r,
                            .spec = {0, 1, 1, 2, 4, 8, 64, 4, 36, 16, 1}};
    tsr_replica_io_t io = {.should_stop = never_stop};
    char err[256] = "";
    assert_int_equal(tsr_replica_run(&r, &io, err, sizeof err), -1);
    assert_non_null(strstr(err, "malformed step from the leader: magic 0xabababab"));
    assert_non_null(strstr(err, "limits 4, 4, 36"));
    /* Before anything, every slot of the engine was freed: a kept engine may
     * hold blocks of the replica's last run. */
    for (int s = 0; s < 8; s++) assert_int_equal(released[s], s < 4 ? 1 : 0);
}

/* ---- a pipeline link's failure ---------------------------------------------------- */

static int ctl_calls;
/* The leader's side of the control channel: one step of one prompt token. */
static int one_step_group(tsr_comm_t *c, const tsr_p2p_t *ops, int n, int timeout_ms, char *err,
                          size_t errlen)
{
    (void)c, (void)n, (void)timeout_ms;
    void *p = ops[0].buf.ptr;
    switch (ctl_calls++) {
    case 0:
        *(tsr_ctl_hdr_t *)p = (tsr_ctl_hdr_t){TSR_CTL_MAGIC, TSR_CTL_STEP, 7, 1, 0, 1, 0};
        return 0;
    case 1:
        *(tsr_ctl_entry_t *)p = (tsr_ctl_entry_t){.req = 9, .n = 1, .prompt_len = 1, .max_tokens = 4};
        *(int32_t *)((tsr_ctl_entry_t *)p + 1) = 3;
        return 0;
    default:   /* the leader is gone: the run must have ended before */
        snprintf(err, errlen, "control channel asked too often");
        return -1;
    }
}
/* The tensor channel: each pipeline link's operation fails as the link's
 * backend would tell it, naming the pair's rank. */
static bool link_recv_fails;
static int link_group(tsr_comm_t *c, const tsr_p2p_t *ops, int n, int timeout_ms, char *err,
                      size_t errlen)
{
    (void)c, (void)n, (void)timeout_ms;
    if (ops[0].is_send == link_recv_fails) return 0;
    snprintf(err, errlen, "send/recv did not complete: rank %d is dead or stalled", ops[0].peer);
    return -1;
}
static float hidden_rows[36 * 4];
static tsr_buf_t fake_hidden(tsr_engine_t *e, int which)
{
    (void)e, (void)which;
    return tsr_host_buf(hidden_rows, 36 * 4, TSR_DT_F32);
}
static int stepped;
static int fake_step(tsr_engine_t *e, const tsr_batch_t *b, int32_t *sampled, char *err,
                     size_t errlen)
{
    (void)e, (void)sampled, (void)err, (void)errlen;
    assert_int_equal(b->n_entries, 1);
    stepped++;
    return 0;
}

static void test_a_pipeline_link_failure_is_told_as_the_link_s(void **state)
{
    (void)state;
    static const tsr_coll_ops_t ctl = {.name = "fake-ctl", .group = one_step_group};
    static const tsr_coll_ops_t links = {.name = "fake-links", .group = link_group};
    static const tsr_engine_ops_t eng = {.name = "fake", .model = fake_model_of,
                                         .kv_usage = fake_kv_usage, .release = fake_release,
                                         .hidden = fake_hidden, .step = fake_step};
    for (int recv_fails = 1; recv_fails >= 0; recv_fails--) {
        /* The middle stage of three, tp 1: rank 1 of its link from stage 0,
         * rank 0 of its link to stage 2. */
        tsr_replica_rank_t r = {.eng_ops = &eng, .ops = &links, .ctl_ops = &ctl,
                                .ctl = (tsr_comm_t *)&r, .prev = (tsr_comm_t *)&r,
                                .next = (tsr_comm_t *)&r,
                                .spec = {0, 1, 1, 3, 4, 8, 64, 4, 36, 16, 1}};
        tsr_replica_io_t io = {.should_stop = never_stop};
        char err[256] = "";
        ctl_calls = stepped = 0;
        link_recv_fails = recv_fails;
        assert_int_equal(tsr_replica_run(&r, &io, err, sizeof err), -1);
        assert_int_equal(ctl_calls, 2);
        if (recv_fails) {
            assert_int_equal(stepped, 0);
            assert_string_equal(err, "the pipeline link from stage 0 (its rank 0 is the earlier "
                                     "stage): send/recv did not complete: rank 0 is dead or stalled");
        } else {
            assert_int_equal(stepped, 1);
            assert_string_equal(err, "the pipeline link to stage 2 (its rank 0 is the earlier "
                                     "stage): send/recv did not complete: rank 1 is dead or stalled");
        }
    }
}

/* ---- a step's prefix-cache keys ---------------------------------------------------- */

static int key_case;
/* The leader's side: one step whose entry attaches one cached block at position 16;
 * case 0 names a key this rank does not hold, case 1 gives two keys for the one. */
static int keyed_step_group(tsr_comm_t *c, const tsr_p2p_t *ops, int n, int timeout_ms, char *err,
                            size_t errlen)
{
    (void)c, (void)n, (void)timeout_ms;
    void *p = ops[0].buf.ptr;
    switch (ctl_calls++) {
    case 0:
        *(tsr_ctl_hdr_t *)p = (tsr_ctl_hdr_t){TSR_CTL_MAGIC, TSR_CTL_STEP, 7, 1, 0, 16,
                                              key_case == 0 ? 1 : 2};
        return 0;
    case 1: {
        tsr_ctl_entry_t *e = p;
        *e = (tsr_ctl_entry_t){.req = 9, .slot = 0, .pos = 16, .n = 16, .prompt_len = 33,
                               .max_tokens = 4, .n_attach = 1};
        uint64_t *k = (uint64_t *)(e + 1);
        k[0] = 12345;
        k[1] = 6789;
        return 0;
    }
    default:
        snprintf(err, errlen, "control channel asked too often");
        return -1;
    }
}
static tsr_kvpool_t *rank_pool;
static tsr_kvpool_t *fake_kvpool(tsr_engine_t *e)
{
    (void)e;
    return rank_pool;
}

static void test_a_step_naming_a_cached_block_this_rank_lacks_or_miscounting_keys_is_refused(
    void **state)
{
    (void)state;
    static const tsr_coll_ops_t ctl = {.name = "fake-ctl", .group = keyed_step_group};
    static const tsr_engine_ops_t eng = {.name = "fake", .model = fake_model_of,
                                         .kv_usage = fake_kv_usage, .release = fake_release,
                                         .hidden = fake_hidden, .step = fake_step,
                                         .kvpool = fake_kvpool};
    rank_pool = tsr_kvpool_new(16, 4, 64);
    for (key_case = 0; key_case < 2; key_case++) {
        tsr_replica_rank_t r = {.eng_ops = &eng, .ops = &ctl, .ctl_ops = &ctl,
                                .ctl = (tsr_comm_t *)&r, .prev = (tsr_comm_t *)&r,
                                .spec = {0, 1, 1, 2, 4, 8, 64, 4, 36, 16, 1}};
        tsr_replica_io_t io = {.should_stop = never_stop};
        char err[256] = "";
        ctl_calls = stepped = 0;
        assert_int_equal(tsr_replica_run(&r, &io, err, sizeof err), -1);
        assert_int_equal(stepped, 0);
        if (key_case == 0)
            assert_string_equal(err, "slot 0 cannot take the 1 cached block(s) the leader named: "
                                     "this rank's prefix cache differs from the leader's, or "
                                     "the slot is in use");
        else
            assert_string_equal(err, "malformed step from the leader: 2 keys for entries that "
                                     "take 1");
        assert_int_equal(tsr_kvpool_used(rank_pool), 0);
    }
    tsr_kvpool_destroy(&rank_pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_any_eos_id_ends_generation),
        cmocka_unit_test(test_max_tokens_counts_the_generated_tokens),
        cmocka_unit_test(test_max_seq_len_stops_when_no_position_is_left),
        cmocka_unit_test(test_greedy_picks_the_first_maximum),
        cmocka_unit_test(test_greedy_is_the_first_maximum_scan),
        cmocka_unit_test(test_top_p_keeps_only_the_nucleus),
        cmocka_unit_test(test_nan_parameters_fall_back_safely),
        cmocka_unit_test(test_the_draw_depends_on_seed_and_position_only),
        cmocka_unit_test(test_low_temperature_sharpens),
        cmocka_unit_test(test_a_run_frees_every_slot_and_refuses_a_garbage_step_naming_what_is_wrong),
        cmocka_unit_test(test_a_pipeline_link_failure_is_told_as_the_link_s),
        cmocka_unit_test(test_a_step_naming_a_cached_block_this_rank_lacks_or_miscounting_keys_is_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
