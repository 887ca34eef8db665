# man pages of the chat-template API (mlens_chat.h): one page per function.
dist_man_MANS += man/mlens_chat_template_open.3 man/mlens_chat_template_parse.3 \
	man/mlens_chat_template_render.3 man/mlens_chat_template_free.3
