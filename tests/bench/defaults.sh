#!/bin/sh
# What a user gets with no tuning flags, against the tuned benchmark. For
# the GPU machine, from a configured CUDA build tree:
#   1. `mlens-bench serve` on the workload, as hybrid.sh runs it (every
#      client thread a tenant with no running cap, the pool kept full);
#   2. `mlensd --model M --gpu-memory GPU --kv-cache KV` (nothing else
#      but socket paths) and `mlens generate -i jobs.jsonl -o out.jsonl`
#      with no flags, on the same requests.
# Both daemons' /metrics are sampled four times a second, and each run's
# steady rate is read off the daemon's own counters the same way: generated
# tokens/s over the middle third of the run's generated tokens (between the
# ramp-up and the drain). The requests carry "ignore_eos": the model has
# random weights and a fixed generation length is the workload.
# JSON per run under $OUT (default ./out), a table last.
#
# Usage: defaults.sh [GPU_MEMORY] [KV_CACHE] [SCALE]
# Environment: P, G (prompt and generation length, 128 and 32), BACKEND
# (cuda; cpu to try it on a small model), MLENS_SERVE_MODEL (the model,
# default /dev/shm/mlens-mixtral8, written if missing), RUN_TIMEOUT (600),
# RUNS (bench generate).
set -u
OUT=${OUT:-$PWD/out}
GPU=${1:-8G}
KV=${2:-40G}
SCALE=${3:-1.0}
P=${P:-128}
G=${G:-32}
BACKEND=${BACKEND:-cuda}
RUNS=${RUNS:-bench generate}
MODEL=${MLENS_SERVE_MODEL:-/dev/shm/mlens-mixtral8}
TMO=${RUN_TIMEOUT:-600}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
if [ ! -f "$MODEL/config.json" ]; then
	./daemon/mlens-mkmodel -o "$MODEL" --preset mixtral-8x7b --layers 8 --dtype bf16 >/dev/null ||
		{ echo "defaults.sh: cannot write the model"; exit 1; }
fi
. "$here/kvpool.sh"
s=$(seqs_of "$KV" "$P" "$G")
n=$(awk -v s="$s" -v k="$SCALE" 'BEGIN { r = int(3 * s * k + 0.5); print (r < 64 ? 64 : r) }')
c=$(awk -v s="$s" -v g="$G" 'BEGIN { printf "%d", s + 2 * int((s + g - 1) / g) }')
port=$((20000 + $$ % 20000))
T=$(mktemp -d /tmp/mlens-defaults.XXXXXX)
sampler=
daemon_pid=
cleanup() {
	[ -n "$sampler" ] && kill "$sampler" 2>/dev/null
	[ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null
	wait 2>/dev/null
	rm -rf "$T"
}
trap cleanup EXIT INT TERM
echo "defaults.sh: p=$P g=$G, $n requests (the pool holds $s at once), GPU $GPU, KV $KV, backend $BACKEND"

# the jobs: random prompts inside the vocabulary
python3 "$here/jobs.py" "$MODEL" "$n" "$P" "$G" > "$T/jobs.jsonl" || exit 1

for r in $RUNS; do
	python3 "$here/metrics_rate.py" sample "http://127.0.0.1:$port/metrics" "$OUT/defaults_$r.samples" &
	sampler=$!
	t0=$(date +%s)
	case $r in
	bench)
		./tests/bench/mlens-bench serve --model "$MODEL" --mlensd ./daemon/mlensd --backend "$BACKEND" \
			--gpu-memory "$GPU" --kv-cache "$KV" --prompt-len "$P" --gen-len "$G" \
			--requests "$n" --concurrency "$c" --threads 8 --timeout "$TMO" --json \
			--daemon-arg "--stats-http=127.0.0.1:$port" --daemon-log "$OUT/defaults_bench.mlensd.log" \
			> "$OUT/defaults_bench.json" 2> "$OUT/defaults_bench.err"
		rc=$?
		;;
	generate)
		rm -f "$OUT/defaults_generate.mlensd.log"
		./daemon/mlensd --model "$MODEL" --gpu-memory "$GPU" --kv-cache "$KV" --backend "$BACKEND" \
			--socket "$T/mlensd.sock" --control "$T/control.sock" --stats "$T/stats.sock" \
			--stats-http "127.0.0.1:$port" --log "$OUT/defaults_generate.mlensd.log" --foreground &
		daemon_pid=$!
		# the socket is bound before the model loads; it serves once the log says so
		while ! grep -q "serving on" "$OUT/defaults_generate.mlensd.log" 2>/dev/null &&
			kill -0 "$daemon_pid" 2>/dev/null; do sleep 0.2; done
		/usr/bin/time -f '%e' -o "$T/wall" ./client/mlens generate -s "$T/mlensd.sock" \
			-i "$T/jobs.jsonl" -o "$T/out.jsonl" --quiet 2> "$OUT/defaults_generate.err"
		rc=$?
		kill "$daemon_pid" 2>/dev/null
		wait "$daemon_pid" 2>/dev/null
		daemon_pid=
		python3 - "$T/out.jsonl" "$n" "$G" "$(cat "$T/wall" 2>/dev/null || echo 0)" > "$OUT/defaults_generate.json" <<'EOF'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
n, g, wall = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4] or 0)
ok = [json.loads(l) for l in lines]
full = sum(1 for d in ok if len(d.get("tokens") or []) == g)
gen = sum(len(d.get("tokens") or []) for d in ok)
print(json.dumps({"requests": n, "result_lines": len(lines), "full_length": full,
                  "generated_tokens": gen, "wall_seconds": wall,
                  "generated_tokens_per_s": gen / wall if wall else None}))
EOF
		;;
	esac
	kill "$sampler" 2>/dev/null
	wait "$sampler" 2>/dev/null
	sampler=
	echo "$r: rc $rc in $(($(date +%s) - t0)) s"
done
python3 "$here/metrics_rate.py" table "$OUT" $RUNS | tee "$OUT/defaults_table.txt"
