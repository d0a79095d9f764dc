"""What do LoRA adapters cost a decode step, and how long does loading one take?

Decode ceiling (`step.ceiling`: `--steps` forward + sample steps in one scan, no host work)
of a batch of `--batch` rows on a benchmark config with random weights, side by side in
turns (every variant once per round, `--reps` rounds, medians):

  none          programs without adapter slots (what an engine with max_adapters=0 runs)
  r<R>/<n>/<mode>  slot tables of `--slots` adapters of rank R, n distinct adapters among
                the rows (row i uses adapter i mod n; 0: every row in slot 0, "no adapter",
                which still pays the products), each product formulation
                (`photon_jax.model.lora.MODES`: "gather" per row, "masked" over all slots)

One JSON line ("kind": "lora") per batch size:

  tok_s         {variant: tokens/s}, and `over_none`: each against "none"
  adapter_bytes {rank/mode: adapter bytes one decode step reads: "gather" rows x rank x
                sum(in + out) x layers, "masked" (slots + 1) x rank x sum(in + out) x
                layers, times the dtype's size; a Moondream 3 config's expert adapters
                are gathered per (row, expert) assignment in both: rows x k x rank/k x
                (in + out) per expert target}, next to `weight_bytes` (what every step
                reads anyway).  Counted, not taken from XLA's cost analysis: on CPU the
                dense layers run in our kernel, a custom call XLA does not count, and XLA
                charges a gather the whole table it gathers from
  load_ms       {rank: one adapter into a slot: padding on the host, upload and the
                slot write, blocked until done (median of 5)}
  engine_load   an engine decoding base rows takes requests for 4 new adapters: the launch
                of their prefill (adapter writes included) against a prefill of base rows

    python bench/lora.py                          # small, batch 8 and 32, ranks 8 and 64
    python bench/lora.py --config tiny --batch 4 --ranks 4 --distinct 0 2 --steps 4 --reps 1
    python bench/lora.py --config small_md3 --modes gather   # Moondream 3's expert adapters
"""

from __future__ import annotations

import argparse
import json
import time

from common import (CONFIGS, PROMPT_TOKENS, build_model, device_state, env_info, median,
                    prefix, reexec_with_allocator_env)


def _tables(model, slots: int, rank: int, seed: int = 0):
    """Slot tables holding `slots` random adapters of rank `rank`."""
    import jax
    import numpy as np

    from photon_jax.model import lora

    rng = np.random.default_rng(seed)
    out = []
    for layer in lora.init_tables(model.cfg, slots, rank):
        d = {}
        for t, ab in layer.items():
            d[t] = {k: jax.device_put(np.concatenate([
                np.zeros((1, *v.shape[1:]), np.float32),
                (rng.standard_normal((slots, *v.shape[1:])) * 0.02).astype(np.float32)])
            ).astype(v.dtype) for k, v in ab.items()}
        out.append(d)
    return out


def _programs(model, mode):
    from photon_jax.engine import step

    rec = model.platform
    return step.build(model.cfg, rec.attention, grouped=rec.grouped,
                      vision_loop=rec.vision_loop, dense=rec.dense, lora_mode=mode)


def _runner(model, batch, steps, progs, tables, distinct):
    """(a function timing one ceiling run in s, the device state, the tables argument);
    compiled here."""
    import jax
    import numpy as np

    from photon_jax.engine import stepmeta as M

    st = device_state(model, batch, steps)
    metas = st["metas"].copy()
    if distinct:
        metas[:, M.M_ADAPTER, :batch] = 1 + np.arange(batch) % distinct
    put = jax.device_put
    args = (put(metas), put(st["pages"]), put(st["samp"]), st["splits"])
    extra = () if tables is None else (tables,)
    state = [st["pool"], st["slot"], st["pending"]]

    def once():
        t0 = time.perf_counter()
        state[:] = progs.ceiling(model.params, *state, st["tables"], *args, *extra)
        jax.block_until_ready(state[2])
        return time.perf_counter() - t0

    once()   # compile
    return once, st, extra


def _adapter_bytes(cfg, batch: int, slots: int, rank: int, mode: str) -> int:
    import numpy as np

    from photon_jax.model import lora

    k = cfg.text.moe.experts_per_token if cfg.text.moe else 1
    total = 0
    for layer in lora.layout(cfg, rank):
        for t, (a, b) in layer.items():
            per = a[-2] * (a[-1] + b[-2])   # rank x (in + out)
            if t in lora.EXPERT_TARGETS:
                total += per * batch * k
            else:
                total += per * (batch if mode == "gather" else slots + 1)
    return total * np.dtype(cfg.dtype).itemsize


def _adapter_file(cfg, rank: int, rng) -> dict:
    """A random adapter of rank `rank` under its published names: the reference's for
    Moondream 2, kestrel's for Moondream 3 (`convert.adapters`)."""
    import numpy as np

    from photon_jax.model import lora

    md2 = {"qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
    out = {}
    for li, layer in enumerate(lora.layout(cfg, rank)):
        for t, shapes in layer.items():
            for ab, shape in zip("AB", shapes):
                if cfg.text.moe is None:
                    key = f"text.blocks.{li}.{md2[t]}.{ab}"
                elif t in lora.EXPERT_TARGETS:
                    key = f"text_lora.moe.{li - cfg.text.n_dense}.{t}_{ab.lower()}"
                else:
                    key = f"text_lora.dense.{li}.{'up' if t == 'fc1' else 'down'}_{ab.lower()}"
                out[key] = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    return out


def _load_ms(model, rank: int, slots: int) -> float:
    import jax
    import numpy as np

    from photon_jax.engine import step
    from photon_jax.model import lora

    cfg = model.cfg
    tables = jax.device_put(lora.init_tables(cfg, slots, rank))
    write = step.programs_of(model).write_adapter
    rng = np.random.default_rng(0)
    one = [{t: {"A": rng.standard_normal(a).astype(np.float32),
                "B": rng.standard_normal(b).astype(np.float32)}
            for t, (a, b) in layer.items()} for layer in lora.layout(cfg, rank)]
    times = []
    for k in range(6):
        t0 = time.perf_counter()
        tables = write(tables, jax.device_put(np.int32(1 + k % slots)), jax.device_put(one))
        jax.block_until_ready(tables)
        times.append(time.perf_counter() - t0)
    return 1e3 * median(times[1:])


def _engine_load(model, batch: int, rank: int) -> dict:
    """Launch of a prefill taking 4 new adapters while base rows decode, against a prefill
    of 4 base rows in the same state (the second of two rounds: the first compiles)."""
    import os
    import tempfile

    import numpy as np

    from photon_jax.convert.adapters import read_adapter
    from photon_jax.engine.core import Engine
    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import Settings

    from safetensors.numpy import save_file

    cfg = model.cfg
    enc = prefix(model)
    names = {}
    with tempfile.TemporaryDirectory() as d:
        for n in range(8):   # four per round, each new to the engine
            p = os.path.join(d, f"a{n}.safetensors")
            save_file(_adapter_file(cfg, rank, np.random.default_rng(n)), p)
            names[f"a{n}"] = read_adapter(p, cfg, name=f"a{n}", max_rank=rank)
    eng = Engine(model, max_batch_size=batch + 8, max_adapters=8, max_lora_rank=rank,
                 adapters=names, prefill_tokens=(batch + 8) * (cfg.prefix_len + 64))
    rng = np.random.default_rng(0)

    def reqs(n, variants, tokens):
        return [Request("text", rng.integers(10, 290, PROMPT_TOKENS).tolist(), enc,
                        Settings(temperature=0.0, max_tokens=tokens, variant=v),
                        ignore_eos=True) for v in (variants or [None] * n)]
    try:
        out = {}
        # Round one compiles (the shapes, the slot write); round two is reported.
        for label, variants in (("base", None), ("new_adapters", ["a0", "a1", "a2", "a3"]),
                                ("base", None), ("new_adapters", ["a4", "a5", "a6", "a7"])):
            running = eng.submit_many(reqs(batch, None, 64))
            time.sleep(0.5)
            before = len(eng.step_log())
            hs = eng.submit_many(reqs(4, variants, 4))
            for h in hs + running:
                h.result(timeout=3600)
            pre = [s for s in eng.step_log()[before:] if s["kind"] == "prefill"]
            out[label + "_prefill_launch_ms"] = round(1e3 * pre[0]["launch_s"], 2)
        out["adapter_loads"] = eng.sched.adapters.loads
        return out
    finally:
        eng.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--distinct", type=int, nargs="+", default=[0, 1, 4, 8])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=["gather", "masked"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-engine", action="store_true", help="skip the engine load run")
    args = ap.parse_args(argv)
    reexec_with_allocator_env(__file__)

    from photon_jax.engine import memory, step

    model = build_model(args.config)
    for batch in args.batch:
        runs, costs = {}, {}
        plain = step.programs_of(model)
        runs["none"] = _runner(model, batch, args.steps, plain, None, 0)[0]
        for mode in args.modes:
            progs = _programs(model, mode)
            for rank in args.ranks:
                tables = _tables(model, args.slots, rank)
                for n in args.distinct:
                    name = f"r{rank}/{n}/{mode}"
                    runs[name] = _runner(model, batch, args.steps, progs, tables, n)[0]
                costs[f"r{rank}/{mode}"] = _adapter_bytes(model.cfg, batch, args.slots, rank,
                                                         mode)
        times = {k: [] for k in runs}
        for _ in range(args.reps):
            for k, f in runs.items():
                times[k].append(f())
        tok = {k: batch * args.steps / median(v) for k, v in times.items()}
        rec = {"kind": "lora", "config": args.config, "batch": batch, "steps": args.steps,
               "reps": args.reps, "slots": args.slots,
               "tok_s": {k: round(v, 1) for k, v in tok.items()},
               "over_none": {k: round(v / tok["none"], 3) for k, v in tok.items()},
               "adapter_bytes": costs,
               "weight_bytes": memory.weight_bytes(model.cfg),
               "load_ms": {r: round(_load_ms(model, r, args.slots), 2) for r in args.ranks},
               **env_info()}
        if not args.no_engine and batch == args.batch[-1]:
            rec["engine_load"] = _engine_load(model, batch, args.ranks[0])
        print(json.dumps(rec), flush=True)
        runs.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
