#!/usr/bin/env python3
"""Seeds of the loader fuzz target (tests/fuzz/fuzz_load.c): each one a
config.json, a NUL byte, then a model.safetensors, for every family mlens
serves (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, DBRX; per-expert and the
transformers 5 fused layout) and every fp8 layout it reads
(compressed-tensors per tensor and per channel, fp8 with block scales,
fbgemm_fp8), each valid and with the faults a broken checkpoint has
(missing tensors, wrong shapes, missing or mis-shaped scales, bad block
sizes). The fp8 configs alone also go to the parser target's corpus
(tests/fuzz/corpus, as cfg-q-*). Needs only the standard library; the
output is the same on every run.

    python3 tests/fuzz/make_load_corpus.py [SRCDIR]
"""
import json
import os
import struct
import sys

V, H, NH, NKV, HD = 16, 8, 2, 1, 4
Q, KV = NH * HD, NKV * HD
I, E, L = 12, 3, 2
DTSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}


def data_for(name, dtype, n):
    """n elements of dtype, small and deterministic (fp8: no NaN codes)."""
    h = sum(name.encode()) & 0xff
    if dtype == "F32":
        return b"".join(struct.pack("<f", ((h + i) % 13 - 6) / 64.0) for i in range(n))
    if dtype in ("BF16", "F16"):
        fmt = "<e" if dtype == "F16" else None
        out = []
        for i in range(n):
            v = ((h + i) % 13 - 6) / 64.0
            if fmt:
                out.append(struct.pack(fmt, v))
            else:
                out.append(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0])[2:])
        return b"".join(out)
    return bytes((h + 3 * i) % 0x70 for i in range(n))


def safetensors(tensors, truncate=None):
    """tensors: list of (name, dtype, shape[, data]); an explicit data
    overrides the drawn one (and may disagree with the shape)."""
    header, blobs, off = {}, [], 0
    for t in tensors:
        name, dtype, shape = t[:3]
        n = 1
        for d in shape:
            n *= d
        blob = t[3] if len(t) > 3 else data_for(name, dtype, n)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-len(text)) % 8)
    out = struct.pack("<Q", len(text)) + text + b"".join(blobs)
    return out[:truncate] if truncate else out


def hf_common(arch, **extra):
    c = {"architectures": [arch], "vocab_size": V, "hidden_size": H, "num_hidden_layers": L,
         "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": False, "hidden_act": "silu"}
    c.update(extra)
    return c


def attn(p, dt, qk_norm=None, bias=False, o_bias=False):
    t = [(p + "input_layernorm.weight", dt, [H]),
         (p + "self_attn.q_proj.weight", dt, [Q, H]),
         (p + "self_attn.k_proj.weight", dt, [KV, H]),
         (p + "self_attn.v_proj.weight", dt, [KV, H]),
         (p + "self_attn.o_proj.weight", dt, [H, Q]),
         (p + "post_attention_layernorm.weight", dt, [H])]
    if qk_norm == "head":
        t += [(p + "self_attn.q_norm.weight", dt, [HD]), (p + "self_attn.k_norm.weight", dt, [HD])]
    elif qk_norm == "all":
        t += [(p + "self_attn.q_norm.weight", dt, [Q]), (p + "self_attn.k_norm.weight", dt, [KV])]
    if bias:
        t += [(p + "self_attn.q_proj.bias", dt, [Q]), (p + "self_attn.k_proj.bias", dt, [KV]),
              (p + "self_attn.v_proj.bias", dt, [KV])]
    if o_bias:
        t.append((p + "self_attn.o_proj.bias", dt, [H]))
    return t


def experts(p, dt, router, base, names, fused=False):
    if fused:
        return [(p + "mlp.gate.weight", dt, [E, H]),
                (p + "mlp.experts.gate_up_proj", dt, [E, 2 * I, H]),
                (p + "mlp.experts.down_proj", dt, [E, H, I])]
    t = [(p + router, dt, [E, H])]
    for j in range(E):
        t += [(p + "%s.%d.%s.weight" % (base, j, names[0]), dt, [I, H]),
              (p + "%s.%d.%s.weight" % (base, j, names[1]), dt, [H, I]),
              (p + "%s.%d.%s.weight" % (base, j, names[2]), dt, [I, H])]
    return t


def top(dt, embed="model.embed_tokens.weight", norm="model.norm.weight"):
    return [(embed, dt, [V, H]), (norm, dt, [H]), ("lm_head.weight", dt, [V, H])]


QWEN = ("mlp.gate.weight", "mlp.experts", ("gate_proj", "down_proj", "up_proj"))
MIXTRAL = ("block_sparse_moe.gate.weight", "block_sparse_moe.experts", ("w1", "w2", "w3"))


def mixtral(dt="F32", fused=False):
    cfg = hf_common("MixtralForCausalLM", intermediate_size=I, num_local_experts=E,
                    num_experts_per_tok=2, torch_dtype={"F32": "float32", "BF16": "bfloat16"}[dt])
    t = top(dt)
    for i in range(L):
        p = "model.layers.%d." % i
        t += attn(p, dt) + experts(p, dt, *MIXTRAL, fused=fused)
    return cfg, t


def qwen3(fused=False):
    cfg = hf_common("Qwen3MoeForCausalLM", moe_intermediate_size=I, intermediate_size=20,
                    num_experts=E, num_experts_per_tok=2, norm_topk_prob=True,
                    mlp_only_layers=[1], decoder_sparse_step=1, use_sliding_window=False,
                    attention_bias=False, torch_dtype="float32")
    t = top("F32")
    for i in range(L):
        p = "model.layers.%d." % i
        t += attn(p, "F32", qk_norm="head")
        if i == 1:
            t += [(p + "mlp.gate_proj.weight", "F32", [20, H]),
                  (p + "mlp.down_proj.weight", "F32", [H, 20]),
                  (p + "mlp.up_proj.weight", "F32", [20, H])]
        else:
            t += experts(p, "F32", *QWEN, fused=fused)
    return cfg, t


def qwen2(fused=False):
    cfg = hf_common("Qwen2MoeForCausalLM", moe_intermediate_size=I, intermediate_size=20,
                    shared_expert_intermediate_size=10, num_experts=E, num_experts_per_tok=2,
                    norm_topk_prob=False, qkv_bias=True, torch_dtype="float32")
    t = top("F32")
    for i in range(L):
        p = "model.layers.%d." % i
        t += attn(p, "F32", bias=True)
        t += [(p + "mlp.shared_expert.gate_proj.weight", "F32", [10, H]),
              (p + "mlp.shared_expert.down_proj.weight", "F32", [H, 10]),
              (p + "mlp.shared_expert.up_proj.weight", "F32", [10, H]),
              (p + "mlp.shared_expert_gate.weight", "F32", [1, H])]
        t += experts(p, "F32", *QWEN, fused=fused)
    return cfg, t


def olmoe(fused=False):
    cfg = hf_common("OlmoeForCausalLM", intermediate_size=I, num_experts=E, num_experts_per_tok=2,
                    clip_qkv=4.0, attention_bias=True, norm_topk_prob=False, torch_dtype="float32")
    t = top("F32")
    for i in range(L):
        p = "model.layers.%d." % i
        t += attn(p, "F32", qk_norm="all", bias=True, o_bias=True) + experts(p, "F32", *QWEN, fused=fused)
    return cfg, t


def dbrx():
    cfg = {"architectures": ["DbrxForCausalLM"], "vocab_size": V, "d_model": H, "n_layers": L,
           "n_heads": NH, "max_seq_len": 64, "torch_dtype": "float32",
           "attn_config": {"kv_n_heads": NKV, "clip_qkv": 8.0, "rope_theta": 10000.0},
           "ffn_config": {"ffn_hidden_size": I, "moe_num_experts": E, "moe_top_k": 2,
                          "moe_normalize_expert_weights": 1, "ffn_act_fn": {"name": "silu"}}}
    t = top("F32", "transformer.wte.weight", "transformer.norm_f.weight")
    for i in range(L):
        p = "transformer.blocks.%d." % i
        t += [(p + "norm_attn_norm.norm_1.weight", "F32", [H]),
              (p + "norm_attn_norm.attn.Wqkv.weight", "F32", [Q + 2 * KV, H]),
              (p + "norm_attn_norm.attn.out_proj.weight", "F32", [H, Q]),
              (p + "norm_attn_norm.norm_2.weight", "F32", [H]),
              (p + "ffn.router.layer.weight", "F32", [E, H]),
              (p + "ffn.experts.mlp.w1", "F32", [E * I, H]),
              (p + "ffn.experts.mlp.v1", "F32", [E * I, H]),
              (p + "ffn.experts.mlp.w2", "F32", [E * I, H])]
    return cfg, t


# ==== fp8 Mixtral: experts (and, where not ignored, attention) in e4m3 ====

def ceil(a, b):
    return (a + b - 1) // b


def scales(n):
    """n fp32 scales, positive."""
    return b"".join(struct.pack("<f", 0.01 * (1 + k % 5)) for k in range(n))


def scale_shape(layout, rows, cols, block):
    if layout == "tensor":
        return [1]
    if layout == "channel":
        return [rows, 1]
    return [ceil(rows, block[0]), ceil(cols, block[1])]


def fp8_mixtral(method, layout, attn_fp8=False, block=(4, 8)):
    """Mixtral with fp8 experts: method compressed-tensors, fp8 or
    fbgemm_fp8; layout tensor, channel or block."""
    cfg, t = mixtral("BF16")
    suffix = "weight_scale_inv" if method == "fp8" else "weight_scale"
    if method == "compressed-tensors":
        w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
             "strategy": layout}
        if layout == "block":
            w["block_structure"] = list(block)
        ignore = ["lm_head", "re:.*block_sparse_moe.gate$"]
        if not attn_fp8:
            ignore.append("re:.*self_attn.*")
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": w,
                                            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}}},
              "ignore": ignore}
    elif method == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "modules_to_not_convert": ["lm_head", "gate"] + ([] if attn_fp8 else ["self_attn"])}
        if layout == "block":
            qc["weight_block_size"] = list(block)
    else:
        qc = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
              "modules_to_not_convert": ["lm_head", "block_sparse_moe.gate"] +
              ([] if attn_fp8 else ["self_attn"])}
    cfg["quantization_config"] = qc
    out = []
    for name, dt, shape in t:
        fp8 = (".experts." in name or (attn_fp8 and "_proj.weight" in name))
        if not fp8:
            out.append((name, dt, shape))
            continue
        out.append((name, "F8_E4M3", shape))
        ss = scale_shape(layout, shape[0], shape[1], block)
        n = 1
        for d in ss:
            n *= d
        out.append((name[:-len("weight")] + suffix, "F32", ss, scales(n)))
    return cfg, out


# ==== the seeds ====

def drop(t, name):
    n = [x for x in t if x[0] != name]
    assert len(n) == len(t) - 1, name
    return n


def reshape(t, name, shape):
    """t with tensor name in another shape (its data drawn again; a
    scale's positive)."""
    out, hit = [], False
    for x in t:
        if x[0] == name:
            hit = True
            n = 1
            for d in shape:
                n *= d
            x = (name, x[1], shape) + ((scales(n),) if "_scale" in name else ())
        out.append(x)
    assert hit, name
    return out


def seed(cfg, tensors, truncate=None):
    return json.dumps(cfg, indent=1).encode() + b"\0" + safetensors(tensors, truncate)


def seeds():
    s = {}
    for fused in (False, True):
        f = "-fused" if fused else ""
        s["mixtral" + f] = mixtral("F32", fused)
        s["qwen3" + f] = qwen3(fused)
        s["qwen2" + f] = qwen2(fused)
        s["olmoe" + f] = olmoe(fused)
    s["mixtral-bf16"] = mixtral("BF16")
    s["dbrx"] = dbrx()
    out = {k: seed(*v) for k, v in s.items()}

    p0 = "model.layers.0."
    # family faults
    c, t = mixtral()
    out["mixtral-missing-expert"] = seed(c, drop(t, p0 + "block_sparse_moe.experts.2.w3.weight"))
    c, t = qwen3()
    out["qwen3-missing-q-norm"] = seed(c, drop(t, p0 + "self_attn.q_norm.weight"))
    out["qwen3-q-norm-whole"] = seed(c, reshape(t, p0 + "self_attn.q_norm.weight", [Q]))
    out["qwen3-dense-missing"] = seed(c, drop(t, "model.layers.1.mlp.up_proj.weight"))
    out["qwen3-missing-expert"] = seed(c, drop(t, p0 + "mlp.experts.1.down_proj.weight"))
    c, t = qwen3(True)
    out["qwen3-fused-wrong-shape"] = seed(c, reshape(t, p0 + "mlp.experts.gate_up_proj", [E, I, H]))
    c, t = qwen2()
    out["qwen2-shared-gate-shape"] = seed(c, reshape(t, p0 + "mlp.shared_expert_gate.weight", [H, 1]))
    out["qwen2-shared-gate-missing"] = seed(c, drop(t, "model.layers.1.mlp.shared_expert_gate.weight"))
    out["qwen2-bias-missing"] = seed(c, drop(t, p0 + "self_attn.v_proj.bias"))
    c, t = olmoe()
    out["olmoe-k-norm-shape"] = seed(c, reshape(t, p0 + "self_attn.k_norm.weight", [Q]))
    c, t = dbrx()
    b0 = "transformer.blocks.0."
    out["dbrx-wqkv-rows"] = seed(c, reshape(t, b0 + "norm_attn_norm.attn.Wqkv.weight", [3 * Q, H]))
    out["dbrx-w1-shape"] = seed(c, reshape(t, b0 + "ffn.experts.mlp.w1", [E, I * H]))
    out["dbrx-v1-missing"] = seed(c, drop(t, "transformer.blocks.1.ffn.experts.mlp.v1"))
    c["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    out["dbrx-quantized"] = seed(c, t)
    # fp8 experts in a family without fp8 support, with and without a scale
    c, t = qwen3()
    e1 = p0 + "mlp.experts.1.gate_proj.weight"
    out["qwen3-fp8-expert"] = seed(c, [(x[0], "F8_E4M3", x[2]) if x[0] == e1 else x for x in t] +
                                   [(e1 + "_scale", "F32", [I, 1], scales(I))])
    c, t = dbrx()
    out["dbrx-fp8-w1"] = seed(c, [(x[0], "F8_E4M3", x[2]) if x[0] == b0 + "ffn.experts.mlp.w1" else x for x in t])
    c, t = qwen3()
    c["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}
    out["qwen3-quantized"] = seed(c, t)

    # fp8 layouts, valid
    for method, layout in (("compressed-tensors", "tensor"), ("compressed-tensors", "channel"),
                           ("compressed-tensors", "block"), ("fp8", "block"), ("fp8", "channel"),
                           ("fbgemm_fp8", "channel")):
        name = "fp8-%s-%s" % ({"compressed-tensors": "ct", "fp8": "fp8", "fbgemm_fp8": "fbgemm"}[method], layout)
        out[name] = seed(*fp8_mixtral(method, layout))
    out["fp8-ct-channel-attn"] = seed(*fp8_mixtral("compressed-tensors", "channel", attn_fp8=True))
    out["fp8-block-attn"] = seed(*fp8_mixtral("fp8", "block", attn_fp8=True))

    # fp8 faults
    w1 = p0 + "block_sparse_moe.experts.1.w1.weight"
    c, t = fp8_mixtral("compressed-tensors", "channel")
    out["fp8-scale-missing"] = seed(c, drop(t, w1 + "_scale"))
    out["fp8-scale-shape"] = seed(c, reshape(t, w1 + "_scale", [1, I]))
    out["fp8-scale-dtype"] = seed(c, [(x[0], "F8_E4M3", x[2], bytes(I)) if x[0] == w1 + "_scale" else x for x in t])
    out["fp8-scale-negative"] = seed(c, [(x[0], x[1], x[2], struct.pack("<f", -1.0) * I) if x[0] == w1 + "_scale" else x for x in t])
    out["fp8-scale-nan"] = seed(c, [(x[0], x[1], x[2], struct.pack("<f", float("nan")) * I) if x[0] == w1 + "_scale" else x for x in t])
    # the fp8 matrix last in the file, its data cut short
    out["fp8-truncated"] = seed(c, [x for x in t if x[0] != w1] + [x for x in t if x[0] == w1], truncate=-7)
    out["fp8-input-scale"] = seed(c, t + [(w1[:-len("weight")] + "input_scale", "F32", [2])])
    out["fp8-mixed-experts"] = seed(c, [(x[0], "BF16", x[2]) if x[0] == w1 else x for x in t if x[0] != w1 + "_scale"])
    out["fp8-1d"] = seed(c, [(x[0], "F8_E4M3", x[2]) if x[0] == "model.norm.weight" else x for x in t])
    cc = json.loads(json.dumps(c))
    cc["quantization_config"]["ignore"].append("re:.*experts.1.w1")
    out["fp8-ignored-module"] = seed(cc, t)
    cc = json.loads(json.dumps(c))
    cc["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    out["fp8-ct-int4"] = seed(cc, t)
    cc = json.loads(json.dumps(c))
    cc["quantization_config"]["format"] = "pack-quantized"
    out["fp8-ct-format"] = seed(cc, t)
    cc = json.loads(json.dumps(c))
    del cc["quantization_config"]
    out["fp8-no-config"] = seed(cc, t)
    cc = json.loads(json.dumps(c))
    cc["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    out["fp8-gptq"] = seed(cc, t)
    # an empty fp8 tensor no family names, starting at an expert's first byte
    w3 = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    a = []
    for x in t:
        if x[0] == w3:
            a.append((w3 + ".alias.weight", "F8_E4M3", [0, H]))
        a.append(x)
    out["fp8-alias-of-expert"] = seed(c, a + [(w3 + ".alias.weight_scale", "F32", [0])])
    c, t = fp8_mixtral("fp8", "block")
    for bad, v in (("zero", [0, 8]), ("one", [4]), ("string", "4x8"), ("huge", [1 << 20, 8])):
        cc = json.loads(json.dumps(c))
        cc["quantization_config"]["weight_block_size"] = v
        out["fp8-block-size-" + bad] = seed(cc, t)
    cc = json.loads(json.dumps(c))
    cc["quantization_config"]["weight_block_size"] = [8, 8]
    out["fp8-block-grid"] = seed(cc, t)
    out["fp8-block-channel-scale"] = seed(c, reshape(t, w1 + "_scale_inv", [I, 1]))
    out["fp8-block-scale-transposed"] = seed(c, reshape(t, p0 + "block_sparse_moe.experts.0.w2.weight_scale_inv", [3, 1]))
    cc = json.loads(json.dumps(c))
    cc["quantization_config"]["fmt"] = "e5m2"
    out["fp8-fmt-e5m2"] = seed(cc, t)
    c, t = fp8_mixtral("fbgemm_fp8", "channel")
    out["fp8-fbgemm-scale-inv"] = seed(c, [(x[0].replace("weight_scale", "weight_scale_inv"),) + x[1:] if x[0] == w1 + "_scale" else x for x in t])
    return out


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    load = os.path.join(src, "tests", "fuzz", "load-corpus")
    parse = os.path.join(src, "tests", "fuzz", "corpus")
    os.makedirs(load, exist_ok=True)
    configs = set()
    for name, data in seeds().items():   # the valid layouts first: they name the configs
        with open(os.path.join(load, name), "wb") as f:
            f.write(data)
        text = data.split(b"\0", 1)[0]
        if b"quantization_config" in text and text not in configs:
            configs.add(text)
            with open(os.path.join(parse, "cfg-q-" + name.replace("fp8-", "", 1)), "wb") as f:
                f.write(text)
    print("%d seeds in %s, %d configs in %s" % (len(seeds()), load, len(configs), parse))


if __name__ == "__main__":
    main()
