#!/bin/sh
# Description: a real mlensd (CPU backend, tiny model) under random and
# hostile requests on its control socket (random commands, keys and value
# types, truncated lines) and its Prometheus listener (random bytes,
# methods, long paths, bad Content-Length, cut requests), seeded so a
# failure replays: every whole control line gets one JSON reply with
# "ok" (or the connection is closed for a line that is not an object),
# nothing hangs, and afterwards the daemon is up, answers status and
# /health, serves a request and drains cleanly.
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3"; exit 77; }
"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny >/dev/null || fail "mlens-mkmodel"
start_mlensd --model "$tmp/m" --backend cpu --kv-cache 4M --threads 1 --stats-http 127.0.0.1:0
port=$(stats_port)
[ -n "$port" ] || fail "no stats_http port in status"

python3 - "$tmp/c.sock" "$port" "${HOSTILE_SEED:-1}" <<'PY' || fail "random requests (seed ${HOSTILE_SEED:-1})"
import json, random, socket, sys
ctl_path, port, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
# drain and shutdown change the daemon's state for good; profile and trace
# are slow by design (their own tests cover them)
cmds = ["status", "tenants", "quota", "evict", "log-level", "config", "stats", "resume", "bogus", "", "STATUS"]
keys = ["tenant", "set", "level", "cancel", "running", "kv_blocks", "queued", "weight", "cmd", "x"]
def val(d=0):
    r = rng.random()
    if r < 0.15: return rng.choice([0, 1, -1, 2**31, 2**63 - 1, -2**63, 2**64, 3, 999])
    if r < 0.25: return rng.choice([0.5, -0.0, 1e308, -1e308, 1e-300])
    if r < 0.4: return rng.choice(["", "x", "1", "-1", "1e9", "debug", "info", "nan", "inf", "0x10", "3 ", "\u00e9" * 10])
    if r < 0.5: return rng.choice([True, False, None])
    if r < 0.7 and d < 3: return {rng.choice(keys): val(d + 1) for _ in range(rng.randint(0, 4))}
    if r < 0.8 and d < 3: return [val(d + 1) for _ in range(rng.randint(0, 3))]
    return rng.randint(-5, 10)
for i in range(600):
    req = {"cmd": rng.choice(cmds)}
    for _ in range(rng.randint(0, 4)):
        k = rng.choice(keys)
        if k != "cmd" or rng.random() < 0.2:
            req[k] = val()
    if req.get("cmd") in ("drain", "shutdown", "profile", "trace"):
        req["cmd"] = "status"
    line = json.dumps(req)
    whole = rng.random() >= 0.1
    if not whole:
        line = line[:rng.randint(1, len(line))]
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(20)
    s.connect(ctl_path)
    s.sendall((line + "\n").encode())
    s.shutdown(socket.SHUT_WR)
    data = b""
    while True:
        c = s.recv(65536)
        if not c:
            break
        data += c
    s.close()
    if whole:
        assert data.endswith(b"\n") and data.count(b"\n") == 1, (i, line, data[:200])
        r = json.loads(data)
        assert isinstance(r.get("ok"), bool), (i, line, r)
        if not r["ok"]:
            assert isinstance(r.get("error"), str) and r["error"], (i, line, r)
    elif data:
        # a cut line that still parses as an object gets a reply; any other
        # is answered by closing the connection
        json.loads(data)
codes = {}
for i in range(600):
    if rng.random() < 0.3:
        req = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 600)))
    else:
        hdrs = "".join("%s: %s\r\n" % (rng.choice(["Host", "Content-Length", "Transfer-Encoding", "Connection", "X"]),
                                       rng.choice(["1", "-1", "99999999999", "chunked", "close", "x" * 100]))
                       for _ in range(rng.randint(0, 5)))
        req = ("%s %s HTTP/1.%d\r\n%s\r\n" % (
            rng.choice(["GET", "POST", "HEAD", "PUT", "GARBAGE", ""]),
            rng.choice(["/metrics", "/health", "/", "/metrics?x=1", "/../etc/passwd", "/" + "a" * 9000, "/%00"]),
            rng.randint(0, 1), hdrs)).encode()
        if rng.random() < 0.2:
            req = req[:rng.randint(1, len(req))]
    s = socket.socket()
    s.settimeout(20)
    s.connect(("127.0.0.1", port))
    try:
        s.sendall(req)
        s.shutdown(socket.SHUT_WR)
        data = s.recv(200)
    except (ConnectionResetError, BrokenPipeError):
        data = b""
    s.close()
    code = data.split(b" ")[1][:3].decode() if data.startswith(b"HTTP/1.") else "closed"
    codes[code] = codes.get(code, 0) + 1
    assert code in ("200", "400", "404", "405", "413", "501", "closed"), (i, req[:100], data[:100])
print("control: 600 requests; http:", codes)
PY

kill -0 "$pid" 2>/dev/null || fail "mlensd died"
ctl resume >/dev/null 2>&1 || fail "resume after the random requests"
ctl --json status >"$tmp/st" || fail "status after the random requests"
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ] || fail "/health not 200"
"$tenant" "$tmp/t.sock" after 1 5 >"$tmp/gen" && grep -q '^req 0 status 0 finish 1 tokens 5$' "$tmp/gen" ||
	fail "a request after the random requests: $(cat "$tmp/gen")"
kill -TERM "$pid"
wait "$pid"; rc=$?
pid=
[ $rc -eq 0 ] || fail "mlensd exit $rc after SIGTERM"
grep -q "exited cleanly" "$tmp/log" || fail "no clean exit"
echo "hostile ops: all passed"
