#!/bin/sh
# Description: the op time account in a real mlensd (CPU backend, the tiny
# model of mlens-mkmodel; a CPU-only daemon runs the engine, whose marks
# are the host clock): with --op-timing, after a few requests the stats
# socket's gpu_ops names every op of the one list, the ops a CPU step runs
# have seconds > 0, calls per step as the layers make them and the FLOPs
# of the rows the requests carried, the ops fit inside their span, every
# step is timed; /metrics has mlens_gpu_op_seconds_total per op and the
# span; without the flag there is no account (no gpu_ops, no series).
# Times are only checked to be positive, never against a speed.
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }
command -v curl >/dev/null || { echo "SKIP: needs curl for /metrics"; exit 77; }

"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny >/dev/null || fail "mlens-mkmodel"
start_mlensd --model "$tmp/m" --backend cpu --threads 1 --mlock=false --kv-cache 4M \
	--stats-http 127.0.0.1:0 --op-timing
grep -q "op_timing: every step's ops timed on the cpu backend" "$tmp/log" || fail "no op_timing line in the log"
"$tenant" "$tmp/t.sock" a 3 5 >"$tmp/gen" || fail "tenant: $(cat "$tmp/gen")"
[ "$(grep -c 'status 0 finish [0-9]* tokens 5' "$tmp/gen")" = 3 ] || fail "requests: $(cat "$tmp/gen")"
"$raw" "unix:$tmp/s.sock" 3000 </dev/null >"$tmp/s.json" || fail "stats socket"
port=$(stats_port)
curl -sf "http://127.0.0.1:$port/metrics" >"$tmp/metrics" || fail "GET /metrics"
python3 - "$tmp/s.json" "$tmp/m/config.json" "$tmp/metrics" <<'PY' || fail "gpu_ops: $(head -c 1500 "$tmp/s.json")"
import json, sys
s = json.load(open(sys.argv[1]))
c = json.load(open(sys.argv[2]))
ops = s["gpu_ops"]
names = ["norm", "qkv_gemm", "rope", "kv_store", "prefill_attention", "decode_attention", "o_gemm",
         "router", "moe", "lm_head_gemm", "sample", "embed"]
assert sorted(ops) == sorted(names), sorted(ops)
# the CPU backend's prompts read the paged cache: no prefill attention op
ran = [n for n in names if n != "prefill_attention"]
for n in ran:
    assert ops[n]["seconds"] > 0 and ops[n]["calls"] > 0, (n, ops[n])
assert ops["prefill_attention"] == {"seconds": 0, "flops": 0, "calls": 0}, ops["prefill_attention"]
steps = s["steps_total"]
assert steps > 0 and s["gpu_op_steps_total"] == steps, (steps, s["gpu_op_steps_total"])
assert s["gpu_ops_dropped_total"] == 0, s["gpu_ops_dropped_total"]
L, H, V = c["num_hidden_layers"], c["hidden_size"], c["vocab_size"]
qd = c["num_attention_heads"] * c.get("head_dim", H // c["num_attention_heads"])
# per step: one QKV, O and router GEMM a layer; two norms a layer and
# the head's gather and final norm
assert ops["qkv_gemm"]["calls"] == L * steps and ops["o_gemm"]["calls"] == L * steps, ops
assert ops["norm"]["calls"] == (2 * L + 2) * steps, ops["norm"]
assert ops["embed"]["calls"] == steps and ops["sample"]["calls"] == steps, ops
# rows: every prompt token and every generated token but each request's last
rows = s["prompt_tokens_total"] + s["generation_tokens_total"] - s["requests_done_total"]
assert ops["o_gemm"]["flops"] == 2 * rows * qd * H * L, (ops["o_gemm"], rows)
assert ops["lm_head_gemm"]["flops"] == 2 * s["generation_tokens_total"] * H * V, ops["lm_head_gemm"]
assert ops["moe"]["flops"] == 2 * 3 * rows * c["num_experts_per_tok"] * H * c["intermediate_size"] * L, ops["moe"]
assert ops["rope"]["flops"] == 0 and ops["decode_attention"]["flops"] > 0, ops
total = sum(o["seconds"] for o in ops.values())
span = s["gpu_op_span_seconds_total"]
assert 0 < total <= span * (1 + 1e-6) + 1e-9, (total, span)
m = {}
for line in open(sys.argv[3]):
    if line.startswith("mlens_gpu_op"):
        k, v = line.rsplit(" ", 1)
        m[k] = float(v)
for n in names:
    k = 'mlens_gpu_op_seconds_total{op="%s"}' % n
    assert k in m and abs(m[k] - ops[n]["seconds"]) <= 1e-7 * ops[n]["seconds"], (k, m.get(k), ops[n])
assert m['mlens_gpu_op_seconds_total{op="moe"}'] > 0, m
assert m["mlens_gpu_op_span_seconds_total"] > 0, m
print("op_timing: %d steps, ops %.3f ms of a %.3f ms span" % (steps, total * 1e3, span * 1e3))
PY
grep -q '^# TYPE mlens_gpu_op_seconds_total counter$' "$tmp/metrics" || fail "no TYPE for mlens_gpu_op_seconds_total"
kill "$pid" && wait "$pid"
pid=

# ==== without the flag: no account ====
rm -f "$tmp/log"
start_mlensd --model "$tmp/m" --backend cpu --threads 1 --mlock=false --kv-cache 4M --stats-http 127.0.0.1:0
"$tenant" "$tmp/t.sock" b 1 3 >"$tmp/gen" || fail "tenant: $(cat "$tmp/gen")"
"$raw" "unix:$tmp/s.sock" 3000 </dev/null >"$tmp/s.json" || fail "stats socket"
grep -q '"steps_total":[1-9]' "$tmp/s.json" || fail "no steps: $(head -c 300 "$tmp/s.json")"
grep -q 'gpu_op' "$tmp/s.json" && fail "gpu_ops without --op-timing"
port=$(stats_port)
curl -sf "http://127.0.0.1:$port/metrics" >"$tmp/metrics" || fail "GET /metrics"
grep -q '^mlens_gpu_op' "$tmp/metrics" && fail "op series without --op-timing"
grep -q 'op_timing' "$tmp/log" && fail "op_timing logged without the flag"
exit 0
