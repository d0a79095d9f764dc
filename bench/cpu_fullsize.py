"""Full-size Moondream 2 on a CPU, side by side with the public reference (PyTorch): the same
Hugging Face snapshot, the same images, greedy captions, each side in its own fresh
processes.

For each photon_jax dtype (bfloat16, float32) one fresh process loads the snapshot's
converted checkpoint and captions every image of the folder in one call twice:

  first   the first call in a fresh process (what a user's script pays each run; compiled
          programs come from JAX's persistent compile cache when an earlier run filled it:
          run this script twice to see both, `--fresh-cache` empties a private cache first)
  warm    the same call again, with the image-prefix cache off, so it redoes every encode
          and prefill (the same work the reference redoes; the prefix cache would skip them)

and reports the load, both calls, the process's peak RSS (sampled every 50 ms, and
getrusage's maximum) and the memory plan's estimate.  The reference
(`bench/reference_caption.py`, run by the torch virtualenv's Python) captions the same
images one call per image, `cold` (its first pass) and `warm`, in bfloat16 (its default).

One JSON line per run, then a summary line with the ratios (reference seconds over
photon_jax seconds: > 1 means photon_jax is faster) and whether the captions are the same.

  # a snapshot with the real weights (the HF repo vikhyatk/moondream2), or random weights
  # in its layout, written by: python bench/reference_caption.py --write-hf DIR --config md2
  python bench/cpu_fullsize.py --hf-dir DIR --images IMAGES \\
      --ref-python /path/to/torch-venv/bin/python --reference-src /path/to/moondream

Without --ref-python only photon_jax runs.  Images: `--write-images` writes the two of the
measurements in bench/README.md (800x600 and 378x378 noise JPEGs).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def write_images(folder: str) -> None:
    import numpy as np
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate([(800, 600), (378, 378)]):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(
            os.path.join(folder, f"img{i}.jpg"), quality=90)


def _rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 2**20
    return 0.0


def child(args) -> None:
    """One fresh process: load, first call, warm call; one JSON line on stdout."""
    dtype = args.dtype[0]
    peak = [0.0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_gib())
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    from PIL import Image

    from photon_jax import Moondream

    names = sorted(os.listdir(args.images))
    images = [Image.open(os.path.join(args.images, n)) for n in names]
    t = time.perf_counter()
    md = Moondream.load(args.ckpt, dtype=dtype, prefix_cache=False)
    load = time.perf_counter() - t
    plan = md.engine.plan   # (`memory.plan`: the estimate checked at load)
    settings = {"max_tokens": args.max_tokens, "temperature": 0}
    t = time.perf_counter()
    first = md.caption(images, settings=settings)
    t_first = time.perf_counter() - t
    t = time.perf_counter()
    warm = md.caption(images, settings=settings)
    t_warm = time.perf_counter() - t
    done.set()
    md.close()
    print(json.dumps({
        "bench": "cpu_fullsize", "side": "photon_jax", "dtype": dtype,
        "images": len(images), "max_tokens": args.max_tokens, "load_s": round(load, 2),
        "first_s": round(t_first, 2), "warm_s": round(t_warm, 2),
        "peak_rss_gib": round(max(peak[0], resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss / 2**20), 2),
        "plan_gib": round(plan.total / 2**30, 2),
        "captions": [c["caption"] for c in first],
        "warm_same": [c["caption"] for c in first] == [c["caption"] for c in warm]}),
        flush=True)


def run(cmd, env=None) -> tuple[list[dict], float]:
    """Run `cmd`, returning its JSON lines and the peak RSS (GiB) of the largest child so
    far (getrusage of the children: the reference runs first, so its figure is its own)."""
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    return rows, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf-dir", help="a Hugging Face Moondream 2 snapshot")
    ap.add_argument("--images", help="the images (every file of the folder, sorted)")
    ap.add_argument("--write-images", metavar="DIR", help="write the two test images, exit")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--keep", metavar="DIR", help="keep the converted checkpoint here")
    ap.add_argument("--fresh-cache", action="store_true",
                    help="a new, empty persistent compile cache for photon_jax's runs")
    ap.add_argument("--ref-python", help="the torch virtualenv's python (omit: no reference)")
    ap.add_argument("--reference-src", default="/work/refsrc/moondream")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.write_images:
        write_images(args.write_images)
        return 0
    if args.child:
        child(args)
        return 0
    if not (args.hf_dir and args.images):
        ap.error("--hf-dir and --images are needed (or --write-images DIR)")
    work = args.keep or tempfile.mkdtemp(prefix="photon-fullsize-")
    env = dict(os.environ)
    if args.fresh_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="photon-jax-cache-")
    ref = {}
    if args.ref_python:
        rows, rss = run([args.ref_python, os.path.join(HERE, "reference_caption.py"),
                         "--reference-src", args.reference_src, "--hf-dir", args.hf_dir,
                         "--images", args.images, "--max-tokens", str(args.max_tokens),
                         "--dtype", "bfloat16", "--out", os.path.join(work, "reference.jsonl")])
        for r in rows:
            r["peak_rss_gib"] = round(rss, 2)   # (its own: the first child, see `run`)
            print(json.dumps(r), flush=True)
            ref[r["pass"]] = r
    results = []
    # The snapshot converted as it is (bfloat16 weights stay bfloat16); each run loads it
    # in its dtype (float32 widens every weight exactly).
    ckpt = os.path.join(work, "ckpt")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "photon-convert"),
                        args.hf_dir, ckpt], check=True, capture_output=True)
    for dtype in args.dtype:
        rows, _ = run([sys.executable, os.path.abspath(__file__), "--child", "--ckpt", ckpt,
                       "--images", args.images, "--dtype", dtype,
                       "--max-tokens", str(args.max_tokens)], env)
        for r in rows:
            print(json.dumps(r), flush=True)
            results.append(r)
    if args.ref_python:
        with open(os.path.join(work, "reference.jsonl")) as f:
            ref_caps = [json.loads(ln)["caption"] for ln in f]
        for r in results:
            # The reference's pass time is wall_s less its load (load excluded both sides).
            cold = ref["cold"]["wall_s"] - ref["cold"]["load_s"]
            warm = ref["warm"]["wall_s"] - ref["warm"]["load_s"]
            print(json.dumps({
                "bench": "cpu_fullsize", "side": "summary", "dtype": r["dtype"],
                "first_vs_reference_cold": round(cold / r["first_s"], 2),
                "warm_vs_reference_warm": round(warm / r["warm_s"], 2),
                "same_captions": r["captions"] == ref_caps}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
