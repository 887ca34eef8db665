#!/bin/sh
# Description: weights on disk (weights_on_disk = auto): a host_memory
# budget too small for the weight pages leaves half of each layer's
# experts in the model files, read each step into pinned staging; greedy
# tokens (fp32 model) are those of a daemon with every expert in RAM. The
# start-up log, status, the stats socket and /metrics say how much stays
# on disk and what the steps read. With the test hook MLENS_TEST_DISK_FAIL
# a read error (and a short read) fails the step with the file and tensor
# named; the daemon stays up and the next request, the hook gone, gets the
# same tokens. weights_on_disk = never refuses that budget by name.
# MLENS_TEST_BACKEND=cuda runs the daemons on the CUDA backend (default
# cpu) with MLENS_WEIGHTS_DISK_FLAGS added (e.g. a --gpu-memory below the
# model's need: the hybrid pipeline streams the disk experts from their
# staging); there each request must end the same way, token counts
# included (a near tie of two logits may fork a sequence).
set -u
. "${MLENS_SRCDIR:-.}/tests/integration/lib.sh"
BACKEND=${MLENS_TEST_BACKEND:-cpu}
EXTRA=${MLENS_WEIGHTS_DISK_FLAGS:-}
tc() { timeout 120 "$B/tests/integration/tclient" "$@"; }

# eight layers of four experts: half the experts is most of the model
"$B/daemon/mlens-mkmodel" -o "$tmp/model" --preset tiny --layers 8 --dtype fp32 --seed 5 >/dev/null ||
	fail "mkmodel"
COMMON="--model $tmp/model --mlock=false --threads 2 --backend $BACKEND --max-step-tokens 256"
HALF=4500K

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
stat_of() { awk -v k="$2" '$1 == k { print $2 }' "$tmp/$1.stats"; }
same() {
	cmp -s "$1" "$2" && return 0
	[ "$BACKEND" = cuda ] || return 1
	awk '{print $1, $2, $3, NF}' "$1" > "$tmp/same_a"
	awk '{print $1, $2, $3, NF}' "$2" > "$tmp/same_b"
	cmp -s "$tmp/same_a" "$tmp/same_b"
}

run ref --host-memory 64M
grep -q "weights on disk" "$tmp/ref.log" && fail "64M: experts left on disk: $(grep 'weights on disk' "$tmp/ref.log")"

run disk --host-memory $HALF
grep -q "weights on disk: 2 of 4 experts in each of 8 MoE layers (1.5 MiB) stay in the model files" "$tmp/disk.log" ||
	fail "$HALF: no disk tier line: $(grep -i 'disk' "$tmp/disk.log")"
grep -q "host memory budget 4.4 MiB: .*disk staging 0.4 MiB.*weights on disk 1.5 MiB" "$tmp/disk.log" ||
	fail "$HALF: the split has no disk tier: $(grep 'host memory' "$tmp/disk.log")"
for k in 1 2; do
	same "$tmp/ref_$k.out" "$tmp/disk_$k.out" || fail "tenant $k's tokens differ with half the experts on disk"
done
echo "ok: half the experts on disk, the same tokens as all in RAM"
