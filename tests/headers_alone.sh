#!/bin/sh
# Description: every installed header compiles on its own, with nothing
# included before it, as strict C99 and (when a C++ compiler is there) as
# C++, as libqb's tests/Makefile.am checks its public headers.
set -u
: "${MLENS_SRCDIR:?run through make check}"
: "${MLENS_PUBLIC_HEADERS:?run through make check}"
cc=${CC:-cc}
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT
fail=0
n=0
for h in $MLENS_PUBLIC_HEADERS; do
	dir=$MLENS_SRCDIR/$(dirname "$h")
	base=$(basename "$h")
	printf '#include <%s>\nint main(void) { return 0; }\n' "$base" > "$tmp/alone.c"
	if ! $cc -std=c99 -pedantic-errors -Wall -Wextra -Werror -I"$dir" \
		-c "$tmp/alone.c" -o "$tmp/alone.o"; then
		echo "FAIL: $h does not compile alone as C99" >&2
		fail=1
	fi
	if [ -n "${CXX:-}" ] && command -v "${CXX%% *}" >/dev/null 2>&1; then
		cp "$tmp/alone.c" "$tmp/alone.cc"
		if ! $CXX -Wall -Wextra -Werror -I"$dir" -c "$tmp/alone.cc" -o "$tmp/alone.o"; then
			echo "FAIL: $h does not compile alone as C++" >&2
			fail=1
		fi
	fi
	n=$((n + 1))
done
if [ "$n" -eq 0 ]; then
	echo "FAIL: no public headers listed" >&2
	exit 1
fi
echo "$n public header(s) checked"
exit $fail
