#!/bin/sh
# Description: mlens-bench serve stopped by SIGTERM mid-run (CPU backend,
# the tiny model of mlens-mkmodel): it says so, writes the JSON of the run
# so far marked "stopped_by", exits 1 and leaves no mlensd behind; a TERM
# while the daemon starts stops it too; one client thread with more
# requests in flight than its rings hold finishes them all.
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }
bench="$B/tests/bench/mlens-bench"
# the daemons mlens-bench starts are its children, not $pid: a failing
# case must not leave one behind
cleanup() {
	pkill -f "mlensd --model $tmp/m" 2>/dev/null
	rm -rf "$tmp"
}

"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny >/dev/null || fail "mlens-mkmodel"
# a run far longer than the test: stopped once requests have finished
# (8 tokens each: a few steps, even in a TSan build on a busy box)
"$bench" serve --model "$tmp/m" --mlensd "$mlensd" --backend cpu --kv-cache 8M \
	--prompt-len 16 --gen-len 8 --requests 1000000 --concurrency 32 --threads 2 --json \
	--daemon-log "$tmp/log" >"$tmp/out.json" 2>"$tmp/err" &
bpid=$!
wait_for 'grep -q "tenant 3 attached" "$tmp/log" 2>/dev/null' 300 || fail "the run did not start: $(cat "$tmp/err")"
sleep 2
kill -TERM $bpid
wait $bpid; rc=$?
[ $rc -eq 1 ] || fail "exit $rc after SIGTERM, not 1: $(cat "$tmp/err")"
grep -q "^serve: stopped by SIGTERM after [0-9.]* s: [0-9]* of 1000000 requests finished" "$tmp/err" ||
	fail "no stop message: $(cat "$tmp/err")"
python3 - "$tmp/out.json" <<'PY' || fail "JSON: $(head -c 400 "$tmp/out.json")"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["stopped_by"] == "SIGTERM", d.get("stopped_by")
assert d["requests_ok"] > 0 and d["generated_tokens"] >= 8 * d["requests_ok"], d
assert d["requests_ok"] + d["requests_failed"] < 1000000, d
assert d["generated_tokens_per_s"] > 0, d
# the steady window (when it has the daemon's counters) in generations of
# 8: its steps at the counters' rate, at least those counted
s = d.get("steady")
if s and s.get("steps") is not None:
    assert s["generations"] >= s["steps"] / 8 - 1e-9, s
    assert s["short"] == (s["generations"] < 1), s
PY
grep -q "drained: exiting" "$tmp/log" || fail "mlensd was not stopped: $(tail -5 "$tmp/log")"
! pgrep -f "mlensd --model $tmp/m" >/dev/null || fail "an mlensd is left running"

# TERM while the daemon loads: a precise message, exit 1, no daemon left
: >"$tmp/log2"
"$bench" serve --model "$tmp/m" --mlensd "$mlensd" --backend cpu --kv-cache 8M --requests 10 \
	--daemon-log "$tmp/log2" >"$tmp/out2" 2>"$tmp/err2" &
bpid=$!
wait_for '[ -s "$tmp/log2" ]' 300 || fail "the daemon did not start logging: $(cat "$tmp/err2")"
kill -TERM $bpid
wait $bpid; rc=$?
[ $rc -eq 1 ] || fail "exit $rc after SIGTERM in start-up, not 1: $(cat "$tmp/err2")"
if ! grep -q "^serve: stopped by SIGTERM while mlensd started" "$tmp/err2"; then
	# the daemon may have come up between the log line and the signal
	grep -q "^serve: stopped by SIGTERM after" "$tmp/err2" || fail "start-up stop: $(cat "$tmp/err2")"
fi
! pgrep -f "mlensd --model $tmp/m" >/dev/null || fail "an mlensd is left running after start-up stop"

# one client thread with 1300 requests in flight in a pool that runs ~128
# at once: more than its tenant's submission ring (1024 entries) and queue
# quota (1024) hold (the old bench: 320 of 1600 refused). It
# submits without waiting and reads events when the rings are full (the
# daemon takes submissions only while the completion ring has room: a
# blocking submit waited forever there), and the daemon queues its share:
# every request finishes
# (1,600 requests: ~40 s under ThreadSanitizer, 2 s without)
timeout 240 "$bench" serve --model "$tmp/m" --mlensd "$mlensd" --backend cpu --kv-cache 1M \
	--prompt-len 16 --gen-len 4 --requests 1600 --concurrency 1300 --threads 1 --json \
	--daemon-log "$tmp/log3" >"$tmp/out3.json" 2>"$tmp/err3"
rc=$?
[ $rc -eq 0 ] || fail "1300 in flight on one thread: exit $rc: $(tail -3 "$tmp/err3")"
python3 - "$tmp/out3.json" <<'PY' || fail "1300 in flight: $(head -c 400 "$tmp/out3.json")"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["requests_ok"] == 1600 and d["requests_failed"] == 0, d
assert d["generated_tokens"] == 1600 * 4, d
PY
echo "all ok"
