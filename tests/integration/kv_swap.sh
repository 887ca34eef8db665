#!/bin/sh
# Description: the KV swap file under preemption (CPU backend, tiny fp32
# model, greedy): four tenants with long prompts on a KV pool too small for
# them get the tokens of a pool that holds them all, with the swap off
# (every preempted sequence re-prefills) and with kv_swap_policy = always
# (every one goes to the file and comes back without a re-prefill, the
# slots all free at the end, bytes in = bytes out). With the test hook
# MLENS_TEST_SWAP_FAIL, a write error, a full disk and a read error each
# fall back to a re-prefill: the same tokens for every tenant, no request
# failed, the fallback counted, the daemon up. With kv_swap_policy = auto
# and the disk's rate forced by MLENS_TEST_SWAP_RATE, a slow disk
# recomputes every preempted sequence and a fast one swaps, tokens
# unchanged; the rates and their sources are reported. Status, the stats socket
# and /metrics show the counters; an fp8 pool swaps its scales with its
# codes; a kv_swap_path that is an existing file is refused at start-up by
# name.
# MLENS_TEST_BACKEND=cuda runs the daemons on the CUDA backend (default
# cpu), with MLENS_KV_SWAP_FLAGS added (default there: --resident-experts
# 0, hybrid mode, whose KV pool is in host memory; GPU-only mode has no KV
# swap and the script skips there). On CUDA a sequence batched
# otherwise may fork where two logits nearly tie (see tenants.sh): there
# every request must end the same way, token counts included.
set -u
. "${MLENS_SRCDIR:-.}/tests/integration/lib.sh"
BACKEND=${MLENS_TEST_BACKEND:-cpu}
# on CUDA by default: hybrid mode (no expert resident), whose KV pool is
# in host memory
if [ "$BACKEND" = cpu ]; then EXTRA=${MLENS_KV_SWAP_FLAGS:-}
else EXTRA=${MLENS_KV_SWAP_FLAGS:---resident-experts 0}; fi
tc() { timeout 120 "$B/tests/integration/tclient" "$@"; }

"$B/daemon/mlens-mkmodel" -o "$tmp/model" --preset tiny --dtype fp32 --seed 5 >/dev/null || fail "mkmodel"

# run NAME ARGS...: a daemon with ARGS, four tenants of three requests
# (prompts of 200 tokens, 100 generated) at once, their outputs in
# $tmp/NAME_K.out, its stats in $tmp/NAME.stats; the daemon then stops
run() {
	name=$1; shift
	# shellcheck disable=SC2086 # EXTRA is words
	start_mlensd --model "$tmp/model" --mlock=false --threads 2 --backend "$BACKEND" \
		--stats-http 127.0.0.1:0 $EXTRA "$@"
	cl=
	for k in 1 2 3 4; do
		tc -s "$tmp/t.sock" --seed $k -n 3 -p 200 -g 100 > "$tmp/${name}_$k.out" &
		cl="$cl $!"
	done
	r=0
	for p in $cl; do wait "$p" || r=1; done
	[ $r -eq 0 ] || fail "$name: a tenant failed: $(cat "$tmp/${name}"_*.out | grep -v ' length ' | head -3)"
	ctl stats > "$tmp/$name.stats" || fail "$name: mlensctl stats"
	ctl status > "$tmp/$name.status" || fail "$name: mlensctl status"
	port=$(stats_port)
	curl -sf "http://127.0.0.1:$port/metrics" > "$tmp/$name.metrics" 2>/dev/null || : > "$tmp/$name.metrics"
	cp "$tmp/log" "$tmp/$name.log"
	kill "$pid" && wait "$pid"
	pid=
	rm -f "$tmp/log"
}
same_as_ref() {
	for k in 1 2 3 4; do
		same "$tmp/ref_$k.out" "$tmp/$1_$k.out" || fail "$1: tenant $k's tokens differ from the large pool's"
	done
	[ "$(stat_of "$1" requests_failed_total)" = 0 ] || fail "$1: requests failed"
}
SMALL="--kv-cache 400K --admit-lookahead 1"

run ref --kv-cache 64M
[ "$(stat_of ref preemptions_total)" = 0 ] || fail "the large pool preempted"

# swap off: preempted sequences re-prefill
run off $SMALL
same_as_ref off
[ "$(stat_of off preemptions_total)" -gt 0 ] || fail "the small pool never preempted"
[ -z "$(stat_of off kv_swaps_total)" ] || fail "swap counters without a swap file"
echo "ok: swap off, $(stat_of off preemptions_total) preemptions re-prefilled, tokens unchanged"

# every preempted sequence to the swap file and back
run always $SMALL --kv-swap 16M --kv-swap-path "$tmp" --kv-swap-policy always
if grep -q "GPU-only mode keeps the KV cache in GPU memory" "$tmp/always.log"; then
	echo "SKIP: GPU-only mode has no KV swap (MLENS_KV_SWAP_FLAGS=\"--resident-experts 0\": hybrid mode)"
	exit 77
fi
same_as_ref always
pre=$(stat_of always preemptions_total) sw=$(stat_of always kv_swaps_total)
[ "$pre" -gt 0 ] || fail "always: no preemption"
[ "$sw" -gt 0 ] || fail "always: no sequence swapped ($pre preemptions)"
[ "$(stat_of always kv_swap_ins_total)" = "$sw" ] || fail "always: $sw swapped out, $(stat_of always kv_swap_ins_total) back in"
[ "$(stat_of always kv_swap_bytes_in_total)" = "$(stat_of always kv_swap_bytes_out_total)" ] ||
	fail "always: bytes in $(stat_of always kv_swap_bytes_in_total) != out $(stat_of always kv_swap_bytes_out_total)"
[ "$(stat_of always kv_swap_slots_used)" = 0 ] || fail "always: slots still used at the end"
[ "$(stat_of always kv_swap_errors_total)" = 0 ] || fail "always: I/O errors"
# the swapped sequences did not re-prefill: fewer prefill tokens than
# prompts + re-prefills of the same preemptions would take
[ "$(stat_of always prompt_tokens_total)" -lt "$(stat_of off prompt_tokens_total)" ] ||
	fail "always: $(stat_of always prompt_tokens_total) prefill tokens, no fewer than with re-prefills ($(stat_of off prompt_tokens_total))"
grep -q "^KV swap .* slots used in $tmp; .* out, .* in; $sw preempted sequences swapped" "$tmp/always.status" ||
	fail "mlensctl status lacks the KV swap line: $(cat "$tmp/always.status")"
if command -v curl >/dev/null; then
	grep -q "^mlens_kv_swap_preemptions_total{how=\"swap\"} $sw\$" "$tmp/always.metrics" || fail "/metrics lacks the swaps"
	grep -q "^mlens_kv_swap_bytes_total{dir=\"in\"} $(stat_of always kv_swap_bytes_in_total)\$" "$tmp/always.metrics" ||
		fail "/metrics lacks the bytes read back"
	grep -q "^mlens_kv_swap_slots_total [1-9]" "$tmp/always.metrics" || fail "/metrics lacks the slots"
	grep -q "^mlens_kv_swap_io_seconds_total [0-9]" "$tmp/always.metrics" || fail "/metrics lacks the swap I/O time"
fi
grep -q "KV swap file in $tmp: .* slots of .* bytes" "$tmp/always.log" || fail "no start-up line on the swap file"
grep -q "preemption: $pre sequences evicted so far (KV blocks short); $sw went to the KV swap file, 0 re-prefill" "$tmp/always.log" ||
	fail "the preemption log line lacks the swap: $(grep preemption: "$tmp/always.log" | tail -1)"
[ -z "$(ls -A "$tmp" | grep -i swap)" ] || fail "a swap file was left in $tmp: $(ls "$tmp")"
echo "ok: swap always, $sw of $pre preempted sequences swapped out and back, tokens unchanged"
sed -n 's/^\(KV swap .*\)/  mlensctl status: \1/p' "$tmp/always.status"

# the cost model (kv_swap_policy = auto) with the disk's rate forced by
# MLENS_TEST_SWAP_RATE: 1 KB/s makes every swap dearer than a re-prefill
# (none observed, so the rate stays); 1 PB/s makes the first swaps cheaper
# (later ones weigh the rates then observed); tokens unchanged either way
for speed in slow fast; do
	case $speed in slow) rate=1000 ;; fast) rate=1e15 ;; esac
	export MLENS_TEST_SWAP_RATE=$rate
	run "auto_$speed" $SMALL --kv-swap 16M --kv-swap-path "$tmp" --kv-swap-policy auto
	unset MLENS_TEST_SWAP_RATE
	same_as_ref "auto_$speed"
	pre=$(stat_of "auto_$speed" preemptions_total) sw=$(stat_of "auto_$speed" kv_swaps_total)
	rc=$(stat_of "auto_$speed" kv_swap_recomputes_total)
	[ "$pre" -gt 0 ] || fail "auto $speed: no preemption"
	grep -q "write+read .* GB/s (set by MLENS_TEST_SWAP_RATE); .*cost model: disk .* GB/s (measured)" \
		"$tmp/auto_$speed.log" || fail "auto $speed: the start-up line lacks the forced rate: $(grep 'KV swap file' "$tmp/auto_$speed.log")"
	[ "$(awk "BEGIN { print $(stat_of "auto_$speed" kv_swap_disk_measured_bps) == $rate }")" = 1 ] ||
		fail "auto $speed: measured rate $(stat_of "auto_$speed" kv_swap_disk_measured_bps), not $rate"
	[ "$(stat_of "auto_$speed" kv_swap_prefill_source)" = observed ] ||
		fail "auto $speed: prefill rate's source $(stat_of "auto_$speed" kv_swap_prefill_source), not observed"
	if [ $speed = slow ]; then
		[ "$sw" = 0 ] && [ "$rc" -gt 0 ] || fail "auto slow: $sw swapped, $rc recomputed (want 0 and > 0)"
		[ "$(stat_of auto_slow kv_swap_disk_source)" = measured ] ||
			fail "auto slow: disk source $(stat_of auto_slow kv_swap_disk_source), not measured"
		grep -q "cost model: disk 1e-06 GB/s (measured), prefill .* FLOP/s (observed)" "$tmp/auto_slow.status" ||
			fail "mlensctl status lacks the cost model's rates: $(grep '^KV swap' "$tmp/auto_slow.status")"
	else
		[ "$sw" -gt 0 ] || fail "auto fast: no sequence swapped ($pre preemptions, $rc recomputed)"
		[ "$(stat_of auto_fast kv_swap_disk_source)" = observed ] ||
			fail "auto fast: disk source $(stat_of auto_fast kv_swap_disk_source) after $sw swaps, not observed"
		if command -v curl >/dev/null; then
			grep -q '^mlens_kv_swap_disk_bytes_per_second{source="observed"} [0-9]' "$tmp/auto_fast.metrics" ||
				fail "/metrics lacks the observed disk rate"
			grep -q '^mlens_kv_swap_prefill_flops_per_second{source="observed"} [0-9]' "$tmp/auto_fast.metrics" ||
				fail "/metrics lacks the observed prefill rate"
		fi
	fi
	echo "ok: auto with a $speed disk: $sw swapped, $rc recomputed of $pre preemptions, tokens unchanged"
done
sed -n 's/^\(KV swap .*\)/  mlensctl status: \1/p' "$tmp/auto_slow.status"

# an fp8 pool (a scale a row after the codes) on a pool as short of
# tokens: the scales go to the file and come back with the codes, the
# tokens those of an fp8 pool that holds them all
run ref8 --kv-cache 64M --kv-dtype fp8
run always8 --kv-cache 125K --admit-lookahead 1 --kv-dtype fp8 --kv-swap 16M --kv-swap-path "$tmp" --kv-swap-policy always
for k in 1 2 3 4; do
	same "$tmp/ref8_$k.out" "$tmp/always8_$k.out" || fail "fp8: tenant $k's tokens differ from the large fp8 pool's"
done
sw=$(stat_of always8 kv_swaps_total)
[ "$sw" -gt 0 ] || fail "fp8: no sequence swapped ($(stat_of always8 preemptions_total) preemptions)"
[ "$(stat_of always8 kv_swap_ins_total)" = "$sw" ] && [ "$(stat_of always8 kv_swap_errors_total)" = 0 ] ||
	fail "fp8: $sw swapped out, $(stat_of always8 kv_swap_ins_total) back in, errors $(stat_of always8 kv_swap_errors_total)"
echo "ok: an fp8 pool's $sw swapped sequences come back with their scales, tokens unchanged"

# faults: each falls back to a re-prefill, nobody fails
for f in write enospc read; do
	export MLENS_TEST_SWAP_FAIL=$f
	run "fail_$f" $SMALL --kv-swap 16M --kv-swap-path "$tmp" --kv-swap-policy always
	unset MLENS_TEST_SWAP_FAIL
	same_as_ref "fail_$f"
	case $f in
	write) [ "$(stat_of fail_write kv_swap_errors_total)" -gt 0 ] && [ "$(stat_of fail_write kv_swaps_total)" = 0 ] ||
		fail "write fault: errors $(stat_of fail_write kv_swap_errors_total), swaps $(stat_of fail_write kv_swaps_total)" ;;
	enospc) [ "$(stat_of fail_enospc kv_swap_full_total)" -gt 0 ] && [ "$(stat_of fail_enospc kv_swap_errors_total)" = 0 ] ||
		fail "full disk: full $(stat_of fail_enospc kv_swap_full_total), errors $(stat_of fail_enospc kv_swap_errors_total)" ;;
	read) [ "$(stat_of fail_read kv_swap_errors_total)" -gt 0 ] && [ "$(stat_of fail_read kv_swap_ins_total)" = 0 ] &&
		[ "$(stat_of fail_read kv_swap_slots_used)" = 0 ] ||
		fail "read fault: errors $(stat_of fail_read kv_swap_errors_total), ins $(stat_of fail_read kv_swap_ins_total)" ;;
	esac
	grep -q "KV swap" "$tmp/fail_$f.log" || fail "$f fault: nothing logged"
	echo "ok: $f fault falls back to re-prefill, tokens unchanged"
done

# a swap file left small: the rest re-prefill, counted as full
run tiny $SMALL --kv-swap 40K --kv-swap-path "$tmp" --kv-swap-policy always
same_as_ref tiny
[ "$(stat_of tiny kv_swap_full_total)" -gt 0 ] || fail "a 5-slot swap file never ran full"
echo "ok: a full swap file falls back to re-prefill"

# an existing file as kv_swap_path: refused at start-up, by name
: > "$tmp/taken"
"$mlensd" --model "$tmp/model" --mlock=false --foreground --socket "$tmp/x.sock" --control "$tmp/xc.sock" \
	--stats "" --kv-swap 1M --kv-swap-path "$tmp/taken" >"$tmp/out" 2>&1
[ $? -ne 0 ] && grep -q "kv_swap_path $tmp/taken exists and is not a directory" "$tmp/out" ||
	fail "an existing kv_swap_path file was not refused: $(cat "$tmp/out")"
echo "ok: an existing file as kv_swap_path is refused"
exit 0
