"""Skill state machines and the constraint table (pure Python and NumPy, no JAX): which
constraint each step of a skill asks for, its length caps, and what each constraint id means
on the device."""

import numpy as np

from photon_jax.engine import constraints, skills
from photon_jax.model import config


def test_constraint_table_is_the_rules():
    """Each id's table row says what its rule says, with the tokenizer's own ids."""
    tok = config.tiny().tokenizer
    v = 2048
    t = constraints.tables(tok, v)
    assert t["ban"].shape == (constraints.N_CONSTRAINTS, v)
    banned = {c: sorted(np.flatnonzero(t["ban"][c]).tolist())
              for c in range(constraints.N_CONSTRAINTS)}
    assert banned == {constraints.FREE: [], constraints.BAN_ANSWER: [tok.answer_id],
                      constraints.SPATIAL_X: [], constraints.FORCE_COORD: [],
                      constraints.FORCE_SIZE: [], constraints.REASON_FIRST: [],
                      constraints.REASON: sorted([tok.eos_id, tok.size_id]),
                      constraints.SEGMENT: []}
    assert t["remap"].tolist() == [-1, -1, tok.coord_id, tok.coord_id, tok.size_id, -1, -1, -1]
    assert np.flatnonzero(t["keep_eos"]).tolist() == [constraints.SPATIAL_X]
    assert np.flatnonzero(t["size_kind"]).tolist() == [constraints.FORCE_SIZE,
                                                       constraints.SEGMENT]
    # The region heads run exactly for the constraints whose rows can carry a value.
    assert constraints.REGION.tolist() == np.flatnonzero(
        t["coord_kind"] | t["size_kind"]).tolist() == [2, 3, 4, 5, 6, 7]
    assert constraints.banned(constraints.REASON, tok) == [tok.eos_id, tok.size_id]


def test_for_request_picks_the_skill():
    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import Settings

    tok = config.tiny().tokenizer
    kw = dict(prompt_end=5, max_context=100, decode=lambda ids: "")
    made = {name: type(skills.for_request(Request(image=None, prompt=[1], skill=skill,
                                                  settings=Settings(), reasoning=reasoning),
                                          tok, **kw)).__name__
            for name, skill, reasoning in (("caption", "text", False),
                                           ("reason", "text", True), ("detect", "detect", False),
                                           ("point", "point", False),
                                           ("segment", "segment", False))}
    assert made == {"caption": "TextSkill", "reason": "ReasoningSkill",
                    "detect": "PointsSkill", "point": "PointsSkill",
                    "segment": "SegmentSkill"}


def text(max_tokens=4, prompt_end=10, ctx=100):
    return skills.TextSkill(max_tokens=max_tokens, prompt_end=prompt_end, max_context=ctx,
                            eos_id=0, decode=lambda ids: "".join(f"w{i} " for i in ids))


def test_text_constraints_and_length_cap():
    t = text(max_tokens=3)
    assert [t.constraint(i) for i in range(3)] == [constraints.FREE, constraints.BAN_ANSWER,
                                                   constraints.BAN_ANSWER]
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
    assert [d.constraint(i) for i in range(4)] == [constraints.SPATIAL_X, constraints.FORCE_COORD,
                                                   constraints.FORCE_SIZE, constraints.SPATIAL_X]
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
