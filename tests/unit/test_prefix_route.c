/* test_prefix_route.c: the router's estimate of each replica's prefix cache
 * (coordinator/prefix_route.h): it holds the keys routed to a replica up to
 * the replica's pool size, oldest out first and of one chain the deepest
 * first, as the replica evicts (a key added again is new again); it forgets
 * as many of the oldest keys as the replica reports it evicted (a size not
 * reported keeps it); another epoch of the replica's leader empties it; replicas and
 * deployments are apart.  (Its place in routing: test_coordinator.) */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>

#include "coordinator/prefix_route.h"

static uint64_t keys[64];

static int setup(void **state)
{
    (void)state;
    for (int i = 0; i < 64; i++) keys[i] = 1000 + (uint64_t)i;
    return 0;
}

static void test_it_holds_up_to_the_pool_size_oldest_out_first(void **state)
{
    (void)state;
    tsr_prefix_route_t *p = tsr_prefix_route_new();
    tsr_prefix_replica_t rep = {7, 8, 0};
    tsr_prefix_route_add(p, "d", 0, &rep, keys, 6);
    assert_int_equal(tsr_prefix_route_match(p, "d", 0, &rep, keys, 6), 6);
    assert_int_equal(tsr_prefix_route_match(p, "d", 1, &rep, keys, 6), 0);   /* another replica */
    assert_int_equal(tsr_prefix_route_match(p, "e", 0, &rep, keys, 6), 0);   /* another deployment */
    tsr_prefix_route_add(p, "d", 0, &rep, keys + 5, 1);   /* key 5 is the newest again */
    tsr_prefix_route_add(p, "d", 0, &rep, keys + 10, 3);  /* 9 keys for 8 blocks: key 4 goes,
                                                             the deepest of the chain left */
    assert_int_equal(tsr_prefix_route_size(p, "d", 0), 8);
    assert_int_equal(tsr_prefix_route_match(p, "d", 0, &rep, keys, 6), 4);
    assert_int_equal(tsr_prefix_route_match(p, "d", 0, &rep, keys + 5, 1), 1);
    assert_int_equal(tsr_prefix_route_match(p, "d", 0, &rep, keys + 10, 3), 3);
    /* many times over its size: still bounded, the newest kept */
    for (int k = 0; k < 40; k++) tsr_prefix_route_add(p, "d", 0, &rep, keys + (k % 20), 1);
    assert_int_equal(tsr_prefix_route_size(p, "d", 0), 8);
    assert_int_equal(tsr_prefix_route_match(p, "d", 0, &rep, keys + 12, 8), 8);
    tsr_prefix_route_free(&p);
    assert_null(p);
}

static void test_reported_evictions_drop_the_oldest_and_a_new_epoch_empties_it(void **state)
{
    (void)state;
    tsr_prefix_route_t *p = tsr_prefix_route_new();
    tsr_prefix_replica_t rep = {3, 100, 50};
    tsr_prefix_route_add(p, "d", 2, &rep, keys, 10);
    rep.evictions = 54;                     /* four evicted since: the chain's last four */
    assert_int_equal(tsr_prefix_route_match(p, "d", 2, &rep, keys, 10), 6);
    assert_int_equal(tsr_prefix_route_size(p, "d", 2), 6);
    rep.evictions = 10;                     /* a new process: its count starts again */
    assert_int_equal(tsr_prefix_route_match(p, "d", 2, &rep, keys, 10), 6);
    rep.evictions = 11;
    assert_int_equal(tsr_prefix_route_match(p, "d", 2, &rep, keys, 10), 5);
    assert_int_equal(tsr_prefix_route_size(p, "d", 2), 5);
    rep.pool_blocks = 0;                    /* not reported (a worker marked dead): kept */
    assert_int_equal(tsr_prefix_route_match(p, "d", 2, &rep, keys, 10), 5);
    rep.epoch = 4;                          /* its ranks start the epoch with no cache */
    assert_int_equal(tsr_prefix_route_match(p, "d", 2, &rep, keys, 10), 0);
    assert_int_equal(tsr_prefix_route_size(p, "d", 2), 0);
    tsr_prefix_route_free(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_it_holds_up_to_the_pool_size_oldest_out_first),
        cmocka_unit_test(test_reported_evictions_drop_the_oldest_and_a_new_epoch_empties_it),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
