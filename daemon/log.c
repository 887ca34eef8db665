/* Logging: the target and level are process-wide; the level is an atomic so
 * that mlensctl can change it while threads log; the target is guarded by a
 * mutex since reopen replaces the fd. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <syslog.h>
#include <time.h>
#include <unistd.h>
#include "daemon/log.h"

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;	/* guards fd, path, use_syslog */
static int log_fd = 2;
static char log_path[4096];
static int use_syslog;
static atomic_int log_level = MLENS_LOG_INFO;
/* the last message written, and how often it came again since (log_lock) */
#define REPEAT_FLUSH_S 30.0
static char last_msg[2048];
static int last_level = -1;
static unsigned long last_repeats;
static double last_flush;

static double mono_now(void);
static void do_flush_repeats(double now);

static const char *const names[] = { "error", "warn", "info", "debug" };

int mlens_log_parse_level(const char *name)
{
	for (int i = 0; i < 4; i++)
		if (name && !strcmp(name, names[i]))
			return i;
	if (name && !strcmp(name, "warning"))
		return MLENS_LOG_WARN;
	return -1;
}

const char *mlens_log_level_name(enum mlens_log_level level)
{
	return level >= 0 && level <= 3 ? names[level] : "?";
}

int mlens_log_open(const char *target, enum mlens_log_level level)
{
	int rc = 0;
	atomic_store(&log_level, (int)level);
	pthread_mutex_lock(&log_lock);
	if (log_fd > 2)
		close(log_fd);
	log_fd = 2;
	log_path[0] = 0;
	use_syslog = 0;
	if (target && !strcmp(target, "syslog")) {
		openlog("mlensd", LOG_PID | LOG_NDELAY, LOG_DAEMON);
		use_syslog = 1;
	} else if (target && strcmp(target, "stderr") && target[0]) {
		int fd = open(target, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
		if (fd < 0) {
			rc = -errno;
		} else {
			log_fd = fd;
			snprintf(log_path, sizeof(log_path), "%s", target);
		}
	}
	pthread_mutex_unlock(&log_lock);
	return rc;
}

int mlens_log_reopen(void)
{
	int rc = 0;
	pthread_mutex_lock(&log_lock);
	if (log_path[0]) {
		int fd = open(log_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
		if (fd < 0) {
			rc = -errno;
		} else {
			close(log_fd);
			log_fd = fd;
		}
	}
	pthread_mutex_unlock(&log_lock);
	return rc;
}

void mlens_log_close(void)
{
	pthread_mutex_lock(&log_lock);
	do_flush_repeats(mono_now());
	last_level = -1;
	if (log_fd > 2)
		close(log_fd);
	log_fd = 2;
	log_path[0] = 0;
	if (use_syslog)
		closelog();
	use_syslog = 0;
	pthread_mutex_unlock(&log_lock);
}

void mlens_log_set_level(enum mlens_log_level level)
{
	atomic_store(&log_level, (int)level);
}

enum mlens_log_level mlens_log_get_level(void)
{
	return (enum mlens_log_level)atomic_load(&log_level);
}

static double mono_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* One line to the target. Caller holds log_lock. */
static void do_write(enum mlens_log_level level, const char *msg)
{
	static const int prio[] = { LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG };
	char line[2200];
	struct timespec ts;
	struct tm tm;
	int n;

	if (use_syslog) {
		syslog(prio[level], "%s", msg);
		return;
	}
	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	n = snprintf(line, sizeof(line), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ mlensd[%d] %s: %s\n",
		     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
		     tm.tm_sec, ts.tv_nsec / 1000000, (int)getpid(), names[level], msg);
	if (n > (int)sizeof(line))
		n = (int)sizeof(line);
	if (write(log_fd, line, (size_t)n) < 0) {
		/* nowhere left to report it */
	}
}

/* Say how often the last message came again, if it did. Caller holds log_lock. */
static void do_flush_repeats(double now)
{
	char msg[80];
	if (last_repeats) {
		snprintf(msg, sizeof(msg), "last message repeated %lu times", last_repeats);
		do_write((enum mlens_log_level)last_level, msg);
	}
	last_repeats = 0;
	last_flush = now;
}

void mlens_vlog(enum mlens_log_level level, const char *fmt, va_list ap)
{
	char msg[2048];
	double now;

	if ((int)level > atomic_load(&log_level))
		return;
	vsnprintf(msg, sizeof(msg), fmt, ap);
	now = mono_now();
	pthread_mutex_lock(&log_lock);
	if ((int)level == last_level && !strcmp(msg, last_msg)) {
		last_repeats++;
		if (now - last_flush >= REPEAT_FLUSH_S)
			do_flush_repeats(now);
	} else {
		do_flush_repeats(now);
		do_write(level, msg);
		memcpy(last_msg, msg, sizeof(last_msg));
		last_level = (int)level;
	}
	pthread_mutex_unlock(&log_lock);
}

void mlens_log_limited(struct mlens_log_limit *lim, enum mlens_log_level level, const char *fmt, ...)
{
	char msg[1900];
	unsigned long suppressed = 0;
	double now = mono_now();
	bool pass;
	va_list ap;

	if ((int)level > atomic_load(&log_level))
		return;
	pthread_mutex_lock(&log_lock);
	if (now - lim->start >= lim->interval) {
		suppressed = lim->suppressed;
		lim->start = now;
		lim->n = 0;
		lim->suppressed = 0;
	}
	pass = lim->n < lim->burst;
	if (pass)
		lim->n++;
	else
		lim->suppressed++;
	pthread_mutex_unlock(&log_lock);
	if (!pass)
		return;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (suppressed)
		mlens_log(level, "%s (%lu similar messages suppressed before this one)", msg, suppressed);
	else
		mlens_log(level, "%s", msg);
}

void mlens_log(enum mlens_log_level level, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	mlens_vlog(level, fmt, ap);
	va_end(ap);
}
