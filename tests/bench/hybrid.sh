#!/bin/sh
# The hybrid pipeline's benchmark set, for the GPU machine, from a configured CUDA
# build tree: a Mixtral-8x7B-shaped model with 8 layers (bf16, ~23.7 GB,
# written to /dev/shm once), GPU budget 8 GiB (so mlensd runs the hybrid
# pipeline), KV pool 40 GiB in pinned host memory; workloads p=512/g=128,
# p=512/g=32 and p=128/g=32, and p=512/g=32 again with a 20 GiB pool (two
# mixes x two KV sizes, for the performance model), each with about three times as many
# requests as the pool holds at once and --predict; then the baseline a user
# would reach for, transformers + accelerate offloading the same model under
# the same budget (tests/bench/hf_baseline.py), on a small workload.
# JSON per run under $OUT (default ./out), with the daemon's log beside it
# (hybrid_RUN.mlensd.log: its plan, profile and n_real), a table last.
# With MODEL_DIR on a local disk and HOST_MEMORY below the model's size,
# the experts that do not fit are read from the disk each step (a table of
# the disk read rate against its measured ceiling).
#
# Usage: hybrid.sh [GPU_MEMORY] [KV_CACHE] [SCALE]
#   SCALE (default 1.0) multiplies the request counts to fit a time limit
#   (below 1 the runs hold fewer than three pool-fulls: said so).
# Environment:
#   RUNS             runs to do, in order (default all):
#                    p512g128 p512g32 p128g32 p512g32kv20 p512g128kv20 hf,
#                    or p128g32kv20 (a kv20 run with its 40G pair: two
#                    mixes x two pool sizes)
#   MAX_STEP_TOKENS  passed to mlensd as --max-step-tokens (default: unset,
#                    the daemon's own cap: n_real from its profile)
#   DAEMON_ARGS      more mlensd arguments, split at blanks (for example
#                    "--group-tokens 0" or "--threads 13"); with --op-timing
#                    mlens-bench serve also reads the daemon's per-op GPU
#                    times and a table per run shows them (ms a step, share
#                    of the step, TFLOP/s and its ratio to the held GEMM
#                    rate, the time between the ops)
#   EXPECT_TPS       total tokens/s assumed for the time estimate (30000)
#   RUN_TIMEOUT      seconds a run may take before mlens-bench stops it
#                    (570)
#   STARTUP_S        seconds per run outside the requests (45: model into
#                    pinned memory, ceilings, profile, shutdown)
#   HF_REQ           requests of the baseline (16, one batch of 16)
#   QUEUE_STEPS      requests the clients keep outstanding beyond what the
#                    pool holds, in steps' worth of completions (S/g each;
#                    default 2, 0 for none): a client submits a finished
#                    request's replacement after the step that finished it,
#                    so the daemon sees it a step later; with no more
#                    outstanding than the pool holds, its queue is empty at
#                    admission and the pool runs a few per cent short of
#                    full, below the bound's full pool
#   KV2              the second pool size (20G)
#   KV_DTYPE         fp8 when DAEMON_ARGS holds --kv-dtype fp8: the pool then
#                    holds more sequences, and the runs keep it full
#   BACKEND          mlensd's backend (cuda; cpu to try the script on a
#                    small model given as MLENS_SERVE_MODEL)
#   MODEL_DIR        where the model is (written there once when absent;
#                    default MLENS_SERVE_MODEL, else /dev/shm/mlens-mixtral8):
#                    a directory on a local NVMe file system for the disk
#                    tier (/dev/shm is memory: O_DIRECT is refused there)
#   HOST_MEMORY      passed to mlensd as --host-memory: below the model's
#                    size, the experts it has no room for stay in the model
#                    files and are read each step (weights_on_disk); each
#                    run's JSON then has "disk": the read rate of the
#                    steady steps against the profiler's measured ceiling
#   DRY=1            print the plan and its time estimate, run nothing
# The estimate: a run of R requests of p+g tokens takes about
#   STARTUP_S + R (p+g) / EXPECT_TPS seconds,
# R = max(64, 3 x SCALE x S), S = KV tokens / (p + g/2 + 8) the sequences
# the pool holds at once (8: half a KV block of rounding), S + QUEUE_STEPS x
# ceil(S/g) of them outstanding (mlens-bench serve --concurrency); the baseline
# about 60 s of loading + HF_REQ/16 x g x 1.5 s. mlens-bench serve's JSON
# says what a run really took (wall_seconds): set EXPECT_TPS from it.
set -u
OUT=${OUT:-$PWD/out}
GPU=${1:-8G}
KV=${2:-40G}
SCALE=${3:-1.0}
RUNS=${RUNS:-p512g128 p512g32 p128g32 p512g32kv20 p512g128kv20 hf}
EXPECT_TPS=${EXPECT_TPS:-30000}
STARTUP_S=${STARTUP_S:-45}
HF_REQ=${HF_REQ:-16}
QUEUE_STEPS=${QUEUE_STEPS:-2}
case $QUEUE_STEPS in
''|*[!0-9]*) echo "hybrid.sh: QUEUE_STEPS must be a whole number of steps (0, 1, 2, ...), not '$QUEUE_STEPS'" >&2; exit 2 ;;
esac
KV2=${KV2:-20G}
BACKEND=${BACKEND:-cuda}
MODEL=${MODEL_DIR:-${MLENS_SERVE_MODEL:-/dev/shm/mlens-mixtral8}}
mkdir -p "$OUT"
. "$(dirname "$0")/kvpool.sh"

conc_of() {	# seqs g -> requests outstanding
	awk -v s="$1" -v g="$2" -v q="$QUEUE_STEPS" 'BEGIN { printf "%d", s + q * int((s + g - 1) / g) }'
}
req_of() {	# seqs -> requests
	awk -v s="$1" -v k="$SCALE" 'BEGIN { r = int(3 * s * k + 0.5); print (r < 64 ? 64 : r) }'
}
spec() {	# run name -> "kv p g"
	case $1 in
	p512g128) echo "$KV 512 128" ;;
	p512g32) echo "$KV 512 32" ;;
	p128g32) echo "$KV 128 32" ;;
	p512g32kv20) echo "$KV2 512 32" ;;
	p512g128kv20) echo "$KV2 512 128" ;;
	p128g32kv20) echo "$KV2 128 32" ;;
	*) echo "" ;;
	esac
}

# the plan and its time estimate
echo "plan (SCALE $SCALE, EXPECT_TPS $EXPECT_TPS total tokens/s, STARTUP_S $STARTUP_S):"
total=0
[ -f "$MODEL/config.json" ] || { echo "  model: written to $MODEL first (~60 s)"; total=60; }
for r in $RUNS; do
	if [ "$r" = hf ]; then
		est=$(awk -v n="$HF_REQ" 'BEGIN { printf "%d", 60 + n / 16 * 32 * 1.5 }')
		echo "  hf: transformers+accelerate, p=128 g=32, $HF_REQ requests: ~$est s"
	else
		set -- $(spec "$r")
		[ $# -eq 3 ] || { echo "hybrid.sh: unknown run '$r'"; exit 2; }
		s=$(seqs_of "$1" "$2" "$3")
		n=$(req_of "$s")
		est=$(awk -v n="$n" -v p="$2" -v g="$3" -v t="$EXPECT_TPS" -v s0="$STARTUP_S" \
			'BEGIN { printf "%d", s0 + n * (p + g) / t }')
		echo "  $r: KV $1 p=$2 g=$3, pool holds $s ($(conc_of "$s" "$3") outstanding), $n requests ($(awk -v n="$n" -v s="$s" \
			'BEGIN { printf "%.1f", n / s }') x): ~$est s"
	fi
	total=$((total + est))
done
echo "  total ~$total s"
awk -v k="$SCALE" 'BEGIN { exit !(k < 1) }' &&
	echo "  note: SCALE < 1: fewer requests than three pool-fulls"
[ "${DRY:-0}" = 1 ] && exit 0

if [ ! -f "$MODEL/config.json" ]; then
	./daemon/mlens-mkmodel -o "$MODEL" --preset mixtral-8x7b --layers 8 --dtype bf16 >/dev/null ||
		{ echo "hybrid.sh: cannot write the model"; exit 1; }
fi
# the model's dimensions beside the profile: mlens-bench predict replays
# the model on the two later, without the GPU
cp "$MODEL/config.json" "$OUT/model_config.json"
# one profile for every run: same model, backend, GPU and budget
set -- --daemon-arg --profile --daemon-arg "--profile-cache=$OUT/profile_cache.json"
[ -n "${MAX_STEP_TOKENS:-}" ] && set -- "$@" --max-step-tokens "$MAX_STEP_TOKENS"
[ -n "${HOST_MEMORY:-}" ] && set -- "$@" --daemon-arg "--host-memory=$HOST_MEMORY"
for a in ${DAEMON_ARGS:-}; do
	set -- "$@" --daemon-arg "$a"
	[ "$a" = --op-timing ] && set -- "$@" --op-timing
done
for r in $RUNS; do
	t0=$(date +%s)
	if [ "$r" = hf ]; then
		python3 "$(dirname "$0")/hf_baseline.py" "$MODEL" --gpu-memory "$(echo "$GPU" | sed 's/G$/GiB/')" \
			--prompt-len 128 --gen-len 32 --requests "$HF_REQ" --batch 16 \
			> "$OUT/hf_baseline.json" 2> "$OUT/hf_baseline.err"
		rc=$?
		echo "hf: transformers+accelerate: rc $rc in $(($(date +%s) - t0)) s"
		continue
	fi
	spec_=$(spec "$r")
	kv=${spec_%% *}
	rest=${spec_#* }
	p=${rest%% *}
	g=${rest#* }
	s=$(seqs_of "$kv" "$p" "$g")
	n=$(req_of "$s")
	c=$(conc_of "$s" "$g")
	# a run's limit does not follow EXPECT_TPS (an estimate for the
	# plan): a guess too high once cut a 4-minute run at 221 s
	tmo=${RUN_TIMEOUT:-570}
	./tests/bench/mlens-bench serve --model "$MODEL" --mlensd ./daemon/mlensd --backend "$BACKEND" \
		--gpu-memory "$GPU" --kv-cache "$kv" --prompt-len "$p" --gen-len "$g" \
		--requests "$n" --concurrency "$c" --threads 8 --timeout "$tmo" --predict --json \
		--daemon-log "$OUT/hybrid_$r.mlensd.log" "$@" \
		> "$OUT/hybrid_$r.json" 2> "$OUT/hybrid_$r.err"
	rc=$?
	echo "$r: KV $kv p=$p g=$g requests=$n (pool holds $s at once, $c outstanding): rc $rc in $(($(date +%s) - t0)) s"
done
echo
python3 - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
def f(x, fmt="%.1f"):
    return "-" if x is None else fmt % x
rows = []
hf = None
for path in sorted(glob.glob(os.path.join(out, "hybrid_*.json"))):
    try:
        d = json.load(open(path))
    except ValueError:
        print("%s: no JSON (see %s)" % (os.path.basename(path), path[:-5] + ".err"))
        continue
    b, p, s, a = d.get("bound") or {}, d.get("predicted") or {}, d.get("steady") or {}, d.get("achieved") or {}
    rows.append((os.path.basename(path)[7:-5], d, b, p, s, a))
if os.path.exists(os.path.join(out, "hf_baseline.json")):
    try:
        hf = json.load(open(os.path.join(out, "hf_baseline.json")))
    except ValueError:
        hf = None
print("%-12s %9s %9s %9s %9s %6s %9s %7s %7s %7s %-12s %6s %6s %6s" % (
    "run", "gen t/s", "steady", "total t/s", "bound", "m/b", "predicted", "err", "err st",
    "step n", "binds", "PCIe", "attn", "GPU%"))
for name, d, b, p, s, a in rows:
    print("%-12s %9s %9s %9s %9s %6s %9s %7s %7s %7s %-12s %6s %6s %6s" % (
        name, f(d.get("generated_tokens_per_s")), f(s.get("generated_tokens_per_s")),
        f(d.get("total_tokens_per_s")), f(b.get("generated_tokens_per_s")),
        f(d.get("measured_over_bound"), "%.2f"), f(p.get("generated_tokens_per_s")),
        f(None if d.get("prediction_error") is None else 100 * d["prediction_error"], "%+.0f%%"),
        f(None if d.get("prediction_error_steady") is None else 100 * d["prediction_error_steady"], "%+.0f%%"),
        f(s.get("mean_step_tokens") or d.get("mean_step_tokens"), "%.0f"),
        (b.get("binds") or "-") + "/" + (p.get("binding") or "-"),
        f(a.get("pcie_h2d_gb_per_s")), f(a.get("cpu_attention_gb_per_s")),
        f(None if a.get("gpu_busy_ratio") is None else 100 * a["gpu_busy_ratio"], "%.0f")))
# the steady window's shares (mlens-bench serve's "steady"): where the
# step's time went on each side
# st/b after: against the bound from the host ceilings measured again once
# the daemon stopped (the box's memory and link as they were after the run)
# lone: against the bound with the GEMM rate of lone GEMMs (the GPU at its
# burst clock) instead of the rate it holds under load
# blk/run: KV blocks the CPU attention read per run of consecutive ids
print("%-12s %6s %6s %6s %6s %6s %7s %10s %6s %7s" % ("steady", "st/b", "after", "lone", "GPU%", "host%",
                                                       "append%", "attn GB/s", "PCIe", "blk/run"))
for name, d, b, p, s, a in rows:
    pct = lambda x: f(None if x is None else 100 * x, "%.0f")
    print("%-12s %6s %6s %6s %6s %6s %7s %10s %6s %7s" % (
        name + ("*" if s.get("short") else ""), f(d.get("steady_over_bound"), "%.2f"),
        f(d.get("steady_over_bound_after"), "%.2f"),
        f(d.get("steady_over_bound_burst_gemm"), "%.2f"), pct(s.get("gpu_busy_ratio")),
        pct(s.get("cpu_busy_ratio")), pct(s.get("cpu_append_ratio")),
        f(s.get("cpu_attention_only_gb_per_s")), f(s.get("pcie_h2d_gb_per_s")),
        f(s.get("kv_blocks_per_run"))))
# weights on disk (HOST_MEMORY below the model): the steady steps' read
# rate of the model files against the profiler's measured ceiling
# and the bound's disk term (the step's bytes at that ceiling), what binds
disk_rows = [(name, d["disk"], d.get("bound") or {}) for name, d, b, p, s, a in rows if d.get("disk")]
if disk_rows:
    print("%-12s %10s %10s %9s %9s %7s %10s %10s" % ("disk", "on disk GB", "step GB", "GB/s", "ceiling", "of it",
                                                   "t_disk ms", "binds"))
    for name, k, bd in disk_rows:
        print("%-12s %10s %10s %9s %9s %7s %10s %10s" % (
            name, f(k["resident_bytes"] / 1e9, "%.2f"), f(k["step_bytes"] / 1e9, "%.2f"),
            f(k.get("steady_gb_per_s"), "%.2f"), f(k.get("ceiling_gb_per_s"), "%.2f"),
            f(None if k.get("steady_over_ceiling") is None else 100 * k["steady_over_ceiling"], "%.0f%%"),
            f(None if bd.get("t_disk_s") is None else 1e3 * bd["t_disk_s"], "%.0f"), bd.get("binds", "-")))
if hf:
    print("%-12s %9s %9s %9s   (transformers+accelerate, p=%d g=%d)" % (
        "hf", f(hf.get("generated_tokens_per_s")), "-", f(hf.get("total_tokens_per_s")),
        hf.get("prompt_len", 0), hf.get("gen_len", 0)))
    if hf.get("gpu_peak_over_budget"):
        print("  hf's GPU peak %.2f GB went past its %s budget (accelerate brings offloaded modules onto the GPU)"
              % (hf["gpu_peak_bytes"] / 1e9, hf.get("gpu_memory")))
    for name, d, b, p, s, a in rows:
        if hf.get("generated_tokens_per_s"):
            st = s.get("generated_tokens_per_s")
            print("  %s / hf: %.1fx generated tokens/s over the whole run%s" % (
                name, d["generated_tokens_per_s"] / hf["generated_tokens_per_s"],
                ", %.1fx steady" % (st / hf["generated_tokens_per_s"]) if st else ""))
# DAEMON_ARGS with --op-timing: where the GPU's compute queue spent each
# run's steps, op by op (mlens-bench serve's "ops")
for name, d, b, p, s, a in rows:
    o = d.get("ops")
    if not o:
        continue
    step = o["step_seconds"]
    print("%-20s %9s %7s %9s %8s %10s  (%s, %.0f steps)" % ("ops " + name, "ms/step", "share", "TFLOP/s",
                                                           "of GEMM", "calls/step", o["over"], o["steps"]))
    for r in o["by_op"]:
        print("  %-18s %9.3f %6.1f%% %9s %8s %10.1f" % (
            r["op"], 1e3 * r["seconds_per_step"], 100 * r["share"], f(r.get("tflops")),
            f(r.get("of_held_gemm"), "%.2f"), r["calls_per_step"]))
    for label, key in (("between ops", "between_ops_seconds_per_step"),
                       ("outside the span", "outside_span_seconds_per_step")):
        print("  %-18s %9.3f %6.1f%%" % (label, 1e3 * o[key], 100 * o[key] / step))
    print("  %-18s %9.3f  (held GEMM rate %s TFLOP/s)" % ("step", 1e3 * step, f(o.get("held_gemm_tflops"), "%.0f")))
print("binds: the bound's binding ceiling / the daemon model's binding resource; err: predicted vs measured generated tokens/s")
if any((s or {}).get("short") for name, d, b, p, s, a in rows):
    print("*: a steady window of less than one generation: the ramp's rates, not a steady state's (SCALE too small)")
EOF
