# tests/model.mk: model loader tests, the mlens-mkmodel CLI test, the fuzz
# corpus replay (make check) and the libFuzzer target (make fuzz).
if HAVE_CHECK
check_PROGRAMS += tests/check_model
TESTS += tests/check_model
tests_check_model_SOURCES = tests/check_model.c tests/model_files.h
tests_check_model_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS)
tests_check_model_LDADD = daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CHECK_LIBS) $(JANSSON_LIBS)
endif

dist_check_SCRIPTS += tests/mkmodel_cli.sh
TESTS += tests/mkmodel_cli.sh

# Replays every committed corpus file through the fuzz target: built with
# $(CC), so the sanitizer build runs it under ASan and UBSan.
check_PROGRAMS += tests/fuzz/replay
TESTS += tests/fuzz/replay
tests_fuzz_replay_SOURCES = tests/fuzz/replay.c tests/fuzz/fuzz_model.c
tests_fuzz_replay_LDADD = daemon/libmlens_core.la
EXTRA_DIST += tests/fuzz/corpus

# The loader target: a config.json and a model.safetensors in one input,
# opened as a model directory (family binding, fp8 scales); its seeds are
# written by tests/fuzz/make_load_corpus.py.
check_PROGRAMS += tests/fuzz/replay_load
TESTS += tests/fuzz/replay_load
tests_fuzz_replay_load_SOURCES = tests/fuzz/replay.c tests/fuzz/fuzz_load.c
tests_fuzz_replay_load_CPPFLAGS = $(AM_CPPFLAGS) -DREPLAY_CORPUS='"tests/fuzz/load-corpus"'
tests_fuzz_replay_load_LDADD = daemon/libmlens_core.la
EXTRA_DIST += tests/fuzz/load-corpus tests/fuzz/make_load_corpus.py tests/fuzz/load.dict

# libFuzzer needs clang; automake compiles with $(CC), hence a plain rule.
# `make fuzz` builds it and `make fuzz-load` the loader's; run as:
# tests/fuzz/fuzz_model CORPUS_DIR,
# tests/fuzz/fuzz_load -dict=tests/fuzz/load.dict CORPUS_DIR
FUZZ_MODEL_LIB = $(top_srcdir)/daemon/model/safetensors.c $(top_srcdir)/daemon/model/model.c $(top_srcdir)/daemon/errf.c \
	$(top_srcdir)/daemon/model/family.c $(top_srcdir)/daemon/model/family_dbrx.c \
	$(top_srcdir)/daemon/model/quant.c \
	$(top_srcdir)/daemon/infile.c
FUZZ_MODEL_HDR = $(top_srcdir)/daemon/model/model.h $(top_srcdir)/daemon/model/family.h \
	$(top_srcdir)/daemon/model/safetensors.h $(top_srcdir)/daemon/model/model_int.h $(top_srcdir)/daemon/errf.h \
	$(top_srcdir)/daemon/model/quant.h $(top_srcdir)/daemon/infile.h
# each target is tests/fuzz/$(@F).c over the loader's sources
FUZZ_MODEL_LINK = $(AM_V_CCLD)$(MKDIR_P) tests/fuzz && \
	$(CLANG) -std=gnu11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
		-include $(top_builddir)/config.h -I$(top_srcdir) $(JANSSON_CFLAGS) \
		$(top_srcdir)/tests/fuzz/$(@F).c $(FUZZ_MODEL_LIB) $(JANSSON_LIBS) -lm -lpthread -o $@
if HAVE_CLANG
tests/fuzz/fuzz_model: $(top_srcdir)/tests/fuzz/fuzz_model.c $(FUZZ_MODEL_LIB) $(FUZZ_MODEL_HDR)
	$(FUZZ_MODEL_LINK)
tests/fuzz/fuzz_load: $(top_srcdir)/tests/fuzz/fuzz_load.c $(FUZZ_MODEL_LIB) $(FUZZ_MODEL_HDR)
	$(FUZZ_MODEL_LINK)
fuzz: tests/fuzz/fuzz_model
fuzz-load: tests/fuzz/fuzz_load
else
fuzz fuzz-load:
	@echo "make $@: configure found no clang, which libFuzzer needs" >&2; exit 1
endif
.PHONY: fuzz fuzz-load
CLEANFILES += tests/fuzz/fuzz_model tests/fuzz/fuzz_load
# the libFuzzer targets still build and run (skips without clang)
dist_check_SCRIPTS += tests/fuzz_build.sh
TESTS += tests/fuzz_build.sh

# Interoperability with Hugging Face transformers (skips without it).
check_PROGRAMS += tests/model_info
tests_model_info_SOURCES = tests/model_info.c
tests_model_info_LDADD = daemon/libmlens_core.la
dist_check_SCRIPTS += tests/model_hf_interop.sh
EXTRA_DIST += tests/model_hf_interop.py
TESTS += tests/model_hf_interop.sh

# DBRX and Mixtral-8x22B: config, files, the ops DBRX adds, 8x22B's ratios
if HAVE_CHECK
check_PROGRAMS += tests/check_dbrx
TESTS += tests/check_dbrx
tests_check_dbrx_SOURCES = tests/check_dbrx.c tests/model_files.h
tests_check_dbrx_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS)
tests_check_dbrx_LDADD = tests/libmlens_golden.la daemon/tools/libmlens_tools.la \
	daemon/libmlens_core.la $(CHECK_LIBS) $(JANSSON_LIBS)
endif
dist_check_SCRIPTS += tests/integration/dbrx.sh
TESTS += tests/integration/dbrx.sh
