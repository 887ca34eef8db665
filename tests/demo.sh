#!/bin/sh
# The mlens demo on a fresh Debian 12 machine: install what is missing,
# build, write a small random-weight Mixtral model, start mlensd on it, run
# several tenant processes against it at once (mlens generate) and show,
# while they run, what an operator sees: mlensctl status and a few lines of
# /metrics; then each tenant's summary and the total rate.
set -e
cd "$(dirname "$0")/.."
./tests/setup-deps.sh
top=$(pwd)
mkdir -p _build && cd _build
[ -f Makefile ] || "$top/configure" -q
make -j"$(nproc)" >/dev/null
B=$(pwd)
T=$(mktemp -d /tmp/mlens-demo.XXXXXX)
port=$((20000 + $$ % 20000))
daemon_pid=
gateway_pid=
cleanup() {
	[ -n "$gateway_pid" ] && kill "$gateway_pid" 2>/dev/null
	[ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null
	wait 2>/dev/null; rm -rf "$T"
}
trap cleanup EXIT INT TERM

echo "== a random-weight Mixtral (tiny preset, with a byte-level tokenizer and a chat template) in $T/model"
"$B/daemon/mlens-mkmodel" -o "$T/model" --preset tiny --seed 7 --tokenizer

echo "== mlensd (backend auto: CUDA where a GPU is, else the CPU)"
"$B/daemon/mlensd" --model "$T/model" --foreground --mlock=false --kv-cache 64M \
	--socket "$T/mlensd.sock" --control "$T/control.sock" --stats "$T/stats.sock" \
	--stats-http "127.0.0.1:$port" --log "$T/mlensd.log" &
daemon_pid=$!
for i in $(seq 100); do
	grep -q "serving on" "$T/mlensd.log" 2>/dev/null && break
	kill -0 "$daemon_pid" 2>/dev/null || { cat "$T/mlensd.log"; exit 1; }
	sleep 0.1
done
sed 's/^[^ ]* //' "$T/mlensd.log"
ctl() { "$B/client/mlensctl" -s "$T/control.sock" "$@"; }
echo "-- the mode it chose: $(ctl status | sed -n 's/^mode  *//p')"

# four tenants, each with its own batch of 64 prompts (token ids of the
# model's 512); generation ends at max_tokens or at the model's EOS (id 2)
for t in 1 2 3 4; do
	awk -v t=$t 'BEGIN { for (r = 1; r <= 64; r++) { s = t * 100 + r; srand(s);
		printf "{\"prompt\": ["; n = 8 + int(rand() * 24);
		for (i = 0; i < n; i++) printf "%s%d", (i ? ", " : ""), int(rand() * 512);
		printf "], \"max_tokens\": 256, \"temperature\": %s, \"seed\": %d}\n", (s % 2 ? "0.8" : "0"), s } }' \
		> "$T/in$t.jsonl"
done
echo
echo "== 4 tenant processes at once: mlens generate, 64 requests each"
t0=$(date +%s.%N)
clients=
for t in 1 2 3 4; do
	"$B/client/mlens" generate -s "$T/mlensd.sock" -i "$T/in$t.jsonl" -o "$T/out$t.jsonl" 2> "$T/summary$t.txt" &
	clients="$clients $!"
done
# what an operator sees while they run: once half the requests run (or 4 s)
running() { ctl --json status 2>/dev/null | sed -n 's/^ *"requests_running": \([0-9]*\),*$/\1/p'; }
for i in $(seq 80); do
	[ "$(running)" -ge 128 ] 2>/dev/null && break
	sleep 0.05
done
echo
echo "-- mlensctl status, while the tenants run"
ctl status
echo
echo "-- a few lines of http://127.0.0.1:$port/metrics, while the tenants run"
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^mlens_(requests_running|requests_waiting|generation_tokens_total|prompt_tokens_total|kv_blocks_used|preemptions_total|time_to_first_token_seconds_count)' | head -12
for p in $clients; do wait "$p" || echo "(a tenant exited with status $?)"; done
t1=$(date +%s.%N)
echo
for t in 1 2 3 4; do
	echo "-- tenant $t"; cat "$T/summary$t.txt"
done
cat "$T"/summary*.txt | sed -n 's/.*, \([0-9]*\) generated tokens in .*/\1/p' |
	awk -v t0="$t0" -v t1="$t1" '{ n += $1 } END { printf "-- all 4 tenants: %d generated tokens in %.2f s: %.1f tokens/s\n", n, t1 - t0, n / (t1 - t0) }'
echo
echo "-- tenant 1, first result:"
head -1 "$T/out1.jsonl"

# text in, text out: the OpenAI-compatible gateway, a tenant of its own,
# with the model directory's tokenizer and chat template (random weights:
# the reply is random text, but every part of the path is the real one)
gport=$((port + 1))
echo
echo "== mlens-gateway on 127.0.0.1:$gport, and a chat completion through it with curl"
"$B/client/mlens-gateway" -s "$T/mlensd.sock" --model "$T/model" --listen "127.0.0.1:$gport" 2> "$T/gateway.log" &
gateway_pid=$!
for i in $(seq 100); do
	curl -sf "http://127.0.0.1:$gport/health" >/dev/null 2>&1 && break
	kill -0 "$gateway_pid" 2>/dev/null || { cat "$T/gateway.log"; exit 1; }
	sleep 0.1
done
echo "\$ curl -s http://127.0.0.1:$gport/v1/chat/completions -H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 16, \"seed\": 1}'"
curl -s "http://127.0.0.1:$gport/v1/chat/completions" -H 'Content-Type: application/json' \
	-d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16, "seed": 1}' > "$T/chat.json"
cat "$T/chat.json"; echo
grep -q '"object": *"chat.completion"' "$T/chat.json" || { echo "demo: the gateway gave no chat completion"; cat "$T/gateway.log"; exit 1; }
kill -TERM "$gateway_pid"
wait "$gateway_pid"
gateway_pid=
kill -TERM "$daemon_pid"
wait "$daemon_pid" && echo && echo "== mlensd drained and exited cleanly"
daemon_pid=
