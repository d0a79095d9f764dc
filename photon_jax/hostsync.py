"""Guarding the launch path against hidden host syncs.

The engine runs its launch and finalize code inside `sync_free()`: implicit host-to-device
transfers raise there (JAX's transfer guard; every input must be uploaded explicitly), and so
do implicit device-to-host transfers on accelerators.  On the CPU backend the
device-to-host guard never fires (host reads are zero-copy), so `install_detector()` adds a
check that does: while a thread is inside `sync_free()`, any read of a `jax.Array`'s value
on the host (`int()`, `bool()`, `float()`, `.item()`, `.tolist()`, printing, `np.asarray`,
`np.array`, `jax.device_get`, `block_until_ready`) raises `HostSyncError`.  Tests install it;
production code never pays for it.
"""

from __future__ import annotations

import contextlib
import threading

import jax
import numpy as np

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


def install_detector():
    """Make host reads of device arrays inside `sync_free()` raise.  Returns `uninstall`."""
    from jax._src.array import ArrayImpl

    saved = []

    def patch(owner, name, make):
        orig = getattr(owner, name)
        saved.append((owner, name, orig))
        setattr(owner, name, make(orig))

    def method(orig, what):
        def wrapped(*a, **k):
            if active():
                _trip(what)
            return orig(*a, **k)
        return wrapped

    def on_arrays(orig, what):
        def wrapped(x, *a, **k):
            if active() and any(isinstance(v, jax.Array) for v in jax.tree.leaves(x)):
                _trip(what)
            return orig(x, *a, **k)
        return wrapped

    value = ArrayImpl._value

    def guarded_value(self):
        if active():
            _trip("reading a jax.Array's value (int/bool/float/item/tolist/print)")
        return value.fget(self)

    saved.append((ArrayImpl, "_value", value))
    ArrayImpl._value = property(guarded_value)
    for name in ("__array__", "item", "tolist", "block_until_ready"):
        patch(ArrayImpl, name, lambda o, n=name: method(o, f"jax.Array.{n}"))
    # np.asarray / np.array use the buffer protocol on CPU, which bypasses __array__.
    for name in ("asarray", "array", "asanyarray"):
        patch(np, name, lambda o, n=name: on_arrays(o, f"np.{n} of a jax.Array"))
    patch(jax, "device_get", lambda o: on_arrays(o, "jax.device_get"))
    patch(jax, "block_until_ready", lambda o: on_arrays(o, "jax.block_until_ready"))

    def uninstall():
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)

    return uninstall
