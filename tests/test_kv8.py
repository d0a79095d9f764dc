"""The 8-bit KV pool (`kv_dtype` "int8" / "float8_e4m3fn"): the quantizer's round trip,
every attention path over 8-bit pages against float64 attention on the *dequantized* K/V
(ragged lengths, shared pages, MHA and GQA), the writes (prefill, decode, image prefix, page
copies carry their scales), the engine end to end, the memory plan, and the fidelity of
decoding with an 8-bit cache against the unquantized one (bounded, and shown to catch a
broken scale)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from photon_jax.engine import kvpool, memory, step as step_mod, stepmeta as M
from photon_jax.engine.pages import pages_for
from photon_jax.kernels import cpukernel
from photon_jax.model.config import moondream2

from helpers import CPU_KERNEL_SHAPE_IDS, CPU_KERNEL_SHAPES, FIXTURE_DIR, pallas_attention

FORMATS = ["int8", "float8_e4m3fn"]


def dense_attention(q_QH, k_KSH, v_KSH):
    kh, n = k_KSH.shape[0], q_QH.shape[0]
    q = q_QH.reshape(kh, n // kh, -1).astype(np.float64)
    s = np.einsum("kgh,ksh->kgs", q, k_KSH.astype(np.float64)) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("kgs,ksh->kgh", w, v_KSH.astype(np.float64)).reshape(-1)


def quantized_pool(rng, fmt, kh, p, page, h):
    """(codes, scales, dequantized float64) of random K (or V) pages [kh, p, page, h]."""
    x = rng.normal(size=(kh, p, page, h)) * rng.uniform(0.1, 4.0, size=(kh, p, page, 1))
    codes, sc = kvpool.quantize(jnp.asarray(x, jnp.float32), fmt)
    deq = np.asarray(codes.astype(jnp.float32), np.float64) * np.asarray(sc, np.float64)[..., None]
    return codes, sc, deq


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizer_round_trip_is_within_half_a_step(fmt):
    """int8: |x - q*s| <= s/2 (s = absmax/127); e4m3: relative error <= 2^-4 (3 mantissa
    bits, round to nearest) above the subnormal range, absolute <= s * 2^-10 inside it.
    The vector's absmax is exact, zero vectors stay zero."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4, 64)).astype(np.float32) * rng.uniform(0.01, 100, (64, 4, 1))
    x[3, 1] = 0.0
    codes, sc = kvpool.quantize(jnp.asarray(x), fmt)
    assert codes.dtype == jnp.dtype(fmt) and sc.shape == (64, 4) and sc.dtype == jnp.float32
    y = np.asarray(kvpool.dequantize(codes, sc))
    s = np.asarray(sc)[..., None]
    err = np.abs(y - x)
    if fmt == "int8":
        assert np.all(err <= s * 0.5 * (1 + 1e-5))
    else:
        assert np.all(err <= np.maximum(np.abs(x) * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-5))
    top = np.abs(x).argmax(-1)
    np.testing.assert_allclose(np.take_along_axis(np.abs(y), top[..., None], -1),
                               np.take_along_axis(np.abs(x), top[..., None], -1), rtol=1e-6)
    assert np.all(y[3, 1] == 0)


def _tables(rng, lengths, p, page, m):
    free = rng.permutation(np.arange(1, p)).tolist()
    tables = np.zeros((len(lengths), m), np.int32)
    for i, n in enumerate(lengths):
        used = pages_for(max(n, 1), page)
        tables[i, :used] = free[:used]
        free = free[used:]
    return tables


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kh,g", [(4, 1), (2, 2)], ids=["mha", "gqa"])
def test_decode_paths_equal_float64_on_the_dequantized_pool(fmt, kh, g):
    """The XLA sweep (pages over several arenas), the Pallas kernel (interpreted on CPU) and
    our C++ kernel, over 8-bit pages with scales: rows of 1, 16, 17, 31, 32 and 100
    positions, one row sharing another's pages: each equals float64 attention over the
    dequantized K/V of its own positions."""
    rng = np.random.default_rng(kh * 7 + g)
    h, page, m = 32, 16, 8
    arenas = M.Arenas((12, 12, 24))
    p = arenas.n_pages
    kq, ksc, kd = quantized_pool(rng, fmt, kh, p, page, h)
    vq, vsc, vd = quantized_pool(rng, fmt, kh, p, page, h)
    positions = [0, 15, 16, 30, 31, 99]
    tables = [list(t[:pages_for(pos + 1, page)])
              for t, pos in zip(_tables(rng, [x + 1 for x in positions], p, page, m),
                                positions)]
    q = rng.normal(size=(8, kh * g, h)).astype(np.float32)
    cut = np.cumsum(arenas.sizes)[:-1]

    def split(a, axis=1):
        return tuple(jnp.asarray(x) for x in np.split(np.asarray(a), cut, axis))

    meta, pages, n = M.pack_decode(list(range(1, 7)), positions, tables, 8, m, page, arenas)
    table = jnp.asarray(meta[M.M_TABLE:].T)
    lengths = jnp.asarray(meta[M.M_POS] + 1)
    outs = {}
    sweep_args = [tuple(x.astype(kq.dtype) for x in split(kq))[:n],
                  tuple(x.astype(vq.dtype) for x in split(vq))[:n]]
    outs["sweep"] = np.asarray(jax.jit(kvpool.decode_attend)(
        *sweep_args, jnp.asarray(q), jnp.asarray(pages[0]), jnp.asarray(pages[1]), table,
        split(ksc)[:n], split(vsc)[:n]))
    outs["pallas"] = np.asarray(kvpool.kernel_attend(
        (kq,), (vq,), jnp.asarray(q), table, lengths,
        interpret=pallas_attention() != "pallas", scales_k=(ksc,), scales_v=(vsc,)))
    if jax.default_backend() == "cpu":
        assert cpukernel.load(), cpukernel.reason()
        outs["cpu"] = np.asarray(jax.jit(cpukernel.attend)(kq, vq, jnp.asarray(q), table,
                                                           lengths, ksc, vsc))
        # ... and as a CPU pool stores the codes (e4m3: its bytes, `kvpool.storage_dtype`)
        st = kvpool.storage_dtype(fmt, "cpu")
        outs["cpu-stored"] = np.asarray(jax.jit(cpukernel.attend)(
            kvpool.as_storage(kq, st), kvpool.as_storage(vq, st), jnp.asarray(q), table,
            lengths, ksc, vsc))
    for name, out in outs.items():
        for i, (pos, t) in enumerate(zip(positions, tables)):
            want = dense_attention(q[i], np.concatenate([kd[:, j] for j in t], 1)[:, :pos + 1],
                                   np.concatenate([vd[:, j] for j in t], 1)[:, :pos + 1])
            tol = 2e-5 if (name == "pallas" and pallas_attention() == "pallas") else 5e-6
            np.testing.assert_allclose(out[i].reshape(-1), want, atol=tol, err_msg=name)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("qdt", ["float32", "bfloat16"])
def test_the_gpu_kernel_with_scales_lowers_for_cuda(fmt, qdt):
    """The Pallas kernel over 8-bit pages with their scales lowers for CUDA (a Triton call;
    no GPU needed: what the interpreter runs above must also lower)."""
    r, n, h, kh, p, t, m = 2, 4, 64, 4, 16, 16, 8
    pool = jax.ShapeDtypeStruct((kh, p, t, h), jnp.dtype(fmt))
    sc = jax.ShapeDtypeStruct((kh, p, t), jnp.float32)
    fn = jax.jit(lambda k, v, ks, vs, q, pt, ln: kvpool.kernel_attend(
        (k,), (v,), q, pt, ln, scales_k=(ks,), scales_v=(vs,)))
    text = fn.trace(pool, pool, sc, sc, jax.ShapeDtypeStruct((r, n, h), jnp.dtype(qdt)),
                    jax.ShapeDtypeStruct((r, m), jnp.int32),
                    jax.ShapeDtypeStruct((r,), jnp.int32)).lower(
                        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()
    assert f"tensor<{kh}x{p}x{t}x{h}x{'i8' if fmt == 'int8' else 'f8E4M3FN'}>" in text


# Our C++ kernel is an XLA:CPU FFI target: on a GPU backend (bench/gpu_run.sh's kernel
# pass) there is nothing of it to run; the Pallas tests above cover that backend.
ON_CPU = pytest.mark.skipif(jax.default_backend() != "cpu",
                            reason="the C++ paged-attention kernel exists on the CPU backend only")


@ON_CPU
@pytest.mark.parametrize("h", [256, 260], ids=["vectorized", "element-wise"])
def test_cpu_kernel_decodes_every_e4m3_code_exactly(h):
    """A one-position row's attention is its V vector: with the 254 non-NaN e4m3 codes
    (subnormals, zeros and both signs included) in one vector at scale 1, the kernel's
    arithmetic widening gives exactly ml_dtypes' values, on both of its paths (a head dim
    that is a multiple of 8 or not)."""
    assert cpukernel.load(), cpukernel.reason()
    codes = np.zeros(h, np.uint8)
    codes[:256] = np.arange(256, dtype=np.uint8)
    codes[[0x7F, 0xFF]] = 0                                  # the two NaN codes
    v = np.zeros((1, 2, 4, h), np.uint8)
    v[0, 1, 0] = codes
    v8 = jnp.asarray(v).view(jnp.float8_e4m3fn)
    ones = jnp.ones((1, 2, 4), jnp.float32)
    out = jax.jit(cpukernel.attend)(jnp.zeros_like(v8), v8, jnp.ones((1, 1, h)),
                                    jnp.array([[1]], jnp.int32), jnp.array([1], jnp.int32),
                                    ones, ones)
    want = np.asarray(jnp.asarray(codes).view(jnp.float8_e4m3fn).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(out)[0, 0], want)


@ON_CPU
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("h,page", CPU_KERNEL_SHAPES, ids=CPU_KERNEL_SHAPE_IDS)
def test_cpu_kernel_shared_pages_and_empty_rows(fmt, h, page):
    """Our C++ kernel, GQA: rows of 0 / 17 / 64 positions and a row reading another's pages
    (a shared prefix), float64 on the dequantized pages; a row of length 0 is zeros; 8-bit
    pages without their scales are refused."""
    assert cpukernel.load(), cpukernel.reason()
    rng = np.random.default_rng(3)
    kh, g, m, p = 2, 4, pages_for(64, page), 24
    kq, ksc, kd = quantized_pool(rng, fmt, kh, p, page, h)
    vq, vsc, vd = quantized_pool(rng, fmt, kh, p, page, h)
    lengths = [0, 17, 64]
    tables = _tables(rng, lengths, p, page, m)
    tables = np.concatenate([tables, tables[2:3]])
    lengths = np.asarray(lengths + [40], np.int32)
    q = rng.normal(size=(4, kh * g, h)).astype(np.float32)
    out = np.asarray(jax.jit(cpukernel.attend)(kq, vq, jnp.asarray(q), jnp.asarray(tables),
                                               jnp.asarray(lengths), ksc, vsc))
    assert np.all(out[0] == 0)
    for i in range(1, 4):
        n = lengths[i]
        t = tables[i, :pages_for(n, page)]
        want = dense_attention(q[i], np.concatenate([kd[:, j] for j in t], 1)[:, :n],
                               np.concatenate([vd[:, j] for j in t], 1)[:, :n])
        np.testing.assert_allclose(out[i].reshape(-1), want, atol=5e-6)
    with pytest.raises(Exception, match="need scales"):
        jax.block_until_ready(jax.jit(cpukernel.attend)(kq, vq, jnp.asarray(q),
                                                        jnp.asarray(tables),
                                                        jnp.asarray(lengths)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_writes_quantize_and_prefill_attends_the_dequantized_pages(fmt):
    """Prefill (PrefillAccess) writes quantized codes + scales at their (page, offset) and
    attends float64-equal over the dequantized pages; decode's row writes (write_rows) and
    the image-prefix writes (write_prefix_pages) store the same codes as the quantizer; a
    page copy (copy_pages, a prefix-cache hit) carries its scales."""
    from photon_jax.model.config import tiny

    cfg = tiny()
    t = cfg.text
    rng = np.random.default_rng(1)
    page, sizes = 16, (9,)
    pool = kvpool.init_pool(t, sizes, page, fmt)
    assert pool.quantized and pool.k[0][0].dtype == kvpool.storage_dtype(fmt)
    assert pool.ks[0][0].shape == (t.n_kv_heads, 9, page)
    rows, steps = 2, 20
    k = rng.normal(size=(rows, steps, t.n_kv_heads, t.head_dim)).astype(np.float32)
    v = rng.normal(size=(rows, steps, t.n_kv_heads, t.head_dim)).astype(np.float32)
    q = rng.normal(size=(rows, steps, t.n_heads, t.head_dim)).astype(np.float32)
    table = np.array([[3, 5], [4, 1]], np.int32)
    pos = np.tile(np.arange(steps), (rows, 1))
    page_RT, off_RT = table[np.arange(rows)[:, None], pos // page], pos % page
    acc = kvpool.PrefillAccess(jnp.asarray(page_RT), jnp.asarray(off_RT), jnp.asarray(table),
                               jnp.zeros(rows, jnp.int32))
    new, out = jax.jit(lambda pl, *a: acc.update(pl, 0, *a))(
        pool, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos))
    kc, ksc = kvpool.quantize(jnp.asarray(k), fmt)
    got = np.asarray(kvpool.as_format(new.k[0][0]))[:, page_RT, off_RT]        # [K, R, T, H]
    np.testing.assert_array_equal(got, np.moveaxis(np.asarray(kc), 2, 0))
    np.testing.assert_array_equal(np.asarray(new.ks[0][0])[:, page_RT, off_RT],
                                  np.moveaxis(np.asarray(ksc), 2, 0))
    kd = np.asarray(kvpool.dequantize(*kvpool.quantize(jnp.asarray(k), fmt)), np.float64)
    vd = np.asarray(kvpool.dequantize(*kvpool.quantize(jnp.asarray(v), fmt)), np.float64)
    for r in range(rows):
        for i in (0, 7, 16, 19):   # causal: position i sees 0..i
            want = dense_attention(q[r, i], kd[r, :i + 1].transpose(1, 0, 2),
                                   vd[r, :i + 1].transpose(1, 0, 2))
            np.testing.assert_allclose(np.asarray(out[r, i]).reshape(-1), want, atol=5e-6)
    # Decode writes: one position per row.
    k1 = rng.normal(size=(rows, t.n_kv_heads, t.head_dim)).astype(np.float32)
    res = jax.jit(kvpool.write_rows)(new.k[0], new.v[0], jnp.array([3, 1]), jnp.array([5, 4]),
                                     jnp.asarray(k1), jnp.asarray(k1), new.ks[0], new.vs[0])
    c1, s1 = kvpool.quantize(jnp.asarray(k1), fmt)
    np.testing.assert_array_equal(np.asarray(kvpool.as_format(res[0][0]))[:, [3, 1], [5, 4]],
                                  np.moveaxis(np.asarray(c1), 1, 0))
    np.testing.assert_array_equal(np.asarray(res[2][0])[:, [3, 1], [5, 4]], np.asarray(s1).T)
    # The image prefix's dense K/V, then a copy of its pages (a cache hit).
    n = 20
    kl = rng.normal(size=(t.n_layers, n, t.n_kv_heads, t.head_dim)).astype(np.float32)
    pg = np.array([6] * page + [7] * (n - page), np.int32)
    off = np.arange(n, dtype=np.int32) % page
    written = jax.jit(step_mod._write_prefix_pages)(new, jnp.asarray(kl), jnp.asarray(kl),
                                                    jnp.asarray(pg), jnp.asarray(off))
    cl, sl = kvpool.quantize(jnp.asarray(kl[1]), fmt)
    np.testing.assert_array_equal(np.asarray(kvpool.as_format(written.k[1][0]))[:, pg, off],
                                  np.moveaxis(np.asarray(cl), 1, 0))
    copied = jax.jit(step_mod._copy_pages)(written, jnp.array([6, 7]), jnp.array([8, 2]))
    for part in ("k", "v", "ks", "vs"):
        a = np.asarray(kvpool.as_format(getattr(copied, part)[1][0]))
        np.testing.assert_array_equal(a[:, [8, 2]], a[:, [6, 7]], err_msg=part)


# -- exposure: the memory plan, the arguments -------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_memory_plan_holds_about_twice_the_tokens(fmt):
    """Full-size Moondream 2 (bfloat16) on a 40 GiB device: an 8-bit pool holds 1.88x the
    positions of a bfloat16 one (64 code bytes + 4 scale bytes per head against 128), and
    its byte count (codes + scales) is the pool's shapes' own; a float32 model's, 3.76x."""
    cfg = moondream2("bfloat16")
    kw = dict(platform="gpu", max_batch_size=32, max_context=2048, page_size=64,
              free=40 * memory.GiB, weights_loaded=True)
    base = memory.plan(cfg, **kw)
    q8 = memory.plan(cfg, kv_dtype=fmt, **kw)
    assert memory.bytes_per_token(cfg, kv_dtype=fmt) == 24 * 2 * 32 * (64 + 4)
    assert 1.85 < q8.kv_cache_tokens / base.kv_cache_tokens < 1.9
    # The same room, less the 8-bit prefill's larger workspace (its dequantized view).
    room = lambda p: p.pool + memory.GPU_POOL_SHARE * p.workspace  # noqa: E731
    assert q8.workspace > base.workspace
    assert abs(room(q8) - room(base)) <= memory.bytes_per_token(cfg) * 64 * 2
    pool = jax.eval_shape(lambda: kvpool.init_pool(cfg.text, q8.arenas.sizes, 64, fmt))
    assert q8.pool == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool))
    f32 = memory.plan(moondream2("float32"), **kw)
    q8f = memory.plan(moondream2("float32"), kv_dtype=fmt, **kw)
    assert 3.7 < q8f.kv_cache_tokens / f32.kv_cache_tokens < 3.8


def test_a_bad_kv_dtype_is_refused_by_name():
    for bad in ("int4", "float16", "fp16", 3):
        with pytest.raises(ValueError, match=r"kv_dtype must be one of .*'int8'.*'float8_e4m3fn'"):
            kvpool.canonical_kv_dtype(bad, "float32")
    assert kvpool.canonical_kv_dtype("fp8") == "float8_e4m3fn"
    assert kvpool.canonical_kv_dtype("float32", "float32") is None
    with pytest.raises(ValueError, match="kv_dtype"):
        kvpool.canonical_kv_dtype("bfloat16", "float32")


# -- the engine end to end ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def model8(tiny_ckpt):
    from helpers import biased_model

    return biased_model(tiny_ckpt, {0: 0.3})


def _requests(model):
    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import Settings

    pr = model.prompts
    land, sq = (os.path.join(FIXTURE_DIR, f) for f in ("img_land800x600.png", "img_sq378.png"))
    g = Settings(temperature=0.0, max_tokens=10)
    hot = Settings(temperature=0.9, top_p=0.8, seed=5, max_tokens=10)
    return [Request("text", pr.caption("short"), land, g),
            Request("text", pr.query("w5 w7"), sq, hot),
            Request("text", pr.query("w9"), land, g),          # the same image: a cache hit
            Request("text", [0] + pr.query("w100 w200"), None, g)]


def _run(model, reqs, **kw):
    from photon_jax.engine.core import Engine

    eng = Engine(model, max_batch_size=3, **kw)
    try:
        outs = [h.result(timeout=300) for h in [eng.submit(r) for r in reqs]]
        mem, stats = eng.memory(), eng.stats()
    finally:
        eng.close()
    assert (eng.sched.alloc.in_use(), eng.sched.alloc.reserved) == (0, 0)
    return [{k: v for k, v in o.items() if k != "output_tokens"} for o in outs], mem, stats


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_pipelined_equals_blocking_and_cache_hits_equal_misses(model8, fmt):
    """The fixture model with an 8-bit pool: pipelined == blocking (greedy and sampled text,
    a text-only prompt), and a prefix-cache hit (full pages read in place, the partial last
    page copied with its scales by `copy_pages`) gives what a miss gives; `memory()`
    reports the format and the bytes per position (scales included).  (The XLA sweep's
    reads and `copy_pages` are checked above; the sweep's engine compiles per arena count,
    too slow to add here.)"""
    reqs = _requests(model8)
    piped, mem, stats = _run(model8, reqs, kv_dtype=fmt)
    assert stats["prefix_cache"]["hits"] >= 1
    assert mem["kv_dtype"] == fmt
    assert mem["kv_bytes_per_token"] == memory.bytes_per_token(model8.cfg, kv_dtype=fmt)
    assert _run(model8, reqs, kv_dtype=fmt, pipelined=False)[0] == piped
    assert _run(model8, reqs, kv_dtype=fmt, prefix_cache=False)[0] == piped


def test_a_bad_kv_dtype_is_refused_by_the_engine_load_and_the_cli(model8, tiny_ckpt, capsys):
    from photon_jax.api import Moondream
    from photon_jax.cli.caption import build_parser
    from photon_jax.engine.core import Engine

    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        Engine(model8, max_batch_size=2, kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):   # before the weights
        Moondream.load(tiny_ckpt, kv_dtype="float16", compile_cache=False)
    assert build_parser().parse_args(["x", "--model", "m", "--kv-dtype", "int8"]).kv_dtype == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["x", "--model", "m", "--kv-dtype", "int4"])
    assert "--kv-dtype" in capsys.readouterr().err


# -- fidelity: 8-bit against the unquantized cache, teacher-forced -------------------------------

# Measured here (the fixture model, EOS-biased, short-caption prompt, 12 steps): top-1
# agreement 1.0, max |logit error| / logit range 1.2e-3 (int8) and 1.9e-3 (e4m3); bounds at
# ~3x.  (bench/kv8.py --config tiny, 24 steps of the unbiased model: 2.7e-4 and 1.1e-3.)
FIDELITY_BOUNDS = {"int8": 4e-3, "float8_e4m3fn": 6e-3}


def test_fidelity_of_8bit_decoding_is_bounded_and_a_broken_scale_fails(model8):
    """An image prefix, a prompt and 12 greedy steps of the unquantized cache, the same
    tokens teacher-forced through int8 and e4m3 pools: the top-1 agrees (all but one step)
    and the logit error stays within FIDELITY_BOUNDS of the step's logit range.  The bound
    can fail: int8 K scales off by 50% (the prefix's, every layer) break it."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    import kv8

    from photon_jax.engine import reference

    enc = reference.encode_image(model8, kv8.IMAGE)
    prompt = model8.prompts.caption("short")
    ref, fed = kv8.teacher_force(model8, None, prompt, enc, greedy_steps=12)
    n = len(prompt)
    for fmt, bound in FIDELITY_BOUNDS.items():
        got, _ = kv8.teacher_force(model8, fmt, fed, enc)
        f = kv8.fidelity(ref[n:], got[n:])
        assert f["top1_agreement"] >= 11 / 12, (fmt, f)
        assert f["max_rel_logit_error"] < bound, (fmt, f)

    def broken(pool):
        return pool.replace(ks=tuple(tuple(s * 1.5 for s in layer) for layer in pool.ks))

    got, _ = kv8.teacher_force(model8, "int8", fed, enc, corrupt=broken)
    bad = kv8.fidelity(ref[n:], got[n:])
    assert bad["max_rel_logit_error"] > FIDELITY_BOUNDS["int8"], bad
