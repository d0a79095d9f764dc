"""The region model: Fourier-feature encoders for coordinates and sizes, the decoders, and
the bin -> value maps.

Decoders by config: Moondream 2's are MLPs (fc1 -> GELU(tanh) -> fc2); Moondream 3's are one
linear layer each after their own LayerNorm (`region.ln`).  Both read the text hidden state
*before* the final LayerNorm.  The rounding points in
bf16 mode are the reference's: round(2*pi*x) first, then the product with the feature matrix,
then cos/sin, each rounded to the model dtype.  Values (coordinates, sizes) are float32.
"""

import jax.numpy as jnp
import numpy as np

from ..base.dtypes import F32, matmul_precision
from .config import MoondreamConfig
from .layers import layer_norm, linear, mlp

TWO_PI = np.float32(2 * np.pi)


def fourier_features(x_NI, w_IF, dtype):
    """[..., I] values, [I, F] frequencies -> [..., 2F] (cos f, sin f), f = 2*pi*x @ w."""
    t = (TWO_PI * x_NI.astype(dtype).astype(F32)).astype(dtype)
    f = jnp.einsum("...i,if->...f", t, w_IF.astype(dtype), precision=matmul_precision(dtype),
                   preferred_element_type=F32).astype(dtype).astype(F32)
    return jnp.concatenate([jnp.cos(f), jnp.sin(f)], axis=-1).astype(dtype)


def encode_coordinate(pr, x_N, dtype):
    """[...] coordinates in [0, 1] -> [..., D] input embeddings."""
    return linear(fourier_features(x_N[..., None], pr["coord_features"], dtype),
                  pr["coord_encoder"])


def encode_size(pr, wh_N2, dtype):
    """[..., 2] (width, height) -> [..., D] input embeddings."""
    return linear(fourier_features(wh_N2, pr["size_features"], dtype), pr["size_encoder"])


def _decode(pr, hidden_ND, name):
    h = layer_norm(hidden_ND, pr["ln"]) if "ln" in pr else hidden_ND
    p = pr[name]
    return (mlp(h, p) if "fc1" in p else linear(h, p)).astype(F32)


def coord_logits(pr, hidden_ND):
    return _decode(pr, hidden_ND, "coord_decoder")


def size_logits(pr, hidden_ND):
    """[..., 2, bins]: row 0 width, row 1 height."""
    out = _decode(pr, hidden_ND, "size_decoder")
    return out.reshape(*out.shape[:-1], 2, -1)


def coord_value(bin_N, n_bins: int):
    """bin / n_bins (the reference divides by the bin count, 1024)."""
    return bin_N.astype(F32) / F32(n_bins)


def size_value(bin_N, n_bins: int):
    """2 ** (bin / (n_bins - 1) * 10 - 10): a log scale from 2^-10 to 1, in float32."""
    return jnp.exp2(bin_N.astype(F32) / F32(n_bins - 1) * F32(10.0) - F32(10.0))


def region_heads(params, hidden_RD, *, cfg: MoondreamConfig):
    """Each row's coordinate bin and value, size bins [R, 2] and values [R, 2] (argmax bins)
    from its hidden state, over the whole param dict."""
    r = cfg.region
    cbin = jnp.argmax(coord_logits(params["region"], hidden_RD), axis=-1).astype(jnp.int32)
    sbin = jnp.argmax(size_logits(params["region"], hidden_RD), axis=-1).astype(jnp.int32)
    return (cbin, coord_value(cbin, r.coord_out_dim), sbin,
            size_value(sbin, r.size_out_dim // 2))
