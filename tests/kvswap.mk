# tests/kvswap.mk: the host and disk tiers: the KV swap file, weights on disk
# (daemon/exec/kv_swap.c) and the host memory plan (daemon/plan/host_plan.c).
if HAVE_CHECK
check_PROGRAMS += tests/check_kv_swap
TESTS += tests/check_kv_swap
tests_check_kv_swap_SOURCES = tests/check_kv_swap.c tests/check_common.h
tests_check_kv_swap_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_kv_swap_LDADD = daemon/libmlens_core.la $(CHECK_LIBS)
endif
dist_check_SCRIPTS += tests/integration/kv_swap.sh
TESTS += tests/integration/kv_swap.sh
# the host memory plan (daemon/plan/host_plan.c): host_memory's split
if HAVE_CHECK
check_PROGRAMS += tests/check_host_plan
TESTS += tests/check_host_plan
tests_check_host_plan_SOURCES = tests/check_host_plan.c tests/check_common.h
tests_check_host_plan_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_host_plan_LDADD = daemon/libmlens_core.la $(CHECK_LIBS)
endif
dist_check_SCRIPTS += tests/integration/host_memory.sh
TESTS += tests/integration/host_memory.sh
# weights on disk (daemon/model/disk_tier.c): experts host_memory has no
# room for read from the model files each step
dist_check_SCRIPTS += tests/integration/weights_disk.sh
TESTS += tests/integration/weights_disk.sh
dist_check_SCRIPTS += tests/integration/weights_disk_routing.sh
TESTS += tests/integration/weights_disk_routing.sh
if HAVE_CHECK
check_PROGRAMS += tests/check_disk_tier
TESTS += tests/check_disk_tier
tests_check_disk_tier_SOURCES = tests/check_disk_tier.c tests/check_common.h
tests_check_disk_tier_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_disk_tier_LDADD = daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CHECK_LIBS) $(JANSSON_LIBS)
endif
# swap or recompute under preemption, by hand (not in make check): wall,
# tokens/s and the cost model's choice with kv_swap_policy always, never, auto
EXTRA_DIST += tests/bench/kv_swap_bench.sh
