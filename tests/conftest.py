"""Shared test fixtures: the tiny reference model (converted once per session) and its
golden cases, all from tests/fixtures (a fresh clone tests itself)."""

import atexit
import gc
import json
import os
import shutil
import tempfile

import numpy as np
import pytest

from helpers import (FIXTURE_DIR, MD3_FIXTURE_DIR, SUITE_GC_THRESHOLD, SUITE_MAPPINGS_SHARE,
                     release_programs, suite_xla_flags)

# One persistent XLA compilation cache for the session, shared with the subprocesses the CLI
# and benchmark tests start (set before JAX is imported): each program compiles once per
# session instead of once per process.  A cache the caller set up is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="photon-test-xla-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The whole suite runs under a GPU's device-to-host transfer rule (photon_jax.engine.hostsync:
# host copies and implicit reads raise under a "disallow" guard, uploaded NumPy arrays become
# read-only), in this process and in the CLI and benchmark subprocesses: a CPU's zero-copy
# buffers would otherwise hide what fails on a GPU's first step.
os.environ.setdefault("PHOTON_JAX_GPU_RULES", "1")
# XLA's CPU backend at -O0 with its older elemental emitters (helpers.SUITE_FLAGS): most of the
# suite's time is XLA compiling several thousand small programs once each, and these settings
# compile them much faster (the numbers are at SUITE_FLAGS).  The results differ from the
# default level's in their last bits only (fused or reassociated float arithmetic):
# tests/test_opt_level.py runs the golden parity tests and the engine's pipelined == blocking
# == reference test at the default level to keep that claim honest.  Only where no
# accelerator plugin is installed (a GPU's or TPU's compiles keep their own default), and
# PHOTON_JAX_TEST_XLA_OPT=default turns it off (helpers.suite_xla_flags decides).
os.environ["XLA_FLAGS"] = suite_xla_flags(os.environ)
# The collector less often (helpers.SUITE_GC_THRESHOLD says why).
gc.set_threshold(*SUITE_GC_THRESHOLD)
# Snapshots converted on load go to a session folder, never the user's own cache.
if "PHOTON_JAX_CACHE" not in os.environ:
    _CKPT_CACHE = tempfile.mkdtemp(prefix="photon-test-ckpt-")
    atexit.register(shutil.rmtree, _CKPT_CACHE, ignore_errors=True)
    os.environ["PHOTON_JAX_CACHE"] = _CKPT_CACHE


# The files that take longest, first (measured with --durations; test_bench and the two
# mesh processes are most of a minute to several): xdist's loadfile hands whole files to
# whichever worker is free in collection order, so the long ones start at once and short
# files fill the end of the run instead of one worker finishing a long file alone.
HEAVY_FIRST = ("test_bench.py", "test_mesh.py", "test_mesh_two.py", "test_caption.py",
               "test_tpu_attention.py", "test_gpu_attention.py", "test_lora.py", "test_liveness.py",
               "test_gpu_lowering.py", "test_quantized.py", "test_moe.py",
               "test_serve_abuse.py", "test_invariants.py", "test_md3_engine.py",
               "test_engine.py", "test_kv8.py", "test_pool.py")


@pytest.fixture(scope="module", autouse=True)
def _mapping_guard():
    """After each file, a worker holding more than 40% of its memory-mapping limit frees its
    compiled programs (recompiled, or read from the persistent cache, where needed again):
    at the limit XLA:CPU's compiles fail and the worker can crash (docs/testing.md, "The
    worker crashes").  PHOTON_JAX_TEST_MAPS_LOG names a file that gets each file's count."""
    yield
    from photon_jax.engine import hostmem

    room = hostmem.mapping_headroom()
    if room is None:
        return
    released = room[0] > SUITE_MAPPINGS_SHARE * room[1]
    if released:
        release_programs()
    log = os.environ.get("PHOTON_JAX_TEST_MAPS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {room[0]} {room[1]} {'released' if released else ''} "
                    f"-> {hostmem.mappings_in_use()}\n")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: ties keep order


@pytest.fixture(scope="session")
def fixture_dir():
    return FIXTURE_DIR


def _cases(fixture_dir):
    with open(os.path.join(fixture_dir, "cases.json")) as f:
        return json.load(f)


def _arrays(fixture_dir):
    return dict(np.load(os.path.join(fixture_dir, "cases.npz")))


def _converted(tmp_path_factory, fixture_dir, name, dtype):
    """A fixture's HF folder converted with photon-convert."""
    from photon_jax.convert import convert

    out = tmp_path_factory.mktemp("ckpt") / name
    convert(fixture_dir, str(out), dtype=dtype, log=lambda s: None)
    return str(out)


@pytest.fixture(scope="session")
def cases():
    return _cases(FIXTURE_DIR)


@pytest.fixture(scope="session")
def arrays():
    return _arrays(FIXTURE_DIR)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The fixture's HF folder converted with photon-convert (float32)."""
    return _converted(tmp_path_factory, FIXTURE_DIR, "tiny-f32", "float32")


@pytest.fixture(scope="session")
def tiny_ckpt_bf16(tmp_path_factory):
    return _converted(tmp_path_factory, FIXTURE_DIR, "tiny-bf16", "bfloat16")


@pytest.fixture(scope="session")
def md3_cases():
    return _cases(MD3_FIXTURE_DIR)


@pytest.fixture(scope="session")
def md3_arrays():
    return _arrays(MD3_FIXTURE_DIR)


@pytest.fixture(scope="session")
def md3_ckpt(tmp_path_factory):
    """The Moondream 3 fixture's HF folder converted with photon-convert (float32)."""
    return _converted(tmp_path_factory, MD3_FIXTURE_DIR, "md3-tiny-f32", "float32")
