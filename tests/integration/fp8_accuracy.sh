#!/bin/sh
# Description: mlens-kvcompare's accuracy matrix of fp8 against bf16 on a
# small random bf16 Mixtral (head_dim 128, 4 layers): the control (the
# reference's weights and KV dtype) agrees exactly; fp8 experts quantized
# at load (weight_dtype = fp8), the fp8 KV cache and both agree on most
# greedy tokens with a small, nonzero log-probability difference, and both
# together differ about as much as the larger of the two; an fp8
# checkpoint written per channel from the same seed gives the very numbers
# of the quantization at load, a block-scaled one numbers of its own; the
# single-run flags give the matrix's rows; a model whose experts cannot
# take fp8 and a test model of another shape are refused, naming them.
# MLENS_FP8ACC_BACKEND=cuda runs the same checks on the GPU.
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }
be=${MLENS_FP8ACC_BACKEND:-cpu}
# mk DIR ARGS...: the small Mixtral from one seed, as ARGS write it
mk() {
	d=$1
	shift
	"$B/daemon/mlens-mkmodel" -o "$tmp/$d" --preset tiny --head-dim 128 --layers 4 --seed 11 "$@" >/dev/null ||
		fail "mlens-mkmodel $*"
}
# kvc JSON ARGS...: the tool on the bf16 model, its JSON into $tmp/JSON
kvc() {
	j=$1
	shift
	"$B/daemon/mlens-kvcompare" --model "$tmp/m" --prompts 32 --prompt-len 12 --gen 6 --threads 1 \
		--backend "$be" --json "$tmp/$j" "$@" >"$tmp/out" 2>"$tmp/err" ||
		fail "mlens-kvcompare $*: $(cat "$tmp/err")"
}
mk m
mk m8c --dtype fp8 --fp8-scales channel
mk m8b --dtype fp8 --fp8-scales block

kvc mx.json --matrix
grep -q '^weights+kv  *F8_E4M3/channel  *F8_E4M3 ' "$tmp/out" || fail "matrix table: $(cat "$tmp/out")"
python3 - "$tmp/mx.json" <<'EOF' || fail "matrix: $(cat "$tmp/mx.json")"
import json, sys
r = json.load(open(sys.argv[1]))
c = {x["name"]: x for x in r["configs"]}
assert list(c) == ["control", "weights", "kv", "weights+kv"], list(c)
assert r["reference"] == "BF16" and r["reference_weights"] == "BF16", r
ctl = c["control"]
assert ctl["greedy_agreement_tokens"] == 1.0 and ctl["greedy_agreement_sequences"] == 1.0, ctl
assert ctl["mean_abs_logprob_diff"] == 0.0 and ctl["max_abs_logprob_diff"] == 0.0, ctl
assert (c["weights"]["weights"], c["weights"]["kv"]) == ("F8_E4M3/channel", "BF16"), c["weights"]
assert (c["kv"]["weights"], c["kv"]["kv"]) == ("BF16", "F8_E4M3"), c["kv"]
assert (c["weights+kv"]["weights"], c["weights+kv"]["kv"]) == ("F8_E4M3/channel", "F8_E4M3")
for n in ("weights", "kv", "weights+kv"):
    x = c[n]
    # a random-weight model's near ties flip some greedy choices; the
    # bounds leave a margin below what this model gives
    assert x["greedy_agreement_tokens"] >= 0.85 and x["greedy_agreement_first"] >= 0.8, (n, x)
    assert 0 < x["mean_abs_logprob_diff"] <= x["max_abs_logprob_diff"] < 0.1, (n, x)
    assert x["mean_abs_logprob_diff"] < 0.05, (n, x)
# the two errors do not cancel: both together about as large as the larger
both, w, kv = (c[n]["mean_abs_logprob_diff"] for n in ("weights+kv", "weights", "kv"))
assert both >= 0.7 * max(w, kv), (both, w, kv)
# fp8 experts take fewer bytes; the fp8 KV pool holds 1.94 x the tokens
assert c["weights"]["weight_bytes"] < r["reference_weight_bytes"], c["weights"]
assert c["kv"]["weight_bytes"] == r["reference_weight_bytes"], c["kv"]
assert abs(c["kv"]["kv_tokens_ratio"] - 256 / 132) < 1e-4 and c["weights"]["kv_tokens_ratio"] == 1.0
EOF
echo "ok: matrix: control exact; $(python3 -c 'import json,sys
for x in json.load(open(sys.argv[1]))["configs"][1:]:
    print("%s agreement %.4f, mean |dlogprob| %.5f;" % (x["name"], x["greedy_agreement_tokens"], x["mean_abs_logprob_diff"]), end=" ")' "$tmp/mx.json")"

# row JSON [NAME]: the weights, KV dtype and scores of a single run's JSON,
# or of its matrix row NAME
row() {
	python3 - "$tmp/$1" "${2:-}" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
if sys.argv[2]:
    x = [c for c in r["configs"] if c["name"] == sys.argv[2]][0]
    w, kv = x["weights"], x["kv"]
else:
    x, w, kv = r, r["test_weights"], r["test"]
print(w, kv, *(x[k] for k in ("greedy_agreement_tokens", "greedy_agreement_first",
                              "greedy_agreement_sequences", "mean_abs_logprob_diff",
                              "max_abs_logprob_diff")))
EOF
}
# an fp8 checkpoint with per-channel scales from the same seed holds the
# bytes the quantization at load makes: the same numbers (the KV dtype
# follows the reference's unless --test says otherwise)
kvc m8c.json --test-model "$tmp/m8c"
[ "$(row m8c.json)" = "$(row mx.json weights)" ] ||
	fail "fp8 checkpoint: $(row m8c.json) against quantized at load: $(row mx.json weights)"
grep -q "^test weights from $tmp/m8c" "$tmp/out" || fail "the table does not name the test model: $(head -3 "$tmp/out")"
kvc m8b.json --test-model "$tmp/m8b" --test fp8
python3 -c 'import json,sys; w = json.load(open(sys.argv[1]))
assert w["test_weights"] == "F8_E4M3/block" and w["test"] == "F8_E4M3", w
assert w["greedy_agreement_tokens"] >= 0.85 and 0 < w["mean_abs_logprob_diff"] < 0.05, w' "$tmp/m8b.json" ||
	fail "block-scaled checkpoint: $(cat "$tmp/m8b.json")"
echo "ok: the per-channel fp8 checkpoint scores as the quantization at load; the block-scaled one with fp8 KV: $(row m8b.json)"

# the single-run flags give the matrix's rows
kvc w.json --test-weights fp8
[ "$(row w.json)" = "$(row mx.json weights)" ] || fail "--test-weights fp8: $(row w.json), matrix $(row mx.json weights)"
kvc wk.json --test-weights fp8 --test fp8
[ "$(row wk.json)" = "$(row mx.json weights+kv)" ] || fail "--test-weights fp8 --test fp8: $(row wk.json)"
kvc k.json
[ "$(row k.json)" = "$(row mx.json kv)" ] || fail "default (fp8 KV): $(row k.json), matrix $(row mx.json kv)"
kvc c.json --test-weights auto --test bf16
[ "$(row c.json)" = "BF16 BF16 1.0 1.0 1.0 0.0 0.0" ] || fail "control: $(row c.json)"
echo "ok: --test-weights fp8 [--test fp8], --test fp8 and the control give the matrix's rows"

# refusals: experts that cannot take fp8, a test model of another shape
"$B/daemon/mlens-mkmodel" -o "$tmp/q" --preset qwen3-tiny --seed 1 >/dev/null || fail "mlens-mkmodel qwen3-tiny"
"$B/daemon/mlens-kvcompare" --model "$tmp/q" --matrix --prompts 2 >/dev/null 2>"$tmp/err" && fail "qwen3 --matrix accepted"
grep -q "test-weights fp8: .*Qwen3MoeForCausalLM experts cannot be quantized" "$tmp/err" || fail "qwen3 refusal: $(cat "$tmp/err")"
"$B/daemon/mlens-mkmodel" -o "$tmp/m2" --preset tiny --seed 11 >/dev/null || fail "mlens-mkmodel 2 layers"
"$B/daemon/mlens-kvcompare" --model "$tmp/m" --test-model "$tmp/m2" --prompts 2 >/dev/null 2>"$tmp/err" && fail "shape mismatch accepted"
grep -q "test-model $tmp/m2 has num_hidden_layers 2, the reference model .* 4" "$tmp/err" || fail "shape refusal: $(cat "$tmp/err")"
"$B/daemon/mlens-kvcompare" --model "$tmp/m" --test-weights fp16 >/dev/null 2>"$tmp/err"
[ $? = 2 ] && grep -q "test-weights wants auto or fp8, got 'fp16'" "$tmp/err" || fail "bad --test-weights: $(cat "$tmp/err")"
"$B/daemon/mlens-kvcompare" --model "$tmp/m" --gpu-fp8-gemm fp16 >/dev/null 2>"$tmp/err" && fail "--gpu-fp8-gemm fp16 accepted"
grep -q "gpu_fp8_gemm.*'fp16' is not one of auto, fp8, dequant" "$tmp/err" || fail "bad --gpu-fp8-gemm: $(cat "$tmp/err")"
echo "ok: refusals name the architecture, the shape, the value and the gpu_fp8_gemm key"
