# tests/golden: numerics against Hugging Face transformers. The fixtures
# (model files + references) are made by tests/golden/make_golden.py (Mixtral),
# make_golden_families.py (Qwen3-MoE, Qwen2-MoE, OLMoE), make_golden_fp8.py
# (fp8 Mixtral) and make_golden_dbrx.py (DBRX), which also write
# tests/golden/files.mk, files_families.mk, files_fp8.mk and files_dbrx.mk,
# the lists of their files.
include tests/golden/files.mk
include tests/golden/files_families.mk
include tests/golden/files_fp8.mk
include tests/golden/files_dbrx.mk

noinst_LTLIBRARIES += tests/libmlens_golden.la
tests_libmlens_golden_la_SOURCES = tests/golden/golden.h tests/golden/golden.c
tests_libmlens_golden_la_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS)
tests_libmlens_golden_la_CPPFLAGS = $(AM_CPPFLAGS) -DMLENS_GOLDEN_SRCDIR='"$(abs_top_srcdir)"'
tests_libmlens_golden_la_LIBADD = $(JANSSON_LIBS) -lm

dist_noinst_DATA += $(GOLDEN_FIXTURES) $(GOLDEN_FIXTURES_FAMILIES) $(GOLDEN_FP8_FIXTURES) $(GOLDEN_FIXTURES_DBRX)
EXTRA_DIST += tests/golden/make_golden_dbrx.py tests/golden/files_dbrx.mk
EXTRA_DIST += tests/golden/make_golden.py tests/golden/make_golden_families.py \
	tests/golden/README.md tests/golden/files.mk tests/golden/files_families.mk \
	tests/golden/make_golden_fp8.py tests/golden/files_fp8.mk \
	tests/golden/check_golden_cuda.sh tests/golden/run_gemm_modes.sh

if HAVE_CHECK
check_PROGRAMS += tests/check_golden
TESTS += tests/check_golden
tests_check_golden_SOURCES = tests/check_golden.c tests/gpulock.h
tests_check_golden_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_golden_LDADD = tests/libmlens_golden.la daemon/libmlens_core.la $(CHECK_LIBS)
if HAVE_CUDA
TESTS += tests/golden/check_golden_cuda.sh
endif
endif
