"""Which kernels and schedules a device platform gets, decided once per loaded model.

`choose(cfg, platform)` gives a `Platform` record: the decode attention (`ATTENTION`: our
C++ kernel on CPU, our Pallas kernels on GPU and TPU, the XLA sweep as the fallback), the
pool layout it reads (`pack`), whether decode's dense layers use the CPU kernel, the MoE
prefill schedule (`moe.schedule`), the vision attention's formulation, the compute dtype.
Everything else reads these fields; nothing else compares platform or attention names.

The decode attentions: "xla" (the engine's in-place sweep of the pool, every backend),
"cpu-kernel" (our C++ paged-attention kernel through the XLA FFI: `kernels.cpukernel`),
"pallas" (our Pallas GPU kernel, `kernels.gpu_attention`, which replaced JAX's
paged-attention kernel), "pallas-tpu" (our Pallas TPU kernel, `kernels.tpu_attention`, over
the pool's TPU layout) or "pallas-interpret" / "pallas-tpu-interpret" (the same kernels run
by the Pallas interpreter: tests on CPU).

The engine's programs are built from this record (`engine.step.build_for`); the model's
functions take its fields as arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp

from ..kernels import cpukernel, tpu_attention
from .config import MoondreamConfig

ATTENTION = ("xla", "cpu-kernel", "pallas", "pallas-interpret", "pallas-tpu",
             "pallas-tpu-interpret")
# The decode attentions of our GPU kernel (split plans) and of our TPU kernel (the pool's
# TPU layout: `tpu_attention.pack` heads a row).
GPU_ATTENTION = ("pallas", "pallas-interpret")
TPU_ATTENTION = ("pallas-tpu", "pallas-tpu-interpret")


def check_attention(attention: str) -> None:
    """Refuse, by name, an attention that is not one of `ATTENTION` or that cannot run here
    (the CPU kernel without a C++ compiler)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    if attention == "cpu-kernel" and not cpukernel.load():
        raise ValueError("attention='cpu-kernel': the CPU paged-attention kernel could not "
                         f"be built ({cpukernel.reason()}); install a C++ compiler (g++) "
                         "or pass attention='xla'")


def default_attention(platform: str) -> str:
    """The decode attention a backend gets: our Pallas kernels on GPU (`gpu_attention`) and
    TPU (`tpu_attention`); on CPU our C++ kernel (`cpukernel`) when it builds, else the XLA
    sweep; the XLA sweep elsewhere."""
    if platform == "gpu":
        return "pallas"
    if platform == "tpu":
        return "pallas-tpu"
    if platform == "cpu":
        return "cpu-kernel" if cpukernel.load() else "xla"
    return "xla"


def sweeps(attention: str) -> bool:
    """Whether a decode attention reads the pool by the arena sweep (several arenas, page
    owners uploaded each step) rather than through page tables (one arena)."""
    return attention == "xla"


def default_vision_loop(platform: str) -> bool:
    """Whether the vision encoder's attention loops over (crop, head) pairs: on CPU (2-4x
    faster: the scores stay in cache), not on accelerators (`vision.attention_per_crop_head`)."""
    return platform == "cpu"


def default_grouped(platform: str) -> str:
    """The MoE schedules a backend gets (`moe.schedule`).  Prefill: by `ragged_dot` on
    TPU, by every expert on every position (`dense`) on GPU, by the static-trip block loop
    elsewhere.  Measured in deviceless compiles at Moondream 3's shapes (one layer, 746
    tokens; docs/tpu.md, docs/platforms.md):

    - TPU: ragged_dot is XLA:TPU's grouped product (a Mosaic kernel) with the useful flops
      only (75.8 GFLOP), declaring less traffic than megablox's (1.43 against 2.15 GB);
      the block loop would run its blocks one after the other.
    - GPU: XLA:GPU (jax 0.10.2) expands ragged_dot into a masked product of every
      assignment with every expert -- 64x the useful flops and the rows copied once per
      expert (1.59 GB of temporaries) -- where `dense` is one batched product with E/k = 8x
      the useful flops and 0.29 GB (the block loop: 0.10 GB and the useful flops, but ~150
      dependent small products a layer, unmeasured on a GPU).
    - CPU: XLA:CPU's ragged_dot is a masked product over every expert as well.

    A decode step of few experts uses megablox on TPU, whose grid reads only the selected
    experts, where XLA:TPU's gather copies the stack; on CPU the block loop (blocks of one
    row: each assignment's expert read in place; XLA:CPU's gather copied them: a full-size
    Moondream 3 layer at one token 16 ms against 78, `bench/moe.py --layer md3`); `gather`
    on GPU, where XLA fuses it into the products at one token."""
    return {"gpu": "dense", "tpu": "ragged+megablox"}.get(platform, "blocks+blocks")


# Below this many rows a step keeps XLA's products even with `dense`: they are weight-read
# bound there, and XLA streams the weights better than 16-column panels do (measured at 1
# row: 8-9 ms a step against 16-17 ms with the kernel; even at 2, ahead from 4).
DENSE_MIN_ROWS = 4


def default_dense(cfg: MoondreamConfig, attention: str) -> bool:
    """Whether decode steps run their dense layers and LM head on `cpukernel.dense`: with
    the CPU attention kernel (so: on CPU, the kernels built), in float32, where the kernel
    is vectorized (`cpukernel.dense_fast`).  Prefill keeps XLA's products: with hundreds of
    rows they run near the machine's peak."""
    return (attention == "cpu-kernel" and jnp.dtype(cfg.dtype) == jnp.float32
            and cpukernel.dense_fast())


def default_burst(platform: str) -> int:
    """Decode steps per launch for plain text rows, by default (docs/host.md).  A launch
    costs the host a fixed ~0.6-1.4 ms on this project's CPU (uploads, dispatches, NumPy),
    whatever its rows.  On an accelerator a full-size decode step at small batch is as short
    (~0.8 ms at batch 1 on an H200), so single steps would leave the device waiting for
    Python: 8 steps a launch there.  In the pinned stand-in (a CPU core as the device, the
    tiny config's 0.24-0.31 ms step), bursts of 8 took batch 1 from 0.23-0.28 to 0.99-1.03
    of the device's ceiling and small int8 from 0.85-0.94 to 1.01, where bursts of 4 reached
    only 0.69-0.79 at tiny batch 1.  On a CPU that is itself the device, a real model's step
    is 100x the launch (~0.15 s at full size), so bursts would gain under 1% and deliver
    streamed tokens in clumps: single steps there (`decode_burst=` opts in)."""
    return 1 if host_platform(platform) else 8


@dataclass(frozen=True)
class Platform:
    """What a device platform's choice means, worked out once (`choose`).  Everything
    outside this module reads these fields; nothing else compares platform or attention
    names."""
    name: str                  # "cpu", "gpu", "tpu", ...
    attention: str             # the decode attention (`ATTENTION`)
    sweeps: bool               # decode reads the pool by the arena sweep, not page tables
    shares_prefix: bool        # cached prefix pages are read in place (else copied)
    plans_splits: bool         # decode steps take a split plan (the GPU kernel's)
    pack: int                  # kv heads per pool row (> 1: the TPU kernel's layout)
    dense: bool                # decode's dense layers on `cpukernel.dense`
    grouped: str               # the MoE prefill schedule (`moe.schedule`)
    vision_loop: bool          # the vision attention loops over (crop, head) pairs
    host_memory: bool          # device memory is the host's (pool sized from host RAM)
    dtype: str                 # the compute dtype
    kv_dtype: str | None = None    # the pool's 8-bit format (None: the model's dtype)
    # Decode steps one launch runs for plain text rows (`Engine(decode_burst=)`), in steps of
    # at most `burst_rows` rows (`default_burst`).
    decode_burst: int = 1
    burst_rows: int = 8

    def with_kv_dtype(self, kv_dtype: str | None) -> "Platform":
        return dataclasses.replace(self, kv_dtype=kv_dtype)


def host_platform(platform: str) -> bool:
    """Whether a platform's device memory is the host's (CPU)."""
    return platform == "cpu"


def default_dtype(platform: str, checkpoint_dtype: str) -> str:
    """The compute dtype when none is asked for: float32 on CPU (XLA:CPU has no bfloat16
    matmul on most x86 CPUs and converts operands in every step, so a bfloat16 model decodes
    slower than the same model in float32: `bench/caption.py`), the checkpoint's elsewhere."""
    return "float32" if platform == "cpu" else checkpoint_dtype


def choose(cfg: MoondreamConfig, platform: str, attention: str | None = None,
           kv_dtype: str | None = None) -> Platform:
    """The record of what `platform` gets for `cfg` (its dtype already chosen): the default
    attention (or `attention`) and the rest that follows from it.  Builds nothing."""
    attention = attention or default_attention(platform)
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    sweep = sweeps(attention)
    return Platform(
        name=platform, attention=attention, sweeps=sweep, shares_prefix=not sweep,
        plans_splits=attention in GPU_ATTENTION,
        pack=tpu_attention.pack(cfg.text.head_dim) if attention in TPU_ATTENTION else 1,
        dense=default_dense(cfg, attention),
        grouped=default_grouped(platform), vision_loop=default_vision_loop(platform),
        host_memory=host_platform(platform), dtype=cfg.dtype, kv_dtype=kv_dtype,
        decode_burst=default_burst(platform))
