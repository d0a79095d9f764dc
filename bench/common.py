"""What the benchmark scripts share: model configs and builders, random image prefixes, the
requests of a fixed-length decode run, the device state of a decode step built the engine's
way, the per-step cost from XLA's cost analysis next to its floor, and the CPU allocator
settings.  The scripts import this module; they never import each other.
"""

from __future__ import annotations

import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:   # run from a checkout without installing: last, so that an
    sys.path.append(ROOT)  # installed photon_jax or PYTHONPATH (caption.py --source-tree) wins
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


def reexec_with_allocator_env(script: str) -> None:
    """Restart this process with CPU_ALLOCATOR_ENV unless it is already set."""
    if os.environ.get("MALLOC_ARENA_MAX") != CPU_ALLOCATOR_ENV["MALLOC_ARENA_MAX"]:
        os.execve(sys.executable, [sys.executable, os.path.abspath(script), *sys.argv[1:]],
                  {**os.environ, **CPU_ALLOCATOR_ENV})


# -- configs and models -----------------------------------------------------------------------

def small_config():
    from photon_jax.model.config import MoondreamConfig, RegionConfig, TextConfig, VisionConfig

    return MoondreamConfig(
        text=TextConfig(dim=512, ff_dim=2048, n_layers=4, vocab_size=32768, max_context=1024,
                        n_heads=8, n_kv_heads=8),
        vision=VisionConfig(enc_dim=16, enc_ff_dim=32, enc_n_heads=2, enc_n_layers=1,
                            proj_out_dim=512, proj_inner_dim=128),
        region=RegionConfig(dim=512, inner_dim=128),
        dtype="float32",
    )


def tiny_config():
    from photon_jax.model.config import tiny

    return tiny()


def md2_config():
    from photon_jax.model.config import moondream2

    return moondream2("bfloat16")


def md3_config():
    from photon_jax.model.config import moondream3

    return moondream3("bfloat16")


def tiny_md3_config():
    """The Moondream 3 test fixture's shapes (`config.tiny_md3`): what `gpu_md2.py --config
    tiny` (the CPU smoke run) takes for its Moondream 3 row."""
    from photon_jax.model.config import tiny_md3

    return tiny_md3()


def small_md3_config():
    """"small" with Moondream 3's parts: tau attention, layers 2-3 mixtures of 32 experts
    (top-4, expert width 256: the real model's 1/8 of experts per token), linear region
    heads."""
    from dataclasses import replace

    from photon_jax.model.config import MoEConfig, moondream3

    base, md3 = small_config(), moondream3("float32")
    return replace(md3, text=replace(base.text, rope_theta=1.5e6, tau=True,
                                     moe=MoEConfig(32, 2, 4, 256)),
                   vision=base.vision, region=replace(md3.region, dim=512))


def small_v27_config():
    """"small"'s text model with the fixture's 27-layer vision tower: what the public
    reference can run (it takes the vision layer count as the patch grid side)."""
    from dataclasses import replace

    from photon_jax.model.config import tiny

    return replace(small_config(), vision=replace(tiny().vision, proj_out_dim=512))


CONFIGS = {"small": small_config, "tiny": tiny_config, "md2": md2_config, "md3": md3_config,
           "small_md3": small_md3_config, "tiny_md3": tiny_md3_config,
           "small_v27": small_v27_config}


# `--weights` of the compile benchmarks: a format for every quantizable weight
# (`config.Weights.of`), or "fp8-experts": Moondream 3.1's and 3-preview's published layout.
WEIGHT_CHOICES = ("int8", "fp8", "int4", "fp8-experts")


def with_weights(cfg, weights: str | None):
    """`cfg` with the weights of a `WEIGHT_CHOICES` entry quantized (None: as it is)."""
    from photon_jax.model.config import Weights

    if weights is None:
        return cfg
    if weights == "fp8-experts":
        return cfg.with_weights(Weights(experts="fp8"))
    return cfg.with_weights(weights)


def build_model(name: str, eos_bias: float = 0.0, dtype: str | None = None,
                kv_dtype: str | None = None, weights: str | None = None, seed: int = 0):
    """A Model of config `name` with random weights (an EOS logit bias if asked).
    `kv_dtype`: the KV pool format every run of this model gets (kept on the model as
    `bench_kv_dtype`, canonical: None = the model's dtype).  `weights`: the same random
    weights quantized ("int8", "fp8", "int4": `config.Weights.of`); None or "float32" /
    "bfloat16" / "float": unquantized.  `seed`: the random weights' draw."""
    import jax

    from photon_jax.model import Model
    from photon_jax.model.params import init_params
    from photon_jax.model.tokenizer import load_tokenizer

    cfg = CONFIGS[name]()
    if dtype:
        cfg = cfg.with_dtype(dtype)
    params = init_params(jax.random.PRNGKey(seed), cfg)
    if eos_bias:
        head = params["text"]["lm_head"]
        head["b"] = head["b"].at[cfg.tokenizer.eos_id].add(eos_bias)
    if weights not in (None, "float", "float32", "bfloat16"):
        from photon_jax.model.params import quantize_params

        cfg = cfg.with_weights(weights)
        params = quantize_params(params, cfg, free=True)
    from photon_jax.engine.kvpool import canonical_kv_dtype

    model = Model(cfg, params, load_tokenizer(TOKENIZER))
    model.bench_kv_dtype = canonical_kv_dtype(kv_dtype, cfg.dtype)
    model.bench_weights = weights if cfg.weights.any else None
    return model


def with_context(model, positions: int):
    """`model` (the same weights) with `max_context` raised to hold `positions`, in steps
    of 256; unchanged if it holds them already.  The small configs' context is 1024; a long
    conversation or several images need more, and random weights do not care where their
    rotary positions end."""
    from dataclasses import replace

    from photon_jax.model import Model

    cfg = model.cfg
    if positions <= cfg.text.max_context:
        return model
    cfg = replace(cfg, text=replace(cfg.text, max_context=-(-positions // 256) * 256))
    return Model(cfg, model.params, model.prompts.tok, device=model.device)


def label_of(model) -> str:
    """What tells a benchmark model apart in a side-by-side run: its quantized weights, its
    KV pool format, else its dtype."""
    return getattr(model, "bench_weights", None) or kv_dtype_of(model) or model.cfg.dtype


def kv_dtype_of(model):
    """The KV pool format of a benchmark model (`build_model`)."""
    return getattr(model, "bench_kv_dtype", None)


def prefix(model):
    """A random image prefix (BOS + 729 image positions, dense K/V): prompts start at 730
    without paying for a 730-token prefill per run."""
    import jax
    import numpy as np

    from photon_jax.engine.frontend import ImagePrefix

    t = model.cfg.text
    shape = (t.n_layers, model.cfg.prefix_len, t.n_kv_heads, t.head_dim)
    rng = np.random.default_rng(1)
    kv = [jax.device_put(rng.normal(size=shape).astype(np.float32)).astype(model.cfg.dtype)
          for _ in range(2)]
    return ImagePrefix(kv[0], kv[1], (1, 1))


def start(model, prompt_tokens: int = PROMPT_TOKENS) -> int:
    """The first decode position of the benchmark's requests."""
    return model.cfg.prefix_len + prompt_tokens


def requests(model, enc, batch: int, steps: int, settings=None, ignore_eos=True,
             prompt_tokens: int = PROMPT_TOKENS):
    import numpy as np

    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import Settings

    rng = np.random.default_rng(0)
    s = settings or Settings(temperature=0.0, max_tokens=steps + 1)   # token 0: the prefill
    return [Request("text", rng.integers(10, 30000, prompt_tokens).tolist(), enc, s,
                    ignore_eos=ignore_eos) for _ in range(batch)]


# -- a decode step's device state, built the engine's way -------------------------------------

def run_tokens(batch: int, positions: int, page_size: int = 64) -> int:
    """KV positions a run of `batch` rows reaching `positions` each needs: whole pages per
    row and one spare row's worth (an accelerator's pool is sized to the run, not to 90% of
    its memory: Moondream 3's 32k context x 32 rows would ask for 206 GB)."""
    from photon_jax.engine.pages import pages_for

    return (batch + 1) * pages_for(positions + 1, page_size) * page_size


def memory_plan(model, batch: int, page_size: int = 64, kv_cache_tokens: int | None = None,
                positions: int | None = None):
    """The pool an Engine(max_batch_size=batch) would get on this backend; on an accelerator
    just what `batch` rows of `positions` positions need (`run_tokens`; default: the whole
    context)."""
    import jax

    from photon_jax.engine import memory

    cfg = model.cfg
    plat = jax.devices()[0].platform
    if kv_cache_tokens is None and plat != "cpu":
        kv_cache_tokens = run_tokens(batch, positions or cfg.text.max_context, page_size)
    return memory.plan(cfg, platform=plat, max_batch_size=batch,
                       max_context=cfg.text.max_context, page_size=page_size,
                       kv_cache_tokens=kv_cache_tokens, free=None if plat != "cpu" else
                       memory.device_free(jax.devices()[0]),
                       sweep=model.platform.sweeps, kv_dtype=kv_dtype_of(model))


def row_tables(batch: int, positions: int, page_size: int) -> list[list[int]]:
    """Page tables of `batch` rows holding `positions` positions each, pages handed out
    lowest-first (page 0 is the dummy page)."""
    from photon_jax.engine.pages import pages_for

    n = pages_for(positions, page_size)
    return [list(range(1 + r * n, 1 + (r + 1) * n)) for r in range(batch)]


def decode_metas(model, batch: int, first: int, steps: int, plan, owners: bool = True):
    """Stacked (meta_NFR, pages_N2P) of `steps` decode steps of `batch` rows (rows 1..batch)
    from position `first`, and the number of arenas they read (the same for all steps).
    `owners`: the sweep's page owners (else [2, 1] stand-ins, as the engine uploads for the
    kernels)."""
    import numpy as np

    from photon_jax.engine.pages import pages_for
    from photon_jax.engine.stepmeta import pack_decode

    page = plan.page_size
    tables = row_tables(batch, first + steps, page)
    m = pages_for(model.cfg.text.max_context, page)
    n_arenas = plan.arenas.covering(max(max(t) for t in tables))
    metas, pages = [], []
    for i in range(steps):
        mt, pg, _ = pack_decode(list(range(1, batch + 1)), [first + i] * batch, tables, batch,
                                m, page, plan.arenas, owners=owners)
        width = plan.arenas.pages_in(n_arenas) if owners else 1
        full = np.zeros((2, width), np.int32)
        full[0] = batch
        full[:, :pg.shape[1]] = pg
        metas.append(mt)
        pages.append(full)
    return np.stack(metas), np.stack(pages), n_arenas


def device_state(model, batch: int, steps: int, page_size: int = 64,
                 prompt_tokens: int = PROMPT_TOKENS):
    """Everything one decode step of `batch` rows needs on the device, as the engine lays it
    out: the pool's arenas the steps read, a slot, the pending buffers, the constraint
    table, the per-step metadata of `steps` steps from `start(model)`, and sampling rows."""
    import jax
    import numpy as np

    from photon_jax.engine import constraints, step as step_mod, stepmeta as M

    cfg = model.cfg
    plan = memory_plan(model, batch, page_size, positions=start(model, prompt_tokens) + steps)
    metas, pages, n_arenas = decode_metas(model, batch, start(model, prompt_tokens), steps,
                                          plan, owners=model.platform.sweeps)
    dev = step_mod.DeviceState.init(cfg, arena_sizes=plan.arenas.sizes[:n_arenas],
                                    page_size=page_size, max_batch_size=batch,
                                    device=jax.devices()[0], kv_dtype=kv_dtype_of(model))
    samp = np.zeros((step_mod.S_ALLOW + 1, batch), np.int32)
    samp[step_mod.S_ROW] = np.arange(1, batch + 1)
    samp[step_mod.S_CONSTRAINT] = constraints.BAN_ANSWER
    samp[step_mod.S_INDEX] = 1
    samp[step_mod.S_TOP_P] = np.ones(batch, np.float32).view(np.int32)
    samp[step_mod.S_ALLOW] = -1
    # The GPU kernel's split count, planned from the last step's lengths as the engine
    # plans each step (1 for the other attentions).
    d = jax.devices()[0]
    splits = step_mod.programs_of(model).decode_splits(
        metas[-1][M.M_POS][:batch] + 1, page_size,
        getattr(d, "core_count", None) if d.platform == "gpu" else None)
    return {"pool": dev.pool, "slot": dev.slots[0], "pending": dev.pending,
            "tables": dev.tables, "metas": metas, "pages": pages, "samp": samp, "plan": plan,
            "n_arenas": n_arenas, "splits": splits}


# -- bytes: XLA's cost analysis of a decode step, next to its floor -------------------------

def decode_cost(cfg, batch: int, position: int, page_size: int = 64, platform_: str = "cpu",
                attention: str = "xla", kv_dtype: str | None = None) -> dict:
    """Bytes accessed by the compiled decode forward (`step.forward`) of `batch` rows at
    `position`, from XLA's cost analysis, compiled from abstract shapes only (nothing is
    allocated: works at full model size), next to its floor: the weights the step must read
    (text weights but the embedding table, one embedding row per row, the region encoders),
    the attended KV (every row's positions 0..position) and the logits written."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from photon_jax.engine import memory, step as step_mod
    from photon_jax.kernels import cpukernel
    from photon_jax.model import platforms
    from photon_jax.model.params import abstract_params
    from photon_jax.model.text import unstack_layers

    # The pool `memory_plan` gives the benchmark's runs on this backend.
    tokens = batch * cfg.text.max_context
    if platform_ == "cpu":
        tokens += 4 * cfg.prefix_len
    plan = memory.plan(cfg, platform=platform_, max_batch_size=batch,
                       max_context=cfg.text.max_context, page_size=page_size,
                       kv_cache_tokens=tokens, free=None, sweep=platforms.sweeps(attention),
                       kv_dtype=kv_dtype)

    class _Model:
        pass

    m = _Model()
    m.cfg = cfg
    metas, pages, n_arenas = decode_metas(m, batch, position, 1, plan,
                                          owners=platforms.sweeps(attention))
    params = jax.eval_shape(unstack_layers, abstract_params(cfg))   # as a loaded model
    dev = step_mod.DeviceState.abstract(cfg, arena_sizes=plan.arenas.sizes[:n_arenas],
                                        page_size=page_size, max_batch_size=batch,
                                        kv_dtype=kv_dtype, platform=platform_)
    programs = step_mod.build(cfg, attention)
    prog = programs.forward
    # (The GPU kernel's split count as the engine would plan this step; 1 elsewhere.)
    args = (params, dev.pool, dev.slots[0], dev.pending,
            jax.ShapeDtypeStruct(metas[0].shape, jnp.int32),
            jax.ShapeDtypeStruct(pages[0].shape, jnp.int32),
            programs.decode_splits([position + 1] * batch, page_size))
    compiled = prog.lower(*args).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    t, itemsize = cfg.text, jnp.dtype(cfg.dtype).itemsize
    # Bytes as stored: a quantized weight's codes and scales (`model.quant`).
    def nbytes(tree):
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree))

    region = params["region"]
    region_w = sum(nbytes(region[k]) for k in ("coord_encoder", "size_encoder",
                                               "coord_features", "size_features"))
    weights = (nbytes(params["text"]) - (t.vocab_size - batch) * t.dim * itemsize
               + region_w)
    # (An 8-bit pool's attended KV: its codes and their scales.)
    kv = batch * (position + 1) * memory.bytes_per_token(cfg, kv_dtype=kv_dtype)
    logits = batch * t.vocab_size * 4
    floor = weights + kv + logits
    if platforms.sweeps(attention):
        swept = plan.arenas.pages_in(n_arenas) * page_size * \
            memory.bytes_per_token(cfg, kv_dtype=kv_dtype)
    else:   # the kernels read each row's positions 0..position through its page table
        swept = kv
    xla_bytes = int(ca["bytes accessed"])
    # XLA's cost analysis sees a custom call (the CPU kernel) as reading nothing: add what
    # the kernel reads and writes -- every attended K/V element once, the queries, the
    # outputs (float32) -- so the figure is the whole step's.  (The Pallas kernel is part of
    # the compiled GPU program and counted by XLA.)
    # The dense kernel (decode steps of 4 rows or more on CPU, float32) likewise: its calls
    # read their weights and inputs whole and write their outputs.
    kernel = 0
    if attention == "cpu-kernel":
        kernel = cpukernel.bytes_accessed(kv, t.n_layers, batch, t.n_heads, t.head_dim)
        kernel += cpukernel.dense_bytes_accessed(
            jax.make_jaxpr(prog, static_argnums=(6,))(*args))
    total = xla_bytes + kernel
    return {"batch": batch, "position": position, "page_size": page_size,
            "attention": attention, "bytes_accessed": total, "xla_bytes_accessed": xla_bytes,
            "kernel_bytes": int(kernel), "floor_bytes": int(floor),
            "weights_bytes": int(weights), "attended_kv_bytes": int(kv),
            "logits_bytes": int(logits), "swept_kv_bytes": int(swept),
            "over_floor": round(total / floor, 3)}


# -- the three loops of a decode run, and the cost model (pipeline.py, gpu_md2.py) ----------

def engine_run(model, enc, batch: int, steps: int, pipelined: bool, host_work_ms=0.0,
               prompt_tokens: int = PROMPT_TOKENS, burst: int = 1):
    """-> (decode tokens/s, host ms per decode launch, its parts in ms; the parts also hold
    `tokens_per_launch` (a row's tokens: `burst` for the engine's bursts) and
    `host_us_per_token`: the host's time per committed token, all rows counted)."""
    import jax

    from photon_jax.engine.core import Engine

    # An accelerator's default pool is most of its memory; the run needs only this much.
    tokens = None if jax.devices()[0].platform == "cpu" else \
        run_tokens(batch, start(model, prompt_tokens) + steps + 1)
    # One prefill of every row's prompt, what the run's schedule needs: the scheduler counts
    # a launch's positions image prefix included, and its computed positions padding
    # included.  Not batch x the context, which the memory plan budgets as a workspace of
    # that many positions (33.7 GiB at the small config's batch 32).
    from photon_jax.engine.step import prefill_row_bucket, prompt_bucket

    eng = Engine(model, max_batch_size=batch, pipelined=pipelined, host_work_ms=host_work_ms,
                 prefill_tokens=max(batch * (model.cfg.prefix_len + prompt_tokens),
                                    prefill_row_bucket(batch, batch) * prompt_bucket(prompt_tokens)),
                 kv_cache_tokens=tokens, kv_dtype=kv_dtype_of(model), decode_burst=burst,
                 burst_rows=batch)   # bursts, where asked, at any batch: what is measured
    try:
        for h in eng.submit_many(requests(model, enc, batch, steps,
                                          prompt_tokens=prompt_tokens)):
            h.result(timeout=3600)
    finally:
        eng.close()
    steps_log = eng.step_log()
    log = [s for s in steps_log if s["kind"] in ("decode", "burst")]
    per = [burst if s["kind"] == "burst" else 1 for s in log]   # a row's tokens per launch
    assert sum(per) == steps and all(s["rows"] == batch for s in log), "unexpected schedule"
    if len(log) == 1:   # one burst was the whole run: timed from the prefill's commit
        log = [steps_log[steps_log.index(log[0]) - 1], log[0]]
        per = [0, per[0]]
    # From the first decode commit to the last: in the pipelined loop the first decode step
    # is launched while the prefill still runs, which is not decode time.
    wall = log[-1]["t_end"] - log[0]["t_end"]
    launches, tokens = len(log) - 1, sum(per[1:])
    parts = {k: 1e3 * sum(s[k] for s in log[1:]) / launches
             for k in ("launch_s", "finalize_s", "commit_s", "wait_s")}
    # The host's whole share of a launch: everything between two commits except the wait
    # for the device (launch, finalize, commit, and the scheduler loop around them).
    host = 1e3 * wall / launches - parts.pop("wait_s")
    parts["tokens_per_launch"] = tokens / launches
    parts["host_us_per_token"] = 1e3 * host * launches / (batch * tokens)
    return batch * tokens / wall, host, parts


def ceiling_run(model, batch: int, steps: int, warm: bool = False,
                prompt_tokens: int = PROMPT_TOKENS) -> float:
    """Decode tokens/s of the ceiling: `steps` forward + sample steps in one scan."""
    import jax

    from photon_jax.engine import step

    P = step.programs_of(model)
    st = device_state(model, batch, steps, prompt_tokens=prompt_tokens)
    put = jax.device_put

    def once(pool, slot, pending):
        pool, slot, pending = P.ceiling(model.params, pool, slot, pending, st["tables"],
                                        put(st["metas"]), put(st["pages"]), put(st["samp"]),
                                        st["splits"])
        jax.block_until_ready(pending)
        return pool, slot, pending

    state = (st["pool"], st["slot"], st["pending"])
    if not warm:
        state = once(*state)   # compile
    t0 = time.perf_counter()
    once(*state)
    return batch * steps / (time.perf_counter() - t0)


def component_times(model, batch: int, steps: int, reps: int = 5,
                    prompt_tokens: int = PROMPT_TOKENS):
    """forward and sample alone (each call synchronised), ms per step, at the run's middle
    step; and the part of those calls spent before they returned (the dispatch, which the
    loops count as host time)."""
    import jax

    from photon_jax.engine import step

    P = step.programs_of(model)
    st = device_state(model, batch, steps, prompt_tokens=prompt_tokens)
    i = steps // 2
    meta_d, pages_d = jax.device_put(st["metas"][i]), jax.device_put(st["pages"][i])
    samp_d = jax.device_put(st["samp"])
    pool, slot, pending = st["pool"], st["slot"], st["pending"]

    def timed(call, n_calls):
        total = disp = 0.0
        for k in range(n_calls + 2):   # two untimed calls first
            t0 = time.perf_counter()
            out = call()
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            if k >= 2:
                total += time.perf_counter() - t0
                disp += t1 - t0
        return 1e3 * total / n_calls, 1e3 * disp / n_calls

    def forward():
        nonlocal pool, slot
        pool, slot = P.forward(model.params, pool, slot, pending, meta_d, pages_d,
                               st["splits"])
        return slot

    def sample():
        nonlocal slot, pending
        slot, pending = P.sampler(False, False)(model.params, slot, pending, st["tables"],
                                                samp_d)
        return pending

    fwd, fwd_disp = timed(forward, reps)
    smp, smp_disp = timed(sample, reps)
    return fwd, smp, fwd_disp + smp_disp


def measure(model, config: str, batch: int, steps: int, mode: str, reps: int,
            prompt_tokens: int = PROMPT_TOKENS, bursts: tuple = ()) -> dict:
    import jax

    pt = {"prompt_tokens": prompt_tokens}
    enc = prefix(model)
    # Warm-up compiles every shape the loops use (both loops run the same programs); the
    # timed runs compile nothing.
    engine_run(model, enc, batch, steps, False, **pt)
    for k in bursts:
        engine_run(model, enc, batch, steps, True, burst=k, **pt)
    ceiling_run(model, batch, steps, warm=True, **pt)   # its first run compiles: not kept
    # The loops are timed side by side, `reps` times interleaved, and the median of each is
    # reported, so slow drifts of a shared machine hit all of them alike.
    runs = {k: [] for k in ("blocking", "pipelined", "ceiling", "host_b", "host_p", "parts_b",
                            "us_tok_p")}
    burst_runs = {k: {"tok_s": [], "host": [], "us_tok": []} for k in bursts}
    for _ in range(reps):
        tok_s, host, parts = engine_run(model, enc, batch, steps, False, **pt)
        runs["blocking"].append(tok_s)
        runs["host_b"].append(host)
        runs["parts_b"].append(parts)
        tok_s, host, parts_p = engine_run(model, enc, batch, steps, True, **pt)
        runs["pipelined"].append(tok_s)
        runs["host_p"].append(host)
        runs["us_tok_p"].append(parts_p["host_us_per_token"])
        for k in bursts:
            tok_s, host, parts_k = engine_run(model, enc, batch, steps, True, burst=k, **pt)
            burst_runs[k]["tok_s"].append(tok_s)
            burst_runs[k]["host"].append(host)
            burst_runs[k]["us_tok"].append(parts_k["host_us_per_token"])
        runs["ceiling"].append(ceiling_run(model, batch, steps, warm=True, **pt))
    b, p, c, hb, hp = (median(runs[k]) for k in ("blocking", "pipelined", "ceiling", "host_b",
                                                 "host_p"))
    pb = {k: median([x[k] for x in runs["parts_b"]]) for k in runs["parts_b"][0]}
    fwd, smp, disp = component_times(model, batch, steps, **pt)
    # Bytes: XLA's cost analysis of the compiled forward at the run's middle step.
    cost = decode_cost(model.cfg, batch, start(model, prompt_tokens) + steps // 2,
                       platform_=jax.devices()[0].platform, attention=model.attention,
                       kv_dtype=kv_dtype_of(model))
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
        "kv_dtype": kv_dtype_of(model) or model.cfg.dtype,
        "weights": model.cfg.weights.describe(),
        "first_position": start(model, prompt_tokens),
        "blocking_tok_s": round(b, 1), "pipelined_tok_s": round(p, 1),
        "ceiling_tok_s": round(c, 1), "host_ms": r(hb), "host_pipelined_ms": r(hp),
        "launch_ms": r(pb["launch_s"]), "finalize_ms": r(pb["finalize_s"]),
        "commit_ms": r(pb["commit_s"]), "forward_ms": r(fwd), "sample_ms": r(smp),
        "device_ms": r(c_ms), "sync_ms": r(sync),
        "pipelined_over_blocking": r(p / b), "pipelined_over_ceiling": r(p / c),
        "blocking_over_ceiling": r(b / c),
        "host_us_per_token": round(median(runs["us_tok_p"]), 1),
        **{f"burst{k}": {"pipelined_tok_s": round(median(v["tok_s"]), 1),
                         "pipelined_over_ceiling": r(median(v["tok_s"]) / c),
                         "host_ms_per_launch": r(median(v["host"])),
                         "host_us_per_token": round(median(v["us_tok"]), 1)}
           for k, v in burst_runs.items()},
        "blocking_step_ms": r(b_ms), "pipelined_step_ms": r(p_ms),
        "predicted_blocking_ms": r(pred_b), "predicted_pipelined_ms": r(pred_p),
        "blocking_model_err": r(pred_b / b_ms - 1), "pipelined_model_err": r(pred_p / p_ms - 1),
        **{k: cost[k] for k in ("bytes_accessed", "floor_bytes", "over_floor",
                                "attended_kv_bytes", "swept_kv_bytes")},
        "reps": reps, **env_info(),
    }


# -- small helpers -----------------------------------------------------------------------------

def median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def env_info() -> dict:
    import jax

    return {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
            "cpus": os.cpu_count(), "machine": platform.machine(),
            "date": time.strftime("%Y-%m-%d")}


def image_block_prefill(cfg, page_size: int, lora_args: tuple = ()) -> tuple:
    """`EnginePrograms.prefill_slot`'s arguments after (params, pool, slot) for one row whose
    prompt holds an image block (a later turn's image: `Request.blocks`) between 32 and 64
    text tokens, after the image prefix; the image's embeddings abstract."""
    import jax
    import numpy as np

    from photon_jax.engine import step as step_mod, stepmeta as M
    from photon_jax.model.config import KIND_IMAGE

    z = cfg.prefix_len - 1
    n = z + 64
    prompt = step_mod.prompt_bucket(n)
    kv_len = -(-(cfg.prefix_len + prompt) // page_size) * page_size
    pre, write, table = M.pack_prefill([1], [cfg.prefix_len], [cfg.prefix_len], [n],
                                       [list(range(1, kv_len // page_size + 1))], 1, prompt,
                                       kv_len, page_size)
    kinds = np.zeros((1, prompt), np.int32)
    ids = np.zeros((1, prompt), np.int32)
    kinds[0, 32:32 + z], ids[0, 32:32 + z] = KIND_IMAGE, np.arange(z)
    images = jax.ShapeDtypeStruct((1, z, cfg.text.dim), cfg.dtype)
    return (kinds, ids, np.zeros((1, prompt, 2), np.float32), pre, write, table,
            *(lora_args or (None,)), images)
