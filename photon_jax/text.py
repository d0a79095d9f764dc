"""The text decoder (Phi-style parallel blocks), its KV cache and the LM head.

Pure functions over `params["text"]`.  One `forward` serves every use: the 730-position image
prefix (bidirectional inside the prefix), prompt prefill, one-token decode, for one row or
many.  Each row of the input writes its K/V at its own positions into its own cache row, and
the mask is built from positions, so rows never see each other and a row's result does not
depend on what else is in the batch.

KV cache layout: [L, R, S, K, H] (layers, cache rows, positions, kv heads, head dim).  K is
stored post-RoPE in the reference's interleaved order (rotated pairs (j, j+16) written to dims
2j, 2j+1), so a cache can be compared with the reference's directly.
"""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .config import MoondreamConfig, TextConfig
from .dtypes import F32, jnp_dtype
from .layers import attention, gelu_tanh, layer_norm, linear


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # [L, R, S, K, H]
    v: jax.Array  # [L, R, S, K, H]

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


def cache_shape(cfg: TextConfig, rows: int, length: int | None = None):
    return (cfg.n_layers, rows, length or cfg.max_context, cfg.n_kv_heads, cfg.head_dim)


def init_cache(cfg: MoondreamConfig, rows: int, length: int | None = None, dtype=None):
    shape = cache_shape(cfg.text, rows, length)
    dt = jnp_dtype(dtype or cfg.dtype)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


def rope_inv_freq(cfg: TextConfig) -> np.ndarray:
    # Computed on the host in float32 exactly as the reference does (theta ** (2j/rot)).
    rot = cfg.rope_dim
    exps = np.arange(0, rot, 2, dtype=np.float32)[: rot // 2] / np.float32(rot)
    return (np.float32(1.0) / np.power(np.float32(cfg.rope_theta), exps)).astype(np.float32)


def apply_rope(x_RTNH, pos_RT, cfg: TextConfig):
    """Rotate the first `rope_dim` dims (halves j and j+rot/2 as pairs), written interleaved."""
    rot, half = cfg.rope_dim, cfg.rope_dim // 2
    ang = pos_RT.astype(F32)[..., None] * jnp.asarray(rope_inv_freq(cfg))   # [R, T, half]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    xr = x_RTNH[..., :rot].astype(F32)
    re, im = xr[..., :half], xr[..., half:]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
    out = out.reshape(*x_RTNH.shape[:-1], rot).astype(x_RTNH.dtype)
    return jnp.concatenate([out, x_RTNH[..., rot:]], axis=-1)


def attention_mask(pos_RT, prefix_R, kv_len: int):
    """[R, T, S]: key j is visible from query position p if j <= p, or if both lie inside the
    row's bidirectional prefix (BOS + image; 0 for text-only rows)."""
    j = jnp.arange(kv_len)[None, None, :]
    p = pos_RT[:, :, None]
    pre = prefix_R[:, None, None]
    return (j <= p) | ((j < pre) & (p < pre))


def forward(pt, cfg: TextConfig, x_RTD, pos_RT, cache: KVCache, rows_R, prefix_R,
            kv_len: int):
    """Run the decoder on input embeddings; returns (hidden before post_ln [R,T,D], cache).

    `rows_R` are the cache rows written/read, `pos_RT` the absolute positions of the inputs,
    `kv_len` (static) how many cache positions are attended: cost scales with it, not with the
    cache's full length.  Positions at or past the cache length are dropped on write.
    """
    r, t, d = x_RTD.shape
    nh, kh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    mask = attention_mask(pos_RT, prefix_R, kv_len)

    def body(carry, layer):
        x, kc, vc = carry
        p, li = layer
        h = layer_norm(x, p["ln"])
        qkv = linear(h, p["qkv"])
        q = qkv[..., : nh * hd].reshape(r, t, nh, hd)
        k = qkv[..., nh * hd:(nh + kh) * hd].reshape(r, t, kh, hd)
        v = qkv[..., (nh + kh) * hd:].reshape(r, t, kh, hd)
        q = apply_rope(q, pos_RT, cfg)
        k = apply_rope(k, pos_RT, cfg)
        kc = kc.at[li, rows_R[:, None], pos_RT].set(k.astype(kc.dtype), mode="drop")
        vc = vc.at[li, rows_R[:, None], pos_RT].set(v.astype(vc.dtype), mode="drop")
        k_all = kc[li, rows_R, :kv_len]
        v_all = vc[li, rows_R, :kv_len]
        a = attention(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask)
        # (x + attn) + mlp, in the reference's order: it matters for bf16 rounding.
        x = x + linear(a, p["proj"])
        x = x + linear(gelu_tanh(linear(h, p["fc1"])), p["fc2"])
        return (x, kc, vc), None

    layers = (pt["blocks"], jnp.arange(cfg.n_layers))
    (x, kc, vc), _ = jax.lax.scan(body, (x_RTD, cache.k, cache.v), layers)
    return x, KVCache(kc, vc)


def logits(pt, hidden_RD):
    """post_ln + lm_head, float32 logits (rounded through the model dtype first, as the
    reference's bf16 logits are)."""
    return linear(layer_norm(hidden_RD, pt["post_ln"]), pt["lm_head"]).astype(F32)


def embed_tokens(pt, ids):
    return pt["wte"][ids]
