#!/bin/sh
# Swap or recompute: a preemption-heavy workload (long prompts, a KV pool
# far too small for the requests in flight) run three times, with
# kv_swap_policy = always (every preempted sequence's KV to the swap file
# and back), never (every one re-prefills) and auto (the cost model
# chooses). Per run: wall seconds and generated tokens/s of the client,
# the daemon's CPU seconds, preemptions, swap-outs and recomputes from the
# daemon's stats, the swap file's write+read rate measured at start-up and
# the rates the cost model ended on, with their sources. Last, which of always and never was faster
# and whether auto chose the same way (most of its preemptions swapped or
# most recomputed). Greedy decoding: every run's tokens must be the same,
# which the script checks. By hand, not in make check: from a build tree,
#   tests/bench/kv_swap_bench.sh
# JSON per run and a summary (kv_swap_summary.json) under $OUT (default
# ./out), a table last; exit 1 when the tokens differ between runs.
#
# Environment: BACKEND (cpu; cuda runs hybrid mode, whose KV pool is in
# host memory: MLENS_KV_SWAP_FLAGS, default there --resident-experts 0),
# MODEL (a tiny fp32 Mixtral written to a scratch folder if unset; on cuda
# a 2-layer Mixtral-8x7B-shaped bf16 one, whose prefill is real GEMM
# work), P and G (prompt and
# generation length, 512 and 384; 512 and 64 on cuda), N (requests, 24), TENANTS (client
# processes at once, each a tenant with its share of the requests, 4), KV
# (the KV pool, 700K: three prompts, so that their growth preempts; on
# cuda three prompts of its model),
# SWAP_PATH (where the swap file goes, /var/tmp), THREADS (2), POLICIES (always never auto), REPEAT (rounds of them, 3),
# RUN_TIMEOUT (600 s a run).
set -u
B=${MLENS_BUILDDIR:-.}
OUT=${OUT:-$PWD/out}
BACKEND=${BACKEND:-cpu}
P=${P:-512}
if [ "$BACKEND" = cuda ]; then G=${G:-64}; else G=${G:-384}; fi
N=${N:-24}
KV=${KV:-}
SWAP_PATH=${SWAP_PATH:-/var/tmp}
THREADS=${THREADS:-2}
REPEAT=${REPEAT:-3}
TENANTS=${TENANTS:-4}
POLICIES=${POLICIES:-always never auto}
TMO=${RUN_TIMEOUT:-600}
if [ "$BACKEND" = cpu ]; then EXTRA=${MLENS_KV_SWAP_FLAGS:-}
else EXTRA=${MLENS_KV_SWAP_FLAGS:---resident-experts 0}; fi
T=$(mktemp -d /tmp/mlens-kvswap.XXXXXX) || exit 1
daemon_pid=
cleanup() {
	[ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null
	rm -rf "$T"
}
trap cleanup EXIT INT TERM
mkdir -p "$OUT"
MODEL=${MODEL:-}
if [ -z "$MODEL" ]; then
	MODEL=$T/model
	if [ "$BACKEND" = cpu ]; then mk="--preset tiny --dtype fp32"
	else mk="--preset mixtral-8x7b --layers 2 --dtype bf16"; fi
	# shellcheck disable=SC2086 # mk is words
	"$B/daemon/mlens-mkmodel" -o "$MODEL" $mk --seed 5 >/dev/null ||
		{ echo "kv_swap_bench.sh: cannot write the model"; exit 1; }
fi
# three prompts of KV (K and V of every layer, the model's dtype): the
# pool holds them, and their growth preempts
if [ -z "$KV" ] && [ "$BACKEND" = cpu ]; then KV=700K
elif [ -z "$KV" ]; then
	KV=$(python3 -c '
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
kvh = c.get("num_key_value_heads", c["num_attention_heads"])
hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
b = {"float32": 4}.get(c.get("torch_dtype"), 2)
print("%dK" % ((3 * int(sys.argv[2]) * c["num_hidden_layers"] * 2 * kvh * hd * b + 1023) // 1024))
' "$MODEL" "$P") || exit 1
fi
echo "kv_swap_bench.sh: $N requests of p=$P g=$G, KV pool $KV, backend $BACKEND, swap file in $SWAP_PATH"

# the jobs: random prompts inside the vocabulary, a fixed length each
python3 "$(dirname "$0")/jobs.py" "$MODEL" "$N" "$P" "$G" > "$T/jobs.jsonl" || exit 1
for k in $(seq 1 "$TENANTS"); do
	awk -v k="$k" -v t="$TENANTS" '(NR - 1) % t == k - 1' "$T/jobs.jsonl" > "$T/jobs_$k.jsonl"
done

# REPEAT rounds, the policies interleaved in each (a neighbour's load
# falls on all of them alike); a policy's run of median wall is its result
runs=
for rep in $(seq 1 "$REPEAT"); do
for pol in $POLICIES; do
	run=${pol}_$rep
	runs="$runs $run"
	rm -f "$T"/*.sock "$OUT/kv_swap_$run.mlensd.log"
	# shellcheck disable=SC2086 # EXTRA is words
	"$B/daemon/mlensd" --model "$MODEL" --backend "$BACKEND" --threads "$THREADS" --mlock=false \
		--kv-cache "$KV" --admit-lookahead 1 --kv-swap 256M --kv-swap-path "$SWAP_PATH" \
		--kv-swap-policy "$pol" $EXTRA --socket "$T/t.sock" --control "$T/c.sock" --stats "$T/s.sock" \
		--stats-http "" --log "$OUT/kv_swap_$run.mlensd.log" --foreground &
	daemon_pid=$!
	while ! grep -q "serving on" "$OUT/kv_swap_$run.mlensd.log" 2>/dev/null &&
		kill -0 "$daemon_pid" 2>/dev/null; do sleep 0.2; done
	# the tenants at once, each its share of the jobs all in flight (the
	# client would keep no more than the pool holds: no preemption)
	t0=$(date +%s.%N)
	cl=
	for k in $(seq 1 "$TENANTS"); do
		timeout "$TMO" "$B/client/mlens" generate -s "$T/t.sock" -i "$T/jobs_$k.jsonl" -o "$T/${run}_t$k.out" -n "$N" \
			--quiet 2>> "$OUT/kv_swap_$run.err" &
		cl="$cl $!"
	done
	rc=0
	for c in $cl; do wait "$c" || rc=1; done
	t1=$(date +%s.%N)
	for k in $(seq 1 "$TENANTS"); do cat "$T/${run}_t$k.out"; done > "$T/$run.out.jsonl"
	"$B/client/mlensctl" -s "$T/c.sock" stats > "$T/$run.stats" 2>/dev/null
	# the daemon's CPU seconds (user + system): less swayed than the wall
	# by a neighbour's load
	awk -v hz="$(getconf CLK_TCK)" '{ sub(/.*\) /, ""); print "daemon_cpu_seconds", ($12 + $13) / hz }' \
		"/proc/$daemon_pid/stat" >> "$T/$run.stats" 2>/dev/null
	kill "$daemon_pid" 2>/dev/null
	wait "$daemon_pid" 2>/dev/null
	daemon_pid=
	python3 - "$pol" "$rc" "$t0" "$t1" "$T/$run.out.jsonl" "$T/$run.stats" "$N" "$G" \
		> "$OUT/kv_swap_$run.json" <<'EOF'
import json, sys
pol, rc, t0, t1, outf, statf, n, g = sys.argv[1:9]
wall = float(t1) - float(t0)
try:
    res = [json.loads(l) for l in open(outf)]
except OSError:
    res = []
st = {}
for line in open(statf):
    k, _, v = line.strip().partition(" ")
    st[k] = v.strip()
def num(k):
    try:
        return float(st[k])
    except (KeyError, ValueError):
        return None
gen = sum(len(r.get("tokens") or []) for r in res)
print(json.dumps({
    "policy": pol, "exit_status": int(rc), "requests": int(n), "completed": len(res),
    "generated_tokens": gen, "wall_seconds": round(wall, 3),
    "tokens_per_s": round(gen / wall, 2) if wall > 0 else None,
    "preemptions": num("preemptions_total"), "swap_outs": num("kv_swaps_total"),
    "swap_ins": num("kv_swap_ins_total"), "recomputes": num("kv_swap_recomputes_total"),
    "prompt_tokens": num("prompt_tokens_total"), "swap_io_seconds": num("kv_swap_io_seconds_total"),
    "swap_bytes_out": num("kv_swap_bytes_out_total"),
    "step_seconds": num("step_seconds_sum"), "daemon_cpu_seconds": num("daemon_cpu_seconds"),
    "disk_measured_bps": num("kv_swap_disk_measured_bps"),
    "disk_bps": num("kv_swap_disk_bps"), "disk_source": st.get("kv_swap_disk_source"),
    "prefill_flops": num("kv_swap_prefill_flops"), "prefill_source": st.get("kv_swap_prefill_source"),
    "tokens": [r.get("tokens") for r in res]}))
EOF
	echo "$run: rc $rc, $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["wall_seconds"], "s")' "$OUT/kv_swap_$run.json")"
done
done

# shellcheck disable=SC2086 # runs is words
python3 - "$OUT" "$BACKEND" "$P" "$G" "$N" "$KV" "$TENANTS" $runs > "$OUT/kv_swap_table.txt" <<'EOF'
import json, sys
out, backend, p, g, n, kv, tenants = sys.argv[1:8]
all_runs = [json.load(open(f"{out}/kv_swap_{r}.json")) for r in sys.argv[8:]]
ref = all_runs[0]["tokens"]
same = all(r["tokens"] == ref for r in all_runs)
by_pol = {}
for r in all_runs:
    by_pol.setdefault(r["policy"], []).append(r)
    del r["tokens"]
runs = {}
for pol, rs in by_pol.items():
    srt = sorted(rs, key=lambda r: r["wall_seconds"])
    runs[pol] = dict(srt[(len(srt) - 1) // 2], walls=[r["wall_seconds"] for r in rs])
summary = {"backend": backend, "prompt_len": int(p), "gen_len": int(g), "requests": int(n), "tenants": int(tenants),
           "kv_cache": kv, "repeat": len(all_runs) // len(runs), "tokens_identical": same}
if "always" in runs and "never" in runs:
    faster = "always" if runs["always"]["wall_seconds"] < runs["never"]["wall_seconds"] else "never"
    summary["faster"] = faster
    a = runs.get("auto")
    if a:
        sw = sum(r["swap_outs"] or 0 for r in by_pol["auto"])
        rc = sum(r["recomputes"] or 0 for r in by_pol["auto"])
        choice = "swap" if sw > rc else "recompute" if rc > sw else "none" if not sw else "mixed"
        summary["auto_choice"] = choice
        summary["auto_swap_outs"], summary["auto_recomputes"] = sw, rc
        summary["auto_matched_faster"] = (choice, faster) in (("swap", "always"), ("recompute", "never"))
        summary["auto_vs_faster"] = round(a["wall_seconds"] / runs[faster]["wall_seconds"], 3)
    cpu = {pol: sorted(r["daemon_cpu_seconds"] or 0 for r in by_pol[pol]) for pol in ("always", "never")}
    med = {pol: v[(len(v) - 1) // 2] for pol, v in cpu.items()}
    summary["faster_by_daemon_cpu"] = "always" if med["always"] < med["never"] else "never"
    if a:
        summary["auto_matched_faster_by_daemon_cpu"] = (choice, summary["faster_by_daemon_cpu"]) in \
            (("swap", "always"), ("recompute", "never"))
json.dump({"summary": summary, "runs": list(runs.values()), "all_runs": all_runs},
          open(f"{out}/kv_swap_summary.json", "w"), indent=1)
print(json.dumps(summary))
def f(x, fmt):
    return "-" if x is None else fmt.format(x)
print(f"{'policy':8} {'wall s (median; all)':>26} {'tok/s':>8} {'cpu s':>6} {'preempt':>8} {'swap-out':>8} {'recomp':>8} "
      f"{'swap I/O s':>10} {'measured GB/s':>13} {'disk GB/s (source)':>22} {'prefill FLOP/s (source)':>26}")
for pol, r in runs.items():
    walls = f"{r['wall_seconds']:.2f}; " + " ".join(f"{w:.2f}" for w in r["walls"])
    print(f"{pol:8} {walls:>26} {f(r['tokens_per_s'], '{:.1f}'):>8} {f(r['daemon_cpu_seconds'], '{:.1f}'):>6} "
          f"{f(r['preemptions'], '{:.0f}'):>8} "
          f"{f(r['swap_outs'], '{:.0f}'):>8} {f(r['recomputes'], '{:.0f}'):>8} {f(r['swap_io_seconds'], '{:.3f}'):>10} "
          f"{f(r['disk_measured_bps'] and r['disk_measured_bps'] / 1e9, '{:.3g}'):>13} "
          f"{f(r['disk_bps'] and r['disk_bps'] / 1e9, '{:.3g}') + ' (' + str(r['disk_source']) + ')':>22} "
          f"{f(r['prefill_flops'], '{:.3g}') + ' (' + str(r['prefill_source']) + ')':>26}")
if "auto_choice" in summary:
    print(f"faster of always/never: {summary['faster']}; auto chose {summary['auto_choice']} "
          f"({summary['auto_swap_outs']:.0f} swapped, {summary['auto_recomputes']:.0f} recomputed over its runs): "
          f"{'matched' if summary['auto_matched_faster'] else 'did not match'}; auto's wall / the faster's: "
          f"{summary['auto_vs_faster']}")
    print(f"faster by the daemon's CPU seconds (median): {summary['faster_by_daemon_cpu']}; auto "
          f"{'matched' if summary['auto_matched_faster_by_daemon_cpu'] else 'did not match'}")
print("greedy tokens identical across runs:", "yes" if same else "NO")
sys.exit(0 if same else 1)
EOF
st=$?
cat "$OUT/kv_swap_table.txt"
exit $st
