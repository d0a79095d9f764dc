"""Image prefixes computed a slice at a time between decode steps (engine/slicing.py,
docs/slicing.md): the slices give the one-program encode's bits; an engine slicing at
several budgets gives the reference's answers, pipelined and blocking, with LoRA variants,
8-bit KV, `encode_image` and cancellations; the policy (slices only while rows decode, at
least one per decode step, none in front of a prefill); the budget's measure; the new
programs' HLO; and nothing compiled after warm-up."""

import json
import os
import threading
import time

import jax
import numpy as np
import pytest

from photon_jax import Moondream
from photon_jax.engine import reference, slicing, step
from photon_jax.engine.core import Engine
from photon_jax.engine.frontend import prepare_image
from photon_jax.engine.request import Request
from photon_jax.engine.settings import Settings
from photon_jax.model import Model, lora
from photon_jax.model.config import tiny, tiny_md3
from photon_jax.model.params import init_params
from photon_jax.model.tokenizer import load_tokenizer

from helpers import (ENGINE_IMAGES, FIXTURE_DIR, LAND, LORA_DIR, SQ, audit, biased_model,
                     rel_err, run_in_waves, strip, workload)

GROUPS = [(1, 0.5), (9, 2)]   # one block and half a layer; 9 blocks and 2 layers


def _random_model(make_cfg, dtype=None):
    cfg = make_cfg()
    if dtype is not None:
        from dataclasses import replace
        cfg = replace(cfg, dtype=dtype)
    return Model(cfg, init_params(jax.random.PRNGKey(0), cfg),
                 load_tokenizer(os.path.join(FIXTURE_DIR, "tokenizer.json")))


def _sliced(model, prep, groups, tables=None, slot=None):
    """An image prefix through `slicing.launch`, slice by slice (the engine's path)."""
    P, cfg = step.programs_of(model), model.cfg
    job = slicing.ImageJob(b"", None, prep, slicing.plan(cfg, prep.crops.shape[0], groups))
    scalar = lambda n: jax.device_put(np.int32(n))  # noqa: E731
    out = None
    for sl in job.slices:
        assert out is None
        out = slicing.launch(P, model.params, slicing.text_layers(model.params, cfg),
                             slicing.text_kinds(cfg), job, sl, scalar, tables, slot)
    return out


@pytest.mark.parametrize("make_cfg,dtype", [(tiny, None), (tiny, "bfloat16"), (tiny_md3, None)],
                         ids=["moondream2", "moondream2-bf16", "moondream3"])
def test_slices_give_the_one_program_prefix_bit_for_bit(make_cfg, dtype):
    """Slicings (blocks and layers per slice, half layers) give the K/V of `image_kv`
    exactly: each layer computes what it computes there, from the same inputs.  Moondream 3's
    MoE layers and bf16 included; with a LoRA adapter in its slot too.

    Bit for bit at XLA's default optimization level (tests/test_opt_level.py runs this test
    so).  The suite's -O0 with the older emitters (conftest.py) compiles Moondream 3's
    one-program prefix differently in its last float32 bits (from layer 1 on, 1e-6 apart):
    there, Moondream 3 is held to float32 rounding instead."""
    model = _random_model(make_cfg, dtype)
    prep = prepare_image(model, LAND)
    P = step.programs_of(model)
    k0, v0 = P.image_kv(model.params, prep.crops, prep.src, prep.ph, prep.pw)
    exact = model.cfg.text.moe is None or os.environ.get("PHOTON_JAX_TEST_XLA_OPT") == "default"
    for groups in GROUPS:
        enc = _sliced(model, prep, groups)
        for mine, want in ((enc.k, k0), (enc.v, v0)):
            if exact:
                assert np.array_equal(np.asarray(mine), np.asarray(want)), groups
            else:
                np.testing.assert_allclose(np.asarray(mine), np.asarray(want), rtol=1e-5,
                                           atol=1e-5)
        assert enc.tiling == prep.tiling
    if make_cfg is tiny and dtype is None:   # under an adapter (random tables, slot 2)
        tables = lora.init_tables(model.cfg, 3, 4)
        keys = iter(jax.random.split(jax.random.PRNGKey(1), 4 * len(jax.tree.leaves(tables))))
        tables = jax.tree.map(lambda a: 0.05 * jax.random.normal(next(keys), a.shape, a.dtype),
                              tables)
        slot = jax.device_put(np.full(1, 2, np.int32))
        k1, v1 = P.image_kv(model.params, prep.crops, prep.src, prep.ph, prep.pw, tables, slot)
        assert not np.array_equal(np.asarray(k1), np.asarray(k0))
        enc = _sliced(model, prep, (1, 0.5), tables, slot)
        assert np.array_equal(np.asarray(enc.k), np.asarray(k1))
        assert np.array_equal(np.asarray(enc.v), np.asarray(v1))


def test_sliced_prefix_matches_the_references_kv(cases, arrays, tiny_ckpt):
    """Against the public reference's own image-prefix K/V (the fixture's golden arrays)."""
    model = Model.load(tiny_ckpt)
    iid = cases["kv_image"]
    enc = _sliced(model, prepare_image(model, os.path.join(FIXTURE_DIR, f"img_{iid}.png")),
                  (1, 0.5))
    last = model.cfg.text.n_layers - 1
    for name, layer in (("layer0", 0), (f"layer{last}", last)):
        for kind, mine in (("k", enc.k), ("v", enc.v)):
            ref = arrays[f"fp32.{iid}.kv_{name}_{kind}"]
            got = np.asarray(mine[layer]).transpose(1, 0, 2)[None]
            assert rel_err(got, ref) < 1e-4, (name, kind)


def test_plan_covers_each_layer_once_and_prices_the_last_as_its_qkv():
    cfg = tiny_md3()   # dense layers then MoE layers
    kinds = slicing.text_kinds(cfg)
    for groups in [(1, 0.5), (3, 1), (9, 2), (27, 5)]:
        plan = slicing.plan(cfg, 7, groups)
        vis = [s for s in plan if s.kind == "vision"]
        assert sum(s.n for s in vis) == cfg.vision.enc_n_layers
        assert [s.first for s in vis] == list(range(0, cfg.vision.enc_n_layers, groups[0]))
        text = [s for s in plan if s.kind != "vision"]
        assert text[-1].kv_only and not any(s.kv_only for s in text[:-1])
        if groups[1] == 0.5:
            assert [(s.kind, s.first) for s in text] == \
                [(k, i) for i in range(len(kinds) - 1) for k in ("attention", "mlp")] + \
                [("attention", len(kinds) - 1)]
        else:
            layers = [i for s in text for i in range(s.first, s.first + s.n)]
            assert layers == list(range(len(kinds)))
            assert all(len({kinds[i] for i in range(s.first, s.first + s.n)}) == 1
                       for s in text)   # a group never mixes dense and MoE layers
        assert all(s.flops > 0 for s in plan)
    with pytest.raises(ValueError, match="must divide"):
        slicing.plan(cfg, 7, (2, 1))
    for bad in [(1, 0.3), (0, 1), (1,), (True, 1), "1,1"]:
        with pytest.raises(ValueError, match="slice_groups"):
            slicing.check_groups(cfg, bad)


def test_budget_measures_the_gap_and_the_slices_speed():
    b = slicing.SliceBudget(ratio=4.0, rate=1e11)
    assert b.seconds() == 0.0   # no gap seen yet: one slice per launch
    for g in (0.010, 0.012, 0.011):
        b.observe(g, {})
    assert b.median_gap == pytest.approx(0.011) and b.seconds() == pytest.approx(0.033)
    sl = slicing.Slice("mlp", 0, 1, 2e9)
    assert b.cost(sl) == pytest.approx(0.02)
    # A gap of 11 + 40 ms with 2 Gflop of MLP in front: they ran at 50 Gflop/s, not 100.
    b.observe(0.051, {"mlp": 2e9})
    assert b.rates["mlp"] == pytest.approx(5e10)
    # Faster than predicted: the rate rises a quarter of the way (in the log), no more.
    b.observe(0.011 + 0.010, {"mlp": 2e9})
    assert 5e10 < b.rates["mlp"] < 1e11
    before = dict(b.rates)
    b.observe(0.0111, {"vision": 1e6})   # too small to tell from the noise
    assert b.rates == before
    fixed = slicing.SliceBudget(ratio=4.0, rate=1e11, fixed=3e9)
    assert fixed.limit() == 3e9 and fixed.cost(sl) == 2e9


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return biased_model(tiny_ckpt, {0: 0.8})


@pytest.fixture(scope="module")
def encoded(model):
    return [reference.encode_image(model, p) for p in ENGINE_IMAGES]


def _stream(model, n=400):
    return Request("text", [0] + list(range(100, 116)), None,
                   Settings(temperature=0.0, max_tokens=n), ignore_eos=True)


def _until(cond, timeout=120.0):
    """Wait for `cond()`, failing the test (not hanging it) past `timeout` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def _read(h):
    """A thread reading `h`'s text stream (the engine slices images for streamed rows)."""
    t = threading.Thread(target=lambda: [None for _ in h.text_stream()], daemon=True)
    t.start()
    return t


def _while_decoding(eng, model, reqs, waves=2, streamed=True):
    """`reqs` in waves while a long text row decodes, read as a stream (so their images
    are sliced) -> their results; the row is cancelled after."""
    h = eng.submit(_stream(model))
    reader = _read(h) if streamed else None
    _until(lambda: eng.counters["decode"] + eng.counters["burst"] >= 3)
    try:
        return run_in_waves(eng, reqs, waves=waves)
    finally:
        h.cancel()
        h.wait(timeout=120)
        if reader is not None:
            reader.join(timeout=60)


@pytest.mark.parametrize("pipelined,budget", [(True, 0.0), (False, 4e8), (True, None)],
                         ids=["pipelined-one-slice", "blocking-budget", "pipelined-measured"])
def test_sliced_engine_equals_the_reference(model, encoded, pipelined, budget):
    """Random mixed workloads (images as files: misses, then hits; encoded prefixes; text;
    detect/point) arriving while a row decodes, their images sliced one slice per decode
    step, a few per step (blocking), or as the budget measures: every answer is the one-request
    path's, and every page comes back."""
    items = workload(model, encoded, 11, 10)
    eng = Engine(model, max_batch_size=4, pipelined=pipelined, slice_budget=budget)
    try:
        outs = _while_decoding(eng, model, [r for r, _ in items])
        st = eng.stats()
    finally:
        eng.close()
    assert st["sliced_images"] >= 1 and st["slices"] >= 31 * st["sliced_images"] / 2
    for (req, want), got in zip(items, outs):
        assert strip(got) == want, req.skill
    assert (eng.sched.alloc.in_use(), eng.sched.alloc.reserved) == (0, 0)
    assert eng._jobs == {}


def test_slicing_only_for_streams_and_never_in_front_of_a_prefill(model, encoded):
    """Images arriving at an idle engine, or while only rows nobody streams decode (a
    batch job), are encoded whole (no slicing overhead); while a streamed row decodes,
    slices go only in front of decode steps, a budget's worth (here one slice) each."""
    eng = Engine(model, max_batch_size=4, slice_budget=0.0)
    try:
        for p in ENGINE_IMAGES:
            eng.submit(Request("text", model.prompts.caption("short"), p,
                               Settings(temperature=0.0, max_tokens=3))).result(timeout=120)
        new = np.random.default_rng(1).integers(0, 255, (300, 400, 3), np.uint8)
        _while_decoding(eng, model, [Request("text", model.prompts.caption("short"), new,
                                             Settings(temperature=0.0, max_tokens=3))],
                        waves=1, streamed=False)
        assert eng.stats().get("slices", 0) == 0
        _while_decoding(eng, model, [Request("text", model.prompts.caption("short"),
                                             os.path.join(FIXTURE_DIR, "img_photo512x600.png"),
                                             Settings(temperature=0.0, max_tokens=3))],
                        waves=1)
        log = eng.step_log()
    finally:
        eng.close()
    assert eng.counters["slices"] > 0
    assert all(s["slice_flops"] == 0 for s in log if s["kind"] == "prefill")
    per_step = [s["slice_flops"] for s in log if s["slice_flops"]]
    assert len(per_step) == eng.counters["slices"]   # one slice in front of each


def test_encode_image_cancel_kv8_and_variants_while_rows_decode(tiny_ckpt):
    """While a row decodes: `encode_image` (its prefix sliced, the handle after the last
    slice), a request cancelled while its image is being sliced, 8-bit KV, and a LoRA
    variant's image (its prefix sliced under the adapter's slot): the goldens and the
    reference's answers, nothing leaked."""
    with open(os.path.join(LORA_DIR, "golden.json")) as f:
        golden = json.load(f)
    v = "ft-beta@7"
    final = {v: os.path.join(LORA_DIR, v, "final.pt")}
    md = Moondream.load(tiny_ckpt, adapters=final, max_adapters=2, max_lora_rank=8,
                        max_batch_size=4)
    try:
        eng = md.engine
        eng.slicer.fixed = 0.0   # one slice per decode step
        st = golden["settings"]
        s = {"temperature": 0, "max_tokens": st["max_tokens"]}
        h = eng.submit(_stream(eng.model, 2000))
        reader = _read(h)
        _until(lambda: eng.counters["decode"] >= 3)
        enc = md.encode_image(SQ)
        assert eng.counters["slices"] > 0
        assert md.caption(enc, "short", settings=s)["caption"] == \
            golden["runs"]["base"]["sq378"]["caption_short"]["text"]
        enc.release()
        gone = eng.submit(Request("text", eng.model.prompts.caption("short"), LAND,
                                  Settings(max_tokens=5)))
        _until(lambda: eng._jobs or gone.done())
        gone.cancel()
        assert gone.result(timeout=120)["finish_reason"] == "cancelled"
        _until(lambda: not eng._jobs)   # its job is dropped (or had finished)
        got = md.caption(LAND, "short", settings={**s, "variant": v})["caption"]
        assert got == golden["runs"][v]["land800x600"]["caption_short"]["text"]
        h.cancel()
        h.result(timeout=120)
        reader.join(timeout=60)
        assert eng.sched.adapters.in_use() == 0
    finally:
        md.close()
    assert eng._jobs == {}
    assert (eng.sched.alloc.in_use(), eng.sched.alloc.reserved) == (0, 0)
    # 8-bit KV: the sliced prefix is quantized into the pages as the whole one is.
    model = Model.load(tiny_ckpt)
    outs = {}
    for sliced in (True, False):
        e = Engine(model, max_batch_size=4, kv_dtype="int8", slice_images=sliced,
                   slice_budget=0.0)
        try:
            outs[sliced] = _while_decoding(e, model, [
                Request("text", model.prompts.caption("short"), p,
                        Settings(temperature=0.0, max_tokens=8)) for p in ENGINE_IMAGES], 1)
            assert (e.counters["slices"] > 0) == sliced
        finally:
            e.close()
    assert outs[True] == outs[False]


def test_a_pool_too_small_for_every_image_at_once_serves_them_all(model, encoded):
    """Six new images while a streamed row decodes, in a pool that holds about two image
    requests besides the row: jobs take entries as pages allow (the rest encode whole),
    finished entries are evictable like any other, and every request is answered with the
    whole-encode engine's tokens.  (It passes with the pins the first version held for a
    finished job's request too: the wait those could cause was reasoned, not reproduced.)"""
    imgs = [np.random.default_rng(10 + i).integers(0, 255, (300, 400, 3), np.uint8)
            for i in range(6)]
    reqs = [Request("text", model.prompts.caption("short"), im,
                    Settings(temperature=0.0, max_tokens=6)) for im in imgs]
    outs = {}
    for sliced in (True, False):
        eng = Engine(model, max_batch_size=4, max_context=900, kv_cache_tokens=64 * 40,
                     slice_images=sliced, slice_budget=0.0)
        try:
            outs[sliced] = _while_decoding(eng, model, reqs, waves=1)
            assert (eng.counters["slices"] > 0) == sliced
            assert eng.sched.cache.evictions > 0   # the pool really was short
        finally:
            eng.close()
        assert (eng.sched.alloc.in_use(), eng.sched.alloc.reserved) == (0, 0)
    assert outs[True] == outs[False]


def test_slice_programs_are_sync_free_and_compiled_at_warm_up(tiny_ckpt):
    """Every slice program's optimized HLO has no conditional and no unknown-trip loop
    (Moondream 2 and 3, with adapter tables too); after the warm-up, a run slicing an image
    of a warmed layout compiles none."""
    texts = {}
    for make_cfg in (tiny, tiny_md3):
        model = _random_model(make_cfg)
        cfg, P = model.cfg, step.programs_of(model)
        prep = prepare_image(model, LAND)
        layers, kinds = slicing.text_layers(model.params, cfg), slicing.text_kinds(cfg)
        tables = lora.init_tables(cfg, 2, 4)
        slot, first = np.ones(1, np.int32), np.int32(1)
        x = jax.eval_shape(P.vision_embed, model.params, prep.crops)
        h, k, v = jax.eval_shape(P.prefix_input, model.params, x, prep.src, prep.ph, prep.pw)
        name = cfg.text.moe is None and "md2" or "md3"
        texts[f"{name}.vision_embed"] = P.vision_embed.lower(model.params, prep.crops)
        texts[f"{name}.vision_blocks"] = P.vision_blocks.lower(model.params, x, first, 3)
        texts[f"{name}.prefix_input"] = P.prefix_input.lower(model.params, x, prep.src,
                                                            prep.ph, prep.pw)
        for extra, tag in (((), ""), ((tables[1:3], slot), ".lora")):
            for kv_only in (False, True):
                texts[f"{name}.layers{tag}{kv_only}"] = P.prefix_layers.lower(
                    layers[1:3], tuple(kinds[1:3]), h, k, v, first, *extra, kv_only=kv_only)
                texts[f"{name}.attention{tag}{kv_only}"] = P.prefix_attention.lower(
                    layers[1], h, k, v, first, *((tables[1:2], slot) if extra else ()),
                    kv_only=kv_only)
            texts[f"{name}.mlp{tag}"] = P.prefix_mlp.lower(
                layers[-1], kinds[-1], h, h, *((tables[-1:], slot) if extra else ()))
    found = {n: audit(t.compile().as_text()) for n, t in texts.items()}
    assert found == {n: [] for n in texts}, found

    model = Model.load(tiny_ckpt)
    eng = Engine(model, max_batch_size=4, warmup=True, slice_budget=0.0)
    try:
        eng.wait_warm(timeout=600)
        P = eng.programs
        names = ("vision_embed", "vision_blocks", "prefix_input", "prefix_layers",
                 "prefix_attention", "prefix_mlp", "write_prefix_pages")
        warm = {n: getattr(P, n)._cache_size() for n in names}
        img = np.random.default_rng(0).integers(0, 255, (768, 1024, 3), np.uint8)
        _while_decoding(eng, model, [Request("text", model.prompts.caption("short"), img,
                                             Settings(temperature=0.0, max_tokens=4))], 1)
        assert eng.counters["slices"] > 0
        assert {n: getattr(P, n)._cache_size() for n in names} == warm
    finally:
        eng.close()


def test_bad_slicing_options_are_refused_by_name(tiny_ckpt):
    model = Model.load(tiny_ckpt)
    for kw, match in [({"slice_ratio": 1.0}, "slice_ratio"), ({"slice_ratio": "4"}, "slice_ratio"),
                      ({"slice_budget": -1}, "slice_budget"),
                      ({"slice_groups": (4, 1)}, "must divide"),
                      ({"slice_groups": (1, 0.25)}, "slice_groups")]:
        with pytest.raises(ValueError, match=match):
            Engine(model, **kw)
