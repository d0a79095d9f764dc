"""Images/s of `photon-caption` by batch size: does batching pay for a dataset run?

A random-weights checkpoint of the chosen config is written to a temporary folder, N images
(640x480 JPEGs of noise: 9 crops each, decoded and cropped on the worker threads like any
dataset) are captioned greedily with a fixed --max-tokens, once per --batch-size, in one
process and in the same order.  An untimed run per batch size (that many images, the same
--max-tokens, so the same attended-length buckets) first compiles the programs it uses
(compiled programs are shared across loads of one config), so the timed runs measure
steady-state captioning.  One JSON line per batch size:

  {"bench": "caption", "config", "batch", "images", "max_tokens", "images_per_s",
   "tokens_per_s", "wall_s", "vs_batch1"}

images_per_s and tokens_per_s are the CLI's own `Summary` (from the first submission to the
last write, model load excluded); wall_s is the whole call.  Random weights rarely emit EOS,
so nearly every caption is max_tokens long and all batch sizes do the same work.

  python bench/caption.py                      # small config, batch 1 8 32, 32 images
  python bench/caption.py --config tiny --images 6 --batch 1 2 --max-tokens 4   # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from pipeline import CONFIGS, CPU_ALLOCATOR_ENV, TOKENIZER, build_model  # noqa: E402

def write_checkpoint(name: str, folder: str) -> str:
    from photon_jax import checkpoint

    model = build_model(name)
    checkpoint.save_params(folder, model.params)
    shutil.copyfile(TOKENIZER, os.path.join(folder, "tokenizer.json"))
    checkpoint.write_metadata(folder, model.cfg, {"source": f"random weights ({name})"})
    return folder


def write_images(folder: str, n: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        a = rng.integers(0, 256, (480, 640, 3), np.uint8)
        Image.fromarray(a).save(os.path.join(folder, f"img{i:04d}.jpg"), quality=90)


def caption(ckpt: str, images: str, batch: int, max_tokens: int, out: str) -> dict:
    from photon_jax import caption as cli

    args = cli.build_parser().parse_intermixed_args(
        [images, "--model", ckpt, "--batch-size", str(batch), "--max-tokens", str(max_tokens),
         "--no-sidecar", "--jsonl", out, "--quiet"])
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        summary = cli.run(args)
    wall = time.perf_counter() - t0
    if summary.exit_code != 0:
        raise RuntimeError(f"photon-caption failed (exit {summary.exit_code}):\n"
                           f"{err.getvalue()[-2000:]}")
    return {"images_per_s": round(summary.images_per_s, 3),
            "tokens_per_s": round(summary.tokens_per_s, 1), "wall_s": round(wall, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default="small", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="a normal-length caption is about this many tokens")
    args = ap.parse_args(argv)
    if os.environ.get("MALLOC_ARENA_MAX") != CPU_ALLOCATOR_ENV["MALLOC_ARENA_MAX"]:
        # Same allocator settings as bench/pipeline.py (see CPU_ALLOCATOR_ENV there).
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__),
                                   *sys.argv[1:]], {**os.environ, **CPU_ALLOCATOR_ENV})
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(args.config, os.path.join(tmp, "ckpt"))
        imgs = os.path.join(tmp, "images")
        os.makedirs(imgs)
        write_images(imgs, args.images)
        for b in sorted(set(args.batch)):   # compile each batch size's shapes, untimed
            warm = os.path.join(tmp, f"warm{b}")
            os.makedirs(warm)
            for i in range(min(b, args.images)):
                shutil.copy(os.path.join(imgs, f"img{i:04d}.jpg"), warm)
            caption(ckpt, warm, b, args.max_tokens, warm + ".jsonl")
        base = None
        for b in args.batch:
            r = caption(ckpt, imgs, b, args.max_tokens, os.path.join(tmp, f"b{b}.jsonl"))
            base = base or r["images_per_s"]
            print(json.dumps({"bench": "caption", "config": args.config, "batch": b,
                              "images": args.images, "max_tokens": args.max_tokens, **r,
                              "vs_batch1": round(r["images_per_s"] / base, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
