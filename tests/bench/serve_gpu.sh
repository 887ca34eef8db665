#!/bin/sh
# The GPU machine's serving run (from a configured CUDA build tree): build,
# make check (check_cuda, goldens on CUDA, everything else), the tenant
# integration test on --backend cuda, then mlens-bench serve on a
# Mixtral-8x7B-shaped model (8 layers, bf16, written to /dev/shm while the
# tests run) at p=512 g=128, and a shorter run with per-op profiling.
# Results go to $OUT (default ./out); a table is printed last.
# Usage: serve_gpu.sh [REQUESTS] [KV_CACHE]
set -u
OUT=${OUT:-$PWD/out}
REQ=${1:-2400}
KV=${2:-48G}
MODEL=${MLENS_SERVE_MODEL:-/dev/shm/mlens-mixtral8}
J=$(nproc)
mkdir -p "$OUT"
t0=$(date +%s)
make -j"$J" > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
echo "build: $(($(date +%s) - t0)) s"
if [ ! -f "$MODEL/config.json" ]; then
	( /usr/bin/time -f "mkmodel %e s" ./daemon/mlens-mkmodel -o "$MODEL" --preset mixtral-8x7b \
		--layers 8 --dtype bf16 ) > /tmp/mkmodel.log 2>&1 &
	MK=$!
else
	MK=
fi
make -j8 check > "$OUT/check.log" 2>&1
echo "make check: rc $? after $(($(date +%s) - t0)) s"
grep -E "^(PASS|FAIL|SKIP|ERROR|XPASS|XFAIL):" "$OUT/check.log"
grep -E "golden .*\[cuda\]|Checks|FAIL|fail" tests/golden/check_golden_cuda.sh.log | head -30
MLENS_TEST_BACKEND=cuda MLENS_BUILDDIR=$PWD timeout 300 sh ./tests/integration/tenants.sh > "$OUT/tenants_cuda.log" 2>&1
echo "tenants.sh on cuda: rc $?"; grep -E "^(ok|note|FAIL|skip|all)" "$OUT/tenants_cuda.log"
tar czf "$OUT/testlogs.tar.gz" tests/*.log tests/*/*.log 2>/dev/null
[ -n "$MK" ] && { wait $MK; cat /tmp/mkmodel.log; }
echo "model ready after $(($(date +%s) - t0)) s"
B="./tests/bench/mlens-bench serve --model $MODEL --mlensd ./daemon/mlensd --backend cuda --kv-cache $KV --prompt-len 512 --gen-len 128 --concurrency 1024 --threads 8 --timeout 240 --json"
$B --requests "$REQ" > "$OUT/serve.json" 2> "$OUT/serve.err"
echo "serve: rc $? after $(($(date +%s) - t0)) s"
MLENS_ENGINE_PROFILE=40 $B --requests 600 > "$OUT/serve_prof.json" 2> "$OUT/serve_prof.err"
echo "serve (profiled): rc $? after $(($(date +%s) - t0)) s"
tail -3 "$OUT/serve_prof.err"
cat "$OUT/serve.err" | tail -5
cat "$OUT/serve.json"
