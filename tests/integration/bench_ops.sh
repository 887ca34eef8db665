#!/bin/sh
# Description: mlens-bench ops on the CPU backend (the tiny model of
# mlens-mkmodel): every op kind a step runs has a time, the GEMM-like ops
# their FLOPs from the step's shape and a rate that is FLOPs over time, and
# the ops plus the launch gaps make up the probed step; the backend is
# started with mlensd's default options for the model (bf16 prefill
# attention for a 16-bit model, fp32 for an fp32 one); bad arguments are
# refused. Times are not compared with any speed.
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }
bench="$B/tests/bench/mlens-bench"
"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny >/dev/null || fail "mlens-mkmodel"
timeout 120 "$bench" ops --model "$tmp/m" --backend cpu --prompt-len 16 --prompts 2 --decode 4 \
	--context 20 --steps 3 --json >"$tmp/o.json" 2>"$tmp/err" || fail "ops: exit $?: $(cat "$tmp/err")"
python3 - "$tmp/o.json" "$tmp/m/config.json" <<'PY' || fail "JSON: $(head -c 800 "$tmp/o.json")"
import json, math, sys
d = json.load(open(sys.argv[1]))
c = json.load(open(sys.argv[2]))
assert d["backend"] == "cpu" and d["tokens"] == 2 * 16 + 4, d
assert d["prefill_op"] is False, d   # the CPU backend's prefill reads the paged cache
ops = {o["op"]: o for o in d["ops"]}
ran = ["embed", "norm", "qkv_gemm", "rope", "kv_store", "decode_attention", "o_gemm",
       "router", "moe", "lm_head_gemm", "sample"]
for name in ran:
    assert ops[name]["seconds"] > 0 and ops[name]["calls"] > 0, ops[name]
assert ops["prefill_attention"]["calls"] == 0 and ops["prefill_attention"]["seconds"] == 0, ops
L, H, V = c["num_hidden_layers"], c["hidden_size"], c["vocab_size"]
# per step: qkv, o, router, rope x2, k/v store, attention, moe per layer;
# two norms a layer and the final norm's gather and norm
assert ops["qkv_gemm"]["calls"] == L and ops["o_gemm"]["calls"] == L, ops
assert ops["norm"]["calls"] == 2 * L + 2, ops["norm"]
assert ops["lm_head_gemm"]["flops"] == 2 * 6 * H * V, ops["lm_head_gemm"]
qd = c["num_attention_heads"] * c.get("head_dim", H // c["num_attention_heads"])
assert ops["o_gemm"]["flops"] == 2 * 36 * qd * H * L, ops["o_gemm"]
for o in d["ops"]:
    if o["flops"] > 0 and o["seconds"] > 0:
        assert abs(o["tflops"] - o["flops"] / o["seconds"] / 1e12) <= 1e-4 * o["tflops"], o
total = sum(o["seconds"] for o in d["ops"])
assert abs(total - d["ops_seconds"]) <= 1e-9 + 1e-5 * total, (total, d["ops_seconds"])
# the CPU backend has timing marks (its clock): ops, the gaps between them
# and the host's time outside them make up the probed step
assert d["timing"] == "marks", d["timing"]
assert d["gaps_seconds"] >= -1e-9 and d["host_seconds"] >= -1e-9, d
parts = d["ops_seconds"] + d["gaps_seconds"] + d["host_seconds"]
assert abs(parts - d["probed_step_seconds"]) <= 1e-5 * d["probed_step_seconds"], d
assert d["step_seconds"] > 0, d
# the backend options mlensd's defaults pick for a bf16 model: fast GEMMs,
# prefill attention on tensor cores
assert d["backend_opts"] == {"gemm": "fast", "prefill_attention": "bf16"}, d["backend_opts"]
PY
# an fp32 model keeps fp32 prefill attention, as mlensd's auto does
"$B/daemon/mlens-mkmodel" -o "$tmp/m32" --preset tiny --dtype fp32 >/dev/null || fail "mlens-mkmodel fp32"
timeout 120 "$bench" ops --model "$tmp/m32" --backend cpu --prompt-len 8 --prompts 1 --decode 2 \
	--context 10 --steps 1 --json >"$tmp/f.json" 2>"$tmp/err" || fail "ops fp32: $(cat "$tmp/err")"
python3 -c 'import json, sys; o = json.load(open(sys.argv[1]))["backend_opts"]; sys.exit(o != {"gemm": "fast", "prefill_attention": "fp32"})' \
	"$tmp/f.json" || fail "fp32 model's backend options: $(grep -A3 backend_opts "$tmp/f.json")"
# --waits: a wait after each op instead of the marks; the ops and the rest
# still make up the step
timeout 120 "$bench" ops --model "$tmp/m" --backend cpu --prompt-len 8 --prompts 1 --decode 2 \
	--context 10 --steps 2 --waits --json >"$tmp/w.json" 2>"$tmp/err" || fail "ops --waits: $(cat "$tmp/err")"
python3 - "$tmp/w.json" <<'PY' || fail "JSON --waits: $(head -c 800 "$tmp/w.json")"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["timing"] == "waits" and d["host_seconds"] == 0 and d["gaps_seconds"] >= 0, d
assert all(o["seconds"] > 0 for o in d["ops"] if o["calls"]), d["ops"]
assert abs(d["ops_seconds"] + d["gaps_seconds"] - d["probed_step_seconds"]) <= 1e-5 * d["probed_step_seconds"], d
PY
"$bench" ops --model "$tmp/m" --backend cpu --steps 0 >/dev/null 2>&1
[ $? -eq 2 ] || fail "--steps 0 accepted"
"$bench" ops --model "$tmp/m" --backend cpu --context 5000 >/dev/null 2>"$tmp/err2"
[ $? -eq 1 ] && grep -q "^ops: --context 5000 plus 11 steps, or --prompt-len 512, is past the model's 4096 positions" "$tmp/err2" ||
	fail "a context past the model: $(cat "$tmp/err2")"
exit 0
