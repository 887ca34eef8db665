# daemon/exec: running a step: the decoder layer, the step around it, the
# engine and its op time account, the KV block pool and its swap file, and the hybrid pipeline's step program and
# executor.
daemon_libmlens_core_la_SOURCES += daemon/exec/layer.h daemon/exec/layer.c \
	daemon/exec/step.h daemon/exec/step.c \
	daemon/exec/engine.h daemon/exec/engine.c \
	daemon/exec/op_time.h daemon/exec/op_time.c \
	daemon/exec/kv_pool.h daemon/exec/kv_pool.c \
	daemon/exec/kv_swap.h daemon/exec/kv_swap.c \
	daemon/exec/pipeprog.h daemon/exec/pipeprog.c \
	daemon/exec/residency.h daemon/exec/residency.c \
	daemon/exec/pipeline.h daemon/exec/pipeline.c
