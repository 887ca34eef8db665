#!/bin/sh
# The mlens demo on a fresh Debian 12 machine: install what is missing,
# build, write a small random-weight Mixtral model, and generate from a
# batch of prompts through the engine, printing tokens and tokens/s.
set -e
cd "$(dirname "$0")/.."
./tests/setup-deps.sh
top=$(pwd)
mkdir -p _build && cd _build
[ -f Makefile ] || "$top/configure" -q
make -j"$(nproc)" >/dev/null
model=$(mktemp -d /tmp/mlens-demo.XXXXXX)
trap 'rm -rf "$model"' EXIT
./daemon/mlens-mkmodel -o "$model" --preset tiny --seed 7
echo
echo "== generating: 8 prompts of 24 tokens, 32 new tokens each (CPU engine, greedy)"
./daemon/mlens-local --model "$model" --prompts 8 --prompt-len 24 --max-tokens 32
