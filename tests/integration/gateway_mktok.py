#!/usr/bin/env python3
"""Write a small byte-level BPE tokenizer.json (trained on a few lines with
Hugging Face tokenizers), a tokenizer_config.json with a chat template, into
a model directory made by mlens-mkmodel. Exit 77 when tokenizers is missing.
usage: gateway_mktok.py MODEL_DIR VOCAB_SIZE"""
import json
import os
import sys

try:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
except ImportError:
    print("SKIP: the Python package tokenizers is not installed")
    sys.exit(77)

LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "mlens serves mixture-of-experts models from one GPU box.",
    "A gateway speaks HTTP and JSON; the daemon sees token ids only.",
    "Stop here. Or there, or anywhere: the end is near.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols ! ? . , ; : - _ ( ) [ ]",
    "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001f600",
]
CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def main():
    out, vocab = sys.argv[1], int(sys.argv[2])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(LINES * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    assert tok.get_vocab_size() <= vocab, tok.get_vocab_size()
    assert tok.token_to_id("<s>") == 1 and tok.token_to_id("</s>") == 2
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT}, f)
    # what the tests compare the gateway's /tokenize with
    print(json.dumps({"hello": tok.encode("Hello, world!").ids}))


main()
