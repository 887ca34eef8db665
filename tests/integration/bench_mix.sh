#!/bin/sh
# Description: mlens-bench serve with mixed lengths (CPU backend, the tiny
# model of mlens-mkmodel): log-uniform ranges drawn from --seed give the
# same requests for the same seed and others for another, every length
# inside its range; a --lengths file gives exactly its pairs; a bad line of
# it is refused with file:line and what is wrong, before any daemon starts;
# the JSON has the step-token and KV-occupancy distribution, ordered and in
# range; a fixed length keeps every request at it; the bound's model counts
# the experts and KV cache the daemon runs (fp8 ones with their scales).
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }
bench="$B/tests/bench/mlens-bench"
"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny >/dev/null || fail "mlens-mkmodel"

serve() {
	out=$1
	shift
	timeout 240 "$bench" serve --model "$tmp/m" --mlensd "$mlensd" --backend cpu --kv-cache 8M \
		--concurrency 32 --threads 2 --json "$@" >"$out" 2>"$out.err" ||
		fail "serve $*: exit $?: $(tail -3 "$out.err")"
}

serve "$tmp/a.json" --prompt-len 4:48 --gen-len 1:24 --seed 7 --requests 600
serve "$tmp/b.json" --prompt-len 4:48 --gen-len 1:24 --seed 7 --requests 600
serve "$tmp/c.json" --prompt-len 4:48 --gen-len 1:24 --seed 8 --requests 600
printf '# prompt gen\n10 3\n\n40 1\n  7\t12\n' >"$tmp/pairs"
serve "$tmp/f.json" --lengths "$tmp/pairs" --requests 7
serve "$tmp/x.json" --prompt-len 16 --gen-len 5 --requests 40
serve "$tmp/q.json" --prompt-len 16 --gen-len 5 --requests 8 \
	--daemon-arg=--weight-dtype=fp8 --daemon-arg=--kv-dtype=fp8
python3 - "$tmp" <<'PY' || fail "JSON: $(head -c 600 "$tmp/a.json")"
import json, sys
d = {k: json.load(open(f"{sys.argv[1]}/{k}.json")) for k in "abcfx"}
a, b, c, f, x = (d[k] for k in "abcfx")
for r in d.values():
    assert r["requests_ok"] == r["requests"] and r["requests_failed"] == 0, r
# the same seed, the same requests; another seed, others
assert (a["prompt_tokens"], a["generated_tokens"]) == (b["prompt_tokens"], b["generated_tokens"]), (a, b)
assert (a["prompt_tokens"], a["generated_tokens"]) != (c["prompt_tokens"], c["generated_tokens"]), (a, c)
L = a["lengths"]
assert (L["prompt_min"], L["prompt_max"], L["gen_min"], L["gen_max"], L["seed"]) == (4, 48, 1, 24, 7), L
assert 4 <= L["prompt_mean"] <= 48 and 1 <= L["gen_mean"] <= 24, L
assert abs(a["prompt_tokens"] - 600 * L["prompt_mean"]) < 1e-4 * a["prompt_tokens"], a
assert abs(a["generated_tokens"] - 600 * L["gen_mean"]) < 1e-4 * a["generated_tokens"], a
# a mix is not one length: both lengths spread (log-uniform over 4..48
# gives a mean far from either end)
assert 8 < L["prompt_mean"] < 30, L
# the file's pairs in turn: 10 3, 40 1, 7 12, then 10 3, 40 1, 7 12, 10 3
assert f["prompt_tokens"] == 2 * (10 + 40 + 7) + 10, f
assert f["generated_tokens"] == 2 * (3 + 1 + 12) + 3, f
L = f["lengths"]
assert L["from"].endswith("pairs"), L
assert (L["prompt_min"], L["prompt_max"], L["gen_min"], L["gen_max"]) == (7, 40, 1, 12), L
# a fixed length: every request at it
assert x["prompt_tokens"] == 40 * 16 and x["generated_tokens"] == 40 * 5, x
assert (x["prompt_len"], x["gen_len"]) == (16, 5), x
for r in (a, c, x):
    s = r["steps_sampled"]
    assert s["over"] in ("steady", "run"), s
    if s["steps"] == 0:
        continue
    t, k = s["step_tokens"], s["kv_occupancy"]
    assert 1 <= t["min"] <= t["p10"] <= t["p50"] <= t["p90"] <= r["step_token_cap"], s
    # a read just after the step that finished the last sequences sees
    # the pool empty
    assert 0 <= k["min"] <= k["p10"] <= k["p50"] <= k["p90"] <= 1, s
# the bound's model is the daemon's: bf16 experts and KV as the file has
# them, then fp8 experts quantized at load (a byte an element, a scale a
# row of each matrix, every piece rounded up to 16 bytes) and an fp8 KV
# cache (a byte an element, a scale a row of K and of V)
q = json.load(open(f"{sys.argv[1]}/q.json"))
assert q["requests_ok"] == q["requests"], q
cfg = json.load(open(f"{sys.argv[1]}/m/config.json"))
H, I, nkv, hd = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_key_value_heads", "head_dim"))
p16 = lambda n: (n + 15) // 16 * 16
assert x["bound_model"] == {"expert_dtype": "BF16", "expert_bytes": 3 * H * I * 2,
                            "kv_dtype": "BF16", "kv_token_bytes": 2 * nkv * hd * 2}, x["bound_model"]
assert q["bound_model"] == {"expert_dtype": "F8_E4M3",
                            "expert_bytes": 3 * p16(H * I) + 2 * p16(4 * I) + p16(4 * H),
                            "kv_dtype": "F8_E4M3", "kv_token_bytes": 2 * nkv * hd + 2 * nkv * 4}, q["bound_model"]
# at least one run saw steps (10 reads a second over runs of ~1 s)
assert sum(r["steps_sampled"]["steps"] for r in (a, b, c)) > 0, [r["steps_sampled"] for r in (a, b, c)]
PY

# bad --lengths lines: refused with file:line and what is wrong, exit 2
bad() {
	printf "$1" >"$tmp/bad"
	"$bench" serve --model "$tmp/m" --mlensd "$mlensd" --backend cpu --lengths "$tmp/bad" \
		--requests 4 >/dev/null 2>"$tmp/bad.err"
	rc=$?
	[ $rc -eq 2 ] || fail "lengths '$1': exit $rc, not 2: $(cat "$tmp/bad.err")"
	grep -q "$2" "$tmp/bad.err" || fail "lengths '$1': no '$2' in: $(cat "$tmp/bad.err")"
}
bad '10 3\n12\n' "$tmp/bad:2: '12': expected two whole numbers \"P G\""
bad '10 3\n\n5 x\n' "$tmp/bad:3: .*expected two whole numbers"
bad '10 3\n0 4\n' "$tmp/bad:2: prompt 0, generation 4: both must be between 1"
bad '10 3 9\n' "$tmp/bad:1: .*nothing after them"
bad '# nothing\n' "$tmp/bad: no \"P G\" line"
"$bench" serve --model "$tmp/m" --mlensd "$mlensd" --prompt-len 9:3 >/dev/null 2>"$tmp/r.err"
[ $? -eq 2 ] && grep -q "^serve: --prompt-len '9:3': give a length N or a range LO:HI" "$tmp/r.err" ||
	fail "a reversed range: $(cat "$tmp/r.err")"
# a request over the daemon's context (the tiny model: 4096 positions): named with its line
printf '10 3\n4000 100\n' >"$tmp/long"
"$bench" serve --model "$tmp/m" --mlensd "$mlensd" --backend cpu --kv-cache 8M --lengths "$tmp/long" \
	--requests 4 >/dev/null 2>"$tmp/long.err"
[ $? -eq 1 ] && grep -q "^serve: $tmp/long:2: request 1: p=4000 g=100 is over the daemon's limits" "$tmp/long.err" ||
	fail "a request over the context: $(cat "$tmp/long.err")"
exit 0
