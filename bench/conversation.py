"""What does a conversation's next turn cost, with and without the conversation cache?

A conversation of `--turns` turns about one image: turn 1 asks a question; every later turn
sends back everything before it (the prompt and the answer's tokens, as a client that keeps
the history does) and asks another question.  Answers are `--answer-tokens` long (EOS
ignored).  The same conversation runs on an engine with the caches and on one without, in one
process, one JSON line per turn and setting:

  {"kind": "conversation", "cache", "turn", "prompt_tokens" (image prefix included),
   "cached_tokens" (read from the caches), "computed_tokens" (prefilled), "ttft_s" (time to
   first token, from submit), "same_answer" (cache on: equal to the answer without it)}

and a last line ("kind": "conversation_summary") with each setting's turn-6-over-turn-2
time-to-first-token ratio and the prefilled tokens in all.

`--shared N` adds a line ("kind": "prefix_sharing"): the most pool pages held at once by N
requests about one image behind one system prompt of `--system-tokens` tokens (submitted at
once after one such request finished), against N requests each with its own image and
system prompt.

    python bench/conversation.py                        # small_v27, 6 turns, 200-token answers
    python bench/conversation.py --config tiny --turns 3 --answer-tokens 8 --shared 4  # smoke
    python bench/conversation.py --config md2 --dtype float32 --cache-only --shared 0
    python bench/conversation.py --attention xla --shared 0   # the XLA sweep: cached pages copied
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from common import (CONFIGS, ROOT, build_model, env_info, reexec_with_allocator_env,
                    with_context)

IMAGE = os.path.join(ROOT, "tests", "fixtures", "moondream2-tiny", "img_land800x600.png")


def _conversation(eng, model, turns: int, answer_tokens: int, image=IMAGE) -> list[dict]:
    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import Settings

    pr = model.prompts
    s = Settings(temperature=0.0, max_tokens=answer_tokens)
    history, rows = [], []
    for t in range(turns):
        prompt = history + pr.query(f"w{100 + t} w{200 + t} w{300 + t}")
        h = eng.submit(Request("text", prompt, image, s, ignore_eos=True))
        r = h.result(timeout=3600)
        m = h.metrics()
        rows.append({"turn": t + 1, "prompt_tokens": m["input_tokens"],
                     "cached_tokens": m["cached_tokens"],
                     "computed_tokens": m["input_tokens"] - m["cached_tokens"],
                     "ttft_s": round(m["time_to_first_token_s"], 4), "ids": r["ids"]})
        history = prompt + r["ids"][:-1]   # the last answer token is never fed back
    return rows


def _peak_pages(eng, make_requests) -> int:
    """The most pool pages in use while the requests run (polled every 2 ms)."""
    peak, done = [0], threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], eng.sched.alloc.in_use())
            time.sleep(0.002)

    t = threading.Thread(target=poll)
    t.start()
    try:
        for h in eng.submit_many(make_requests()):
            h.result(timeout=3600)
    finally:
        done.set()
        t.join()
    return peak[0]


def _sharing(model, n: int, system_tokens: int, make_engine) -> dict:
    import numpy as np
    from PIL import Image

    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import Settings

    pr = model.prompts
    s = Settings(temperature=0.0, max_tokens=16)
    rng = np.random.default_rng(0)
    system = pr.encode(" ".join(f"w{i}" for i in rng.integers(10, 30000, system_tokens)))
    images = [Image.fromarray(rng.integers(0, 256, (60, 80, 3), np.uint8)) for _ in range(n)]
    systems = [pr.encode(" ".join(f"w{i}" for i in rng.integers(10, 30000, system_tokens)))
               for _ in range(n)]
    out = {}
    for name in ("shared", "distinct"):
        eng = make_engine()
        try:
            eng.submit(Request("text", system + pr.query("w1"), IMAGE, s)).result(timeout=3600)
            if name == "shared":
                make = lambda: [Request("text", system + pr.query(f"w{5 + i}"), IMAGE, s)  # noqa: E731
                                for i in range(n)]
            else:
                make = lambda: [Request("text", systems[i] + pr.query(f"w{5 + i}"), images[i], s)  # noqa: E731
                                for i in range(n)]
            out[name] = _peak_pages(eng, make)
            out[f"{name}_page_size"] = eng.page_size
        finally:
            eng.close()
    return {"kind": "prefix_sharing", "requests": n, "system_tokens": system_tokens,
            "peak_pages": {"shared": out["shared"], "distinct": out["distinct"]},
            "shared_over_distinct": round(out["shared"] / out["distinct"], 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small_v27", choices=sorted(CONFIGS))
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer-tokens", type=int, default=200)
    ap.add_argument("--shared", type=int, default=32, help="requests of the sharing line "
                    "(0: none)")
    ap.add_argument("--system-tokens", type=int, default=200)
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: the config's; "
                    "float32 for md2 on a CPU, whose dense kernel is float32)")
    ap.add_argument("--attention", default=None,
                    help="the decode attention (platforms.ATTENTION; default: the device's). "
                         "xla: the XLA sweep, whose follow-ups copy the cached pages")
    ap.add_argument("--cache-only", action="store_true",
                    help="only the engine with the caches (no baseline and no same_answer: "
                         "for full-size shapes on a CPU, where the baseline's prefills of the "
                         "whole history take minutes)")
    args = ap.parse_args(argv)
    reexec_with_allocator_env(__file__)

    from photon_jax.engine.core import Engine

    from PIL import Image, ImageOps

    model = build_model(args.config, dtype=args.dtype)
    warm = ImageOps.mirror(Image.open(IMAGE).convert("RGB"))
    ctx = model.cfg.prefix_len + args.turns * (args.answer_tokens + 16) + 64
    model = with_context(model, ctx)
    if args.attention:
        from photon_jax.model import Model

        model = Model(model.cfg, model.params, model.prompts.tok, attention=args.attention)
    runs = {}
    settings = (True,) if args.cache_only else (False, True)
    for cache in settings:   # cache off first: it also compiles what both use
        # The pool: the conversation, its cached pages and the image entry, with room to
        # spare (not most of the host's memory, as an engine's default pool would take).
        eng = Engine(model, max_batch_size=4, max_context=ctx, prefix_cache=cache,
                     kv_cache_tokens=4 * -(-ctx // 64) * 64)
        try:
            # Warm-up: the same conversation about the image mirrored (same crops, another
            # key) compiles every shape the timed one uses and caches nothing it could read.
            _conversation(eng, model, args.turns, args.answer_tokens, warm)
            runs[cache] = _conversation(eng, model, args.turns, args.answer_tokens)
        finally:
            eng.close()
    for cache in settings:
        for i, r in enumerate(runs[cache]):
            row = {k: v for k, v in r.items() if k != "ids"}
            same = None if args.cache_only else r["ids"] == runs[False][i]["ids"]
            print(json.dumps({"kind": "conversation", "config": args.config, "cache": cache,
                              **row, "same_answer": same}), flush=True)
    summary = {"kind": "conversation_summary", "config": args.config, "turns": args.turns,
               "answer_tokens": args.answer_tokens, "attention": model.attention}
    for cache in settings:
        rows = runs[cache]
        key = "cache" if cache else "no_cache"
        if len(rows) >= 2:
            summary[f"{key}_last_over_turn2_ttft"] = round(rows[-1]["ttft_s"] / rows[1]["ttft_s"], 3)
        summary[f"{key}_computed_tokens"] = sum(r["computed_tokens"] for r in rows)
    print(json.dumps({**summary, **env_info()}), flush=True)
    if args.shared:
        row = _sharing(model, args.shared, args.system_tokens,
                       lambda: Engine(model, max_batch_size=args.shared))
        print(json.dumps({**row, "config": args.config, **env_info()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
