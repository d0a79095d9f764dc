"""The GPU path, checked on a machine without a GPU.

A GPU gets other programs than the CPU: decode attention by our Pallas kernel
(`gpu_attention`), the MoE prefill as one `dense` product, the vision attention without the per-crop
loop (`platforms.default_*`).  Two checks here, for Moondream 2 and Moondream 3:

* The engine runs a mixed workload on the GPU's programs (the Pallas kernel under the Pallas
  interpreter), and its outputs equal the CPU's one-request path's, the path the parity
  tests hold to the reference.  Every device program it and the one-request path dispatch
  is recorded with the shapes and dtypes of its arguments; each is then built as a GPU gets
  it and lowered for CUDA.  Lowering runs Pallas's Triton lowering, so a block shape, dtype or grid
  the kernel rejects fails here, at the shapes the engine really uses.
* The decode step and the ceiling at full Moondream 2 and Moondream 3 (32k context) shapes,
  batch 32, lowered for CUDA from abstract shapes (nothing allocated): the kernel at the
  page-table width of real sizes (every split variant: tests/test_gpu_attention.py and
  bench/gpu_compile.py).

What lowering cannot check: the GPU compilers (`bench/gpu_compile.py` runs them for an H200
without a GPU, where JAX's CUDA plugin is installed), and memory and speed at run time
(`bench/gpu_md2.py`, on a GPU).
"""

import dataclasses
import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from photon_jax.engine import kvpool, reference, step as step_mod
from photon_jax.engine.core import Engine
from photon_jax.engine.request import Request
from photon_jax.engine.settings import Settings
from photon_jax.model import Model
from photon_jax.model.config import moondream2, moondream3

from helpers import FIXTURE_DIR, biased_model, pallas_attention

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))

TRITON = "__gpu$xla.gpu.triton"   # the custom call a Pallas GPU kernel lowers to
IMAGES = [os.path.join(FIXTURE_DIR, f) for f in ("img_land800x600.png", "img_sq378.png")]


def lower_for_cuda(fn, args) -> str:
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _abstract(x):
    if isinstance(x, (jax.Array, np.ndarray)):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x   # static arguments (ints, bools) as they were


class Recorder:
    """Wraps a bundle of programs (`step.EnginePrograms` or `step.OraclePrograms`): each
    call is recorded once per distinct argument signature, as (program name, abstract
    arguments), then run."""

    def __init__(self, programs, calls: dict | None = None):
        self.calls: dict = {} if calls is None else calls
        self._lock = threading.Lock()
        wrapped = {}
        for f in dataclasses.fields(programs):
            fn = getattr(programs, f.name)
            if isinstance(fn, dict):   # sample_step: its static variants
                wrapped[f.name] = {k: self._wrap((f.name, k), g) for k, g in fn.items()}
            elif callable(fn):
                wrapped[f.name] = self._wrap(f.name, fn)
        self.programs = dataclasses.replace(programs, **wrapped)

    def _wrap(self, name, fn):
        def call(*args):   # (static arguments, forward's splits, are positional ints)
            abstract = jax.tree.map(_abstract, args)
            key = (name, repr(abstract))
            with self._lock:
                self.calls.setdefault(key, (name, abstract))
            return fn(*args)
        return call


def lower_recorded(calls, *bundles) -> dict:
    """{program name: number of Pallas kernel calls in its CUDA lowering}, over every
    recorded signature (the counts of one name are summed); each name is looked up in the
    bundle that has it (the two bundles' names differ)."""
    out: dict = {}
    for name, args in calls.values():
        field = name[0] if isinstance(name, tuple) else name
        fn = getattr(next(b for b in bundles if hasattr(b, field)), field)
        fn = fn[name[1]] if isinstance(name, tuple) else fn
        label = name if isinstance(name, str) else f"{name[0]}{name[1]}"
        out[label] = out.get(label, 0) + lower_for_cuda(fn, args).count(TRITON)
    return out


def run_workload(model, requests, programs):
    """The pipelined engine's outputs on `programs`, its pool all free after close().  800
    positions in pages of 32: page tables 25 pages wide, not a power of 2 (Triton's lowering
    cares).  Decode bursts of 4, a GPU's default (the model here is on the CPU, whose
    default is single steps)."""
    eng = Engine(model, max_batch_size=4, max_context=800, page_size=32, programs=programs,
                 decode_burst=4)
    try:
        got = [h.result(timeout=600) for h in [eng.submit(r) for r in requests]]
    finally:
        eng.close()
    assert (eng.sched.alloc.in_use(), eng.sched.alloc.reserved) == (0, 0)
    return got


def requests_for(model):
    pr = model.prompts
    greedy, hot = Settings(max_tokens=6, temperature=0), Settings(max_tokens=5, seed=3)
    return [Request("text", pr.caption("short"), IMAGES[0], greedy),
            Request("text", pr.query("w60 w7"), IMAGES[0], greedy),   # a prefix-cache hit
            Request("text", pr.caption("normal"), IMAGES[1], hot),
            Request("text", [0] + pr.query("w90"), None, greedy),     # text only
            Request("point", pr.point("w70"), IMAGES[1], Settings(max_objects=2))]


def check_engine_on_gpu_programs(base: Model, n_requests: int, monkeypatch):
    """The engine on the GPU's programs equals the one-request path on the CPU's (the path
    the parity tests hold to the reference), token for token; then every program the two
    dispatched (the one-request path's take the same arguments on both) is built as a GPU
    gets it and lowers for CUDA."""
    # `base`'s weights on the programs a GPU builds: the Pallas kernel (under the
    # interpreter, except on a GPU), the dense MoE prefill, the vision attention without
    # the loop.
    model = Model(base.cfg, base.params, base.prompts.tok, attention=pallas_attention())
    rec = Recorder(step_mod.build_for(base.cfg, "gpu", pallas_attention()))
    # The one-request path on `base` dispatches through recorders of its programs too.
    recorded = {id(base): (Recorder(step_mod.programs_of(base), rec.calls).programs,
                           Recorder(step_mod.oracle_of(base), rec.calls).programs)}
    programs_of, oracle_of = step_mod.programs_of, step_mod.oracle_of
    monkeypatch.setattr(step_mod, "programs_of",
                        lambda m: recorded[id(m)][0] if id(m) in recorded else programs_of(m))
    monkeypatch.setattr(step_mod, "oracle_of",
                        lambda m: recorded[id(m)][1] if id(m) in recorded else oracle_of(m))
    reqs = requests_for(model)[:n_requests]
    got = run_workload(model, reqs, rec.programs)
    for req, out in zip(reqs, got):
        enc = None if req.image is None else reference.encode_image(base, req.image)
        if req.skill == "text":
            want = reference.generate_text(base, enc, req.prompt, req.settings)["ids"]
            assert out["ids"] == want, req
        else:
            want = reference.generate_points(base, enc, req.prompt, with_size=False,
                                             max_objects=req.settings.max_objects)
            assert out["objects"] == want["objects"], req
    # The engine planned splits from the rows' lengths (image prompts: ~760 positions, 2
    # splits), so the split kernel and its combine produced the tokens compared above.
    splits = {args[6] for n, args in rec.calls.values() if n == "forward"}
    assert 2 in splits, splits
    dispatched = {n if isinstance(n, str) else n[0] for n, _ in rec.calls.values()}
    assert {"image_kv", "write_prefix_pages", "copy_pages", "prefill_slot", "forward",
            "sample_step", "prefill", "decode"} <= dispatched, dispatched
    lowered = lower_recorded(rec.calls, step_mod.build_for(model.cfg, "gpu"),
                             step_mod.oracle_for(model.cfg, "gpu"))
    # Decode attention is the Pallas kernel (one kernel, called from every layer), in single
    # steps and in decode bursts (the default: k steps in one program); nothing else is.
    assert lowered["forward"] >= 1, lowered
    assert any(k.startswith("burst") for k in lowered), lowered   # bursts did run
    assert all(v >= 1 for k, v in lowered.items() if k.startswith("burst")), lowered
    assert all(v == 0 for k, v in lowered.items()
               if k != "forward" and not k.startswith("burst")), lowered
    return lowered


def test_the_engine_on_the_gpu_programs_equals_the_reference_and_lowers_for_cuda(tiny_ckpt,
                                                                                monkeypatch):
    check_engine_on_gpu_programs(biased_model(tiny_ckpt, {0: 0.8}), 5, monkeypatch)


def test_moondream3_on_the_gpu_programs_equals_the_reference_and_lowers_for_cuda(md3_ckpt,
                                                                                 monkeypatch):
    # (Fewer requests: the same programs at Moondream 3's shapes: tau attention, MoE
    # prefill as one dense product.)
    check_engine_on_gpu_programs(biased_model(md3_ckpt, {0: 0.8}), 2, monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_multiplies_float32_in_float32(dtype):
    """JAX's kernel multiplied on the tensor cores at the default precision, TF32 for
    float32; ours is a mat-vec on the vector units (`gpu_attention`): no dot at all, so a
    float32 pool's scores and outputs are float32 products, whatever the precision flag."""
    r, n, h, kh, p, t, m = 2, 4, 64, 4, 16, 16, 8
    pool = jax.ShapeDtypeStruct((kh, p, t, h), jnp.dtype(dtype))
    for splits in (1, 4):
        jaxpr = str(jax.make_jaxpr(lambda k, v, q, pt, ln: kvpool.kernel_attend(
            (k,), (v,), q, pt, ln, splits=splits))(
                pool, pool, jax.ShapeDtypeStruct((r, n, h), jnp.float32),
                jax.ShapeDtypeStruct((r, m), jnp.int32), jax.ShapeDtypeStruct((r,), jnp.int32)))
        assert "pallas_call" in jaxpr
        assert "dot_general" not in jaxpr and "mul" in jaxpr


@pytest.mark.parametrize("cfg_fn, dtype", [(moondream2, "bfloat16"), (moondream3, "bfloat16"),
                                           (moondream2, "float32")])
def test_the_full_size_decode_step_lowers_for_cuda(cfg_fn, dtype):
    """Batch 32 at the config's full context (Moondream 3: 32k positions, 512 pages a row),
    a pool for every row's whole context, abstract shapes only (the arguments
    `bench/gpu_compile.py` compiles for an H200): the decode step, the ceiling's scan and a
    decode burst call the kernel, and it reads the pool in the model's dtype, never a converted copy."""
    from gpu_compile import decode_args, stacked

    cfg = cfg_fn().with_dtype(dtype)
    a = decode_args(cfg, 32, 64, free=None, kv_cache_tokens=32 * cfg.text.max_context)
    assert len(a["plan"].arenas.sizes) == 1   # the kernel reads one arena
    params, dev = a["params"], a["dev"]
    P = step_mod.build_for(cfg, "gpu")
    text = lower_for_cuda(P.forward, (params, dev.pool, dev.slots[0], dev.pending, a["meta"],
                                      a["owners"]))
    ceiling = lower_for_cuda(P.ceiling, (params, dev.pool, dev.slots[0], dev.pending,
                                         dev.tables, stacked(a["meta"], 2),
                                         stacked(a["owners"], 2), a["samp"]))
    burst = lower_for_cuda(P.burst[True], (params, dev.pool, dev.slots[0], dev.pending,
                                           dev.tables, stacked(a["meta"], 2),
                                           stacked(a["owners"], 2), a["samp"]))
    assert text.count(TRITON) >= 1 and ceiling.count(TRITON) >= 1
    assert burst.count(TRITON) >= 1   # decode bursts (docs/host.md) call the kernel too
    k, pages_n, t, h = dev.pool.k[0][0].shape
    kv_type = {"bfloat16": "bf16", "float32": "f32"}[dtype]
    assert f"tensor<{k}x{pages_n}x{t}x{h}x{kv_type}>" in text
    if dtype != "float32":
        assert f"tensor<{k}x{pages_n}x{t}x{h}xf32>" not in text


@pytest.mark.parametrize("mode", ["gather", "masked"])
def test_the_full_size_decode_step_with_adapter_slots_lowers_for_cuda(mode):
    """Moondream 2 at full size, batch 32, with 8 LoRA slots of rank 64 (docs/lora.md),
    abstract shapes only: the decode step, the prefill and the slot write lower for CUDA,
    the kernel still in the decode step, the tables read in the model's dtype."""
    from gpu_compile import decode_args

    from photon_jax.engine import stepmeta as M
    from photon_jax.model import lora, platforms

    cfg = moondream2().with_dtype("bfloat16")
    a = decode_args(cfg, 32, 64, free=None, kv_cache_tokens=32 * cfg.text.max_context)
    params, dev = a["params"], a["dev"]
    rec = platforms.choose(cfg, "gpu")   # what build_for gives a GPU, with the mode
    P = step_mod.build(cfg, rec.attention, grouped=rec.grouped, vision_loop=rec.vision_loop,
                       dense=rec.dense, lora_mode=mode)
    tables = jax.eval_shape(lambda: lora.init_tables(cfg, 8, 64))
    text = lower_for_cuda(P.forward, (params, dev.pool, dev.slots[0], dev.pending, a["meta"],
                                      a["owners"], 1, tables))
    assert text.count(TRITON) >= 1
    assert "tensor<9x64x2048xbf16>" in text   # a qkv A table: slots + 1, rank, in
    if mode == "gather":
        # Each layer's gather waits for that layer's input (bench/gpu_compile.py measured
        # XLA:GPU hoisting them all otherwise: 2.9 GB of temporaries for a 32-row prefill).
        assert text.count("optimization_barrier") >= 4 * cfg.text.n_layers
    rows, t = 4, 32
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)   # noqa: E731
    pre = lower_for_cuda(P.prefill_slot, (
        params, dev.pool, dev.slots[0], i32(rows, t), i32(rows, t),
        jax.ShapeDtypeStruct((rows, t, 2), jnp.float32), i32(M.F_ADAPTER + 1, rows),
        i32(2, rows, t), i32(rows, 1024 // 64), tables))
    assert "tensor<9x64x2048xbf16>" in pre
    one = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], jnp.float32), tables)
    lower_for_cuda(P.write_adapter, (tables, jax.ShapeDtypeStruct((), jnp.int32), one))


def test_moondream3_full_size_decode_step_with_expert_adapter_slots_lowers_for_cuda():
    """Moondream 3 at full size, batch 32, 8 LoRA slots of rank 64 in kestrel's layout
    (8 per expert), abstract shapes only: the decode step lowers for CUDA with the expert
    tables in it, read per assignment in the model's dtype."""
    from gpu_compile import decode_args

    from photon_jax.model import lora

    cfg = moondream3().with_dtype("bfloat16")
    a = decode_args(cfg, 32, 64, free=None, kv_cache_tokens=32 * 2048)
    P = step_mod.build_for(cfg, "gpu")
    tables = jax.eval_shape(lambda: lora.init_tables(cfg, 8, 64))
    assert "qkv" not in tables[0] and set(tables[-1]) == {"up", "down"}
    text = lower_for_cuda(P.forward, (a["params"], a["dev"].pool, a["dev"].slots[0],
                                      a["dev"].pending, a["meta"], a["owners"], 1, tables))
    assert text.count(TRITON) >= 1
    assert "tensor<9x64x8x2048xbf16>" in text   # up A: slots + 1, experts, 64 / 8, D
    assert "tensor<9x64x2048x8xbf16>" in text   # up B: 2I = 2048 rows
