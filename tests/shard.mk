# tests: the sharded math (fake collectives) against the unsharded engine,
# the partitioning arithmetic and the multi-GPU performance model.
if HAVE_CHECK
check_PROGRAMS += tests/check_shard
TESTS += tests/check_shard
tests_check_shard_SOURCES = tests/check_shard.c
tests_check_shard_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_shard_LDADD = tests/libmlens_testutil.la daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CHECK_LIBS) -lm
endif

# mlensd and the gpus key: several GPUs refused in plain words
dist_check_SCRIPTS += tests/shard_gpus.sh
TESTS += tests/shard_gpus.sh

# the estimates of daemon/MULTINODE.md (JSON; arithmetic only)
noinst_PROGRAMS += tests/bench/shard_estimates
tests_bench_shard_estimates_SOURCES = tests/bench/shard_estimates.c
tests_bench_shard_estimates_LDADD = daemon/libmlens_core.la -lm
