"""The scheduler alone, driven with fakes (no JAX, no model): admission by pages in arrival
order, the prefill / decode fairness rule, finalize-early / release-late with zombies,
cancellations, the prefix cache's hits and pins, and requests that could never fit.

Each test plays the engine's part by hand: plan a prefill, "launch" it (start_prefill),
commit fake tokens, plan decode steps (eligible / grow / start_decode)."""

from dataclasses import dataclass

import pytest

from photon_jax.engine.request import Handle, Request, RequestError
from photon_jax.engine.scheduler import Origin, Scheduler, Seq, Source
from photon_jax.engine.step import prefill_row_bucket, prompt_bucket

PAGE = 4


class FakeRunner:
    alive, failure = True, None

    def wake(self):
        pass


class FakeSkill:
    """A text-like skill: `budget` tokens at most, stops at token 0."""
    spatial = False

    def __init__(self, budget):
        self.budget, self.count, self.ids = budget, 0, []

    def feedable(self, index):
        return index + 1 < self.budget

    def consume(self, token, value):
        self.count += 1
        if token == 0:
            return "stop"
        self.ids.append(token)
        return None if self.count < self.budget else "length"

    def result(self, reason):
        return {"ids": list(self.ids), "finish_reason": reason}


@dataclass
class FakeImage:
    key: bytes
    has_crops: bool = True
    tiling: tuple = (1, 1)


def seq(prompt_end, budget=4, image=None, prefix=0):
    h = Handle(FakeRunner(), Request("text", [1] * (prompt_end - prefix)))
    s = Seq(h, prefix, prompt_end, FakeSkill(budget))
    if image is not None:
        s.image, s.key = image, image.key
    s.ready = True
    return s


def scheduler(pages=9, rows=4, prefix_len=8, text_cache=None, **kw):
    """`text_cache`: whether finished sequences' pages join the conversation cache (by
    default only where pages are read in place: the tests that count pages of other kinds
    run without it)."""
    sc = Scheduler(max_batch_size=rows, n_pages=pages, page_size=PAGE,
                   prefix_len=prefix_len, prefill_tokens=1000, **kw)
    sc.text.enabled = kw.get("share_prefix", False) if text_cache is None else text_cache
    return sc


def admit(sc, *seqs, ctx=64):
    for s in seqs:
        s.need_pages = sc.budget_pages(s, ctx)
    sc.add(list(seqs))


def launch_prefill(sc, decode_waiting=False):
    batch = sc.plan_prefill(decode_waiting)
    sc.start_prefill(batch)
    for s in batch:
        s.pending_ready = True   # the device sampled its first token
    return batch


def decode(sc):
    rows = sc.eligible()
    index = sc.grow(rows)
    sc.start_decode(rows)
    for s in rows:
        s.pending_ready = True
    return rows, index


def test_admission_by_pages_in_arrival_order():
    sc = scheduler(pages=9)                      # 8 usable pages of 4 positions
    a, b, c = seq(10, budget=6), seq(10, budget=6), seq(2, budget=2)
    admit(sc, a, b, c)
    assert [s.need_pages for s in (a, b, c)] == [4, 4, 1]
    assert launch_prefill(sc) == [a, b]          # 8 pages: none left for c...
    assert sc.alloc.available() == 0 and list(sc.waiting) == [c]
    assert [len(s.pages) for s in (a, b)] == [3, 3]   # the prompt's pages, assigned now
    assert sc.plan_prefill(False) == []          # ...and keeps waiting while nothing frees
    for s in (a, b):
        sc.commit([s], [0], [(0.0, 0.0)], 0.0)   # EOS: finalized and released at once
    assert sc.alloc.in_use() == 0 and sc.alloc.reserved == 0
    assert launch_prefill(sc) == [c] and c.row == 1   # rows come back lowest first
    sc.flush_outbox()
    assert a.handle.result(0) == {"ids": [], "finish_reason": "stop"}


def test_a_prefill_is_held_to_its_budget_in_computed_positions_padding_included():
    """The requests' own positions fit (90 + 4 x 2 <= 100), but launched together every row
    is padded to the long prompt: 5 rows x 90 positions computed (rows x longest, the
    default cost), 5 x 128 with the engine's buckets.  The memory plan's workspace holds
    `prefill_tokens` computed positions, so the long prompt runs alone and the short ones
    together after it (4 rows x 16 = 64).  Before, all five launched at once."""
    buckets = lambda rows, longest: prefill_row_bucket(rows, 5) * prompt_bucket(longest)  # noqa: E731
    for cost in (None, buckets):
        sc = Scheduler(max_batch_size=5, n_pages=41, page_size=PAGE, prefix_len=8,
                       prefill_tokens=100, prefill_cost=cost)
        long, shorts = seq(90), [seq(2) for _ in range(4)]
        admit(sc, long, *shorts, ctx=128)
        assert launch_prefill(sc) == [long]
        assert launch_prefill(sc) == shorts


def test_a_prefill_never_follows_a_prefill_while_decode_rows_wait():
    sc = scheduler(pages=33)
    first, late = seq(4), seq(4)
    admit(sc, first)
    launch_prefill(sc)
    sc.commit([first], [5], [(0, 0)], 0.0)
    admit(sc, late)
    assert sc.plan_prefill(decode_waiting=True) == []      # decode goes first
    rows, index = decode(sc)
    assert rows == [first] and index == [1]
    assert sc.plan_prefill(decode_waiting=True) == [late]  # then the new request


def test_zombie_rows_are_released_at_the_commit_of_their_last_step():
    sc = scheduler(pages=33, record_events=True)
    s = seq(4, budget=10)
    admit(sc, s)
    launch_prefill(sc)
    decode(sc)                         # two steps in flight: the prefill and one decode
    assert s.inflight_refs == 2 and s.length == 5
    sc.commit([s], [0], [(0, 0)], 0.0)  # EOS sampled by the prefill: finalized early...
    assert s.finalized and s in sc.running and s.row == 1   # ...still in flight: a zombie
    sc.flush_outbox()
    assert s.handle.done()             # its result already went out
    assert sc.eligible() == []         # never launched again
    sc.commit([s], [7], [(0, 0)], 0.0)  # the zombie's step: discarded, row released
    assert s not in sc.running and sc.free_rows[-1] == 1 and sc.alloc.in_use() == 0
    assert [e[0] for e in sc.events] == ["acquire", "finalize", "release"]
    assert s.handle.result(0)["ids"] == []


def test_pages_are_assigned_lazily_at_page_boundaries():
    sc = scheduler(pages=33)
    s = seq(3, budget=8)               # positions 0..10: 3 pages of 4, reserved up front
    admit(sc, s)
    launch_prefill(sc)
    assert len(s.pages) == 1 and s.reserved == 2
    for step in range(5):
        sc.commit([s], [5], [(0, 0)], 0.0)
        decode(sc)                     # writes positions 3, 4, 5, 6, 7
    assert len(s.pages) == 2 and s.reserved == 1
    assert len(set(s.pages)) == 2 and 0 not in s.pages


def test_cancel_waiting_and_running():
    sc = scheduler(pages=33)
    run, wait = seq(4, budget=10), seq(4)
    admit(sc, run)
    launch_prefill(sc)
    admit(sc, wait)
    wait.handle.cancel()
    run.handle.cancel()
    sc.settle_cancels()
    assert wait.handle.result(0)["finish_reason"] == "cancelled" and not sc.waiting
    assert not run.finalized            # its prefill is in flight: finalized at its commit
    sc.commit([run], [5], [(0, 0)], 0.0)
    assert run.finalized and run not in sc.running
    sc.flush_outbox()
    assert run.handle.result(0) == {"ids": [5], "finish_reason": "cancelled"}
    assert sc.alloc.in_use() == 0


def test_prefix_cache_hit_miss_and_pins():
    sc = scheduler(pages=17, prefix_len=8)   # a prefix takes 2 pages
    img = FakeImage(b"k")
    a = seq(10, image=img, prefix=8)
    admit(sc, a)
    (planned,) = launch_prefill(sc)
    src = planned.source
    entry = src.entry
    assert src.origin is Origin.MISS and entry is not None and len(entry.pages) == 2
    assert set(entry.pages).isdisjoint(a.pages)      # its own pages, at the top of the pool
    sc.commit([a], [0], [(0, 0)], 0.0)
    b = seq(10, image=FakeImage(b"k"), prefix=8)
    admit(sc, b)
    (planned,) = launch_prefill(sc)
    assert planned.source == Source(Origin.HIT, entry)
    # A pinned entry survives pressure; an unpinned one is evicted for a new request.
    sc.commit([b], [0], [(0, 0)], 0.0)
    sc.cache.pin(b"k")
    big = seq(4 * 14 - 1, budget=1)                  # 14 pages: every one not pinned
    admit(sc, big)
    assert launch_prefill(sc) == [big] and b"k" in sc.cache.entries
    sc.commit([big], [0], [(0, 0)], 0.0)
    sc.cache.unpin(b"k")
    admit(sc, seq(4 * 15 - 1, budget=1))             # 15 pages: now it must go
    assert len(launch_prefill(sc)) == 1 and b"k" not in sc.cache.entries
    assert sc.cache.evictions == 1


def test_shared_prefix_pages_are_read_in_place_pinned_and_never_freed_by_a_request():
    """With page tables (the kernels), a request whose image is cached reads the entry's
    full prefix pages in place: it reserves and owns only the rest (the prefix's partial
    last page is its own copy), the entry stays pinned -- never evicted -- while any such
    request holds it, and freeing a request gives back its own pages only.  A miss shares
    the entry it creates too."""
    sc = scheduler(pages=21, prefix_len=10, share_prefix=True)   # prefix: 2 full + 1 partial
    sc.text.enabled = False   # the image entry alone here (the conversation cache: below)
    assert sc.shared_pages == 2 and sc.prefix_pages == 3
    a = seq(12, budget=4, image=FakeImage(b"k"), prefix=10)      # 16 positions: 4 pages
    admit(sc, a)
    (pa,) = launch_prefill(sc)
    src = pa.source
    entry = src.entry
    assert src.origin is Origin.MISS and a.pages[:2] == entry.pages[:2] and sc.n_shared(a) == 2
    assert set(a.pages[2:]).isdisjoint(entry.pages) and entry.pins == 1
    # 3 entry pages + a's own pages (1 of its prompt, 1 reserved for growth).
    assert sc.alloc.in_use() == 3 + 1 and sc.alloc.reserved == 1
    b = seq(12, budget=4, image=FakeImage(b"k"), prefix=10)
    admit(sc, b)
    (pb,) = launch_prefill(sc)
    assert pb.source == Source(Origin.HIT, entry) and b.pages[:2] == entry.pages[:2] and entry.pins == 2
    assert sc.alloc.in_use() == 3 + 1 + 1 and sc.alloc.reserved == 2
    sc.commit([a, b], [0, 0], [(0, 0)] * 2, 0.0)                 # both finish and release
    assert entry.pins == 0 and sc.alloc.in_use() == 3 and sc.alloc.reserved == 0
    # A planned prefill that is not launched gives everything back, the pin included.
    c = seq(12, budget=4, image=FakeImage(b"k"), prefix=10)
    admit(sc, c)
    planned = sc.plan_prefill(False)
    assert planned == [c] and entry.pins == 1
    sc.unplan(planned)
    assert entry.pins == 0 and sc.alloc.in_use() == 3 and sc.alloc.reserved == 0
    # Pressure while c runs: every evictable page is wanted, but c reads the entry.
    assert launch_prefill(sc) == [c] and entry.pins == 1
    sc.cache.evict_for(sc.alloc.usable)
    assert b"k" in sc.cache.entries
    sc.commit([c], [0], [(0, 0)], 0.0)
    sc.cache.evict_for(sc.alloc.usable)
    assert b"k" not in sc.cache.entries
    assert sc.alloc.in_use() == 0 and sc.alloc.reserved == 0


def test_a_request_blocked_by_pins_fails_alone():
    """A request that only pinned pages could serve fails alone, after the grace period."""
    sc = scheduler(pages=9, prefix_len=8)
    sc.cache.insert(b"pinned", 6, (1, 1), pin=True)
    blocked, small = seq(4 * 5, budget=1), seq(2, budget=1)
    admit(sc, blocked, small)
    assert launch_prefill(sc) == []          # arrival order: small waits behind blocked
    # The pins' holders get pin_wait_s to release them before the request fails.
    sc.check_stuck(idle=True, now=100.0)
    sc.check_stuck(idle=True, now=100.0 + sc.pin_wait_s / 2)
    assert not blocked.handle.done()
    sc.check_stuck(idle=True, now=100.0 + sc.pin_wait_s)
    with pytest.raises(RequestError, match="pinned by EncodedImage"):
        blocked.handle.result(0)
    assert launch_prefill(sc) == [small]


def test_an_evicted_skipped_crop_is_prepared_again():
    """A request whose crops were skipped for a predicted hit that is evicted since waits
    for the engine to prepare its image again (`take_unprepared`), once."""
    sc = scheduler(pages=17)
    s = seq(10, image=FakeImage(b"gone", has_crops=False), prefix=8)
    admit(sc, s)
    assert launch_prefill(sc) == [] and not s.ready and s.prep is None
    assert launch_prefill(sc) == []                # still waiting: not asked twice
    assert sc.take_unprepared() == [s] and sc.take_unprepared() == []


def test_fail_all_returns_every_page():
    sc = scheduler(pages=33)
    a, b = seq(4), seq(4)
    admit(sc, a)
    launch_prefill(sc)
    admit(sc, b)
    sc.fail_all(RuntimeError("device lost"))
    for s in (a, b):
        with pytest.raises(Exception, match="device lost"):
            s.handle.result(0)
    assert sc.alloc.in_use() == 0 and sc.alloc.reserved == 0 and sc.drained()


def _run(sc, s, tokens):
    """Admit, prefill and decode `s`, committing `tokens` (the last one ends it)."""
    admit(sc, s)
    assert launch_prefill(sc) == [s]
    for i, t in enumerate(tokens):
        if i:
            decode(sc)
        sc.commit([s], [t], [(0, 0)], 0.0)
    assert s not in sc.running


def _text_seq(prompt, budget=8):
    h = Handle(FakeRunner(), Request("text", list(prompt)))
    s = Seq(h, 0, len(prompt), FakeSkill(budget))
    s.ready = True
    return s


def test_conversation_pages_are_kept_read_in_place_and_evicted_leaves_first():
    """A finished sequence's full pages of written K/V (its prompt and every generated token
    but the last, never fed) join the conversation cache; a prompt that starts the same way
    reads them in place, pinned, and prefills from the first position past them; eviction
    takes the deepest pages first, never a pinned one."""
    sc = scheduler(pages=40, share_prefix=True)
    p1 = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    a = _text_seq(p1)
    _run(sc, a, [5, 6, 7, 0])                      # 10 + 3 fed positions: 3 full pages
    assert len(sc.text.pages) == 3 and sc.text.inserts == 3
    kept = [tp.page for tp in sc.text.pages.values()]
    assert sc.alloc.in_use() == 3 and sc.alloc.reserved == 0
    # The next turn: everything before, then new tokens.
    b = _text_seq(p1 + [5, 6, 7, 8, 9])
    admit(sc, b)
    assert launch_prefill(sc) == [b]
    assert b.start == 12 and sc.n_shared(b) == 3 and b.text_keys
    assert sorted(b.pages[:3]) == sorted(kept) and set(b.pages[3:]).isdisjoint(kept)
    assert all(tp.pins == 1 for tp in sc.text.pages.values())
    sc.flush_outbox()
    assert b.handle._cached_tokens == 12   # what its metrics report
    # Under pressure while b runs, nothing it reads can go.
    sc.text.evict_for(sc.alloc.usable)
    assert len(sc.text.pages) == 3
    sc.commit([b], [0], [(0, 0)], 0.0)              # b ends at once: nothing new to keep
    assert all(tp.pins == 0 for tp in sc.text.pages.values())
    # A prompt that differs inside page 1 reads page 0 only.
    c = _text_seq(p1[:5] + [99] + p1[6:] + [5, 6])
    admit(sc, c)
    launch_prefill(sc)
    assert c.start == 4 and len(c.text_keys) == 1
    sc.commit([c], [0], [(0, 0)], 0.0)
    # c kept its own pages 1 and 2 (a second chain from page 0); eviction takes leaves
    # first: never a page while a deeper page of its chain stays.
    assert len(sc.text.pages) == 5
    order = list(sc.text.pages)
    sc.text.evict_for(sc.alloc.available() + 2)
    left = list(sc.text.pages)
    assert left == order[2:] and sc.text.evictions == 2
    assert sc.alloc.in_use() == len(left)
    sc.text.clear()
    assert sc.alloc.in_use() == 0


def test_without_page_tables_a_follow_up_gets_copies_of_the_cached_pages():
    """The XLA sweep (one owner row per page): a follow-up's cached pages are listed as
    (cached, own) copies into pages it owns, none read in place; at its release its copies
    of pages already cached go back, its new full pages join the cache, and the cached pages
    it copied are unpinned."""
    sc = scheduler(pages=40, text_cache=True)
    assert sc.copy_text
    p1 = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    _run(sc, _text_seq(p1), [5, 6, 7, 0])          # 10 + 3 fed positions: 3 full pages
    cached = {tp.key: tp.page for tp in sc.text.pages.values()}
    assert len(cached) == 3 and sc.alloc.in_use() == 3
    b = _text_seq(p1 + [5, 6, 7, 8, 9])            # 15 positions: 3 cached pages, 1 new
    admit(sc, b)
    assert launch_prefill(sc) == [b]
    assert b.start == 3 * PAGE and sc.n_shared(b) == 0 and len(b.pages) == 4
    assert [src for src, _ in b.text_copies] == [cached[k] for k in b.text_keys]
    assert sorted(b.text_keys) == sorted(cached)
    assert [dst for _, dst in b.text_copies] == b.pages[:3]
    assert not set(b.pages) & set(cached.values())
    assert all(sc.text.pages[k].pins == 1 for k in b.text_keys)
    for i, t in enumerate([1, 2, 0]):              # 15 + 2 fed = 17 positions: 4 full pages
        if i:
            decode(sc)
        sc.commit([b], [t], [(0, 0)], 0.0)
    assert b not in sc.running
    assert len(sc.text.pages) == 4 and all(tp.pins == 0 for tp in sc.text.pages.values())
    assert sc.alloc.in_use() == 4 and sc.alloc.reserved == 0
    sc.text.clear()
    assert sc.alloc.in_use() == 0


def test_the_conversation_cache_skips_spatial_refs():
    sc = scheduler(pages=40, share_prefix=True)
    s = _text_seq(list(range(10, 22)))
    s.kinds = [0] * 12   # a prompt with spatial refs: values the chain cannot name
    _run(sc, s, [5, 0])
    assert not sc.text.pages and sc.alloc.in_use() == 0


def test_a_follow_up_counts_only_what_its_prefill_computes():
    """Two follow-ups whose 20-position prompts are 16 positions cached share one prefill
    under a budget of 16 computed positions (4 each, padding included); counted whole, they
    would each have taken a launch of their own."""
    sc = Scheduler(max_batch_size=4, n_pages=60, page_size=PAGE, prefix_len=8,
                   prefill_tokens=16, share_prefix=True,
                   prefill_cost=lambda rows, longest: rows * longest)
    stem = list(range(30, 46))
    for tail in ([5], [6]):                         # two first turns: 17 + 1 fed
        _run(sc, _text_seq(stem + tail[:1]), [7, 8, 0])
    follow = [_text_seq(stem + [5, 7, 8, 9]), _text_seq(stem + [6, 7, 8, 9])]
    admit(sc, *follow)
    batch = launch_prefill(sc)
    assert batch == follow and all(s.start == 16 for s in follow)
    assert all(s.prompt_end - s.start == 4 for s in follow)


def test_a_request_waiting_on_pins_is_served_when_they_are_released_in_time():
    """Pins released within the grace period: the waiting request runs, nothing fails."""
    sc = scheduler(pages=9, prefix_len=8)
    sc.cache.insert(b"pinned", 6, (1, 1), pin=True)
    blocked = seq(4 * 5, budget=1)
    admit(sc, blocked)
    assert launch_prefill(sc) == []
    sc.check_stuck(idle=True, now=0.0)
    sc.check_stuck(idle=True, now=sc.pin_wait_s - 0.01)
    sc.cache.unpin(b"pinned")
    sc.check_stuck(idle=True, now=sc.pin_wait_s + 1)   # nothing is stuck any more
    assert not blocked.handle.done()
    assert launch_prefill(sc) == [blocked]


@dataclass(frozen=True)
class FakeAdapter:
    digest: bytes


def with_adapter(s, name):
    s.adapter = None if name is None else FakeAdapter(name.encode())
    return s


def finish(sc, seqs):
    """Commit a stop token for each running row of `seqs` (all finish and release)."""
    sc.commit(seqs, [0] * len(seqs), [(0, 0)] * len(seqs), 0.0)


def test_a_plan_stopped_by_its_token_budget_holds_no_adapter_slot():
    """The second request of a variant does not fit this launch's prefill budget: it must
    hold no slot reference while it waits (a leaked one kept the slot held forever, and
    every request for another variant waited forever behind it)."""
    sc = scheduler(pages=40, rows=4, adapter_slots=1)
    sc.prefill_tokens = 12
    a1, a2 = with_adapter(seq(10), "A"), with_adapter(seq(10), "A")
    admit(sc, a1, a2)
    assert launch_prefill(sc) == [a1]            # a2 is over the budget of this launch
    assert sc.adapters.refs[1] == 1              # a1's alone
    finish(sc, [a1])
    assert sc.adapters.refs[1] == 0
    b = with_adapter(seq(4), "B")
    admit(sc, b)
    assert launch_prefill(sc) == [a2]            # arrival order
    finish(sc, [a2])
    assert launch_prefill(sc) == [b] and sc.adapters.holds[1].digest == b"B"


def test_a_request_waiting_for_a_slot_gets_the_next_free_one_before_later_arrivals():
    """One slot held by A's rows; B waits; more A requests keep arriving after B: they do
    not take the slot (it would never come free); plain rows still go ahead.  Once A's rows
    finish, B gets the slot, then the later A requests get it back."""
    sc = scheduler(pages=60, rows=8, adapter_slots=1)
    a1 = with_adapter(seq(4, budget=3), "A")
    admit(sc, a1)
    assert launch_prefill(sc) == [a1]
    b = with_adapter(seq(4), "B")
    a2, plain = with_adapter(seq(4), "A"), seq(4)
    admit(sc, b, a2, plain)
    assert launch_prefill(sc) == [plain]         # a2 waits behind b; the plain row runs
    assert sc.slot_blocked() == b.id
    finish(sc, [a1, plain])                      # A's last row releases the slot
    assert launch_prefill(sc) == [b]
    a3 = with_adapter(seq(4), "A")
    admit(sc, a3)
    assert launch_prefill(sc) == []              # a2 and a3 wait for b's row
    finish(sc, [b])
    assert launch_prefill(sc) == [a2, a3]
    finish(sc, [a2, a3])
    assert sc.adapters.in_use() == 0 and sc.slot_blocked() is None
