"""The paged KV pool on the device: its layout, the writes into it, and the attention that
reads it where it lies.  (Which page belongs to whom is host bookkeeping: `pages.py`.)

Layout.  K and V are kept per layer and per *arena*: `pool.k[l][a]` is one array
[K, Pa, T, H] (kv heads, pages of the arena, positions in a page, head dim).  A page holds
`T` consecutive positions of one sequence, page j of a sequence its positions
[j*T, (j+1)*T).  Global page id g lives in arena g // Pa at index g % Pa.  Page 0 is never
handed out: padding rows and padding positions write there, so they corrupt nothing.

Why per-layer arrays, and arenas.  On XLA:CPU any slice of a bigger array that feeds a dot is
copied out first, dynamic or static: a scan over stacked layers copied every layer's weights
and KV in every step (3x the bytes, measured).  So the serving programs unroll the layers over
per-layer arrays, and a decode step reads whole arrays only.  The kernels (`cpukernel` on CPU,
JAX's Pallas paged attention on GPU) read one arena through each row's page table up to its
length; arenas matter only to the XLA sweep, which then takes only the arenas below the
highest page any of its rows uses (pages are handed out lowest-first), so it reads the pool
up to its live high-water mark, not the whole pool.

Decode attention, XLA sweep (`decode_attend`, the fallback without a C++ compiler): every
page of the swept arenas is scored against its owner row's query in one batched matmul (K
pages) and one for V -- each KV element read once, in place -- giving per-page partials
(max, sum, weighted V).  The partials of a row are then gathered in the row's *logical* page
order and combined (the flash-decoding rescale), so a row's result depends on its own pages
only.  Pages of the swept arenas that no row of the step owns are read and masked, and each
page has one owner row (no shared pages).

Prefill attention gathers the rows' pages into a contiguous [R, S, K, H] view (prefill is
compute-bound; the gather is small next to it) and runs the ordinary masked attention, so
prefill numerics are exactly the one-request path's.

Shapes use the axis letters of docs/architecture.md (in the repository); P pages, T positions in a page, M pages
in a row's page table.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from . import compat, cpukernel
from .config import TextConfig
from .dtypes import F32, jnp_dtype, matmul_precision
from .layers import attention


@flax.struct.dataclass
class KVPool:
    """k[l][a], v[l][a]: [K, Pa, T, H] arrays, per layer l and arena a (arenas may differ in
    size: `meta.Arenas`)."""
    k: tuple
    v: tuple

    @property
    def n_arenas(self) -> int:
        return len(self.k[0])

    @property
    def page_size(self) -> int:
        return self.k[0][0].shape[2]

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in jax.tree.leaves(self)))

    def arenas(self, n: int) -> "KVPool":
        """The first n arenas of every layer (what a decode step reads and writes)."""
        return KVPool(tuple(k[:n] for k in self.k), tuple(v[:n] for v in self.v))

    def merge(self, part: "KVPool") -> "KVPool":
        """Put back the arenas a program returned (the first len(part) of each layer)."""
        n = part.n_arenas
        return KVPool(tuple(p + k[n:] for p, k in zip(part.k, self.k)),
                      tuple(p + v[n:] for p, v in zip(part.v, self.v)))


def arena_shape(cfg: TextConfig, pages: int, page_size: int):
    return (cfg.n_kv_heads, pages, page_size, cfg.head_dim)


def abstract_pool(cfg: TextConfig, arena_sizes: tuple, page_size: int, dtype) -> KVPool:
    dt = jnp_dtype(dtype)
    layer = tuple(jax.ShapeDtypeStruct(arena_shape(cfg, n, page_size), dt)
                  for n in arena_sizes)
    return KVPool(tuple(layer for _ in range(cfg.n_layers)),
                  tuple(layer for _ in range(cfg.n_layers)))


def init_pool(cfg: TextConfig, arena_sizes: tuple, page_size: int, dtype) -> KVPool:
    dt = jnp_dtype(dtype)

    def layer():
        return tuple(jnp.zeros(arena_shape(cfg, n, page_size), dt) for n in arena_sizes)

    return KVPool(tuple(layer() for _ in range(cfg.n_layers)),
                  tuple(layer() for _ in range(cfg.n_layers)))


def pool_bytes(cfg: TextConfig, n_pages: int, page_size: int, dtype) -> int:
    return 2 * cfg.n_layers * n_pages * page_size * cfg.n_kv_heads * cfg.head_dim * \
        jnp_dtype(dtype).itemsize


# -- writes and gathers over the arenas of one layer ---------------------------------------

def _spans(arenas: tuple):
    """(first global page, page count) of each arena, from the arrays' static shapes."""
    start, out = 0, []
    for a in arenas:
        out.append((start, a.shape[1]))
        start += a.shape[1]
    return out


def _local(start: int, size: int, page_X):
    """Global page ids -> indices into the arena at [start, start + size); pages of other
    arenas -> size (out of bounds: a write there is dropped, a gather is masked)."""
    loc = page_X - start
    return jnp.where((loc >= 0) & (loc < size), loc, size)


def write_tokens(arenas: tuple, page_X, off_X, x_XKH) -> tuple:
    """Write one [K, H] vector per index of X (any shape) at (page, offset): in place under
    donation.  Each arena takes the writes of its own pages."""
    upd = jnp.moveaxis(x_XKH, -2, 0)                      # [K, X..., H]
    return tuple(a.at[:, _local(st, n, page_X), off_X, :].set(upd.astype(a.dtype),
                                                               mode="drop")
                 for a, (st, n) in zip(arenas, _spans(arenas)))


def write_rows(arenas_k: tuple, arenas_v: tuple, page_R, off_R, k_RKH, v_RKH):
    """One position per row (a decode step): a loop over the rows (a static trip count)
    whose body updates, in place, the one slice of each arena that row writes, kept only in
    the arena that holds its page.  (A scatter does the same work, but XLA's cost analysis
    charges a scatter its whole operand, read and written, and unrolled slice updates cost
    minutes of compilation at 32 rows: this keeps the step's bytes-accessed figure true.)"""
    spans = _spans(arenas_k)

    def one(a, x, r, st, n):
        loc = page_R[r] - st
        start = (0, jnp.clip(loc, 0, n - 1), off_R[r], 0)
        old = jax.lax.dynamic_slice(a, start, (a.shape[0], 1, 1, a.shape[3]))
        new = jax.lax.dynamic_index_in_dim(x, r, 0, keepdims=False)
        new = new.astype(a.dtype)[:, None, None, :]
        return jax.lax.dynamic_update_slice(a, jnp.where((loc >= 0) & (loc < n), new, old),
                                            start)

    def body(r, kv):
        ks, vs = kv
        return (tuple(one(a, k_RKH, r, st, n) for a, (st, n) in zip(ks, spans)),
                tuple(one(a, v_RKH, r, st, n) for a, (st, n) in zip(vs, spans)))

    return jax.lax.fori_loop(0, k_RKH.shape[0], body, (tuple(arenas_k), tuple(arenas_v)))


def gather_pages(arenas: tuple, page_X):
    """[K, X..., T, H]: whole pages, by global id, from whichever arena holds each."""
    out = None
    for a, (st, n) in zip(arenas, _spans(arenas)):
        loc = _local(st, n, page_X)
        g = a[:, jnp.minimum(loc, n - 1)]
        ok = (loc < n)[None, ..., None, None]
        out = g if out is None else jnp.where(ok, g, out)
    return out


def write_pages(arenas: tuple, page_N, blocks_KNTH) -> tuple:
    """Overwrite whole pages (page-granular copies: the prefix cache)."""
    return tuple(a.at[:, _local(st, n, page_N)].set(blocks_KNTH.astype(a.dtype), mode="drop")
                 for a, (st, n) in zip(arenas, _spans(arenas)))


# -- attention ------------------------------------------------------------------------------

def prefill_attend(arenas_k: tuple, arenas_v: tuple, q_RTQH, pt_RM, mask_RTS):
    """Prompt queries against their rows' pages (gathered contiguous), masked by positions."""
    r, m = pt_RM.shape
    kv_len = m * arenas_k[0].shape[2]

    def view(arenas):   # [K, R, M, T, H] -> [R, S, K, H]
        g = gather_pages(arenas, pt_RM)
        return g.transpose(1, 2, 3, 0, 4).reshape(r, kv_len, g.shape[0], g.shape[-1])

    k, v = view(arenas_k), view(arenas_v)
    return attention(q_RTQH, k.astype(q_RTQH.dtype), v.astype(q_RTQH.dtype), mask_RTS)


def page_partials(q_RKGH, k_KPTH, v_KPTH, owner_P, count_P):
    """Per page of one arena: (max [K, P, G], sum [K, P, G], weighted V [K, P, G, H]) of its
    owner row's attention over its first count_P positions (count 0: an empty partial)."""
    qz = jnp.concatenate([q_RKGH, jnp.zeros_like(q_RKGH[:1])])   # row R: no owner
    q_KPGH = qz[owner_P].transpose(1, 0, 2, 3)
    s = jnp.einsum("kpgh,kpth->kpgt", q_KPGH.astype(k_KPTH.dtype), k_KPTH,
                   preferred_element_type=F32) * (q_RKGH.shape[-1] ** -0.5)
    valid = jnp.arange(k_KPTH.shape[2])[None, None, None, :] < count_P[None, :, None, None]
    s = jnp.where(valid, s, -jnp.inf)
    m = s.max(-1)
    e = jnp.where(valid, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), 0.0)
    o = jnp.einsum("kpgt,kpth->kpgh", e.astype(v_KPTH.dtype), v_KPTH,
                   preferred_element_type=F32)
    return m, e.sum(-1), o


def combine_partials(m_KPG, l_KPG, o_KPGH, pt_RM):
    """A row's attention from its pages' partials, taken in the row's logical page order
    (pt_RM: global page ids, padded with P = an empty partial)."""
    k, _, g = m_KPG.shape
    m_KPG = jnp.concatenate([m_KPG, jnp.full((k, 1, g), -jnp.inf, F32)], 1)
    l_KPG = jnp.concatenate([l_KPG, jnp.zeros((k, 1, g), F32)], 1)
    o_KPGH = jnp.concatenate([o_KPGH, jnp.zeros((k, 1, *o_KPGH.shape[2:]), F32)], 1)
    m = m_KPG[:, pt_RM]                                   # [K, R, M, G]
    top = m.max(2)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(m - top[:, :, None])
    den = (w * l_KPG[:, pt_RM]).sum(2)                    # [K, R, G]
    num = (w[..., None] * o_KPGH[:, pt_RM]).sum(2)        # [K, R, G, H]
    out = num / jnp.where(den > 0, den, 1.0)[..., None]
    return out.transpose(1, 0, 2, 3)                      # [R, K, G, H]


def decode_attend(arenas_k: tuple, arenas_v: tuple, q_RQH, owner_P, count_P, pt_RM):
    """One query per row against its pages, every swept page read once in place.
    owner_P / count_P cover the pages of the given arenas in global order."""
    r, n, h = q_RQH.shape
    kh = arenas_k[0].shape[0]
    q = q_RQH.reshape(r, kh, n // kh, h).astype(F32)
    parts = [page_partials(q, kt, vt, owner_P[st:st + size], count_P[st:st + size])
             for kt, vt, (st, size) in zip(arenas_k, arenas_v, _spans(arenas_k))]
    m, l, o = (jnp.concatenate(x, axis=1) for x in zip(*parts))
    return combine_partials(m, l, o, pt_RM).reshape(r, n * h).astype(q_RQH.dtype)


def kernel_attend(arenas_k: tuple, arenas_v: tuple, q_RQH, pt_RM, length_R, *,
                  interpret: bool = False):
    """The same attention by JAX's Pallas GPU paged-attention kernel, which walks each row's
    page table up to its length (one arena: global page ids are its indices)."""
    paged_attention = compat.pallas_gpu_paged_attention()
    if len(arenas_k) != 1:
        raise ValueError("the paged-attention kernel reads a single-arena pool")
    dtype = arenas_k[0].dtype
    k_splits, per_block = kernel_blocks(pt_RM.shape[1], arenas_k[0].shape[2],
                                        kernel_max_positions(dtype, arenas_k[0].shape[3]))
    q = (q_RQH.astype(F32) * (q_RQH.shape[-1] ** -0.5)).astype(dtype)
    # The kernel's products take the default matmul precision, which on GPU multiplies
    # float32 in TF32 (10-bit mantissas); a float32 model's products are HIGHEST everywhere
    # else (`dtypes.matmul_precision`), so its attention is too.
    with jax.default_matmul_precision(matmul_precision(dtype).name.lower()):
        out = paged_attention(q, arenas_k[0], arenas_v[0], pt_RM, length_R,
                              k_splits=k_splits, pages_per_compute_block=per_block,
                              interpret=interpret)
    return out.reshape(q_RQH.shape[0], -1).astype(q_RQH.dtype)


def kernel_max_positions(dtype, head_dim: int) -> int:
    """The most positions one step of the Pallas kernel may load (pages_per_compute_block x
    page_size).  Its K and V tiles live in shared memory: compiled for an H200
    (`bench/gpu_compile.py`, head dim 64), float32 tiles of 256 positions ask for 260 KiB
    of the 227 KiB a block may have, bfloat16 ones fit up to 512 positions.  bfloat16 keeps
    256, the largest block JAX's own GPU tests of the kernel run.  Scaled for other head
    dims (the tiles grow with it)."""
    base = 128 if jnp.dtype(dtype).itemsize >= 4 else 256
    n = max(1, base * 64 // head_dim)
    return 1 << (n.bit_length() - 1)   # a power of 2, as the lowering needs


def kernel_blocks(m: int, page_size: int, max_positions: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) of the Pallas kernel for page tables of width m:
    the table splits into k_splits partitions (as many as divide m, up to 16: parallelism
    at small batches), each walked `pages_per_compute_block` pages at a time.  That block
    count must be a power of 2 (Pallas's Triton lowering takes only power-of-2 arrays: a
    table width like 25 -- max_context 800 in pages of 32 -- gave blocks of 5, which lowers
    in the interpreter but not for a GPU) that divides the partition, up to 8 pages and
    `max_positions` positions (`kernel_max_positions`; a page larger than that is refused
    by the engine)."""
    k_splits = max(d for d in range(1, min(m, 16) + 1) if m % d == 0)
    part = m // k_splits
    cap = max(1, min(8, max_positions // page_size))
    per_block = 1
    while 2 * per_block <= cap and part % (2 * per_block) == 0:
        per_block *= 2
    return k_splits, per_block


# -- the access objects text.forward writes and attends through --------------------------

@flax.struct.dataclass
class PrefillAccess:
    """Prompt rows writing at (page, offset) per position and attending their page tables."""
    page_RT: jax.Array
    off_RT: jax.Array
    pt_RM: jax.Array
    prefix_R: jax.Array

    def update(self, pool: KVPool, li: int, q, k, v, pos_RT):
        ks = write_tokens(pool.k[li], self.page_RT, self.off_RT, k)
        vs = write_tokens(pool.v[li], self.page_RT, self.off_RT, v)
        kv_len = self.pt_RM.shape[1] * ks[0].shape[2]
        mask = attention_mask(pos_RT, self.prefix_R, kv_len)
        return _replace_layer(pool, li, ks, vs), prefill_attend(ks, vs, q, self.pt_RM, mask)


@flax.struct.dataclass
class DecodeAccess:
    """One new position per row; attention over the pages of the arenas given, by `attend`
    (`step.ATTENTION`): "xla" (the sweep, any backend), "cpu-kernel" (`cpukernel`:
    XLA:CPU), "pallas" (JAX's Pallas GPU kernel) or "pallas-interpret" (the same run on CPU:
    tests).  The kernels read one arena through the rows' page tables and lengths; the sweep
    reads every page of the arenas given, with owner_P / count_P."""
    page_R: jax.Array
    off_R: jax.Array
    owner_P: jax.Array
    count_P: jax.Array
    pt_RM: jax.Array
    length_R: jax.Array
    attend: str = flax.struct.field(pytree_node=False, default="xla")

    def update(self, pool: KVPool, li: int, q, k, v, pos_RT):
        if self.attend.startswith("pallas"):   # GPU: one scatter per arena (one kernel)
            ks = write_tokens(pool.k[li], self.page_R, self.off_R, k[:, 0])
            vs = write_tokens(pool.v[li], self.page_R, self.off_R, v[:, 0])
        else:
            ks, vs = write_rows(pool.k[li], pool.v[li], self.page_R, self.off_R, k[:, 0],
                                v[:, 0])
        if self.attend == "xla":
            a = decode_attend(ks, vs, q[:, 0], self.owner_P, self.count_P, self.pt_RM)
        elif self.attend == "cpu-kernel":
            if len(ks) != 1:
                raise ValueError("the CPU paged-attention kernel reads a single-arena pool")
            a = cpukernel.attend(ks[0], vs[0], q[:, 0], self.pt_RM, self.length_R)
            a = a.reshape(a.shape[0], -1)
        else:
            a = kernel_attend(ks, vs, q[:, 0], self.pt_RM, self.length_R,
                              interpret=self.attend == "pallas-interpret")
        return _replace_layer(pool, li, ks, vs), a[:, None]


def _replace_layer(pool: KVPool, li: int, ks: tuple, vs: tuple) -> KVPool:
    return KVPool(pool.k[:li] + (ks,) + pool.k[li + 1:], pool.v[:li] + (vs,) + pool.v[li + 1:])


def attention_mask(pos_RT, prefix_R, kv_len: int):
    """[R, T, S]: key j is visible from query position p if j <= p, or if both lie inside the
    row's bidirectional prefix (BOS + image; 0 for text-only rows)."""
    j = jnp.arange(kv_len)[None, None, :]
    p = pos_RT[:, :, None]
    pre = prefix_R[:, None, None]
    return (j <= p) | ((j < pre) & (p < pre))

