/* test_executor.c: the data-plane thread's event queue (worker/executor.c):
 * an event that cannot be queued is never lost silently. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "worker/executor.h"

static void *fail_alloc(size_t n, size_t size)
{
    (void)n;
    (void)size;
    return NULL;
}

/* A request submitted to a worker that leads no replica is answered with a
 * retryable error event; when that event cannot be allocated, the agent gets
 * a failure of the piece instead (so its requests resume elsewhere), and
 * then nothing more. */
static void test_an_event_lost_to_memory_becomes_a_retryable_failure(void **state)
{
    (void)state;
    char err[256];
    tsr_executor_t *ex = tsr_executor_new("127.0.0.1", "127.0.0.1", err, sizeof err);
    if (!ex) fail_msg("%s", err);

    tsr_request_t r = {.request_id = 7, .n_prompt = 1, .max_tokens = 1};
    r.prompt = malloc(sizeof *r.prompt);
    r.prompt[0] = 1;
    tsr_executor_submit(ex, &r);
    tsr_event_t ev;
    assert_int_equal(tsr_executor_pop_event(ex, &ev), 1);
    assert_int_equal(ev.kind, TSR_EV_TOKEN);
    assert_int_equal(ev.request_id, 7);
    assert_true(ev.retryable);
    assert_int_equal(tsr_executor_pop_event(ex, &ev), 0);

    tsr_executor_test_set_event_alloc(fail_alloc);
    for (int k = 0; k < 3; k++) {
        r.prompt = malloc(sizeof *r.prompt);
        r.prompt[0] = 1;
        r.request_id = 8 + (uint64_t)k;
        tsr_executor_submit(ex, &r);
    }
    tsr_executor_test_set_event_alloc(NULL);
    assert_int_equal(tsr_executor_pop_event(ex, &ev), 1);
    assert_int_equal(ev.kind, TSR_EV_FAILED);
    assert_true(ev.retryable);
    assert_non_null(strstr(ev.text, "lost 3 event(s)"));
    assert_int_equal(tsr_executor_pop_event(ex, &ev), 0);
    tsr_executor_destroy(&ex);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_an_event_lost_to_memory_becomes_a_retryable_failure),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
