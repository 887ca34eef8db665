# tests: the hybrid pipeline's plan, program and executor on the CPU.
if HAVE_CHECK
check_PROGRAMS += tests/check_hybrid
TESTS += tests/check_hybrid
tests_check_hybrid_SOURCES = tests/check_hybrid.c
tests_check_hybrid_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_hybrid_LDADD = tests/libmlens_testutil.la daemon/libmlens_core.la $(CHECK_LIBS) -lm
endif
