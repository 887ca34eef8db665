# tests: the hybrid pipeline's plan, program and executor on the CPU.
if HAVE_CHECK
check_PROGRAMS += tests/check_hybrid
TESTS += tests/check_hybrid
tests_check_hybrid_SOURCES = tests/check_hybrid.c
tests_check_hybrid_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_hybrid_LDADD = tests/libmlens_testutil.la daemon/libmlens_core.la $(CHECK_LIBS) -lm
endif

# the golden checks through the hybrid pipeline (tests/golden/golden.c
# knows the backend names "hybrid" and "hybrid-cpu")
EXTRA_DIST += tests/golden/check_golden_hybrid.sh tests/golden/check_golden_hybrid_cpu.sh
if HAVE_CHECK
TESTS += tests/golden/check_golden_hybrid_cpu.sh
if HAVE_CUDA
TESTS += tests/golden/check_golden_hybrid.sh
endif
endif
