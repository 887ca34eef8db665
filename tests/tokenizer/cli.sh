#!/bin/sh
# Description: mlens tokenize and mlens detokenize: JSON lines in order
# through the committed SentencePiece-style and byte-level fixtures, ids
# exactly as the Hugging Face goldens, a round trip back to the text,
# --add-special adding BOS, --skip-special dropping it, a bad line
# answered by an error line (exit 1), and usage or model trouble (exit 2).
set -u
bin="${MLENS_BUILDDIR:-.}/client/mlens"
src="${MLENS_SRCDIR:-.}"
fx="$src/tests/tokenizer/fixtures"
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

printf '%s\n' '{"text": "Hello world"}' '{"text": "The quick brown fox jumps over the lazy dog."}' \
	'{"text": "东京是日本的首都"}' '{"text": ""}' >"$tmp/in.jsonl"
"$bin" tokenize --model "$fx/spm" <"$tmp/in.jsonl" >"$tmp/tok.jsonl" || fail "tokenize: exit $?"
# the goldens of the same strings (make_fixtures.py)
[ "$(sed -n 1p "$tmp/tok.jsonl")" = '{"tokens":[351,75,513,555,449,291,283]}' ] ||
	fail "tokenize line 1: $(sed -n 1p "$tmp/tok.jsonl")"
[ "$(sed -n 4p "$tmp/tok.jsonl")" = '{"tokens":[]}' ] || fail "empty text: $(sed -n 4p "$tmp/tok.jsonl")"
[ "$(wc -l <"$tmp/tok.jsonl")" -eq 4 ] || fail "tokenize wrote $(wc -l <"$tmp/tok.jsonl") lines for 4"
"$bin" detokenize --model "$fx/spm" -i "$tmp/tok.jsonl" -o "$tmp/text.jsonl" || fail "detokenize: exit $?"
printf '%s\n' '{"text":"Hello world"}' '{"text":"The quick brown fox jumps over the lazy dog."}' \
	'{"text":"东京是日本的首都"}' '{"text":""}' >"$tmp/want.jsonl"
cmp -s "$tmp/text.jsonl" "$tmp/want.jsonl" || fail "round trip: $(cat "$tmp/text.jsonl")"

# special tokens only when asked
echo '{"text": "Hello world"}' | "$bin" tokenize --model "$fx/spm" --add-special >"$tmp/s.jsonl" ||
	fail "tokenize --add-special: exit $?"
[ "$(cat "$tmp/s.jsonl")" = '{"tokens":[1,351,75,513,555,449,291,283]}' ] || fail "--add-special: $(cat "$tmp/s.jsonl")"
"$bin" detokenize --model "$fx/spm" <"$tmp/s.jsonl" >"$tmp/d.jsonl" || fail "detokenize: exit $?"
[ "$(cat "$tmp/d.jsonl")" = '{"text":"<s> Hello world"}' ] || fail "detokenize with BOS: $(cat "$tmp/d.jsonl")"
"$bin" detokenize --model "$fx/spm" --skip-special <"$tmp/s.jsonl" >"$tmp/d.jsonl" || fail "exit $?"
[ "$(cat "$tmp/d.jsonl")" = '{"text":"Hello world"}' ] || fail "--skip-special: $(cat "$tmp/d.jsonl")"

# byte-level: special tokens in the text are matched, CJK round trips
printf '%s\n' '{"text": "<|im_start|>user\nHi 東京<|im_end|>"}' | "$bin" tokenize --model "$fx/bytelevel" |
	"$bin" detokenize --model "$fx/bytelevel" >"$tmp/b.jsonl" || fail "byte-level round trip: exit $?"
[ "$(cat "$tmp/b.jsonl")" = '{"text":"<|im_start|>user\nHi 東京<|im_end|>"}' ] || fail "byte-level: $(cat "$tmp/b.jsonl")"

# a bad line: an error line in its place, the others still answered, exit 1
printf '%s\n' '{"text": "a"}' '{"txt": "b"}' 'not json' '{"text": "c"}' >"$tmp/bad.jsonl"
"$bin" tokenize --model "$fx/spm" -i "$tmp/bad.jsonl" >"$tmp/out" 2>"$tmp/err"
[ $? -eq 1 ] || fail "bad lines: exit not 1"
[ "$(wc -l <"$tmp/out")" -eq 4 ] || fail "bad lines: $(cat "$tmp/out")"
sed -n 2p "$tmp/out" | grep -q '"error":"expected an object with one key \\"text\\"' || fail "line 2: $(sed -n 2p "$tmp/out")"
grep -q "line 3: not valid JSON" "$tmp/err" || fail "stderr: $(cat "$tmp/err")"
echo '{"tokens": [1, 99999]}' | "$bin" detokenize --model "$fx/spm" >"$tmp/out" 2>"$tmp/err"
[ $? -eq 1 ] || fail "bad id: exit not 1"
grep -q 'tokens\[1\] is not a token id of this vocabulary' "$tmp/out" || fail "bad id: $(cat "$tmp/out")"

# usage and model trouble: exit 2 with the reason
expect_trouble() {	# expected-substring args...
	want=$1; shift
	"$bin" "$@" </dev/null >/dev/null 2>"$tmp/err"
	rc=$?
	[ $rc -eq 2 ] || fail "mlens $*: exit $rc, expected 2"
	grep -q -- "$want" "$tmp/err" || fail "mlens $*: stderr lacks '$want': $(cat "$tmp/err")"
}
expect_trouble "--model DIR is required" tokenize
expect_trouble "$tmp/none/tokenizer.json: No such file" tokenize --model "$tmp/none"
expect_trouble "--add-special belongs to mlens tokenize" detokenize --model "$fx/spm" --add-special
expect_trouble "unexpected argument" tokenize --model "$fx/spm" extra
expect_trouble "$tmp: read failed: Is a directory" tokenize --model "$fx/spm" -i "$tmp"

# CRLF line ends are taken off and blank lines skipped
printf '{"text": "Hello world"}\r\n\n\r\n{"text": ""}' | "$bin" tokenize --model "$fx/spm" >"$tmp/out" ||
	fail "CRLF and blank lines: exit $?"
[ "$(cat "$tmp/out")" = "$(printf '%s\n' '{"tokens":[351,75,513,555,449,291,283]}' '{"tokens":[]}')" ] ||
	fail "CRLF and blank lines: $(cat "$tmp/out")"
echo "mlens tokenize/detokenize: goldens, round trips, specials, bad lines and usage as documented"
