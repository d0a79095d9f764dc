"""Streams decoding while new images arrive: how long the streams freeze, and what the
arrivals pay, with image prefixes sliced between decode steps and without (today's whole
encode), side by side in one process.

The scenario (issue 60): `--streams` rows decode greedily, each read as a stream by a
thread; once they run, `--arrivals` caption requests with new images arrive at once.  One JSON line per mode:
  median_gap_ms            the streams' median gap between commits before the arrivals;
  max_gap_over_median      the longest gap while the arrivals are encoded and prefilled
  p99_gap_over_median      (from their submission to the last arrival's first token), over
                           that median;
  arrivals_s / alone_s     from the arrivals' submission to the last one's result, with the
                           streams decoding, and the same arrivals (other images of the same
                           size) with nothing else running;
  arrivals_over_alone      arrivals_s over the whole-encode engine's alone_s of that rep;
  ttft_ms / ttft_alone_ms  the arrivals' mean time to first token, both ways;
  decode_tok_s             all tokens committed over the streamed round's time;
  slices, budget_ms        how many slices ran, the budget the engine measured, and the
  rates_gflops             slices' speeds it measured, by kind;
then per mode the medians over the reps (`summary`).

    python bench/arrivals.py --config small_v27          # the medium model, CPU
    python bench/arrivals.py --config md2 --streams 4    # full size (a GPU: bench/gpu_run.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common as P  # noqa: E402 - the shared model builder and allocator settings
from prefill import image  # noqa: E402 - the benchmark images (sizes by crop count)


def _gaps(log, t_from: float, t_to: float, before: float):
    """(median gap before `before`, gaps between step ends in [t_from, t_to])."""
    ends = np.array(sorted(s["t_end"] for s in log))
    gaps = np.diff(ends)
    at = ends[1:]
    base = gaps[at < before]
    during = gaps[(at > t_from) & (at <= t_to)]
    return float(np.median(base[-64:])), during


def scenario(eng, model, streams: int, arrivals: int, crops: int, seed: int,
             stream_tokens: int) -> dict:
    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import Settings

    def captions(s0):
        return [Request("text", model.prompts.caption("short"), image(crops, s0 + i),
                        Settings(temperature=0.0, max_tokens=8), ignore_eos=True)
                for i in range(arrivals)]

    # Alone: the arrivals with nothing else running.
    t0 = time.perf_counter()
    hs = [eng.submit(r) for r in captions(seed + 50)]
    for h in hs:
        h.result(timeout=3600)
    alone = time.perf_counter() - t0
    ttft_alone = np.mean([h.metrics()["time_to_first_token_s"] for h in hs])
    # With the streams decoding.
    text = [Request("text", [0] + list(range(100, 116)), None,
                    Settings(temperature=0.0, max_tokens=stream_tokens), ignore_eos=True)
            for _ in range(streams)]
    c0 = dict(eng.counters)
    t_start = time.perf_counter()
    dec = [eng.submit(r) for r in text]
    readers = [threading.Thread(target=lambda h=h: [None for _ in h.text_stream()], daemon=True)
               for h in dec]   # streamed, as a chat UI reads them (the engine slices for them)
    for t in readers:
        t.start()
    while eng.counters["decode"] + eng.counters["burst"] < c0.get("decode", 0) + \
            c0.get("burst", 0) + 40:   # the streams run (their gap is measured first)
        time.sleep(0.005)
    t1 = time.perf_counter()
    hs = [eng.submit(r) for r in captions(seed)]
    for h in hs:
        h.result(timeout=3600)
    t2 = time.perf_counter()
    ttft = [h.metrics()["time_to_first_token_s"] for h in hs]
    first = t1 + max(ttft)
    for h in dec:
        h.cancel()
    for h in dec:
        h.wait(timeout=3600)
    for t in readers:
        t.join(timeout=60)
    total = time.perf_counter() - t_start
    log = [s for s in eng.step_log() if s["t0"] >= t_start]
    med, during = _gaps(log, t1, first, t1)
    tokens = eng.counters["tokens"] - c0.get("tokens", 0)
    st = eng.stats()
    return {"median_gap_ms": round(1e3 * med, 2),
            "max_gap_over_median": round(float(during.max()) / med, 2) if during.size else None,
            "p99_gap_over_median": round(float(np.percentile(during, 99)) / med, 2)
            if during.size else None,
            "arrivals_s": round(t2 - t1, 3), "alone_s": round(alone, 3),
            "arrivals_over_alone": round((t2 - t1) / alone, 2),
            "ttft_ms": round(1e3 * float(np.mean(ttft)), 1),
            "ttft_alone_ms": round(1e3 * float(ttft_alone), 1),
            "decode_tok_s": round(tokens / total, 1),
            "slices": st.get("slices", 0) - c0.get("slices", 0),
            "budget_ms": round(1e3 * st["slicing"]["budget_s"], 1),
            "margin": round(st["slicing"]["margin"], 2),
            "rates_gflops": {k: round(v / 1e9, 1) for k, v in st["slicing"]["rates_flops_per_s"].items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default="small_v27", choices=sorted(P.CONFIGS))
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--arrivals", type=int, default=4)
    ap.add_argument("--crops", type=int, default=9, choices=(2, 9, 13))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=None, help="Engine(slice_ratio=)")
    ap.add_argument("--stream-tokens", type=int, default=900)
    ap.add_argument("--groups", default=None, help="Engine(slice_groups=), e.g. 3,0.5")
    args = ap.parse_args(argv)
    if os.environ.get("MALLOC_ARENA_MAX") is None:   # same allocator settings as pipeline.py
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
                  dict(os.environ, **P.CPU_ALLOCATOR_ENV))
    from photon_jax.engine.core import Engine

    model = P.build_model(args.config)
    base = {"config": args.config, "streams": args.streams, "arrivals": args.arrivals,
            "crops": args.crops, "date": time.strftime("%Y-%m-%d")}
    kw = {} if args.ratio is None else {"slice_ratio": args.ratio}
    if args.groups:
        kw["slice_groups"] = tuple(float(g) if "." in g else int(g) for g in args.groups.split(","))
    engines = {"whole": Engine(model, max_batch_size=args.streams + args.arrivals,
                               slice_images=False),
               "sliced": Engine(model, max_batch_size=args.streams + args.arrivals, **kw)}
    try:
        for mode, eng in engines.items():   # compiles every shape the scenario meets
            scenario(eng, model, args.streams, args.arrivals, args.crops, 1000,
                     args.stream_tokens)
        rows = {m: [] for m in engines}
        for rep in range(args.reps):        # alternating: drift hits both alike
            for mode, eng in engines.items():
                out = scenario(eng, model, args.streams, args.arrivals, args.crops,
                               2000 + 100 * rep, args.stream_tokens)
                rows[mode].append(out)
            # Both modes' arrivals against the same baseline: today's engine with nothing
            # else running (an engine that slices may slice the later arrivals behind the
            # first one, which then decodes: its own "alone" is reported as measured).
            alone = rows["whole"][-1]["alone_s"]
            for mode in engines:
                out = rows[mode][-1]
                out["arrivals_over_alone"] = round(out["arrivals_s"] / alone, 2)
                print(json.dumps({**base, "mode": mode, "rep": rep, **out}), flush=True)
        for mode in engines:   # medians over the reps (this machine's noise is large)
            med = {k: round(float(np.median([r[k] for r in rows[mode]])), 2)
                   for k in ("median_gap_ms", "max_gap_over_median", "p99_gap_over_median",
                             "arrivals_s", "alone_s", "arrivals_over_alone", "ttft_ms",
                             "decode_tok_s")}
            print(json.dumps({**base, "mode": mode, "summary": "median", "reps": args.reps,
                              **med}), flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
