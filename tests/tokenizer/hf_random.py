#!/usr/bin/env python3
"""Random differential test of the tokenizer against Hugging Face
tokenizers, run by hand (needs `pip install tokenizers`): random strings
of hard pieces and random code points through `mlens tokenize`, random id
lists through `mlens detokenize`, each compared with what HF gives.

    python3 tests/tokenizer/hf_random.py BUILD/client/mlens [SEED [N]]

Runs over every fixture of tests/tokenizer/fixtures; prints the first
mismatches of each and exits 1 when there are any. Code points are drawn
from blocks on which PCRE2's, utf8proc's and HF's Unicode tables agree:
characters whose Unicode data changed between versions may split or
normalize differently.
"""
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

from tokenizers import Tokenizer

PIECES = ["the", " quick", "Hello", "world", " ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000",
          "\u0085", "\u2028", "\u200b", "東京", "日本語", "한국어", "Привет", "مرحبا", "שלום", "😀",
          "👨‍👩‍👧", "🇫🇷", "e\u0301", "\u0301", "123", "4567", "3.14", "'s", "'LL", "?!", "...",
          "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<think>", "[INST]", "fox", "quick brown",
          "<sep>", "_", "-", "ﬁ", "①", "²", "Å", "ß", "İ", "\u0000", "\x7f", "▁", "##", ",", ";",
          ".", "x", "ab", "<0x41>", "$", "\\", "\"", "{}", "𝓗"]


def rand_str(rng):
    s = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
    if rng.random() < 0.3:
        s += "".join(chr(rng.choice([rng.randint(0x20, 0x7e), rng.randint(0xa0, 0xd7ff),
                                     rng.randint(0xe000, 0xffff), rng.randint(0x10000, 0x104ff),
                                     rng.randint(0x1f000, 0x1faff), rng.randint(0x20000, 0x2a6df)]))
                     for _ in range(rng.randint(1, 6)))
    return s


def run(mlens, args, lines):
    out = subprocess.run([mlens] + args, input="".join(lines).encode(), capture_output=True)
    return [json.loads(x) for x in out.stdout.decode().split("\n") if x]


def main():
    mlens = sys.argv[1]
    rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
    fx = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
    tmp = tempfile.mkdtemp()
    bad = 0
    for name in sorted(os.listdir(fx)):
        d = os.path.join(fx, name)
        if not os.path.exists(os.path.join(d, "tokenizer.json")):
            d = os.path.join(tmp, name)
            shutil.copytree(os.path.join(fx, name), d)
            with gzip.open(os.path.join(d, "tokenizer.json.gz")) as f:
                open(os.path.join(d, "tokenizer.json"), "wb").write(f.read())
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        strs = [rand_str(rng) for _ in range(n)]
        miss = 0
        for special in (False, True):
            args = ["tokenize", "--model", d] + (["--add-special"] if special else [])
            got = run(mlens, args, [json.dumps({"text": s}) + "\n" for s in strs])
            for s, g in zip(strs, got):
                want = tok.encode(s, add_special_tokens=special).ids
                if g.get("tokens") != want:
                    miss += 1
                    if miss <= 5:
                        print(name, "encode", repr(s), special, "got", g.get("tokens"), "want", want)
        v = tok.get_vocab_size()
        idl = [[rng.randrange(v) for _ in range(rng.randint(0, 10))] for _ in range(n)]
        for skip in (False, True):
            args = ["detokenize", "--model", d] + (["--skip-special"] if skip else [])
            got = run(mlens, args, [json.dumps({"tokens": i}) + "\n" for i in idl])
            for i, g in zip(idl, got):
                want = tok.decode(i, skip_special_tokens=skip)
                if g.get("text") != want:
                    miss += 1
                    if miss <= 8:
                        print(name, "decode", i, skip, "got", repr(g.get("text")), "want", repr(want))
        print("%s: %d strings, %d id lists, %d mismatches" % (name, n, n, miss))
        bad += miss
    shutil.rmtree(tmp)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
