"""The platform choice is made once (`platforms.choose` -> `platforms.Platform`) and read everywhere
else: the engine, the memory plan and the preflight agree because they read one record."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from photon_jax.engine import memory, step
from photon_jax.model import platforms
from photon_jax.model.config import moondream2, tiny

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "photon_jax")


def test_the_record_of_each_platform():
    cfg = moondream2("bfloat16")
    gpu = platforms.choose(cfg, "gpu")
    assert gpu.attention.startswith("pallas") and not gpu.sweeps and gpu.shares_prefix
    assert gpu.plans_splits and gpu.grouped == "dense" and not gpu.host_memory
    assert not gpu.dense and not gpu.vision_loop and gpu.dtype == "bfloat16"
    tpu = platforms.choose(cfg, "tpu")   # our TPU kernel: two heads of dim 64 per pool row
    assert tpu.attention == "pallas-tpu" and tpu.pack == 2 and not tpu.plans_splits
    assert not tpu.sweeps and tpu.shares_prefix and tpu.grouped == "ragged+megablox"
    assert gpu.pack == 1 and platforms.choose(tiny(), "cpu", "pallas-tpu-interpret").pack == 2
    P = step.build_for(cfg, tpu)   # no GPU split plans: one forward per bucket
    assert P.decode_splits([2000], 64) == 1 and P.split_variants(1) == (1,)
    xla = platforms.choose(tiny(), "cpu", "xla")
    assert xla.sweeps and not xla.shares_prefix and not xla.plans_splits
    assert xla.host_memory and xla.vision_loop and xla.grouped == "blocks+blocks"
    assert platforms.choose(tiny(), "cpu", "xla", "int8").kv_dtype == "int8"
    with pytest.raises(ValueError, match="attention must be one of"):
        platforms.choose(tiny(), "cpu", "flash")


def test_the_memory_plan_reads_the_same_record_as_the_engine():
    """A CPU plan asked by name gets the default attention's layout (one arena for the
    kernel, arenas for the sweep), as the engine built on that record does."""
    kw = dict(max_batch_size=4, max_context=1024, page_size=64, kv_cache_tokens=8192)
    cfg = tiny()
    for attention in ("xla", platforms.default_attention("cpu")):
        rec = platforms.choose(cfg, "cpu", attention)
        plan = memory.plan(cfg, platform=rec, **kw)
        assert (len(plan.arenas.sizes) > 1) == rec.sweeps
    assert memory.plan(cfg, platform="cpu", **kw).arenas == \
        memory.plan(cfg, platform=platforms.choose(cfg, "cpu"), **kw).arenas


def test_no_module_but_platforms_compares_platform_or_attention_names():
    pat = re.compile(r"""(==|!=)\s*["'](cpu|gpu|tpu|xla|cpu-kernel|pallas[\w-]*)["']|"""
                     r"""startswith\(["'](pallas|cpu|xla)""")
    found = []
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py") and f != "platforms.py":
                path = os.path.join(root, f)
                for i, line in enumerate(open(path), 1):
                    if pat.search(line):
                        found.append(f"{os.path.relpath(path, PKG)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w_vd"])
def test_one_bfloat16_row_is_multiplied_without_widening_the_weight_on_cpu(transposed):
    """XLA:CPU multiplies one bfloat16 row by a bfloat16 weight by converting the whole
    weight to float32 first (a full-size one-row decode step took 5.5 s); `layers.linear`
    multiplies it as two rows there.  The compiled program must hold no float32 copy of the
    weight, and give the plain product's values (to a bfloat16 rounding: the summation order
    of the transposed head differs)."""
    from photon_jax.model.layers import linear

    rng = np.random.default_rng(0)
    shape = (512, 256) if transposed else (256, 512)
    w = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    p = {"w_vd" if transposed else "w": w, "b": jnp.zeros(512, jnp.bfloat16)}
    x = jnp.asarray(rng.normal(size=(1, 1, 256)), jnp.bfloat16)
    compiled = jax.jit(linear).lower(x, p).compile()
    assert f"f32[{shape[0]},{shape[1]}]" not in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes < w.nbytes
    got = np.asarray(compiled(x, p), np.float32)
    want = np.asarray(jnp.einsum("...i,oi->...o" if transposed else "...i,io->...o", x, w,
                                 preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                      np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    if not transposed:
        assert np.array_equal(got, want)


def test_the_memory_plan_counts_the_cpu_vision_copy_of_a_bfloat16_tower():
    """`memory.cpu_vision_widened_bytes` is the float32 bytes of every vision block's
    parameters (what XLA:CPU widens ahead of the encoder's scan): checked against the
    parameter shapes themselves, 0 in float32."""
    from photon_jax.engine import memory
    from photon_jax.model.config import moondream2
    from photon_jax.model.params import abstract_params

    cfg = moondream2("bfloat16")
    blocks = abstract_params(cfg)["vision"]["blocks"]
    assert memory.cpu_vision_widened_bytes(cfg) == 4 * sum(
        int(np.prod(a.shape)) for a in jax.tree.leaves(blocks))
    assert memory.cpu_vision_widened_bytes(cfg.with_dtype("float32")) == 0
