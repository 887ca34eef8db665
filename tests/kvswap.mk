# tests/kvswap.mk: the KV swap file (daemon/exec/kv_swap.c): its cost
# model, slot allocator and I/O; a real daemon that preempts with it.
if HAVE_CHECK
check_PROGRAMS += tests/check_kv_swap
TESTS += tests/check_kv_swap
tests_check_kv_swap_SOURCES = tests/check_kv_swap.c tests/check_common.h
tests_check_kv_swap_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_kv_swap_LDADD = daemon/libmlens_core.la $(CHECK_LIBS)
endif
dist_check_SCRIPTS += tests/integration/kv_swap.sh
TESTS += tests/integration/kv_swap.sh
