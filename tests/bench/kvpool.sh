# Sourced by the benchmark scripts (hybrid.sh, nreal_sweep.sh) after
# MODEL is set: per_token, the KV bytes a token takes in the pool (layers x
# kv_heads x head_dim x 2 (K, V) x 2 (bf16 KV; f32 models keep f32 KV), the
# 8-layer Mixtral's until the model exists; KV_DTYPE=fp8: a byte an element
# and a 4-byte scale a row, as mlensd --kv-dtype fp8 keeps them), and seqs_of.
per_token=$(python3 -c 'import json,os,sys
c = json.load(open(sys.argv[1] + "/config.json"))
hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
es = 4 if c.get("torch_dtype") == "float32" else 2
row = hd + 4 if os.environ.get("KV_DTYPE") == "fp8" else hd * es
print(c["num_hidden_layers"] * c["num_key_value_heads"] * row * 2)' "$MODEL" 2>/dev/null) ||
	per_token=$((8 * 8 * 128 * 2 * 2))

seqs_of() {	# kv p g -> sequences the pool holds at once (8: half a KV block of rounding)
	kvb=$(numfmt --from=iec "$1")
	awk -v b="$kvb" -v t="$per_token" -v p="$2" -v g="$3" 'BEGIN { s = int(b / t / (p + g / 2 + 8)); print (s < 1 ? 1 : s) }'
}
