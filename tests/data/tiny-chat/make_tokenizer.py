#!/usr/bin/env python3
"""Builds the tiny byte-level BPE tokenizer used by the server tests (tokenizer.json and
tokenizer_config.json in this folder). Standard library only; deterministic output.

Layout: ids 0..255 are the 256 byte symbols (GPT-2 byte-to-unicode map, in byte order),
then merges learned greedily from CORPUS up to id 396, then three ChatML special tokens
(<|endoftext|> 397, <|im_start|> 398, <|im_end|> 399): 400 ids, the test model's vocabulary.
Pre-tokenization at run time is Qwen2's split regex followed by ByteLevel, like Qwen's own.
"""
import collections
import json
import os
import re

N_VOCAB = 400
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = """
You are a helpful assistant. The user asks a question and the assistant answers it.
Hello there! How are you today? I am fine, thank you. What is the capital of France?
The capital of France is Paris. Tell me a story about a small robot that learns to sing.
Once upon a time there was a little robot. It wanted to sing with the birds in the morning.
Write a poem about the sea and the sky. Count from one to ten: one two three four five six
seven eight nine ten. The quick brown fox jumps over the lazy dog. Please summarize this text.
Mixture of experts models route each token to a few experts. The server streams tokens.
"""

CHAT_TEMPLATE = (
    "{%- if messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content.strip() + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def bytes_to_unicode():
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
        range(ord("\xae"), ord("\xff") + 1)
    )
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def main():
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    words = collections.Counter(
        re.findall(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", CORPUS)
    )
    seqs = {w: [b2u[b] for b in w.encode("utf-8")] for w in words}
    merges = []
    n_merges = N_VOCAB - 256 - len(SPECIALS)
    while len(merges) < n_merges:
        pairs = collections.Counter()
        for w, c in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        # Most frequent pair; ties broken by the pair itself so the output is deterministic.
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append((a, b))
        vocab[a + b] = len(vocab)
        for w in seqs:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    assert len(vocab) == N_VOCAB - len(SPECIALS), len(vocab)
    added = []
    for tok in SPECIALS:
        added.append(
            {"id": len(vocab) + len(added), "content": tok, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        )
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges],
        },
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 512,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "added_tokens_decoder": {
            str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for a in added
        },
        "chat_template": CHAT_TEMPLATE,
    }
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(os.path.join(here, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
