"""One engine over a mesh of CPU devices gives one device's results, token for token
(`photon_jax.model.sharding`).  JAX fixes its CPU device count when it starts, so the cases
run in `tests/mesh_check.py` with --xla_force_host_platform_device_count: one process for
the 4-device cases and one for the 2-device cases (module fixtures), sharing their
converted fixtures and compiled programs."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_cases(devices: int, cases: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "mesh_check.py"), str(devices),
                           ",".join(cases)], capture_output=True, text=True, env=env,
                          timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MESH-RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("MESH-RESULT "):])


def assert_same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want)
    for key in want:
        assert got[key] == want[key], f"{what}: {key} differs"


@pytest.fixture(scope="module")
def four():
    return run_cases(4, ["fixtures", "heads", "load"])


@pytest.fixture(scope="module")
def two():
    return run_cases(2, ["variants", "tpu"])


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


@pytest.mark.parametrize("case", ["gqa", "xla", "int8"])
def test_variants_on_2_devices(two, case):
    """GQA (two query heads per kv head), the XLA sweep and an 8-bit pool, split over two
    chips: the same tokens as one device."""
    one, mesh = two["variants"][case]
    assert mesh == one


def test_every_moe_schedule_with_experts_split_over_2_devices_equals_one_device(two):
    """Each chip gets every assignment, those of the other chip's experts as an id past
    its own (left out of ragged_dot's and megablox's groups: no work for them)."""
    assert two["variants"]["moe"] == dict.fromkeys(
        ("dense", "gather", "blocks", "ragged", "megablox-interpret"), True)


def test_moondream_load_with_mesh_and_tensor_parallel(four):
    """The documented calls: Moondream.load(path, mesh=Mesh(devices[:4], ("model",))) and
    tensor_parallel=4, on the Moondream 3 fixture's Hugging Face folder."""
    one, mesh, tp = four["load"]["load"]
    assert mesh == one and tp == one


def test_the_tpu_kernel_split_by_kv_heads_over_2_devices_equals_one_device(two):
    """The TPU decode attention ("pallas-tpu-interpret") on its packed pool over two chips,
    each holding its kv heads' rows (2 heads per 128-lane row): the tokens of one device's
    XLA attention; with an int8 pool too (its scales [K/2, P, 2B] split like the codes)."""
    out = two["tpu"]
    ((one_shape, _),), ((mesh_shape, shard_shape),), one8, mesh8 = out["tpu_pool"]
    assert one_shape[0] == 8 and one_shape[3] == 64          # [K, P, B, H] on one device
    assert mesh_shape[0] == 4 and mesh_shape[3] == 128       # [K/2, P, B, 128] ...
    assert shard_shape[0] == 2                                # ... split over the two
    (scales, scale_shard) = mesh8[1]
    assert mesh8[0][1][0] == 2 and scales[0] == 4 and scales[2] == 2 * mesh_shape[2]
    assert scale_shard[0] == 2 and one8[1][0][0] == 8         # one device: [K, P, B]
    one, mesh, one_int8, mesh_int8 = out["tpu"]
    assert mesh == one and one[0]["caption"]
    assert mesh_int8 == one_int8 and one_int8[0]["caption"]
