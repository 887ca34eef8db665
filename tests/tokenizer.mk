# tests/tokenizer.mk: the tokenizer of libmlens against Hugging Face
# goldens (check_tokenizer), the mlens tokenize/detokenize CLI, the
# tokenizer.json fuzz target's corpus replay (make check) and libFuzzer
# target (make fuzz-tokenizer).
if HAVE_CHECK
check_PROGRAMS += tests/check_tokenizer
TESTS += tests/check_tokenizer
tests_check_tokenizer_SOURCES = tests/check_tokenizer.c
tests_check_tokenizer_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS)
tests_check_tokenizer_LDADD = client/libmlens.la $(CHECK_LIBS) $(JANSSON_LIBS) $(PTHREAD_LIBS)
endif
EXTRA_DIST += tests/tokenizer/make_fixtures.py tests/tokenizer/fixtures
