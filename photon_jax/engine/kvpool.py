"""The paged KV pool on the device: its layout, the writes into it, and the attention that
reads it where it lies.  (Which page belongs to whom is host bookkeeping: `pages.py`.)

Layout.  K and V are kept per layer and per *arena*: `pool.k[l][a]` is one array
[K, Pa, B, H] (kv heads, pages of the arena, positions in a page, head dim).  A page holds
`B` consecutive positions of one sequence, page j of a sequence its positions
[j*B, (j+1)*B).  Global page id g lives in arena g // Pa at index g % Pa.  Page 0 is never
handed out: padding rows and padding positions write there, so they corrupt nothing.

Why per-layer arrays, and arenas.  On XLA:CPU any slice of a bigger array that feeds a dot is
copied out first, dynamic or static: a scan over stacked layers copied every layer's weights
and KV in every step (3x the bytes, measured).  So the serving programs unroll the layers over
per-layer arrays, and a decode step reads whole arrays only.  The kernels (`cpukernel` on
CPU, our Pallas kernel `gpu_attention` on GPU) read one arena through each row's page table
up to its length; arenas matter only to the XLA sweep, which then takes only the arenas below the
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

8-bit pools (`kv_dtype` "int8" / "float8_e4m3fn"; default: the model's dtype, unquantized).
K and V are stored as 8-bit codes with one float32 scale per (kv head, position): `ks[l][a]`
/ `vs[l][a]` of shape [K, Pa, B] beside the [K, Pa, B, H] codes (the layout JAX's Pallas
kernel took as `k_scales_pages` / `v_scales_pages`; `gpu_attention` reads the same).  The
scale is the absmax of that head's H-vector over the format's largest value (127, or 448
for e4m3), so the vector's largest element is represented exactly and the rest to the format's resolution.  Why per
position and not per page: positions are written one at a time as a page fills (decode
appends one per step), so a per-page scale would have to grow -- and the page be
requantized -- whenever a later position is larger, compounding rounding on values already
stored; a per-position scale is computed once, at the write, and never touched again (a
page of the prefix cache is quantized once, when written, and shared or copied as bytes
with its scales).  The cost: 4 bytes per (head, position) next to H code bytes (6% at
H = 64).  Every write quantizes (`quantize`); every attention dequantizes where it reads:
the sweep and the kernels fold the scales into the scores (K) and the probabilities (V),
prefill multiplies the gathered codes by their scales.  e4m3 codes are stored as their
bytes (uint8) on CPU, typed float8 elsewhere (`storage_dtype`: XLA:CPU emulates float8 by
converting whole operands).

TPU layout (`pack` > 1, the "pallas-tpu" attention).  A TPU tiles the last two dims of an
array by (sublanes, 128 lanes), and a [K, P, B, 64] pool fits its tiles badly (see
`tpu_attention`), so the pool that attention reads puts `pack` = 128 // H kv heads side by
side: [ceil(K / pack), P, B, pack * H], head j*pack + s in lanes [s*H, (s+1)*H) of row j.
The writes pack the heads (`tpu_attention.pack_heads`), the prefill gather unpacks them,
and page copies move whole rows either way.  An 8-bit pool's scales are [ceil(K / pack),
P, pack * B] there, head j*pack + s of position t at [j, p, s*B + t]
(`tpu_attention.scale_shape`, `write_pages_merged`).  The layout follows the attention
(`platforms.Platform.pack`), not the platform, so the Pallas interpreter runs it on CPU in the
tests.

Shapes use the axis letters of docs/architecture.md (in the repository); P pages, B positions in a page, M pages
in a row's page table.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from ..base.dtypes import F32, jnp_dtype
from ..kernels import cpukernel, gpu_attention, tpu_attention
from ..model.config import TextConfig
from ..model.layers import attention, attention_mask


# 8-bit formats of the pool and the largest magnitude each represents.
QUANTIZED = {"int8": 127.0, "float8_e4m3fn": 448.0}
KV_DTYPES = (None, *QUANTIZED)
_KV_ALIASES = {"fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "float8": "float8_e4m3fn",
               "s8": "int8"}


def canonical_kv_dtype(kv_dtype, model_dtype=None):
    """None (unquantized: the model's dtype), "int8" or "float8_e4m3fn"; the model's own
    dtype name means None.  Anything else is refused, naming the argument and the choices."""
    if kv_dtype is None:
        return None
    try:
        name = kv_dtype if isinstance(kv_dtype, str) else jnp.dtype(kv_dtype).name
    except TypeError:
        name = repr(kv_dtype)
    name = _KV_ALIASES.get(name.lower(), name.lower())
    if name in QUANTIZED:
        return name
    if model_dtype is not None and name in ("float32", "bfloat16", "f32", "bf16", "fp32") and \
            jnp_dtype(name) == jnp_dtype(model_dtype):
        return None
    raise ValueError(f"kv_dtype must be one of None (the model's dtype), 'int8' or "
                     f"'float8_e4m3fn', got {kv_dtype!r}")


# How an 8-bit pool stores its codes.  e4m3 codes live as their bytes (uint8) on CPU: XLA:CPU
# emulates float8 by converting every float8 operand to float16 first, so an in-place write
# of one position or a gather of a few pages converted the whole arena (measured: a batch-32
# decode step of the small config went from 40 ms to minutes).  On GPU the pool is typed
# float8_e4m3fn, which the GPU kernel reads as such.  int8 is int8 everywhere.
_BYTES = jnp.dtype(jnp.uint8)


# Backends whose pools keep e4m3 codes as bytes (see above).
_FP8_AS_BYTES = frozenset({"cpu"})


# bfloat16 pools live as their bits (uint16) on CPU, for the same reason: XLA:CPU has no
# 16-bit float scatter or slice update and widens the whole operand to float32 and back
# around each one, so every write of a position rewrote its arena (measured at full
# Moondream 2 size: 0.2-0.4 s a write per arena of 90-500 MB; a 730-position prefix write
# took twice the pool in temporaries, and a decode step's writes more than its products).
# As uint16 the same writes are in place (0.05-1.3 ms); reads take the bits back as
# bfloat16 (`as_format`), and the CPU kernel reads them as it reads bfloat16.
_BF16_BITS = jnp.dtype(jnp.uint16)
_BF16_AS_BITS = frozenset({"cpu"})


def storage_dtype(fmt: str, platform: str | None = None):
    """The pool's array dtype for 8-bit format `fmt` on `platform` (None: JAX's default)."""
    platform = platform or jax.default_backend()
    if fmt == "float8_e4m3fn" and platform in _FP8_AS_BYTES:
        return _BYTES
    return jnp.dtype(fmt)


def format_of(dtype) -> str:
    """The 8-bit format of a pool array's dtype (uint8: e4m3 bytes)."""
    dtype = jnp.dtype(dtype)
    return "int8" if dtype == jnp.int8 else "float8_e4m3fn"


def as_format(codes):
    """Codes as their format's dtype (e4m3 bytes and bfloat16 bits reinterpreted; anything
    else as is)."""
    if codes.dtype == _BYTES:
        return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    if codes.dtype == _BF16_BITS:
        return jax.lax.bitcast_convert_type(codes, jnp.bfloat16)
    return codes


def as_storage(codes, dtype):
    """Codes as a pool of `dtype` stores them (e4m3 -> its bytes for a uint8 pool,
    bfloat16 -> its bits for a uint16 one)."""
    if jnp.dtype(dtype) == _BYTES and codes.dtype != _BYTES:
        return jax.lax.bitcast_convert_type(codes.astype(jnp.float8_e4m3fn), _BYTES)
    if jnp.dtype(dtype) == _BF16_BITS and codes.dtype != _BF16_BITS:
        return jax.lax.bitcast_convert_type(codes.astype(jnp.bfloat16), _BF16_BITS)
    return codes.astype(dtype)


def quantize(x, fmt: str):
    """(codes, scale): x [..., H] as 8-bit codes of `fmt` and float32 scales [...] with
    codes * scale ~ x; scale = absmax(x) / the format's max (1 for an all-zero vector)."""
    top = QUANTIZED[fmt]
    x = x.astype(F32)
    scale = jnp.max(jnp.abs(x), axis=-1) / top
    scale = jnp.where(scale > 0, scale, 1.0)
    y = jnp.clip(x / scale[..., None], -top, top)
    if fmt == "int8":
        y = jnp.round(y)
    return y.astype(jnp.dtype(fmt)), scale


def dequantize(codes, scale):
    """float32 codes * scale (scale [...] for codes [..., H]; codes in any storage)."""
    return as_format(codes).astype(F32) * scale[..., None]


@flax.struct.dataclass
class KVPool:
    """k[l][a], v[l][a]: [K, Pa, B, H] arrays, per layer l and arena a (arenas may differ in
    size: `stepmeta.Arenas`).  8-bit pools also hold ks[l][a], vs[l][a]: [K, Pa, B] float32
    scales (empty tuples when unquantized)."""
    k: tuple
    v: tuple
    ks: tuple = ()
    vs: tuple = ()

    @property
    def quantized(self) -> bool:
        return len(self.ks) > 0

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
        return KVPool(*(tuple(x[:n] for x in part) for part in self._parts()))

    def _parts(self):
        return (self.k, self.v, self.ks, self.vs) if self.quantized else (self.k, self.v)

    def merge(self, part: "KVPool") -> "KVPool":
        """Put back the arenas a program returned (the first len(part) of each layer)."""
        n = part.n_arenas
        return KVPool(*(tuple(p + x[n:] for p, x in zip(new, old))
                        for new, old in zip(part._parts(), self._parts())))

    def layer(self, li: int):
        """(k, v, ks, vs) arenas of layer li (ks, vs None when unquantized)."""
        if self.quantized:
            return self.k[li], self.v[li], self.ks[li], self.vs[li]
        return self.k[li], self.v[li], None, None


def arena_shape(cfg: TextConfig, pages: int, page_size: int, pack: int = 1):
    if pack > 1:
        rows, lanes = tpu_attention.packed_heads(cfg.n_kv_heads, cfg.head_dim)
        return (rows, pages, page_size, lanes)
    return (cfg.n_kv_heads, pages, page_size, cfg.head_dim)


def _pool_dtype(dtype, platform=None):
    if dtype in QUANTIZED:
        return storage_dtype(dtype, platform)
    dt = jnp_dtype(dtype)
    if dt == jnp.bfloat16 and (platform or jax.default_backend()) in _BF16_AS_BITS:
        return _BF16_BITS
    return dt


def abstract_pool(cfg: TextConfig, arena_sizes: tuple, page_size: int, dtype,
                  platform: str | None = None, pack: int = 1) -> KVPool:
    """`dtype`: the model's dtype (unquantized) or an 8-bit format of `QUANTIZED`."""
    return jax.eval_shape(lambda: init_pool(cfg, arena_sizes, page_size, dtype, platform,
                                            pack))


def init_pool(cfg: TextConfig, arena_sizes: tuple, page_size: int, dtype,
              platform: str | None = None, pack: int = 1) -> KVPool:
    """Zeroed pool; `dtype` an 8-bit format of `QUANTIZED` adds the scale arrays (ones),
    its codes stored as `storage_dtype` gives for `platform` (None: JAX's default).
    `pack` > 1: the TPU layout (`platforms.Platform.pack`), its scales [rows, Pa, pack * B]
    (`tpu_attention.scale_shape`)."""
    dt = _pool_dtype(dtype, platform)

    def layer():
        return tuple(jnp.zeros(arena_shape(cfg, n, page_size, pack), dt) for n in arena_sizes)

    def scale_shape(n):
        if pack > 1:
            rows, lanes = tpu_attention.packed_heads(cfg.n_kv_heads, cfg.head_dim)
            return tpu_attention.scale_shape(rows, n, page_size, lanes // cfg.head_dim)
        return arena_shape(cfg, n, page_size)[:3]

    def scales():
        return tuple(jnp.ones(scale_shape(n), F32) for n in arena_sizes)

    parts = [tuple(layer() for _ in range(cfg.n_layers)),
             tuple(layer() for _ in range(cfg.n_layers))]
    if dtype in QUANTIZED:
        parts += [tuple(scales() for _ in range(cfg.n_layers)),
                  tuple(scales() for _ in range(cfg.n_layers))]
    return KVPool(*parts)


def position_bytes(cfg: TextConfig, dtype, pack: int = 1) -> int:
    """Bytes of one position's K and V over every layer (an 8-bit pool: codes + scales);
    `pack` > 1: the TPU layout, whose rows hold `pack` heads (an odd head count pads one)."""
    heads = cfg.n_kv_heads
    if pack > 1:
        rows, lanes = tpu_attention.packed_heads(cfg.n_kv_heads, cfg.head_dim)
        heads = rows * (lanes // cfg.head_dim)
    per_head = cfg.head_dim * _pool_dtype(dtype).itemsize + (4 if dtype in QUANTIZED else 0)
    return 2 * cfg.n_layers * heads * per_head


def pool_bytes(cfg: TextConfig, n_pages: int, page_size: int, dtype) -> int:
    return n_pages * page_size * position_bytes(cfg, dtype)


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
    donation.  Each arena takes the writes of its own pages.  (Also writes scales: arenas
    [K, Pa, B] and x [X..., K].)"""
    head_axis = -2 if arenas[0].ndim == 4 else -1
    if arenas[0].ndim == 4 and arenas[0].shape[-1] != x_XKH.shape[-1]:   # the TPU layout
        x_XKH = tpu_attention.pack_heads(x_XKH, arenas[0].shape[-1])
    upd = jnp.moveaxis(x_XKH, head_axis, 0)               # [K, X..., H]
    return tuple(a.at[:, _local(st, n, page_X), off_X].set(as_storage(upd, a.dtype), mode="drop")
                 for a, (st, n) in zip(arenas, _spans(arenas)))


def write_tokens_q(arenas: tuple, scales, page_X, off_X, x_XKH, max_pages: int | None = None):
    """`write_tokens` into an 8-bit pool: (arenas, scales), the vectors quantized here, once
    (`quantize`).  `scales` None: an unquantized pool, (arenas, None).

    The TPU layout is written page by page (`write_pages_merged`) when the pool is 8-bit or
    `max_pages` is given (prefill and prefix writes, where it bounds the distinct pages
    the positions fall in; None: one per position)."""
    lanes, page_size = arenas[0].shape[-1], arenas[0].shape[2]
    packed = lanes != x_XKH.shape[-1]   # the TPU layout
    if not packed or (scales is None and max_pages is None):
        if scales is None:
            return write_tokens(arenas, page_X, off_X, x_XKH), None
        codes, sc = quantize(x_XKH, format_of(arenas[0].dtype))
        return (write_tokens(arenas, page_X, off_X, codes),
                write_tokens(scales, page_X, off_X, sc))
    codes, sc = (x_XKH, None) if scales is None else quantize(x_XKH, format_of(arenas[0].dtype))
    rows = arenas[0].shape[0]
    upd = jnp.moveaxis(tpu_attention.pack_heads(codes, lanes), -2, 0)       # [rows, X..., L]
    pages = page_X.reshape(-1)
    size = pages.shape[0] if max_pages is None else min(max_pages, pages.shape[0])
    uniq, inv = jnp.unique(pages, size=size, fill_value=jnp.iinfo(jnp.int32).max,
                           return_inverse=True)
    inv, offs = inv.reshape(-1), off_X.reshape(-1)
    arenas = write_pages_merged(arenas, uniq, (inv, offs), upd.reshape(rows, -1, lanes))
    if scales is None:
        return arenas, None
    f = lanes // x_XKH.shape[-1]
    lane = jnp.arange(f) * page_size + offs[:, None]                         # [X, f]
    scu = tpu_attention.pack_scales(sc, rows, f).reshape(rows, -1, f)       # [rows, X, f]
    return arenas, write_pages_merged(scales, uniq, (inv[:, None], lane), scu)


def write_pages_merged(arenas: tuple, uniq_U, index, upd) -> tuple:
    """Positions into whole pages of the TPU layout's arenas (codes [rows, Pa, B, L], an
    8-bit pool's scales [rows, Pa, f*B]): the pages `uniq_U` (each written page once,
    padded with ids past every arena) are gathered, `upd` [rows, X, ...] set into that
    small copy at `index` (its page slot and offset, or lane, per position), and the pages
    scattered back.  A scatter of single positions or scales instead makes XLA:TPU lay the
    arena out another way for the scatter and copy it back around every write (measured in
    deviceless compiles: bfloat16 and int8 rows, 0.2 GB an arena and call -- Moondream 3's
    32-row prefill on a v5e 2x2 had 3.9 GB of temporaries, 0.6 GB this way; scales, 3.7 GB
    of temporaries in a decode step of Moondream 2); a scatter of whole pages, like
    `write_pages`, is in place."""
    out = []
    for a, (st, n) in zip(arenas, _spans(arenas)):
        loc = _local(st, n, uniq_U)
        old = a[:, jnp.minimum(loc, n - 1)]                          # [rows, U, ...]
        new = old.at[(slice(None), *index)].set(as_storage(upd, a.dtype))
        out.append(a.at[:, loc].set(new, mode="drop"))
    return tuple(out)


def write_rows(arenas_k: tuple, arenas_v: tuple, page_R, off_R, k_RKH, v_RKH,
               scales_k=None, scales_v=None):
    """One position per row (a decode step): a loop over the rows (a static trip count)
    whose body updates, in place, the one slice of each arena that row writes, kept only in
    the arena that holds its page.  (A scatter does the same work, but XLA's cost analysis
    charges a scatter its whole operand, read and written, and unrolled slice updates cost
    minutes of compilation at 32 rows: this keeps the step's bytes-accessed figure true.)
    With `scales_k` / `scales_v` (an 8-bit pool) the rows are quantized first and the
    result is (k, v, ks, vs).

    The TPU layout (arenas of `pack` heads a row; the 8-bit pool's decode writes, `DecodeAccess`)
    is written packed -- a row's codes, each head's scale at its lane -- by slice updates
    unrolled over the rows.  Measured in deviceless v5e compiles of Moondream 2's 32-row
    int8 step: a scatter of int8 rows made XLA:TPU lay the arena out another way for the
    scatter and copy it back (48 copies of 0.2 GB a step); this loop as a `fori_loop` made
    it carry copies (over HBM: 17 GB of temporaries); unrolled, every update is in place
    (88 MB of temporaries).  (On XLA:CPU, unrolling cost minutes of compilation at 32
    rows; the CPU pools are not packed.)"""
    spans = _spans(arenas_k)
    lanes, page_size = arenas_k[0].shape[-1], arenas_k[0].shape[2]
    packed = lanes != k_RKH.shape[-1]

    def heads(x_RKH):
        return tpu_attention.pack_heads(x_RKH, lanes) if packed else x_RKH

    parts = [(tuple(arenas_k), heads(k_RKH)), (tuple(arenas_v), heads(v_RKH))]
    if scales_k is not None:
        fmt = format_of(arenas_k[0].dtype)
        (kq, ksc), (vq, vsc) = quantize(k_RKH, fmt), quantize(v_RKH, fmt)
        if packed:   # scales [R, rows, f]
            rows, f = arenas_k[0].shape[0], lanes // k_RKH.shape[-1]
            ksc, vsc = (jnp.moveaxis(tpu_attention.pack_scales(x, rows, f), 0, 1)
                        for x in (ksc, vsc))
        parts = [(tuple(arenas_k), heads(kq)), (tuple(arenas_v), heads(vq)),
                 (tuple(scales_k), ksc), (tuple(scales_v), vsc)]

    def put(a, new, loc, n, start):
        old = jax.lax.dynamic_slice(a, start, new.shape)
        return jax.lax.dynamic_update_slice(a, jnp.where((loc >= 0) & (loc < n), new, old),
                                            start)

    def one(a, x, r, st, n):
        loc = page_R[r] - st
        at = jnp.clip(loc, 0, n - 1)
        new = jax.lax.dynamic_index_in_dim(x, r, 0, keepdims=False)
        if packed and a.ndim == 3:   # TPU-layout scales: head s of the row at lane s*B + off
            for s_ in range(new.shape[-1]):
                a = put(a, new[:, s_].reshape(a.shape[0], 1, 1), loc, n,
                        (0, at, s_ * page_size + off_R[r]))
            return a
        rest = a.shape[3:]
        new = as_storage(new, a.dtype).reshape(a.shape[0], 1, 1, *rest)
        return put(a, new, loc, n, (0, at, off_R[r]) + (0,) * len(rest))

    def body(r, arrays):
        return tuple(tuple(one(a, x, r, st, n) for a, (st, n) in zip(arenas, spans))
                     for arenas, (_, x) in zip(arrays, parts))

    arrays = tuple(a for a, _ in parts)
    if packed:   # unrolled: see the docstring
        for r in range(k_RKH.shape[0]):
            arrays = body(r, arrays)
        return arrays
    return jax.lax.fori_loop(0, k_RKH.shape[0], body, arrays)


def gather_pages(arenas: tuple, page_X):
    """[K, X..., B, H]: whole pages, by global id, from whichever arena holds each (scales:
    [K, X..., B])."""
    out = None
    for a, (st, n) in zip(arenas, _spans(arenas)):
        loc = _local(st, n, page_X)
        g = a[:, jnp.minimum(loc, n - 1)]
        ok = (loc < n).reshape(1, *loc.shape, *(1,) * (a.ndim - 2))
        out = g if out is None else jnp.where(ok, g, out)
    return out


def write_pages(arenas: tuple, page_N, blocks_KNBH) -> tuple:
    """Overwrite whole pages (page-granular copies: the prefix cache)."""
    return tuple(a.at[:, _local(st, n, page_N)].set(blocks_KNBH.astype(a.dtype), mode="drop")
                 for a, (st, n) in zip(arenas, _spans(arenas)))


# -- attention ------------------------------------------------------------------------------

def prefill_attend(arenas_k: tuple, arenas_v: tuple, q_RTQH, pt_RM, mask_RTS,
                   scales_k=None, scales_v=None, n_kv: int | None = None):
    """Prompt queries against their rows' pages (gathered contiguous), masked by positions.
    An 8-bit pool's gathered codes are dequantized by their scales.  `n_kv`: the kv heads
    (needed by the TPU layout, whose rows hold several)."""
    r, m = pt_RM.shape
    kv_len = m * arenas_k[0].shape[2]
    h = q_RTQH.shape[-1]

    def view(arenas, scales):   # [K, R, M, B, H] -> [R, S, K, H]
        g = gather_pages(arenas, pt_RM)
        packed = g.shape[-1] != h   # the TPU layout: heads side by side in a row
        if packed:
            g = tpu_attention.unpack_heads(g, n_kv, h)
        if scales is not None:
            sc = gather_pages(scales, pt_RM)
            if packed:
                sc = tpu_attention.unpack_scales(sc, n_kv, arenas[0].shape[2])
            g = dequantize(g, sc)
        else:
            g = as_format(g)
        return g.transpose(1, 2, 3, 0, 4).reshape(r, kv_len, g.shape[0], g.shape[-1])

    k, v = view(arenas_k, scales_k), view(arenas_v, scales_v)
    return attention(q_RTQH, k.astype(q_RTQH.dtype), v.astype(q_RTQH.dtype), mask_RTS)


def page_partials(q_RKGH, k_KPBH, v_KPBH, owner_P, count_P, ks_KPB=None, vs_KPB=None):
    """Per page of one arena: (max [K, P, G], sum [K, P, G], weighted V [K, P, G, H]) of its
    owner row's attention over its first count_P positions (count 0: an empty partial).
    8-bit pages: the K scales multiply the scores, the V scales the probabilities (a
    position's scale is a common factor of its vector), so no dequantized copy is made."""
    qz = jnp.concatenate([q_RKGH, jnp.zeros_like(q_RKGH[:1])])   # row R: no owner
    q_KPGH = qz[owner_P].transpose(1, 0, 2, 3)
    if ks_KPB is not None:
        k_KPBH, v_KPBH = as_format(k_KPBH).astype(F32), as_format(v_KPBH).astype(F32)
    else:
        k_KPBH, v_KPBH = as_format(k_KPBH), as_format(v_KPBH)
    s = jnp.einsum("kpgh,kpth->kpgt", q_KPGH.astype(k_KPBH.dtype), k_KPBH,
                   preferred_element_type=F32) * (q_RKGH.shape[-1] ** -0.5)
    if ks_KPB is not None:
        s = s * ks_KPB[:, :, None, :]
    valid = jnp.arange(k_KPBH.shape[2])[None, None, None, :] < count_P[None, :, None, None]
    s = jnp.where(valid, s, -jnp.inf)
    m = s.max(-1)
    e = jnp.where(valid, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), 0.0)
    ev = e if vs_KPB is None else e * vs_KPB[:, :, None, :]
    o = jnp.einsum("kpgt,kpth->kpgh", ev.astype(v_KPBH.dtype), v_KPBH,
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


def decode_attend(arenas_k: tuple, arenas_v: tuple, q_RQH, owner_P, count_P, pt_RM,
                  scales_k=None, scales_v=None):
    """One query per row against its pages, every swept page read once in place.
    owner_P / count_P cover the pages of the given arenas in global order."""
    r, n, h = q_RQH.shape
    kh = arenas_k[0].shape[0]
    q = q_RQH.reshape(r, kh, n // kh, h).astype(F32)
    none = (None,) * len(arenas_k)
    parts = [page_partials(q, kt, vt, owner_P[st:st + size], count_P[st:st + size], kst, vst)
             for kt, vt, kst, vst, (st, size) in zip(
                 arenas_k, arenas_v, scales_k or none, scales_v or none, _spans(arenas_k))]
    m, l, o = (jnp.concatenate(x, axis=1) for x in zip(*parts))
    return combine_partials(m, l, o, pt_RM).reshape(r, n * h).astype(q_RQH.dtype)


def kernel_attend(arenas_k: tuple, arenas_v: tuple, q_RQH, pt_RM, length_R, *,
                  splits: int = 1, interpret: bool = False, scales_k=None, scales_v=None):
    """The same attention by our Pallas GPU kernel (`gpu_attention`), which walks each row's
    page table up to its length in `splits` splits (one arena: global page ids are its
    indices).  An 8-bit pool passes its scales ([K, P, B])."""
    if len(arenas_k) != 1:
        raise ValueError("the paged-attention kernel reads a single-arena pool")
    return gpu_attention.attend(arenas_k[0], arenas_v[0], q_RQH, pt_RM, length_R,
                                splits=splits, interpret=interpret,
                                ks_KPB=None if scales_k is None else scales_k[0],
                                vs_KPB=None if scales_v is None else scales_v[0])


# -- the access objects text.forward writes and attends through --------------------------

@flax.struct.dataclass
class PrefillAccess:
    """Prompt rows writing at (page, offset) per position and attending their page tables."""
    page_RT: jax.Array
    off_RT: jax.Array
    pt_RM: jax.Array
    prefix_R: jax.Array

    tp: object = flax.struct.field(pytree_node=False, default=None)
    vis_RT: jax.Array | None = None   # image blocks in the prompt (`attention_mask`)

    def update(self, pool: KVPool, li: int, q, k, v, pos_RT):
        return _on_layer(self, pool, li, q, k, v, pos_RT)

    def _layer(self, arrays, q, k, v, pos_RT):
        ks, vs, ksc, vsc = arrays
        # Each row's positions are consecutive: at most T // page + 1 pages a row, and the
        # dummy page of its padding.
        bound = self.page_RT.shape[0] * (-(-self.page_RT.shape[1] // ks[0].shape[2]) + 2)
        ks, ksc = write_tokens_q(ks, ksc, self.page_RT, self.off_RT, k, bound)
        vs, vsc = write_tokens_q(vs, vsc, self.page_RT, self.off_RT, v, bound)
        kv_len = self.pt_RM.shape[1] * ks[0].shape[2]
        mask = attention_mask(pos_RT, self.prefix_R, kv_len, self.vis_RT)
        return (ks, vs, ksc, vsc), prefill_attend(ks, vs, q, self.pt_RM, mask, ksc, vsc,
                                                  n_kv=k.shape[-2])


@flax.struct.dataclass
class DecodeAccess:
    """One new position per row; attention over the pages of the arenas given by `attend`,
    one of the readers below (`step` picks it from the platform record): `sweep_attend`
    (any backend), `cpu_kernel_attend` (`cpukernel`: XLA:CPU), `gpu_kernel_attend` (our
    Pallas GPU kernel, `gpu_attention`), `tpu_kernel_attend` (our Pallas TPU kernel,
    `tpu_attention`, over the TPU layout) or `gpu_interpret_attend` / `tpu_kernel_attend`
    with `interpret` (the same run by the Pallas interpreter: tests).  The kernels read one arena through the rows' page tables
    and lengths; the sweep reads every page of the arenas given, with owner_P / count_P.
    `scatter`: new positions written by one scatter per arena (the GPU and TPU kernels' pools) rather
    than a row loop.  `splits`: the GPU kernel's split count (`gpu_attention.plan_splits`,
    static)."""
    page_R: jax.Array
    off_R: jax.Array
    owner_P: jax.Array
    count_P: jax.Array
    pt_RM: jax.Array
    length_R: jax.Array
    attend: object = flax.struct.field(pytree_node=False, default=None)
    scatter: bool = flax.struct.field(pytree_node=False, default=False)
    splits: int = flax.struct.field(pytree_node=False, default=1)
    tp: object = flax.struct.field(pytree_node=False, default=None)

    def update(self, pool: KVPool, li: int, q, k, v, pos_RT):
        return _on_layer(self, pool, li, q, k, v, pos_RT)

    def _layer(self, arrays, q, k, v, pos_RT):
        ks, vs, ksc, vsc = arrays
        # GPU, TPU: one scatter per arena (one kernel); but an 8-bit pool in the TPU layout
        # takes the row updates of `write_rows` (XLA:TPU scatters int8 rows through another
        # layout than the pool's and copies every arena back: `write_rows`).
        if self.scatter and not (ksc is not None and ks[0].shape[-1] != k.shape[-1]):
            ks, ksc = write_tokens_q(ks, ksc, self.page_R, self.off_R, k[:, 0])
            vs, vsc = write_tokens_q(vs, vsc, self.page_R, self.off_R, v[:, 0])
        elif ksc is None:
            ks, vs = write_rows(ks, vs, self.page_R, self.off_R, k[:, 0], v[:, 0])
        else:
            ks, vs, ksc, vsc = write_rows(ks, vs, self.page_R, self.off_R, k[:, 0], v[:, 0],
                                          ksc, vsc)
        a = (self.attend or sweep_attend)(self, (ks, vs, ksc, vsc), q[:, 0])
        return (ks, vs, ksc, vsc), a[:, None]


# The decode readers a `DecodeAccess` takes: (access, (k, v, k scales, v scales) arenas,
# q [R, Q, H]) -> [R, Q * H].

def sweep_attend(acc: DecodeAccess, arrays, q_RQH):
    ks, vs, ksc, vsc = arrays
    return decode_attend(ks, vs, q_RQH, acc.owner_P, acc.count_P, acc.pt_RM, ksc, vsc)


def cpu_kernel_attend(acc: DecodeAccess, arrays, q_RQH):
    ks, vs, ksc, vsc = arrays
    if len(ks) != 1:
        raise ValueError("the CPU paged-attention kernel reads a single-arena pool")
    a = cpukernel.attend(ks[0], vs[0], q_RQH, acc.pt_RM, acc.length_R,
                         None if ksc is None else ksc[0], None if vsc is None else vsc[0])
    return a.reshape(a.shape[0], -1)


def _bf16_view(arenas: tuple) -> tuple:
    """A CPU pool's bfloat16 bits as bfloat16 for the Pallas kernels (interpreted on CPU:
    tests); every other pool as it is (e4m3 bytes stay bytes: the kernels read those)."""
    return tuple(as_format(a) if a.dtype == _BF16_BITS else a for a in arenas)


def gpu_kernel_attend(acc: DecodeAccess, arrays, q_RQH, interpret: bool = False):
    ks, vs, ksc, vsc = arrays
    ks, vs = _bf16_view(ks), _bf16_view(vs)
    return kernel_attend(ks, vs, q_RQH, acc.pt_RM, acc.length_R, splits=acc.splits,
                         interpret=interpret, scales_k=ksc, scales_v=vsc)


def gpu_interpret_attend(acc: DecodeAccess, arrays, q_RQH):
    return gpu_kernel_attend(acc, arrays, q_RQH, interpret=True)


def tpu_kernel_attend(acc: DecodeAccess, arrays, q_RQH, *, n_kv_heads: int,
                      interpret: bool = False):
    """Our Pallas TPU kernel over the TPU layout (`tpu_attention`): `n_kv_heads` the kv heads
    this chip's pool rows hold (`step.decode_access` binds it: a packed row holds several)."""
    ks, vs, ksc, vsc = arrays
    if len(ks) != 1:
        raise ValueError("the TPU paged-attention kernel reads a single-arena pool")
    ks, vs = _bf16_view(ks), _bf16_view(vs)
    return tpu_attention.attend(ks[0], vs[0], q_RQH, acc.pt_RM, acc.length_R,
                                n_kv_heads=n_kv_heads, interpret=interpret,
                                ks_pool=None if ksc is None else ksc[0],
                                vs_pool=None if vsc is None else vsc[0])


def _on_layer(access, pool: KVPool, li: int, q, k, v, pos_RT):
    """Write layer li's new K/V and attend, through `access._layer`: on one device
    directly; over a mesh (`access.tp`, `sharding.TensorParallel`) on each chip's kv heads."""
    arrays = pool.layer(li)
    if access.tp is None:
        arrays, a = access._layer(arrays, q, k, v, pos_RT)
    else:
        def local(arrays, heads, rest):
            acc, pos = rest
            arrays, a = acc._layer(arrays, *heads, pos)
            return arrays, a.reshape(*a.shape[:2], -1)
        arrays, a = access.tp.on_heads(local, k.shape[2], arrays, (q, k, v),
                                       (access.replace(tp=None), pos_RT))
    return _replace_layer(pool, li, *arrays), a


def _replace_layer(pool: KVPool, li: int, ks: tuple, vs: tuple, ksc=None, vsc=None) -> KVPool:
    def put(arrays, x):
        return arrays[:li] + (x,) + arrays[li + 1:]
    if ksc is None:
        return KVPool(put(pool.k, ks), put(pool.v, vs))
    return KVPool(put(pool.k, ks), put(pool.v, vs), put(pool.ks, ksc), put(pool.vs, vsc))
