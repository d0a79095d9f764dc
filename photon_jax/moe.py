"""The mixture-of-experts MLP of Moondream 3: routing, and the experts computed only for the
(token, expert) pairs the router selected.

Routing (the reference's order): router logits = linear with bias, in the model dtype; take
the top-k logits, then a softmax over those k only, in float32, cast back to the model dtype.
Expert e: h = x @ fc1[e] ([D, 2I], no bias), act = GELU_erf(h[:I]) * (h[I:] + 1),
y = act @ fc2[e] ([I, D], no bias); the output is the weighted sum over the k experts.

Parameters of one layer: {"router": linear [D, E], "fc1": [E, D, 2I], "fc2": [E, I, D]}
(the checkpoint's [E, out, in] expert tensors are transposed once, by the converter).

The schedule (one for prefill and decode alike): the A = tokens * k assignments are sorted
by expert and laid out in blocks of `block` rows, each block holding rows of one expert only
(a group's last block is padded with zero rows); a loop over the blocks actually used (a
dynamic trip count) reads that block's expert weights and does one [block, D] x [D, 2I]
and one [block, I] x [I, D] matmul.  Experts nobody chose are never read; work is at most
A + E * (block - 1) rows instead of tokens * E.  `block` is the mean rows per expert rounded
down to a power of two (1 below two rows per expert, e.g. a decode step of a few rows: one
expert application per assignment; up to 64 in prefill), so padding at most doubles the work.
Not measured on an accelerator, where each block iteration is a kernel launch: a grouped
matmul kernel would be the next step there.

Why this one (CPU, the small_md3 layer: width 512, 32 experts, top-4, expert width 256;
`bench/moe.py`): at 1 / 8 / 32 / 746 tokens it takes 0.5 / 3.0 / 6.1 / 30 ms against 16 / 27
/ 30 / 162 ms for the dense all-experts product.  Rejected: gathering each assignment's
expert weights into one batched matmul copies A weight matrices (54 ms at 8 tokens, slower
than dense); one batched matmul over all blocks with per-block gathered weights was no
faster than dense at 746 tokens; `jax.lax.ragged_dot` lowers, on CPU (jax 0.10), to a
masked product over every group, i.e. all experts for every token (24 / 30 / 51 / 573 ms).
`dense_reference` (every expert for every token, then the top-k mix) exists for tests and
benchmarks only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .dtypes import F32, matmul_precision
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


def _apply_experts(p, x_ND, ids_NK, block: int):
    """[N, k, D] expert outputs of every (token, expert) assignment, by the block loop."""
    n, k = ids_NK.shape
    e = p["fc1"].shape[0]
    inner = p["fc2"].shape[1]
    d = x_ND.shape[1]
    prec = matmul_precision(x_ND.dtype)
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
    n_blocks = -(-(a + min(e, a) * (block - 1)) // block)
    rows = n_blocks * block
    xs = jnp.zeros((rows, d), x_ND.dtype).at[dest].set(x_ND[order // k])
    block_expert = jnp.minimum(
        jnp.searchsorted(pad_end, jnp.arange(n_blocks, dtype=jnp.int32) * block, side="right"),
        e - 1)

    def body(i, y):
        ex = block_expert[i]
        xb = jax.lax.dynamic_slice_in_dim(xs, i * block, block)
        h = jnp.einsum("bd,df->bf", xb, p["fc1"][ex], precision=prec,
                       preferred_element_type=F32).astype(x_ND.dtype)
        yb = jnp.einsum("bf,fd->bd", _activation(h, inner), p["fc2"][ex], precision=prec,
                        preferred_element_type=F32).astype(x_ND.dtype)
        return jax.lax.dynamic_update_slice_in_dim(y, yb, i * block, 0)

    y = jax.lax.fori_loop(0, pad_end[-1] // block, body, jnp.zeros((rows, d), x_ND.dtype))
    y_sorted = y[dest]
    y_assign = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    return y_assign.reshape(n, k, -1)


def moe_mlp(p, x_TD, k: int, with_routes: bool = False):
    """The mixture-of-experts MLP on [..., D] inputs; `with_routes` also returns the routing
    (ids, weights), each [..., k]."""
    lead, d = x_TD.shape[:-1], x_TD.shape[-1]
    x = x_TD.reshape(-1, d)
    ids, w = route(p, x, k)
    y = _apply_experts(p, x, ids, block_size(x.shape[0] * k, p["fc1"].shape[0]))
    out = _mix(y, w, x.dtype).reshape(*lead, d)
    if with_routes:
        return out, (ids.reshape(*lead, k), w.reshape(*lead, k))
    return out


def dense_reference(p, x_TD, k: int):
    """Every expert for every token, then the top-k mix: the straightforward formula the
    selected-experts schedule is tested (and benchmarked) against."""
    lead, d = x_TD.shape[:-1], x_TD.shape[-1]
    x = x_TD.reshape(-1, d)
    prec = matmul_precision(x.dtype)
    inner = p["fc2"].shape[1]
    ids, w = route(p, x, k)
    h = jnp.einsum("nd,edf->nef", x, p["fc1"], precision=prec,
                   preferred_element_type=F32).astype(x.dtype)
    y = jnp.einsum("nef,efd->ned", _activation(h, inner), p["fc2"], precision=prec,
                   preferred_element_type=F32).astype(x.dtype)
    y = jnp.take_along_axis(y, ids[..., None], axis=1)
    return _mix(y, w, x.dtype).reshape(*lead, d)
