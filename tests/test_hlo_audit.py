"""No host sync inside a device program, by construction: the optimized HLO of every program
on the decode path has no `conditional` and no `while` whose trip count XLA does not know.
(XLA:GPU runs both by reading a predicate on the host: a sync per branch or iteration.  On
CPU they cost nothing visible, so only the HLO can show them.)"""

import os

import jax
import numpy as np
import pytest

from photon_jax.engine import step, stepmeta as M
from photon_jax.engine.core import Engine
from photon_jax.engine.frontend import prepare_image
from photon_jax.model import Model
from photon_jax.model.config import tiny, tiny_md3
from photon_jax.model.params import init_params
from photon_jax.model.tokenizer import load_tokenizer

from helpers import FIXTURE_DIR, audit


def test_the_audit_catches_a_cond_and_a_data_dependent_loop():
    def f(x, n):
        c = jax.lax.cond(n > 0, lambda: x, lambda: -x)
        return jax.lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, s[1] * 2),
                                  (0, c))[1]

    def fine(x):
        return jax.lax.fori_loop(0, 3, lambda i, y: y * 2, x)

    bad = audit(jax.jit(f).lower(np.ones(3, np.float32), 2).compile().as_text())
    assert len(bad) == 2 and {" conditional(" in b for b in bad} == {True, False}
    assert any(" while(" in b for b in bad)
    assert audit(jax.jit(fine).lower(np.ones(3, np.float32)).compile().as_text()) == []


@pytest.mark.parametrize("make_cfg", [tiny, tiny_md3], ids=["moondream2", "moondream3"])
def test_decode_path_programs_are_sync_free(make_cfg):
    cfg = make_cfg()
    model = Model(cfg, init_params(jax.random.PRNGKey(0), cfg),
                  load_tokenizer(os.path.join(FIXTURE_DIR, "tokenizer.json")))
    P = step.programs_of(model)
    eng = Engine(model, max_batch_size=2, max_context=1024, kv_cache_tokens=2048,
                 page_size=64)
    try:
        texts = {}
        # Decode: two rows, over every arena count a step may read.
        tables = [list(range(1, 13)), list(range(13, 26))]
        meta, pages, n = M.pack_decode([1, 2], [740, 790], tables, 2, eng.max_pages, 64,
                                       eng.arenas)
        dev = eng.dev
        texts["forward"] = P.forward.lower(model.params, dev.pool.arenas(n), dev.slots[0],
                                           dev.pending, meta, pages).compile().as_text()
        samp = np.zeros((7, 2), np.int32)
        mask = np.full((2, (cfg.text.vocab_size + 31) // 32), -1, np.int32)
        for (stochastic, region, logprobs), prog in P.sample_step.items():
            if logprobs and not (stochastic and region):   # the widest logprobs variant
                continue
            texts[f"sample{stochastic, region, logprobs}"] = prog.lower(
                model.params, dev.slots[0], dev.pending, dev.tables, samp).compile().as_text()
            # ...and its twin with the output shapes' bitmask (engine/grammar.py).
            texts[f"sample{stochastic, region, logprobs}_masked"] = prog.lower(
                model.params, dev.slots[0], dev.pending, dev.tables, samp,
                mask).compile().as_text()
        # Prefill of a prompt after an image prefix, the image prefix itself, and its pages.
        pre, write, table = M.pack_prefill([1], [730], [730], [5], [tables[0]], 1, 16, 768,
                                           64)
        ids = np.zeros((1, 16), np.int32)
        vals = np.zeros((1, 16, 2), np.float32)
        texts["prefill_slot"] = P.prefill_slot.lower(
            model.params, dev.pool, dev.slots[0], ids, ids, vals, pre, write,
            table).compile().as_text()
        # ...with an image block inside the prompt (a later turn's image).
        z = cfg.prefix_len - 1
        texts["prefill_slot_images"] = P.prefill_slot.lower(
            model.params, dev.pool, dev.slots[0], ids, ids, vals, pre, write, table, None,
            jax.ShapeDtypeStruct((1, z, cfg.text.dim), np.float32)).compile().as_text()
        prep = prepare_image(model, os.path.join(FIXTURE_DIR, "img_sq378.png"))
        texts["image_kv"] = P.image_kv.lower(model.params, prep.crops, prep.src, prep.ph,
                                             prep.pw).compile().as_text()
        texts["image_embeddings"] = P.image_embeddings.lower(
            model.params, prep.crops, prep.src, prep.ph, prep.pw).compile().as_text()
        k = jax.ShapeDtypeStruct((cfg.text.n_layers, 730, cfg.text.n_kv_heads,
                                  cfg.text.head_dim), np.float32)
        s = np.zeros(730, np.int32)
        texts["write_prefix_pages"] = P.write_prefix_pages.lower(
            dev.pool, k, k, s, s).compile().as_text()
        texts["copy_pages"] = P.copy_pages.lower(dev.pool, s[:12], s[:12]).compile().as_text()
        metas = np.stack([meta] * 3)
        texts["ceiling"] = P.ceiling.lower(model.params, dev.pool.arenas(n), dev.slots[0],
                                           dev.pending, dev.tables, metas,
                                           np.stack([pages] * 3), samp).compile().as_text()
        for stochastic, prog in P.burst.items():   # the engine's decode bursts (k = 3)
            texts[f"burst{stochastic}"] = prog.lower(
                model.params, dev.pool.arenas(n), dev.slots[0], dev.pending, dev.tables,
                metas, np.stack([pages] * 3), samp).compile().as_text()
    finally:
        eng.close()
    found = {name: audit(t) for name, t in texts.items()}
    assert found == {name: [] for name in texts}, found
    if cfg.text.moe is not None:   # the image prefix ran the MoE block loop: a known trip
        assert '"known_trip_count"' in texts["image_kv"]


@pytest.mark.parametrize("mode,make_cfg", [("gather", tiny), ("masked", tiny),
                                           ("gather", tiny_md3)],
                         ids=["gather", "masked", "moondream3"])
def test_adapter_programs_are_sync_free(mode, make_cfg):
    """The decode, prefill and image programs with LoRA slot tables (each row's adapter a
    gathered or masked product: docs/lora.md; Moondream 3's per-expert adapters gathered
    per assignment), and the slot write, have no conditional and no unknown-trip loop
    either."""
    cfg = make_cfg()
    model = Model(cfg, init_params(jax.random.PRNGKey(0), cfg),
                  load_tokenizer(os.path.join(FIXTURE_DIR, "tokenizer.json")))
    rec = model.platform
    P = step.build(cfg, rec.attention, grouped=rec.grouped, vision_loop=rec.vision_loop,
                   dense=rec.dense, lora_mode=mode)
    eng = Engine(model, max_batch_size=2, max_context=1024, kv_cache_tokens=2048,
                 page_size=64, programs=P, max_adapters=3, max_lora_rank=4)
    try:
        tabs, dev, texts = eng.lora, eng.dev, {}
        tables = [list(range(1, 13)), list(range(13, 26))]
        meta, pages, n = M.pack_decode([1, 2], [740, 790], tables, 2, eng.max_pages, 64,
                                       eng.arenas, adapters=[2, 0])
        texts["forward"] = P.forward.lower(model.params, dev.pool.arenas(n), dev.slots[0],
                                           dev.pending, meta, pages, 1, tabs).compile().as_text()
        pre, write, table = M.pack_prefill([1], [730], [730], [5], [tables[0]], 1, 16, 768,
                                           64, adapters=[1])
        ids = np.zeros((1, 16), np.int32)
        vals = np.zeros((1, 16, 2), np.float32)
        texts["prefill_slot"] = P.prefill_slot.lower(
            model.params, dev.pool, dev.slots[0], ids, ids, vals, pre, write, table,
            tabs).compile().as_text()
        prep = prepare_image(model, os.path.join(FIXTURE_DIR, "img_sq378.png"))
        texts["image_kv"] = P.image_kv.lower(model.params, prep.crops, prep.src, prep.ph,
                                             prep.pw, tabs,
                                             np.ones(1, np.int32)).compile().as_text()
        one = jax.tree.map(lambda t: np.zeros(t.shape[1:], np.float32), tabs)
        texts["write_adapter"] = P.write_adapter.lower(tabs, np.int32(1),
                                                       one).compile().as_text()
    finally:
        eng.close()
    found = {name: audit(t) for name, t in texts.items()}
    assert found == {name: [] for name in texts}, found
