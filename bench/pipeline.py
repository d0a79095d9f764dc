"""How big is the GPU bubble, and how much of it does the pipelined engine hide?

For each (mode, batch) this prints one JSON line with decode tokens/s of
  - the blocking loop   (the engine with pipelined=False: launch, sample, wait, commit),
  - the pipelined loop  (the engine: commit t while forward t+1 runs),
  - the ceiling         (the same forward + sample step iterated inside one jitted
                         `lax.fori_loop`: the device alone, no host work at all),
over the same fixed number of decode steps with EOS ignored, plus the measured parts of a
step: `forward_ms` and `sample_ms` (each program alone, synchronised) and `host_ms` (the
pipelined engine's host time per step in commit + finalize/plan + launch/dispatch, not
counting the wait for the device).

Modes, each in its own subprocess (pinning must happen before JAX starts its threads):
  default  XLA and the host share every core;
  pinned   XLA's threads on core 0 and the Python host on core 1: the CPU stands in for an
           accelerator that runs beside the host (DESIGN.md section 7).

Config "small": text width 512, 4 layers, 8 heads, vocab 32768, context 1024, prompts of
746 tokens (BOS + 745 ids, the length of an image prompt), random float32 weights, greedy.

    python bench/pipeline.py            # batch 8 and 32, both modes
    python bench/pipeline.py --quick    # batch 8, 64 steps, both modes (~2 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "moondream2-tiny", "tokenizer.json")
PROMPT_LEN = 746
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


CONFIGS = {"small": small_config, "tiny": tiny_config}


def build_model(name: str):
    import jax

    from photon_jax.model import Model
    from photon_jax.params import init_params
    from photon_jax.tokenizer import load_tokenizer

    cfg = CONFIGS[name]()
    params = init_params(jax.random.PRNGKey(0), cfg)
    return Model(cfg, params, load_tokenizer(TOKENIZER))


def requests(model, batch: int, steps: int):
    import numpy as np

    from photon_jax.engine import Request
    from photon_jax.settings import Settings

    rng = np.random.default_rng(0)
    s = Settings(temperature=0.0, max_tokens=steps + 1)   # token 0 comes from the prefill
    out = []
    for _ in range(batch):
        ids = [model.cfg.tokenizer.bos_id] + rng.integers(10, 30000, PROMPT_LEN - 1).tolist()
        out.append(Request("text", ids, None, s, ignore_eos=True))
    return out


def engine_run(model, batch: int, steps: int, pipelined: bool):
    """-> (decode tokens/s, host ms per decode step)."""
    from photon_jax.engine import Engine

    eng = Engine(model, max_batch_size=batch, pipelined=pipelined,
                 prefill_tokens=batch * PROMPT_LEN)
    try:
        for h in [eng.submit(r) for r in requests(model, batch, steps)]:
            h.result(timeout=3600)
        log = [s for s in eng.step_log() if s["kind"] == "decode"]
    finally:
        eng.close()
    assert len(log) == steps and all(s["rows"] == batch for s in log), "unexpected schedule"
    # From the first decode commit to the last: in the pipelined loop the first decode step
    # is launched while the (long) prefill still runs, so its launch time would count
    # prefill work as decode time.
    wall = log[-1]["t_end"] - log[0]["t_end"]
    host = sum(s["launch_s"] + s["finalize_s"] + s["commit_s"] for s in log) / len(log)
    return batch * (steps - 1) / wall, host * 1e3


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
    meta[1] = PROMPT_LEN
    samp = np.zeros((step_mod.S_ALLOW + 1, batch), np.int32)
    samp[step_mod.S_CONSTRAINT] = skills.BAN_ANSWER
    samp[step_mod.S_INDEX] = 1
    samp[step_mod.S_TOP_P] = np.ones(batch, np.float32).view(np.int32)
    samp[step_mod.S_ALLOW] = -1
    return kv, slot, pending, tables, meta, samp


def segments(steps: int, ctx: int):
    """(first position, n steps, attended length) runs of equal KV bucket, as the engine
    would schedule them."""
    from photon_jax.step import kv_bucket

    out, pos = [], PROMPT_LEN
    while pos < PROMPT_LEN + steps:
        b = kv_bucket(pos + 1, ctx)
        n = min(PROMPT_LEN + steps, b) - pos
        out.append((pos, n, b))
        pos += n
    return out


def ceiling_run(model, batch: int, steps: int) -> float:
    import jax
    import numpy as np

    P = model.programs
    kv, slot, pending, tables, meta, samp = device_state(model, batch)
    segs = segments(steps, model.cfg.text.max_context)

    def once(kv, slot, pending):
        for pos, n, b in segs:
            m = meta.copy()
            m[1] = pos
            s = samp.copy()
            s[1] = pos - PROMPT_LEN + 1
            kv, slot, pending = P.ceiling(model.params, kv, slot, pending, tables,
                                          jax.device_put(m), jax.device_put(s),
                                          jax.device_put(np.int32(n)), b)
        jax.block_until_ready(pending)
        return kv, slot, pending

    kv, slot, pending = once(kv, slot, pending)   # compile every bucket
    t0 = time.perf_counter()
    once(kv, slot, pending)
    return batch * steps / (time.perf_counter() - t0)


def component_times(model, batch: int, reps: int = 20):
    """forward and sample alone (each call synchronised), ms, at the decode's first bucket."""
    import jax

    P = model.programs
    kv, slot, pending, tables, meta, samp = device_state(model, batch)
    meta_d, samp_d = jax.device_put(meta), jax.device_put(samp)
    kv_len = segments(1, model.cfg.text.max_context)[0][2]
    res = {}
    for name in ("forward", "sample"):
        for i in range(reps + 3):
            if i == 3:
                t0 = time.perf_counter()
            if name == "forward":
                kv, slot = P.forward(model.params, kv, slot, pending, meta_d, kv_len)
                jax.block_until_ready(slot)
            else:
                slot, pending = P.sample_step(model.params, slot, pending, tables, meta_d,
                                              samp_d)
                jax.block_until_ready(pending)
        res[name] = (time.perf_counter() - t0) / reps * 1e3
    return res["forward"], res["sample"]


def median(xs):
    return sorted(xs)[len(xs) // 2]


def measure(config: str, batch: int, steps: int, mode: str, reps: int) -> dict:
    model = build_model(config)
    # Warm-up compiles every shape the loops use; the timed runs compile nothing.
    for pipelined in (False, True):
        engine_run(model, batch, steps, pipelined)
    # The three loops are timed side by side, `reps` times interleaved, and the median of
    # each is reported, so slow drifts of a shared machine hit all three alike.
    runs = {"blocking": [], "pipelined": [], "ceiling": [], "host": []}
    for _ in range(reps):
        tok_s, _ = engine_run(model, batch, steps, False)
        runs["blocking"].append(tok_s)
        tok_s, host_ms = engine_run(model, batch, steps, True)
        runs["pipelined"].append(tok_s)
        runs["host"].append(host_ms)
        runs["ceiling"].append(ceiling_run(model, batch, steps))
    blocking, pipelined, ceiling = (median(runs[k]) for k in ("blocking", "pipelined",
                                                              "ceiling"))
    fwd, smp = component_times(model, batch)
    import jax

    return {
        "config": config, "batch": batch, "mode": mode, "steps": steps,
        "blocking_tok_s": round(blocking, 1), "pipelined_tok_s": round(pipelined, 1),
        "ceiling_tok_s": round(ceiling, 1), "host_ms": round(median(runs["host"]), 3),
        "forward_ms": round(fwd, 3), "sample_ms": round(smp, 3),
        "pipelined_over_blocking": round(pipelined / blocking, 3),
        "pipelined_over_ceiling": round(pipelined / ceiling, 3),
        "blocking_over_ceiling": round(blocking / ceiling, 3),
        "reps": reps, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
        "cpus": os.cpu_count(), "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
    }


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
    for batch in args.batch:
        print(json.dumps(measure(args.config, batch, args.steps, args.mode, args.reps)),
              flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small config, batch 8, both modes")
    ap.add_argument("--config", default="small", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--steps", type=int, default=128, help="decode steps per run")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    ap.add_argument("--modes", nargs="+", default=["default", "pinned"],
                    choices=["default", "pinned"])
    ap.add_argument("--mode", help=argparse.SUPPRESS)   # set in the child process
    args = ap.parse_args(argv)
    if args.mode:
        child(args)
        return 0
    if args.quick:
        args.config, args.batch, args.steps, args.reps = "small", [8], 64, 2
    env = dict(os.environ, **CPU_ALLOCATOR_ENV)
    for mode in args.modes:
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--config",
               args.config, "--steps", str(args.steps), "--reps", str(args.reps),
               "--batch", *map(str, args.batch)]
        r = subprocess.run(cmd, cwd=ROOT, env=env)
        if r.returncode:
            return r.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
