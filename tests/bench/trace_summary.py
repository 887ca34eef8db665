#!/usr/bin/env python3
"""Summarise a hybrid step trace (mlensctl trace FILE): step times, each
track's span count and busy time, the medians of the CPU attention (C) and
the GPU's GA and GB per token group, and the GPU commands that ran over a
threshold (a GA or GB of a 4096-token group takes 2-7 ms on the H200, so
one much longer waited for something). Usage: trace_summary.py FILE [MS]"""
import collections
import json
import sys


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    long_ms = float(sys.argv[2]) if len(sys.argv) == 3 else 20.0
    try:
        with open(sys.argv[1]) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit("trace_summary: %s: %s" % (sys.argv[1], e))
    names = {e["tid"]: e["args"]["name"] for e in d["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    ev = [e for e in d["traceEvents"] if e.get("ph") == "X"]
    busy, n = collections.Counter(), collections.Counter()
    dur = collections.defaultdict(list)
    for e in ev:
        t = names.get(e["tid"], "?")
        busy[t] += e["dur"] / 1e3
        n[t] += 1
        dur[(t, e["name"].split()[0])].append(e["dur"] / 1e3)
    print("  steps (ms):", " ".join("%.0f (%d tokens)" % (e["dur"] / 1e3, e["args"]["tokens"])
                                    for e in ev if names.get(e["tid"]) == "step"))
    for k in sorted(busy):
        print("  %-13s %5d spans %9.1f ms" % (k, n[k], busy[k]))

    def med(v):
        return sorted(v)[len(v) // 2] if v else float("nan")
    print("  median ms: C %.2f  GA %.2f  GB %.2f" % (med(dur[("cpu-attn", "C")]),
          med(dur[("gpu", "GA")]), med(dur[("gpu", "GB")])))
    slow = [e for e in ev if names.get(e["tid"]) == "gpu" and e["dur"] > long_ms * 1e3]
    print("  GPU commands over %g ms: %d, %.1f ms in all%s%s" % (
        long_ms, len(slow), sum(e["dur"] for e in slow) / 1e3, ": " if slow else "",
        ", ".join("%s %.0f" % (e["name"], e["dur"] / 1e3) for e in slow[:12])))


if __name__ == "__main__":
    main()
