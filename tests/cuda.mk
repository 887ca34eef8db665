# tests: the CUDA backend against the CPU oracle (check_cuda, exits 77
# without a GPU) and its benchmark program (JSON on stdout).
EXTRA_DIST += tests/check_cuda.c tests/bench/bench_cuda.c tests/bench/bench_copyq.c
if HAVE_CUDA
if HAVE_CHECK
check_PROGRAMS += tests/check_cuda
TESTS += tests/check_cuda
tests_check_cuda_SOURCES = tests/check_cuda.c tests/gpulock.h
tests_check_cuda_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_cuda_LDADD = kernels/libmlens_kernels.la $(CHECK_LIBS) $(CUDA_LIBS)
endif
noinst_PROGRAMS += tests/bench/bench_cuda
tests_bench_bench_cuda_SOURCES = tests/bench/bench_cuda.c
tests_bench_bench_cuda_CFLAGS = $(AM_CFLAGS) $(CUDA_CFLAGS)
tests_bench_bench_cuda_LDADD = kernels/libmlens_kernels.la $(CUDA_LIBS)
# how long an activation copy waits behind the weight stream (bench_copyq.c)
noinst_PROGRAMS += tests/bench/bench_copyq
tests_bench_bench_copyq_SOURCES = tests/bench/bench_copyq.c
tests_bench_bench_copyq_CFLAGS = $(AM_CFLAGS) $(CUDA_CFLAGS)
tests_bench_bench_copyq_LDADD = $(CUDA_LIBS)
endif
