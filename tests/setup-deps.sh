#!/bin/sh
# Install the Debian 12 packages mlens builds and tests with, when missing,
# then generate the build system. Used by tests/demo.sh and tests/run-all.sh.
set -e
pkgs="build-essential autoconf automake libtool pkg-config liburing-dev libnuma-dev
libevent-dev libjansson-dev libpcre2-dev libutf8proc-dev check libsubunit-dev mandoc procps curl"
missing=
for p in $pkgs; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
	echo "setup-deps: installing:$missing"
	if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
	$SUDO apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
cd "$(dirname "$0")/.."
if [ ! -x configure ] || [ configure.ac -nt configure ]; then
	autoreconf -fi >/dev/null 2>&1 || autoreconf -fi
fi
