/* clock.c: timed waits on the monotonic clock (clock.h). */
#include "common/clock.h"

int tsr_cond_init_monotonic(pthread_cond_t *cv)
{
    pthread_condattr_t a;
    int rc = pthread_condattr_init(&a);
    if (rc) return rc;
    rc = pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    if (!rc) rc = pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
    return rc;
}

struct timespec tsr_monotonic_after_ms(int64_t ms)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (ms < 0) ms = 0;
    t.tv_sec += (time_t)(ms / 1000);
    t.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) t.tv_sec++, t.tv_nsec -= 1000000000L;
    return t;
}
