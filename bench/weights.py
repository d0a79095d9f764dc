"""Fidelity of quantized weights, measured: teacher-force one token sequence through the
engine's own decode program with the float weights and with each quantized format, and
compare each step's logits.

The sequence is `kv8.py`'s: an image prefix (the fixture image through the vision tower),
then a prompt and the float model's own greedy continuation, fed one position per step
(`step.forward`, the engine's decode program, batch 1).  Each quantized model is the same
random weights quantized (`bench/common.build_model(weights=)`, `model.quant`), fed the same
tokens, so its logits differ only by its weights.  Its image prefix is its own (the vision
tower is never quantized, but the prefix's text layers are).  Reported per format: top-1
agreement over the steps and max |logit error| / (max - min of the reference logits at that
step), as for the 8-bit KV cache.

    python bench/weights.py --config small_v27 --steps 48
    python bench/weights.py --config small_md3 --steps 48
    python bench/weights.py --config md2 --dtype float32 --steps 24   # full size, ~14 GB RAM
    python bench/weights.py --config small small_v27 --formats int8 --seeds 0 1 2 3 4 5 6 7

One draw of random weights is one sample: their logits are nearly tied (small_v27's top-1
leads the runner-up by a median 0.5% of the logit range), so whether 45 or 48 of 48 steps
agree depends on the draw.  `--seeds` measures several draws (a JSON line each) and ends
with a "summary" line: per config and format, the agreeing steps of all draws together and
of the worst draw.

tests/test_quantized.py bounds the same figures on the tiny models.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import kv8  # noqa: E402

FORMATS = ("int8", "fp8", "int4")


def measure(name: str, steps: int, dtype=None, formats=FORMATS, seed: int = 0) -> dict:
    import gc

    from photon_jax.engine import reference

    ref_model = common.build_model(name, dtype=dtype, seed=seed)
    enc = reference.encode_image(ref_model, kv8.IMAGE)
    prompt = ref_model.prompts.caption("normal")
    ref, fed = kv8.teacher_force(ref_model, None, prompt, enc, greedy_steps=steps)
    out = {"config": name, "seed": seed, "dtype": ref_model.cfg.dtype,
           "attention": ref_model.attention,
           "prompt_tokens": len(prompt), "decode_steps": steps}
    del ref_model
    gc.collect()
    for fmt in formats:
        model = common.build_model(name, dtype=dtype, weights=fmt, seed=seed)
        got, _ = kv8.teacher_force(model, None, fed, reference.encode_image(model, kv8.IMAGE))
        out[fmt] = kv8.fidelity(ref[len(prompt):], got[len(prompt):])
        out[fmt]["weights"] = model.cfg.weights.describe()
        del model
        gc.collect()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", nargs="+", default=["small_v27"], choices=sorted(common.CONFIGS))
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0],
                    help="draws of the random weights, each measured (a line each)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="the model's compute dtype (default: the config's)")
    args = ap.parse_args(argv)
    rows = []
    for config in args.config:
        for seed in args.seeds:
            t0 = time.perf_counter()
            res = measure(config, args.steps, args.dtype, args.formats, seed)
            res["seconds"] = round(time.perf_counter() - t0, 1)
            res.update(common.env_info())
            rows.append(res)
            print(json.dumps(res, indent=None if len(args.seeds) > 1 else 1), flush=True)
    if len(args.seeds) > 1:
        print(json.dumps(summary(rows)), flush=True)
    return 0


def summary(rows) -> dict:
    """Per config and format: steps agreeing over all draws, and the worst draw's."""
    out = {"kind": "summary", "seeds": sorted({r["seed"] for r in rows})}
    for r in rows:
        for fmt in FORMATS:
            if fmt not in r:
                continue
            n = r[fmt]["steps"]
            agree = round(r[fmt]["top1_agreement"] * n)
            s = out.setdefault(f'{r["config"]}/{fmt}',
                               {"agree": 0, "steps": 0, "worst": n, "per_seed": []})
            s["agree"] += agree
            s["steps"] += n
            s["worst"] = min(s["worst"], agree)
            s["per_seed"].append(agree)
    return out


if __name__ == "__main__":
    sys.exit(main())
