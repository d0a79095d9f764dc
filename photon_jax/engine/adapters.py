"""Which LoRA adapter each device slot holds, and who uses it: the engine's adapter slots.

Pure Python, no JAX.  An engine keeps `max_adapters` slots in device memory (slot 0, all
zeros, is "no adapter").  A request naming an adapter takes a slot at admission: the slot
already holding that adapter (shared by every row using it), else a free one -- never
written, or the least recently used of those no row holds -- whose old adapter is dropped.
When every slot holds an adapter some row still uses, the request waits, and from then on
no request that arrived after it takes a slot (`Scheduler.slot_blocked`), not even one whose
adapter is resident: a slot whose adapter keeps receiving new rows would otherwise never come
free.  Plain rows (slot 0) are not held back.  A slot is held from admission until the
request's row is released (the last step reading it has committed), so a slot is rewritten
only when no launched step can read it.  Slots are keyed by the adapter's contents
(`Adapter.digest`): an adapter loaded again under the same name with other weights takes
another slot, and the rows still using the old weights keep theirs.
"""

from __future__ import annotations

import collections


class AdapterSlots:
    def __init__(self, n: int):
        self.n = n
        self.holds: list = [None] * (n + 1)      # slot -> the Adapter assigned to it
        self.written: list = [None] * (n + 1)    # slot -> the Adapter its device rows hold
        self.refs = [0] * (n + 1)
        self.slot_of: dict = {}                  # digest -> slot
        self.idle = collections.OrderedDict()    # slots held by no row, least recent first
        for s in range(1, n + 1):
            self.idle[s] = None
        self.loads = 0

    def acquire(self, adapter) -> int | None:
        """The slot for a request using `adapter` (None: slot 0), or None when every slot is
        held.  The engine writes the slot before the launch that first reads it
        (`stale`)."""
        if adapter is None:
            return 0
        s = self.slot_of.get(adapter.digest)
        if s is None:
            if not self.idle:
                return None
            s = next(iter(self.idle))
            old = self.holds[s]
            if old is not None:
                del self.slot_of[old.digest]
            self.holds[s] = adapter
            self.slot_of[adapter.digest] = s
        self.idle.pop(s, None)
        self.refs[s] += 1
        return s

    def can_take(self, adapter) -> bool:
        """Would `acquire(adapter)` give a slot now?"""
        return adapter is None or adapter.digest in self.slot_of or bool(self.idle)

    def stale(self, slot: int) -> bool:
        """Must the slot's device rows be written before a launch reads them?"""
        return slot != 0 and self.written[slot] is not self.holds[slot]

    def mark_written(self, slot: int) -> None:
        self.written[slot] = self.holds[slot]
        self.loads += 1

    def release(self, slot: int) -> None:
        if slot == 0:
            return
        self.refs[slot] -= 1
        assert self.refs[slot] >= 0
        if self.refs[slot] == 0:
            self.idle[slot] = None   # most recently used: last to be taken

    def in_use(self) -> int:
        return sum(1 for r in self.refs[1:] if r)
