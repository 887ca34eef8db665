#!/bin/sh
# Description: mlensd serves each model family from its Hugging Face
# directory (mlens-mkmodel's qwen3-tiny with a dense layer, qwen2-tiny with
# a shared expert, olmoe-tiny), CPU backend: the start-up log names the
# architecture, `mlens generate` returns max_tokens tokens for every
# request, and a prompt's tokens are the same alone and in a batch; a
# Qwen3-MoE config that asks for sliding-window attention is refused at
# start-up naming the key, and so are fp8 experts (--weight-dtype fp8,
# mlens-mkmodel --dtype fp8). MLENS_FAMILIES_BACKEND=cuda runs the serving
# checks on the GPU.
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }
mlens="$B/client/mlens"

# the token lists of the results file $1, one a line
tokens() {
	python3 -c 'import json,sys
for l in open(sys.argv[1]).read().split("\n")[:-1]:
    print(json.dumps(json.loads(l)["tokens"], separators=(",", ":")))' "$1"
}

for preset in qwen3-tiny:Qwen3MoeForCausalLM qwen2-tiny:Qwen2MoeForCausalLM \
	olmoe-tiny:OlmoeForCausalLM; do
	name=${preset%%:*} arch=${preset#*:}
	"$B/daemon/mlens-mkmodel" -o "$tmp/$name" --preset "$name" --seed 7 >/dev/null ||
		fail "mlens-mkmodel $name"
	start_mlensd --model "$tmp/$name" --kv-cache 64M --mlock=false --threads 1 \
		--backend "${MLENS_FAMILIES_BACKEND:-cpu}"
	grep -q "model $tmp/$name: $arch, 2 layers" "$tmp/log" || fail "$name: start-up log does not name $arch"
	echo '{"prompt": [5, 6, 7, 8], "max_tokens": 10, "ignore_eos": true}' >"$tmp/one"
	python3 -c 'for i in range(3): print("{\"prompt\": [%s], \"max_tokens\": 10, \"ignore_eos\": true}" % ("5, 6, 7, 8" if i == 1 else "%d, 9" % (i + 20)))' >"$tmp/three"
	"$mlens" generate -q -s "$tmp/t.sock" -i "$tmp/one" -o "$tmp/one.out" || fail "$name: generate"
	"$mlens" generate -q -s "$tmp/t.sock" -i "$tmp/three" -o "$tmp/three.out" || fail "$name: generate 3"
	alone=$(tokens "$tmp/one.out")
	[ "$(echo "$alone" | tr ',' '\n' | wc -l)" -eq 10 ] || fail "$name: not 10 tokens: $alone"
	[ "$(tokens "$tmp/three.out" | wc -l)" -eq 3 ] || fail "$name: not 3 results: $(cat "$tmp/three.out")"
	[ "$(tokens "$tmp/three.out" | sed -n 2p)" = "$alone" ] ||
		fail "$name: batched $(tokens "$tmp/three.out" | sed -n 2p) != alone $alone"
	kill "$pid" && wait "$pid" 2>/dev/null
	pid=
	echo "ok: $arch served ($alone alone and batched)"
done

# fp8 experts are Mixtral's only (a shared expert would have no scales):
# quantizing at load is refused at start-up, named, and so is writing one
refused 1 "Qwen2MoeForCausalLM experts cannot be quantized to fp8 (mlens quantizes MixtralForCausalLM experts only); set weight_dtype auto" \
	--model "$tmp/qwen2-tiny" --weight-dtype fp8
"$B/daemon/mlens-mkmodel" -o "$tmp/q8" --preset qwen3-tiny --dtype fp8 2>"$tmp/err" &&
	fail "mlens-mkmodel wrote a Qwen3-MoE model with fp8 experts"
grep -qF "fp8 experts are written for Mixtral only; write Qwen3MoeForCausalLM in bf16, fp16 or fp32" \
	"$tmp/err" || fail "mkmodel qwen3 fp8: $(cat "$tmp/err")"
echo "ok: fp8 experts for Qwen2-MoE and Qwen3-MoE refused (weight_dtype fp8, mkmodel --dtype fp8), named"

sed 's/"use_sliding_window": false/"use_sliding_window": true/' "$tmp/qwen3-tiny/config.json" >"$tmp/c" &&
	mv "$tmp/c" "$tmp/qwen3-tiny/config.json"
refused 1 "'use_sliding_window' is true; mlens has no sliding-window attention" --model "$tmp/qwen3-tiny"
echo "ok: use_sliding_window refused at start-up, named"
