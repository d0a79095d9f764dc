"""Streaming with a real byte-level BPE tokenizer trained here (the fixture tokenizer has no
spaces inside tokens, newlines or CJK): the reference's flush rules, the leading-space
rules of the prompts, and streams through the engine (joined stream == result; closing a
stream early cancels only that request)."""

import os

import jax
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from photon_jax.engine.core import Engine

from photon_jax.engine.request import Request
from photon_jax.engine.settings import Settings
from photon_jax.engine.streaming import is_cjk, TextStreamer
from photon_jax.model import Model
from photon_jax.model.tokenizer import Prompts

from helpers import FIXTURE_DIR

CORPUS = ["a cat sat on the mat\nthe cat ate a fish", "猫が好き 日本語の文 です",
          "hello world, a dog and a cat\n\nend", "naïve café déjà vu"] * 40


@pytest.fixture(scope="module")
def bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>"] + [f"<|special{i}|>" for i in range(1, 10)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def decode_fn(tok):
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def check_flushes(pieces, ids, decode, valid_utf8=True):
    """The reference's rules: text goes out up to the last space, in full at a newline or a
    CJK character, never a broken character (for text that is valid UTF-8: random byte
    tokens may decode to replacement characters for good); the pieces add up to the whole
    text."""
    assert "".join(pieces) == decode(ids)
    for p in pieces[:-1]:
        assert not valid_utf8 or "\ufffd" not in p
        assert p.endswith((" ", "\n")) or is_cjk(ord(p[-1])), repr(p)


def test_flush_rules_on_bpe_text(bpe):
    decode = decode_fn(bpe)
    for text in ("the cat sat on the mat\nthe dog ate", "日本語の文 です a cat",
                 "naïve café\n\ndéjà vu", "hello"):
        ids = bpe.encode(text).ids
        s = TextStreamer(decode)
        pieces = [p for p in (s.push(i) for i in ids) if p]
        tail = s.flush()
        pieces += [tail] if tail else []
        check_flushes(pieces, ids, decode)
        if "\n" in text:
            # A newline releases everything up to and including it at once.
            assert any(p.endswith("\n") for p in pieces)
        if text.startswith("日本"):
            # CJK goes out as soon as a character is complete, without waiting for a space.
            s2 = TextStreamer(decode)
            k = next(k for k, i in enumerate(ids) if s2.push(i) or False) + 1
            first = decode(ids[:k])
            assert is_cjk(ord(first[-1])) and " " not in first
            assert all(not is_cjk(ord(decode(ids[:j])[-1])) for j in range(1, k)
                       if decode(ids[:j]))


def test_leading_space_rules(bpe, tiny_ckpt):
    from photon_jax.model.config import TokenizerConfig

    pr = Prompts(bpe, TokenizerConfig())
    cat, space_cat = bpe.encode("cat").ids, bpe.encode(" cat").ids
    assert cat != space_cat
    assert pr.detect("cat")[4:-1] == space_cat     # objects get a leading space
    assert pr.point("cat")[3:-1] == space_cat
    assert pr.query("cat")[3:-2] == cat           # questions do not


@pytest.fixture(scope="module")
def bpe_model(tiny_ckpt, bpe):
    """The fixture model with its output restricted to the BPE's ordinary tokens."""
    base = Model.load(tiny_ckpt)
    params = jax.tree.map(lambda x: x, base.params)
    head = dict(params["text"]["lm_head"])
    head["b"] = head["b"].at[10:bpe.get_vocab_size()].add(40.0)
    params["text"] = {**params["text"], "lm_head": head}
    return Model(base.cfg, params, bpe, device=base.device)


def test_engine_streams_join_to_the_result_and_early_close_cancels(bpe_model):
    img = os.path.join(FIXTURE_DIR, "img_land800x600.png")
    pr = bpe_model.prompts
    eng = Engine(bpe_model, max_batch_size=3)
    try:
        reqs = [Request("text", pr.caption("normal"), img,
                        Settings(temperature=0.8, seed=i, max_tokens=300 if i == 1 else 40))
                for i in range(3)]
        want = [eng.submit(r).result(timeout=300) for r in reqs]
        handles = [eng.submit(r) for r in reqs]
        streams = [h.text_stream() for h in handles]
        first = next(streams[1])
        streams[1].close()      # the caller walks away from request 1
        pieces = [list(streams[0]), list(streams[2])]
        for p, w, h in zip(pieces, (want[0], want[2]), (handles[0], handles[2])):
            check_flushes(p, w["ids"], decode_fn(bpe_model.prompts.tok), valid_utf8=False)
            assert "".join(p) == w["text"] and h.result() == w
        cancelled = handles[1].result(timeout=60)
        assert cancelled["finish_reason"] == "cancelled"
        assert want[1]["text"].startswith(first)
        assert sorted(eng.sched.free_rows) == [1, 2, 3]
    finally:
        eng.close()
