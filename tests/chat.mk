# tests/chat.mk: chat templates of libmlens. check_chat renders the golden
# cases of tests/chat/goldens.json (made by tests/chat/make_goldens.py with
# transformers, from the real templates in tests/chat/templates/) and the
# error and limit cases; the libFuzzer target (make fuzz-chat) parses and
# renders arbitrary templates, and tests/chat/fuzz.sh runs it briefly.
if HAVE_CHECK
check_PROGRAMS += tests/check_chat
TESTS += tests/check_chat
tests_check_chat_SOURCES = tests/check_chat.c
tests_check_chat_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS)
tests_check_chat_LDADD = client/libmlens.la $(CHECK_LIBS) $(JANSSON_LIBS)
endif
EXTRA_DIST += tests/chat/make_goldens.py tests/chat/goldens.json tests/chat/templates
