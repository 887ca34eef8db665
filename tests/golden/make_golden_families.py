#!/usr/bin/env python3
"""Write the golden fixtures of the model families other than Mixtral
(Qwen3-MoE, Qwen2-MoE, OLMoE) for tests/check_golden.c, in the format of
make_golden.py (read tests/golden/README.md): small random models saved
with save_pretrained in float32 (one also in bf16, written and checked as
make_golden.py's bf16 Mixtral), and transformers' float32 eager-attention
CPU outputs for them. The weights are drawn as make_golden.py draws them
(std scaled by fan-in, so logits are not flat), the seeds chosen so that
no router's k-th and (k+1)-th logits come close (router_min_gap).

Usage (from the source root):  python3 tests/golden/make_golden_families.py [OUTDIR]
It also writes files_families.mk, the list of these fixtures' files that
tests/golden.mk ships. Deterministic, as make_golden.py.
"""
import os
import shutil
import sys

import torch
import transformers
from transformers import (OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

sys.dont_write_bytecode = True  # nothing written beside the fixtures
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden as mg  # noqa: E402

FAMILIES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM),
}

COMMON = dict(vocab_size=256, hidden_size=64, max_position_embeddings=256, rms_norm_eps=1e-6,
              bos_token_id=None, eos_token_id=None, pad_token_id=None,
              tie_word_embeddings=False)

# Each exercises one family's own steps: per-head q/k norm, a dense layer
# among MoE layers, renormalised or raw top-k weights, biases, a shared
# expert with its sigmoid gate, a q/k norm over the whole projection, the
# clip of q, k, v.
MODELS = [
    dict(name="q3-dense-layer", family="qwen3_moe", seed=1103,
         cfg=dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  intermediate_size=96, mlp_only_layers=[1], decoder_sparse_step=1,
                  norm_topk_prob=False, attention_bias=False, rope_theta=1e6)),
    dict(name="q3-topk-norm-bias", family="qwen3_moe", seed=1209, bf16=True,
         cfg=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                  num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                  intermediate_size=64, mlp_only_layers=[], decoder_sparse_step=1,
                  norm_topk_prob=True, attention_bias=True, rope_theta=1e4)),
    dict(name="q2-shared-expert", family="qwen2_moe", seed=2103,
         cfg=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=64, intermediate_size=96,
                  mlp_only_layers=[], decoder_sparse_step=1, norm_topk_prob=False,
                  rope_theta=1e6)),
    dict(name="olmoe-qk-norm", family="olmoe", seed=3106,
         cfg=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts=16, num_experts_per_tok=4, intermediate_size=32,
                  norm_topk_prob=False, clip_qkv=None, rope_theta=1e4)),
    dict(name="olmoe-clip-bias", family="olmoe", seed=3204,
         cfg=dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                  norm_topk_prob=True, clip_qkv=1.0, attention_bias=True, rope_theta=1e4)),
]

TOL = dict(prefill=mg.TOL_F32, decode=mg.TOL_F32,
           note="fp32 weights and activations: rounding-order differences only")


class RouterWatch:
    """Smallest gap between the k-th and (k+1)-th router logit over every
    token, MoE layers only (a dense layer has no router)."""

    def __init__(self, model, k):
        self.k = k
        self.min_gap = float("inf")
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and not isinstance(gate, torch.nn.Linear) or \
                    isinstance(gate, torch.nn.Linear) and gate.out_features > 1:
                gate.register_forward_hook(self.hook)

    def hook(self, mod, inp, out):
        x = inp[0].reshape(-1, inp[0].shape[-1]).float()
        lg = x @ mod.weight.float().T
        top = torch.topk(lg, self.k + 1, dim=-1).values
        self.min_gap = min(self.min_gap, float((top[:, self.k - 1] - top[:, self.k]).min()))


def write_fixture(d, spec, cls, prompts):
    model = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    watch = RouterWatch(model, spec["cfg"]["num_experts_per_tok"])
    ref = mg.reference(model, prompts)
    js = dict(
        name=os.path.basename(d), dtype="float32", vocab_size=COMMON["vocab_size"],
        n_gen=mg.N_GEN, n_gen_logits=mg.N_GEN_LOGITS,
        tolerance=dict(prefill=TOL["prefill"], decode=TOL["decode"]), tolerance_note=TOL["note"],
        reference=("transformers %s, torch %s: %s.from_pretrained(this dir, dtype=float32, "
                   "attn_implementation='eager'), CPU, one prompt at a time, greedy with "
                   "use_cache" % (transformers.__version__, torch.__version__, cls.__name__)),
        prompts=[])
    for n, (p, r) in enumerate(zip(prompts, ref)):
        mg.write_f32(os.path.join(d, "logits_prefill_p%d.f32" % n), r["prefill"])
        mg.write_f32(os.path.join(d, "logits_gen_p%d.f32" % n), r["gen"])
        js["prompts"].append(dict(
            tokens=p, greedy=r["greedy"], margin=r["margin"], max_abs=r["max_abs"],
            prefill_logits="logits_prefill_p%d.f32" % n, gen_logits="logits_gen_p%d.f32" % n))
        print("  %s prompt %d (len %2d): greedy steps safe at tol %.0e: %d/%d, min margin %.3g"
              % (js["name"], n, len(p), TOL["decode"], mg.first_unsafe(r, TOL["decode"]),
                 mg.N_GEN, min(r["margin"])))
    js["router_min_gap"] = watch.min_gap
    print("  %s: router min top-k gap %.3g" % (js["name"], watch.min_gap))
    mg.write_golden_json(d, js)


def main():
    out = mg.begin()
    files = []
    for spec in MODELS:
        ccls, mcls = FAMILIES[spec["family"]]
        cfg = ccls(**COMMON, **spec["cfg"])
        torch.manual_seed(spec["seed"])
        model = mcls(cfg).eval()
        mg.init_weights(model, spec["seed"])
        g = torch.Generator().manual_seed(spec["seed"] + 1)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
                   for n in mg.PROMPT_LENS]
        d = os.path.join(out, spec["name"])
        shutil.rmtree(d, ignore_errors=True)
        model.save_pretrained(d)
        print("%s (%s)" % (d, mcls.__name__))
        write_fixture(d, spec, mcls, prompts)
        files += [os.path.join(spec["name"], f) for f in sorted(os.listdir(d))]
        if spec.get("bf16"):
            # the same weights rounded to bf16, with the bf16 Mixtral's
            # references (bf16-KV, router data for the fast GEMMs)
            d += "-bf16"
            shutil.rmtree(d, ignore_errors=True)
            model.to(torch.bfloat16).save_pretrained(d)
            print("%s (%s, bfloat16)" % (d, mcls.__name__))
            mg.write_fixture(d, dict(spec, cfg=dict(spec["cfg"], vocab_size=cfg.vocab_size)),
                             prompts, "bfloat16", mg.TOL_BF16, mg.hf_bf16_served, cls=mcls)
            files += [os.path.join(os.path.basename(d), f) for f in sorted(os.listdir(d))]
    # The build ships exactly these files (tests/golden.mk includes the list).
    mg.write_files_list(os.path.join(out, "files_families.mk"), "GOLDEN_FIXTURES_FAMILIES",
                        "tests/golden/make_golden_families.py: every fixture file", files)


if __name__ == "__main__":
    main()
