#!/bin/sh
# Description: a request that runs into a limit ends with that limit's
# words and numbers at the client (mlens_event_strerror, and mlens
# generate's result line): a prompt + max_tokens larger than the KV pool
# says how many blocks it needs and the pool holds; requests waiting when
# mlensctl quota lowers kv_blocks below what they need fail with the
# quota's numbers instead of waiting for ever, while the running one goes
# on.
set -u
. "$(dirname "$0")/lib.sh"
tc() { timeout 60 "$B/tests/integration/tclient" -s "$tmp/t.sock" -T 50 --why "$@"; }
# columns of mlensctl tenants: id ... running queued kv_blocks
tenant_use() { ctl tenants | awk -v id="$1" '$1 == id { print $5, $6 }'; }

stop_daemon() { kill "$pid" && wait "$pid"; pid=; }
"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny --seed 3 >/dev/null || fail "mlens-mkmodel"

# ==== above the KV pool: the numbers reach the client ====
start_mlensd --model "$tmp/m" --backend cpu --threads 1 --mlock=false --kv-cache 256K
# 64 blocks of 16 tokens; 1000 + 100 tokens need 69
tc -n 1 -p 1000 -g 100 >"$tmp/pool.out"
grep -q "^0 3 -7$" "$tmp/pool.out" || fail "over the pool: not E2BIG: $(cat "$tmp/pool.out")"
grep -q "^0 why prompt + max_tokens need 69 KV blocks; mlensd's KV pool has 64" "$tmp/pool.out" ||
	fail "over the pool, no numbers: $(cat "$tmp/pool.out")"
# mlens generate puts the same words in the result line's error
awk 'BEGIN { printf "{\"prompt\": ["; for (i = 0; i < 1000; i++) printf "%s%d", i ? "," : "", i % 50; print "], \"max_tokens\": 100}" }' \
	>"$tmp/req.jsonl"
"$B/client/mlens" generate -q -s "$tmp/t.sock" -i "$tmp/req.jsonl" -o "$tmp/res.jsonl"
[ $? -eq 1 ] || fail "mlens generate over the pool: not exit 1: $(cat "$tmp/res.jsonl")"
grep -q "\"error\": *\"prompt + max_tokens need 69 KV blocks; mlensd's KV pool has 64" "$tmp/res.jsonl" ||
	fail "mlens generate: no numbers in the error: $(cat "$tmp/res.jsonl")"
echo "ok: a request above the KV pool says: $(sed -n 's/^0 why //p' "$tmp/pool.out")"
stop_daemon

# ==== a KV quota lowered below what waiting requests need ====
: >"$tmp/log"
# 4096 blocks of 16 tokens; one request runs at a time
start_mlensd --model "$tmp/m" --backend cpu --threads 1 --mlock=false --kv-cache 16M --quota-running 1
# prompts of 1000 tokens hold 63 blocks and need 250 by their end (4000
# tokens): the first runs for thousands of steps, the other 4 wait
tc -n 5 -p 1000 -g 3000 >"$tmp/quota.out" &
cpid=$!
wait_for '[ -n "$(ctl tenants | awk '"'"'$1 ~ /^[0-9]+$/ { print $1; exit }'"'"')" ]' ||
	fail "the client did not attach"
id=$(ctl tenants | awk '$1 ~ /^[0-9]+$/ { print $1; exit }')
wait_for '[ "$(tenant_use "$id")" = "1 4" ]' 300 || fail "expected 1 running, 4 queued: $(ctl tenants)"
ctl quota "$id" kv_blocks=10 >/dev/null || fail "mlensctl quota"
# the 4 waiting can never fit 10 blocks: they fail, the running one goes on
wait_for '[ "$(tenant_use "$id")" = "1 0" ]' 300 || fail "the waiting requests still wait: $(ctl tenants)"
ctl evict "$id" >/dev/null || fail "mlensctl evict"
wait "$cpid"
nfail=$(grep -c "^[1-4] 3 -122$" "$tmp/quota.out")
[ "$nfail" = 4 ] || fail "4 requests over the quota, $nfail failed so: $(cut -c1-40 "$tmp/quota.out")"
[ "$(grep -c "^[1-4] why prompt + max_tokens need 250 KV blocks; this tenant's kv_blocks quota is 10 " "$tmp/quota.out")" = 4 ] ||
	fail "over quota without the numbers: $(grep why "$tmp/quota.out")"
grep -q "^0 3 -103" "$tmp/quota.out" || fail "the running request did not end by the eviction: $(cut -c1-40 "$tmp/quota.out")"
wait_for '[ "$(ctl --json status | jfield requests_running)" = 0 ]' || fail "requests left behind: $(ctl tenants)"
echo "ok: a lowered KV quota fails the 4 waiting requests with its numbers"
