#!/bin/sh
# Description: `mlens generate` against a real mlensd (CPU backend, tiny
# random model): generation ends at the model's EOS id (config.json's, then
# a list in generation_config.json, which wins) with that token last and
# finish "stop", and runs past it with "ignore_eos"; with the defaults a
# batch of 200 has all 200 in flight at once; SIGINT mid-run cancels the
# running requests and still writes one whole JSON result per input line,
# in order, exit 130, the daemon left idle; a second SIGINT quits at once
# leaving whole lines only.
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }
mlens="$B/client/mlens"

# the results file $1: every line a JSON object, index 0.. in order;
# prints "count finish_reasons..." (one word a line)
results() {
	python3 - "$1" <<'PY'
import json, sys
lines = open(sys.argv[1], encoding="utf-8").read().split("\n")
assert lines[-1] == "", "the last line is not whole"
rs = [json.loads(l) for l in lines[:-1]]
for i, r in enumerate(rs):
    assert r["index"] == i, "line %d has index %s" % (i, r["index"])
print(len(rs), " ".join(r["finish_reason"] for r in rs))
PY
}
# field $2 (JSON) of result line $3 (from 0) of file $1
field() {
	python3 -c 'import json,sys; print(json.dumps(json.loads(open(sys.argv[1]).read().split("\n")[int(sys.argv[3])])[sys.argv[2]], separators=(",", ":")))' "$@"
}
# MLENS_GENERATE_BACKEND=cuda runs the same checks on the GPU (the EOS
# rule is the scheduler's, whatever backend computes the tokens)
serve() {
	start_mlensd --model "$tmp/m" --kv-cache 64M --mlock=false --threads 1 --backend "${MLENS_GENERATE_BACKEND:-cpu}"
}

"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny --seed 3 >/dev/null || fail "mlens-mkmodel"
grep -q '"eos_token_id": 2,' "$tmp/m/config.json" || fail "mkmodel: eos_token_id 2 not in config.json"
serve
grep -q "EOS token ids: 2;" "$tmp/log" || fail "start-up log does not name EOS id 2"
ctl status | grep -q "^EOS token ids  *2 (generation ends there)" || fail "status: $(ctl status)"

# ==== EOS of config.json (2) ====
P='"prompt": [5, 6, 7], "max_tokens": 24'
echo "{$P, \"ignore_eos\": true}" >"$tmp/in"
"$mlens" generate -q -s "$tmp/t.sock" -i "$tmp/in" -o "$tmp/all" || fail "generate (ignore_eos)"
[ "$(results "$tmp/all")" = "1 length" ] || fail "ignore_eos: $(cat "$tmp/all")"
all=$(field "$tmp/all" tokens 0)
# expected: up to the first 2, or all 24 tokens when 2 never comes; and
# for generation_config.json, X: the first token (from the 4th on) not
# seen before it, Y: an id that never comes
exp=$(python3 -c 'import json,sys
t = json.loads(sys.argv[1])
def js(v): return json.dumps(v, separators=(",", ":"))
assert len(t) == 24
k = t.index(2) if 2 in t else None
print(js(t if k is None else t[:k + 1]), "length" if k is None else "stop")
x = next(i for i in range(3, 24) if t[i] not in t[:i])
print(js(t[:x + 1]), t[x], next(y for y in range(500, 0, -1) if y not in t))' "$all") ||
	fail "tokens: $all"
echo "{$P}" >"$tmp/in"
"$mlens" generate -q -s "$tmp/t.sock" -i "$tmp/in" -o "$tmp/out" || fail "generate"
[ "$(field "$tmp/out" tokens 0) $(field "$tmp/out" finish_reason 0 | tr -d '"')" = \
	"$(echo "$exp" | sed -n 1p)" ] || fail "EOS 2: got $(cat "$tmp/out"), all tokens $all"
echo "ok: EOS of config.json ends generation ($(echo "$exp" | sed -n 1p)); ignore_eos runs on"

# ==== defaults keep more than 64 requests in flight ====
python3 -c 'for i in range(200): print("{\"prompt\": [%d, 9], \"max_tokens\": 4}" % (i % 500 + 1))' \
	>"$tmp/in200"
"$mlens" generate -s "$tmp/t.sock" -i "$tmp/in200" -o "$tmp/out200" 2>"$tmp/err" ||
	fail "generate 200: $(cat "$tmp/err")"
[ "$(results "$tmp/out200" | cut -d' ' -f1)" = 200 ] || fail "200 results expected"
grep -q "up to 200 requests in flight" "$tmp/err" || fail "not all 200 in flight: $(cat "$tmp/err")"
limit=$(sed -n 's/.*in flight (limit \([0-9]*\)).*/\1/p' "$tmp/err")
[ "${limit:-0}" -gt 64 ] || fail "in-flight limit ${limit:-?} (want the daemon's, above 64)"
echo "ok: defaults: 200 in flight at once (limit $limit)"

# ==== generation_config.json wins: a list [Y, X] ====
set -- $(echo "$exp" | sed -n 2p)
want=$1 x=$2 y=$3
printf '{"bos_token_id": 1, "eos_token_id": [%s, %s]}\n' "$y" "$x" >"$tmp/m/generation_config.json"
kill "$pid" && wait "$pid"
pid=
serve
grep -q "EOS token ids: $y, $x;" "$tmp/log" || fail "start-up log does not name EOS ids $y, $x"
ctl status | grep -q "^EOS token ids  *$y, $x (generation" || fail "status: $(ctl status)"
echo "{$P}" >"$tmp/in"
echo "{$P, \"ignore_eos\": true}" >>"$tmp/in"
"$mlens" generate -q -s "$tmp/t.sock" -i "$tmp/in" -o "$tmp/out" || fail "generate"
[ "$(results "$tmp/out")" = "2 stop length" ] || fail "generation_config EOS: $(cat "$tmp/out")"
[ "$(field "$tmp/out" tokens 0)" = "$want" ] || fail "EOS $x: $(field "$tmp/out" tokens 0), want $want"
[ "$(field "$tmp/out" tokens 1)" = "$all" ] || fail "ignore_eos: $(field "$tmp/out" tokens 1)"
echo "ok: generation_config.json's EOS list [$y, $x] ends at $x"

# ==== SIGINT: every line gets a whole result, exit 130 ====
# (a background job of sh starts with SIGINT ignored, which mlens keeps)
env --default-signal=INT true 2>/dev/null || { echo "skip: SIGINT needs env --default-signal"; exit 0; }
python3 -c 'for i in range(300): print("{\"prompt\": [%d], \"max_tokens\": 4000, \"ignore_eos\": true}" % (i + 1))' \
	>"$tmp/slow"
env --default-signal=INT "$mlens" generate -s "$tmp/t.sock" -i "$tmp/slow" -o "$tmp/int" 2>"$tmp/err" &
gpid=$!
wait_for '[ "$(ctl --json status | jfield requests_running)" = 300 ]' 200 || fail "300 never ran: $(ctl status)"
kill -INT $gpid
wait $gpid
rc=$?
gpid=
[ $rc -eq 130 ] || fail "SIGINT: exit $rc, want 130: $(cat "$tmp/err")"
r=$(results "$tmp/int") || fail "SIGINT: results not whole JSON lines"
[ "$(echo "$r" | cut -d' ' -f1)" = 300 ] || fail "SIGINT: $(echo "$r" | cut -d' ' -f1) lines for 300"
[ "$(echo "$r" | tr ' ' '\n' | sed 1d | sort -u)" = cancelled ] || fail "SIGINT: finish reasons $r"
wait_for '[ "$(ctl --json status | jfield requests_running)" = 0 ]' || fail "SIGINT: requests still run"
echo "ok: SIGINT: 300 result lines, all cancelled, exit 130, daemon idle"

# ==== a second SIGINT quits at once: whole lines only ====
# The daemon stopped, the cancels go unanswered: the first SIGINT waits up
# to 5 s for them, the second ends that wait.
env --default-signal=INT "$mlens" generate -s "$tmp/t.sock" -i "$tmp/slow" -o "$tmp/int2" 2>"$tmp/err" &
gpid=$!
wait_for '[ "$(ctl --json status | jfield requests_running)" = 300 ]' 200 || fail "300 never ran: $(ctl status)"
kill -STOP "$pid"
kill -INT $gpid
sleep 0.5
t0=$(date +%s)
kill -INT $gpid
wait $gpid
rc=$?
gpid=
kill -CONT "$pid"
[ $rc -eq 130 ] || fail "second SIGINT: exit $rc, want 130"
[ $(($(date +%s) - t0)) -le 2 ] || fail "second SIGINT: mlens went on waiting"
results "$tmp/int2" >/dev/null || fail "second SIGINT: a line is not whole JSON"
grep -q "again to quit at once" "$tmp/err" || fail "first SIGINT not reported: $(cat "$tmp/err")"
echo "ok: a second SIGINT quits at once"
