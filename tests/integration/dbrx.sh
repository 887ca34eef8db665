#!/bin/sh
# Description: a DBRX model (mlens-mkmodel's dbrx-tiny: LayerNorm, fused
# Wqkv with clip_qkv, 8 experts top-4 fused, w2 read as stored) served by a
# real mlensd: a config.json asking for what mlens does not implement is
# refused at start-up naming the key and its value, and so are fp8 experts
# (--weight-dtype fp8); the model's greedy
# tokens for four prompts are the same in one batch as one at a time, and
# every request runs to its max_tokens. MLENS_DBRX_BACKEND=cuda runs it on
# the GPU.
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }
mlens="$B/client/mlens"

"$B/daemon/mlens-mkmodel" -o "$tmp/d" --preset dbrx-tiny --seed 5 >/dev/null || fail "mlens-mkmodel"
grep -q '"DbrxForCausalLM"' "$tmp/d/config.json" || fail "mkmodel: not a DBRX config.json"

# ==== refused at start-up, named ====
cp -r "$tmp/d" "$tmp/bad"
sed 's/"moe_normalize_expert_weights": 1.0/"moe_normalize_expert_weights": 2.0/' "$tmp/d/config.json" \
	>"$tmp/bad/config.json"
refused 1 "ffn_config.moe_normalize_expert_weights is 2; mlens implements only 1" --model "$tmp/bad"
echo "ok: moe_normalize_expert_weights 2 refused at start-up, named"

# fp8 experts: DBRX's down projections are stored transposed, which the fp8
# paths do not read; quantizing them at load is refused, named, and so is
# writing such a model
refused 1 "DbrxForCausalLM experts (down projection stored transposed) cannot be quantized to fp8; set weight_dtype auto" \
	--model "$tmp/d" --weight-dtype fp8
"$B/daemon/mlens-mkmodel" -o "$tmp/d8" --preset dbrx-tiny --dtype fp8 2>"$tmp/err" &&
	fail "mlens-mkmodel wrote a DBRX model with fp8 experts"
grep -qF "fp8 experts are written for Mixtral only" "$tmp/err" || fail "mkmodel dbrx fp8: $(cat "$tmp/err")"
echo "ok: fp8 experts for DBRX refused (weight_dtype fp8, mkmodel --dtype fp8), named"

# ==== served: batched equals one at a time ====
start_mlensd --model "$tmp/d" --kv-cache 64M --mlock=false --threads 1 \
	--backend "${MLENS_DBRX_BACKEND:-cpu}"
for p in "[5, 6, 7]" "[300]" "[11, 200, 44, 90, 7, 31, 260, 8, 9]" "[1, 2, 3, 4]"; do
	echo "{\"prompt\": $p, \"max_tokens\": 12, \"ignore_eos\": true}"
done >"$tmp/in"
"$mlens" generate -q -s "$tmp/t.sock" -i "$tmp/in" -o "$tmp/batch" || fail "generate (batch)"
: >"$tmp/alone"
for i in 1 2 3 4; do
	sed -n "${i}p" "$tmp/in" >"$tmp/one"
	"$mlens" generate -q -s "$tmp/t.sock" -i "$tmp/one" -o "$tmp/o1" || fail "generate (prompt $i)"
	cat "$tmp/o1" >>"$tmp/alone"
done
python3 - "$tmp/batch" "$tmp/alone" <<'PY' || fail "batch $(cat "$tmp/batch") alone $(cat "$tmp/alone")"
import json, sys
b = [json.loads(l) for l in open(sys.argv[1])]
a = [json.loads(l) for l in open(sys.argv[2])]
assert len(b) == 4 and len(a) == 4
for x, y in zip(b, a):
    assert x["finish_reason"] == "length" and len(x["tokens"]) == 12, x
    assert x["tokens"] == y["tokens"], (x["tokens"], y["tokens"])
assert len({tuple(x["tokens"]) for x in b}) > 1, "every prompt gave the same tokens"
PY
echo "ok: DBRX served: 4 prompts x 12 greedy tokens, batched equal to alone"
