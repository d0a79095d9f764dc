"""How big is the GPU bubble, and how much of it does the pipelined engine hide?

For each (config, mode, batch) this prints one JSON line ("kind": "loops") with decode
tokens/s of
  - the blocking loop   (the engine with pipelined=False: launch, sample, wait, commit),
  - the pipelined loop  (the engine: commit t while forward t+1 runs),
  - the ceiling         (the same forward + sample step iterated inside one jitted
                         `lax.fori_loop`: the device alone, no host work at all),
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
  "host_work"  pinned and default, batch 8: both loops with 0, 4, 16, 32 ms of synthetic
               host work per step; the parent writes bench/results/pipeline.json and, with
               matplotlib, bench/results/pipeline_gain.png (gain vs host share);
  "zombies"    (first mode only) batch 1 and 32, three waves of requests with sampled
               output lengths (tiny model, EOS calibrated to a mean of about 60 tokens): the
               share of computed rows that belonged to finished sequences;
  "busy"       the device's busy fraction in each loop, from a `jax.profiler` trace.

Modes, each in its own subprocess (pinning must happen before JAX starts its threads):
  default  XLA and the host share every core;
  pinned   XLA's threads on core 0 and the Python host on core 1: the CPU stands in for an
           accelerator that runs beside the host (DESIGN.md section 7).

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
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "moondream2-tiny", "tokenizer.json")
RESULTS = os.path.join(HERE, "results")
PROMPT_TOKENS = 16
# XLA's CPU runtime allocates each execution's temporaries with malloc.  glibc gives each
# thread its own arena and hands freed memory of big blocks back to the OS, so every execution
# pays page faults and zeroing for its temporaries (measured: ~33k faults, ~30% of a batch-32
# forward).  An accelerator's runtime keeps a caching allocator, so this is a CPU artifact,
# and it would penalise the two-program step (forward, then sample) against the one-program
# ceiling.  One arena, no mmap, no trimming: freed memory is reused, for all three loops.
CPU_ALLOCATOR_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
                     "MALLOC_TRIM_THRESHOLD_": str(64 << 30), "MALLOC_TOP_PAD_": str(512 << 20)}


def small_config():
    from photon_jax.config import MoondreamConfig, RegionConfig, TextConfig, VisionConfig

    return MoondreamConfig(
        text=TextConfig(dim=512, ff_dim=2048, n_layers=4, vocab_size=32768, max_context=1024,
                        n_heads=8, n_kv_heads=8),
        vision=VisionConfig(enc_dim=16, enc_ff_dim=32, enc_n_heads=2, enc_n_layers=1,
                            proj_out_dim=512, proj_inner_dim=128),
        region=RegionConfig(dim=512, inner_dim=128),
        dtype="float32",
    )


def tiny_config():
    from photon_jax.config import tiny

    return tiny()


def md2_config():
    from photon_jax.config import moondream2

    return moondream2("bfloat16")


def small_md3_config():
    """"small" with Moondream 3's parts: tau attention, layers 2-3 mixtures of 32 experts
    (top-4, expert width 256: the real model's 1/8 of experts per token), linear region
    heads."""
    from dataclasses import replace

    from photon_jax.config import MoEConfig, moondream3

    base, md3 = small_config(), moondream3("float32")
    return replace(md3, text=replace(base.text, rope_theta=1.5e6, tau=True,
                                     moe=MoEConfig(32, 2, 4, 256)),
                   vision=base.vision, region=replace(md3.region, dim=512))


CONFIGS = {"small": small_config, "tiny": tiny_config, "md2": md2_config,
           "small_md3": small_md3_config}


def build_model(name: str, eos_bias: float = 0.0):
    import jax

    from photon_jax.model import Model
    from photon_jax.params import init_params
    from photon_jax.tokenizer import load_tokenizer

    cfg = CONFIGS[name]()
    params = init_params(jax.random.PRNGKey(0), cfg)
    if eos_bias:
        head = params["text"]["lm_head"]
        head["b"] = head["b"].at[cfg.tokenizer.eos_id].add(eos_bias)
    return Model(cfg, params, load_tokenizer(TOKENIZER))


def prefix(model):
    """A random image prefix (BOS + 729 image positions): prompts start at 730 without
    paying for a 730-token prefill per run."""
    import jax
    import numpy as np

    from photon_jax.reference import EncodedImage

    t = model.cfg.text
    shape = (t.n_layers, model.cfg.prefix_len, t.n_kv_heads, t.head_dim)
    rng = np.random.default_rng(1)
    kv = [jax.device_put(rng.normal(size=shape).astype(np.float32)).astype(model.cfg.dtype)
          for _ in range(2)]
    return EncodedImage(kv[0], kv[1], (1, 1))


def requests(model, enc, batch: int, steps: int, settings=None, ignore_eos=True):
    import numpy as np

    from photon_jax.engine import Request
    from photon_jax.settings import Settings

    rng = np.random.default_rng(0)
    s = settings or Settings(temperature=0.0, max_tokens=steps + 1)   # token 0: the prefill
    return [Request("text", rng.integers(10, 30000, PROMPT_TOKENS).tolist(), enc, s,
                    ignore_eos=ignore_eos) for _ in range(batch)]


def engine_run(model, enc, batch: int, steps: int, pipelined: bool, host_work_ms=0.0):
    """-> (decode tokens/s, host ms per decode step, its parts in ms)."""
    from photon_jax.engine import Engine

    eng = Engine(model, max_batch_size=batch, pipelined=pipelined, host_work_ms=host_work_ms,
                 prefill_tokens=batch * model.cfg.text.max_context)
    try:
        for h in eng.submit_many(requests(model, enc, batch, steps)):
            h.result(timeout=3600)
    finally:
        eng.close()
    log = [s for s in eng.step_log() if s["kind"] == "decode"]
    assert len(log) == steps and all(s["rows"] == batch for s in log), "unexpected schedule"
    # From the first decode commit to the last: in the pipelined loop the first decode step
    # is launched while the prefill still runs, which is not decode time.
    wall = log[-1]["t_end"] - log[0]["t_end"]
    parts = {k: 1e3 * sum(s[k] for s in log[1:]) / (steps - 1)
             for k in ("launch_s", "finalize_s", "commit_s", "wait_s")}
    # The host's whole share of a step: everything between two commits except the wait for
    # the device (launch, finalize, commit, and the scheduler loop around them).
    host = 1e3 * wall / (steps - 1) - parts.pop("wait_s")
    return batch * (steps - 1) / wall, host, parts


def device_state(model, batch: int):
    import jax
    import numpy as np

    from photon_jax import skills, step as step_mod
    from photon_jax.text import init_cache

    cfg = model.cfg
    kv = init_cache(cfg, batch + 1, cfg.text.max_context)
    slot = step_mod.init_slot(cfg, batch)
    pending = step_mod.init_pending(batch + 1)
    tables = step_mod.Tables(**jax.device_put(step_mod.make_tables(cfg)))
    meta = np.zeros((4, batch), np.int32)
    meta[0] = np.arange(1, batch + 1)
    meta[1] = start(model)
    meta[2] = model.cfg.prefix_len
    samp = np.zeros((step_mod.S_ALLOW + 1, batch), np.int32)
    samp[step_mod.S_CONSTRAINT] = skills.BAN_ANSWER
    samp[step_mod.S_INDEX] = 1
    samp[step_mod.S_TOP_P] = np.ones(batch, np.float32).view(np.int32)
    samp[step_mod.S_ALLOW] = -1
    return kv, slot, pending, tables, meta, samp


def start(model) -> int:
    return model.cfg.prefix_len + PROMPT_TOKENS


def segments(model, steps: int):
    """(first position, n steps, attended length) runs of equal KV bucket, as the engine
    schedules them."""
    from photon_jax.step import kv_bucket

    ctx, first = model.cfg.text.max_context, start(model)
    out, pos = [], first
    while pos < first + steps:
        b = kv_bucket(pos + 1, ctx)
        n = min(first + steps, b) - pos
        out.append((pos, n, b))
        pos += n
    return out


def ceiling_run(model, batch: int, steps: int, warm: bool = False) -> float:
    import jax
    import numpy as np

    P = model.programs
    kv, slot, pending, tables, meta, samp = device_state(model, batch)

    def once(kv, slot, pending):
        for pos, n, b in segments(model, steps):
            m = meta.copy()
            m[1] = pos
            s = samp.copy()
            s[1] = pos - start(model) + 1
            kv, slot, pending = P.ceiling(model.params, kv, slot, pending, tables,
                                          jax.device_put(m), jax.device_put(s),
                                          jax.device_put(np.int32(n)), b)
        jax.block_until_ready(pending)
        return kv, slot, pending

    if not warm:
        kv, slot, pending = once(kv, slot, pending)   # compile every bucket
    t0 = time.perf_counter()
    once(kv, slot, pending)
    return batch * steps / (time.perf_counter() - t0)


def component_times(model, batch: int, steps: int, reps: int = 5):
    """forward and sample alone (each call synchronised), ms per step, weighted over the
    attended-length buckets of a run of `steps` steps; and the part of those calls spent
    before they returned (the dispatch, which the loops count as host time)."""
    import jax

    P = model.programs
    kv, slot, pending, tables, meta, samp = device_state(model, batch)
    meta_d, samp_d = jax.device_put(meta), jax.device_put(samp)

    def timed(call, n_calls):
        total = disp = 0.0
        for i in range(n_calls + 2):   # two untimed calls first
            t0 = time.perf_counter()
            out = call()
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            if i >= 2:
                total += time.perf_counter() - t0
                disp += t1 - t0
        return 1e3 * total / n_calls, 1e3 * disp / n_calls

    fwd = fwd_disp = 0.0
    for _, n, kv_len in segments(model, steps):
        def forward():
            nonlocal kv, slot
            kv, slot = P.forward(model.params, kv, slot, pending, meta_d, kv_len)
            return slot
        t, d = timed(forward, reps)
        fwd, fwd_disp = fwd + t * n / steps, fwd_disp + d * n / steps

    def sample():
        nonlocal slot, pending
        slot, pending = P.sample_step(model.params, slot, pending, tables, meta_d, samp_d)
        return pending
    smp, smp_disp = timed(sample, reps)
    return fwd, smp, fwd_disp + smp_disp


def median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def env_info() -> dict:
    import jax

    return {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
            "cpus": os.cpu_count(), "machine": platform.machine(),
            "date": time.strftime("%Y-%m-%d")}


def measure(model, config: str, batch: int, steps: int, mode: str, reps: int) -> dict:
    enc = prefix(model)
    # Warm-up compiles every shape the loops use (both loops run the same programs); the
    # timed runs compile nothing.
    engine_run(model, enc, batch, steps, False)
    ceiling_run(model, batch, steps, warm=True)   # its first run compiles: not kept
    # The three loops are timed side by side, `reps` times interleaved, and the median of
    # each is reported, so slow drifts of a shared machine hit all three alike.
    runs = {k: [] for k in ("blocking", "pipelined", "ceiling", "host_b", "host_p", "parts_b")}
    for _ in range(reps):
        tok_s, host, parts = engine_run(model, enc, batch, steps, False)
        runs["blocking"].append(tok_s)
        runs["host_b"].append(host)
        runs["parts_b"].append(parts)
        tok_s, host, _ = engine_run(model, enc, batch, steps, True)
        runs["pipelined"].append(tok_s)
        runs["host_p"].append(host)
        runs["ceiling"].append(ceiling_run(model, batch, steps, warm=True))
    b, p, c, hb, hp = (median(runs[k]) for k in ("blocking", "pipelined", "ceiling", "host_b",
                                                 "host_p"))
    pb = {k: median([x[k] for x in runs["parts_b"]]) for k in runs["parts_b"][0]}
    fwd, smp, disp = component_times(model, batch, steps)
    b_ms, p_ms, c_ms = (1e3 * batch / x for x in (b, p, c))
    # The cost model, from parts measured apart from the loop they predict: the device's
    # step is the ceiling's (forward + sample with no host in between), split between
    # forward and sample as the programs run alone; the host's bookkeeping is what the
    # blocking loop spends per step outside the wait.  Blocking: the host plans and
    # dispatches, the device runs forward while the host builds the constraint and
    # dispatches sample (finalize), then sample, then the host commits -- serial except that
    # overlap.  Pipelined: the host's tick hides behind the device's step, or the reverse.
    fwd_dev = c_ms * fwd / (fwd + smp)
    smp_dev = c_ms - fwd_dev
    # `sync`: what a synchronised program call costs beyond its dispatch (host time, counted
    # in the loops' bookkeeping) and its device time: handing the work to XLA's threads and
    # waking the waiting host; from the two programs run alone against the fused ceiling.
    # A blocking step waits for the device once.
    sync = max(0.0, (fwd + smp - disp - c_ms) / 2)
    overlap = min(fwd_dev, pb["finalize_s"])
    pred_b = hb + c_ms - overlap + sync
    # Pipelined, the sample of step t is dispatched only once the host has committed t-1
    # and built t's constraint ("forward first, sample later" puts the sample, not the
    # forward, behind the host), so besides max(device, host) a second chain bounds the
    # step: wake + commit + finalize + sample.
    # Unpinned, XLA's threads and the host share every core: the host's time comes out of
    # the device's, one core's worth of it (the pinned mode is the accelerator's case,
    # where the two are independent).
    steal = hb / len(os.sched_getaffinity(0)) if mode == "default" else 0.0
    pred_p = max(c_ms + steal, hb, sync + pb["commit_s"] + pb["finalize_s"] + smp_dev)
    r = lambda x: round(x, 3)  # noqa: E731
    return {
        "kind": "loops", "config": config, "batch": batch, "mode": mode, "steps": steps,
        "blocking_tok_s": round(b, 1), "pipelined_tok_s": round(p, 1),
        "ceiling_tok_s": round(c, 1), "host_ms": r(hb), "host_pipelined_ms": r(hp),
        "launch_ms": r(pb["launch_s"]), "finalize_ms": r(pb["finalize_s"]),
        "commit_ms": r(pb["commit_s"]), "forward_ms": r(fwd), "sample_ms": r(smp),
        "device_ms": r(c_ms), "sync_ms": r(sync),
        "pipelined_over_blocking": r(p / b), "pipelined_over_ceiling": r(p / c),
        "blocking_over_ceiling": r(b / c),
        "blocking_step_ms": r(b_ms), "pipelined_step_ms": r(p_ms),
        "predicted_blocking_ms": r(pred_b), "predicted_pipelined_ms": r(pred_p),
        "blocking_model_err": r(pred_b / b_ms - 1), "pipelined_model_err": r(pred_p / p_ms - 1),
        "reps": reps, **env_info(),
    }


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
    1/mean_len under the model's own logits (T = 1); every EOS finish rides one extra step."""
    import numpy as np

    from photon_jax.engine import Engine
    from photon_jax.settings import Settings

    from photon_jax import reference

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
    rows = sum(x["rows"] for x in eng.step_log() if x["kind"] == "decode")
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

    for config in args.config:
        model = build_model(config)
        for batch in args.batch:
            emit(measure(model, config, batch, args.steps, args.mode, args.reps))
    if args.host_work:
        model = build_model(args.config[-1])
        for row in host_work(model, args.config[-1], 8, args.steps, args.mode, args.reps,
                             args.host_work):
            emit(row)
    if args.zombies:   # a property of the schedule, not of the model's size: the tiny model
        for batch in (1, 32):
            emit(zombies("tiny", batch, args.mode, args.zombie_len))
    if args.busy:
        emit(busy(build_model(args.config[-1]), args.config[-1], 8, args.steps, args.mode))


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
    ap.add_argument("--modes", nargs="+", default=["default", "pinned"],
                    choices=["default", "pinned"])
    ap.add_argument("--host-work", type=float, nargs="*", default=None,
                    help="synthetic host ms per step to sweep (full run: 0 4 16 32)")
    ap.add_argument("--zombies", action="store_true", help="zombie tax at batch 1 and 32")
    ap.add_argument("--zombie-len", type=int, default=60,
                    help="mean sampled output length of the zombie-tax requests")
    ap.add_argument("--busy", action="store_true", help="busy fraction from a profiler trace")
    ap.add_argument("--out", help="write all rows (JSON) and the gain plot here "
                    "(full run: bench/results)")
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
        args.out = RESULTS
    env = dict(os.environ, **CPU_ALLOCATOR_ENV)
    # Both modes compile the same programs: the second reads them from a persistent cache
    # (compilation is never inside a timed region; this only shortens the run).
    cache = tempfile.TemporaryDirectory(prefix="photon-bench-xla-")
    env.update(JAX_COMPILATION_CACHE_DIR=cache.name, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    rows = []
    for mode in args.modes:
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--config",
               *args.config, "--steps", str(args.steps), "--reps", str(args.reps),
               "--batch", *map(str, args.batch)]
        if args.host_work:
            cmd += ["--host-work", *map(str, args.host_work)]
        # The zombie tax is a property of the schedule, not of where XLA runs: one mode.
        cmd += ["--zombies", "--zombie-len", str(args.zombie_len)] * (
            args.zombies and mode == args.modes[0])
        cmd += ["--busy"] * args.busy
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
