# tests/tokenizer.mk: the tokenizer of libmlens against Hugging Face
# goldens (check_tokenizer), the mlens tokenize/detokenize CLI, the
# tokenizer.json fuzz target's corpus replay (make check) and libFuzzer
# target (make fuzz-tokenizer, run by tests/fuzz_build.sh).
if HAVE_CHECK
check_PROGRAMS += tests/check_tokenizer
TESTS += tests/check_tokenizer
tests_check_tokenizer_SOURCES = tests/check_tokenizer.c
tests_check_tokenizer_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS)
tests_check_tokenizer_LDADD = client/libmlens.la $(CHECK_LIBS) $(JANSSON_LIBS) $(PTHREAD_LIBS)
endif
EXTRA_DIST += tests/tokenizer/make_fixtures.py tests/tokenizer/fixtures
dist_check_SCRIPTS += tests/tokenizer/cli.sh
TESTS += tests/tokenizer/cli.sh

# Replays every committed corpus file through the tokenizer's fuzz target
# (built with $(CC): the sanitizer build runs it under ASan and UBSan).
TOKENIZER_SRC = client/tokenizer_int.h client/tokenizer.c client/tokenizer_encode.c \
	client/tokenizer_decode.c
check_PROGRAMS += tests/tokenizer/fuzz_replay
TESTS += tests/tokenizer/fuzz_replay
tests_tokenizer_fuzz_replay_SOURCES = tests/fuzz/replay.c tests/fuzz/fuzz_tokenizer.c $(TOKENIZER_SRC)
tests_tokenizer_fuzz_replay_CPPFLAGS = $(AM_CPPFLAGS) -DREPLAY_CORPUS='"tests/tokenizer/fuzz_corpus"'
tests_tokenizer_fuzz_replay_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS) $(PCRE2_CFLAGS) $(UTF8PROC_CFLAGS)
tests_tokenizer_fuzz_replay_LDADD = $(JANSSON_LIBS) $(PCRE2_LIBS) $(UTF8PROC_LIBS) $(PTHREAD_LIBS)
EXTRA_DIST += tests/tokenizer/fuzz_corpus

# libFuzzer needs clang: a plain rule, as tests/model.mk's.
# `make fuzz-tokenizer` builds it; run as: tests/fuzz/fuzz_tokenizer CORPUS_DIR
FUZZ_TOKENIZER_SRC = $(top_srcdir)/tests/fuzz/fuzz_tokenizer.c $(top_srcdir)/client/tokenizer.c \
	$(top_srcdir)/client/tokenizer_encode.c $(top_srcdir)/client/tokenizer_decode.c
if HAVE_CLANG
tests/fuzz/fuzz_tokenizer: $(FUZZ_TOKENIZER_SRC) $(top_srcdir)/client/tokenizer_int.h \
		$(top_srcdir)/client/mlens_tokenizer.h
	$(AM_V_CCLD)$(MKDIR_P) tests/fuzz && \
	$(CLANG) -std=gnu11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
		-include $(top_builddir)/config.h -I$(top_srcdir) -I$(top_srcdir)/client \
		$(JANSSON_CFLAGS) $(PCRE2_CFLAGS) $(UTF8PROC_CFLAGS) \
		$(FUZZ_TOKENIZER_SRC) $(JANSSON_LIBS) $(PCRE2_LIBS) $(UTF8PROC_LIBS) -lpthread -o $@
fuzz-tokenizer: tests/fuzz/fuzz_tokenizer
else
fuzz-tokenizer:
	@echo "make fuzz-tokenizer: configure found no clang, which libFuzzer needs" >&2; exit 1
endif
.PHONY: fuzz-tokenizer
CLEANFILES += tests/fuzz/fuzz_tokenizer

# mlens-bench tokenizer
tests_bench_mlens_bench_SOURCES += tests/bench/bench_tokenizer.c
EXTRA_DIST += tests/tokenizer/hf_random.py
