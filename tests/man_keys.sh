#!/bin/sh
# Description: the documentation follows the code: every flag of
# `mlensd --help` is in mlensd(8), every key in mlensd.conf(5) and in the
# example config, every command of `mlensctl --help` in mlensctl(8); and
# the example config, uncommented, is a file mlensd accepts.
set -u
B="${MLENS_BUILDDIR:-.}"
src="${MLENS_SRCDIR:-.}"
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT
bad=0
miss() { echo "FAIL: $*"; bad=$((bad + 1)); }

"$B/daemon/mlensd" --help >"$tmp/help" || { echo "FAIL: mlensd --help"; exit 1; }
sed -n 's/^  --\([a-z][a-z0-9-]*\).*/\1/p' "$tmp/help" | grep -v '^help$\|^version$' >"$tmp/flags"
[ "$(wc -l <"$tmp/flags")" -ge 20 ] || { echo "FAIL: too few flags parsed from --help"; exit 1; }
while read -r flag; do
	key=$(echo "$flag" | tr - _)
	grep -q "Fl -$flag\\b" "$src/man/mlensd.8" || miss "mlensd.8 lacks --$flag"
	[ "$key" = config ] && continue	# a flag only: the file cannot name another file
	grep -q "^\\.It Cm $key " "$src/man/mlensd.conf.5" || miss "mlensd.conf.5 lacks key $key"
	grep -q "^#$key =" "$src/man/mlensd.conf.example" || miss "mlensd.conf.example lacks key $key"
done <"$tmp/flags"

"$B/client/mlensctl" --help >"$tmp/ctlhelp" || { echo "FAIL: mlensctl --help"; exit 1; }
for cmd in $(sed -n 's/^  \([a-z][a-z-]*\)\( \|$\).*/\1/p; s/^  \([a-z-]*\) | \([a-z-]*\).*/\2/p' "$tmp/ctlhelp"); do
	grep -q "^\\.It Cm $cmd\\b" "$src/man/mlensctl.8" || miss "mlensctl.8 lacks command $cmd"
done
grep -q "^\\.It Cm resume" "$src/man/mlensctl.8" || miss "mlensctl.8 lacks resume"

# the example, every key uncommented, parses (the model is checked later,
# so a missing model directory is the first thing it may complain of)
sed -n 's/^#\([a-z_]* =.*\)/\1/p' "$src/man/mlensd.conf.example" >"$tmp/all.conf"
"$B/daemon/mlensd" --config "$tmp/all.conf" --model "$tmp/none" --foreground --socket "$tmp/t.sock" \
	--control "$tmp/c.sock" --stats "$tmp/s.sock" --stats-http "" --log "$tmp/log" >"$tmp/out" 2>&1
rc=$?
[ $rc -ne 2 ] || miss "the example config does not parse: $(cat "$tmp/out")"

# mlens-gateway: every flag in mlens-gateway(8), every key (a flag but
# --config) in the page and in the example config, which it accepts
"$B/client/mlens-gateway" --help >"$tmp/gwhelp" || { echo "FAIL: mlens-gateway --help"; exit 1; }
sed -n 's/^  --\([a-z][a-z0-9-]*\).*/\1/p' "$tmp/gwhelp" | grep -v '^help$\|^version$' >"$tmp/gwflags"
[ "$(wc -l <"$tmp/gwflags")" -ge 9 ] || { echo "FAIL: too few flags parsed from mlens-gateway --help"; exit 1; }
while read -r flag; do
	key=$(echo "$flag" | tr - _)
	grep -q "Fl -$flag\\b" "$src/man/mlens-gateway.8" || miss "mlens-gateway.8 lacks --$flag"
	[ "$key" = config ] && continue
	grep -q "^\\.Pq Cm $key\$" "$src/man/mlens-gateway.8" || miss "mlens-gateway.8 lacks key $key"
	grep -q "^#$key =" "$src/man/mlens-gateway.conf.example" || miss "mlens-gateway.conf.example lacks key $key"
done <"$tmp/gwflags"
sed -n 's/^#\([a-z_]* =.*\)/\1/p' "$src/man/mlens-gateway.conf.example" | grep -v '^api_key_file\|^tokenizer\|^model' >"$tmp/gw.conf"
"$B/client/mlens-gateway" --config "$tmp/gw.conf" --help >/dev/null 2>"$tmp/gwout" ||
	miss "the example mlens-gateway config does not parse: $(cat "$tmp/gwout")"

[ $bad -eq 0 ] || exit 1
echo "man_keys: $(wc -l <"$tmp/flags") flags and keys documented"
