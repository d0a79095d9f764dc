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


def measure(name: str, steps: int, dtype=None, formats=FORMATS) -> dict:
    import gc

    from photon_jax.engine import reference

    ref_model = common.build_model(name, dtype=dtype)
    enc = reference.encode_image(ref_model, kv8.IMAGE)
    prompt = ref_model.prompts.caption("normal")
    ref, fed = kv8.teacher_force(ref_model, None, prompt, enc, greedy_steps=steps)
    out = {"config": name, "dtype": ref_model.cfg.dtype, "attention": ref_model.attention,
           "prompt_tokens": len(prompt), "decode_steps": steps}
    del ref_model
    gc.collect()
    for fmt in formats:
        model = common.build_model(name, dtype=dtype, weights=fmt)
        got, _ = kv8.teacher_force(model, None, fed, reference.encode_image(model, kv8.IMAGE))
        out[fmt] = kv8.fidelity(ref[len(prompt):], got[len(prompt):])
        out[fmt]["weights"] = model.cfg.weights.describe()
        del model
        gc.collect()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="small_v27", choices=sorted(common.CONFIGS))
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="the model's compute dtype (default: the config's)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = measure(args.config, args.steps, args.dtype, args.formats)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res.update(common.env_info())
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
