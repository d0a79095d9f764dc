"""Writes tests/fixtures/chat/tokenizer.json: a small byte-level BPE tokenizer shaped like
Moondream's starmie (id 0 `<|endoftext|>`, ids 1-9 special, byte-level pre-tokenizer and
decoder), for the tests of chat rendering and output shapes.

The fixtures' own tokenizer is a word-level stand-in with no decoder (every unknown word is
id 0), which neither shows a rendering's text ids nor can be read by the grammar library:
shapes are defined over token bytes, and a byte-level tokenizer has them.  The vocabulary:
the 10 special ids, the 256 byte symbols, then merges of a few words the tests use.

Run: python tests/make_bytelevel_tokenizer.py (deterministic; the file is committed)."""

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

WORDS = ["true", "false", "indoor", "cat", "dog", "yes", "no", "What", "colour", "Answer"]


def build() -> Tokenizer:
    specials = ["<|endoftext|>"] + [f"<|md_reserved_{i}|>" for i in range(9)]
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = []
    for w in WORDS:   # left-to-right merges: w[:k] + w[k]
        for k in range(1, len(w)):
            pair = (w[:k], w[k])
            if pair not in merges:
                merges.append(pair)
                vocab.setdefault(w[:k + 1], len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "chat",
                       "tokenizer.json")
    build().save(out)
    print("wrote", out)
