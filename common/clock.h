/* clock.h: timed waits on the monotonic clock.  A wall-clock step (NTP, an operator's
 * date) must neither cut nor stretch a deadline, so every condition variable that is
 * waited on with a timeout is made here and every absolute deadline is computed here. */
#ifndef TSR_CLOCK_H
#define TSR_CLOCK_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

/* pthread_cond_init with CLOCK_MONOTONIC as the clock of pthread_cond_timedwait.
 * 0, or an errno value. */
int tsr_cond_init_monotonic(pthread_cond_t *cv);
/* The CLOCK_MONOTONIC time ms milliseconds from now (ms < 0 counts as 0): the deadline
 * for pthread_cond_timedwait on such a condition, or for pthread_clockjoin_np. */
struct timespec tsr_monotonic_after_ms(int64_t ms);

#endif
