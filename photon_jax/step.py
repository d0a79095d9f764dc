"""The one place that calls `jax.jit`: every device program of the model, compiled per config.

`build(cfg)` returns a `Programs` bundle.  All functions take arrays positionally; static
arguments are only the shape buckets (`kv_len`).  The KV cache is donated into every call that
writes it and handed back, so it is updated in place.

Input kinds of a decode row (`kind_R`): 0 = token id, 1 = coordinate value, 2 = size value.
Detect/point feed region values back as embeddings, so one decode program serves text and
region steps and rows of different kinds can share a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

from . import region, sampling, text, vision
from .config import MoondreamConfig
from .dtypes import jnp_dtype

KIND_TOKEN, KIND_COORD, KIND_SIZE = 0, 1, 2


def input_embeddings(params, cfg: MoondreamConfig, kind_R, token_R, value_R2):
    """[R, D] embeddings of one input per row: a token, a coordinate, or a (w, h) size."""
    dt = jnp_dtype(cfg.dtype)
    tok = text.embed_tokens(params["text"], token_R).astype(dt)
    coord = region.encode_coordinate(params["region"], value_R2[:, 0], dt)
    size = region.encode_size(params["region"], value_R2, dt)
    k = kind_R[:, None]
    return jnp.where(k == KIND_COORD, coord, jnp.where(k == KIND_SIZE, size, tok))


def _encode_image(params, crops_u8, src, ph, pw, *, cfg):
    dt = jnp_dtype(cfg.dtype)
    feats = vision.encode_crops(params["vision"], crops_u8, cfg.vision, dt)
    return feats, vision.project(params["vision"], feats, src, ph, pw)


def _prefill(params, cache, embeds_RTD, pos_RT, rows_R, prefix_R, last_R, kv_len, *, cfg):
    hidden, cache = text.forward(params["text"], cfg.text, embeds_RTD, pos_RT, cache, rows_R,
                                 prefix_R, kv_len)
    last = jnp.take_along_axis(hidden, last_R[:, None, None], axis=1)[:, 0]
    return cache, hidden, last, text.logits(params["text"], last)


def _decode(params, cache, kind_R, token_R, value_R2, pos_R, rows_R, prefix_R, kv_len, *, cfg):
    x = input_embeddings(params, cfg, kind_R, token_R, value_R2)[:, None]
    hidden, cache = text.forward(params["text"], cfg.text, x, pos_R[:, None], cache, rows_R,
                                 prefix_R, kv_len)
    h = hidden[:, 0]
    return cache, h, text.logits(params["text"], h)


def _embed_prompt(params, ids_RT, *, cfg):
    return text.embed_tokens(params["text"], ids_RT).astype(jnp_dtype(cfg.dtype))


def _image_prefix(params, img_emb_PD, *, cfg):
    """[1, 1 + P, D]: BOS embedding then the image embeddings."""
    bos = text.embed_tokens(params["text"], jnp.array([cfg.tokenizer.bos_id]))
    return jnp.concatenate([bos.astype(img_emb_PD.dtype), img_emb_PD], axis=0)[None]


def _region_heads(params, hidden_RD, *, cfg):
    """Coordinate bin/value and size bins/values for each row's hidden state."""
    r = cfg.region
    cl = region.coord_logits(params["region"], hidden_RD)
    cbin = jnp.argmax(cl, axis=-1).astype(jnp.int32)
    sl = region.size_logits(params["region"], hidden_RD)
    sbin = jnp.argmax(sl, axis=-1).astype(jnp.int32)
    return (cbin, region.coord_value(cbin, r.coord_out_dim), sbin,
            region.size_value(sbin, r.size_out_dim // 2))


def _read_prefix(cache, row, *, n: int):
    return cache.k[:, row, :n], cache.v[:, row, :n]


def _write_prefix(cache, k_LPKH, v_LPKH, row):
    n = k_LPKH.shape[1]
    k = cache.k.at[:, row, :n].set(k_LPKH)
    v = cache.v.at[:, row, :n].set(v_LPKH)
    return text.KVCache(k, v)


@dataclass(frozen=True)
class Programs:
    cfg: MoondreamConfig
    encode_image: Callable
    prefill: Callable
    decode: Callable
    embed_prompt: Callable
    image_prefix: Callable
    region_heads: Callable
    sample: Callable
    read_prefix: Callable
    write_prefix: Callable


def build(cfg: MoondreamConfig) -> Programs:
    c = {"cfg": cfg}
    return Programs(
        cfg=cfg,
        encode_image=jax.jit(partial(_encode_image, **c)),
        prefill=jax.jit(partial(_prefill, **c), static_argnums=(7,), donate_argnums=(1,)),
        decode=jax.jit(partial(_decode, **c), static_argnums=(8,), donate_argnums=(1,)),
        embed_prompt=jax.jit(partial(_embed_prompt, **c)),
        image_prefix=jax.jit(partial(_image_prefix, **c)),
        region_heads=jax.jit(partial(_region_heads, **c)),
        sample=jax.jit(sampling.sample),
        read_prefix=jax.jit(partial(_read_prefix, n=cfg.prefix_len)),
        write_prefix=jax.jit(_write_prefix, donate_argnums=(0,)),
    )


def kv_bucket(n: int, max_context: int, step: int = 256) -> int:
    """Attended KV length for a sequence of n positions: a multiple of `step`, capped."""
    return min(max_context, -(-max(n, 1) // step) * step)


def prompt_bucket(n: int, step: int = 16) -> int:
    return -(-max(n, 1) // step) * step
