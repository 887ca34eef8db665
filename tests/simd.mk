# tests/simd.mk: the CPU attention kernels' test and benchmark.
if HAVE_CHECK
check_PROGRAMS += tests/check_attention
TESTS += tests/check_attention
tests_check_attention_SOURCES = tests/check_attention.c
tests_check_attention_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_attention_LDADD = kernels/libmlens_kernels.la $(CHECK_LIBS) $(PTHREAD_LIBS) -lm
endif

# The attention benchmark: a subcommand of mlens-bench (bench_attention.c),
# and a stand-alone program until the subcommand table takes it.
noinst_PROGRAMS += tests/bench/mlens-bench-attention
tests_bench_mlens_bench_attention_SOURCES = tests/bench/mlens-bench-attention.c \
	tests/bench/bench_attention.c tests/bench/bench_attention.h
tests_bench_mlens_bench_attention_LDADD = kernels/libmlens_kernels.la $(PTHREAD_LIBS) -lm
