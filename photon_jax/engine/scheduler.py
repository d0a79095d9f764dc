"""The scheduler: who runs, in which row, with which pages -- pure Python, no JAX.

Owns the request queues (waiting for a prefill, encode jobs, running), the free rows, the
page allocator and the image-prefix cache (`pages`), and every decision the engine's tick
asks for: admission in arrival order by pages, the prefill plan (fairness with decode rows
included), the rows eligible for the next decode step, and at commit the per-row outcome
(finalize early, release late, cancellations).  The engine (`engine.Engine`) is the runner:
it packs these decisions into arrays, dispatches the device programs and reads the results
back.  Tests drive this class with fake requests and skills (tests/test_scheduler.py).

What requests learn reaches their handles through one door, the `Outbox`: the scheduler
queues each event there and the engine flushes it after logging the step it came from.
The scheduler asks nothing of the engine: images to prepare again wait in `unprepared`
for the engine to pick up.

Two clocks per sequence (`Seq`): `length` / `n_tokens` advance when a step is *launched*
(the device's view), the skill's `count` when it is *committed* (the host's view).  A row
is released -- its row and pages handed to someone else -- only once no launched step
contains it (`inflight_refs == 0`); a finalized row still in flight rides along as a
"zombie" whose outputs are discarded.
"""

from __future__ import annotations

import collections
import enum
import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass

from .adapters import AdapterSlots
from .pages import Entry, PageAllocator, PrefixCache, TextCache, chain_keys, pages_for
from .request import EngineError, Handle, RequestError


class Origin(enum.Enum):
    """Where a request's image prefix comes from (`Source.origin`)."""
    HIT = "hit"       # the prefix cache holds it: the request reads (or copies) the entry
    MISS = "miss"     # encoded for this request, into a new cache entry when there is one
    LATER = "later"   # its crops were skipped for a predicted hit evicted since: re-prepared,
                      # or its entry is still being computed a slice at a time


@dataclass(frozen=True)
class Source:
    """`Scheduler.source`'s answer (None there: no image prefix to place).  `entry`: the
    cache entry a hit reads, or the one a miss fills (None: caching off or no room)."""
    origin: Origin
    entry: Entry | None = None

    @property
    def hit(self) -> bool:
        return self.origin is Origin.HIT


LATER = Source(Origin.LATER)


class Outbox:
    """The one writer of request handles (`request.Handle`'s `deliver_*` methods): events
    are queued as they happen and delivered in order by `flush`.  An instance belongs to one
    thread (the engine's scheduler thread, or a caller failing requests it never queued)."""

    def __init__(self):
        self._queue: list = []

    def prefill(self, h: Handle, input_tokens: int, prefix_hit: bool | None,
                cached_tokens: int = 0) -> None:
        self._queue.append((h.deliver_prefill, (input_tokens, prefix_hit, cached_tokens)))

    def token(self, h: Handle, now: float) -> None:
        self._queue.append((h.deliver_token, (now,)))

    def logprob(self, h: Handle, entry: dict) -> None:
        self._queue.append((h.deliver_logprob, (entry,)))

    def text(self, h: Handle, piece: str) -> None:
        self._queue.append((h.deliver_text, (piece,)))

    def reasoning(self, h: Handle, reasoning: dict) -> None:
        self._queue.append((h.deliver_reasoning, (reasoning,)))

    def result(self, h: Handle, result=None, error: BaseException | None = None) -> None:
        self._queue.append((h.deliver_result, (result, error)))

    def flush(self) -> None:
        queued, self._queue = self._queue, []
        for deliver, args in queued:
            deliver(*args)


class Seq:
    """Scheduler-side state of one request: two clocks, in-flight refs, finalized."""
    _ids = itertools.count()

    def __init__(self, handle: Handle, prefix: int, prompt_end: int, skill):
        self.id = next(self._ids)
        self.handle, self.req = handle, handle.request
        self.prefix, self.prompt_end, self.skill = prefix, prompt_end, skill
        self.kinds = self.values = None   # per prompt position, when spatial refs are given
        self.prep = None          # Future of a PreparedImage while preprocessing
        self.image = None         # once ready: ImagePrefix / PreparedImage / EncodedImage / None
        self.encoded = False      # the image is an EncodedImage (pinned; never re-prepared)
        self.ready = False
        self.key = None           # the image's prefix-cache key (namespaced by adapter)
        self.adapter = None       # the request's LoRA adapter (`convert.adapters.Adapter`)
        self.adapter_slot = 0     # its device slot, taken at admission (0: none)
        self.source: Source | None = None   # set at admission
        self.need_pages = 0       # pages of the whole budget, reserved at admission
        self.pages: list[int] = []   # assigned pages, logical order
        self.shared = None        # key of the cache entry whose full prefix pages lead
                                  # `pages` (read, never written; pinned until freed)
        self.text_keys: list = []  # conversation-cache pages read after them (pinned)
        # (cached page, own page) pairs to copy before the prefill (the XLA sweep's pool).
        self.text_copies: list = []
        self.start = prefix       # first position the prefill computes (past cached pages)
        self.prompt_chain = None  # the prompt's full pages' hash-chain keys (computed once)
        # Image blocks inside the prompt: (first position, length, image key), and their
        # `PreparedImage`s (Futures while a worker prepares them; the key is known once
        # `Scheduler.resolve` sees them done) until the prefill is launched.
        self.blocks: list = []
        self.block_images: list = []
        self.generated: list[int] = []   # committed tokens, in order
        self.reserved = 0         # pages still promised to it (assigned lazily)
        self.row = 0
        self.length = 0           # GPU clock: next KV position written (advanced at launch)
        self.n_tokens = 0         # token indices handed to launched steps
        self.inflight_refs = 0    # launched, not yet committed steps containing this row
        self.pending_ready = False
        self.finalized = False
        self.finish_reason = None
        self.outcome = None       # (result, error) held back until release (cancellations)


class Scheduler:
    """Queues, rows, pages and the prefix cache of one engine (see the module docstring).

    max_batch_size: the rows, numbered 1..max_batch_size (row 0 is the device's dummy row);
    a step takes at most that many.  n_pages: pages of the pool (page 0 is the dummy page).
    prefix_len: positions of an image prefix.  prefill_tokens: prompt positions one prefill
    launch may take, counted twice over: the requests' positions (image prefix included),
    and the positions the launch computes, padding included (`prefill_cost(rows, longest
    prompt)`, the engine's bucketed shape; default rows x longest).  A request alone may
    exceed it (it must run somehow; the engine refuses prompts beyond its context).
    share_prefix: requests read the full pages of their image's
    cache entry and of the conversation cache in place (decode attention through page
    tables: the kernels); else they get copies of both (the XLA sweep gives each page one
    owner row)."""

    def __init__(self, *, max_batch_size: int, n_pages: int, page_size: int,
                 prefix_len: int, prefill_tokens: int, prefix_cache: bool = True,
                 record_events: bool = False, share_prefix: bool = False,
                 prefill_cost=None, spatial_ids: tuple = (), adapter_slots: int = 0,
                 pin_wait_s: float = 10.0):
        self.max_batch_size, self.page_size = max_batch_size, page_size
        self.prefill_tokens = prefill_tokens
        self.prefill_cost = prefill_cost or (lambda rows, longest: rows * longest)
        self.alloc = PageAllocator(n_pages)
        self.cache = PrefixCache(self.alloc, enabled=prefix_cache)
        self.text = TextCache(self.alloc, enabled=prefix_cache)
        # Where pages have one owner row (the XLA sweep), a hit's cached pages are copied
        # into the request's own (`text_copies`) instead of read in place.
        self.copy_text = not share_prefix
        # Generated ids fed back as values, not as tokens (coordinates, sizes): a chain of
        # token ids cannot describe their K/V, so a cached sequence ends before them.
        self.spatial_ids = frozenset(spatial_ids)
        self.prefix_pages = pages_for(prefix_len, page_size)
        # Full pages of a prefix (shared when allowed); the last, partial one is copied, as
        # the request's prompt is written into the rest of it.
        self.shared_pages = prefix_len // page_size if share_prefix else 0
        # Requests whose image must be prepared again, crops included (their crops were
        # skipped for a predicted cache hit evicted since): the engine sets their `prep`.
        self.unprepared: list[Seq] = []
        self.free_rows = list(range(max_batch_size, 0, -1))   # pop() hands out the lowest
        self.waiting: collections.deque[Seq] = collections.deque()
        self.encodes: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.last_kind: str | None = None   # "prefill" / "decode": the last launch
        self.commits = 0
        # (event, request id, commit number, detail) for the zombie-accounting tests.
        self.events: list | None = [] if record_events else None
        # Flushed by the engine after a commit's step is logged, so a caller that holds a
        # result also finds the step that produced it in the step log.
        self.outbox = Outbox()
        self.adapters = AdapterSlots(adapter_slots)
        # How long requests wait for pages pinned by EncodedImage handles, with no row
        # running, before they fail (`check_stuck`), and since when they have waited.
        self.pin_wait_s = pin_wait_s
        self.pinned_since: float | None = None

    # -- intake ---------------------------------------------------------------------------

    def budget_pages(self, seq: Seq, max_context: int) -> int:
        """Pages of the request's whole budget (prompt + what it may generate, capped by
        the context), reserved at admission."""
        if seq.skill is None:   # an encode job: its cache entry
            return self.prefix_pages
        return pages_for(min(seq.prompt_end + seq.skill.budget, max_context), self.page_size)

    def add(self, seqs: list[Seq]) -> None:
        for s in seqs:
            (self.encodes if s.skill is None else self.waiting).append(s)

    def drained(self) -> bool:
        return not self.waiting and not self.encodes and not self.running

    # -- admission ------------------------------------------------------------------------

    def resolve(self, s: Seq) -> bool:
        """Are the request's images prepared (the front one and its blocks' images)?  A
        failed preparation fails the request alone."""
        try:
            if not s.ready and s.prep is not None and s.prep.done():
                s.image, s.ready = s.prep.result(), True
                s.key = adapter_key(s.image.key, s.adapter)
            if any(isinstance(p, Future) for p in s.block_images):
                if not all(p.done() for p in s.block_images if isinstance(p, Future)):
                    return False
                s.block_images = [p.result() if isinstance(p, Future) else p
                                  for p in s.block_images]
                s.blocks = [(a, z, p.key) for (a, z, _), p in zip(s.blocks, s.block_images)]
        except Exception as e:  # unreadable image etc.: this request alone fails
            (self.encodes if s.skill is None else self.waiting).remove(s)
            self.outbox.result(s.handle, error=e)
            return False
        return s.ready

    def source(self, s: Seq) -> Source | None:
        """Where the request's image prefix comes from: a hit, a miss (its entry not made
        yet), `LATER` (re-prepared, or its entry still being computed), or None (no image,
        or a dense prefix)."""
        if s.key is None:
            return None
        entry = self.cache.get(s.key)
        if entry is not None:
            # Being computed slice by slice: the request waits for its last slice.
            return LATER if entry.pending else Source(Origin.HIT, entry)
        if s.encoded:
            raise RequestError("this EncodedImage was released and its prefix evicted; "
                               "encode the image again")
        if not s.image.has_crops:   # predicted a hit that was evicted since: crop it now
            s.ready, s.image, s.prep = False, None, None
            self.unprepared.append(s)
            return LATER
        return Source(Origin.MISS)

    def admit_pages(self, s: Seq, keep: set, shared: int = 0) -> bool:
        """Reserve the request's pages (evicting unpinned cached prefixes least recently used
        first if needed) and assign those of its prompt, but the first `shared` (a cache
        hit's pages it will read: `share`).  False: not now (it waits)."""
        need = s.need_pages - shared
        if self.alloc.available() < need:
            self.evict_for(need, keep)
            if self.alloc.available() < need:
                return False
        self.alloc.reserve(need)
        s.reserved = need
        n = pages_for(s.prompt_end, self.page_size) - shared if s.skill is not None else 0
        s.pages = self.alloc.take(n, reserved=True)
        s.reserved -= n
        return True

    def share(self, s: Seq, entry, owned: bool) -> None:
        """The request reads the full prefix pages of `entry` in place of its own, and pins
        the entry until its pages are freed.  `owned`: its own pages for them were assigned
        (a miss, whose entry was made after admission) and go back now."""
        n = self.shared_pages
        if not n or entry is None:
            return
        if owned:
            self.alloc.give_back(s.pages[:n])
            s.pages = s.pages[n:]
        s.pages = entry.pages[:n] + s.pages
        s.shared = entry.key
        self.cache.pin(entry.key)

    def n_shared(self, s: Seq) -> int:
        """How many leading pages of the request it reads and does not own: its image
        entry's full pages, then its conversation-cache pages."""
        return ((self.shared_pages if s.shared is not None else 0)
                + (0 if self.copy_text else len(s.text_keys)))

    def evict_for(self, n_pages: int, keep: set = frozenset()) -> None:
        """Make n_pages available: conversation pages first (they hang from image entries),
        then image entries, each least recently used first."""
        self.text.evict_for(n_pages)
        if self.alloc.available() < n_pages:
            self.cache.evict_for(n_pages, keep)

    # -- the conversation cache -----------------------------------------------------------

    def _chain(self, s: Seq, tokens: list, n_pages: int) -> list:
        """Hash-chain keys of the first n_pages full pages of `s`'s sequence."""
        root = b"image:" + s.key if s.key is not None else adapter_key(b"text", s.adapter)
        return chain_keys(root, list(range(s.prefix)) + tokens, self.page_size, n_pages,
                          tuple((a, a + n, key) for a, n, key in s.blocks))

    def _text_usable(self, s: Seq, src) -> bool:
        return (self.text.enabled and s.skill is not None and s.kinds is None
                and ((src is None and s.prefix == 0) or (src is not None and src.hit)))

    def text_hit(self, s: Seq, src) -> list:
        """The cached pages that continue `s`'s prompt past its image entry's full pages,
        leaving at least one prompt position to compute (it gives the first token)."""
        if not self._text_usable(s, src):
            return []
        first = s.prefix // self.page_size
        n_full = (s.prompt_end - 1) // self.page_size
        if n_full <= first:
            return []
        if s.prompt_chain is None:   # a waiting request is looked up every tick
            s.prompt_chain = self._chain(s, list(s.req.prompt), n_full)
        return self.text.match(s.prompt_chain[first:])

    def keep_text(self, s: Seq) -> None:
        """At release: the request's own full pages of written K/V join the conversation
        cache (prompt and generated tokens; the last generated one was never fed)."""
        if (not self.text.enabled or s.skill is None or s.kinds is not None
                or s.finish_reason == "error"
                or (s.prefix and s.shared is None and not self.copy_text)):
            # Spatial refs' values, a failure, or an image with no entry to hang from (with
            # copies, every request of an image owns its prefix: the chain hangs from the
            # image's key, and a later request finds it when the image is cached).
            return
        fed = []
        for t in s.generated[:-1]:
            if t in self.spatial_ids:
                break
            fed.append(t)
        tokens = list(s.req.prompt) + fed
        n_full = (s.prefix + len(tokens)) // self.page_size
        keys = self._chain(s, tokens, n_full)
        own = self.n_shared(s)
        first = max(own, s.prefix // self.page_size)
        kept = {p for p in reversed(range(first, min(n_full, len(s.pages))))
                if self.text.insert(keys[p], s.pages[p])}
        if kept:
            s.pages = [pg for i, pg in enumerate(s.pages) if i not in kept]

    def cache_miss(self, s: Seq, keep: set):
        """A cache entry for a miss's prefix (evicting older ones if needed), or None when
        caching is off or the pool has no room for it."""
        if not self.cache.enabled:
            return None
        if self.alloc.available() < self.prefix_pages:
            self.evict_for(self.prefix_pages, keep)
        return self.cache.insert(s.key, self.prefix_pages, s.image.tiling)

    def next_encode(self):
        """The next encode job that can run now, with its source: a hit, or a miss with its
        pinned new entry; None when none can (they wait for images or pages)."""
        blocked = self.slot_blocked()
        for s in list(self.encodes):
            if not self.resolve(s):
                continue
            src = self.source(s)
            if src is LATER:
                continue
            if src.hit:
                self.cache.pin(s.key)
                self.cache.count_hit()
                return s, src
            # A variant's prefix is computed under its adapter: the encode holds the
            # adapter's slot until it is launched (`Engine._run_encodes` releases it).
            if s.adapter is not None and blocked is not None and s.id > blocked:
                continue   # an older request waits for a slot: it gets the next free one
            slot = self.adapters.acquire(s.adapter)
            if slot is None:
                blocked = s.id if blocked is None else blocked
                continue   # every slot is held: waits for one
            if self.alloc.available() < self.prefix_pages:
                self.evict_for(self.prefix_pages)
            entry = self.cache.insert(s.key, self.prefix_pages, s.image.tiling, pin=True)
            if entry is None:
                self.adapters.release(slot)
                continue   # waits for pages
            s.adapter_slot = slot
            self.cache.count_miss()
            return s, Source(Origin.MISS, entry)
        return None

    def slot_blocked(self) -> int | None:
        """The id of the oldest request (prefill or encode) whose adapter cannot have a slot
        now, every slot being held; None when there is none.  Requests that arrived after it
        take no slot until it has one: the rows holding slots finish within their budgets,
        the least recently used slot comes free, and it goes to this request, however
        many requests for the resident adapters keep arriving."""
        a = self.adapters
        if not a.n or a.idle:   # no slots, or a free one: nobody waits for one
            return None
        ids = [s.id for s in self.waiting
               if s.adapter is not None and s.ready and not a.can_take(s.adapter)]
        ids += [s.id for s in self.encodes
                if s.adapter is not None and s.ready and not a.can_take(s.adapter)
                and s.key not in self.cache.entries]
        return min(ids, default=None)

    # -- launch ---------------------------------------------------------------------------

    def eligible(self) -> list[Seq]:
        """Rows that may join the next decode step: not finalized, their next input on the
        device, fewer than two steps in flight, and a next token that will be fed."""
        return [s for s in self.running
                if not s.finalized and s.pending_ready and s.inflight_refs < 2
                and not s.handle.cancel_requested and s.skill.feedable(s.n_tokens - 1)]

    def plan_prefill(self, decode_waiting: bool) -> list[Seq]:
        """The requests of the next prefill, their pages reserved (and cache entries made
        for misses).  Prefill first, but never twice in a row while decode rows wait: a
        stream of arrivals must not starve the rows already generating.  Requests are
        admitted in arrival order: one that cannot get its pages now waits, and so do those
        behind it."""
        if not self.free_rows or (decode_waiting and self.last_kind == "prefill"):
            return []
        batch, tokens, longest, keep = [], 0, 0, set()
        blocked = self.slot_blocked()
        for s in list(self.waiting):
            if not self.resolve(s):
                continue
            if len(batch) == min(len(self.free_rows), self.max_batch_size):
                break
            try:
                src = self.source(s)
            except RequestError as e:
                self.waiting.remove(s)
                self.outbox.result(s.handle, error=e)
                continue
            if src is LATER:
                continue
            if s.adapter is not None:
                if blocked is not None and s.id > blocked:
                    continue   # an older request waits for a slot: it gets the next free one
                if not self.adapters.can_take(s.adapter):
                    blocked = s.id if blocked is None else blocked
                    continue   # every adapter slot is held by running rows: wait
            hit = src is not None and src.hit
            text = self.text_hit(s, src)
            first = s.prefix // self.page_size
            start = (first + len(text)) * self.page_size if text else s.prefix
            # What this launch computes for the request: its prompt past the cached pages
            # (and its image prefix on a miss).  The padded shape counts as well as the
            # real positions: one long prompt among short ones pads every row to its length
            # (and the rows to their bucket), and the memory plan's workspace holds only
            # prefill_tokens computed positions.
            own = s.prompt_end - (start if text else 0)
            wide = max(longest, s.prompt_end - start)
            if batch and (tokens + own > self.prefill_tokens or
                          self.prefill_cost(len(batch) + 1, wide) > self.prefill_tokens):
                break
            # Taken only now, past every check that can still leave the request out of
            # this launch (a slot taken before the budget check above was never given back
            # when the budget stopped the plan: the slot stayed held forever).
            slot = self.adapters.acquire(s.adapter)
            self.text.use(text)   # pinned now: admission's evictions must not take them
            read = 0 if self.copy_text else len(text)   # cached pages read in place
            # (A hit's own entry is kept too: its pages are the ones it will read.)
            if not self.admit_pages(s, keep | {s.key} if hit else keep,
                                    (self.shared_pages if hit else 0) + read):
                self.text.unpin([tp.key for tp in text])
                self.adapters.release(slot)
                break
            s.adapter_slot = slot
            if src is not None:
                keep.add(s.key)
                if not hit:
                    src = Source(Origin.MISS, self.cache_miss(s, keep))
                self.share(s, src.entry, owned=not hit)
            if text and self.copy_text:   # pinned until the launch has copied them
                s.text_copies = [(tp.page, s.pages[first + i]) for i, tp in enumerate(text)]
                s.text_keys = [tp.key for tp in text]
                s.start = start
            elif text:
                s.pages = s.pages[:first] + [tp.page for tp in text] + s.pages[first:]
                s.text_keys = [tp.key for tp in text]
                s.start = start
            s.source = src
            batch.append(s)
            tokens, longest = tokens + own, wide
        return batch

    def unplan(self, batch: list[Seq]) -> None:
        """Give back what planning reserved (the prefill is not launched this tick)."""
        for s in batch:
            self.free_pages(s)
            self.adapters.release(s.adapter_slot)
            s.adapter_slot = 0
            if s.source is not None and not s.source.hit and s.source.entry is not None:
                self.cache.remove(s.key)
                self.alloc.give_back(s.source.entry.pages)
            s.source = None

    def start_prefill(self, batch: list[Seq]) -> None:
        """The planned batch is launched: each request takes a row and starts running, its
        first token sampled by the device (token index 0)."""
        for s in batch:
            self.waiting.remove(s)
            cached = s.start if (s.text_keys or (s.source is not None and s.source.hit)) else 0
            self.text.hit_pages += len(s.text_keys)
            self.outbox.prefill(s.handle, s.prompt_end,
                                None if s.source is None else s.source.hit, cached)
            s.row = self.free_rows.pop()
            self._event("acquire", s, s.row)
            self.running.append(s)
            s.length, s.n_tokens, s.inflight_refs = s.prompt_end, 1, 1
        self.last_kind = "prefill"

    def grow(self, rows: list[Seq], k: int = 1) -> list[int]:
        """Before a decode step (a burst: k steps) of `rows`: assign each row the pages of
        the positions it writes when it crosses into them (from its reservation: a burst's
        k stays inside every row's budget, `Engine._burst_len`).  -> token index per row."""
        for s in rows:
            while (s.length + k - 1) // self.page_size >= len(s.pages):
                s.pages += self.alloc.take(1, reserved=True)
                s.reserved -= 1
        return [s.n_tokens for s in rows]

    def start_decode(self, rows: list[Seq], k: int = 1) -> None:
        """The decode step (a burst: k steps) of `rows` is launched: both device clocks
        advance."""
        for s in rows:
            s.inflight_refs += 1
            s.n_tokens += k
            s.length += k
            s.pending_ready = False
        self.last_kind = "decode"

    # -- commit ---------------------------------------------------------------------------

    def commit(self, seqs: list[Seq], tokens, values, now: float, logprobs=None) -> int:
        """Feed one committed step to its rows (tokens[i], values[i] for seqs[i]): finalize
        the rows that finished (results go to the outbox), release zombies whose last step
        this was.  `logprobs`: the step's `step.Slot.logprobs` rows, when its sampler
        computed them.  -> tokens committed (zombie rows excluded)."""
        return self.commit_burst(seqs, [tokens], [values], now,
                                 None if logprobs is None else [logprobs])

    def commit_burst(self, seqs: list[Seq], tokens_K, values_K, now: float,
                     logprobs_K=None) -> int:
        """`commit` of a step that sampled K tokens per row (tokens_K[j][i]: row i's j-th):
        each row takes them in order until it finishes; the rest were computed for a
        finished row, as a zombie's are, and are dropped.  -> tokens committed."""
        self.commits += 1
        n = 0
        for i, s in enumerate(seqs):
            s.inflight_refs -= 1
            if s.finalized:
                if s.inflight_refs == 0:
                    self.release(s)
                continue
            for j in range(len(tokens_K)):
                self.outbox.token(s.handle, now)
                token = int(tokens_K[j][i])
                s.generated.append(token)
                args = (token, values_K[j][i])
                if logprobs_K is not None and s.req.settings.logprobs is not None:
                    args += (logprobs_K[j][i],)   # the skill keeps an answer token's
                try:
                    reason = s.skill.consume(*args)
                except Exception as e:  # e.g. a tokenizer failure: this request alone fails
                    self.finalize(s, "error", error=e)
                    break
                n += 1
                if reason is None and s.handle.cancel_requested:
                    reason = "cancelled"
                if reason is not None:
                    self.finalize(s, reason)
                    break
        return n

    def finalize(self, s: Seq, reason: str, error: BaseException | None = None) -> None:
        """Finalize early: the result goes out now (cancellations: at release)."""
        s.finalized, s.finish_reason = True, reason
        self._event("finalize", s, reason, s.inflight_refs)
        if error is None:
            result = s.skill.result(reason)
            if reason == "cancelled":
                s.outcome = (result, None)
            else:
                self.outbox.result(s.handle, result)
        else:
            self.outbox.result(s.handle, error=error)
        if s.inflight_refs == 0:
            self.release(s)

    def release(self, s: Seq) -> None:
        """Release late: the row is free only when no launched step contains it."""
        assert s.inflight_refs == 0 and s.finalized
        self._event("release", s, s.row)
        self.running.remove(s)
        self.free_rows.append(s.row)
        self.free_rows.sort(reverse=True)
        self.keep_text(s)
        self.free_pages(s)
        self.adapters.release(s.adapter_slot)
        s.row = -1
        if s.outcome is not None:
            self.outbox.result(s.handle, *s.outcome)

    def free_pages(self, s: Seq) -> None:
        self.alloc.give_back(s.pages[self.n_shared(s):])
        self.alloc.unreserve(s.reserved)
        if s.shared is not None:
            self.cache.unpin(s.shared)
        self.text.unpin(s.text_keys)
        s.pages, s.reserved, s.shared, s.text_keys, s.text_copies = [], 0, None, [], []
        s.start = s.prefix

    def flush_outbox(self) -> None:
        self.outbox.flush()

    def finish_encode(self, s: Seq, encoded) -> None:
        """An encode job is done: its result (an `EncodedImage`) goes out."""
        self.encodes.remove(s)
        self.outbox.result(s.handle, encoded)

    def take_unprepared(self) -> list[Seq]:
        """The requests whose image must be prepared again (see `unprepared`)."""
        out, self.unprepared = self.unprepared, []
        return out

    # -- cancellations, stalls, failure ---------------------------------------------------

    def settle_cancels(self) -> None:
        """Cancelled requests: waiting ones finish now; running ones with nothing in flight
        are finalized (the others at the commit of their last step)."""
        for q in (self.waiting, self.encodes):
            for s in list(q):
                if s.handle.cancel_requested:
                    q.remove(s)
                    if s.prep is not None:
                        s.prep.cancel()
                    self.outbox.result(s.handle,
                                       None if s.skill is None else s.skill.result("cancelled"))
        for s in list(self.running):
            if s.handle.cancel_requested and not s.finalized and s.inflight_refs == 0:
                self.finalize(s, "cancelled")
        self.flush_outbox()

    def check_stuck(self, idle: bool, now: float | None = None) -> None:
        """With nothing in flight (`idle`): fail loudly on rows that can never move (a
        scheduler bug); and when no row runs and requests wait for pages that only the
        EncodedImage handles' pins could free, fail each such request alone once that state
        has lasted `pin_wait_s` seconds (its holders may release the pins any moment: a
        thread that encodes, asks and releases is a normal client, not a stuck one)."""
        now = time.monotonic() if now is None else now
        if not idle:
            self.pinned_since = None
            return
        if self.running and not any(s.inflight_refs or s.handle.cancel_requested
                                    for s in self.running):
            if not self.eligible():
                raise EngineError(f"scheduler stuck with {len(self.running)} resident rows")
        if self.running:
            self.pinned_since = None
            return
        free = (self.alloc.available() + self.cache.evictable_pages()
                + self.text.evictable_pages())
        stuck = [(q, s) for q in (self.waiting, self.encodes) for s in q
                 if s.ready and s.need_pages > free]
        if not stuck:
            self.pinned_since = None
            return
        if self.pinned_since is None:
            self.pinned_since = now
        if now - self.pinned_since < self.pin_wait_s:
            return
        pinned = self.cache.pages() - self.cache.evictable_pages()
        for q, s in stuck:
            q.remove(s)
            self.outbox.result(s.handle, error=RequestError(
                f"this request needs {s.need_pages} KV pages and only {free} can be freed: "
                f"{pinned} are pinned by EncodedImage handles and none was released in "
                f"{self.pin_wait_s:g} s; release them or raise kv_cache_tokens"))
        self.pinned_since = None
        self.flush_outbox()

    def fail_all(self, err: BaseException) -> None:
        """Every request not finished fails with `err`; every page comes back."""
        self.flush_outbox()   # results that were finished before the failure still count
        for s in itertools.chain(self.waiting, self.encodes, self.running):
            self.outbox.result(s.handle, error=err if isinstance(err, EngineError) else
                               EngineError(f"the engine failed: {err!r}"))
        self.flush_outbox()
        for s in self.running:
            self.free_pages(s)
        self.waiting.clear()
        self.encodes.clear()
        self.running.clear()

    def _event(self, name: str, s: Seq, *detail) -> None:
        if self.events is not None:
            self.events.append((name, s.id, self.commits, *detail))


def adapter_key(key: bytes, adapter) -> bytes:
    """A prefix-cache key in the namespace of the request's adapter: an adapter changes the
    K/V of every position, the image prefix included."""
    return key if adapter is None else key + b"|lora:" + adapter.digest
