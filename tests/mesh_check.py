"""Run in its own process by tests/test_mesh.py (JAX's CPU device count is fixed when JAX
starts): every public surface on one device and on a mesh of CPU devices, printed as one
JSON object, one entry per case, for the test to compare.  The cases of one device count
share a process: its converted fixtures, and the programs they have in common.

usage: python tests/mesh_check.py DEVICES CASE[,CASE...]
"""

import gc
import json
import os
import sys

DEVICES, CASES = int(sys.argv[1]), sys.argv[2].split(",")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={DEVICES}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import helpers  # noqa: E402
from helpers import GREEDY, LAND, MD3_BIASES, SQ  # noqa: E402
from photon_jax import Moondream  # noqa: E402
from photon_jax.engine.core import Engine  # noqa: E402
from photon_jax.engine.stepmeta import M_TABLE  # noqa: E402
from photon_jax.model import Model  # noqa: E402

gc.set_threshold(*helpers.SUITE_GC_THRESHOLD)   # as conftest.py's processes
FIX = os.path.dirname(helpers.FIXTURE_DIR)
HF2, HF3 = os.path.join(FIX, "moondream2-tiny"), os.path.join(FIX, "moondream3-tiny")
MESH = Mesh(np.array(jax.devices()[:DEVICES]), ("model",))


def with_heads(model: Model, n_heads: int, n_kv_heads: int, seed: int) -> Model:
    """The model's config with more heads (random weights from `seed`, the same biases as
    `helpers.biased_model` would give): a pool whose kv heads divide over the mesh.  Its
    vision tower has one layer instead of the fixture's 27: these cases split the text
    model's heads and pool, and an image's encode through 27 layers (about 0.03 s a crop on
    2 cores, three times that on a 4-device mesh) was most of their time.  The 27-layer tower runs
    on the mesh in the "fixtures" and "load" cases."""
    from dataclasses import replace

    from photon_jax.model.params import init_params

    cfg = model.cfg   # head dim 64, as Moondream's (RoPE turns its first 32 dims)
    cfg = replace(cfg, text=replace(cfg.text, dim=64 * n_heads, n_heads=n_heads,
                                    n_kv_heads=n_kv_heads),
                  vision=replace(cfg.vision, proj_out_dim=64 * n_heads, enc_n_layers=1),
                  region=replace(cfg.region, dim=64 * n_heads)).validate()
    params = init_params(jax.random.PRNGKey(seed), cfg)
    head = params["text"]["lm_head"]
    # EOS for varied lengths; Moondream 3's coordinate and size ids as in MD3_BIASES.
    for tok, val in ({0: 1.5} if cfg.text.moe is None else {5: 17.0, 6: 16.0}).items():
        head["b"] = head["b"].at[tok].add(val)
    return Model(cfg, params, model.prompts.tok)


def on_mesh(model: Model, **kw) -> Model:
    return Model(model.cfg, model.params, model.prompts.tok, mesh=MESH, **kw)


def layout(model: Model) -> dict:
    """How the model's and its engine's arrays are split (to show the case means what it
    says)."""
    p = model.params["text"]
    layer = p["moe_blocks"][0] if p.get("moe_blocks") else p["blocks"][0]
    eng = Engine(model, max_batch_size=2, kv_cache_tokens=2048)
    try:
        pool = eng.dev.pool.k[0][0]
        out = {"qkv": str(layer["qkv"]["w"].sharding.spec),
               "lm_head": str(p["lm_head"]["w_vd"].sharding.spec),
               "pool": str(pool.sharding.spec),
               "pool_shard_heads": pool.addressable_shards[0].data.shape[0]}
        if "moe" in layer:
            out["experts"] = str(layer["moe"]["fc1"].sharding.spec)
        return out
    finally:
        eng.close()


def moe_split() -> dict:
    """Moondream 3's MoE with its experts split over the mesh, every schedule (megablox
    under the interpreter), against one device: {schedule: bitwise equal}."""
    from functools import partial

    from photon_jax.model import moe
    from photon_jax.model.sharding import TensorParallel

    e, k, d, inner = 8, 2, 48, 24
    keys = jax.random.split(jax.random.PRNGKey(21), 4)
    p = {"router": {"w": jax.random.normal(keys[0], (d, e)) / 3,
                    "b": 0.05 * jax.random.normal(keys[1], (e,))},
         "fc1": jax.random.normal(keys[2], (e, d, 2 * inner)) / 7,
         "fc2": jax.random.normal(keys[3], (e, inner, d)) / 5}
    x = jax.random.normal(jax.random.PRNGKey(22), (90, d))
    # Per-expert LoRA tables (Moondream 3's adapters): 2 slots of rank 2 per expert, and
    # the tokens' slots cycling through none, 1 and 2.
    r, lk = 2, jax.random.split(jax.random.PRNGKey(23), 4)
    tables = {"up": {"A": jax.random.normal(lk[0], (3, e, r, d)) / 7,
                     "B": jax.random.normal(lk[1], (3, e, 2 * inner, r)) / 2},
              "down": {"A": jax.random.normal(lk[2], (3, e, r, inner)) / 5,
                       "B": jax.random.normal(lk[3], (3, e, d, r)) / 2}}
    tables = jax.tree.map(lambda t: t.at[0].set(0), tables)
    slots = jnp.arange(90, dtype=jnp.int32) % 3
    tp, out = TensorParallel(MESH), {}
    for how, n in (("dense", 8), ("gather", 2), ("blocks", 90), ("ragged", 90),
                   ("megablox-interpret", 90)):
        fn = partial(moe.moe_mlp, k=k, schedule_=how)
        one = np.asarray(jax.jit(fn)(p, x[:n]))
        split = np.asarray(jax.jit(partial(fn, tp=tp))(p, x[:n]))
        out[how] = bool(np.array_equal(one, split))
        ad = (tables, slots[:n])
        one_l = np.asarray(jax.jit(lambda p, x, ad: fn(p, x, lora=ad))(p, x[:n], ad))
        split_l = np.asarray(jax.jit(lambda p, x, ad: fn(p, x, tp=tp, lora=ad))(p, x[:n], ad))
        # equal over the mesh, and the adapters changed the rows of slots 1 and 2
        out[how + "+lora"] = bool(np.array_equal(one_l, split_l)
                                  and np.abs(one_l - one)[1:].max() > 1e-3)
    return out


def converted(src: str, out: str) -> str:
    from photon_jax.convert import convert

    convert(src, out, dtype="float32", log=lambda s: None)
    return out


def collectives(model: Model, rows: int) -> list:
    """The result shapes of every collective in the compiled decode step of `rows` rows
    (all-gather, all-reduce, all-to-all, collective-permute)."""
    import re

    eng = Engine(model, max_batch_size=rows, kv_cache_tokens=2048)
    try:
        meta = jax.device_put(np.zeros((M_TABLE + eng.max_pages, rows), np.int32),
                              model.placement)
        pages = jax.device_put(np.zeros((2, 1), np.int32), model.placement)
        hlo = eng.programs.forward.lower(model.params, eng.dev.pool, eng.dev.slots[0],
                                         eng.dev.pending, meta, pages).compile().as_text()
    finally:
        eng.close()
    pat = re.compile(r"= \w+\[([\d,]*)\][^ ]* (all-gather|all-reduce|all-to-all|"
                     r"collective-permute)(-start)?\(")
    return [[int(d) for d in m.group(1).split(",") if d] for m in pat.finditer(hlo)]


def main() -> None:
    import tempfile

    global MD2, MD3
    tmp = tempfile.mkdtemp(prefix="photon-mesh-")
    MD2, MD3 = converted(HF2, os.path.join(tmp, "md2")), converted(HF3, os.path.join(tmp, "md3"))
    result = {}
    for case in CASES:
        result[case] = run_case(case)
    print("MESH-RESULT " + json.dumps(result, sort_keys=True, default=str))


def run_case(case: str) -> dict:
    out = {}
    if case == "fixtures":
        # The fixture models (one kv head: the pool stays whole on each chip; the linear
        # layers and Moondream 3's experts are split), both loops.
        md2 = helpers.biased_model(MD2, {0: 0.8})
        md3 = helpers.biased_model(MD3, MD3_BIASES)
        out["one"] = helpers.run_surfaces([md2, md3], pipelined=True)
        meshed = [on_mesh(md2), on_mesh(md3)]
        out["layout"] = [layout(m) for m in meshed]
        out["mesh_pipelined"] = helpers.run_surfaces(meshed, pipelined=True)
    elif case == "heads":
        # Heads that divide over the mesh: the pool and the attention split by kv heads.
        base2, base3 = Model.load(MD2), Model.load(MD3)
        md2 = with_heads(base2, DEVICES, DEVICES, 11)
        md3 = with_heads(base3, DEVICES, DEVICES, 12)
        out["one"] = helpers.run_surfaces([md2, md3], pipelined=True)
        meshed = [on_mesh(md2), on_mesh(md3)]
        out["layout"] = [layout(m) for m in meshed]
        out["collectives"] = [collectives(m, 8) for m in meshed]
        # A pool too small for every request at once (waiting, prefix-cache eviction),
        # pipelined and blocking (the same programs): results equal "one" all the same.
        out["mesh_pipelined"] = helpers.run_surfaces(meshed, pipelined=True,
                                                     kv_cache_tokens=2048)
        out["mesh_blocking"] = helpers.run_surfaces(meshed, pipelined=False,
                                                    kv_cache_tokens=2048)
    elif case == "variants":
        # GQA (2 query heads per kv head), the XLA sweep and an 8-bit pool, on the mesh.
        md2 = with_heads(Model.load(MD2), 2 * DEVICES, DEVICES, 13)
        for name, kw, ekw in (("gqa", {}, {}), ("xla", {"attention": "xla"}, {}),
                              ("int8", {}, {"kv_dtype": "int8"})):
            res = []
            for m in (Model(md2.cfg, md2.params, md2.prompts.tok, **kw),
                      Model(md2.cfg, md2.params, md2.prompts.tok, mesh=MESH, **kw)):
                md = Moondream(m, Engine(m, max_batch_size=2, **ekw))
                try:
                    res.append([md.caption(LAND, "short", settings=GREEDY),
                                md.query(SQ, "w5 w6", settings=GREEDY),
                                md.caption([LAND, SQ, LAND], "short", settings=GREEDY)])
                finally:
                    md.engine.close()   # (Moondream.close would free the shared weights)
            out[name] = res
        # LoRA adapters on the mesh (their slot tables replicated): rows of two adapters
        # and a base row in one batch, and a caption under each.
        from photon_jax.convert.adapters import read_adapter
        from photon_jax.engine.request import Request
        from photon_jax.engine.settings import parse

        tmp, t = os.path.dirname(MD2), md2.cfg.text
        shapes = dict(dim=t.dim, ff=t.ff_dim, qkv=(t.n_heads + 2 * t.n_kv_heads) * t.head_dim,
                      layers=t.n_layers, b_scale=1.0)
        adapters = {n: read_adapter(helpers.write_lora(os.path.join(tmp, f"{n}.safetensors"),
                                                       4, seed, **shapes),
                                    md2.cfg, name=n, max_rank=8)
                    for n, seed in (("a", 21), ("b", 22))}
        res = []
        for m in (md2, Model(md2.cfg, md2.params, md2.prompts.tok, mesh=MESH)):
            md = Moondream(m, Engine(m, max_batch_size=4, max_adapters=2, max_lora_rank=8,
                                     adapters=dict(adapters)))
            try:
                mixed = md.engine.submit_many(
                    [Request("text", m.prompts.query("w5 w6"), img,
                             parse({**GREEDY, "variant": v}))
                     for img, v in ((SQ, None), (SQ, "a"), (LAND, "b"), (SQ, "b"))])
                res.append([[h.result()["text"] for h in mixed],
                            [md.caption(LAND, "short", settings={**GREEDY, "variant": v})
                             for v in (None, "a", "b")]])
            finally:
                md.engine.close()
        out["lora"] = res
        out["moe"] = moe_split()
    elif case == "tpu":
        # The TPU kernel (under the Pallas interpreter) over its packed pool, split by kv
        # heads: 2 heads per pool row, 2 rows per chip.
        # An int8 pool too: its scales [rows, P, 2B] split with the codes.
        md2 = with_heads(Model.load(MD2), 4 * DEVICES, 4 * DEVICES, 14)
        res, shapes = [], []
        for kv in (None, "int8"):
            for m in (Model(md2.cfg, md2.params, md2.prompts.tok, attention="xla"),
                      Model(md2.cfg, md2.params, md2.prompts.tok, mesh=MESH,
                            attention="pallas-tpu-interpret")):
                md = Moondream(m, Engine(m, max_batch_size=2, kv_dtype=kv))
                try:
                    pool = md.engine.dev.pool
                    arrays = [pool.k[0][0]] + ([pool.ks[0][0]] if kv else [])
                    shapes.append([[list(a.shape), list(a.addressable_shards[0].data.shape)]
                                   for a in arrays])
                    res.append([md.caption(LAND, "short", settings=GREEDY),
                                md.query(SQ, "w5 w6", settings=GREEDY),
                                md.caption([LAND, SQ, LAND], "short", settings=GREEDY)])
                finally:
                    md.engine.close()
        out["tpu"] = res
        out["tpu_pool"] = shapes
    elif case == "load":
        # The documented call: Moondream.load(path, mesh=...) and tensor_parallel=.
        res = []
        for kw in ({}, {"mesh": MESH}, {"tensor_parallel": DEVICES}):
            md = Moondream.load(HF3, max_batch_size=4, compile_cache=False, **kw)
            try:
                res.append([md.caption(LAND, "short", settings=GREEDY),
                            md.detect(LAND, "w7", settings={"max_objects": 2})])
            finally:
                md.close()
        out["load"] = res
    else:
        raise SystemExit(f"unknown case {case!r}")
    return out


if __name__ == "__main__":
    main()
