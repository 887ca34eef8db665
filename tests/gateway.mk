# tests/gateway.mk: mlens-gateway against a real mlensd (curl, and the
# openai Python client when installed).
dist_check_SCRIPTS += tests/integration/gateway.sh
TESTS += tests/integration/gateway.sh
EXTRA_DIST += tests/integration/gateway_mktok.py tests/integration/gateway_openai.py
# the gateway's overhead against mlens generate on one token workload
EXTRA_DIST += tests/bench/gateway_overhead.py
