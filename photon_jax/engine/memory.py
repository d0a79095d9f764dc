"""Device memory: what a loaded model needs (weights, KV pool, slots, workspace), how large the
KV pool is by default, and the check at load that refuses with numbers instead of running
out of memory mid-run.

Sizes come from shapes alone (`jax.eval_shape` of the param tree and the pool), so the
accounting of a full-size model is computed, and tested, without allocating anything.

Default pool (`kv_cache_tokens=None`):
- GPU (and other accelerators): 90% of what is free on the device once the weights, the two
  slots and a workspace for XLA's temporaries are set aside.  JAX preallocates 75% of GPU
  memory by default; `XLA_PYTHON_CLIENT_MEM_FRACTION` changes that share (see README).
- CPU: enough for `max_batch_size` sequences at full context plus four cached image
  prefixes, capped at a quarter of the available host memory (and at 2 GiB): MemAvailable,
  page cache included, within the cgroup's limit (`hostmem.host_available`).

An 8-bit pool (`kv_dtype`, `kvpool.QUANTIZED`) costs its code bytes plus a float32 scale per
(kv head, position): 68 bytes per head and position at head dim 64 against 128 in bfloat16,
so the same bytes hold 1.88x the positions (3.76x against float32).

Over a mesh (`mesh_size` chips, `sharding`), every figure is per chip: each split weight
counts 1/n, the replicated ones whole, and the pool 1/n when its kv heads divide over the
chips; the pool is then sized from the first chip's free memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..base.dtypes import canonical, jnp_dtype
from ..model import moe
from ..model.config import MoondreamConfig
from ..model.platforms import Platform, choose, host_platform
from ..model.sharding import local_experts
from .hostmem import host_available
from .pages import pages_for
from .stepmeta import Arenas

GiB = 1 << 30
CPU_POOL_CAP = 2 * GiB
GPU_POOL_SHARE = 0.9
MIN_WORKSPACE = 1 * GiB
PAGE_MULTIPLE = 8   # pool pages in the TPU layout (`plan`)
PREFILL_TOKENS = 2048   # the engine's default prompt positions a prefill (`Engine`)


class MemoryError_(MemoryError):
    """The model, its KV pool and its buffers do not fit the device (the message gives the
    numbers and the settings that change them)."""


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def bytes_per_token(cfg: MoondreamConfig, dtype=None, kv_dtype=None, mesh_size: int = 1,
                    pack: int = 1) -> int:
    """K + V of one position over every layer (`kv_dtype` an 8-bit format: codes and
    scales; None: the pool in the model's dtype), on one chip of a `mesh_size` mesh, in
    the pool layout `pack` gives (`platforms.Platform.pack`: > 1 on TPU)."""
    from .kvpool import position_bytes

    full = position_bytes(cfg.text, kv_dtype or canonical(dtype or cfg.dtype), pack)
    rows = -(-cfg.text.n_kv_heads // pack)   # pool rows (`sharding.TensorParallel.heads_split`)
    split = mesh_size > 1 and cfg.text.n_kv_heads % mesh_size == 0 and rows % mesh_size == 0
    return full // mesh_size if split else full


def weight_bytes(cfg: MoondreamConfig, dtype=None, mesh_size: int = 1) -> int:
    """The weights' bytes (on one chip of a `mesh_size` mesh: `sharding.param_spec`)."""
    from ..model.params import abstract_params
    from ..model.sharding import param_axis_split

    def on_chip(kp, x):
        nbytes = int(np.prod(x.shape)) * x.dtype.itemsize
        return nbytes // mesh_size if param_axis_split(kp, x.shape, mesh_size) else nbytes

    return sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(
        on_chip, abstract_params(cfg, dtype or cfg.dtype))))


def slot_bytes(cfg: MoondreamConfig, max_batch_size: int, dtype=None) -> int:
    """The engine's device state besides the pool (`step.DeviceState`): two slots (logits
    f32, hidden, sampled ids/values), the pending inputs and the constraint table, from
    abstract shapes."""
    from .step import DeviceState

    state = DeviceState.abstract(cfg.with_dtype(canonical(dtype or cfg.dtype)),
                                 arena_sizes=(1,), page_size=16,
                                 max_batch_size=max_batch_size).nbytes()
    return state["slots"] + state["pending"] + state["tables"]


def prefill_token_bytes(cfg: MoondreamConfig, prefill_tokens: int = PREFILL_TOKENS,
                        mesh_size: int = 1, dtype=None, grouped: str = "ragged",
                        max_context: int | None = None) -> int:
    """Temporaries one prompt position of a prefill keeps live in its widest layer, on one
    chip of a `mesh_size` mesh (it = the dtype's bytes, D the width, I an expert's width):

    - the MLP: a mixture of k experts (`moe`, the grouped `ragged_dot` schedule) holds, per
      position and chosen expert, its input sorted by expert (D x it), fc1's gate and up
      outputs in float32 and cast back (2I x (4 + it)), the gated activation (I x it),
      fc2's output in float32 (D x 4) and the weighted output with its sum over the chips
      (2D x it) -- each chip holds a row for every (position, expert), those of other
      chips' experts in no group (`sharding.TensorParallel.experts`: not computed, but
      allocated: the row count is static), so none of it divides over the mesh; with the
      `dense` prefill schedule (`grouped`, GPU) each of the chip's experts holds fc1's
      output and the gated activation for every position (E/n x 3I x it: XLA fuses the
      float32 accumulations into the products; 0.39 MB a position at Moondream 3's shapes,
      746 and 2048 positions, measured in deviceless H200 compiles); a dense MLP holds fc1's output in float32, cast back, and its activation (ff x (4 + 2 it));
    - the attention: float32 scores of the chip's query heads against the keys of the
      position's own row -- at most an image prefix plus the prefill's positions, and at
      most the row's context (`max_context`, rounded up to 256 positions: the gathered view
      is whole pages) -- (n_heads / n x keys x 4).  Uncapped, a 32-row bench prefill of
      32 x 1024 positions was budgeted as one 32768-position sequence (33.7 GB).

    Measured in deviceless compiles of 32-row prefills (2048 positions, after an image
    prefix): Moondream 3 on a v5e 2x2, 0.60 GB of temporaries per chip, against 2048 x this
    = 0.75 GB (+ 0.05 GB of view, `prefill_view_bytes`); Moondream 2 on one v5e, 1.03 GB
    against 0.86 + 0.21 GB."""
    t = cfg.text
    it = np.dtype(canonical(dtype or cfg.dtype)).itemsize
    if t.moe is not None:
        d, inner, k = t.dim, t.moe.expert_inner_dim, t.moe.experts_per_token
        mlp = k * (d * it + 2 * inner * (4 + it) + inner * it + d * 4 + 2 * d * it)
        e = t.moe.num_experts
        if moe.schedule(prefill_tokens, e, k, grouped) == "dense":
            mlp = max(mlp, local_experts(e, mesh_size) * 3 * inner * it)
    else:
        mlp = t.ff_dim * (4 + 2 * it)
    split = mesh_size > 1 and t.n_kv_heads % mesh_size == 0
    heads = t.n_heads // mesh_size if split else t.n_heads
    keys = cfg.prefix_len + prefill_tokens
    if max_context is not None:
        keys = min(keys, -(-max_context // 256) * 256)
    return mlp + heads * keys * 4


def prefill_view_bytes(cfg: MoondreamConfig, max_batch_size: int,
                       prefill_tokens: int = PREFILL_TOKENS, mesh_size: int = 1, dtype=None,
                       kv_dtype=None) -> int:
    """The K/V a prompt prefill gathers from the pool into a contiguous view
    (`kvpool.prefill_attend`), on one chip: each row's image prefix and the prefill's
    positions, K and V, the chip's kv heads; an 8-bit pool's codes are dequantized there
    (float32) and cast to the model's dtype.  Measured with Moondream 2's int8 pool on one
    v5e, 32 rows of 64 positions: 1.29 GB of temporaries, against 0.73 GB of view plus the
    positions' 0.86 GB (`prefill_token_bytes`)."""
    from .kvpool import QUANTIZED

    t = cfg.text
    it = np.dtype(canonical(dtype or cfg.dtype)).itemsize
    per_elem = 1 + 4 + it if kv_dtype in QUANTIZED else it
    heads = t.n_kv_heads // mesh_size if mesh_size > 1 and t.n_kv_heads % mesh_size == 0 \
        else t.n_kv_heads
    positions = max_batch_size * cfg.prefix_len + prefill_tokens
    return positions * 2 * heads * t.head_dim * per_elem


def widened_bytes(cfg: MoondreamConfig, dtype=None, mesh_size: int = 1) -> int:
    """The largest quantized weight widened to the compute dtype at once, on one chip
    (`quant.dequantize`: where XLA does not fuse the widening into the product, a CPU's
    prefill, a grouped expert product's whole stack of one layer); 0 unquantized."""
    from ..model.params import flatten, param_shapes, weight_format
    from ..model.sharding import local_experts

    if not cfg.weights.any:
        return 0
    it = np.dtype(canonical(dtype or cfg.dtype)).itemsize
    best, experts = 0, 0
    for path, shape in flatten(param_shapes(cfg)).items():
        if not weight_format(path, cfg):
            continue
        per_layer = int(np.prod(shape[1:] if path[1] in ("blocks", "moe_blocks") else shape))
        if "moe" in path:
            e = shape[1]
            experts += per_layer // e * local_experts(e, mesh_size)
        else:
            n = shape[-1]
            best = max(best, per_layer // (mesh_size if n % mesh_size == 0 else 1))
    return max(best, experts) * it


def workspace_bytes(cfg: MoondreamConfig, dtype=None, prefill_tokens: int = PREFILL_TOKENS,
                    mesh_size: int = 1, max_batch_size: int = 1, kv_dtype=None,
                    grouped: str = "ragged", max_context: int | None = None) -> int:
    """A budget for XLA's temporaries: twice the largest single activation of an image
    prefill (the vision encoder's attention scores over all crops, or the text model's over
    the image prefix), or a prompt prefill of `prefill_tokens` positions over up to
    `max_batch_size` rows (`prefill_token_bytes` each, and the K/V view it gathers:
    `prefill_view_bytes`), at least 1 GiB; plus, with quantized weights, the largest of them
    widened (`widened_bytes`)."""
    v, t = cfg.vision, cfg.text
    crops = v.max_crops + 1
    vision = crops * v.enc_n_heads * v.n_patches ** 2 * 4
    text = t.n_heads * cfg.prefix_len ** 2 * 4
    mlp = cfg.prefix_len * max(t.ff_dim, v.enc_ff_dim * crops) * 4
    prefill = (prefill_tokens * prefill_token_bytes(cfg, prefill_tokens, mesh_size, dtype,
                                                    grouped, max_context)
               + prefill_view_bytes(cfg, max_batch_size, prefill_tokens, mesh_size, dtype,
                                    kv_dtype))
    return max(MIN_WORKSPACE, 2 * max(vision, text, mlp), prefill) + widened_bytes(
        cfg, dtype, mesh_size)


def cpu_vision_widened_bytes(cfg: MoondreamConfig, dtype=None) -> int:
    """XLA:CPU's float32 copy of a bfloat16 vision tower's blocks, made for every encode:
    the encoder scans its stacked blocks, and XLA:CPU takes a bfloat16 product whose weight
    is sliced out of a stack in float32, converting the whole stack ahead of the loop
    (measured at full Moondream 2 size: 2.1 GB of temporaries in the image prefix program).
    0 in float32."""
    if jnp_dtype(dtype or cfg.dtype) != jnp.bfloat16:
        return 0
    e, f = cfg.vision.enc_dim, cfg.vision.enc_ff_dim
    per_block = 4 * e * e + 2 * e * f + 9 * e + f   # qkv, proj, fc1, fc2, biases, 2 norms
    return 4 * cfg.vision.enc_n_layers * per_block


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    pool: int
    slots: int
    workspace: int
    capacity: int | None      # bytes the device can still give us (None: unknown)
    kv_cache_tokens: int      # positions the pool holds (usable pages x page size)
    page_size: int
    arenas: Arenas
    mesh_size: int = 1        # chips of a tensor-parallel mesh: every figure is per chip
    adapters: int = 0         # the LoRA adapter slots' tables (`lora.table_bytes`)

    @property
    def total(self) -> int:
        return self.weights + self.pool + self.slots + self.workspace + self.adapters

    @property
    def n_pages(self) -> int:
        return self.arenas.n_pages

    def describe(self) -> str:
        cap = "unknown" if self.capacity is None else gib(self.capacity)
        return (f"weights {gib(self.weights)} + KV pool {gib(self.pool)} "
                f"({self.kv_cache_tokens} tokens) + slots {gib(self.slots)} + workspace "
                f"{gib(self.workspace)}"
                + (f" + adapter slots {gib(self.adapters)}" if self.adapters else "")
                + f" = {gib(self.total)}; device free {cap}"
                + (f" (per chip of a {self.mesh_size}-chip mesh)" if self.mesh_size > 1
                   else ""))


def device_free(device) -> int | None:
    """Bytes the device can still allocate: accelerators from their allocator's stats, the
    CPU from what the kernel can give the process (`hostmem.host_available`)."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:   # some backends do not implement it
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    if host_platform(device.platform):
        return host_available()
    return None


def plan(cfg: MoondreamConfig, *, platform, max_batch_size: int, max_context: int,
         page_size: int, kv_cache_tokens: int | None = None, free: int | None = None,
         weights_loaded: bool = False, dtype=None, sweep: bool | None = None,
         kv_dtype: str | None = None, mesh_size: int = 1,
         prefill_tokens: int = PREFILL_TOKENS, adapter_bytes: int = 0) -> MemoryPlan:
    """The memory plan of a model on a device with `free` bytes available (None: unknown).
    `platform`: the device's `platforms.Platform` record (or its name: its default record).
    `weights_loaded`: `free` was measured after the weights were placed.  `sweep`: the
    decode attention is the XLA sweep (several arenas; default on CPU) rather than the
    Pallas kernel (one arena).  `kv_dtype`: an 8-bit pool (None: the model's dtype).
    `mesh_size`: the chips of a tensor-parallel mesh; the plan is then per chip.
    `prefill_tokens`: the engine's prompt positions a prefill (its workspace).
    `adapter_bytes`: the LoRA slot tables the engine keeps (`lora.table_bytes`)."""
    rec = platform if isinstance(platform, Platform) else choose(cfg, platform)
    dtype = dtype or cfg.dtype
    per_tok = bytes_per_token(cfg, dtype, kv_dtype, mesh_size, rec.pack)
    weights = weight_bytes(cfg, dtype, mesh_size)
    slots = slot_bytes(cfg, max_batch_size, dtype)
    work = workspace_bytes(cfg, dtype, prefill_tokens, mesh_size, max_batch_size, kv_dtype,
                           rec.grouped, max_context)
    if rec.host_memory:
        work += cpu_vision_widened_bytes(cfg, dtype)
    row_pages = pages_for(max_context, page_size)
    if kv_cache_tokens is None:
        if rec.host_memory:
            want = max_batch_size * max_context + 4 * cfg.prefix_len
            cap = CPU_POOL_CAP if free is None else min(CPU_POOL_CAP, free // 4)
            kv_cache_tokens = max(min(want, cap // per_tok), max_context + cfg.prefix_len)
        else:
            if free is None:
                raise MemoryError_("cannot size the KV pool: the device does not report its "
                                   "free memory; pass kv_cache_tokens")
            room = free - slots - work - adapter_bytes - (0 if weights_loaded else weights)
            if room <= per_tok * (max_context + cfg.prefix_len):
                raise MemoryError_(
                    f"no room for a KV pool: the device has {gib(free)} free and the weights "
                    f"({gib(weights)}), slots ({gib(slots)}) and workspace ({gib(work)}) "
                    "leave less than one sequence; use a larger device, load in bfloat16, or "
                    "free device memory")
            kv_cache_tokens = int(GPU_POOL_SHARE * room) // per_tok
    if not isinstance(kv_cache_tokens, int) or isinstance(kv_cache_tokens, bool) or \
            kv_cache_tokens < 1:
        raise ValueError(f"kv_cache_tokens must be a positive int, got {kv_cache_tokens!r}")
    usable = pages_for(kv_cache_tokens, page_size)
    n_pages = usable + 1   # page 0: the dummy page
    if rec.pack > 1:
        # The TPU layout: pages a multiple of 8, else XLA:TPU lays an 8-bit pool's scales
        # ([rows, P, 2B], `tpu_attention.scale_shape`) out pages-major (the sublane tile is
        # 8) and copies them to the kernel's row-major layout and back in every step.
        n_pages = -(-n_pages // PAGE_MULTIPLE) * PAGE_MULTIPLE
        usable = n_pages - 1
    if sweep is None:
        sweep = rec.sweeps
    arenas = Arenas.geometric(n_pages, row_pages) if sweep else Arenas((n_pages,))
    return MemoryPlan(weights, n_pages * page_size * per_tok, slots, work, free,
                      usable * page_size, page_size, arenas, mesh_size, adapter_bytes)


def check(p: MemoryPlan, cfg: MoondreamConfig, *, max_context: int, weights_loaded: bool):
    """Refuse a plan that cannot work: a pool too small for one sequence at full context, or
    more than the device has."""
    need = p.total - (p.weights if weights_loaded else 0)
    if p.capacity is not None and need > p.capacity:
        raise MemoryError_(
            f"the model does not fit the device: {p.describe()}. Lower kv_cache_tokens "
            "(--kv-cache-tokens), max_batch_size (--batch-size) or max_context "
            "(--max-context), load in bfloat16, " + (
                f"use more chips than the mesh's {p.mesh_size} (tensor_parallel), "
                if p.mesh_size > 1 else "split it over chips (tensor_parallel), ") +
            "or free device memory (other processes; "
            "XLA_PYTHON_CLIENT_MEM_FRACTION raises JAX's share of a GPU)")
    if p.kv_cache_tokens < cfg.prefix_len + 1:
        raise MemoryError_(
            f"the KV pool holds {p.kv_cache_tokens} tokens, less than one image prompt "
            f"({cfg.prefix_len + 1}); raise kv_cache_tokens (--kv-cache-tokens)")
    return p
