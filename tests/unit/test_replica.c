/* test_replica.c: when generation stops, and how the next token is picked. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "worker/engine.h"
#include "worker/replica.h"

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
    uint64_t rng = 1;
    assert_int_equal(tsr_sample(logits, 5, 0.0f, 1.0f, &rng), 1);
    assert_int_equal(rng, 1);  /* greedy draws nothing */
}

static void test_top_p_keeps_only_the_nucleus(void **state)
{
    (void)state;
    /* Probabilities about 0.29, 0.26, 0.24, 0.21: without the cut every
     * token comes up; with top_p 0.25 the nucleus is token 0 alone, and with
     * 0.5 it is tokens 0 and 1. */
    float logits[] = {1.0f, 0.9f, 0.8f, 0.7f};
    int seen[4] = {0, 0, 0, 0}, seen_half[4] = {0, 0, 0, 0}, seen_all[4] = {0, 0, 0, 0};
    for (uint64_t seed = 0; seed < 400; seed++) {
        uint64_t a = seed, b = seed, c = seed;
        seen[tsr_sample(logits, 4, 1.0f, 0.25f, &a)]++;
        seen_half[tsr_sample(logits, 4, 1.0f, 0.5f, &b)]++;
        seen_all[tsr_sample(logits, 4, 1.0f, 1.0f, &c)]++;
    }
    assert_int_equal(seen[0], 400);
    assert_true(seen_half[0] > 0 && seen_half[1] > 0);
    assert_int_equal(seen_half[2] + seen_half[3], 0);
    for (int i = 0; i < 4; i++) assert_true(seen_all[i] > 40);
}

static void test_nan_parameters_fall_back_safely(void **state)
{
    (void)state;
    float logits[] = {0.1f, 2.0f, 0.3f};
    uint64_t rng = 3;
    assert_int_equal(tsr_sample(logits, 3, NAN, 0.9f, &rng), 1);  /* greedy */
    int32_t t = tsr_sample(logits, 3, 1.0f, NAN, &rng);            /* no cut */
    assert_true(t >= 0 && t < 3);
}

static void test_sampling_follows_the_distribution_and_the_seed(void **state)
{
    (void)state;
    /* Two equally likely tokens: a fair draw gives both, in about equal
     * numbers, and the same seed gives the same sequence. */
    float logits[] = {1.0f, 1.0f, -30.0f};
    int counts[3] = {0, 0, 0};
    uint64_t a = 42, b = 42;
    for (int i = 0; i < 2000; i++) {
        int32_t x = tsr_sample(logits, 3, 1.0f, 1.0f, &a);
        assert_int_equal(x, tsr_sample(logits, 3, 1.0f, 1.0f, &b));
        counts[x]++;
    }
    assert_int_equal(counts[2], 0);
    assert_true(counts[0] > 850 && counts[1] > 850);
}

static void test_low_temperature_sharpens(void **state)
{
    (void)state;
    float logits[] = {1.0f, 1.5f};
    int top = 0;
    uint64_t rng = 9;
    for (int i = 0; i < 1000; i++) top += tsr_sample(logits, 2, 0.05f, 1.0f, &rng) == 1;
    assert_true(top > 990);
}

/* ---- a garbage step from the previous stage ------------------------------------ */

static tsr_model_info_t fake_model = {.hidden_size = 4, .vocab_size = 8};
static const tsr_model_info_t *fake_model_of(const tsr_engine_t *e)
{
    (void)e;
    return &fake_model;
}
static int garbage_recv(tsr_comm_t *c, int peer, void *buf, size_t len, int timeout_ms,
                        char *err, size_t errlen)
{
    (void)c, (void)peer, (void)timeout_ms, (void)err, (void)errlen;
    memset(buf, 0xab, len);  /* no magic, an op and a count from nowhere */
    return 0;
}
static int never_stop(void *arg)
{
    (void)arg;
    return 0;
}

static void test_garbage_step_is_refused_naming_what_is_wrong(void **state)
{
    (void)state;
    static const tsr_coll_ops_t ops = {.name = "fake", .recv = garbage_recv};
    static const tsr_engine_ops_t eng = {.name = "fake", .model = fake_model_of};
    tsr_replica_rank_t r = {.eng_ops = &eng, .ops = &ops, .prev = (tsr_comm_t *)&r,
                            .spec = {0, 1, 1, 2, 4, 8, 64, 1}};
    tsr_replica_io_t io = {.should_stop = never_stop};
    char err[256] = "";
    assert_int_equal(tsr_replica_run(&r, &io, err, sizeof err), -1);
    assert_non_null(strstr(err, "malformed step from the previous stage: magic 0xabababab"));
    assert_non_null(strstr(err, "max_seq_len 64"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_any_eos_id_ends_generation),
        cmocka_unit_test(test_max_tokens_counts_the_generated_tokens),
        cmocka_unit_test(test_max_seq_len_stops_when_no_position_is_left),
        cmocka_unit_test(test_greedy_picks_the_first_maximum),
        cmocka_unit_test(test_top_p_keeps_only_the_nucleus),
        cmocka_unit_test(test_nan_parameters_fall_back_safely),
        cmocka_unit_test(test_sampling_follows_the_distribution_and_the_seed),
        cmocka_unit_test(test_low_temperature_sharpens),
        cmocka_unit_test(test_garbage_step_is_refused_naming_what_is_wrong),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
