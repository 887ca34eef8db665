#!/usr/bin/env python3
"""The baseline a user would otherwise reach for: Hugging Face
transformers + accelerate serving the same model directory under the same
GPU memory budget, the weights that do not fit offloaded to CPU memory by
accelerate's device_map. Generates greedily for N prompts of P random
tokens, G new tokens each, in batches of B, and prints one JSON object:
generated and total tokens/s, wall time, the device map's split.

Usage: hf_baseline.py MODEL_DIR --gpu-memory 8GiB [--prompt-len P]
       [--gen-len G] [--requests N] [--batch B] [--seed S]
Not a test: run by hand or by tests/bench/hybrid.sh on the GPU machine.
"""
import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def budget_bytes(text):
    """accelerate's max_memory notation ("8GiB", "8GB", "512MiB", bytes)."""
    units = {"GIB": 1 << 30, "MIB": 1 << 20, "KIB": 1 << 10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    t = text.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            return int(float(t[:-len(u)]) * units[u])
    return int(t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--gpu-memory", default="8GiB")
    ap.add_argument("--cpu-memory", default="200GiB")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()

    cuda = torch.cuda.is_available()
    max_memory = {"cpu": a.cpu_memory}
    if cuda:
        max_memory[0] = a.gpu_memory
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(
        a.model, dtype=torch.bfloat16, device_map="auto", max_memory=max_memory)
    model.eval()
    load_s = time.time() - t0
    placement = {}
    for dev in getattr(model, "hf_device_map", {}).values():
        placement[str(dev)] = placement.get(str(dev), 0) + 1

    g = torch.Generator().manual_seed(a.seed)
    vocab = model.config.vocab_size
    dev = "cuda:0" if cuda else "cpu"
    generated = 0
    t1 = time.time()
    done = 0
    while done < a.requests:
        b = min(a.batch, a.requests - done)
        ids = torch.randint(0, vocab, (b, a.prompt_len), generator=g).to(dev)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=a.gen_len, min_new_tokens=a.gen_len,
                                 do_sample=False, pad_token_id=0)
        generated += (out.shape[1] - a.prompt_len) * b
        done += b
    if cuda:
        torch.cuda.synchronize()
    wall = time.time() - t1
    res = {
        "system": "transformers+accelerate",
        "model": a.model,
        "gpu_memory": a.gpu_memory if cuda else None,
        "device_map_modules": placement,
        "requests": a.requests,
        "batch": a.batch,
        "prompt_len": a.prompt_len,
        "gen_len": a.gen_len,
        "load_seconds": round(load_s, 2),
        "wall_seconds": round(wall, 3),
        "generated_tokens": generated,
        "generated_tokens_per_s": round(generated / wall, 2),
        "total_tokens_per_s": round((generated + a.requests * a.prompt_len) / wall, 2),
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
    }
    if cuda:
        # max_memory places the weights; accelerate's hooks then bring each
        # offloaded module onto the GPU for its forward, past the budget
        res["gpu_budget_bytes"] = budget_bytes(a.gpu_memory)
        res["gpu_peak_over_budget"] = res["gpu_peak_bytes"] > res["gpu_budget_bytes"]
    json.dump(res, sys.stdout)
    print()
    print("transformers+accelerate: %d requests, %d generated tokens in %.2f s: %.1f generated tokens/s"
          % (a.requests, generated, wall, res["generated_tokens_per_s"]), file=sys.stderr)
    if res.get("gpu_peak_over_budget"):
        print("transformers+accelerate: its GPU peak %.2f GB went past the %s budget (offloaded modules "
              "are brought onto the GPU for their forward)" % (res["gpu_peak_bytes"] / 1e9, a.gpu_memory),
              file=sys.stderr)


if __name__ == "__main__":
    main()
