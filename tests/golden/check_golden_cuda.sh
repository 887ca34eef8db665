#!/bin/sh
# The golden checks (tests/check_golden) on the CUDA backend: exits 77
# (skip) when the build has no CUDA or the machine no GPU.
MLENS_TEST_BACKEND=cuda
export MLENS_TEST_BACKEND
exec "${MLENS_BUILDDIR:-.}/tests/check_golden" "$@"
