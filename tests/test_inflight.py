"""The pure-Python pipeline state machine (no JAX): slot alternation, FIFO commits,
two-phase completion, drain.  The skills it carries are tested in test_skills.py."""

import pytest

from photon_jax.engine.inflight import PipelineError, PipelineState


class Step:
    def __init__(self, slot, name=""):
        self.slot, self.name = slot, name


def run_tick(p, log, n):
    """One pipelined tick: commit oldest, finalize in flight, launch the next."""
    if p.queue:
        log.append(p.pop_oldest().name)
        p.on_step_completed()
    if p.launch is not None:
        p.on_sampled(p.launch)
    if p.can_launch():
        p.on_launch(Step(p.free_slot(), f"s{n}"))


def test_slots_alternate_and_commits_are_fifo():
    p = PipelineState()
    log, slots = [], []
    for n in range(10):
        run_tick(p, log, n)
        slots.append(p.launch.slot)
        assert p.in_flight() <= 2
    assert slots == [0, 1] * 5
    assert log == [f"s{i}" for i in range(8)]


def test_two_phase_completion_keeps_slot_busy_until_commit_finishes():
    p = PipelineState()
    a = Step(p.free_slot(), "a")
    p.on_launch(a)
    p.on_sampled(a)
    b = Step(p.free_slot(), "b")
    assert b.slot == 1
    p.on_launch(b)
    p.on_sampled(b)
    assert p.free_slot() is None and not p.can_launch()
    assert p.pop_oldest() is a
    # Popped for commit, but its host copy is still being read: the slot stays taken.
    assert p.free_slot() is None
    with pytest.raises(PipelineError):
        p.on_launch(Step(0))
    with pytest.raises(PipelineError, match="in progress"):
        p.pop_oldest()
    p.on_step_completed()
    assert p.free_slot() == 0 and p.can_launch()


def test_invalid_transitions_are_refused():
    p = PipelineState()
    with pytest.raises(PipelineError, match="nothing"):
        p.pop_oldest()
    with pytest.raises(PipelineError):
        p.on_step_completed()
    a = Step(0)
    p.on_launch(a)
    with pytest.raises(PipelineError, match="already"):
        p.on_launch(Step(1))
    with pytest.raises(PipelineError):
        p.on_sampled(Step(0))


def test_blocking_order_uses_one_slot():
    p = PipelineState()
    for n in range(4):
        s = Step(p.free_slot(), n)
        p.on_launch(s)
        p.on_sampled(s)
        p.pop_oldest()
        p.on_step_completed()
        assert s.slot == 0 and p.idle()
