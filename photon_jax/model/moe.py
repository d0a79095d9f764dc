"""The mixture-of-experts MLP of Moondream 3: routing, and schedules that compute the experts
with no data-dependent control flow (so no host round trip inside a step on any backend).

Routing (the reference's order): router logits = linear with bias, in the model dtype; take
the top-k logits, then a softmax over those k only, in float32, cast back to the model dtype.
Expert e: h = x @ fc1[e] ([D, 2I], no bias), act = GELU_erf(h[:I]) * (h[I:] + 1),
y = act @ fc2[e] ([I, D], no bias); the output is the weighted sum over the k experts.

Parameters of one layer: {"router": linear [D, E], "fc1": [E, D, 2I], "fc2": [E, I, D]}
(the checkpoint's [E, out, in] expert tensors are transposed once, by the converter; a loaded
model holds each layer's experts as their own arrays, so no layer's stack is ever sliced out
of a bigger one).

Schedules, chosen from static shapes (`schedule`):

- decode (N <= DECODE_TOKENS tokens): every expert's weights are read at most once.
  `dense`: all E experts for every token, then the top-k mix -- when the step selects most
  experts (expected distinct selected experts d = E (1 - (1 - k/E)^N), 3d >= E).  `gather`:
  the distinct selected experts (a static U = min(E, N k) slots; `jnp.unique` pads the
  sorted list past the last id when fewer are distinct) are gathered and applied to every
  token -- when few are selected: reading U experts (and writing and reading their gathered
  copy) costs less than reading all E.  Both are one product batched over experts.  When
  few are selected a CPU uses the `blocks` loop below instead (one-row blocks at 1-2
  tokens: each assignment's expert read in place, no gathered copy; 5x faster than gather
  at one token on a full-size layer), a TPU `megablox`; with many, `blocks` would read an
  expert once per block, so `dense` (`bench/moe.py` measures each schedule).
- on TPU a decode step that selects few experts uses `megablox` instead of `gather`: XLA:TPU
  gathers the selected experts by copying the whole stack (compiled at Moondream 3's shapes,
  1 token: 0.52 GB of temporaries and 2.3 GB accessed per layer, against dense's 0.81 GB),
  while megablox's grid visits only the tiles of the selected experts (8 of 64 at 1 token:
  each expert's weights read once, 0.1 GB).
- prefill: `ragged` (`jax.lax.ragged_dot`, a grouped matmul over the assignments sorted by
  expert: a Mosaic kernel on TPU) on TPU; `dense` on GPU, where XLA (jax 0.10.2) expands
  ragged_dot into every assignment times every expert (`platforms.default_grouped`); on CPU,
  where ragged_dot is a masked product over every expert too, `blocks`: the assignments
  sorted by expert in blocks of `block` rows of one expert each, and a loop over a static
  number of blocks (an upper bound: the used ones plus at most one padded block per
  expert) that applies each block's expert.  `megablox`: JAX's Pallas TPU grouped matmul
  on the same sorted rows, compared with `ragged` for TPU in `bench/tpu_compile.py --moe`
  (docs/tpu.md).
- experts split over chips: each chip gets every assignment, those of other chips' experts
  as id E; the grouped schedules count them in no group (no work), the others compute them
  as expert E-1 and the caller drops them.

- LoRA adapters on the experts (`lora`, Moondream 3's finetunes): each schedule takes the
  adapters' up deltas per (token, expert) assignment ([N, k, 2I], computed outside it by
  `lora.expert_delta`), adds them to its up products before the activation, and hands back
  the activations ([N, k, I]) so the down adapters are applied outside it too: one place
  for the adapters' products, whatever the schedule.

`bench/moe.py` measures every schedule (ms and bytes accessed) at 1, 8, 32 and 746 tokens.
`dense_reference` is `dense` by another name, kept as the tests' formula.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from ..base.dtypes import F32, matmul_precision
from . import lora as lora_, quant
from .layers import linear

MAX_BLOCK = 64


def gelu_erf(x):
    # Moondream 3's experts (and its tau attention) use the exact erf GELU.
    return jax.nn.gelu(x.astype(F32), approximate=False).astype(x.dtype)


def route(p, x_ND, k: int):
    """-> (expert ids [N, k] int32 in descending logit order, weights [N, k] in x's dtype)."""
    logits = linear(x_ND, p["router"])
    top, ids = jax.lax.top_k(logits, k)
    return ids.astype(jnp.int32), jax.nn.softmax(top.astype(F32), axis=-1).astype(x_ND.dtype)


def _activation(h_AF, inner: int):
    # Each op rounds to the model dtype, as the reference's do.
    return gelu_erf(h_AF[..., :inner]) * (h_AF[..., inner:] + 1)


def _mix(y_NKD, w_NK, dtype):
    """Weighted sum over the k experts of each token (products rounded to the model dtype
    first, as the reference multiplies before it sums)."""
    return (y_NKD * w_NK[..., None]).astype(F32).sum(axis=1).astype(dtype)


def block_size(n_assign: int, n_experts: int) -> int:
    """Rows per block: the mean rows per expert, rounded down to a power of two, in
    [1, MAX_BLOCK]."""
    b = 1
    while b * 2 <= min(n_assign // n_experts, MAX_BLOCK):
        b *= 2
    return b


DECODE_TOKENS = 64


def schedule(n_tokens: int, n_experts: int, k: int, grouped: str = "blocks") -> str:
    """The schedule for a call on n_tokens tokens (static): see the module docstring.
    `grouped`: the prefill schedule, or "PREFILL+FEW": that prefill, and FEW in place of
    gather for a decode step that selects few experts ("blocks" on CPU, "megablox" on TPU;
    "megablox-interpret": that kernel under Pallas's interpreter, for tests off TPU)."""
    prefill, _, few = grouped.partition("+")
    if n_tokens > DECODE_TOKENS:
        return prefill
    distinct = n_experts * (1 - (1 - k / n_experts) ** n_tokens)
    return "dense" if 3 * distinct >= n_experts else (few or "gather")


def _experts(x_ND, fc1_EDF, fc2_EFD, du=None):
    """[E, N, D]: every given expert applied to every token; with `du` = (adapter up deltas
    [N, k, F], the computed slot of each [N, k]), the deltas added before the activation
    and ([E, N, D], the activations [E, N, I]) returned.

    Written as a product batched over experts ([E, N, D] x [E, D, F]), the layout a batched
    matmul reads as it lies: contracting x [N, D] with the stack's middle axis directly makes
    XLA transpose (copy) the whole [E, D, F] weight stack first, which read and wrote the
    weights twice more than the product itself (2.3x the layer's weights at 1 token)."""
    prec = matmul_precision(x_ND.dtype)
    x_ND, fc1_EDF = _widen(x_ND, fc1_EDF)
    x_END = jnp.broadcast_to(x_ND[None], (fc1_EDF.shape[0],) + x_ND.shape)
    h = jnp.einsum("end,edf->enf", x_END, fc1_EDF, precision=prec,
                   preferred_element_type=F32).astype(x_ND.dtype)
    if du is not None:
        # Added where h lies (a scatter-add into it), not through a zeroed [E, N, F] copy
        # of the deltas, which would be h's size again.
        du_NKF, pos_NK = du
        h = h.at[pos_NK, jnp.arange(h.shape[1])[:, None]].add(du_NKF)
    act = _activation(h, quant.logical_shape(fc2_EFD)[1])
    a, fc2_EFD = _widen(act, fc2_EFD)
    y = jnp.einsum("enf,efd->end", a, fc2_EFD,
                   precision=prec, preferred_element_type=F32).astype(x_ND.dtype)
    return y if du is None else (y, act)


def _pick(y_END, slot_NK):
    """[N, K, D]: row n's output of slot slot_NK[n, k] (reads only the picked rows)."""
    return y_END[slot_NK, jnp.arange(slot_NK.shape[0])[:, None]]


def _widen(x, w):
    """(x, w widened to x's dtype), after x (`quant.widen_for`).  Quantized experts widen
    next to the product that reads them; after `take`, only the selected experts' codes."""
    return quant.widen_for(x, w, x.dtype)


def n_experts(p) -> int:
    return quant.logical_shape(p["fc1"])[0]


def _inner(p) -> int:
    return quant.logical_shape(p["fc2"])[1]


def _picked(out, pos_NK):
    """`_experts`' result picked per assignment: y, or (y, activations) with deltas."""
    if isinstance(out, tuple):
        return tuple(_pick(o, pos_NK) for o in out)
    return _pick(out, pos_NK)


def _dense(p, x_ND, ids_NK, du=None):
    return _picked(_experts(x_ND, p["fc1"], p["fc2"], None if du is None else (du, ids_NK)),
                   ids_NK)


def _gather(p, x_ND, ids_NK, du=None):
    n, k = ids_NK.shape
    e = n_experts(p)
    u = min(e, n * k)
    # Sorted, padded at the end with E (past every id), so searchsorted finds each id among
    # the real entries; the padding slots compute expert E-1 again and are never picked.
    uniq = jnp.unique(ids_NK.reshape(-1), size=u, fill_value=e)
    safe = jnp.minimum(uniq, e - 1)
    pos = jnp.searchsorted(uniq, ids_NK)
    return _picked(_experts(x_ND, quant.take(p["fc1"], safe), quant.take(p["fc2"], safe),
                            None if du is None else (du, pos)), pos)


def _sorted_assignments(ids_NK, e: int, block: int):
    """Assignments sorted by expert, laid out in blocks of one expert each: (order, dest
    row of each sorted assignment, expert of each block, rows, blocks)."""
    n, k = ids_NK.shape
    a = n * k
    flat = ids_NK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    counts = jnp.zeros(e, jnp.int32).at[flat].add(1)
    padded = (counts + block - 1) // block * block
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    sorted_start = jnp.cumsum(counts) - counts
    dest = pad_start[expert] + jnp.arange(a, dtype=jnp.int32) - sorted_start[expert]
    # Static bound: the assignments, plus at most one partly filled block per expert used.
    n_blocks = -(-(a + min(e, a) * (block - 1)) // block)
    block_expert = jnp.minimum(
        jnp.searchsorted(pad_end, jnp.arange(n_blocks, dtype=jnp.int32) * block, side="right"),
        e - 1)
    return order, dest, block_expert, counts, n_blocks


def _unsort(v_sorted, order, n: int, k: int):
    """Rows in sorted-assignment order back to [N, k, ...]."""
    return jnp.zeros_like(v_sorted).at[order].set(v_sorted).reshape(n, k, -1)


def _blocks(p, x_ND, ids_NK, unroll: bool = False, du=None):
    n, k = ids_NK.shape
    e, d = n_experts(p), x_ND.shape[1]
    prec = matmul_precision(x_ND.dtype)
    inner = _inner(p)
    block = block_size(n * k, e)
    order, dest, block_expert, _, n_blocks = _sorted_assignments(ids_NK, e, block)
    rows = n_blocks * block
    xs = jnp.zeros((rows, d), x_ND.dtype).at[dest].set(x_ND[order // k])
    dus = None if du is None else jnp.zeros((rows, du.shape[-1]), du.dtype).at[dest].set(
        du.reshape(n * k, -1)[order])

    def body(i, carry):
        y, acts = carry
        ex = block_expert[i]
        xb = jax.lax.dynamic_slice_in_dim(xs, i * block, block)
        xb, w1 = _widen(xb, quant.take(p["fc1"], ex))
        h = jnp.einsum("bd,df->bf", xb, w1, precision=prec,
                       preferred_element_type=F32).astype(x_ND.dtype)
        if dus is not None:
            h = h + jax.lax.dynamic_slice_in_dim(dus, i * block, block)
        act = _activation(h, inner)
        a, w2 = _widen(act, quant.take(p["fc2"], ex))
        yb = jnp.einsum("bf,fd->bd", a, w2, precision=prec,
                        preferred_element_type=F32).astype(x_ND.dtype)
        if acts is not None:
            acts = jax.lax.dynamic_update_slice_in_dim(acts, act, i * block, 0)
        return jax.lax.dynamic_update_slice_in_dim(y, yb, i * block, 0), acts

    # A static trip count: blocks past the used ones apply the last expert to zero rows
    # nobody reads.
    acts0 = None if du is None else jnp.zeros((rows, inner), x_ND.dtype)
    y, acts = jax.lax.fori_loop(0, n_blocks, body,
                                (jnp.zeros((rows, d), x_ND.dtype), acts0), unroll=unroll)
    y = _unsort(y[dest], order, n, k)
    return y if du is None else (y, _unsort(acts[dest], order, n, k))


def _grouped_rows(ids_NK, e: int):
    """The assignments sorted by expert: (order, rows per expert).  An id of `e` (another
    chip's expert, `sharding.TensorParallel.experts`) sorts last and is counted in no group,
    so a grouped product leaves its rows out."""
    flat = ids_NK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.zeros(e, jnp.int32).at[flat].add(1, mode="drop")


def _ragged(p, x_ND, ids_NK, du=None):
    n, k = ids_NK.shape
    e = n_experts(p)
    prec = matmul_precision(x_ND.dtype)
    order, counts = _grouped_rows(ids_NK, e)
    # The grouped product reads whole stacks: quantized ones are widened first (one
    # layer's stack at a time).
    xs, fc1 = _widen(x_ND[order // k], p["fc1"])
    h = jax.lax.ragged_dot(xs, fc1, counts, precision=prec,
                           preferred_element_type=F32).astype(x_ND.dtype)
    if du is not None:
        h = h + du.reshape(n * k, -1)[order]
    act = _activation(h, _inner(p))
    a, fc2 = _widen(act, p["fc2"])
    y = jax.lax.ragged_dot(a, fc2, counts,
                           precision=prec, preferred_element_type=F32).astype(x_ND.dtype)
    y = _unsort(y, order, n, k)
    return y if du is None else (y, _unsort(act, order, n, k))


def megablox_tile_rows(n_assign: int, n_experts: int) -> int:
    """Megablox's row tile: the mean rows per expert rounded down to a power of two, in
    [128, 512]; or, for at most 128 assignments (decode), one tile of them all rounded up
    to 16 rows (bfloat16's sublane tile).  Each tile an expert's rows touch reads that
    expert's whole weights once and computes all the tile's rows: a tile far above the
    mean multiplies the flops, one far below re-reads the weights."""
    if n_assign <= 128:
        return -(-n_assign // 16) * 16
    t = 128
    while t * 2 <= min(n_assign // n_experts, 512):
        t *= 2
    return t


def _megablox(p, x_ND, ids_NK, interpret: bool = False, du=None):
    """The grouped product as JAX's Pallas TPU grouped matmul (`megablox.gmm`): its grid
    visits only the row tiles that hold assignments (a dynamic count), so rows of no group
    cost nothing.  Rows are padded to whole tiles; `interpret` runs it on any backend."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    n, k = ids_NK.shape
    e = n_experts(p)
    a = n * k
    tm = megablox_tile_rows(a, e)
    rows = -(-a // tm) * tm
    order, counts = _grouped_rows(ids_NK, e)
    xs = jnp.zeros((rows, x_ND.shape[1]), x_ND.dtype).at[:a].set(x_ND[order // k])

    def product(lhs, rhs):
        kk, nn = rhs.shape[1:]
        # Whole-dimension tiles below 128 (a block may equal the array's dimension).
        tiling = (tm, min(kk, 512), min(nn, 512))
        return gmm(lhs, rhs, counts, preferred_element_type=F32, tiling=tiling,
                   interpret=interpret).astype(x_ND.dtype)

    h = product(*_widen(xs, p["fc1"]))
    if du is not None:
        h = h + jnp.zeros((rows, du.shape[-1]), du.dtype).at[:a].set(
            du.reshape(a, -1)[order])
    act = _activation(h, _inner(p))
    y = _unsort(product(*_widen(act, p["fc2"]))[:a], order, n, k)
    return y if du is None else (y, _unsort(act[:a], order, n, k))


_APPLY = {"dense": _dense, "gather": _gather, "blocks": _blocks, "ragged": _ragged,
          "megablox": _megablox, "megablox-interpret": partial(_megablox, interpret=True)}
# The schedules that skip an id of E (another chip's expert); the others compute it.
GROUPED = ("ragged", "megablox", "megablox-interpret")


def moe_mlp(p, x_TD, k: int, with_routes: bool = False, grouped: str = "blocks",
            schedule_: str | None = None, unroll: bool = False, tp=None, lora=None):
    """The mixture-of-experts MLP on [..., D] inputs; `with_routes` also returns the routing
    (ids, weights), each [..., k].  `grouped`: the platform's schedules (`schedule`,
    `platforms.default_grouped`); `schedule_` forces one (tests, benchmarks); `unroll` unrolls the block
    loop (so XLA's cost analysis, which counts a loop body once, sees every block).  `tp`:
    experts split over a mesh (`sharding.TensorParallel.experts`; None: one device).
    `lora`: (this layer's expert adapter tables, each token's slot [N]) -- `lora.Rows.
    experts`; None: no adapters."""
    lead, d = x_TD.shape[:-1], x_TD.shape[-1]
    x = x_TD.reshape(-1, d)
    ids, w = route(p, x, k)
    how = schedule_ or schedule(x.shape[0], n_experts(p), k, grouped)
    if schedule_ is None and how.startswith("megablox") and x.shape[0] <= DECODE_TOKENS \
            and quant.is_quantized(p["fc1"]):
        # Megablox reads whole stacks, so quantized ones would be widened into a copy first
        # (compiled for a v5e 2x2 at Moondream 3.1's shapes: 2.9 GB of temporaries per
        # chip).  The block loop reads each selected expert's codes where they lie, widened
        # inside its product.
        how = "blocks"
    def apply(w, x, ids, *du):
        if how not in GROUPED:   # another chip's expert computed as any (the caller drops it)
            if du:   # ... and adds no delta to this chip's expert it is computed as
                du = (jnp.where((ids < n_experts(w))[..., None], du[0],
                                jnp.zeros((), du[0].dtype)),)
            ids = jnp.minimum(ids, n_experts(w) - 1)
        kw = {"du": du[0]} if du else {}
        if how == "blocks":
            return _blocks(w, x, ids, unroll, **kw)
        return _APPLY[how](w, x, ids, **kw)

    if lora is None:
        y = apply(p, x, ids) if tp is None else tp.experts(apply, p, x, ids)
    else:
        tables, slot_N = lora
        du = lora_.expert_delta(x, tables["up"], slot_N, ids)
        y, act = apply(p, x, ids, du) if tp is None else tp.experts(apply, p, x, ids, du)
        y = y + lora_.expert_delta(act, tables["down"], slot_N, ids)
    out = _mix(y, w, x.dtype).reshape(*lead, d)
    if with_routes:
        return out, (ids.reshape(*lead, k), w.reshape(*lead, k))
    return out


def dense_reference(p, x_TD, k: int):
    """Every expert for every token, then the top-k mix: the straightforward formula the
    other schedules are tested (and benchmarked) against."""
    return moe_mlp(p, x_TD, k, schedule_="dense")
