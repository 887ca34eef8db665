#!/bin/bash
# The GPU machine's measurements in one command, from an unpacked
# `make dist` tree configured --with-cuda and built (or a CUDA build tree):
#   1. the GPU tests: check_cuda, check_hybrid_cuda(_groups), the goldens on cuda
#      and hybrid (exact and fast GEMMs)
#   2. the CPU attention headline and its tuning sweep; the
#      copy-queue probe (tests/bench/bench_copyq.c); the CUDA
#      ops benchmark (tests/bench/bench_cuda.c: GEMMs, the MoE per stream
#      count and chunk)
#   3. the 8-layer Mixtral-8x7B-shaped model in /dev/shm (written while 1
#      runs), 3-step traces of a hybrid run (where the time goes),
#      one per TRACE_VARIANTS entry (e.g. "|--group-tokens 0|--threads 13"),
#      summarised by tests/bench/trace_summary.py
#   4. the hybrid benchmark set (tests/bench/hybrid.sh) at SCALE and the
#      transformers+accelerate baseline, then the n_real sweep
# GPU_TESTS overrides the tests of part 1.
# Each part has a time limit (seconds: T_TESTS, T_ATTN, T_COPYQ, T_BENCH,
# T_TRACE, T_SET, T_SWEEP; 0 skips the part; T_BENCH and T_SWEEP default
# 0) so that the whole fits one device call; what a part did not finish
# is said. Everything goes to $OUT/session.tgz (one file) and a
# summary to stdout.
# Usage: gpu_session.sh [SCALE]   (default 0.25: a quarter of
#        hybrid.sh's three pool-fulls of requests per workload)
set -u
SCALE=${1:-0.25}
OUT=${OUT:-$PWD/out}
R=$(mktemp -d /tmp/mlens-session.XXXXXX)
MODEL=${MLENS_SERVE_MODEL:-/dev/shm/mlens-mixtral8}
T_TESTS=${T_TESTS:-150}
T_ATTN=${T_ATTN:-90}
T_COPYQ=${T_COPYQ:-60}
T_BENCH=${T_BENCH:-0}
T_TRACE=${T_TRACE:-120}
# requests of the traced run: enough that the traced steps are steady ones
# (at ~4,000 generated tokens/s, 2,400 requests of 32 tokens were done in
# 30 s)
TRACE_REQUESTS=${TRACE_REQUESTS:-7200}
T_SET=${T_SET:-330}
T_SWEEP=${T_SWEEP:-0}
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0)) s] $*"; }
mkdir -p "$OUT"

if [ ! -f "$MODEL/config.json" ]; then
	( ./daemon/mlens-mkmodel -o "$MODEL" --preset mixtral-8x7b --layers 8 --dtype bf16 \
		> "$R/mkmodel.log" 2>&1; echo "mkmodel rc $?" >> "$R/mkmodel.log" ) &
	mk=$!
else
	mk=
fi

GPU_TESTS=${GPU_TESTS:-"tests/check_cuda tests/check_hybrid_cuda tests/check_hybrid_cuda_groups \
	tests/golden/check_golden_cuda.sh tests/golden/check_golden_hybrid.sh \
	tests/check_plan tests/check_stepprog tests/check_pipeline"}
if [ "$T_TESTS" -gt 0 ]; then
	timeout "$T_TESTS" make -j8 check TESTS="$GPU_TESTS" > "$R/check.log" 2>&1
	el "GPU tests: rc $?"
	grep -E "^(PASS|FAIL|SKIP|ERROR):" "$R/check.log"
	cp tests/check_cuda.log tests/check_hybrid_cuda.log tests/check_hybrid_cuda_groups.log \
		tests/golden/check_golden_cuda.sh.log \
		tests/golden/check_golden_hybrid.sh.log "$R/" 2>/dev/null
	grep -h -E "^==|Checks" tests/golden/check_golden_cuda.sh.log \
		tests/golden/check_golden_hybrid.sh.log 2>/dev/null
fi

[ -n "$mk" ] && wait "$mk" && cat "$R/mkmodel.log"
el "model ready"

B=./tests/bench/mlens-bench
if [ "$T_ATTN" -gt 0 ]; then
	timeout "$T_ATTN" sh -c "$B attention --threads 1,16 --json --min-time 0.4 > '$R/attn.json' 2> '$R/attn.err';
		sh ./tests/bench/attn_sweep.sh $B 16 > '$R/attn_sweep.txt' 2>&1"
	el "attention: rc $?"
fi
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("read bandwidth", d["read_bw_gbs"], "GB/s")
for r in d["results"]: print("%-7s %2d threads %7.2f GB/s %5.0f%%" % (r["variant"], r["threads"], r["kv_gbs"], 100 * r["kv_gbs"] / d["read_bw_gbs"]))' \
	"$R/attn.json" 2>/dev/null
cat "$R/attn_sweep.txt" 2>/dev/null

# does anything delay the pipeline's activation copies behind the weight
# stream? (once a layer a GPU command lasts as long as the
# layer's copy); alone, then with the CPU reading memory as the attention
# does
if [ "$T_COPYQ" -gt 0 ] && [ -x ./tests/bench/bench_copyq ]; then
	timeout "$T_COPYQ" sh -c "COPYQ_REGISTER=1 ./tests/bench/bench_copyq > '$R/copyq.json' 2> '$R/copyq.txt';
		COPYQ_REGISTER=1 COPYQ_CPU_THREADS=14 ./tests/bench/bench_copyq > '$R/copyq_load.json' 2> '$R/copyq_load.txt';
		COPYQ_REGISTER=1 COPYQ_GEMM=1 ./tests/bench/bench_copyq > '$R/copyq_gemm.json' 2> '$R/copyq_gemm.txt';
		COPYQ_REGISTER=1 COPYQ_GEMM=1 COPYQ_BEFORE=1 ./tests/bench/bench_copyq > '$R/copyq_before.json' 2> '$R/copyq_before.txt'"
	el "copy queue probe: rc $?"
	for f in copyq_load copyq_gemm copyq_before; do echo "== $f"; cat "$R/$f.txt"; done
fi

# the CUDA backend's heavy ops alone (tests/bench/bench_cuda.c): GEMM
# rates, one expert's GEMMs at a chunk's row counts, the MoE per stream
# count and tokens per call, attention
if [ "$T_BENCH" -gt 0 ] && [ -x ./tests/bench/bench_cuda ]; then
	timeout "$T_BENCH" ./tests/bench/bench_cuda > "$R/bench_cuda.json" 2> "$R/bench_cuda.txt"
	el "bench_cuda: rc $?"
	cat "$R/bench_cuda.txt"
fi

# 3-step traces of a hybrid run at full pipeline, armed once it serves:
# one per TRACE_VARIANTS entry ('|'-separated mlensd arguments, added to
# DAEMON_ARGS; default one run as configured), each summarised: step
# times, each track's busy time, the medians of C, GA and GB, and the GPU
# commands that ran over 20 ms (a GA or GB alone takes 2-7 ms)
trace_run() {	# index, extra mlensd arguments
	d=$R/trace$1
	mkdir -p "$d"
	# shellcheck disable=SC2086
	./daemon/mlensd --model "$MODEL" --foreground --backend cuda --gpu-memory 8G --kv-cache 40G \
		--mlock=false --quota-running 0 ${DAEMON_ARGS:-} $2 --socket "$d/s" --control "$d/c" \
		--stats "$d/st" --log "$d/mlensd.log" &
	pid=$!
	for _ in $(seq 600); do grep -q "serving on" "$d/mlensd.log" 2>/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 0.1; done
	awk -v n="$TRACE_REQUESTS" 'BEGIN { srand(7); for (r = 0; r < n; r++) { printf "{\"prompt\": ["; for (i = 0; i < 512; i++)
		printf "%s%d", (i ? ", " : ""), 1 + int(rand() * 31999); printf "], \"max_tokens\": 32}\n" } }' > "$d/in.jsonl"
	timeout "$T_TRACE" ./client/mlens generate -s "$d/s" -i "$d/in.jsonl" -o "$d/out.jsonl" -n 2400 -q 2> "$d/gen.err" &
	gen=$!
	sleep "${TRACE_AFTER:-25}"	# past the first, prefill-only steps
	./client/mlensctl -s "$d/c" trace --steps 3 "$R/trace$1.json" 2>&1
	./client/mlensctl -s "$d/c" status 2>&1 | grep -E "mode|pipeline|step"
	kill $gen 2>/dev/null
	wait $gen 2>/dev/null
	kill -TERM $pid
	wait $pid
	cp "$d/mlensd.log" "$R/trace${1}_mlensd.log"
	echo "trace $1 (mlensd ${DAEMON_ARGS:-} $2):"
	python3 "$(dirname "$0")/trace_summary.py" "$R/trace$1.json"
}
if [ "$T_TRACE" -gt 0 ]; then
	i=0
	IFS='|'
	# shellcheck disable=SC2086
	set -- ${TRACE_VARIANTS:-""}
	unset IFS
	[ $# -eq 0 ] && set -- ""
	for v in "$@"; do
		trace_run "$i" "$v"
		i=$((i + 1))
	done
	el "trace done"
fi

if [ "$T_SET" -gt 0 ]; then
	OUT=$R RUNS=${RUNS:-"p512g32 p512g128 p128g32 p512g32kv20 p512g128kv20 hf"} EXPECT_TPS=${EXPECT_TPS:-25000} STARTUP_S=30 \
		timeout "$T_SET" sh ./tests/bench/hybrid.sh 8G 40G "$SCALE" 2>&1 | tail -20
	el "benchmark set: rc $?"
fi
if [ "$T_SWEEP" -gt 0 ]; then
	OUT=$R timeout "$T_SWEEP" sh ./tests/bench/nreal_sweep.sh 512 32 40G 8G 2>&1 | tail -12
	el "n_real sweep: rc $?"
fi
# the traced runs' request and output files stay out (tens of MB)
tar czf "$OUT/session.tgz" --exclude='*.jsonl' -C "$(dirname "$R")" "$(basename "$R")"
el "results in $OUT/session.tgz"
