"""The TPU decode attention (`tpu_attention`) run by the Pallas TPU interpreter on CPU: values
against float64 attention (under the TPU interpreter: scratch memory starts as NaN, and an
out-of-bounds copy raises), the pool's TPU layout through the writes and gathers of `kvpool`,
and the engine on it against the default attention.  (Whether it compiles for a TPU -- Mosaic,
XLA:TPU, VMEM -- is `bench/tpu_compile.py`'s check, with libtpu.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from photon_jax.engine import kvpool
from photon_jax.engine.core import Engine
from photon_jax.engine.request import Request
from photon_jax.engine.settings import Settings
from photon_jax.kernels import tpu_attention as ta
from photon_jax.model import Model
from photon_jax.model.config import tiny

from helpers import FIXTURE_DIR, biased_model


def attention64(k_KPBH, v_KPBH, q_RQH, pt_RM, length_R):
    """Float64 attention of each row's query over its first length positions, read in its
    page table's order from the [K, P, B, H] pages."""
    r, n_q, h = q_RQH.shape
    n_kv, _, page, _ = k_KPBH.shape
    g = n_q // n_kv
    out = np.zeros((r, n_q, h))
    for i in range(r):
        pages = pt_RM[i, : -(-length_R[i] // page)]
        k = np.concatenate([k_KPBH[:, p] for p in pages], 1)[:, :length_R[i]]
        v = np.concatenate([v_KPBH[:, p] for p in pages], 1)[:, :length_R[i]]
        for qh in range(n_q):
            s = k[qh // g].astype(np.float64) @ q_RQH[i, qh].astype(np.float64) / np.sqrt(h)
            w = np.exp(s - s.max())
            out[i, qh] = (w / w.sum()) @ v[qh // g].astype(np.float64)
    return out.reshape(r, n_q * h)


def packed(x_KPBH, lanes):
    """[K, P, B, H] pages in the TPU layout [ceil(K / f), P, B, f * H]."""
    return np.asarray(ta.pack_heads(jnp.asarray(x_KPBH).transpose(1, 2, 0, 3),
                                    lanes)).transpose(2, 0, 1, 3)


def case(n_kv, groups, dtype, page=16, n_pages=24, width=6, seed=0):
    """Pool, queries and tables: ragged lengths (one position, a page boundary, a full
    table, ...) and rows 1 and 2 sharing their first two pages (a cached prefix)."""
    rng = np.random.default_rng(seed)
    h = 64
    length = np.array([1, 17, 40, 96, 33, 64])
    r = len(length)
    k = rng.standard_normal((n_kv, n_pages, page, h)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_pages, page, h)).astype(np.float32)
    q = rng.standard_normal((r, n_kv * groups, h)).astype(np.float32)
    pt = rng.permutation(np.arange(1, n_pages))[: r * width // 2]
    pt = np.concatenate([pt, rng.integers(1, n_pages, r * width - len(pt))]).reshape(r, width)
    pt[2, :2] = pt[1, :2]
    # Round the inputs to the dtype once, so that float64 sees what the kernel sees.
    rnd = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
    return rnd(k), rnd(v), rnd(q), pt.astype(np.int32), length.astype(np.int32)


@pytest.mark.parametrize("n_kv, groups, dtype, tol", [
    (2, 1, "float32", 2e-6),     # MHA, two heads in one pool row
    (4, 2, "float32", 2e-6),     # GQA
    (3, 2, "float32", 2e-6),     # an odd head count: a zero head pads the last row
    (2, 1, "bfloat16", 2e-2),
    (4, 4, "bfloat16", 2e-2),
])
def test_the_kernel_matches_float64_attention(n_kv, groups, dtype, tol):
    k, v, q, pt, length = case(n_kv, groups, dtype)
    lanes = 128
    got = ta.attend(jnp.asarray(packed(k, lanes), dtype), jnp.asarray(packed(v, lanes), dtype),
                    jnp.asarray(q, dtype), jnp.asarray(pt), jnp.asarray(length),
                    n_kv_heads=n_kv, interpret="strict")
    assert got.dtype == jnp.dtype(dtype) and got.shape == (len(length), n_kv * groups * 64)
    want = attention64(k, v, q, pt, length)
    err = np.abs(np.asarray(got, np.float64) - want).max()
    assert err < tol, err
    # bfloat16: the error is the output's rounding, not a wrong weighting.
    assert np.abs(np.asarray(got, np.float64) - want).mean() < tol / 4


def test_the_kernel_reads_no_page_past_a_rows_length():
    """Table entries past each row's last live page point outside the pool: the interpreter
    raises on an out-of-bounds copy, so the kernel copied none of them -- it reads each row's
    live pages only, and the rows' shared pages where they lie."""
    k, v, q, pt, length = case(2, 1, "float32")
    page = k.shape[2]
    live = -(-length // page)
    bad = pt.copy()
    for i, n in enumerate(live):
        bad[i, n:] = 10_000 + i
    args = (jnp.asarray(packed(k, 128)), jnp.asarray(packed(v, 128)), jnp.asarray(q))
    got = ta.attend(*args, jnp.asarray(bad), jnp.asarray(length), n_kv_heads=2, interpret="strict")
    np.testing.assert_allclose(np.asarray(got), attention64(k, v, q, pt, length), atol=2e-6)
    # ... and the same table with a live entry out of bounds is refused: the check bites.
    bad[0, 0] = 10_000
    with pytest.raises(Exception):
        jax.block_until_ready(ta.attend(*args, jnp.asarray(bad), jnp.asarray(length),
                                        n_kv_heads=2, interpret="strict"))


def test_the_kernel_reads_at_most_1_1x_the_attended_bytes_at_moondream_shapes():
    """Bytes copied (`read_bytes`: whole live pages, all heads, nothing padded at 32 kv
    heads of dim 64) against the attended K/V bytes, for rows after an image prefix (730
    positions) in pages of 64."""
    for n in range(731, 2049):
        got = ta.read_bytes([n], 64, 32, 64, 2)
        assert got <= 1.1 * 2 * n * 32 * 64 * 2, n
    assert ta.packed_heads(32, 64) == (16, 128)   # Moondream: no padded head
    assert ta.pack(64) == 2 and ta.pack(128) == 1 and ta.pack(32) == 4 and ta.pack(96) == 1


def test_the_tpu_layout_round_trips_through_the_pool_writes_and_gathers():
    """`kvpool.write_tokens` packs heads into the TPU layout and the prefill gather unpacks
    them: what was written at (page, offset) is read back per head, for an odd head count
    too (the padded head stays zero)."""
    cfg = tiny().text
    for n_kv in (1, 4):
        c = type(cfg)(**{**cfg.__dict__, "n_heads": n_kv, "n_kv_heads": n_kv,
                         "dim": 64 * n_kv})
        pool = kvpool.init_pool(c, (6,), 16, "float32", pack=ta.pack(64))
        assert pool.k[0][0].shape == (-(-n_kv // 2), 6, 16, 128)
        x = np.random.default_rng(1).standard_normal((3, n_kv, 64)).astype(np.float32)
        page, off = np.array([2, 5, 2]), np.array([0, 7, 15])
        (arena,) = kvpool.write_tokens(pool.k[0], page, off, jnp.asarray(x))
        g = ta.unpack_heads(kvpool.gather_pages((arena,), jnp.asarray([[2, 5]])), n_kv, 64)
        assert g.shape == (n_kv, 1, 2, 16, 64)
        g = np.asarray(g)
        np.testing.assert_array_equal(g[:, 0, 0, 0], x[0])
        np.testing.assert_array_equal(g[:, 0, 1, 7], x[1])
        np.testing.assert_array_equal(g[:, 0, 0, 15], x[2])
        if n_kv % 2:
            assert not np.asarray(arena)[..., 64:].any()


def quantized(x_KPBH, fmt):
    """(codes [K, P, B, H] as the pool stores them on CPU, scales [K, P, B], the dequantized
    values in float64)."""
    codes, sc = kvpool.quantize(jnp.asarray(x_KPBH), fmt)
    codes = kvpool.as_storage(codes, kvpool.storage_dtype(fmt, "cpu"))
    deq = np.asarray(kvpool.as_format(codes).astype(jnp.float32), np.float64) * \
        np.asarray(sc, np.float64)[..., None]
    return codes, sc, deq


def packed_scales(sc_KPB, f):
    """[K, P, B] scales in the TPU layout [ceil(K / f), P, f * B] (`ta.scale_shape`)."""
    k, p, t = sc_KPB.shape
    rows = -(-k // f)
    x = ta.pack_scales(jnp.asarray(sc_KPB).transpose(1, 2, 0), rows, f)   # [rows, P, B, f]
    return x.transpose(0, 1, 3, 2).reshape(rows, p, f * t)


@pytest.mark.parametrize("n_kv, groups, fmt, qdtype, tol", [
    (2, 1, "int8", "float32", 2e-6),          # MHA
    (3, 2, "int8", "float32", 2e-6),          # GQA, an odd head count (a padded head)
    (4, 2, "int8", "bfloat16", 2e-2),         # the products in bfloat16
    (2, 1, "float8_e4m3fn", "float32", 2e-6),  # e4m3 (stored as bytes on CPU)
])
def test_the_kernel_reads_8bit_pages_and_matches_float64_attention(n_kv, groups, fmt, qdtype,
                                                                   tol):
    """An 8-bit pool in the TPU layout, scales [rows, P, 2 * T]: the kernel's attention
    equals float64 attention over the dequantized pool (ragged rows, two rows sharing
    pages), the products in q's dtype."""
    k, v, q, pt, length = case(n_kv, groups, "float32", page=32, n_pages=12, width=3)
    (kc, ksc, kd), (vc, vsc, vd) = quantized(k, fmt), quantized(v, fmt)
    got = ta.attend(jnp.asarray(packed(np.asarray(kc), 128)),
                    jnp.asarray(packed(np.asarray(vc), 128)),
                    jnp.asarray(q, qdtype), jnp.asarray(pt), jnp.asarray(length),
                    n_kv_heads=n_kv, ks_pool=packed_scales(ksc, 2),
                    vs_pool=packed_scales(vsc, 2), interpret="strict")
    assert got.dtype == jnp.dtype(qdtype) and got.shape == (len(length), n_kv * groups * 64)
    q64 = np.asarray(jnp.asarray(q, qdtype).astype(jnp.float32))
    want = attention64(kd, vd, q64, pt, length)
    err = np.abs(np.asarray(got, np.float64) - want)
    assert err.max() < tol and err.mean() < tol / 4, err.max()


def test_8bit_codes_and_scales_round_trip_through_the_tpu_layout():
    """`kvpool.write_tokens_q` into an int8 pool in the TPU layout (three heads: one padded)
    puts each head's scale at lane s*B + offset of its page's row, and the prefill gather
    reads back what `quantize` gave; a page copy moves the scales with the codes."""
    cfg = tiny().text
    c = type(cfg)(**{**cfg.__dict__, "n_heads": 3, "n_kv_heads": 3, "dim": 192})
    pool = kvpool.init_pool(c, (6,), 32, "int8", pack=2)
    assert pool.k[0][0].shape == (2, 6, 32, 128) and pool.ks[0][0].shape == (2, 6, 64)
    x = np.random.default_rng(2).standard_normal((3, 3, 64)).astype(np.float32)
    page, off = np.array([2, 5, 2]), np.array([0, 7, 31])
    (arena,), (sc,) = kvpool.write_tokens_q(pool.k[0], pool.ks[0], page, off, jnp.asarray(x))
    codes, want_sc = kvpool.quantize(jnp.asarray(x), "int8")
    sc_np = np.asarray(sc)
    np.testing.assert_array_equal(sc_np[1, 5, 7], want_sc[1, 2])          # head 2: row 1, s 0
    np.testing.assert_array_equal(sc_np[0, 2, 32 + 31], want_sc[2, 1])    # head 1: row 0, s 1
    assert sc_np[1, 5, 32 + 7] == 1.0                                      # the padded head
    g = ta.unpack_heads(kvpool.gather_pages((arena,), jnp.asarray([[2, 5]])), 3, 64)
    gs = ta.unpack_scales(kvpool.gather_pages((sc,), jnp.asarray([[2, 5]])), 3, 32)
    assert gs.shape == (3, 1, 2, 32)
    deq = np.asarray(kvpool.dequantize(g, gs))
    np.testing.assert_array_equal(deq[:, 0, 1, 7], np.asarray(kvpool.dequantize(codes, want_sc))[1])
    (moved,) = kvpool.write_pages((sc,), jnp.asarray([3]), kvpool.gather_pages((sc,), jnp.asarray([5])))
    np.testing.assert_array_equal(np.asarray(moved)[:, 3], sc_np[:, 5])
    # A decode step's row updates (`write_rows`) write what the scatter writes.
    page, off = np.array([2, 5, 4]), np.array([0, 7, 31])
    (a, _, s_, _) = kvpool.write_rows(pool.k[0], pool.v[0], page, off, jnp.asarray(x),
                                      jnp.asarray(x), pool.ks[0], pool.vs[0])
    (want_a,), (want_s,) = kvpool.write_tokens_q(pool.k[0], pool.ks[0], page, off,
                                                 jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(want_a))
    np.testing.assert_array_equal(np.asarray(s_[0]), np.asarray(want_s))


def test_the_memory_plan_counts_the_8bit_tpu_pool():
    """On TPU ("pallas-tpu", the packed layout) an int8 pool costs 68 bytes per head and
    position against bfloat16's 128: the plan fits about 1.8x the tokens on a 16 GiB chip
    (1.88x the bytes' ratio, less its larger prefill workspace); an odd head count pays for
    its padded head."""
    from photon_jax.engine import memory
    from photon_jax.model import platforms
    from photon_jax.model.config import moondream2

    cfg = moondream2("bfloat16")
    plat = platforms.choose(cfg, "tpu", "pallas-tpu")
    kw = dict(platform=plat, max_batch_size=32, max_context=2048, page_size=64,
              free=16 << 30)
    base, q8 = memory.plan(cfg, **kw), memory.plan(cfg, kv_dtype="int8", **kw)
    assert memory.bytes_per_token(cfg, kv_dtype="int8", pack=2) == 24 * 2 * 32 * (64 + 4)
    assert 1.75 < q8.kv_cache_tokens / base.kv_cache_tokens < 1.9
    # The same room, less the 8-bit prefill's larger workspace (its dequantized view).
    room = lambda p: p.pool + memory.GPU_POOL_SHARE * p.workspace  # noqa: E731
    assert q8.workspace > base.workspace
    assert abs(room(q8) - room(base)) <= memory.bytes_per_token(cfg) * 64 * 9
    t = tiny().text   # one kv head: a pool row holds it and a zero head
    assert memory.bytes_per_token(tiny(), kv_dtype="int8", pack=2) == \
        2 * memory.bytes_per_token(tiny(), kv_dtype="int8") == 2 * 2 * t.n_layers * 68


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_the_engine_on_the_tpu_kernel_equals_the_default_attention(tiny_ckpt, kv_dtype):
    """The engine on "pallas-tpu-interpret" (the pool in the TPU layout: the tiny model's one
    kv head padded to a pair) gives the tokens of the default attention: captions with a
    prefix-cache hit (shared pages read in place), sampled and greedy, a text-only prompt;
    with an int8 pool too (the same codes and scales, in the TPU layout)."""
    base = biased_model(tiny_ckpt, {0: 0.8})
    model = Model(base.cfg, base.params, base.prompts.tok, attention="pallas-tpu-interpret")
    pr = model.prompts
    img = f"{FIXTURE_DIR}/img_sq378.png"
    greedy, hot = Settings(max_tokens=6, temperature=0), Settings(max_tokens=5, seed=3)
    reqs = [Request("text", pr.caption("short"), img, greedy),
            Request("text", pr.query("w60 w7"), img, greedy),
            Request("text", pr.caption("normal"), img, hot),
            Request("text", [0] + pr.query("w90"), None, greedy)]

    def run(m):
        eng = Engine(m, max_batch_size=4, max_context=800, page_size=32,
                     kv_dtype=kv_dtype)
        try:
            shape = eng.dev.pool.k[0][0].shape
            return [h.result(timeout=600)["ids"] for h in [eng.submit(r) for r in reqs]], shape
        finally:
            eng.close()

    got, shape = run(model)
    want, base_shape = run(base)
    assert shape[0] == 1 and shape[3] == 128 and base_shape[3] == 64   # the TPU layout
    assert got == want
    assert all(len(ids) > 0 for ids in got)
