#!/bin/sh
# Description: `mlens generate --model DIR` with text against a real mlensd
# (CPU backend, tiny random model whose vocabulary is the committed
# byte-level tokenizer fixture's, with a ChatML template): a text prompt
# runs as the ids `mlens tokenize --add-special` gives, a chat as the ids of
# its rendered template; results' text is `mlens detokenize --skip-special`
# of their tokens; a stop string cuts the text before it, ends the request
# with "stop" after the token that completed it, and cancels it in the
# daemon; --stream deltas add up to the final tokens and text; OpenAI batch
# lines get OpenAI-shaped output lines with usage counts, a bad url an
# error line while the others run; without --model a text line is an error
# line and token lines still run; SIGINT under --stream still gives one
# final line per input line.
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3 to read the JSON"; exit 77; }
src="${MLENS_SRCDIR:-.}"
mlens="$B/client/mlens"
M="$tmp/m"
gen() { "$mlens" generate -q -s "$tmp/t.sock" -m "$M" "$@"; }
# one JSON value of a line through a Python expression over o
js() { python3 -c 'import json,sys; o=json.loads(sys.argv[1]); print(json.dumps(eval(sys.argv[2]), separators=(",", ":"), ensure_ascii=False))' "$@"; }
# the ids of text $1, special tokens added as the model's tokenizer adds them
tokenize() {
	printf '%s' "$1" | python3 -c 'import json,sys; print(json.dumps({"text": sys.stdin.read()}))' |
		"$mlens" tokenize --model "$M" --add-special | sed 's/{"tokens": *\(.*\)}/\1/;s/ //g'
}
# generation_tokens_total of the stats socket
generated() {
	python3 -c 'import json,socket,sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); d = b""
while True:
    x = s.recv(65536)
    if not x: break
    d += x
print(json.loads(d)["generation_tokens_total"])' "$tmp/s.sock"
}

# the fixture's vocabulary is ids 0..738: the model's is the same
"$B/daemon/mlens-mkmodel" -o "$M" --preset tiny --vocab 739 --seed 3 >/dev/null || fail "mlens-mkmodel"
cp "$src/tests/tokenizer/fixtures/bytelevel/tokenizer.json" "$M/" || fail "no tokenizer fixture"
python3 - "$M/tokenizer_config.json" <<'PY' || fail "tokenizer_config.json"
import json, sys
tpl = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
       "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
       "{{ '<|im_start|>assistant\n' }}{% endif %}")
json.dump({"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
           "chat_template": tpl}, open(sys.argv[1], "w"))
PY
start_mlensd --model "$M" --kv-cache 64M --mlock=false --threads 1 --backend cpu

# ==== a text prompt runs as its tokenized ids ====
T='Hi there'
ids=$(tokenize "$T")
[ -n "$ids" ] || fail "mlens tokenize gave nothing"
{
	echo "{\"prompt\": \"$T\", \"max_tokens\": 24, \"ignore_eos\": true, \"custom_id\": \"t\"}"
	echo "{\"prompt\": $ids, \"max_tokens\": 24, \"ignore_eos\": true}"
} >"$tmp/in"
gen -i "$tmp/in" -o "$tmp/out" || fail "generate text: $(cat "$tmp/out")"
a=$(sed -n 1p "$tmp/out") b=$(sed -n 2p "$tmp/out")
[ "$(js "$a" 'o["custom_id"]')" = '"t"' ] || fail "custom_id not echoed: $a"
[ "$(js "$a" 'o["tokens"]')" = "$(js "$b" 'o["tokens"]')" ] ||
	fail "text prompt ran other ids than $ids: $a / $b"
full=$(js "$a" 'o["tokens"]') ftext=$(js "$a" 'o["text"]')
[ "$(js "$a" 'len(o["tokens"])')" = 24 ] || fail "24 tokens expected: $a"
# the text is the tokens' decode, special tokens left out
d=$(echo "{\"tokens\": $full}" | "$mlens" detokenize --model "$M" --skip-special) || fail "detokenize"
[ "$(js "$d" 'o["text"]')" = "$ftext" ] || fail "text $ftext, detokenize says $d"
echo "ok: text prompt runs as $ids; text is the decode of the tokens"

# ==== a chat runs as the ids of its rendered template ====
chat='<|im_start|>user
Hi there<|im_end|>
<|im_start|>assistant
'
cids=$(tokenize "$chat")
{
	echo '{"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 12, "ignore_eos": true}'
	echo "{\"prompt\": $cids, \"max_tokens\": 12, \"ignore_eos\": true}"
} >"$tmp/in"
gen -i "$tmp/in" -o "$tmp/out" || fail "generate chat: $(cat "$tmp/out")"
[ "$(js "$(sed -n 1p "$tmp/out")" 'o["tokens"]')" = "$(js "$(sed -n 2p "$tmp/out")" 'o["tokens"]')" ] ||
	fail "chat ran other ids than the template's $cids: $(cat "$tmp/out")"
echo "ok: messages run as the rendered ChatML template's ids $cids"

# ==== stop strings: cut before, "stop" after the completing token, cancelled ====
# the stop: 2 characters across two tokens' texts (from the 4th token on),
# and the tokens expected: the fewest whose decode holds it
exp=$(python3 - "$M" "$mlens" "$full" "$ftext" <<'PY'
import json, subprocess, sys
m, mlens, toks, text = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
def dec(t):
    r = subprocess.run([mlens, "detokenize", "--model", m, "--skip-special"], check=True,
                       input=json.dumps({"tokens": t}), capture_output=True, text=True)
    return json.loads(r.stdout)["text"]
def across(n):
    a, b = dec(toks[:n]), dec(toks[:n + 1])
    k = len(a) - 1
    return b[k:k + 2] if k >= 0 and b.startswith(a) and len(b) > len(a) and \
        "\ufffd" not in b[k:k + 2] and text.index(b[k:k + 2]) == k else None
stop = next(s for s in map(across, range(4, 23)) if s)
n = next(n for n in range(1, 25) if stop in dec(toks[:n]))
assert n < 24
print(json.dumps(stop, ensure_ascii=False))
print(json.dumps([text[:text.index(stop)], toks[:n], "stop"], separators=(",", ":"), ensure_ascii=False))
PY
) || fail "no stop string found in $ftext"
stop=$(echo "$exp" | sed -n 1p) want=$(echo "$exp" | sed -n 2p)
g0=$(generated)
echo "{\"prompt\": \"$T\", \"max_tokens\": 2000, \"ignore_eos\": true, \"stop\": [$stop]}" >"$tmp/in"
gen -i "$tmp/in" -o "$tmp/out" || fail "generate stop: $(cat "$tmp/out")"
got=$(js "$(cat "$tmp/out")" '[o["text"], o["tokens"], o["finish_reason"]]')
[ "$got" = "$want" ] || fail "stop $stop: got $got, want $want"
wait_for '[ "$(ctl --json status | jfield requests_running)" = 0 ]' || fail "stopped request still runs"
spent=$(($(generated) - g0))
[ "$spent" -lt 1000 ] || fail "stop $stop: the daemon generated $spent of 2000 tokens (not cancelled)"
echo "ok: stop $stop cuts the text, ends after $(js "$want" 'len(o[1])') tokens, the daemon cancelled ($spent generated)"

# ==== --stream: deltas add up to the final line ====
{
	echo "{\"prompt\": \"$T\", \"max_tokens\": 24, \"ignore_eos\": true, \"custom_id\": \"s0\"}"
	echo "{\"prompt\": \"$T\", \"max_tokens\": 2000, \"ignore_eos\": true, \"stop\": $stop}"
	echo '{"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 12}'
	echo "{\"custom_id\": \"n2\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": \"$T\", \"max_tokens\": 5, \"n\": 2, \"temperature\": 1}}"
} >"$tmp/in"
gen --stream -i "$tmp/in" -o "$tmp/out" || fail "generate --stream: $(cat "$tmp/out")"
python3 - "$tmp/out" "$full" <<'PY' || fail "stream: $(cat "$tmp/out")"
import json, sys
lines = open(sys.argv[1], encoding="utf-8").read().split("\n")
assert lines[-1] == ""
acc, finals = {}, []
for l in lines[:-1]:
    o = json.loads(l)
    if "delta" in o:
        i = o["index"]
        assert i not in [f["index"] for f in finals], "a delta after the final line of %d" % i
        assert o.get("custom_id") == {0: "s0", 3: "n2"}.get(i)
        assert ("choice" in o) == (i == 3)
        i = (i, o.get("choice", 0))
        t, x = acc.get(i, ([], ""))
        acc[i] = (t + o["delta"]["tokens"], x + o["delta"]["text"])
    else:
        finals.append(o)
assert [f.get("index") for f in finals] == [0, 1, 2, None], finals
assert finals[0]["tokens"] == json.loads(sys.argv[2])
assert finals[1]["finish_reason"] == "stop"
for f in finals[:3]:
    assert acc[(f["index"], 0)] == (f["tokens"], f["text"]), (acc[(f["index"], 0)], f)
for k, c in enumerate(finals[3]["response"]["body"]["choices"]):
    assert acc[(3, k)][1] == c["text"] and len(acc[(3, k)][0]) == 5, (acc, c)
PY
echo "ok: --stream deltas add up to each final line's tokens and text, stop strings held back"

# ==== OpenAI batch lines ====
cat >"$tmp/in" <<EOF
{"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "$T", "max_tokens": 24, "ignore_eos": true, "logprobs": 0}}
{"custom_id": "c2", "method": "POST", "url": "/v1/embeddings", "body": {"model": "tiny", "input": "x"}}
{"custom_id": "c3", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_completion_tokens": 12, "ignore_eos": true, "stop": [$stop], "logprobs": true}}
{"custom_id": "c4", "method": "POST", "url": "/v1/completions", "body": {"prompt": "$T", "max_tokens": 6, "ignore_eos": true, "n": 3, "temperature": 1, "seed": 7}}
{"prompt": "$T", "max_tokens": 6, "ignore_eos": true, "temperature": 1, "seed": 7}
{"prompt": "$T", "max_tokens": 6, "ignore_eos": true, "temperature": 1, "seed": 8}
{"prompt": "$T", "max_tokens": 6, "ignore_eos": true, "temperature": 1, "seed": 9}
EOF
"$mlens" generate -q -s "$tmp/t.sock" -m "$M" -i "$tmp/in" -o "$tmp/out"
rc=$?
[ $rc -eq 1 ] || fail "batch with a bad line: exit $rc, want 1"
python3 - "$tmp/out" "$ids" "$cids" "$ftext" <<'PY' || fail "batch output: $(cat "$tmp/out")"
import json, sys
rs = [json.loads(l) for l in open(sys.argv[1], encoding="utf-8")]
ids, cids, ftext = json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
assert [r.get("custom_id") for r in rs] == ["c1", "c2", "c3", "c4", None, None, None]
c1, c2, c3, c4 = rs[:4]
for r in (c1, c3):
    assert r["error"] is None and r["response"]["status_code"] == 200
    assert r["id"].startswith("batch_req_") and r["response"]["request_id"]
b = c1["response"]["body"]
assert b["object"] == "text_completion" and b["model"] == "tiny"
ch = b["choices"][0]
assert ch["text"] == ftext and ch["finish_reason"] == "length", ch
assert b["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 24, "total_tokens": len(ids) + 24}
lp = ch["logprobs"]
assert len(lp["tokens"]) == 24 and len(lp["token_logprobs"]) == 24
assert all(x <= 0 for x in lp["token_logprobs"])
assert c2["response"] is None and c2["error"]["code"] == "invalid_request_error"
assert "/v1/embeddings" in c2["error"]["message"]
b = c3["response"]["body"]
assert b["object"] == "chat.completion"
ch = b["choices"][0]
assert ch["message"]["role"] == "assistant" and ch["finish_reason"] in ("stop", "length")
u = b["usage"]
assert u["prompt_tokens"] == len(cids) and 1 <= u["completion_tokens"] <= 12
assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
# n 3: choice k is what seed + k makes, the prompt counted once
b = c4["response"]["body"]
assert [c["index"] for c in b["choices"]] == [0, 1, 2]
assert [c["text"] for c in b["choices"]] == [r["text"] for r in rs[4:]]
assert [r["index"] for r in rs[4:]] == [4, 5, 6]  # lines, not requests
assert b["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 18, "total_tokens": len(ids) + 18}
lp = ch["logprobs"]["content"]
assert len(lp) == u["completion_tokens"], lp
assert all(set(x) == {"token", "logprob", "bytes", "top_logprobs"} and x["logprob"] <= 0 and
           bytes(x["bytes"]).decode("utf-8") == x["token"] for x in lp), lp
PY
echo "ok: batch lines: completion and chat.completion objects with usage, n choices, a bad url an error line"

# ==== without --model: text is an error line, ids still run ====
{
	echo '{"prompt": "text"}'
	echo '{"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": true}'
} >"$tmp/in"
"$mlens" generate -q -s "$tmp/t.sock" -i "$tmp/in" -o "$tmp/out"
rc=$?
[ $rc -eq 1 ] || fail "text without --model: exit $rc, want 1"
grep -q '^{"index":0,"tokens":\[\],"finish_reason":"error","error":"prompt is text: mlens generate needs --model DIR' \
	"$tmp/out" || fail "text without --model: $(sed -n 1p "$tmp/out")"
sed -n 2p "$tmp/out" | grep -q '^{"index":1,"tokens":\[[0-9,]*\],"finish_reason":"length"}$' ||
	fail "ids without --model: $(sed -n 2p "$tmp/out")"
"$mlens" generate -q -s "$tmp/t.sock" -m "$tmp/none" -i "$tmp/in" -o "$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && grep -q "^mlens generate: --model $tmp/none: " "$tmp/err" ||
	fail "a missing model directory: exit $rc: $(cat "$tmp/err")"
echo "ok: without --model a text line is an error line; a bad --model exits 2"

# ==== SIGINT under --stream: one final line per input line ====
# (the batch lines without max_tokens run to the end of the context)
env --default-signal=INT true 2>/dev/null || { echo "skip: SIGINT needs env --default-signal"; exit 0; }
python3 -c 'import json
for i in range(30): print("{\"prompt\": \"word %d\", \"max_tokens\": 4000, \"ignore_eos\": true}" % i)
for i in range(10): print(json.dumps({"custom_id": "b%d" % i, "method": "POST", "url": "/v1/completions",
                                       "body": {"prompt": "word", "ignore_eos": True, "seed": i}}))' \
	>"$tmp/slow"
env --default-signal=INT "$mlens" generate -q --stream -s "$tmp/t.sock" -m "$M" -i "$tmp/slow" \
	-o "$tmp/int" 2>"$tmp/err" &
gpid=$!
wait_for '[ "$(ctl --json status | jfield requests_running)" = 40 ]' 200 || fail "40 never ran"
kill -INT $gpid
wait $gpid
rc=$?
gpid=
[ $rc -eq 130 ] || fail "SIGINT: exit $rc, want 130: $(cat "$tmp/err")"
python3 - "$tmp/int" <<'PY' || fail "SIGINT under --stream: $(tail -3 "$tmp/int")"
import json, sys
lines = open(sys.argv[1], encoding="utf-8").read().split("\n")
assert lines[-1] == ""
finals = [o for o in map(json.loads, lines[:-1]) if "delta" not in o]
assert [f["index"] for f in finals[:30]] == list(range(30))
assert {f["finish_reason"] for f in finals[:30]} == {"cancelled"}
assert [f["custom_id"] for f in finals[30:]] == ["b%d" % i for i in range(10)]
assert all(f["response"] is None and f["error"]["code"] == "cancelled" for f in finals[30:])
PY
echo "ok: SIGINT under --stream: 40 final lines (10 of them batch lines), all cancelled, exit 130"
