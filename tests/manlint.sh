#!/bin/sh
# Description: every man page in man/ lints clean with mandoc -T lint
# -W warning (skipped when mandoc is absent).
set -u
src="${MLENS_SRCDIR:-${top_srcdir:-.}}"
command -v mandoc >/dev/null || { echo "SKIP: mandoc not found"; exit 77; }
n=0
bad=0
for page in "$src"/man/*.[1-8]; do
	[ -f "$page" ] || continue
	n=$((n + 1))
	out=$(mandoc -T lint -W warning "$page" 2>&1)
	if [ $? -ne 0 ] || [ -n "$out" ]; then
		echo "$out"
		bad=$((bad + 1))
	fi
done
[ $n -gt 0 ] || { echo "FAIL: no man pages in $src/man"; exit 1; }
[ $bad -eq 0 ] || { echo "FAIL: $bad of $n pages have lint warnings"; exit 1; }
echo "manlint: $n pages clean"
