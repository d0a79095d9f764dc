"""Images/s of `photon-caption` on a dataset of mixed image sizes: does batching pay?

A random-weights checkpoint of the chosen config is written to a temporary folder (stored in
`--ckpt-dtype`), with N images of mixed sizes (noise JPEGs cycling through 378x378, 640x480,
800x600, 1024x768, 1500x400 and 512x600: 2 to 13 crops each, decoded and cropped on the
worker threads like any dataset).  They are captioned greedily ("normal" captions, a fixed
--max-tokens) once per (checkpoint dtype, batch size), twice in one process:

  cold   the first pass: it compiles every program it meets (what a user's first run pays;
         each configuration runs in its own process with an empty persistent compile cache);
  warm   the same images again: compiled programs are reused (steady-state captioning).

With --processes, two more runs per configuration, each a new process running photon-caption
with one fresh persistent compile cache folder: `fresh_cache` (compiles and fills it) and
`warm_cache` (reads it), each with the load time (`load_s`), the time from the start of the
load to the first caption (`first_caption_s`) and the whole run (`run_s`): what the compile
cache saves a user's second run.  `--source-tree DIR` runs an older checkout's photon-caption
on the same images and checkpoints (`--keep DIR` keeps them between invocations).

One JSON line per pass:

  {"bench": "caption", "config", "ckpt_dtype", "compute_dtype", "kv_dtype", "batch",
   "images", "max_tokens", "pass", "images_per_s", "tokens_per_s", "wall_s"}
  (+ "same_caption" for an 8-bit `--kv-dtype`: the share of images captioned exactly as
  with the unquantized pool)

images_per_s and tokens_per_s are the CLI's own `Summary` (from the first submission to the
last write, model load excluded); wall_s is the whole call.  Random weights rarely emit EOS,
so nearly every caption is max_tokens long and every configuration does the same work.

The default config, "small_v27", is the text model of `inflight.py`'s "small" (width 512, 4
layers) with the fixture's 27-layer vision tower: the public reference needs 27 vision layers
(it uses the layer count as the patch grid side), so this is the model it can run too
(`bench/reference_caption.py`).

  python bench/caption.py                                     # f32 and bf16 checkpoints, batch 32
  python bench/caption.py --batch 1 8 32 --ckpt-dtype float32
  python bench/caption.py --config tiny --images 3 --batch 1 2 --max-tokens 3   # smoke
  python bench/caption.py --ckpt-dtype float32 --kv-dtype model int8 float8_e4m3fn
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
from common import CONFIGS, TOKENIZER, build_model, reexec_with_allocator_env  # noqa: E402

SIZES = [(378, 378), (640, 480), (800, 600), (1024, 768), (1500, 400), (512, 600)]


def write_checkpoint(name: str, folder: str, dtype: str = "float32") -> str:
    import jax

    from photon_jax.model import checkpoint
    from photon_jax.model.text import stack_layers

    model = build_model(name)
    params = jax.tree.map(lambda a: a.astype(dtype), model.params)
    checkpoint.save_params(folder, stack_layers(params))
    shutil.copyfile(TOKENIZER, os.path.join(folder, "tokenizer.json"))
    checkpoint.write_metadata(folder, model.cfg.with_dtype(dtype),
                              {"source": f"random weights ({name})"})
    return folder


def write_images(folder: str, n: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        a = rng.integers(0, 256, (h, w, 3), np.uint8)
        Image.fromarray(a).save(os.path.join(folder, f"img{i:04d}.jpg"), quality=90)


def caption_cli():
    """photon-caption's module in the photon_jax this process imported:
    `photon_jax.cli.caption`, or `photon_jax.caption` in an older checkout (`--source-tree`).
    Chosen by the files beside it, not by trying the import: an editable install maps
    `photon_jax.cli` to its own tree whichever photon_jax came first."""
    import importlib

    import photon_jax

    here = os.path.dirname(os.path.abspath(photon_jax.__file__))
    new = os.path.isfile(os.path.join(here, "cli", "caption.py"))
    return importlib.import_module("photon_jax.cli.caption" if new else "photon_jax.caption")


def caption(ckpt: str, images: str, batch: int, max_tokens: int, out: str,
            dtype: str | None = None, kv_dtype: str | None = None) -> dict:
    cli = caption_cli()

    argv = [images, "--model", ckpt, "--batch-size", str(batch), "--max-tokens",
            str(max_tokens), "--no-sidecar", "--jsonl", out, "--quiet", "--overwrite"]
    if dtype:
        argv += ["--dtype", dtype]
    if kv_dtype:
        argv += ["--kv-dtype", kv_dtype]
    args = cli.build_parser().parse_intermixed_args(argv)
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


def _captions(jsonl: str) -> dict:
    """{image: caption} of a photon-caption JSONL output (the last pass's)."""
    out = {}
    with open(jsonl) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["path"]] = rec["caption"]
    return out


def _child(code_args: list[str], env_extra: dict, cwd: str) -> list[dict]:
    """Run `_passes` or `_one_run` of this file in a new interpreter; its JSON lines, each
    with the photon_jax package the child imported (`photon_jax_dir`).  The child runs in
    `cwd`, a folder without a photon_jax package: `python -c` puts its working directory
    first on sys.path, so a run started in a checkout would import that checkout's
    photon_jax whatever PYTHONPATH (--source-tree) says."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import json, os, sys; sys.path.insert(1, %r); import caption as b; "
            "import photon_jax; d = os.path.dirname(os.path.dirname(photon_jax.__file__)); "
            "[print(json.dumps({**r, 'photon_jax_dir': d}), flush=True) "
            "for r in getattr(b, sys.argv[1])(*sys.argv[2:])]" % here)
    env = {**os.environ, **env_extra}
    r = subprocess.run([sys.executable, "-c", code, *code_args], env=env, capture_output=True,
                       text=True, cwd=cwd)
    if r.returncode != 0:
        raise RuntimeError(f"photon-caption run failed:\n{r.stderr[-3000:]}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def _passes(ckpt, images, batch, max_tokens, out, dtype, kv_dtype="") -> list[dict]:
    """(In a child process.)  The cold and the warm pass, in one process."""
    return [{"pass": name, **caption(ckpt, images, int(batch), int(max_tokens), out,
                                     dtype or None, kv_dtype or None)}
            for name in ("cold", "warm")]


def _one_run(ckpt, images, batch, max_tokens, out, dtype, kv_dtype="") -> list[dict]:
    """(In a child process.)  One photon-caption run: rates, load time, first caption."""
    cli = caption_cli()

    argv = [images, "--model", ckpt, "--batch-size", batch, "--max-tokens", max_tokens,
            "--no-sidecar", "--jsonl", out, "--quiet", "--overwrite"]
    if dtype:
        argv += ["--dtype", dtype]
    if kv_dtype:
        argv += ["--kv-dtype", kv_dtype]
    t0 = time.perf_counter()
    s = cli.run(cli.build_parser().parse_intermixed_args(argv))
    if s.exit_code != 0:
        raise SystemExit(f"photon-caption failed (exit {s.exit_code})")
    return [{"images_per_s": round(s.images_per_s, 3),
             "tokens_per_s": round(s.tokens_per_s, 1), "load_s": round(s.load_seconds, 2),
             "captioning_s": round(s.seconds, 2),
             "first_caption_s": round(s.load_seconds + s.first_result_seconds, 2),
             "run_s": round(time.perf_counter() - t0, 2)}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default="small_v27", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, nargs="+", default=[32])
    ap.add_argument("--images", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ckpt-dtype", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"], help="dtype the checkpoint is stored in")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="compute dtype passed to photon-caption (default: its own choice)")
    ap.add_argument("--kv-dtype", nargs="+", default=["model"],
                    help="KV pool formats to run side by side ('model': unquantized, or int8 "
                         "/ float8_e4m3fn); an 8-bit run's lines also carry "
                         "`same_caption`, the share of images whose caption equals the "
                         "unquantized run's (run 'model' first)")
    ap.add_argument("--processes", action="store_true",
                    help="also run photon-caption twice in new processes sharing a fresh "
                         "persistent compile cache: a first run (fresh cache) and a second "
                         "(warm cache)")
    ap.add_argument("--source-tree", default=None, metavar="DIR",
                    help="run photon-caption from this source tree (PYTHONPATH=DIR), e.g. a "
                         "`git worktree` of an older commit, for before/after numbers on the "
                         "same images and checkpoints")
    ap.add_argument("--compile-cache", default=None, metavar="DIR",
                    help="use this persistent compile cache for the passes instead of an "
                         "empty one per configuration (bench/gpu_run.py shares one across "
                         "its steps); `cold` then compiles only what is not in it")
    ap.add_argument("--keep", default=None, metavar="DIR",
                    help="write (or reuse) the images and checkpoints here instead of a "
                         "temporary folder")
    args = ap.parse_args(argv)
    reexec_with_allocator_env(__file__)   # see common.CPU_ALLOCATOR_ENV
    env = {"PYTHONPATH": os.path.abspath(args.source_tree)} if args.source_tree else {}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or tmp
        imgs = os.path.join(work, "images")
        if not os.path.isdir(imgs) or len(os.listdir(imgs)) != args.images:
            shutil.rmtree(imgs, ignore_errors=True)
            os.makedirs(imgs)
            write_images(imgs, args.images)
        for ckpt_dtype in args.ckpt_dtype:
            ckpt = os.path.join(work, f"ckpt-{args.config}-{ckpt_dtype}")
            if not os.path.isdir(ckpt):
                write_checkpoint(args.config, ckpt, ckpt_dtype)
            for b in args.batch:
                base = None   # the unquantized run's captions, by image
                for kv in args.kv_dtype:
                    kv_arg = "" if kv == "model" else kv
                    out = os.path.join(tmp, f"{ckpt_dtype}-b{b}-{kv}.jsonl")
                    common_args = [ckpt, imgs, str(b), str(args.max_tokens), out,
                                   args.dtype or "", kv_arg]
                    # Each configuration in its own process with its own empty compile
                    # cache: "cold" compiles everything it meets.
                    rows = _child(["_passes", *common_args],
                                  {**env, "JAX_COMPILATION_CACHE_DIR": args.compile_cache or
                                   tempfile.mkdtemp(dir=tmp, prefix="xla-")}, tmp)
                    if args.processes:
                        cache = tempfile.mkdtemp(dir=tmp, prefix="xla-")
                        for name in ("fresh_cache", "warm_cache"):
                            rows += [{"pass": name, **r} for r in _child(
                                ["_one_run", *common_args],
                                {**env, "JAX_COMPILATION_CACHE_DIR": cache}, tmp)]
                    caps = _captions(out)
                    extra = {}
                    if kv == "model":
                        base = caps
                    elif base:
                        extra["same_caption"] = round(
                            sum(caps.get(k) == c for k, c in base.items()) / len(base), 3)
                    for r in rows:
                        print(json.dumps({"bench": "caption", "config": args.config,
                                          "ckpt_dtype": ckpt_dtype,
                                          "compute_dtype": args.dtype, "kv_dtype": kv,
                                          "source": args.source_tree or "this tree",
                                          "batch": b, "images": args.images,
                                          "max_tokens": args.max_tokens, **r, **extra}),
                              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
