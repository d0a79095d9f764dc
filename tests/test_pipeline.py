"""The pure-Python pipeline state machine and skill state machines (no JAX): slot
alternation, FIFO commits, two-phase completion, drain; skill constraints and length caps."""

import pytest

from photon_jax import skills
from photon_jax.pipeline import PipelineError, PipelineState


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
    with pytest.raises(PipelineError):
        PipelineState(3)
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


def test_drain_returns_oldest_first():
    p = PipelineState()
    for name in "ab":
        s = Step(p.free_slot(), name)
        p.on_launch(s)
        p.on_sampled(s)
    assert [s.name for s in p.drain_all()] == ["a", "b"]
    assert p.idle() and p.used_mask() == 0


def test_blocking_order_uses_one_slot():
    p = PipelineState()
    for n in range(4):
        s = Step(p.free_slot(), n)
        p.on_launch(s)
        p.on_sampled(s)
        p.pop_oldest()
        p.on_step_completed()
        assert s.slot == 0 and p.idle()


# -- skills -------------------------------------------------------------------------------


def text(max_tokens=4, prompt_end=10, ctx=100):
    return skills.TextSkill(max_tokens=max_tokens, prompt_end=prompt_end, max_context=ctx,
                            eos_id=0, decode=lambda ids: "".join(f"w{i} " for i in ids))


def test_text_constraints_and_length_cap():
    t = text(max_tokens=3)
    assert [t.constraint(i) for i in range(3)] == [skills.FREE, skills.BAN_ANSWER,
                                                   skills.BAN_ANSWER]
    # Token 2 is the last one: it is never fed back, so no step is launched for it.
    assert [t.feedable(i) for i in range(3)] == [True, True, False]
    assert t.consume(7, None) is None and t.consume(8, None) is None
    assert t.consume(9, None) == "length"
    assert t.result("length")["ids"] == [7, 8, 9]


def test_text_eos_and_context_cap():
    t = text()
    assert t.consume(5, None) is None
    assert t.consume(0, None) == "stop"
    assert t.result("stop") == {"text": "w5 ", "ids": [5], "finish_reason": "stop",
                                "output_tokens": 2}
    # prompt_end 98, context 100: tokens 0 and 1 are fed at positions 98 and 99; token 2
    # would need position 100.
    t = text(max_tokens=50, prompt_end=98, ctx=100)
    assert [t.feedable(i) for i in range(3)] == [True, True, False]


def test_points_cycle_and_caps():
    d = skills.PointsSkill(with_size=True, max_objects=2, prompt_end=10, max_context=100,
                           eos_id=0)
    assert [d.constraint(i) for i in range(4)] == [skills.SPATIAL_X, skills.FORCE_COORD,
                                                   skills.FORCE_SIZE, skills.SPATIAL_X]
    # Indices 0 and 3 start objects; index 6 would be a third object: not fed.
    assert [d.feedable(i) for i in range(7)] == [True] * 6 + [False]
    for tok, val in ((5, (0.5, 0)), (5, (0.25, 0)), (6, (0.1, 0.2))):
        assert d.consume(tok, val) is None
    assert d.objects == [{"x_min": 0.45, "y_min": 0.15, "x_max": 0.55, "y_max": 0.35}]
    for tok, val in ((5, (0.5, 0)), (5, (0.5, 0)), (6, (0.5, 0.5))):
        assert d.consume(tok, val) is None
    assert d.consume(5, (0.1, 0)) == "max_objects"
    p = skills.PointsSkill(with_size=False, max_objects=9, prompt_end=10, max_context=13,
                           eos_id=0)
    # Room for one point (positions 10, 11), not for a second one starting at index 2.
    assert [p.feedable(i) for i in range(3)] == [True, True, False]
    assert p.consume(0, (0, 0)) == "stop" and p.result("stop")["objects"] == []
