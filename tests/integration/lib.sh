# Shared by the integration scripts that drive a real mlensd (sourced, not
# run): where the binaries are, a scratch folder removed on exit with the
# daemon in $pid (and a client run in the background as $gpid), fail (with
# the daemon log's tail), mlensctl on the scratch control socket, a JSON
# field of its --json output, a start-up refusal, waiting, a saved stats
# value and two clients' outputs compared.
B="${MLENS_BUILDDIR:-.}"
mlensd="$B/daemon/mlensd"
ctlbin="$B/client/mlensctl"
tenant="$B/tests/integration/ops_tenant"
raw="$B/tests/integration/ops_raw"
tmp=$(mktemp -d) || exit 99
pid=
gpid=
# the daemon, and a client a script runs in the background as $gpid
cleanup() {
	for p in $gpid $pid; do
		kill "$p" 2>/dev/null && wait "$p" 2>/dev/null
	done
	rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
	echo "FAIL: $*"
	[ -f "$tmp/log" ] && { echo "--- daemon log (tail)"; tail -20 "$tmp/log"; }
	exit 1
}
ctl() { "$ctlbin" -s "$tmp/c.sock" "$@"; }
# the value of "key" in mlensctl --json output (first match; keys are unique where used)
jfield() { sed -n "s/^ *\"$1\": \"\{0,1\}\([^\",]*\)\"\{0,1\},\{0,1\}\$/\1/p" | head -1; }
# mlensd with the arguments given, on the scratch sockets ($tmp/t.sock,
# c.sock, s.sock) and log, in the background as $pid; returns once it
# answers status
start_mlensd() {
	"$mlensd" "$@" --foreground --socket "$tmp/t.sock" --control "$tmp/c.sock" \
		--stats "$tmp/s.sock" --log "$tmp/log" &
	pid=$!
	wait_for '[ -S "$tmp/c.sock" ] && ctl status >/dev/null 2>&1' 300 || fail "daemon did not come up"
}
# refused WANT_STATUS TEXT ARGS...: mlensd (CPU backend, scratch sockets)
# with the arguments given exits with WANT_STATUS within 10 s and says
# TEXT on standard error
refused() {
	want=$1 text=$2
	shift 2
	timeout 10 "$mlensd" --foreground --backend cpu --threads 1 --mlock=false --kv-cache 1M \
		--socket "$tmp/t.sock" --control "$tmp/c.sock" --stats "$tmp/s.sock" "$@" 2>"$tmp/err"
	st=$?
	[ $st -eq 124 ] && fail "mlensd $*: still starting after 10 s (blocked?)"
	[ $st -eq "$want" ] || fail "mlensd $*: exit $st, not $want: $(cat "$tmp/err")"
	grep -qF "$text" "$tmp/err" || fail "mlensd $*: no '$text' in: $(cat "$tmp/err")"
}
# the port of its Prometheus listener (stats_http 127.0.0.1:0 picks one)
stats_port() { ctl --json status | jfield stats_http | sed 's/.*://'; }
# wait for a condition given as a command: up to $2 tries (default 100)
# 0.1 s apart
wait_for() {
	i=0
	while ! eval "$1"; do
		i=$((i + 1))
		[ $i -ge "${2:-100}" ] && return 1
		sleep 0.1
	done
}
# stat_of NAME KEY: KEY of the mlensctl stats saved in $tmp/NAME.stats
stat_of() { awk -v k="$2" '$1 == k { print $2 }' "$tmp/$1.stats"; }
# same A B: byte for byte on the CPU; on CUDA each request's index,
# finish, status and token count ($BACKEND: the script's backend)
same() {
	cmp -s "$1" "$2" && return 0
	[ "${BACKEND:-cpu}" = cuda ] || return 1
	awk '{print $1, $2, $3, NF}' "$1" > "$tmp/same_a"
	awk '{print $1, $2, $3, NF}' "$2" > "$tmp/same_b"
	cmp -s "$tmp/same_a" "$tmp/same_b"
}
