#!/bin/sh
# Description: kv_dtype = fp8 through a real mlensd (CPU backend, a small
# random bf16 model with head_dim 128): status and the start-up log name the
# KV dtype, the same kv_cache holds about twice the tokens of bf16 (head_dim
# + 4 bytes a row against 2 x head_dim), greedy generation gives whole
# results of valid tokens that mostly agree with the bf16 cache's; the
# fp32 model's auto rule stays fp32; a bad value is refused, naming the key.
# MLENS_KVFP8_BACKEND=cuda runs the same checks on the GPU (GPU-only mode:
# the CUDA append and decode on the fp8 pool); MLENS_KVFP8_ARGS adds mlensd
# flags (a small --gpu-memory for hybrid mode).
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }
mlens="$B/client/mlens"
be=${MLENS_KVFP8_BACKEND:-cpu}

# field of status's budgets.kv_cache
kvfield() { ctl --json status | python3 -c 'import json,sys; print(json.load(sys.stdin)["budgets"]["kv_cache"][sys.argv[1]])' "$1"; }
serve() {
	start_mlensd --model "$1" --kv-cache 8M --mlock=false --threads 1 --backend "$be" ${MLENS_KVFP8_ARGS:-} $2
}
stop() { kill "$pid" && wait "$pid"; pid=; }
# greedy tokens of 24 prompts, one line of ids per prompt, into $1
gen() {
	python3 -c 'for i in range(24): print("{\"prompt\": [%d, %d, %d, 7, 9, 11], \"max_tokens\": 12, \"ignore_eos\": true}" % (i + 3, 2 * i + 5, 300 - i))' >"$tmp/in"
	"$mlens" generate -q -s "$tmp/t.sock" -i "$tmp/in" -o "$tmp/raw" || fail "generate"
	python3 -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    assert r["finish_reason"] == "length" and len(r["tokens"]) == 12, l
    assert all(0 <= t < 512 for t in r["tokens"]), l
    print(" ".join(map(str, r["tokens"])))' "$tmp/raw" >"$1" || fail "results: $(head -3 "$tmp/raw")"
}

"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny --head-dim 128 --seed 11 >/dev/null || fail "mlens-mkmodel"

serve "$tmp/m" "--kv-dtype bf16"
[ "$(kvfield dtype)" = BF16 ] || fail "status KV dtype $(kvfield dtype), want BF16"
bf16_tokens=$(kvfield tokens_total)
gen "$tmp/bf16"
stop

serve "$tmp/m" "--kv-dtype fp8"
[ "$(kvfield dtype)" = F8_E4M3 ] || fail "status KV dtype $(kvfield dtype), want F8_E4M3"
grep -q "KV cache: .*(F8_E4M3, " "$tmp/log" || fail "start-up log does not name the fp8 KV cache"
ctl status | grep -q "^KV cache .*F8_E4M3" || fail "mlensctl status: $(ctl status | grep KV)"
fp8_tokens=$(kvfield tokens_total)
# 256 / 132 bytes a row: 1.94 x, less a block lost to rounding
[ $((fp8_tokens * 100)) -ge $((bf16_tokens * 190)) ] && [ $((fp8_tokens * 100)) -le $((bf16_tokens * 194)) ] ||
	fail "fp8 pool holds $fp8_tokens tokens, bf16 $bf16_tokens: want about 1.94 x"
gen "$tmp/fp8"
stop
same=$(python3 -c 'import sys
a = [l.split() for l in open(sys.argv[1])]; b = [l.split() for l in open(sys.argv[2])]
print(sum(x[0] == y[0] for x, y in zip(a, b)), sum(x == y for x, y in zip(a, b)))' "$tmp/bf16" "$tmp/fp8")
set -- $same
# first tokens: the fp8 error must not change most greedy choices
[ "$1" -ge 20 ] || fail "fp8 KV: only $1 of 24 first tokens agree with bf16 KV ($2 whole sequences)"
echo "ok: fp8 KV holds $fp8_tokens tokens against bf16's $bf16_tokens; $1/24 first tokens and $2/24 sequences agree with bf16"

# the accuracy tool on the same model: its control (bf16 against bf16) is
# exact, and fp8 agrees on most greedy tokens with a small logprob shift
kvc() { "$B/daemon/mlens-kvcompare" --model "$tmp/m" --prompts 16 --prompt-len 12 --gen 6 --threads 1 --backend "$be" --json "$tmp/kvc.json" "$@" >/dev/null || fail "mlens-kvcompare $*"; }
jnum() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$tmp/kvc.json" "$1"; }
kvc --test bf16
[ "$(jnum greedy_agreement_tokens)" = 1.0 ] && [ "$(jnum max_abs_logprob_diff)" = 0.0 ] ||
	fail "kvcompare control: $(cat "$tmp/kvc.json")"
kvc --test fp8
python3 -c 'import json,sys; r = json.load(open(sys.argv[1]))
assert r["test"] == "F8_E4M3" and r["greedy_agreement_tokens"] >= 0.8 and 0 < r["mean_abs_logprob_diff"] < 0.05, r' "$tmp/kvc.json" ||
	fail "kvcompare fp8: $(cat "$tmp/kvc.json")"
echo "ok: mlens-kvcompare: control exact; fp8 agreement $(jnum greedy_agreement_tokens), mean |dlogprob| $(jnum mean_abs_logprob_diff)"

# the auto rule keeps fp32 for an fp32 model
"$B/daemon/mlens-mkmodel" -o "$tmp/m32" --preset tiny --dtype fp32 --seed 11 >/dev/null || fail "mlens-mkmodel fp32"
serve "$tmp/m32" ""
[ "$(kvfield dtype)" = F32 ] || fail "auto KV dtype for an fp32 model: $(kvfield dtype)"
stop
serve "$tmp/m32" "--kv-dtype fp8"
[ "$(kvfield dtype)" = F8_E4M3 ] || fail "fp32 model with kv_dtype fp8: $(kvfield dtype)"
gen "$tmp/fp8_32"
stop
echo "ok: auto keeps F32 for an fp32 model; fp8 serves it too"

# a value outside the list is refused before start-up, naming the key
if "$mlensd" --model "$tmp/m" --kv-dtype fp4 --foreground --socket "$tmp/t.sock" \
	--control "$tmp/c.sock" --stats "$tmp/s.sock" --log "$tmp/log2" >"$tmp/err" 2>&1; then
	fail "kv_dtype fp4 accepted"
fi
grep -q "kv.dtype" "$tmp/err" "$tmp/log2" 2>/dev/null || fail "refusal does not name kv_dtype: $(cat "$tmp/err")"
echo "ok: kv_dtype fp4 refused"
