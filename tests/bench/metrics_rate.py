#!/usr/bin/env python3
"""A daemon's rates from its Prometheus counters, for the benchmark scripts.

  metrics_rate.py sample URL FILE   poll URL (/metrics) four times a second
                                    until killed; one JSON line a sample
  metrics_rate.py table DIR RUN...  each DIR/defaults_RUN.samples' steady
                                    rate, JSON into DIR/defaults_rates.json
                                    and a table

The steady rate: generated tokens/s over the middle third of the run's
generated tokens, the same rule for every run whatever drove it.
"""
import json
import os
import sys
import time
import urllib.request

KEYS = ("mlens_generation_tokens_total", "mlens_prompt_tokens_total", "mlens_steps_total",
        "mlens_gpu_busy_seconds_total", "mlens_requests_running", "mlens_requests_waiting")


def parse(text):
    v = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" in line:
            continue
        parts = line.split()
        if len(parts) == 2 and parts[0] in KEYS:
            v[parts[0]] = float(parts[1])
    return v


def sample(url, path):
    with open(path, "w") as f:
        while True:
            t = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    v = parse(r.read().decode())
                v["t"] = t
                f.write(json.dumps(v) + "\n")
                f.flush()
            except (OSError, ValueError):
                pass
            time.sleep(max(0.0, 0.25 - (time.monotonic() - t)))


def steady(samples):
    s = [x for x in samples if "mlens_generation_tokens_total" in x]
    if len(s) < 3:
        return None
    total = s[-1]["mlens_generation_tokens_total"]
    lo = next((x for x in s if x["mlens_generation_tokens_total"] >= total / 3), None)
    hi = next((x for x in s if x["mlens_generation_tokens_total"] >= 2 * total / 3), None)
    if not lo or not hi or hi["t"] <= lo["t"]:
        return None
    dt = hi["t"] - lo["t"]
    gen = hi["mlens_generation_tokens_total"] - lo["mlens_generation_tokens_total"]
    pr = hi.get("mlens_prompt_tokens_total", 0) - lo.get("mlens_prompt_tokens_total", 0)
    steps = hi.get("mlens_steps_total", 0) - lo.get("mlens_steps_total", 0)
    busy = hi.get("mlens_gpu_busy_seconds_total", 0) - lo.get("mlens_gpu_busy_seconds_total", 0)
    running = [x.get("mlens_requests_running", 0) for x in s if lo["t"] <= x["t"] <= hi["t"]]
    return {"seconds": dt, "generated_tokens_per_s": gen / dt, "total_tokens_per_s": (gen + pr) / dt,
            "mean_step_tokens": (gen + pr) / steps if steps else None,
            "gpu_busy_ratio": busy / dt, "mean_running": sum(running) / len(running) if running else None,
            "generated_tokens": total}


def table(d, runs):
    rates = {}
    for r in runs:
        p = os.path.join(d, "defaults_%s.samples" % r)
        try:
            rates[r] = steady([json.loads(l) for l in open(p) if l.strip()])
        except (OSError, ValueError):
            rates[r] = None
    if rates.get("bench") and rates.get("generate"):
        rates["generate_over_bench"] = (rates["generate"]["generated_tokens_per_s"] /
                                        rates["bench"]["generated_tokens_per_s"])
    json.dump(rates, open(os.path.join(d, "defaults_rates.json"), "w"), indent=1)
    f = lambda x, fmt="%.1f": "-" if x is None else fmt % x
    print("%-10s %10s %10s %8s %6s %9s %7s" % ("run", "gen t/s", "total t/s", "step n", "GPU%",
                                               "running", "seconds"))
    for r in runs:
        x = rates.get(r) or {}
        print("%-10s %10s %10s %8s %6s %9s %7s" % (
            r, f(x.get("generated_tokens_per_s")), f(x.get("total_tokens_per_s")),
            f(x.get("mean_step_tokens"), "%.0f"),
            f(None if x.get("gpu_busy_ratio") is None else 100 * x["gpu_busy_ratio"], "%.0f"),
            f(x.get("mean_running"), "%.0f"), f(x.get("seconds"))))
    if "generate_over_bench" in rates:
        print("generate / bench (steady generated tokens/s): %.3f" % rates["generate_over_bench"])


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "sample":
        sample(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 3 and sys.argv[1] == "table":
        table(sys.argv[2], sys.argv[3:])
    else:
        sys.stderr.write(__doc__)
        sys.exit(2)
