"""`python -m photon_jax CKPT IMAGE...`: caption a few images with a converted checkpoint and
print one JSON line per image (a quick check; the dataset tool is `photon-caption`)."""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m photon_jax",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("checkpoint", help="directory written by photon-convert")
    ap.add_argument("images", nargs="+", help="image files")
    ap.add_argument("--length", default="normal", choices=["short", "normal", "long"])
    ap.add_argument("--max-tokens", type=int, default=768)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default=None, choices=[None, "bfloat16", "float32"])
    args = ap.parse_args(argv)
    from photon_jax import Moondream
    from photon_jax.api import BatchError

    t0 = time.perf_counter()
    settings = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    with Moondream.load(args.checkpoint, dtype=args.dtype) as md:
        # One list call: every image runs in the same continuous batch.
        try:
            outs, errors = md.caption(args.images, args.length, settings=settings), None
        except BatchError as e:
            outs, errors = e.results, e.errors
    failed = 0
    for i, path in enumerate(args.images):
        if errors and errors[i] is not None:
            failed += 1
            print(json.dumps({"path": path, "caption": None, "error": str(errors[i])}),
                  flush=True)
        else:
            print(json.dumps({"path": path, "caption": outs[i]["caption"]}), flush=True)
    print(f"{len(args.images)} image(s), {failed} failed, {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
