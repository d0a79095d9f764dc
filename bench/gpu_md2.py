"""The Photon question on a GPU at the real Moondream 2 shapes, in one short run: decode
tokens/s of the blocking engine, the pipelined engine and the device-only ceiling, the bytes
a decode step moves, and how close it comes to the memory-bandwidth floor.  Random bf16
weights; greedy; decode from about position --position (an image prefix and a prompt
before it).  Sized for about 8 minutes on one H200, compilation included (the persistent
compilation cache is on: a second run compiles nothing).

One JSON line per (model, batch), kind "gpu":
  blocking_tok_s, pipelined_tok_s, ceiling_tok_s   the three loops (`common.measure`)
  bytes_accessed        XLA's cost analysis of the compiled decode forward (a Pallas kernel
                        is a custom call: the analysis charges its operands whole, i.e. the
                        pool's K/V arrays, so on GPU this overstates)
  floor_bytes           weights read once + every row's attended KV + the logits written
  achieved_GBps         floor_bytes / the ceiling's step time: the bandwidth the step would
                        have used if it moved exactly the floor
  floor_ratio_4.8, floor_ratio_4.3   the ceiling's step time over the floor's time at 4.8
                        TB/s (H200's datasheet) and 4.3 TB/s (measured copy bandwidth)
  bubble_blocking, bubble_pipelined   1 - loop tok/s / ceiling tok/s: the share of each
                        loop's step in which the device waits for the host
--ceiling-only skips the engine loops; --md3-only / --no-md3 pick the rows; --md3-loops runs
the engine loops for Moondream 3 too; --kv-dtype int8 / float8_e4m3fn stores K/V in 8 bits.  The pool is sized to what the run needs.  --trace DIR writes a 5-step `jax.profiler` trace of
the ceiling under DIR.  The Moondream 3 row (random weights at full shape, ceiling only)
uses fewer layers if the full model does not fit the device, and says how many.

    python bench/gpu_md2.py --trace /tmp/trace            # on a GPU
    python bench/gpu_md2.py --config small --steps 4      # CPU smoke (tested in CI)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (CONFIGS, build_model, ceiling_run, decode_cost, env_info,  # noqa: E402
                    kv_dtype_of, measure)

MD3_FOR = {"md2": "md3", "small": "small_md3", "tiny": "tiny_md3"}


def floor_fields(cost: dict, step_ms: float, bandwidths) -> dict:
    out = {"achieved_GBps": round(cost["floor_bytes"] / (step_ms / 1e3) / 1e9, 1)}
    for bw in bandwidths:
        floor_ms = cost["floor_bytes"] / bw * 1e3
        out[f"floor_ms_{bw / 1e12:g}"] = round(floor_ms, 3)
        out[f"floor_ratio_{bw / 1e12:g}"] = round(step_ms / floor_ms, 3)
    return out


def md3_layers_that_fit(cfg) -> tuple[int, bool]:
    """(layers, full): the most text layers of Moondream 3 whose weights and a small pool fit
    the default device's free memory."""
    import jax

    from photon_jax.engine import memory

    free = memory.device_free(jax.devices()[0])
    full = cfg.text.n_layers
    if free is None:
        return full, True
    per_layer = memory.weight_bytes(cfg) / full
    fits = int((0.8 * free) // per_layer)
    return (full, True) if fits >= full else (max(cfg.text.moe.start_layer + 1, fits), False)


def trace(model, batch: int, folder: str, prompt_tokens: int) -> str:
    import jax

    os.makedirs(folder, exist_ok=True)
    with jax.profiler.trace(folder):
        ceiling_run(model, batch, 5, warm=True, prompt_tokens=prompt_tokens)
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default="md2", choices=["md2", "small", "tiny"])
    ap.add_argument("--batch", type=int, nargs="+", default=[32])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--position", type=int, default=1000,
                    help="first decode position (image prefix + prompt before it)")
    ap.add_argument("--ceiling-only", action="store_true")
    ap.add_argument("--no-md3", action="store_true", help="skip the Moondream 3 row")
    ap.add_argument("--md3-only", action="store_true", help="only the Moondream 3 row")
    ap.add_argument("--kv-dtype", default=None, choices=["int8", "float8_e4m3fn"],
                    help="an 8-bit KV pool (default: the model's dtype)")
    ap.add_argument("--weights", default=None, choices=["int8", "fp8", "int4"],
                    help="the random weights quantized (`model.quant`; default: bfloat16)")
    ap.add_argument("--burst", type=int, nargs="*", default=[],
                    help="also time the pipelined engine with these decode_burst values "
                         "(a 'burstK' entry each, bursts at any batch: docs/host.md)")
    ap.add_argument("--md3-loops", action="store_true",
                    help="the engine loops for Moondream 3 too (default: its ceiling only)")
    ap.add_argument("--trace", metavar="DIR", help="write a 5-step profiler trace here")
    ap.add_argument("--bandwidth", type=float, nargs="+", default=[4.8e12, 4.3e12],
                    help="bytes/s for the floor")
    args = ap.parse_args(argv)
    import jax

    from photon_jax.engine import compile_cache

    cache = compile_cache.enable()
    print(f"device: {jax.devices()[0]}; compilation cache: {cache}", file=sys.stderr)
    t_start = time.perf_counter()
    rows = [] if args.md3_only else [(args.config, None)]
    if not args.no_md3:
        rows.append((MD3_FOR[args.config], None if args.md3_loops else "ceiling"))
    for config, only in rows:
        cfg = CONFIGS[config]()
        note = {}
        if cfg.text.moe is not None:
            layers, full = md3_layers_that_fit(cfg)
            if not full:
                from dataclasses import replace
                cfg = replace(cfg, text=replace(cfg.text, n_layers=layers))
                note = {"note": f"{layers} of {CONFIGS[config]().text.n_layers} layers: the "
                                "full model does not fit this device"}
            CONFIGS[config + "_fit"] = lambda cfg=cfg: cfg
            config = config + "_fit"
        model = build_model(config, kv_dtype=args.kv_dtype, weights=args.weights)
        prompt = max(1, args.position - model.cfg.prefix_len)
        for batch in args.batch:
            t0 = time.perf_counter()
            if args.ceiling_only or only == "ceiling":
                ceiling_run(model, batch, args.steps, prompt_tokens=prompt)   # compiles
                tok_s = ceiling_run(model, batch, args.steps, warm=True, prompt_tokens=prompt)
                row = {"ceiling_tok_s": round(tok_s, 1), "device_ms": round(1e3 * batch / tok_s,
                                                                            3)}
            else:
                row = measure(model, config, batch, args.steps, "gpu", args.reps,
                              prompt_tokens=prompt,
                              bursts=tuple(k for k in args.burst if k > 1))
            cost = decode_cost(model.cfg, batch, model.cfg.prefix_len + prompt + args.steps // 2,
                               platform_=jax.devices()[0].platform, attention=model.attention,
                               kv_dtype=kv_dtype_of(model))
            row.update({k: cost[k] for k in ("bytes_accessed", "floor_bytes", "weights_bytes",
                                             "attended_kv_bytes")})
            row.update(floor_fields(cost, row["device_ms"], args.bandwidth))
            if "pipelined_tok_s" in row:
                # The bubble: the share of a loop's step in which the device has nothing to
                # do, against the device-only ceiling of the same step.
                for loop in ("blocking", "pipelined"):
                    row[f"bubble_{loop}"] = round(1 - row[f"{loop}_tok_s"] /
                                                  row["ceiling_tok_s"], 3)
            if args.trace and only is None:
                row["trace"] = trace(model, batch, os.path.join(args.trace, f"b{batch}"),
                                     prompt)
            print(json.dumps({**row, "kind": "gpu", "config": config.removesuffix("_fit"),
                              "batch": batch, "first_position": model.cfg.prefix_len + prompt,
                              "kv_dtype": kv_dtype_of(model) or model.cfg.dtype,
                              "weights": model.cfg.weights.describe(), **note, "seconds": round(time.perf_counter() - t0, 1),
                              "total_seconds": round(time.perf_counter() - t_start, 1),
                              **env_info()}), flush=True)
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
