"""Model invariants on random tiny configs, including grouped-query attention:
cached decode == uncached full forward, prefill-then-decode == full forward, row
independence, reproducible sampling, and full-size shapes via jax.eval_shape."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from photon_jax.engine import step
from photon_jax.model import config as C, sampling, text
from photon_jax.model.params import init_params

from helpers import full_forward

sample = jax.jit(sampling.sample)   # as the engine runs it (eager lax.cond recompiles)

PREFIX = 730


def small_cfg(n_heads, n_kv_heads, layers=2):
    base = C.tiny("float32")
    t = replace(base.text, dim=64 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads,
                n_layers=layers, ff_dim=96)
    v = replace(base.vision, proj_out_dim=t.dim)
    r = replace(base.region, dim=t.dim)
    return replace(base, text=t, vision=v, region=r).validate()


@pytest.fixture(scope="module", params=[(1, 1), (4, 2)], ids=["mha", "gqa-4h-2kv"])
def setup(request):
    cfg = small_cfg(*request.param)
    params = init_params(jax.random.PRNGKey(7), cfg)
    return cfg, params, step.build_oracle(cfg)


def test_prefill_then_decode_equals_full_forward(setup):
    cfg, params, P = setup
    n_prompt, n_decode = 6, 5
    key = jax.random.PRNGKey(1)
    x = jax.random.normal(key, (PREFIX + n_prompt + n_decode, cfg.text.dim), jnp.float32)
    ref = np.asarray(full_forward(cfg, params, x, PREFIX))

    cache = text.init_cache(cfg, rows=1)
    rows, pre = np.zeros(1, np.int32), np.full(1, PREFIX, np.int32)
    cache, hid, _, _ = P.prefill(params, cache, x[None, :PREFIX], np.arange(PREFIX)[None],
                                 rows, pre, np.full(1, PREFIX - 1), 1024)
    np.testing.assert_allclose(hid[0], ref[:PREFIX], rtol=0, atol=1e-4 * np.abs(ref).max())
    p = PREFIX
    cache, hid, _, _ = P.prefill(params, cache, x[None, p:p + n_prompt],
                                 np.arange(p, p + n_prompt)[None], rows, pre,
                                 np.full(1, n_prompt - 1), 1024)
    np.testing.assert_allclose(hid[0], ref[p:p + n_prompt], atol=1e-4 * np.abs(ref).max())
    p += n_prompt
    # Decode steps feed embeddings directly through text.forward with T=1 (cached path),
    # compiled once (op by op, each of its small ops compiled on its own).
    forward = jax.jit(lambda pt, x, pos, cache: text.forward(
        pt, cfg.text, x, pos, cache, text.DenseAccess(rows, pre, 1024)))
    for i in range(n_decode):
        hid, cache, _ = forward(params["text"], x[None, p:p + 1], np.array([[p]]), cache)
        np.testing.assert_allclose(hid[0, 0], ref[p], atol=1e-4 * np.abs(ref).max())
        p += 1


def test_decode_program_equals_uncached_forward_on_tokens(setup):
    """The jitted decode program (token inputs) reproduces a from-scratch forward."""
    cfg, params, P = setup
    ids = np.array([5, 17, 300, 4000, 12, 9, 77], np.int32)
    emb = params["text"]["wte"][ids]
    ref = np.asarray(full_forward(cfg, params, emb, 0))   # text-only: purely causal
    cache = text.init_cache(cfg, rows=1)
    rows, pre = np.zeros(1, np.int32), np.zeros(1, np.int32)
    cache, hid, last, logits = P.prefill(params, cache, emb[None, :3], np.arange(3)[None], rows,
                                         pre, np.array([2]), 256)
    np.testing.assert_allclose(hid[0], ref[:3], atol=1e-4 * np.abs(ref).max())
    for p in range(3, len(ids)):
        cache, h, lg = P.decode(params, cache, np.zeros(1, np.int32), ids[p:p + 1],
                                np.zeros((1, 2), np.float32), np.array([p]), rows, pre, 256)
        np.testing.assert_allclose(h[0], ref[p], atol=1e-4 * np.abs(ref).max())
        want = text.logits(params["text"], jnp.asarray(ref[p])[None])
        np.testing.assert_allclose(lg, want, atol=1e-4 * np.abs(want).max())


def test_rows_are_independent(setup):
    """A row's hidden state and logits do not depend on the other rows of the batch."""
    cfg, params, P = setup
    rng = np.random.default_rng(0)
    rows_n = 4
    cache = text.init_cache(cfg, rows=rows_n + 1)
    ids = rng.integers(10, 1000, size=(rows_n, 8)).astype(np.int32)
    emb = params["text"]["wte"][ids]
    rows = np.arange(1, rows_n + 1, dtype=np.int32)
    pre = np.zeros(rows_n, np.int32)
    pos = np.tile(np.arange(8, dtype=np.int32), (rows_n, 1))
    cache, hid_a, _, lg_a = P.prefill(params, cache, emb, pos, rows, pre,
                                      np.full(rows_n, 7, np.int32), 256)
    # Change every other row's tokens (same shapes): row 0's outputs must not move at all.
    ids2 = ids.copy()
    ids2[1:] = rng.integers(10, 1000, size=(rows_n - 1, 8))
    cache2 = text.init_cache(cfg, rows=rows_n + 1)
    cache2, hid_b, _, lg_b = P.prefill(params, cache2, params["text"]["wte"][ids2], pos, rows,
                                       pre, np.full(rows_n, 7, np.int32), 256)
    np.testing.assert_array_equal(np.asarray(hid_a[0]), np.asarray(hid_b[0]))
    np.testing.assert_array_equal(np.asarray(lg_a[0]), np.asarray(lg_b[0]))
    assert not np.array_equal(np.asarray(lg_a[1]), np.asarray(lg_b[1]))
    # Decode with rows at different positions: row 0 again unaffected by its neighbours.
    outs = []
    for c, other in ((cache, 3), (cache2, 900)):
        toks = np.array([42, other, other + 1, other + 2], np.int32)
        c, h, lg = P.decode(params, c, np.zeros(rows_n, np.int32), toks,
                            np.zeros((rows_n, 2), np.float32), np.full(rows_n, 8, np.int32),
                            rows, pre, 256)
        outs.append(np.asarray(lg[0]))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_sampling_is_reproducible_and_batch_independent():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(3, 500)) * 3, jnp.float32)
    ban = np.full((3, 1), -1, np.int32)
    t, p = np.full(3, 0.8, np.float32), np.full(3, 0.9, np.float32)
    seed, idx = np.array([5, 5, 6], np.int32), np.array([0, 1, 0], np.int32)
    a = np.asarray(sample(logits, ban, t, p, seed, idx))
    # Row 0 alone gives the same draw as inside the batch.
    b = np.asarray(sample(logits[:1], ban[:1], t[:1], p[:1], seed[:1], idx[:1]))
    assert a[0] == b[0]
    draws = {int(sample(logits[:1], ban[:1], t[:1], p[:1], np.array([s], np.int32),
                        np.array([0], np.int32))[0]) for s in range(40)}
    assert len(draws) > 1, "different seeds must be able to give different tokens"
    # temperature 0 is argmax; a banned id is never chosen
    g = sample(logits, ban, np.zeros(3, np.float32), p, seed, idx)
    np.testing.assert_array_equal(g, np.argmax(np.asarray(logits), -1))
    top = np.argmax(np.asarray(logits), -1)
    g2 = sample(logits, top[:, None].astype(np.int32), np.zeros(3, np.float32), p, seed, idx)
    assert not np.any(np.asarray(g2) == top)


def test_top_p_keeps_only_the_nucleus():
    # probabilities ~ [0.5, 0.3, 0.2, ...]: with top_p 0.6 only ids 0 and 1 may be drawn
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]], jnp.float32))
    seen = set()
    for s in range(60):
        tok = sample(logits, np.full((1, 1), -1, np.int32), np.ones(1, np.float32),
                     np.full(1, 0.6, np.float32), np.array([s], np.int32),
                     np.zeros(1, np.int32))
        seen.add(int(tok[0]))
    assert seen == {0, 1}


def test_full_size_programs_have_the_right_shapes():
    """The real Moondream 2 shapes through the image and text programs, without allocating."""
    cfg = C.moondream2()
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), cfg))
    P = step.build_oracle(cfg)
    n_crops, tiling = 9, (2, 4)
    from photon_jax.model.pixels import pool_operands

    src, ph, pw = pool_operands(tiling, cfg.vision)
    feats, emb = jax.eval_shape(P.encode_image, params,
                                jax.ShapeDtypeStruct((n_crops, 378, 378, 3), jnp.uint8),
                                src, ph, pw)
    assert feats.shape == (9, 729, 1152) and emb.shape == (729, 2048)
    assert emb.dtype == jnp.bfloat16
    cache = jax.eval_shape(lambda: text.init_cache(cfg, rows=2))
    assert cache.k.shape == (24, 2, 2048, 32, 64)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    out = jax.eval_shape(P.decode, params, cache, i32(2), i32(2),
                         jax.ShapeDtypeStruct((2, 2), jnp.float32), i32(2), i32(2), i32(2), 1024)
    assert out[1].shape == (2, 2048) and out[2].shape == (2, 51200)
    assert out[2].dtype == jnp.float32


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_cpu_vision_attention_loop_equals_the_batched_attention(dtype, tol):
    """The vision encoder's CPU attention (one (crop, head) at a time, the softmax's division
    after the product with V) computes `layers.attention`'s values: float32 to a few ulps,
    bfloat16 to its own rounding; and the whole encoder agrees either way."""
    from photon_jax.model import vision
    from photon_jax.model.layers import attention

    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(3, 729, 2, 8)) * 2, dtype) for _ in range(3))
    got = np.asarray(vision.attention_per_crop_head(q, k, v), np.float32)
    want = np.asarray(attention(q, k, v), np.float32)
    assert got.shape == want.shape == (3, 729, 16)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)

    cfg = C.tiny()
    pv = init_params(jax.random.PRNGKey(1), cfg)["vision"]
    crops = jnp.asarray(r.integers(0, 256, (2, 378, 378, 3)), jnp.uint8)
    a, b = (np.asarray(vision.encode_crops(pv, crops, cfg.vision, jnp.float32, loop=lp))
            for lp in (True, False))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
