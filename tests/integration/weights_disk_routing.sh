#!/bin/sh
# Description: the experts kept in RAM follow the routing
# (weights_disk_follow). A model whose routers send every token to its
# last two experts (mlens-mkmodel --router-favor 2) under a host_memory
# budget that leaves two of four experts of each layer on disk: the
# split as loaded keeps experts 0 and 1 in RAM, which no token uses. With
# the default the daemon trades the favored experts into RAM (stats,
# metrics and status count the trades and name the sets), and the tokens
# stay those of a daemon with every expert in RAM. --no-weights-disk-follow keeps
# the split as loaded; with the test hook MLENS_TEST_DISK_FAIL holding
# "trade" every trade fails, is logged and counted, nothing moves and the
# tokens are the same.
set -u
. "${MLENS_SRCDIR:-.}/tests/integration/lib.sh"
tc() { timeout 120 "$B/tests/integration/tclient" "$@"; }

"$B/daemon/mlens-mkmodel" -o "$tmp/model" --preset tiny --layers 8 --dtype fp32 --seed 5 --router-favor 2 \
	>/dev/null || fail "mkmodel"
COMMON="--model $tmp/model --mlock=false --threads 2 --backend cpu --max-step-tokens 256 --expert-residency-period 4"
HALF=${MLENS_WEIGHTS_DISK_HALF:-4500K}
ALL01='[[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1],[0,1]]'
ALL23='[[2,3],[2,3],[2,3],[2,3],[2,3],[2,3],[2,3],[2,3]]'

# run NAME ARGS...: a daemon with ARGS, two rounds of two tenants of three
# requests at once (outputs in $tmp/NAME_R_K.out), then its stats, status
# and metrics; the daemon then stops
run() {
	name=$1; shift
	# shellcheck disable=SC2086 # COMMON is words
	start_mlensd $COMMON --stats-http 127.0.0.1:0 "$@"
	for round in 1 2; do
		cl=
		for k in 1 2; do
			tc -s "$tmp/t.sock" --seed $k -n 3 -p 40 -g 24 > "$tmp/${name}_${round}_$k.out" &
			cl="$cl $!"
		done
		r=0
		for p in $cl; do wait "$p" || r=1; done
		[ $r -eq 0 ] || fail "$name: a tenant failed: $(cat "$tmp/${name}_${round}"_*.out | head -3)"
	done
	ctl stats > "$tmp/$name.stats" || fail "$name: mlensctl stats"
	ctl status > "$tmp/$name.status" || fail "$name: mlensctl status"
	curl -sf "http://127.0.0.1:$(stats_port)/metrics" > "$tmp/$name.metrics" 2>/dev/null || : > "$tmp/$name.metrics"
	cp "$tmp/log" "$tmp/$name.log"
	kill "$pid" && wait "$pid"
	pid=
	rm -f "$tmp/log"
}

# same_tokens NAME: every output of NAME is the all-in-RAM run's
same_tokens() {
	for round in 1 2; do
		for k in 1 2; do
			same "$tmp/ref_${round}_$k.out" "$tmp/$1_${round}_$k.out" ||
				fail "$1: round $round tenant $k's tokens differ from all in RAM"
		done
	done
}

run ref --host-memory 64M
grep -q "weights on disk" "$tmp/ref.log" && fail "64M: experts left on disk"

run follow --host-memory "$HALF"
grep -q "weights on disk: 2 of 4 experts in each of 8 MoE layers" "$tmp/follow.log" ||
	fail "$HALF: not two experts of four on disk: $(grep -i 'disk\|host memory' "$tmp/follow.log")"
grep -q "weights on disk: the experts kept in RAM follow the routing" "$tmp/follow.log" ||
	fail "no follow line: $(grep 'weights on disk' "$tmp/follow.log")"
same_tokens follow
trades=$(stat_of follow weights_disk_trades_total)
[ "${trades:-0}" -ge 16 ] || fail "trades_total '$trades': two experts of each of 8 layers should have moved"
[ "$(stat_of follow weights_disk_trade_errors_total)" = 0 ] || fail "trade errors without a fault"
[ "$(stat_of follow weights_disk_experts_ram)" = "$ALL23" ] ||
	fail "RAM set $(stat_of follow weights_disk_experts_ram), not the favored experts 2 and 3"
[ "$(stat_of follow weights_disk_experts_disk)" = "$ALL01" ] ||
	fail "disk set $(stat_of follow weights_disk_experts_disk)"
grep -q "^mlens_weights_disk_trades_total $trades$" "$tmp/follow.metrics" ||
	fail "metrics: $(grep trade "$tmp/follow.metrics")"
grep -q '^mlens_weights_disk_experts{tier="ram"} 2$' "$tmp/follow.metrics" || fail "metrics: no RAM experts"
grep -q "^disk trades  *2 experts of each layer in RAM, 2 on disk; $trades trades, 0 trade errors$" \
	"$tmp/follow.status" || fail "status: $(grep -i trade "$tmp/follow.status")"
echo "ok: $trades trades moved the favored experts into RAM, the same tokens as all in RAM"

run static --host-memory "$HALF" --no-weights-disk-follow
same_tokens static
[ "$(stat_of static weights_disk_trades_total)" = 0 ] || fail "trades with --no-weights-disk-follow"
[ "$(stat_of static weights_disk_experts_ram)" = "$ALL01" ] ||
	fail "static RAM set $(stat_of static weights_disk_experts_ram)"
grep -q "stay as loaded (weights_disk_follow = false)" "$tmp/static.log" || fail "no static line"
echo "ok: --no-weights-disk-follow keeps experts 0 and 1 in RAM"

echo trade > "$tmp/fail"
MLENS_TEST_DISK_FAIL="$tmp/fail"
export MLENS_TEST_DISK_FAIL
run faulty --host-memory "$HALF"
unset MLENS_TEST_DISK_FAIL
same_tokens faulty
[ "$(stat_of faulty weights_disk_trades_total)" = 0 ] || fail "a trade went through the fault"
[ "$(stat_of faulty weights_disk_trade_errors_total)" -ge 1 ] || fail "no trade error counted"
[ "$(stat_of faulty weights_disk_read_errors_total)" = 0 ] || fail "the steps' reads failed on 'trade'"
[ "$(stat_of faulty weights_disk_experts_ram)" = "$ALL01" ] ||
	fail "a failed trade moved experts: $(stat_of faulty weights_disk_experts_ram)"
grep -q "weights on disk: moving layer [0-9]* expert [23] into RAM in place of expert [01] failed reading model.layers.[0-9]*.block_sparse_moe.experts.[23].w1.weight at offset [0-9]* of $tmp/model/model.safetensors: Input/output error; both stay where they were" \
	"$tmp/faulty.log" || fail "no trade error logged: $(grep -i 'trade\|moving' "$tmp/faulty.log" | head -3)"
echo "ok: failed trades leave the split as loaded, counted and logged; the same tokens"
