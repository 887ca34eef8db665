#!/bin/sh
# Description: every man page in man/ passes `mandoc -T lint -W warning`
# with nothing reported (configure runs this only when it found mandoc).
set -u
: "${MLENS_SRCDIR:?run through make check}"
: "${MANDOC:?run through make check with mandoc found by configure}"
fail=0
n=0
for page in "$MLENS_SRCDIR"/man/*.[1-8]; do
	[ -e "$page" ] || continue
	# a .so page only names another page: nothing to lint
	if head -n 1 "$page" | grep -q '^\.so '; then
		continue
	fi
	out=$($MANDOC -T lint -W warning "$page" 2>&1)
	if [ $? -ne 0 ] || [ -n "$out" ]; then
		printf '%s\n' "$out" >&2
		echo "FAIL: $page" >&2
		fail=1
	fi
	n=$((n + 1))
done
if [ "$n" -eq 0 ]; then
	echo "FAIL: no man pages found in $MLENS_SRCDIR/man" >&2
	exit 1
fi
echo "$n man page(s) lint clean"
exit $fail
