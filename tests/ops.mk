# tests/ops.mk: operating mlensd: control socket and mlensctl, stats socket,
# /metrics and /health, config errors, man pages.
check_PROGRAMS += tests/integration/ops_tenant
tests_integration_ops_tenant_SOURCES = tests/integration/ops_tenant.c
tests_integration_ops_tenant_LDADD = shm/libmlens_shm.la
check_PROGRAMS += tests/integration/ops_raw
tests_integration_ops_raw_SOURCES = tests/integration/ops_raw.c
dist_check_SCRIPTS += tests/integration/ops.sh
EXTRA_DIST += tests/integration/lib.sh
TESTS += tests/integration/ops.sh
# random and hostile control and /metrics requests against a live daemon
dist_check_SCRIPTS += tests/integration/hostile_ops.sh
TESTS += tests/integration/hostile_ops.sh
# names, log limits, access rules and listening sockets, unit by unit
if HAVE_CHECK
check_PROGRAMS += tests/check_ops
TESTS += tests/check_ops
tests_check_ops_SOURCES = tests/check_ops.c
tests_check_ops_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS) $(LIBEVENT_CFLAGS)
tests_check_ops_LDADD = daemon/libmlens_core.la $(CHECK_LIBS) $(LIBEVENT_LIBS)
endif
# the sockets against careless and hostile local users
dist_check_SCRIPTS += tests/integration/sockets.sh
TESTS += tests/integration/sockets.sh
# the Prometheus listener against a client hoarding connections
dist_check_SCRIPTS += tests/integration/metrics_hostile.sh
TESTS += tests/integration/metrics_hostile.sh
# lints ALL man/*.[1-8] pages (shared with the client pages)
dist_check_SCRIPTS += tests/manlint.sh tests/man_keys.sh
TESTS += tests/manlint.sh tests/man_keys.sh
