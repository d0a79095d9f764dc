"""Host-side bookkeeping of the KV pool: which page is whose, reservations, and the image
prefix cache.  Pure Python and NumPy (no JAX): the scheduler thread owns one of each, and
the tests drive them with fakes.

Pages.  A request reserves, at admission, the pages of its whole budget (prompt + what it may
generate, capped by its context), as Photon does: once admitted it never waits for memory
and nothing is preempted.  Pages are *assigned* lazily from that reservation (the prompt's at
prefill, one more each time decoding crosses a page boundary) and always the lowest free
ones, so the live pages of the running rows stay packed at the bottom of the pool (all the
XLA sweep reads).  Prefix-cache entries take the highest free pages instead.  Page 0
is never handed out (padding writes land there).

Prefix cache.  An entry holds the KV of BOS + the image tokens (the 730-position prefix) of
one image, keyed by a hash of the image's decoded pixels, in pool pages.  A request whose
image hits reads the entry's full pages in place, as the head of its own page table (decode
attention through page tables: the kernels), and gets a copy of the last, partial page,
whose remaining positions its prompt fills; with the XLA sweep, which scores each page
against one owner row (see `kvpool`), it copies every prefix page instead.  Entries are
pinned by `encode_image` handles and by the requests reading them (never evicted while
pinned) and otherwise evicted least-recently-used when an admission needs their pages.

Conversation cache (`TextCache`).  The full pages of finished sequences -- prompt and
generated tokens, past the image prefix -- keyed by a hash chain: a page's key hashes its
parent's key and its own positions' tokens, so equal keys mean equal K/V for the whole
sequence up to that page's end.  A new request whose prompt starts the same way (the next
turn of a conversation, a shared system prompt) reads those pages in place and prefills
only the rest.  It extends the image cache: a chain starts at the first page past an image
entry's full pages (which the entry holds), or at page 0 for text-only sequences.  Pages are
pinned by the requests reading them and evicted least-recently-used, leaves first.  With the
XLA sweep a hit's pages are copied into the request's own, as image prefixes are, and the
pins end once the copy is dispatched.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field

import numpy as np


class PoolError(RuntimeError):
    """Page bookkeeping broken (a scheduler bug, never a user error)."""


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class PageAllocator:
    """Free pages and reservations of a pool of `n_pages` pages (page 0 is reserved)."""

    def __init__(self, n_pages: int):
        if n_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages, got {n_pages}")
        self.n_pages = n_pages
        self._free = np.ones(n_pages, bool)
        self._free[0] = False
        self.n_free = n_pages - 1
        self.reserved = 0        # promised to admitted requests, not yet assigned

    @property
    def usable(self) -> int:
        """Pages that can ever be handed out."""
        return self.n_pages - 1

    def available(self) -> int:
        """Free pages not promised to anyone."""
        return self.n_free - self.reserved

    def reserve(self, n: int) -> None:
        if n > self.available():
            raise PoolError(f"reserving {n} pages with {self.available()} available")
        self.reserved += n

    def unreserve(self, n: int) -> None:
        if n > self.reserved:
            raise PoolError(f"releasing {n} reserved pages of {self.reserved}")
        self.reserved -= n

    def take(self, n: int, *, reserved: bool, top: bool = False) -> list[int]:
        """Assign n free pages: from a reservation (`reserved`) or from what is available;
        the lowest ids, or with `top` the highest."""
        if n <= 0:
            return []
        if reserved:
            self.unreserve(n)
        elif n > self.available():
            raise PoolError(f"taking {n} pages with {self.available()} available")
        ids = np.flatnonzero(self._free)
        picked = ids[-n:][::-1] if top else ids[:n]
        self._free[picked] = False
        self.n_free -= n
        return picked.tolist()

    def give_back(self, pages: list[int]) -> None:
        if not pages:
            return
        idx = np.asarray(pages)
        if idx.min() < 1 or self._free[idx].any():
            raise PoolError(f"freeing pages that are not in use: {pages}")
        self._free[idx] = True
        self.n_free += len(pages)

    def in_use(self) -> int:
        return self.usable - self.n_free


@dataclass
class Entry:
    """One cached image prefix: its pages (logical order) and its pins.  `pending`: its
    prefix is being computed a slice at a time (`engine.slicing`); nothing reads it yet."""
    key: bytes
    pages: list[int]
    tiling: tuple
    pins: int = 0
    pending: bool = False


@dataclass
class PrefixCache:
    """Image prefixes by content key, least recently used first.  Owned by the scheduler's
    thread, but `keys` (the cached keys: a frozenset replaced, never changed, on every
    insert and drop) may be read from any thread."""
    allocator: PageAllocator
    enabled: bool = True
    entries: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    keys: frozenset = frozenset()
    hits: int = 0
    misses: int = 0
    inserts: int = 0
    evictions: int = 0

    def get(self, key: bytes | None) -> Entry | None:
        """The entry of `key` (now most recently used), or None.  Counts hits only: a miss
        is counted when the prefix is computed (`count_miss`), since a request may look up
        several times while it waits."""
        e = self.entries.get(key) if key is not None else None
        if e is not None:
            self.entries.move_to_end(key)
        return e

    def count_hit(self) -> None:
        self.hits += 1

    def count_miss(self) -> None:
        self.misses += 1

    def insert(self, key: bytes, n_pages: int, tiling: tuple, pin: bool = False) -> Entry | None:
        """A new entry with n_pages fresh pages (highest free ones), or None when caching is
        off (and nothing pins it) or the pages are not available without eviction."""
        if (not self.enabled and not pin) or key in self.entries:
            return None
        if self.allocator.available() < n_pages:
            return None
        e = Entry(key, self.allocator.take(n_pages, reserved=False, top=True), tiling,
                  pins=int(pin))
        self.entries[key] = e
        self.keys = self.keys | {key}
        self.inserts += 1
        return e

    def evictable_pages(self) -> int:
        return sum(len(e.pages) for e in self.entries.values() if e.pins == 0)

    def evict_for(self, n_pages: int, keep: set = frozenset()) -> None:
        """Evict unpinned entries, least recently used first, until n_pages are available
        (or nothing more can go).  Entries in `keep` stay (the batch being planned uses
        them)."""
        for key in list(self.entries):
            if self.allocator.available() >= n_pages:
                return
            e = self.entries[key]
            if e.pins == 0 and key not in keep:
                self._drop(e)
                self.evictions += 1

    def pin(self, key: bytes) -> None:
        self.entries[key].pins += 1

    def unpin(self, key: bytes) -> None:
        e = self.entries.get(key)
        if e is None:
            return
        e.pins -= 1
        if e.pins == 0 and not self.enabled:
            self._drop(e)

    def remove(self, key: bytes) -> Entry | None:
        """Take an entry out without giving its pages back (the caller does) -> it, if any."""
        e = self.entries.pop(key, None)
        self.keys = self.keys - {key}
        return e

    def _drop(self, e: Entry) -> None:
        self.remove(e.key)
        self.allocator.give_back(e.pages)

    def pages(self) -> int:
        return sum(len(e.pages) for e in self.entries.values())

    def clear(self) -> None:
        for e in list(self.entries.values()):
            self._drop(e)


def chain_keys(root: bytes, tokens, page_size: int, n_pages: int,
               blocks: tuple = ()) -> list[bytes]:
    """The hash-chain key of each of the first `n_pages` full pages of a sequence: `root`
    names what precedes the tokens' positions' meaning (the image key, or none) and `tokens`
    holds one int per position (image positions: their index).  `blocks`: (start, end, key)
    of image blocks inside the sequence, whose positions hold placeholders: a page with any
    of a block's positions also hashes that image's key (and its span), so pages of two
    conversations that differ only in an image never share a key."""
    keys, parent = [], root
    arr = np.asarray(tokens, np.int64)
    for p in range(n_pages):
        lo, hi = p * page_size, (p + 1) * page_size
        extra = b"".join(key + np.asarray([a, b], np.int64).tobytes()
                         for a, b, key in blocks if a < hi and b > lo)
        parent = hashlib.blake2b(parent + arr[lo:hi].tobytes() + extra,
                                 digest_size=16).digest()
        keys.append(parent)
    return keys


@dataclass
class TextPage:
    key: bytes
    page: int
    pins: int = 0


@dataclass
class TextCache:
    """Finished sequences' full pages by hash-chain key, least recently used first."""
    allocator: PageAllocator
    enabled: bool = True
    pages: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    hit_pages: int = 0   # pages read by launched prefills (counted by the scheduler)
    inserts: int = 0
    evictions: int = 0

    def match(self, keys: list[bytes]) -> list[TextPage]:
        """The cached pages of the longest run of `keys` from its start."""
        out = []
        for k in keys:
            tp = self.pages.get(k)
            if tp is None:
                break
            out.append(tp)
        return out

    def use(self, hits: list[TextPage]) -> None:
        """Pin pages a request reads; the deepest become least recent, so eviction takes
        leaves before the pages they hang from."""
        for tp in reversed(hits):
            tp.pins += 1
            self.pages.move_to_end(tp.key)

    def unpin(self, keys: list[bytes]) -> None:
        for k in keys:
            self.pages[k].pins -= 1

    def insert(self, key: bytes, page: int) -> bool:
        """Keep `page` under `key` (most recent; insert a chain deepest first, so that its
        root is newest) -> False when the key is cached already (the caller gives the page
        back)."""
        if not self.enabled or key in self.pages:
            return False
        self.pages[key] = TextPage(key, page)
        self.inserts += 1
        return True

    def evictable_pages(self) -> int:
        return sum(1 for tp in self.pages.values() if tp.pins == 0)

    def evict_for(self, n_pages: int) -> None:
        """Evict unpinned pages, least recently used first, until n_pages are available."""
        for key in list(self.pages):
            if self.allocator.available() >= n_pages:
                return
            tp = self.pages[key]
            if tp.pins == 0:
                del self.pages[key]
                self.allocator.give_back([tp.page])
                self.evictions += 1

    def clear(self) -> None:
        for tp in self.pages.values():
            self.allocator.give_back([tp.page])
        self.pages.clear()
