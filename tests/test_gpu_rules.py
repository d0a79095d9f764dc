"""A GPU's device-to-host transfer rule, applied on the CPU (`hostsync.emulate_gpu_transfers`):
the emulation behaves as jaxlib does on a GPU, the whole suite runs under it, and every public
surface gives the same results with it as without it, pipelined and blocking."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from photon_jax.engine import hostsync

from helpers import MD3_BIASES, biased_model, run_surfaces
DISALLOWED = "Disallowed device-to-host transfer"


@pytest.fixture
def plain_cpu():
    """The CPU's own rules for the duration of a test (the suite runs emulated)."""
    hostsync._uninstall_emulation()
    try:
        yield
    finally:
        hostsync.emulate_gpu_transfers()


def test_the_suite_runs_under_the_emulation():
    assert os.environ.get("PHOTON_JAX_GPU_RULES") == "1"
    assert hostsync.emulating_gpu_transfers()
    # ...and so do the CLI and benchmark subprocesses, which inherit the variable.
    code = "from photon_jax.engine import hostsync; print(hostsync.emulating_gpu_transfers())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "True"


def test_the_emulation_is_the_gpu_rule():
    x = jnp.arange(4) + 1
    s = x.sum()
    implicit = {"copy_to_host_async": lambda: x.copy_to_host_async(),
                "np.asarray": lambda: np.asarray(x), "np.array": lambda: np.array(x),
                "__array__": lambda: x.__array__(), "item": lambda: s.item(),
                "int": lambda: int(s), "tolist": lambda: x.tolist(), "repr": lambda: repr(x)}
    with jax.transfer_guard("disallow"):
        for name, read in implicit.items():
            with pytest.raises(jax.errors.JaxRuntimeError, match=DISALLOWED):
                read()
        # Explicit transfers and waits are allowed under "disallow", as on a GPU.
        assert jax.device_get(x).tolist() == [1, 2, 3, 4]
        x.block_until_ready()
        jax.block_until_ready(s)
    with jax.transfer_guard("disallow_explicit"):
        with pytest.raises(jax.errors.JaxRuntimeError, match=DISALLOWED):
            jax.device_get(jnp.arange(3))
    with hostsync.sync_free():   # the engine's guard is JAX's
        with pytest.raises(jax.errors.JaxRuntimeError, match=DISALLOWED):
            x.copy_to_host_async()
    # Outside a guard everything reads, and a value already on the host moves nothing.
    y = jnp.arange(3) * 2
    assert np.asarray(y).tolist() == [0, 2, 4] and int(s) == 10
    # An uploaded NumPy array becomes read-only: the CPU device array aliases it.
    host = np.arange(4, dtype=np.float32)
    dev = jax.device_put(host)
    with pytest.raises(ValueError, match="read-only"):
        host[0] = 7
    assert float(dev[0]) == 0.0


@pytest.mark.usefixtures("plain_cpu")
def test_without_the_emulation_a_cpu_allows_it():
    """Why the emulation exists: the CPU backend permits what a GPU refuses."""
    x = jnp.arange(4) + 1
    with jax.transfer_guard("disallow"):
        x.copy_to_host_async()
        assert np.asarray(x).tolist() == [1, 2, 3, 4]
    raw = np.zeros(1024 + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    host = raw[start:start + 1024]   # 64-byte aligned, as XLA:CPU needs to alias it
    dev = jax.device_put(host)
    host[0] = 5   # aliased on CPU: the "uploaded" value changes
    assert float(dev[0]) == 5.0


def test_the_detector_also_trips_on_starting_a_host_copy():
    uninstall = hostsync.install_detector()
    try:
        x = jnp.arange(3) + 1
        with hostsync.sync_free():
            with pytest.raises(hostsync.HostSyncError, match="copy_to_host_async"):
                x.copy_to_host_async()
    finally:
        uninstall()


@pytest.fixture(scope="module")
def models(tiny_ckpt, md3_ckpt):
    from photon_jax.model import Model

    return Model.load(tiny_ckpt), biased_model(md3_ckpt, MD3_BIASES)


def test_every_surface_gives_the_same_results_under_gpu_rules(models):
    """The check a GPU's first step would make, on every public surface: the same results
    with the rule as without it (and pipelined == blocking)."""
    emulated = {p: run_surfaces(models, p) for p in (True, False)}
    hostsync._uninstall_emulation()
    try:
        plain = run_surfaces(models, True)
    finally:
        hostsync.emulate_gpu_transfers()
    assert emulated[True] == plain
    assert emulated[False] == plain
    assert plain["cancelled"] == "cancelled"
    assert plain["detect"]["objects"] and plain["md3"][1]["bbox"] is not None
