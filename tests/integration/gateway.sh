#!/bin/sh
# Description: mlens-gateway in front of a real mlensd (CPU backend, tiny
# model with a small trained tokenizer): every error status with its
# OpenAI JSON shape, token-id and text completions (tokens and usage equal
# to mlens generate's), streaming events in order ending in [DONE], stop
# strings, a client that hangs up cancels its request in the daemon, API
# keys map to named tenants with their own quotas, draining and a daemon
# gone answer 503, and the official openai Python client (chat and
# completions, streamed and not) when it is installed.
set -u
. "$(dirname "$0")/lib.sh"
command -v curl >/dev/null || { echo "SKIP: needs curl"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: needs python3"; exit 77; }
src="${MLENS_SRCDIR:-.}"
gwbin="$B/client/mlens-gateway"
gpid=
kpid=
cleanup() {
	for p in $gpid $kpid $pid; do
		kill "$p" 2>/dev/null && wait "$p" 2>/dev/null
	done
	rm -rf "$tmp"
}

"$B/daemon/mlens-mkmodel" -o "$tmp/m" --preset tiny --seed 3 >/dev/null || fail "mlens-mkmodel"
python3 "$src/tests/integration/gateway_mktok.py" "$tmp/m" 512 >"$tmp/tok.json"
case $? in
0) TEXT=1 ;;
77) TEXT=0; echo "note: Python tokenizers not installed: the text parts are skipped" ;;
*) fail "gateway_mktok.py" ;;
esac
start_mlensd --model "$tmp/m" --backend cpu --threads 2 --mlock=false --kv-cache 8M --stats-http ""

# start_gateway VAR LOG ARGS...: a gateway on a free port; VAR gets its URL
start_gateway() {
	var=$1 log=$2
	shift 2
	"$gwbin" -s "$tmp/t.sock" --listen 127.0.0.1:0 "$@" 2>"$tmp/$log" &
	eval "${var}_pid=$!"
	wait_for "grep -q 'serving .* on http' '$tmp/$log' 2>/dev/null" 50 ||
		{ cat "$tmp/$log"; fail "mlens-gateway did not start"; }
	eval "$var=$(sed -n 's/.* on \(http:[^ ]*\) .*/\1/p' "$tmp/$log")"
}
start_gateway U gw.log --model "$tmp/m" --max-body 4096
gpid=$U_pid
printf 'key-alice-0001 alice\nkey-bob-00002 bob\n# a comment\nkey-carol-003 carol\n' >"$tmp/keys"
chmod 600 "$tmp/keys"
start_gateway K gwk.log --model "$tmp/m" --api-key-file "$tmp/keys" --served-model-name tiny
kpid=$K_pid

# req METHOD URL [BODY [CURL ARGS]]: the status code; the body in $tmp/body
req() {
	m=$1 u=$2 b=${3-}
	shift 2
	[ $# -gt 0 ] && shift
	if [ -n "$b" ]; then
		curl -s -m 30 -o "$tmp/body" -w '%{http_code}' -X "$m" -H 'Content-Type: application/json' \
			--data-binary "$b" "$@" "$u"
	else
		curl -s -m 30 -o "$tmp/body" -w '%{http_code}' -X "$m" "$@" "$u"
	fi
}
# py EXPR: evaluate EXPR with j = the JSON in $tmp/body; prints the value
py() { python3 -c "import json,sys; j=json.load(open('$tmp/body')); v = ($1); print(v)"; }
# expect_err CODE TYPE PARAM ERRCODE METHOD URL [BODY [CURL ARGS]]
expect_err() {
	code=$1 type=$2 param=$3 ecode=$4
	shift 4
	got=$(req "$@")
	[ "$got" = "$code" ] || fail "$1 $2: status $got, expected $code: $(cat "$tmp/body")"
	python3 - "$tmp/body" "$type" "$param" "$ecode" <<'EOF' || fail "$1 $2: not the OpenAI error expected: $(cat "$tmp/body")"
import json, sys
j = json.load(open(sys.argv[1]))
e = j["error"]
assert sorted(j) == ["error"] and sorted(e) == ["code", "message", "param", "type"], j
assert len(e["message"]) > 10, e
assert [e["type"], str(e["param"]), e["code"]] == sys.argv[2:], (e, sys.argv[2:])
EOF
}

# ==== errors: status, and the OpenAI shape ====
expect_err 404 invalid_request_error None unknown_url GET "$U/v1/nothing"
expect_err 405 invalid_request_error None method_not_allowed GET "$U/v1/completions"
expect_err 405 invalid_request_error None method_not_allowed DELETE "$U/v1/models"
expect_err 400 invalid_request_error None invalid_json POST "$U/v1/completions" '{"prompt": [1, 2'
expect_err 400 invalid_request_error None invalid_json POST "$U/v1/completions" '[1, 2]'
expect_err 400 invalid_request_error max_tokens invalid_value POST "$U/v1/completions" \
	'{"prompt": [1, 2], "max_tokens": "many"}'
expect_err 400 invalid_request_error temperature invalid_value POST "$U/v1/completions" \
	'{"prompt": [1, 2], "temperature": -1}'
expect_err 400 invalid_request_error prompt invalid_value POST "$U/v1/completions" \
	'{"prompt": [1, 99999]}'
expect_err 400 invalid_request_error prompt invalid_value POST "$U/v1/completions" '{"max_tokens": 3}'
expect_err 400 invalid_request_error model model_not_found POST "$U/v1/completions" \
	'{"model": "gpt-17", "prompt": [1]}'
expect_err 400 invalid_request_error prompt context_length_exceeded POST "$U/v1/completions" \
	'{"prompt": [1, 2, 3], "max_tokens": 4094}'
expect_err 400 invalid_request_error logprobs invalid_value POST "$U/v1/completions" \
	'{"prompt": [1], "logprobs": 3}'
expect_err 400 invalid_request_error frequency_penalty invalid_value POST "$U/v1/completions" \
	'{"prompt": [1], "frequency_penalty": 0.5}'
big=$(python3 -c "print('{\"prompt\": [' + ', '.join(['1'] * 2000) + ']}')")
expect_err 413 invalid_request_error None request_too_large POST "$U/v1/completions" "$big"
expect_err 401 authentication_error None invalid_api_key GET "$K/v1/models"
expect_err 401 authentication_error None invalid_api_key POST "$K/v1/completions" '{"prompt": [1]}' \
	-H 'Authorization: Bearer key-mallory-9'
[ "$(req GET "$K/health")" = 200 ] || fail "/health needs no key"
echo "ok: 404, 405, 400 (JSON, fields, model, context), 413, 401 are OpenAI errors"

# ==== /v1/models ====
[ "$(req GET "$U/v1/models")" = 200 ] || fail "/v1/models: $(cat "$tmp/body")"
[ "$(py "j['object'], j['data'][0]['id'], j['data'][0]['max_model_len']")" = "('list', 'm', 4096)" ] ||
	fail "/v1/models: $(cat "$tmp/body")"
[ "$(req GET "$U/v1/models/m")" = 200 ] && [ "$(py "j['id'], j['object']")" = "('m', 'model')" ] ||
	fail "/v1/models/m: $(cat "$tmp/body")"
expect_err 404 invalid_request_error model model_not_found GET "$U/v1/models/gpt-17"
[ "$(req GET "$K/v1/models" '' -H 'Authorization: Bearer key-bob-00002')" = 200 ] &&
	[ "$(py "j['data'][0]['id']")" = tiny ] || fail "/v1/models with a key: $(cat "$tmp/body")"

# ==== token-id completions: the tokens mlens generate gets ====
printf '{"prompt": [5, 6, 7, 8], "max_tokens": 9, "temperature": 0}\n' >"$tmp/in.jsonl"
"$B/client/mlens" generate -s "$tmp/t.sock" -i "$tmp/in.jsonl" -o "$tmp/out.jsonl" -q ||
	fail "mlens generate"
want=$(python3 -c "import json; print(json.load(open('$tmp/out.jsonl'))['tokens'])")
[ "$(req POST "$U/v1/completions" '{"prompt": [5, 6, 7, 8], "max_tokens": 9, "temperature": 0, "return_token_ids": true}')" = 200 ] ||
	fail "completion: $(cat "$tmp/body")"
[ "$(py "j['choices'][0]['token_ids']")" = "$want" ] || fail "tokens differ from mlens generate's $want: $(cat "$tmp/body")"
[ "$(py "j['object'], j['usage'], j['choices'][0]['finish_reason'], j['id'].startswith('cmpl-')")" = \
	"('text_completion', {'prompt_tokens': 4, 'completion_tokens': 9, 'total_tokens': 13}, 'length', True)" ] ||
	fail "completion shape: $(cat "$tmp/body")"
# several prompts times n, seeded: n seeded choices differ and repeat
b='{"prompt": [[1, 2, 3], [4, 5]], "n": 3, "max_tokens": 6, "temperature": 0.9, "seed": 11, "return_token_ids": true}'
[ "$(req POST "$U/v1/completions" "$b")" = 200 ] || fail "n=3: $(cat "$tmp/body")"
[ "$(py "[c['index'] for c in j['choices']], j['usage']")" = \
	"([0, 1, 2, 3, 4, 5], {'prompt_tokens': 5, 'completion_tokens': 36, 'total_tokens': 41})" ] ||
	fail "n=3 of two prompts: $(cat "$tmp/body")"
first=$(py "[c['token_ids'] for c in j['choices']]")
[ "$(py "len(set(str(c['token_ids']) for c in j['choices'][:3]))")" -gt 1 ] || fail "n seeded choices all alike"
req POST "$U/v1/completions" "$b" >/dev/null
[ "$(py "[c['token_ids'] for c in j['choices']]")" = "$first" ] || fail "the same seed gave other tokens"
# logprobs: the sampled token's, as many as tokens
[ "$(req POST "$U/v1/completions" '{"prompt": [9], "max_tokens": 4, "logprobs": 1, "temperature": 0}')" = 200 ] ||
	fail "logprobs: $(cat "$tmp/body")"
[ "$(py "len(j['choices'][0]['logprobs']['token_logprobs']), all(x <= 0 for x in j['choices'][0]['logprobs']['token_logprobs']), len(j['choices'][0]['logprobs']['top_logprobs'])")" = "(4, True, 4)" ] ||
	fail "logprobs shape: $(cat "$tmp/body")"
echo "ok: token-id completions match mlens generate; usage, n, seed, logprobs"

# ==== streaming: one event a token, the finish, usage, then [DONE] ====
curl -s -N -m 30 -H 'Content-Type: application/json' -o "$tmp/sse" "$U/v1/completions" --data-binary \
	'{"prompt": [5, 6, 7, 8], "max_tokens": 9, "temperature": 0, "stream": true, "return_token_ids": true, "stream_options": {"include_usage": true}}' ||
	fail "stream"
python3 - "$tmp/sse" "$want" <<'EOF' || fail "stream events: $(cat "$tmp/sse")"
import json, sys
raw = open(sys.argv[1]).read()
assert raw.endswith("data: [DONE]\n\n"), "no [DONE] at the end"
events = [e for e in raw.split("\n\n") if e]
assert all(e.startswith("data: ") for e in events), events
js = [json.loads(e[6:]) for e in events[:-1]]
toks = [t for j in js if j["choices"] for t in j["choices"][0].get("token_ids", [])]
assert str(toks) == sys.argv[2], (toks, sys.argv[2])
fin = [j["choices"][0]["finish_reason"] for j in js if j["choices"]]
assert fin[-1] == "length" and all(f is None for f in fin[:-1]), fin
assert js[-1]["choices"] == [] and js[-1]["usage"]["completion_tokens"] == 9, js[-1]
assert len({j["id"] for j in js}) == 1
EOF
echo "ok: streamed events in order, usage, [DONE]"

# ==== errors the daemon gives: quota (429), draining (503) ====
req POST "$K/v1/completions" '{"prompt": [1], "max_tokens": 2}' -H 'Authorization: Bearer key-alice-0001' >/dev/null
alice=$(ctl tenants | awk '$4 == "alice" { print $1 }')
[ -n "$alice" ] || fail "no tenant alice: $(ctl tenants)"
ctl quota "$alice" kv_blocks=1 >/dev/null || fail "quota"
expect_err 429 rate_limit_error None quota_exceeded POST "$K/v1/completions" \
	'{"prompt": [1, 2, 3], "max_tokens": 40}' -H 'Authorization: Bearer key-alice-0001'
expect_err 429 rate_limit_error None quota_exceeded POST "$K/v1/completions" \
	'{"prompt": [1, 2, 3], "max_tokens": 40, "stream": true}' -H 'Authorization: Bearer key-alice-0001'
[ "$(req POST "$K/v1/completions" '{"prompt": [1, 2, 3], "max_tokens": 40}' -H 'Authorization: Bearer key-bob-00002')" = 200 ] ||
	fail "bob is held by alice's quota: $(cat "$tmp/body")"
ctl drain >/dev/null || fail "drain"
expect_err 503 server_error None draining POST "$U/v1/completions" '{"prompt": [1], "max_tokens": 2}'
ctl resume >/dev/null || fail "resume"
[ "$(req POST "$U/v1/completions" '{"prompt": [1], "max_tokens": 2}')" = 200 ] || fail "after resume"
echo "ok: a tenant's quota is 429 for it alone; draining is 503"

# ==== API keys are tenants, by name ====
for k in bob carol; do
	key=$(awk -v n=$k '$2 == n { print $1 }' "$tmp/keys")
	req POST "$K/v1/completions" '{"prompt": [1, 2], "max_tokens": 3}' -H "Authorization: Bearer $key" >/dev/null
done
ctl tenants >"$tmp/tenants"
for k in alice bob carol mlens-gateway; do
	grep -q " $k " "$tmp/tenants" || fail "tenant $k not attached: $(cat "$tmp/tenants")"
done
# carol's only request: 2 prompt tokens, 3 generated
[ "$(awk '$4 == "carol" { print $8, $9 }' "$tmp/tenants")" = "2 3" ] || fail "carol's counts: $(cat "$tmp/tenants")"
echo "ok: API keys map to tenants alice, bob, carol"

# ==== a client that hangs up cancels its request ====
running() { ctl --json status | jfield requests_running; }
gen_of() { ctl tenants | awk -v n="$1" '$4 == n { print $9 }'; }
g0=$(gen_of carol)
curl -s -N -m 30 -o "$tmp/cut" -H 'Authorization: Bearer key-carol-003' "$K/v1/completions" \
	--data-binary '{"prompt": [1, 2], "max_tokens": 4000, "temperature": 0, "stream": true, "ignore_eos": true}' &
cpid=$!
wait_for "[ -s '$tmp/cut' ]" 100 || fail "no stream began"
kill "$cpid"
wait "$cpid" 2>/dev/null
wait_for '[ "$(running)" = 0 ]' 30 || fail "the request of a client gone still runs"
g1=$(gen_of carol)
[ $((g1 - g0)) -lt 3500 ] || fail "carol's request ran to the end ($((g1 - g0)) tokens) after its client left"
# the same without streaming
curl -s -m 0.5 -o /dev/null -H 'Authorization: Bearer key-carol-003' "$K/v1/completions" \
	--data-binary '{"prompt": [1, 2], "max_tokens": 4000, "temperature": 0, "ignore_eos": true}'
wait_for '[ "$(running)" = 0 ]' 30 || fail "the unstreamed request of a client gone still runs"
g2=$(gen_of carol)
[ $((g2 - g1)) -lt 3500 ] || fail "carol's unstreamed request ran to the end ($((g2 - g1)) tokens)"
[ "$(req GET "$K/v1/models" '' -H 'Authorization: Bearer key-carol-003')" = 200 ] || fail "gateway down after hang-ups"
echo "ok: a client hanging up cancels its request in mlensd ($((g1 - g0)) and $((g2 - g1)) of 4000 tokens made)"

# ==== text: tokenize, detokenize, stop strings ====
if [ $TEXT = 1 ]; then
	hello=$(python3 -c "import json; print(json.load(open('$tmp/tok.json'))['hello'])")
	[ "$(req POST "$U/tokenize" '{"prompt": "Hello, world!"}')" = 200 ] || fail "/tokenize: $(cat "$tmp/body")"
	[ "$(py "j['tokens']")" = "$hello" ] && [ "$(py "j['count']")" = "$(py "len(j['tokens'])")" ] ||
		fail "/tokenize: $(cat "$tmp/body"), tokenizers says $hello"
	[ "$(req POST "$U/detokenize" "{\"tokens\": $hello}")" = 200 ] &&
		[ "$(py "j['prompt']")" = "<s>Hello, world!" ] || fail "/detokenize: $(cat "$tmp/body")"
	[ "$(req POST "$U/v1/completions" '{"prompt": "Hello", "max_tokens": 30, "temperature": 0}')" = 200 ] ||
		fail "text completion: $(cat "$tmp/body")"
	full=$(py "json.dumps(j['choices'][0]['text'])")
	# a stop string from the middle of that text: cut there, finish stop
	stop=$(python3 -c "import json; t = json.loads('''$full'''); print(json.dumps(t[len(t)//2:len(t)//2+2]))")
	[ "$(req POST "$U/v1/completions" "{\"prompt\": \"Hello\", \"max_tokens\": 30, \"temperature\": 0, \"stop\": [$stop]}")" = 200 ] ||
		fail "stop: $(cat "$tmp/body")"
	python3 -c "
import json
j = json.load(open('$tmp/body')); full = json.loads('''$full'''); stop = json.loads('''$stop''')
c = j['choices'][0]
assert c['finish_reason'] == 'stop', c
assert c['text'] == full[:full.index(stop)], (c['text'], full, stop)
assert j['usage']['completion_tokens'] < 30, j['usage']
" || fail "stop string: $(cat "$tmp/body") (full text $full, stop $stop)"
	# streamed: no piece of the stop string goes out before the cut
	curl -s -N -m 30 -o "$tmp/sse" "$U/v1/completions" --data-binary \
		"{\"prompt\": \"Hello\", \"max_tokens\": 30, \"temperature\": 0, \"stop\": [$stop], \"stream\": true}" ||
		fail "streamed stop"
	python3 -c "
import json
full = json.loads('''$full'''); stop = json.loads('''$stop''')
ev = [json.loads(e[6:]) for e in open('$tmp/sse').read().split('\n\n') if e.startswith('data: {')]
text = ''.join(e['choices'][0]['text'] for e in ev)
assert text == full[:full.index(stop)], (text, full, stop)
assert ev[-1]['choices'][0]['finish_reason'] == 'stop', ev[-1]
" || fail "streamed stop string: $(cat "$tmp/sse") (full text $full, stop $stop)"
	expect_err 400 invalid_request_error prompt invalid_value POST "$U/v1/completions" '{"prompt": ["Hi", []]}'
	echo "ok: /tokenize, /detokenize, text prompts, stop strings"
	# the official client
	python3 "$src/tests/integration/gateway_openai.py" "$U/v1" m
	rc=$?
	[ $rc -eq 77 ] && echo "note: the openai Python package is not installed: its part is skipped"
	[ $rc -eq 0 ] || [ $rc -eq 77 ] || fail "the openai client"
else
	expect_err 400 invalid_request_error prompt no_tokenizer POST "$U/v1/completions" '{"prompt": "Hello"}'
fi

# ==== the daemon gone: a stream ends with an error event, then 503 ====
curl -s -N -m 30 -o "$tmp/lost" "$U/v1/completions" --data-binary \
	'{"prompt": [1, 2], "max_tokens": 4000, "temperature": 0, "stream": true, "ignore_eos": true}' &
cpid=$!
wait_for "[ -s '$tmp/lost' ]" 100 || fail "no stream began"
kill -9 "$pid"
wait "$pid" 2>/dev/null
pid=
wait "$cpid" || fail "the stream did not end after mlensd died: $(tail -c 300 "$tmp/lost")"
python3 - "$tmp/lost" <<'EOF' || fail "the stream's end after mlensd died: $(tail -c 600 "$tmp/lost")"
import json, sys
ev = [e for e in open(sys.argv[1]).read().split("\n\n") if e]
assert ev[-1] == "data: [DONE]", ev[-1]
err = json.loads(ev[-2][6:])["error"]
assert err["code"] == "daemon_unavailable" and err["type"] == "server_error", err
assert len(ev) > 3 and all("choices" in json.loads(e[6:]) for e in ev[:-2])
EOF
expect_err 503 server_error None daemon_unavailable POST "$U/v1/completions" '{"prompt": [1], "max_tokens": 2}'
[ "$(req GET "$U/health")" = 200 ] || fail "gateway down after the daemon left"
for g in gpid kpid; do
	eval "p=\$$g"
	kill "$p"
	wait "$p" || { rc=$?; tail -20 "$tmp/gw.log" "$tmp/gwk.log"; fail "mlens-gateway exit status $rc on SIGTERM"; }
	eval "$g="
done
echo "ok: the daemon gone ends a stream with an error event, then is 503; SIGTERM stops the gateway cleanly"
