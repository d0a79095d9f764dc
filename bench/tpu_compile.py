"""Every serving program compiled for a TPU on a machine without one.

With libtpu installed (`pip install ".[tpu]"`), `jax.experimental.topologies` describes TPU
chips that are not attached (`TPU_SKIP_MDS_QUERY=1`; "v5e:1x1" is refused, so a one-chip
program takes one device of a 2x2).  Programs given abstract arguments placed on those
devices then lower and compile for real: Mosaic compiles the Pallas TPU kernel
(`tpu_attention`), XLA:TPU the rest, and `memory_analysis()` gives per-chip bytes (the
compiler refuses a program over HBM).  Nothing runs: no speeds, only whether each program
compiles, what it needs per chip, and whether its optimized HLO has a `conditional` or a
`while` of unknown trip count (each one a host round trip).

One JSON line per (model, topology, program), kind "tpu_compile": compiled, argument_bytes,
output_bytes, temp_bytes, hbm_bytes_per_chip (arguments + outputs - aliased + temporaries +
code), conditionals, unknown_trip_loops, compile_s, flops and bytes_accessed (XLA's cost
analysis), error (when not compiled); and the
pool `memory.plan` gave for the chip (kv_cache_tokens).  `--cost-model` prints instead one
line per (model, chip, chips, context) of the decode-step byte model (kind "tpu_cost"): the
weights and KV bytes a step reads per chip against the chip's HBM bandwidth, and the
tokens/s that bound gives.

    pip install ".[tpu]"      # libtpu; keep it out of a CPU/GPU environment
    TPU_SKIP_MDS_QUERY=1 JAX_PLATFORMS=cpu python bench/tpu_compile.py
    python bench/tpu_compile.py --lower-only        # no libtpu: tiny config, StableHLO (CI)
    ... --kv-dtype int8                             # the 8-bit pool (`tpu_attention`)
    ... --moe [TOKENS ...]     # one MoE layer: ragged_dot against megablox (kind "tpu_moe")

(JAX_PLATFORMS=cpu: JAX must not try to open a TPU it does not have; the topology is
described by libtpu regardless.  Results: bench/README.md.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (CONFIGS, WEIGHT_CHOICES, env_info, image_block_prefill,  # noqa: E402
                    with_weights)

GiB = 1 << 30
# Per chip: HBM bytes and bandwidth (public figures), and the topology name a one-chip
# program borrows a device from.
CHIPS = {"v5e": {"hbm": 16 * GiB, "bw": 819e9, "kind": "TPU v5 lite"},
         "v6e": {"hbm": 32 * GiB, "bw": 1.6e12, "kind": "TPU v6 lite"}}
# What `memory.device_free` would read on the chip: assumed 95% of HBM (the TPU runtime
# keeps some for itself; not measured here, there is no TPU).
FREE_SHARE = 0.95
PAGE = 64
ATTENTION = "pallas-tpu"


def devices_of(topology: str):
    """(chip, devices): "v5e" = one chip (a device of "v5e:2x2"), "v5e:2x2" = all four."""
    from photon_jax.base import compat

    chip, _, shape = topology.partition(":")
    topo = compat.topology_desc(platform="tpu", topology_name=f"{chip}:{shape or '2x2'}")
    devs = list(topo.devices)
    return chip, (devs if shape else devs[:1])


def _computations(hlo_text: str) -> dict:
    """{name: body lines} of an HLO module's computations."""
    out, name = {}, None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and "{" in line and line.rstrip().endswith("{"):
            name = line.split()[1 if line.startswith("ENTRY") else 0]
            out[name] = []
        elif name is not None:
            out[name].append(line.strip())
    return out


def _bounded(cond_lines) -> bool:
    """Whether a while's condition compares its counter against a constant (a static trip
    count).  XLA:TPU's optimized HLO carries no `known_trip_count` annotation (XLA:CPU and
    XLA:GPU do): a fori_loop's condition there is `compare(counter, constant(n))`, a
    data-dependent loop's compares two loop values."""
    consts = {ln.split(" = ")[0].replace("ROOT ", "") for ln in cond_lines if " constant(" in ln}
    root = next((ln for ln in cond_lines if ln.startswith("ROOT ")), "")
    if " compare(" not in root:
        return False
    args = root.split(" compare(", 1)[1].split(")", 1)[0]
    return any(a.strip() in consts for a in args.split(","))


def audit_counts(hlo_text: str) -> tuple[int, int]:
    """(conditionals, whiles without a known trip count) of an optimized HLO module: the
    audit of tests/test_hlo_audit.py, with `_bounded` for XLA:TPU's whiles."""
    comps = _computations(hlo_text)
    cond = loops = 0
    for line in hlo_text.splitlines():
        if " conditional(" in line:
            cond += 1
        elif " while(" in line and '"known_trip_count"' not in line:
            name = line.split("condition=", 1)[1].split(",", 1)[0].strip()
            loops += not _bounded(comps.get(name, []))
    return cond, loops


def lowering_context(chip: str | None):
    """Pallas's TPU lowering asks the default device's kind; without a TPU attached it is
    told by an abstract mesh of one described chip."""
    import jax

    if chip is None:
        return contextlib.nullcontext()
    dev = jax.sharding.AbstractDevice(device_kind=CHIPS[chip]["kind"], num_cores=1,
                                      platform="tpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                    abstract_device=dev))


def placed_args(args, devices, shardings=None):
    """`args` as abstract arrays on `devices`: one device, or a mesh with `shardings` (a
    function of the args giving a NamedSharding per array leaf)."""
    import jax

    if shardings is None:
        where = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(devices[0]), args)
    else:
        where = shardings(args)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                        if hasattr(a, "shape") else a, args, where)


def compile_row(fn, args, devices, chip: str, shardings=None, **fields) -> dict:
    """Compile `fn` at the abstract `args` for `devices` (None: lower to StableHLO for TPU
    only, no libtpu; several: a mesh, `shardings` placing the args); the row to print."""
    import jax

    row = {"kind": "tpu_compile", **fields}
    t0 = time.perf_counter()
    if devices is None:
        try:
            with lowering_context(chip):
                text = fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        except Exception as e:
            return {**row, "compiled": False, "lower_only": True,
                    "error": f"{type(e).__name__}: {str(e)[:300]}"}
        return {**row, "compiled": False, "lower_only": True, "lowered": True,
                "tpu_kernels": text.count("tpu_custom_call"),
                "lower_s": round(time.perf_counter() - t0, 1)}
    try:
        placed = placed_args(args, devices, shardings)
        with jax.default_device(devices[0]):
            compiled = fn.trace(*placed).lower().compile()
    except Exception as e:   # the compiler's verdict is the result
        return {**row, "compiled": False, "compile_s": round(time.perf_counter() - t0, 1),
                "error": f"{type(e).__name__}: {str(e)[:400]}"}
    text = compiled.as_text()
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    cond, loops = audit_counts(text)
    hbm = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
           + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
    return {**row, "compiled": True, "compile_s": round(time.perf_counter() - t0, 1),
            "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes), "hbm_bytes_per_chip": int(hbm),
            "hbm_share": round(hbm / CHIPS[chip]["hbm"], 3),
            "conditionals": cond, "unknown_trip_loops": loops,
            "tpu_kernels": text.count("tpu_custom_call"),
            # XLA's estimate; a Pallas kernel counts what its CostEstimate declares.
            "flops": float(cost.get("flops", -1)),
            "bytes_accessed": float(cost.get("bytes accessed", -1))}


def serving_args(cfg, batch: int, chip: str | None, kv_cache_tokens=None,
                 chips: int = 1, kv_dtype: str | None = None, adapter_bytes: int = 0) -> dict:
    """Abstract arguments (nothing allocated) of the serving programs: params as a loaded
    model holds them, the device state with the pool `memory.plan` gives for the chip (one
    arena, the TPU layout; over `chips` chips, per chip; `kv_dtype`: an 8-bit pool;
    `adapter_bytes`: LoRA slot tables set aside first, as the engine's plan does), decode
    metadata per row bucket, sampling rows."""
    import jax
    import jax.numpy as jnp

    from photon_jax.engine import memory, step as step_mod, stepmeta as M
    from photon_jax.model import platforms
    from photon_jax.model.params import abstract_params
    from photon_jax.model.text import unstack_layers

    ctx = cfg.text.max_context
    free = None if chip is None else int(FREE_SHARE * CHIPS[chip]["hbm"])
    mesh = {"mesh_size": chips} if chips > 1 else {}   # (a plan per chip: the mesh sharding)
    plat = platforms.choose(cfg, "tpu", ATTENTION)
    plan = memory.plan(cfg, platform=plat, max_batch_size=batch, max_context=ctx,
                       page_size=PAGE, kv_cache_tokens=kv_cache_tokens, free=free,
                       kv_dtype=kv_dtype, adapter_bytes=adapter_bytes, **mesh)
    dev = step_mod.DeviceState.abstract(cfg, arena_sizes=plan.arenas.sizes, page_size=PAGE,
                                        max_batch_size=batch, platform="tpu", pack=plat.pack,
                                        kv_dtype=kv_dtype)
    width = -(-ctx // PAGE)
    return {"plan": plan, "dev": dev,
            "params": jax.eval_shape(unstack_layers, abstract_params(cfg)),
            "meta": {r: jax.ShapeDtypeStruct((M.M_TABLE + width, r), jnp.int32)
                     for r in step_mod.row_buckets(batch)},
            "owners": jax.ShapeDtypeStruct((2, 1), jnp.int32),
            "samp": jax.ShapeDtypeStruct((step_mod.S_ALLOW + 1, batch), jnp.int32)}


def program_calls(cfg, a: dict, batch: int, grouped: str | None = None, tp=None,
                  lora_slots: int = 0, lora_rank: int = 16):
    """(name, fields, program, abstract args) of every serving program (`tp`: the engine's
    over a mesh, `sharding.TensorParallel`; `lora_slots`: with that many LoRA adapter
    slots of rank `lora_rank`, docs/lora.md)."""
    import jax
    import numpy as np
    from PIL import Image

    from photon_jax.engine import step as step_mod, stepmeta as M
    from photon_jax.model import lora, pixels as image_mod, platforms

    mesh = {"tp": tp} if tp is not None else {}
    P = step_mod.build_for(cfg, "tpu", ATTENTION, **mesh)
    if grouped is not None:   # another MoE prefill schedule (the comparison of moe.py's)
        P = step_mod.build(cfg, ATTENTION, grouped=grouped,
                           vision_loop=platforms.default_vision_loop("tpu"), **mesh)
    params, dev = a["params"], a["dev"]
    ad = ()   # the LoRA slot tables, the programs' last argument
    if lora_slots:
        ad = (jax.eval_shape(lambda: lora.init_tables(cfg, lora_slots, lora_rank)),)
    for rows, meta in a["meta"].items():
        yield "forward", {"rows": rows}, P.forward, (params, dev.pool, dev.slots[0],
                                                    dev.pending, meta, a["owners"], 1, *ad)
    # A decode burst of 4 steps of every row (Engine(decode_burst=4), docs/host.md).
    four = lambda x: jax.ShapeDtypeStruct((4, *x.shape), x.dtype)  # noqa: E731
    yield "burst4", {"rows": batch}, P.burst[True], (
        params, dev.pool, dev.slots[0], dev.pending, dev.tables, four(a["meta"][batch]),
        four(a["owners"]), a["samp"], 1, *ad)
    # Every variant without logprobs, and the widest one with them.
    for (stochastic, region, lp), prog in P.sample_step.items():
        if lp and not (stochastic and region):
            continue
        yield (f"sample_step{stochastic, region}" + ("_logprobs" if lp else ""),
               {"rows": batch}, prog, (params, dev.slots[0], dev.pending, dev.tables, a["samp"]))
    # The sampler with the output shapes' bitmask (rows held to a JSON schema).
    words = jax.ShapeDtypeStruct((a["samp"].shape[1], (cfg.text.vocab_size + 31) // 32),
                                 np.int32)
    yield ("sample_step_masked", {"rows": batch}, P.sample_step[(True, True, False)],
           (params, dev.slots[0], dev.pending, dev.tables, a["samp"], words))
    # A prompt of 64 tokens after the image prefix, per prefill row bucket.
    prompt = 64
    kv_len = -(-(cfg.prefix_len + prompt) // PAGE) * PAGE
    for rows in step_mod.prefill_row_buckets(batch):
        pre, write, table = M.pack_prefill(
            list(range(1, rows + 1)), [cfg.prefix_len] * rows, [cfg.prefix_len] * rows,
            [prompt] * rows, [list(range(1, kv_len // PAGE + 1))] * rows, rows, prompt,
            kv_len, PAGE)
        ids = np.zeros((rows, prompt), np.int32)
        yield "prefill_slot", {"rows": rows, "prompt": prompt}, P.prefill_slot, (
            params, dev.pool, dev.slots[0], ids, ids, np.zeros((rows, prompt, 2), np.float32),
            pre, write, table, *ad)
    # A later turn's image inside the prompt (the program variant with `images`).
    yield "prefill_slot_images", {"rows": 1}, P.prefill_slot, (
        params, dev.pool, dev.slots[0], *image_block_prefill(cfg, PAGE, ad))
    t = cfg.text
    kv = jax.ShapeDtypeStruct((t.n_layers, cfg.prefix_len, t.n_kv_heads, t.head_dim),
                              cfg.dtype)
    at = np.zeros(cfg.prefix_len, np.int32)
    yield "write_prefix_pages", {}, P.write_prefix_pages, (dev.pool, kv, kv, at, at)
    yield "copy_pages", {}, P.copy_pages, (dev.pool, at[:1], at[:1])
    # The image prefix of a 1200 x 900 photo: crops through the vision encoder to K/V.
    crops = image_mod.make_crops(Image.fromarray(np.zeros((900, 1200, 3), np.uint8)),
                                 cfg.vision)
    src, ph, pw = image_mod.pool_operands(crops.tiling, cfg.vision)
    n = int(crops.crops.shape[0])
    yield "encode_image", {"crops": n}, step_mod.oracle_for(cfg, "tpu").encode_image, (
        params, crops.crops, src, ph, pw)
    yield "image_kv", {"crops": n}, P.image_kv, (params, crops.crops, src, ph, pw, *ad,
                                                 *((np.ones(1, np.int32),) if ad else ()))


def cost_rows(models, batch: int, contexts=(1024, 2048), kv_dtype: str | None = None):
    """The decode step's HBM bytes per chip and the tokens/s they allow: the text weights
    (every layer, the LM head; Moondream 3 at batch 32 selects ~63 of its 64 experts per
    layer, so all are counted) once per step, plus each row's K/V up to its context.  A
    lower bound on time: compute, the sampler and the host are left out.  Over n chips each
    reads 1/n of both (the pool is split by kv heads, the weights by columns or experts;
    the few replicated ones -- norms, embeddings -- are left out).  `fits`: those bytes
    within the chip's HBM."""
    import jax
    import numpy as np

    from photon_jax.engine import memory
    from photon_jax.model.params import abstract_params

    for name in models:
        cfg = CONFIGS[name]().with_dtype("bfloat16")
        p = abstract_params(cfg)
        text = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                   for x in jax.tree.leaves((p["text"], p["region"])))
        per_tok = memory.bytes_per_token(cfg, kv_dtype=kv_dtype)
        for chip, spec in CHIPS.items():
            for n in (1, 4):
                for ctx in contexts:
                    step = (text + batch * ctx * per_tok) / n
                    yield {"kind": "tpu_cost", "model": name, "chip": chip, "chips": n,
                           "kv_dtype": kv_dtype or "bfloat16",
                           "batch": batch, "context": ctx,
                           "weights_GB": round(text / n / 1e9, 2),
                           "kv_GB": round(batch * ctx * per_tok / n / 1e9, 2),
                           "fits": step <= spec["hbm"],
                           "step_ms": round(1e3 * step / spec["bw"], 2),
                           "tok_s": round(batch * spec["bw"] / step)}


def mesh_layout(cfg, devices):
    """(tp, shardings) for a program over `devices` as the engine places it: the mesh
    layout (`sharding.TensorParallel`) and a function of a program's args giving each leaf
    its NamedSharding -- params by `param_shardings`, the device state by
    `DeviceState.shardings`, everything else replicated."""
    import jax
    import numpy as np

    from photon_jax.engine import kvpool, step as step_mod
    from photon_jax.model import platforms, sharding

    tp = sharding.TensorParallel(jax.sharding.Mesh(np.array(devices), (sharding.AXIS,)),
                                 pack=platforms.choose(cfg, "tpu").pack)

    def shardings(args):
        def one(x):
            if isinstance(x, dict) and "text" in x:            # the params
                return tp.param_shardings(x)
            if isinstance(x, step_mod.DeviceState):
                return step_mod.DeviceState.shardings(x, cfg, tp)
            if isinstance(x, kvpool.KVPool):
                return step_mod.DeviceState.shardings(
                    step_mod.DeviceState(x, [], None, None), cfg, tp).pool
            return jax.tree.map(lambda _: tp.replicated, x)
        return tuple(one(x) for x in args)

    return tp, shardings


def moe_rows(topologies, tokens, schedules=("ragged", "megablox")):
    """One Moondream 3 MoE layer (bfloat16, full shapes), compiled per (topology, token
    count, schedule: the grouped ones, and at decode counts gather and dense): kind "tpu_moe", with XLA's cost analysis of the program
    (flops, bytes_accessed; a Pallas kernel counts what its own CostEstimate declares) beside
    the compile fields.  Over several chips the experts are split as the engine splits them
    (`sharding.TensorParallel.experts`)."""
    from functools import partial

    import jax
    import jax.numpy as jnp
    import numpy as np

    from photon_jax.model import moe, sharding
    from photon_jax.model.params import abstract_params
    from photon_jax.model.text import unstack_layers

    cfg = CONFIGS["md3"]().with_dtype("bfloat16")
    m = cfg.text.moe
    p = jax.eval_shape(unstack_layers, abstract_params(cfg))["text"]["moe_blocks"][0]["moe"]
    expert_bytes = (p["fc1"].size + p["fc2"].size) // m.num_experts * 2   # bfloat16
    for topology in topologies:
        chip, devices = devices_of(topology)
        tp = shardings = None
        if len(devices) > 1:
            tp = sharding.TensorParallel(jax.sharding.Mesh(np.array(devices),
                                                           (sharding.AXIS,)))

            def shardings(args, tp=tp):
                split = jax.sharding.NamedSharding(tp.mesh, jax.sharding.PartitionSpec(
                    sharding.AXIS))
                w, x = args
                return ({"router": jax.tree.map(lambda _: tp.replicated, w["router"]),
                         "fc1": split, "fc2": split}, tp.replicated)
        for n in tokens:
            x = jax.ShapeDtypeStruct((n, cfg.text.dim), jnp.bfloat16)
            for how in schedules + (("gather", "dense") if n <= moe.DECODE_TOKENS else ()):
                fn = jax.jit(partial(moe.moe_mlp, k=m.experts_per_token, schedule_=how,
                                     tp=tp))
                row = compile_row(fn, (p, x), devices, chip, shardings, kind="tpu_moe",
                                  topology=topology, tokens=n, schedule=how,
                                  assignments=n * m.experts_per_token)
                if how == "megablox":
                    row.update(megablox_grid(n, m.num_experts, m.experts_per_token,
                                             len(devices), expert_bytes))
                yield row


def megablox_grid(n: int, e: int, k: int, chips: int, expert_bytes: int) -> dict:
    """What megablox's grid reads of the weights on one chip, for a uniform random routing
    of n tokens (seeded): each (row tile, expert) pair it visits copies the expert's whole
    [K, N] weights once (grid (n tiles, visits, k tiles): the weight block changes every
    step), so weight bytes = visits x an expert's bytes (fc1 and fc2 visit the same tiles).
    Visits come from the kernel's own metadata (`make_group_metadata`, empty groups
    skipped); over several chips, chip 0's experts (the others' rows are in no group)."""
    import importlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    from photon_jax.model import moe

    gmm = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    local = e // chips
    counts = np.bincount(ids[ids < local], minlength=local).astype(np.int32)
    tm = moe.megablox_tile_rows(n * k, local)
    rows = -(-n * k // tm) * tm
    # Compiled as one program (op by op, its ~60 small ops compiled one at a time).
    meta = jax.jit(gmm.make_group_metadata,
                   static_argnames=("m", "tm", "num_nonzero_groups", "visit_empty_groups"))
    _, visits = meta(group_sizes=jnp.asarray(counts), m=rows, tm=tm,
                     start_group=jnp.zeros((), jnp.int32), num_nonzero_groups=local,
                     visit_empty_groups=False)
    return {"tile_rows": tm, "experts_used": int((counts > 0).sum()),
            "grid_visits": int(visits), "grid_weight_bytes": int(visits) * expert_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["md2", "md3"],
                    help="configs of bench/common.py, in bfloat16")
    ap.add_argument("--topologies", nargs="+",
                    default=["v5e", "v6e", "v5e:2x2", "v6e:2x2"],
                    help="v5e / v6e: one chip; v5e:2x2 / v6e:2x2: four")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--programs", nargs="+", default=None,
                    help="only these programs (names as printed)")
    ap.add_argument("--rows", nargs="+", type=int, default=None,
                    help="only these row buckets of forward and prefill_slot")
    ap.add_argument("--grouped", default=None, choices=["blocks", "ragged", "megablox"],
                    help="MoE prefill schedule instead of platforms.default_grouped('tpu')")
    ap.add_argument("--kv-dtype", default=None, choices=["int8", "float8_e4m3fn"],
                    help="an 8-bit KV pool (default: bfloat16, the model's dtype)")
    ap.add_argument("--weights", default=None, choices=WEIGHT_CHOICES,
                    help="quantized weights (fp8-experts: Moondream 3.1's published layout)")
    ap.add_argument("--lora-slots", type=int, default=0, metavar="N",
                    help="compile the programs with N LoRA adapter slots (docs/lora.md)")
    ap.add_argument("--lora-rank", type=int, default=16, metavar="R")
    ap.add_argument("--cost-model", action="store_true",
                    help="only the decode byte model (no compiles, no libtpu)")
    ap.add_argument("--lower-only", action="store_true",
                    help="no libtpu: lower the tiny config's programs to StableHLO for TPU")
    ap.add_argument("--moe", nargs="*", type=int, default=None, metavar="TOKENS",
                    help="only one Moondream 3 MoE layer per --topologies, ragged_dot "
                         "against megablox, at these token counts (default 746 and 25408: "
                         "one and 32 image prompts)")
    args = ap.parse_args()
    env = env_info()
    from photon_jax.model import lora

    if args.moe is not None:
        for row in moe_rows(args.topologies, args.moe or [746, 25408]):
            print(json.dumps({**row, **env}), flush=True)
        return
    if args.cost_model:   # arithmetic only: no compile, no libtpu
        for row in cost_rows(args.models, args.batch, kv_dtype=args.kv_dtype):
            print(json.dumps(row), flush=True)
        return
    if args.lower_only:
        runs = [("tiny", None)]
    else:
        runs = [(m, t) for m in args.models for t in args.topologies]
    for name, topology in runs:
        cfg = with_weights(CONFIGS[name]().with_dtype("bfloat16"), args.weights)
        if topology is None:
            chip, devices = "v5e", None
            a = serving_args(cfg, 4, None, kv_cache_tokens=4 * cfg.text.max_context,
                             kv_dtype=args.kv_dtype)
            batch = 4
        else:
            chip, devices = devices_of(topology)
            batch = args.batch
            try:
                tp, shardings = (None, None) if len(devices) == 1 else \
                    mesh_layout(cfg, devices)
                # The slot tables whole on every chip, as the engine's plan counts them.
                tables = (lora.table_bytes(cfg, args.lora_slots, args.lora_rank)
                          if args.lora_slots else 0)
                a = serving_args(cfg, batch, chip, chips=len(devices),
                                 kv_dtype=args.kv_dtype, adapter_bytes=tables)
            except Exception as e:   # the plan refuses (the model does not fit the chip), or
                # this tree has no mesh sharding (photon_jax.model.sharding)
                print(json.dumps({"kind": "tpu_compile", "model": name, "topology": topology,
                                  "program": "setup", "compiled": False,
                                  "error": f"{type(e).__name__}: {str(e)[:400]}", **env}),
                      flush=True)
                continue
        info = {"model": name, "topology": topology or "lowered for TPU", "batch": batch,
                "kv_cache_tokens": a["plan"].kv_cache_tokens,
                "weights": cfg.weights.describe(), "weights_bytes": a["plan"].weights,
                "kv_dtype": args.kv_dtype or "bfloat16"}
        if args.lora_slots:
            info.update(lora_slots=args.lora_slots, lora_rank=args.lora_rank)
        for prog, fields, fn, call_args in program_calls(cfg, a, batch, args.grouped,
                                                         None if topology is None else tp,
                                                         args.lora_slots, args.lora_rank):
            if args.programs and prog not in args.programs:
                continue
            if args.rows and prog in ("forward", "prefill_slot") and \
                    fields["rows"] not in args.rows:
                continue
            row = compile_row(fn, call_args, devices, chip,
                              None if topology is None else shardings,
                              program=prog, **fields, **info)
            if args.grouped:
                row["grouped"] = args.grouped
            print(json.dumps({**row, **env}), flush=True)


if __name__ == "__main__":
    main()
