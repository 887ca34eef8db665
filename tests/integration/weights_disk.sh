#!/bin/sh
# Description: weights on disk (weights_on_disk = auto): a host_memory
# budget too small for the weight pages leaves half of each layer's
# experts in the model files, read each step into pinned staging; greedy
# tokens (fp32 model) are those of a daemon with every expert in RAM. The
# start-up log, status, the stats socket and /metrics say how much stays
# on disk and what the steps read. With the test hook MLENS_TEST_DISK_FAIL
# a read error (and a short read) fails the step with the file and tensor
# named; the daemon stays up and the next request, the hook gone, gets the
# same tokens. The profiler measures the files' read rate (the disk
# ceiling). weights_on_disk = kv-first leaves experts on disk for the
# whole kv_cache where auto would keep them in RAM with a smaller pool.
# weights_on_disk = never refuses that budget by name, and so
# does weight_dtype = fp8 with experts on disk.
# MLENS_TEST_BACKEND=cuda runs the daemons on the CUDA backend (default
# cpu) with MLENS_WEIGHTS_DISK_FLAGS added (default there: --gpu-memory
# 512M --group-tokens 64 --resident-experts 0), which should include
# --resident-experts 0 (or 1): the tiny model's experts all fit on the
# GPU, so only a cap on the resident experts makes the hybrid pipeline
# stream the disk experts from their staging each step (a --gpu-memory
# below the model's need, with its 1G KV pool: 512M, selects hybrid mode
# but its plan still holds every expert); --group-tokens 64 keeps its
# host staging inside the small budget; there each request must end
# the same way, token counts included (a near tie of two logits may fork
# a sequence). MLENS_WEIGHTS_DISK_HALF sets the budget (default 4500K,
# 3000K on the CUDA backend).
set -u
. "${MLENS_SRCDIR:-.}/tests/integration/lib.sh"
BACKEND=${MLENS_TEST_BACKEND:-cpu}
# on CUDA by default: hybrid mode with no expert resident, so that the
# disk experts stream from their staging every step
if [ "$BACKEND" = cpu ]; then EXTRA=${MLENS_WEIGHTS_DISK_FLAGS:-}
else EXTRA=${MLENS_WEIGHTS_DISK_FLAGS:---gpu-memory 512M --group-tokens 64 --resident-experts 0}; fi
tc() { timeout 120 "$B/tests/integration/tclient" "$@"; }

# eight layers of four experts: half the experts is most of the model
"$B/daemon/mlens-mkmodel" -o "$tmp/model" --preset tiny --layers 8 --dtype fp32 --seed 5 >/dev/null ||
	fail "mkmodel"
COMMON="--model $tmp/model --mlock=false --threads 2 --backend $BACKEND --max-step-tokens 256"
# the hybrid pipeline's host staging is smaller than the CPU engine's: a
# smaller budget leaves experts on disk there
if [ "$BACKEND" = cpu ]; then HALF=${MLENS_WEIGHTS_DISK_HALF:-4500K}; else HALF=${MLENS_WEIGHTS_DISK_HALF:-3000K}; fi

# run NAME ARGS...: a daemon with ARGS, two tenants of three requests at
# once, their outputs in $tmp/NAME_K.out, status, stats and metrics beside;
# the daemon then stops
run() {
	name=$1; shift
	# shellcheck disable=SC2086 # COMMON and EXTRA are words
	start_mlensd $COMMON --stats-http 127.0.0.1:0 $EXTRA "$@"
	cl=
	for k in 1 2; do
		tc -s "$tmp/t.sock" --seed $k -n 3 -p 40 -g 24 > "$tmp/${name}_$k.out" &
		cl="$cl $!"
	done
	r=0
	for p in $cl; do wait "$p" || r=1; done
	[ $r -eq 0 ] || fail "$name: a tenant failed: $(cat "$tmp/${name}"_*.out | head -3)"
	ctl stats > "$tmp/$name.stats" || fail "$name: mlensctl stats"
	ctl status > "$tmp/$name.status" || fail "$name: mlensctl status"
	ctl --json status > "$tmp/$name.json" || fail "$name: mlensctl --json status"
	curl -sf "http://127.0.0.1:$(stats_port)/metrics" > "$tmp/$name.metrics" 2>/dev/null || : > "$tmp/$name.metrics"
	cp "$tmp/log" "$tmp/$name.log"
	kill "$pid" && wait "$pid"
	pid=
	rm -f "$tmp/log"
}

run ref --host-memory 64M
grep -q "weights on disk" "$tmp/ref.log" && fail "64M: experts left on disk: $(grep 'weights on disk' "$tmp/ref.log")"

run disk --host-memory $HALF
if [ "$BACKEND" != cpu ] && ! grep -q "hybrid mode" "$tmp/disk.log"; then
	echo "SKIP: GPU-only mode copies the disk experts to the GPU once (MLENS_WEIGHTS_DISK_FLAGS=\"--resident-experts 0 --group-tokens 64\": hybrid mode, the disk experts streamed)"
	exit 77
fi
# the CUDA backend's (hybrid) staging differs: the share on disk may too
D=2
[ "$BACKEND" = cpu ] || D=$(sed -n 's/.*weights on disk: \([1-4]\) of 4 experts.*/\1/p' "$tmp/disk.log")
grep -q "weights on disk: $D of 4 experts in each of 8 MoE layers (.* MiB) stay in the model files" "$tmp/disk.log" ||
	fail "$HALF: no disk tier line: $(grep -i -e 'disk' -e 'host memory' "$tmp/disk.log")"
grep -q "host memory budget [0-9.]* MiB: .*disk staging .* MiB.*weights on disk .* MiB" "$tmp/disk.log" ||
	fail "$HALF: the split has no disk tier: $(grep 'host memory' "$tmp/disk.log")"
for k in 1 2; do
	same "$tmp/ref_$k.out" "$tmp/disk_$k.out" || fail "tenant $k's tokens differ with half the experts on disk"
done
echo "ok: half the experts on disk, the same tokens as all in RAM"
# a hybrid plan that holds every expert on the GPU reads them once: the
# tokens above are checked, but there are no disk reads a step to test
# (the tiny model's experts are far below the GPU's least budget; a
# resident_experts below 4 streams them)
if [ "$BACKEND" != cpu ] && grep -q "resident weights .* (4 of 4 experts per layer)" "$tmp/disk.log"; then
	echo "SKIP: the hybrid plan holds every expert on the GPU: nothing is read from disk a step (add --resident-experts 0 to MLENS_WEIGHTS_DISK_FLAGS)"
	exit 77
fi
grep -q "^weights on disk  *.* MiB in the model files ($D experts in each of 8 layers" "$tmp/disk.status" ||
	fail "status: $(grep -i 'disk' "$tmp/disk.status")"
db=$(stat_of disk weights_disk_resident_bytes)
[ "$(jfield disk_bytes < "$tmp/disk.json")" = "$db" ] || fail "status and stats disagree on the disk bytes"
# D experts of 8 layers, three 32 KiB matrices each
[ "$db" -eq $((D * 8 * 3 * 32768)) ] || fail "disk bytes $db"
step=$(stat_of disk weights_disk_step_bytes)
rd=$(stat_of disk weights_disk_read_bytes_total)
# every step reads every disk layer: at least one step's worth per step
[ "$rd" -ge $((step * $(stat_of disk steps_total))) ] || fail "read $rd bytes in $(stat_of disk steps_total) steps of $step"
[ "$(stat_of disk weights_disk_read_errors_total)" = 0 ] || fail "read errors without a fault"
grep -q "^mlens_weights_disk_read_bytes_total $rd$" "$tmp/disk.metrics" || fail "metrics: $(grep disk "$tmp/disk.metrics")"
grep -q "^mlens_weights_disk_resident_bytes $db$" "$tmp/disk.metrics" || fail "metrics: no disk bytes"
grep -q "^mlens_disk_busy_ratio " "$tmp/disk.metrics" || fail "metrics: no disk busy ratio"
[ -z "$(stat_of ref weights_disk_resident_bytes)" ] || fail "disk counters without experts on disk"
echo "ok: status, stats and metrics say $db bytes on disk, $rd bytes read"

# faults: a read error, then a short read, each fail their request's step
# with the file and tensor named; the daemon stays up; with the hook gone
# the next request gets the tokens of all in RAM
MLENS_TEST_DISK_FAIL="$tmp/fail"
export MLENS_TEST_DISK_FAIL
# shellcheck disable=SC2086 # COMMON and EXTRA are words
start_mlensd $COMMON $EXTRA --host-memory $HALF
unset MLENS_TEST_DISK_FAIL
echo eio > "$tmp/fail"
tc -s "$tmp/t.sock" --seed 1 -n 1 -p 40 -g 24 --why > "$tmp/f1.out" && fail "a read error did not fail the request"
grep -q "weights on disk: reading model.layers.[0-9]*.block_sparse_moe.experts.[0-3].w[123].weight (layer [0-9]* expert [0-3]) at offset [0-9]* of $tmp/model/model.safetensors failed: Input/output error" "$tmp/log" ||
	fail "no read error naming the file and tensor: $(grep -i 'disk\|step failed' "$tmp/log" | tail -3)"
echo short > "$tmp/fail"
tc -s "$tmp/t.sock" --seed 1 -n 1 -p 40 -g 24 > "$tmp/f2.out" && fail "a short read did not fail the request"
grep -q "of $tmp/model/model.safetensors failed: short read (the file ends before the tensor does)" "$tmp/log" ||
	fail "no short read named: $(grep -i 'disk' "$tmp/log" | tail -3)"
ctl status >/dev/null || fail "the daemon is down after the read errors"
rm -f "$tmp/fail"
tc -s "$tmp/t.sock" --seed 1 -n 3 -p 40 -g 24 > "$tmp/f3.out" || fail "the request after the faults failed: $(cat "$tmp/f3.out")"
same "$tmp/ref_1.out" "$tmp/f3.out" || fail "the tokens after the faults differ from all in RAM"
# the profiler measures the files' read rate: the disk ceiling of the
# performance model, shown in the stats
ctl --json profile > "$tmp/prof.json" || fail "mlensctl profile: $(cat "$tmp/prof.json")"
bps=$(jfield disk_read_bytes_per_s < "$tmp/prof.json")
awk -v b="$bps" 'BEGIN { exit !(b > 1e6) }' || fail "disk read rate '$bps' in the profile"
grep -q '"disk": ' "$tmp/prof.json" || fail "no disk tier in the profile's layer times"
ctl stats > "$tmp/f.stats"
awk -v b="$(stat_of f weights_disk_ceiling_bytes_per_second)" 'BEGIN { exit !(b > 1e6) }' ||
	fail "no disk ceiling in the stats"
[ "$(stat_of f weights_disk_read_errors_total)" -ge 2 ] || fail "read errors not counted"
echo "ok: read errors fail their step by name, the daemon stays up, the next request is right"
kill "$pid" && wait "$pid"
pid=

# weights_on_disk = never: the budget is refused by name
[ "$BACKEND" = cpu ] || exit 0
refused 1 "host_memory of 4.4 MiB cannot run this model: weight pages 3.7 MiB + staging" --model "$tmp/model" --host-memory $HALF \
	--max-step-tokens 256 --weights-on-disk never --kv-cache 64M
echo "ok: weights_on_disk = never refuses the budget"
# weights_on_disk = kv-first: a budget that holds the files beside the
# least KV pool but not beside kv_cache; auto keeps every expert in RAM and
# gives the pool the rest, kv-first leaves experts on disk so that the pool
# gets all of kv_cache; the tokens are those of all in RAM
rm -f "$tmp/log"
run kvauto --host-memory 8M --kv-cache 4M
grep -q "weights on disk" "$tmp/kvauto.log" && fail "8M auto: experts on disk: $(grep 'weights on disk' "$tmp/kvauto.log")"
grep -q "KV cache: 105 blocks of 16 tokens" "$tmp/kvauto.log" || fail "8M auto: the pool: $(grep 'KV cache:' "$tmp/kvauto.log")"
run kvfirst --host-memory 8M --kv-cache 4M --weights-on-disk kv-first
grep -q "weights on disk: 2 of 4 experts in each of 8 MoE layers" "$tmp/kvfirst.log" ||
	fail "kv-first: $(grep -i 'disk\|host memory' "$tmp/kvfirst.log")"
grep -q "KV cache: 128 blocks of 16 tokens (F32, 4.0 MiB" "$tmp/kvfirst.log" ||
	fail "kv-first: the pool is not kv_cache: $(grep 'KV cache:' "$tmp/kvfirst.log")"
for k in 1 2; do
	same "$tmp/ref_$k.out" "$tmp/kvfirst_$k.out" || fail "kv-first: tenant $k's tokens differ from all in RAM"
done
echo "ok: weights_on_disk = kv-first leaves experts on disk for the whole kv_cache"
# experts quantized at load come from the weight pages: not with some on disk
refused 1 "weight_dtype = fp8 quantizes the experts from the weight pages, but host_memory of 4.4 MiB leaves 2 experts a layer on disk" \
	--model "$tmp/model" --host-memory $HALF --max-step-tokens 256 --weight-dtype fp8 --kv-cache 64M
echo "ok: weight_dtype = fp8 with experts on disk is refused by name"
exit 0
