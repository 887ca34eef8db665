# daemon: the core library and mlensd. The rooms' fragments (daemon/ROOM/
# local.mk) add their sources to libmlens_core.la, so Makefile.am includes
# this file before them.
# Here: start-up (mlensd.c), configuration, logging, errors, pinned memory
# and the file reader every room uses.
noinst_LTLIBRARIES += daemon/libmlens_core.la
daemon_libmlens_core_la_SOURCES = daemon/config.h daemon/config.c \
	daemon/log.h daemon/log.c daemon/errf.h daemon/errf.c \
	daemon/mem.h daemon/mem.c daemon/infile.h daemon/infile.c
daemon_libmlens_core_la_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS) $(URING_CFLAGS) $(LIBEVENT_CFLAGS)
daemon_libmlens_core_la_LIBADD = kernels/libmlens_kernels.la $(JANSSON_LIBS) $(URING_LIBS) $(LIBEVENT_LIBS) $(NUMA_LIBS) $(PTHREAD_LIBS) -lm
daemon_libmlens_core_la_LIBADD += shm/libmlens_shm.la

sbin_PROGRAMS += daemon/mlensd
daemon_mlensd_SOURCES = daemon/mlensd.c
daemon_mlensd_CFLAGS = $(AM_CFLAGS) $(LIBEVENT_CFLAGS)
daemon_mlensd_LDADD = daemon/libmlens_core.la $(LIBEVENT_LIBS)
EXTRA_DIST += daemon/THREADS.md daemon/MULTINODE.md
