"""The parameter tree: its exact shapes for a config, and random initialisation for tests.

Params are a plain nested dict of arrays (the same dict is stored in the orbax checkpoint, so
there is no second layout to keep in sync).  Per-layer weights are stacked on a leading L axis
so the layer loops are `lax.scan`s: compile time stays flat in depth (27 vision blocks).
Linear weights are [in, out] (expert weights [E, in, out]).

Text layers form two stacked groups: `blocks` (the dense layers, 0 .. n_dense-1) and, with
mixture-of-experts layers, `moe_blocks` (n_dense .. n_layers-1; their MLP is
`moe = {router, fc1 [E, D, 2I], fc2 [E, I, D]}`).  A group with no layers is absent.  Tau
attention adds `tau = {wq [qkv, N], wv [qkv, N], alpha [N]}` to every layer; linear region
decoders are plain linears, `region.ln` their LayerNorm.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ..base.dtypes import jnp_dtype
from .config import MoondreamConfig


def _lin(i, o, lead=()):
    return {"w": (*lead, i, o), "b": (*lead, o)}


def _ln(d, lead=()):
    return {"w": (*lead, d), "b": (*lead, d)}


def param_shapes(cfg: MoondreamConfig) -> dict:
    """Nested dict of shape tuples, one per parameter."""
    v, t, r = cfg.vision, cfg.text, cfg.region
    L, E = (v.enc_n_layers,), v.enc_dim
    D = t.dim
    return {
        "vision": {
            "patch_emb": _lin(v.patch_dim, E),
            "pos_emb": (v.n_patches, E),
            "blocks": {
                "ln1": _ln(E, L),
                "qkv": _lin(E, 3 * E, L),
                "proj": _lin(E, E, L),
                "ln2": _ln(E, L),
                "fc1": _lin(E, v.enc_ff_dim, L),
                "fc2": _lin(v.enc_ff_dim, E, L),
            },
            "post_ln": _ln(E),
            "proj_mlp": {"fc1": _lin(2 * E, v.proj_inner_dim),
                         "fc2": _lin(v.proj_inner_dim, v.proj_out_dim)},
        },
        "text": {
            "wte": (t.vocab_size, D),
            **_text_blocks(t),
            "post_ln": _ln(D),
            "lm_head": _lin(D, t.vocab_size),
        },
        "region": {
            "coord_features": (1, r.coord_feat_dim // 2),
            "size_features": (2, r.size_feat_dim // 2),
            "coord_encoder": _lin(r.coord_feat_dim, r.dim),
            "coord_decoder": _decoder(r, r.coord_out_dim),
            "size_encoder": _lin(r.size_feat_dim, r.dim),
            "size_decoder": _decoder(r, r.size_out_dim),
            **({"ln": _ln(r.dim)} if r.use_ln else {}),
        },
    }


def _decoder(r, out: int) -> dict:
    if r.decoder_arch == "linear":
        return _lin(r.dim, out)
    return {"fc1": _lin(r.dim, r.inner_dim), "fc2": _lin(r.inner_dim, out)}


def _text_blocks(t) -> dict:
    """The dense group and (if any) the mixture-of-experts group of text layers."""
    D = t.dim

    def attn(lead):
        out = {"ln": _ln(D, lead), "qkv": _lin(D, t.qkv_dim, lead), "proj": _lin(D, D, lead)}
        if t.tau:
            out["tau"] = {"wq": (*lead, t.qkv_dim, t.n_heads), "wv": (*lead, t.qkv_dim, t.n_heads),
                          "alpha": (*lead, t.n_heads)}
        return out

    groups = {}
    if t.n_dense:
        lead = (t.n_dense,)
        groups["blocks"] = {**attn(lead), "fc1": _lin(D, t.ff_dim, lead),
                            "fc2": _lin(t.ff_dim, D, lead)}
    if t.n_moe:
        lead, m = (t.n_moe,), t.moe
        e, i = m.num_experts, m.expert_inner_dim
        groups["moe_blocks"] = {**attn(lead), "moe": {
            "router": _lin(D, e, lead), "fc1": (*lead, e, D, 2 * i), "fc2": (*lead, e, i, D)}}
    return groups


def _is_shape(x):
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


_REGION_LINEARS = ("coord_encoder", "size_encoder", "coord_decoder", "size_decoder", "fc1",
                   "fc2")


def weight_format(path: tuple[str, ...], cfg: MoondreamConfig) -> str:
    """The format of the leaf at `path` (checkpoint layout): "" (the model dtype) or one of
    `quant.FORMATS`, by `cfg.weights`."""
    w = cfg.weights
    if not w.any or not path:
        return ""
    if path[0] == "text":
        if "moe" in path:
            return w.experts if path[-1] in ("fc1", "fc2") else ""
        if path[-1] != "w":
            return ""
        if path[-2] == "lm_head":
            return w.head
        return w.linear if path[-2] in ("qkv", "proj", "fc1", "fc2") else ""
    if path[0] == "region" and path[-1] == "w" and path[-2] in _REGION_LINEARS:
        return w.region
    return ""


def param_specs(cfg: MoondreamConfig, dtype=None) -> dict:
    """The stored tree: {leaf: (shape, dtype)}, a quantized weight as its dict of parts
    (`quant.specs`); float leaves in `dtype` (default the config's)."""
    from . import quant

    dt = np.dtype(jnp_dtype(dtype or cfg.dtype))
    flat = flatten(param_shapes(cfg))
    out: dict = {}
    for path, shape in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        fmt = weight_format(path, cfg)
        node[path[-1]] = quant.specs(shape, fmt) if fmt else (shape, dt)
    return out


def _is_spec(x):
    return isinstance(x, tuple) and len(x) == 2 and _is_shape(x[0])


def abstract_params(cfg: MoondreamConfig, dtype=None, sharding=None) -> dict:
    """The tree of `jax.ShapeDtypeStruct` a checkpoint is restored against: float leaves in
    `dtype` (default the config's), quantized parts in their own dtypes."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s[0], s[1], sharding=sharding),
                        param_specs(cfg, dtype), is_leaf=_is_spec)


def init_params(key, cfg: MoondreamConfig, dtype=None) -> dict:
    """Random params (float: `quantize_params` makes a quantized tree of them) with roughly the reference's scales (for tests and benchmarks only).

    Each leaf is the first values of a flat draw whose size is rounded up to a power of two:
    JAX's (partitionable) threefry gives value i from the key and i alone, so these are the
    values a draw of the leaf's own shape gives, bit for bit, while one program per size
    bucket compiles instead of one per shape (a config has some 40 shapes, and on a CPU each
    compile of the normal sampler takes about half a second)."""
    dt = jnp_dtype(dtype or cfg.dtype)
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)[0]]
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, shape, path in zip(keys, leaves, paths):
        n = int(np.prod(shape))
        # Large leaves (benchmark configs) are drawn at their own size: no doubled draw.
        size = n if n > _BUCKET_CAP else max(256, 1 << (n - 1).bit_length())
        z = jax.random.normal(k, (size,), jnp.float32)
        # The same elementwise ops, one eager op at a time, as on the leaf's own shape.
        if "ln" in path and path.endswith("['w']"):
            val = 1.0 + 0.1 * z
        elif path.endswith("['b']"):
            val = 0.02 * z
        elif "features" in path:
            val = z
        elif path.endswith(("['w']", "['wq']", "['wv']", "['fc1']", "['fc2']")):
            val = z / np.sqrt(shape[-2])
        else:  # embeddings
            val = 0.5 * z
        out.append(_leading(val.astype(dt), n, shape))
    return jax.tree.unflatten(treedef, out)


_BUCKET_CAP = 1 << 22


def _leading(flat, n: int, shape) -> jax.Array:
    """The first `n` values of a flat array, shaped `shape`.  A bucketed draw (at most
    `_BUCKET_CAP` values) is cut on the host: a device slice would compile once per shape.
    A leaf drawn at its own size, and any draw under a trace (`jax.eval_shape(init_params)`
    gives the tree's shapes), stay on the device: a large leaf never makes a host round
    trip."""
    if flat.shape[0] == n:
        return flat.reshape(shape)
    if isinstance(flat, jax.core.Tracer):
        return flat[:n].reshape(shape)
    return jax.device_put(np.asarray(flat)[:n].reshape(shape))


def count_params(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def flatten(tree: dict) -> dict:
    """{path tuple: leaf} of a nested dict: anything that is not a dict is a leaf."""
    flat = {}

    def walk(node, path):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, (*path, k))
            else:
                flat[(*path, k)] = v

    walk(tree, ())
    return flat


def quantize_params(params: dict, cfg: MoondreamConfig, free: bool = False) -> dict:
    """A float checkpoint-layout tree -> the tree of `cfg.weights`: each leaf that
    `weight_format` names is quantized on the host (`quant.quantize` in NumPy, as the
    converter does, so a checkpoint quantized at load holds the converter's codes bit for
    bit; XLA:CPU's division inside a fused program is not IEEE-exact and moved one int4 code
    of 8192) and placed back on the leaf's device; leaves already quantized stay.  `free`:
    delete each float leaf once quantized (peak: the tree plus one leaf's codes)."""
    from . import quant

    out: dict = {}
    for path, leaf in flatten(params).items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        fmt = weight_format(path, cfg)
        if fmt and not quant.is_quantized(leaf):
            dev = next(iter(leaf.devices())) if isinstance(leaf, jax.Array) else None
            q = quant.quantize(np.asarray(leaf, np.float32), fmt)
            if free and isinstance(leaf, jax.Array):
                leaf.delete()
            leaf = jax.device_put(q, dev)
        node[path[-1]] = leaf
    return out
