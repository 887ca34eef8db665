#!/usr/bin/env python3
"""mlens-gateway's overhead against mlens generate on the same token workload.

One mlensd (CPU backend by default) serves both runs in turn: `mlens
generate` with the requests as JSON lines, then the same requests as
token-id prompts to /v1/completions of mlens-gateway, from C client threads
with one keep-alive HTTP connection each (unstreamed, then streamed).
Every request is greedy, so the runs must produce the same tokens; the
script checks that. The three runs take turns for R rounds and each run's
fastest round counts; the gateway's own CPU time per token is read from
/proc, the clients' (mlens generate, or this script's threads) from
getrusage. Wall time includes mlens generate's start and attach and the
Python client's work. Prints one JSON object, then a table.

usage: gateway_overhead.py [-n REQUESTS] [-p PROMPT] [-g GEN] [-c CONCURRENCY] [-r ROUNDS]
                           [--model DIR] [--backend cpu|cuda] [--build DIR]
"""
import argparse
import http.client
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time


def wait_for(pred, tries=300):
    for _ in range(tries):
        if pred():
            return True
        time.sleep(0.1)
    return False


def pct(v, p):
    v = sorted(v)
    return v[max(0, min(len(v) - 1, int(round(p / 100 * len(v) + 0.5)) - 1))] if v else 0.0


def cpu_s(pid):
    """User + system CPU seconds of process pid so far."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_generate(b, sock, jobs, tmp, conc):
    inp, out = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out.jsonl")
    with open(inp, "w") as f:
        for j in jobs:
            f.write(json.dumps(j) + "\n")
    t0 = time.monotonic()
    subprocess.run([os.path.join(b, "client/mlens"), "generate", "-s", sock, "-i", inp, "-o", out,
                    "-n", str(conc), "-q"], check=True)
    wall = time.monotonic() - t0
    with open(out) as f:
        toks = [json.loads(line)["tokens"] for line in f]
    return wall, toks, []


def run_gateway(port, jobs, conc, stream):
    toks = [None] * len(jobs)
    lat = [0.0] * len(jobs)
    nxt = [0]
    lock = threading.Lock()
    err = []

    def worker():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(jobs):
                break
            body = dict(jobs[i], return_token_ids=True, stream=stream)
            t0 = time.monotonic()
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            lat[i] = time.monotonic() - t0
            if r.status != 200:
                err.append(data.decode())
                break
            if stream:
                ids = []
                for ev in data.decode().split("\n\n"):
                    if ev.startswith("data: {"):
                        for c in json.loads(ev[6:])["choices"]:
                            ids += c.get("token_ids", [])
                toks[i] = ids
            else:
                toks[i] = json.loads(data)["choices"][0]["token_ids"]
        conn.close()

    t0 = time.monotonic()
    th = [threading.Thread(target=worker) for _ in range(conc)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    if err:
        raise SystemExit("gateway_overhead: the gateway refused a request: " + err[0])
    return time.monotonic() - t0, toks, lat


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=64, help="requests (default 64)")
    ap.add_argument("-p", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("-g", type=int, default=64, help="generated tokens (default 64)")
    ap.add_argument("-c", type=int, default=8, help="requests at once (default 8)")
    ap.add_argument("-r", type=int, default=3, help="rounds; each run's fastest counts (default 3)")
    ap.add_argument("--model", help="model directory (default: a tiny one written here)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", default="2", help="mlensd's CPU threads (default 2)")
    ap.add_argument("--build", default=os.environ.get("MLENS_BUILDDIR", "."))
    a = ap.parse_args()
    b = a.build
    tmp = tempfile.mkdtemp(prefix="mlens-gwbench.")
    procs = []
    try:
        model = a.model or os.path.join(tmp, "m")
        if not a.model:
            subprocess.run([os.path.join(b, "daemon/mlens-mkmodel"), "-o", model, "--preset", "tiny"],
                           check=True, stdout=subprocess.DEVNULL)
        vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
        sock = os.path.join(tmp, "t.sock")
        d = subprocess.Popen([os.path.join(b, "daemon/mlensd"), "--model", model, "--foreground",
                              "--socket", sock, "--control", os.path.join(tmp, "c.sock"),
                              "--stats", os.path.join(tmp, "s.sock"), "--stats-http", "",
                              "--backend", a.backend, "--threads", a.threads, "--mlock=false",
                              "--log", os.path.join(tmp, "d.log")])
        procs.append(d)
        if not wait_for(lambda: os.path.exists(sock) and "serving on" in open(os.path.join(tmp, "d.log")).read()):
            raise SystemExit("gateway_overhead: mlensd did not start")
        glog = open(os.path.join(tmp, "gw.log"), "w")
        g = subprocess.Popen([os.path.join(b, "client/mlens-gateway"), "-s", sock, "--listen",
                              "127.0.0.1:0", "--max-pending", str(max(256, a.c))], stderr=glog)
        procs.append(g)
        port = []

        def up():
            for line in open(os.path.join(tmp, "gw.log")):
                if " on http://" in line:
                    port.append(int(line.split(" on http://")[1].split()[0].rsplit(":", 1)[1]))
                    return True
            return False
        if not wait_for(up):
            raise SystemExit("gateway_overhead: mlens-gateway did not start")
        rnd = random.Random(1)
        jobs = [{"prompt": [rnd.randrange(3, vocab) for _ in range(a.p)], "max_tokens": a.g,
                 "temperature": 0} for _ in range(a.n)]
        # a warm-up through each path, not counted
        run_generate(b, sock, jobs[:a.c], tmp, a.c)
        run_gateway(port[0], jobs[:a.c], a.c, False)
        runs = {}
        # rounds interleave the three runs, so that a busy spell of the
        # machine hits them alike; the fastest round of each counts
        for _ in range(a.r):
            for name, fn in (("mlens generate", lambda: run_generate(b, sock, jobs, tmp, a.c)),
                             ("gateway", lambda: run_gateway(port[0], jobs, a.c, False)),
                             ("gateway stream", lambda: run_gateway(port[0], jobs, a.c, True))):
                cpu0 = cpu_s(g.pid)
                ru0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
                wall, toks, lat = fn()
                cpu = cpu_s(g.pid) - cpu0
                ru1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
                client = sum(b.ru_utime + b.ru_stime - a.ru_utime - a.ru_stime for a, b in zip(ru0, ru1))
                if name in runs and runs[name]["wall_s"] <= wall:
                    continue
                runs[name] = {"wall_s": round(wall, 4), "tokens": sum(len(t) for t in toks),
                              "tokens_per_s": round(sum(len(t) for t in toks) / wall, 1),
                              "latency_p50_ms": round(pct(lat, 50) * 1e3, 2) if lat else None,
                              "latency_p99_ms": round(pct(lat, 99) * 1e3, 2) if lat else None,
                              "client_cpu_s": round(client, 3),
                              "gateway_cpu_us_per_token": round(cpu / max(1, sum(len(t) for t in toks)) * 1e6, 2)
                              if name != "mlens generate" else None,
                              "_toks": toks}
        base = runs["mlens generate"]
        for name, r in runs.items():
            r["same_tokens"] = r.pop("_toks") == base.get("_toks", None) if name != "mlens generate" else True
            r["overhead_pct"] = round((r["wall_s"] / base["wall_s"] - 1) * 100, 1)
        base.pop("_toks", None)
        out = {"requests": a.n, "prompt": a.p, "gen": a.g, "concurrency": a.c, "rounds": a.r,
               "backend": a.backend, "model": "tiny" if not a.model else a.model, "runs": runs}
        print(json.dumps(out, indent=1))
        print("\n%-16s %8s %8s %10s %9s %9s %9s %13s %12s %6s" % (
            "run", "wall s", "tokens", "tokens/s", "p50 ms", "p99 ms", "overhead", "gw cpu us/tok",
            "client cpu s", "same"))
        for name, r in runs.items():
            print("%-16s %8.3f %8d %10.1f %9s %9s %8.1f%% %13s %12.3f %6s" % (
                name, r["wall_s"], r["tokens"], r["tokens_per_s"], r["latency_p50_ms"] or "-",
                r["latency_p99_ms"] or "-", r["overhead_pct"], r["gateway_cpu_us_per_token"] or "-",
                r["client_cpu_s"], r["same_tokens"]))
        if not all(r["same_tokens"] for r in runs.values()):
            sys.exit(1)
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


main()
