"""The Photon question on a GPU, at the real Moondream 2 shapes (random bf16 weights).

Runs the three loops of `pipeline.py` (blocking engine, pipelined engine, device-only
ceiling) at batch 1, 8, 32 and 64 on the default JAX device, and adds the bandwidth floor of
a decode step: the bytes it must move (every text weight except the embedding table, plus
the attended KV of every row) over the device's memory bandwidth (--bandwidth, default the
~4.3 TB/s measured on an H200).  One JSON line per batch.  Sized to fit in 10 minutes on one
H200 including compilation (two attended-length buckets, 48 steps, one repetition).

    python bench/gpu_md2.py                       # after pip install ".[cuda12]"
    python bench/gpu_md2.py --batch 1 8 --steps 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pipeline as P  # noqa: E402


def floor_ms(model, batch: int, steps: int, bandwidth: float) -> float:
    """Mean over the run's steps of bytes moved / bandwidth."""
    import jax
    import jax.numpy as jnp

    t = model.cfg.text
    itemsize = jnp.dtype(model.cfg.dtype).itemsize
    weights = sum(x.size for x in jax.tree.leaves(model.params["text"])) - t.vocab_size * t.dim
    total = 0.0
    for pos, n, _ in P.segments(model, steps):
        for k in range(n):
            kv = batch * (pos + k + 1) * t.n_layers * 2 * t.n_kv_heads * t.head_dim
            total += (weights + kv) * itemsize / bandwidth
    return total / steps * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s")
    args = ap.parse_args(argv)
    import jax

    print(f"device: {jax.devices()[0]}", file=sys.stderr)
    model = P.build_model("md2")
    for batch in args.batch:
        row = P.measure(model, "md2", batch, args.steps, "gpu", args.reps)
        fl = floor_ms(model, batch, args.steps, args.bandwidth)
        row.update(floor_step_ms=round(fl, 3), floor_tok_s=round(1e3 * batch / fl, 1),
                   ceiling_over_floor=round(row["ceiling_tok_s"] / (1e3 * batch / fl), 3))
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
