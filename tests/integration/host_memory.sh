#!/bin/sh
# Description: host_memory, the host budget: start-up prints its split
# among weight pages, the KV pool and staging and sizes the KV pool from
# it (up to kv_cache); with weights_on_disk = never a budget below the
# weight pages alone is refused before the model is read; one that even
# every expert left on disk (weights_on_disk = auto, weights_disk.sh)
# does not fit, and one below weights + staging + the least KV pool, are
# refused with the budget to ask for, all by name.
set -u
. "${MLENS_SRCDIR:-.}/tests/integration/lib.sh"

"$B/daemon/mlens-mkmodel" -o "$tmp/model" --preset tiny --dtype fp32 --seed 5 >/dev/null || fail "mkmodel"

# refuse HM TEXT [FLAG]: mlensd --host-memory HM (and FLAG) exits non-zero saying TEXT
refuse() {
	"$mlensd" --model "$tmp/model" --mlock=false --foreground --backend cpu --socket "$tmp/x.sock" \
		--control "$tmp/xc.sock" --stats "" --host-memory "$1" ${3:-} >"$tmp/out" 2>&1
	rc=$?
	[ $rc -ne 0 ] && grep -q "$2" "$tmp/out" || fail "host_memory $1: rc $rc, $(cat "$tmp/out")"
	[ ! -e "$tmp/x.sock" ] || fail "host_memory $1: refused only after start-up"
}
refuse 512K "host_memory of 0.5 MiB is below the weight pages alone (1.1 MiB, the model files)" --weights-on-disk=never
refuse 512K "host_memory of 0.5 MiB cannot run this model even with every expert on disk: weight pages 0.4 MiB + disk staging 0.8 MiB + staging 17.0 MiB"
refuse 10M "host_memory of 10.0 MiB cannot run this model: weight pages 1.1 MiB + staging 17.0 MiB + the least KV pool 2.0 MiB"
echo "ok: budgets that cannot run are refused by name"

# 30 MiB: the KV pool takes what weights and staging leave
start_mlensd --model "$tmp/model" --mlock=false --backend cpu --host-memory 30M
grep -q "host memory budget 30.0 MiB: weight pages 1.1 MiB (4%), KV pool 11.9 MiB (40%), staging 17.0 MiB (57%)" "$tmp/log" ||
	fail "no split line: $(grep 'host memory' "$tmp/log")"
ctl status | grep -q "^host memory  *30.0 MiB budget; staging 17.0 MiB" || fail "status: $(ctl status | grep 'host memory')"
kvb=$(ctl --json status | jfield bytes | head -1)
[ "$kvb" -gt 12000000 ] && [ "$kvb" -le $((30 * 1048576 - 17 * 1048576)) ] || fail "KV pool of $kvb bytes under a 30 MiB budget"
kill "$pid" && wait "$pid"
pid=
echo "ok: a 30 MiB budget gives the KV pool $kvb bytes"

# kv_cache caps the pool under a larger budget
rm -f "$tmp/log"
start_mlensd --model "$tmp/model" --mlock=false --backend cpu --host-memory 64M --kv-cache 4M
grep -q "KV pool 4.0 MiB (6%).*the rest unused (kv_cache caps the KV pool)" "$tmp/log" ||
	fail "kv_cache did not cap the pool: $(grep 'host memory' "$tmp/log")"
echo "ok: kv_cache caps the KV pool under a larger budget"
exit 0
