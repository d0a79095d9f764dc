"""LoRA adapters on the text decoder: the device tables of adapter slots and the per-row
low-rank products the decoder adds.

Moondream 2's finetunes (the public reference, `moondream/torch/lora.py`, `text.py`,
`layers.py`) add `B(A(h))` to four linear layers of every text block: `qkv` and `fc1` take
the block's layer-normed input h, `fc2` the GELU output, and `proj` -- as the reference
writes it -- also the block's layer-normed input h, not the attention output.  No scale
factor: A [r, in] and B [out, r] are used as stored.

Serving many adapters in one batch: every layer keeps, per target, a table of S slots,
`A` [S, rank, in] and `B` [S, out, rank] (slot 0 all zeros: "no adapter"; adapters of a
smaller rank are zero-padded).  Each row carries its slot id.  Two formulations give the
same sums, chosen per platform (`MODES`):

- "gather": each row's A and B are gathered from the table (the Punica / S-LoRA idea): the
  step reads rows x rank x (in + out) values per target;
- "masked": every row multiplies by all slots' A at once ([in, S x rank]), the columns of
  other slots are zeroed, then one product with all slots' B ([S x rank, out]): the step
  reads the whole table once, whatever the batch (fewer bytes once rows outnumber slots).

Slot tables are an argument of the programs, never a constant in them: loading an adapter
writes its slot (`write_slot`, a device write outside the step) and retraces nothing.

Moondream 3's finetunes are laid out as Moondream's own engine lays them out (kestrel 0.9.2,
`models/moondream/lora.py`, `lora_workspace.py`, and kestrel_kernels' MoE LoRA path): no
attention adapters; the dense MLP of each of the first `start_layer` layers adapted as
above (fc1 "up", fc2 "down", at the adapter's rank r); and per-expert adapters on every
mixture-of-experts layer, the rank split over the k active experts (r / k per expert):
for a token routed to expert e, `up` adds B_up[e](A_up[e] x) to the expert's gate/up output
(2I wide, before the activation) and `down` adds B_down[e](A_down[e] a) to its output
(before the routing weight), so each expert computes as if its weights were
W + B A -- the merged finetune.  The expert tables, `up` {A [S, E, r/k, D],
B [S, E, 2I, r/k]} and `down` {A [S, E, r/k, I], B [S, E, D, r/k]}, are read per
(token, expert) assignment (`expert_delta`), whatever the MoE schedule.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..base.dtypes import F32, jnp_dtype, matmul_precision
from .config import MoondreamConfig

TARGETS = ("qkv", "proj", "fc1", "fc2")
EXPERT_TARGETS = ("up", "down")
MODES = ("gather", "masked")


def target_dims(cfg: MoondreamConfig) -> dict:
    """(in, out) of each adapted layer of a dense text block."""
    t = cfg.text
    return {"qkv": (t.dim, t.qkv_dim), "proj": (t.dim, t.dim),
            "fc1": (t.dim, t.ff_dim), "fc2": (t.ff_dim, t.dim)}


def expert_rank(cfg: MoondreamConfig, rank: int) -> int:
    """Per-expert rank of an adapter of total rank `rank` (kestrel: rank / k)."""
    return rank // cfg.text.moe.experts_per_token if cfg.text.moe else 0


def layout(cfg: MoondreamConfig, rank: int) -> list:
    """Per text layer, target -> (A shape, B shape) of one adapter of rank `rank` (no slot
    axis): Moondream 2's four targets per block; Moondream 3's fc1 / fc2 on its dense
    layers and `up` / `down` per expert on its mixture-of-experts layers."""
    t = cfg.text
    dims = target_dims(cfg)
    dense = TARGETS if t.moe is None else ("fc1", "fc2")
    out = [{n: ((rank, dims[n][0]), (dims[n][1], rank)) for n in dense}
           for _ in range(t.n_dense)]
    if t.n_moe:
        e, inner, re = t.moe.num_experts, t.moe.expert_inner_dim, expert_rank(cfg, rank)
        moe = {"up": ((e, re, t.dim), (e, 2 * inner, re)),
               "down": ((e, re, inner), (e, t.dim, re))}
        out += [dict(moe) for _ in range(t.n_moe)]
    return out


def supported(cfg: MoondreamConfig, rank: int | None = None) -> str | None:
    """None if adapter slots of total rank `rank` fit this model, else why not."""
    moe = cfg.text.moe
    if moe is not None and rank is not None and rank < moe.experts_per_token:
        return (f"max_lora_rank {rank} is below Moondream 3's {moe.experts_per_token} "
                "experts per token: an adapter's rank is split over the active experts "
                f"(rank / {moe.experts_per_token} each); raise max_lora_rank")
    return None


def init_tables(cfg: MoondreamConfig, slots: int, rank: int, dtype=None) -> list:
    """Zeroed slot tables: one dict per text layer, target -> {"A": [S, *A], "B": [S, *B]}
    (`layout`) with S = slots + 1 (slot 0 = no adapter)."""
    dt = jnp_dtype(dtype or cfg.dtype)
    return [{n: {"A": jnp.zeros((slots + 1,) + a, dt), "B": jnp.zeros((slots + 1,) + b, dt)}
             for n, (a, b) in layer.items()} for layer in layout(cfg, rank)]


def table_bytes(cfg: MoondreamConfig, slots: int, rank: int, dtype=None) -> int:
    """Device bytes of `init_tables`."""
    size = jnp.dtype(jnp_dtype(dtype or cfg.dtype)).itemsize
    count = sum(math.prod(a) + math.prod(b) for layer in layout(cfg, rank)
                for a, b in layer.values())
    return count * (slots + 1) * size


def write_slot(tables: list, slot, adapter: list) -> list:
    """`tables` with slot `slot` (int32 scalar) holding `adapter` (the same structure
    without the slot axis, already padded to the tables' rank)."""
    return jax.tree.map(lambda t, a: jax.lax.dynamic_update_index_in_dim(
        t, a.astype(t.dtype), slot, 0), tables, adapter)


def delta(x_RTI, ab, slot_R, mode: str = "gather"):
    """B(A(x)) of each row under its slot's adapter -> [R, T, out] in x's dtype, accumulated
    in float32 (the intermediate rounded to x's dtype, as the reference's two linears)."""
    a, b = ab["A"], ab["B"]
    prec = matmul_precision(x_RTI.dtype)
    dt = x_RTI.dtype
    if mode == "gather":
        # The gather reads only the tables and the slot ids, so XLA:GPU schedules every
        # layer's gathered copy at the start of the program, all alive at once (measured,
        # H200 deviceless compile, Moondream 2, 8 slots of rank 64: a 32-row prefill's
        # temporaries 2.9 GB instead of ~0.5 GB).  Tying the ids to this layer's input keeps
        # each copy next to its use.
        x_RTI, slot_R = jax.lax.optimization_barrier((x_RTI, slot_R))
        a_R, b_R = a[slot_R].astype(dt), b[slot_R].astype(dt)
        u = jnp.einsum("rti,rki->rtk", x_RTI, a_R, precision=prec,
                       preferred_element_type=F32).astype(dt)
        return jnp.einsum("rtk,rok->rto", u, b_R, precision=prec,
                          preferred_element_type=F32).astype(dt)
    if mode != "masked":
        raise ValueError(f"LoRA mode {mode!r}; expected one of {MODES}")
    s, k, i = a.shape
    u = jnp.einsum("rti,ski->rtsk", x_RTI, a.astype(dt), precision=prec,
                   preferred_element_type=F32).astype(dt)
    own = (jnp.arange(s, dtype=slot_R.dtype)[None, :] == slot_R[:, None])   # [R, S]
    u = jnp.where(own[:, None, :, None], u, jnp.zeros((), dt)).reshape(*u.shape[:2], s * k)
    bt = b.astype(dt).transpose(1, 0, 2).reshape(b.shape[1], s * k)   # [out, S x rank]
    return jnp.einsum("rtj,oj->rto", u, bt, precision=prec,
                      preferred_element_type=F32).astype(dt)


def expert_delta(x, ab, slot_N, ids_NK):
    """Each (token, expert) assignment's adapter product B[s, e](A[s, e] x) -> [N, k, out]
    in x's dtype: `x` [N, in] (the token's input, for `up`) or [N, k, in] (the assignment's
    activation, for `down`), `ab` one layer's expert tables {"A": [S, E, r, in], "B": [S,
    E, out, r]}, `slot_N` each token's slot, `ids_NK` its experts.  Each assignment's A and
    B are gathered, so the bytes read follow the assignments, not the slots times the
    experts.  In one piece, not in a loop over chunks of assignments: XLA:GPU fuses the
    gathers into the products (+67 MB of temporaries for a 2048-token expert layer at
    Moondream 3's shapes, rank 64, H200 deviceless compile), while a loop's buffers are
    never shared between layers (+33 MB per layer at 512 tokens, every layer's at once)."""
    n, k = ids_NK.shape
    dt = x.dtype
    a_tab, b_tab = ab["A"], ab["B"]
    prec = matmul_precision(dt)
    x_AI = jnp.broadcast_to(x[:, None], (n, k, x.shape[-1])) if x.ndim == 2 else x
    x_AI = x_AI.reshape(n * k, -1)
    slot_A = jnp.broadcast_to(slot_N[:, None], (n, k)).reshape(-1)
    ids_A = ids_NK.reshape(-1)
    # An id past the table (another chip's expert, `sharding.TensorParallel.experts`) is
    # read as the last expert; the caller drops that assignment.
    ids_A = jnp.minimum(ids_A, a_tab.shape[1] - 1)

    u = jnp.einsum("ai,ari->ar", x_AI, a_tab[slot_A, ids_A].astype(dt), precision=prec,
                   preferred_element_type=F32).astype(dt)
    out = jnp.einsum("ar,aor->ao", u, b_tab[slot_A, ids_A].astype(dt), precision=prec,
                     preferred_element_type=F32).astype(dt)
    return out.reshape(n, k, -1)


class Rows:
    """What `text.forward` needs to apply adapters: the slot tables (one dict per layer),
    each row's slot id [R] and the formulation.  A plain holder, made inside a program."""
    __slots__ = ("tables", "slot_R", "mode")

    def __init__(self, tables, slot_R, mode: str = "gather"):
        self.tables, self.slot_R, self.mode = tables, slot_R, mode

    def add(self, li: int, target: str, x_RTI, y):
        """y + B(A(x)) for layer `li`'s `target`, in the reference's order (base first); y
        itself where the layer's adapters leave that target alone (Moondream 3's
        attention)."""
        ab = self.tables[li].get(target)
        if ab is None:
            return y
        return y + delta(x_RTI, ab, self.slot_R, self.mode)

    def experts(self, li: int, t: int):
        """(layer `li`'s expert tables, each token's slot [R * t]) for `moe.moe_mlp`."""
        return self.tables[li], jnp.repeat(self.slot_R, t)


def default_mode(attention: str) -> str:
    """The formulation a platform's programs use (`MODES`), by its decode attention.
    "gather" for every one today: on CPU it is as fast or faster but at rank 64 and batch
    32 (bench/lora.py), and the H200 and TPU v5e deviceless compiles need no more memory
    for it (docs/lora.md); GPU and TPU speeds are not measured."""
    return "gather"
