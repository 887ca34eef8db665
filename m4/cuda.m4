# MLENS_CHECK_CUDA: optional CUDA toolkit + nvcc + cuBLAS.
#   --with-cuda[=DIR]     (default: check /usr/local/cuda; "no" disables)
#   --with-cuda-arch=LIST (default: "90": sm_90 SASS plus compute_90 PTX)
# Defines HAVE_CUDA, AM_CONDITIONAL HAVE_CUDA, and substitutes NVCC,
# CUDA_CFLAGS, CUDA_LIBS, NVCC_FLAGS.
AC_DEFUN([MLENS_CHECK_CUDA], [
  AC_ARG_WITH([cuda],
    [AS_HELP_STRING([--with-cuda@<:@=DIR@:>@], [build the CUDA backend (toolkit in DIR, default /usr/local/cuda)])],
    [], [with_cuda=check])
  AC_ARG_WITH([cuda-arch],
    [AS_HELP_STRING([--with-cuda-arch=LIST], [comma-separated SM versions (default: 90)])],
    [], [with_cuda_arch=90])
  mlens_have_cuda=no
  mlens_cuda_summary=no
  AS_IF([test "x$with_cuda" != xno], [
    AS_CASE([$with_cuda], [yes|check], [cuda_dir=/usr/local/cuda], [cuda_dir=$with_cuda])
    AC_PATH_PROG([NVCC], [nvcc], [], [$cuda_dir/bin:$PATH])
    AS_IF([test -n "$NVCC" && test -f "$cuda_dir/include/cuda_runtime.h"], [
      CUDA_CFLAGS="-I$cuda_dir/include"
      cuda_libdir="$cuda_dir/lib64"
      AS_IF([test -d "$cuda_dir/targets/x86_64-linux/lib"], [cuda_libdir="$cuda_dir/targets/x86_64-linux/lib"])
      CUDA_LIBS="-L$cuda_libdir -Wl,-rpath,$cuda_libdir -lcublasLt -lcublas -lcudart"
      save_LIBS=$LIBS
      LIBS="$LIBS -L$cuda_libdir -lcudart"
      AC_MSG_CHECKING([for cudaMalloc in libcudart])
      AC_LINK_IFELSE([AC_LANG_PROGRAM([[void *cudaMalloc(void **, unsigned long);]], [[void *p; cudaMalloc(&p, 1);]])],
        [AC_MSG_RESULT([yes]); mlens_have_cuda=yes], [AC_MSG_RESULT([no])])
      LIBS=$save_LIBS
      NVCC_FLAGS="-std=c++17 -O3 -Xcompiler -fPIC -Xcompiler -Wall"
      for a in `echo $with_cuda_arch | tr ',' ' '`; do
        NVCC_FLAGS="$NVCC_FLAGS -gencode arch=compute_$a,code=sm_$a"
        last_arch=$a
      done
      NVCC_FLAGS="$NVCC_FLAGS -gencode arch=compute_$last_arch,code=compute_$last_arch"
    ])
    AS_IF([test "x$mlens_have_cuda" = xno && test "x$with_cuda" != xcheck],
      [AC_MSG_ERROR([--with-cuda given but no usable toolkit (nvcc, cuda_runtime.h, libcudart) in $cuda_dir])])
  ])
  AS_IF([test "x$mlens_have_cuda" = xyes], [
    AC_DEFINE([HAVE_CUDA], [1], [Define if the CUDA backend is built])
    mlens_cuda_summary="yes ($NVCC, sm_$with_cuda_arch + PTX)"
  ], [
    AS_IF([test "x$with_cuda" = xno], [mlens_cuda_summary="no (disabled)"], [mlens_cuda_summary="no (toolkit not found)"])
  ])
  AM_CONDITIONAL([HAVE_CUDA], [test "x$mlens_have_cuda" = xyes])
  AC_SUBST([NVCC])
  AC_SUBST([CUDA_CFLAGS])
  AC_SUBST([CUDA_LIBS])
  AC_SUBST([NVCC_FLAGS])
])
