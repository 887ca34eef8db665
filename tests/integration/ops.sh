#!/bin/sh
# Description: operating a real mlensd (CPU backend, a tiny random model):
# every mlensctl command with its effect checked, the stats socket, /metrics
# checked against the work done, /health through drain and resume, quotas
# and eviction on live tenants, garbage / HTTP / over-long / half-written
# requests that close only their own connection, the connection limit, a
# second uid refused (as root, through setpriv), control_group, SIGHUP log
# reopen, shutdown, and the promised config-file errors.
set -u
. "$(dirname "$0")/lib.sh"
command -v curl >/dev/null || { echo "SKIP: needs curl for /metrics and /health"; exit 77; }
apid=
lpid=
cleanup() {	# the tenants this script leaves running too
	for p in $apid $lpid $pid; do
		kill "$p" 2>/dev/null && wait "$p" 2>/dev/null
	done
	rm -rf "$tmp"
}
# RUN QUEUED KV of tenant $1
tenant_use() { ctl tenants | awk -v id="$1" '$1 == id { print $5, $6, $7 }'; }
# a metric's value from the last /metrics scrape
metric() { awk -v n="$1" '$1 == n { print $2 }' "$tmp/metrics"; }

"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny >/dev/null || fail "mlens-mkmodel"

# ==== config-file errors: exit 2 naming FILE:LINE and the key ====
expect_config_error() {	# expected-substring file-content
	printf '%s' "$2" >"$tmp/bad.conf"
	"$mlensd" --config "$tmp/bad.conf" --model "$tmp/m" --foreground >"$tmp/out" 2>&1
	rc=$?
	[ $rc -eq 2 ] || fail "config '$2': exit $rc, expected 2"
	grep -qF -- "$1" "$tmp/out" || fail "config '$2': no '$1' in: $(cat "$tmp/out")"
}
expect_config_error "bad.conf:3: unknown key 'bogus'" "# comment
threads = 1
bogus = 1
"
expect_config_error "bad.conf:1: key 'kv_cache': '12Q' is not a size" "kv_cache = 12Q
"
expect_config_error "bad.conf:2: key 'mlock': 'maybe' is not a boolean" "
mlock = maybe"
expect_config_error "bad.conf:1: key 'threads': 'two' is not an integer" "threads = two"
expect_config_error "bad.conf:1: expected 'key = value'" "kv_cache 1G"
expect_config_error "bad.conf:1: key 'gpu_copy': 'dma' is not one of engine, sm" "gpu_copy = dma"
expect_config_error "bad.conf:1: key 'gpu_copy_out': 'both' is not one of compute, down, side" "gpu_copy_out = both"
expect_config_error "bad.conf:1: key 'admit_lookahead': 300 is outside [1, 256]" "admit_lookahead = 300"
expect_config_error "bad.conf:1: key 'gpu_prefill_attention': 'half' is not one of auto, fp32, bf16" "gpu_prefill_attention = half"
expect_config_error "bad.conf:1: key 'gpu_gemm': 'exactish' is not one of fast, exact" "gpu_gemm = exactish"
expect_config_error "bad.conf:1: key 'kv_append': 'disk' is not one of gpu, cpu" "kv_append = disk"
expect_config_error "bad.conf:1: key 'gpu_sync': 'sleep' is not one of auto, spin, yield, block" "gpu_sync = sleep"
expect_config_error "bad.conf:1: key 'backend': 'tpu' is not one of auto, cpu, cuda" "backend = tpu"
expect_config_error "bad.conf:1: key 'attn_kernel': 'avx1024' is not one of auto, scalar, avx2, avx512" "attn_kernel = avx1024"
expect_config_error "bad.conf:1: key 'log_level': 'loud' is not one of error, warn, warning, info, debug" "log_level = loud"
# a word of the list is not a prefix match, nor a list of words
expect_config_error "bad.conf:1: key 'kv_append': 'gp' is not one of gpu, cpu" "kv_append = gp"
expect_config_error "bad.conf:1: key 'kv_append': 'gpu|cpu' is not one of gpu, cpu" "kv_append = gpu|cpu"
# flags the same way
"$mlensd" --model "$tmp/m" --foreground --kv-append=disk >"$tmp/out" 2>&1
[ $? -eq 2 ] && grep -qF "option '--kv-append': 'disk' is not one of gpu, cpu" "$tmp/out" ||
	fail "bad enumerated flag: $(cat "$tmp/out")"
expect_config_error "bad.conf:1: key 'gpu_moe_streams': 0 is outside [1, 4]" "gpu_moe_streams = 0"
expect_config_error "bad.conf:1: key 'gpu_moe_streams': 5 is outside [1, 4]" "gpu_moe_streams = 5"
"$mlensd" --model "$tmp/m" --foreground --bogus-flag >"$tmp/out" 2>&1
[ $? -eq 2 ] && grep -q "unknown option '--bogus-flag'" "$tmp/out" || fail "unknown flag: $(cat "$tmp/out")"
# a non-loopback stats listener is refused at start-up, with the reason
"$mlensd" --model "$tmp/m" --foreground --mlock=false --threads 1 --socket "$tmp/x.sock" \
	--control "$tmp/xc.sock" --stats "" --stats-http 0.0.0.0:9 >"$tmp/out" 2>&1
[ $? -eq 2 ] && grep -q "not a loopback address" "$tmp/out" || fail "stats_http 0.0.0.0 accepted: $(cat "$tmp/out")"
[ ! -e "$tmp/x.sock" ] || fail "stats_http 0.0.0.0: refused only after start-up"
"$mlensd" --model "$tmp/m" --foreground --control-group no-such-group-here >"$tmp/out" 2>&1
[ $? -eq 2 ] && grep -q "control_group 'no-such-group-here': no such group" "$tmp/out" ||
	fail "unknown control_group: $(cat "$tmp/out")"

# ==== start: the file sets log_level and kv_cache, the flag wins for kv_cache ====
cat >"$tmp/mlensd.conf" <<EOC
log_level = debug    # from the file
kv_cache = 2M
mlock = false
threads = 1
backend = cpu     # the operations under test do not depend on it; on a GPU box auto picks cuda
gpu_memory = 1G   # no GPU memory plan on the cpu backend: status shows no budget
EOC
start_mlensd --config "$tmp/mlensd.conf" --model "$tmp/m" --kv-cache 4M --stats-http 127.0.0.1:0

# ==== usage and connection errors ====
"$ctlbin" >/dev/null 2>&1; [ $? -eq 2 ] || fail "mlensctl without a command: not exit 2"
ctl frobnicate >/dev/null 2>&1; [ $? -eq 2 ] || fail "unknown command: not exit 2"
ctl quota >/dev/null 2>&1; [ $? -eq 2 ] || fail "quota without a tenant: not exit 2"
ctl quota 1 running >/dev/null 2>&1; [ $? -eq 2 ] || fail "quota KEY without =: not exit 2"
"$ctlbin" -s "$tmp/none.sock" status 2>"$tmp/err"; [ $? -eq 3 ] || fail "missing socket: not exit 3"
grep -q "cannot connect" "$tmp/err" || fail "missing socket message: $(cat "$tmp/err")"
MLENS_CONTROL="$tmp/c.sock" "$ctlbin" status >/dev/null || fail "MLENS_CONTROL not used"

# ==== status, config, log-level ====
ctl --json status >"$tmp/st" || fail "status"
[ "$(jfield backend <"$tmp/st")" = cpu ] || fail "status backend: $(cat "$tmp/st")"
[ "$(jfield mode <"$tmp/st")" = cpu ] || fail "status mode"
[ -n "$(jfield mode_reason <"$tmp/st")" ] || fail "status mode_reason"
[ "$(jfield admission <"$tmp/st")" = open ] || fail "status admission"
[ "$(jfield layers <"$tmp/st")" = 2 ] || fail "status model layers"
[ "$(jfield budget_bytes <"$tmp/st")" = 4194304 ] || fail "flag --kv-cache 4M did not win over the file's 2M"
# the GPU budget is the plan's effective one; the cpu backend has no plan
gpu_budget=$(sed -n '/"gpu_memory": {/,/}/p' "$tmp/st" | jfield budget_bytes)
[ "$gpu_budget" = null ] || fail "status: GPU budget '$gpu_budget' with the cpu backend, expected null"
ctl status | grep -q "^GPU budget  *none" || fail "human status: GPU budget with the cpu backend"
[ "$(jfield blocks_total <"$tmp/st")" -gt 0 ] || fail "status KV blocks"
[ "$(jfield blocks_used <"$tmp/st")" = 0 ] || fail "status KV blocks used at rest"
[ "$(jfield requests_running <"$tmp/st")" = 0 ] || fail "status running"
[ "$(jfield token_cap <"$tmp/st")" = 4096 ] || fail "status token cap"
port=$(jfield stats_http <"$tmp/st" | sed 's/.*://')
[ "$port" -gt 0 ] 2>/dev/null || fail "status: no stats_http port"
ctl status | grep -q "^backend  *cpu" || fail "human status"
[ "$(stat -c %a "$tmp/c.sock")" = 600 ] || fail "control socket mode $(stat -c %a "$tmp/c.sock")"
ctl config | grep -q "^kv_cache = 4194304$" || fail "config dump: kv_cache"
ctl config | grep -q "^log_level = debug$" || fail "config dump: log_level from the file"
[ "$(ctl log-level)" = debug ] || fail "log-level from the file"
[ "$(ctl log-level warn)" = warn ] || fail "log-level set"
[ "$(ctl log-level)" = warn ] || fail "log-level get after set"
ctl log-level loud 2>"$tmp/err"; [ $? -eq 1 ] || fail "bad log level: not exit 1"
grep -q "not one of" "$tmp/err" || fail "bad log level message"
ctl log-level info >/dev/null

# ==== work: counters move by what was done ====
"$tenant" "$tmp/t.sock" gen 3 20 >"$tmp/gen" || fail "tenant generate: $(cat "$tmp/gen")"
[ "$(grep -c '^req .* status 0 finish 1 tokens 20$' "$tmp/gen")" = 3 ] || fail "generation: $(cat "$tmp/gen")"
curl -sf "http://127.0.0.1:$port/metrics" >"$tmp/metrics" || fail "GET /metrics"
[ "$(metric mlens_generation_tokens_total)" = 60 ] || fail "generation tokens $(metric mlens_generation_tokens_total), expected 60"
[ "$(metric mlens_prompt_tokens_total)" = 24 ] || fail "prompt tokens $(metric mlens_prompt_tokens_total), expected 24"
[ "$(metric 'mlens_requests_finished_total{outcome="done"}')" = 3 ] || fail "requests done"
[ "$(metric mlens_time_to_first_token_seconds_count)" = 3 ] || fail "ttft count"
[ "$(metric 'mlens_time_to_first_token_seconds_bucket{le="+Inf"}')" = 3 ] || fail "ttft +Inf bucket"
[ "$(metric mlens_time_per_output_token_seconds_count)" = 57 ] || fail "tpot count $(metric mlens_time_per_output_token_seconds_count), expected 3 x 19"
[ "$(metric mlens_requests_running)" = 0 ] && [ "$(metric mlens_requests_waiting)" = 0 ] || fail "running/waiting at rest"
[ "$(metric mlens_kv_blocks_used)" = 0 ] || fail "KV blocks used at rest"
[ "$(metric mlens_steps_total)" -gt 0 ] || fail "steps"
[ "$(metric mlens_steps_total)" = "$(metric mlens_step_seconds_count)" ] || fail "step summary count"
[ "$(metric mlens_bad_entries_total)" = 0 ] || fail "bad entries"
for name in mlens_requests_running mlens_requests_waiting mlens_preemptions_total mlens_repreemptions_total \
	mlens_steps_short_total mlens_decodes_deferred_total \
	mlens_prompt_tokens_total \
	mlens_generation_tokens_total mlens_kv_blocks_used mlens_kv_blocks_total mlens_kv_room_taken_total \
	mlens_steps_total mlens_tenants \
	mlens_bad_entries_total; do
	grep -q "^# HELP $name " "$tmp/metrics" && grep -q "^# TYPE $name " "$tmp/metrics" || fail "no HELP/TYPE for $name"
	[ -n "$(metric $name)" ] || fail "no sample of $name"
done
grep -q '^# TYPE mlens_time_to_first_token_seconds histogram$' "$tmp/metrics" || fail "ttft TYPE"
grep -q '^# TYPE mlens_step_seconds summary$' "$tmp/metrics" || fail "step TYPE"
# cumulative buckets never go down
awk -F'[ ]' '/^mlens_time_per_output_token_seconds_bucket/ { if ($2 < last) bad = 1; last = $2 } END { exit bad }' \
	"$tmp/metrics" || fail "tpot buckets not cumulative"
# the stats socket: one JSON object, then the daemon closes
"$raw" "unix:$tmp/s.sock" 3000 </dev/null >"$tmp/sj" || fail "stats socket did not close"
grep -q '"generation_tokens_total":60' "$tmp/sj" || fail "stats socket JSON: $(head -c 300 "$tmp/sj")"
ctl stats | grep -q "^generation_tokens_total  *60$" || fail "mlensctl stats"
curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/nope" | grep -q 404 || fail "/nope not 404"

# ==== drain and resume ====
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ] || fail "/health not 200"
ctl drain >/dev/null || fail "drain"
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 503 ] || fail "/health not 503 while draining"
[ "$(ctl --json status | jfield admission)" = draining ] || fail "status admission while draining"
"$tenant" "$tmp/t.sock" drained 1 5 >"$tmp/gen" || fail "tenant during drain: $(cat "$tmp/gen")"
grep -q '^req 0 status -108 finish 3 tokens 0$' "$tmp/gen" || fail "submit during drain not refused (-ESHUTDOWN): $(cat "$tmp/gen")"
ctl resume >/dev/null || fail "resume"
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ] || fail "/health not 200 after resume"
"$tenant" "$tmp/t.sock" resumed 1 5 >"$tmp/gen" && grep -q '^req 0 status 0 finish 1 tokens 5$' "$tmp/gen" ||
	fail "submit after resume: $(cat "$tmp/gen")"

# ==== quota below use, per tenant; evict frees the KV ====
# A never reads its completions: its ring fills and its 3 requests stay
# running, holding KV. Its quota is then lowered below that use: 2 more of
# its requests wait, while B is served.
"$tenant" --stall --more "$tmp/more" 2 --hold 120 "$tmp/t.sock" stuck 3 4000 >"$tmp/a.out" &
apid=$!
wait_for 'grep -q "^tenant " "$tmp/a.out" 2>/dev/null' || fail "tenant A did not attach"
aid=$(sed -n 's/^tenant //p' "$tmp/a.out")
wait_for '[ "$(tenant_use "$aid" | cut -d" " -f1)" = 3 ]' || fail "A: 3 running expected: $(ctl tenants)"
# the ring fills within a few thousand steps (seconds; tens of seconds
# under ASan on a loaded 2-core box); then A's KV stays put
# (unchanged over 1.2 s: a slow build, TSan's, can pause the daemon for
# a few tenths of a second while the ring still has room)
kv_settled() {
	kv1=$(tenant_use "$aid" | cut -d' ' -f3)
	for _ in 1 2 3 4; do
		sleep 0.3
		kv2=$(tenant_use "$aid" | cut -d' ' -f3)
		[ -n "$kv1" ] && [ "$kv1" -gt 0 ] && [ "$kv1" = "$kv2" ] || return 1
	done
}
wait_for kv_settled 250 || fail "A: KV blocks should settle with a full ring ($kv1, $kv2)"
ctl quota "$aid" running=1 kv_blocks=5000 queued=8 weight=0.5 >/dev/null || fail "quota set"
ctl --json quota "$aid" >"$tmp/q" || fail "quota get"
[ "$(jfield running <"$tmp/q")" = 1 ] && [ "$(jfield queued <"$tmp/q")" = 8 ] &&
	[ "$(jfield kv_blocks <"$tmp/q")" = 5000 ] && [ "$(jfield weight <"$tmp/q")" = 0.5 ] || fail "quota get: $(cat "$tmp/q")"
ctl quota "$aid" running=x 2>"$tmp/err"; [ $? -eq 1 ] || fail "bad quota value accepted"
ctl quota "$aid" colour=red 2>"$tmp/err"; [ $? -eq 1 ] && grep -q "unknown key 'colour'" "$tmp/err" || fail "unknown quota key"
ctl quota 999 2>"$tmp/err"; [ $? -eq 1 ] || fail "quota of an unknown tenant: not exit 1"
# one prefix, the id named as such
[ "$(cat "$tmp/err")" = "mlensctl: quota: no tenant with id 999 is attached (see mlensctl tenants)" ] ||
	fail "quota of an unknown tenant: $(cat "$tmp/err")"
ctl quota "$aid" running=x 2>"$tmp/err"
[ "$(cat "$tmp/err")" = 'mlensctl: quota: running = "x": must be a whole number in [0, 1048576]; 0 = no limit' ] ||
	fail "bad quota value message: $(cat "$tmp/err")"
touch "$tmp/more"
wait_for 'grep -q "^submitted 2 more" "$tmp/a.out"' || fail "A did not submit more"
wait_for '[ "$(tenant_use "$aid" | cut -d" " -f2)" = 2 ]' || fail "A: 2 queued expected (quota below use): $(ctl tenants)"
wait_for kv_settled 250 || fail "A: KV blocks should settle again"
[ "$(tenant_use "$aid")" = "3 2 $kv2" ] || fail "A: the lowered quota admitted more: $(tenant_use "$aid")"
"$tenant" "$tmp/t.sock" other 1 5 >"$tmp/gen" && grep -q '^req 0 status 0 finish 1 tokens 5$' "$tmp/gen" ||
	fail "B not served while A is over quota: $(cat "$tmp/gen")"
# B's blocks are free once its request ends; the stats snapshot shows it
# after the worker's next publish (its step loop), a moment after B may
# already have read its last token
kv_is_as() { used=$(ctl --json status | jfield blocks_used); [ "$used" = "$1" ]; }
wait_for "kv_is_as $kv2" 100 || fail "KV used $used, expected A's $kv2"
ctl evict "$aid" >/dev/null || fail "evict"
wait "$apid"
grep -q '^hangup$' "$tmp/a.out" || fail "A was not disconnected: $(cat "$tmp/a.out")"
# the eviction closes A's connection at once; the daemon detaches it (and
# drops it from the list) when its loop sees the close, a moment later
wait_for '[ -z "$(tenant_use "$aid")" ]' || fail "A still listed after evict"
[ "$(ctl --json status | jfield blocks_used)" = 0 ] || fail "evict did not free A's KV"
ctl evict "$aid" 2>/dev/null; [ $? -eq 1 ] || fail "evicting a gone tenant: not exit 1"
curl -sf "http://127.0.0.1:$port/metrics" >"$tmp/metrics" || fail "GET /metrics"
[ "$(metric 'mlens_requests_finished_total{outcome="failed"}')" -ge 3 ] || fail "A's requests not failed"
[ "$(metric mlens_requests_running)" = 0 ] && [ "$(metric mlens_kv_blocks_used)" = 0 ] || fail "metrics after evict"

# ==== per-tenant series carry a tenant label ====
"$tenant" --stall --hold 10 "$tmp/t.sock" labelled 1 4000 >"$tmp/l.out" &
lpid=$!
wait_for 'grep -q "^tenant " "$tmp/l.out" 2>/dev/null' || fail "tenant L did not attach"
lid=$(sed -n 's/^tenant //p' "$tmp/l.out")
wait_for '[ "$(tenant_use "$lid" | cut -d" " -f1)" = 1 ]' || fail "L not running"
curl -sf "http://127.0.0.1:$port/metrics" >"$tmp/metrics" || fail "GET /metrics"
[ "$(metric "mlens_tenant_requests_running{tenant=\"$lid\"}")" = 1 ] || fail "per-tenant running"
[ "$(metric "mlens_tenant_kv_blocks_used{tenant=\"$lid\"}")" -gt 0 ] || fail "per-tenant KV"
[ "$(metric mlens_tenants)" = 1 ] || fail "mlens_tenants"
grep -q "^mlens_tenant_info{tenant=\"$lid\",uid=\"$(id -u)\",pid=\"[0-9]*\",name=\"labelled\"} 1$" "$tmp/metrics" ||
	fail "tenant info series"
ctl evict "$lid" >/dev/null || fail "evict L"
wait "$lpid"

# ==== bad input closes that connection only ====
printf 'hello, garbage\n' | "$raw" "unix:$tmp/c.sock" 3000 >"$tmp/r" || fail "garbage: connection not closed"
grep -q '"ok":false' "$tmp/r" || fail "garbage: no error reply: $(cat "$tmp/r")"
printf '["status"]\n' | "$raw" "unix:$tmp/c.sock" 3000 >"$tmp/r" || fail "JSON array: connection not closed"
printf 'GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n' | "$raw" "unix:$tmp/c.sock" 3000 >"$tmp/r" ||
	fail "HTTP: connection not closed"
grep -q '^HTTP/1.0 400' "$tmp/r" || fail "HTTP: no 400: $(cat "$tmp/r")"
head -c 70000 /dev/zero | tr '\0' 'x' | "$raw" "unix:$tmp/c.sock" 3000 >"$tmp/r" || fail "long line: not closed"
grep -q "longer than 64 KiB" "$tmp/r" || fail "long line: no reason: $(cat "$tmp/r")"
t0=$(date +%s)
printf '{"cmd":"sta' | "$raw" "unix:$tmp/c.sock" 9000 >"$tmp/r" || fail "half-written request not closed within 9 s"
[ $(($(date +%s) - t0)) -ge 4 ] || fail "half-written request closed too early"
printf '{"cmd":"what"}\n{"cmd":"log-level"}\n' | "$raw" "unix:$tmp/c.sock" 500 >"$tmp/r"
[ $? -eq 1 ] || fail "an unknown command closed the connection"
grep -q "unknown command 'what'" "$tmp/r" && grep -q '"level":"info"' "$tmp/r" || fail "two requests on one connection: $(cat "$tmp/r")"
printf 'GET /metrics HTTP/1.1\r\nHost: x\r\n' | "$raw" "tcp:127.0.0.1:$port" 9000 >/dev/null ||
	fail "half-written HTTP request not closed"
ctl status >/dev/null || fail "daemon stopped serving after bad input"

# ==== connection limit ====
# 32 holders (up to 20 s each, killed once done); then the 33rd must be
# refused. A probe that connects while the holders still do can take a
# holder's place (that holder is refused): one more holder replaces it.
idle=
hold() { "$raw" "unix:$tmp/c.sock" 20000 </dev/null >/dev/null & idle="$idle $!"; }
refused=$(grep -c "control: refused pid" "$tmp/log")
for i in $(seq 32); do hold; done
for i in $(seq 100); do
	sleep 0.1
	ctl status >/dev/null 2>"$tmp/err"; rc=$?
	[ $rc -eq 1 ] && break
	n=$(grep -c "control: refused pid" "$tmp/log")
	while [ "$refused" -lt "$n" ]; do hold; refused=$((refused + 1)); done
done
kill $idle 2>/dev/null
wait $idle 2>/dev/null
[ $rc -eq 1 ] && grep -q "too many control connections" "$tmp/err" || fail "33rd connection: exit $rc: $(cat "$tmp/err")"
# the daemon frees the holders' places as it sees them close
wait_for 'ctl status >/dev/null 2>&1' 50 || fail "status after the connection limit"

# ==== another uid is refused ====
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null; then
	chmod 755 "$tmp"
	nobody="setpriv --reuid=65534 --regid=65534 --clear-groups"
	$nobody "$ctlbin" -s "$tmp/c.sock" status >/dev/null 2>"$tmp/err"; rc=$?
	[ $rc -eq 3 ] && grep -q "Permission denied" "$tmp/err" || fail "nobody on a 0600 socket: exit $rc: $(cat "$tmp/err")"
	# past the file mode (CAP_DAC_OVERRIDE), SO_PEERCRED still refuses
	$nobody --inh-caps=+dac_override --ambient-caps=+dac_override "$ctlbin" -s "$tmp/c.sock" status \
		>/dev/null 2>"$tmp/err"; rc=$?
	[ $rc -eq 1 ] && grep -q "permission denied" "$tmp/err" || fail "nobody past the mode: exit $rc: $(cat "$tmp/err")"
	grep -q "control: refused uid 65534" "$tmp/log" || fail "refusal not logged"
else
	echo "SKIP part: second uid (needs root and setpriv)"
fi

# ==== SIGHUP reopens the log ====
mv "$tmp/log" "$tmp/log.1"
kill -HUP "$pid"
wait_for 'grep -q "log reopened" "$tmp/log" 2>/dev/null' || fail "SIGHUP did not reopen the log"

# ==== shutdown: drain, exit 0, socket files gone ====
ctl shutdown >/dev/null || fail "shutdown"
wait "$pid"; rc=$?
pid=
[ $rc -eq 0 ] || fail "exit status $rc after shutdown"
for s in c.sock s.sock t.sock; do
	[ ! -e "$tmp/$s" ] || fail "$s left behind"
done

# ==== control_group: mode 0660, members allowed ====
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && getent group nogroup >/dev/null; then
	"$mlensd" --model "$tmp/m" --foreground --mlock=false --threads 1 --kv-cache 1M --socket "$tmp/t.sock" \
		--control "$tmp/c.sock" --stats "$tmp/s.sock" --control-group nogroup --log "$tmp/log" &
	pid=$!
	wait_for '[ -S "$tmp/c.sock" ] && ctl status >/dev/null 2>&1' || fail "daemon 2 did not come up"
	[ "$(stat -c '%a %G' "$tmp/c.sock")" = "660 nogroup" ] || fail "control socket: $(stat -c '%a %G' "$tmp/c.sock")"
	setpriv --reuid=65534 --regid=65534 --clear-groups "$ctlbin" -s "$tmp/c.sock" log-level >/dev/null ||
		fail "a control_group member was refused"
	kill -TERM "$pid"; wait "$pid" || fail "SIGTERM exit status"
	pid=
fi
echo "ops: all passed"
