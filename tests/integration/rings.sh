#!/bin/sh
# Description: back-pressure and broken rings cost the daemon nothing. A
# tenant that stops reading its completions, with submissions still queued,
# leaves the daemon asleep (its CPU time over a second stays small) while
# another tenant gets the tokens of its lone run; a tenant that writes an
# impossible consumer index into its completion ring is evicted (logged,
# hung up, counted once) and the daemon goes on serving the others.
set -u
. "$(dirname "$0")/lib.sh"
rawc="$B/tests/integration/rawclient"
tc() { timeout 60 "$B/tests/integration/tclient" -s "$tmp/t.sock" "$@"; }
# the daemon's CPU time so far, in clock ticks (user + system, all threads)
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$pid/stat"; }
hz=$(getconf CLK_TCK)

"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny --seed 3 >/dev/null || fail "mlens-mkmodel"
start_mlensd --model "$tmp/m" --backend cpu --threads 1 --mlock=false --kv-cache 16M --log-level debug
tc --seed 5 -n 3 -g 20 >"$tmp/lone.out" || fail "lone run: $(cat "$tmp/lone.out")"

# ==== a tenant that stops reading, submissions queued behind a full ring ====
"$rawc" "$tmp/t.sock" stall >"$tmp/stall.out" &
spid=$!
wait_for 'grep -q "^stall" "$tmp/stall.out"' 700 || fail "stall client: $(cat "$tmp/stall.out")"
grep -q "^stalled: .*, 4 submissions waiting$" "$tmp/stall.out" || fail "stall client: $(cat "$tmp/stall.out")"
sleep 0.3
c0=$(cpu_ticks)
sleep 1
c1=$(cpu_ticks)
used=$((c1 - c0))
# asleep: at most a twentieth of a core (the spin took all of one)
[ $((used * 20)) -le "$hz" ] || fail "daemon used $used of $hz ticks in 1 s beside a stalled tenant"
tc --seed 5 -n 3 -g 20 >"$tmp/beside.out" || fail "tenant beside a stalled one: $(cat "$tmp/beside.out")"
cmp -s "$tmp/lone.out" "$tmp/beside.out" || fail "tokens changed beside a stalled tenant"
kill "$spid"; wait "$spid" 2>/dev/null
echo "ok: a stalled tenant costs $used of $hz ticks a second and stalls only itself"

# ==== a corrupt completion-ring head ====
bad0=$(ctl --json stats | jfield bad_entries_total)
[ -n "$bad0" ] || fail "stats: no bad_entries_total"
timeout 30 "$rawc" "$tmp/t.sock" corrupt-head >"$tmp/head.out" || fail "corrupt-head: $(cat "$tmp/head.out")"
grep -q "completion ring corrupt.*evicted" "$tmp/log" || fail "no eviction logged for the corrupt head"
wait_for 'grep -q "tenant [0-9]* detached" "$tmp/log" && [ "$(ctl --json status | jfield tenants)" = 0 ]' ||
	fail "the corrupt tenant is still attached: $(ctl tenants)"
sleep 0.5
bad1=$(ctl --json stats | jfield bad_entries_total)
[ $((bad1 - bad0)) -eq 1 ] || fail "bad entries counted $((bad1 - bad0)) times for one corrupt index"
tc --seed 5 -n 3 -g 20 >"$tmp/after.out" || fail "tenant after a corrupt head: $(cat "$tmp/after.out")"
cmp -s "$tmp/lone.out" "$tmp/after.out" || fail "tokens changed after a corrupt head"
echo "ok: a corrupt completion head is evicted and counted once"
