"""Tensor parallelism: one engine over a mesh of chips, with results equal to one chip's.

One host drives the mesh; the scheduler, page tables and slots are unchanged and replicated.
What is split over the mesh axis "model" (`AXIS`):

- every text linear layer (qkv, proj, the MLP's fc1 and fc2) and the LM head by their
  *output* columns (the LM head by vocabulary);
- Moondream 3's experts by expert (expert parallel): a chip holds E/n whole experts;
- the KV pool by kv heads, and with it the decode and prefill attention (each chip writes
  and reads the heads it holds, through the same page tables);
- nothing else: the vision encoder, the region heads, the embeddings and the norms are
  replicated (the vision encoder is about 0.4 GB in bfloat16; splitting it would save less
  than one layer of Moondream 3's experts).

Why columns only, and no row-parallel layer with an all-reduce: an all-reduce sums partial
products in another order than one chip's matmul does, so logits would differ in the last
bits and, on near ties, the tokens.  Here every output element of every product is computed
whole on one chip, and the activations between products are gathered (`dense`): the values
are bitwise those of one chip (measured on XLA:CPU; `tests/test_mesh.py`).  That rests on a
column-split product summing each column in the order the whole one does, which XLA:CPU's
dots and our CPU kernel do; a GPU or TPU GEMM may pick another algorithm (split-K, tiles)
for the narrower shape, and then ties could break differently.  Unchecked: no multi-chip
device was available (the check would be `tests/mesh_check.py` on a multi-GPU host).  The gathers move
[rows, width] activations, a few MB per decode step at batch 32 -- nothing beside the
weights a step reads.  The experts' outputs are combined with a `psum` in which exactly one
chip contributes each (token, expert) product and the others add zeros, which is exact too.

A dimension that does not divide by the mesh size stays replicated (a tiny test model's one
kv head, a vocabulary of odd size): correct, only less spread.  `memory.plan` counts bytes
per chip from the same rule (`param_spec`).

Each sharded computation is a `jax.shard_map` over explicit specs rather than an annotation
for XLA's partitioner: custom calls (our CPU kernels, Pallas kernels) cannot be partitioned
by XLA, and explicit specs keep XLA from choosing a reduction order of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import quant

AXIS = "model"

_TEXT_LINEARS = ("qkv", "proj", "fc1", "fc2")
# The output axis of each leaf of a linear layer: {"w": [in, out], "b": [out]}, or the
# serving LM head's {"w_vd": [out, in], "b"} (`text.unstack_layers`).
_OUT_AXIS = {"w": -1, "w_vd": -2, "b": -1}


def local_experts(n_experts: int, mesh_size: int) -> int:
    """Experts one chip holds: an equal share, or all of them when they do not divide
    (`param_spec`'s rule for the experts' axis)."""
    if mesh_size > 1 and n_experts % mesh_size == 0:
        return n_experts // mesh_size
    return n_experts


def make_mesh(tensor_parallel: int, devices=None) -> Mesh:
    """A one-axis mesh over the first `tensor_parallel` of `devices` (default: the local
    devices)."""
    devs = list(jax.local_devices() if devices is None else devices)
    if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or \
            tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be a positive int, got {tensor_parallel!r}")
    if tensor_parallel > len(devs):
        raise ValueError(f"tensor_parallel={tensor_parallel} needs {tensor_parallel} devices; "
                         f"{len(devs)} available")
    return Mesh(np.array(devs[:tensor_parallel]), (AXIS,))


def check_mesh(mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if mesh.axis_names != (AXIS,):
        raise ValueError(f"mesh must have the one axis {AXIS!r} (e.g. Mesh(devices, "
                         f"({AXIS!r},))), got axes {mesh.axis_names}")
    return mesh


def _key(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "idx", entry)))


def param_axis(path: tuple[str, ...]) -> int | None:
    """The axis a parameter is split on (negative, so stacked checkpoint layers and the
    serving per-layer dicts agree), or None: replicated.  `path`: its keys from the root.
    A part of a quantized weight (`quant`) is split where its weight is: by output column
    or by expert."""
    if path and path[-1] in quant.PARTS:
        return _part_axis(path[-2], path[-1], param_axis(path[:-1]))
    if not path or path[0] != "text":
        return None
    name, parent = path[-1], path[-2] if len(path) > 1 else ""
    if "moe" in path and name in ("fc1", "fc2"):
        return -3                                # [.., E, in, out]: by expert
    if parent == "lm_head" or (parent in _TEXT_LINEARS and "moe" not in path[:-1]):
        return _OUT_AXIS.get(name)               # by output column (LM head: vocabulary)
    return None


def _part_axis(weight: str, part: str, axis: int | None) -> int | None:
    if axis is None:
        return None
    if axis == -3:                     # an expert stack: every part leads with E ...
        return -2 if part == "s" else -3   # ... a channel scale is [.., E, N]
    if weight == "w_vd":               # the head's codes [V, D], its scales [V]
        return -1 if part == "s" else -2
    return -1                          # [.., K, N] codes and [.., N] / [.., G, N] scales


def _spec(axis: int | None, shape: tuple, n: int) -> P:
    if axis is None or n == 1 or shape[axis] % n:
        return P()
    spec = [None] * len(shape)
    spec[axis] = AXIS
    return P(*spec)


def param_spec(path: tuple[str, ...], shape: tuple, n: int) -> P:
    return _spec(param_axis(path), shape, n)


def _path(kp) -> tuple[str, ...]:
    return tuple(_key(e) for e in kp)


def param_axis_split(kp, shape: tuple, n: int) -> bool:
    """Whether the parameter at key path `kp` is split over an n-chip mesh."""
    return param_spec(_path(kp), shape, n) != P()


@dataclass(frozen=True)
class TensorParallel:
    """The layout of one model over `mesh` (hashable: a static argument of the programs).
    `pack`: kv heads per pool row (`platforms.Platform.pack`: 2 in the TPU kernel's layout)."""
    mesh: Mesh
    pack: int = 1

    @property
    def n(self) -> int:
        return self.mesh.size

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    # -- placement ---------------------------------------------------------------------

    def param_specs(self, params):
        return jax.tree_util.tree_map_with_path(
            lambda kp, x: param_spec(_path(kp), x.shape, self.n), params)

    def param_shardings(self, params):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.param_specs(params),
                            is_leaf=lambda x: isinstance(x, P))

    def heads_split(self, n_kv_heads: int) -> bool:
        """Whether the pool (and attention) is split by kv heads: the heads, and the pool
        rows that hold them, divide over the mesh."""
        rows = -(-n_kv_heads // self.pack)
        return self.n > 1 and n_kv_heads % self.n == 0 and rows % self.n == 0

    def heads_per_chip(self, n_kv_heads: int) -> int:
        """The kv heads each chip's pool holds (all of them when they are not split)."""
        return n_kv_heads // self.n if self.heads_split(n_kv_heads) else n_kv_heads

    def pool_spec(self, n_kv_heads: int) -> P:
        # Every pool array ([K, P, B, H] codes, [K, P, B] scales) leads with kv heads.
        return P(AXIS) if self.heads_split(n_kv_heads) else P()

    # -- computations ------------------------------------------------------------------

    def _map(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    def dense(self, inner):
        """A linear layer (`layers.linear` or a kernel with its signature) computed by
        output columns on each chip from the gathered input, its output gathered again."""
        def apply(x, p):
            # The rule `param_spec` placed them by (a text linear layer or the LM head).
            specs = {k: ({part: _spec(_part_axis(k, part, _OUT_AXIS[k]), a.shape, self.n)
                          for part, a in v.items()} if quant.is_quantized(v)
                         else _spec(_OUT_AXIS[k], v.shape, self.n)) for k, v in p.items()}
            split = specs.get("w_vd", specs.get("w"))
            if isinstance(split, dict):
                split = split.get("q", split.get("q4"))
            if split == P():
                return inner(x, p)
            out = P(*([None] * (x.ndim - 1)), AXIS)
            y = self._map(inner, (P(), specs), out)(x, p)
            return jax.lax.with_sharding_constraint(y, self.replicated)
        return apply

    def experts(self, apply, p, x_ND, ids_NK, *extra):
        """`apply(p, x, ids, *extra)` -> [N, k, D] (or a tuple of [N, k, ...]) over this
        chip's experts only, combined: each (token, expert) product comes from the one chip
        holding the expert, the others add zeros (`psum`, exact).  `extra`: per-assignment
        inputs [N, k, ...] (the adapters' up deltas), replicated."""
        e = quant.logical_shape(p["fc1"])[0]
        if local_experts(e, self.n) == e:
            return apply(p, x_ND, ids_NK, *extra)

        def local(w, x, ids, *more):
            e_local = quant.logical_shape(w["fc1"])[0]
            lid = ids - jax.lax.axis_index(AXIS) * e_local
            mine = (lid >= 0) & (lid < e_local)
            # Other chips' experts as id e_local: a grouped schedule leaves them out.
            out = apply(w, x, jnp.where(mine, lid, e_local), *more)
            return jax.tree.map(lambda y: jax.lax.psum(
                jnp.where(mine[..., None], y, jnp.zeros((), y.dtype)), AXIS), out)

        w = {"fc1": p["fc1"], "fc2": p["fc2"]}
        return self._map(local, ({"fc1": P(AXIS), "fc2": P(AXIS)}, P(), P())
                         + (P(),) * len(extra), P())(w, x_ND, ids_NK, *extra)

    def on_heads(self, fn, n_kv_heads: int, arrays, heads, rest):
        """`fn(arrays, heads, rest)` on each chip's kv heads: `arrays` (pool arrays, leading
        kv heads), `heads` (activations [R, T, heads, H]: q, k, v), `rest` (replicated:
        page tables, offsets).  Returns (arrays, out) with `out` [R, T, heads * H]."""
        if not self.heads_split(n_kv_heads):
            return fn(arrays, heads, rest)
        pool = jax.tree.map(lambda _: P(AXIS), arrays)
        act = jax.tree.map(lambda _: P(None, None, AXIS), heads)
        rep = jax.tree.map(lambda _: P(), rest)
        return self._map(fn, (pool, act, rep), (pool, P(None, None, AXIS)))(
            arrays, heads, rest)

    def on_pool(self, fn, n_kv_heads: int, arrays, heads, rest):
        """`fn(arrays, heads, rest)` -> arrays, on each chip's kv heads: prefix writes
        (`heads`: [L, S, K, H] dense K/V) and page copies (`heads` empty)."""
        if not self.heads_split(n_kv_heads):
            return fn(arrays, heads, rest)
        pool = jax.tree.map(lambda _: P(AXIS), arrays)
        act = jax.tree.map(lambda _: P(None, None, AXIS), heads)
        rep = jax.tree.map(lambda _: P(), rest)
        return self._map(fn, (pool, act, rep), pool)(arrays, heads, rest)
