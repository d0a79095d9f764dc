"""One engine over a mesh of two CPU devices gives one device's results, token for token:
GQA, the XLA sweep, an 8-bit pool, LoRA adapters, the MoE schedules and the TPU kernel split
by kv heads.
The cases run in one `tests/mesh_check.py` process, as tests/test_mesh.py's do."""

import pytest

from helpers import mesh_cases as run_cases


@pytest.fixture(scope="module")
def two():
    return run_cases(2, ["variants", "tpu"])


@pytest.mark.parametrize("case", ["gqa", "xla", "int8"])
def test_variants_on_2_devices(two, case):
    """GQA (two query heads per kv head), the XLA sweep and an 8-bit pool, split over two
    chips: the same tokens as one device."""
    one, mesh = two["variants"][case]
    assert mesh == one


def test_lora_adapters_over_2_devices_equal_one_device(two):
    """LoRA adapters on the mesh (slot tables replicated): a batch mixing two adapters and
    the base, and a caption under each, give one device's tokens; the adapters matter."""
    one, mesh = two["variants"]["lora"]
    assert mesh == one
    mixed, captions = one
    assert mixed[0] != mixed[1] and captions[0] != captions[1] != captions[2]


def test_every_moe_schedule_with_experts_split_over_2_devices_equals_one_device(two):
    """Each chip gets every assignment, those of the other chip's experts as an id past
    its own (left out of ragged_dot's and megablox's groups: no work for them).  With
    per-expert LoRA adapters (Moondream 3's) too: each assignment's up delta goes to the
    chip of its expert, the activations come back from it."""
    hows = ("dense", "gather", "blocks", "ragged", "megablox-interpret")
    assert two["variants"]["moe"] == dict.fromkeys(hows + tuple(h + "+lora" for h in hows),
                                                   True)


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

