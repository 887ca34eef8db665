# client/gateway.mk: mlens-gateway, the OpenAI-compatible HTTP server that
# is a tenant of mlensd (libmlens + libevent's evhttp).
bin_PROGRAMS += client/mlens-gateway
client_mlens_gateway_SOURCES = client/gateway_int.h client/gateway.c client/gateway_conf.c \
	client/gateway_api.c client/gateway_text.h client/gateway_text.c
client_mlens_gateway_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS) $(LIBEVENT_CFLAGS)
client_mlens_gateway_LDADD = client/libmlens.la $(JANSSON_LIBS) $(LIBEVENT_LIBS)
