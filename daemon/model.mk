# daemon/model.mk: model loading (safetensors + config.json) and the
# random-weight model writer mlens-mkmodel.
daemon_libmlens_core_la_SOURCES += \
	daemon/model.c daemon/safetensors.c daemon/safetensors.h \
	daemon/mkmodel.h daemon/mkmodel_lib.c

bin_PROGRAMS += daemon/mlens-mkmodel
daemon_mlens_mkmodel_SOURCES = daemon/mkmodel.c
daemon_mlens_mkmodel_LDADD = daemon/libmlens_core.la

dist_man_MANS += man/mlens-mkmodel.1
