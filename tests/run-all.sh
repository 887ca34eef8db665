#!/bin/sh
# The whole test suite from a fresh clone on Debian 12: install what is
# missing, build (with CUDA when a toolkit is found), run make check, then
# the same under ASan/UBSan and under TSan, then make distcheck. Exits
# non-zero on any failure. Build trees: _build/, _build-asan/, _build-tsan/.
set -e
cd "$(dirname "$0")/.."
./tests/setup-deps.sh
jobs=$(nproc 2>/dev/null || echo 2)
top=$(pwd)

step() { printf '\n==== %s ====\n' "$*"; }
# the failed tests' logs (the tail of each), or of all logs when no test
# result says which, then stop
logs_fail() {
	failed=$(grep -l -E '^:test-result: (FAIL|ERROR)' tests/*.trs tests/*/*.trs 2>/dev/null || true)
	[ -n "$failed" ] || { cat tests/*.log tests/*/*.log 2>/dev/null | tail -200; exit 1; }
	for t in $failed; do
		printf -- '--- %s\n' "${t%.trs}.log"; tail -80 "${t%.trs}.log"
	done
	exit 1
}

step "build and check"
mkdir -p _build && cd _build
[ -f Makefile ] || "$top/configure" -q
make -j"$jobs" >/dev/null
make -j"$jobs" check || logs_fail
cd "$top"

step "sanitizer build (ASan + UBSan) and check"
mkdir -p _build-asan && cd _build-asan
[ -f Makefile ] || "$top/configure" -q --enable-sanitizers
make -j"$jobs" >/dev/null
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	make -j"$jobs" check || logs_fail
cd "$top"

step "sanitizer build (TSan) and check"
mkdir -p _build-tsan && cd _build-tsan
[ -f Makefile ] || "$top/configure" -q --enable-sanitizers=thread
make -j"$jobs" >/dev/null
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
# Check's per-test timeouts are set for plain builds; TSan runs 5-15x slower
export CK_TIMEOUT_MULTIPLIER=3
if ! make -j"$jobs" check; then
	# a data race TSan reports fails at once; a test that failed without
	# a report (a timing assumption under TSan's 5-15x slowdown) gets one
	# more run on its own
	trs=$(find tests -name '*.trs')
	failed=$(grep -l '^:test-result: FAIL' $trs | sed 's/\.trs$//' || true)
	if [ -z "$failed" ] || grep -q '^:test-result: ERROR' $trs ||
	   grep -l "WARNING: ThreadSanitizer" $(for t in $failed; do echo "$t.log"; done) 2>/dev/null; then
		logs_fail
	fi
	echo "TSan: no race reported; running again alone:" $failed
	make check TESTS="$failed" || logs_fail
fi
unset TSAN_OPTIONS CK_TIMEOUT_MULTIPLIER
cd "$top"

step "distcheck"
cd _build
if ! make -j"$jobs" distcheck > distcheck.log 2>&1; then
	echo "make distcheck failed:"
	grep -E "^(FAIL|ERROR)" distcheck.log
	for f in $(grep -l -E "^(FAIL|ERROR)" mlens-*/_build/sub/tests/*.log mlens-*/_build/sub/tests/*/*.log 2>/dev/null); do
		echo "--- $f"; tail -60 "$f"
	done
	tail -30 distcheck.log
	exit 1
fi
echo "distcheck: ok"
echo
echo "all tests passed"
