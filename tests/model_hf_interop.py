#!/usr/bin/env python3
# Description: the mlens loader and Hugging Face transformers agree on the
# model format, both ways. Models written by mlens-mkmodel (per-expert and
# fused layouts, tied embeddings) load in transformers with no missing or
# unexpected keys; a model saved by transformers' save_pretrained (sharded,
# bf16, head_dim != hidden/heads) opens in mlens; mlens-mkmodel's DBRX
# (dbrx-tiny) loads in transformers' DbrxForCausalLM. Weight checksums seen
# by each side must match. Skips (77) where torch/transformers are absent.
import json
import os
import subprocess
import sys
import tempfile

try:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
except Exception as e:  # any import failure means "not available here"
    print(f"SKIP: torch/transformers not importable: {e}")
    sys.exit(77)

build = os.environ.get("MLENS_BUILDDIR", ".")
mkmodel = os.path.join(build, "daemon", "mlens-mkmodel")
info = os.path.join(build, "tests", "model_info")
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def experts(layer):
    """(w1, w2, w3) per expert, whatever layout this transformers uses."""
    moe = getattr(layer, "mlp", None) or layer.block_sparse_moe
    ex = moe.experts
    if hasattr(ex, "gate_up_proj"):
        inter = ex.down_proj.shape[-1]
        return [(ex.gate_up_proj[j][:inter], ex.down_proj[j], ex.gate_up_proj[j][inter:])
                for j in range(ex.gate_up_proj.shape[0])]
    return [(e.w1.weight, e.w2.weight, e.w3.weight) for e in ex]


def hf_sums(m):
    """Checksums of the weights model_info is asked for, in float64."""
    def s(t):
        t = t.detach().to(torch.float64)
        return [t.sum().item(), (t * t).sum().item()]
    L = m.model.layers
    out = {
        "model.embed_tokens.weight": s(m.model.embed_tokens.weight),
        "model.norm.weight": s(m.model.norm.weight),
        "model.layers.1.self_attn.q_proj.weight": s(L[1].self_attn.q_proj.weight),
        "model.layers.0.self_attn.k_proj.weight": s(L[0].self_attn.k_proj.weight),
        "model.layers.1.post_attention_layernorm.weight": s(L[1].post_attention_layernorm.weight),
    }
    for l in (0, 1):
        for j, (w1, w2, w3) in enumerate(experts(L[l])):
            if j in (0, 2):
                out[f"{l}.{j}.w1"] = s(w1)
                out[f"{l}.{j}.w2"] = s(w2)
                out[f"{l}.{j}.w3"] = s(w3)
    return out


def mlens_info(d, names):
    r = subprocess.run([info, d] + names, capture_output=True, text=True)
    if r.returncode:
        return None, r.stderr.strip()
    return json.loads(r.stdout), ""


def compare(tag, d, m):
    want = hf_sums(m)
    got, err = mlens_info(d, list(want))
    check(got is not None, f"{tag}: mlens opens it {err}")
    if got is None:
        return
    cfg = m.config
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_local_experts", "num_experts_per_tok", "max_position_embeddings"):
        check(got[k] == getattr(cfg, k), f"{tag}: {k} {got[k]} == {getattr(cfg, k)}")
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    check(got["rope_theta"] == theta, f"{tag}: rope_theta {got['rope_theta']} == {theta}")
    check(got["tie_word_embeddings"] == bool(cfg.tie_word_embeddings), f"{tag}: tie_word_embeddings")
    for k, (s, s2) in want.items():
        gs, gs2 = got["sums"][k]
        ok = abs(gs - s) <= 1e-9 * max(1.0, abs(s2)) and abs(gs2 - s2) <= 1e-9 * abs(s2)
        check(ok, f"{tag}: {k} sums mlens {gs:.9g}/{gs2:.9g} hf {s:.9g}/{s2:.9g}")


with tempfile.TemporaryDirectory(prefix="mlens-interop-") as tmp:
    cases = [
        ("mkmodel fp32 per-expert", ["--dtype", "fp32", "--seed", "5"]),
        ("mkmodel bf16 fused tied 2 shards", ["--dtype", "bf16", "--seed", "6", "--fused-experts",
                                              "--tie", "--shards", "2", "--head-dim", "8"]),
    ]
    for i, (tag, args) in enumerate(cases):
        d = os.path.join(tmp, f"mk{i}")
        subprocess.run([mkmodel, "-o", d] + args, check=True, stdout=subprocess.DEVNULL)
        m, li = MixtralForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
        check(not li["missing_keys"] and not li["unexpected_keys"] and not li["mismatched_keys"],
              f"{tag}: transformers loads it cleanly {li}")
        logits = m(torch.tensor([[1, 2, 3, 4]])).logits
        check(bool(torch.isfinite(logits).all()), f"{tag}: transformers logits are finite")
        m = MixtralForCausalLM.from_pretrained(d, dtype=torch.float64)
        compare(tag, d, m)

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=300, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                        num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=512,
                        tie_word_embeddings=False)
    m = MixtralForCausalLM(cfg).to(torch.bfloat16)
    d = os.path.join(tmp, "hf")
    m.save_pretrained(d, max_shard_size="100KB")
    got, _ = mlens_info(d, [])
    check(got is not None and got["n_files"] > 1 and got["dtype"] == "BF16",
          f"transformers save_pretrained: sharded bf16 ({got and got['n_files']} files)")
    compare("transformers save_pretrained", d, m)

    # DBRX: mlens-mkmodel's dbrx-tiny in transformers (DBRX's own layout,
    # experts fused over E, w2 [E*ffn][d_model]); the per-expert views
    # mlens binds sum as transformers' split of the fused tensors
    from transformers import DbrxForCausalLM
    d = os.path.join(tmp, "dbrx")
    subprocess.run([mkmodel, "-o", d, "--preset", "dbrx-tiny", "--dtype", "fp32", "--seed", "8"],
                   check=True, stdout=subprocess.DEVNULL)
    m, li = DbrxForCausalLM.from_pretrained(d, dtype=torch.float64, output_loading_info=True)
    check(not li["missing_keys"] and not li["unexpected_keys"] and not li["mismatched_keys"],
          f"dbrx-tiny: transformers loads it cleanly {li}")
    cfg = m.config
    check(cfg.rope_parameters["rope_theta"] == 5e5, f"dbrx-tiny: transformers reads rope_theta "
          f"{cfg.rope_parameters['rope_theta']}")
    check(bool(torch.isfinite(m(torch.tensor([[1, 2, 3, 4]])).logits).all()),
          "dbrx-tiny: transformers logits are finite")
    ffn = cfg.ffn_config.ffn_hidden_size
    E = cfg.ffn_config.moe_num_experts
    B = m.transformer.blocks
    want = {"transformer.wte.weight": m.transformer.wte.weight,
            "transformer.blocks.1.norm_attn_norm.attn.Wqkv.weight": B[1].norm_attn_norm.attn.Wqkv.weight}
    for l in (0, 1):
        mlp = B[l].ffn.experts.mlp
        for j in (0, E - 1):
            for name, t in (("w1", mlp.w1), ("w2", mlp.w2), ("w3", mlp.v1)):
                want[f"{l}.{j}.{name}"] = t.view(E, ffn, -1)[j]
    got, err = mlens_info(d, list(want))
    check(got is not None, f"dbrx-tiny: mlens opens it {err}")
    if got is not None:
        check(got["rope_theta"] == 5e5 and got["head_dim"] == cfg.d_model // cfg.n_heads,
              f"dbrx-tiny: rope_theta {got['rope_theta']}, head_dim {got['head_dim']}")
        for k, t in want.items():
            t = t.detach().to(torch.float64)
            s, s2 = t.sum().item(), (t * t).sum().item()
            gs, gs2 = got["sums"][k]
            ok = abs(gs - s) <= 1e-9 * max(1.0, abs(s2)) and abs(gs2 - s2) <= 1e-9 * abs(s2)
            check(ok, f"dbrx-tiny: {k} sums mlens {gs:.9g}/{gs2:.9g} hf {s:.9g}/{s2:.9g}")

if failures:
    print(f"FAIL: {len(failures)} checks")
    sys.exit(1)
print("PASS: mlens and transformers agree")
