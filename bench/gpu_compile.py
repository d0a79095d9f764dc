"""The GPU programs compiled for an NVIDIA H200 on a machine without a GPU.

XLA's GPU compiler can compile for a described device instead of an attached one (a
"deviceless" topology made from a GPU target description), and JAX's CUDA plugin ships it,
with Triton and ptxas.  So this runs everything of a GPU compile that needs no device:
Pallas's Triton lowering, Triton's shared-memory and register limits, XLA:GPU's passes and
its scheduler -- what `tests/test_gpu_lowering.py` (lowering only) cannot check.  Nothing
runs: there are no speeds here, only whether each program compiles and what XLA says of it.

One JSON line per compile, kind "gpu_compile":
  what = "kernel"   our decode attention (`gpu_attention`) alone: every split variant at
                    full Moondream 2 and 3 shapes per pool dtype (bf16, f32, e4m3, int8),
                    and pages of 16 to 256 positions (`kernel_rows`)
  what = "program"  a serving program at full Moondream 2 / Moondream 3 shapes with a pool
                    from `memory.plan` for the H200's memory: compile seconds, temporaries,
                    and the conditionals and unknown-trip loops in the optimized HLO (each
                    one a host round trip on a GPU)
  what = "ptxas"    (--ptxas DIR) each compiled kernel's registers and spill bytes, from
                    ptxas -v over the PTX XLA dumped
  ok, error         whether it compiled, and XLA's or Triton's message if not

    pip install "jax[cuda13]==$(python -c 'import jax; print(jax.__version__)')"
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu python bench/gpu_compile.py
    python bench/gpu_compile.py --lower-only --models tiny     # without the plugin (tests)
    python bench/gpu_compile.py --programs burst4 forward      # only these, no kernel rows
    python bench/gpu_compile.py --programs slices              # an image prefix's slices

(The two variables: the plugin's start-up check wants a CUDA driver, and JAX must not try to
run on a GPU it does not have.  Measured numbers: bench/README.md.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import WEIGHT_CHOICES, env_info, image_block_prefill  # noqa: E402

# An H200 SXM as XLA's GPU compiler needs it described (public hardware figures: 132 SMs,
# compute capability 9.0, 228 KiB of shared memory per SM of which 227 KiB per block on
# request, 64 Ki registers per SM, 50 MiB of L2, 4.8 TB/s, 141 GB).
H200_BYTES = 151397597184
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32  threads_per_core_limit: 2048
  shared_memory_per_block: 49152  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
  core_count: 132  fpus_per_core: 128  clock_rate_ghz: 1.98
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000  l2_cache_size: 52428800
  device_memory_size: %d
  cuda_compute_capability { major: 9 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200 (described)"
""" % H200_BYTES


def h200_device():
    from photon_jax.base import compat

    topo = compat.topology_desc(platform="cuda", topology_name="", topology="1x1x1",
                                target_config=H200)
    return topo.devices[0]


def slice_rows(P, params, cfg, device, info):
    """An image prefix's slices (`engine.slicing`, docs/slicing.md) for the 1200 x 900
    photo: the encoder's embedding and one block, the prefix input, one decoder layer's
    halves, two layers, and the last layer's K/V alone."""
    import jax
    import numpy as np
    from PIL import Image

    from photon_jax.engine import slicing
    from photon_jax.model import pixels as image_mod

    crops = image_mod.make_crops(Image.fromarray(np.zeros((900, 1200, 3), np.uint8)),
                                 cfg.vision)
    src, ph, pw = image_mod.pool_operands(crops.tiling, cfg.vision)
    layers, kinds = slicing.text_layers(params, cfg), slicing.text_kinds(cfg)
    x = jax.eval_shape(P.vision_embed, params, crops.crops)
    h, k, v = jax.eval_shape(P.prefix_input, params, x, src, ph, pw)
    first, n = np.int32(1), int(crops.crops.shape[0])
    rows = [("vision_embed", P.vision_embed, (params, crops.crops), {}),
            ("vision_blocks", P.vision_blocks, (params, x, first, 1), {}),
            ("prefix_input", P.prefix_input, (params, x, src, ph, pw), {}),
            ("prefix_attention", P.prefix_attention, (layers[1], h, k, v, first), {}),
            ("prefix_mlp", P.prefix_mlp, (layers[-1], kinds[-1], h, h), {}),
            ("prefix_layers", P.prefix_layers, (layers[1:3], tuple(kinds[1:3]), h, k, v,
                                                first), {}),
            ("prefix_kv", P.prefix_attention, (layers[-1], h, k, v, first),
             {"kv_only": True})]
    for name, fn, args, kw in rows:
        yield compile_row("program", fn, args, device, kwargs=kw, program=name, group="slices",
                          crops=n, **info)


def compile_row(what: str, fn, args, device, kwargs=None, **fields) -> dict:
    """Compile `fn` for `device` at the abstract `args` (and static `kwargs`; device None:
    only lower it for CUDA, which needs no plugin); the row to print."""
    kwargs = kwargs or {}
    import jax

    row = {"kind": "gpu_compile", "what": what, **fields}
    t0 = time.perf_counter()
    if device is None:
        try:
            fn.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
        except Exception as e:
            return {**row, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        return {**row, "ok": True, "lower_only": True,
                "lower_s": round(time.perf_counter() - t0, 1)}
    sharding = jax.sharding.SingleDeviceSharding(device)
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
                          if hasattr(a, "shape") else a, args)
    try:
        compiled = fn.trace(*placed, **kwargs).lower().compile()
    except Exception as e:   # the compiler's verdict is the result
        return {**row, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    return {**row, "ok": True, "compile_s": round(time.perf_counter() - t0, 1),
            "temp_MB": round(getattr(mem, "temp_size_in_bytes", 0) / 1e6, 1),
            "conditionals": text.count(" conditional("),
            "unknown_trip_whiles": sum(1 for ln in text.splitlines() if " while(" in ln
                                       and "known_trip_count" not in ln)}


# Pool dtypes of the kernel rows: (K/V dtype, query dtype).  8-bit pools take the model's
# queries (bfloat16 on GPU).
KERNEL_DTYPES = {"bfloat16": "bfloat16", "float32": "float32",
                 "float8_e4m3fn": "bfloat16", "int8": "bfloat16"}


def kernel_rows(device, kv_dtypes=tuple(KERNEL_DTYPES)):
    """Our decode attention (`gpu_attention.attend`, kernel + combine) alone: every split
    variant at full Moondream 2 and Moondream 3 shapes (batch 32, 32 KV heads of 64, pages
    of 64: tables 32 and 512 pages wide) for each pool dtype; then pages of 16 to 256
    positions (Moondream 2's context) at 1 and 16 splits."""
    import jax
    import jax.numpy as jnp
    from photon_jax.kernels import gpu_attention as ga

    rows, kv_heads, heads, dim = 32, 32, 32, 64
    ints = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731

    def one(kv, page, ctx, splits, **fields):
        width = -(-ctx // page)
        pages = rows * width + 1
        pool = jax.ShapeDtypeStruct((kv_heads, pages, page, dim), jnp.dtype(kv))
        q = jax.ShapeDtypeStruct((rows, heads, dim), jnp.dtype(KERNEL_DTYPES[kv]))
        args = [pool, pool, q, ints(rows, width), ints(rows)]
        if kv in ("int8", "float8_e4m3fn"):
            sc = jax.ShapeDtypeStruct((kv_heads, pages, page), jnp.float32)
            fn = jax.jit(lambda k, v, q, t, n, ks, vs: ga.attend(
                k, v, q, t, n, splits=splits, ks_KPB=ks, vs_KPB=vs))
            args += [sc, sc]
        else:
            fn = jax.jit(lambda k, v, q, t, n: ga.attend(k, v, q, t, n, splits=splits))
        return compile_row("kernel", fn, tuple(args), device, kv_dtype=kv,
                           dtype=KERNEL_DTYPES[kv], page_size=page, table_width=width,
                           splits=splits, per_step=ga.per_step(page), **fields)

    for model, ctx in (("md2", 2048), ("md3", 32768)):
        for kv in kv_dtypes:
            for splits in ga.SPLITS:
                yield one(kv, 64, ctx, splits, model=model)
    for kv in kv_dtypes[:2]:
        for page in (16, 32, 128, 256):
            for splits in (1, 16):
                yield one(kv, page, 2048, splits, model="md2")


def decode_args(cfg, batch: int, page: int, free: int | None, kv_cache_tokens=None,
                adapter_bytes: int = 0) -> dict:
    """Abstract arguments (nothing allocated) of a GPU's decode-step programs for `batch`
    rows at full context: params as a loaded model holds them, the device state with the
    pool `memory.plan` gives (one arena: the kernel's; `adapter_bytes`: LoRA slot tables
    set aside first, as the engine's plan does), a step's metadata, the stand-in page
    owners the kernels take, and the sampling rows.  Also used by
    tests/test_gpu_lowering.py."""
    import jax
    import jax.numpy as jnp

    from photon_jax.engine import memory, step as step_mod, stepmeta as M
    from photon_jax.model.params import abstract_params
    from photon_jax.model.text import unstack_layers

    ctx = cfg.text.max_context
    plan = memory.plan(cfg, platform="gpu", max_batch_size=batch, max_context=ctx,
                       page_size=page, kv_cache_tokens=kv_cache_tokens, free=free, sweep=False,
                       adapter_bytes=adapter_bytes)
    dev = step_mod.DeviceState.abstract(cfg, arena_sizes=plan.arenas.sizes, page_size=page,
                                        max_batch_size=batch, platform="gpu")
    return {"plan": plan, "dev": dev,
            "params": jax.eval_shape(unstack_layers, abstract_params(cfg)),
            "meta": jax.ShapeDtypeStruct((M.M_TABLE + -(-ctx // page), batch), jnp.int32),
            "owners": jax.ShapeDtypeStruct((2, 1), jnp.int32),
            "samp": jax.ShapeDtypeStruct((step_mod.S_ALLOW + 1, batch), jnp.int32)}


def stacked(a, steps: int):
    """`a` for a scan of `steps` steps (the ceiling's per-step metadata)."""
    import jax

    return jax.ShapeDtypeStruct((steps, *a.shape), a.dtype)


def program_rows(device, batch: int, models, weights=None, lora_slots: int = 0,
                 lora_rank: int = 16, programs=None):
    """The serving programs' rows; `programs` (names): only those programs' rows."""
    import jax
    import numpy as np

    from common import CONFIGS, with_weights
    from photon_jax.engine import step as step_mod, stepmeta as M
    from photon_jax.model import lora

    def wanted(what, fn, args, device, **fields):
        if programs is None or fields["program"] in programs:
            yield compile_row(what, fn, args, device, **fields)

    page = 64
    for name in models:
        cfg = with_weights(CONFIGS[name]().with_dtype("bfloat16"), weights)
        # What `memory.device_free` reads on a real H200: JAX's allocator takes 75% of the
        # device by default (XLA_PYTHON_CLIENT_MEM_FRACTION).
        a = decode_args(cfg, batch, page, free=int(0.75 * H200_BYTES),
                        adapter_bytes=lora.table_bytes(cfg, lora_slots, lora_rank)
                        if lora_slots else 0)
        params, dev = a["params"], a["dev"]
        P = step_mod.build_for(cfg, "gpu")
        info = {"model": name, "batch": batch, "kv_cache_tokens": a["plan"].kv_cache_tokens,
                "weights": cfg.weights.describe(), "weights_bytes": a["plan"].weights}
        # LoRA slot tables (docs/lora.md): the programs' last argument, when asked for.
        ad = ()
        if lora_slots:
            tables = jax.eval_shape(lambda: lora.init_tables(cfg, lora_slots, lora_rank))
            ad = (tables,)
            info.update(lora_slots=lora_slots, lora_rank=lora_rank,
                        lora_bytes=lora.table_bytes(cfg, lora_slots, lora_rank))
            one = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape[1:], np.float32), tables)
            yield from wanted("program", P.write_adapter,
                              (tables, jax.ShapeDtypeStruct((), np.int32), one), device,
                              program="write_adapter", **info)
        yield from wanted("program", P.forward, (params, dev.pool, dev.slots[0], dev.pending,
                                                 a["meta"], a["owners"], 1, *ad), device,
                          program="forward", **info)
        # The most splits, in the whole step (a batch this size plans 1; small ones more).
        yield from wanted("program", P.forward, (params, dev.pool, dev.slots[0], dev.pending,
                                                 a["meta"], a["owners"], 16, *ad), device,
                          program="forward_s16", **info)
        # Every variant without logprobs, and the widest one with them.
        for (stochastic, region, lp), prog in P.sample_step.items():
            if lp and not (stochastic and region):
                continue
            yield from wanted("program", prog, (params, dev.slots[0], dev.pending,
                                                dev.tables, a["samp"]), device,
                              program=f"sample_step{stochastic, region}"
                              + ("_logprobs" if lp else ""), **info)
        # The sampler with the output shapes' bitmask (rows held to a JSON schema).
        words = jax.ShapeDtypeStruct((a["samp"].shape[1], (cfg.text.vocab_size + 31) // 32),
                                 np.int32)
        yield from wanted("program", P.sample_step[(True, True, False)],
                          (params, dev.slots[0], dev.pending, dev.tables, a["samp"], words),
                          device, program="sample_step_masked", **info)
        yield from wanted("program", P.ceiling, (params, dev.pool, dev.slots[0], dev.pending,
                                                 dev.tables, stacked(a["meta"], 4),
                                                 stacked(a["owners"], 4), a["samp"], 1, *ad),
                          device, program="ceiling", **info)
        # A decode burst of 4 steps (Engine(decode_burst=4), docs/host.md), sampled rows.
        yield from wanted("program", P.burst[True], (params, dev.pool, dev.slots[0],
                                                     dev.pending, dev.tables,
                                                     stacked(a["meta"], 4),
                                                     stacked(a["owners"], 4), a["samp"], 1,
                                                     *ad),
                          device, program="burst4", **info)
        # A prompt of 64 tokens after the image prefix, for 8 rows at once (the slot's rows
        # at most).
        rows, prompt = min(8, batch), 64
        kv_len = -(-(cfg.prefix_len + prompt) // page) * page
        pre, write, table = M.pack_prefill(
            list(range(1, rows + 1)), [cfg.prefix_len] * rows, [cfg.prefix_len] * rows,
            [prompt] * rows, [list(range(1, kv_len // page + 1))] * rows, rows, prompt,
            kv_len, page)
        ids = np.zeros((rows, prompt), np.int32)
        yield from wanted("program", P.prefill_slot,
                          (params, dev.pool, dev.slots[0], ids, ids,
                           np.zeros((rows, prompt, 2), np.float32), pre, write, table, *ad),
                          device, program="prefill_slot", rows=rows, **info)
        # A later turn's image inside the prompt: one row, an image block (Z positions)
        # and 64 text tokens after the prefix; the program variant with `images`.
        yield from wanted("program", P.prefill_slot,
                          (params, dev.pool, dev.slots[0], *image_block_prefill(cfg, page, ad)),
                          device, program="prefill_slot_images", rows=1, **info)
        # An image prefix into pool pages (a cache miss), and a hit's partial-page copy.
        t = cfg.text
        kv = jax.ShapeDtypeStruct((t.n_layers, cfg.prefix_len, t.n_kv_heads, t.head_dim),
                                  cfg.dtype)
        at = np.zeros(cfg.prefix_len, np.int32)
        yield from wanted("program", P.write_prefix_pages, (dev.pool, kv, kv, at, at), device,
                          program="write_prefix_pages", **info)
        yield from wanted("program", P.copy_pages, (dev.pool, at[:1], at[:1]), device,
                          program="copy_pages", **info)
        if programs is None or "image_kv" in programs:
            yield from image_rows(P, params, cfg, device, info,
                                  ad + ((np.ones(1, np.int32),) if ad else ()))
        if programs is None or "slices" in programs:
            yield from slice_rows(P, params, cfg, device, info)


def image_rows(P, params, cfg, device, info, adapter=()):
    """The image prefix of a 1200 x 900 photo: its crops through the vision encoder to the
    prefix K/V."""
    import numpy as np
    from PIL import Image

    from photon_jax.model import pixels as image_mod

    rgb = Image.fromarray(np.zeros((900, 1200, 3), np.uint8))
    crops = image_mod.make_crops(rgb, cfg.vision)
    src, ph, pw = image_mod.pool_operands(crops.tiling, cfg.vision)
    yield compile_row("program", P.image_kv, (params, crops.crops, src, ph, pw, *adapter),
                      device, program="image_kv", crops=int(crops.crops.shape[0]), **info)


def ptxas_rows(dump: str):
    """Registers and spills of every compiled `gpu_attention` kernel: ptxas -v (the CUDA
    plugin's) over the PTX XLA dumped, for the H200's sm_90a."""
    import glob
    import re
    import subprocess

    import jax_cuda13_plugin   # noqa: F401  (where the plugin's ptxas lives)
    ptxas = glob.glob(os.path.join(os.path.dirname(os.path.dirname(
        jax_cuda13_plugin.__file__)), "nvidia", "cu*", "bin", "ptxas"))
    seen = set()
    for path in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
        text = open(path).read()
        names = re.findall(r"\.entry (photon_decode_attention\w*)", text)
        if not names or not ptxas or names[0] in seen:
            continue
        seen.add(names[0])
        out = subprocess.run([ptxas[0], "-v", "-arch=sm_90a", path, "-o", os.devnull],
                             capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", out)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
        yield {"kind": "gpu_compile", "what": "ptxas", "kernel": names[0],
               "registers": int(regs.group(1)) if regs else None,
               "spill_store_bytes": int(spill.group(1)) if spill else None,
               "spill_load_bytes": int(spill.group(2)) if spill else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kernel-only", action="store_true")
    ap.add_argument("--kv-dtype", nargs="+", default=list(KERNEL_DTYPES),
                    choices=list(KERNEL_DTYPES), help="pool dtypes of the kernel rows")
    ap.add_argument("--models", nargs="+", default=["md2", "md3"],
                    help="configs of bench/common.py (bfloat16)")
    ap.add_argument("--lower-only", action="store_true",
                    help="lower for CUDA instead of compiling (no plugin needed: the tests)")
    ap.add_argument("--weights", default=None, choices=WEIGHT_CHOICES,
                    help="quantized weights (fp8-experts: Moondream 3.1's published layout)")
    ap.add_argument("--lora-slots", type=int, default=0, metavar="N",
                    help="compile the programs with N LoRA adapter slots (docs/lora.md)")
    ap.add_argument("--lora-rank", type=int, default=16, metavar="R",
                    help="with --lora-slots: the slots' rank")
    ap.add_argument("--programs", nargs="+", metavar="NAME",
                    help="only these programs' rows (their `program` names, e.g. burst4), "
                         "no kernel rows")
    ap.add_argument("--ptxas", metavar="DIR",
                    help="dump XLA's PTX to DIR and report each kernel's registers and "
                         "spills (ptxas -v)")
    args = ap.parse_args()
    if args.ptxas:   # (before JAX starts its backends)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_dump_to={args.ptxas}").strip()
    device = None if args.lower_only else h200_device()
    env = {**env_info(), "target": "lowered for CUDA" if device is None else "H200, deviceless"}
    for row in () if args.programs else kernel_rows(device, tuple(args.kv_dtype)):
        print(json.dumps({**row, **env}), flush=True)
    if not args.kernel_only:
        seen = set()
        for row in program_rows(device, args.batch, args.models, args.weights,
                                args.lora_slots, args.lora_rank, args.programs):
            seen.update((row["program"], row.get("group")))
            print(json.dumps({**row, **env}), flush=True)
        if args.programs and set(args.programs) - seen:
            sys.exit(f"no program named {sorted(set(args.programs) - seen)}")
    if args.ptxas and device is not None:
        for row in ptxas_rows(args.ptxas):
            print(json.dumps({**row, **env}), flush=True)


if __name__ == "__main__":
    main()
