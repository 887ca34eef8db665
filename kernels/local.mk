# kernels: the backend interface and its implementations (libmlens_kernels.la).
noinst_LTLIBRARIES += kernels/libmlens_kernels.la
kernels_libmlens_kernels_la_SOURCES = \
	kernels/backend.h kernels/dtype.h kernels/fp8.h kernels/wscale.h kernels/kv.h kernels/backend.c \
	kernels/cpu/cpu.h kernels/cpu/pool.h kernels/cpu/pool.c \
	kernels/cpu/backend_cpu.c kernels/cpu/readbw.h kernels/cpu/readbw.c
kernels_libmlens_kernels_la_CFLAGS = $(AM_CFLAGS) -O3
kernels_libmlens_kernels_la_LIBADD = $(PTHREAD_LIBS) -lm
