#!/bin/sh
# Issue 7's benchmark set, for the GPU machine, from a configured CUDA build
# tree: a Mixtral-8x7B-shaped model with 8 layers (bf16, ~23.7 GB, written
# to /dev/shm once), GPU budget 8 GiB (so mlensd runs the hybrid pipeline),
# KV pool 40 GiB in pinned host memory; workloads p=512/g=128, p=512/g=32,
# p=128/g=32 with about three times as many requests as the KV pool holds
# at once; then the baseline a user would reach for, transformers +
# accelerate offloading the same model under the same budget
# (tests/bench/hf_baseline.py), on a workload small enough to finish.
# JSON per run under $OUT (default ./out), a table last.
# Usage: hybrid.sh [GPU_MEMORY] [KV_CACHE] [SCALE]
#   SCALE (default 1.0) multiplies the request counts, to fit a time limit.
set -u
OUT=${OUT:-$PWD/out}
GPU=${1:-8G}
KV=${2:-40G}
SCALE=${3:-1.0}
MODEL=${MLENS_SERVE_MODEL:-/dev/shm/mlens-mixtral8}
mkdir -p "$OUT"
if [ ! -f "$MODEL/config.json" ]; then
	./daemon/mlens-mkmodel -o "$MODEL" --preset mixtral-8x7b --layers 8 --dtype bf16 >/dev/null ||
		{ echo "hybrid.sh: cannot write the model"; exit 1; }
fi
# KV bytes per token: layers * kv_heads * head_dim * 2 (K, V) * 2 (bf16)
per_token=$((8 * 8 * 128 * 2 * 2))
kv_bytes=$(numfmt --from=iec "$KV")
run() {	# name p g
	seqs=$((kv_bytes / per_token / ($2 + $3)))
	req=$(awk -v s="$seqs" -v k="$SCALE" 'BEGIN { r = int(3 * s * k); print (r < 64 ? 64 : r) }')
	./tests/bench/mlens-bench serve --model "$MODEL" --mlensd ./daemon/mlensd --backend cuda \
		--gpu-memory "$GPU" --kv-cache "$KV" --prompt-len "$2" --gen-len "$3" \
		--requests "$req" --concurrency "$seqs" --threads 8 --timeout 600 --json \
		> "$OUT/hybrid_$1.json" 2> "$OUT/hybrid_$1.err"
	echo "$1: p=$2 g=$3 requests=$req (KV holds $seqs at once): rc $?"
}
run p512g128 512 128
run p512g32 512 32
run p128g32 128 32
python3 ./tests/bench/hf_baseline.py "$MODEL" --gpu-memory "$(echo "$GPU" | sed 's/G$/GiB/')" \
	--prompt-len 128 --gen-len 32 --requests 32 --batch 16 > "$OUT/hf_baseline.json" 2> "$OUT/hf_baseline.err"
echo "transformers+accelerate: rc $?"
echo
printf '%-12s %14s %14s\n' run "generated t/s" "total t/s"
for f in "$OUT"/hybrid_*.json "$OUT/hf_baseline.json"; do
	[ -s "$f" ] || continue
	python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); g=d.get("generated_tokens_per_s", d.get("measured", {}).get("generated_tokens_per_s")); t=d.get("total_tokens_per_s", d.get("measured", {}).get("total_tokens_per_s")); print("%-12s %14s %14s" % (sys.argv[1].split("/")[-1][:-5], g, t))' "$f"
done
