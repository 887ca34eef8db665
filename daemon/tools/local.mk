# daemon/tools: programs that do not serve, outside the core library: the
# random-weight model writer (mlens-mkmodel, and the library the tests use to
# write models), the single-process shard simulation, and mlens-local (the
# engine in-process on a model directory). libmlens_tools.la comes before
# libmlens_core.la on a link line. The programs keep their daemon/ paths.
noinst_LTLIBRARIES += daemon/tools/libmlens_tools.la
daemon_tools_libmlens_tools_la_SOURCES = daemon/tools/mkmodel.h daemon/tools/mkmodel_lib.c daemon/tools/mkmodel_tok.c \
	daemon/tools/shard_sim.h daemon/tools/shard_sim.c

bin_PROGRAMS += daemon/mlens-mkmodel
daemon_mlens_mkmodel_SOURCES = daemon/tools/mkmodel.c
daemon_mlens_mkmodel_LDADD = daemon/tools/libmlens_tools.la daemon/libmlens_core.la
dist_man_MANS += man/mlens-mkmodel.1

noinst_PROGRAMS += daemon/mlens-local
daemon_mlens_local_SOURCES = daemon/tools/local_main.c daemon/tools/toolopt.h
daemon_mlens_local_LDADD = daemon/libmlens_core.la

# mlens-kvcompare: the accuracy of fp8 experts (quantized at load or an fp8
# checkpoint) and of the fp8 KV cache against bf16 (or fp32), in-process:
# greedy agreement and log-probability differences.
noinst_PROGRAMS += daemon/mlens-kvcompare
daemon_mlens_kvcompare_SOURCES = daemon/tools/kvcompare.c daemon/tools/toolopt.h
daemon_mlens_kvcompare_LDADD = daemon/libmlens_core.la -lm
