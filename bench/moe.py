"""What does computing only the selected experts buy?  One JSON line per (schedule, tokens).

The MoE MLP of one layer of the small Moondream 3 config (`pipeline.py --config small_md3`:
width 512, 32 experts, top-4, expert width 256), on CPU, at decode token counts (rows of one
step: 1, 8, 32) and prefill ones (a 16-token prompt; 746 = image prefix + prompt), for:
  selected  photon_jax.moe.moe_mlp (sorted blocks, a loop over the blocks used)
  dense     moe.dense_reference (every expert for every token, then the top-k mix)
  ragged    the same sort, with jax.lax.ragged_dot as the grouped matmul (on CPU, jax 0.10
            lowers it to a masked product over every group)
Times are medians of jitted calls after a warm-up call; `max_abs_diff` is against dense.

    python bench/moe.py [--reps 7] [--tokens 1 8 32 16 746]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def ragged(p, x, k):
    """jax.lax.ragged_dot over the assignments sorted by expert (not used by the model)."""
    import jax
    import jax.numpy as jnp

    from photon_jax import moe

    ids, w = moe.route(p, x, k)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.zeros(p["fc1"].shape[0], jnp.int32).at[flat].add(1)
    prec = jax.lax.Precision.HIGHEST
    h = jax.lax.ragged_dot(x[order // k], p["fc1"], counts, precision=prec)
    inner = p["fc2"].shape[1]
    y = jax.lax.ragged_dot(moe.gelu_erf(h[:, :inner]) * (h[:, inner:] + 1), p["fc2"], counts,
                           precision=prec)
    y = jnp.zeros_like(y).at[order].set(y).reshape(x.shape[0], k, -1)
    return (y * w[..., None]).sum(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 16, 746])
    args = ap.parse_args(argv)
    from functools import partial

    import jax
    import numpy as np

    from photon_jax import moe
    from photon_jax.params import init_params
    from pipeline import small_md3_config

    cfg = small_md3_config()
    k = cfg.text.moe.experts_per_token
    params = init_params(jax.random.PRNGKey(0), cfg)
    p = jax.tree.map(lambda a: a[0], params["text"]["moe_blocks"]["moe"])
    fns = {"selected": jax.jit(partial(moe.moe_mlp, k=k)),
           "dense": jax.jit(partial(moe.dense_reference, k=k)),
           "ragged": jax.jit(partial(ragged, k=k))}
    for n in args.tokens:
        x = jax.random.normal(jax.random.PRNGKey(n), (n, cfg.text.dim))
        ref = np.asarray(fns["dense"](p, x))
        for name, fn in fns.items():
            out = np.asarray(fn(p, x))
            ts = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(p, x))
                ts.append(time.perf_counter() - t0)
            print(json.dumps({"kind": "moe", "schedule": name, "tokens": n,
                              "experts": cfg.text.moe.num_experts, "top_k": k,
                              "ms": round(1e3 * float(np.median(ts)), 3),
                              "max_abs_diff": float(np.abs(out - ref).max())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
