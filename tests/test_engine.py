"""The pipelined engine against its blocking twin and the one-request reference path, plus
the mechanisms that make pipelining safe: zombies, donation, no hidden host sync, no
retracing, failure isolation.

The randomized workloads use the fixture model with a bias on the EOS logit, so requests end
at many different lengths (text and detect/point alike) and zombies happen all the time.
"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from photon_jax.engine import hostsync, kvpool, reference, step as step_mod, stepmeta as meta_mod
from photon_jax.engine.core import Engine
from photon_jax.engine.request import EngineError, Request, RequestError
from photon_jax.engine.settings import Settings
from photon_jax.model import Model, platforms

from helpers import ENGINE_IMAGES as IMAGES, biased_model, run_in_waves, strip, workload

EOS_BIAS = 0.8


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return biased_model(tiny_ckpt, {0: EOS_BIAS})


@pytest.fixture(scope="module")
def encoded(model):
    return [reference.encode_image(model, p) for p in IMAGES]


@pytest.mark.parametrize("seed", [0, 1])
def test_pipelined_equals_blocking_equals_reference(model, encoded, seed):
    items = workload(model, encoded, seed, 14)
    reqs = [r for r, _ in items]
    cancel = {3, 9}
    outs = {}
    for pipelined in (True, False):
        eng = Engine(model, max_batch_size=3, pipelined=pipelined, record_events=True)
        try:
            outs[pipelined] = run_in_waves(eng, reqs, cancel=cancel)
        finally:
            eng.close()
        assert eng.sched.running == [] and sorted(eng.sched.free_rows) == [1, 2, 3]
        alloc = eng.sched.alloc
        assert (alloc.in_use(), alloc.reserved) == (0, 0)   # every page came back
    finishes = set()
    for i, ((req, want), got_p, got_b) in enumerate(zip(items, outs[True], outs[False])):
        for got in (got_p, got_b):
            if i in cancel and got["finish_reason"] == "cancelled":
                # Cancelled mid-way: what it produced is a prefix of the full answer.
                key = "ids" if "ids" in got else "objects"
                assert got[key] == want[key][:len(got[key])]
            else:
                assert strip(got) == want, (i, req.skill)
                finishes.add(got["finish_reason"])
    # The workload really exercised EOS and the caps.
    assert {"stop", "length"} <= finishes


def events_of(model, encoded, seed, n, waves, **engine_kw):
    """Run a random workload to the end; the engine's (event, id, commit, detail) log."""
    eng = Engine(model, record_events=True, **engine_kw)
    try:
        run_in_waves(eng, [r for r, _ in workload(model, encoded, seed, n)], waves=waves)
    finally:
        eng.close()
    return eng.sched.events


def test_zombies_are_released_one_commit_after_finalize(model, encoded):
    events = events_of(model, encoded, 7, 12, waves=2, max_batch_size=4)
    fin = {e[1]: e for e in events if e[0] == "finalize"}
    rel = {e[1]: e for e in events if e[0] == "release"}
    assert fin.keys() == rel.keys() and len(fin) == 12
    zombies = 0
    for sid, (_, _, commit, reason, refs) in fin.items():
        if reason == "stop" and refs == 1:
            zombies += 1
            assert rel[sid][2] == commit + 1   # released at the very next commit
        else:
            # Length and max_objects caps are predicted at dispatch: never a zombie.
            assert refs == 0 and rel[sid][2] == commit, (reason, refs)
    assert zombies > 0, "the workload should produce zombies"


def test_blocking_twin_never_has_zombies(model, encoded):
    events = events_of(model, encoded, 8, 8, waves=1, max_batch_size=4, pipelined=False)
    assert all(e[4] == 0 for e in events if e[0] == "finalize")


def test_capacity_counts_zombies(model, encoded):
    """A row goes to a new request only after its previous holder was released, which for a
    zombie is one commit after its result went out (freeing rows at finalize would hand a
    row to a prefill while the zombie's in-flight step still writes its KV and pending
    entries).  With 2 rows and 10 requests, rows are reused many times."""
    events = events_of(model, encoded, 9, 10, waves=1, max_batch_size=2)
    holder = {}
    zombie_reuses = 0
    fin = {e[1]: e for e in events if e[0] == "finalize"}
    for kind, sid, commit, row in (e for e in events if e[0] in ("acquire", "release")):
        if kind == "acquire":
            assert holder.get(row) is None, f"row {row} handed out while still held"
            holder[row] = sid
        else:
            assert holder.pop(row) == sid
            zombie_reuses += fin[sid][4] == 1
    assert not holder and zombie_reuses > 0


def test_no_host_sync_in_launch_and_finalize(model, encoded):
    uninstall = hostsync.install_detector()
    try:
        # The detector itself: every hidden-sync form raises inside sync_free().
        x = jnp.arange(4) + 1
        y = x.sum()
        for bad in (lambda: int(y), lambda: bool(y), lambda: float(y), lambda: y.item(),
                    lambda: np.asarray(x), lambda: np.array(x), lambda: x.tolist(),
                    lambda: print(x), lambda: jax.device_get(x), lambda: x.block_until_ready()):
            with hostsync.sync_free():
                with pytest.raises(hostsync.HostSyncError):
                    bad()
        with hostsync.sync_free():   # and implicit uploads are refused by the transfer guard
            with pytest.raises(Exception, match="[Dd]isallowed"):
                jnp.add(np.ones(3, np.float32), 1)
        assert int(y) == 10   # outside the guarded section nothing changes
        # The engine runs a whole mixed workload without tripping it.
        reqs = [r for r, _ in workload(model, encoded, 3, 8)]
        eng = Engine(model, max_batch_size=4)
        try:
            outs = run_in_waves(eng, reqs, waves=2)
        finally:
            eng.close()
        assert all(o["finish_reason"] in ("stop", "length", "max_objects") for o in outs)
        # Negative control: a launch path with a hidden sync fails its requests loudly,
        # single steps (forward) and bursts alike.
        for burst in (1, 4):
            eng = Engine(model, max_batch_size=4, decode_burst=burst)
            real = eng.programs

            def syncing(program, meta_at):
                def call(*args):
                    args[meta_at].tolist()   # the kind of bug the detector exists for
                    return program(*args)
                return call

            class Syncing:
                def __getattr__(self, name):
                    return getattr(real, name)

                forward = staticmethod(syncing(real.forward, 4))
                burst = {st: syncing(p, 5) for st, p in real.burst.items()}

            eng.programs = Syncing()
            h = eng.submit(Request("text", model.prompts.caption("short"), encoded[0],
                                   Settings(max_tokens=9)))
            with pytest.raises(EngineError, match="host sync"):
                h.result(timeout=120)
            eng.close()
    finally:
        uninstall()


def test_donated_buffers_are_consumed(model, encoded):
    eng = Engine(model, max_batch_size=2)
    try:
        pool, slots, pending = eng.dev.pool, list(eng.dev.slots), eng.dev.pending
        eng.submit(Request("text", model.prompts.caption("short"), encoded[0],
                           Settings(max_tokens=4))).result(timeout=120)
        # The arenas a decode step read (the first one at least) were donated and replaced.
        for arr in (pool.k[0][0], pool.v[-1][0], pending.token, pending.value,
                    *jax.tree.leaves(slots)):
            assert arr.is_deleted()
        mem = eng.memory()
        assert mem["kv_pool"] == eng.dev.pool.nbytes > 0 and mem["slots"] > 0
    finally:
        eng.close()


def cache_sizes(programs):
    out = {n: getattr(programs, n)._cache_size()
           for n in ("forward", "prefill_slot", "write_prefix_pages")}
    out["sample_step"] = sum(f._cache_size() for f in programs.sample_step.values())
    return out


def test_steady_state_never_retraces(model, encoded):
    """After the warm-up compiled every decode bucket, the sampling variants and the common
    prefill shapes, a long mixed run compiles no decode, sample or prefill program, and leaves
    no device memory behind."""
    eng = Engine(model, max_batch_size=4, max_context=1280, warmup=True)
    try:
        reqs = [Request("text", model.prompts.caption("normal"), encoded[i % 2],
                        Settings(max_tokens=300, temperature=0.5, seed=i), ignore_eos=True)
                for i in range(4)] + [Request("point", model.prompts.point("w7"), encoded[0],
                                              Settings(max_objects=40), ignore_eos=True)]
        eng.wait_warm(timeout=600)
        warm = cache_sizes(eng.programs)
        eng.submit(reqs[0]).result(timeout=300)
        # row buckets 1, 2, 4 x the number of arenas a step reads (one for the kernels)
        assert warm["forward"] >= 3 * len(eng.arenas.sizes) >= 3 * (2 if eng.sweep else 1)
        live = sum(x.nbytes for x in jax.live_arrays())
        outs = [h.result(timeout=300) for h in [eng.submit(r) for r in reqs]]
        assert [len(o.get("ids", o.get("objects"))) for o in outs] == [300] * 4 + [40]
        now = cache_sizes(eng.programs)
        assert {k: now[k] for k in ("forward", "sample_step", "prefill_slot")} == \
            {k: warm[k] for k in ("forward", "sample_step", "prefill_slot")}
        # Device memory is flat: the run allocated nothing that outlives it.
        assert sum(x.nbytes for x in jax.live_arrays()) == live
    finally:
        eng.close()


@pytest.mark.parametrize("attention", ["xla", "cpu-kernel"])
def test_row_is_independent_of_its_neighbours(model, attention):
    """At equal shapes, what other rows hold and where their pages lie never changes a row's
    logits (bitwise), nor does where its own pages lie: the XLA sweep (three arenas) and
    the CPU kernel (one)."""
    model = Model(model.cfg, model.params, model.prompts.tok, attention=attention)
    cfg, P = model.cfg, step_mod.programs_of(model)
    t, page, m = cfg.text, 64, 16
    sweep = platforms.sweeps(attention)
    arenas = meta_mod.Arenas((20, 20, 40) if sweep else (80,))
    rng0 = np.random.default_rng(5)
    # Row 0's 13 pages of K/V (positions 0 .. 831); other rows get random ones.
    mine = rng0.normal(size=(t.n_layers, 2, t.n_kv_heads, 13, page, t.head_dim))

    def row0_logits(seed):
        r = np.random.default_rng(seed)
        pool = np.asarray(r.normal(size=(t.n_layers, 2, t.n_kv_heads, arenas.n_pages, page,
                                         t.head_dim)), np.float32)
        free = r.permutation(np.arange(1, arenas.n_pages))
        tables = [free[:13].tolist()] + [free[13 + 14 * i:27 + 14 * i].tolist()
                                         for i in range(3)]
        pool[:, :, :, tables[0]] = mine
        positions = [831, *r.integers(780, 890, 3)]
        meta, pages, n = meta_mod.pack_decode([1, 2, 3, 4], positions, tables, 4, m, page,
                                              arenas, owners=sweep)
        split = np.split(pool, np.cumsum(arenas.sizes)[:-1], axis=3)
        kv = kvpool.KVPool(*(tuple(tuple(jnp.asarray(a[li, j]) for a in split[:n])
                                   for li in range(t.n_layers)) for j in range(2)))
        pend = step_mod.Pending(
            jnp.asarray([0, 1, *r.integers(3, size=3)], jnp.int32),
            jnp.asarray([0, 77, *r.integers(10, 999, 3)], jnp.int32),
            jnp.asarray(np.vstack([[0, 0], [0.3, 0], r.random((3, 2))]), jnp.float32))
        slot = step_mod.init_slot(cfg, 4)
        out = P.forward(model.params, kv, slot, pend, jnp.asarray(meta), jnp.asarray(pages))[1]
        return np.array(out.logits[0])

    np.testing.assert_array_equal(row0_logits(1), row0_logits(2))


def test_bad_requests_fail_alone(model, encoded, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    eng = Engine(model, max_batch_size=3, max_context=760)
    try:
        good = Request("text", model.prompts.caption("short"), encoded[0],
                       Settings(max_tokens=6, temperature=0))
        hs = [eng.submit(good),
              eng.submit(Request("text", model.prompts.caption("short"), str(bad))),
              eng.submit(Request("text", list(range(10, 60)), encoded[0])),
              eng.submit(Request("text", [], None)),
              eng.submit(good)]
        with pytest.raises(Exception, match="not an image in an accepted format"):
            hs[1].result(timeout=120)
        with pytest.raises(RequestError, match="exceeds the context of 760"):
            hs[2].result(timeout=120)
        with pytest.raises(RequestError, match="empty prompt"):
            hs[3].result(timeout=120)
        a, b = hs[0].result(timeout=120), hs[4].result(timeout=120)
        assert a == b and a["finish_reason"] in ("stop", "length")
        assert eng.alive
    finally:
        eng.close()


def test_device_error_fails_everything_and_stops(model, encoded):
    eng = Engine(model, max_batch_size=4, decode_burst=1)   # every step through the sampler
    real = eng.programs
    calls = {"n": 0}

    class Failing:
        def __getattr__(self, name):
            return getattr(real, name)

        def sampler(self, *variant):
            def failing(*args):
                calls["n"] += 1
                if calls["n"] == 4:
                    raise RuntimeError("simulated device failure")
                return real.sampler(*variant)(*args)
            return failing

    eng.programs = Failing()
    hs = [eng.submit(Request("text", model.prompts.caption("long"), encoded[i % 2],
                             Settings(max_tokens=50), ignore_eos=True)) for i in range(3)]
    for h in hs:
        with pytest.raises(EngineError, match="simulated device failure"):
            h.result(timeout=120)
    deadline = time.time() + 30
    while eng.alive and time.time() < deadline:
        time.sleep(0.01)
    assert not eng.alive
    with pytest.raises(EngineError, match="simulated device failure"):
        eng.submit(Request("text", [0, 1], None))
    eng.close(timeout=30)


def test_cancel_and_close_drain(model, encoded):
    eng = Engine(model, max_batch_size=2)
    long = Request("text", model.prompts.caption("long"), encoded[0], Settings(max_tokens=400),
                   ignore_eos=True)
    h = eng.submit(long)
    stream = h.text_stream()
    first = next(stream)
    assert isinstance(first, str)
    stream.close()   # closing the stream cancels the request
    out = h.result(timeout=120)
    assert out["finish_reason"] == "cancelled" and 0 < len(out["ids"]) < 400
    # Requests accepted before close() all finish; later submits are refused.
    hs = [eng.submit(Request("text", model.prompts.caption("short"), encoded[1],
                             Settings(max_tokens=5))) for _ in range(3)]
    eng.close(timeout=120)
    assert all(x.done() for x in hs) and all(x.result()["ids"] for x in hs)
    with pytest.raises(EngineError, match="closed"):
        eng.submit(long)
    assert threading.active_count() < 50


def test_constraint_table_and_allowed_sets(model):
    """One int per row selects the constraint; a per-row allowed set restricts further."""
    from photon_jax.engine import constraints

    cfg, P = model.cfg, step_mod.programs_of(model)
    tok = cfg.tokenizer
    v, rows = cfg.text.vocab_size, 7
    logits = np.zeros((rows, v), np.float32)
    logits[:, 100] = 5.0
    logits[:, tok.answer_id] = 9.0                 # row 1 bans it -> 100
    logits[[2, 4], tok.eos_id] = 20.0              # EOS wins the full argmax of rows 2 and 4
    c = constraints
    cons = [c.FREE, c.BAN_ANSWER, c.SPATIAL_X, c.SPATIAL_X, c.FORCE_COORD, c.FORCE_SIZE, c.FREE]
    with jax.default_device(model.device):
        slot = step_mod.init_slot(cfg, rows)
        slot = slot.replace(logits=jnp.asarray(logits),
                            hidden=jnp.asarray(np.random.default_rng(0).normal(
                                size=(rows, cfg.text.dim)), slot.hidden.dtype))
        pending = step_mod.init_pending(10)
        tables = step_mod.Tables(**jax.device_put(constraints.tables(tok, v)))
    meta = np.zeros((4, rows), np.int32)
    meta[0] = [9, 8, 7, 6, 5, 4, 3]
    samp = np.zeros((step_mod.S_ALLOW + 2, rows), np.int32)
    samp[step_mod.S_ROW] = meta[0]
    samp[step_mod.S_CONSTRAINT] = cons
    samp[step_mod.S_TOP_P] = np.ones(rows, np.float32).view(np.int32)
    samp[step_mod.S_ALLOW:] = -1
    samp[step_mod.S_ALLOW:, 6] = [200, 300]        # row 6 may only pick 200 or 300
    slot = slot.replace(logits=slot.logits.at[6, 300].set(1.0))
    slot, pending = P.sampler(False, True)(model.params, slot, pending, tables,
                                           jnp.asarray(samp))
    out = np.array(slot.out)
    ids = out[:, 0]
    assert ids.tolist() == [tok.answer_id, 100, tok.eos_id, tok.coord_id, tok.coord_id,
                            tok.size_id, 300]
    vals = out[:, 1:].view(np.float32)
    kinds = np.array(pending.kind)[meta[0]]
    assert kinds.tolist() == [0, 0, 0, 1, 1, 2, 0]
    assert np.all(vals[[0, 1, 2, 6]] == 0) and np.all(vals[[3, 4], 1] == 0)
    assert np.all((vals[3:5, 0] >= 0) & (vals[3:5, 0] < 1)) and np.all(vals[5] > 0)
    np.testing.assert_array_equal(np.array(pending.token)[meta[0]], ids)
    np.testing.assert_array_equal(np.array(pending.value)[meta[0]], vals)


def test_step_log_holds_the_step_of_every_delivered_result(model, encoded):
    """A result goes out only after the step that finished it is logged (the benchmark
    reads the log as soon as results arrive; slow host work widens the old race)."""
    eng = Engine(model, max_batch_size=2, host_work_ms=30.0)
    try:
        for n in (1, 3):
            before = len(eng.step_log())
            eng.submit(Request("text", model.prompts.caption("short"), encoded[0],
                               Settings(temperature=0, max_tokens=n), ignore_eos=True)).result(60)
            assert [s["kind"] for s in eng.step_log()[before:]] == ["prefill"] + ["decode"] * (n - 1)
    finally:
        eng.close()


def test_a_long_prompt_among_short_ones_is_prefilled_alone(model):
    """The engine holds a prefill launch to `prefill_tokens` positions in its padded shape
    (rows and prompt length rounded to its buckets), not only in the requests' own
    positions.  A 200-token text prompt and a 40-token one (240 <= 256) would launch as 4
    rows x 256 positions: the long one runs alone.  Five 40-token prompts (200) would
    launch as 8 rows x 64 = 512 (the row bucket after 4 is 8): four go together, then one.
    Every answer is what it is alone."""
    eng = Engine(model, max_batch_size=8, prefill_tokens=256)
    greedy = Settings(temperature=0, max_tokens=2)
    try:
        reqs = [Request("text", list(range(10, 210)), None, greedy)]
        reqs += [Request("text", list(range(20 + i, 60 + i)), None, greedy) for i in range(5)]
        together = [h.result(timeout=300) for h in eng.submit_many(reqs)]
        prefills = [s["rows"] for s in eng.step_log() if s["kind"] == "prefill"]
        assert prefills == [1, 4, 1]
        assert [eng.submit(r).result(timeout=300) for r in reqs] == together
    finally:
        eng.close()
