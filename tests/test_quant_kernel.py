"""The CPU dense kernel (`cpukernel.dense`, csrc/dense.cc) on quantized weights
(`model.quant`): int8 and float8_e4m3fn codes with channel scales, [K, N] and the LM head's
[N, K], and 4-bit codes with group scales and zero points.  The kernel widens the codes as
it packs W's panels, so its result must be bitwise the float kernel's on the weight
`quant.dequantize` makes (the same packed values through the same tiles), at every edge
of the tiling: 1, 5 and 13 rows (a lone row past the 6-row tiles, and none), columns not a
multiple of 16 and more than one 128-column block, k not a multiple of the packing depth
(nor of 8 or 16, where the head is transposed 8 x 8 and widened 16 at a time), 4-bit groups
of 128 and of 4 rows.  At 1-4 rows a [K, N] W is streamed instead (no packing: the codes
widened in registers, each output's sum still in k order): bitwise the same, at its own
edges (column groups of 32, 16 and 8 and single columns, several column blocks, sweeps of
8 k's cut by a 4-bit group or the half of K)."""

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from photon_jax.kernels import cpukernel
from photon_jax.model import quant

F8 = ml_dtypes.float8_e4m3fn


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpukernel.load(), cpukernel.reason()
    if not cpukernel.dense_fast():   # the kernel refuses; decode keeps XLA's products
        w = _dev(quant.quantize(np.ones((16, 16), np.float32), "int8"))
        with pytest.raises(Exception, match="without AVX2 and FMA"):
            jax.block_until_ready(jax.jit(cpukernel.dense)(jnp.ones((1, 16)), w,
                                                           jnp.zeros(16)))
        pytest.skip("this CPU lacks AVX2 + FMA: the dense kernel is not built for it")


def _dev(tree):
    return jax.tree.map(jnp.asarray, tree)


@partial(jax.jit, static_argnames="transposed")
def _dense3(xs, w, b, transposed):
    """The kernel at several row counts, in one program (one compile per weight)."""
    return [cpukernel.dense(x, w, b, transposed) for x in xs]


def _run(xs, w, b, transposed):
    return [np.asarray(y) for y in _dense3([jnp.asarray(x) for x in xs], _dev(w),
                                           jnp.asarray(b), transposed)]


LAYOUTS = [("int8", False), ("int8", True), ("fp8", False), ("fp8", True), ("int4", False)]


@pytest.mark.parametrize("fmt,transposed", LAYOUTS)
@pytest.mark.parametrize("k,n", [(256, 33), (300, 40), (520, 272)])
def test_quantized_dense_is_the_float_kernel_on_the_dequantized_weight(fmt, transposed, k, n):
    """Bitwise the float kernel on `quant.dequantize(w, float32)` (the same packed values,
    the same sums), and close to float64 on numpy's dequantized weight.  4-bit: K = 256 is
    2 groups of 128, 300 is 75 groups of 4, 520 is 65 groups of 8."""
    rng = np.random.default_rng(k * 1000 + n)
    w = rng.normal(size=(k, n)).astype(np.float32)
    q = quant.quantize(w, fmt)
    if transposed:
        q = quant.transpose_head(q)
    b = rng.normal(size=n).astype(np.float32)
    xs = [rng.normal(size=(m, k)).astype(np.float32) for m in (1, 5, 13)]
    wf = np.asarray(quant.dequantize(_dev(q), jnp.float32, transposed))
    # numpy's widening is the same numbers (4-bit: through bfloat16 both ways).
    np.testing.assert_array_equal(quant.dequantize(q, np.float32, transposed, xp=np), wf)
    got = _run(xs, q, b, transposed)
    want = _run(xs, wf, b, transposed)
    w_kn = (wf.T if transposed else wf).astype(np.float64)
    for x, y, yf in zip(xs, got, want):
        assert y.shape == (x.shape[0], n) and y.dtype == np.float32
        np.testing.assert_array_equal(y, yf)
        np.testing.assert_allclose(y, x.astype(np.float64) @ w_kn + b, rtol=1e-5, atol=2e-4)
    # `linear` passes the dict through as it is ("w", or the head's "w_vd").
    p = {"w_vd" if transposed else "w": _dev(q), "b": jnp.asarray(b)}
    np.testing.assert_array_equal(np.asarray(jax.jit(cpukernel.linear)(jnp.asarray(xs[1]), p)),
                                  got[1])


STREAM_CASES = [(fmt, k, n) for fmt in ("int8", "fp8", "int4")
                for k, n in ((300, 77), (520, 200), (1000, 2100))] + \
               [("int8", 301, 45), ("fp8", 301, 45), ("int4", 2, 9)]


@pytest.mark.parametrize("fmt,k,n", STREAM_CASES)
def test_few_rows_stream_the_codes_bitwise_as_the_float_kernel(fmt, k, n):
    """1-4 rows (the streaming path) and 5 (packed again), bitwise the float kernel (packed
    tiles) on the dequantized weight.  N = 77, 200, 2100, 45, 9: groups of 32, 16 and 8
    columns and single ones, blocks of columns past the first; K = 300, 301, 520, 1000, 2:
    sweeps of 8 k's and a partial last one; 4 bits: 75 groups of 4 (the half of K inside a
    group), 65 and 125 of 8, one of 2."""
    rng = np.random.default_rng(k * 7 + n)
    w = rng.normal(size=(k, n)).astype(np.float32)
    q = quant.quantize(w, fmt)
    b = rng.normal(size=n).astype(np.float32)
    xs = [rng.normal(size=(m, k)).astype(np.float32) for m in (1, 2, 3, 4, 5)]
    wf = np.asarray(quant.dequantize(_dev(q), jnp.float32))
    got = _run(xs, q, b, False)
    want = _run(xs, wf, b, False)
    for x, y, yf in zip(xs, got, want):
        assert y.shape == (x.shape[0], n) and y.dtype == np.float32
        np.testing.assert_array_equal(y, yf)
        np.testing.assert_allclose(y, x.astype(np.float64) @ wf.astype(np.float64) + b,
                                   rtol=1e-5, atol=5e-4)


def test_fp8_codes_widen_by_the_format_definition():
    """All 256 float8_e4m3fn codes (NaN for S.1111.111) as ml_dtypes widens them, through
    each of the kernel's paths: [K, N] 16 columns at a time (the F16C widening), the head's
    [N, K] 16 k's at a time (widened, then transposed) and its scalar k tail (the table);
    times a scale, rounded once like numpy's float32 product."""
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(F8).astype(np.float32)
    assert np.isnan(values).sum() == 2
    rng = np.random.default_rng(1)
    for s in (np.ones(256, np.float32), rng.uniform(0.01, 3.0, 256).astype(np.float32)):
        want = values * s   # float32
        b = np.zeros(256, np.float32)
        one = np.ones((1, 1), np.float32)
        y_kn = _run([one], {"q": codes.view(F8)[None, :], "s": s}, b, False)[0][0]
        y_nk = _run([one], {"q": codes.view(F8)[:, None], "s": s}, b, True)[0][0]
        # [256, 16]: code n at k = 0, zeros after; x picks k = 0.
        q16 = np.zeros((256, 16), np.uint8)
        q16[:, 0] = codes
        x16 = np.eye(1, 16, dtype=np.float32)
        y_16 = _run([x16], {"q": q16.view(F8), "s": s}, b, True)[0][0]
        for y in (y_kn, y_nk, y_16):
            np.testing.assert_array_equal(y, want)


def test_int4_rounds_both_steps_to_bfloat16_and_keeps_nans():
    """(code - z) and its product with s each round to the nearest bfloat16, ties to even
    (crafted ties in both steps), and a NaN scale or zero point gives NaN, as
    `quant.dequantize` (XLA's reduce_precision) computes, bit for bit."""
    k, n = 256, 48
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 16, size=(k, n)).astype(np.uint8)
    s = rng.uniform(0.001, 0.1, size=(2, n)).astype(np.float32)
    z = rng.uniform(0, 15, size=(2, n)).astype(np.float32)
    # Ties in (code - z): code 3, z = 3 - t for t halfway between two bfloat16 values.
    ties = np.array([0x3F808000, 0x3F818000, 0x40208000], np.uint32).view(np.float32)
    codes[0, :3] = 3
    z[0, :3] = 3 - ties
    s[0, :3] = 1.0
    # A tie in the product: bf16(c - z) = 1 (c = 1, z = 0), s a tie itself.
    codes[1, 3] = 1
    z[0, 3] = 0.0
    s[0, 3] = ties[1]
    w = {"q4": quant.pack_nibbles(codes), "s4": s, "z4": z}
    wf = np.asarray(quant.dequantize(_dev(w), jnp.float32))
    np.testing.assert_array_equal(wf[0, :3], ties.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert wf[1, 3] == np.float32(ties[1]).astype(ml_dtypes.bfloat16).astype(np.float32)
    x = rng.normal(size=(2, k)).astype(np.float32)
    b = np.zeros(n, np.float32)
    np.testing.assert_array_equal(_run([x], w, b, False)[0], _run([x], wf, b, False)[0])
    # NaN in a scale, a zero point (first block) and one past the last full panel.
    s[1, 5], z[0, 20], z[1, 40] = np.nan, np.nan, np.nan
    w = {"q4": w["q4"], "s4": s, "z4": z}
    wf = np.asarray(quant.dequantize(_dev(w), jnp.float32))
    y = _run([x], w, b, False)[0]
    assert np.isnan(y[:, [5, 20, 40]]).all() and not np.isnan(np.delete(y, [5, 20, 40], 1)).any()
    np.testing.assert_array_equal(y, _run([x], wf, b, False)[0])


def test_int4_nan_payloads_stay_nan_streamed_and_packed():
    """A NaN scale or zero point whose payload the bfloat16 rounding's carry would turn into
    a zero or an infinity (0x7FFFFFFF, 0xFFFF8000) still gives NaN, at 1 row (streamed)
    and 5 (packed), as `quant.dequantize` keeps it."""
    k, n = 256, 80
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 16, size=(k, n)).astype(np.uint8)
    s = rng.uniform(0.001, 0.1, size=(2, n)).astype(np.float32)
    z = rng.uniform(0, 15, size=(2, n)).astype(np.float32)
    bad = np.array([0x7FFFFFFF, 0xFFFF8000], np.uint32).view(np.float32)
    s[0, 3], z[1, 70], z[0, 66] = bad[0], bad[1], bad[0]
    w = {"q4": quant.pack_nibbles(codes), "s4": s, "z4": z}
    wf = np.asarray(quant.dequantize(_dev(w), jnp.float32))
    assert np.isnan(wf[:, [3, 66, 70]]).any(0).all()
    xs = [rng.normal(size=(m, k)).astype(np.float32) for m in (1, 5)]
    b = np.zeros(n, np.float32)
    for y, yf in zip(_run(xs, w, b, False), _run(xs, wf, b, False)):
        assert np.isnan(y[:, [3, 66, 70]]).all()
        assert not np.isnan(np.delete(y, [3, 66, 70], 1)).any()
        np.testing.assert_array_equal(y, yf)


def test_dense_bytes_accessed_counts_codes_scales_and_zeros():
    """A quantized call reads its codes, scales and zero points at their own widths (and
    x and the bias; it writes y); a float call its float32 weight, with nothing for the
    empty scale and zero operands."""
    m, k, n = 3, 256, 40
    rng = np.random.default_rng(3)
    w = rng.normal(size=(k, n)).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32))
    b = jnp.zeros(n, jnp.float32)
    rest = m * k * 4 + n * 4 + m * n * 4
    for fmt, transposed in [(None, False), ("int8", False), ("fp8", True), ("int4", False)]:
        wq = quant.quantize(w, fmt) if fmt else w
        if transposed:
            wq = quant.transpose_head(wq)
        p = {"w_vd" if transposed else "w": _dev(wq), "b": b}
        jaxpr = jax.make_jaxpr(lambda x, p: cpukernel.linear(x, p))(x, p)
        weight_bytes = {None: k * n * 4, "int8": k * n + n * 4, "fp8": k * n + n * 4,
                        "int4": k // 2 * n + 2 * (k // 128) * n * 4}[fmt]
        assert weight_bytes == quant.nbytes((k, n), fmt, np.float32)
        assert cpukernel.dense_bytes_accessed(jaxpr) == rest + weight_bytes, fmt


def test_bad_quantized_weights_are_refused():
    w = quant.quantize(np.ones((64, 16), np.float32), "int4")
    x = jnp.ones((1, 64), jnp.float32)
    b = jnp.zeros(16, jnp.float32)
    with pytest.raises(ValueError, match="never held transposed"):
        cpukernel.dense(x, _dev(w), b, transposed=True)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        cpukernel.dense(x, {"q": jnp.ones((64, 16), jnp.uint8), "s": jnp.ones(16)}, b)
    with pytest.raises(ValueError, match="'avx2' or 'avx512', not 'sse'"):
        cpukernel.dense_isa("sse")


@pytest.fixture
def avx2_stream():
    """The 256-bit stream for this test (`cpukernel.dense_isa("avx2")`), the 512-bit one
    restored after.  Where this machine builds the 512-bit stream, nothing else in the suite
    runs the 256-bit one, which every AVX2 CPU without AVX-512 runs."""
    before = cpukernel.dense_isa()
    assert cpukernel.dense_isa("avx2") == "avx2"
    yield before
    cpukernel.dense_isa(before)


@pytest.mark.parametrize("fmt,k,n", [("int8", 300, 77), ("int8", 301, 2100), ("fp8", 520, 45)])
def test_the_256_bit_stream_gives_the_same_bits(avx2_stream, fmt, k, n):
    """1-4 rows of 8-bit codes through the 256-bit stream equal the float kernel on the
    dequantized weight bit for bit, as the 512-bit stream does (where built): column groups
    of 32, 16 and 8 and single columns, sweeps cut short."""
    rng = np.random.default_rng(k + n)
    w = rng.normal(size=(k, n)).astype(np.float32)
    q = quant.quantize(w, fmt)
    b = rng.normal(size=n).astype(np.float32)
    xs = [rng.normal(size=(m, k)).astype(np.float32) for m in (1, 2, 3, 4)]
    wf = np.asarray(quant.dequantize(_dev(q), jnp.float32))
    want = _run(xs, wf, b, False)
    for y, yf in zip(_run(xs, q, b, False), want):
        np.testing.assert_array_equal(y, yf)
    if avx2_stream == "avx512":   # and the 512-bit stream, switched back on
        assert cpukernel.dense_isa("avx512") == "avx512"
        for y, yf in zip(_run(xs, q, b, False), want):
            np.testing.assert_array_equal(y, yf)
