"""What does a row held to a JSON schema (or asking for log-probabilities) cost the batch's
step?

One engine (pipelined, as users run it) decodes a batch of `--batch` rows for `--steps`
steps, EOS ignored, with 0, k... of its rows held to a JSON schema (`--constrained`, default
0 8 32), timed in turns (0, 8, 32, 0, 8, 32, ...: the machine's drift hits each alike) and
reported as medians.  One JSON line ("kind": "shapes") per run:

  step_ms        {constrained rows: the median decode step, first decode commit to last}
  over_none      each step against the unconstrained batch's
  finalize_ms    the host's finalize per step (where the masks are computed), median
  mask_us        the host time of one row's mask (llguidance's fill + copy), measured alone
                 over the same schema's outputs, and `consume_us`, one committed token
  mask_bytes     bytes of masks uploaded per step at each count

The schema is an object with a boolean, an enum and an array of strings (an answer that
never has to end: every step of the run is constrained).  The model is a benchmark config
(random weights) with the byte-level test tokenizer (tests/fixtures/chat), since shapes are
defined over token bytes.

With `--logprobs K` the rows counted by `--constrained` ask for log-probabilities with K
alternatives instead ("kind": "logprobs"; the host's mask and consume costs are not measured,
and `copy_bytes` is what each step copies back to the host besides the sampled ids).

    python bench/shapes.py                         # small, batch 32, 48 steps, 3 rounds
    python bench/shapes.py --logprobs 5 --constrained 0 1 32
    python bench/shapes.py --config tiny --batch 4 --constrained 0 2 --steps 8 --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from common import (CONFIGS, PROMPT_TOKENS, ROOT, build_model, env_info, median, prefix,
                    reexec_with_allocator_env)

SCHEMA = {"type": "object",
          "properties": {"indoor": {"type": "boolean"},
                         "animal": {"enum": ["cat", "dog", "bird"]},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["indoor", "animal", "tags"]}


def _model(config: str):
    from tokenizers import Tokenizer

    from photon_jax.model import Model

    base = build_model(config)
    tok = Tokenizer.from_file(os.path.join(ROOT, "tests", "fixtures", "chat", "tokenizer.json"))
    return Model(base.cfg, base.params, tok, device=base.device)


def _run(eng, model, enc, batch: int, constrained: int, steps: int, logprobs=None):
    import numpy as np

    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import Settings, parse

    shape = parse({"json_schema": SCHEMA}).shape
    rng = np.random.default_rng(0)
    reqs = [Request("text", rng.integers(10, 290, PROMPT_TOKENS).tolist(), enc,
                    Settings(temperature=0.0, max_tokens=steps + 1,
                             shape=shape if i < constrained and logprobs is None else None,
                             logprobs=logprobs if i < constrained else None),
                    ignore_eos=True)
            for i in range(batch)]
    before = len(eng.step_log())
    for h in eng.submit_many(reqs):
        h.result(timeout=3600)
    log = [s for s in eng.step_log()[before:] if s["kind"] == "decode"]
    assert len(log) == steps and all(s["rows"] == batch for s in log), "unexpected schedule"
    wall = log[-1]["t_end"] - log[0]["t_end"]
    fin = [s["finalize_s"] for s in log[1:]]
    return 1e3 * wall / (steps - 1), 1e3 * median(fin)


def _host_costs(eng, n: int = 400) -> dict:
    """One row's mask and consume, timed alone along a greedy walk through the schema."""
    import numpy as np

    from photon_jax.engine.settings import parse

    m = eng.grammars.matcher(*parse({"json_schema": SCHEMA}).shape)
    t_mask = t_cons = 0.0
    rng = np.random.default_rng(0)
    for _ in range(n):
        t0 = time.perf_counter()
        mask = m.mask()
        t1 = time.perf_counter()
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[1:]) + 1   # anything but EOS: the walk goes on
        if allowed.size == 0:
            break
        m.consume(int(rng.choice(allowed)))
        t_mask += t1 - t0
        t_cons += time.perf_counter() - t1
    return {"mask_us": round(1e6 * t_mask / n, 1), "consume_us": round(1e6 * t_cons / n, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--constrained", type=int, nargs="+", default=[0, 8, 32])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--logprobs", type=int, default=None, metavar="K",
                    help="the counted rows ask for log-probabilities (K alternatives) instead "
                         "of a shape")
    args = ap.parse_args(argv)
    reexec_with_allocator_env(__file__)

    from photon_jax.engine.core import Engine

    model = _model(args.config)
    enc = prefix(model)
    # Single steps: the run times one step's price per share of constrained rows, and a
    # batch with none would otherwise run in bursts (docs/host.md).
    eng = Engine(model, max_batch_size=args.batch, decode_burst=1,
                 prefill_tokens=args.batch * (model.cfg.prefix_len + 64))
    try:
        lp = args.logprobs
        for k in args.constrained:   # compiles (the masked sampler on first use)
            _run(eng, model, enc, args.batch, k, 4, lp)
        steps = {k: [] for k in args.constrained}
        fins = {k: [] for k in args.constrained}
        for _ in range(args.reps):
            for k in args.constrained:
                s, f = _run(eng, model, enc, args.batch, k, args.steps, lp)
                steps[k].append(s)
                fins[k].append(f)
        host = _host_costs(eng) if lp is None else {}
    finally:
        eng.close()
    words = (model.cfg.text.vocab_size + 31) // 32
    base = median(steps[args.constrained[0]])
    if lp is None:
        cost = {"mask_bytes": {k: (4 * words * args.batch if k else 0)
                               for k in args.constrained}}
    else:   # the slot's logprobs rows (`step.Slot.logprobs`), int32
        from photon_jax.engine.step import TOP_LOGPROBS

        row = 4 * (1 + 2 * TOP_LOGPROBS)
        cost = {"logprobs": lp, "copy_bytes": {k: (row * args.batch if k else 0)
                                               for k in args.constrained}}
    print(json.dumps({
        "kind": "shapes" if lp is None else "logprobs", "config": args.config,
        "batch": args.batch, "steps": args.steps, "reps": args.reps,
        "step_ms": {k: round(median(v), 2) for k, v in steps.items()},
        "over_none": {k: round(median(v) / base, 3) for k, v in steps.items()},
        "finalize_ms": {k: round(median(v), 3) for k, v in fins.items()},
        **cost,
        "runs_step_ms": {k: [round(x, 2) for x in v] for k, v in steps.items()},
        **host, **env_info()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
