# daemon: core library (model, KV pool, engine) and mlensd.
noinst_LTLIBRARIES += daemon/libmlens_core.la
daemon_libmlens_core_la_SOURCES = daemon/model.h
daemon_libmlens_core_la_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS) $(URING_CFLAGS) $(LIBEVENT_CFLAGS)
daemon_libmlens_core_la_LIBADD = kernels/libmlens_kernels.la $(JANSSON_LIBS) $(URING_LIBS) $(LIBEVENT_LIBS) $(NUMA_LIBS) $(PTHREAD_LIBS) -lm
daemon_libmlens_core_la_SOURCES += daemon/kv_pool.h daemon/kv_pool.c daemon/engine.h daemon/engine.c \
	daemon/layer.h daemon/layer.c daemon/step.h daemon/step.c
daemon_libmlens_core_la_SOURCES += daemon/sched.h daemon/sched.c
daemon_libmlens_core_la_SOURCES += daemon/log.h daemon/log.c daemon/errf.h daemon/errf.c
daemon_libmlens_core_la_SOURCES += daemon/infile.h daemon/infile.c
daemon_libmlens_core_la_SOURCES += daemon/config.h daemon/config.c
daemon_libmlens_core_la_SOURCES += daemon/mem.h daemon/mem.c
daemon_libmlens_core_la_SOURCES += daemon/weights.h daemon/weights.c

# mlens-local: the engine in-process on a model directory (demo, measurement)
noinst_PROGRAMS += daemon/mlens-local
daemon_mlens_local_SOURCES = daemon/local_main.c
daemon_mlens_local_LDADD = daemon/libmlens_core.la
daemon_libmlens_core_la_SOURCES += daemon/tenant.h daemon/tenant.c daemon/worker.h daemon/worker.c
daemon_libmlens_core_la_LIBADD += shm/libmlens_shm.la
daemon_libmlens_core_la_SOURCES += daemon/server.h daemon/server.c

sbin_PROGRAMS += daemon/mlensd
daemon_mlensd_SOURCES = daemon/mlensd.c
daemon_mlensd_CFLAGS = $(AM_CFLAGS) $(LIBEVENT_CFLAGS)
daemon_mlensd_LDADD = daemon/libmlens_core.la $(LIBEVENT_LIBS)
EXTRA_DIST += daemon/THREADS.md
