#!/bin/sh
# A/B of two mlens builds (or two daemon settings) on one machine, for
# changes worth a few per cent: two runs of the same code on one machine
# differ by several per cent, and machines differ more, so a change is
# judged by runs of both sides in one sitting, alternated (A B, B A, A B,
# ...) so that a drift of the machine falls on both.
#
# Each run is one tests/bench/hybrid.sh workload (the script beside this
# one), from the build's top directory (a configured, built tree: a `make
# dist` tree or a build directory), into $OUT/A1, $OUT/B1, $OUT/B2, ...
# Then a table and $OUT/ab.json: per side the steady generated tokens/s
# of each run, their mean and spread, steady over bound, the GPU's and the
# host's busy shares, the mean step tokens; and B's mean over A's.
#
# Usage: ab.sh BUILD_A BUILD_B [ROUNDS]   (ROUNDS default 2: four runs)
# Environment:
#   RUN            the workload (hybrid.sh's RUNS name; default p128g32)
#   GPU, KV, SCALE hybrid.sh's arguments (default 8G 40G 0.8)
#   DAEMON_ARGS_A, DAEMON_ARGS_B   mlensd arguments of each side (on top
#                  of DAEMON_ARGS): with BUILD_A = BUILD_B, an A/B of a
#                  setting, e.g. DAEMON_ARGS_B="--gpu-moe-streams 1"
#   ENV_A, ENV_B   environment of each side's runs (NAME=VALUE ...), e.g.
#                  ENV_B="MLENS_CUDA_APPEND_BLOCKS=16"
#   and hybrid.sh's own (RUN_TIMEOUT, STARTUP_S, EXPECT_TPS, BACKEND, ...).
# Not a test: it asserts nothing. The exit status is 1 when a run failed.
set -u
[ $# -ge 2 ] || { echo "usage: ab.sh BUILD_A BUILD_B [ROUNDS]" >&2; exit 2; }
A=$(cd "$1" && pwd) || exit 2
B=$(cd "$2" && pwd) || exit 2
ROUNDS=${3:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
RUN=${RUN:-p128g32}
mkdir -p "$OUT"
for d in "$A" "$B"; do
	[ -x "$d/tests/bench/mlens-bench" ] && [ -x "$d/daemon/mlensd" ] ||
		{ echo "ab.sh: $d is not a built mlens tree (no tests/bench/mlens-bench, daemon/mlensd)" >&2; exit 2; }
done
fail=0
r=1
while [ "$r" -le "$ROUNDS" ]; do
	if [ $((r % 2)) -eq 1 ]; then order="A B"; else order="B A"; fi
	for side in $order; do
		if [ "$side" = A ]; then
			dir=$A; extra=${DAEMON_ARGS_A:-}; envs=${ENV_A:-}
		else
			dir=$B; extra=${DAEMON_ARGS_B:-}; envs=${ENV_B:-}
		fi
		t0=$(date +%s)
		# shellcheck disable=SC2086 (envs: NAME=VALUE words)
		(cd "$dir" && env $envs OUT="$OUT/$side$r" RUNS="$RUN" DAEMON_ARGS="${DAEMON_ARGS:-} $extra" \
			sh "$HERE/hybrid.sh" "${GPU:-8G}" "${KV:-40G}" "${SCALE:-0.8}" > "$OUT/$side$r.txt" 2>&1)
		rc=$?
		[ -s "$OUT/$side$r/hybrid_$RUN.json" ] || rc=1
		[ "$rc" -eq 0 ] || fail=1
		echo "$side$r: $RUN on $dir: rc $rc in $(($(date +%s) - t0)) s"
	done
	r=$((r + 1))
done
python3 - "$OUT" "$RUN" "$A" "$B" <<'EOF'
import glob, json, os, sys
out, run, dirs = sys.argv[1], sys.argv[2], {"A": sys.argv[3], "B": sys.argv[4]}
res = {"run": run, "sides": {}}
print("%-4s %10s %6s %5s %6s %8s  %s" % ("run", "steady", "st/b", "GPU%", "host%", "step n", "build"))
for side in ("A", "B"):
    runs = []
    for path in sorted(glob.glob(os.path.join(out, side + "*", "hybrid_%s.json" % run))):
        try:
            d = json.load(open(path))
        except ValueError:
            continue
        s = d.get("steady") or {}
        if s.get("generated_tokens_per_s") is None:
            continue
        r = {"name": os.path.basename(os.path.dirname(path)),
             "steady_generated_tokens_per_s": s["generated_tokens_per_s"],
             "steady_over_bound": d.get("steady_over_bound"),
             "gpu_busy": s.get("gpu_busy_ratio"), "host_busy": s.get("cpu_busy_ratio"),
             "step_tokens": s.get("mean_step_tokens"), "short": bool(s.get("short"))}
        runs.append(r)
        pct = lambda x: "-" if x is None else "%.0f" % (100 * x)
        print("%-4s %10.1f %6s %5s %6s %8s  %s" % (
            r["name"] + ("*" if r["short"] else ""), r["steady_generated_tokens_per_s"],
            "-" if r["steady_over_bound"] is None else "%.3f" % r["steady_over_bound"],
            pct(r["gpu_busy"]), pct(r["host_busy"]),
            "-" if r["step_tokens"] is None else "%.0f" % r["step_tokens"], dirs[side]))
    v = [r["steady_generated_tokens_per_s"] for r in runs]
    res["sides"][side] = {"build": dirs[side], "runs": runs,
                          "mean": sum(v) / len(v) if v else None,
                          "min": min(v) if v else None, "max": max(v) if v else None}
a, b = res["sides"]["A"]["mean"], res["sides"]["B"]["mean"]
res["b_over_a"] = b / a if a and b else None
for side in ("A", "B"):
    x = res["sides"][side]
    if x["mean"] is not None:
        print("%s: mean %.1f generated tokens/s (%.1f-%.1f, %d runs)" % (
            side, x["mean"], x["min"], x["max"], len(x["runs"])))
if res["b_over_a"] is not None:
    print("B / A: %.3f" % res["b_over_a"])
if any(r["short"] for x in res["sides"].values() for r in x["runs"]):
    print("*: a steady window under one generation (SCALE too small)")
json.dump(res, open(os.path.join(out, "ab.json"), "w"), indent=1)
EOF
exit $fail
