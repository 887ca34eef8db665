#!/usr/bin/env python3
"""Benchmark jobs for mlens-bench client: N requests of P random prompt
tokens inside MODEL's vocabulary (ids from 3: clear of the usual special
tokens), G generated tokens each with EOS ignored, one JSON object a line
on standard output. Seeded: the same arguments give the same jobs.

usage: jobs.py MODEL N P G
"""
import json
import random
import sys

if len(sys.argv) != 5:
    sys.exit(__doc__.strip())
cfg = json.load(open(sys.argv[1] + "/config.json"))
n, p, g = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(1)
v = cfg["vocab_size"]
for i in range(n):
    print(json.dumps({"prompt": [rng.randrange(3, v) for _ in range(p)], "max_tokens": g,
                      "ignore_eos": True}, separators=(",", ":")))
