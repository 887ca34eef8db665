#!/usr/bin/env python3
"""Summarise a hybrid step trace (mlensctl trace FILE): step times, each
track's span count and busy time, the medians of the CPU attention (C) and
the GPU's GA and GB per token group, the GPU commands that ran over a
threshold (a GA or GB of a 4096-token group takes a few ms, so one much
longer waited for something), and per layer: token groups, the
GPU's time from the layer's first GA to its last GB, and how long the
weight stream then stood idle (waiting for a slot: the GPU side is the
slower one; none: the stream is), and where the GPU stood idle: before a
layer's first GB (the layer's weights, or its C), before another GB (its
C), before a GA, and between steps; the chain of a token group (GA's end
to C, C, C's end to GB, against the GPU's time from GA's end to GB); and
the time between steps (the worker's, to the first GPU command, after
the last); and the CPU attention's rate per C (the KV bytes its span
names over its time), for the C spans the weight stream ran beside and
those it did not. Usage: trace_summary.py FILE [MS]"""
import collections
import json
import re
import sys

PIECE = re.compile(r"^(COPY|PREFETCH) l\d+ p\d+$")
C_SPAN = re.compile(r"^C l\d+ g\d+ kv(\d+)$")	# a C span with the KV bytes it read


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
        dur[(t, (e["name"].split() or ["?"])[0])].append(e["dur"] / 1e3)
    print("  steps (ms):", " ".join("%.0f (%d tokens, %.2f us a token)" % (
        e["dur"] / 1e3, e["args"]["tokens"], e["dur"] / max(e["args"]["tokens"], 1))
        for e in ev if names.get(e["tid"]) == "step"))
    for k in sorted(busy):
        print("  %-13s %5d spans %9.1f ms" % (k, n[k], busy[k]))

    print("  median ms: C %.2f  GA %.2f  GB %.2f" % (med(dur[("cpu-attn", "C")]),
          med(dur[("gpu", "GA")]), med(dur[("gpu", "GB")])))
    # a slow C stops the GPU (with two sets at once, with three after the
    # one group the GPU has in hand): the spread says how often
    print("  spread ms (p25 p50 p75 p90): C %s  GB %s" % (
        spread(dur[("cpu-attn", "C")]), spread(dur[("gpu", "GB")])))
    slow = [e for e in ev if names.get(e["tid"]) == "gpu" and e["dur"] > long_ms * 1e3]
    print("  GPU commands over %g ms: %d, %.1f ms in all%s%s" % (
        long_ms, len(slow), sum(e["dur"] for e in slow) / 1e3, ": " if slow else "",
        ", ".join("%s %.0f" % (e["name"], e["dur"] / 1e3) for e in slow[:12])))
    layers(ev, names)
    gpu_gaps(ev, names)
    chain(ev, names)
    between_steps(ev, names)
    c_rates(ev, names)


def med(v):
    return sorted(v)[len(v) // 2] if v else float("nan")


def spread(v):
    if not v:
        return "-"
    v = sorted(v)
    return " ".join("%.2f" % v[min(int(len(v) * q), len(v) - 1)] for q in (0.25, 0.5, 0.75, 0.9))


def chain(ev, names):
    """Per token group, the chain GA -> C -> GB: from GA's end to C's
    start (the copies down and the host's wake-up), C, from C's end to
    GB's start (the upload and the queue before GB), against the GPU's
    time from GA's end to GB's start (what the chain may take before the
    GPU waits for it)."""
    steps = sorted((e for e in ev if names.get(e["tid"]) == "step"), key=lambda e: e["ts"])

    def step_of(t):
        for i, s in enumerate(steps):
            if s["ts"] <= t <= s["ts"] + s["dur"]:
                return i
        return -1
    span = {}
    for e in ev:
        t = names.get(e["tid"])
        w = e["name"].split()
        if (t, w[:1]) in (("gpu", ["GA"]), ("gpu", ["GB"]), ("cpu-attn", ["C"])) and len(w) >= 3:
            span[(w[0], step_of(e["ts"]), w[1], w[2])] = e
    down, c, up, room = [], [], [], []
    for (k, s, l, g), ce in span.items():
        if k != "C":
            continue
        ga, gb = span.get(("GA", s, l, g)), span.get(("GB", s, l, g))
        if not ga or not gb:
            continue
        down.append((ce["ts"] - ga["ts"] - ga["dur"]) / 1e3)
        c.append(ce["dur"] / 1e3)
        up.append((gb["ts"] - ce["ts"] - ce["dur"]) / 1e3)
        room.append((gb["ts"] - ga["ts"] - ga["dur"]) / 1e3)
    if c:
        print("  chain a group, median ms (%d groups): GA end -> C %.2f, C %.2f, C end -> GB %.2f; "
              "GA end -> GB %.2f" % (len(c), med(down), med(c), med(up), med(room)))


def weight_pieces(ev, names):
    """The weight stream's pieces ("COPY l3 p7", "PREFETCH l0 p2") in time
    order, not a copy carried from an untraced step (daemon/ops/trace.h:
    MLENS_STEP_TIMER_CARRIED)."""
    return sorted((e for e in ev if names.get(e["tid"]) == "h2d" and PIECE.match(e["name"])),
                  key=lambda e: e["ts"])


def c_rates(ev, names):
    """The CPU attention's KV rate per C span ("C l3 g5 kv354123456": the
    bytes its group's decode rows read in that layer), and how it moves
    with the weight stream: spans the stream's pieces covered for at
    least 90% of their time against those covered for at most 10% (the
    copy and the attention share the host's memory bandwidth)."""
    merged = []
    for a, b in ((e["ts"], e["ts"] + e["dur"]) for e in weight_pieces(ev, names)):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])

    def covered(t0, t1):
        return sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in merged if a < t1 and b > t0)
    rate, beside, alone = [], [], []
    for e in ev:
        if names.get(e["tid"]) != "cpu-attn" or e["dur"] <= 0:
            continue
        m = C_SPAN.match(e["name"])
        if not m or int(m.group(1)) == 0:
            continue
        gbs = int(m.group(1)) / e["dur"] / 1e3	# bytes / us -> GB/s
        rate.append(gbs)
        f = covered(e["ts"], e["ts"] + e["dur"]) / e["dur"]
        if f >= 0.9:
            beside.append(gbs)
        elif f <= 0.1:
            alone.append(gbs)
    if rate:
        print("  CPU attention a C, median GB/s: %.1f (%d spans); with the weight stream "
              "beside it %.1f (%d), without %.1f (%d)" % (med(rate), len(rate), med(beside),
                                                        len(beside), med(alone), len(alone)))


def between_steps(ev, names):
    """Between the traced steps: the worker's own time (one step's end to
    the next one's start), the step's start to its first GPU command
    (HEAD: the batch laid out, the program built), and its last GPU
    command's end to the step's end (the sampled tokens back)."""
    steps = sorted((e for e in ev if names.get(e["tid"]) == "step"), key=lambda e: e["ts"])
    gpu = sorted((e for e in ev if names.get(e["tid"]) == "gpu"), key=lambda e: e["ts"])
    head, tail, gap = [], [], []
    for i, s in enumerate(steps):
        inside = [e for e in gpu if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]
        if inside:
            head.append((inside[0]["ts"] - s["ts"]) / 1e3)
            tail.append((s["ts"] + s["dur"] - inside[-1]["ts"] - inside[-1]["dur"]) / 1e3)
        if i + 1 < len(steps):
            gap.append((steps[i + 1]["ts"] - s["ts"] - s["dur"]) / 1e3)
    if head:
        print("  between steps, median ms: worker %.2f, step start -> first GPU command %.2f, "
              "last GPU command -> step end %.2f" % (med(gap), med(head), med(tail)))


def gpu_gaps(ev, names):
    """The GPU's idle time between its traced commands, by what came next."""
    gpu = sorted((e for e in ev if names.get(e["tid"]) == "gpu"), key=lambda e: e["ts"])
    steps = sum(1 for e in gpu if e["name"].startswith("HEAD"))
    gap = collections.Counter()
    for a, b in zip(gpu, gpu[1:]):
        w = b["name"].split()
        if w[0] == "HEAD":
            what = "before HEAD (between steps)"
        elif w[0] == "GB":
            what = "before a layer's first GB" if w[2:3] == ["g0"] else "before another GB"
        else:
            what = "before " + w[0]
        gap[what] += max(0.0, b["ts"] - a["ts"] - a["dur"]) / 1e3
    if not gpu:
        return
    print("  GPU idle, ms a step (%d steps): %s" % (max(steps, 1), ", ".join(
        "%s %.1f" % (k, v / max(steps, 1)) for k, v in sorted(gap.items()))))


def layers(ev, names):
    """Per (step, layer) the GPU span and groups; per layer copied, the
    stream's idle time before the next layer's first piece."""
    gpu = sorted((e for e in ev if names.get(e["tid"]) == "gpu"), key=lambda e: e["ts"])
    h2d = weight_pieces(ev, names)
    span, groups, rows, step = {}, collections.Counter(), [], -1
    for e in gpu:
        kind, layer = e["name"].split()[:2]
        if kind == "HEAD":
            step += 1
        if kind not in ("GA", "GB") or not layer.startswith("l"):
            continue
        k = (step, int(layer[1:]))
        t0, t1 = span.get(k, (e["ts"], e["ts"]))
        span[k] = (min(t0, e["ts"]), max(t1, e["ts"] + e["dur"]))
        groups[k] += kind == "GA"
        rows += [int(w[1:]) for w in e["name"].split()[3:4] if kind == "GA" and w[:1] == "n"]
    idle = collections.defaultdict(float)
    for a, b in zip(h2d, h2d[1:]):
        if a["name"].split()[1] != b["name"].split()[1]:
            idle[b["name"].split()[1]] += max(0.0, b["ts"] - a["ts"] - a["dur"])
    if not span:
        return
    per = [(v[1] - v[0]) / 1e3 for v in span.values()]
    g = sorted(groups.values())
    print("  per layer: %d-%d groups (median %d), GPU %.1f ms median (%.1f-%.1f)" % (
        g[0], g[-1], g[len(g) // 2], sorted(per)[len(per) // 2], min(per), max(per)))
    if rows:
        rows.sort()
        print("  rows a group: median %d (%d-%d)" % (rows[len(rows) // 2], rows[0], rows[-1]))
    times = collections.Counter(e["name"].split()[1] for e in h2d if e["name"].endswith(" p0"))
    busy = collections.Counter()
    for e in h2d:
        busy[e["name"].split()[1]] += e["dur"] / 1e3
    print("  weight stream, per copy of a layer: %s" % ", ".join(
        "%s %.1f ms busy %.1f idle before" % (l, busy[l] / times[l], idle[l] / 1e3 / times[l])
        for l in sorted(busy, key=lambda x: int(x[1:])) if times[l]))


if __name__ == "__main__":
    main()
