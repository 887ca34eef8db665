#!/bin/sh
# Description: the tokenizer's libFuzzer target (make fuzz-tokenizer:
# clang, outside automake's rules) still builds and runs: it replays the
# committed corpus and a few thousand generated inputs without a finding.
# Skips without clang, and in a sanitizer build tree (the target carries
# its own ASan/UBSan whatever the tree; the plain tree checks it).
set -u
B="${MLENS_BUILDDIR:-.}"
src="${MLENS_SRCDIR:-.}"
grep -q '^CLANG = ..*' "$B/Makefile" || { echo "SKIP: configure found no clang"; exit 77; }
if grep -q '^SAN_CFLAGS = ..*' "$B/Makefile"; then
	echo "SKIP: a sanitizer build tree (the plain tree checks the fuzz target)"
	exit 77
fi
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# a make of its own, not a job of the make check that runs this
env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s -C "$B" fuzz-tokenizer >"$tmp/build" 2>&1 ||
	fail "make fuzz-tokenizer: $(tail -20 "$tmp/build")"
mkdir "$tmp/corpus"
cp "$src"/tests/tokenizer/fuzz_corpus/* "$tmp/corpus/" || fail "no corpus in $src/tests/tokenizer/fuzz_corpus"
"$B/tests/fuzz/fuzz_tokenizer" -runs=3000 -seed=1 -max_len=16384 -rss_limit_mb=2048 \
	-artifact_prefix="$tmp/" "$tmp/corpus" >"$tmp/t.log" 2>&1 || fail "fuzz_tokenizer: $(tail -30 "$tmp/t.log")"
grep -q "Done 3000 runs" "$tmp/t.log" || fail "fuzz_tokenizer did not finish its runs: $(tail -5 "$tmp/t.log")"
echo "fuzz_tokenizer: built, 3000 inputs without a finding"
