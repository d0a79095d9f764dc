"""The text decoder (Phi-style parallel blocks) and the LM head; the dense KV cache.

Moondream 3 adds, by config: tau attention in every layer (q and v scaled per token and head
before RoPE and before the cache write), and mixture-of-experts MLPs (`moe.py`) in the
layers from `text.moe.start_layer` on.  Checkpoints stack each group of layers
(`params["text"]["blocks"]`, `["moe_blocks"]`) on a leading axis; loaded models hold them as
lists of per-layer dicts (`unstack_layers`) and `forward` unrolls the layer loop.

Pure functions over `params["text"]`.  One `forward` serves every use: the 730-position image
prefix (bidirectional inside the prefix), prompt prefill, one-token decode, for one row or
many, over a dense cache or the engine's paged pool (the `access` object says where K/V go
and what each row attends).  The mask is built from positions, so rows never see each other
and a row's result does not depend on what else is in the batch.

The model's entry points (`input_embeddings`, `image_prefix`, `image_kv`, the dense-cache
`prefill` / `decode` of the one-request path, `write_prefix`) take the whole param dict and
the `MoondreamConfig` (keyword `cfg`); `step` jits them, `functional` calls them.

Dense cache layout: [L, R, S, K, H] (layers, cache rows, positions, kv heads, head dim).  K
is stored post-RoPE in the reference's interleaved order (rotated pairs (j, j+16) written to
dims 2j, 2j+1), so a cache can be compared with the reference's directly.
"""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from ..base.dtypes import F32, jnp_dtype, matmul_precision
from . import lora, moe, quant, region, vision
from .config import KIND_COORD, KIND_SIZE, MoondreamConfig, TextConfig
from .layers import attention, attention_mask, gelu_tanh, layer_norm, linear, mlp


@flax.struct.dataclass
class KVCache:
    """A dense cache, one row per sequence: [L, R, S, K, H] each.  The one-request path (the
    oracle), image prefixes and the functional entry points use it; the engine's pool is
    `kvpool.KVPool`."""
    k: jax.Array
    v: jax.Array

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


def cache_shape(cfg: TextConfig, rows: int, length: int | None = None):
    return (cfg.n_layers, rows, length or cfg.max_context, cfg.n_kv_heads, cfg.head_dim)


def init_cache(cfg: MoondreamConfig, rows: int, length: int | None = None, dtype=None):
    shape = cache_shape(cfg.text, rows, length)
    dt = jnp_dtype(dtype or cfg.dtype)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


@flax.struct.dataclass
class DenseAccess:
    """Rows `rows_R` of a dense `KVCache`: writes at each input's position, attention over
    the first `kv_len` (static) positions.  Positions past the cache are dropped on write."""
    rows_R: jax.Array
    prefix_R: jax.Array
    kv_len: int = flax.struct.field(pytree_node=False)
    vis_RT: jax.Array | None = None   # image blocks in the prompt (`attention_mask`)

    def update(self, cache: KVCache, li: int, q, k, v, pos_RT):
        idx = (li, self.rows_R[:, None], pos_RT)
        kc = cache.k.at[idx].set(k.astype(cache.k.dtype), mode="drop")
        vc = cache.v.at[idx].set(v.astype(cache.v.dtype), mode="drop")
        mask = attention_mask(pos_RT, self.prefix_R, self.kv_len, self.vis_RT)
        a = attention(q, kc[li, self.rows_R, :self.kv_len].astype(q.dtype),
                      vc[li, self.rows_R, :self.kv_len].astype(q.dtype), mask)
        return KVCache(kc, vc), a


def rope_inv_freq(cfg: TextConfig) -> np.ndarray:
    # Computed on the host in float32 exactly as the reference does (theta ** (2j/rot)).
    rot = cfg.rope_dim
    exps = np.arange(0, rot, 2, dtype=np.float32)[: rot // 2] / np.float32(rot)
    return (np.float32(1.0) / np.power(np.float32(cfg.rope_theta), exps)).astype(np.float32)


def apply_rope(x_RTQH, pos_RT, cfg: TextConfig):
    """Rotate the first `rope_dim` dims (halves j and j+rot/2 as pairs), written interleaved."""
    rot, half = cfg.rope_dim, cfg.rope_dim // 2
    ang = pos_RT.astype(F32)[..., None] * jnp.asarray(rope_inv_freq(cfg))   # [R, T, half]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    xr = x_RTQH[..., :rot].astype(F32)
    re, im = xr[..., :half], xr[..., half:]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
    out = out.reshape(*x_RTQH.shape[:-1], rot).astype(x_RTQH.dtype)
    return jnp.concatenate([out, x_RTQH[..., rot:]], axis=-1)


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


def layer_params(pt, cfg: TextConfig) -> list:
    """Each text layer's params in order, with its kind ("dense" or "moe").  The serving
    params hold them as lists (one dict per layer: see `unstack_layers`); checkpoints and
    `init_params` stack them on a leading axis, sliced here (tests, conversion checks)."""
    out = []
    for group, kind, n in (("blocks", "dense", cfg.n_dense), ("moe_blocks", "moe", cfg.n_moe)):
        if not n:
            continue
        g = pt[group]
        layers = g if isinstance(g, (list, tuple)) else [
            jax.tree.map(lambda a, i=i: a[i], g) for i in range(n)]
        out += [(p, kind) for p in layers]
    return out


def unstack_layers(params: dict, free: bool = False) -> dict:
    """Stacked text layer groups -> lists of per-layer dicts, and the LM head transposed to
    [V, D] (`w_vd`); with `free`, each stacked array is deleted once sliced (peak memory: the
    weights plus one stacked tensor).  Serving programs unroll the layer loop over these: on
    XLA:CPU a scan over stacked weights copies each layer's weights in every call (measured:
    3.4 ms -> 8.9 ms for 4 layers of width 512 at batch 1)."""
    text = dict(params["text"])
    for group in ("blocks", "moe_blocks"):
        g = text.get(group)
        if g is None or isinstance(g, (list, tuple)):
            continue
        paths, treedef = jax.tree.flatten(g)
        n = paths[0].shape[0]
        per_layer = [[] for _ in range(n)]
        for leaf in paths:
            # jnp.unstack: one program per leaf shape gives all n layers (indexing op by op
            # compiles a slice and a squeeze per shape, then dispatches both n times).
            parts = (jnp.unstack(leaf) if isinstance(leaf, jax.Array)
                     else [leaf[i] for i in range(n)])
            for i in range(n):
                per_layer[i].append(parts[i])
            if free and isinstance(leaf, jax.Array):
                leaf.delete()
        text[group] = [jax.tree.unflatten(treedef, xs) for xs in per_layer]
    head = text.get("lm_head")
    if head is not None and "w" in head and not quant.is_quantized(head["w"]):
        # The LM head as [V, D]: XLA:CPU's dot reads a [D, V] weight several times over at 8
        # to 32 rows (measured: 54 ms -> 14-21 ms at 32 rows, width 512); GPU layouts are
        # XLA's choice either way.  A quantized head stays [D, V]: the CPU kernel streams
        # its codes row by row as they lie, and on GPU and TPU the layout is XLA's anyway.
        w = head["w"]
        text["lm_head"] = {"w_vd": w.T, "b": head["b"]}
        if free and isinstance(w, jax.Array):
            jax.block_until_ready(text["lm_head"]["w_vd"])
            w.delete()
    return {**params, "text": text}


def stack_layers(params: dict) -> dict:
    """The inverse of `unstack_layers` (the checkpoint layout)."""
    text = dict(params["text"])
    for group in ("blocks", "moe_blocks"):
        g = text.get(group)
        if isinstance(g, (list, tuple)):
            text[group] = jax.tree.map(lambda *xs: jnp.stack(xs), *g)
    head = text.get("lm_head")
    if head is not None and "w_vd" in head:
        text["lm_head"] = {"w": head["w_vd"].T, "b": head["b"]}
    return {**params, "text": text}


def forward(pt, cfg: TextConfig, x_RTD, pos_RT, kv, access, grouped: str = "blocks",
            dense=linear, tp=None, lora=None):
    """Run the decoder on input embeddings -> (hidden before post_ln [R, T, D], kv, routes).

    `kv` is a dense `KVCache` or the engine's `kvpool.KVPool`; `access` says where each
    row's K/V are written and what it attends (`DenseAccess`, `kvpool.PrefillAccess`,
    `kvpool.DecodeAccess`).  `routes`: the MoE routing, (expert ids, weights) each
    [Lm, R, T, k] over the MoE layers in order, or None without MoE layers.  `grouped`: the
    MoE prefill schedule (`moe.schedule`).  `dense`: what computes the dense layers
    (`layers.linear`; the CPU decode step passes `cpukernel.linear`).  `tp`: the layout over
    a mesh (`sharding.TensorParallel`; None: one device): dense layers by output columns,
    experts by expert (a pool access carries its own `tp` for the attention).  `lora`: each
    row's adapter (`lora.Rows`; None: no adapters), added to qkv, proj, fc1 and fc2 of
    the dense blocks where the reference adds them (Moondream 3: fc1 and fc2 of its dense
    blocks and every expert, as kestrel adds them).
    """
    return forward_layers(layer_params(pt, cfg), cfg, x_RTD, pos_RT, kv, access, grouped,
                          dense, tp, lora)


def forward_layers(layers: list, cfg: TextConfig, x_RTD, pos_RT, kv, access,
                   grouped: str = "blocks", dense=linear, tp=None, lora=None,
                   halves: bool = False):
    """`forward` over `layers` ((params, kind) each, in order), layer i of them writing
    layer i of `kv` and reading adapter layer i of `lora`: the whole decoder, or a group of
    its layers (an image prefix computed a few layers per launch, `prefix_layers`).

    `halves`: each layer's halves' outputs (x + attention and ln(x), then x + MLP) are held
    in their dtype between the halves and between layers, as if each half were its own
    program.  XLA may otherwise keep a bfloat16 sum in float32 into the next fused op (its
    "excess precision"), which a boundary between launches rounds away: with it, an image
    prefix computed in one program and in slices agree to the bit in bfloat16 too (and
    each sum is rounded where the reference's bfloat16 arithmetic rounds it)."""
    if tp is not None:
        dense = tp.dense(dense)
    hold = jax.lax.optimization_barrier if halves else (lambda v: v)
    x, routes = x_RTD, []
    for li, (p, kind) in enumerate(layers):
        x, h, kv = layer_attention(p, li, cfg, x, pos_RT, kv, access, dense, lora)
        x, h = hold((x, h))
        x, rt = layer_mlp(p, kind, li, cfg, x, h, grouped, dense, tp, lora)
        x = hold(x)
        if rt is not None:
            routes.append(rt)
    if routes:
        routes = tuple(jnp.stack(xs) for xs in zip(*routes))
    return x, kv, routes or None


def layer_attention(p, li: int, cfg: TextConfig, x, pos_RT, kv, access, dense=linear,
                    lora=None):
    """A decoder layer's first half -> (x + attention, its block input h = ln(x), kv).
    Moondream's block is parallel (attention and MLP both read h), so the two halves are
    separable: an image prefix may run them in different launches (`prefix_attention`,
    `prefix_mlp`)."""
    r, t, d = x.shape
    nh, kh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = layer_norm(x, p["ln"])
    qkv = dense(h, p["qkv"])
    if lora is not None:
        qkv = lora.add(li, "qkv", h, qkv)
    q = qkv[..., : nh * hd].reshape(r, t, nh, hd)
    k = qkv[..., nh * hd:(nh + kh) * hd].reshape(r, t, kh, hd)
    v = qkv[..., (nh + kh) * hd:].reshape(r, t, kh, hd)
    if cfg.tau:
        tq, tv = tau_factors(p["tau"], qkv, pos_RT)
        q = q * tq[..., None]
        # One factor per query head; kv head j takes head j's (all heads have their own
        # kv head in Moondream 3).
        v = v * tv[..., :kh, None]
    q = apply_rope(q, pos_RT, cfg)
    k = apply_rope(k, pos_RT, cfg)
    kv, a = access.update(kv, li, q, k, v, pos_RT)
    # (x + attn) + mlp, in the reference's order: it matters for bf16 rounding.
    o = dense(a.reshape(r, t, nh * hd), p["proj"])
    if lora is not None:   # the reference adapts proj from the block input h
        o = lora.add(li, "proj", h, o)
    return x + o, h, kv


def layer_mlp(p, kind: str, li: int, cfg: TextConfig, x, h, grouped: str = "blocks",
              dense=linear, tp=None, lora=None):
    """A decoder layer's second half -> (x + MLP(h), the MoE routing or None)."""
    rt = None
    if kind == "moe":
        m, rt = moe.moe_mlp(p["moe"], h, cfg.moe.experts_per_token, with_routes=True,
                            grouped=grouped, tp=tp,
                            lora=None if lora is None else lora.experts(li, h.shape[1]))
    elif lora is not None:
        g = gelu_tanh(lora.add(li, "fc1", h, dense(h, p["fc1"])))
        m = lora.add(li, "fc2", g, dense(g, p["fc2"]))
    else:
        m = mlp(h, p, dense)
    return x + m, rt


def logits(pt, hidden_RD, dense=linear, tp=None):
    """post_ln + lm_head, float32 logits (rounded through the model dtype first, as the
    reference's bf16 logits are).  `dense`, `tp`: as in `forward`."""
    if tp is not None:
        dense = tp.dense(dense)
    x = layer_norm(hidden_RD, pt["post_ln"])
    return dense(x, pt["lm_head"]).astype(F32)


def embed_tokens(pt, ids):
    return pt["wte"][ids]


def embed_rows(pt, ids_R):
    """[R, D]: `embed_tokens` of one token per row (a decode step), as R one-row slices of
    the table.  Same values; but XLA's cost analysis charges a gather of more than one row
    the whole [V, D] table (67 MB at the small config, 210 MB for Moondream 2 in float32)
    while a slice is charged its row, so the step's bytes-accessed figure stays what the
    step reads.  (When it runs, either form reads only its rows.)"""
    w = pt["wte"]
    return jnp.concatenate([jax.lax.dynamic_slice_in_dim(w, ids_R[i], 1)
                            for i in range(ids_R.shape[0])])


def input_embeddings(params, kind, token, value, *, cfg: MoondreamConfig, rows: bool = False):
    """[..., D] embeddings of inputs: a token, a coordinate, or a (w, h) size each (any
    leading shape: decode rows, or prompt positions with spatial refs).  `rows`: one token
    per row, [R] (a decode step: `embed_rows`)."""
    dt = jnp_dtype(cfg.dtype)
    embed = embed_rows if rows else embed_tokens
    tok = embed(params["text"], token).astype(dt)
    coord = region.encode_coordinate(params["region"], value[..., 0], dt)
    size = region.encode_size(params["region"], value, dt)
    k = kind[..., None]
    return jnp.where(k == KIND_COORD, coord, jnp.where(k == KIND_SIZE, size, tok))


def image_prefix(params, img_emb_ZD, *, cfg: MoondreamConfig):
    """[1, 1 + Z, D]: BOS embedding then the image embeddings."""
    bos = embed_tokens(params["text"], jnp.array([cfg.tokenizer.bos_id]))
    return jnp.concatenate([bos.astype(img_emb_ZD.dtype), img_emb_ZD], axis=0)[None]


def image_kv(params, crops_u8, src, ph, pw, adapters=None, slot_1=None, *,
             cfg: MoondreamConfig, grouped="blocks", vision_loop=False, tp=None,
             lora_mode="gather"):
    """An image's prefix KV ([L, 730, K, H] each): encode, project, and prefill BOS + image
    tokens (bidirectional) in a one-row cache of exactly the prefix length.  `adapters`,
    `slot_1` ([1] int32): the LoRA slot tables and the slot the prefix is computed under
    (the reference prefills the image through the adapted decoder too)."""
    _, emb = vision.encode_image(params, crops_u8, src, ph, pw, cfg=cfg, vision_loop=vision_loop)
    cache, pos, access = _prefix_cache(cfg, cfg.prefix_len, cfg.text.n_layers)
    rows = None if adapters is None else lora.Rows(adapters, slot_1, lora_mode)
    # (Each layer's halves held apart: the same bits as the prefix in slices, `halves`.)
    _, cache, _ = forward_layers(layer_params(params["text"], cfg.text), cfg.text,
                                 image_prefix(params, emb, cfg=cfg), pos, cache, access,
                                 grouped, tp=tp, lora=rows, halves=True)
    return cache.k[:, 0], cache.v[:, 0]


def _prefix_cache(cfg: MoondreamConfig, n: int, layers: int, dtype=None):
    """A one-row dense cache of `layers` layers and `n` positions for an image prefix, its
    positions [1, n] and the access that attends all n of them (the prefix is
    bidirectional): `image_kv`'s, and its slices'."""
    cache = init_cache(cfg, rows=1, length=n, dtype=dtype)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    access = DenseAccess(jnp.zeros(1, jnp.int32), jnp.full(1, n, jnp.int32), n)
    return KVCache(cache.k[:layers], cache.v[:layers]), pos, access


def prefix_layers(layers: list, kinds: tuple, h_1SD, k_LSKH, v_LSKH, first, adapters=None,
                  slot_1=None, *, cfg: MoondreamConfig, grouped="blocks", tp=None,
                  lora_mode="gather", kv_only: bool = False):
    """Layers first .. first + len(layers) of an image prefix's prefill (`image_kv`'s text
    part, a group of layers per launch) -> (hidden after them [1, S, D], K, V).  `layers`:
    those layers' params, `kinds` their kinds; `adapters` those layers' adapter tables
    (None: none).  Their K/V go into the prefix's dense [L, S, K, H] buffers at layer
    `first` (traced: one program per group shape, not per position in the stack).  The
    same arithmetic per layer as `image_kv`'s one pass: a layer's inputs are the previous
    layer's outputs whichever launch computed them.  `kv_only` (the last group): -> (K, V)
    only; the compiler drops what only the hidden needed (the last layer's attention
    output and MLP), as it does in `image_kv`."""
    cache, pos, access = _prefix_cache(cfg, h_1SD.shape[1], len(layers), k_LSKH.dtype)
    rows = None if adapters is None else lora.Rows(adapters, slot_1, lora_mode)
    h, cache, _ = forward_layers(list(zip(layers, kinds)), cfg.text, h_1SD, pos, cache,
                                 access, grouped, tp=tp, lora=rows, halves=True)
    at = (first, 0, 0, 0)
    kv = (jax.lax.dynamic_update_slice(k_LSKH, cache.k[:, 0], at),
          jax.lax.dynamic_update_slice(v_LSKH, cache.v[:, 0], at))
    return kv if kv_only else (h, *kv)


def prefix_attention(layer, x_1SD, k_LSKH, v_LSKH, first, adapters=None, slot_1=None, *,
                     cfg: MoondreamConfig, grouped="blocks", tp=None, lora_mode="gather",
                     kv_only: bool = False):
    """The first half of decoder layer `first` of an image prefix (`prefix_layers` by
    halves, for slices finer than a layer) -> (x + attention, h = ln(x), K, V with the
    layer's K/V written); with `kv_only` (the last layer), (K, V) alone: its attention is
    dropped by the compiler.  `adapters`: that layer's adapter tables as a one-element
    list (None: none)."""
    rows = None if adapters is None else lora.Rows(adapters, slot_1, lora_mode)
    dense = linear if tp is None else tp.dense(linear)
    cache, pos, access = _prefix_cache(cfg, x_1SD.shape[1], 1, k_LSKH.dtype)
    x, h, cache = layer_attention(layer, 0, cfg.text, x_1SD, pos, cache, access, dense, rows)
    at = (first, 0, 0, 0)
    kv = (jax.lax.dynamic_update_slice(k_LSKH, cache.k[:, 0], at),
          jax.lax.dynamic_update_slice(v_LSKH, cache.v[:, 0], at))
    return kv if kv_only else (x, h, *kv)


def prefix_mlp(layer, kind: str, x_1SD, h_1SD, adapters=None, slot_1=None, *,
               cfg: MoondreamConfig, grouped="blocks", tp=None, lora_mode="gather"):
    """The second half of a decoder layer of an image prefix -> x + MLP(h)."""
    rows = None if adapters is None else lora.Rows(adapters, slot_1, lora_mode)
    dense = linear if tp is None else tp.dense(linear)
    return layer_mlp(layer, kind, 0, cfg.text, x_1SD, h_1SD, grouped, dense, tp, rows)[0]


def _rows(adapters, slot_R):
    return None if adapters is None else lora.Rows(adapters, slot_R)


def prefill(params, cache, embeds_RTD, pos_RT, rows_R, prefix_R, last_R, kv_len,
            adapters=None, slot_R=None, *, cfg: MoondreamConfig, with_routes=False,
            grouped="blocks", vis_RT=None):
    """Dense-cache prefill (the one-request path) -> (cache, hidden, last hidden, logits).
    `with_routes` (parity traces): also the MoE routing at each row's last position,
    (ids, weights) each [Lm, R, k].  `adapters`, `slot_R`: LoRA slot tables and each
    row's slot (`lora`; None: none).  `vis_RT`: image blocks inside the prompt
    (`layers.attention_mask`; None: none)."""
    hidden, cache, routes = forward(params["text"], cfg.text, embeds_RTD, pos_RT, cache,
                                    DenseAccess(rows_R, prefix_R, kv_len, vis_RT), grouped,
                                    lora=_rows(adapters, slot_R))
    last = jnp.take_along_axis(hidden, last_R[:, None, None], axis=1)[:, 0]
    out = (cache, hidden, last, logits(params["text"], last))
    if not with_routes:
        return out
    at_last = jax.tree.map(lambda a: jnp.take_along_axis(a, last_R[None, :, None, None],
                                                         axis=2)[:, :, 0], routes)
    return (*out, at_last)


def decode(params, cache, kind_R, token_R, value_R2, pos_R, rows_R, prefix_R, kv_len,
           adapters=None, slot_R=None, *, cfg: MoondreamConfig, with_routes=False,
           grouped="blocks"):
    """Dense-cache decode of one input per row (the one-request path) -> (cache, hidden,
    logits).  `with_routes` (parity traces): also the MoE routing, (ids, weights) each
    [Lm, R, k].  `adapters`, `slot_R`: as `prefill`'s."""
    x = input_embeddings(params, kind_R, token_R, value_R2, cfg=cfg)[:, None]
    hidden, cache, routes = forward(params["text"], cfg.text, x, pos_R[:, None], cache,
                                    DenseAccess(rows_R, prefix_R, kv_len), grouped,
                                    lora=_rows(adapters, slot_R))
    h = hidden[:, 0]
    out = (cache, h, logits(params["text"], h))
    if not with_routes:
        return out
    return (*out, jax.tree.map(lambda a: a[:, :, 0], routes))


def write_prefix(cache: KVCache, k_LTKH, v_LTKH, row) -> KVCache:
    """An image prefix into row `row` of a dense cache (the one-request path)."""
    n = k_LTKH.shape[1]
    return KVCache(cache.k.at[:, row, :n].set(k_LTKH), cache.v.at[:, row, :n].set(v_LTKH))
