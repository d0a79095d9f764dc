"""The one door to JAX's private (`jax._src`) and experimental (`jax.experimental`) APIs.

photon_jax is tested on jax 0.10.2 (CPU, in CI); the GPU image it is measured on has jax
0.11.2.  Private and experimental names can move between releases, so every use goes
through a function here that checks what it gets and raises `JaxCompatError` -- naming the
installed version, the API and what to do -- instead of failing deep inside a trace or,
worse, computing something else.  docs/platforms.md lists the same table:

| API | used by | for |
|---|---|---|
| `jax._src.array.ArrayImpl` (`_value`, `copy_to_host_async`, `__array__`, `item`, `tolist`, `block_until_ready`) | `hostsync` (tests, `PHOTON_JAX_GPU_RULES`) | patching host reads |
| `jax._src.config.transfer_guard_device_to_host` | `hostsync` | the device-to-host guard level in force |
| `jax._src.lib.guard_lib.thread_local_state().explicit_device_get` | `hostsync` | telling `jax.device_get` (explicit) from implicit reads |
| `jax.experimental.pallas` (`pallas_call`, `BlockSpec`, `program_id`, `when`, `ds`) and `jax.experimental.pallas.triton.CompilerParams` | `gpu_attention` (GPU decode) | our decode-attention kernel |
| `jax.experimental.pallas.tpu` (`PrefetchScalarGridSpec`, `VMEM`, `SMEM`, `SemaphoreType`, `make_async_copy`, `CompilerParams`, `InterpretParams`) and `jax.experimental.pallas` (`ANY`) | `tpu_attention` (TPU decode) | the TPU paged-attention kernel |
| `jax.experimental.topologies.get_topology_desc` | `bench/gpu_compile.py`, `bench/tpu_compile.py` | deviceless H200 and TPU compiles |

(`jax.ffi`, used by the CPU kernels, is public API.)
"""

from __future__ import annotations

import inspect

import jax

TESTED_JAX = ("0.10.2",)


class JaxCompatError(RuntimeError):
    """A private or experimental JAX API photon_jax relies on is missing or changed."""


def _fail(api: str, what: str) -> JaxCompatError:
    return JaxCompatError(
        f"photon_jax needs {api} ({what}), which jax {jax.__version__} does not provide as "
        f"expected (photon_jax is tested on jax {', '.join(TESTED_JAX)}); install a tested "
        "jax, or report this JAX version")


def array_impl():
    """`jax._src.array.ArrayImpl`, with the host-read methods hostsync patches."""
    try:
        from jax._src.array import ArrayImpl
    except ImportError as e:
        raise _fail("jax._src.array.ArrayImpl", "the concrete jax.Array class") from e
    for name in ("_value", "copy_to_host_async", "__array__", "tolist", "block_until_ready"):
        if not hasattr(ArrayImpl, name):
            raise _fail(f"jax._src.array.ArrayImpl.{name}", "a host-read method")
    if not isinstance(inspect.getattr_static(ArrayImpl, "_value"), property):
        raise _fail("jax._src.array.ArrayImpl._value", "a property")
    return ArrayImpl


def d2h_guard_reader():
    """-> a function returning (level, explicit): the device-to-host transfer guard level
    in force on this thread ("allow", "log", "disallow", "log_explicit",
    "disallow_explicit" or None for the default, allow) and whether the read is inside
    `jax.device_get` (an explicit transfer, which "disallow" permits)."""
    try:
        from jax._src import config as jconfig
        from jax._src.lib import guard_lib
        option = jconfig.transfer_guard_device_to_host
        state = guard_lib.thread_local_state
        option.value   # noqa: B018  (fails here, not in the middle of a patched read)
        state().explicit_device_get   # noqa: B018
    except (ImportError, AttributeError) as e:
        raise _fail("jax._src.config.transfer_guard_device_to_host and "
                    "jax._src.lib.guard_lib.thread_local_state().explicit_device_get",
                    "the transfer guard's state") from e

    def read():
        return option.value, bool(state().explicit_device_get)

    return read


_PALLAS = ("pallas_call", "BlockSpec", "program_id", "when", "ds")


def pallas_triton():
    """(pallas, pallas.triton): Pallas and its Triton (GPU) backend's module, checked for
    the names `gpu_attention`'s kernel uses."""
    try:
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import triton as plgpu
    except ImportError as e:
        raise _fail("jax.experimental.pallas and jax.experimental.pallas.triton",
                    "writing the GPU decode-attention kernel") from e
    missing = [f"pallas.{n}" for n in _PALLAS if not hasattr(pl, n)]
    if not hasattr(plgpu, "CompilerParams"):
        missing.append("pallas.triton.CompilerParams")
    if missing:
        raise _fail(", ".join(missing), "writing the GPU decode-attention kernel")
    return pl, plgpu


_PALLAS_TPU_NAMES = (("pl", ("pallas_call", "BlockSpec", "ANY", "program_id", "when")),
                     ("pltpu", ("PrefetchScalarGridSpec", "VMEM", "SMEM", "SemaphoreType",
                                "make_async_copy", "CompilerParams", "InterpretParams",
                                "einshape")))


def pallas_tpu():
    """(pallas, pallas.tpu): JAX's Pallas and its TPU (Mosaic) module, checked for the names
    `tpu_attention` uses."""
    try:
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import tpu as pltpu
    except ImportError as e:
        raise _fail("jax.experimental.pallas.tpu", "the Pallas TPU (Mosaic) kernels") from e
    mods = {"pl": pl, "pltpu": pltpu}
    for mod, names in _PALLAS_TPU_NAMES:
        missing = [n for n in names if not hasattr(mods[mod], n)]
        if missing:
            raise _fail("jax.experimental.pallas" + (".tpu" if mod == "pltpu" else "") + "."
                        + ", ".join(missing), "names the TPU paged-attention kernel uses")
    return pl, pltpu


def topology_desc(**kwargs):
    """`jax.experimental.topologies.get_topology_desc(**kwargs)` (deviceless compiles)."""
    try:
        from jax.experimental import topologies
        get = topologies.get_topology_desc
    except (ImportError, AttributeError) as e:
        raise _fail("jax.experimental.topologies.get_topology_desc",
                    "describing a device that is not attached") from e
    return get(**kwargs)
