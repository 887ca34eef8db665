# tests for shm/ (check_shm) and the mlens-bench program (ring subcommand;
# other parts add their subcommands' sources to mlens_bench below).
if HAVE_CHECK
check_PROGRAMS += tests/check_shm
TESTS += tests/check_shm
tests_check_shm_SOURCES = tests/check_shm.c
tests_check_shm_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_shm_LDADD = shm/libmlens_shm.la $(CHECK_LIBS) -lm
endif

bin_PROGRAMS += tests/bench/mlens-bench
tests_bench_mlens_bench_SOURCES = \
	tests/bench/bench.h tests/bench/mlens-bench.c tests/bench/bench_ring.c
tests_bench_mlens_bench_CFLAGS = $(AM_CFLAGS) -O2
tests_bench_mlens_bench_LDADD = shm/libmlens_shm.la
