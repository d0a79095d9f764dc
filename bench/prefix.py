"""What does the image-prefix cache buy when the same images come back?  N images, Q questions
about each (every question a separate request, all submitted at once in random order),
answered with the cache on and off, in one process; one JSON line per setting:

  {"bench": "prefix", "cache", "images", "questions_per_image", "requests", "seconds",
   "images_per_s", "requests_per_s", "hits", "misses", "hit_rate", "same_answers"}

A hit reads the cached prefix's pages in place (copying only its partial last page) instead
of running the vision encoder and the 730-position prefix prefill.  `same_answers`: the answers with the cache on
equal those with it off (they must).  Each setting first runs the same workload on other images of the same sizes, untimed
(compilation).

    python bench/prefix.py                 # 16 images x 8 questions, small_v27 config
    python bench/prefix.py --images 2 --questions 2 --max-tokens 2 --config tiny   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, env_info, reexec_with_allocator_env  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small_v27", choices=sorted(CONFIGS))
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args(argv)
    reexec_with_allocator_env(__file__)
    import numpy as np

    import caption as cap   # the dataset bench's checkpoint and image writers
    from photon_jax import Moondream

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = cap.write_checkpoint(args.config, os.path.join(tmp, "ckpt"))
        folder = os.path.join(tmp, "images")
        os.makedirs(folder)
        cap.write_images(folder, 2 * args.images)   # the first half warms up (compiles)
        files = sorted(os.path.join(folder, f) for f in os.listdir(folder))
        warm, files = files[:args.images], files[args.images:]
        pairs = [(f, f"w{100 + q} w{200 + i}") for i, f in enumerate(files)
                 for q in range(args.questions)]
        order = rng.permutation(len(pairs))
        imgs = [pairs[i][0] for i in order]
        qs = [pairs[i][1] for i in order]
        s = {"temperature": 0, "max_tokens": args.max_tokens}
        answers = {}
        for cache in (True, False):
            with Moondream.load(ckpt, max_batch_size=args.batch_size,
                                prefix_cache=cache) as md:
                md.query([warm[i % len(warm)] for i in range(len(imgs))], qs, settings=s)
                before = md.engine.stats()["prefix_cache"]
                t0 = time.perf_counter()
                out = md.query(imgs, qs, settings=s)
                dt = time.perf_counter() - t0
                st = md.engine.stats()["prefix_cache"]
            hits, misses = st["hits"] - before["hits"], st["misses"] - before["misses"]
            answers[cache] = [o["answer"] for o in out]
            print(json.dumps({
                "bench": "prefix", "config": args.config, "cache": cache,
                "images": args.images, "questions_per_image": args.questions,
                "requests": len(pairs), "max_tokens": args.max_tokens,
                "seconds": round(dt, 2), "images_per_s": round(args.images / dt, 3),
                "requests_per_s": round(len(pairs) / dt, 2), "hits": hits, "misses": misses,
                "hit_rate": round(hits / max(hits + misses, 1), 3),
                "same_answers": cache is False and answers[True] == answers[False] or None,
                **env_info()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
