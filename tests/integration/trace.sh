#!/bin/sh
# Description: step traces in a real mlensd (CPU backend, the tiny model of
# mlens-mkmodel; a CPU-only daemon runs the engine, not the hybrid
# pipeline, so the spans are the engine's per-layer timing marks):
# mlensctl trace --steps 2 waits for two steps of a request and the file it
# names is Chrome trace-event JSON with two step events and layer spans
# inside them; the daemon sends the trace and mlensctl writes the file (a
# relative name from its directory, owned by the invoking user); a
# missing directory, an existing file, bad steps and a second trace are
# refused with the reason; --cancel stops an armed trace and its requester
# hears so; on an idle daemon mlensctl gives up after --timeout, leaves no
# file, and the daemon drops the trace.
# On the GPU machine: MLENS_TRACE_FLAGS="--backend cuda" (GPU-only mode:
# layer spans on the "gpu" row) or with a --gpu-memory below the model's
# need (hybrid mode: the pipeline's rows); the script then prints each
# row's spans and busy time instead of asserting the CPU layer spans.
set -u
flags="${MLENS_TRACE_FLAGS:---backend cpu}"
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }

"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny >/dev/null || fail "mlens-mkmodel"
# shellcheck disable=SC2086 # flags are words
group=
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && getent group nogroup >/dev/null; then
	group=nogroup	# a second uid may trace, through control_group
fi
start_mlensd --model "$tmp/m" $flags --threads 1 --mlock=false --kv-cache 4M --stats-http "" \
	${group:+--control-group "$group"}

# ==== refusals ====
ctl trace --steps 2 "$tmp/no/such/dir/t.json" 2>"$tmp/err"; rc=$?
[ $rc -eq 1 ] || fail "missing directory: exit $rc, not 1"
grep -q "cannot create the trace file $tmp/no/such/dir/t.json: No such file" "$tmp/err" ||
	fail "missing directory message: $(cat "$tmp/err")"
: >"$tmp/exists.json"
ctl trace "$tmp/exists.json" 2>"$tmp/err"; [ $? -eq 1 ] || fail "existing file not refused"
grep -q "name a new file" "$tmp/err" || fail "existing file message: $(cat "$tmp/err")"
ctl trace --steps 0 "$tmp/x.json" 2>"$tmp/err"; [ $? -eq 1 ] || fail "--steps 0 not refused"
grep -q "steps must be a number in \[1, 64\]" "$tmp/err" || fail "--steps 0 message: $(cat "$tmp/err")"
ctl trace --steps 2 >/dev/null 2>&1; [ $? -eq 2 ] || fail "trace without FILE: not exit 2"
ctl trace --cancel 2>"$tmp/err"; [ $? -eq 1 ] || fail "cancel with nothing armed: not refused"
grep -q "none is recording" "$tmp/err" || fail "cancel message: $(cat "$tmp/err")"

# armed traces so far, from the daemon's log
armed() { grep -c "control: tracing the next" "$tmp/log"; }

# ==== an idle daemon: the wait ends, no file, the trace is dropped ====
t0=$(date +%s)
ctl trace --steps 2 --timeout 1 "$tmp/idle.json" 2>"$tmp/err"; rc=$?
[ $rc -eq 1 ] || fail "idle trace: exit $rc, not 1: $(cat "$tmp/err")"
[ $(($(date +%s) - t0)) -le 5 ] || fail "idle trace: --timeout 1 waited $(($(date +%s) - t0)) s"
grep -q "trace: the steps did not run within 1 s: nothing written" "$tmp/err" || fail "idle trace message: $(cat "$tmp/err")"
[ ! -e "$tmp/idle.json" ] || fail "idle trace left a file"
ctl trace --steps 1 --timeout x "$tmp/x.json" 2>/dev/null; [ $? -eq 2 ] || fail "--timeout x: not exit 2"
# the connection closed, the daemon cancelled the trace: a new one may arm
wait_for 'grep -q "trace.*cancelled" "$tmp/log"' 30 || fail "idle trace not cancelled in the daemon"

# ==== two steps of a request, named relative to mlensctl's directory ====
n0=$(armed)
(cd "$tmp" && "$ctlbin" -s "$tmp/c.sock" trace --steps 2 t.json >"$tmp/out" 2>&1; echo $? >"$tmp/rc") &
wait_for '[ "$(armed)" -gt "$n0" ]' || fail "trace not armed: $(cat "$tmp/out")"
[ ! -e "$tmp/t.json" ] || fail "trace file created before the trace is recorded"
ctl trace --steps 1 "$tmp/second.json" 2>"$tmp/err"; [ $? -eq 1 ] || fail "second trace not refused"
grep -q "one is recording already" "$tmp/err" || fail "second trace message: $(cat "$tmp/err")"
"$tenant" "$tmp/t.sock" gen 1 6 >"$tmp/gen" || fail "tenant: $(cat "$tmp/gen")"
wait_for '[ -s "$tmp/rc" ]' || fail "mlensctl trace did not return: $(cat "$tmp/out")"
[ "$(cat "$tmp/rc")" = 0 ] || fail "mlensctl trace: $(cat "$tmp/out")"
grep -q "^trace of 2 steps written to t.json: [0-9]* spans" "$tmp/out" || fail "reply: $(cat "$tmp/out")"
spans=$(sed -n 's/.*: \([0-9]*\) spans.*/\1/p' "$tmp/out")
python3 - "$tmp/t.json" "$spans" "$flags" <<'PY' || fail "trace JSON: $(head -c 600 "$tmp/t.json")"
import json, sys
d = json.load(open(sys.argv[1]))
ev = d["traceEvents"]
names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
xs = [e for e in ev if e["ph"] == "X"]
steps = [e for e in xs if names[e["tid"]] == "step"]
assert len(xs) == int(sys.argv[2]), (len(xs), sys.argv[2])
assert [s["name"] for s in steps] == ["step 1", "step 2"], steps
assert steps[0]["ts"] == 0 and steps[0]["args"]["tokens"] > 1, steps[0]	# the prompt
assert steps[1]["args"] == {"tokens": 1, "seqs": 1}, steps[1]		# a decode step
assert steps[1]["ts"] >= steps[0]["ts"] + steps[0]["dur"]
for e in xs:
    assert e["dur"] >= 0 and e["pid"] == 1
    # every span lies inside a step (1 us of rounding)
    assert any(s["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1 for s in steps), e
if sys.argv[3] == "--backend cpu":
    layers = [e for e in xs if names[e["tid"]] == "cpu"]
    # the tiny model has 2 layers: embed, layer 0, layer 1, lm_head per step
    assert len(layers) == 8, [e["name"] for e in layers]
    for s in steps:
        inner = [e for e in layers if s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1]
        assert [e["name"] for e in inner] == ["embed", "layer 0", "layer 1", "lm_head + sample"], inner
else:
    rows = sorted(set(names[e["tid"]] for e in xs) - {"step"})
    assert rows, "no spans besides the steps"
    for r in rows:
        durs = [e["dur"] for e in xs if names[e["tid"]] == r]
        print("  row %-10s %4d spans, %.3f ms" % (r, len(durs), sum(durs) / 1e3))
assert d["otherData"]["steps"] == 2 and d["otherData"]["dropped_spans"] == 0
print("trace: %d spans, step 1 %.3f ms, step 2 %.3f ms" % (len(xs), steps[0]["dur"] / 1e3, steps[1]["dur"] / 1e3))
PY
grep -q "trace of 2 steps recorded" "$tmp/log" || fail "not logged"
[ "$(stat -c %u "$tmp/t.json")" = "$(id -u)" ] || fail "trace file owner $(stat -c %u "$tmp/t.json")"

# ==== the file is the invoking user's: the daemon writes none ====
printf '{"cmd":"trace","path":"/tmp/x"}\n' | "$raw" "unix:$tmp/c.sock" 500 >"$tmp/r"
grep -q '"ok":false.*the daemon writes no file' "$tmp/r" || fail "a path for the daemon accepted: $(cat "$tmp/r")"
if [ -n "$group" ]; then
	chmod 755 "$tmp"
	mkdir "$tmp/nb" && chown 65534 "$tmp/nb"
	rm -f "$tmp/rc"
	n0=$(armed)
	(setpriv --reuid=65534 --regid="$(getent group nogroup | cut -d: -f3)" --clear-groups \
		"$ctlbin" -s "$tmp/c.sock" trace --steps 1 "$tmp/nb/t.json" >"$tmp/out" 2>&1; echo $? >"$tmp/rc") &
	wait_for '[ "$(armed)" -gt "$n0" ]' || fail "nobody's trace not armed: $(cat "$tmp/out")"
	"$tenant" "$tmp/t.sock" gen 1 3 >"$tmp/gen" || fail "tenant: $(cat "$tmp/gen")"
	wait_for '[ -s "$tmp/rc" ]' || fail "nobody's mlensctl trace did not return"
	[ "$(cat "$tmp/rc")" = 0 ] || fail "nobody's trace: $(cat "$tmp/out")"
	[ "$(stat -c %u "$tmp/nb/t.json")" = 65534 ] || fail "trace file of uid 65534 owned by $(stat -c %u "$tmp/nb/t.json")"
else
	echo "SKIP part: a trace as another uid (needs root, setpriv and group nogroup)"
fi

# ==== cancel: the waiting mlensctl hears it, the file goes ====
rm -f "$tmp/rc"
n0=$(armed)
(ctl trace --steps 3 "$tmp/c.json" >"$tmp/out" 2>&1; echo $? >"$tmp/rc") &
wait_for '[ "$(armed)" -gt "$n0" ]' || fail "second trace not armed: $(cat "$tmp/out")"
ctl trace --cancel >"$tmp/cout" || fail "cancel: $(cat "$tmp/cout")"
wait_for '[ -s "$tmp/rc" ]' || fail "cancelled mlensctl trace did not return"
[ "$(cat "$tmp/rc")" = 1 ] || fail "cancelled trace: exit $(cat "$tmp/rc"): $(cat "$tmp/out")"
grep -q "cancelled" "$tmp/out" || fail "cancelled trace message: $(cat "$tmp/out")"
[ ! -e "$tmp/c.json" ] || fail "cancelled trace left its file"

# ==== a trace armed at shutdown is cancelled, and the daemon exits ====
n0=$(armed)
(ctl trace --timeout 0 "$tmp/s.json" >/dev/null 2>&1) &
wait_for '[ "$(armed)" -gt "$n0" ]' || fail "third trace not armed"
kill "$pid" && wait "$pid"; rc=$?
pid=
[ $rc -eq 0 ] || fail "daemon exit $rc with a trace armed"
[ ! -e "$tmp/s.json" ] || fail "trace at shutdown left its file"
echo "trace: ok"
