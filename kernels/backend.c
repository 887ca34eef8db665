/* Backend selection by name. */
#include <errno.h>
#include <limits.h>
#include <string.h>
#include "kernels/backend.h"

int mlens_backend_create(struct mlens_backend *be, const char *name,
			 const struct mlens_backend_opts *o)
{
	if (!name || !strcmp(name, "cpu"))
		return mlens_backend_cpu_create(be, o);
	if (!strcmp(name, "cuda")) {
#ifdef HAVE_CUDA
		return mlens_backend_cuda_create(be, o);
#else
		return -ENOTSUP;
#endif
	}
	if (!strcmp(name, "auto")) {
#ifdef HAVE_CUDA
		if (mlens_cuda_available() && mlens_backend_cuda_create(be, o) == 0)
			return 0;
#endif
		return mlens_backend_cpu_create(be, o);
	}
	return -EINVAL;
}

int mlens_gemm_mode_parse(const char *s, enum mlens_gemm_mode *out)
{
	if (s && !strcmp(s, "fast"))
		*out = MLENS_GEMM_FAST;
	else if (s && !strcmp(s, "exact"))
		*out = MLENS_GEMM_EXACT;
	else
		return -EINVAL;
	return 0;
}

const char *mlens_gemm_mode_name(enum mlens_gemm_mode m)
{
	return m == MLENS_GEMM_EXACT ? "exact" : "fast";
}

/* The index of s in names[count], or -EINVAL: the enums named in order. */
static int name_index(const char *const *names, size_t count, const char *s)
{
	for (size_t i = 0; s && i < count; i++)
		if (!strcmp(s, names[i]))
			return (int)i;
	return -EINVAL;
}

#define NAMES_COUNT(a) (sizeof(a) / sizeof((a)[0]))

static const char *const sync_names[] = { "auto", "spin", "yield", "block" };

int mlens_gpu_sync_parse(const char *s, enum mlens_gpu_sync *out)
{
	int i = name_index(sync_names, NAMES_COUNT(sync_names), s);
	if (i < 0)
		return i;
	*out = (enum mlens_gpu_sync)i;
	return 0;
}

const char *mlens_gpu_sync_name(enum mlens_gpu_sync m)
{
	return (unsigned)m < NAMES_COUNT(sync_names) ? sync_names[m] : "?";
}

static const char *const grouped_names[] = { "auto", "on", "off" };

int mlens_moe_grouped_parse(const char *s, enum mlens_moe_grouped *out)
{
	int i = name_index(grouped_names, NAMES_COUNT(grouped_names), s);
	if (i < 0)
		return i;
	*out = (enum mlens_moe_grouped)i;
	return 0;
}

const char *mlens_moe_grouped_name(enum mlens_moe_grouped m)
{
	return (unsigned)m < NAMES_COUNT(grouped_names) ? grouped_names[m] : "?";
}

#ifdef HAVE_CUDA
/* kernels/cuda/backend_cuda.cu */
int mlens_cuda_pci_bus_id(int device, char *buf, int len);
#else
/* Without the CUDA backend there is no GPU to offer (the CUDA build
 * defines this in kernels/cuda/backend_cuda.cu). */
bool mlens_cuda_available(void)
{
	return false;
}
#endif

int mlens_gpu_bus_id(int device, char *buf, size_t len)
{
#ifdef HAVE_CUDA
	if (len > 0 && mlens_cuda_available())
		return mlens_cuda_pci_bus_id(device, buf, len > INT_MAX ? INT_MAX : (int)len);
#else
	(void)device;
	(void)buf;
	(void)len;
#endif
	return -ENODEV;
}
