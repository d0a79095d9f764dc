"""The text decoder (Phi-style parallel blocks), its KV cache and the LM head.

Moondream 3 adds, by config: tau attention in every layer (q and v scaled per token and head
before RoPE and before the cache write), and mixture-of-experts MLPs (`moe.py`) in the
layers from `text.moe.start_layer` on.  The dense layers and the MoE layers are two stacked
groups (`params["text"]["blocks"]`, `["moe_blocks"]`), each run by one `lax.scan`.

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

from . import moe
from .config import MoondreamConfig, TextConfig
from .dtypes import F32, jnp_dtype, matmul_precision
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


def tau_factors(p, qkv_RTQ, pos_RT):
    """Tau attention's per-head scales of q and v, each [R, T, N]: tanh(GELU_erf(qkv) @ w)
    plus the position term 1 + (sigmoid(alpha * ln(p + 1)) - 0.5).

    p + 1 is formed in the model dtype, as the reference does (bf16 rounds positions above
    256: 730 -> 728); the log and sigmoid then run in float32 and the term is rounded once.
    (Rounding the log too, op by op, moved our bf16 hidden states twice as far from the
    float32 oracle as the oracle's own bf16 run.)"""
    dt = qkv_RTQ.dtype
    u = moe.gelu_erf(qkv_RTQ)
    prec = matmul_precision(dt)

    def tok(w):
        return jnp.tanh(jnp.einsum("rtq,qn->rtn", u, w, precision=prec,
                                   preferred_element_type=F32).astype(dt))

    logp = jnp.log((pos_RT.astype(dt) + jnp.asarray(1, dt)).astype(F32))
    alpha = p["alpha"].astype(F32)[None, None, :]
    tp = (1 + (jax.nn.sigmoid(alpha * logp[..., None]) - 0.5)).astype(dt)
    return tok(p["wq"]) + tp, tok(p["wv"]) + tp


def _dense_mlp(p, h, cfg):
    return linear(gelu_tanh(linear(h, p["fc1"])), p["fc2"]), None


def _moe_mlp(p, h, cfg):
    return moe.moe_mlp(p["moe"], h, cfg.moe.experts_per_token, with_routes=True)


def forward(pt, cfg: TextConfig, x_RTD, pos_RT, cache: KVCache, rows_R, prefix_R,
            kv_len: int, with_routes: bool = False):
    """Run the decoder on input embeddings; returns (hidden before post_ln [R,T,D], cache),
    and with `with_routes` also the MoE routing (expert ids, weights), each [Lm, R, T, k]
    over the MoE layers in order (None without MoE layers).

    `rows_R` are the cache rows written/read, `pos_RT` the absolute positions of the inputs,
    `kv_len` (static) how many cache positions are attended: cost scales with it, not with the
    cache's full length.  Positions at or past the cache length are dropped on write.
    """
    r, t, d = x_RTD.shape
    nh, kh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    mask = attention_mask(pos_RT, prefix_R, kv_len)

    def block(mlp):
        def body(carry, layer):
            x, kc, vc = carry
            p, li = layer
            h = layer_norm(x, p["ln"])
            qkv = linear(h, p["qkv"])
            q = qkv[..., : nh * hd].reshape(r, t, nh, hd)
            k = qkv[..., nh * hd:(nh + kh) * hd].reshape(r, t, kh, hd)
            v = qkv[..., (nh + kh) * hd:].reshape(r, t, kh, hd)
            if cfg.tau:
                tq, tv = tau_factors(p["tau"], qkv, pos_RT)
                q = q * tq[..., None]
                # One factor per query head; kv head j takes head j's (all heads have their
                # own kv head in Moondream 3).
                v = v * tv[..., :kh, None]
            q = apply_rope(q, pos_RT, cfg)
            k = apply_rope(k, pos_RT, cfg)
            kc = kc.at[li, rows_R[:, None], pos_RT].set(k.astype(kc.dtype), mode="drop")
            vc = vc.at[li, rows_R[:, None], pos_RT].set(v.astype(vc.dtype), mode="drop")
            k_all = kc[li, rows_R, :kv_len]
            v_all = vc[li, rows_R, :kv_len]
            a = attention(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask)
            # (x + attn) + mlp, in the reference's order: it matters for bf16 rounding.
            x = x + linear(a, p["proj"])
            m, routes = mlp(p, h, cfg)
            return (x + m, kc, vc), routes
        return body

    carry, routes = (x_RTD, cache.k, cache.v), None
    if cfg.n_dense:
        carry, _ = jax.lax.scan(block(_dense_mlp), carry,
                                (pt["blocks"], jnp.arange(cfg.n_dense)))
    if cfg.n_moe:
        carry, routes = jax.lax.scan(block(_moe_mlp), carry,
                                     (pt["moe_blocks"], cfg.n_dense + jnp.arange(cfg.n_moe)))
    x, kc, vc = carry
    if with_routes:
        return x, KVCache(kc, vc), routes
    return x, KVCache(kc, vc)


def logits(pt, hidden_RD):
    """post_ln + lm_head, float32 logits (rounded through the model dtype first, as the
    reference's bf16 logits are)."""
    return linear(layer_norm(hidden_RD, pt["post_ln"]), pt["lm_head"]).astype(F32)


def embed_tokens(pt, ids):
    return pt["wte"][ids]
