#!/bin/sh
# The mlens demo on a fresh Debian 12 machine: install what is missing,
# build, write a small random-weight Mixtral model, start mlensd on it, run
# several tenant processes against it at once (mlens generate), then show
# what an operator sees: mlensctl status and a few lines of /metrics.
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
cleanup() { [ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$T"; }
trap cleanup EXIT INT TERM

echo "== a random-weight Mixtral (tiny preset) in $T/model"
"$B/daemon/mlens-mkmodel" -o "$T/model" --preset tiny --seed 7

echo "== mlensd (CPU backend)"
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

# four tenants, each with its own batch of 8 prompts (token ids)
for t in 1 2 3 4; do
	: > "$T/in$t.jsonl"
	for r in 1 2 3 4 5 6 7 8; do
		awk -v s=$((t * 100 + r)) 'BEGIN { srand(s); printf "{\"prompt\": ["; n = 8 + int(rand() * 24);
			for (i = 0; i < n; i++) printf "%s%d", (i ? ", " : ""), int(rand() * 512);
			printf "], \"max_tokens\": 48, \"temperature\": %s, \"seed\": %d}\n", (s % 2 ? "0.8" : "0"), s }' >> "$T/in$t.jsonl"
	done
done
echo
echo "== 4 tenant processes at once: mlens generate, 8 requests each"
clients=
for t in 1 2 3 4; do
	"$B/client/mlens" generate -s "$T/mlensd.sock" -i "$T/in$t.jsonl" -o "$T/out$t.jsonl" 2> "$T/summary$t.txt" &
	clients="$clients $!"
done
for p in $clients; do wait "$p" || echo "(a tenant exited with status $?)"; done
for t in 1 2 3 4; do
	echo "-- tenant $t"; cat "$T/summary$t.txt"
done
echo
echo "-- tenant 1, first result:"
head -1 "$T/out1.jsonl"
echo
echo "== mlensctl status"
"$B/client/mlensctl" -s "$T/control.sock" status
echo
echo "== a few lines of http://127.0.0.1:$port/metrics"
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^mlens_(requests_running|generation_tokens_total|prompt_tokens_total|kv_blocks_used|preemptions_total|time_to_first_token_seconds_count)' | head -12
kill -TERM "$daemon_pid"
wait "$daemon_pid" && echo && echo "== mlensd drained and exited cleanly"
daemon_pid=
