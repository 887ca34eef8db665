#!/bin/sh
# Description: the profiler in a real mlensd (CPU backend, the tiny model of
# mlens-mkmodel): mlensctl profile prints n_real and the policy (no GPU and
# no PCIe on the CPU backend: its compute tier is "cpu", and the engine's
# largest step bounds n_real, said so), its JSON
# agrees with the status' token cap, --cached predicts without measuring,
# the stats socket and /metrics expose n_real, the binding resource and
# predicted vs measured step time; profile = true at start-up writes
# profile_cache and the next start takes it from there; max_step_tokens
# pins the cap against the profile; the prediction and the cap follow the
# traffic's lengths (workload_follow). mlens-bench predict replays the
# model on the cache.
set -u
. "$(dirname "$0")/lib.sh"
command -v curl >/dev/null || { echo "SKIP: needs curl for /metrics"; exit 77; }
start() {	# extra flags
	: >"$tmp/log"
	"$mlensd" --model "$tmp/m" --foreground --backend cpu --threads 1 --mlock=false --kv-cache 4M \
		--socket "$tmp/t.sock" --control "$tmp/c.sock" --stats "$tmp/s.sock" \
		--stats-http 127.0.0.1:0 --log "$tmp/log" "$@" &
	pid=$!
	wait_for '[ -S "$tmp/c.sock" ] && ctl status >/dev/null 2>&1' || fail "daemon did not come up"
}
stop() {
	kill "$pid" && wait "$pid"
	pid=
}

"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny >/dev/null || fail "mlens-mkmodel"

# ==== on demand ====
start
ctl profile >"$tmp/human" || fail "mlensctl profile: $(cat "$tmp/human")"
grep -q "^n_real  *[0-9][0-9]* tokens per step" "$tmp/human" || fail "no n_real in: $(cat "$tmp/human")"
grep -q "^policy  *[0-9][0-9]* resident experts per layer" "$tmp/human" || fail "no policy in: $(cat "$tmp/human")"
grep -q "^predicted  *[0-9.]* tokens/s" "$tmp/human" || fail "no prediction in: $(cat "$tmp/human")"
grep -q "^binding  *[a-z]" "$tmp/human" || fail "no binding resource in: $(cat "$tmp/human")"
# the CPU backend has no bus and no GPU: no PCIe tiers, its compute is "cpu",
# and n_real is the engine's largest step, said so
grep -q "^per layer  *cpu-memory [0-9.]* ms cpu [0-9.]* ms.*; fill [0-9.]* ms a step$" "$tmp/human" ||
	fail "no per-layer tiers in: $(cat "$tmp/human")"
! grep -q "gpu\|pcie" "$tmp/human" || fail "a GPU or PCIe on the CPU backend: $(cat "$tmp/human")"
grep -q "^n_real  *4096 tokens per step (CPU backend: no PCIe, nothing streams; the engine's largest step bounds it)" \
	"$tmp/human" || fail "n_real on the CPU backend: $(grep n_real "$tmp/human")"
ctl --json profile --prompt-len 64 --gen-len 16 >"$tmp/p.json" || fail "profile --json"
[ "$(jfield prompt_len <"$tmp/p.json")" = 64.0 ] || fail "prompt_len not 64: $(cat "$tmp/p.json")"
[ "$(jfield from_cache <"$tmp/p.json")" = false ] || fail "an on-demand profile came from a cache"
[ "$(jfield token_cap_pinned <"$tmp/p.json")" = false ] || fail "cap pinned without max_step_tokens"
cap=$(jfield token_cap <"$tmp/p.json")
# each resource's seconds a layer: the binding one is the largest
sed -n '/"layer_seconds": {/,/}/p' "$tmp/p.json" >"$tmp/ls"
bind=$(jfield binding <"$tmp/p.json")
bsec=$(jfield "$bind" <"$tmp/ls")
for k in pcie-h2d pcie-d2h gpu gpu-cpu-chain; do
	[ -z "$(jfield "$k" <"$tmp/ls")" ] || fail "layer_seconds has $k on the CPU backend"
done
[ "$(jfield n_real_bound <"$tmp/p.json")" = largest-step ] || fail "n_real_bound: $(jfield n_real_bound <"$tmp/p.json")"
[ "$(jfield token_cap_source <"$tmp/p.json")" = n_real ] || fail "token_cap_source: $(jfield token_cap_source <"$tmp/p.json")"
for k in cpu-memory cpu cpu-attention cpu-chain; do
	v=$(jfield "$k" <"$tmp/ls")
	awk -v v="$v" -v b="$bsec" 'BEGIN { exit !(v >= 0 && v <= b && b > 0) }' ||
		fail "layer_seconds: $k = '$v' against the binding $bind's '$bsec'"
done
nreal=$(jfield n_real <"$tmp/p.json" | sed 's/\..*//')
[ "$nreal" -ge 64 ] 2>/dev/null || fail "n_real '$nreal' below the prompt"
# the scheduler's cap is what the profile set: n_real, at most the engine's 4096
want=$nreal; [ "$want" -gt 4096 ] && want=4096
[ "$cap" = "$want" ] || fail "profile's token_cap $cap, expected min(n_real $nreal, 4096)"
[ "$(ctl --json status | jfield token_cap)" = "$cap" ] || fail "status token cap differs from the profile's $cap"
for k in gemm_flops cpu_attention_bytes_per_s kv_append_bytes_per_s cpu_memory_bytes_per_s; do
	v=$(jfield $k <"$tmp/p.json")
	awk -v v="$v" 'BEGIN { exit !(v > 0) }' || fail "$k = '$v' not positive"
done
ctl --json profile --cached --gen-len 32 >"$tmp/c.json" || fail "profile --cached"
[ "$(jfield gen_len <"$tmp/c.json")" = 32.0 ] || fail "--cached did not predict for gen_len 32"
ctl profile --prompt-len >/dev/null 2>&1; [ $? -eq 2 ] || fail "--prompt-len without a value: not exit 2"
ctl profile --gen-len 0 2>"$tmp/err"; [ $? -eq 1 ] || fail "gen_len 0: not refused"
grep -q "gen_len" "$tmp/err" || fail "gen_len 0 message: $(cat "$tmp/err")"

# a connection's later requests wait for its profile and are answered in
# order; ops_raw listens for twice two profiles' time as measured above (a
# sanitizer build's profile takes seconds), at least 4 s
wait_ms=$(awk -v s="$(jfield seconds <"$tmp/p.json")" 'BEGIN { w = int(4000 * s) + 4000; print (w > 4000 ? w : 4000) }')
printf '{"cmd":"profile","gen_len":8}\n{"cmd":"profile","gen_len":9}\n{"cmd":"log-level"}\n' |
	"$raw" "unix:$tmp/c.sock" "$wait_ms" >"$tmp/r"
[ "$(wc -l <"$tmp/r")" = 3 ] || fail "three requests, replies: $(cat "$tmp/r")"
sed -n 1p "$tmp/r" | grep -q '"gen_len": *8' || fail "first reply: $(sed -n 1p "$tmp/r")"
sed -n 2p "$tmp/r" | grep -q '"gen_len": *9' || fail "second reply: $(sed -n 2p "$tmp/r")"
sed -n 3p "$tmp/r" | grep -q '"level"' || fail "third reply: $(sed -n 3p "$tmp/r")"

# stats and /metrics after some work
"$tenant" "$tmp/t.sock" gen 2 8 >"$tmp/gen" || fail "tenant: $(cat "$tmp/gen")"
ctl --json stats >"$tmp/stats" || fail "stats"
[ -n "$(jfield n_real <"$tmp/stats")" ] || fail "stats: no n_real"
[ -n "$(jfield binding_resource <"$tmp/stats")" ] || fail "stats: no binding_resource"
meas=$(jfield step_seconds_measured <"$tmp/stats")
awk -v v="$meas" 'BEGIN { exit !(v > 0) }' || fail "step_seconds_measured '$meas'"
pred=$(jfield step_seconds_predicted <"$tmp/stats")
awk -v v="$pred" 'BEGIN { exit !(v > 0) }' || fail "step_seconds_predicted '$pred'"
port=$(ctl --json status | jfield stats_http | sed 's/.*://')
curl -sf "http://127.0.0.1:$port/metrics" >"$tmp/metrics" || fail "/metrics"
grep -q "^mlens_n_real $nreal$" "$tmp/metrics" || fail "/metrics: mlens_n_real not $nreal"
grep -q '^mlens_binding_resource_info{resource="[a-z-]*"} 1$' "$tmp/metrics" || fail "/metrics: binding resource"
grep -q "^mlens_step_seconds_predicted [0-9]" "$tmp/metrics" || fail "/metrics: predicted step time"
grep -q "^mlens_step_seconds_measured [0-9]" "$tmp/metrics" || fail "/metrics: measured step time"
stop

# ==== at start-up, with the cache; a pinned cap ====
start --profile --profile-cache "$tmp/prof.json" --max-step-tokens 100
[ -s "$tmp/prof.json" ] || fail "profile = true wrote no profile_cache"
grep -q '"config_hash"' "$tmp/prof.json" || fail "cache without its key"
grep -q "step cap 100 tokens (pinned by max_step_tokens)" "$tmp/log" || fail "start-up: pinned cap not logged"
ctl --json profile --cached >"$tmp/s.json" || fail "profile --cached after start-up"
[ "$(jfield token_cap_pinned <"$tmp/s.json")" = true ] || fail "cap not reported pinned"
[ "$(jfield token_cap <"$tmp/s.json")" = 100 ] || fail "pinned cap not 100"
ctl profile >/dev/null || fail "profile with a pinned cap"
[ "$(ctl --json status | jfield token_cap)" = 100 ] || fail "the profile moved a pinned cap"
stop
start --profile --profile-cache "$tmp/prof.json" --max-step-tokens 100
grep -q "profile (cached)" "$tmp/log" || fail "second start did not take the cache"
ctl --json profile --cached | jfield from_cache | grep -q true || fail "from_cache not true"
stop
# the key holds the GPU memory plan's effective budget; the cpu backend
# has no GPU plan, so a gpu_memory it does not use keeps the cache (a
# changed effective budget measuring again: tests/check_plan)
start --profile --profile-cache "$tmp/prof.json" --gpu-memory 1G
grep -q "profile (cached)" "$tmp/log" || fail "an unused gpu_memory dropped the cache"
grep -q "profile: n_real" "$tmp/log" || fail "no profile at start-up"
stop

# ==== the workload follows the traffic (workload_follow) ====
# 200 requests of 8 prompt tokens and 4 generated against a profile made
# for 512/128: within a second or two the prediction, the stats, /metrics
# and the cap are for 8/4; with workload_follow 0 they stay 512/128
awk 'BEGIN { for (r = 0; r < 200; r++) printf "{\"prompt\": [%d, 5, 6, 7, 8, 9, 10, 11], \"max_tokens\": 4}\n", 1 + r % 90 }' \
	>"$tmp/in.jsonl"
start --profile --workload-follow 1 --stats-http 127.0.0.1:0
[ "$(ctl --json stats | jfield profile_prompt_len)" = 512.0 ] || fail "start-up workload not 512"
"$B/client/mlens" generate -s "$tmp/t.sock" -i "$tmp/in.jsonl" -o "$tmp/out.jsonl" -q ||
	fail "mlens generate: $(head -3 "$tmp/out.jsonl")"
wait_for 'grep -q "workload from the traffic: p=8 g=4 (was 512/128)" "$tmp/log"' 50 ||
	fail "the workload did not follow the traffic"
[ "$(ctl --json stats | jfield profile_prompt_len)" = 8.0 ] || fail "stats: workload not 8/4"
[ "$(ctl --json stats | jfield profile_gen_len)" = 4.0 ] || fail "stats: gen_len not 4"
fcap=$(sed -n 's/.*workload from the traffic: p=8 g=4 .*; step cap \([0-9]*\) (was .*/\1/p' "$tmp/log" | head -1)
[ -n "$fcap" ] || fail "no cap in: $(grep "workload from" "$tmp/log")"
wait_for '[ "$(ctl --json status | jfield token_cap)" = "$fcap" ]' 50 ||
	fail "status token cap $(ctl --json status | jfield token_cap), the log says $fcap"
curl -sf "http://127.0.0.1:$(stats_port)/metrics" >"$tmp/metrics" || fail "/metrics"
grep -q '^mlens_profile_workload_tokens{part="prompt"} 8$' "$tmp/metrics" || fail "/metrics: prompt workload"
grep -q '^mlens_profile_workload_tokens{part="generated"} 4$' "$tmp/metrics" || fail "/metrics: generated workload"
# a bare mlensctl profile --cached predicts for the held workload, 8/4 now
ctl --json profile --cached >"$tmp/f.json" || fail "profile --cached after following"
[ "$(jfield prompt_len <"$tmp/f.json")" = 8.0 ] && [ "$(jfield gen_len <"$tmp/f.json")" = 4.0 ] ||
	fail "profile --cached moved the followed workload: $(grep -E '"(prompt|gen)_len"' "$tmp/f.json")"
# --cached with lengths is a what-if: it answers for them and holds 8/4
ctl --json profile --cached --prompt-len 300 >"$tmp/w.json" || fail "profile --cached --prompt-len 300"
[ "$(jfield prompt_len <"$tmp/w.json")" = 300.0 ] || fail "the what-if did not predict for 300"
[ "$(ctl --json stats | jfield profile_prompt_len)" = 8.0 ] ||
	fail "profile --cached --prompt-len 300 moved the held workload to $(ctl --json stats | jfield profile_prompt_len)"
[ "$(ctl --json profile --cached | jfield prompt_len)" = 8.0 ] || fail "a bare --cached after the what-if: not 8"
# the same traffic again: within 10%, no new line
n=$(grep -c "workload from the traffic" "$tmp/log")
"$B/client/mlens" generate -s "$tmp/t.sock" -i "$tmp/in.jsonl" -o "$tmp/out.jsonl" -q || fail "generate again"
sleep 2.2
[ "$(grep -c "workload from the traffic" "$tmp/log")" = "$n" ] || fail "unchanged traffic moved the workload"
stop
start --profile --workload-follow 0
"$B/client/mlens" generate -s "$tmp/t.sock" -i "$tmp/in.jsonl" -o "$tmp/out.jsonl" -q || fail "generate (0)"
sleep 1.5
grep -q "workload from the traffic" "$tmp/log" && fail "workload_follow 0 followed the traffic"
[ "$(ctl --json stats | jfield profile_prompt_len)" = 512.0 ] || fail "workload_follow 0: workload moved"
stop

# ==== the model replayed on the cache (mlens-bench predict) ====
# the cache of the starts above, given gpu_memory 1G, as a hybrid daemon would
# predict from it: n_real, and the steady state at a cap of 64 tokens
bench=$B/tests/bench/mlens-bench
"$bench" predict --config "$tmp/m/config.json" --profile "$tmp/prof.json" --gpu-memory 1G \
	--kv-cache 4M --prompt-len 16 --gen-len 8 --cap 64 --json >"$tmp/rp.json" 2>"$tmp/err" ||
	fail "mlens-bench predict: $(cat "$tmp/err")"
rn=$(jfield n_real <"$tmp/rp.json" | sed 's/\..*//')
[ "$rn" -ge 16 ] 2>/dev/null || fail "replayed n_real '$rn' below the prompt"
[ "$(jfield cap <"$tmp/rp.json")" = 64 ] || fail "replay cap: $(cat "$tmp/rp.json")"
awk -v t="$(jfield step_seconds <"$tmp/rp.json")" 'BEGIN { exit !(t > 0) }' ||
	fail "replay without a steady step: $(cat "$tmp/rp.json")"
"$bench" predict --config "$tmp/m/config.json" --profile "$tmp/prof.json" --prompt-len 16 \
	--gen-len 8 --cap 64 >"$tmp/rp.txt" || fail "mlens-bench predict (table)"
grep -q "^cap 64, .* generated / .* total tokens/s" "$tmp/rp.txt" || fail "replay table: $(cat "$tmp/rp.txt")"
# bad input: exit 1 with the reason, 2 for an argument
"$bench" predict --config "$tmp/m/config.json" --profile "$tmp/none.json" 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "no profile cache at" "$tmp/err" || fail "missing cache: $(cat "$tmp/err")"
"$bench" predict --config "$tmp/prof.json" --profile "$tmp/prof.json" 2>"$tmp/err"
[ $? -eq 1 ] || fail "a profile cache taken for config.json: $(cat "$tmp/err")"
"$bench" predict --config "$tmp/none/config.json" --profile "$tmp/prof.json" 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "config.json: cannot open: No such file" "$tmp/err" ||
	fail "missing config.json: $(cat "$tmp/err")"
"$bench" predict --config "$tmp/m/config.json" --profile "$tmp/prof.json" --gpu-memory lots 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "gpu-memory" "$tmp/err" || fail "bad size: $(cat "$tmp/err")"
echo "profile: n_real $nreal, token cap $cap, predicted step $pred s vs measured $meas s; replayed n_real $rn"
