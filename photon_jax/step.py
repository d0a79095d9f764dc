"""The one place that calls `jax.jit`: every device program of the model, compiled per config.

`build(cfg)` returns a `Programs` bundle.  All functions take arrays positionally; static
arguments are only the shape buckets (`kv_len`).  The KV cache is donated into every call that
writes it and handed back, so it is updated in place.

The engine's programs are `forward` (decode R rows into a slot), `prefill_slot` (prompt
prefill into a slot) and `sample_step` (constrained sampling of a slot's rows into the
pending buffers): forward and sample are separate so the constraint of step t+1 can be
built on the host after step t is committed.  `ceiling` iterates forward + sample inside one
jitted loop: the device-only bound of the benchmark.

Input kinds of a decode row (`kind_R`): 0 = token id, 1 = coordinate value, 2 = size value.
Detect/point feed region values back as embeddings, so one decode program serves text and
region steps and rows of different kinds can share a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import jax
import jax.numpy as jnp

import flax.struct
import numpy as np

from . import region, sampling, skills, text, vision
from .config import MoondreamConfig
from .dtypes import F32, jnp_dtype

KIND_TOKEN, KIND_COORD, KIND_SIZE = 0, 1, 2

# Rows of the per-step metadata array `meta_FR` (int32 [4, R]), uploaded once per launch.
M_ROW, M_POS, M_PREFIX, M_LAST = range(4)
# Rows of the per-step sampling array `samp_FR` (int32 [5 + A, R]), uploaded once per
# finalize: constraint id, token index, seed, temperature and top_p (float32 bits), then A
# rows of an optional per-row allowed-id set (-1 = unused).
S_CONSTRAINT, S_INDEX, S_SEED, S_TEMP, S_TOP_P, S_ALLOW = range(6)


@flax.struct.dataclass
class Slot:
    """Per-step buffers, preallocated at the maximum step size; a step uses the first R rows.
    Two of these alternate; each is donated into the call that writes it."""
    logits: jax.Array   # [Rs, V] float32: forward output, read by sample
    hidden: jax.Array   # [Rs, D]: last hidden before post_ln (region heads read it)
    out: jax.Array      # [Rs, 3] int32: sampled id, value x bits, value y bits (host reads)


@flax.struct.dataclass
class Pending:
    """Device-resident next inputs per cache row: what the next forward of that row feeds."""
    kind: jax.Array     # [Rc] int32: KIND_TOKEN / KIND_COORD / KIND_SIZE
    token: jax.Array    # [Rc] int32
    value: jax.Array    # [Rc, 2] float32: coordinate (x, 0) or size (w, h)


@flax.struct.dataclass
class Tables:
    """The constraint table: one row per constraint id of `skills`, indexed by one int per
    row and step, so a step uploads R ints instead of an [R, V] mask."""
    ban: jax.Array        # [M, V] bool: True = logit set to -inf
    remap: jax.Array      # [M] int32: sampled ids become this id (-1 = keep)
    keep_eos: jax.Array   # [M] bool: ...except EOS, which stays EOS
    coord_kind: jax.Array  # [M] bool: a sampled coord id carries a coordinate value
    size_kind: jax.Array   # [M] bool: a sampled size id carries a (w, h) value


def make_tables(cfg: MoondreamConfig) -> dict:
    """Host (NumPy) contents of the constraint table."""
    t, v = cfg.tokenizer, cfg.text.vocab_size
    m = skills.N_CONSTRAINTS
    ban = np.zeros((m, v), bool)
    ban[skills.BAN_ANSWER, t.answer_id] = True
    ban[skills.REASON, [t.eos_id, t.size_id]] = True
    remap = np.full(m, -1, np.int32)
    remap[[skills.SPATIAL_X, skills.FORCE_COORD]] = t.coord_id
    remap[skills.FORCE_SIZE] = t.size_id
    keep_eos = np.zeros(m, bool)
    keep_eos[skills.SPATIAL_X] = True
    coord_kind = np.zeros(m, bool)
    coord_kind[[skills.SPATIAL_X, skills.FORCE_COORD, skills.REASON_FIRST, skills.REASON,
                skills.SEGMENT]] = True
    size_kind = np.zeros(m, bool)
    size_kind[[skills.FORCE_SIZE, skills.SEGMENT]] = True
    return dict(ban=ban, remap=remap, keep_eos=keep_eos, coord_kind=coord_kind,
                size_kind=size_kind)


def init_slot(cfg: MoondreamConfig, rows: int) -> Slot:
    dt = jnp_dtype(cfg.dtype)
    return Slot(jnp.zeros((rows, cfg.text.vocab_size), F32), jnp.zeros((rows, cfg.text.dim), dt),
                jnp.zeros((rows, 3), jnp.int32))


def init_pending(rows: int) -> Pending:
    return Pending(jnp.zeros(rows, jnp.int32), jnp.zeros(rows, jnp.int32),
                   jnp.zeros((rows, 2), F32))


def input_embeddings(params, cfg: MoondreamConfig, kind, token, value):
    """[..., D] embeddings of inputs: a token, a coordinate, or a (w, h) size each (any
    leading shape: decode rows, or prompt positions with spatial refs)."""
    dt = jnp_dtype(cfg.dtype)
    tok = text.embed_tokens(params["text"], token).astype(dt)
    coord = region.encode_coordinate(params["region"], value[..., 0], dt)
    size = region.encode_size(params["region"], value, dt)
    k = kind[..., None]
    return jnp.where(k == KIND_COORD, coord, jnp.where(k == KIND_SIZE, size, tok))


def _encode_image(params, crops_u8, src, ph, pw, *, cfg):
    dt = jnp_dtype(cfg.dtype)
    feats = vision.encode_crops(params["vision"], crops_u8, cfg.vision, dt)
    return feats, vision.project(params["vision"], feats, src, ph, pw)


def _prefill(params, cache, embeds_RTD, pos_RT, rows_R, prefix_R, last_R, kv_len, *, cfg,
             with_routes=False):
    """`with_routes` (parity traces): also the MoE routing at each row's last position,
    (ids, weights) each [Lm, R, k]."""
    hidden, cache, routes = text.forward(params["text"], cfg.text, embeds_RTD, pos_RT, cache,
                                         rows_R, prefix_R, kv_len, with_routes=True)
    last = jnp.take_along_axis(hidden, last_R[:, None, None], axis=1)[:, 0]
    out = (cache, hidden, last, text.logits(params["text"], last))
    if not with_routes:
        return out
    at_last = jax.tree.map(lambda a: jnp.take_along_axis(a, last_R[None, :, None, None],
                                                         axis=2)[:, :, 0], routes)
    return (*out, at_last)


def _decode(params, cache, kind_R, token_R, value_R2, pos_R, rows_R, prefix_R, kv_len, *, cfg,
            with_routes=False):
    """`with_routes` (parity traces): also the MoE routing, (ids, weights) each [Lm, R, k]."""
    x = input_embeddings(params, cfg, kind_R, token_R, value_R2)[:, None]
    hidden, cache, routes = text.forward(params["text"], cfg.text, x, pos_R[:, None], cache,
                                         rows_R, prefix_R, kv_len, with_routes=True)
    h = hidden[:, 0]
    out = (cache, h, text.logits(params["text"], h))
    if not with_routes:
        return out
    return (*out, jax.tree.map(lambda a: a[:, :, 0], routes))


def _forward(params, cache, slot: Slot, pending: Pending, meta_FR, kv_len, *, cfg):
    """One decode step for R rows: inputs gathered on the device from the pending buffers by
    cache row (never through the host), logits and hidden written into the slot."""
    rows = meta_FR[M_ROW]
    cache, h, lg = _decode(params, cache, pending.kind[rows], pending.token[rows],
                           pending.value[rows], meta_FR[M_POS], rows, meta_FR[M_PREFIX], kv_len,
                           cfg=cfg)
    return cache, _into_slot(slot, h, lg)


def _into_slot(slot: Slot, h_RD, logits_RV) -> Slot:
    return slot.replace(logits=slot.logits.at[: h_RD.shape[0]].set(logits_RV),
                        hidden=slot.hidden.at[: h_RD.shape[0]].set(h_RD.astype(slot.hidden.dtype)))


def _prefill_slot(params, cache, slot: Slot, kinds_RT, ids_RT, values_RT2, meta_FR, kv_len, *,
                  cfg):
    """Prompt prefill for R rows starting at per-row positions (after an image prefix, or 0
    for text-only prompts); the last real position's logits and hidden go into the slot.
    Prompt positions of kind coord / size (spatial refs) embed their values."""
    t = ids_RT.shape[1]
    pos = meta_FR[M_POS][:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    emb = input_embeddings(params, cfg, kinds_RT, ids_RT, values_RT2)
    cache, _, last, lg = _prefill(params, cache, emb, pos, meta_FR[M_ROW], meta_FR[M_PREFIX],
                                  meta_FR[M_LAST], kv_len, cfg=cfg)
    return cache, _into_slot(slot, last, lg)


def _sample_step(params, slot: Slot, pending: Pending, tables: Tables, meta_FR, samp_FR, *, cfg):
    """Sample R rows of a forwarded step under their constraints; decode region values; write
    the host-bound results into the slot and the next inputs into the pending buffers."""
    r = meta_FR.shape[1]
    tok_cfg = cfg.tokenizer
    rows = meta_FR[M_ROW]
    cons = samp_FR[S_CONSTRAINT]
    logits = slot.logits[:r]
    ban = tables.ban[cons]
    allow_RA = samp_FR[S_ALLOW:].T
    restricted = jnp.any(allow_RA >= 0, axis=1)
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    allowed = jnp.any(ids[None, None, :] == allow_RA[:, :, None], axis=1)
    ban = ban | (restricted[:, None] & ~allowed)
    temp = jax.lax.bitcast_convert_type(samp_FR[S_TEMP], F32)
    top_p = jax.lax.bitcast_convert_type(samp_FR[S_TOP_P], F32)
    tok = sampling.draw(jnp.where(ban, -jnp.inf, logits), temp, top_p, samp_FR[S_SEED],
                        samp_FR[S_INDEX])
    remap = tables.remap[cons]
    keep = tables.keep_eos[cons] & (tok == tok_cfg.eos_id)
    tok = jnp.where((remap >= 0) & ~keep, remap, tok)
    is_coord = tables.coord_kind[cons] & (tok == tok_cfg.coord_id)
    is_size = tables.size_kind[cons] & (tok == tok_cfg.size_id)
    kind = jnp.where(is_coord, KIND_COORD, jnp.where(is_size, KIND_SIZE, KIND_TOKEN))

    def values(_):
        _, cval, _, sval = _region_heads(params, slot.hidden[:r], cfg=cfg)
        return jnp.stack([cval, jnp.zeros_like(cval)], -1), sval

    zeros = jnp.zeros((r, 2), F32)
    # Text-only steps skip the region MLPs on the device.
    coord, size = jax.lax.cond(jnp.any(is_coord | is_size), values, lambda _: (zeros, zeros),
                               None)
    k = kind[:, None]
    value = jnp.where(k == KIND_COORD, coord, jnp.where(k == KIND_SIZE, size, zeros))
    out = jnp.concatenate([tok[:, None], jax.lax.bitcast_convert_type(value, jnp.int32)], -1)
    slot = slot.replace(out=slot.out.at[:r].set(out))
    pending = Pending(pending.kind.at[rows].set(kind), pending.token.at[rows].set(tok),
                      pending.value.at[rows].set(value))
    return slot, pending


def _ceiling(params, cache, slot, pending, tables, meta_FR, samp_FR, n_steps, kv_len, *, cfg):
    """The device-only ceiling: `n_steps` decode + sample steps in one jitted loop, no host
    work between them (positions and token indices advance by one per step)."""
    def body(i, carry):
        cache, slot, pending = carry
        meta = meta_FR.at[M_POS].add(i)
        samp = samp_FR.at[S_INDEX].add(i)
        cache, slot = _forward(params, cache, slot, pending, meta, kv_len, cfg=cfg)
        slot, pending = _sample_step(params, slot, pending, tables, meta, samp, cfg=cfg)
        return cache, slot, pending

    return jax.lax.fori_loop(0, n_steps, body, (cache, slot, pending))


def _embed_prompt(params, kinds_RT, ids_RT, values_RT2, *, cfg):
    return input_embeddings(params, cfg, kinds_RT, ids_RT, values_RT2)


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


def _image_kv(params, crops_u8, src, ph, pw, *, cfg):
    """An image's prefix KV ([L, 730, K, H] each): encode, project, and prefill BOS + image
    tokens (bidirectional) in a one-row cache of exactly the prefix length."""
    n = cfg.prefix_len
    _, emb = _encode_image(params, crops_u8, src, ph, pw, cfg=cfg)
    cache = text.init_cache(cfg, rows=1, length=n)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    zero, full = jnp.zeros(1, jnp.int32), jnp.full(1, n, jnp.int32)
    _, cache = text.forward(params["text"], cfg.text, _image_prefix(params, emb, cfg=cfg), pos,
                            cache, zero, full, n)
    return cache.k[:, 0], cache.v[:, 0]


def _write_prefix(cache, k_LPKH, v_LPKH, row):
    n = k_LPKH.shape[1]
    k = cache.k.at[:, row, :n].set(k_LPKH)
    v = cache.v.at[:, row, :n].set(v_LPKH)
    return text.KVCache(k, v)


@dataclass(frozen=True)
class Programs:
    cfg: MoondreamConfig
    encode_image: Callable
    image_kv: Callable
    prefill: Callable
    decode: Callable
    # prefill / decode that also return the MoE routing (parity traces of Moondream 3).
    prefill_routes: Callable
    decode_routes: Callable
    embed_prompt: Callable
    region_heads: Callable
    sample: Callable
    write_prefix: Callable
    # The engine's programs (slot, pending buffers and KV cache are donated).
    forward: Callable
    prefill_slot: Callable
    sample_step: Callable
    ceiling: Callable


@lru_cache(maxsize=16)
def build(cfg: MoondreamConfig) -> Programs:
    """The jitted programs of one config.  Cached per config (configs are frozen and
    hashable), so loading the same model again -- on another device, in another engine --
    reuses the compiled executables instead of tracing and compiling everything anew."""
    c = {"cfg": cfg}
    return Programs(
        cfg=cfg,
        encode_image=jax.jit(partial(_encode_image, **c)),
        image_kv=jax.jit(partial(_image_kv, **c)),
        prefill=jax.jit(partial(_prefill, **c), static_argnums=(7,), donate_argnums=(1,)),
        decode=jax.jit(partial(_decode, **c), static_argnums=(8,), donate_argnums=(1,)),
        prefill_routes=jax.jit(partial(_prefill, with_routes=True, **c), static_argnums=(7,),
                               donate_argnums=(1,)),
        decode_routes=jax.jit(partial(_decode, with_routes=True, **c), static_argnums=(8,),
                              donate_argnums=(1,)),
        embed_prompt=jax.jit(partial(_embed_prompt, **c)),
        region_heads=jax.jit(partial(_region_heads, **c)),
        sample=jax.jit(sampling.sample),
        write_prefix=jax.jit(_write_prefix, donate_argnums=(0,)),
        forward=jax.jit(partial(_forward, **c), static_argnums=(5,), donate_argnums=(1, 2)),
        prefill_slot=jax.jit(partial(_prefill_slot, **c), static_argnums=(7,),
                             donate_argnums=(1, 2)),
        sample_step=jax.jit(partial(_sample_step, **c), donate_argnums=(1, 2)),
        ceiling=jax.jit(partial(_ceiling, **c), static_argnums=(8,), donate_argnums=(1, 2, 3)),
    )


def row_bucket(n: int, max_rows: int) -> int:
    """Rows a step of n rows compiles for: 1, 2, 4, 8, 16, 32, ... capped at max_rows."""
    b = 1
    while b < n:
        b *= 2
    return min(b, max_rows)


def row_buckets(max_rows: int) -> list[int]:
    return sorted({row_bucket(n, max_rows) for n in range(1, max_rows + 1)})


def kv_bucket(n: int, max_context: int, step: int = 256) -> int:
    """Attended KV length for a sequence of n positions: a multiple of `step`, capped."""
    return min(max_context, -(-max(n, 1) // step) * step)


def kv_buckets(max_context: int) -> list[int]:
    return sorted({kv_bucket(n, max_context) for n in range(1, max_context + 1, 256)}
                  | {max_context})


def prompt_bucket(n: int, step: int = 16) -> int:
    return -(-max(n, 1) // step) * step
