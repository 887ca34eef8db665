# tests/trace.mk: the trace recorder (spans in, JSON out, the cap, bad
# paths), the CPU backend's timing marks; mlensctl trace against a daemon;
# the op time account (op_timing) on those marks and in a daemon.
if HAVE_CHECK
check_PROGRAMS += tests/check_trace
TESTS += tests/check_trace
tests_check_trace_SOURCES = tests/check_trace.c
tests_check_trace_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS) $(LIBEVENT_CFLAGS)
tests_check_trace_LDADD = daemon/libmlens_core.la $(CHECK_LIBS) $(LIBEVENT_LIBS) -lm
check_PROGRAMS += tests/check_op_time
TESTS += tests/check_op_time
tests_check_op_time_SOURCES = tests/check_op_time.c
tests_check_op_time_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS)
tests_check_op_time_LDADD = daemon/libmlens_core.la $(CHECK_LIBS) -lm
endif
dist_check_SCRIPTS += tests/integration/trace.sh
TESTS += tests/integration/trace.sh
dist_check_SCRIPTS += tests/integration/op_timing.sh
TESTS += tests/integration/op_timing.sh
