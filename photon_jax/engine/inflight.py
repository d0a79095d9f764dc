"""The pipeline state machine: which steps are in flight, in which slot, in which order.

Pure Python, no JAX (docs/architecture.md, "Engine invariants").  A step goes through three states:

    launched  (forward dispatched, not yet sampled)        -> `launch`        (at most one)
    pending   (sampled, host copy started, not committed)  -> `queue`         (FIFO)
    committing (popped for commit, host still reading it)  -> `committing`    (at most one)

Exactly two slots exist.  A slot is in use while any step holding it is in one of the three
states; it becomes free only at `on_step_completed`, after the commit that read its host
copies has finished ("two-phase completion").  Freeing it at `pop_oldest` instead would let
the next launch donate arrays the commit is still reading: the JAX form of Photon's I6 bug.
Free slots are handed out lowest-first, so with one step per tick the slots alternate.
"""

from __future__ import annotations

from collections import deque
from typing import Any

N_SLOTS = 2


class PipelineError(RuntimeError):
    """A transition that the scheduler must never attempt (a bug, not a user error)."""


class PipelineState:
    def __init__(self):
        self.launch: Any = None          # the step whose forward is in flight, unsampled
        self.queue: deque = deque()      # sampled steps awaiting commit, oldest at the left
        self.committing: Any = None      # the step being committed right now

    # -- queries -------------------------------------------------------------------------

    def used_mask(self) -> int:
        m = 0
        for s in self._holders():
            m |= 1 << s.slot
        return m

    def free_slot(self) -> int | None:
        m = self.used_mask()
        for i in range(N_SLOTS):
            if not m & (1 << i):
                return i
        return None

    def can_launch(self) -> bool:
        return self.launch is None and self.free_slot() is not None

    def in_flight(self) -> int:
        """Steps launched and not yet fully committed."""
        return sum(1 for _ in self._holders())

    def idle(self) -> bool:
        return self.in_flight() == 0

    def _holders(self):
        if self.launch is not None:
            yield self.launch
        yield from self.queue
        if self.committing is not None:
            yield self.committing

    # -- transitions ---------------------------------------------------------------------

    def on_launch(self, step) -> None:
        if self.launch is not None:
            raise PipelineError("a forward is already in flight")
        if self.used_mask() & (1 << step.slot):
            raise PipelineError(f"slot {step.slot} is still in use")
        self.launch = step

    def on_sampled(self, step) -> None:
        """The in-flight forward was sampled: it now waits for its commit."""
        if self.launch is not step:
            raise PipelineError("only the in-flight step can be sampled")
        self.queue.append(step)
        self.launch = None

    def pop_oldest(self):
        """Begin committing the oldest sampled step (its slot stays busy)."""
        if self.committing is not None:
            raise PipelineError("a commit is already in progress")
        if not self.queue:
            raise PipelineError("nothing to commit")
        self.committing = self.queue.popleft()
        return self.committing

    def on_step_completed(self) -> None:
        """The commit finished reading the step's host copies: its slot is free again."""
        if self.committing is None:
            raise PipelineError("no commit in progress")
        self.committing = None
