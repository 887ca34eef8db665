#!/bin/sh
# Description: mlensd refuses at start-up, at once and naming the file or
# the key, what it cannot serve: a FIFO given as its configuration file, as
# a model's config.json or as its model.safetensors (opening one used to
# wait for a writer for ever), a model whose max_position_embeddings
# cannot hold a prompt and one generated token, and a resident_experts
# above the model's experts a layer.
set -u
. "$(dirname "$0")/lib.sh"

"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny >/dev/null || fail "mlens-mkmodel"

mkfifo "$tmp/conf"
refused 2 "$tmp/conf: not a regular file (a FIFO)" --config "$tmp/conf" --model "$tmp/m"

cp -r "$tmp/m" "$tmp/f1"
rm "$tmp/f1/model.safetensors" && mkfifo "$tmp/f1/model.safetensors"
refused 1 "$tmp/f1/model.safetensors: not a regular file (a FIFO)" --model "$tmp/f1"

cp -r "$tmp/m" "$tmp/f2"
rm "$tmp/f2/config.json" && mkfifo "$tmp/f2/config.json"
refused 1 "$tmp/f2/config.json: not a regular file (a FIFO)" --model "$tmp/f2"

cp -r "$tmp/m" "$tmp/p1"
sed 's/"max_position_embeddings": *[0-9]*/"max_position_embeddings": 1/' "$tmp/m/config.json" >"$tmp/p1/config.json"
grep -q '"max_position_embeddings": 1,' "$tmp/p1/config.json" || fail "config.json not edited"
refused 1 "'max_position_embeddings' is 1; mlens accepts 2 to" --model "$tmp/p1"
echo "ok: FIFOs and a one-position model refused at start-up, named"

refused 1 "resident_experts = 5 is more than the 4 experts a layer of model $tmp/m; set it to at most 4" \
	--model "$tmp/m" --resident-experts 5
echo "ok: resident_experts above the model's experts refused at start-up, named"
