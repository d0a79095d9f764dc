"""Images/s of the Ray Data integration against photon-caption, side by side in one run: does
the Ray path keep its engine as full as the CLI does?

A random-weights checkpoint of the chosen config is written to a temporary folder, with two
sets of N noise JPEGs of mixed sizes (378x378, 640x480, 800x600, 1024x768, 1500x400 and
512x600 in turn: 2 to 13 crops each): a warm-up set and the measured set (other pixels, so
the image-prefix cache never hits).  On a local Ray cluster (2 CPUs) the same images are
captioned greedily ("normal" captions, a fixed --max-tokens, --batch rows per engine):

  cli   `photon_jax.cli.caption.run` in this process, after an untimed run over the warm-up set
        that compiles every program it meets; images/s is the CLI's own `Summary` (from the
        first submission to the last write, model load excluded);
  ray   `caption_dataset` over `ray.data.read_binary_files` with one Captioner actor on
        CPU, once per --batches-in-flight (2: the integration's default window, 1: one
        batch at a time, for reference).  The actor captions the warm-up set when it starts
        (so it compiles the same programs), then the timed span is, like the CLI's, from the
        first batch handed to the actor to the last batch it returned; wall_s is the whole
        `take_all` (actor start, model load and warm-up included).

Both paths share one persistent XLA compile cache (only the untimed warm-ups profit) and run
under the same CPU allocator settings (`common.CPU_ALLOCATOR_ENV`; the Ray processes inherit
them).  One JSON line per run, then one per Ray variant with the ratio:

  {"bench": "ray_caption", "path": "cli"|"ray", "batches_in_flight", "config", "batch",
   "images", "max_tokens", "rep", "images_per_s", "tokens_per_s", "span_s", "wall_s",
   "same_captions"}
  {"bench": "ray_caption", "kind": "ratio", "batches_in_flight", "ray_images_per_s",
   "cli_images_per_s", "ray_over_cli"}    (medians over --reps)

same_captions: the Ray rows' captions, finish reasons and token counts equal the CLI's.

  python bench/ray_caption.py                          # small_v27, 24 images, batch 8, 32 tokens
  python bench/ray_caption.py --config tiny --images 3 --batch 2 --max-tokens 3 \\
      --batches-in-flight 2                             # smoke
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, TOKENIZER, build_model, median, reexec_with_allocator_env  # noqa: E402

SIZES = [(378, 378), (640, 480), (800, 600), (1024, 768), (1500, 400), (512, 600)]


def make_checkpoint(name: str, folder: str) -> str:
    """A float32 random-weights checkpoint of config `name`, as photon-convert writes one."""
    from photon_jax.model import checkpoint
    from photon_jax.model.text import stack_layers

    model = build_model(name)
    checkpoint.save_params(folder, stack_layers(model.params))
    shutil.copyfile(TOKENIZER, os.path.join(folder, "tokenizer.json"))
    checkpoint.write_metadata(folder, model.cfg, {"source": f"random weights ({name})"})
    return folder


def make_images(folder: str, n: int, seed: int) -> list[str]:
    import numpy as np
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        p = os.path.join(folder, f"img{i:04d}.jpg")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(p, quality=90)
        paths.append(p)
    return paths


def cli_run(ckpt: str, images: str, batch: int, max_tokens: int, workers: int,
            out: str) -> tuple[dict, dict]:
    """One photon-caption run in this process: (its numbers, {abspath: record})."""
    from photon_jax.cli import caption as cli

    argv = [images, "--model", ckpt, "--batch-size", str(batch), "--max-tokens",
            str(max_tokens), "--workers", str(workers), "--no-sidecar", "--jsonl", out,
            "--quiet", "--overwrite"]
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        s = cli.run(cli.build_parser().parse_intermixed_args(argv))
    wall = time.perf_counter() - t0
    if s.exit_code != 0:
        raise RuntimeError(f"photon-caption failed (exit {s.exit_code}):\n"
                           f"{err.getvalue()[-2000:]}")
    with open(out) as f:
        recs = {os.path.abspath(r["path"]): r for r in map(json.loads, f)}
    return ({"images_per_s": round(s.images_per_s, 3), "tokens_per_s": round(s.tokens_per_s, 1),
             "span_s": round(s.seconds, 2), "wall_s": round(wall, 2)}, recs)


def timed_captioner():
    """A Captioner that captions a warm-up set when it starts and stamps each output row
    with its batch's call start and end (the actor's monotonic clock)."""
    import numpy as np

    from photon_jax.integrations.ray import Captioner

    class TimedCaptioner(Captioner):
        def __init__(self, checkpoint, *, warmup_images, **kwargs):
            super().__init__(checkpoint, **kwargs)
            self.md.caption(warmup_images, length=self.length, settings=self.settings)

        def __call__(self, batch):
            t0 = time.monotonic()
            out = super().__call__(batch)
            n = len(out["caption"])
            out["t_start"] = np.full(n, t0)
            out["t_end"] = np.full(n, time.monotonic())
            return out

    return TimedCaptioner


def ray_run(ckpt: str, images: str, warmup: list[str], batch: int, max_tokens: int,
            workers: int, batches_in_flight: int) -> tuple[dict, dict]:
    """One caption_dataset run on one CPU actor: (its numbers, {abspath: row})."""
    import ray

    from photon_jax.integrations.ray import caption_dataset

    t0 = time.perf_counter()
    ds = ray.data.read_binary_files(images, include_paths=True)
    ds = caption_dataset(ds, ckpt, image_column="bytes", concurrency=1, batch_size=batch,
                         batches_in_flight=batches_in_flight, captioner=timed_captioner(),
                         settings={"max_tokens": max_tokens}, workers=workers,
                         warmup_images=warmup)
    rows = ds.take_all()
    wall = time.perf_counter() - t0
    span = max(r["t_end"] for r in rows) - min(r["t_start"] for r in rows)
    ok = [r for r in rows if r["error"] is None]
    if len(ok) != len(rows):
        raise RuntimeError(f"Ray run: {len(rows) - len(ok)} image(s) failed: "
                           f"{next(r['error'] for r in rows if r['error'] is not None)}")
    tokens = sum(int(r["output_tokens"]) for r in ok)
    recs = {os.path.abspath(r["path"]): r for r in rows}
    return ({"images_per_s": round(len(ok) / span, 3), "tokens_per_s": round(tokens / span, 1),
             "span_s": round(span, 2), "wall_s": round(wall, 2)}, recs)


def same(cli: dict, ray_rows: dict) -> bool:
    keys = ("caption", "finish_reason", "output_tokens")
    return cli.keys() == ray_rows.keys() and all(
        all(cli[p][k] == ray_rows[p][k] for k in keys) for p in cli)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default="small_v27", choices=sorted(CONFIGS))
    ap.add_argument("--images", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8,
                    help="engine rows (CLI --batch-size, Ray batch_size); below --images, so "
                         "the Ray path crosses batch boundaries")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batches-in-flight", type=int, nargs="+", default=[2, 1],
                    help="Ray variants to run (caption_dataset's batches_in_flight)")
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions (medians)")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="image decode threads per engine, on both paths")
    args = ap.parse_args(argv)
    reexec_with_allocator_env(__file__)   # see common.CPU_ALLOCATOR_ENV
    with tempfile.TemporaryDirectory() as tmp:
        # Before JAX starts here and before Ray starts its workers (which inherit it).
        os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tmp, "xla")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        imgs, warm = os.path.join(tmp, "images"), os.path.join(tmp, "warmup")
        make_images(imgs, args.images, seed=0)
        warmup = make_images(warm, args.images, seed=1)
        ckpt = make_checkpoint(args.config, os.path.join(tmp, "ckpt"))

        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            base = {"bench": "ray_caption", "config": args.config, "batch": args.batch,
                    "images": args.images, "max_tokens": args.max_tokens}
            run_args = (ckpt, args.batch, args.max_tokens, args.workers)
            cli_run(run_args[0], warm, *run_args[1:], os.path.join(tmp, "warm.jsonl"))
            rates = {"cli": []} | {k: [] for k in args.batches_in_flight}
            for rep in range(args.reps):
                res, cli_recs = cli_run(run_args[0], imgs, *run_args[1:],
                                        os.path.join(tmp, f"cli{rep}.jsonl"))
                rates["cli"].append(res["images_per_s"])
                print(json.dumps({**base, "path": "cli", "batches_in_flight": None,
                                  "rep": rep, **res, "same_captions": True}), flush=True)
                for k in args.batches_in_flight:
                    res, rows = ray_run(ckpt, imgs, warmup, *run_args[1:], k)
                    rates[k].append(res["images_per_s"])
                    print(json.dumps({**base, "path": "ray", "batches_in_flight": k,
                                      "rep": rep, **res,
                                      "same_captions": same(cli_recs, rows)}), flush=True)
            cli_rate = median(rates["cli"])
            for k in args.batches_in_flight:
                print(json.dumps({"bench": "ray_caption", "kind": "ratio",
                                  "batches_in_flight": k,
                                  "ray_images_per_s": round(median(rates[k]), 3),
                                  "cli_images_per_s": round(cli_rate, 3),
                                  "ray_over_cli": round(median(rates[k]) / cli_rate, 3)}),
                      flush=True)
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
