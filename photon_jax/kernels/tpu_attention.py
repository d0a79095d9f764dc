"""Decode attention over the paged KV pool on TPU: a Pallas (Mosaic) kernel that reads each
row's pages where they lie, through its page table, and the pool layout it reads.

What this module owns: the TPU pool layout (`pack`: how many kv heads share a pool row), the
packing of heads into and out of that layout (`pack_heads`, `unpack_heads`), and `attend`,
the kernel.  `kvpool` calls `pack_heads` / `unpack_heads` where it writes and gathers, and
`attend` for the "pallas-tpu" decode attention (`platforms.ATTENTION`).

Why a layout of its own.  A TPU tiles the last two dims of an array by (sublanes, 128
lanes).  The CPU/GPU pool is [K, P, B, H] per layer and arena with H = 64 (Moondream), so a
page's [T, 64] slab fills half the lanes of its tiles.  Measured on a v5e (a deviceless
compile, `bench/tpu_compile.py`): XLA:TPU then lays such an array out with the *page* axis
on the lanes ({1,3,2,0:T(8,128)}), so one page's positions are spread one lane each over
whole tiles -- a page read in place is a strided read of tiles mostly not its own -- and
JAX's Pallas TPU paged-attention kernel refuses the [T, 64] block outright ("last two
dimensions of the block shape divisible by 8 and 128").  Padding H to 128 would double every
byte read.  So the TPU pool puts `pack` = 128 // H kv heads side by side in one row:

    pool[j, p, t, s*H:(s+1)*H] = K (or V) of kv head j*pack + s at position t of page p

an array [ceil(K / pack), P, B, 128] whose natural layout is the row-major tiled one.  A
page of one head pair is a dense [T, 128] slab; a page of all heads is a strided run of
them, read by one DMA.  Nothing is padded when K is a multiple of `pack` (Moondream 2 and
3: 32 kv heads); an odd K (the tiny test models: 1) pads the last row with a zero head.
CPU and GPU keep [K, P, B, H] (`pack` 1).

The kernel.  Grid: one step per row, run in order (the steps share a DMA pipeline).  Scalar
prefetch puts the lengths and the flattened page tables in SMEM.  A step walks its row's
pages `per_block` at a time; each page of all heads is one DMA from the pool in HBM into a
double-buffered VMEM block, started while the previous block is computed (and the last
block of a row starts the next row's first, so the pipeline does not drain between rows).
Only pages below the row's length are copied (a DMA per live page, the others skipped), so
the bytes read are the row's pages: its K/V bytes rounded up to whole pages (under 1.09x at
an image prompt of 730+ positions in pages of 64; `read_bytes`).  For every pool row j at
once (products batched over the rows): scores of its `pack` * G queries against the
block's 128-lane K rows in one product -- the queries are block-diagonal (query rows of
head s carry their H values in lanes [sH, (s+1)H) and zeros elsewhere), so each query row's
score is its own head's dot product -- an online softmax per query row, and the
probabilities times the 128-lane V rows; at the end each query row keeps the lanes of its
own head.  The products compute `pack` times the useful flops (decode attention is bound
by HBM bytes, not by the MXU).  (A loop over the rows with 2-D products compiles too; the
batched form issues 2 products per block instead of 2 per row.)

Positions past a row's length are masked in the scores, and their V rows zeroed: a skipped
page leaves its buffer holding whatever was there (another row's page, or memory never
written), and 0 * NaN would be NaN.

8-bit pools (`kv_dtype` "int8" / "float8_e4m3fn", `kvpool.quantize`: a float32 scale per
kv head and position).  The codes keep the layout above ([K/f, P, B, 128], one byte each),
so a page of all heads is still one DMA, of half the bytes of bfloat16.  The scales are
laid out to match (`scale_shape`):

    scales[j, p, s*B + t] = the scale of kv head j*f + s at position t of page p

an array [K/f, P, f*B] float32: the scales of one pool row's page are one row of f*B
lanes (128 at head dim 64 and pages of 64: no padding, 8 pages to a tile), the array leads
with the pool rows like the codes (split over a mesh the same way), and a page's scales of
all rows are one more DMA beside its codes (K with K's, V with V's; 6% of the codes' bytes
at H = 64).  In VMEM the codes are widened to q's dtype (bfloat16 or float32; exact: int8
and e4m3 values are bfloat16 values), the block's scales rearranged to [K/f, f, positions]
(`pltpu.einshape`), and applied where the other attentions of `kvpool` apply them: the K
scales multiply the scores (a position's scale is a common factor of its dot product), the
V scales the probabilities.  TPU v5e and v6e have no float8 arithmetic; e4m3 codes are only
converted (in VMEM, by Mosaic's conversion), never multiplied as float8.  Checked without a
TPU (deviceless Mosaic compiles, libtpu 0.0.42.1, Moondream 2's shapes, 32 rows): int8 and
e4m3 pools compile for v5e and v6e at pages of 64, int8 for v5e at pages of 16, 32 and 128
too (Mosaic's int8 tile is (32, 128): a page of 16 int8 positions is half a tile, relaid by
Mosaic; the scales of pages under 64 fill under 128 lanes) -- nothing has run on a TPU, so
the cost of the widening and of those relayouts is unmeasured.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..base import compat
from ..base.dtypes import F32

LANES = 128
# A large finite negative score for masked positions: -inf would make a block whose
# positions are all masked compute exp(-inf - -inf) = NaN.
MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
# VMEM a block's K and V may take, both buffers (MD2/MD3 in bfloat16: 4 pages of 64): with
# the block's temporaries the kernel compiles for v5e and v6e within Mosaic's default VMEM.
BLOCK_BYTES = 4 << 20


def pack(head_dim: int) -> int:
    """kv heads per row of the TPU pool: 128 // head_dim for head dims dividing 128, else 1
    (a head dim of 128 or more fills the lanes by itself)."""
    if head_dim < LANES and LANES % head_dim == 0:
        return LANES // head_dim
    return 1


def packed_heads(n_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(rows, lanes): the pool's first and last axis for K kv heads of head_dim."""
    f = pack(head_dim)
    return -(-n_kv_heads // f), f * head_dim


def pack_heads(x_XKH, lanes: int):
    """[..., K, H] -> [..., ceil(K / f), f * H] (f = lanes // H): heads j*f..j*f+f-1 side by
    side in row j, a missing last head zero."""
    *lead, k, h = x_XKH.shape
    f = lanes // h
    rows = -(-k // f)
    if rows * f != k:
        pad = [(0, 0)] * len(lead) + [(0, rows * f - k), (0, 0)]
        x_XKH = jnp.pad(x_XKH, pad)
    return x_XKH.reshape(*lead, rows, lanes)


def unpack_heads(x_JXBL, n_kv_heads: int, head_dim: int):
    """Gathered pages of the TPU layout [J, X..., B, f * H] -> [K, X..., B, H]."""
    j, *mid, lanes = x_JXBL.shape
    f = lanes // head_dim
    x = x_JXBL.reshape(j, *mid, f, head_dim)
    x = jnp.moveaxis(x, -2, 1)                                   # [J, f, X..., B, H]
    return x.reshape(j * f, *mid, head_dim)[:n_kv_heads]


def pack_scales(sc_XK, rows: int, f: int):
    """Scales [X..., K] -> [rows, X..., f] (f heads a row, a missing last head's scale 1):
    what `scale_shape`'s lane s*B + t of row j holds for head j*f + s."""
    *lead, k = sc_XK.shape
    if rows * f != k:
        sc_XK = jnp.pad(sc_XK, [(0, 0)] * len(lead) + [(0, rows * f - k)],
                        constant_values=1.0)
    return jnp.moveaxis(sc_XK.reshape(*lead, rows, f), -2, 0)


def unpack_scales(sc_JXL, n_kv_heads: int, page_size: int):
    """Gathered scales of the TPU layout [J, X..., f * B] -> [K, X..., B]."""
    j, *mid, lanes = sc_JXL.shape
    f = lanes // page_size
    x = jnp.moveaxis(sc_JXL.reshape(j, *mid, f, page_size), -2, 1)   # [J, f, X..., B]
    return x.reshape(j * f, *mid, page_size)[:n_kv_heads]


def read_bytes(length_R, page_size: int, n_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """K and V bytes the kernel copies from HBM for rows of these lengths: every page
    below each row's length, all heads (the rows of a packed page are whole)."""
    rows, lanes = packed_heads(n_kv_heads, head_dim)
    pages = sum(-(-int(n) // page_size) for n in length_R)
    return 2 * pages * rows * page_size * lanes * itemsize


def block_pages(table_width: int, page_size: int, rows: int, lanes: int, itemsize: int) -> int:
    """Pages per block: as many as fit BLOCK_BYTES (K and V, two buffers each), at most 8 and
    the table's width (a power of 2: nothing needs it, but it keeps the blocks even)."""
    per_page = 4 * rows * page_size * lanes * itemsize
    n = max(1, min(8, table_width, BLOCK_BYTES // per_page))
    return 1 << (n.bit_length() - 1)


def scale_shape(rows: int, pages: int, page_size: int, f: int) -> tuple:
    """The TPU layout of an 8-bit pool's scales: [rows, P, f * B], the scales of pool row
    j's f heads on page p in one lane row, head s's B positions in lanes [s*B, (s+1)*B)."""
    return (rows, pages, f * page_size)


# The 8-bit code dtypes the kernel reads: int8, e4m3 (typed, on a TPU), and e4m3 as its
# bytes (uint8: `kvpool.storage_dtype` on CPU, where the interpreter runs the kernel).
CODES = ("int8", "float8_e4m3fn", "uint8")


def check_8bit(dtype) -> None:
    """Refuse, by name, 8-bit codes the kernel cannot read (`CODES`)."""
    name = jnp.dtype(dtype).name
    if name not in CODES:
        raise ValueError(f"the TPU kernel reads 8-bit pools of {CODES[:2]}, got {name}")


pl = pltpu = None   # bound on first use (`_pallas`): the modules are experimental JAX


def _pallas():
    global pl, pltpu
    if pl is None:
        pl, pltpu = compat.pallas_tpu()
    return pl, pltpu


def widen(codes, dtype):
    """8-bit codes as `dtype` (through float32; e4m3 bytes reinterpreted first)."""
    if codes.dtype == jnp.uint8:
        codes = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    return codes.astype(F32).astype(dtype)


def _kernel(len_ref, pt_ref, q_ref, *refs, per_block: int, width: int, n_rows: int,
            groups: int, head_dim: int, precision, quantized: bool, compute):
    """One row (grid step r): its pages block by block, all head rows of the pool.  An
    8-bit pool (`quantized`) also copies each page's scales and dequantizes in VMEM."""
    if quantized:
        (k_hbm, v_hbm, ks_hbm, vs_hbm, o_ref, k_buf, v_buf, ks_buf, vs_buf, sem, slot_ref,
         m_sc, l_sc, acc_sc) = refs
        hbm, bufs = (k_hbm, v_hbm, ks_hbm, vs_hbm), (k_buf, v_buf, ks_buf, vs_buf)
    else:
        k_hbm, v_hbm, o_ref, k_buf, v_buf, sem, slot_ref, m_sc, l_sc, acc_sc = refs
        hbm, bufs = (k_hbm, v_hbm), (k_buf, v_buf)
    r = pl.program_id(0)
    n_heads, _, page, lanes = k_buf.shape[1:]
    f = lanes // head_dim
    bk = per_block * page

    def n_blocks(row):
        # At least one, so that a block started for the next row is always waited for.
        return jnp.maximum(1, (len_ref[row] + bk - 1) // bk)

    def copies(row, block, slot):
        """The DMAs of one block: (live, [K, V (, K scales, V scales)] copies) per page
        slot (K and its scales signal one semaphore, V and its scales the other)."""
        live_pages = (len_ref[row] + page - 1) // page
        out = []
        for j in range(per_block):
            idx = block * per_block + j
            pg = pt_ref[row * width + jnp.minimum(idx, width - 1)]
            out.append((idx < live_pages,
                        [pltpu.make_async_copy(src.at[:, pg], dst.at[slot, :, j],
                                               sem.at[i % 2, slot])
                         for i, (src, dst) in enumerate(zip(hbm, bufs))]))
        return out

    def each_live(row, block, slot, op):
        """`op` on every copy of each live page of a block (pages past the row's length
        are never copied)."""
        for live, cs in copies(row, block, slot):
            @pl.when(live)
            def _():
                for c in cs:
                    op(c)

    def start(row, block, slot):
        each_live(row, block, slot, lambda c: c.start())

    def wait(row, block, slot):
        each_live(row, block, slot, lambda c: c.wait())

    @pl.when(r == 0)
    def _():
        slot_ref[0] = 0
        start(0, 0, 0)

    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, F32)
    l_sc[...] = jnp.zeros(l_sc.shape, F32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, F32)
    length = len_ref[r]
    nb = n_blocks(r)
    first = slot_ref[0]
    n_q = f * groups

    def per_query_row(sc_JSB):
        """Page scales [J, f, bk] -> [J, f*G, bk]: query row i takes head i // G's."""
        row = jax.lax.broadcasted_iota(jnp.int32, (n_heads, n_q, bk), 1)
        out = jnp.zeros((n_heads, n_q, bk), F32)
        for s_ in range(f):
            out = jnp.where(row // groups == s_,
                            jnp.broadcast_to(sc_JSB[:, s_:s_ + 1, :], out.shape), out)
        return out

    def scales(buf, slot):
        """A block's scales as [J, f*G, bk]: the buffer holds [J, pages, f*B] (head s's
        B positions in lanes [s*B, (s+1)*B) of a page's row)."""
        sc = buf[slot]                                               # [J, per_block, f*B]
        sc = pltpu.einshape("jb(st)->js(bt)", sc, s=f)               # [J, f, bk]
        return per_query_row(sc)

    def block_body(i, carry):
        slot = (first + i) % 2
        more = i + 1 < nb

        @pl.when(more)
        def _():
            start(r, i + 1, 1 - slot)

        @pl.when(jnp.logical_not(more) & (r + 1 < n_rows))
        def _():
            start(r + 1, 0, 1 - slot)

        wait(r, i, slot)
        pos_S = i * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        pos_S1 = i * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)

        # All head rows at once: products batched over the rows (one MXU stream each
        # instead of a loop of tiny ones).
        q = q_ref[...]                                               # [J, f*G, lanes]
        k = k_buf[slot].reshape(n_heads, bk, lanes)
        v = v_buf[slot].reshape(n_heads, bk, lanes)
        if quantized:   # codes -> the compute dtype (exact: int8, e4m3 fit bfloat16)
            k, v = widen(k, compute), widen(v, compute)
        v = jnp.where(pos_S1[None] < length, v, jnp.zeros_like(v))
        s = jax.lax.dot_general(q, k, (((2,), (2,)), ((0,), (0,))), precision=precision,
                                preferred_element_type=F32)          # [J, f*G, bk]
        if quantized:   # a position's K scale is a common factor of its scores
            s = s * scales(ks_buf, slot)
        s = jnp.where(pos_S[None] < length, s, MASK)
        m_prev, l_prev = m_sc[...], l_sc[...]                        # [J, f*G, 128]
        m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new[..., :1])
        m_sc[...] = m_new
        l_sc[...] = alpha * l_prev + p.sum(axis=-1, keepdims=True)
        if quantized:   # ... and its V scale of its probability (masked: stale buffers)
            p = p * jnp.where(pos_S[None] < length, scales(vs_buf, slot), 0.0)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((2,), (1,)), ((0,), (0,))),
                                 precision=precision, preferred_element_type=F32)
        acc_sc[...] = alpha[..., :1] * acc_sc[...] + pv
        return carry

    jax.lax.fori_loop(0, nb, block_body, 0)
    slot_ref[0] = (first + nb) % 2

    lane = jax.lax.broadcasted_iota(jnp.int32, (groups, lanes), 1)

    def finish(j, c):
        l = l_sc[j][:, :1]
        o = acc_sc[j] / jnp.where(l > 0, l, 1.0)                      # [f*G, lanes]
        out = jnp.zeros((groups, lanes), F32)
        for s_ in range(f):   # query rows of head s keep head s's lanes
            mine = (lane >= s_ * head_dim) & (lane < (s_ + 1) * head_dim)
            out = jnp.where(mine, o[s_ * groups:(s_ + 1) * groups], out)
        o_ref[j] = out.astype(o_ref.dtype)
        return c

    jax.lax.fori_loop(0, n_heads, finish, 0)


def attend(k_pool, v_pool, q_RQH, pt_RM, length_R, *, n_kv_heads: int,
           ks_pool=None, vs_pool=None, interpret: bool | str = False):
    """Decode attention of one query per row over its pages: q [R, Q, H] (unscaled), pools
    [ceil(K / f), P, B, f * H] (`pack`), page tables [R, M] (global page ids) and lengths
    [R] -> [R, Q * H] in q's dtype.  Scores and softmax in float32; the products take the
    pool's dtype (float32 pools: full float32 precision).

    An int8 pool comes with its scales `ks_pool`, `vs_pool` [ceil(K / f), P, f * B] float32
    (`scale_shape`): the codes are copied as bytes and widened in VMEM to q's dtype (exact),
    the K scales multiply the scores and the V scales the probabilities; the products then
    take q's dtype (float32: full precision).

    `interpret`: False (Mosaic, a TPU), True (Pallas's HLO interpreter: the engine's
    "pallas-tpu-interpret", one XLA program), or "strict" (the TPU interpreter --
    scratch memory starts as NaN, an out-of-bounds copy raises -- but it runs host
    callbacks, which the engine's transfer guard refuses: the kernel tests)."""
    pl_, pltpu_ = _pallas()
    r, n_q, h = q_RQH.shape
    rows, n_pages, page, lanes = k_pool.shape
    f = lanes // h
    if rows * f < n_kv_heads or n_q % n_kv_heads:
        raise ValueError(f"pool rows {k_pool.shape} do not hold {n_kv_heads} kv heads of "
                         f"dim {h} for {n_q} query heads")
    quantized = ks_pool is not None
    dtype = k_pool.dtype
    if quantized:
        check_8bit(dtype)
        if ks_pool.shape != scale_shape(rows, n_pages, page, f):
            raise ValueError(f"scales {ks_pool.shape} do not match the pool {k_pool.shape}")
    elif jnp.dtype(dtype).itemsize == 1:
        raise ValueError(f"an 8-bit pool ({jnp.dtype(dtype).name}) needs its scales")
    g = n_q // n_kv_heads
    width = pt_RM.shape[1]
    # The products' dtype: the pool's, or q's for 8-bit codes (widened in VMEM).
    compute = jnp.dtype(q_RQH.dtype) if quantized else jnp.dtype(dtype)
    # (8-bit pages: blocks sized as pages of q's dtype, the form they are widened to.)
    per_block = block_pages(width, page, rows, lanes, compute.itemsize)
    precision = jax.lax.Precision.HIGHEST if compute.itemsize >= 4 else None

    # Queries scaled in float32, then block-diagonal per pool row: query row s*G + g of row
    # j is query head (j*f + s)*G + g, its H values in lanes [s*H, (s+1)*H).
    q = (q_RQH.astype(F32) * (h ** -0.5)).reshape(r, n_kv_heads, g, h)
    q = jnp.pad(q, ((0, 0), (0, rows * f - n_kv_heads), (0, 0), (0, 0)))
    q = q.reshape(r, rows, f, g, h)
    q = jnp.einsum("rjsgh,st->rjsgth", q, jnp.eye(f, dtype=F32))
    q = q.reshape(r, rows, f * g, lanes).astype(compute)

    kernel = functools.partial(_kernel, per_block=per_block, width=width, n_rows=r,
                               groups=g, head_dim=h, precision=precision,
                               quantized=quantized, compute=compute)
    row_block = lambda b, *_: (b, 0, 0, 0)  # noqa: E731
    pools = (k_pool, v_pool) + ((ks_pool, vs_pool) if quantized else ())
    bufs = [pltpu_.VMEM((2, rows, per_block, page, lanes), dtype)] * 2
    if quantized:
        bufs += [pltpu_.VMEM((2, rows, per_block, f * page), F32)] * 2
    out = pl_.pallas_call(
        kernel,
        grid_spec=pltpu_.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(r,),
            in_specs=[pl_.BlockSpec((None, rows, f * g, lanes), row_block)]
            + [pl_.BlockSpec(memory_space=pl_.ANY)] * len(pools),
            out_specs=pl_.BlockSpec((None, rows, g, lanes), row_block),
            scratch_shapes=[
                *bufs,
                pltpu_.SemaphoreType.DMA((2, 2)),
                pltpu_.SMEM((1,), jnp.int32),
                pltpu_.VMEM((rows, f * g, LANES), F32),
                pltpu_.VMEM((rows, f * g, LANES), F32),
                pltpu_.VMEM((rows, f * g, lanes), F32),
            ]),
        # One step per row, in order: a step starts the next row's first DMA.
        compiler_params=pltpu_.CompilerParams(dimension_semantics=("arbitrary",)),
        out_shape=jax.ShapeDtypeStruct((r, rows, g, lanes), F32),
        interpret=(pltpu_.InterpretParams() if interpret == "strict" else bool(interpret)),
    )(length_R.astype(jnp.int32), pt_RM.astype(jnp.int32).reshape(-1), q, *pools)
    out = out.reshape(r, rows, g, f, h).transpose(0, 1, 3, 2, 4)
    out = out.reshape(r, rows * f, g, h)[:, :n_kv_heads]
    return out.reshape(r, n_q * h).astype(q_RQH.dtype)
