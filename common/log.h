/* log.h: one line per event on stderr ("LEVEL component: message"); under
 * systemd, journald adds the timestamps and the unit name. */
#ifndef TSR_LOG_H
#define TSR_LOG_H

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

/* Monotonic milliseconds since an arbitrary origin. */
int64_t tsr_now_ms(void);
/* Wall-clock milliseconds since the epoch. */
int64_t tsr_wall_ms(void);

#endif
