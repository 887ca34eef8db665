# tests/profiler.mk: the profiler on the CPU backend, its cache, the cap it
# sets; mlensctl profile against a real daemon.
if HAVE_CHECK
check_PROGRAMS += tests/check_profiler
TESTS += tests/check_profiler
tests_check_profiler_SOURCES = tests/check_profiler.c
tests_check_profiler_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS)
tests_check_profiler_LDADD = tests/libmlens_testutil.la daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CHECK_LIBS) -lm
endif
# mlens-bench predict: the model replayed on a recorded profile cache
tests_bench_mlens_bench_SOURCES += tests/bench/bench_predict.c
dist_check_SCRIPTS += tests/integration/profile.sh
TESTS += tests/integration/profile.sh
