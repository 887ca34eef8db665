# daemon/model: a model directory: config.json and safetensors parsed and
# checked (each family's keys and names: family.c), and the weight pages
# read into pinned memory with io_uring.
daemon_libmlens_core_la_SOURCES += daemon/model/model.h daemon/model/model.c \
	daemon/model/model_int.h daemon/model/family.h daemon/model/family.c \
	daemon/model/safetensors.h daemon/model/safetensors.c \
	daemon/model/weights.h daemon/model/weights.c \
	daemon/model/disk_tier.h daemon/model/disk_tier.c \
	daemon/model/quant.h daemon/model/quant.c
# DBRX's config and tensor names (a family's description, not a layer)
daemon_libmlens_core_la_SOURCES += daemon/model/family_dbrx.c
