# man/ops.mk: mlensd(8), mlensctl(8), mlensd.conf(5), the example config
# (installed under $(docdir)/examples) and the systemd unit (installed to
# $(systemdsystemunitdir), not enabled).
dist_man_MANS += man/mlensd.8 man/mlensctl.8 man/mlensd.conf.5

mlensexampledir = $(docdir)/examples
dist_mlensexample_DATA = man/mlensd.conf.example

systemdsystemunit_DATA = man/mlensd.service
EXTRA_DIST += man/mlensd.service.in
CLEANFILES += man/mlensd.service
# paths are substituted at make time: configure leaves ${prefix} unexpanded
man/mlensd.service: $(top_srcdir)/man/mlensd.service.in Makefile
	$(AM_V_GEN)$(MKDIR_P) man && \
	sed -e 's|@sbindir[@]|$(sbindir)|g' -e 's|@sysconfdir[@]|$(sysconfdir)|g' \
		$(top_srcdir)/man/mlensd.service.in >$@.tmp && mv $@.tmp $@
