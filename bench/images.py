"""What does each more image in a prompt cost?

One user message with N images and a short question (`Moondream.chat`, reasoning off), for
each N in `--images`: the first image is the image prefix (encoded with BOS), every other one
an image block inside the prompt (vision encoder, projection, and 729 more positions to
prefill, attended bidirectionally inside the block).  Every request's images are new (random
pixels), so neither cache helps: this is the cost of a first question.  Per N, one JSON line:

  {"kind": "images", "images": N, "prompt_tokens", "ttft_s" (time to first token, median of
   `--reps`), "decode_tok_s" (the answer's tokens after the first, per second, median; the
   answer is `--answer-tokens` long, EOS suppressed), "ttft_over_one", "decode_over_one"
   (both against N = 1)}

Each N's programs are compiled by a warm-up request first (not timed).  The random weights'
context is raised to what the largest N needs (`small_v27`: 1024 -> 2560 for 3 images).

    python bench/images.py                               # small_v27, 1-3 images
    python bench/images.py --config tiny --images 1 2 --reps 1 --answer-tokens 4  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (CONFIGS, build_model, env_info, reexec_with_allocator_env,  # noqa: E402
                    with_context)

QUESTION = "w5 w6 w7"


def _images(rng, n: int, size=(378, 378)):
    from PIL import Image

    return [Image.fromarray(rng.integers(0, 256, (*size, 3), dtype="uint8"), "RGB")
            for _ in range(n)]


def _ask(md, images, answer_tokens: int) -> dict:
    content = [{"type": "image", "image": im} for im in images]
    content.append({"type": "text", "text": QUESTION})
    out = md.chat([{"role": "user", "content": content}], reasoning=False,
                  settings={"temperature": 0, "max_tokens": answer_tokens},
                  return_metrics=True)
    return out["metrics"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small_v27", choices=sorted(CONFIGS))
    ap.add_argument("--images", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.answer_tokens < 2 or min(args.images) < 1:
        ap.error("--answer-tokens must be at least 2 (a decode rate needs two tokens) and "
                 "--images at least 1")
    reexec_with_allocator_env(__file__)

    import numpy as np

    from photon_jax import Moondream
    from photon_jax.engine.core import Engine

    # EOS pushed far down: every answer is `--answer-tokens` long.
    model = build_model(args.config, eos_bias=-1e4)
    per_image = model.cfg.prefix_len - 1    # an image block: the prefix without BOS
    model = with_context(model, model.cfg.prefix_len + (max(args.images) - 1) * per_image
                         + args.answer_tokens + 64)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    md = Moondream(model, Engine(model, max_batch_size=2, max_context=cfg.text.max_context,
                                 kv_cache_tokens=4 * -(-cfg.text.max_context // 64) * 64))
    rows = []
    try:
        for n in args.images:
            _ask(md, _images(rng, n), args.answer_tokens)         # compiles
            ttft, rate, prompt = [], [], None
            for _ in range(args.reps):
                m = _ask(md, _images(rng, n), args.answer_tokens)
                assert m["cached_tokens"] == 0 and m["output_tokens"] == args.answer_tokens, m
                ttft.append(m["time_to_first_token_s"])
                rate.append(m["decode_tokens_per_s"])
                prompt = m["input_tokens"]
            rows.append({"kind": "images", "config": args.config, "images": n,
                         "prompt_tokens": prompt, "answer_tokens": args.answer_tokens,
                         "ttft_s": round(statistics.median(ttft), 4),
                         "decode_tok_s": round(statistics.median(rate), 1),
                         "reps": args.reps})
    finally:
        md.engine.close()
    one = rows[0]
    for r in rows:
        r["ttft_over_one"] = round(r["ttft_s"] / one["ttft_s"], 3)
        r["decode_over_one"] = round(r["decode_tok_s"] / one["decode_tok_s"], 3)
        print(json.dumps({**r, **env_info()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
