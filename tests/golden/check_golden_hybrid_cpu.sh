#!/bin/sh
# The golden checks (tests/check_golden) through the hybrid pipeline with
# the CPU backend on both sides (the step program run in order), so that
# CI checks the pipeline's numerics against Hugging Face without a GPU.
MLENS_TEST_BACKEND=hybrid-cpu
export MLENS_TEST_BACKEND
exec "${MLENS_BUILDDIR:-.}/tests/check_golden" "$@"
