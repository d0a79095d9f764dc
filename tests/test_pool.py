"""The paged KV pool: host bookkeeping (pages, reservations, the prefix cache), the metadata a
step uploads, the decode attention that reads pages in place (XLA sweep and Pallas kernel),
and the engine under memory pressure: requests wait for pages, cached prefixes are evicted
and re-created, pinned ones never are, and everything comes back at the end."""

import dataclasses
import os
from functools import partial
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from photon_jax.engine import kvpool, memory, reference, step as step_mod, stepmeta as M
from photon_jax.engine.core import Engine
from photon_jax.engine.frontend import EncodedImage
from photon_jax.engine.pages import PageAllocator, pages_for, PoolError, PrefixCache
from photon_jax.engine.request import Request, RequestError
from photon_jax.engine.settings import Settings
from photon_jax.kernels import cpukernel
from photon_jax.model import Model, platforms, text
from photon_jax.model.config import moondream2, moondream3, tiny, tiny_md3
from photon_jax.model.layers import attention
from photon_jax.model.params import abstract_params, init_params
from photon_jax.model.tokenizer import load_tokenizer

import helpers
from helpers import FIXTURE_DIR, biased_model, pallas_attention

IMAGES = [os.path.join(FIXTURE_DIR, f) for f in
          ("img_land800x600.png", "img_sq378.png", "img_wide1500x400.png",
           "img_photo512x600.png")]


# -- host bookkeeping -------------------------------------------------------------------------

def test_allocator_reserves_then_assigns_lowest_first_and_entries_take_the_top():
    a = PageAllocator(10)
    assert (a.usable, a.available()) == (9, 9)
    a.reserve(4)
    assert a.available() == 5
    assert a.take(2, reserved=True) == [1, 2] and a.reserved == 2
    assert a.take(2, reserved=False, top=True) == [9, 8]
    assert a.available() == 3
    with pytest.raises(PoolError):
        a.reserve(4)
    a.give_back([1])
    assert a.take(1, reserved=True) == [1]   # the lowest free page again
    with pytest.raises(PoolError):
        a.give_back([5])                      # never handed out
    with pytest.raises(PoolError):
        a.give_back([0])                      # the dummy page
    a.give_back([1, 2, 9, 8])
    a.unreserve(1)
    assert (a.in_use(), a.reserved, a.available()) == (0, 0, 9)


def test_prefix_cache_evicts_least_recently_used_and_never_a_pinned_entry():
    a = PageAllocator(9)
    c = PrefixCache(a)
    for k in (b"a", b"b", b"c", b"d"):
        assert c.insert(k, 2, (1, 1)) is not None
    assert a.available() == 0 and c.insert(b"e", 2, (1, 1)) is None   # no room: not cached
    c.pin(b"a")
    c.get(b"b")                     # b is now the most recently used
    c.evict_for(4)                  # a is pinned: c and d (least recent) go
    assert list(c.entries) == [b"a", b"b"] and c.evictions == 2
    c.evict_for(100)                # everything evictable goes, never the pinned entry
    assert list(c.entries) == [b"a"] and a.available() == 6
    c.unpin(b"a")
    c.evict_for(8)
    assert not c.entries and a.available() == 8
    off = PrefixCache(PageAllocator(9), enabled=False)
    assert off.insert(b"x", 2, (1, 1)) is None                      # off: not cached ...
    assert off.insert(b"x", 2, (1, 1), pin=True) is not None        # ... unless pinned
    off.unpin(b"x")
    assert not off.entries and off.allocator.available() == 8       # and dropped at unpin


def test_decode_metadata_names_each_page_of_each_row():
    # Arena k covers the dummy page 0 and 4 x 2^k pages: k rows of 4 pages fit exactly.
    assert M.Arenas.geometric(100, 4).sizes == (5, 4, 8, 16, 32, 35)
    assert M.Arenas.geometric(30, 4, growth=4).sizes == (5, 12, 13)
    arenas = M.Arenas.geometric(20, 4)
    assert arenas.sizes == (5, 4, 8, 3) and arenas.covering(8) == 2 and arenas.covering(9) == 3
    tables = [[3, 9], [5]]
    meta, pages, n = M.pack_decode([2, 1], [70, 10], tables, 4, 3, 64, arenas, adapters=[0, 3])
    assert n == 3 and pages.shape == (2, 17)
    assert meta[M.M_ADAPTER].tolist() == [0, 3, 0, 0]   # each row's LoRA slot
    assert meta[M.M_ROW].tolist() == [2, 1, 0, 0] and meta[M.M_POS].tolist() == [70, 10, 0, 0]
    assert meta[M.M_PAGE].tolist() == [9, 5, 0, 0] and meta[M.M_OFF].tolist() == [6, 10, 0, 0]
    assert meta[M.M_TABLE:, 0].tolist() == [3, 9, 0] and meta[M.M_TABLE:, 2].tolist() == [0] * 3
    owner, count = pages
    assert (owner[3], count[3], owner[9], count[9], owner[5], count[5]) == (0, 64, 0, 7, 1, 11)
    assert all(owner[p] == 4 and count[p] == 0 for p in range(17) if p not in (3, 9, 5))
    pre, write, table = M.pack_prefill([1], [730], [730], [3], [list(range(1, 14))], 2, 16,
                                       768, 64, adapters=[5])
    assert pre[:, 0].tolist() == [1, 730, 730, 2, 5] and pre[:, 1].tolist() == [0] * 5
    assert write[0, 0, :4].tolist() == [12, 12, 12, 0] and write[1, 0, :3].tolist() == [26, 27,
                                                                                         28]
    assert table.shape == (2, 12) and table[0].tolist() == list(range(1, 13))


# -- attention over pages ---------------------------------------------------------------------

def dense_attention(q_QH, k_KSH, v_KSH):
    kh, n = k_KSH.shape[0], q_QH.shape[0]
    q = q_QH.reshape(kh, n // kh, -1).astype(np.float64)
    s = np.einsum("kgh,ksh->kgs", q, k_KSH) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("kgs,ksh->kgh", w, v_KSH).reshape(-1)


@pytest.mark.parametrize("kh,g", [(4, 1), (2, 2)], ids=["mha", "gqa"])
def test_sweep_and_pallas_kernel_equal_dense_attention(kh, g):
    """Ragged rows, lengths at page boundaries (1, 16, 17, 31, 32, 100 positions), pages
    scattered over arenas: the XLA sweep and our Pallas decode-attention kernel (run by the
    Pallas interpreter; every split: tests/test_gpu_attention.py) both equal attention over
    the row's positions gathered densely."""
    rng = np.random.default_rng(kh)
    h, page, m = 32, 16, 8
    arenas = M.Arenas((12, 12, 24))
    p = arenas.n_pages
    k = rng.normal(size=(kh, p, page, h)).astype(np.float32)
    v = rng.normal(size=(kh, p, page, h)).astype(np.float32)
    positions = [0, 15, 16, 30, 31, 99]
    free = rng.permutation(np.arange(1, p)).tolist()
    tables = []
    for pos in positions:
        n = pos // page + 1
        tables.append(free[:n])
        free = free[n:]
    meta, pages, n = M.pack_decode(list(range(1, 7)), positions, tables, 8, m, page, arenas)
    q = rng.normal(size=(8, kh * g, h)).astype(np.float32)
    split = [jnp.asarray(a) for a in np.split(k, np.cumsum(arenas.sizes)[:-1], 1)[:n]]
    splitv = [jnp.asarray(a) for a in np.split(v, np.cumsum(arenas.sizes)[:-1], 1)[:n]]
    table = jnp.asarray(meta[M.M_TABLE:].T)
    sweep = np.asarray(jax.jit(kvpool.decode_attend)(tuple(split), tuple(splitv),
                                                     jnp.asarray(q), jnp.asarray(pages[0]),
                                                     jnp.asarray(pages[1]), table))
    kern = np.asarray(kvpool.kernel_attend((jnp.asarray(k),), (jnp.asarray(v),),
                                           jnp.asarray(q), table,
                                           jnp.asarray(meta[M.M_POS] + 1),
                                           interpret=pallas_attention() != "pallas"))
    for i, (pos, t) in enumerate(zip(positions, tables)):
        want = dense_attention(q[i], np.concatenate([k[:, j] for j in t], 1)[:, :pos + 1],
                               np.concatenate([v[:, j] for j in t], 1)[:, :pos + 1])
        np.testing.assert_allclose(sweep[i], want, atol=2e-6)
        # (On a GPU the kernel runs for real, with the GPU's approximate exp2.)
        np.testing.assert_allclose(kern[i], want,
                                   atol=2e-6 if pallas_attention() != "pallas" else 2e-5)
    assert np.all(sweep[6:] == 0)   # padding rows of the bucket own no page


CPU_KERNEL_SHAPES = pytest.mark.parametrize("h,page", helpers.CPU_KERNEL_SHAPES,
                                            ids=helpers.CPU_KERNEL_SHAPE_IDS)


@pytest.mark.parametrize("kh,g", [(4, 1), (2, 4)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@CPU_KERNEL_SHAPES
def test_cpu_kernel_equals_dense_attention(kh, g, dtype, h, page):
    """Our C++ kernel (`cpukernel`, through the XLA FFI): rows of 0, 1, 16, 17, 31, 32, 64
    and 100 positions (inside, on and across page boundaries), pages scattered through one
    arena, two rows reading the same pages (shared prefix pages), bfloat16 pools widened
    exactly: each row equals float64 attention over its own positions gathered densely, a
    row of length 0 is zeros, and nothing else in the pool matters."""
    from photon_jax.kernels import cpukernel

    assert cpukernel.load(), cpukernel.reason()
    rng = np.random.default_rng(kh * 10 + g)
    m, p = pages_for(100, page), 40
    dt = jnp.dtype(dtype)
    k = np.asarray(jnp.asarray(rng.normal(size=(kh, p, page, h)), dt).astype(jnp.float32))
    v = np.asarray(jnp.asarray(rng.normal(size=(kh, p, page, h)), dt).astype(jnp.float32))
    lengths = [0, 1, 16, 17, 31, 32, 64, 100]
    free = rng.permutation(np.arange(1, p)).tolist()
    tables = np.zeros((len(lengths) + 1, m), np.int32)
    for i, n in enumerate(lengths):
        used = pages_for(n, page)
        tables[i, :used] = free[:used]
        free = free[used:]
    tables[-1] = tables[6]              # a row sharing row 6's pages
    lengths = np.asarray(lengths + [50], np.int32)
    q = rng.normal(size=(len(lengths), kh * g, h)).astype(np.float32)
    out = np.asarray(jax.jit(cpukernel.attend)(
        jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(q), jnp.asarray(tables),
        jnp.asarray(lengths)))
    assert out.dtype == np.float32
    for i, n in enumerate(lengths):
        if n == 0:
            assert np.all(out[i] == 0)
            continue
        t = tables[i, :pages_for(n, page)]
        want = dense_attention(q[i].reshape(-1, h), np.concatenate([k[:, j] for j in t], 1)[:, :n],
                               np.concatenate([v[:, j] for j in t], 1)[:, :n])
        np.testing.assert_allclose(out[i].reshape(-1), want, atol=2e-6)
    # Pages no row reads can hold anything (NaN included): results do not change.
    unread = np.setdiff1d(np.arange(p), tables[lengths > 0].ravel())
    k2, v2 = k.copy(), v.copy()
    k2[:, unread], v2[:, unread] = np.nan, np.nan
    out2 = np.asarray(jax.jit(cpukernel.attend)(
        jnp.asarray(k2, dt), jnp.asarray(v2, dt), jnp.asarray(q), jnp.asarray(tables),
        jnp.asarray(lengths)))
    np.testing.assert_array_equal(out2, out)
    # A table naming a page outside the pool (a bookkeeping bug) fails the call, loudly.
    bad = tables.copy()
    bad[1, 0] = p
    with pytest.raises(Exception, match="outside the pool"):
        jax.block_until_ready(jax.jit(cpukernel.attend)(
            jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(q), jnp.asarray(bad),
            jnp.asarray(lengths)))


def test_cpu_dense_kernel_equals_float64():
    """`cpukernel.dense` (the decode step's dense layers on CPU) at every edge of its
    tiling: 1 to 6 rows, 13 and 32 (each 6-row tile remainder), columns not a multiple of 16
    and more than one 128-column work item, k past one 256-deep packed block, not a multiple
    of 8 where the [N, K] head is transposed 8 x 8 at a time: against float64 and against
    XLA's product (`layers.linear`).  A [K, N] weight and the same weight as [N, K]
    (`transposed`, the LM head) give the same bits (the same sums in the same order).  On a
    CPU without AVX2 + FMA the call fails, naming the reason (the step never makes it)."""
    from photon_jax.model.layers import linear

    assert cpukernel.load(), cpukernel.reason()
    rng = np.random.default_rng(5)
    x, w, b = (rng.normal(size=s).astype(np.float32) for s in [(2, 3), (3, 4), (4,)])
    if not cpukernel.dense_fast():
        with pytest.raises(Exception, match="without AVX2 and FMA"):
            jax.block_until_ready(jax.jit(cpukernel.dense)(x, w, b))
        return
    for m, k, n in [(1, 7, 5), (2, 305, 40), (3, 64, 17), (4, 16, 33), (5, 305, 40),
                    (6, 256, 16), (13, 600, 300), (32, 520, 272)]:
        x = rng.normal(size=(m, k)).astype(np.float32)
        w = rng.normal(size=(k, n)).astype(np.float32)
        b = rng.normal(size=n).astype(np.float32)
        y = np.asarray(jax.jit(cpukernel.dense)(x, w, b))
        y_t = np.asarray(jax.jit(partial(cpukernel.dense, transposed=True))(x, w.T.copy(), b))
        assert y.shape == (m, n) and y.dtype == np.float32
        np.testing.assert_allclose(y, x.astype(np.float64) @ w + b, rtol=1e-5, atol=2e-4)
        np.testing.assert_array_equal(y_t, y)
        want = np.asarray(jax.jit(linear)(x, {"w": w, "b": b}))
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=2e-4)
        # The serving LM head's layout through both `linear`s.
        head = {"w_vd": w.T.copy(), "b": b}
        np.testing.assert_array_equal(np.asarray(jax.jit(cpukernel.linear)(x, head)), y)
        np.testing.assert_allclose(np.asarray(jax.jit(linear)(x, head)),
                                   x.astype(np.float64) @ w + b, rtol=1e-5, atol=2e-4)


def test_cpu_kernel_falls_back_to_the_sweep_without_a_compiler(monkeypatch, caplog):
    """No C++ compiler: CPU models get the XLA sweep (with a warning naming the reason),
    and asking for the kernel by name fails with the fix."""
    from photon_jax.kernels import cpukernel

    monkeypatch.setattr(cpukernel, "_state", {})
    monkeypatch.setattr(cpukernel, "_compiler", lambda: None)
    with caplog.at_level("WARNING"):
        assert platforms.default_attention("cpu") == "xla"
    assert "no C++ compiler" in cpukernel.reason() and "falls back" in caplog.text
    with pytest.raises(ValueError, match="install a C\\+\\+ compiler"):
        step_mod.build(tiny(), "cpu-kernel")
    # The dense kernel goes with it: decode keeps XLA's products.
    assert not cpukernel.dense_fast() and not platforms.default_dense(tiny(), "xla")
    with pytest.raises(ValueError, match="dense=True needs"):
        step_mod.build(tiny(), "xla", dense=True)
    with pytest.raises(ValueError, match="dense=True needs"):   # and float32 only
        step_mod.build(tiny().with_dtype("bfloat16"), "xla", dense=True)


def test_pallas_kernel_in_the_model_equals_the_xla_sweep():
    """A whole decode step of the Moondream 3 fixture model (tau attention, MoE) with the
    kernel (interpreted) in place of the sweep, over one arena: rows at ragged positions
    (inside a page, on a page's last and first position, several pages in), pages scattered
    through the pool: the same logits and the same next tokens.  The "cpu-kernel" model's
    step also runs its dense layers and LM head on `cpukernel.dense` (4 rows, float32: the
    program calls it), so that kernel is checked in the model too."""
    cfg = tiny_md3()
    t, page, rows = cfg.text, 16, 4
    params = init_params(jax.random.PRNGKey(3), cfg)
    tok = load_tokenizer(os.path.join(FIXTURE_DIR, "tokenizer.json"))
    arenas = M.Arenas((48,))
    r = np.random.default_rng(7)
    positions = [5, 15, 16, 100]
    free = r.permutation(np.arange(1, arenas.n_pages)).tolist()
    tables = []
    for pos in positions:
        n = pages_for(pos + 1, page)
        tables.append(free[:n])
        free = free[n:]
    meta, pages, _ = M.pack_decode(list(range(1, rows + 1)), positions, tables, rows, 8, page,
                                   arenas)
    pool = r.normal(size=(t.n_layers, 2, t.n_kv_heads, arenas.n_pages, page, t.head_dim))
    pend = step_mod.Pending(jnp.zeros(rows + 1, jnp.int32),
                            jnp.asarray(r.integers(10, 999, rows + 1), jnp.int32),
                            jnp.zeros((rows + 1, 2), jnp.float32))
    logits = []
    cpu = jax.default_backend() == "cpu"
    for attention in ("xla", pallas_attention()) + (("cpu-kernel",) if cpu else ()):
        m = Model(cfg, params, tok, attention=attention)
        kv = kvpool.KVPool(*(tuple((jnp.asarray(pool[li, j], jnp.float32),)
                                   for li in range(t.n_layers)) for j in range(2)))
        args = (m.params, kv, step_mod.init_slot(cfg, rows), pend, jnp.asarray(meta),
                jnp.asarray(pages))
        calls = step_mod.programs_of(m).forward.lower(*args).as_text().count(cpukernel.DENSE_TARGET)
        # qkv and proj of every layer, fc1 and fc2 of the plain (not MoE) layers, the LM head.
        kinds = [kind for _, kind in text.layer_params(m.params["text"], t)]
        want = 2 * len(kinds) + 2 * kinds.count("dense") + 1
        # (A CPU without AVX2 + FMA keeps XLA's products: `platforms.default_dense`.)
        used = attention == "cpu-kernel" and cpukernel.dense_fast()
        assert calls == (want if used else 0), (attention, calls, kinds)
        out = step_mod.programs_of(m).forward(*args)[1]
        logits.append(np.array(out.logits))
    for other in logits[1:]:
        np.testing.assert_allclose(other, logits[0], rtol=2e-5, atol=2e-5)
        assert (other.argmax(-1) == logits[0].argmax(-1)).all()


# -- the engine under memory pressure --------------------------------------------------------

@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return biased_model(tiny_ckpt, {0: 0.8})


@pytest.fixture(scope="module")
def encoded(model):
    return {p: reference.encode_image(model, p) for p in IMAGES}


def ref_ids(model, encoded, req):
    enc = None if req.image is None else encoded[req.image]
    return reference.generate_text(model, enc, req.prompt, req.settings)["ids"]


def test_a_small_pool_makes_requests_wait_evicts_and_recreates_prefixes(model, tmp_path):
    """A pool with room for about four requests at a time when each holds its own prefix,
    12 requests over 4 images from 4 threads: every request finishes with the one-request
    path's output in the pipelined engine with the cache and in its blocking twin without;
    without the cache the pool, not max_batch_size, bounds the rows; with it, cached
    prefixes are evicted under the pressure; every page is free after close().  (Small
    images: their two crops keep the vision encoder's share of the test small.)"""
    from PIL import Image

    pr = model.prompts
    rng = np.random.default_rng(0)
    images = []
    for k in range(5):   # the fifth for one request after the others (below)
        images.append(str(tmp_path / f"im{k}.png"))
        Image.fromarray(rng.integers(0, 256, (40 + k, 48, 3), np.uint8)).save(images[-1])
    encoded = {p: reference.encode_image(model, p) for p in images}
    reqs = []
    for i in range(12):
        s = Settings(temperature=0.0 if i % 3 else 0.8, seed=i,
                     max_tokens=int(rng.integers(4, 20)))
        prompt = pr.caption("short") if i % 2 else pr.query(f"w{rng.integers(50, 900)}")
        reqs.append(Request("text", prompt, images[i % 4], s))   # each of the four, 3 times
    # After the threads, a request on a fifth image: with four prefixes cached it must
    # evict one (whatever the threads' timing did before).
    last = Request("text", pr.caption("short"), images[4], Settings(temperature=0.0,
                                                                    max_tokens=6))
    want = [ref_ids(model, encoded, r) for r in reqs] + [ref_ids(model, encoded, last)]
    tokens = 2 * 800 + 2 * 768   # about four requests at a time, or fewer and a few prefixes
    # The pipelined engine with the cache, its blocking twin without: both dimensions.
    for pipelined, cache in ((True, True), (False, False)):
        eng = Engine(model, max_batch_size=8, max_context=800, kv_cache_tokens=tokens,
                     page_size=32, pipelined=pipelined, prefix_cache=cache)
        fits = eng.sched.alloc.usable // pages_for(model.cfg.prefix_len + 5 + 4, 32)
        got = [None] * (len(reqs) + 1)
        try:
            def client(k):
                hs = [(i, eng.submit(reqs[i])) for i in range(k, len(reqs), 4)]
                for i, h in hs:
                    got[i] = h.result(timeout=600)["ids"]

            threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            got[-1] = eng.submit(last).result(timeout=600)["ids"]
            stats = eng.stats()["prefix_cache"]
            peak = max(s["rows"] for s in eng.step_log())
        finally:
            eng.close()
        assert got == want, (pipelined, cache)
        if not cache or eng.sweep:
            # Every row holds all its pages: the pool, not max_batch_size, bounds the rows.
            assert peak <= fits < 8
        # (With the cache and the kernels, rows on a cached image share its prefix pages and
        # hold only a page or two of their own: how many run at once then depends on how
        # many distinct images the running rows use, i.e. on the threads' timing.)
        if cache:
            # Every image request was a hit or a miss.  How many of each depends on the
            # threads' timing; re-creation is checked deterministically by
            # `test_an_evicted_prefix_is_recreated_exactly`.
            assert stats["hits"] + stats["misses"] == len(got) and stats["inserts"] > 0
            # Entries go only when an admission needs their pages: 4 prefixes of 23 pages
            # in about 98 leave too few for the fifth image's 24, so at least that
            # admission evicted (the threads' requests usually did too, by their timing).
            assert stats["evictions"] > 0
        else:
            assert stats["hits"] == 0 and stats["entries"] == 0
        assert (eng.sched.alloc.in_use(), eng.sched.alloc.reserved) == (0, 0)


def test_an_evicted_prefix_is_recreated_exactly(model, encoded):
    """A pool with room for one request and one cached prefix, requests one after another:
    image A is cached, B evicts it, A again evicts B and re-creates A's entry, A once more
    hits it; every output equals the one-request path's."""
    page = 32
    req_pages = pages_for(model.cfg.prefix_len + 16 + 4, page)
    eng = Engine(model, max_batch_size=1, max_context=800, page_size=page,
                 kv_cache_tokens=(req_pages + pages_for(model.cfg.prefix_len, page) + 4) * page)
    try:
        s = Settings(max_tokens=4, temperature=0)
        for img in (IMAGES[0], IMAGES[1], IMAGES[0], IMAGES[0]):
            r = Request("text", model.prompts.caption("short"), img, s)
            assert eng.submit(r).result(timeout=300)["ids"] == ref_ids(model, encoded, r)
        st = eng.stats()["prefix_cache"]
        assert (st["inserts"], st["evictions"], st["hits"], st["misses"]) == (3, 2, 1, 3)
        # On CPU with the kernel, hits and misses read the entry's full pages in place.
        assert eng.sched.shared_pages == (0 if eng.sweep else model.cfg.prefix_len // page)
    finally:
        eng.close()
    assert (eng.sched.alloc.in_use(), eng.sched.alloc.reserved) == (0, 0)


def test_a_request_larger_than_the_pool_fails_alone(model, encoded):
    eng = Engine(model, max_batch_size=2, max_context=2048, kv_cache_tokens=1024, page_size=64)
    try:
        big = eng.submit(Request("text", model.prompts.caption("short"), IMAGES[0],
                                 Settings(max_tokens=700)))
        ok = eng.submit(Request("text", model.prompts.caption("short"), IMAGES[0],
                                Settings(max_tokens=20, temperature=0)))
        with pytest.raises(RequestError, match="more than the whole KV pool .1024 tokens.; "
                                               "raise kv_cache_tokens"):
            big.result(timeout=60)
        assert ok.result(timeout=300)["ids"] == ref_ids(model, encoded, ok.request)
    finally:
        eng.close()


def test_cancelling_frees_pages_at_the_right_commit(model, encoded):
    """A waiting request holds no pages; a running one keeps its pages until the commit of
    its last step in flight, then gives them all back."""
    eng = Engine(model, max_batch_size=1, max_context=800, kv_cache_tokens=800, page_size=64,
                 record_events=True, prefix_cache=False)
    try:
        long = eng.submit(Request("text", model.prompts.caption("long"), IMAGES[1],
                                  Settings(max_tokens=60), ignore_eos=True))
        # (Submitted once `long` runs: a request whose image is still being prepared does
        # not hold back later ones that are ready, so it could otherwise start first.)
        while not any(s["kind"] in ("decode", "burst") for s in eng.step_log()):
            pass
        waiting = eng.submit(Request("text", model.prompts.caption("short"), IMAGES[1],
                                     Settings(max_tokens=5)))
        assert eng.memory()["pages_in_sequences"] > 0
        waiting.cancel()   # it waits for pages behind `long`: cancelled before any work
        assert waiting.result(timeout=60)["finish_reason"] == "cancelled"
        long.cancel()
        assert long.result(timeout=60)["finish_reason"] == "cancelled"
        mem = eng.memory()
        assert (mem["pages_in_sequences"], mem["pages_reserved"]) == (0, 0)
        ev = {e[0]: e for e in eng.sched.events if e[1] == long.id}
        assert ev["release"][2] >= ev["finalize"][2]   # released at or after its last commit
    finally:
        eng.close()


def test_a_pinned_prefix_is_never_evicted(model, encoded):
    """An EncodedImage pins its prefix: other images churn through a pool with room for one
    more cached prefix, and the pinned one keeps serving hits until it is released."""
    eng = Engine(model, max_batch_size=1, max_context=800, kv_cache_tokens=3 * 768 + 100,
                 page_size=64)
    try:
        pinned = eng.encode(IMAGES[0]).result(timeout=300)
        assert isinstance(pinned, EncodedImage)
        s = Settings(max_tokens=4, temperature=0)
        for img in IMAGES[1:] * 2:
            eng.submit(Request("text", eng.model.prompts.caption("short"), img, s)).result(
                timeout=300)
        st = eng.stats()["prefix_cache"]
        assert st["evictions"] > 0 and pinned.key in eng.sched.cache.entries
        hits = st["hits"]
        q = Request("text", eng.model.prompts.caption("short"), pinned, s)
        assert eng.submit(q).result(timeout=300)["ids"] == ref_ids(
            model, encoded, Request("text", q.prompt, IMAGES[0], s))
        assert eng.stats()["prefix_cache"]["hits"] == hits + 1
        pinned.release()
        eng.submit(Request("text", eng.model.prompts.caption("short"), IMAGES[1], s)).result(
            timeout=300)
        # The handle's pin is gone (the engine processed the release before that request).
        # (The request itself pins its own image's entry until its row is released, one
        # commit after its result: that entry may still count as pinned here.)
        entry = eng.sched.cache.entries.get(pinned.key)
        assert entry is None or entry.pins == 0
    finally:
        eng.close()
    assert (eng.sched.alloc.in_use(), eng.sched.alloc.reserved) == (0, 0)


# -- memory accounting -------------------------------------------------------------------------

def nbytes(tree):
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


@pytest.mark.parametrize("cfg,ctx", [(moondream2("bfloat16"), 2048),
                                     (moondream3("bfloat16"), 32768)], ids=["md2", "md3-32k"])
def test_full_size_accounting_from_shapes(cfg, ctx):
    """Weights and pool bytes of the real models, from abstract shapes (nothing allocated),
    and the default pool of the GPUs they fit."""
    p = memory.plan(cfg, platform="gpu", max_batch_size=32, max_context=ctx, page_size=64,
                    kv_cache_tokens=32 * ctx)
    assert p.weights == nbytes(jax.eval_shape(lambda: abstract_params(cfg)))
    pool = jax.eval_shape(lambda: kvpool.init_pool(cfg.text, p.arenas.sizes, 64, cfg.dtype))
    assert p.pool == nbytes(pool) == p.n_pages * 64 * memory.bytes_per_token(cfg)
    assert memory.bytes_per_token(cfg) == 24 * 2 * 32 * 64 * 2   # 192 KiB per position
    md3 = cfg.family == "moondream3"
    for gb in ((80,) if md3 else (16, 80)):
        free = gb * 10**9
        d = memory.plan(cfg, platform="gpu", max_batch_size=32, max_context=ctx,
                        page_size=64, free=free)
        assert d.total <= free and d.pool >= 0.85 * (free - d.weights - d.slots - d.workspace)
    if md3:
        # 18.5 GB of weights: no room on a 16 GB GPU, said with the numbers.
        with pytest.raises(memory.MemoryError_, match=r"no room for a KV pool: .*weights "
                                                      r"\(17\.\d\d GiB\)"):
            memory.plan(cfg, platform="gpu", max_batch_size=32, max_context=ctx, page_size=64,
                        free=16 * 10**9)
        # 32 full-context rows (192 GiB of KV) fit no GPU: refused with numbers and settings.
        with pytest.raises(memory.MemoryError_, match=r"KV pool 192\.\d\d GiB.*Lower "
                                                      r"kv_cache_tokens \(--kv-cache-tokens\)"):
            memory.check(dataclasses.replace(p, capacity=140 * 10**9), cfg,
                         max_context=ctx, weights_loaded=False)


def test_the_engine_refuses_a_pool_larger_than_the_device(model, monkeypatch):
    monkeypatch.setattr(memory, "device_free", lambda device: 64 << 20)
    with pytest.raises(memory.MemoryError_, match="does not fit the device"):
        Engine(model, max_batch_size=2, kv_cache_tokens=200_000)
    assert pages_for(65, 64) == 2 and tiny().prefix_len == 730


def test_load_refuses_before_reading_the_weights(tiny_ckpt, monkeypatch):
    """Moondream.load checks weights + pool + slots against the device before it restores a
    byte of the checkpoint, and names the setting to change."""
    from photon_jax import Moondream
    from photon_jax.model import checkpoint

    def no_restore(*a, **k):
        raise AssertionError("the weights were read before the memory check")

    monkeypatch.setattr(checkpoint, "restore_params", no_restore)
    monkeypatch.setattr(memory, "device_free", lambda device: 256 << 20)
    with pytest.raises(memory.MemoryError_, match=r"does not fit the device: weights .* "
                                                  r"Lower kv_cache_tokens"):
        Moondream.load(tiny_ckpt, kv_cache_tokens=1_000_000, compile_cache=False)


def test_on_demand_adapter_slots_that_do_not_fit_leave_the_model_loadable(model, monkeypatch):
    """The bytes set aside for on-demand LoRA slots must not refuse a model that fits
    without them: the engine starts without slots, and a variant request is refused naming
    the settings that make room (a plan that fits with them keeps them)."""
    from photon_jax.engine.request import RequestError
    from photon_jax.model import lora

    kw = dict(max_batch_size=2, kv_cache_tokens=4096, max_lora_rank=512)
    tables = lora.table_bytes(model.cfg, 4, 512)
    bare = Engine(model, **kw)
    try:
        need = bare.plan.total - bare.plan.weights   # what the plan asks of the device
    finally:
        bare.close()
    monkeypatch.setattr(memory, "device_free", lambda device: need + tables // 2)
    eng = Engine(model, max_adapters=4, adapters_on_demand=True, **kw)
    try:
        assert eng.max_adapters == 0 and eng.plan.adapters == 0
        with pytest.raises(RequestError, match="no device memory was left for 4 adapter "
                                               "slots.*lower kv_cache_tokens"):
            eng.adapter("anything")
    finally:
        eng.close()
    monkeypatch.setattr(memory, "device_free", lambda device: need + 2 * tables)
    eng = Engine(model, max_adapters=4, adapters_on_demand=True, **kw)
    try:
        assert eng.max_adapters == 4 and eng.plan.adapters == tables and eng.lora is None
    finally:
        eng.close()
    with pytest.raises(memory.MemoryError_):   # asked for by number: refused, as before
        monkeypatch.setattr(memory, "device_free", lambda device: need + tables // 2)
        Engine(model, max_adapters=4, **kw)


# -- XLA:CPU and bfloat16 pools: every write in place -----------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8"])
def test_pool_writes_on_cpu_are_in_place_and_exact(dtype):
    """XLA:CPU has no 16-bit float scatter or slice update: it widens the whole operand to
    float32 and back around each, so a write of one position into a bfloat16 arena rewrote
    the arena (a 730-position prefix write into Moondream 2's 4 GiB pool took 8 GiB of
    temporaries).  A CPU pool of a bfloat16 model therefore stores the bits (uint16).  Each
    write -- decode rows, prefill positions, whole pages -- must take temporaries the size
    of what it writes, not of the arena, and store exactly what a bfloat16 array would."""
    store = kvpool._pool_dtype(dtype, "cpu")
    assert (store == jnp.uint16) == (dtype == "bfloat16")
    pages, kh, b, h = 300, 4, 16, 8
    arena_bytes = kh * pages * b * h * store.itemsize
    rng = np.random.default_rng(0)
    ref = jnp.asarray(rng.normal(size=(kh, pages, b, h)) * 10).astype(dtype)
    a0 = kvpool.as_storage(ref, store)

    def check(fn, args, expect):
        fn = jax.jit(fn, donate_argnums=(0,))
        temp = fn.lower(a0, *args).compile().memory_analysis().temp_size_in_bytes
        assert temp < arena_bytes / 8, (dtype, temp, arena_bytes)
        got = kvpool.as_format(fn(jnp.array(a0, copy=True), *args))
        assert got.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expect, np.float32))

    for rows in (1, 3):   # decode: one position per row
        pg, off = jnp.asarray([5, 7, 9][:rows]), jnp.asarray([1, 15, 2][:rows])
        k = jnp.asarray(rng.normal(size=(rows, kh, h)), jnp.float32)
        expect = ref.at[:, pg, off].set(jnp.moveaxis(k, 1, 0).astype(dtype))
        check(lambda a, k: kvpool.write_rows((a,), (a,), pg, off, k, k)[0][0], (k,), expect)
    for n in (10, 40):    # prefill: consecutive positions from an offset inside a page
        s = np.arange(n) + 9
        pg, off = jnp.asarray(20 + s // b)[None], jnp.asarray(s % b)[None]
        x = jnp.asarray(rng.normal(size=(1, n, kh, h)), jnp.float32)
        expect = ref.at[:, pg[0], off[0]].set(jnp.moveaxis(x[0], 1, 0).astype(dtype))
        check(lambda a, x: kvpool.write_tokens_q((a,), None, pg, off, x, n // b + 3)[0][0],
              (x,), expect)
    dst = jnp.asarray([9, 3])   # whole pages (a prefix-cache copy)
    blocks = jnp.asarray(rng.normal(size=(kh, 2, b, h))).astype(dtype)
    check(lambda a, blk: kvpool.write_pages((a,), dst, blk)[0], (kvpool.as_storage(blocks, store),),
          ref.at[:, dst].set(blocks))


def test_a_cpu_bfloat16_pool_is_read_as_bfloat16_by_every_decode_reader():
    """A bfloat16 model's pool holds uint16 bits on CPU; the C++ kernel, the XLA sweep and
    the Pallas GPU kernel (interpreted here, as the GPU tests run it) must all read them as
    bfloat16 -- a reader taking them as integers would attend to garbage."""
    c = tiny().text
    pool = kvpool.init_pool(c, (6,), 16, "bfloat16", "cpu")
    assert pool.k[0][0].dtype == jnp.uint16
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(1, 20, c.n_kv_heads, c.head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 20, c.n_kv_heads, c.head_dim)), jnp.float32)
    pg, off = jnp.asarray(1 + np.arange(20) // 16)[None], jnp.asarray(np.arange(20) % 16)[None]
    ks, vs = kvpool.write_tokens(pool.k[0], pg, off, k), kvpool.write_tokens(pool.v[0], pg, off, v)
    q = jnp.asarray(rng.normal(size=(1, 1, c.n_heads, c.head_dim)), jnp.float32)
    want = np.asarray(attention(q, k.astype(jnp.bfloat16).astype(jnp.float32),
                                v.astype(jnp.bfloat16).astype(jnp.float32))[:, 0])
    pt, ln = jnp.asarray([[1, 2]], jnp.int32), jnp.asarray([20], jnp.int32)
    acc = kvpool.DecodeAccess(pg[0, :1], off[0, :1], jnp.asarray([1, 0, 0, 1, 1, 1]),
                              jnp.asarray([0, 16, 4, 0, 0, 0]), pt, ln)
    for reader in (kvpool.cpu_kernel_attend, kvpool.gpu_interpret_attend, None):
        got = (reader or kvpool.sweep_attend)(acc, (ks, vs, None, None), q[:, 0])
        np.testing.assert_allclose(np.asarray(got, np.float32).reshape(want.shape), want,
                                   rtol=0, atol=5e-3, err_msg=str(reader))   # (bf16 probabilities)
