#!/bin/sh
# Run tests/check_golden on $MLENS_TEST_BACKEND with exact GEMMs, then with
# fast GEMMs (MLENS_TEST_GEMM). Fails when either fails; skips (77) when
# the backend is unavailable.
set -u
B="${MLENS_BUILDDIR:-.}"
rc_all=0
for mode in exact fast; do
	echo "== check_golden on $MLENS_TEST_BACKEND with $mode GEMMs"
	MLENS_TEST_GEMM=$mode "$B/tests/check_golden" "$@"
	rc=$?
	[ "$rc" = 77 ] && exit 77
	if [ "$rc" != 0 ]; then
		echo "FAIL: check_golden on $MLENS_TEST_BACKEND with $mode GEMMs (exit $rc)"
		rc_all=1
	fi
done
exit $rc_all
