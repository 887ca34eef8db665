#!/usr/bin/env python3
"""Write the fp8-weight golden fixtures of tests/check_golden.c.

One small random Mixtral (fp32) is quantized to fp8 e4m3 in the two layouts
Hugging Face checkpoints use, each saved as such a checkpoint would be:

  q1-fp8-channel   quant_method "compressed-tensors": experts per output
                   channel (weight_scale [rows, 1]), attention per tensor
                   (weight_scale [1], with a static input_scale [1]);
                   lm_head and the router ignored
  q2-fp8-block     quant_method "fp8", weight_block_size [32, 48] (blocks
                   that do not divide the matrices, as 128 x 128 blocks do
                   not always): experts with weight_scale_inv
                   [ceil(rows/32), ceil(cols/48)]; attention, router and
                   lm_head in modules_to_not_convert stay fp32

The reference is transformers' MixtralForCausalLM over the DEQUANTIZED
weights (w = float(q) * scale, one fp32 product an element, computed here in
torch: transformers' own fp8 paths need a GPU), in fp32 on the CPU, through
make_golden.py's reference and fixture writer. Non-quantized tensors are
fp32, so the fp32 tolerances hold (the KV cache is fp32 too).

Usage (from the source root):  python3 tests/golden/make_golden_fp8.py [OUTDIR]
Deterministic: rerunning rewrites byte-identical files. Also writes
files_fp8.mk, the list of these fixtures' files that tests/golden.mk ships.
"""
import json
import math
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden as mg  # noqa: E402

from transformers import MixtralForCausalLM  # noqa: E402

E4M3_MAX = 448.0
BLOCK = (32, 48)
SPEC = dict(name="q-fp8", seed=413, shard=None, bf16=False,
            cfg=dict(vocab_size=320, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                     rope_theta=1e4, tie_word_embeddings=False))
TOL = dict(prefill=mg.TOL_F32, decode=mg.TOL_F32,
           note=("fp8 e4m3 weights with fp32 scales, dequantized exactly (w = float(q) * "
                 "scale in fp32); everything else fp32: rounding-order differences only"))


def quantize(w, kind):
    """fp8 q and fp32 scale of an fp32 matrix: scale = amax / 448 per tensor,
    row or block, q = e4m3(w / scale) (round to nearest even)."""
    if kind == "tensor":
        s = (w.abs().max() / E4M3_MAX).reshape(1)
        return (w / s).to(torch.float8_e4m3fn), s
    if kind == "channel":
        s = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        return (w / s).to(torch.float8_e4m3fn), s
    br, bc = BLOCK
    R, C = w.shape
    s = torch.zeros(math.ceil(R / br), math.ceil(C / bc))
    q = torch.zeros(R, C, dtype=torch.float8_e4m3fn)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s[i, j] = blk.abs().max() / E4M3_MAX
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def dequantize(q, s):
    """float(q) * scale, the scale broadcast over its tensor, row or block."""
    R, C = q.shape
    if s.dim() == 2 and s.shape[1] > 1 or s.shape[0] not in (1, R):
        s = s.repeat_interleave(BLOCK[0], 0)[:R].repeat_interleave(BLOCK[1], 1)[:, :C]
    return q.float() * s


def is_expert(name):
    return ".experts." in name


def is_attn(name):
    return ".self_attn." in name and name.endswith("_proj.weight")


VARIANTS = [
    dict(name="q1-fp8-channel", scale_suffix="_scale",
         kinds=lambda n: "channel" if is_expert(n) else "tensor" if is_attn(n) else None,
         input_scale=is_attn,
         qc=dict(quant_method="compressed-tensors", format="float-quantized",
                 quantization_status="compressed",
                 config_groups=dict(
                     group_0=dict(targets=["re:.*block_sparse_moe[.]experts.*"],
                                  weights=dict(num_bits=8, type="float", strategy="channel",
                                               symmetric=True, dynamic=False),
                                  input_activations=dict(num_bits=8, type="float",
                                                         strategy="token", symmetric=True,
                                                         dynamic=True)),
                     group_1=dict(targets=["re:.*self_attn.*"],
                                  weights=dict(num_bits=8, type="float", strategy="tensor",
                                               symmetric=True, dynamic=False),
                                  input_activations=dict(num_bits=8, type="float",
                                                         strategy="tensor", symmetric=True,
                                                         dynamic=False))),
                 ignore=["lm_head", "re:.*block_sparse_moe[.]gate$"])),
    dict(name="q2-fp8-block", scale_suffix="_scale_inv",
         kinds=lambda n: "block" if is_expert(n) else None,
         input_scale=lambda n: False,
         qc=dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3",
                 weight_block_size=list(BLOCK),
                 modules_to_not_convert=["lm_head", "block_sparse_moe.gate", "self_attn"])),
]


def write_variant(out, v, model, prompts):
    d = os.path.join(out, v["name"])
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d)
    sd = load_file(os.path.join(d, "model.safetensors"))
    deq = dict(sd)
    for name in sorted(sd):
        kind = v["kinds"](name)
        if kind is None:
            continue
        q, s = quantize(sd[name], kind)
        sd[name] = q
        sd[name + v["scale_suffix"]] = s.contiguous()
        if v["input_scale"](name):
            sd[name[:-len(".weight")] + ".input_scale"] = torch.tensor([0.05])
        deq[name] = dequantize(q, s)
    # the reference: transformers loading the dequantized weights under the
    # file's own names (its conversion to its fused layout applies)
    tmp = d + ".dequantized"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(d, tmp)
    save_file(deq, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    ref = mg.load(tmp, torch.float32)
    shutil.rmtree(tmp)
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = v["qc"]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    print("%s (fp8 %s)" % (d, v["qc"]["quant_method"]))
    note = ("transformers %s, torch %s: MixtralForCausalLM over this folder's weights "
            "DEQUANTIZED in torch (float(q) * scale, fp32), dtype=float32, eager attention, "
            "CPU, one prompt at a time, greedy with use_cache"
            % (mg.transformers.__version__, torch.__version__))
    mg.write_fixture(d, SPEC, prompts, "float32", TOL, model=ref, reference_note=note)
    return [os.path.join(v["name"], f) for f in sorted(os.listdir(d))]


def main():
    out = mg.begin()
    cfg = mg.make_config(SPEC["cfg"])
    torch.manual_seed(SPEC["seed"])
    model = MixtralForCausalLM(cfg).eval()
    mg.init_weights(model, SPEC["seed"])
    g = torch.Generator().manual_seed(SPEC["seed"] + 1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
               for n in mg.PROMPT_LENS]
    files = []
    for v in VARIANTS:
        files += write_variant(out, v, model, prompts)
    mg.write_files_list(os.path.join(out, "files_fp8.mk"), "GOLDEN_FP8_FIXTURES",
                        "tests/golden/make_golden_fp8.py: every fp8 fixture file", files)


if __name__ == "__main__":
    main()
