#!/bin/sh
# Description: the scheduler keeps steps full through a mixed-length job
# (CPU backend, the tiny model of mlens-mkmodel, driven by mlens-bench
# serve): prompts up to nearly the token cap wait at most a bounded number
# of steps and then go in place of some decode tokens (put off a step),
# so the steps do not shrink while the running batch drains below cap -
# prompt with the queue full; steps under half the cap while requests
# waited stay a small share, with no preemption. And mlens-bench serve's
# job sizing: --pool-fulls N draws N KV pools' worth of the mix, the
# default concurrency keeps two pools' worth in flight, and the JSON has
# the ramp-up and drain seconds.
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }
bench="$B/tests/bench/mlens-bench"
"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny >/dev/null || fail "mlens-mkmodel"

serve() {
	out=$1
	shift
	timeout 240 "$bench" serve --model "$tmp/m" --mlensd "$mlensd" --backend cpu --threads 2 \
		--max-step-tokens 512 --prompt-len 4:500 --gen-len 2:64 --seed 3 --json "$@" >"$out" 2>"$out.err" ||
		fail "serve $*: exit $?: $(tail -3 "$out.err")"
}

# the KV pool holds far more than the cap lets run: the cap, not KV,
# holds the long prompts back; the whole job queued at once
serve "$tmp/a.json" --kv-cache 8M --requests 300 --concurrency 300
# a small pool: three pool-fulls, the in-flight count left to the bench
serve "$tmp/b.json" --kv-cache 1M --pool-fulls 3

python3 - "$tmp" <<'PY' || fail "JSON: $(head -c 1500 "$tmp/a.json")"
import json, math, sys
a = json.load(open(f"{sys.argv[1]}/a.json"))
b = json.load(open(f"{sys.argv[1]}/b.json"))
for r in (a, b):
    assert r["requests_ok"] == r["requests"] and r["requests_failed"] == 0, r
    assert r["preemptions"] == 0 and r["repreemptions"] == 0, r
    assert r["steps_short"] is not None and r["decodes_deferred"] is not None, r
# a prompt near the cap waits a bounded number of steps, then takes the
# place of decodes: without that the batch drains below cap - prompt
# for it, a run of small steps each time, with the queue full
assert a["decodes_deferred"] > 0, a
assert a["steps_short"] <= 0.05 * a["steps"], (a["steps_short"], a["steps"])
# the job's size in pools and the default in-flight count: two pools
assert b["pool_fulls"] == 3 and b["concurrency_from"] == "kv pool", b
S = b["pool_sequences"]
assert S >= 1 and b["requests"] == math.ceil(3 * S), (S, b["requests"])
assert b["concurrency"] == min(b["requests"], math.ceil(2 * S)), (S, b["concurrency"])
assert a["concurrency"] == 300 and a["concurrency_from"] == "flag" and a["pool_fulls"] is None, a
# ramp-up and drain: inside the run, around the steady window
for r in (a, b):
    st = r["steady"]
    assert st is not None, r
    assert abs(r["ramp_up_s"] - st["start_s"]) < 1e-3, r
    assert abs(r["drain_s"] - (r["wall_seconds"] - st["end_s"])) < 1e-3, r
    assert 0 <= r["ramp_up_s"] and 0 <= r["drain_s"] and r["ramp_up_s"] + r["drain_s"] < r["wall_seconds"], r
PY

# a bad --pool-fulls, or one beside --requests, is refused before any
# daemon starts
"$bench" serve --model "$tmp/m" --mlensd "$mlensd" --pool-fulls 0 >/dev/null 2>"$tmp/pf.err"
[ $? -eq 2 ] && grep -q "^serve: --pool-fulls '0': give a whole number of KV pools, 1 or more" "$tmp/pf.err" ||
	fail "--pool-fulls 0: $(cat "$tmp/pf.err")"
"$bench" serve --model "$tmp/m" --mlensd "$mlensd" --pool-fulls 2 --requests 9 >/dev/null 2>"$tmp/pf.err"
[ $? -eq 2 ] && grep -q "^serve: give the job's size as --requests or as --pool-fulls, not both" "$tmp/pf.err" ||
	fail "--pool-fulls with --requests: $(cat "$tmp/pf.err")"
exit 0
