#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/time.h>
#include <time.h>

static char log_component[64] = "tessera";
static int log_level = TSR_LOG_INFO;

void tsr_log_init(const char *component, int level)
{
    snprintf(log_component, sizeof log_component, "%s", component);
    log_level = level;
    const char *env = getenv("TESSERA_LOG_LEVEL");
    if (env) {
        if (!strcasecmp(env, "debug")) log_level = TSR_LOG_DEBUG;
        else if (!strcasecmp(env, "info")) log_level = TSR_LOG_INFO;
        else if (!strcasecmp(env, "warn")) log_level = TSR_LOG_WARN;
        else if (!strcasecmp(env, "error")) log_level = TSR_LOG_ERROR;
    }
}

void tsr_log(int level, const char *fmt, ...)
{
    static const char *names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
    if (level < log_level) return;
    if (level < 0 || level > TSR_LOG_ERROR) level = TSR_LOG_ERROR;

    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);

    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    gmtime_r(&tv.tv_sec, &tm);
    /* One fprintf per line so lines from concurrent processes sharing a
     * terminal do not interleave mid-line. */
    fprintf(stderr, "%02d:%02d:%02d.%03ld %s %s: %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec,
            (long)(tv.tv_usec / 1000), names[level], log_component, msg);
}

bool tsr_log_limit_pass(tsr_log_limit_t *l, int64_t now_ms, int64_t gap_ms, uint64_t *held)
{
    if (l->last_ms && now_ms - l->last_ms < gap_ms) {
        l->held++;
        return false;
    }
    *held = l->held;
    l->held = 0;
    l->last_ms = now_ms ? now_ms : 1;
    return true;
}

int64_t tsr_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t tsr_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}
