/* Daemon logging: levels, one target (stderr, a file reopened on SIGHUP,
 * or syslog). Thread-safe: each message is one write. */
#ifndef MLENS_LOG_H
#define MLENS_LOG_H

#include <stdarg.h>

enum mlens_log_level {
	MLENS_LOG_ERROR = 0,
	MLENS_LOG_WARN = 1,
	MLENS_LOG_INFO = 2,
	MLENS_LOG_DEBUG = 3,
};

/* target: NULL or "stderr", "syslog", or a file path (appended). */
int mlens_log_open(const char *target, enum mlens_log_level level);
/* Reopen the file target (after logrotate moved it); no-op otherwise. */
int mlens_log_reopen(void);
void mlens_log_close(void);
void mlens_log_set_level(enum mlens_log_level level);
enum mlens_log_level mlens_log_get_level(void);
/* "error", "warn", "info", "debug": the level, or -1. */
int mlens_log_parse_level(const char *name);
const char *mlens_log_level_name(enum mlens_log_level level);

void mlens_log(enum mlens_log_level level, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
void mlens_vlog(enum mlens_log_level level, const char *fmt, va_list ap);

/* Rate limit of one call site: at most burst messages every interval
 * seconds; the rest are counted, and the next message that passes says how
 * many were suppressed. Besides, mlens_vlog writes a message identical to
 * the last one only as "last message repeated N times" (at the next other
 * message, or every 30 s while it repeats). */
struct mlens_log_limit {
	unsigned burst;
	double interval;
	double start;		/* of the current interval (CLOCK_MONOTONIC) */
	unsigned n;		/* messages passed in it */
	unsigned long suppressed;
};
#define MLENS_LOG_LIMIT_INIT(burst, seconds) { (burst), (seconds), 0, 0, 0 }
void mlens_log_limited(struct mlens_log_limit *lim, enum mlens_log_level level, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

#define log_error(...) mlens_log(MLENS_LOG_ERROR, __VA_ARGS__)
#define log_warn(...) mlens_log(MLENS_LOG_WARN, __VA_ARGS__)
#define log_info(...) mlens_log(MLENS_LOG_INFO, __VA_ARGS__)
#define log_debug(...) mlens_log(MLENS_LOG_DEBUG, __VA_ARGS__)

#endif
