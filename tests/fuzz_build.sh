#!/bin/sh
# Description: the libFuzzer targets (make fuzz, make fuzz-load, make
# fuzz-shm, make fuzz-tokenizer: clang, outside automake's rules) still
# build and run:
# each replays the committed corpus and a few thousand generated inputs
# without a finding.
# Skips without clang, and in a sanitizer build tree (the targets carry
# their own ASan/UBSan whatever the tree; the plain tree checks them).
set -u
B="${MLENS_BUILDDIR:-.}"
src="${MLENS_SRCDIR:-.}"
grep -q '^CLANG = ..*' "$B/Makefile" || { echo "SKIP: configure found no clang"; exit 77; }
if grep -q '^SAN_CFLAGS = ..*' "$B/Makefile"; then
	echo "SKIP: a sanitizer build tree (the plain tree checks the fuzz targets)"
	exit 77
fi
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
# done_runs LOG N: libFuzzer finished at least N runs (it may count a few
# more: the last input's mutations end their batch)
done_runs() {
	awk -v n="$2" '/^Done [0-9]+ runs/ { d = $2 } END { exit !(d >= n) }' "$1"
}

# a make of its own, not a job of the make check that runs this
env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s -C "$B" fuzz fuzz-load fuzz-shm fuzz-tokenizer >"$tmp/build" 2>&1 ||
	fail "make fuzz fuzz-load fuzz-shm fuzz-tokenizer: $(tail -20 "$tmp/build")"
mkdir "$tmp/model" "$tmp/load" "$tmp/shm" "$tmp/tok"
cp "$src"/tests/fuzz/corpus/* "$tmp/model/" || fail "no corpus in $src/tests/fuzz/corpus"
"$B/tests/fuzz/fuzz_model" -runs=4000 -seed=1 -rss_limit_mb=2048 "$tmp/model" >"$tmp/m.log" 2>&1 ||
	fail "fuzz_model: $(tail -30 "$tmp/m.log")"
done_runs "$tmp/m.log" 4000 || fail "fuzz_model did not finish its runs: $(tail -5 "$tmp/m.log")"
cp "$src"/tests/fuzz/load-corpus/* "$tmp/load/" || fail "no corpus in $src/tests/fuzz/load-corpus"
TMPDIR="$tmp" "$B/tests/fuzz/fuzz_load" -runs=1500 -seed=1 -rss_limit_mb=2048 -artifact_prefix="$tmp/" \
	-dict="$src/tests/fuzz/load.dict" \
	"$tmp/load" >"$tmp/l.log" 2>&1 || fail "fuzz_load: $(tail -30 "$tmp/l.log")"
done_runs "$tmp/l.log" 1500 || fail "fuzz_load did not finish its runs: $(tail -5 "$tmp/l.log")"
"$B/tests/fuzz/fuzz_shm" -runs=20000 -seed=1 "$tmp/shm" >"$tmp/s.log" 2>&1 ||
	fail "fuzz_shm: $(tail -30 "$tmp/s.log")"
done_runs "$tmp/s.log" 20000 || fail "fuzz_shm did not finish its runs: $(tail -5 "$tmp/s.log")"
cp "$src"/tests/tokenizer/fuzz_corpus/* "$tmp/tok/" || fail "no corpus in $src/tests/tokenizer/fuzz_corpus"
"$B/tests/fuzz/fuzz_tokenizer" -runs=3000 -seed=1 -max_len=16384 -rss_limit_mb=2048 \
	-artifact_prefix="$tmp/" "$tmp/tok" >"$tmp/t.log" 2>&1 || fail "fuzz_tokenizer: $(tail -30 "$tmp/t.log")"
done_runs "$tmp/t.log" 3000 || fail "fuzz_tokenizer did not finish its runs: $(tail -5 "$tmp/t.log")"
echo "fuzz targets: built, 4000 model, 1500 loader, 20000 region and 3000 tokenizer inputs without a finding"
