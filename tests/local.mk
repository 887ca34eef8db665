# tests: Check unit tests, integration scripts, golden fixtures, benchmarks.
# Parts add their own tests in tests/PART.mk; this file holds the shared
# pieces and the engine's tests.
noinst_LTLIBRARIES += tests/libmlens_testutil.la
tests_libmlens_testutil_la_SOURCES = tests/testmodel.h tests/testmodel.c

if HAVE_CHECK
check_PROGRAMS += tests/check_engine
TESTS += tests/check_engine
tests_check_engine_SOURCES = tests/check_engine.c
tests_check_engine_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_engine_LDADD = tests/libmlens_testutil.la daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CHECK_LIBS)
endif

# the e4m3 conversions every backend shares (kernels/fp8.h)
if HAVE_CHECK
check_PROGRAMS += tests/check_fp8
TESTS += tests/check_fp8
tests_check_fp8_SOURCES = tests/check_fp8.c tests/check_common.h
tests_check_fp8_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_fp8_LDADD = $(CHECK_LIBS) -lm
endif

# the KV block pool (daemon/exec/kv_pool.c), pinned memory (daemon/mem.c) and
# what a step does around its layers (daemon/exec/step.c)
if HAVE_CHECK
check_PROGRAMS += tests/check_kv_pool tests/check_mem tests/check_step
TESTS += tests/check_kv_pool tests/check_mem tests/check_step
tests_check_step_SOURCES = tests/check_step.c tests/check_common.h
tests_check_step_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_step_LDADD = daemon/libmlens_core.la $(CHECK_LIBS)
tests_check_kv_pool_SOURCES = tests/check_kv_pool.c tests/check_common.h
tests_check_kv_pool_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_kv_pool_LDADD = daemon/libmlens_core.la $(CHECK_LIBS)
tests_check_mem_SOURCES = tests/check_mem.c tests/check_common.h
tests_check_mem_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_mem_LDADD = daemon/libmlens_core.la $(CHECK_LIBS)
endif

# the weight pages (daemon/model/weights.c): model files read into pinned memory
if HAVE_CHECK
check_PROGRAMS += tests/check_weights
TESTS += tests/check_weights
tests_check_weights_SOURCES = tests/check_weights.c tests/check_common.h
tests_check_weights_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_weights_LDADD = daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CHECK_LIBS)
endif

if HAVE_CHECK
check_PROGRAMS += tests/check_layer
TESTS += tests/check_layer
tests_check_layer_SOURCES = tests/check_layer.c
tests_check_layer_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_layer_LDADD = tests/libmlens_testutil.la daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CHECK_LIBS)
endif

if HAVE_CHECK
check_PROGRAMS += tests/check_sched
TESTS += tests/check_sched
tests_check_sched_SOURCES = tests/check_sched.c
tests_check_sched_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_sched_LDADD = tests/libmlens_testutil.la daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CHECK_LIBS)
endif

# mlensd.conf and the flags (daemon/config.c)
if HAVE_CHECK
check_PROGRAMS += tests/check_config
TESTS += tests/check_config
tests_check_config_SOURCES = tests/check_config.c tests/check_common.h
tests_check_config_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_config_LDADD = daemon/libmlens_core.la $(CHECK_LIBS)
endif
dist_noinst_SCRIPTS += tests/setup-deps.sh tests/run-all.sh tests/demo.sh

# integration: real mlensd processes and real tenant processes
check_PROGRAMS += tests/integration/tclient tests/integration/rawclient
tests_integration_tclient_SOURCES = tests/integration/tclient.c
tests_integration_tclient_LDADD = client/libmlens.la
tests_integration_rawclient_SOURCES = tests/integration/rawclient.c
tests_integration_rawclient_LDADD = shm/libmlens_shm.la
dist_check_SCRIPTS += tests/integration/tenants.sh tests/integration/rings.sh tests/integration/limits.sh \
	tests/integration/startup_refusals.sh tests/integration/fp8.sh tests/integration/families.sh
TESTS += tests/integration/tenants.sh tests/integration/rings.sh tests/integration/limits.sh \
	tests/integration/startup_refusals.sh tests/integration/fp8.sh tests/integration/families.sh
