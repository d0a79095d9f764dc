"""GPU decode attention over the paged KV pool: our Pallas kernel (lowered to Triton), its
split plan, and the count of the bytes it moves.

What it replaces.  JAX's Pallas `paged_attention` is shaped for grouped-query attention: it
pads the queries of a KV head to 16 rows (`block_h`), so for Moondream (32 query heads on
32 KV heads: one query per KV head) every program computed and wrote 16 rows for one, and
its k-splits came from the page-table width (`max_context`), not from the rows' lengths,
so at 1k positions of a 2k table half its programs had nothing to read and still wrote.

The kernel.  One program per (row, KV head, split).  It reads its row's length and page
table, and walks its share of the row's pages `per_step` pages at a time (a gather of those
pages through the table), computing the attention of the KV head's G queries (G = 1 for
Moondream's MHA) as a mat-vec on the vector units: scores are a broadcast multiply and a
sum over the head dim, the output a broadcast multiply and a sum over positions.  No query
is padded: a program reads its pages once and writes G rows.  (Triton's `dot` wants 16 rows
or more; with G = 1 it would be 15 rows of padding again, and grouping 16 heads of a row in
one program gives no legitimate dot either: in MHA each head has its own K/V, so it is 16
mat-vecs whatever the grouping, with the same bytes read.  Decode attention does 2 flops
per K/V element it reads, so the tensor cores have nothing to win here.)

Splits ("flash-decoding").  A row's length is cut into `cdiv(length, per_step * T)` steps
and split s of S takes steps [s * n // S, (s + 1) * n // S): splits follow the row's real
length, balanced to a step.  With S = 1 the program writes the row's normalized output
directly, in the model's dtype.  With S > 1 each program writes a partial (max, sum,
unnormalized output, float32) and `combine` merges them in plain jnp; a split with no step
(a row shorter than S steps) skips everything under `pl.when`: it reads nothing and writes
nothing, and the combine masks its slot, which it recomputes from the lengths.

The plan (`plan_splits`).  S is picked on the host per decode step from a small static set
(`SPLITS`), so a step never recompiles: each S is a static variant of the decode program.
It comes from the rows x KV heads (the programs S = 1 gives), the device's SM count and the
longest real length (a split should stream a few steps, else its partial costs more than
its work).

8-bit pools.  int8 / float8_e4m3fn codes with a float32 scale per (KV head, position)
(`kvpool.quantize`): the codes are widened to float32 in registers, the K scales multiply
the scores and the V scales the probabilities (a position's scale is a common factor of its
vector), as every other attention path of `kvpool` does.

Softmax in base 2.  The queries are pre-multiplied by log2(e) / sqrt(H), so the kernel uses
exp2 (one instruction on a GPU) and its max statistic is in base-2 units; `combine` uses
exp2 too.

Shapes: R rows, K KV heads, G queries per KV head, H head dim, P pages in the pool, T
positions per page, M pages in a row's table, S splits.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ..base import compat
from ..base.dtypes import F32

# The split counts a decode program is compiled for.
SPLITS = (1, 2, 4, 8, 16)
# H200 SXM (the GPU the plan is tuned for when the device does not say).
DEFAULT_SMS = 132
# Programs the plan aims for per SM: a program holds one (row, head, split) and is small
# (4 warps), so an SM runs several; below two per SM splitting pays (a memory-bound SM with
# one program has one stream of loads in flight).  A rule, not yet tuned on a GPU: this
# and MIN_SPLIT_POSITIONS are the two knobs a GPU run should sweep.
PROGRAMS_PER_SM = 2
# A split should stream at least this many positions (two steps of 128 at T = 64): below
# that its partial and the combine cost as much as the positions it reads.
MIN_SPLIT_POSITIONS = 256
# Positions one step of the kernel loads per query of the group (its K and V tiles, in
# registers: 128 x 64 float32 values over 4 warps is 64 registers a thread per tile).
STEP_POSITIONS = 128
NUM_WARPS = 4
NUM_STAGES = 2
_LOG2E = math.log2(math.e)


def per_step(page_size: int, group: int = 1) -> int:
    """Pages one kernel step loads: a power of 2 (Triton's arrays are), at least one page,
    about `STEP_POSITIONS` positions per query of the group."""
    n = max(1, STEP_POSITIONS // (page_size * group))
    return 1 << (n.bit_length() - 1)


def plan_splits(lengths, kv_heads: int, page_size: int, sms: int | None = None,
                group: int = 1) -> int:
    """The split count (one of `SPLITS`) of a decode step over rows of attended `lengths`
    (host ints; one per real row): the fewest splits that give `PROGRAMS_PER_SM` programs
    per SM, but never so many that a split of the longest row streams fewer than
    `MIN_SPLIT_POSITIONS` positions (nor fewer than one kernel step)."""
    lengths = [int(n) for n in lengths] or [1]
    sms = sms or DEFAULT_SMS
    items = len(lengths) * kv_heads
    longest = max(lengths)
    step = per_step(page_size, group) * page_size
    room = max(1, min(longest // MIN_SPLIT_POSITIONS, -(-longest // step)))
    want = -(-PROGRAMS_PER_SM * sms // items)
    best = 1
    for s in SPLITS:
        if s > room:
            break
        best = s
        if s >= want:
            break
    return best


def split_variants(rows: int, kv_heads: int, sms: int | None = None) -> tuple:
    """The split counts `plan_splits` can give a step of `rows` real rows (any lengths):
    those a row bucket's programs are warmed up for."""
    sms = sms or DEFAULT_SMS
    most = plan_splits([1 << 30] * rows, kv_heads, 64, sms)
    return tuple(s for s in SPLITS if s <= most)


def bucket_variants(bucket: int, kv_heads: int, sms: int | None = None) -> tuple:
    """Split counts of a row bucket (`step.row_bucket`): the fewest real rows it holds
    allow the most splits."""
    return split_variants(bucket // 2 + 1 if bucket > 1 else 1, kv_heads, sms)


def _steps(length, step_len: int):
    return (length + step_len - 1) // step_len


def split_bounds(lengths_R, splits: int, step_len: int):
    """(first, last) step of each split of each row, [R, S] each (jnp or numpy ints): the
    kernel's own arithmetic, shared with `combine` and `traffic`."""
    xp = jnp if isinstance(lengths_R, jax.Array) else np
    n = _steps(lengths_R, step_len)[:, None]
    s = xp.arange(splits)[None, :]
    return (s * n) // splits, ((s + 1) * n) // splits


def _kernel(len_ref, pt_ref, q_ref, k_ref, v_ref, *refs, splits: int, per: int,
            quantized: bool):
    if quantized:
        ks_ref, vs_ref, *outs = refs
    else:
        ks_ref = vs_ref = None
        outs = refs
    pl, _ = compat.pallas_triton()
    _, page, dim = k_ref.shape
    step_len = per * page
    length = len_ref[0]
    n = (length + step_len - 1) // step_len
    s = pl.program_id(2)
    first, last = (s * n) // splits, ((s + 1) * n) // splits

    def run():
        q = q_ref[...].astype(F32)                                   # [G, H]
        group = q.shape[0]

        def body(i, carry):
            m, l, o = carry
            pages = pt_ref[pl.ds(i * per, per)]
            k = k_ref[pages].reshape(step_len, dim).astype(F32)     # [BT, H]
            v = v_ref[pages].reshape(step_len, dim).astype(F32)
            sc = jnp.sum(q[:, None, :] * k[None, :, :], axis=-1)     # [G, BT]
            if quantized:
                sc = sc * ks_ref[pages].reshape(1, step_len)
            pos = i * step_len + jnp.arange(step_len, dtype=jnp.int32)
            # A step starts below the length, so it has a valid position and m stays finite.
            sc = jnp.where((pos < length)[None, :], sc, -jnp.inf)
            m_new = jnp.maximum(m, sc.max(axis=-1))
            corr = jnp.exp2(m - m_new)
            p = jnp.exp2(sc - m_new[:, None])
            l = l * corr + p.sum(axis=-1)
            if quantized:
                p = p * vs_ref[pages].reshape(1, step_len)
            o = o * corr[:, None] + jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
            return m_new, l, o

        # (-1e30, not -inf: exp2(m - m_new) of an all-masked start stays 0, never NaN.)
        init = (jnp.full((group,), -1e30, F32), jnp.zeros((group,), F32),
                jnp.zeros((group, dim), F32))
        m, l, o = jax.lax.fori_loop(first, last, body, init)
        if splits == 1:
            (o_ref,) = outs
            o_ref[...] = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
        else:
            o_ref, m_ref, l_ref = outs
            o_ref[...] = o
            m_ref[...] = m
            l_ref[...] = l

    if splits == 1:
        run()   # split 0 of every row: its whole length (0 steps: zeros)
    else:
        pl.when(first < last)(run)


def attend(k_KPBH, v_KPBH, q_RQH, pt_RM, length_R, *, splits: int = 1,
           interpret: bool = False, ks_KPB=None, vs_KPB=None):
    """[R, Q*H]: each row's queries q_RQH (Q = K * G heads) against its first length_R
    positions, read through its page table pt_RM from one arena of the pool, in `splits`
    splits (static: one of `SPLITS`).  8-bit pools pass their scales ks/vs [K, P, B]
    (codes as stored: e4m3 bytes are reinterpreted).  `interpret`: the Pallas interpreter
    (CPU tests) instead of Triton."""
    r, nq, dim = q_RQH.shape
    out = kernel(k_KPBH, v_KPBH, q_RQH, pt_RM, length_R, splits=splits, interpret=interpret,
                 ks_KPB=ks_KPB, vs_KPB=vs_KPB)
    if splits > 1:
        out = combine(*out, length_R.astype(jnp.int32),
                      per_step(k_KPBH.shape[2], nq // k_KPBH.shape[0]) * k_KPBH.shape[2])
    return out.reshape(r, nq * dim).astype(q_RQH.dtype)


def kernel(k_KPBH, v_KPBH, q_RQH, pt_RM, length_R, *, splits: int = 1,
           interpret: bool = False, ks_KPB=None, vs_KPB=None):
    """The kernel's own outputs (arguments as `attend`): S = 1, the attention [R, K, G, H]
    in q's dtype; S > 1, the partials (o [R, K, S, G, H], max and sum [R, K, S, G], float32),
    the slots of empty splits left as they were (never written)."""
    if splits not in SPLITS:
        raise ValueError(f"splits must be one of {SPLITS}, got {splits!r}")
    pl, plgpu = compat.pallas_triton()
    r, nq, dim = q_RQH.shape
    kh, p_n, page, _ = k_KPBH.shape
    group = nq // kh
    if group * kh != nq or group & (group - 1):
        raise ValueError(f"{nq} query heads on {kh} KV heads: the kernel takes a power-of-2 "
                         "group of queries per KV head")
    quantized = ks_KPB is not None
    if quantized and k_KPBH.dtype == jnp.uint8:   # e4m3 codes as a CPU pool stores them
        k_KPBH, v_KPBH = (jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
                          for x in (k_KPBH, v_KPBH))
    per = per_step(page, group)
    # The table padded to whole steps: a step's gather of `per` entries stays inside it
    # (entries past a row's pages read page 0, whose positions are masked).
    m = pt_RM.shape[1]
    pad = -(-m // per) * per - m
    pt = jnp.pad(pt_RM.astype(jnp.int32), ((0, 0), (0, pad)))
    q = (q_RQH.astype(F32) * (_LOG2E / math.sqrt(dim))).reshape(r, kh, group, dim)
    lengths = length_R.astype(jnp.int32)

    row = lambda *blk: pl.BlockSpec(blk, lambda i, j, s: (i,) + (0,) * (len(blk) - 1))  # noqa
    head = lambda *blk: pl.BlockSpec(blk, lambda i, j, s: (j,) + (0,) * (len(blk) - 1))  # noqa
    in_specs = [pl.BlockSpec((1,), lambda i, j, s: (i,)),
                row(None, pt.shape[1]),
                pl.BlockSpec((None, None, group, dim), lambda i, j, s: (i, j, 0, 0)),
                head(None, p_n, page, dim), head(None, p_n, page, dim)]
    args = [lengths, pt, q, k_KPBH, v_KPBH]
    if quantized:
        in_specs += [head(None, p_n, page), head(None, p_n, page)]
        args += [ks_KPB.astype(F32), vs_KPB.astype(F32)]
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((r, kh, group, dim), q_RQH.dtype)
        out_specs = pl.BlockSpec((None, None, group, dim), lambda i, j, s: (i, j, 0, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((r, kh, splits, group, dim), F32),
                     jax.ShapeDtypeStruct((r, kh, splits, group), F32),
                     jax.ShapeDtypeStruct((r, kh, splits, group), F32))
        out_specs = (pl.BlockSpec((None, None, None, group, dim),
                                  lambda i, j, s: (i, j, s, 0, 0)),
                     pl.BlockSpec((None, None, None, group), lambda i, j, s: (i, j, s, 0)),
                     pl.BlockSpec((None, None, None, group), lambda i, j, s: (i, j, s, 0)))
    out = pl.pallas_call(
        partial(_kernel, splits=splits, per=per, quantized=quantized),
        grid=(r, kh, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret,
        name=f"photon_decode_attention_s{splits}_p{per}_{k_KPBH.dtype.name}_{q_RQH.dtype.name}",
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
    )(*args)
    return out


def combine(o_RKSGH, m_RKSG, l_RKSG, length_R, step_len: int):
    """[R, K, G, H]: the splits' partials merged (the flash-decoding rescale, base 2).  The
    slots of empty splits were never written: they are masked by the same arithmetic the
    kernel used, with `where` (their memory may hold anything, NaN included)."""
    splits = m_RKSG.shape[2]
    first, last = split_bounds(length_R, splits, step_len)
    ok = (last > first)[:, None, :, None]                          # [R, 1, S, 1]
    m = jnp.where(ok, m_RKSG, -jnp.inf)
    top = m.max(axis=2, keepdims=True)
    w = jnp.where(ok, jnp.exp2(m - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    den = jnp.sum(w * jnp.where(ok, l_RKSG, 0.0), axis=2)
    num = jnp.sum(w[..., None] * jnp.where(ok[..., None], o_RKSGH, 0.0), axis=2)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


# -- the bytes it moves ---------------------------------------------------------------------

def traffic(lengths, *, kv_heads: int, group: int, head_dim: int, page_size: int,
            table_width: int, splits: int, kv_itemsize: int, out_itemsize: int,
            quantized: bool = False) -> dict:
    """Bytes one call moves, counted from the grid, the block shapes and each program's
    steps (the kernel's own arithmetic, `split_bounds`), not measured: per program the K/V
    pages its steps gather (whole steps, so up to per_step - 1 pages past a row's end), the
    scales of those positions, its table entries, its queries and its length; the writes of
    its output block (S = 1) or partials (S > 1, non-empty programs only); and (S > 1) the
    combine's reads of every partial slot and its writes of the output.  `lengths`: every
    row of the call (the bucket's padding rows included).  `table_width` does not change
    the count (a program reads only the table entries its steps use); it is taken so the
    arguments match the replaced kernel's count (`bench/gpu_traffic.py`)."""
    lengths = np.asarray(lengths, np.int64)
    per = per_step(page_size, group)
    step_len = per * page_size
    first, last = split_bounds(lengths, splits, step_len)
    steps = (last - first).sum()                     # over rows and splits, per KV head
    programs = len(lengths) * kv_heads * splits
    empty = int(((last - first) == 0).sum()) * kv_heads if splits > 1 else 0
    per_pos = 2 * (head_dim * kv_itemsize + (4 if quantized else 0))
    read = kv_heads * (steps * step_len * per_pos + steps * per * 4) \
        + programs * (group * head_dim * 4 + 4)
    out = len(lengths) * kv_heads * group * head_dim * out_itemsize
    if splits == 1:
        written, combine_read, combine_written = out, 0, 0
    else:
        part = group * (head_dim + 2) * 4
        written = (programs - empty) * part
        combine_read, combine_written = programs * part, out
    attended = int(lengths.sum()) * kv_heads * per_pos
    return {"programs": programs, "empty": empty, "kv_attended": attended,
            "read": int(read), "written": int(written), "combine_read": int(combine_read),
            "combine_written": int(combine_written)}
