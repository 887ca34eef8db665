#!/bin/sh
# Description: the chat-template interpreter survives hostile templates:
# every real template and every file of the fuzz corpus replays through
# the fuzz target's entry point (built with $(CC), so the sanitizer build
# checks it under ASan and UBSan), then the libFuzzer target (make
# fuzz-chat: clang) runs a few thousand generated inputs without a finding.
# The libFuzzer part skips without clang and in a sanitizer build tree.
set -u
B="${MLENS_BUILDDIR:-.}"
src="${MLENS_SRCDIR:-.}"
fail() { echo "FAIL: $*"; exit 1; }

for d in "$src/tests/chat/templates" "$src/tests/chat/fuzz-corpus"; do
	"$B/tests/chat/replay_chat" "$d" || fail "replay of $d"
done
grep -q '^CLANG = ..*' "$B/Makefile" || { echo "SKIP: configure found no clang (replay passed)"; exit 77; }
if grep -q '^SAN_CFLAGS = ..*' "$B/Makefile"; then
	echo "SKIP: a sanitizer build tree (replay passed; the plain tree runs libFuzzer)"
	exit 77
fi
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT
# a make of its own, not a job of the make check that runs this
env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s -C "$B" fuzz-chat >"$tmp/build" 2>&1 ||
	fail "make fuzz-chat: $(tail -20 "$tmp/build")"
mkdir "$tmp/corpus"
cp "$src"/tests/chat/templates/*.jinja "$src"/tests/chat/fuzz-corpus/* "$tmp/corpus/" || fail "no corpus"
"$B/tests/fuzz/fuzz_chat" -runs=3000 -seed=1 -max_len=8192 -rss_limit_mb=2048 -timeout=20 \
	"$tmp/corpus" >"$tmp/log" 2>&1 || fail "fuzz_chat: $(tail -30 "$tmp/log")"
grep -q "Done 3000 runs" "$tmp/log" || fail "fuzz_chat did not finish its runs: $(tail -5 "$tmp/log")"
echo "fuzz_chat: corpus replayed, 3000 generated inputs without a finding"
