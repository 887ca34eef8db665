#!/bin/sh
# Description: the Prometheus listener (/metrics, /health) of a real mlensd
# (CPU backend, the tiny model) against a local client that hoards
# connections: of 200 silent ones it holds at most its cap, a new client
# still gets /metrics at once and the control socket still answers, the
# silent ones it holds are closed after the timeout, a huge header is
# refused at once, and methods other than GET and HEAD get 405.
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3"; exit 77; }
"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny >/dev/null || fail "mlens-mkmodel"
start_mlensd --model "$tmp/m" --backend cpu --threads 1 --mlock=false --kv-cache 1M --stats-http 127.0.0.1:0
port=$(stats_port)
[ -n "$port" ] || fail "no stats_http port in status"
nfds() { ls "/proc/$pid/fd" | wc -l; }
base=$(nfds)

python3 - "$port" "$pid" "$base" "$ctlbin" "$tmp/c.sock" <<'PY' || fail "hostile HTTP clients"
import os, select, socket, subprocess, sys, time
port, pid, base, ctl, csock = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
CAP, TIMEOUT = 64, 5
def nfds(): return len(os.listdir("/proc/%s/fd" % pid))
def request(raw, limit=2.0):
    s = socket.create_connection(("127.0.0.1", port), timeout=limit)
    s.sendall(raw)
    data = b""
    try:
        while True:
            d = s.recv(65536)
            if not d: break
            data += d
    except socket.timeout:
        pass
    s.close()
    return data
def closed(s):
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True

t0 = time.time()
silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
for s in silent: s.setblocking(False)
time.sleep(1.0)
held = [s for s in silent if not closed(s)]
assert len(held) <= CAP, "%d of 200 silent connections held, cap %d" % (len(held), CAP)
assert nfds() <= base + CAP + 4, "the daemon holds %d descriptors more than before" % (nfds() - base)
# a scraper still gets in, and the control socket still answers
t = time.time()
r = request(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
assert r.startswith(b"HTTP/1.1 200 ") and b"mlens_" in r, r[:200]
assert time.time() - t < 1.0, "/metrics took %.1f s beside silent connections" % (time.time() - t)
out = subprocess.run([ctl, "-s", csock, "status"], capture_output=True, timeout=5)
assert out.returncode == 0, out
# the held ones are closed by the timeout, not before it (but for the
# oldest, which made room for the scraper)
end, early = t0 + TIMEOUT + 4, 0
while held and time.time() < end:
    r, _, _ = select.select(held, [], [], max(0, end - time.time()))
    for s in r:
        if closed(s):
            early += time.time() - t0 < TIMEOUT - 1.5
            held.remove(s)
assert early <= 1, "%d silent connections closed before the timeout" % early
assert not held, "%d silent connections still open after %d s" % (len(held), TIMEOUT + 4)
for s in silent: s.close()
# a huge header is refused at once, not at the timeout
t = time.time()
r = request(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100000 + b"\r\n\r\n", 4.0)
assert time.time() - t < 1.0 and (r == b"" or r.startswith(b"HTTP/1.1 4")), (time.time() - t, r[:100])
# methods: GET and HEAD only
for m in (b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"BREW"):
    r = request(m + b" /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert r.startswith(b"HTTP/1.1 405 ") and b"\r\nAllow: GET, HEAD\r\n" in r, (m, r[:200])
r = request(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
assert r.startswith(b"HTTP/1.1 200 "), r[:200]
r = request(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
assert r.startswith(b"HTTP/1.1 200 ") and r.endswith(b"\r\n\r\nok\n"), r[:200]
time.sleep(0.3)
assert nfds() <= base + 1, "%d descriptors more than before at the end" % (nfds() - base)
print("metrics_hostile: 200 silent, %d held at most" % CAP)
PY
grep -q "stats_http: 64 connections held: closing the oldest silent one" "$tmp/log" ||
	fail "no log line for the connection cap"
[ "$(grep -c "connections held" "$tmp/log")" -le 10 ] || fail "the connection cap floods the log"
ctl status >/dev/null || fail "no status afterwards"
echo "metrics_hostile: all passed"
