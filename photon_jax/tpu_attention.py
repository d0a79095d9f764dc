"""Decode attention over the paged KV pool on TPU: a Pallas (Mosaic) kernel that reads each
row's pages where they lie, through its page table, and the pool layout it reads.

What this module owns: the TPU pool layout (`pack`: how many kv heads share a pool row), the
packing of heads into and out of that layout (`pack_heads`, `unpack_heads`), and `attend`,
the kernel.  `kvpool` calls `pack_heads` / `unpack_heads` where it writes and gathers, and
`attend` for the "pallas-tpu" decode attention (`step.ATTENTION`).

Why a layout of its own.  A TPU tiles the last two dims of an array by (sublanes, 128
lanes).  The CPU/GPU pool is [K, P, T, H] per layer and arena with H = 64 (Moondream), so a
page's [T, 64] slab fills half the lanes of its tiles.  Measured on a v5e (a deviceless
compile, `bench/tpu_compile.py`): XLA:TPU then lays such an array out with the *page* axis
on the lanes ({1,3,2,0:T(8,128)}), so one page's positions are spread one lane each over
whole tiles -- a page read in place is a strided read of tiles mostly not its own -- and
JAX's Pallas TPU paged-attention kernel refuses the [T, 64] block outright ("last two
dimensions of the block shape divisible by 8 and 128").  Padding H to 128 would double every
byte read.  So the TPU pool puts `pack` = 128 // H kv heads side by side in one row:

    pool[j, p, t, s*H:(s+1)*H] = K (or V) of kv head j*pack + s at position t of page p

an array [ceil(K / pack), P, T, 128] whose natural layout is the row-major tiled one.  A
page of one head pair is a dense [T, 128] slab; a page of all heads is a strided run of
them, read by one DMA.  Nothing is padded when K is a multiple of `pack` (Moondream 2 and
3: 32 kv heads); an odd K (the tiny test models: 1) pads the last row with a zero head.
CPU and GPU keep [K, P, T, H] (`pack` 1).

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

8-bit pools are not supported here yet (the scales' [K, P, T] layout has the same lane
problem); `kvpool` refuses them with this attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import compat
from .dtypes import F32

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


def unpack_heads(x_JXTL, n_kv_heads: int, head_dim: int):
    """Gathered pages of the TPU layout [J, X..., T, f * H] -> [K, X..., T, H]."""
    j, *mid, lanes = x_JXTL.shape
    f = lanes // head_dim
    x = x_JXTL.reshape(j, *mid, f, head_dim)
    x = jnp.moveaxis(x, -2, 1)                                   # [J, f, X..., T, H]
    return x.reshape(j * f, *mid, head_dim)[:n_kv_heads]


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


pl = pltpu = None   # bound on first use (`_pallas`): the modules are experimental JAX


def _pallas():
    global pl, pltpu
    if pl is None:
        pl, pltpu = compat.pallas_tpu()
    return pl, pltpu


def _kernel(len_ref, pt_ref, q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sem, slot_ref,
            m_sc, l_sc, acc_sc, *, per_block: int, width: int, n_rows: int, groups: int,
            head_dim: int, precision):
    """One row (grid step r): its pages block by block, all head rows of the pool."""
    r = pl.program_id(0)
    n_heads, _, page, lanes = k_buf.shape[1:]
    f = lanes // head_dim
    bk = per_block * page

    def n_blocks(row):
        # At least one, so that a block started for the next row is always waited for.
        return jnp.maximum(1, (len_ref[row] + bk - 1) // bk)

    def copies(row, block, slot):
        """The DMAs of one block: (live, K copy, V copy) per page slot."""
        live_pages = (len_ref[row] + page - 1) // page
        out = []
        for j in range(per_block):
            idx = block * per_block + j
            pg = pt_ref[row * width + jnp.minimum(idx, width - 1)]
            out.append((idx < live_pages,
                        pltpu.make_async_copy(k_hbm.at[:, pg], k_buf.at[slot, :, j],
                                              sem.at[0, slot]),
                        pltpu.make_async_copy(v_hbm.at[:, pg], v_buf.at[slot, :, j],
                                              sem.at[1, slot])))
        return out

    def each_live(row, block, slot, op):
        """`op` on the K and V copy of each live page of a block (pages past the row's
        length are never copied)."""
        for live, ck, cv in copies(row, block, slot):
            @pl.when(live)
            def _():
                op(ck)
                op(cv)

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
        v = jnp.where(pos_S1[None] < length, v, jnp.zeros_like(v))
        s = jax.lax.dot_general(q, k, (((2,), (2,)), ((0,), (0,))), precision=precision,
                                preferred_element_type=F32)          # [J, f*G, bk]
        s = jnp.where(pos_S[None] < length, s, MASK)
        m_prev, l_prev = m_sc[...], l_sc[...]                        # [J, f*G, 128]
        m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new[..., :1])
        m_sc[...] = m_new
        l_sc[...] = alpha * l_prev + p.sum(axis=-1, keepdims=True)
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
           interpret: bool | str = False):
    """Decode attention of one query per row over its pages: q [R, Q, H] (unscaled), pools
    [ceil(K / f), P, T, f * H] (`pack`), page tables [R, M] (global page ids) and lengths
    [R] -> [R, Q * H] in q's dtype.  Scores and softmax in float32; the products take the
    pool's dtype (float32 pools: full float32 precision).

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
    g = n_q // n_kv_heads
    width = pt_RM.shape[1]
    dtype = k_pool.dtype
    itemsize = jnp.dtype(dtype).itemsize
    per_block = block_pages(width, page, rows, lanes, itemsize)
    precision = jax.lax.Precision.HIGHEST if itemsize >= 4 else None

    # Queries scaled in float32, then block-diagonal per pool row: query row s*G + g of row
    # j is query head (j*f + s)*G + g, its H values in lanes [s*H, (s+1)*H).
    q = (q_RQH.astype(F32) * (h ** -0.5)).reshape(r, n_kv_heads, g, h)
    q = jnp.pad(q, ((0, 0), (0, rows * f - n_kv_heads), (0, 0), (0, 0)))
    q = q.reshape(r, rows, f, g, h)
    q = jnp.einsum("rjsgh,st->rjsgth", q, jnp.eye(f, dtype=F32))
    q = q.reshape(r, rows, f * g, lanes).astype(dtype)

    kernel = functools.partial(_kernel, per_block=per_block, width=width, n_rows=r,
                               groups=g, head_dim=h, precision=precision)
    row_block = lambda b, *_: (b, 0, 0, 0)  # noqa: E731
    out = pl_.pallas_call(
        kernel,
        grid_spec=pltpu_.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(r,),
            in_specs=[pl_.BlockSpec((None, rows, f * g, lanes), row_block),
                      pl_.BlockSpec(memory_space=pl_.ANY),
                      pl_.BlockSpec(memory_space=pl_.ANY)],
            out_specs=pl_.BlockSpec((None, rows, g, lanes), row_block),
            scratch_shapes=[
                pltpu_.VMEM((2, rows, per_block, page, lanes), dtype),
                pltpu_.VMEM((2, rows, per_block, page, lanes), dtype),
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
    )(length_R.astype(jnp.int32), pt_RM.astype(jnp.int32).reshape(-1), q, k_pool, v_pool)
    out = out.reshape(r, rows, g, f, h).transpose(0, 1, 3, 2, 4)
    out = out.reshape(r, rows * f, g, h)[:, :n_kv_heads]
    return out.reshape(r, n_q * h).astype(q_RQH.dtype)
