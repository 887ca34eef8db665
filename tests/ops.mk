# tests/ops.mk: operating mlensd: control socket and mlensctl, stats socket,
# /metrics and /health, config errors, man pages.
check_PROGRAMS += tests/integration/ops_tenant
tests_integration_ops_tenant_SOURCES = tests/integration/ops_tenant.c
tests_integration_ops_tenant_LDADD = shm/libmlens_shm.la
check_PROGRAMS += tests/integration/ops_raw
tests_integration_ops_raw_SOURCES = tests/integration/ops_raw.c
dist_check_SCRIPTS += tests/integration/ops.sh
TESTS += tests/integration/ops.sh
