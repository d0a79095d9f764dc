"""Our GPU decode attention (`gpu_attention`) on a machine without a GPU: the kernel under the
Pallas interpreter against float64 attention (ragged lengths, shared prefix pages, every
split variant, MHA and GQA, float32 / bfloat16 / e4m3 / int8 pools), empty splits that
write nothing, the host's split plan, the traffic count, and every variant lowered for
CUDA (Pallas's Triton lowering: a block shape or op it rejects fails here)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from photon_jax.engine import kvpool, step as step_mod
from photon_jax.engine.pages import pages_for
from photon_jax.kernels import gpu_attention as ga
from photon_jax.model.config import moondream2

from helpers import biased_model, pallas_attention

INTERPRET = pallas_attention() != "pallas"
TRITON = "__gpu$xla.gpu.triton"
# (kv heads, queries per kv head): Moondream's MHA, and GQA
HEADS = [(4, 1), (2, 4)]
DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "int8"]


def dense64(q_QH, k_KSH, v_KSH):
    """float64 attention of one row's queries over its gathered K/V (zeros when empty)."""
    kh, n = k_KSH.shape[0], q_QH.shape[0]
    if k_KSH.shape[1] == 0:
        return np.zeros(q_QH.size)
    q = q_QH.reshape(kh, n // kh, -1).astype(np.float64)
    s = np.einsum("kgh,ksh->kgs", q, k_KSH) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("kgs,ksh->kgh", w, v_KSH).reshape(-1)


def make_case(dtype, kh, g, seed=0, h=32, page=16, p=48, m=16):
    """A pool of `dtype` (8-bit: codes and scales), its float64 values, and rows of 0, 1,
    16, 17, 100 and 200 positions with pages scattered through the pool; row 6 shares row
    5's first 4 pages (a cached prefix) and goes on in pages of its own."""
    rng = np.random.default_rng(seed)
    x = {n: rng.normal(size=(kh, p, page, h)) * rng.uniform(0.2, 3.0, size=(kh, p, page, 1))
         for n in "kv"}
    pool, exact = {}, {}
    for n in "kv":
        if dtype in kvpool.QUANTIZED:
            codes, sc = kvpool.quantize(jnp.asarray(x[n], jnp.float32), dtype)
            pool[n], pool[n + "s"] = codes, sc
            exact[n] = np.asarray(codes.astype(jnp.float32), np.float64) * \
                np.asarray(sc, np.float64)[..., None]
        else:
            pool[n] = jnp.asarray(x[n], dtype)
            exact[n] = np.asarray(pool[n].astype(jnp.float32), np.float64)
    lengths = [0, 1, 16, 17, 100, 200, 90]
    free = rng.permutation(np.arange(1, p)).tolist()
    tables = np.zeros((len(lengths), m), np.int32)
    for i, n in enumerate(lengths[:6]):
        used = pages_for(max(n, 1), page)
        tables[i, :used] = free[:used]
        free = free[used:]
    tables[6, :4] = tables[5, :4]
    own = pages_for(90, page) - 4
    tables[6, 4:4 + own] = free[:own]
    qdt = "bfloat16" if dtype == "bfloat16" else "float32"
    q = jnp.asarray(rng.normal(size=(len(lengths), kh * g, h)), qdt)
    return pool, exact, q, tables, lengths


def want_rows(exact, q, tables, lengths):
    qf = np.asarray(q.astype(jnp.float32), np.float64)
    out = []
    for i, n in enumerate(lengths):
        kv = [np.concatenate([exact[x][:, j] for j in tables[i]], 1)[:, :n] for x in "kv"]
        out.append(dense64(qf[i], *kv))
    return np.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kh,g", HEADS, ids=["mha", "gqa"])
def test_every_split_variant_equals_float64_attention(dtype, kh, g):
    """Each split count gives, for every row (empty, inside / on / across page boundaries,
    sharing another row's prefix pages), float64 attention over its own positions (8-bit
    pools: over the dequantized values); a bfloat16 pool's output is bfloat16."""
    pool, exact, q, tables, lengths = make_case(dtype, kh, g, seed=kh + g)
    want = want_rows(exact, q, tables, lengths)
    # (bfloat16: the kernel computes in float32 and rounds the output once, half a unit
    # of bfloat16's 8-bit mantissa; a GPU's exp2 is approximate.)
    rtol, atol = (2.0 ** -8, 1e-5) if dtype == "bfloat16" else \
        (0.0, 2e-5 if not INTERPRET else 5e-6)
    for splits in ga.SPLITS:
        out = ga.attend(pool["k"], pool["v"], q, jnp.asarray(tables),
                        jnp.asarray(lengths, jnp.int32), splits=splits, interpret=INTERPRET,
                        ks_KPB=pool.get("ks"), vs_KPB=pool.get("vs"))
        assert out.dtype == q.dtype and out.shape == (len(lengths), kh * g * 32)
        np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), want, rtol=rtol,
                                   atol=atol, err_msg=f"splits={splits}")


def test_e4m3_codes_as_a_cpu_pool_stores_them():
    """A CPU pool keeps e4m3 codes as their bytes (`kvpool.storage_dtype`): the kernel reads
    them as float8, the same result."""
    pool, exact, q, tables, lengths = make_case("float8_e4m3fn", 4, 1, seed=9)
    st = kvpool.storage_dtype("float8_e4m3fn", "cpu")
    out = ga.attend(kvpool.as_storage(pool["k"], st), kvpool.as_storage(pool["v"], st), q,
                    jnp.asarray(tables), jnp.asarray(lengths, jnp.int32), splits=4,
                    interpret=INTERPRET, ks_KPB=pool["ks"], vs_KPB=pool["vs"])
    np.testing.assert_allclose(np.asarray(out), want_rows(exact, q, tables, lengths),
                               atol=5e-6 if INTERPRET else 2e-5)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's NaN-filled outputs show what "
                    "a program left unwritten; a GPU's unwritten memory holds anything")
def test_empty_splits_write_nothing_and_the_combine_masks_them():
    """16 splits over rows of 0, 1, 17 and 200 positions (steps of 128: 0, 1, 1, 2 steps):
    the interpreter fills outputs with NaN, so the partial slots of splits with no step are
    still NaN (never written) and exactly those; the combined rows are finite and right."""
    pool, exact, q, tables, lengths = make_case("float32", 4, 1, seed=3)
    pick = [0, 1, 3, 5]
    q, tables = q[np.asarray(pick)], tables[pick]
    lengths = [lengths[i] for i in pick]
    n = jnp.asarray(lengths, jnp.int32)
    o, mx, sm = ga.kernel(pool["k"], pool["v"], q, jnp.asarray(tables), n, splits=16,
                          interpret=True)
    first, last = ga.split_bounds(np.asarray(lengths), 16, ga.per_step(16) * 16)
    empty = (last == first)                                        # [R, S]
    assert empty.sum(1).tolist() == [16, 15, 15, 14]
    for part in (np.asarray(o), np.asarray(mx), np.asarray(sm)):
        untouched = np.isnan(part).reshape(*part.shape[:3], -1).all(-1)   # [R, K, S]
        assert (untouched == empty[:, None, :]).all()
    out = ga.attend(pool["k"], pool["v"], q, jnp.asarray(tables), n, splits=16, interpret=True)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), want_rows(exact, q, tables, lengths),
                               atol=5e-6)


def test_the_plan_follows_rows_heads_lengths_and_sms():
    """Moondream 2 (32 KV heads, pages of 64, an H200's 132 SMs): batch 32 needs no split
    (1024 programs); batch 8 two; batch 1 as many as its length allows (a split streams 256
    positions at least: 4 at 1k positions, 8 at 2k, 16 at 32k); short rows never split; a
    small GPU splits less."""
    def plan(rows, length, sms=None):
        return ga.plan_splits([length] * rows, 32, 64, sms)
    assert plan(32, 1024) == 1 and plan(32, 32768) == 1
    assert plan(8, 1024) == 2 and plan(8, 2048) == 2
    assert plan(4, 1024) == 4 and plan(2, 2048) == 8
    assert (plan(1, 1024), plan(1, 2048), plan(1, 32768)) == (4, 8, 16)
    assert plan(1, 255) == 1 and plan(1, 600) == 2 and plan(3, 100) == 1
    assert plan(1, 2048, sms=16) == 1 and plan(1, 2048, sms=40) == 4
    # Ragged rows: the longest row bounds the splits, every row counts as work.
    assert ga.plan_splits([2048, 10], 32, 64) == 8
    assert ga.plan_splits([2048] + [10] * 7, 32, 64) == 2


def test_every_planned_split_is_one_the_engine_compiled():
    """Whatever the lengths, the plan of a step of n real rows is among the variants its
    row bucket is warmed up for (`EnginePrograms.split_variants`), which stay few (Moondream 2,
    batch up to 32: 16 forward programs over the 6 buckets); other attentions take 1."""
    cfg = moondream2()
    total = 0
    for bucket in step_mod.row_buckets(32):
        variants = ga.bucket_variants(bucket, cfg.text.n_kv_heads)
        total += len(variants)
        assert variants[0] == 1 and set(variants) <= set(ga.SPLITS)
        lo = bucket // 2 + 1 if bucket > 1 else 1
        for n in range(lo, bucket + 1):
            for length in (1, 100, 256, 700, 1024, 2048, 5000, 32768):
                for page in (16, 64, 256):
                    s = ga.plan_splits([length] * n, cfg.text.n_kv_heads, page)
                    assert s in variants, (bucket, n, length, page, s)
    assert total == 16


def test_the_split_plan_over_a_mesh_counts_each_chips_kv_heads():
    """Over a mesh that splits the pool by kv heads, a chip's kernel runs (row, head, split)
    programs for its own heads: the plan is given K / n heads (more splits), the same as
    one chip holding K / n heads; heads that do not divide stay whole."""
    from photon_jax.model import sharding

    cfg = moondream2()
    tp = sharding.TensorParallel(jax.sharding.AbstractMesh((4,), (sharding.AXIS,)))
    one, four = step_mod.build(cfg, "pallas"), step_mod.build(cfg, "pallas", tp=tp)
    assert tp.heads_per_chip(32) == 8 and tp.heads_per_chip(6) == 6
    for rows, length in ((32, 2048), (8, 1024), (2, 2048)):
        lengths = [length] * rows
        assert four.decode_splits(lengths, 64) == ga.plan_splits(lengths, 8, 64)
        assert one.decode_splits(lengths, 64) == ga.plan_splits(lengths, 32, 64)
    assert four.decode_splits([1024] * 8, 64) > one.decode_splits([1024] * 8, 64)
    assert four.split_variants(8) == ga.bucket_variants(8, 8)


def test_other_attentions_take_one_split(tiny_ckpt):
    """The CPU's attentions have one decode program: their plan is always 1 split."""
    base = biased_model(tiny_ckpt, {})
    assert not base.attention.startswith("pallas")
    assert step_mod.programs_of(base).decode_splits([2048], 64) == 1
    assert step_mod.programs_of(base).split_variants(1) == (1,)


def test_the_traffic_count_meets_the_write_target_at_batch_32():
    """The count (`gpu_attention.traffic`) at Moondream 2 shapes, bf16 K/V, ~1k positions:
    batch 32 (no split) writes only its output, under 5% of the K/V it reads (the issue's
    target); at batch 1, 8 and 32 no program is empty and the kernel reads the K/V it
    attends plus at most one step's tail per row and head (and its queries and tables)."""
    kw = dict(kv_heads=32, group=1, head_dim=64, page_size=64, table_width=32,
              kv_itemsize=2, out_itemsize=2)
    for rows in (1, 8, 32):
        lengths = [1000 + 3 * i for i in range(rows)]
        s = ga.plan_splits(lengths, 32, 64)
        t = ga.traffic(lengths, splits=s, **kw)
        assert t["empty"] == 0 and t["programs"] == rows * 32 * s
        assert t["kv_attended"] <= t["read"] <= t["kv_attended"] + rows * 32 * (
            2 * 128 * 64 * 2 + 4096)
        if rows == 32:
            assert s == 1 and t["combine_read"] == t["combine_written"] == 0
            assert t["written"] <= 0.05 * t["kv_attended"]
    # A row of 100 positions in 16 splits: 1 step, 15 empty programs per head, unwritten.
    t = ga.traffic([100], splits=16, **kw)
    assert t["empty"] == 15 * 32 and t["written"] == 32 * (64 + 2) * 4


@pytest.mark.parametrize("kh,g", HEADS, ids=["mha", "gqa"])
def test_every_variant_lowers_for_cuda(kh, g):
    """Every split count over every pool dtype (8-bit ones with their scales, queries in
    bfloat16 and float32), pages of 16 to 256 positions, a table width that is no power of
    2: one Triton call each when lowered for CUDA (no GPU needed)."""
    sds = jax.ShapeDtypeStruct
    for dtype in DTYPES:
        quantized = dtype in kvpool.QUANTIZED
        for qdt in (("bfloat16", "float32") if quantized else (dtype,)):
            for splits in ga.SPLITS:
                page = {1: 16, 2: 64, 4: 32, 8: 128, 16: 256}[splits]
                pool = sds((kh, 16, page, 64), jnp.dtype(dtype))
                sc = sds((kh, 16, page), jnp.float32)
                args = [pool, pool, sds((4, kh * g, 64), jnp.dtype(qdt)),
                        sds((4, 25), jnp.int32), sds((4,), jnp.int32)]
                if quantized:
                    fn = jax.jit(lambda k, v, q, t, n, ks, vs, s=splits: ga.attend(
                        k, v, q, t, n, splits=s, ks_KPB=ks, vs_KPB=vs))
                    args += [sc, sc]
                else:
                    fn = jax.jit(lambda k, v, q, t, n, s=splits: ga.attend(k, v, q, t, n,
                                                                            splits=s))
                text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
                assert text.count(TRITON) == 1, (dtype, qdt, splits)


def test_the_engine_warms_every_split_it_plans_and_never_retraces(tiny_ckpt):
    """The engine on the GPU kernel (interpreted) compiles at start every (row bucket, split)
    variant its plan can give; a request long enough to split (an image prompt, ~760
    positions: 2 splits) then runs without compiling a decode program."""
    from photon_jax.engine.core import Engine
    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import Settings
    from photon_jax.model import Model
    from helpers import ENGINE_IMAGES as IMAGES

    base = biased_model(tiny_ckpt, {})
    model = Model(base.cfg, base.params, base.prompts.tok, attention=pallas_attention())
    eng = Engine(model, max_batch_size=2, max_context=800, page_size=32, warmup=True)
    try:
        eng.wait_warm(timeout=900)
        P = eng.programs
        want = sum(len(P.split_variants(rb)) for rb in step_mod.row_buckets(2))
        assert want > 2 and P.forward._cache_size() == want
        out = eng.submit(Request("text", model.prompts.caption("short"), IMAGES[0],
                                 Settings(max_tokens=4, temperature=0))).result(timeout=600)
        assert len(out["ids"]) > 0
        assert P.decode_splits([760], 32) == 2
        assert P.forward._cache_size() == want
    finally:
        eng.close()
