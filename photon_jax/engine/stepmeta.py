"""The per-step metadata the host uploads with each launch: named rows, and the functions that
pack them.  NumPy only; the device programs (`step.py`) read the same names.

A decode step uploads two int32 arrays:

- `meta_FR` [5 + M, R]: per row (R = the step's row bucket) its pending-buffer row, the
  position it decodes, the page and offset its new K/V go to, its LoRA adapter slot (0:
  none), then its page table (M global page ids in logical order; unused entries 0, the
  never-owned page).
- `pages_2P` [2, P] over the P pages of the arenas the step reads: each page's owner (a step
  row index, R for none) and how many of its positions are valid.

A prefill uploads `pre_FR` [5, R] (pending row, first prompt position, prefix length, index
of the last real prompt position, adapter slot), `write_2RT` [2, R, T] (page and offset of every prompt
position) and `table_RM` [R, M] (the rows' page tables over the attended positions).

Padding rows of a bucket use row 0 and page 0: their writes land in the dummy row and page.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

M_ROW, M_POS, M_PAGE, M_OFF, M_ADAPTER, M_TABLE = range(6)
P_OWNER, P_COUNT = range(2)
F_ROW, F_START, F_PREFIX, F_LAST, F_ADAPTER = range(5)

_I32 = np.int32


@dataclass(frozen=True)
class Arenas:
    """How the pool's pages are split into arenas (one device array each, per layer): arena
    i holds global pages [starts[i], starts[i] + sizes[i])."""
    sizes: tuple[int, ...]

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.sizes[:-1]))

    @property
    def n_pages(self) -> int:
        return int(sum(self.sizes))

    def covering(self, max_page: int) -> int:
        """How many leading arenas hold pages 0 .. max_page."""
        return int(np.searchsorted(np.cumsum(self.sizes), max_page, side="right")) + 1

    def pages_in(self, n_arenas: int) -> int:
        return int(sum(self.sizes[:n_arenas]))

    @staticmethod
    def geometric(n_pages: int, first: int, max_arenas: int = 8, growth: int = 2) -> "Arenas":
        """Arenas covering 1 + first, 1 + growth x first, 1 + growth^2 x first, ... pages
        (the last one takes the rest): a step over a few rows reads a
        small arena, a full batch about what it uses.  Each arena count a step can read is
        another compiled decode program (2-6 s each on CPU); growth 4 halves their number but
        read 2.1x the attended KV at Moondream 2's batch 32 (position 1000) where growth 2
        reads 1.0x (XLA's cost analysis), so 2 it is."""
        # Page 0 (the dummy page) comes first: arena k covers it plus first x growth^k pages,
        # so k full rows of `first` pages fit exactly (without it every power-of-two batch
        # would spill one page into the next arena and read twice what it uses).
        sizes, total, cover = [], 0, max(1, first)
        while total < n_pages:
            size = n_pages - total if len(sizes) == max_arenas - 1 else min(
                cover + 1 - total, n_pages - total)
            sizes.append(size)
            total += size
            cover *= growth
        return Arenas(tuple(sizes))


def pack_decode(rows: list[int], positions: list[int], tables: list[list[int]], bucket: int,
                max_pages: int, page_size: int, arenas: Arenas, owners: bool = True,
                adapters: list[int] | None = None):
    """(meta_FR, pages_2P, n_arenas) of a decode step: rows[i] decodes `positions[i]`, its
    K/V pages are tables[i] (logical order, the page of `positions[i]` included), its
    adapter slot adapters[i] (None: all 0).  Without `owners` (attention through page
    tables: the kernels), pages_2P is a [2, 1] stand-in."""
    meta = np.zeros((M_TABLE + max_pages, bucket), _I32)
    if adapters is not None:
        meta[M_ADAPTER, :len(adapters)] = adapters
    top = 0
    for i, (row, pos, table) in enumerate(zip(rows, positions, tables)):
        meta[M_ROW, i], meta[M_POS, i] = row, pos
        meta[M_PAGE, i], meta[M_OFF, i] = table[pos // page_size], pos % page_size
        meta[M_TABLE:M_TABLE + len(table), i] = table
        top = max(top, max(table))
    n_arenas = arenas.covering(top)
    if not owners:
        return meta, np.zeros((2, 1), _I32), n_arenas
    pages = np.zeros((2, arenas.pages_in(n_arenas)), _I32)
    pages[P_OWNER] = bucket
    for i, (pos, table) in enumerate(zip(positions, tables)):
        t = np.asarray(table)
        pages[P_OWNER, t] = i
        pages[P_COUNT, t] = np.clip(pos + 1 - page_size * np.arange(len(t)), 0, page_size)
    return meta, pages, n_arenas


def pack_prefill(rows: list[int], starts: list[int], prefixes: list[int], lengths: list[int],
                 tables: list[list[int]], bucket: int, prompt_len: int, kv_len: int,
                 page_size: int, adapters: list[int] | None = None):
    """(pre_FR, write_2RT, table_RM) of a prefill: row i's prompt of lengths[i] tokens starts
    at position starts[i]; its pages are tables[i], its adapter slot adapters[i]."""
    pre = np.zeros((F_ADAPTER + 1, bucket), _I32)
    if adapters is not None:
        pre[F_ADAPTER, :len(adapters)] = adapters
    write = np.zeros((2, bucket, prompt_len), _I32)
    table = np.zeros((bucket, kv_len // page_size), _I32)
    for i, (row, start, prefix, n, t) in enumerate(zip(rows, starts, prefixes, lengths,
                                                       tables)):
        pre[:F_ADAPTER, i] = (row, start, prefix, n - 1)
        pos = start + np.arange(n)
        write[0, i, :n] = np.asarray(t)[pos // page_size]
        write[1, i, :n] = pos % page_size
        m = min(len(t), table.shape[1])
        table[i, :m] = t[:m]
    return pre, write, table
