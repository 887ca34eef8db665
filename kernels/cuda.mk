# kernels/cuda: the CUDA backend (libmlens_cuda.la), built only when
# configure finds the toolkit; linked into libmlens_kernels.la. The .cu
# files go through the .cu.lo rule of the top-level Makefile.am.
MLENS_CU_SRCS = kernels/cuda/backend_cuda.cu kernels/cuda/ops_cuda.cu \
	kernels/cuda/attn_cuda.cu kernels/cuda/moe_grouped.cu
MLENS_CU_HDRS = kernels/cuda/cuda_int.h
# shipped even when this build has no CUDA
EXTRA_DIST += $(MLENS_CU_SRCS) $(MLENS_CU_HDRS)

if HAVE_CUDA
noinst_LTLIBRARIES += kernels/libmlens_cuda.la
kernels_libmlens_cuda_la_SOURCES = $(MLENS_CU_SRCS) $(MLENS_CU_HDRS)
# nvcc's host code is C++: the C link needs libstdc++ beside cudart
kernels_libmlens_cuda_la_LIBADD = $(CUDA_LIBS) -lstdc++
kernels_libmlens_kernels_la_LIBADD += kernels/libmlens_cuda.la $(CUDA_LIBS)
# no dependency tracking for nvcc: rebuild every .cu when a header changes
$(MLENS_CU_SRCS:.cu=.lo): $(MLENS_CU_HDRS) kernels/backend.h kernels/kv.h \
	kernels/dtype.h kernels/cpu/cpu.h config.h
endif
