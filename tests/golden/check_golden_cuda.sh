#!/bin/sh
# The golden checks (tests/check_golden) on the CUDA backend, twice: exact
# GEMMs (every fixture at its own tolerances, all steps) and fast GEMMs
# (half-precision fixtures at a looser tolerance, compared up to where the
# fast GEMMs may flip an expert choice). Exits 77 (skip) when the build has
# no CUDA or the machine no GPU.
MLENS_TEST_BACKEND=cuda
export MLENS_TEST_BACKEND
exec "${MLENS_SRCDIR:-.}/tests/golden/run_gemm_modes.sh" "$@"
