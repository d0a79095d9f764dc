"""Functional entry points: pure functions over the loaded params, for use inside your own
`jax.jit`, `jax.vmap` and `jax.grad`.

Owns the one-sequence view of the model: image encode, prefill into a dense KV cache, one
decode step, the region heads, and a greedy `generate` as a `lax.while_loop`.  Each function
takes `(params, cfg, ...)` -- `params` as `Model.load` gives them (text layers as per-layer
lists, LM head `w_vd`) or in the stacked checkpoint layout (`text.stack_layers`), `cfg` the
frozen `MoondreamConfig` (close over it, or mark it static) -- and works on ONE sequence:
batch with `jax.vmap`.  Nothing here calls `jax.jit`; these wrap the model modules' functions
(`vision.encode_image`, `text.image_prefix`, `text.prefill`), which `step` jits for the
engine and the oracle.

The cache is a `text.KVCache` of one sequence, k and v [L, S, K, H] each: position p of the
sequence at index p.  Axis letters (docs/architecture.md) plus: C crops, Z image patches
(729), N generated tokens.

    import jax, jax.numpy as jnp
    from photon_jax import functional as F
    from photon_jax.model import Model

    model = Model.load("out/tiny")
    cfg = model.cfg

    @jax.jit
    def caption(params, crops, src, ph, pw, prompt_T):
        img_ZD = F.encode_image(params, cfg, crops, src, ph, pw)
        x_TD = F.prompt_embeddings(params, cfg, img_ZD, prompt_T)
        logits_V, _, cache = F.prefill(params, cfg, x_TD, cache_len=x_TD.shape[0] + 20)
        return F.generate(params, cfg, logits_V, cache, x_TD.shape[0], max_tokens=20)

    ids_N = caption(model.params, *F.image_inputs(cfg, "photo.png"),
                    jnp.array(model.prompts.caption("short")))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .base.dtypes import jnp_dtype
from .model import pixels as image, region, sampling, text, vision
from .model.config import MoondreamConfig
from .model.text import KVCache

_I32 = jnp.int32


def image_inputs(cfg: MoondreamConfig, img):
    """Host side (NumPy): an image (path, bytes, PIL image or HxWx3 uint8 array) -> the
    operands of `encode_image`: crops_CHWc uint8 [C, 378, 378, 3], src_HW int32, ph_GH and
    pw_GW float32 (as `frontend.prepare_image` makes them, not uploaded).  Images with the
    same tiling have operands of the same shapes (and equal src / ph / pw)."""
    crops = image.make_crops(image.load_image(img), cfg.vision)
    src, ph, pw = image.pool_operands(crops.tiling, cfg.vision)
    return crops.crops, src, ph, pw


def encode_image(params, cfg: MoondreamConfig, crops_CHWc, src_HW, ph_GH, pw_GW):
    """Vision encoder + projection: -> img_ZD, the image embeddings [Z, D]."""
    return vision.encode_image(params, crops_CHWc, src_HW, ph_GH, pw_GW, cfg=cfg)[1]


def embed_tokens(params, cfg: MoondreamConfig, ids):
    """Token ids [...] -> input embeddings [..., D] in the model dtype."""
    return text.embed_tokens(params["text"], ids).astype(jnp_dtype(cfg.dtype))


def prompt_embeddings(params, cfg: MoondreamConfig, img_ZD, ids_T):
    """BOS + image embeddings + prompt tokens: [1 + Z + T, D], the input of `prefill` (its
    first `cfg.prefix_len` = 1 + Z positions are the bidirectional image prefix)."""
    prefix = text.image_prefix(params, img_ZD, cfg=cfg)[0]
    return jnp.concatenate([prefix, embed_tokens(params, cfg, ids_T)], axis=0)


def init_cache(cfg: MoondreamConfig, length: int) -> KVCache:
    """An empty one-sequence cache of `length` positions: k, v [L, S, K, H] zeros."""
    c = text.init_cache(cfg, rows=1, length=length)
    return KVCache(c.k[:, 0], c.v[:, 0])


def _forward(params, cfg, cache: KVCache, x_TD, start, last, prefix):
    """T inputs at positions start.. over the whole cache (`text.prefill` on a one-row view)
    -> (logits at index `last` [V], hidden [T, D], cache)."""
    def one(a):
        return jnp.reshape(jnp.asarray(a, _I32), (1,))

    pos_1T = (start + jnp.arange(x_TD.shape[0], dtype=_I32))[None]
    rows = KVCache(cache.k[:, None], cache.v[:, None])
    rows, hidden, _, lg = text.prefill(params, rows, x_TD[None], pos_1T, one(0), one(prefix),
                                       one(last), rows.k.shape[2], cfg=cfg)
    return lg[0], hidden[0], KVCache(rows.k[:, 0], rows.v[:, 0])


def prefill(params, cfg: MoondreamConfig, embeds_TD, *, cache_len: int | None = None,
            length=None, prefix: int | None = None):
    """Run the decoder over embeds_TD at positions 0..T-1 into a fresh cache of `cache_len`
    positions (static, default T; leave room for what you will decode).

    `length` (may be traced): the real positions; the logits are those of position
    length - 1 (default T).  Padding after it is harmless: its cache entries are overwritten
    by the decode steps from position `length` on before anything attends to them.
    `prefix`: the leading positions that attend each other bidirectionally (default
    `cfg.prefix_len`, BOS + image; 0 for a text-only sequence).

    -> (logits_V float32, hidden_TD (before the final LayerNorm: what `logits` and the
    region heads read), cache)."""
    t = embeds_TD.shape[0]
    cache_len = t if cache_len is None else cache_len
    if cache_len < t:
        raise ValueError(f"cache_len {cache_len} < {t} positions")
    last = t - 1 if length is None else jnp.asarray(length, _I32) - 1
    prefix = cfg.prefix_len if prefix is None else prefix
    return _forward(params, cfg, init_cache(cfg, cache_len), embeds_TD, 0, last, prefix)


def decode_embedding(params, cfg: MoondreamConfig, cache: KVCache, x_D, pos):
    """One decode step on an input embedding x_D at position `pos` (traced ok; < S): writes
    its K/V at `pos`, attends positions 0..pos.  -> (logits_V, hidden_D, cache)."""
    lg, h, cache = _forward(params, cfg, cache, x_D[None], pos, 0, 0)
    return lg, h[0], cache


def decode_step(params, cfg: MoondreamConfig, cache: KVCache, token, pos):
    """One decode step on a token id.  -> (logits_V, hidden_D, cache)."""
    return decode_embedding(params, cfg, cache, embed_tokens(params, cfg, token), pos)


def logits(params, cfg: MoondreamConfig, hidden_XD):
    """Hidden states [..., D] (from `prefill` / `decode_*`) -> float32 logits [..., V]."""
    return text.logits(params["text"], hidden_XD)


def decode_coordinate(params, cfg: MoondreamConfig, hidden_XD):
    """The region head's coordinate [...] float32 in [0, 1] (argmax bin / bins: how the
    reference reads x or y) from hidden states [..., D]."""
    b = sampling.greedy(region.coord_logits(params["region"], hidden_XD))
    return region.coord_value(b, cfg.region.coord_out_dim)


def decode_size(params, cfg: MoondreamConfig, hidden_XD):
    """The region head's size (width, height) [..., 2] float32 from hidden states [..., D]."""
    b = sampling.greedy(region.size_logits(params["region"], hidden_XD))
    return region.size_value(b, cfg.region.size_out_dim // 2)


def encode_coordinate(params, cfg: MoondreamConfig, x):
    """Coordinates [...] in [0, 1] -> input embeddings [..., D] (feed with `decode_embedding`)."""
    return region.encode_coordinate(params["region"], jnp.asarray(x, jnp.float32),
                                    jnp_dtype(cfg.dtype))


def encode_size(params, cfg: MoondreamConfig, wh_X2):
    """Sizes (width, height) [..., 2] -> input embeddings [..., D]."""
    return region.encode_size(params["region"], jnp.asarray(wh_X2, jnp.float32),
                              jnp_dtype(cfg.dtype))


def generate(params, cfg: MoondreamConfig, logits_V, cache: KVCache, pos, *, max_tokens: int):
    """Greedy decoding from a prefill's logits, as the reference does it: the first token is
    the argmax, later ones the argmax with the answer id banned; stop at EOS (not emitted) or
    after `max_tokens` (static) tokens.  `pos` (traced ok): the position of the first
    generated token, i.e. the prefill's length; the cache needs pos + max_tokens - 1 positions.

    A `lax.while_loop`, at most max_tokens - 1 decode steps; under `vmap` it runs until every
    sequence has stopped.  -> ids_N int32 [max_tokens], -1 after the last token."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    s = cache.k.shape[1]
    if isinstance(pos, (int, np.integer)) and pos + max_tokens - 1 > s:
        raise ValueError(f"a cache of {s} positions has no room for {max_tokens} tokens "
                         f"from position {pos}")
    tok = cfg.tokenizer
    ban_11 = jnp.full((1, 1), tok.answer_id, _I32)

    def cond(carry):
        i, ids_N, _ = carry
        return (i + 1 < max_tokens) & (ids_N[i] != tok.eos_id)

    def body(carry):
        i, ids_N, cache = carry
        lg, _, cache = decode_step(params, cfg, cache, ids_N[i], pos + i)
        nxt = sampling.greedy(sampling.apply_bans(lg[None], ban_11))[0]
        return i + 1, ids_N.at[i + 1].set(nxt), cache

    ids_N = jnp.full(max_tokens, -1, _I32).at[0].set(sampling.greedy(logits_V))
    _, ids_N, _ = jax.lax.while_loop(cond, body, (jnp.zeros((), _I32), ids_N, cache))
    return jnp.where(ids_N == tok.eos_id, -1, ids_N)
