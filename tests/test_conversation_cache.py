"""The conversation cache on the engine: a follow-up that repeats a finished request's tokens
prefills only what is new, and a shared system prompt is computed once; results equal the
engine without caches, pipelined == blocking, under pool pressure too, and every page is
free after close."""

import threading

import numpy as np
import pytest

from photon_jax.engine.core import Engine
from photon_jax.engine.pages import pages_for
from photon_jax.engine.request import Request
from photon_jax.engine.settings import Settings
from photon_jax.model import Model

import os

from helpers import FIXTURE_DIR, LAND, SQ

PAGE = 64


def _turns(eng, model):
    """Turn 1 about an image, turn 2 repeating it (the fed tokens) and asking more, then
    three text-only questions behind one 161-token system prompt."""
    pr = model.prompts
    g = Settings(temperature=0, max_tokens=120)
    p1 = pr.query("w5 w6")
    h1 = eng.submit(Request("text", p1, LAND, g))
    r1 = h1.result(timeout=300)
    fed = r1["ids"][:-1] if r1["finish_reason"] == "length" else r1["ids"]
    p2 = p1 + fed + pr.query("w7")
    h2 = eng.submit(Request("text", p2, LAND, g))
    r2 = h2.result(timeout=300)
    system = [model.cfg.tokenizer.bos_id] + pr.encode(" ".join(f"w{i}" for i in range(300, 460)))
    rest = []
    for q in ("w1", "w2", "w3"):
        h = eng.submit(Request("text", system + pr.query(q), None,
                               Settings(temperature=0.7, seed=3, max_tokens=20)))
        rest.append((h.result(timeout=300)["ids"], h.metrics()["cached_tokens"]))
    return {"r1": r1["ids"], "r2": r2["ids"], "m2": h2.metrics(), "p2": len(p2),
            "fed": len(fed), "p1": len(p1), "system": rest}


@pytest.mark.parametrize("attention", [None, "xla"])
def test_follow_ups_prefill_only_their_new_tokens(tiny_ckpt, attention):
    """With the default decode attention (the CPU kernel: cached pages read in place) and
    with the XLA sweep (each page has one owner row: cached pages copied into the
    request's own before its prefill)."""
    model = Model.load(tiny_ckpt, attention=attention)
    assert model.platform.shares_prefix == (attention is None)
    runs = {}
    for name, kw in (("pipelined", {}), ("blocking", {"pipelined": False}),
                     ("no cache", {"prefix_cache": False})):
        eng = Engine(model, max_batch_size=4, **kw)
        try:
            runs[name] = _turns(eng, model)
            if name == "pipelined":
                stats = eng.stats()["conversation_cache"]
        finally:
            eng.close()
        assert eng.sched.alloc.in_use() == 0
    got = runs["pipelined"]
    prefix = model.cfg.prefix_len
    # Turn 2 read every full page turn 1 wrote (its prompt and the tokens it fed back).
    written = (prefix + got["p1"] + got["fed"]) // PAGE
    want = min(written, (prefix + got["p2"] - 1) // PAGE) * PAGE
    assert want > prefix + PAGE // 2   # the test reaches past the image's pages
    assert got["m2"]["cached_tokens"] == want and got["m2"]["prefix_cache_hit"] is True
    assert got["m2"]["input_tokens"] == prefix + got["p2"]
    # The system prompt's two full pages: computed by the first question, read by the next.
    assert [c for _, c in got["system"]] == [0, 2 * PAGE, 2 * PAGE]
    assert stats["hit_pages"] >= (want - prefix) // PAGE + 4 and stats["inserts"] > 0
    # Same tokens with and without the caches, pipelined or not.
    strip = lambda r: {k: v for k, v in r.items() if k != "m2"}  # noqa: E731
    assert strip(runs["pipelined"]) == strip(runs["blocking"])
    for k in ("r1", "r2"):
        assert runs["pipelined"][k] == runs["no cache"][k]
    assert [i for i, _ in runs["pipelined"]["system"]] == \
        [i for i, _ in runs["no cache"]["system"]]
    assert runs["no cache"]["m2"]["cached_tokens"] == 0


def test_conversations_under_pool_pressure(tiny_ckpt):
    """Six two-turn conversations over three images from two threads, in a pool with room
    for about three sequences: cached pages are evicted and recomputed as needed; every answer
    equals the engine's without caches, and every page comes back.  With the XLA sweep too
    (cached pages copied, not read in place), against the same uncached answers."""
    model = Model.load(tiny_ckpt)
    sweep = Model(model.cfg, model.params, model.prompts.tok, attention="xla")
    pr = model.prompts
    rng = np.random.default_rng(5)
    images = [LAND, SQ, os.path.join(FIXTURE_DIR, "img_photo512x600.png")]
    convos = [(images[k % 3], [f"w{rng.integers(20, 900)}" for _ in range(3)])
              for k in range(6)]
    tokens = 3 * pages_for(900, 32) * 32

    def run(eng):
        out = {}

        def client(ks):
            for k in ks:
                img, words = convos[k]
                p1 = pr.query(" ".join(words))
                s = Settings(temperature=0.0, max_tokens=int(40 + 10 * k))
                r1 = eng.submit(Request("text", p1, img, s)).result(timeout=600)
                fed = r1["ids"][:-1] if r1["finish_reason"] == "length" else r1["ids"]
                h = eng.submit(Request("text", p1 + fed + pr.query("w9"), img, s))
                out[k] = (r1["ids"], h.result(timeout=600)["ids"],
                          h.metrics()["cached_tokens"])

        threads = [threading.Thread(target=client, args=(range(t, 6, 2),)) for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    results, stats = {}, {}
    for name, m, cache in (("cached", model, True), ("sweep", sweep, True),
                           ("uncached", model, False)):
        eng = Engine(m, max_batch_size=4, max_context=900, kv_cache_tokens=tokens,
                     page_size=32, prefix_cache=cache)
        try:
            results[name] = run(eng)
            stats[name] = eng.stats()
        finally:
            eng.close()
        assert eng.sched.alloc.in_use() == 0
    for name in ("cached", "sweep"):
        assert len(results[name]) == 6
        for k in range(6):
            assert results[name][k][:2] == results["uncached"][k][:2], (name, k)
        assert any(c > model.cfg.prefix_len for _, _, c in results[name].values())
        st = stats[name]
        assert st["conversation_cache"]["evictions"] > 0 and st["prefix_cache"]["evictions"] > 0
        assert st["conversation_cache"]["hit_pages"] > 0


def test_random_workloads_with_follow_ups_equal_the_one_request_path(tiny_ckpt):
    """Random mixed requests of which about a third continue an earlier text request's
    conversation (its prompt, answer and a new question, on its image or none), submitted
    in waves so that many continue a finished one: every result equals the one-request
    path, pipelined and blocking, and the follow-ups did read the conversation cache."""
    from helpers import ENGINE_IMAGES, biased_model, run_in_waves, strip, workload

    from photon_jax.engine import reference

    model = biased_model(tiny_ckpt, {0: 0.8})
    encoded = [reference.encode_image(model, p) for p in ENGINE_IMAGES]
    items = workload(model, encoded, 5, 18, followups=True)
    reqs = [r for r, _ in items]
    follow = [i for i, r in enumerate(reqs) if any(
        len(q.prompt) < len(r.prompt) and r.prompt[:len(q.prompt)] == q.prompt
        for q in reqs[:i])]
    assert len(follow) >= 4, follow
    for pipelined in (True, False):
        eng = Engine(model, max_batch_size=3, pipelined=pipelined)
        try:
            got = run_in_waves(eng, reqs, waves=6)
            stats = eng.stats()["conversation_cache"]
        finally:
            eng.close()
        assert [strip(g) for g in got] == [w for _, w in items]
        assert stats["hit_pages"] > 0, stats
        assert eng.sched.alloc.in_use() == 0
