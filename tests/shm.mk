# tests for shm/ (check_shm, which also feeds the fuzz target), the libFuzzer
# target (make fuzz-shm) and the mlens-bench program (ring subcommand; other
# parts add their subcommands' sources to tests_bench_mlens_bench_SOURCES).
if HAVE_CHECK
check_PROGRAMS += tests/check_shm
TESTS += tests/check_shm
tests_check_shm_SOURCES = tests/check_shm.c tests/fuzz/fuzz_shm.c
tests_check_shm_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_shm_LDADD = shm/libmlens_shm.la $(CHECK_LIBS) -lm
endif

bin_PROGRAMS += tests/bench/mlens-bench
tests_bench_mlens_bench_SOURCES = \
	tests/bench/bench.h tests/bench/mlens-bench.c tests/bench/bench_ring.c \
	tests/bench/bench_attention.c tests/bench/bench_attention.h
tests_bench_mlens_bench_CFLAGS = $(AM_CFLAGS) -O2
tests_bench_mlens_bench_LDADD = shm/libmlens_shm.la kernels/libmlens_kernels.la $(PTHREAD_LIBS) -lm

# libFuzzer needs clang; automake compiles with $(CC), hence a plain rule.
# `make fuzz-shm` builds it; run as: tests/fuzz/fuzz_shm [CORPUS_DIR]
FUZZ_SHM_SRC = $(top_srcdir)/tests/fuzz/fuzz_shm.c $(top_srcdir)/shm/ring.c \
	$(top_srcdir)/shm/region.c $(top_srcdir)/shm/proto.c
if HAVE_CLANG
tests/fuzz/fuzz_shm: $(FUZZ_SHM_SRC) $(top_srcdir)/shm/ring.h $(top_srcdir)/shm/region.h \
		$(top_srcdir)/shm/proto.h $(top_srcdir)/shm/barrier.h $(top_srcdir)/shm/shm_int.h
	$(AM_V_CCLD)$(MKDIR_P) tests/fuzz && \
	$(CLANG) -std=gnu11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
		-include $(top_builddir)/config.h -I$(top_srcdir) $(FUZZ_SHM_SRC) -o $@
fuzz-shm: tests/fuzz/fuzz_shm
else
fuzz-shm:
	@echo "make fuzz-shm: configure found no clang, which libFuzzer needs" >&2; exit 1
endif
.PHONY: fuzz-shm
CLEANFILES += tests/fuzz/fuzz_shm
dist_man_MANS += man/mlens-bench.1
