#!/bin/sh
# The golden checks (tests/check_golden) on the CPU backend with the
# avx512bf16 decode attention kernel (bf16 dot products: q and the softmax
# weights rounded to bf16), which "auto" never picks, so that its numerics
# are held against Hugging Face too. Exits 77 (skip) when the CPU lacks
# AVX512_BF16.
MLENS_ATTN_KERNEL=avx512bf16
export MLENS_ATTN_KERNEL
exec "${MLENS_BUILDDIR:-.}/tests/check_golden" "$@"
