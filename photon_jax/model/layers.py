"""Small pure building blocks shared by the vision, text and region models.

Parameters are plain dicts: a linear layer is {"w": [in, out], "b": [out]} (the checkpoint's
torch [out, in] weights are transposed once, by the converter), a LayerNorm is {"w", "b"}.
Each function computes in float32 where the reference's numerics demand it and returns the
input's dtype, so the same code runs the float32 parity model and the bf16 serving model.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp

from ..base.dtypes import F32, matmul_precision
from . import quant

LN_EPS = 1e-5


def linear(x, p):
    """x @ w + b, accumulated in float32, returned in x's dtype.  The weight is p["w"]
    [in, out], or p["w_vd"] [out, in] (the serving LM head: `text.unstack_layers`), float
    or quantized (`quant`: widened here, in the program, next to the product)."""
    transposed = "w_vd" in p
    spec, w = ("...i,oi->...o", p["w_vd"]) if transposed else ("...i,io->...o", p["w"])
    x, w = quant.widen_for(x, w, x.dtype, transposed)
    if math.prod(x.shape[:-1]) == 1 and x.dtype == jnp.bfloat16 == w.dtype:
        y = jax.lax.platform_dependent(x, w, cpu=partial(_one_row_cpu, transposed=transposed),
                                       default=partial(_product, spec))
    else:
        y = _product(spec, x, w)
    return (y + p["b"].astype(F32)).astype(x.dtype)


def _product(spec, x, w):
    return jnp.einsum(spec, x, w, precision=matmul_precision(x.dtype), preferred_element_type=F32)


def _one_row_cpu(x, w, *, transposed: bool):
    """One bfloat16 row times a bfloat16 weight on XLA:CPU, as two rows (a zero row added):
    for one row XLA:CPU widens the whole weight to float32 first (measured, width 2048: a
    [2048, 8192] weight 20.7 ms for one row, 3.9 ms for two; the [51200, 2048] LM head
    124 ms against 13 ms), while two rows take its bfloat16 product."""
    x2 = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
    y = _product("mi,oi->mo" if transposed else "mi,io->mo", x2, w)
    return y[:1].reshape(*x.shape[:-1], y.shape[-1])


def layer_norm(x, p):
    xf = x.astype(F32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + LN_EPS)
    return (y * p["w"].astype(F32) + p["b"].astype(F32)).astype(x.dtype)


def gelu_tanh(x):
    # The reference uses torch's tanh-approximate GELU everywhere in Moondream 2.
    return jax.nn.gelu(x.astype(F32), approximate=True).astype(x.dtype)


def mlp(x, p, dense=linear):
    """fc1 -> GELU(tanh) -> fc2; p = {"fc1": linear, "fc2": linear}.  `dense`: what computes
    a linear layer (`linear`, or the decode step's CPU kernel `cpukernel.linear`)."""
    return dense(gelu_tanh(dense(x, p["fc1"])), p["fc2"])


def attention(q_RTQH, k_RSKH, v_RSKH, mask_RTS=None):
    """Scaled dot-product attention with grouped KV heads.

    KV head k serves the contiguous query heads [k*G, (k+1)*G), as the reference's
    `enable_gqa` does.  Scores and softmax in float32.
    """
    b, t, n, h = q_RTQH.shape
    kh = k_RSKH.shape[2]
    g = n // kh
    q = q_RTQH.reshape(b, t, kh, g, h)
    prec = matmul_precision(q_RTQH.dtype)
    s = jnp.einsum("btkgh,bskh->bkgts", q, k_RSKH, precision=prec,
                   preferred_element_type=F32) * (h ** -0.5)
    if mask_RTS is not None:
        s = jnp.where(mask_RTS[:, None, None, :, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    # The product in its natural order (batch dimensions first), cast, then moved: asked
    # for as "btkgh" in float32, XLA:GPU fused the move and the cast into the next layer's
    # GEMM as a transposed operand it found no Triton tiling for (the vision encoder's
    # output projection, compiled for an H200: bench/gpu_compile.py).  Same values.
    o = jnp.einsum("bkgts,bskh->bkgth", p.astype(v_RSKH.dtype), v_RSKH, precision=prec,
                   preferred_element_type=F32).astype(q_RTQH.dtype)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t, n * h)


def attention_mask(pos_RT, prefix_R, kv_len: int, vis_RT=None):
    """[R, T, S]: key j is visible from query position p if j <= p, or if both lie inside the
    row's bidirectional prefix (BOS + image; 0 for text-only rows).  `vis_RT` (image blocks
    inside the prompt): also every key j <= vis_RT[r, t], which is the last position of the
    query's image block for a position inside one (the whole block, bidirectionally, and
    everything before it) and the position itself elsewhere."""
    j = jnp.arange(kv_len)[None, None, :]
    p = pos_RT[:, :, None]
    pre = prefix_R[:, None, None]
    mask = (j <= p) | ((j < pre) & (p < pre))
    if vis_RT is not None:
        mask = mask | (j <= vis_RT[:, :, None])
    return mask
