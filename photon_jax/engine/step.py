"""The one place that calls `jax.jit`: the device programs, compiled per config, and the
serving glue they need (slots, pending buffers, the constraint table, unpacking `stepmeta`).
The model itself is the model layer's (`text`, `vision`, `region`); this module wraps it,
handing `text.forward` the paged pool through `kvpool`'s access objects.

Two bundles.  `build` gives the engine's `EnginePrograms`: `forward` (decode R rows into a
slot), `prefill_slot` (prompt prefill into a slot), `sample_step` (constrained sampling of a
slot's rows into the pending buffers), `image_kv` (an image's prefix K/V),
`write_prefix_pages` / `copy_pages` (that prefix into pool pages, from its dense K/V or from
the prefix cache's pages), `burst` and `ceiling`.  Forward and sample are separate so the
constraint of step t+1 can be built on the host after step t is committed; `burst` runs K
steps of rows that need no such constraint in one program; `ceiling` scans forward +
sample over precomputed per-step metadata inside one program: the device-only bound of the
benchmark (a static trip count: no host round trip on any backend).  `build_oracle` gives the
one-request path's `OraclePrograms` over a dense cache (`reference`, the parity tests).

All programs take arrays positionally; static arguments are only shape buckets.  The KV pool
(or cache) is donated into every call that writes it and handed back, so it is updated in
place.

`attention` selects the decode attention (`model.platforms.ATTENTION`; a loaded model's
`Platform` record says which, and `programs_of` builds from it).  The GPU kernel's split
count is a static argument of the decode programs, planned on the host per step
(`EnginePrograms.decode_splits`).

Input kinds of a decode row (`kind_R`): 0 = token id, 1 = coordinate value, 2 = size value.
Detect/point feed region values back as embeddings, so one decode program serves text and
region steps and rows of different kinds can share a step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import jax
import jax.numpy as jnp

import flax.struct

from ..base.dtypes import F32, jnp_dtype
from ..kernels import cpukernel, gpu_attention
from ..model import lora, quant, sampling, text, vision
from ..model.config import KIND_COORD, KIND_IMAGE, KIND_SIZE, KIND_TOKEN, MoondreamConfig
from ..model.layers import layer_norm, linear
from ..model.platforms import (DENSE_MIN_ROWS, GPU_ATTENTION, TPU_ATTENTION, Platform,
                               check_attention, choose, default_dense)
from ..model.region import region_heads
from . import constraints, kvpool
from .kvpool import DecodeAccess, KVPool, PrefillAccess
from .stepmeta import (F_ADAPTER, F_LAST, F_PREFIX, F_START, M_ADAPTER, M_OFF, M_PAGE, M_POS,
                       M_ROW, M_TABLE, P_COUNT, P_OWNER)

# Rows of the per-step sampling array `samp_FR` (int32 [6 + A, R]), uploaded once per
# finalize: the row's pending-buffer row, constraint id, token index, seed, temperature and
# top_p (float32 bits), then A rows of an optional per-row allowed-id set (-1 = unused).
S_ROW, S_CONSTRAINT, S_INDEX, S_SEED, S_TEMP, S_TOP_P, S_ALLOW = range(7)
# Alternatives per row the logprobs sampler computes: the most any request may ask for
# (`settings.MAX_TOP_LOGPROBS`), so one compiled width serves every request.
TOP_LOGPROBS = 20


@flax.struct.dataclass
class Slot:
    """Per-step buffers, preallocated at the maximum step size; a step uses the first R rows.
    Two of these alternate; each is donated into the call that writes it."""
    logits: jax.Array   # [Rs, V] float32: forward output, read by sample
    hidden: jax.Array   # [Rs, D]: last hidden before post_ln (region heads read it)
    out: jax.Array      # [Rs, 3] int32: sampled id, value x bits, value y bits (host reads)
    # [Rs, 1 + 2 K] int32 (K = TOP_LOGPROBS), written only by the logprobs variant of the
    # sampler: the sampled id's log-probability, the K best ids' (float32 bits), the K ids.
    # The host copies it only after such a step: the common step's copy stays 12 bytes a row.
    logprobs: jax.Array


@flax.struct.dataclass
class Pending:
    """Device-resident next inputs per cache row: what the next forward of that row feeds."""
    kind: jax.Array     # [Rc] int32: KIND_TOKEN / KIND_COORD / KIND_SIZE
    token: jax.Array    # [Rc] int32
    value: jax.Array    # [Rc, 2] float32: coordinate (x, 0) or size (w, h)


@flax.struct.dataclass
class Tables:
    """The constraint table (`constraints.tables`): one row per constraint id, indexed by
    one int per row and step, so a step uploads R ints instead of an [R, V] mask."""
    ban: jax.Array        # [M, V] bool: True = logit set to -inf
    remap: jax.Array      # [M] int32: sampled ids become this id (-1 = keep)
    keep_eos: jax.Array   # [M] bool: ...except EOS, which stays EOS
    coord_kind: jax.Array  # [M] bool: a sampled coord id carries a coordinate value
    size_kind: jax.Array   # [M] bool: a sampled size id carries a (w, h) value


@dataclass
class DeviceState:
    """Everything an engine keeps on its device between steps: the KV pool, the two slots,
    the pending inputs (one row per decode row + the dummy row 0) and the constraint table.
    A pytree (registered below), and mutable: the engine's scheduler thread replaces each
    field as a program returns its new buffers (the old ones were donated into the call)."""
    pool: KVPool
    slots: list           # [Slot, Slot]: the ping-pong step buffers
    pending: Pending
    tables: Tables

    @classmethod
    def init(cls, cfg: MoondreamConfig, *, arena_sizes: tuple, page_size: int,
             max_batch_size: int, device=None, kv_dtype: str | None = None,
             tp=None, pack: int = 1) -> "DeviceState":
        """Zeroed buffers, committed to `device` (a program first called with uncommitted
        arrays compiles again for the committed ones its outputs are).  `kv_dtype`: an 8-bit
        pool (`kvpool.QUANTIZED`), None = the model's dtype.  `tp` (a mesh's layout,
        `sharding.TensorParallel`): made in place on the mesh, the pool split by kv heads,
        the rest replicated.  `pack`: the pool's layout (`Platform.pack` of the decode
        attention; 1: [K, P, B, H])."""
        if tp is not None:
            build = partial(cls._build, cfg, arena_sizes, page_size, max_batch_size, kv_dtype,
                            tp.mesh.devices.flat[0].platform, pack)
            return jax.jit(build, out_shardings=cls.shardings(jax.eval_shape(build), cfg, tp))()
        with jax.default_device(device):
            state = cls._build(cfg, arena_sizes, page_size, max_batch_size, kv_dtype,
                               None if device is None else device.platform, pack)
            return jax.device_put(state, device)

    @classmethod
    def abstract(cls, cfg: MoondreamConfig, *, arena_sizes: tuple, page_size: int,
                 max_batch_size: int, kv_dtype: str | None = None,
                 platform: str | None = None, pack: int = 1) -> "DeviceState":
        """The same state as shapes and dtypes only (nothing allocated): for compiling and
        for memory accounting (`platform`: whose pool storage, `kvpool.storage_dtype`)."""
        return jax.eval_shape(lambda: cls._build(cfg, arena_sizes, page_size, max_batch_size,
                                                 kv_dtype, platform, pack))

    @classmethod
    def _build(cls, cfg, arena_sizes, page_size, max_batch_size, kv_dtype=None, platform=None,
               pack=1):
        return cls(kvpool.init_pool(cfg.text, tuple(arena_sizes), page_size,
                                    kv_dtype or cfg.dtype, platform, pack),
                   [init_slot(cfg, max_batch_size), init_slot(cfg, max_batch_size)],
                   init_pending(max_batch_size + 1),
                   Tables(**{k: jnp.asarray(v) for k, v in constraints.tables(
                       cfg.tokenizer, cfg.text.vocab_size).items()}))

    @staticmethod
    def shardings(state: "DeviceState", cfg: MoondreamConfig, tp) -> "DeviceState":
        """Where each buffer lives on `tp`'s mesh: the pool by kv heads (when they divide
        over the mesh), everything else replicated."""
        pool = jax.sharding.NamedSharding(tp.mesh, tp.pool_spec(cfg.text.n_kv_heads))
        rest = jax.tree.map(lambda _: tp.replicated,
                            (state.slots, state.pending, state.tables))
        return DeviceState(jax.tree.map(lambda _: pool, state.pool), *rest)

    def nbytes(self) -> dict:
        """Bytes per part: {"pool", "slots", "pending", "tables"}."""
        return {name: int(sum(x.size * x.dtype.itemsize
                              for x in jax.tree.leaves(getattr(self, name))))
                for name in ("pool", "slots", "pending", "tables")}


jax.tree_util.register_dataclass(DeviceState, data_fields=["pool", "slots", "pending", "tables"],
                                 meta_fields=[])


def init_slot(cfg: MoondreamConfig, rows: int) -> Slot:
    dt = jnp_dtype(cfg.dtype)
    return Slot(jnp.zeros((rows, cfg.text.vocab_size), F32), jnp.zeros((rows, cfg.text.dim), dt),
                jnp.zeros((rows, 3), jnp.int32),
                jnp.zeros((rows, 1 + 2 * min(TOP_LOGPROBS, cfg.text.vocab_size)), jnp.int32))


def init_pending(rows: int) -> Pending:
    return Pending(jnp.zeros(rows, jnp.int32), jnp.zeros(rows, jnp.int32),
                   jnp.zeros((rows, 2), F32))


# Each decode attention's reader of the pool and whether it writes by scatter (`kvpool`).
_READERS = {"xla": (kvpool.sweep_attend, False),
            "cpu-kernel": (kvpool.cpu_kernel_attend, False),
            "pallas": (kvpool.gpu_kernel_attend, True),
            "pallas-interpret": (kvpool.gpu_interpret_attend, True),
            "pallas-tpu": (kvpool.tpu_kernel_attend, True),
            "pallas-tpu-interpret": (partial(kvpool.tpu_kernel_attend, interpret=True), True)}


def chip_kv_heads(kv_heads: int, tp=None) -> int:
    """The kv heads one chip's pool holds: all of them, or a 1/n share over a mesh that
    splits the pool by kv heads (`sharding.TensorParallel.heads_split`)."""
    return kv_heads if tp is None else tp.heads_per_chip(kv_heads)


def decode_access(meta_FR, pages_2P, *, attention: str, splits: int = 1,
                  tp=None, kv_heads: int | None = None) -> DecodeAccess:
    """`kv_heads`: the model's (the TPU kernel's reader is bound to those each chip holds:
    a row of its packed pool holds several, an odd count one padded)."""
    attend, scatter = _READERS[attention]
    if attention in TPU_ATTENTION:
        attend = partial(attend, n_kv_heads=chip_kv_heads(kv_heads, tp))
    return DecodeAccess(page_R=meta_FR[M_PAGE], off_R=meta_FR[M_OFF],
                        owner_P=pages_2P[P_OWNER], count_P=pages_2P[P_COUNT],
                        pt_RM=meta_FR[M_TABLE:].T, length_R=meta_FR[M_POS] + 1,
                        attend=attend, scatter=scatter, splits=splits, tp=tp)


def _adapted(adapters, slot_R, mode):
    """The decoder's per-row adapters (`lora.Rows`), or None for an engine without them."""
    return None if adapters is None else lora.Rows(adapters, slot_R, mode)


def _forward(params, pool: KVPool, slot: Slot, pending: Pending, meta_FR, pages_2P,
             splits: int = 1, adapters=None, *, cfg, attention="xla", grouped="blocks",
             dense=False, tp=None, lora_mode="gather"):
    """One decode step for R rows over the arenas given: inputs gathered on the device from
    the pending buffers by row (never through the host), logits and hidden into the slot.
    `dense`: the dense layers and LM head on `cpukernel.dense` (`default_dense`).  `splits`
    (static): the GPU kernel's split count (`EnginePrograms.decode_splits`; 1 for the others).
    `adapters`: the LoRA slot tables (`lora.init_tables`; None: an engine without adapters),
    each row's slot in `meta_FR[M_ADAPTER]`."""
    rows = meta_FR[M_ROW]
    x = text.input_embeddings(params, pending.kind[rows], pending.token[rows],
                              pending.value[rows], cfg=cfg, rows=True)[:, None]
    def product(x, p):
        # Few rows of float32 weights: XLA streams them faster than the kernel's panels.
        # Quantized weights always go to the kernel: it widens the codes in registers,
        # where XLA:CPU would first write the widened weight out whole in every step.
        if dense and (x.shape[0] >= DENSE_MIN_ROWS
                      or quant.is_quantized(p.get("w_vd", p.get("w")))):
            return cpukernel.linear(x, p)
        return linear(x, p)

    hidden, pool, _ = text.forward(params["text"], cfg.text, x, meta_FR[M_POS][:, None], pool,
                                   decode_access(meta_FR, pages_2P, attention=attention,
                                                 splits=splits, tp=tp,
                                                 kv_heads=cfg.text.n_kv_heads),
                                   grouped, dense=product, tp=tp,
                                   lora=_adapted(adapters, meta_FR[M_ADAPTER], lora_mode))
    h = hidden[:, 0]
    return pool, _into_slot(slot, h, text.logits(params["text"], h, dense=product, tp=tp))


def _into_slot(slot: Slot, h_RD, logits_RV) -> Slot:
    return slot.replace(logits=slot.logits.at[: h_RD.shape[0]].set(logits_RV),
                        hidden=slot.hidden.at[: h_RD.shape[0]].set(h_RD.astype(slot.hidden.dtype)))


def _prefill_slot(params, pool: KVPool, slot: Slot, kinds_RT, ids_RT, values_RT2, pre_FR,
                  write_2RT, table_RM, adapters=None, images=None, *, cfg, grouped="blocks",
                  tp=None, lora_mode="gather"):
    """Prompt prefill for R rows starting at per-row positions (after an image prefix, or 0
    for text-only prompts), K/V written into the rows' pages; the last real position's
    logits and hidden go into the slot.  Prompt positions of kind coord / size (spatial
    refs) embed their values.

    `images` ([N, Z, D], a conversation's images after its start; None: none, and the
    program is the one without them): a position of kind KIND_IMAGE with id n Z + z feeds
    patch z of image n and attends its whole block (its Z positions: patch z at block start
    + z) and everything before it (`layers.attention_mask`)."""
    t = ids_RT.shape[1]
    pos = pre_FR[F_START][:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    vis = None
    if images is None:
        emb = text.input_embeddings(params, kinds_RT, ids_RT, values_RT2, cfg=cfg)
    else:
        z = images.shape[1]
        block = kinds_RT == KIND_IMAGE
        emb = text.input_embeddings(params, kinds_RT, jnp.where(block, 0, ids_RT),
                                    values_RT2, cfg=cfg)
        patch = images.reshape(-1, images.shape[-1])[jnp.where(block, ids_RT, 0)]
        emb = jnp.where(block[..., None], patch.astype(emb.dtype), emb)
        vis = jnp.where(block, pos + (z - 1 - ids_RT % z), pos)
    access = PrefillAccess(write_2RT[0], write_2RT[1], table_RM, pre_FR[F_PREFIX], tp=tp,
                           vis_RT=vis)
    hidden, pool, _ = text.forward(params["text"], cfg.text, emb, pos, pool, access, grouped,
                                   tp=tp, lora=_adapted(adapters, pre_FR[F_ADAPTER], lora_mode))
    last = jnp.take_along_axis(hidden, pre_FR[F_LAST][:, None, None], axis=1)[:, 0]
    return pool, _into_slot(slot, last, text.logits(params["text"], last, tp=tp))


def _sample_step(params, slot: Slot, pending: Pending, tables: Tables, samp_FR, mask_RW=None,
                 *, cfg, stochastic: bool = True, region: bool = True, candidates: int = 256,
                 logprobs: bool = False):
    """Sample R rows of a forwarded step under their constraints; decode region values; write
    the host-bound results into the slot and the next inputs into the pending buffers.

    Static variants, picked on the host (no device-side branch): `stochastic` (some row has
    temperature > 0: top-p draws; else argmax only), `region` (some row's constraint lets
    it emit a coordinate or size: run the region heads; else none is needed) and whether
    `mask_RW` is given (int32 [R, ceil(V / 32)]: some row's answer is held to a shape; bit
    i of word w allows id 32 w + i, and an unshaped row's words are all ones).
    `logprobs` (some row asks for log-probabilities): also write each row's sampled id's
    and its TOP_LOGPROBS best ids' log-probabilities into `slot.logprobs`, from the logits
    as the forward gave them (before constraints, shapes and temperature)."""
    r = samp_FR.shape[1]
    tok_cfg = cfg.tokenizer
    rows = samp_FR[S_ROW]
    cons = samp_FR[S_CONSTRAINT]
    logits = slot.logits[:r]
    ban = tables.ban[cons]
    allow_RA = samp_FR[S_ALLOW:].T
    restricted = jnp.any(allow_RA >= 0, axis=1)
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    allowed = jnp.any(ids[None, None, :] == allow_RA[:, :, None], axis=1)
    ban = ban | (restricted[:, None] & ~allowed)
    if mask_RW is not None:
        bits = (mask_RW[:, ids >> 5] >> (ids & 31)) & 1
        ban = ban | (bits == 0)
    logits = jnp.where(ban, -jnp.inf, logits)
    if stochastic:
        temp = jax.lax.bitcast_convert_type(samp_FR[S_TEMP], F32)
        top_p = jax.lax.bitcast_convert_type(samp_FR[S_TOP_P], F32)
        tok = sampling.draw(logits, temp, top_p, samp_FR[S_SEED], samp_FR[S_INDEX],
                            candidates)
    else:
        tok = sampling.greedy(logits)
    remap = tables.remap[cons]
    keep = tables.keep_eos[cons] & (tok == tok_cfg.eos_id)
    tok = jnp.where((remap >= 0) & ~keep, remap, tok)
    zeros = jnp.zeros((r, 2), F32)
    if region:
        is_coord = tables.coord_kind[cons] & (tok == tok_cfg.coord_id)
        is_size = tables.size_kind[cons] & (tok == tok_cfg.size_id)
        kind = jnp.where(is_coord, KIND_COORD, jnp.where(is_size, KIND_SIZE, KIND_TOKEN))
        _, cval, _, sval = region_heads(params, slot.hidden[:r], cfg=cfg)
        k = kind[:, None]
        value = jnp.where(k == KIND_COORD, jnp.stack([cval, jnp.zeros_like(cval)], -1),
                          jnp.where(k == KIND_SIZE, sval, zeros))
    else:
        kind, value = jnp.full((r,), KIND_TOKEN, jnp.int32), zeros
    out = jnp.concatenate([tok[:, None], jax.lax.bitcast_convert_type(value, jnp.int32)], -1)
    slot = slot.replace(out=slot.out.at[:r].set(out))
    if logprobs:
        slot = slot.replace(logprobs=slot.logprobs.at[:r].set(
            _logprobs(slot.logits[:r], tok, (slot.logprobs.shape[1] - 1) // 2)))
    pending = Pending(pending.kind.at[rows].set(kind), pending.token.at[rows].set(tok),
                      pending.value.at[rows].set(value))
    return slot, pending


def _logprobs(logits_RV, tok_R, k: int):
    """[R, 1 + 2 k] int32: log p(tok) and the k best log-probabilities (float32 bits, best
    first), then their ids."""
    lp = jax.nn.log_softmax(logits_RV.astype(F32), axis=-1)
    own = jnp.take_along_axis(lp, tok_R[:, None], axis=1)
    best, ids = jax.lax.top_k(lp, k)
    return jnp.concatenate([jax.lax.bitcast_convert_type(own, jnp.int32),
                            jax.lax.bitcast_convert_type(best, jnp.int32),
                            ids.astype(jnp.int32)], axis=1)


def _ceiling(params, pool, slot, pending, tables, metas_NFR, pages_N2P, samp_FR,
             splits: int = 1, adapters=None, *, cfg, attention="xla", grouped="blocks",
             dense=False, stochastic=False, region=False, tp=None, lora_mode="gather"):
    """The device-only ceiling: one decode + sample step per entry of the stacked per-step
    metadata, in one `lax.scan` (a static trip count), no host work between steps (token
    indices advance by one per step).  `splits` (static): the GPU kernel's split count for
    every step (plan it from the last step's lengths: `EnginePrograms.decode_splits`)."""
    def body(carry, step):
        pool, slot, pending, i = carry
        meta, pages = step
        samp = samp_FR.at[S_INDEX].add(i)
        pool, slot = _forward(params, pool, slot, pending, meta, pages, splits, adapters,
                              cfg=cfg, attention=attention, grouped=grouped, dense=dense,
                              tp=tp, lora_mode=lora_mode)
        slot, pending = _sample_step(params, slot, pending, tables, samp, cfg=cfg,
                                     stochastic=stochastic, region=region)
        return (pool, slot, pending, i + 1), None

    (pool, slot, pending, _), _ = jax.lax.scan(body, (pool, slot, pending, jnp.int32(0)),
                                               (metas_NFR, pages_N2P))
    return pool, slot, pending


def _burst(params, pool, slot, pending, tables, metas_KFR, pages_K2P, samp_FR,
           splits: int = 1, adapters=None, *, cfg, attention="xla", grouped="blocks",
           dense=False, stochastic=False, candidates: int = 256, tp=None,
           lora_mode="gather"):
    """K decode steps of free-running text rows in one program (`Engine` "burst"): forward
    and sample, K times in a `lax.scan` (a static trip count), each step's inputs taken
    from the pending buffers the step before wrote, token indices advancing by one.  The
    rows' constraint is the same for every step (free text past the first token) and no
    host mask is needed, so nothing the host learns between steps could change them; the
    host commits the K tokens at once and drops those after a row's stop.  -> (pool arenas,
    slot, pending, outs [K, R, 3]: each step's `Slot.out` rows)."""
    r = samp_FR.shape[1]

    def body(carry, step):
        pool, slot, pending, i = carry
        meta, pages = step
        pool, slot = _forward(params, pool, slot, pending, meta, pages, splits, adapters,
                              cfg=cfg, attention=attention, grouped=grouped, dense=dense,
                              tp=tp, lora_mode=lora_mode)
        slot, pending = _sample_step(params, slot, pending, tables,
                                     samp_FR.at[S_INDEX].add(i), cfg=cfg,
                                     stochastic=stochastic, region=False,
                                     candidates=candidates)
        return (pool, slot, pending, i + 1), slot.out[:r]

    (pool, slot, pending, _), outs = jax.lax.scan(
        body, (pool, slot, pending, jnp.int32(0)), (metas_KFR, pages_K2P))
    return pool, slot, pending, outs


def _prefix_input(params, x_CZE, src, ph, pw, *, cfg):
    """The encoder's last activations -> (the image prefix's input [1, S, D], and zeroed
    K and V buffers [L, S, K, H] for `text.prefix_layers`): post_ln, pooling and projection
    (`vision.encode_image`'s end), BOS in front (`text.image_kv`).  The buffers are made
    here, on the device, rather than uploaded."""
    pv = params["vision"]
    emb = vision.project(pv, layer_norm(x_CZE, pv["post_ln"]), src, ph, pw)
    h = text.image_prefix(params, emb, cfg=cfg)
    kv = text.init_cache(cfg, rows=1, length=h.shape[1])
    return h, kv.k[:, 0], kv.v[:, 0]


def _write_prefix_pages(pool: KVPool, k_LSKH, v_LSKH, page_S, off_S, *, tp=None) -> KVPool:
    """An image prefix's dense K/V ([L, S, K, H] each) into pool pages, position s at
    (page_S[s], off_S[s]); an 8-bit pool quantizes them here (once: cache hits copy or share
    the pages).  Over a mesh, each chip writes its kv heads."""
    if tp is not None:
        return tp.on_pool(lambda pool, kv, rest: _write_prefix_pages(pool, *kv, *rest),
                          k_LSKH.shape[2], pool, (k_LSKH, v_LSKH), (page_S, off_S))
    parts = ([], [], [], [])
    bound = -(-page_S.shape[0] // pool.page_size) + 2   # consecutive positions, padding
    for li in range(len(pool.k)):
        k, v, ks, vs = pool.layer(li)
        k, ks = kvpool.write_tokens_q(k, ks, page_S, off_S, k_LSKH[li], bound)
        v, vs = kvpool.write_tokens_q(v, vs, page_S, off_S, v_LSKH[li], bound)
        for part, x in zip(parts, (k, v, ks, vs)):
            part.append(x)
    return KVPool(*(tuple(p) for p in (parts if pool.quantized else parts[:2])))


def _copy_pages(pool: KVPool, src_N, dst_N, *, tp=None, kv_heads: int = 0) -> KVPool:
    """Whole pages src_N[i] -> dst_N[i] in every layer (a prefix-cache hit), with their
    scales in an 8-bit pool.  Over a mesh, each chip copies its kv heads."""
    if tp is not None:
        return tp.on_pool(lambda pool, _, rest: _copy_pages(pool, *rest),
                          kv_heads, pool, (), (src_N, dst_N))

    def copy(arenas):
        return kvpool.write_pages(arenas, dst_N, kvpool.gather_pages(arenas, src_N))
    return KVPool(*(tuple(copy(a) for a in part) for part in pool._parts()))


@dataclass(frozen=True)
class OraclePrograms:
    """The one-request path's programs over a dense `text.KVCache` (`reference`, the parity
    and invariant tests).  Its image prefix is the engine's `image_kv`, so both paths start
    from the same K/V."""
    cfg: MoondreamConfig
    encode_image: Callable    # -> (patch features, image embeddings): parity traces
    prefill: Callable
    decode: Callable
    # prefill / decode that also return the MoE routing (parity traces of Moondream 3).
    prefill_routes: Callable
    decode_routes: Callable
    embed_prompt: Callable
    region_heads: Callable
    sample: Callable          # all variants, picked by argument
    greedy: Callable
    write_prefix: Callable


@dataclass(frozen=True)
class EnginePrograms:
    """The serving engine's programs (the slot, pending buffers and KV pool are donated)."""
    cfg: MoondreamConfig
    image_kv: Callable
    write_prefix_pages: Callable
    copy_pages: Callable
    # forward(params, pool, slot, pending, meta, pages, splits=1): `splits` is static, one
    # compile per value (`decode_splits` picks it per step; only the GPU kernel uses it).
    forward: Callable
    prefill_slot: Callable
    # sample_step[(stochastic, region, logprobs)]: the static variants of the sampling
    # program (the logprobs ones compile on first use, as the masked twins do).
    sample_step: dict
    ceiling: Callable
    # burst[stochastic](params, pool, slot, pending, tables, metas, pages, samp, splits=1):
    # K decode + sample steps of free-running text rows in one program (`_burst`).
    burst: dict = None
    # write_adapter(tables, slot, adapter): one adapter into a slot of the LoRA tables
    # (donated): a device write between steps, never a new trace of the step programs.
    write_adapter: Callable = None
    # image_embeddings(params, crops, src, ph, pw) -> [Z, D]: an image's patch embeddings
    # (vision encoder and projection), for an image block inside a prompt; and
    # stack_images(tuple of them) -> [N, Z, D], the prefill's `images` argument.
    image_embeddings: Callable = None
    stack_images: Callable = None
    # An image prefix a group of layers per launch (`engine.slicing`): vision_embed(params,
    # crops) -> patch embeddings; vision_blocks(params, x, first, n) -> x after blocks
    # first.. first + n (n static); prefix_input(params, x, src, ph, pw) -> (BOS + the
    # projected image embeddings [1, S, D], zeroed K, V [L, S, K, H]); prefix_layers(layers, kinds, h, k, v, first,
    # adapters, slot, kv_only=False) -> (h, k, v) after those decoder layers (kinds
    # static; kv_only: (k, v) alone, the last group's).
    vision_embed: Callable = None
    vision_blocks: Callable = None
    prefix_input: Callable = None
    prefix_layers: Callable = None
    # ... and by halves of a layer: prefix_attention(layer, x, k, v, first, adapters, slot,
    # kv_only=False) -> (x, h, k, v) or (k, v); prefix_mlp(layer, kind, x, h, adapters, slot) -> x (kind static).
    prefix_attention: Callable = None
    prefix_mlp: Callable = None
    attention: str = "xla"   # the decode attention forward and ceiling were built with
    tp: object = None        # the mesh layout the engine's programs were built for

    def sampler(self, stochastic: bool, region: bool, logprobs: bool = False) -> Callable:
        """The sampling program of a step.  Called with the shapes' bitmask as one more
        argument, the same jitted function traces a masked twin on first use (warm-up does
        not compile those: most engines never see a shaped request; nor the `logprobs`
        variants, for the same reason)."""
        return self.sample_step[(stochastic, region, logprobs)]

    def decode_splits(self, lengths, page_size: int, sms: int | None = None) -> int:
        """The static `splits` argument of forward / ceiling for a decode step whose real
        rows attend `lengths` positions: the GPU kernel's plan (`gpu_attention.plan_splits`,
        `sms` the device's SM count, None: an H200's), 1 for every other attention (their
        programs take no splits: one compile)."""
        if self.attention not in GPU_ATTENTION:
            return 1
        t = self.cfg.text
        # Programs are (row, kv head, split) triples of the heads each chip holds.
        return gpu_attention.plan_splits(lengths, chip_kv_heads(t.n_kv_heads, self.tp),
                                         page_size, sms, t.n_heads // t.n_kv_heads)

    def split_variants(self, bucket: int, sms: int | None = None) -> tuple:
        """The `splits` values `decode_splits` can give a step of row bucket `bucket`:
        what the engine compiles before serving."""
        if self.attention not in GPU_ATTENTION:
            return (1,)
        return gpu_attention.bucket_variants(
            bucket, chip_kv_heads(self.cfg.text.n_kv_heads, self.tp), sms)


def build(cfg: MoondreamConfig, attention: str = "xla",
          candidates: int = sampling.DEFAULT_CANDIDATES, grouped: str = "blocks",
          vision_loop: bool = False, dense: bool | None = None, tp=None,
          lora_mode: str | None = None) -> EnginePrograms:
    """The engine's jitted programs of one config.  Cached per argument (configs are frozen
    and hashable), so loading the same model again -- on another device, in another engine
    -- reuses the compiled executables instead of tracing and compiling anew.
    `candidates`: the top-p candidate cap (`sampling`); `grouped`: the MoE prefill schedule
    (`moe.schedule`); `vision_loop`: the vision attention's formulation
    (`default_vision_loop`); `dense`: decode's dense layers on the CPU kernel (None:
    `default_dense`); `tp`: the programs split over a mesh (`sharding.TensorParallel`);
    `lora_mode`: how rows apply their adapters (`lora.MODES`; None: `lora.default_mode`)."""
    check_attention(attention)
    if lora_mode is not None and lora_mode not in lora.MODES:
        raise ValueError(f"lora_mode {lora_mode!r}; expected one of {lora.MODES}")
    if dense is None:
        dense = default_dense(cfg, attention)
    elif dense and not default_dense(cfg, attention):
        raise ValueError("dense=True needs attention='cpu-kernel', float32 and a CPU with "
                         "AVX2 and FMA (`default_dense`)")
    return _build(cfg, attention, candidates, grouped, vision_loop, dense, tp,
                  lora.default_mode(attention) if lora_mode is None else lora_mode)


@lru_cache(maxsize=16)
def build_oracle(cfg: MoondreamConfig, candidates: int = sampling.DEFAULT_CANDIDATES,
                 grouped: str = "blocks", vision_loop: bool = False) -> OraclePrograms:
    """The one-request path's jitted programs of one config (cached as `build`'s), on one
    device's layout."""
    g = {"cfg": cfg, "grouped": grouped}
    return OraclePrograms(
        cfg=cfg,
        encode_image=jax.jit(partial(vision.encode_image, cfg=cfg, vision_loop=vision_loop)),
        prefill=jax.jit(partial(text.prefill, **g), static_argnums=(7,), donate_argnums=(1,)),
        decode=jax.jit(partial(text.decode, **g), static_argnums=(8,), donate_argnums=(1,)),
        prefill_routes=jax.jit(partial(text.prefill, with_routes=True, **g),
                               static_argnums=(7,), donate_argnums=(1,)),
        decode_routes=jax.jit(partial(text.decode, with_routes=True, **g),
                              static_argnums=(8,), donate_argnums=(1,)),
        embed_prompt=jax.jit(partial(text.input_embeddings, cfg=cfg)),
        region_heads=jax.jit(partial(region_heads, cfg=cfg)),
        sample=jax.jit(partial(sampling.sample, candidates=candidates)),
        greedy=jax.jit(partial(sampling.sample, stochastic=False)),
        write_prefix=jax.jit(text.write_prefix, donate_argnums=(0,)))


def build_for(cfg: MoondreamConfig, platform: "str | Platform", attention: str | None = None,
              tp=None) -> EnginePrograms:
    """The engine's programs a device of `platform` ("cpu", "gpu", ..., or its `Platform`
    record) gets: its default attention (or `attention`), MoE prefill schedule and vision
    attention (`platforms.choose`).  What an engine runs (`programs_of`); the GPU tests and
    `bench/gpu_compile.py` build a GPU's this way too.  `tp`: over a mesh (`sharding.TensorParallel`)."""
    rec = platform if isinstance(platform, Platform) else choose(cfg, platform, attention)
    return build(cfg, rec.attention, grouped=rec.grouped, vision_loop=rec.vision_loop,
                 dense=rec.dense, tp=tp)


def oracle_for(cfg: MoondreamConfig, platform: "str | Platform") -> OraclePrograms:
    """The one-request path's programs on `platform` (its MoE prefill schedule and vision
    attention, as `build_for`'s)."""
    rec = platform if isinstance(platform, Platform) else choose(cfg, platform)
    return build_oracle(cfg, grouped=rec.grouped, vision_loop=rec.vision_loop)


# Each loaded model's programs, kept as long as the model lives (`build`'s cache holds 16
# configurations; a test session or a process serving many models meets more, and a model's
# programs rebuilt after an eviction would be traced and compiled again).
_MODEL_PROGRAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_MODEL_ORACLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def programs_of(model) -> EnginePrograms:
    """The engine's programs for a loaded `model.Model`: its config, platform record and
    mesh layout (`build_for`), built once per model, so every engine on it shares them."""
    progs = _MODEL_PROGRAMS.get(model)
    if progs is None:
        progs = _MODEL_PROGRAMS[model] = build_for(model.cfg, model.platform, tp=model.tp)
    return progs


def oracle_of(model) -> OraclePrograms:
    """The one-request path's programs for a loaded `model.Model` (`oracle_for`), built
    once per model."""
    progs = _MODEL_ORACLES.get(model)
    if progs is None:
        progs = _MODEL_ORACLES[model] = oracle_for(model.cfg, model.platform)
    return progs


@lru_cache(maxsize=16)
def _build(cfg, attention, candidates, grouped, vision_loop, dense, tp,
           lora_mode) -> EnginePrograms:
    c = {"cfg": cfg}
    e = {"cfg": cfg, "grouped": grouped, "tp": tp, "lora_mode": lora_mode}
    return EnginePrograms(
        cfg=cfg,
        image_kv=jax.jit(partial(text.image_kv, vision_loop=vision_loop, **e)),
        write_prefix_pages=jax.jit(partial(_write_prefix_pages, tp=tp), donate_argnums=(0,)),
        copy_pages=jax.jit(partial(_copy_pages, tp=tp, kv_heads=cfg.text.n_kv_heads),
                           donate_argnums=(0,)),
        forward=jax.jit(partial(_forward, attention=attention, dense=dense, **e),
                        static_argnums=(6,), donate_argnums=(1, 2)),
        prefill_slot=jax.jit(partial(_prefill_slot, **e), donate_argnums=(1, 2)),
        sample_step={(st, rg, lp): jax.jit(partial(_sample_step, stochastic=st, region=rg,
                                                   candidates=candidates, logprobs=lp, **c),
                                           donate_argnums=(1, 2))
                     for st in (False, True) for rg in (False, True) for lp in (False, True)},
        ceiling=jax.jit(partial(_ceiling, attention=attention, dense=dense, **e),
                        static_argnums=(8,), donate_argnums=(1, 2, 3)),
        burst={st: jax.jit(partial(_burst, attention=attention, dense=dense, stochastic=st,
                                   candidates=candidates, **e),
                           static_argnums=(8,), donate_argnums=(1, 2, 3))
               for st in (False, True)},
        write_adapter=jax.jit(lora.write_slot, donate_argnums=(0,)),
        image_embeddings=jax.jit(lambda params, *img: vision.encode_image(
            params, *img, cfg=cfg, vision_loop=vision_loop)[1]),
        stack_images=jax.jit(jnp.stack),
        vision_embed=jax.jit(lambda params, crops: vision.embed_crops(
            params["vision"], crops, cfg.vision, jnp_dtype(cfg.dtype))),
        vision_blocks=jax.jit(lambda params, x, first, n: vision.encode_blocks(
            params["vision"], x, first, n, cfg.vision, vision_loop),
            static_argnums=(3,), donate_argnums=(1,)),
        prefix_input=jax.jit(partial(_prefix_input, cfg=cfg)),
        # (The hidden is not donated: the last slice returns none to reuse it for.)
        prefix_layers=jax.jit(partial(text.prefix_layers, **e), static_argnums=(1,),
                              static_argnames=("kv_only",), donate_argnums=(3, 4)),
        prefix_attention=jax.jit(partial(text.prefix_attention, **e),
                                 static_argnames=("kv_only",), donate_argnums=(2, 3)),
        prefix_mlp=jax.jit(partial(text.prefix_mlp, **e), static_argnums=(1,),
                           donate_argnums=(2,)),
        attention=attention,
        tp=tp,
    )


def row_bucket(n: int, max_rows: int) -> int:
    """Rows a step of n rows compiles for: 1, 2, 4, 8, 16, 32, ... capped at max_rows."""
    b = 1
    while b < n:
        b *= 2
    return min(b, max_rows)


def row_buckets(max_rows: int) -> list[int]:
    return sorted({row_bucket(n, max_rows) for n in range(1, max_rows + 1)})


def prefill_row_bucket(n: int, max_rows: int) -> int:
    """Rows a prefill of n rows compiles for: 1, 4, 16, 64, ... capped at max_rows.  Coarser
    than decode's buckets: a padded prefill row costs a short prompt's compute once, while
    each bucket is another compile (and another warm-up shape)."""
    b = 1
    while b < n:
        b *= 4
    return min(b, max_rows)


def prefill_row_buckets(max_rows: int) -> list[int]:
    return sorted({prefill_row_bucket(n, max_rows) for n in range(1, max_rows + 1)})


def kv_bucket(n: int, max_context: int, step: int = 256) -> int:
    """Attended KV length of the one-request path for n positions: a multiple of `step`."""
    return min(max_context, -(-max(n, 1) // step) * step)


def prompt_bucket(n: int) -> int:
    """Prompt length a prefill compiles for: 16, 32, 64, 128, then multiples of 128 (prompts
    are short; doubling buckets keep the shape count small for the few long ones)."""
    if n > 128:
        return -(-n // 128) * 128
    b = 16
    while b < n:
        b *= 2
    return b
