# daemon/plan: what the daemon decides before it serves: the GPU memory
# plan (gpu_plan: GPU-only mode and the hybrid pipeline), the performance
# model, the pipeline profiler and the multi-GPU shard plan.
daemon_libmlens_core_la_SOURCES += daemon/plan/gpu_plan.h daemon/plan/gpu_plan.c \
	daemon/plan/perfmodel.h daemon/plan/perfmodel.c \
	daemon/plan/profiler.h daemon/plan/profiler.c \
	daemon/plan/shard.h daemon/plan/shard.c
# the host memory plan: host_memory split among weight pages, KV pool, staging
daemon_libmlens_core_la_SOURCES += daemon/plan/host_plan.h daemon/plan/host_plan.c
