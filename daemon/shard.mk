# daemon: several GPUs in one box (issue 9): the partitioning arithmetic
# and the single-process fake-collective path that checks it on the CPU.
daemon_libmlens_core_la_SOURCES += daemon/shard.h daemon/shard.c \
	daemon/shard_sim.h daemon/shard_sim.c
EXTRA_DIST += daemon/MULTINODE.md
