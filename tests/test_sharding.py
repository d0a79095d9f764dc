"""The tensor-parallel layout's rules, per-chip memory accounting and the argument checks, in
one process on one device (the multi-device runs are tests/test_mesh.py)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from photon_jax.dataset.files import UsageError
from photon_jax.dataset.job import device_groups
from photon_jax.engine import memory
from photon_jax.model import sharding
from photon_jax.model.config import moondream2, moondream3, tiny
from photon_jax.model.params import abstract_params


def specs(cfg, n):
    tree = abstract_params(cfg, cfg.dtype)
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: sharding.param_spec(sharding._path(kp), x.shape, n), tree)


def test_what_splits_in_moondream3():
    s = specs(moondream3("bfloat16"), 4)
    t = s["text"]
    assert t["blocks"]["qkv"]["w"] == P(None, None, "model")      # [L, D, qkv]: columns
    assert t["blocks"]["qkv"]["b"] == P(None, "model")
    assert t["blocks"]["fc2"]["w"] == P(None, None, "model")      # output columns too
    assert t["moe_blocks"]["moe"]["fc1"] == P(None, "model", None, None)   # by expert
    assert t["moe_blocks"]["moe"]["router"]["w"] == P()
    assert t["lm_head"]["w"] == P(None, "model") and t["lm_head"]["b"] == P("model")
    assert t["wte"] == P() and t["post_ln"]["w"] == P()
    assert all(x == P() for x in jax.tree.leaves(s["vision"], is_leaf=lambda x: isinstance(
        x, P)))


def test_a_dimension_that_does_not_divide_stays_whole():
    cfg = tiny()   # width 64, vocabulary 32768: a 3-chip mesh divides neither qkv (192)...
    s = specs(cfg, 3)["text"]
    assert s["blocks"]["qkv"]["w"] == P(None, None, "model")      # 192 = 3 x 64
    assert s["blocks"]["fc1"]["w"] == P()                         # 256 does not divide
    assert s["lm_head"]["w"] == P()                               # nor 32768



def test_the_layout_is_a_static_argument():
    """Programs are cached per layout (`step._build`'s lru_cache): equal layouts over the
    same mesh hash alike, a different pool packing does not compare equal."""
    mesh = sharding.make_mesh(1)
    a, b = sharding.TensorParallel(mesh), sharding.TensorParallel(mesh)
    assert a == b and hash(a) == hash(b)
    assert sharding.TensorParallel(mesh, pack=2) != a


def test_memory_is_counted_per_chip():
    """Moondream 3 in bfloat16 does not fit one 16 GB chip; over four, each holds about a
    quarter of the weights and of each position's K/V, and the refusal on one chip says
    how to split it."""
    cfg = moondream3("bfloat16")
    full, quarter = memory.weight_bytes(cfg), memory.weight_bytes(cfg, mesh_size=4)
    assert full > 16e9 and full / 4 < quarter < full / 4 + 1.5e9   # vision etc. replicated
    assert memory.bytes_per_token(cfg, mesh_size=4) * 4 == memory.bytes_per_token(cfg)
    kw = dict(platform="tpu", max_batch_size=32, max_context=4096, page_size=64,
              kv_cache_tokens=32 * 4096)
    with pytest.raises(memory.MemoryError_, match="tensor_parallel"):
        memory.check(memory.plan(cfg, free=15 * memory.GiB, **kw), cfg, max_context=4096,
                     weights_loaded=False)
    plan = memory.plan(cfg, free=15 * memory.GiB, mesh_size=4, **kw)
    memory.check(plan, cfg, max_context=4096, weights_loaded=False)
    assert "per chip of a 4-chip mesh" in plan.describe()
    # Moondream 2's 32 kv heads split too; a model whose heads do not divide keeps them.
    assert memory.bytes_per_token(moondream2(), mesh_size=4) * 4 == \
        memory.bytes_per_token(moondream2())
    assert memory.bytes_per_token(tiny(), mesh_size=4) == memory.bytes_per_token(tiny())


def test_bad_meshes_are_refused_by_name():
    with pytest.raises(ValueError, match="tensor_parallel=9 needs 9 devices"):
        sharding.make_mesh(9, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="positive int"):
        sharding.make_mesh(0)
    with pytest.raises(ValueError, match="one axis 'model'"):
        sharding.check_mesh(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)))
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        sharding.check_mesh([jax.devices()[0]])


def test_photon_caption_groups_devices():
    devs = list(range(8))
    assert device_groups(devs, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert device_groups(devs, 1) == [[d] for d in devs]
    with pytest.raises(UsageError, match="groups of 3"):
        device_groups(devs, 3)
    with pytest.raises(UsageError, match="positive integer"):
        device_groups(devs, 0)
