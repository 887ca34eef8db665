# client/gateway.mk: mlens-gateway, the OpenAI-compatible HTTP server that
# is a tenant of mlensd (libmlens + libevent's evhttp). Its settings, JSON
# and text parts are a small library of their own so that
# tests/check_gateway can exercise them.
noinst_LTLIBRARIES += client/libmlens_gateway.la
client_libmlens_gateway_la_SOURCES = client/gateway_int.h client/gateway_conf.c \
	client/gateway_api.c
client_libmlens_gateway_la_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS)
client_libmlens_gateway_la_LIBADD = client/libmlens_textgen.la client/libmlens.la $(JANSSON_LIBS)

bin_PROGRAMS += client/mlens-gateway
client_mlens_gateway_SOURCES = client/gateway.c
client_mlens_gateway_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS) $(LIBEVENT_CFLAGS)
client_mlens_gateway_LDADD = client/libmlens_gateway.la client/libmlens.la $(JANSSON_LIBS) \
	$(LIBEVENT_LIBS)
