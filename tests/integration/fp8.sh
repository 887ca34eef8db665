#!/bin/sh
# Description: fp8 expert weights through a real mlensd (CPU backend, tiny
# random model): an fp8 checkpoint with per-channel scales
# (compressed-tensors) and the same model in bf16 quantized at load
# (--weight-dtype fp8) hold the same bytes, so a batch of greedy requests
# gets the same tokens from both; a block-scaled checkpoint (quant_method
# fp8) serves too; the profiler runs over each; a quant_method mlens does
# not read (gptq) is refused at start-up, named.
# MLENS_FP8_BACKEND=cuda runs the same on the GPU: the experts on fp8
# tensor cores where it has them (MLENS_FP8_GEMM, default auto: the
# daemon's default), or dequantized (MLENS_FP8_GEMM=dequant).
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }
mlens="$B/client/mlens"
mk="$B/daemon/mlens-mkmodel"

$mk -o "$tmp/bf16" --seed 7 >/dev/null || fail "mlens-mkmodel bf16"
$mk -o "$tmp/ch" --seed 7 --dtype fp8 >/dev/null || fail "mlens-mkmodel fp8 channel"
$mk -o "$tmp/blk" --seed 7 --dtype fp8 --fp8-scales block:32x32 >/dev/null || fail "mlens-mkmodel fp8 block"
for i in 0 1 2 3 4 5; do
	echo "{\"prompt\": [$((i + 5)), $((i * 7 + 3)), 11, $((40 + i))], \"max_tokens\": 16, \"ignore_eos\": true}"
done >"$tmp/in"

# serve NAME MODEL ARGS...: greedy tokens of every request into $tmp/NAME.tok
serve() {
	name=$1 model=$2
	shift 2
	start_mlensd --model "$model" --kv-cache 64M --mlock=false --threads 1 \
		--backend "${MLENS_FP8_BACKEND:-cpu}" --gpu-fp8-gemm "${MLENS_FP8_GEMM:-auto}" "$@"
	"$mlens" generate -q -s "$tmp/t.sock" -i "$tmp/in" -o "$tmp/$name.json" || fail "generate ($name)"
	# the profiler times GEMMs over the experts' weights too
	ctl profile >"$tmp/$name.profile" 2>&1 || fail "$name: mlensctl profile: $(cat "$tmp/$name.profile")"
	python3 -c 'import json,sys
rs = [json.loads(l) for l in open(sys.argv[1])]
assert len(rs) == 6 and all(len(r["tokens"]) == 16 for r in rs), rs
print("\n".join(" ".join(map(str, r["tokens"])) for r in rs))' "$tmp/$name.json" >"$tmp/$name.tok" ||
		fail "$name: results $(cat "$tmp/$name.json")"
	cp "$tmp/log" "$tmp/$name.log"
	kill "$pid" && wait "$pid"
	pid=
	rm -f "$tmp/log"
}

serve ch "$tmp/ch"
grep -q "experts in fp8 e4m3 with per-channel scales, quant_method compressed-tensors" "$tmp/ch.log" ||
	fail "fp8 checkpoint: start-up log: $(cat "$tmp/ch.log")"
serve q "$tmp/bf16" --weight-dtype fp8
grep -q "experts quantized to fp8 e4m3" "$tmp/q.log" || fail "--weight-dtype fp8: start-up log: $(cat "$tmp/q.log")"
cmp -s "$tmp/ch.tok" "$tmp/q.tok" ||
	fail "quantized at load and the fp8 checkpoint differ: $(paste "$tmp/ch.tok" "$tmp/q.tok")"
serve blk "$tmp/blk"
grep -q "experts in fp8 e4m3 with block scales, quant_method fp8" "$tmp/blk.log" ||
	fail "block checkpoint: start-up log: $(cat "$tmp/blk.log")"

cp -r "$tmp/bf16" "$tmp/gptq"
sed 's/"architectures"/"quantization_config": {"quant_method": "gptq", "bits": 4}, "architectures"/' \
	"$tmp/bf16/config.json" >"$tmp/gptq/config.json"
refused 1 'quantization_config.quant_method "gptq" is not supported' --model "$tmp/gptq"
echo "ok: fp8 checkpoints (channel, block) and quantize-at-load served; gptq refused"
