"""How big is the GPU bubble, and how much of it does the pipelined engine hide?

For each (config, mode, batch) this prints one JSON line ("kind": "loops") with decode
tokens/s of
  - the blocking loop   (the engine with pipelined=False: launch, sample, wait, commit),
  - the pipelined loop  (the engine: commit t while forward t+1 runs), in single steps
                         (decode_burst=1), and with each `--burst` k (default 4 and 8: k
                         decode steps per launch at any batch; the engine's default on a GPU
                         or TPU is bursts of 8 in steps of up to 8 rows, docs/host.md) as
                         "burstK" {tokens/s, over the ceiling, host ms per launch, host us
                         per committed token},
  - the ceiling         (the same forward + sample step iterated inside one jitted
                         `lax.scan`: the device alone, no host work at all),
over the same fixed number of decode steps with EOS ignored, plus the measured parts of a
step: `device_ms` (the ceiling's step), `forward_ms` and `sample_ms` (each program alone,
synchronised, over the attended-length buckets the run goes through), `host_ms` (the
bookkeeping: the blocking loop's time between commits minus its wait for the device, with
its parts `launch_ms`, `finalize_ms`, `commit_ms`) and `sync_ms` (a synchronised call's cost
beyond dispatch and device time), and the cost model built from them:
  predicted blocking step  = host + device - min(forward share, finalize) + sync
  predicted pipelined step = max(device + steal, host, sync + commit + finalize + sample share)
(the host builds the constraint and dispatches sample while the forward runs; the sample of
step t waits for the host's commit of t-1 and its constraint; `steal` = host / cores in the
default mode, where the host's time comes out of XLA's cores) next to the measured steps
(`*_step_ms`, `*_model_err`).  bench/README.md explains each term.

Further lines (full run, or the flags):
  "host_work"  pinned and default, batch 8 (--aux-batch): both loops with 0, 4, 16, 32 ms of
               synthetic host work per step; the parent writes bench/results/pipeline.json
               and, with matplotlib, bench/results/pipeline_gain.png (gain vs host share);
  "zombies"    (first mode only) batch 1 and 32 (--zombie-batches), three waves of requests
               with sampled output lengths (tiny model, EOS calibrated to a mean of about 60
               tokens): the share of computed rows that belonged to finished sequences;
  "busy"       the device's busy fraction in each loop (batch 8, --aux-batch), from a
               `jax.profiler` trace.

Modes, each in its own subprocess (pinning must happen before JAX starts its threads):
  default  XLA and the host share every core;
  pinned   XLA's threads on core 0 and the Python host on core 1: the CPU stands in for an
           accelerator that runs beside the host (bench/README.md, "the cost model").

Configs: "small" (text width 512, 4 layers, 8 heads, vocab 32768, context 1024), "tiny" (the
fixture's shapes), "md2" (full-size Moondream 2 in bf16, for GPUs: see gpu_md2.py); random
weights; prompts of 746 positions (an image prefix of 730 + 16 prompt tokens); greedy.

    python bench/pipeline.py            # everything below, about 4 minutes on 2 cores
    python bench/pipeline.py --quick    # small config, batch 8, both modes (~30 s)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (CONFIGS, CPU_ALLOCATOR_ENV, RESULTS, ROOT, build_model,  # noqa: E402
                    ceiling_run, decode_cost, engine_run, env_info, kv_dtype_of, label_of, measure,
                    median, prefix, requests, start)


def host_work(model, config, batch, steps, mode, reps, work_ms) -> list[dict]:
    enc = prefix(model)
    engine_run(model, enc, batch, steps, False)   # compile first
    out = []
    for w in work_ms:
        res = {"blocking": [], "pipelined": [], "host": []}
        for _ in range(reps):
            tok_s, host, _ = engine_run(model, enc, batch, steps, False, w)
            res["blocking"].append(tok_s)
            res["host"].append(host)
            res["pipelined"].append(engine_run(model, enc, batch, steps, True, w)[0])
        b, p, h = (median(res[k]) for k in ("blocking", "pipelined", "host"))
        step = 1e3 * batch / b
        out.append({"kind": "host_work", "config": config, "batch": batch, "mode": mode,
                    "steps": steps, "host_work_ms": w, "host_ms": round(h, 3),
                    "host_share": round(h / step, 3), "blocking_tok_s": round(b, 1),
                    "pipelined_tok_s": round(p, 1), "pipelined_over_blocking": round(p / b, 3),
                    **env_info()})
    return out


def zombies(config: str, batch: int, mode: str, mean_len: int = 60) -> dict:
    """Sampled lengths: EOS's bias is set so that a token is EOS with probability about
    1/mean_len under the model's own logits (T = 1); every EOS finish rides one extra step
    (with decode bursts, the rest of its burst and the next one: the engine's default)."""
    import numpy as np

    from photon_jax.engine.core import Engine
    from photon_jax.engine.settings import Settings

    from photon_jax.engine import reference

    model = build_model(config)
    enc = prefix(model)
    # Calibrate on one prefill: p(EOS) = e^(l0 + b) / (e^(l0 + b) + sum_{j>0} e^l_j).
    trace = {}
    reference.generate_text(model, enc, requests(model, enc, 1, 1)[0].prompt,
                            Settings(temperature=0, max_tokens=1), trace=trace)
    lg = np.array(trace["prefill_logits"], np.float64)
    top = lg.max()
    rest = np.log(np.exp(lg - top).sum() - np.exp(lg[0] - top)) + top
    model = build_model(config, eos_bias=float(rest - np.log(mean_len - 1) - lg[0]))
    eng = Engine(model, max_batch_size=batch)
    try:
        reqs = []
        for k in range(3):   # three waves of `batch` requests
            s = Settings(temperature=1.0, top_p=1.0, max_tokens=4 * mean_len, seed=k)
            reqs += requests(model, enc, batch, 0, settings=s, ignore_eos=False)
        lens = [len(h.result(timeout=3600)["ids"]) for h in eng.submit_many(reqs)]
    finally:
        eng.close()
    zombie = eng.counters["zombie_rows"]
    # Row-steps computed: a burst's rows each ran decode_burst steps.
    rows = sum(x["rows"] * (eng.decode_burst if x["kind"] == "burst" else 1)
               for x in eng.step_log() if x["kind"] in ("decode", "burst"))
    return {"kind": "zombies", "config": config, "batch": batch, "mode": mode,
            "requests": len(lens), "mean_output_tokens": round(float(np.mean(lens)), 1),
            "decode_rows": rows, "zombie_rows": zombie,
            "zombie_tax": round(zombie / max(rows, 1), 4), **env_info()}


def busy(model, config: str, batch: int, steps: int, mode: str) -> dict:
    """The device's busy fraction per loop, from a jax.profiler trace (Perfetto JSON): the
    union of XLA executions on the executing threads over the decode window."""
    import glob
    import gzip
    import tempfile

    import jax

    enc = prefix(model)
    out = {"kind": "busy", "config": config, "batch": batch, "mode": mode, "steps": steps}
    engine_run(model, enc, batch, steps, False)   # compiled already, unless run alone
    for name, pipelined in (("blocking", False), ("pipelined", True)):
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                engine_run(model, enc, batch, steps, pipelined)
            path = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)[0]
            with gzip.open(path) as f:
                events = json.load(f)["traceEvents"]
        out[f"{name}_busy"] = _busy_fraction(events)
    out.update(env_info())
    return out


def _busy_fraction(events) -> float | None:
    """XLA's CPU runtime records each program execution as "ThunkExecutor::Execute" spans on
    its threads; busy = their union over the span from the first to the last one (the
    engine run: a short prefill, then the decode steps)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("name", "").startswith("ThunkExecutor::Execute")
                   and "dur" in e)
    if not spans:
        return None
    busy_us, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy_us += b - max(a, end)
            end = b
    return round(busy_us / (max(b for _, b in spans) - spans[0][0]), 3)


def kv_side_by_side(models, config: str, batch: int, steps: int, mode: str, reps: int) -> dict:
    """The ceiling of each KV pool format at one batch, timed in turns (format A, B, C, A,
    B, C, ... `reps` rounds) so that the machine's slow drifts hit every format alike: the
    median tokens/s of each, its ratio to the first format's, and the bytes of its step
    (XLA's cost analysis, with the CPU kernel's reads) against the step's floor."""
    import jax

    for m in models:
        ceiling_run(m, batch, steps)   # compiles
    runs = {i: [] for i in range(len(models))}
    for _ in range(reps):
        for i, m in enumerate(models):
            runs[i].append(ceiling_run(m, batch, steps, warm=True))
    weights_axis = any(getattr(m, "bench_weights", None) for m in models)
    # Formats of the weights side by side: named by their weights alone (the pool is the
    # same for all, given once as "kv_dtype"), so an 8-bit pool's name never collides with
    # 8-bit weights'.
    names = [(getattr(m, "bench_weights", None) or m.cfg.dtype) if weights_axis else label_of(m)
             for m in models]
    tok = {n: round(median(runs[i]), 1) for i, n in enumerate(names)}
    costs = {n: decode_cost(m.cfg, batch, start(m) + steps // 2,
                            platform_=jax.devices()[0].platform, attention=m.attention,
                            kv_dtype=kv_dtype_of(m)) for n, m in zip(names, models)}
    kind = "weights_side_by_side" if weights_axis else "kv_side_by_side"
    extra = {"kv_dtype": kv_dtype_of(models[0]) or models[0].cfg.dtype} if weights_axis else {}
    if weights_axis and jax.devices()[0].platform == "cpu":
        from photon_jax.kernels import cpukernel

        extra["dense_isa"] = cpukernel.dense_isa()   # the vectors 8-bit codes stream in
    return {"kind": kind, "config": config, "batch": batch, "mode": mode, **extra,
            "steps": steps, "reps": reps, "ceiling_tok_s": tok,
            "over_first": {n: round(t / tok[names[0]], 3) for n, t in tok.items()},
            "bytes_accessed": {n: c["bytes_accessed"] for n, c in costs.items()},
            "floor_bytes": {n: c["floor_bytes"] for n, c in costs.items()},
            "runs_tok_s": {n: [round(x, 1) for x in runs[i]] for i, n in enumerate(names)},
            **env_info()}


def child(args) -> None:
    if args.mode == "pinned":
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            raise SystemExit("pinned mode needs at least two cores")
        # XLA creates its thread pools when the backend starts: start it on core 0 only,
        # then move this (host) thread, and the scheduler thread it will spawn, to core 1.
        os.sched_setaffinity(0, {cores[0]})
        import jax
        import jax.numpy as jnp

        jax.block_until_ready(jnp.ones(8) + 1)
        os.sched_setaffinity(0, {cores[1]})
    t_start = time.perf_counter()

    def emit(row):
        row["elapsed_s"] = round(time.perf_counter() - t_start, 1)   # of this mode's process
        print(json.dumps(row), flush=True)

    kv_dtypes = args.kv_dtype or [None]
    for config in args.config:
        if args.weights:
            models = [build_model(config, kv_dtype=kv_dtypes[0], weights=w, dtype=args.dtype)
                      for w in args.weights]
        else:
            models = [build_model(config, kv_dtype=kv, dtype=args.dtype) for kv in kv_dtypes]
        for batch in args.batch:
            for model in models:
                emit(measure(model, config, batch, args.steps, args.mode, args.reps,
                             bursts=tuple(k for k in args.burst if k > 1)))
            if len(models) > 1:
                emit(kv_side_by_side(models, config, batch, args.steps, args.mode,
                                     args.side_reps))
    if args.host_work:
        model = build_model(args.config[-1])
        for row in host_work(model, args.config[-1], args.aux_batch, args.steps, args.mode,
                             args.reps, args.host_work):
            emit(row)
    if args.zombies:   # a property of the schedule, not of the model's size: the tiny model
        for batch in args.zombie_batches:
            emit(zombies("tiny", batch, args.mode, args.zombie_len))
    if args.busy:
        emit(busy(build_model(args.config[-1]), args.config[-1], args.aux_batch, args.steps,
                  args.mode))
    if args.md2_bytes:   # compile only, from abstract shapes: nothing of full size exists
        import jax

        from photon_jax.engine.step import default_attention

        # This backend's decode attention, and the XLA sweep beside it on CPU.
        attentions = dict.fromkeys([default_attention(jax.devices()[0].platform), "xla"])
        for attention in attentions:
            for dtype in ("bfloat16", "float32"):
                cfg = CONFIGS["md2"]().with_dtype(dtype)
                emit({"kind": "bytes", "config": "md2", "dtype": dtype, "mode": args.mode,
                      **decode_cost(cfg, 32, 1000, attention=attention), **env_info()})


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in sorted({r["mode"] for r in rows}):
        pts = sorted((r["host_share"], r["pipelined_over_blocking"]) for r in rows
                     if r["mode"] == mode)
        ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=mode)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("host share of a blocking step")
    ax.set_ylabel("pipelined / blocking tokens/s")
    ax.set_title("Pipelining gain vs host work (small config, batch 8)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small config, batch 8, both modes")
    ap.add_argument("--config", nargs="+", default=["tiny", "small"], choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=16, help="decode steps per run")
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions (median)")
    ap.add_argument("--burst", type=int, nargs="*", default=[4, 8],
                    help="also time the pipelined engine with these decode_burst values, "
                         "side by side (a 'burstK' entry per value, bursts at any batch; the "
                         "'pipelined' loop runs single steps, decode_burst=1)")
    ap.add_argument("--modes", nargs="+", default=["default", "pinned"],
                    choices=["default", "pinned"])
    ap.add_argument("--host-work", type=float, nargs="*", default=None,
                    help="synthetic host ms per step to sweep (full run: 0 4 16 32)")
    ap.add_argument("--zombies", action="store_true", help="the zombie tax (--zombie-batches)")
    ap.add_argument("--zombie-len", type=int, default=60,
                    help="mean sampled output length of the zombie-tax requests")
    ap.add_argument("--zombie-batches", type=int, nargs="+", default=[1, 32],
                    help="the batches of the zombie-tax runs")
    ap.add_argument("--busy", action="store_true", help="busy fraction from a profiler trace")
    ap.add_argument("--aux-batch", type=int, default=8,
                    help="the batch of the host-work sweep and the busy fraction")
    ap.add_argument("--md2-bytes", action="store_true",
                    help="bytes accessed by a full-size Moondream 2 decode step at batch 32, "
                    "position 1000 (compiled from abstract shapes)")
    ap.add_argument("--out", help="write all rows (JSON) and the gain plot here "
                    "(full run: bench/results)")
    ap.add_argument("--kv-dtype", nargs="+", default=None,
                    help="the KV pool's format for the loops: the model's dtype (default, or "
                         "its name), int8 or float8_e4m3fn; several: each is measured, then "
                         "their ceilings are timed in turns (a \"kv_side_by_side\" line per "
                         "batch)")
    ap.add_argument("--weights", nargs="+", default=None,
                    choices=["float32", "bfloat16", "int8", "fp8", "int4"],
                    help="the same random weights in each of these formats (float32: as "
                         "drawn; int8 / fp8 / int4: quantized, `model.quant`), side by side "
                         "as --kv-dtype's formats are")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="the models' dtype for the --kv-dtype / --weights loops (default: "
                         "the config's; md2 and md3 are bfloat16, and the CPU kernels take "
                         "float32 models only)")
    ap.add_argument("--side-reps", type=int, default=7,
                    help="rounds of the side-by-side ceiling runs (several --kv-dtype)")
    ap.add_argument("--mode", help=argparse.SUPPRESS)   # set in the child process
    args = ap.parse_args(argv)
    if args.mode:
        child(args)
        return 0
    full = not args.quick and argv is None and len(sys.argv) == 1
    if args.quick:
        args.config, args.batch = ["small"], [8]
    if full:
        # A CPU step of the small config is ~35-55 ms, so the sweep goes well past the
        # 0.5-2 ms that matter next to a GPU's few-ms step, up to a host share near 50%.
        args.host_work, args.zombies, args.busy = [0.0, 4.0, 16.0, 32.0], True, True
        args.md2_bytes = True
        args.out = RESULTS
    env = dict(os.environ, **CPU_ALLOCATOR_ENV)
    # Both modes compile the same programs: the second reads them from a persistent cache
    # (compilation is never inside a timed region; this only shortens the run).  A cache
    # the caller set up (the test suite's, whose other processes filled it) is used as is.
    cache = tempfile.TemporaryDirectory(prefix="photon-bench-xla-")
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        env.update(JAX_COMPILATION_CACHE_DIR=cache.name,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    rows = []
    for mode in args.modes:
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--config",
               *args.config, "--steps", str(args.steps), "--reps", str(args.reps),
               "--batch", *map(str, args.batch)]
        if args.kv_dtype:
            cmd += ["--kv-dtype", *args.kv_dtype, "--side-reps", str(args.side_reps)]
        if args.weights:
            cmd += ["--weights", *args.weights, "--side-reps", str(args.side_reps)]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        if args.burst:
            cmd += ["--burst", *map(str, args.burst)]
        if args.host_work:
            cmd += ["--host-work", *map(str, args.host_work)]
        # The zombie tax is a property of the schedule, not of where XLA runs: one mode.
        cmd += ["--zombies", "--zombie-len", str(args.zombie_len), "--zombie-batches",
                *map(str, args.zombie_batches)] * (args.zombies and mode == args.modes[0])
        cmd += ["--aux-batch", str(args.aux_batch)]
        cmd += ["--busy"] * args.busy
        cmd += ["--md2-bytes"] * (args.md2_bytes and mode == args.modes[0])
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for line in r.stdout.splitlines():
            print(line, flush=True)
            if line.startswith("{"):
                rows.append(json.loads(line))
        if r.returncode:
            return r.returncode
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pipeline.json"), "w") as f:
            json.dump(rows, f, indent=1)
        work = [r for r in rows if r["kind"] == "host_work"]
        png = os.path.join(args.out, "pipeline_gain.png")
        if work and plot(work, png):
            print(f"wrote {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
