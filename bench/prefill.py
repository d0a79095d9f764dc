"""Image encode + prefill throughput, and how prefill mixes with decoding.

One JSON line per measurement:
  kind "images":  images/s of encode + prefill (requests of one token, so nothing decodes)
                  for 1, 4 and 16 images at once, at image sizes that give 2, 9 and 13 crops
                  (Moondream 2's tiling gives 2 or 7-13 crops);
  kind "crops":   the vision encoder + image prefix alone (`image_kv`) on synthetic crop
                  batches of 2..13 crops: images/s per crop count;
  kind "mix":     decode rows running while image requests arrive, with the prefill inside
                  the pipeline (the engine's way) or the pipeline drained before each prefill
                  (Photon's older rule): decode tokens/s, image requests' mean latency, the
                  total time, and the decoding rows' gaps between commits (median, and the
                  longest and 99th percentile over it: how long a new image freezes them).

    python bench/prefill.py            # tiny model (the fixture's shapes), CPU
    python bench/prefill.py --quick    # fewer sizes and counts
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common as P  # noqa: E402 - the shared model builder and allocator settings

SIZES = {2: (378, 378), 9: (800, 600), 13: (1000, 700)}


def image(crops: int, seed: int = 0) -> np.ndarray:
    w, h = SIZES[crops]
    return np.random.default_rng(seed).integers(0, 255, (h, w, 3), np.uint8)


def images_per_s(model, crops: int, n: int, reps: int) -> float:
    from photon_jax.engine.core import Engine
    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import Settings

    prompt = model.prompts.caption("short")
    s = Settings(temperature=0.0, max_tokens=1)
    eng = Engine(model, max_batch_size=max(n, 1))
    try:
        best = 0.0
        for rep in range(reps + 1):      # the first round compiles
            imgs = [image(crops, rep * 100 + i) for i in range(n)]
            t0 = time.perf_counter()
            for h in [eng.submit(Request("text", prompt, im, s)) for im in imgs]:
                h.result(timeout=3600)
            if rep:
                best = max(best, n / (time.perf_counter() - t0))
    finally:
        eng.close()
    return best


def crops_per_s(model, crops: int, reps: int) -> float:
    import jax

    from photon_jax.engine import step
    from photon_jax.engine.frontend import prepare_image

    prep = prepare_image(model, image(13))
    c = jax.device_put(np.random.default_rng(crops).integers(0, 255, (crops, 378, 378, 3),
                                                             np.uint8))
    prog = step.programs_of(model).image_kv
    jax.block_until_ready(prog(model.params, c, prep.src, prep.ph, prep.pw))
    t0 = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(prog(model.params, c, prep.src, prep.ph, prep.pw))
    return reps / (time.perf_counter() - t0)


def mix(model, drain: bool, decode_rows: int, arrivals: int, steps: int) -> dict:
    from photon_jax.engine.core import Engine
    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import Settings

    eng = Engine(model, max_batch_size=decode_rows + arrivals, prefill_drains=drain)
    try:
        text = [Request("text", [0] + list(range(100, 116)), None,
                        Settings(temperature=0.0, max_tokens=steps), ignore_eos=True)
                for _ in range(decode_rows)]
        for timed in (False, True):   # the first round compiles every shape it meets
            # New images each round: the timed round's would otherwise hit the prefix cache
            # and skip the encodes whose cost this measures.
            imgs = [Request("text", model.prompts.caption("short"), image(9, i + 100 * timed),
                            Settings(temperature=0.0, max_tokens=8), ignore_eos=True)
                    for i in range(arrivals)]
            t0 = time.perf_counter()
            dec = [eng.submit(r) for r in text]
            lat = []
            for r in imgs:                   # images arrive while the rows decode
                time.sleep(0.02)
                t = time.perf_counter()
                eng.submit(r).result(timeout=3600)
                lat.append(time.perf_counter() - t)
            for h in dec:
                h.result(timeout=3600)
            total = time.perf_counter() - t0
        # A burst's rows each decoded decode_burst tokens.
        tokens = sum(s["rows"] * (eng.decode_burst if s["kind"] == "burst" else 1)
                     for s in eng.step_log() if s["t0"] >= t0 and s["kind"] in ("decode",
                                                                              "burst"))
        gaps = stream_gaps(eng.step_log(), t0)
    finally:
        eng.close()
    return {"decode_tok_s": round(tokens / total, 1), "image_latency_ms":
            round(1e3 * sum(lat) / len(lat), 1), "total_s": round(total, 3), **gaps}


def stream_gaps(log, t0: float) -> dict:
    """How long the decoding rows wait between commits while images arrive: the gaps
    between consecutive step ends from the first decode step to the last (every step in
    between holds the decoding rows back: a prefill, with its image's encode, runs alone),
    as the median and the longest and 99th-percentile gap over it.  A commit is when a
    stream's next piece goes out, so these are the streams' gaps up to delivery."""
    steps = [s for s in log if s["t0"] >= t0]
    dec = [s["t_end"] for s in steps if s["kind"] in ("decode", "burst")]
    ends = sorted(s["t_end"] for s in steps if dec and dec[0] <= s["t_end"] <= dec[-1])
    if len(ends) < 3:
        return {}
    gaps = np.diff(ends)
    med = float(np.median(gaps))
    return {"median_gap_ms": round(1e3 * med, 3),
            "max_gap_over_median": round(float(gaps.max()) / med, 1),
            "p99_gap_over_median": round(float(np.percentile(gaps, 99)) / med, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default="tiny", choices=sorted(P.CONFIGS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="one size of each (tests only)")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    if os.environ.get("MALLOC_ARENA_MAX") is None:   # same allocator settings as pipeline.py
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
                  dict(os.environ, **P.CPU_ALLOCATOR_ENV))
    model = P.build_model(args.config)
    crop_counts = [2] if args.smoke else [2, 13] if args.quick else [2, 9, 13]
    counts = [1] if args.smoke else [1, 4] if args.quick else [1, 4, 16]
    crop_batches = [2] if args.smoke else [2, 7, 13] if args.quick else range(2, 14)
    base = {"config": args.config, "date": time.strftime("%Y-%m-%d")}
    for c in crop_counts:
        for n in counts:
            print(json.dumps({**base, "kind": "images", "crops": c, "images": n,
                              "images_per_s": round(images_per_s(model, c, n, args.reps), 2)}),
                  flush=True)
    for c in crop_batches:
        print(json.dumps({**base, "kind": "crops", "crops": c,
                          "images_per_s": round(crops_per_s(model, c, args.reps), 2)}),
              flush=True)
    short = args.quick or args.smoke
    kw = dict(decode_rows=4, arrivals=2 if short else 4, steps=8 if args.smoke else
              24 if args.quick else 64)
    for drain in (False, True):   # both scenarios once: each meets shapes the other compiles
        mix(model, drain, **kw)
    for drain in (False, True):
        out = mix(model, drain, **kw)
        print(json.dumps({**base, "kind": "mix", "prefill": "drained" if drain else
                          "in_pipeline", **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
