#!/bin/sh
# The golden checks (tests/check_golden) through the hybrid pipeline with
# the CUDA backend on the GPU side and decode attention on the CPU, in
# both GEMM modes (see check_golden_cuda.sh): exits 77 (skip) when the
# build has no CUDA or the machine no GPU.
MLENS_TEST_BACKEND=hybrid
# CUDA does not survive fork(): Check runs the tests in this process
CK_FORK=no
export CK_FORK
export MLENS_TEST_BACKEND
exec "${MLENS_SRCDIR:-.}/tests/golden/run_gemm_modes.sh" "$@"
