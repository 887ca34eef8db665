# tests/gateway.mk: mlens-gateway's parts alone (check_gateway), and
# against a real mlensd (curl, and the openai Python client when installed).
if HAVE_CHECK
check_PROGRAMS += tests/check_gateway
TESTS += tests/check_gateway
tests_check_gateway_SOURCES = tests/check_gateway.c
tests_check_gateway_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS)
tests_check_gateway_LDADD = client/libmlens_gateway.la client/libmlens.la $(CHECK_LIBS) \
	$(JANSSON_LIBS)
endif
dist_check_SCRIPTS += tests/integration/gateway.sh
TESTS += tests/integration/gateway.sh
EXTRA_DIST += tests/integration/gateway_mktok.py tests/integration/gateway_openai.py
# the gateway's overhead against mlens generate on one token workload
EXTRA_DIST += tests/bench/gateway_overhead.py
