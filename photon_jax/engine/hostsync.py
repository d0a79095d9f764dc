"""Guarding the launch path against hidden host syncs, and a GPU's transfer rules on a CPU.

The engine runs its launch and finalize code inside `sync_free()`, which holds JAX's
transfer guard at "disallow": implicit host-to-device transfers raise there on every
backend (every input is uploaded explicitly), and implicit device-to-host reads raise on an
accelerator.  A host copy must therefore *start* outside `sync_free()` too: on a GPU jaxlib
applies the device-to-host guard inside `copy_to_host_async` and inside every implicit read
(`np.asarray`, `__array__`, `.item()`, `int()`, ...), except for buffers that are zero-copy
on the host -- which every CPU buffer is.  So a CPU run cannot see that rule by itself; two
tools make it visible:

- `emulate_gpu_transfers()` applies the GPU's device-to-host rule on the CPU backend: while
  JAX's guard says "disallow" (ours or any caller's), `copy_to_host_async` and every
  implicit read of a `jax.Array` raise `JaxRuntimeError("INVALID_ARGUMENT: Disallowed
  device-to-host transfer ...")`, as jaxlib does on a GPU; `jax.device_get` (explicit) and
  `block_until_ready` (no transfer) stay allowed, as there.  It also makes every NumPy array
  given to `jax.device_put` read-only: on CPU the device array aliases that memory (a later
  host write would change the uploaded value, on CPU only).  The test suite runs entirely
  under it (tests/conftest.py), and `PHOTON_JAX_GPU_RULES=1` turns it on in any process
  (the CLI tests' subprocesses; a user checking their own code on a laptop).
- `install_detector()` is stricter and only for `sync_free()`: any host read *or wait*
  (`int()`, `bool()`, `.item()`, `np.asarray`, `jax.device_get`, `block_until_ready`,
  `copy_to_host_async`, ...) raises `HostSyncError` there, so the launch path provably never
  waits for the device.  Tests install it; production code never pays for it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import jax
import numpy as np

from ..base import compat

_state = threading.local()


class HostSyncError(RuntimeError):
    pass


def active() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def sync_free():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with jax.transfer_guard("disallow"):
            yield
    finally:
        _state.depth -= 1


def _trip(what: str):
    raise HostSyncError(f"host sync inside the launch path: {what}")


def _holds_arrays(x) -> bool:
    if isinstance(x, jax.Array):
        return True
    if isinstance(x, (list, tuple, dict)):
        return any(isinstance(v, jax.Array) for v in jax.tree.leaves(x))
    return False


class _Patches:
    """Attribute replacements that can be undone in reverse order."""

    def __init__(self):
        self.saved = []

    def set(self, owner, name, value):
        self.saved.append((owner, name, owner.__dict__.get(name, _MISSING)
                           if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self):
        for owner, name, orig in reversed(self.saved):
            if orig is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
        self.saved.clear()


_MISSING = object()


def install_detector():
    """Make host reads and waits on device arrays inside `sync_free()` raise
    `HostSyncError`.  Returns `uninstall`."""
    ArrayImpl = compat.array_impl()
    p = _Patches()

    def method(orig, what):
        def wrapped(*a, **k):
            if active():
                _trip(what)
            return orig(*a, **k)
        return wrapped

    def on_arrays(orig, what):
        def wrapped(x, *a, **k):
            if active() and _holds_arrays(x):
                _trip(what)
            return orig(x, *a, **k)
        return wrapped

    value = ArrayImpl._value

    def guarded_value(self):
        if active():
            _trip("reading a jax.Array's value (int/bool/float/item/tolist/print)")
        return value.fget(self)

    p.set(ArrayImpl, "_value", property(guarded_value))
    for name in ("__array__", "item", "tolist", "block_until_ready", "copy_to_host_async"):
        p.set(ArrayImpl, name, method(getattr(ArrayImpl, name), f"jax.Array.{name}"))
    # np.asarray / np.array use the buffer protocol on CPU, which bypasses __array__.
    for name in ("asarray", "array", "asanyarray"):
        p.set(np, name, on_arrays(getattr(np, name), f"np.{name} of a jax.Array"))
    p.set(jax, "device_get", on_arrays(jax.device_get, "jax.device_get"))
    p.set(jax, "block_until_ready", on_arrays(jax.block_until_ready, "jax.block_until_ready"))
    return p.undo


_emulation_lock = threading.Lock()
_emulation: _Patches | None = None


def emulating_gpu_transfers() -> bool:
    return _emulation is not None


def emulate_gpu_transfers():
    """Apply a GPU's device-to-host transfer rule to this process's CPU arrays (see the
    module docstring).  Idempotent; returns `uninstall`."""
    global _emulation
    with _emulation_lock:
        if _emulation is not None:
            return _uninstall_emulation
        ArrayImpl = compat.array_impl()
        guard = compat.d2h_guard_reader()
        p = _Patches()

        def blocked(explicit_ok: bool = True) -> bool:
            level, explicit = guard()
            return level == "disallow_explicit" or (
                level == "disallow" and not (explicit and explicit_ok))

        def refuse(x, how: str):
            aval = getattr(x, "aval", None)
            desc = aval.str_short() if aval is not None else type(x).__name__
            raise jax.errors.JaxRuntimeError(
                f"INVALID_ARGUMENT: Disallowed device-to-host transfer: aval={desc} ({how}; "
                "photon_jax's emulation of a GPU's transfer guard: CPU buffers are zero-copy, "
                "so a CPU backend never applies this rule itself)")

        value = ArrayImpl._value
        copy_async = ArrayImpl.copy_to_host_async

        def guarded_value(self):
            # A value already fetched into the array's host cache moves nothing.
            if self._npy_value is None and blocked():
                refuse(self, "an implicit read: np.asarray/__array__/item/int/tolist/print")
            return value.fget(self)

        def guarded_copy(self):
            if self._npy_value is None and blocked():
                refuse(self, "copy_to_host_async")
            return copy_async(self)

        def on_arrays(orig, what):
            def wrapped(x, *a, **k):
                if _holds_arrays(x) and blocked():
                    refuse(x, what)
                return orig(x, *a, **k)
            return wrapped

        def device_put(orig):
            def wrapped(x, *a, **k):
                for leaf in jax.tree.leaves(x):
                    if isinstance(leaf, np.ndarray) and leaf.flags.writeable:
                        leaf.flags.writeable = False   # the CPU device array aliases it
                return orig(x, *a, **k)
            return wrapped

        p.set(ArrayImpl, "_value", property(guarded_value))
        p.set(ArrayImpl, "copy_to_host_async", guarded_copy)
        # On CPU np.asarray / np.array read through the buffer protocol, not __array__.
        for name in ("asarray", "array", "asanyarray"):
            p.set(np, name, on_arrays(getattr(np, name), f"np.{name}"))
        p.set(jax, "device_put", device_put(jax.device_put))
        _emulation = p
        return _uninstall_emulation


def _uninstall_emulation():
    global _emulation
    with _emulation_lock:
        if _emulation is not None:
            _emulation.undo()
            _emulation = None


if os.environ.get("PHOTON_JAX_GPU_RULES", "") not in ("", "0"):
    try:
        emulate_gpu_transfers()
    except compat.JaxCompatError as e:   # a check for CPU runs must not stop a GPU's
        warnings.warn(f"PHOTON_JAX_GPU_RULES is ignored: {e}", stacklevel=2)
