# kernels/simd.mk: the SIMD decode attention kernels. Each ISA level is a
# convenience library of its own so that only its files get the -m flags;
# attn.c picks among them at run time from CPUID.
noinst_LTLIBRARIES += kernels/libmlens_attn_avx2.la kernels/libmlens_attn_avx512.la
kernels_libmlens_attn_avx2_la_SOURCES = kernels/cpu/attn_avx2.c kernels/cpu/attn_int.h
kernels_libmlens_attn_avx2_la_CFLAGS = $(AM_CFLAGS) -O3 -mavx2 -mfma -mf16c
kernels_libmlens_attn_avx512_la_SOURCES = kernels/cpu/attn_avx512.c kernels/cpu/attn_int.h
kernels_libmlens_attn_avx512_la_CFLAGS = $(AM_CFLAGS) -O3 -mavx512f -mavx512bw -mavx512vl -mfma
EXTRA_DIST += kernels/cpu/attn_simd.inc

kernels_libmlens_kernels_la_SOURCES += kernels/cpu/attn.c kernels/cpu/attn.h kernels/cpu/attn_int.h
kernels_libmlens_kernels_la_LIBADD += kernels/libmlens_attn_avx2.la \
	kernels/libmlens_attn_avx512.la $(NUMA_LIBS)
