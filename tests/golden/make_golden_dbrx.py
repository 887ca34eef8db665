#!/usr/bin/env python3
"""Write the DBRX golden fixtures of mlens' numerics tests (tests/check_golden.c).

The same fixture format as make_golden.py (golden.json, logits_prefill_pN.f32,
logits_gen_pN.f32; see README.md), for small random DbrxForCausalLM models
saved with save_pretrained in fp32: LayerNorm without bias, the fused Wqkv,
experts fused over E in w1, v1 and w2 (w2 stored [E*ffn][d_model], read
transposed), and one model whose clip_qkv is small enough that q, k and v
are clamped (golden.json's clip_fraction says how often).

Usage (from the source root):  python3 tests/golden/make_golden_dbrx.py [OUTDIR]
OUTDIR defaults to the directory of this script. Deterministic: fixed seeds,
float32, eager attention, CPU, one thread. Also writes files_dbrx.mk, the
list of these fixtures' files that tests/golden.mk ships.
"""
import os
import shutil
import sys

import torch
import transformers
from transformers import DbrxConfig, DbrxForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden as mg  # noqa: E402  (its reference run, file writers, rules)

# A seed is taken when the router's k-th and (k+1)-th logits are never
# closer than this over every position the reference runs see.
MIN_ROUTER_GAP = 1e-3

MODELS = [
    # clip_qkv 8 as DBRX's own (transformers' DBRX cannot run without one):
    # nothing reaches it here; d2's clamps a good share of q, k and v.
    dict(name="d1-dbrx-gqa2", seed=1103, must_clip=False,
         cfg=dict(vocab_size=256, d_model=64, n_heads=4, n_layers=2,
                  attn_config=dict(kv_n_heads=2, clip_qkv=8.0),
                  ffn_config=dict(ffn_hidden_size=96, moe_num_experts=8, moe_top_k=4),
                  rope_theta=5e5)),
    dict(name="d2-dbrx-clip", seed=1203, must_clip=True,
         cfg=dict(vocab_size=256, d_model=64, n_heads=2, n_layers=2,
                  attn_config=dict(kv_n_heads=1, clip_qkv=1.5),
                  ffn_config=dict(ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2),
                  rope_theta=1e4)),
]


def make_config(c):
    c = dict(c)
    theta = c.pop("rope_theta")
    attn = dict(c.pop("attn_config"), rope_theta=theta)
    ffn = dict(c.pop("ffn_config"), moe_normalize_expert_weights=1.0)
    return DbrxConfig(max_seq_len=256, attn_config=attn, ffn_config=ffn,
                      rope_parameters=dict(rope_type="default", rope_theta=theta),
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, **c)


def init_weights(model, seed):
    """make_golden.init_weights' rule for DBRX's names: std gain/sqrt(fan_in)
    (1.5 for Wqkv, 2 for the router, 3 for lm_head; w2 is used as
    [ffn][d_model], so its fan-in is ffn_hidden_size), embeddings std 1,
    norm weights uniform in [0.8, 1.2]."""
    g = torch.Generator().manual_seed(seed)
    ffn = model.config.ffn_config.ffn_hidden_size
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda t: t[0]):
            if name.endswith(("norm_1.weight", "norm_2.weight", "norm_f.weight")):
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=g))
                continue
            fan_in = p.shape[-1]
            if name.endswith("wte.weight"):
                std = 1.0
            elif name == "lm_head.weight":
                std = 3.0 / fan_in ** 0.5
            elif "router" in name:
                std = 2.0 / fan_in ** 0.5
            elif "Wqkv" in name:
                std = 1.5 / fan_in ** 0.5
            elif name.endswith("mlp.w2"):
                std = 1.0 / ffn ** 0.5
            else:
                std = 1.0 / fan_in ** 0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)


class Watch:
    """The router's smallest k-th to (k+1)-th logit gap, and how many q, k, v
    values clip_qkv clamps, over everything the model sees."""

    def __init__(self, model):
        cfg = model.config
        self.k = cfg.ffn_config.moe_top_k
        self.clip = cfg.attn_config.clip_qkv
        self.min_gap = float("inf")
        self.clipped = 0
        self.values = 0
        self.handles = []
        for b in model.transformer.blocks:
            self.handles.append(b.ffn.router.layer.register_forward_hook(self.router))
            self.handles.append(b.norm_attn_norm.attn.Wqkv.register_forward_hook(self.qkv))

    def router(self, mod, inp, out):
        x = inp[0].reshape(-1, inp[0].shape[-1]).float()
        top = torch.topk(x @ mod.weight.float().T, self.k + 1, dim=-1).values
        self.min_gap = min(self.min_gap, float((top[:, self.k - 1] - top[:, self.k]).min()))

    def qkv(self, mod, inp, out):
        self.values += out.numel()
        if self.clip is not None:
            self.clipped += int((out.abs() > self.clip).sum())

    def close(self):
        for h in self.handles:
            h.remove()


def load(d):
    return DbrxForCausalLM.from_pretrained(d, dtype=torch.float32,
                                           attn_implementation="eager").eval()


def build(spec):
    """The model and prompts of the first seed from spec's whose router
    gaps stay above MIN_ROUTER_GAP."""
    for seed in range(spec["seed"], spec["seed"] + 50):
        torch.manual_seed(seed)
        model = DbrxForCausalLM(make_config(spec["cfg"])).eval()
        init_weights(model, seed)
        g = torch.Generator().manual_seed(seed + 1)
        prompts = [torch.randint(0, spec["cfg"]["vocab_size"], (n,), generator=g).tolist()
                   for n in mg.PROMPT_LENS]
        w = Watch(model)
        mg.reference(model, prompts)
        w.close()
        if w.min_gap >= MIN_ROUTER_GAP:
            return model, prompts, seed
        print("  %s seed %d: router gap %.3g, next seed" % (spec["name"], seed, w.min_gap))
    sys.exit("%s: no seed with router gaps above %g" % (spec["name"], MIN_ROUTER_GAP))


def write_fixture(d, spec, seed, prompts):
    model = load(d)
    watch = Watch(model)
    ref = mg.reference(model, prompts)
    watch.close()
    js = dict(
        name=os.path.basename(d), dtype="float32", vocab_size=spec["cfg"]["vocab_size"],
        n_gen=mg.N_GEN, n_gen_logits=mg.N_GEN_LOGITS,
        tolerance=dict(prefill=mg.TOL_F32, decode=mg.TOL_F32),
        tolerance_note="fp32 weights and activations: rounding-order differences only",
        reference=("transformers %s, torch %s: DbrxForCausalLM.from_pretrained(this dir, "
                   "dtype=float32, attn_implementation='eager'), CPU, one prompt at a time, "
                   "greedy with use_cache" % (transformers.__version__, torch.__version__)),
        seed=seed, prompts=[])
    for n, (p, r) in enumerate(zip(prompts, ref)):
        mg.write_f32(os.path.join(d, "logits_prefill_p%d.f32" % n), r["prefill"])
        mg.write_f32(os.path.join(d, "logits_gen_p%d.f32" % n), r["gen"])
        js["prompts"].append(dict(
            tokens=p, greedy=r["greedy"], margin=r["margin"], max_abs=r["max_abs"],
            prefill_logits="logits_prefill_p%d.f32" % n,
            gen_logits="logits_gen_p%d.f32" % n))
        print("  %s prompt %d (len %2d): greedy steps safe at tol %.0e: %d/%d, min margin %.3g"
              % (js["name"], n, len(p), mg.TOL_F32, mg.first_unsafe(r, mg.TOL_F32), mg.N_GEN,
                 min(r["margin"])))
    js["router_min_gap"] = watch.min_gap
    js["clip_fraction"] = watch.clipped / watch.values
    print("  %s: router min top-k gap %.3g, q/k/v values clamped %.1f%%"
          % (js["name"], watch.min_gap, 100.0 * js["clip_fraction"]))
    if spec["must_clip"] and watch.clipped == 0:
        sys.exit("%s: clip_qkv clamps nothing; make it smaller" % js["name"])
    mg.write_golden_json(d, js)


def main():
    out = mg.begin()
    files = []
    for spec in MODELS:
        model, prompts, seed = build(spec)
        d = os.path.join(out, spec["name"])
        shutil.rmtree(d, ignore_errors=True)
        model.save_pretrained(d)
        print("%s (float32, seed %d)" % (d, seed))
        write_fixture(d, spec, seed, prompts)
        files += [os.path.join(spec["name"], f) for f in sorted(os.listdir(d))]
    # The build ships exactly these files (tests/golden.mk includes the list).
    mg.write_files_list(os.path.join(out, "files_dbrx.mk"), "GOLDEN_FIXTURES_DBRX",
                        "tests/golden/make_golden_dbrx.py: every DBRX fixture file", files)


if __name__ == "__main__":
    main()
