#!/bin/sh
# Sweep of the CPU decode attention tuning knobs (prefetch distance, mode,
# hint; task size) at one thread count: one mlens-bench attention run per
# setting, printed as a table of KV GB/s next to the read bandwidth.
# usage: attn_sweep.sh [MLENS_BENCH [THREADS [VARIANT]]]
#   defaults: tests/bench/mlens-bench (or mlens-bench on PATH), all online
#   CPUs, avx512 (avx2 where the CPU lacks it). SEQS=N changes the batch.
set -u
bench=${1:-}
if [ -z "$bench" ]; then
	if [ -x tests/bench/mlens-bench ]; then bench=tests/bench/mlens-bench
	else bench=mlens-bench; fi
fi
threads=${2:-$(getconf _NPROCESSORS_ONLN)}
variant=${3:-avx512}
seqs=${SEQS:-1000}
if ! "$bench" attention --variant "$variant" --threads 1 --seqs 1 --min-ctx 16 --max-ctx 16 \
	--bw-mb 1 --min-time 0 >/dev/null 2>&1; then
	variant=avx2
fi

run() {	# label, extra flags
	label=$1
	shift
	out=$("$bench" attention --json --variant "$variant" --threads "$threads" --seqs "$seqs" \
		--bw-mb 1024 --min-time 0.5 "$@" 2>/dev/null) || { printf '%-34s failed\n' "$label"; return; }
	kv=$(printf '%s\n' "$out" | sed -n 's/.*"kv_gbs": \([0-9.]*\).*/\1/p' | head -n 1)
	bw=$(printf '%s\n' "$out" | sed -n 's/^{"read_bw_gbs": \([0-9.]*\).*/\1/p' | head -n 1)
	awk -v l="$label" -v k="$kv" -v b="$bw" \
		'BEGIN { printf "%-34s %8.2f %8.2f %6.0f%%\n", l, k, b, (b > 0 ? 100 * k / b : 0) }'
}

echo "mlens-bench attention sweep: $variant, $threads threads, $seqs seqs of 512-2048 tokens"
printf '%-34s %8s %8s %7s\n' "setting" "KV GB/s" "read" "of read"
run "no prefetch"			--prefetch 0
run "burst, 4 tiles (old default)"	--prefetch-spread 0 --prefetch 4
run "spread, 1 tile"			--prefetch 1
run "spread, 2 tiles"			--prefetch 2
run "spread, 4 tiles (default)"
run "spread, 8 tiles"			--prefetch 8
run "spread, 16 tiles"			--prefetch 16
run "spread, 64 KB"			--prefetch-bytes 65536
run "spread, 4 tiles, t0"		--prefetch-hint t0
run "spread, 4 tiles, t2"		--prefetch-hint t2
run "spread, 4 tiles, every 2nd line"	--prefetch-every 2
run "spread, 4 tiles, chunk 256"	--chunk 256
run "spread, 4 tiles, chunk 1024"	--chunk 1024
run "spread, 4 tiles, 2 heads/task"	--heads-per-task 2
run "avx2, spread, 4 tiles"		--variant avx2
threads=1 seqs=${SEQS1:-200}
run "1 thread, 200 seqs, no prefetch"	--prefetch 0
run "1 thread, 200 seqs, default"
