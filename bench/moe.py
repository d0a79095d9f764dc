"""Moondream 3's mixture-of-experts MLP: every schedule, per token count, in ms and bytes.

One layer of the small Moondream 3 config (`common.small_md3_config`: width 512, 32
experts, top-4, expert width 256) on this machine, at decode token counts (the rows of one
step: 1, 8, 32) and a prefill one (746 = image prefix + a 16-token prompt), for:

  dense    every expert for every token, then the top-k mix: reads each expert once
  gather   the distinct selected experts gathered, applied to every token
  blocks   assignments sorted by expert, a loop over a static number of one-expert blocks
  ragged   the same sort, `jax.lax.ragged_dot` as the grouped matmul (TPU's; XLA:CPU and
           XLA:GPU expand it into a masked product over every expert)
  chosen   what `moe.moe_mlp` runs for that token count on CPU (`moe.schedule`)

Then, compiled only (abstract shapes, nothing allocated: XLA's cost analysis needs no
values), one layer at the full Moondream 3 shapes (width 2048, 64 experts, top-8, expert
width 1024) in float32 (what a CPU computes in) and bfloat16 (the checkpoint's dtype), for
the decode schedules at 1, 8 and 32 tokens: "kind": "moe_full", with ms null and the
selected weights taken at the expected number of distinct experts under uniform routing,
E (1 - (1 - k/E)^N).

Keys: ms (median of --reps jitted calls after a warm-up), bytes_accessed (XLA's cost analysis
of the compiled call; the block loop is compiled unrolled for it, since the analysis counts a
loop body once), selected_weight_bytes (the weights of the distinct experts this input
selects, plus the router), bytes_over_selected, max_abs_diff (against dense).

    python bench/moe.py [--reps 7] [--tokens 1 8 32 746] [--no-full]
    python bench/moe.py --layer md3 --tokens 1 2 746 2048 --no-full    # on a GPU (gpu_run.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_info, small_md3_config  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 746])
    ap.add_argument("--no-full", action="store_true",
                    help="skip the full-shape (compile-only) rows")
    ap.add_argument("--layer", choices=["small", "md3"], default="small",
                    help="md3: one full-size Moondream 3 layer (random weights, bfloat16 "
                         "off CPU), timed: the GPU run's comparison of the prefill schedules")
    args = ap.parse_args(argv)
    from functools import partial

    import jax
    import numpy as np

    from photon_jax.model import moe, platforms

    platform = jax.default_backend()
    if args.layer == "md3":
        from photon_jax.model import config

        cfg = config.moondream3("float32" if platform == "cpu" else "bfloat16")
    else:
        cfg = small_md3_config()
    # The one layer only (drawing the small model's every weight took 4 of the smoke run's
    # 8 s on 2 cores).
    p = layer_weights(cfg)
    k, e = cfg.text.moe.experts_per_token, cfg.text.moe.num_experts
    expert_bytes = (p["fc1"][0].nbytes + p["fc2"][0].nbytes)
    router_bytes = sum(x.nbytes for x in jax.tree.leaves(p["router"]))
    for n in args.tokens:
        x = jax.random.normal(jax.random.PRNGKey(n), (n, cfg.text.dim)).astype(p["fc1"].dtype)
        ids, _ = moe.route(p, x, k)
        distinct = len(np.unique(np.asarray(ids)))
        selected = distinct * expert_bytes + router_bytes
        ref = np.asarray(jax.jit(partial(moe.dense_reference, k=k))(p, x).astype("float32"))
        chosen = moe.schedule(n, e, k, platforms.default_grouped(platform))
        for name in ("dense", "gather", "blocks", "ragged", "chosen"):
            if args.layer == "md3" and name == "gather" and n > moe.DECODE_TOKENS:
                continue   # (a copy of the whole stack: not a prefill schedule)
            how = chosen if name == "chosen" else name
            fn = jax.jit(partial(moe.moe_mlp, k=k, schedule_=how))
            out = np.asarray(fn(p, x).astype("float32"))
            ts = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(p, x))
                ts.append(time.perf_counter() - t0)
            if how == "blocks":   # unrolled, so that the cost analysis sees every block
                costed = None if args.layer == "md3" else jax.jit(   # (hundreds of blocks)
                    lambda p, x: moe.moe_mlp(p, x, k, schedule_="blocks", unroll=True))
            else:
                costed = fn
            ca = None if costed is None else costed.lower(p, x).compile().cost_analysis()
            ca = (ca[0] if isinstance(ca, list) else ca) or {}   # (None on some backends)
            b = ca.get("bytes accessed")
            print(json.dumps({
                "kind": "moe", "layer": args.layer, "platform": platform, "schedule": name,
                "runs": how, "tokens": n, "experts": e, "top_k": k, "distinct_experts": distinct,
                "ms": round(1e3 * float(np.median(ts)), 3),
                "bytes_accessed": None if b is None else int(b),
                "selected_weight_bytes": int(selected),
                "bytes_over_selected": None if b is None else round(b / selected, 3),
                "max_abs_diff": float(np.abs(out - ref).max()), **env_info()}), flush=True)
    if not args.no_full:
        full_rows(moe)
    return 0


def layer_weights(cfg):
    """One MoE layer of `cfg` (Moondream 3's full size: 0.8 GB in bfloat16), random weights
    in the config's dtype, made on the device, scaled like a trained layer's activations."""
    import jax
    import numpy as np

    t, m = cfg.text, cfg.text.moe
    dt = cfg.dtype
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    return {"router": {"w": (jax.random.normal(k1, (t.dim, m.num_experts)) /
                             np.sqrt(t.dim)).astype(dt),
                       "b": (0.05 * jax.random.normal(k2, (m.num_experts,))).astype(dt)},
            "fc1": (jax.random.normal(k3, (m.num_experts, t.dim, 2 * m.expert_inner_dim), dt)
                    / np.sqrt(t.dim)).astype(dt),
            "fc2": (jax.random.normal(k4, (m.num_experts, m.expert_inner_dim, t.dim), dt)
                    / np.sqrt(m.expert_inner_dim)).astype(dt)}


def full_rows(moe) -> None:
    """Bytes accessed per layer at the full Moondream 3 shapes, compiled from abstract shapes."""
    from functools import partial

    import jax

    from photon_jax.model import config
    from photon_jax.model.params import init_params
    from photon_jax.model.text import unstack_layers

    for dtype in ("float32", "bfloat16"):
        cfg = config.moondream3(dtype)
        k, e = cfg.text.moe.experts_per_token, cfg.text.moe.num_experts
        shapes = jax.eval_shape(lambda: unstack_layers(init_params(jax.random.PRNGKey(0), cfg)))
        p = shapes["text"]["moe_blocks"][0]["moe"]
        size = p["fc1"].dtype.itemsize
        expert_bytes = (p["fc1"].shape[1] * p["fc1"].shape[2]
                        + p["fc2"].shape[1] * p["fc2"].shape[2]) * size
        router_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(p["router"]))
        for n in (1, 8, 32):
            x = jax.ShapeDtypeStruct((n, cfg.text.dim), p["fc1"].dtype)
            distinct = e * (1 - (1 - k / e) ** n)
            selected = distinct * expert_bytes + router_bytes
            for name in ("dense", "gather", "chosen"):
                how = moe.schedule(n, e, k, "blocks") if name == "chosen" else name
                fn = jax.jit(partial(moe.moe_mlp, k=k, schedule_=how))
                ca = fn.lower(p, x).compile().cost_analysis()
                b = (ca[0] if isinstance(ca, list) else ca)["bytes accessed"]
                print(json.dumps({
                    "kind": "moe_full", "dtype": dtype, "schedule": name, "runs": how,
                    "tokens": n, "experts": e, "top_k": k,
                    "expected_distinct_experts": round(distinct, 2), "ms": None,
                    "bytes_accessed": int(b), "selected_weight_bytes": int(selected),
                    "bytes_over_selected": round(b / selected, 3), **env_info()}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
