# shm: tenant region layout, SPSC rings, protocol messages (libmlens_shm.la),
# linked by both the daemon and the client library.
noinst_LTLIBRARIES += shm/libmlens_shm.la
shm_libmlens_shm_la_SOURCES = \
	shm/barrier.h shm/ring.h shm/ring.c shm/region.h shm/region.c \
	shm/proto.h shm/proto.c shm/shm_int.h
shm_libmlens_shm_la_CFLAGS = $(AM_CFLAGS) -O2
noinst_HEADERS += shm/attach.h
