# tests/chat.mk: chat templates of libmlens. check_chat renders the golden
# cases of tests/chat/goldens.json (made by tests/chat/make_goldens.py with
# transformers, from the real templates in tests/chat/templates/) and the
# error, limit and loading cases. tests/chat/fuzz.sh replays the templates
# and the fuzz corpus through the libFuzzer target's entry point, and runs
# the libFuzzer target (make fuzz-chat) briefly when clang is there.
if HAVE_CHECK
check_PROGRAMS += tests/check_chat
TESTS += tests/check_chat
tests_check_chat_SOURCES = tests/check_chat.c
tests_check_chat_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS)
tests_check_chat_LDADD = client/libmlens.la $(CHECK_LIBS) $(JANSSON_LIBS) $(PTHREAD_LIBS)
endif
EXTRA_DIST += tests/chat/make_goldens.py tests/chat/goldens.json tests/chat/templates \
	tests/chat/fuzz-corpus

check_PROGRAMS += tests/chat/replay_chat
tests_chat_replay_chat_SOURCES = tests/fuzz/replay.c tests/fuzz/fuzz_chat.c
tests_chat_replay_chat_LDADD = client/libmlens_chat.la
dist_check_SCRIPTS += tests/chat/fuzz.sh
TESTS += tests/chat/fuzz.sh

# libFuzzer needs clang; automake compiles with $(CC), hence a plain rule.
# `make fuzz-chat` builds it; run as: tests/fuzz/fuzz_chat [CORPUS_DIR]
FUZZ_CHAT_SRC = $(top_srcdir)/tests/fuzz/fuzz_chat.c $(top_srcdir)/client/chat_template.c \
	$(top_srcdir)/client/chat_template_parse.c $(top_srcdir)/client/chat_template_eval.c \
	$(top_srcdir)/client/chat_template_value.c $(top_srcdir)/client/chat_template_lib.c
if HAVE_CLANG
tests/fuzz/fuzz_chat: $(FUZZ_CHAT_SRC) $(top_srcdir)/client/chat_template_int.h \
		$(top_srcdir)/client/mlens_chat.h
	$(AM_V_CCLD)$(MKDIR_P) tests/fuzz && \
	$(CLANG) -std=gnu11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
		-include $(top_builddir)/config.h -I$(top_srcdir) $(JANSSON_CFLAGS) \
		$(FUZZ_CHAT_SRC) $(JANSSON_LIBS) -lm -o $@
fuzz-chat: tests/fuzz/fuzz_chat
else
fuzz-chat:
	@echo "make fuzz-chat: configure found no clang, which libFuzzer needs" >&2; exit 1
endif
.PHONY: fuzz-chat
CLEANFILES += tests/fuzz/fuzz_chat
