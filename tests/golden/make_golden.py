#!/usr/bin/env python3
"""Write the golden fixtures of mlens' numerics tests (tests/check_golden.c).

For a few small random Mixtral configs this saves the model with
save_pretrained (fp32, one also bf16, one sharded) and, from the saved files
reloaded through transformers, writes reference outputs:

  golden.json                prompts, greedy continuations, top-2 margins,
                             tolerances, shapes; bf16 models also the
                             router's relative top-k gap per position and
                             how far the CUDA fast GEMMs move the router
                             logits there (router_data)
  logits_prefill_pN.f32      logits of every position of prompt N (full
                             prefill), [len][vocab], little-endian float32
  logits_gen_pN.f32          logits of the first N_GEN_LOGITS greedy steps
                             of prompt N ([steps][vocab]); step 0 is the last
                             prompt position, step i>0 comes from decoding
                             with the KV cache after greedy tokens 0..i-1
  hf_bf16_*.f32              bf16 models only: the same, computed by
                             transformers in bf16 (informational)

Usage (from the source root):  python3 tests/golden/make_golden.py [OUTDIR]
OUTDIR defaults to the directory of this script. The run is deterministic:
weights and prompts come from fixed seeds, and every reference is computed
in float32 with eager attention on the CPU.
"""
import contextlib
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import MixtralConfig, MixtralForCausalLM

PROMPT_LENS = [1, 5, 17, 40]
N_GEN = 48          # greedy tokens per prompt
N_GEN_LOGITS = 32   # generated steps whose logits are stored
TOL_F32 = 1e-4      # max |diff| / max |ref| per prompt
# bf16 weights: fp32 compute, decode reading K/V from a bf16 cache
TOL_BF16 = dict(
    prefill=TOL_F32, decode=1.5e-2, kv_bf16=1e-3,
    note=("reference = these bf16 weights upcast to fp32 compute, as mlens computes "
          "(fp32 activations). Prefill attention uses fp32 K/V, so prefill logits "
          "meet the fp32 tolerance; decode steps read K/V from the bf16 KV cache "
          "(relative rounding 2^-9 = 2e-3 per element), hence the decode tolerance"))

# Each config differs in head_dim, expert count, top-k, GQA ratio and
# rope_theta; m1 is sharded, m3 ties the embeddings, m2 also ships in bf16.
MODELS = [
    dict(name="m1-gqa4-sharded", seed=103, shard="64KB", bf16=False,
         cfg=dict(vocab_size=256, hidden_size=64, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                  head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                  rope_theta=1e6, tie_word_embeddings=False)),
    dict(name="m2-hd32-top3", seed=203, shard=None, bf16=True,
         cfg=dict(vocab_size=320, hidden_size=64, intermediate_size=64,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, num_local_experts=4, num_experts_per_tok=3,
                  rope_theta=1e4, tie_word_embeddings=False)),
    dict(name="m3-hd64-tied", seed=303, shard=None, bf16=False,
         cfg=dict(vocab_size=256, hidden_size=64, intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=64, num_local_experts=8, num_experts_per_tok=2,
                  rope_theta=1e4, tie_word_embeddings=True)),
]


def make_config(c):
    return MixtralConfig(max_position_embeddings=256, rms_norm_eps=1e-5,
                         sliding_window=None, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, **c)


def init_weights(model, seed):
    """Re-initialise every weight from one seeded generator, in name order.

    HF's init (std 0.02) gives nearly flat logits and near-ties everywhere.
    Here a matrix gets std gain/sqrt(fan_in), so that each projection of a
    unit-RMS input has outputs of RMS ~gain: attention scores and router
    logits are well spread (distinct expert choices) and the final logits
    have a standard deviation of a few units (clear greedy choices). Norm
    weights are uniform in [0.8, 1.2].
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda t: t[0]):
            if name.endswith("norm.weight"):
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=g))
                continue
            fan_in = p.shape[-1]
            if "embed_tokens" in name:
                std = 0.5 if model.config.tie_word_embeddings else 1.0
            elif name == "lm_head.weight":
                std = 3.0 / fan_in ** 0.5
            elif "mlp.gate" in name:          # router
                std = 2.0 / fan_in ** 0.5
            elif "q_proj" in name or "k_proj" in name:
                std = 1.5 / fan_in ** 0.5
            else:
                std = 1.0 / fan_in ** 0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)


class RouterWatch:
    """Smallest gap between the k-th and (k+1)-th router logit over every
    token the model sees: a tiny gap would let rounding pick another expert."""

    def __init__(self, model, k):
        self.k = k
        self.min_gap = float("inf")
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(self.hook)

    def hook(self, mod, inp, out):
        x = inp[0].reshape(-1, inp[0].shape[-1]).float()
        lg = x @ mod.weight.float().T
        top = torch.topk(lg, self.k + 1, dim=-1).values
        self.min_gap = min(self.min_gap, float((top[:, self.k - 1] - top[:, self.k]).min()))


class RouterLogits:
    """Router logits of every layer for each position the model sees, in
    order: logits() is [layers][positions][experts]."""

    def __init__(self, model):
        self.rows = [[] for _ in model.model.layers]
        self.handles = [layer.mlp.gate.register_forward_hook(self.hook(i))
                        for i, layer in enumerate(model.model.layers)]

    def hook(self, i):
        def f(mod, inp, out):
            x = inp[0].reshape(-1, inp[0].shape[-1]).float()
            self.rows[i].append(x @ mod.weight.float().T)
        return f

    def close(self):
        for h in self.handles:
            h.remove()

    def logits(self):
        return torch.stack([torch.cat(r) for r in self.rows])


class FastGemm:
    """Within this context F.linear computes as the CUDA backend's fast GEMM
    mode (kernels/cuda/backend_cuda.cu): the activations of every expert
    GEMM, and of every dense GEMM wider than GEMM_NARROW_M outputs, are
    rounded to bf16 (nearest even) before an fp32-accumulated product; the
    silu(g)*u input of the down projection is an expert GEMM input too."""

    NARROW_M = 64     # GEMM_NARROW_M in backend_cuda.cu

    def __init__(self, model):
        self.experts = {p.untyped_storage().data_ptr()
                        for layer in model.model.layers
                        for p in layer.mlp.experts.parameters()}

    def __enter__(self):
        self.orig = torch.nn.functional.linear

        def linear(x, w, b=None):
            if w.untyped_storage().data_ptr() in self.experts or w.shape[0] > self.NARROW_M:
                x = x.to(torch.bfloat16).float()
            return self.orig(x, w, b)
        torch.nn.functional.linear = linear
        return self

    def __exit__(self, *exc):
        torch.nn.functional.linear = self.orig


@torch.no_grad()
def router_run(model, prompt, force, fast):
    """Router logits [layers][positions][experts] of prompt + force[:-1],
    prefilled then decoded one token at a time with the KV cache; fast: as
    the engine computes in the CUDA backend's fast mode (FastGemm, and the
    bf16 KV cache it reads in decode)."""
    rec = RouterLogits(model)
    try:
        with contextlib.ExitStack() as st:
            if fast:
                st.enter_context(FastGemm(model))
                st.enter_context(Bf16KV())
            r = model(input_ids=torch.tensor([prompt]), use_cache=True)
            past = r.past_key_values
            for t in force[:-1]:
                r = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
                past = r.past_key_values
    finally:
        rec.close()
    return rec.logits()


def router_data(model, k, prompt, greedy):
    """Per position of prompt + greedy[:-1] (position len-1+i gives greedy
    step i's logits), the minimum over layers of:
      rel_gap    (k-th - (k+1)-th router logit) / max |router logit| of the
                 reference, how far an expert choice is from flipping
      rel_shift  max |fast-mode router logit - reference| / max |reference
                 router logit|, how far the fast GEMMs moved them here.
    tests/check_golden.c stops fast-mode comparisons at the first position
    whose rel_gap is at most twice the largest rel_shift up to it."""
    ref = router_run(model, prompt, greedy, False)
    fast = router_run(model, prompt, greedy, True)
    scale = ref.abs().amax(dim=-1)
    top = torch.topk(ref, k + 1, dim=-1).values
    rel_gap = ((top[..., k - 1] - top[..., k]) / scale).amin(dim=0)
    rel_shift = ((fast - ref).abs().amax(dim=-1) / scale).amax(dim=0)
    return [float(v) for v in rel_gap], [float(v) for v in rel_shift]


def first_fast_unsafe(rel_gap, rel_shift):
    """The rule of tests/check_golden.c (golden_fast_cut)."""
    most = 0.0
    for i, (g, sh) in enumerate(zip(rel_gap, rel_shift)):
        most = max(most, sh)
        if g <= 2 * most:
            return i
    return len(rel_gap)


class Bf16KV:
    """Within this context the KV cache behaves as mlens' BF16 cache: K/V
    (after RoPE) are stored rounded to bf16; a prefill attends over its own
    fp32 K/V, a decode step reads everything back from the rounded cache."""

    def __enter__(self):
        self.orig = transformers.cache_utils.DynamicLayer.update

        def update(layer, k, v, *a, **kw):
            fresh = not layer.is_initialized or layer.keys.numel() == 0
            self.orig(layer, k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float(), *a, **kw)
            if fresh:
                return k, v
            return layer.keys, layer.values
        transformers.cache_utils.DynamicLayer.update = update
        return self

    def __exit__(self, *exc):
        transformers.cache_utils.DynamicLayer.update = self.orig


@torch.no_grad()
def reference(model, prompts, force=None):
    """Per prompt alone (no padding): full-prefill logits, then greedy
    decoding with the KV cache (or, with force, decoding those tokens).
    Returns a list of dicts."""
    out = []
    for n, p in enumerate(prompts):
        ids = torch.tensor([p])
        r = model(input_ids=ids, use_cache=True)
        prefill = r.logits[0].float().clone()
        past = r.past_key_values
        last = prefill[-1]
        toks, margins, maxabs, gen = [], [], [], []
        for i in range(N_GEN):
            top2 = torch.topk(last, 2).values
            t = int(torch.argmax(last)) if force is None else force[n][i]
            toks.append(t)
            margins.append(float(top2[0] - top2[1]))
            maxabs.append(float(last.abs().max()))
            if i < N_GEN_LOGITS:
                gen.append(last.clone())
            if i + 1 == N_GEN:
                break
            r = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = r.past_key_values
            last = r.logits[0, -1].float()
        out.append(dict(prefill=prefill, greedy=toks, margin=margins, max_abs=maxabs,
                        gen=torch.stack(gen)))
    return out


def write_f32(path, t):
    a = np.ascontiguousarray(t.detach().float().numpy(), dtype="<f4")
    a.tofile(path)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def first_unsafe(ref, tol):
    """First greedy step whose top-2 margin a tol-relative error could flip."""
    for i, (m, mx) in enumerate(zip(ref["margin"], ref["max_abs"])):
        if m <= 2 * tol * mx:
            return i
    return len(ref["margin"])


def load(d, dtype, cls=MixtralForCausalLM):
    return cls.from_pretrained(d, dtype=dtype, attn_implementation="eager").eval()


def write_golden_json(d, js):
    """The fixture's golden.json, as every writer lays it out."""
    with open(os.path.join(d, "golden.json"), "w") as f:
        json.dump(js, f, indent=1)
        f.write("\n")


def write_fixture(d, spec, prompts, dtype_name, tol, bf16_served=None, model=None,
                  reference_note=None, cls=MixtralForCausalLM):
    """model: the reference model when it is not the folder's files as
    transformers loads them (make_golden_fp8.py: the dequantized weights);
    cls: the family's class (make_golden_families.py: a bf16 Qwen3-MoE)."""
    if model is None:
        model = load(d, torch.float32, cls)   # bf16 files are upcast exactly
    watch = RouterWatch(model, spec["cfg"]["num_experts_per_tok"])
    ref = reference(model, prompts)
    V = spec["cfg"]["vocab_size"]
    js = dict(
        name=os.path.basename(d), dtype=dtype_name, vocab_size=V,
        n_gen=N_GEN, n_gen_logits=N_GEN_LOGITS,
        tolerance=dict(prefill=tol["prefill"], decode=tol["decode"]),
        tolerance_note=tol["note"],
        reference=("transformers %s, torch %s: %s.from_pretrained(this dir, "
                   "dtype=float32, attn_implementation='eager'), CPU, one prompt at a time, "
                   "greedy with use_cache" % (transformers.__version__, torch.__version__,
                                              cls.__name__)
                   if reference_note is None else reference_note),
        prompts=[])
    for n, (p, r) in enumerate(zip(prompts, ref)):
        write_f32(os.path.join(d, "logits_prefill_p%d.f32" % n), r["prefill"])
        write_f32(os.path.join(d, "logits_gen_p%d.f32" % n), r["gen"])
        js["prompts"].append(dict(
            tokens=p, greedy=r["greedy"], margin=r["margin"], max_abs=r["max_abs"],
            prefill_logits="logits_prefill_p%d.f32" % n,
            gen_logits="logits_gen_p%d.f32" % n))
        print("  %s prompt %d (len %2d): greedy steps safe at tol %.0e: %d/%d, min margin %.3g"
              % (js["name"], n, len(p), tol["decode"], first_unsafe(r, tol["decode"]), N_GEN,
                 min(r["margin"])))
    if bf16_served:
        js["kv_bf16"] = bf16_kv_check(d, model, prompts, ref, tol)
        js["informational_hf_bf16"] = bf16_served(d, prompts, ref, cls)
    js["router_min_gap"] = watch.min_gap
    if bf16_served:
        # after router_min_gap, which these runs must not change
        for n, (p, r) in enumerate(zip(prompts, ref)):
            gap, shift = router_data(model, spec["cfg"]["num_experts_per_tok"], p, r["greedy"])
            js["prompts"][n]["router_rel_gap"] = gap
            js["prompts"][n]["router_rel_shift_fast"] = shift
            cut = first_fast_unsafe(gap, shift)
            print("  %s prompt %d: fast GEMMs move router logits by up to %.3g (relative) "
                  "before position %d, where fast-mode checks stop (%d greedy steps compared)"
                  % (js["name"], n, max(shift[:cut] or [0.0]), cut, max(cut - (len(p) - 1), 0)))
    print("  %s: router min top-k gap %.3g (fp32 runs)" % (js["name"], watch.min_gap))
    write_golden_json(d, js)
    return ref


def bf16_kv_check(d, model, prompts, ref, tol):
    """A second reference for bf16 models: the same fp32 compute with the
    KV cache rounded to bf16 exactly as mlens stores it. Its decode logits
    (teacher-forced on the main reference's greedy tokens) and its own
    free-running greedy tokens are compared at tol["kv_bf16"]: rounding is
    discontinuous, so an fp32-level difference before it can flip a cached
    element by one bf16 ulp (2^-8 relative); a few such flips move the logits
    by ~1e-4..1e-3, well below what the cache as a whole does. That whole
    effect (distance to the main reference) is what the main decode
    tolerance must cover with room to spare."""
    force = [r["greedy"] for r in ref]
    with Bf16KV():
        forced = reference(model, prompts, force)
        free = reference(model, prompts)
    res = dict(note=("fp32 compute with K/V rounded to bf16 (nearest even, after RoPE) in the "
                     "cache, prefill attending over its own fp32 K/V: gen_logits teacher-forced on "
                     "the main greedy tokens; greedy/margin/max_abs free-running"),
               tolerance=tol["kv_bf16"], prompts=[])
    worst = 0.0
    for n, (f, g, r) in enumerate(zip(forced, free, ref)):
        same = 0
        while same < N_GEN and g["greedy"][same] == r["greedy"][same]:
            same += 1
        drel = rel(f["gen"], r["gen"])
        worst = max(worst, drel)
        write_f32(os.path.join(d, "logits_gen_kvbf16_p%d.f32" % n), f["gen"])
        res["prompts"].append(dict(gen_logits="logits_gen_kvbf16_p%d.f32" % n,
                                   greedy=g["greedy"], margin=g["margin"], max_abs=g["max_abs"],
                                   decode_rel_vs_main=drel, greedy_agree_with_main=same))
        print("  bf16-KV prompt %d: prefill rel %.3g, decode rel %.3g, greedy agrees %d/%d, "
              "safe at %.0e: %d/%d" % (n, rel(f["prefill"], r["prefill"]), drel, same, N_GEN,
                                      tol["kv_bf16"], first_unsafe(g, tol["kv_bf16"]), N_GEN))
    if worst * 3 > tol["decode"]:
        sys.exit("bf16 decode tolerance %.3g is less than 3x the bf16-KV error %.3g" % (tol["decode"], worst))
    return res


def hf_bf16_served(d, prompts, ref32, cls=MixtralForCausalLM):
    """transformers serving the bf16 files in bf16 (its own compute dtype):
    not what mlens computes (fp32 activations), kept to show the gap."""
    model = load(d, torch.bfloat16, cls)
    hb = reference(model, prompts)
    info = dict(note=("transformers in bf16 (dtype=bfloat16, eager): logits vs the fp32-compute "
                      "reference; not compared by the test"), prompts=[])
    for n, (a, b) in enumerate(zip(hb, ref32)):
        write_f32(os.path.join(d, "hf_bf16_prefill_p%d.f32" % n), a["prefill"])
        same = 0
        while same < N_GEN and a["greedy"][same] == b["greedy"][same]:
            same += 1
        info["prompts"].append(dict(
            greedy=a["greedy"], prefill_logits="hf_bf16_prefill_p%d.f32" % n,
            prefill_rel_vs_fp32=rel(a["prefill"], b["prefill"]),
            greedy_agree_with_fp32=same))
        print("  hf-bf16 prompt %d: prefill rel vs fp32 compute %.3g, greedy agrees %d/%d"
              % (n, info["prompts"][-1]["prefill_rel_vs_fp32"], same, N_GEN))
    return info


def write_files_list(path, var, what, files):
    """A make fragment setting var to the fixture files (paths under
    tests/golden), for tests/golden.mk to ship."""
    with open(path, "w") as f:
        f.write("# Generated by %s.\n" % what)
        f.write("%s =" % var)
        for p in files:
            f.write(" \\\n\ttests/golden/%s" % p)
        f.write("\n")


def begin():
    """The output folder (argv[1], else this script's), and torch set up for
    runs that repeat bit for bit."""
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)              # fixed reduction order
    torch.use_deterministic_algorithms(True)
    return sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))


def main():
    out = begin()
    files = []
    for spec in MODELS:
        cfg = make_config(spec["cfg"])
        torch.manual_seed(spec["seed"])
        model = MixtralForCausalLM(cfg).eval()
        init_weights(model, spec["seed"])
        g = torch.Generator().manual_seed(spec["seed"] + 1)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
                   for n in PROMPT_LENS]
        variants = [("", torch.float32, "float32",
                     dict(prefill=TOL_F32, decode=TOL_F32,
                          note="fp32 weights and activations: rounding-order differences only"))]
        if spec["bf16"]:
            variants.append(("-bf16", torch.bfloat16, "bfloat16", TOL_BF16))
        for suffix, dt, dname, tol in variants:
            d = os.path.join(out, spec["name"] + suffix)
            shutil.rmtree(d, ignore_errors=True)
            kw = dict(max_shard_size=spec["shard"]) if spec["shard"] else {}
            model.to(dt).save_pretrained(d, **kw)
            print("%s (%s)" % (d, dname))
            write_fixture(d, spec, prompts, dname, tol,
                          hf_bf16_served if dt == torch.bfloat16 else None)
            files += [os.path.join(os.path.basename(d), f) for f in sorted(os.listdir(d))]
            model.to(torch.float32)
    # The build ships exactly these files (tests/golden.mk includes the list).
    write_files_list(os.path.join(out, "files.mk"), "GOLDEN_FIXTURES",
                     "tests/golden/make_golden.py: every fixture file", files)


if __name__ == "__main__":
    main()
