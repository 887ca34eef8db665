#!/bin/sh
# Description: mlensd's sockets against careless and hostile local users,
# with a real daemon (CPU backend, the tiny model): a missing socket
# directory and a file in the way are refused before the model loads, the
# file left untouched; a second daemon on the same sockets is refused and
# the first stays reachable; mlensctl pointed at the stats or the tenant
# socket says so; tenant names with escape sequences or bytes that are not
# UTF-8 are refused at hello, and a UTF-8 name shows everywhere; the stats
# socket refuses another uid whatever its mode; connections that never say
# hello are bounded (per uid and in all) and an unallowed uid is closed at
# once, while a real tenant is served; running out of descriptors neither
# spins nor floods the log; and a forked daemon keeps no terminal
# descriptor (mlensd ... 2>&1 | cat returns).
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3"; exit 77; }
command -v curl >/dev/null || { echo "SKIP: needs curl"; exit 77; }
dpid=
cleanup() {
	for p in $dpid $pid; do
		kill "$p" 2>/dev/null && wait "$p" 2>/dev/null
	done
	rm -rf "$tmp"
}
"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny >/dev/null || fail "mlens-mkmodel"
# a daemon in the foreground on the scratch sockets (later flags win),
# for starts that must be refused: one that is not ends after 20 s
daemon() {
	timeout 20 "$mlensd" --model "$tmp/m" --backend cpu --threads 1 --mlock=false --kv-cache 1M --stats-http "" \
		--foreground --socket "$tmp/t.sock" --control "$tmp/c.sock" --stats "$tmp/s.sock" "$@"
}
root=
[ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && root=1
nobody="setpriv --reuid=65534 --regid=65534 --clear-groups"
# the daemon's open descriptors
nfds() { ls "/proc/$1/fd" | wc -l; }

# ==== a missing directory: refused before loading, naming it ====
daemon --socket "$tmp/nodir/t.sock" --log "$tmp/log0" >"$tmp/out" 2>&1; rc=$?
[ $rc -eq 1 ] || fail "missing socket directory: exit $rc, not 1: $(cat "$tmp/out")"
grep -qF "mlensd: tenant socket $tmp/nodir/t.sock: cannot create it: No such file or directory (the directory $tmp/nodir does not exist" "$tmp/out" ||
	fail "missing socket directory message: $(cat "$tmp/out")"
! grep -q "weight pages" "$tmp/log0" || fail "the model loaded before the socket was checked"
for s in c s; do [ ! -e "$tmp/$s.sock" ] || fail "$s.sock left behind after a refused start"; done

# ==== a port in use for /metrics: refused before loading too ====
python3 -c 'import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True); time.sleep(30)' >"$tmp/port" &
ppid_=$!
wait_for '[ -s "$tmp/port" ]' || fail "no port"
daemon --stats-http "127.0.0.1:$(cat "$tmp/port")" --log "$tmp/log0" >"$tmp/out" 2>&1; rc=$?
kill "$ppid_"
[ $rc -eq 1 ] && grep -qF "stats_http 127.0.0.1:$(cat "$tmp/port"): cannot listen there (Address already in use); the port is taken" "$tmp/out" ||
	fail "a port in use: exit $rc: $(cat "$tmp/out")"
! grep -q "weight pages" "$tmp/log0" || fail "the model loaded before the port was checked"
for s in t c s; do [ ! -e "$tmp/$s.sock" ] || fail "$s.sock left behind (port in use)"; done

# ==== a file in the way is refused and left as it was ====
for key in socket control stats; do
	echo precious >"$tmp/file"
	daemon "--$key" "$tmp/file" --log "$tmp/log0" >"$tmp/out" 2>&1; rc=$?
	[ $rc -eq 1 ] || fail "regular file at --$key: exit $rc: $(cat "$tmp/out")"
	grep -qF "socket $tmp/file: a regular file is there, not a socket; mlensd replaces only a stale socket file" "$tmp/out" ||
		fail "regular file at --$key: $(cat "$tmp/out")"
	[ -f "$tmp/file" ] && [ "$(cat "$tmp/file")" = precious ] || fail "the regular file at --$key was replaced"
	for s in t c s; do [ ! -e "$tmp/$s.sock" ] || fail "$s.sock left behind (--$key refused)"; done
done
mkdir "$tmp/dir"
daemon --control "$tmp/dir" --log "$tmp/log0" >"$tmp/out" 2>&1
[ $? -eq 1 ] && grep -qF "control socket $tmp/dir: a directory is there" "$tmp/out" || fail "directory: $(cat "$tmp/out")"
[ -d "$tmp/dir" ] || fail "the directory at --control went"
# a stale socket file (nobody listens) is replaced
python3 -c 'import socket, sys; socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).bind(sys.argv[1])' "$tmp/t.sock"

# ==== the first daemon ====
start_mlensd --model "$tmp/m" --backend cpu --threads 1 --mlock=false --kv-cache 1M --stats-http ""
grep -q "tenant socket $tmp/t.sock: replaced the stale socket file" "$tmp/log" || fail "stale socket not replaced"

# ==== a second daemon is refused; the first stays reachable ====
for key in socket control stats; do
	daemon --socket "$tmp/t2.sock" --control "$tmp/c2.sock" --stats "$tmp/s2.sock" \
		"--$key" "$tmp/$(echo $key | cut -c1).sock" --log "$tmp/log2" >"$tmp/out" 2>&1; rc=$?
	[ $rc -eq 1 ] || fail "second daemon on --$key: exit $rc: $(cat "$tmp/out")"
	grep -q "$tmp/$(echo $key | cut -c1).sock: mlensd pid $pid is already serving or starting on it" "$tmp/out" ||
		fail "second daemon on --$key: $(cat "$tmp/out")"
	for s in t2 c2 s2; do [ ! -e "$tmp/$s.sock" ] && [ ! -e "$tmp/$s.sock.lock" ] || fail "second daemon left $s.sock"; done
done
for s in t c s; do [ -S "$tmp/$s.sock" ] || fail "the second daemon removed the first's $s.sock"; done
ctl status >/dev/null || fail "the first daemon is not reachable after the second was refused"
"$tenant" "$tmp/t.sock" first 1 3 >"$tmp/gen" && grep -q '^req 0 status 0 finish 1 tokens 3$' "$tmp/gen" ||
	fail "the first daemon does not serve after the second was refused: $(cat "$tmp/gen")"

# ==== mlensctl at the wrong socket says which it reached ====
"$ctlbin" -s "$tmp/s.sock" status >/dev/null 2>"$tmp/err"; rc=$?
[ $rc -eq 3 ] && grep -qF "mlensctl: $tmp/s.sock is mlensd's stats socket (it sends the counters and closes); mlensctl needs the control socket" "$tmp/err" ||
	fail "mlensctl at the stats socket: exit $rc: $(cat "$tmp/err")"
"$ctlbin" -s "$tmp/t.sock" status >/dev/null 2>"$tmp/err"; rc=$?
[ $rc -eq 3 ] && grep -qF "mlensctl: $tmp/t.sock is not mlensd's control socket but a socket of another kind (mlensd's tenant socket, perhaps)" "$tmp/err" ||
	fail "mlensctl at the tenant socket: exit $rc: $(cat "$tmp/err")"

# ==== tenant names ====
esc=$(printf 'x\033[2J\033]0;pwned\007\nroot logged in')
"$tenant" "$tmp/t.sock" "$esc" 1 3 >"$tmp/out" 2>&1 && fail "a name with escape sequences attached"
grep -q "refused: client name refused: the name holds a control character (U+001B at byte 1)" "$tmp/out" ||
	fail "escape-sequence name: $(cat "$tmp/out")"
"$tenant" "$tmp/t.sock" "$(printf 'ab\377cd')" 1 3 >"$tmp/out" 2>&1 && fail "a name that is not UTF-8 attached"
grep -q "refused: client name refused: the name is not valid UTF-8 (byte 2 is 0xff)" "$tmp/out" ||
	fail "non-UTF-8 name: $(cat "$tmp/out")"
! grep -q "$(printf '\033')" "$tmp/log" || fail "an escape byte reached the log"
! grep -q "^root logged in" "$tmp/log" || fail "a name forged a log line"
"$tenant" --stall --hold 20 "$tmp/t.sock" "café ✓" 1 4000 >"$tmp/u.out" &
upid=$!
wait_for 'grep -q "^tenant " "$tmp/u.out" 2>/dev/null' || fail "the UTF-8 name was refused: $(cat "$tmp/u.out")"
uid_=$(sed -n 's/^tenant //p' "$tmp/u.out")
ctl tenants | grep -q "^ *$uid_ .* café ✓ " || fail "mlensctl tenants: $(ctl tenants)"
ctl --json tenants | grep -q '"name": "café ✓"' || fail "mlensctl --json tenants: $(ctl --json tenants)"
"$raw" "unix:$tmp/s.sock" 3000 </dev/null >"$tmp/sj"
python3 -c 'import json, sys
t = [x for x in json.load(open(sys.argv[1]))["tenant"] if x["id"] == int(sys.argv[2])]
assert t and t[0]["name"] == "caf\u00e9 \u2713", t' "$tmp/sj" "$uid_" || fail "stats socket: $(cat "$tmp/sj")"
ctl evict "$uid_" >/dev/null
wait "$upid"

# ==== the stats socket checks credentials, whatever its mode ====
if [ -n "$root" ]; then
	chmod 755 "$tmp"
	chmod 666 "$tmp/s.sock"
	$nobody "$raw" "unix:$tmp/s.sock" 3000 </dev/null >"$tmp/sj"
	grep -q '^{"ok":false,"error":"permission denied: only the daemon' "$tmp/sj" ||
		fail "stats socket to uid 65534: $(head -c 300 "$tmp/sj")"
	! grep -q '"tenant"' "$tmp/sj" || fail "the stats socket gave uid 65534 the tenants"
	"$raw" "unix:$tmp/s.sock" 3000 </dev/null | grep -q '"tenants":0' || fail "stats socket to root"
else
	echo "SKIP part: the stats socket and another uid (needs root and setpriv)"
fi

# ==== connections that never say hello ====
# hold N connections to the tenant socket for S seconds without a hello;
# print how many the daemon answered (refused) within that time
hold() {
	python3 - "$tmp/t.sock" "$1" "$2" <<'PY'
import select, socket, sys, time
path, n, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
socks, answered = [], 0
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(path)
    except OSError:
        s.close()
        answered += 1
        continue
    socks.append(s)
end = time.time() + secs
while time.time() < end and socks:
    r, _, _ = select.select(socks, [], [], max(0, end - time.time()))
    for s in r:
        socks.remove(s)
        s.close()
        answered += 1
print(answered)
PY
}
base=$(nfds "$pid")
# one uid holds at most 32 of them; the rest are told to try again at once
hold 60 2 >"$tmp/n" &
hpid=$!
sleep 1.5
[ "$(nfds "$pid")" -le $((base + 34)) ] || fail "silent connections hold $(($(nfds "$pid") - base)) descriptors"
wait "$hpid"
[ "$(cat "$tmp/n")" = 28 ] || fail "$(cat "$tmp/n") of 60 silent connections answered in 2 s, expected 28"
# a python that uid 65534 may run
nbpy=
for p in "$(command -v python3)" /usr/bin/python3; do
	[ -n "$root" ] && [ -z "$nbpy" ] && $nobody "$p" -c '' 2>/dev/null && nbpy=$p
done
if [ -n "$nbpy" ]; then
	# a uid the rules do not allow holds nothing: each is closed at once,
	# and a real tenant is served meanwhile
	log0=$(wc -c <"$tmp/log")
	ver=$(sed -n 's/^#define MLENS_PROTO_VERSION \([0-9]*\)u.*/\1/p' "$MLENS_SRCDIR/shm/proto.h")
	$nobody "$nbpy" - "$tmp/t.sock" 800 4 "$ver" >"$tmp/n" 2>&1 <<'PY' &
import socket, struct, sys, time
path, n, secs, ver = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
held, refused = [], 0
end = time.time() + secs
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    held.append(s)
# the last one says hello only after the daemon has answered and closed:
# the answer is still there to read
time.sleep(0.3)
try:
    held[-1].send(struct.pack("<IIII48s", 0x4c4c4548, ver, 0, 0, b"late"))
except OSError:
    pass
for s in held:
    s.settimeout(max(0.01, end - time.time()))
    try:
        w = s.recv(512)
        # the welcome: magic, version, status -EACCES, and why
        if struct.unpack("<IIi", w[:12]) == (0x434c4557, ver, -13) and b"is not allowed to attach" in w:
            refused += 1
    except OSError:
        pass
print(refused)
PY
	hpid=$!
	sleep 1
	[ "$(nfds "$pid")" -le $((base + 10)) ] || fail "uid 65534 holds $(($(nfds "$pid") - base)) descriptors"
	"$tenant" "$tmp/t.sock" served 1 3 >"$tmp/gen" && grep -q '^req 0 status 0 finish 1 tokens 3$' "$tmp/gen" ||
		fail "a tenant was not served during the flood: $(cat "$tmp/gen")"
	wait "$hpid"
	[ "$(cat "$tmp/n")" = 800 ] || fail "uid 65534: $(cat "$tmp/n") of 800 connections answered"
	# the refusals are logged at a bounded rate
	[ $(($(wc -c <"$tmp/log") - log0)) -lt 20000 ] || fail "800 refusals wrote $(($(wc -c <"$tmp/log") - log0)) log bytes"
else
	echo "SKIP part: an unallowed uid's connections (needs root, setpriv and a python uid 65534 may run)"
fi
ctl shutdown >/dev/null && wait "$pid"
pid=
for f in t.sock c.sock s.sock t.sock.lock c.sock.lock s.sock.lock; do
	[ ! -e "$tmp/$f" ] || fail "$f left behind after shutdown"
done

# ==== out of descriptors: accepting pauses, the log stays small ====
mv "$tmp/log" "$tmp/log.1"
(ulimit -n $((base + 7)) && exec "$mlensd" --model "$tmp/m" --backend cpu --threads 1 --mlock=false --kv-cache 1M \
	--stats-http 127.0.0.1:0 --foreground --socket "$tmp/t.sock" --control "$tmp/c.sock" --stats "$tmp/s.sock" \
	--log "$tmp/log") &
pid=$!
wait_for '[ -S "$tmp/c.sock" ] && ctl status >/dev/null 2>&1' 300 || fail "the daemon with few descriptors did not come up"
port=$(stats_port)
# CPU ticks the daemon used (a loop that retries accept at once burns them)
ticks() { awk '{ print $14 + $15 }' "/proc/$pid/stat"; }
t0=$(ticks)
hold 60 2 >/dev/null
python3 -c 'import socket, sys, time
h = [socket.create_connection(("127.0.0.1", int(sys.argv[1]))) for _ in range(60)]
time.sleep(2)' "$port" || fail "connections to the HTTP listener"
used=$(($(ticks) - t0))
[ "$used" -lt 50 ] || fail "out of descriptors: the daemon used $used CPU ticks in 4 s"
emfile=$(grep -c "accept: Too many open files" "$tmp/log")
[ "$emfile" -ge 2 ] && [ "$emfile" -le 12 ] || fail "out of descriptors: $emfile log lines"
grep -q "stats_http: accept: Too many open files" "$tmp/log" || fail "the HTTP listener did not run out"
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ] || fail "/health after running out"
[ "$(wc -c <"$tmp/log")" -lt 50000 ] || fail "out of descriptors: the log grew to $(wc -c <"$tmp/log") bytes"
wait_for '"$tenant" "$tmp/t.sock" after 1 3 >"$tmp/gen" 2>&1' 50 || fail "no tenant served after running out: $(cat "$tmp/gen")"
grep -q '^req 0 status 0 finish 1 tokens 3$' "$tmp/gen" || fail "after running out of descriptors: $(cat "$tmp/gen")"
kill "$pid" && wait "$pid"
pid=

# ==== a forked daemon keeps no terminal descriptor ====
# (the log on stderr goes to syslog once it forks)
rm -f "$tmp/pid"
timeout 20 sh -c '"$0" --model "$1/m" --backend cpu --threads 1 --mlock=false --kv-cache 1M --stats-http "" \
	--socket "$1/t.sock" --control "$1/c.sock" --stats "$1/s.sock" --pid-file "$1/pid" 2>&1 | cat' \
	"$mlensd" "$tmp" >"$tmp/piped"; rc=$?
[ -s "$tmp/pid" ] && dpid=$(cat "$tmp/pid")
[ $rc -eq 0 ] || fail "mlensd 2>&1 | cat did not return (exit $rc)"
[ -n "$dpid" ] && kill -0 "$dpid" || fail "the forked daemon is not running"
[ ! -s "$tmp/piped" ] || fail "the forked daemon wrote to the terminal: $(head -c 300 "$tmp/piped")"
ctl status >/dev/null || fail "the forked daemon does not answer"
# a second daemon hears the pid of the one that serves, not of its parent
daemon --control "$tmp/c2.sock" --stats "$tmp/s2.sock" --log "$tmp/log2" >"$tmp/out" 2>&1
grep -q "tenant socket $tmp/t.sock: mlensd pid $dpid is already serving" "$tmp/out" ||
	fail "second daemon beside a forked one (pid $dpid): $(cat "$tmp/out")"
kill "$dpid"
wait_for '! kill -0 "$dpid" 2>/dev/null' 100 || fail "the forked daemon did not exit"
dpid=
echo "sockets: all passed"
