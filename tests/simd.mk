# tests/simd.mk: the CPU attention kernels' and the worker pool's tests, and the benchmark.
if HAVE_CHECK
check_PROGRAMS += tests/check_attention
TESTS += tests/check_attention
tests_check_attention_SOURCES = tests/check_attention.c
tests_check_attention_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_attention_LDADD = kernels/libmlens_kernels.la $(CHECK_LIBS) $(PTHREAD_LIBS) -lm
check_PROGRAMS += tests/check_pool
TESTS += tests/check_pool
tests_check_pool_SOURCES = tests/check_pool.c
tests_check_pool_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_pool_LDADD = kernels/libmlens_kernels.la $(CHECK_LIBS) $(PTHREAD_LIBS)
endif

# The attention benchmark is `mlens-bench attention` (tests/bench/bench_attention.c,
# built into mlens-bench in tests/shm.mk).
# One-command sweep of the kernels' tuning knobs on a machine (prints a table).
dist_noinst_SCRIPTS += tests/bench/attn_sweep.sh
