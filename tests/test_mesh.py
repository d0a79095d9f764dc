"""One engine over a mesh of four CPU devices gives one device's results, token for token
(`photon_jax.model.sharding`).  JAX fixes its CPU device count when it starts, so the cases
run in `tests/mesh_check.py` with --xla_force_host_platform_device_count, in one process
(a module fixture) sharing its converted fixtures and compiled programs; the 2-device cases
are tests/test_mesh_two.py's, a file of their own so that the two processes run on both
workers at once."""

import pytest

from helpers import mesh_assert_same as assert_same
from helpers import mesh_cases as run_cases


@pytest.fixture(scope="module")
def four():
    return run_cases(4, ["fixtures", "heads", "load"])


def test_fixtures_on_4_devices_equal_one_device(four):
    """The fixture models (one kv head: the pool is whole on each chip; linear layers, the
    LM head and Moondream 3's experts split), every surface (the blocking loop: the heads
    case below)."""
    out = four["fixtures"]
    md2, md3 = out["layout"]
    assert md2["qkv"] == "P(None, 'model')" and md2["lm_head"] == "P('model', None)"
    assert md2["pool"] == "P()" and md3["experts"] == "P('model', None, None)"
    assert_same(out["mesh_pipelined"], out["one"], "pipelined")
    # The surfaces produce something to compare (not only empty strings).
    assert out["one"]["caption"]["caption"] and out["one"]["md3"][2]["objects"]


def test_heads_split_over_4_devices_equal_one_device(four):
    """Four kv heads over four chips: each chip holds one head's pages and attends it,
    under a pool too small for every request at once (requests wait, prefixes are
    evicted), pipelined and blocking."""
    out = four["heads"]
    for lay in out["layout"]:
        assert lay["pool"] == "P('model',)" and lay["pool_shard_heads"] == 1
    # Chips exchange activations only: every collective of an 8-row decode step moves
    # something shaped [8 rows, ...] (never a weight or the pool).
    for shapes in out["collectives"]:
        assert shapes and all(s[0] == 8 for s in shapes), shapes
    assert_same(out["mesh_pipelined"], out["one"], "small pool, pipelined")
    assert_same(out["mesh_blocking"], out["one"], "small pool, blocking")
    assert out["one"]["caption"]["caption"] and out["one"]["md3"][2]["objects"]


def test_moondream_load_with_mesh_and_tensor_parallel(four):
    """The documented calls: Moondream.load(path, mesh=Mesh(devices[:4], ("model",))) and
    tensor_parallel=4, on the Moondream 3 fixture's Hugging Face folder."""
    one, mesh, tp = four["load"]["load"]
    assert mesh == one and tp == one
