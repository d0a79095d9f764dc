"""Fidelity of the 8-bit KV cache, measured: teacher-force one token sequence through the
engine's own decode program over an unquantized pool and over 8-bit pools, and compare each
step's logits.

The sequence: an image prefix (a fixture image through the model's vision tower, written
into the pool by `write_prefix_pages`: quantized there, as the engine does), then a prompt
and the model's own greedy continuation with the unquantized cache, fed one position per
step (`step.forward`, the engine's decode program, batch 1).  Each 8-bit run feeds the same
tokens, so its logits differ only by the cache.  Reported per format: top-1 agreement over
the steps and max |logit error| / (max - min of the reference logits at that step).

    python bench/kv8.py --config small_v27 --steps 48
    python bench/kv8.py --config md2 --dtype float32 --steps 24     # full size, ~10 GB of RAM

`teacher_force` and `fidelity` are also what tests/test_kv8.py bounds on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

IMAGE = os.path.join(common.ROOT, "tests", "fixtures", "moondream2-tiny", "img_land800x600.png")


def teacher_force(model, kv_dtype, tokens, enc=None, greedy_steps: int = 0, page_size: int = 64,
                  corrupt=None):
    """Logits [N, V] (float32 numpy) of feeding `tokens` one per step after the image prefix
    `enc` (an `ImagePrefix`; None: the fixture image), then `greedy_steps` more steps each
    feeding the previous step's argmax; and the tokens fed.  `kv_dtype`: the pool's format.
    `corrupt(pool) -> pool`: applied after the prefix is written (tests: a broken scale)."""
    import jax.numpy as jnp
    import numpy as np

    from photon_jax.engine import reference, step as step_mod, stepmeta as M
    from photon_jax.engine.pages import pages_for

    cfg, prog = model.cfg, step_mod.programs_of(model)
    enc = enc if enc is not None else reference.encode_image(model, IMAGE)
    n_pre = cfg.prefix_len
    total = n_pre + len(tokens) + greedy_steps
    table = list(range(1, 1 + pages_for(total, page_size)))
    arenas = M.Arenas((len(table) + 1,))
    m = len(table)
    state = step_mod.DeviceState.init(cfg, arena_sizes=arenas.sizes, page_size=page_size,
                                      max_batch_size=1, device=model.device, kv_dtype=kv_dtype)
    pos = np.arange(n_pre)
    pool = prog.write_prefix_pages(state.pool, enc.k, enc.v,
                                   jnp.asarray(np.asarray(table)[pos // page_size], jnp.int32),
                                   jnp.asarray(pos % page_size, jnp.int32))
    if corrupt is not None:
        pool = corrupt(pool)
    slot = state.slots[0]
    owners = model.platform.sweeps
    fed, out = list(tokens), []
    i = 0
    while i < len(fed) or len(out) < len(tokens) + greedy_steps:
        if i >= len(fed):
            fed.append(int(out[-1].argmax()))
        meta, pages, _ = M.pack_decode([1], [n_pre + i], [table], 1, m, page_size, arenas,
                                       owners=owners)
        pending = step_mod.Pending(jnp.zeros(2, jnp.int32),
                                   jnp.asarray([0, fed[i]], jnp.int32), jnp.zeros((2, 2)))
        pool, slot = prog.forward(model.params, pool, slot, pending, jnp.asarray(meta),
                                  jnp.asarray(pages))
        out.append(np.asarray(slot.logits[0]))
        i += 1
    return np.stack(out), fed


def fidelity(ref, got) -> dict:
    """Top-1 agreement and the worst |logit error| relative to the reference step's logit
    range, over the steps (logits [N, V] each)."""
    import numpy as np

    rng = ref.max(-1) - ref.min(-1)
    rel = np.abs(got - ref).max(-1) / rng
    return {"steps": int(ref.shape[0]),
            "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
            "max_rel_logit_error": float(rel.max()),
            "mean_rel_logit_error": float(rel.mean()),
            "max_abs_logit_error": float(np.abs(got - ref).max()),
            "mean_logit_range": float(rng.mean())}


def measure(model, steps: int, prompt=None, formats=("int8", "float8_e4m3fn")) -> dict:
    """The reference run (greedy continuation of `prompt`, unquantized), then each format
    teacher-forced on its tokens."""
    from photon_jax.engine import reference

    enc = reference.encode_image(model, IMAGE)
    prompt = prompt or model.prompts.caption("normal")
    ref, fed = teacher_force(model, None, prompt, enc, greedy_steps=steps)
    out = {"config": model.cfg.text.n_layers, "attention": model.attention,
           "prompt_tokens": len(prompt), "decode_steps": steps}
    for fmt in formats:
        got, _ = teacher_force(model, fmt, fed, enc)
        out[fmt] = fidelity(ref[len(prompt):], got[len(prompt):])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="small_v27", choices=sorted(common.CONFIGS))
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--attention", default=None, help="decode attention (default: the backend's)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="the model's compute dtype (default: the config's; float32 for the "
                         "full-size configs on a CPU, which has no fast bfloat16 products)")
    args = ap.parse_args()
    model = common.build_model(args.config, dtype=args.dtype)
    if args.attention:
        from photon_jax.model import Model
        model = Model(model.cfg, model.params, model.prompts.tok, attention=args.attention)
    t0 = time.perf_counter()
    res = measure(model, args.steps)
    res["config"], res["dtype"] = args.config, model.cfg.dtype
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
