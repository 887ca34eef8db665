# man/gateway.mk: mlens-gateway(8), its example config (installed under
# $(docdir)/examples) and its systemd unit (installed, not enabled).
dist_man_MANS += man/mlens-gateway.8
dist_mlensexample_DATA += man/mlens-gateway.conf.example

systemdsystemunit_DATA += man/mlens-gateway.service
EXTRA_DIST += man/mlens-gateway.service.in
CLEANFILES += man/mlens-gateway.service
man/mlens-gateway.service: $(top_srcdir)/man/mlens-gateway.service.in Makefile
	$(AM_V_GEN)$(MKDIR_P) man && \
	sed -e 's|@bindir[@]|$(bindir)|g' -e 's|@sysconfdir[@]|$(sysconfdir)|g' \
		$(top_srcdir)/man/mlens-gateway.service.in >$@.tmp && mv $@.tmp $@
