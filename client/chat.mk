# client/chat.mk: chat templates in libmlens (public header mlens_chat.h):
# a Jinja interpreter for the chat_template of a model's tokenizer config.
# A convenience library of its own, so that the fuzz replay links its
# insides; libmlens takes it whole.
include_HEADERS += client/mlens_chat.h
noinst_LTLIBRARIES += client/libmlens_chat.la
client_libmlens_chat_la_SOURCES = client/chat_template.c client/chat_template_int.h \
	client/chat_template_parse.c client/chat_template_eval.c \
	client/chat_template_value.c client/chat_template_lib.c
client_libmlens_chat_la_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS)
client_libmlens_chat_la_LIBADD = $(JANSSON_LIBS) -lm
client_libmlens_la_LIBADD += client/libmlens_chat.la
