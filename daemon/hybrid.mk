# daemon: the hybrid pipeline (issue 7): GPU memory plan, step program and
# the executor that streams experts and runs decode attention on the CPU.
daemon_libmlens_core_la_SOURCES += daemon/gpuplan.h daemon/gpuplan.c \
	daemon/pipeprog.h daemon/pipeprog.c daemon/pipeline.h daemon/pipeline.c
