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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..base.dtypes import F32, jnp_dtype, matmul_precision
from .config import MoondreamConfig

TARGETS = ("qkv", "proj", "fc1", "fc2")
MODES = ("gather", "masked")


def target_dims(cfg: MoondreamConfig) -> dict:
    """(in, out) of each adapted layer of a dense text block."""
    t = cfg.text
    return {"qkv": (t.dim, t.qkv_dim), "proj": (t.dim, t.dim),
            "fc1": (t.dim, t.ff_dim), "fc2": (t.ff_dim, t.dim)}


def supported(cfg: MoondreamConfig) -> str | None:
    """None if adapters in the reference's layout fit this model, else why not."""
    if cfg.text.n_moe:
        return ("Moondream 3's adapters (per-expert, kestrel's layout) are not supported yet; "
                "only Moondream 2's dense adapters are")
    return None


def init_tables(cfg: MoondreamConfig, slots: int, rank: int, dtype=None) -> list:
    """Zeroed slot tables: one dict per text layer, target -> {"A": [S, rank, in],
    "B": [S, out, rank]} with S = slots + 1 (slot 0 = no adapter)."""
    dt = jnp_dtype(dtype or cfg.dtype)
    dims = target_dims(cfg)
    return [{t: {"A": jnp.zeros((slots + 1, rank, i), dt), "B": jnp.zeros((slots + 1, o, rank), dt)}
             for t, (i, o) in dims.items()} for _ in range(cfg.text.n_layers)]


def table_bytes(cfg: MoondreamConfig, slots: int, rank: int, dtype=None) -> int:
    """Device bytes of `init_tables`."""
    size = jnp.dtype(jnp_dtype(dtype or cfg.dtype)).itemsize
    per_layer = sum(i + o for i, o in target_dims(cfg).values()) * rank * (slots + 1)
    return per_layer * cfg.text.n_layers * size


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


class Rows:
    """What `text.forward` needs to apply adapters: the slot tables (one dict per layer),
    each row's slot id [R] and the formulation.  A plain holder, made inside a program."""
    __slots__ = ("tables", "slot_R", "mode")

    def __init__(self, tables, slot_R, mode: str = "gather"):
        self.tables, self.slot_R, self.mode = tables, slot_R, mode

    def add(self, li: int, target: str, x_RTI, y):
        """y + B(A(x)) for layer `li`'s `target`, in the reference's order (base first)."""
        return y + delta(x_RTI, self.tables[li][target], self.slot_R, self.mode)


def default_mode(attention: str) -> str:
    """The formulation a platform's programs use (`MODES`), by its decode attention.
    "gather" for every one today: on CPU it is as fast or faster but at rank 64 and batch
    32 (bench/lora.py), and the H200 and TPU v5e deviceless compiles need no more memory
    for it (docs/lora.md); GPU and TPU speeds are not measured."""
    return "gather"
