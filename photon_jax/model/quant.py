"""Quantized weights: their layout in the parameter tree, how they are made, how they widen.

A quantized weight takes the place of a float weight leaf (a linear layer's "w" [K, N] or
the serving LM head's "w_vd" [N, K], an expert stack "fc1"/"fc2" [E, K, N]) as a small dict,
so every program sees its kind in the tree's structure and no flag travels beside it:

- per output channel, 8 bits ("int8", "fp8"): {"q": codes [..., K, N] int8 or
  float8_e4m3fn, "s": float32 [..., N]}; W[k, n] = q[k, n] * s[n].  (As "w_vd": q [N, K].)
  This is also the layout of Moondream 3.1's published FP8 experts (a scale per expert and
  output row), which therefore load code for code.
- per group of `g` input rows, 4 bits ("int4"): {"q4": uint8 [..., K/2, N], "s4", "z4":
  float32 [..., K/g, N]}; rows k < K/2 are the low nibbles of q4[k], rows k >= K/2 the high
  nibbles of q4[k - K/2], and W[k, n] = (code - z4[k // g, n]) * s4[k // g, n] with codes
  0..15 and a float zero point, both steps rounded to bfloat16 as Moondream 2's reference
  rounds them (`dequantize`).  g = gcd(128, K): 128 for every real Moondream layer.
  Moondream 2's published 4-bit layers (flat groups of 128 of the row-major torch weight,
  the same asymmetric rule) are repacked into this layout at conversion, value for value;
  where K is not a multiple of 128 a flat group runs over a row's end, and each of its
  g-row runs takes its scale and zero point (`convert/quantized.py`).

Why the split halves rather than adjacent pairs in a byte: unpacking is two whole-array ops
(`& 15`, `>> 4`) and a concatenate, which XLA fuses into the product's operand, and the CPU
kernel reads both halves as contiguous rows.  The scales stay float32: they are 1/K of the
codes' bytes per output (int8) or 1/16 (int4 at g = 128).

Widening happens next to the product, in the program (`dense_weight`): XLA on GPU and TPU
fuses the convert-and-scale into the dot's operand read, so HBM holds and streams the codes;
on CPU the decode step's kernel widens in registers (`kernels/cpukernel`).  The numbers are
the dequantized weight rounded once to the compute dtype (int4: through bfloat16, as the
reference does), so a quantized model computes exactly what the same model with its weights
dequantized in that dtype computes.

Which leaves are quantized is the config's `weights` (`config.Weights`): the text model's
linear layers (qkv, proj, the dense MLP), the experts, the LM head, the region model's
linears (Moondream 2's 4-bit release when its config asks).  The vision encoder, the
embedding table, the router, tau and every bias and LayerNorm stay in the model dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FORMATS = ("int8", "fp8", "int4")
GROUP = 128
# The code dtypes, by format.
CODE_DTYPE = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
              "int4": np.dtype(np.uint8)}
# Largest code magnitude: the scale maps the channel's largest |w| onto it.
_QMAX = {"int8": 127.0, "fp8": 448.0}
CHANNEL_PARTS = ("q", "s")
GROUP_PARTS = ("q4", "s4", "z4")
PARTS = CHANNEL_PARTS + GROUP_PARTS


class QuantError(ValueError):
    pass


def check_format(fmt: str, what: str = "weights") -> str:
    if fmt not in FORMATS:
        raise QuantError(f"{what}={fmt!r} is not a weight format; choose one of "
                         f"{', '.join(FORMATS)} (or leave it unset for the checkpoint's "
                         "own weights)")
    return fmt


def is_quantized(w) -> bool:
    return isinstance(w, dict) and ("q" in w or "q4" in w)


def group_size(k: int) -> int:
    return math.gcd(GROUP, k)


def logical_shape(w, transposed: bool = False) -> tuple[int, ...]:
    """The float weight's shape ([..., K, N]; [N, K] for a transposed head)."""
    if not is_quantized(w):
        return tuple(w.shape)
    if "q" in w:
        return tuple(w["q"].shape)
    *lead, half, n = w["q4"].shape
    return (*lead, 2 * half, n)


def specs(shape: tuple[int, ...], fmt: str) -> dict:
    """{part: (shape, dtype)} of a weight of float shape [..., K, N] in format `fmt`."""
    *lead, k, n = shape
    if fmt == "int4":
        if k % 2:
            raise QuantError(f"int4 needs an even input dimension, got {k}")
        g = group_size(k)
        return {"q4": ((*lead, k // 2, n), CODE_DTYPE["int4"]),
                "s4": ((*lead, k // g, n), np.dtype(np.float32)),
                "z4": ((*lead, k // g, n), np.dtype(np.float32))}
    return {"q": ((*lead, k, n), CODE_DTYPE[fmt]), "s": ((*lead, n), np.dtype(np.float32))}


def nbytes(shape: tuple[int, ...], fmt: str | None, dtype) -> int:
    """Bytes of a weight of float shape `shape` stored as `fmt` (None: float `dtype`)."""
    if not fmt:
        return int(np.prod(shape)) * np.dtype(dtype).itemsize
    return sum(int(np.prod(s)) * d.itemsize for s, d in specs(shape, fmt).values())


# -- making codes -------------------------------------------------------------------------

def quantize(w, fmt: str, xp=np) -> dict:
    """A float weight [..., K, N] -> its quantized dict.  `xp`: NumPy (what conversion and
    `Model.load(weights=)` use, on the host) or jax.numpy (inside a program; XLA:CPU's
    division in a fused loop is not IEEE-exact, so a code may differ by one there)."""
    check_format(fmt)
    w = xp.asarray(w).astype(np.float32)
    if fmt == "int4":
        *lead, k, n = w.shape
        g = group_size(k)
        wg = w.reshape(*lead, k // g, g, n)
        lo, hi = wg.min(axis=-2), wg.max(axis=-2)
        # Asymmetric: the group's [min, max] onto codes 0..15, the float zero point placing
        # the minimum at code 0 (Moondream 2's 4-bit rule); a constant group gets scale 1.
        # (Multiplications by constants: XLA turns a division by a constant into one, and
        # the host and device quantizers must give the same codes.)
        s = xp.where(hi > lo, (hi - lo) * np.float32(1 / 15), np.float32(1))
        z = -lo / s
        codes = xp.clip(xp.rint(wg / s[..., None, :] + z[..., None, :]), 0, 15)
        codes = codes.reshape(*lead, k, n).astype(np.uint8)
        return {"q4": pack_nibbles(codes, xp), "s4": s.astype(np.float32),
                "z4": z.astype(np.float32)}
    amax = xp.abs(w).max(axis=-2)
    s = xp.where(amax > 0, amax * np.float32(1 / _QMAX[fmt]), np.float32(1))
    x = w / s[..., None, :]
    if fmt == "int8":
        q = xp.clip(xp.rint(x), -127, 127).astype(np.int8)
    else:
        q = xp.clip(x, -448, 448).astype(CODE_DTYPE["fp8"])
    return {"q": q, "s": s.astype(np.float32)}


def pack_nibbles(codes, xp=np):
    """uint8 codes 0..15 [..., K, N] -> [..., K/2, N]: row k's low nibble is code row k,
    its high nibble code row k + K/2."""
    half = codes.shape[-2] // 2
    return (codes[..., :half, :] | (codes[..., half:, :] << 4)).astype(np.uint8)


def unpack_nibbles(q4, xp=jnp):
    return xp.concatenate([q4 & 15, q4 >> 4], axis=-2)


# -- widening -----------------------------------------------------------------------------

def dequantize(w, dtype, transposed: bool = False, xp=jnp):
    """The float weight of a quantized dict, computed in float32 and rounded once to `dtype`
    (a float array passes through, cast).  `transposed`: a "w_vd" head, codes [N, K]."""
    if not is_quantized(w):
        return w.astype(dtype)
    if "q" in w:
        s = w["s"][..., :, None] if transposed else w["s"][..., None, :]
        return (w["q"].astype(np.float32) * s).astype(dtype)
    if transposed:
        raise QuantError("a 4-bit weight is never held transposed")
    codes = unpack_nibbles(w["q4"], xp).astype(np.float32)
    *lead, k, n = codes.shape
    groups = w["s4"].shape[-2]
    c = codes.reshape(*lead, groups, k // groups, n)
    # Moondream 2's reference widens its 4-bit weights in a bfloat16 buffer, whatever the
    # model's dtype: q - zero rounded to bfloat16, times the scale rounded again.  Its
    # greedy ids depend on those roundings (they change 2 of 8 golden cases), so every
    # 4-bit weight widens that way.  `reduce_precision`, not a cast pair: XLA may drop a
    # float32 -> bfloat16 -> float32 round trip as excess precision; it keeps this op.
    out = _bf16(_bf16(c - w["z4"][..., None, :], xp) * w["s4"][..., None, :], xp)
    return out.reshape(*lead, k, n).astype(dtype)


def _bf16(x, xp):
    """float32 values rounded to bfloat16's precision (nearest even), kept float32."""
    if xp is np:
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def widen_for(x, w, dtype, transposed: bool = False):
    """(x, w widened to `dtype`) with the widening ordered after `x` exists: an
    optimization barrier on the pair, so XLA cannot hoist every layer's widening (which
    depends on the weights alone) to the program's start and keep all their copies live at
    once (compiled for a v5e 2x2 at Moondream 3.1's shapes, a prefill held 2.8 GB of
    widened experts per chip; with the barrier, one layer's at a time).  A float weight
    passes through untouched."""
    if not is_quantized(w):
        return x, w
    x, w = jax.lax.optimization_barrier((x, w))
    return x, dequantize(w, dtype, transposed)


def take(w, idx):
    """Expert(s) `idx` of an expert stack (float or quantized): indexes every part's
    leading expert axis, so only the selected experts' codes are read."""
    if not is_quantized(w):
        return w[idx]
    return {k: v[idx] for k, v in w.items()}


def transpose_head(w):
    """A [K, N] weight as the serving head's [N, K] ("w_vd")."""
    if not is_quantized(w):
        return w.T
    if "q" not in w:
        raise QuantError("a 4-bit LM head is not supported (the head is kept 8-bit)")
    return {"q": w["q"].T, "s": w["s"]}


def untranspose_head(w):
    if not is_quantized(w):
        return w.T
    return {"q": w["q"].T, "s": w["s"]}


def tree_nbytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))
