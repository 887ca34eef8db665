#!/bin/sh
# Description: mlens-mkmodel's command line: usage errors exit 2 with a
# message naming the problem, a tiny model is written, and the man page
# lints clean when mandoc is present.
set -u
bin="${MLENS_BUILDDIR:-.}/daemon/mlens-mkmodel"
src="${MLENS_SRCDIR:-.}"
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

expect_usage() {	# expected-substring args...
	want=$1; shift
	"$bin" "$@" >"$tmp/out" 2>"$tmp/err"
	rc=$?
	[ $rc -eq 2 ] || fail "mlens-mkmodel $*: exit $rc, expected 2"
	grep -q -- "$want" "$tmp/err" || fail "mlens-mkmodel $*: stderr lacks '$want': $(cat "$tmp/err")"
}

expect_usage "no output directory"
expect_usage "unknown preset 'huge'" -o "$tmp/m" --preset huge
expect_usage "unknown --dtype 'int8'" -o "$tmp/m" --dtype int8
expect_usage "--layers 'x'" -o "$tmp/m" --layers x
expect_usage "--hidden '0'" -o "$tmp/m" --hidden 0
expect_usage "unexpected argument 'extra'" -o "$tmp/m" extra

# Values the config checks refuse: exit 1 naming the field.
"$bin" -o "$tmp/m" --heads 4 --kv-heads 3 2>"$tmp/err" && fail "kv-heads 3 accepted"
grep -q num_key_value_heads "$tmp/err" || fail "kv-heads error: $(cat "$tmp/err")"
"$bin" -o "$tmp/m" --hidden 100 --heads 8 2>"$tmp/err" && fail "hidden 100 / 8 heads accepted"
grep -q "not a multiple of 8 heads" "$tmp/err" || fail "head_dim error: $(cat "$tmp/err")"
"$bin" -o "$tmp/m" --hidden 100 --heads 8 --kv-heads 4 --head-dim 12 >/dev/null || fail "explicit head_dim refused"
grep -q '"head_dim": 12' "$tmp/m/config.json" || fail "head_dim not written"
"$bin" -o "$tmp/m" --experts 2 --top-k 3 2>"$tmp/err" && fail "top-k > experts accepted"
grep -q num_experts_per_tok "$tmp/err" || fail "top-k error: $(cat "$tmp/err")"

# EOS ids: 2 by default, a list, none; outside the vocabulary refused
"$bin" -o "$tmp/m" --eos-token-id 5,7 >/dev/null || fail "--eos-token-id 5,7 refused"
tr -d ' \n' <"$tmp/m/config.json" | grep -q '"eos_token_id":\[5,7\]' || fail "eos list not written"
"$bin" -o "$tmp/m" --eos-token-id none >/dev/null || fail "--eos-token-id none refused"
grep -q '"eos_token_id": null' "$tmp/m/config.json" || fail "eos none not written as null"
"$bin" -o "$tmp/m" --eos-token-id 512 2>"$tmp/err" && fail "eos 512 (vocab 512) accepted"
grep -q "'eos_token_id' 512 is outside the vocabulary" "$tmp/err" || fail "eos error: $(cat "$tmp/err")"

"$bin" -o "$tmp/m" --preset tiny --seed 7 --shards 2 >"$tmp/out" || fail "tiny model not written"
for f in config.json model.safetensors.index.json model-00001-of-00002.safetensors \
	 model-00002-of-00002.safetensors; do
	[ -s "$tmp/m/$f" ] || fail "$f missing"
done
grep -q '"MixtralForCausalLM"' "$tmp/m/config.json" || fail "architectures not written"
grep -q '"eos_token_id": 2,' "$tmp/m/config.json" || fail "default eos_token_id 2 not written"
"$bin" -o "$tmp/m" --preset tiny --seed 7 || fail "single-file rewrite failed"
[ -e "$tmp/m/model.safetensors.index.json" ] && fail "stale index left behind"
"$bin" -o "$tmp/n" --preset tiny --seed 7 || fail "second write failed"
cmp "$tmp/m/model.safetensors" "$tmp/n/model.safetensors" || fail "same seed, different bytes"
"$bin" -o "$tmp/n" --preset tiny --seed 8 || fail "third write failed"
cmp -s "$tmp/m/model.safetensors" "$tmp/n/model.safetensors" && fail "seed ignored"

# values are filled by several threads: the bytes do not depend on how many
big="--hidden 256 --intermediate 512 --vocab 2048 --heads 4 --kv-heads 2 --layers 1"
MLENS_MKMODEL_THREADS=1 "$bin" -o "$tmp/t1" $big --seed 9 >/dev/null || fail "1-thread write failed"
MLENS_MKMODEL_THREADS=3 "$bin" -o "$tmp/t3" $big --seed 9 >/dev/null || fail "3-thread write failed"
cmp "$tmp/t1/model.safetensors" "$tmp/t3/model.safetensors" || fail "bytes depend on the thread count"

# --tokenizer: a byte-level tokenizer and a ChatML template that libmlens
# reads back (text -> ids -> the same text); a vocabulary too small refused
"$bin" -o "$tmp/tk" --tokenizer >/dev/null || fail "--tokenizer refused"
[ -f "$tmp/tk/tokenizer.json" ] && grep -q im_start "$tmp/tk/tokenizer_config.json" || fail "tokenizer files not written"
cli="${MLENS_BUILDDIR:-.}/client/mlens"
printf '{"text":"Hi, w\303\266rld <|im_end|>"}\n' >"$tmp/text.jsonl"
"$cli" tokenize --model "$tmp/tk" <"$tmp/text.jsonl" >"$tmp/ids.jsonl" || fail "mlens tokenize on the written tokenizer"
grep -q '^{"tokens":\[75,108,47,35,122,198,185,117,111,103,35,260\]}$' "$tmp/ids.jsonl" ||
	fail "tokenize: $(cat "$tmp/ids.jsonl")"
"$cli" detokenize --model "$tmp/tk" <"$tmp/ids.jsonl" | cmp -s - "$tmp/text.jsonl" ||
	fail "detokenize does not give the text back"
"$bin" -o "$tmp/tv" --vocab 200 --tokenizer 2>"$tmp/err" && fail "--tokenizer with 200 tokens accepted"
grep -q "at least 261 tokens; the model has 200" "$tmp/err" || fail "small vocabulary error: $(cat "$tmp/err")"
[ ! -e "$tmp/tv" ] || fail "a refused model left a directory"

# The other families' presets: their architecture and keys in config.json;
# a head dimension those without their own cannot express is refused.
for p in qwen3-tiny:Qwen3MoeForCausalLM:moe_intermediate_size qwen2-tiny:Qwen2MoeForCausalLM:shared_expert_intermediate_size \
	olmoe-tiny:OlmoeForCausalLM:clip_qkv; do
	name=${p%%:*} rest=${p#*:}
	"$bin" -o "$tmp/$name" --preset "$name" >/dev/null || fail "$name not written"
	grep -q "\"${rest%%:*}\"" "$tmp/$name/config.json" || fail "$name: no ${rest%%:*} in config.json"
	grep -q "\"${rest#*:}\"" "$tmp/$name/config.json" || fail "$name: no ${rest#*:} in config.json"
done
grep -q '"mlp_only_layers": \[' "$tmp/qwen3-tiny/config.json" || fail "qwen3-tiny: no mlp_only_layers"
"$bin" -o "$tmp/q2" --preset qwen2-tiny --head-dim 8 2>"$tmp/err" && fail "qwen2 head-dim 8 accepted"
grep -q "Qwen2MoeForCausalLM has no head_dim of its own" "$tmp/err" || fail "qwen2 head-dim: $(cat "$tmp/err")"

if command -v mandoc >/dev/null 2>&1; then
	mandoc -T lint -W warning "$src/man/mlens-mkmodel.1" || fail "man page lint"
fi
echo "PASS: mlens-mkmodel CLI"
exit 0
