"""Decode bursts (`Engine(decode_burst=k)`): k decode + sample steps of plain text rows in one
launch, the host committing k tokens at once.  The outputs must be the one-request
reference's, token for token, pipelined and blocking, whatever mix of skills shares the
steps (spatial, shaped or logprob rows make their steps single), with EOS anywhere inside a
burst (an EOS-biased model), budgets that are not multiples of k, stop strings and
cancellations."""

import numpy as np
import pytest

from photon_jax.engine import reference
from photon_jax.engine.core import Engine
from photon_jax.engine.request import Request
from photon_jax.engine.settings import Settings

from helpers import ENGINE_IMAGES as IMAGES, biased_model, run_in_waves, strip, workload


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return biased_model(tiny_ckpt, {0: 0.8})


@pytest.fixture(scope="module")
def encoded(model):
    return [reference.encode_image(model, p) for p in IMAGES]


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_bursts_equal_the_reference_in_a_mixed_workload(model, encoded, pipelined):
    items = workload(model, encoded, 3, 14)
    eng = Engine(model, max_batch_size=3, pipelined=pipelined, decode_burst=4)
    try:
        got = run_in_waves(eng, [r for r, _ in items])
    finally:
        eng.close()
    assert [strip(g) for g in got] == [w for _, w in items]
    assert eng.counters["burst"] > 0          # the text rows did run in bursts
    assert eng.counters["decode"] > 0         # and spatial rows' steps one at a time
    assert eng.sched.running == [] and (eng.sched.alloc.in_use(), eng.sched.alloc.reserved) \
        == (0, 0)


def test_text_rows_in_bursts_give_the_same_tokens_as_single_steps(model, encoded):
    """Greedy and seeded sampled text rows with budgets that are not multiples of k, EOS
    inside bursts, stop strings, and a cancelled row: every field of every result equals the
    single-step engine's, and most tokens came from bursts."""
    pr = model.prompts
    rng = np.random.default_rng(5)
    reqs = []
    for i in range(10):
        s = Settings(temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=i,
                     max_tokens=int(rng.integers(2, 23)),
                     stop=("w4",) if i == 3 else ())
        image = IMAGES[i % len(IMAGES)] if i % 3 else encoded[i % len(encoded)]
        reqs.append(Request("text", pr.caption("normal") if i % 2 else pr.query(f"w{i} w7"),
                            image, s))
    outs = {}
    for k in (1, 4, 8):   # 8: an accelerator's default
        eng = Engine(model, max_batch_size=4, decode_burst=k)
        try:
            outs[k] = run_in_waves(eng, reqs, waves=3)
        finally:
            eng.close()
        if k > 1:
            bursts = [st for st in eng.step_log() if st["kind"] == "burst"]
            assert len(bursts) >= (4 if k == 4 else 1), k
    assert outs[4] == outs[1]
    assert outs[8] == outs[1]


def test_steps_of_more_than_burst_rows_rows_stay_single(model, encoded):
    """The default policy's row limit: with burst_rows=2, steps of 3-4 rows are single steps
    and only steps of 1-2 rows burst, and the tokens are the single-step engine's."""
    pr = model.prompts
    reqs = [Request("text", pr.caption("normal"), encoded[i % len(encoded)],
                    Settings(temperature=0.0, max_tokens=4 + 6 * i)) for i in range(4)]
    outs, logs = {}, {}
    for k, rows in ((1, 8), (4, 2)):
        eng = Engine(model, max_batch_size=4, decode_burst=k, burst_rows=rows)
        try:
            outs[k] = [h.result(timeout=300) for h in [eng.submit(r) for r in reqs]]
        finally:
            eng.close()
        logs[k] = eng.step_log()
    assert outs[4] == outs[1]
    bursts = [st["rows"] for st in logs[4] if st["kind"] == "burst"]
    singles = [st["rows"] for st in logs[4] if st["kind"] == "decode"]
    assert bursts and max(bursts) <= 2
    assert singles and max(singles) > 2


@pytest.mark.parametrize("bad", [0, 65, 2.0, True])
def test_decode_burst_is_checked(model, bad):
    with pytest.raises(ValueError, match="decode_burst"):
        Engine(model, decode_burst=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_burst_rows_is_checked(model, bad):
    with pytest.raises(ValueError, match="burst_rows"):
        Engine(model, burst_rows=bad)


def test_bursts_are_an_accelerators_default_and_a_cpus_opt_in(model):
    from photon_jax.model.platforms import choose

    for name, k in (("cpu", 1), ("gpu", 8), ("tpu", 8)):
        plat = choose(model.cfg, name)
        assert (plat.decode_burst, plat.burst_rows) == (k, 8), name
    eng = Engine(model, max_batch_size=2)   # a model on this machine's CPU
    try:
        assert (eng.decode_burst, eng.burst_rows) == (1, 8)
    finally:
        eng.close()
