# daemon: core library (model, KV pool, engine) and mlensd.
noinst_LTLIBRARIES += daemon/libmlens_core.la
daemon_libmlens_core_la_SOURCES = daemon/model.h
daemon_libmlens_core_la_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS)
daemon_libmlens_core_la_LIBADD = kernels/libmlens_kernels.la $(JANSSON_LIBS) $(PTHREAD_LIBS) -lm
