# client/chat.mk: chat templates in libmlens (public header mlens_chat.h):
# a Jinja interpreter for the chat_template of a model's tokenizer config.
include_HEADERS += client/mlens_chat.h
client_libmlens_la_SOURCES += client/chat_template.c client/chat_template_int.h \
	client/chat_template_parse.c client/chat_template_eval.c \
	client/chat_template_value.c client/chat_template_lib.c
client_libmlens_la_CFLAGS += $(JANSSON_CFLAGS)
client_libmlens_la_LIBADD += $(JANSSON_LIBS) -lm
