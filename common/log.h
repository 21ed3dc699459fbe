/* log.h: one line per event on stderr ("LEVEL component: message"); under
 * systemd, journald adds the timestamps and the unit name. */
#ifndef TSR_LOG_H
#define TSR_LOG_H

#include <stdbool.h>
#include <stdint.h>

enum { TSR_LOG_DEBUG = 0, TSR_LOG_INFO = 1, TSR_LOG_WARN = 2, TSR_LOG_ERROR = 3 };

/* Sets the component name printed on each line and the lowest level shown
 * (TESSERA_LOG_LEVEL=debug|info|warn|error overrides it). */
void tsr_log_init(const char *component, int level);
void tsr_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define tsr_debug(...) tsr_log(TSR_LOG_DEBUG, __VA_ARGS__)
#define tsr_info(...)  tsr_log(TSR_LOG_INFO, __VA_ARGS__)
#define tsr_warn(...)  tsr_log(TSR_LOG_WARN, __VA_ARGS__)
#define tsr_error(...) tsr_log(TSR_LOG_ERROR, __VA_ARGS__)

/* A line that may come in floods (a stranger retrying every second): the
 * first is logged, then at most one every gap_ms, saying how many were held
 * back meanwhile.  Zeroed: nothing logged yet. */
typedef struct {
    int64_t last_ms;            /* when one was last logged (0: never) */
    uint64_t held;              /* how many were not logged since */
} tsr_log_limit_t;
/* True when this one is to be logged, with *held set to the count held back
 * before it; false (and counted) otherwise. */
bool tsr_log_limit_pass(tsr_log_limit_t *l, int64_t now_ms, int64_t gap_ms, uint64_t *held);

/* Monotonic milliseconds since an arbitrary origin. */
int64_t tsr_now_ms(void);
/* Wall-clock milliseconds since the epoch. */
int64_t tsr_wall_ms(void);

#endif
