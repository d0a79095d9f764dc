"""Moondream 3's model pieces on random inputs: the selected-experts MoE against the dense
all-experts formula, cached == uncached forward with tau attention and MoE layers, the
full-size shapes (programs via jax.eval_shape, checkpoint tensors against the published checkpoint layout),
and the segment output parser on synthetic token sequences (segment has no oracle)."""

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from photon_jax.convert import names
from photon_jax.engine import step
from photon_jax.engine.skills import parse_segment
from photon_jax.model import config as C, moe, platforms, text
from photon_jax.model.params import count_params, init_params, param_shapes

from helpers import full_forward


def expert_params(key, d, e, inner, dtype=jnp.float32):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {"router": {"w": (2 * jax.random.normal(k1, (d, e)) / np.sqrt(d)).astype(dtype),
                       "b": (0.05 * jax.random.normal(k4, (e,))).astype(dtype)},
            "fc1": (jax.random.normal(k2, (e, d, 2 * inner)) / np.sqrt(d)).astype(dtype),
            "fc2": (jax.random.normal(k3, (e, inner, d)) / np.sqrt(inner)).astype(dtype)}


@pytest.mark.parametrize("how", [None, "gather", "blocks", "ragged", "megablox-interpret"])
def test_every_schedule_equals_dense_all_experts(how):
    """Token counts from decode (1 token) to prefill (blocks of 64) and uneven ones in
    between; k = E too.  None: the schedule `moe_mlp` picks for the count.  megablox (the
    TPU kernel) under Pallas's interpreter."""
    for e, k, counts in ((8, 2, (1, 17, 300)), (5, 5, (3,))):
        p = expert_params(jax.random.PRNGKey(e), 48, e, 24)
        sel = jax.jit(partial(moe.moe_mlp, k=k, schedule_=how))
        dense = jax.jit(partial(moe.dense_reference, k=k))
        for n in counts:
            x = jax.random.normal(jax.random.PRNGKey(100 + n), (1, n, 48))
            want = np.asarray(dense(p, x))
            np.testing.assert_allclose(sel(p, x), want, rtol=0, atol=1e-5 * np.abs(want).max())
    # Fewer distinct experts than gather's slots (4 equal tokens select the same 2 of 16):
    # the padding slots must never be picked.
    p = expert_params(jax.random.PRNGKey(16), 48, 16, 24)
    x = jnp.tile(jax.random.normal(jax.random.PRNGKey(7), (1, 1, 48)), (1, 4, 1))
    want = np.asarray(jax.jit(partial(moe.dense_reference, k=2))(p, x))
    got = jax.jit(partial(moe.moe_mlp, k=2, schedule_=how))(p, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("how", ["ragged", "megablox-interpret"])
def test_grouped_schedules_leave_other_chips_experts_out(how):
    """An id of E (an expert another chip holds, `sharding.TensorParallel.experts`) is in
    no group: the other assignments are exact, and ragged_dot's left-out rows are zero
    (megablox's are never written: the caller drops them)."""
    e, k, n = 8, 2, 90
    p = expert_params(jax.random.PRNGKey(8), 48, e, 24)
    x = jax.random.normal(jax.random.PRNGKey(9), (n, 48))
    ids = jax.random.randint(jax.random.PRNGKey(10), (n, k), 0, e)
    other = jax.random.bernoulli(jax.random.PRNGKey(11), 0.6, (n, k))
    got = np.asarray(jax.jit(moe._APPLY[how])(p, x, jnp.where(other, e, ids)))
    want = np.asarray(moe._dense(p, x, ids))
    mine = ~np.asarray(other)
    np.testing.assert_allclose(got[mine], want[mine], rtol=0, atol=1e-5 * np.abs(want).max())
    if how == "ragged":
        assert not got[~mine].any()


@pytest.mark.parametrize("tokens", [1, 746])
def test_megablox_lowers_for_tpu_at_moondream3_shapes(tokens):
    """The megablox schedule at full Moondream 3 shapes (bfloat16, abstract: nothing is
    allocated) lowers to a Mosaic kernel per product (decode's one 16-row tile, prefill's
    128-row tiles); libtpu's compile of it: `bench/tpu_compile.py --moe`."""
    cfg = C.moondream3()
    m = cfg.text.moe
    p = {"router": {"w": jax.ShapeDtypeStruct((cfg.text.dim, m.num_experts), jnp.bfloat16),
                    "b": jax.ShapeDtypeStruct((m.num_experts,), jnp.bfloat16)},
         "fc1": jax.ShapeDtypeStruct((m.num_experts, cfg.text.dim, 2 * m.expert_inner_dim),
                                     jnp.bfloat16),
         "fc2": jax.ShapeDtypeStruct((m.num_experts, m.expert_inner_dim, cfg.text.dim),
                                     jnp.bfloat16)}
    x = jax.ShapeDtypeStruct((tokens, cfg.text.dim), jnp.bfloat16)
    dev = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    fn = jax.jit(partial(moe.moe_mlp, k=m.experts_per_token, schedule_="megablox"))
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=dev)):
        text_ = fn.trace(p, x).lower(lowering_platforms=("tpu",)).as_text()
    assert text_.count("tpu_custom_call") == 2


def test_the_gpu_prefill_workspace_counts_every_experts_rows():
    """GPU's MoE prefill (`dense`) holds fc1's output and the gated activation of all 64
    experts for every position (0.39 MB a position at Moondream 3's shapes, measured in
    deviceless H200 compiles); the memory plan's workspace must count them, or a prefill's
    temporaries land in the pool's margin."""
    from photon_jax.engine import memory

    cfg = C.moondream3()
    m = cfg.text.moe
    rows = m.num_experts * 3 * m.expert_inner_dim * 2                    # bfloat16
    scores = cfg.text.n_heads * (cfg.prefix_len + memory.PREFILL_TOKENS) * 4
    gpu = memory.prefill_token_bytes(cfg, grouped=platforms.default_grouped("gpu"))
    assert gpu == rows + scores
    assert memory.prefill_token_bytes(cfg, grouped=platforms.default_grouped("tpu")) < gpu


def test_megablox_tiles_follow_the_rows_per_expert():
    # 746 image-prompt tokens x top-8 over 64 experts: 93 rows each -> tiles of 128;
    # 32 such rows: ~3000 each -> 512 (the cap).
    assert moe.megablox_tile_rows(746 * 8, 64) == 128
    assert moe.megablox_tile_rows(32 * 746 * 8, 64) == 512
    assert moe.megablox_tile_rows(300 * 8, 64) == 128 and moe.megablox_tile_rows(4096, 16) == 256
    # Decode: one tile of every assignment (1 row x top-8 -> 16; 8 rows -> 64).
    assert moe.megablox_tile_rows(8, 64) == 16 and moe.megablox_tile_rows(64, 64) == 64


def test_schedule_reads_few_experts_by_gather_and_many_densely():
    # Moondream 3 (64 experts, top-8): one or two decode rows gather their 8-16 experts,
    # a batch of 4+ rows selects most of them and reads them all once; prefill is grouped.
    assert [moe.schedule(n, 64, 8) for n in (1, 2, 4, 32, 64)] == \
        ["gather", "gather", "dense", "dense", "dense"]
    assert moe.schedule(65, 64, 8) == "blocks" and moe.schedule(746, 64, 8, "ragged") == "ragged"
    # CPU: the block loop where GPUs gather.
    assert [moe.schedule(n, 64, 8, "blocks+blocks") for n in (1, 2, 4, 746)] == \
        ["blocks", "blocks", "dense", "blocks"]
    # TPU: megablox where the others gather; ragged_dot for prefill.
    assert [moe.schedule(n, 64, 8, "ragged+megablox") for n in (1, 2, 4, 746)] == \
        ["megablox", "megablox", "dense", "ragged"]


def test_routing_is_top_k_then_softmax_over_the_k():
    p = expert_params(jax.random.PRNGKey(3), 32, 8, 16)
    x = jax.random.normal(jax.random.PRNGKey(4), (6, 32))
    ids, w = moe.route(p, x, 3)
    logits = np.asarray(x @ p["router"]["w"] + p["router"]["b"])
    want_ids = np.argsort(-logits, axis=1)[:, :3]
    np.testing.assert_array_equal(ids, want_ids)
    top = np.take_along_axis(logits, want_ids, 1)
    want_w = np.exp(top - top.max(1, keepdims=True))
    np.testing.assert_allclose(w, want_w / want_w.sum(1, keepdims=True), rtol=1e-5)


def test_a_skewed_routing_is_still_exact():
    """Every token sent to the same few experts (one group far larger than the mean, so its
    blocks and the padding bound are exercised)."""
    p = expert_params(jax.random.PRNGKey(5), 32, 8, 16)
    p["router"]["b"] = p["router"]["b"].at[jnp.array([2, 6])].add(100.0)
    x = jax.random.normal(jax.random.PRNGKey(6), (200, 32))
    ids, _ = moe.route(p, x, 2)
    assert set(np.unique(ids)) == {2, 6}
    want = np.asarray(moe.dense_reference(p, x, 2))
    for how in ("blocks", "ragged", "megablox-interpret"):
        fn = partial(moe.moe_mlp, k=2, schedule_=how)
        np.testing.assert_allclose(jax.jit(fn)(p, x),
                                   want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.fixture(scope="module")
def md3(md3_ckpt):
    from photon_jax.model import Model

    m = Model.load(md3_ckpt)
    return m.cfg, m.params, step.oracle_of(m)


@pytest.mark.parametrize("grouped", ["blocks", "ragged+megablox-interpret"])
def test_cached_prefill_and_decode_equal_uncached_forward(md3, grouped):
    """The fixture model (tau in every layer, MoE in 2 of 4): prefill of a bidirectional
    prefix and a prompt (its rows through the experts in blocks), then one-token decode
    steps with the KV cache == one uncached forward over everything.  (The 730-position image prefix is
    checked against the oracle's KV cache in test_md3_parity.)  Also with TPU's schedules
    (ragged_dot prefill, megablox decode under the interpreter)."""
    cfg, params, P = md3
    if grouped != "blocks":
        P = step.build_oracle(cfg, grouped=grouped)
    prefix, n_prompt, n_decode = 70, 5, 3
    x = jax.random.normal(jax.random.PRNGKey(1), (prefix + n_prompt + n_decode, cfg.text.dim))
    ref = np.asarray(full_forward(cfg, params, x, prefix))
    tol = 1e-4 * np.abs(ref).max()
    cache = text.init_cache(cfg, rows=1, length=256)
    rows, pre = np.zeros(1, np.int32), np.full(1, prefix, np.int32)
    p = prefix + n_prompt
    cache, hid, _, _ = P.prefill(params, cache, x[None, :p], np.arange(p)[None], rows, pre,
                                 np.full(1, p - 1), 256)
    np.testing.assert_allclose(hid[0], ref[:p], rtol=0, atol=tol)
    # Decode steps fed embeddings directly (the decode program embeds token ids).
    forward = jax.jit(text.forward, static_argnums=(1, 6))
    for _ in range(n_decode):
        hid, cache, _ = forward(params["text"], cfg.text, x[None, p:p + 1], np.array([[p]]),
                                cache, text.DenseAccess(rows, pre, 256), grouped)
        np.testing.assert_allclose(hid[0, 0], ref[p], rtol=0, atol=tol)
        p += 1


def test_rows_do_not_share_experts_state(md3):
    """A row's decode output does not depend on the other rows of the step, though they
    share the experts' blocks."""
    cfg, params, P = md3
    rng = np.random.default_rng(0)
    rows = np.arange(1, 5, dtype=np.int32)
    outs = []
    for other in (rng.integers(10, 900, 3), rng.integers(900, 2000, 3)):
        cache = text.init_cache(cfg, rows=5, length=256)
        toks = np.array([42, *other], np.int32)
        _, _, lg = P.decode(params, cache, np.zeros(4, np.int32), toks,
                            np.zeros((4, 2), np.float32), np.full(4, 3, np.int32), rows,
                            np.zeros(4, np.int32), 256)
        outs.append(np.asarray(lg))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=0, atol=1e-6)
    assert not np.allclose(outs[0][1], outs[1][1])


def test_layer_split_and_expert_count_come_from_the_config():
    base = C.tiny_md3()
    for start, n_layers, e, k in ((0, 2, 4, 1), (2, 2, 4, 4), (1, 3, 16, 3)):
        moe_cfg = C.MoEConfig(num_experts=e, start_layer=start, experts_per_token=k,
                              expert_inner_dim=40)
        cfg = replace(base, text=replace(base.text, n_layers=n_layers, moe=moe_cfg)).validate()
        tree = param_shapes(cfg)["text"]
        assert ("blocks" in tree) == (start > 0)
        assert ("moe_blocks" in tree) == (start < n_layers)
        if start < n_layers:
            assert tree["moe_blocks"]["moe"]["fc1"] == (n_layers - start, e, 64, 80)
            assert tree["moe_blocks"]["moe"]["router"]["w"] == (n_layers - start, 64, e)
    with pytest.raises(C.ConfigError, match="experts_per_token"):
        replace(base, text=replace(base.text, moe=C.MoEConfig(4, 1, 5, 8))).validate()
    with pytest.raises(C.ConfigError, match="start_layer"):
        replace(base, text=replace(base.text, moe=C.MoEConfig(4, 5, 2, 8))).validate()


def test_full_size_moondream3_shapes():
    """The real Moondream 3: parameter count, the HF tensors of the published checkpoint, and the
    decode program's outputs, without allocating."""
    cfg = C.moondream3()
    assert (cfg.text.rope_theta, cfg.text.max_context, cfg.text.n_dense, cfg.text.n_moe) == \
        (1.5e6, 32768, 4, 20)
    assert count_params(jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), cfg))) == \
        9_268_626_928
    hf = names.hf_shapes(cfg)
    real = {
        "model.text.blocks.0.attn.tau.wq": (32, 6144),
        "model.text.blocks.23.attn.tau.wv": (32, 6144),
        "model.text.blocks.5.attn.tau.alpha": (32,),
        "model.text.blocks.3.mlp.fc1.weight": (8192, 2048),
        "model.text.blocks.4.mlp.router.weight": (64, 2048),
        "model.text.blocks.4.mlp.router.bias": (64,),
        "model.text.blocks.4.mlp.fc1.weight": (64, 2048, 2048),
        "model.text.blocks.23.mlp.fc2.weight": (64, 2048, 1024),
        "model.region.coord_decoder.weight": (1024, 2048),
        "model.region.coord_decoder.bias": (1024,),
        "model.region.size_decoder.weight": (2048, 2048),
        "model.region.ln.weight": (2048,),
        "model.region.coord_encoder.weight": (2048, 256),
        "model.region.size_encoder.weight": (2048, 512),
    }
    for name, shape in real.items():
        assert hf[name] == shape, name
    assert "model.text.blocks.4.mlp.fc1.bias" not in hf
    assert "model.region.coord_decoder.fc1.weight" not in hf
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), cfg))
    P = step.build_oracle(cfg)
    cache = jax.eval_shape(lambda: text.init_cache(cfg, rows=2, length=4096))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    out = jax.eval_shape(P.decode, params, cache, i32(2), i32(2),
                         jax.ShapeDtypeStruct((2, 2), jnp.float32), i32(2), i32(2), i32(2), 1024)
    assert out[1].shape == (2, 2048) and out[2].shape == (2, 51200)
    out = jax.eval_shape(P.prefill, params, cache,
                         jax.ShapeDtypeStruct((1, 730, 2048), jnp.bfloat16), i32(1, 730),
                         i32(1), i32(1), i32(1), 1024)
    assert out[1].shape == (1, 730, 2048)


# -- segment output (no oracle: synthetic token sequences) --------------------------------

COORD, SIZE = 5, 6


def words(ids):
    return " ".join(f"w{i}" for i in ids if i >= 10)


def test_segment_box_then_path():
    ids = [COORD, COORD, SIZE, 11, 12, 13]
    values = [(0.5, 0), (0.25, 0), (0.2, 0.1), (0, 0), (0, 0), (0, 0)]
    out = parse_segment(ids, values, words, COORD, SIZE)
    assert out["path"] == "w11 w12 w13"
    assert out["bbox"] == pytest.approx({"x_min": 0.4, "y_min": 0.2, "x_max": 0.6,
                                         "y_max": 0.3})


def test_segment_later_coords_and_sizes_do_not_move_the_box_or_enter_the_path():
    ids = [COORD, COORD, SIZE, 20, COORD, COORD, SIZE, 21]
    values = [(0.1, 0), (0.9, 0), (0.5, 0.5), (0, 0), (0.7, 0), (0.7, 0), (0.1, 0.1), (0, 0)]
    out = parse_segment(ids, values, words, COORD, SIZE)
    assert out["path"] == "w20 w21"
    assert out["bbox"] == pytest.approx({"x_min": -0.15, "y_min": 0.65, "x_max": 0.35,
                                         "y_max": 1.15})    # not clamped, like detect


@pytest.mark.parametrize("ids", [[], [11, 12], [COORD, 11], [COORD, COORD, 11],
                                 [SIZE, COORD, COORD, 11]])
def test_segment_without_a_complete_box(ids):
    """No box unless a size follows two coordinates; the text is still the path."""
    values = [(0.3, 0.3)] * len(ids)
    out = parse_segment(ids, values, words, COORD, SIZE)
    assert out["bbox"] is None
    assert out["path"] == words(ids)
