#!/bin/sh
# The check of n_real, for the GPU machine, from a configured CUDA
# build tree: one hybrid workload (default p=512/g=32, KV pool 40 GiB, GPU
# budget 8 GiB, the model of hybrid.sh) run with the scheduler's token cap
# pinned at several multiples of the daemon's n_real, each long enough for
# a short steady state; prints a table and the cap that gave the most
# generated tokens/s in the steady state against n_real (target: within
# 10%; the grid's spacing limits how closely that can be seen).
#
# Usage: nreal_sweep.sh [P] [G] [KV_CACHE] [GPU_MEMORY]
# Environment:
#   FACTORS       multiples of n_real to run (0.5 0.75 1 1.25 1.5)
#   N_REAL        the grid's centre; else predicted.n_real of
#                 $OUT/hybrid_p<P>g<G>.json (hybrid.sh, same budget), else
#                 a short probe run with --predict (one more start-up)
#   STEADY_STEPS  steps of steady state per point (80; fewer give windows
#                 whose rates are too close to call or read low)
#   EXPECT_TPS    total tokens/s assumed for the time estimate (30000)
#   STARTUP_S     seconds per run outside the requests (45)
#   BACKEND       mlensd's backend (cuda)
#   DRY=1         print the plan and its time estimate, run nothing
# Per point, cap N = factor x n_real: the scheduler admits k = floor(N /
# (p+g-1)) prompts a step (perfmodel.h, mlens_perf_sched_steady), at most
# S/g with S the sequences the pool holds; R = k (g + STEADY_STEPS)
# requests give about STEADY_STEPS steps between the first request's end
# and the last admission (mlens-bench(1)'s steady window). Time per point
# about STARTUP_S + R (p+g) / EXPECT_TPS.
set -u
OUT=${OUT:-$PWD/out}
P=${1:-512}
G=${2:-32}
KV=${3:-40G}
GPU=${4:-8G}
FACTORS=${FACTORS:-0.5 0.75 1 1.25 1.5}
STEADY_STEPS=${STEADY_STEPS:-80}
EXPECT_TPS=${EXPECT_TPS:-30000}
STARTUP_S=${STARTUP_S:-45}
BACKEND=${BACKEND:-cuda}
MODEL=${MLENS_SERVE_MODEL:-/dev/shm/mlens-mixtral8}
mkdir -p "$OUT"
. "$(dirname "$0")/kvpool.sh"
S=$(seqs_of "$KV" "$P" "$G")
PROF="--daemon-arg --profile --daemon-arg --profile-cache=$OUT/profile_cache.json"

serve() {	# extra args...; JSON on stdout
	./tests/bench/mlens-bench serve --model "$MODEL" --mlensd ./daemon/mlensd --backend "$BACKEND" \
		--gpu-memory "$GPU" --kv-cache "$KV" --prompt-len "$P" --gen-len "$G" --threads 8 \
		--predict --json $PROF "$@"
}
json_get() {	# file key.key -> value or empty
	python3 -c 'import json,sys
d = json.load(open(sys.argv[1]))
for k in sys.argv[2].split("."):
    d = d.get(k) if isinstance(d, dict) else None
print("" if d is None else d)' "$1" "$2" 2>/dev/null
}

nr=${N_REAL:-}
src="N_REAL"
if [ -z "$nr" ] && [ -s "$OUT/hybrid_p${P}g${G}.json" ]; then
	nr=$(json_get "$OUT/hybrid_p${P}g${G}.json" predicted.n_real)
	src="$OUT/hybrid_p${P}g${G}.json"
fi
echo "plan: p=$P g=$G KV $KV (holds $S at once) GPU $GPU, factors $FACTORS, $STEADY_STEPS steady steps"
if [ -z "$nr" ]; then
	echo "  probe: 64 requests with --predict for n_real: ~$((STARTUP_S + 5)) s"
	if [ "${DRY:-0}" != 1 ]; then
		serve --requests 64 --concurrency 64 --timeout 300 > "$OUT/nreal_probe.json" 2> "$OUT/nreal_probe.err"
		nr=$(json_get "$OUT/nreal_probe.json" predicted.n_real)
		src="probe run"
	fi
fi
if [ -z "$nr" ]; then
	[ "${DRY:-0}" = 1 ] && { echo "  (n_real unknown until the probe: no estimate per point)"; exit 0; }
	echo "nreal_sweep.sh: no n_real (see $OUT/nreal_probe.err)"
	exit 1
fi
nr=$(printf '%.0f' "$nr")
echo "  n_real $nr (from $src)"
total=0
for f in $FACTORS; do
	set -- $(awk -v f="$f" -v n="$nr" -v p="$P" -v g="$G" -v s="$S" -v st="$STEADY_STEPS" \
		-v t="$EXPECT_TPS" -v s0="$STARTUP_S" 'BEGIN {
		cap = int(f * n + 0.5); if (cap < p) cap = p
		k = int(cap / (p + g - 1)); if (k < 1) k = 1; if (k > s / g) k = s / g
		r = int(k * (g + st) + 0.5); if (r < 64) r = 64
		printf "%d %d %d\n", cap, r, s0 + r * (p + g) / t }')
	echo "  x$f: cap $1, $2 requests: ~$3 s"
	total=$((total + $3))
done
echo "  total ~$total s"
[ "${DRY:-0}" = 1 ] && exit 0

for f in $FACTORS; do
	set -- $(awk -v f="$f" -v n="$nr" -v p="$P" -v g="$G" -v s="$S" -v st="$STEADY_STEPS" 'BEGIN {
		cap = int(f * n + 0.5); if (cap < p) cap = p
		k = int(cap / (p + g - 1)); if (k < 1) k = 1; if (k > s / g) k = s / g
		r = int(k * (g + st) + 0.5); if (r < 64) r = 64
		printf "%d %d\n", cap, r }')
	t0=$(date +%s)
	serve --max-step-tokens "$1" --requests "$2" --concurrency "$S" --timeout 570 \
		--daemon-log "$OUT/nreal_x$f.mlensd.log" \
		> "$OUT/nreal_x$f.json" 2> "$OUT/nreal_x$f.err"
	rc=$?
	echo "x$f: cap $1, $2 requests: rc $rc in $(($(date +%s) - t0)) s"
done
echo
python3 - "$OUT" "$nr" $FACTORS <<'EOF'
import json, os, sys
out, nr, factors = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
def f(x, fmt="%.1f"):
    return "-" if x is None else fmt % x
rows = []
# the scheduler's own n_real, as the daemon of these runs computed it (its
# profile, this machine): the one the target is about; nr (the grid's
# centre) came from elsewhere and may be another machine's
own = []
for fa in factors:
    try:
        v = (json.load(open(os.path.join(out, "nreal_x%s.json" % fa))).get("predicted") or {}).get("n_real")
    except (OSError, ValueError):
        v = None
    if v:
        own.append(float(v))
print("%-6s %7s %10s %8s %10s %8s %8s %10s %7s %s" % ("factor", "cap", "steady g/s", "steady s", "whole g/s",
                                                     "step n", "pred n", "predicted", "err st", "binding"))
short = False
for fa in factors:
    path = os.path.join(out, "nreal_x%s.json" % fa)
    try:
        d = json.load(open(path))
    except (OSError, ValueError):
        print("%-6s %7s  no result (see %s)" % (fa, "-", path[:-5] + ".err"))
        continue
    s, p = d.get("steady") or {}, d.get("predicted") or {}
    g = s.get("generated_tokens_per_s") or d.get("generated_tokens_per_s")
    rows.append((d.get("step_token_cap"), g, fa))
    e = d.get("prediction_error_steady")
    short = short or (s.get("seconds") or 0) < 20
    print("%-6s %7.0f %10s %8s %10s %8s %8s %10s %7s %s" % (fa, d.get("step_token_cap") or 0, f(s.get("generated_tokens_per_s")),
          f(s.get("seconds")), f(d.get("generated_tokens_per_s")), f(s.get("mean_step_tokens") or d.get("mean_step_tokens"), "%.0f"),
          f(p.get("step_tokens"), "%.0f"), f(p.get("generated_tokens_per_s")), f(None if e is None else 100 * e, "%+.0f%%"), p.get("binding", "-")))
if rows:
    cap, g, fa = max(rows, key=lambda r: r[1] or 0)
    edge = len(rows) > 1 and cap in (min(r[0] for r in rows), max(r[0] for r in rows))
    print("most generated tokens/s: cap %.0f (x%s of the grid's centre %.0f)" % (cap, fa, nr))
    for name, n in (("the grid's centre", nr),) + ((("the daemon's own n_real", sum(own) / len(own)),) if own else ()):
        err = (n - cap) / cap
        print("  %s %.0f is %+.1f%% from it: %s" % (name, n, 100 * err,
              "within 10%" if abs(err) <= 0.10 else "NOT within 10%"))
    if own and max(own) - min(own) > 0.01 * max(own):
        print("  (the runs' n_real differ: %s)" % ", ".join("%.0f" % v for v in own))
    lo, hi = min(r[1] or 0 for r in rows), max(r[1] or 0 for r in rows)
    if lo > 0:
        print("  spread of the steady rates over the grid: %.1f%%" % (100 * (hi - lo) / lo))
    if edge:
        print("  at the edge of the grid: the best cap may lie beyond it (widen FACTORS)")
    if short:
        print("  steady windows under 20 s: their rates are noisy (raise STEADY_STEPS)")
EOF
