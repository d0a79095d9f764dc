"""Sampling constraints: the ids, what each one does, and the table the device reads.

Owns the one contract between the host state machines (`skills`), which pick a constraint id
per row and step, the device sample program (`step`), which applies it, and the one-request
oracle (`reference`), which applies the same bans.  Adding a constraint means adding one id
and one `Rule` here (and a skill that asks for it); nothing else changes.

Pure data and NumPy: no JAX, no serving state.  The skill objects that choose among these
ids, and the factory from a request to its skill, live in `skills`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Constraint ids: rows of the device table, one int per row and step in the sample metadata.
FREE = 0          # no constraint
BAN_ANSWER = 1    # the answer id is banned
SPATIAL_X = 2     # full-vocabulary argmax; EOS stays EOS, anything else becomes coord_id
FORCE_COORD = 3   # always coord_id
FORCE_SIZE = 4    # always size_id
REASON_FIRST = 5  # reasoning, first token: free, but a coord id carries a coordinate
REASON = 6        # reasoning: EOS and size banned, a coord id carries a coordinate
SEGMENT = 7       # free; a coord id carries a coordinate, a size id a (w, h) size


@dataclass(frozen=True)
class Rule:
    """What one constraint does, with tokens named by their `TokenizerConfig` field.

    ban: tokens that may not be sampled.  remap: every sampled token becomes this one (the
    argmax still decides whether it is EOS, see keep_eos).  keep_eos: a sampled EOS stays EOS
    despite remap.  coord / size: a sampled coord id / size id carries the coordinate /
    (w, h) size its hidden state decodes to (the region heads run for such rows)."""
    ban: tuple[str, ...] = ()
    remap: str | None = None
    keep_eos: bool = False
    coord: bool = False
    size: bool = False


RULES: dict[int, Rule] = {
    FREE: Rule(),
    BAN_ANSWER: Rule(ban=("answer_id",)),
    SPATIAL_X: Rule(remap="coord_id", keep_eos=True, coord=True),
    FORCE_COORD: Rule(remap="coord_id", coord=True),
    FORCE_SIZE: Rule(remap="size_id", size=True),
    REASON_FIRST: Rule(coord=True),
    REASON: Rule(ban=("eos_id", "size_id"), coord=True),
    SEGMENT: Rule(coord=True, size=True),
}
N_CONSTRAINTS = len(RULES)
assert sorted(RULES) == list(range(N_CONSTRAINTS)), "constraint ids must be 0..M-1"

# Constraints under which a sampled token may carry a region value: a step whose rows use
# none of them runs the sample program variant without the region heads.
REGION = np.array([c for c, r in RULES.items() if r.coord or r.size], np.int32)


def banned(constraint: int, tok) -> list[int]:
    """The token ids `constraint` bans (tok: a `TokenizerConfig`)."""
    return [getattr(tok, name) for name in RULES[constraint].ban]


def tables(tok, vocab_size: int) -> dict:
    """The device table's host contents, one row per constraint id: ban [M, V] bool,
    remap [M] int32 (-1 = keep), keep_eos / coord_kind / size_kind [M] bool."""
    m = N_CONSTRAINTS
    out = dict(ban=np.zeros((m, vocab_size), bool), remap=np.full(m, -1, np.int32),
               keep_eos=np.zeros(m, bool), coord_kind=np.zeros(m, bool),
               size_kind=np.zeros(m, bool))
    for c, rule in RULES.items():
        out["ban"][c, banned(c, tok)] = True
        if rule.remap is not None:
            out["remap"][c] = getattr(tok, rule.remap)
        out["keep_eos"][c], out["coord_kind"][c], out["size_kind"][c] = (
            rule.keep_eos, rule.coord, rule.size)
    return out
