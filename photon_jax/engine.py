"""The Photon engine: pipelined continuous batching over one paged KV pool, two donated slots
and device-resident pending inputs, driven by one scheduler thread.

Each tick of the scheduler thread does, in this order (docs/architecture.md, "One request"):

1. commit the oldest sampled step: read its host copy (started at finalize with
   `copy_to_host_async`), feed each row's token to its skill, deliver finished results now
   ("finalize early") and free rows whose last in-flight step this was ("release late");
2. finalize the forward in flight: build each row's constraint from the state the commit
   just updated (finalized rows: unconstrained) and dispatch `sample_step`, which writes the
   next inputs into the per-row pending buffers on the device;
3. launch the next forward into the free slot: a prefill if requests are ready (their first
   token is sampled on the device and they join the next decode step before the host has
   seen it), else a decode step of every eligible row.

Dispatch is asynchronous, so forward t+1 runs on the device while the host commits step t;
the host blocks only inside commit, on a copy started one step earlier.  The blocking twin
(`pipelined=False`) runs the same code as launch -> finalize -> commit with no overlap.

Memory: K/V live in one paged pool (`kvpool`, `pages`).  A request is admitted when a row
and the pages of its whole budget (prompt + what it may generate) are free, evicting cached
image prefixes least-recently-used if needed; pages are assigned lowest-first as it grows
and come back when its row does.  A request whose image is in the prefix cache copies the
cached prefix pages instead of running the vision encoder and the prefix prefill.

Invariants the tests check: at most two steps in flight; a slot is donated again only after
the commit that read it finished (`pipeline.PipelineState`); a row and its pages are reused
only after the last step containing it was committed (`inflight_refs`); length caps are
predicted at dispatch so they make no zombie; the launch path never syncs with the device
(`hostsync`); every page is free again after `close()`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from . import frontend, hostsync, memory, skills, step as step_mod
from .frontend import EncodedImage, ImagePrefix, PreparedImage
from .kvpool import init_pool
from .meta import Arenas, pack_decode, pack_prefill
from .model import Model
from .pages import PageAllocator, PrefixCache, pages_for
from .pipeline import PipelineState
from .settings import Settings
from .tokenizer import region_inputs

_I32 = np.int32
_END = object()


class EngineError(RuntimeError):
    """The engine stopped (closed, or a device error failed every request)."""


class RequestError(ValueError):
    """A request that cannot run as given (the message names the input and the fix)."""


@dataclass
class Request:
    """One generation.  `skill` is "text" (caption / query), "detect", "point" or "segment"
    (Moondream 3).  `prompt` is the token ids after the image prefix (text-only prompts start
    with BOS themselves).
    `image`: a path, bytes, PIL image, array, `EncodedImage` (this engine's),
    `PreparedImage`, `ImagePrefix` (dense K/V, e.g. the one-request path's) or None."""
    skill: str
    prompt: list
    image: Any = None
    settings: Settings = field(default_factory=Settings)
    region: list | None = None  # (v0, v1) per coord / size token of the prompt (spatial refs)
    reasoning: bool = False     # text: MD2 grounded reasoning before the answer
    ignore_eos: bool = False    # benchmarks: decode a fixed number of tokens


class Handle:
    """The caller's side of a request: `result()`, `cancel()`, `text_stream()`."""

    def __init__(self, engine: "Engine", request: Request):
        self._engine, self.request = engine, request
        self.id = None
        self._done = threading.Event()
        self._result = self._error = None
        self._reasoning = None
        self._reasoned = threading.Event()
        self._texts: queue.SimpleQueue = queue.SimpleQueue()
        self.cancel_requested = False
        self._callbacks: list = []
        self._cb_lock = threading.Lock()
        # Filled by the scheduler for `metrics()`: submit / first-token / end times, prompt
        # positions, tokens committed, whether the image prefix came from the cache.
        self._t_submit = time.perf_counter()
        self._t_first = self._t_end = None
        self._input_tokens = self._output_tokens = 0
        self._prefix_hit: bool | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def metrics(self) -> dict:
        """How the request ended and what it cost, once it finished: {"finish_reason"
        ("stop", "length", "repeat", "max_objects", "cancelled", "error"), "input_tokens"
        (prompt positions, the image prefix included), "output_tokens" (as in the result),
        "prefix_cache_hit" (True / False; None without an image or with the cache off),
        "time_to_first_token_s", "decode_tokens_per_s" (after the first token; None below
        two tokens)}."""
        if not self._done.is_set():
            raise RuntimeError("metrics() is available once the request finished")
        res = self._result if isinstance(self._result, dict) else {}
        n = res.get("output_tokens", self._output_tokens)   # the skill's count, as in results
        ttft = None if self._t_first is None else self._t_first - self._t_submit
        rate = None
        if self._t_first is not None and self._output_tokens > 1 and self._t_end > self._t_first:
            rate = (self._output_tokens - 1) / (self._t_end - self._t_first)
        reason = "error" if self._error is not None else res.get("finish_reason")
        return {"finish_reason": reason, "input_tokens": self._input_tokens,
                "output_tokens": n, "prefix_cache_hit": self._prefix_hit,
                "time_to_first_token_s": ttft, "decode_tokens_per_s": rate}

    def result(self, timeout: float | None = None):
        if not self._done.wait(timeout):
            raise TimeoutError(f"request not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def reasoning(self, timeout: float | None = None) -> dict | None:
        """The reasoning of a reasoning query, as soon as its phase ended (before the answer
        is generated); None if the request ended before reasoning finished."""
        if not self._reasoned.wait(timeout):
            raise TimeoutError(f"reasoning not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._reasoning

    def add_done_callback(self, fn) -> None:
        """Call `fn(handle)` once the request finished (at once if it already has).  It runs
        on the scheduler thread, so it must be quick (e.g. put the handle on a queue)."""
        with self._cb_lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def cancel(self) -> None:
        """Stop generating; the result (finish_reason "cancelled") arrives once the engine
        has released the request's row."""
        self.cancel_requested = True
        self._engine._wake.set()

    def text_stream(self):
        """Text pieces as the engine commits tokens; closing the iterator cancels."""
        try:
            while True:
                try:
                    item = self._texts.get(timeout=0.5)
                except queue.Empty:
                    if not self._engine.alive and not self._done.is_set():
                        raise EngineError("the engine stopped") from self._engine.failure
                    continue
                if item is _END:
                    break
                yield item
            if self._error is not None:
                raise self._error
        finally:
            if not self._done.is_set():
                self.cancel()

    # scheduler side
    def _put_text(self, piece: str) -> None:
        self._texts.put(piece)

    def _set_reasoning(self, reasoning: dict) -> None:
        self._reasoning = reasoning
        self._reasoned.set()

    def _finish(self, result=None, error: BaseException | None = None) -> None:
        if self._done.is_set():
            return
        self._result, self._error = result, error
        self._t_end = time.perf_counter()
        if self._reasoning is None and isinstance(result, dict):
            self._reasoning = result.get("reasoning")
        self._reasoned.set()
        with self._cb_lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        self._texts.put(_END)
        for fn in callbacks:
            try:
                fn(self)
            except Exception:   # a caller's bug must not stop the scheduler
                logging.getLogger(__name__).exception("done callback failed")


class _Seq:
    """Scheduler-side state of one request: two clocks, in-flight refs, finalized."""
    _ids = itertools.count()

    def __init__(self, handle: Handle, prefix: int, prompt_end: int, skill):
        self.id = next(self._ids)
        self.handle, self.req = handle, handle.request
        self.prefix, self.prompt_end, self.skill = prefix, prompt_end, skill
        self.kinds = self.values = None   # per prompt position, when spatial refs are given
        self.prep = None          # Future of a PreparedImage while preprocessing
        self.image = None         # once ready: ImagePrefix / PreparedImage / EncodedImage / None
        self.ready = False
        self.key = None           # the image's prefix-cache key
        self.source = None        # at admission: ("hit", entry) / ("miss", entry or None) / None
        self.need_pages = 0       # pages of the whole budget, reserved at admission
        self.pages: list[int] = []   # assigned pages, logical order
        self.reserved = 0         # pages still promised to it (assigned lazily)
        self.row = 0
        self.length = 0           # GPU clock: next KV position written (advanced at launch)
        self.n_tokens = 0         # token indices handed to launched steps
        self.inflight_refs = 0    # launched, not yet committed steps containing this row
        self.pending_ready = False
        self.finalized = False
        self.finish_reason = None
        self.outcome = None       # (result, error) held back until release (cancellations)


class _Step:
    __slots__ = ("kind", "slot", "seqs", "index", "meta", "out", "t_launch", "t_finalize",
                 "t0")

    def __init__(self, kind, slot, seqs, index, meta):
        self.kind, self.slot, self.seqs, self.index, self.meta = kind, slot, seqs, index, meta
        self.out = None
        self.t_launch = self.t_finalize = 0.0
        self.t0 = time.perf_counter()


class Engine:
    def __init__(self, model: Model, *, max_batch_size: int = 32, max_context: int | None = None,
                 kv_cache_tokens: int | None = None, page_size: int = 64,
                 prefix_cache: bool = True, pipelined: bool = True,
                 prefill_tokens: int = 2048, workers: int = 2, log_steps: int = 100_000,
                 record_events: bool = False, warmup: bool = False,
                 prefill_drains: bool = False, host_work_ms: float = 0.0):
        cfg = model.cfg
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        ctx = cfg.text.max_context if max_context is None else max_context
        if not isinstance(ctx, int) or not cfg.prefix_len < ctx <= cfg.text.max_context:
            raise ValueError(f"max_context must be an int in ({cfg.prefix_len}, "
                             f"{cfg.text.max_context}], got {max_context!r}")
        if page_size not in (16, 32, 64, 128, 256):
            raise ValueError(f"page_size must be 16, 32, 64, 128 or 256, got {page_size!r}")
        self.model, self.cfg, self.programs = model, cfg, model.programs
        self.max_batch_size, self.max_context, self.pipelined = max_batch_size, ctx, pipelined
        self.prefill_tokens = prefill_tokens
        self.device = model.device
        # Memory: planned from shapes and the device's free memory (the weights are placed
        # already), refused with numbers if it cannot work.
        self.plan = memory.check(
            memory.plan(cfg, platform=self.device.platform, max_batch_size=max_batch_size,
                        max_context=ctx, page_size=page_size, kv_cache_tokens=kv_cache_tokens,
                        free=memory.device_free(self.device), weights_loaded=True,
                        sweep=model.attention == "xla"),
            cfg, max_context=ctx, weights_loaded=True)
        self.page_size, self.arenas = page_size, self.plan.arenas
        self.max_pages = pages_for(ctx, page_size)   # a row's page table
        rows = max_batch_size + 1   # row 0 is the dummy row padding points at
        # Every buffer committed to the device, as the programs' outputs are: a program
        # first called with uncommitted arrays compiles again for the committed ones.
        with jax.default_device(self.device):
            self.pool, self.slots, self.pending = jax.device_put(
                (init_pool(cfg.text, self.arenas.sizes, page_size, cfg.dtype),
                 [step_mod.init_slot(cfg, max_batch_size) for _ in range(2)],
                 step_mod.init_pending(rows)), self.device)
            tables = step_mod.make_tables(cfg)
            self.tables = step_mod.Tables(**jax.device_put(tables, self.device))
        # Constraint ids under which a sampled id can carry a coordinate or size value.
        self._region_constraints = np.flatnonzero(tables["coord_kind"] | tables["size_kind"])
        self.alloc = PageAllocator(self.arenas.n_pages)
        self.cache = PrefixCache(self.alloc, enabled=prefix_cache)
        self.prefix_pages = pages_for(cfg.prefix_len, page_size)
        self.pipe = PipelineState()
        self.free_rows = list(range(rows - 1, 0, -1))   # pop() hands out the lowest row
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.encodes: collections.deque[_Seq] = collections.deque()
        self.running: list[_Seq] = []
        self.steps_log: collections.deque = collections.deque(maxlen=log_steps)
        self.counters = collections.Counter()
        # (event, request id, commit number, detail) for the zombie-accounting tests.
        self.events: list | None = [] if record_events else None
        self._commits = 0
        # Results finished during a commit go out after its step is logged, so a caller
        # that holds a result also finds the step that produced it in `step_log()`.
        self._outbox: list = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._unpins: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._closing = False
        self._last_kind = None
        self.failure: BaseException | None = None
        self.alive = True
        self._warmup = warmup
        self._warm = threading.Event()   # set once warm-up compiled (or was not asked)
        # Benchmark knobs: drain the pipeline before each prefill (Photon's older rule), and
        # burn this much host time per commit (to chart the gain against the host's share).
        self.prefill_drains, self.host_work_s = prefill_drains, host_work_ms / 1e3
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="photon-prep")
        self._thread = threading.Thread(target=self._loop, name="photon-scheduler", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------------

    def memory(self) -> dict:
        """The device buffers allocated at start-up and how the KV pool is used now (pages
        of `page_size` positions; `kv_cache_tokens` = usable pages x page size)."""
        a = self.alloc
        return {"kv_pool": self.plan.pool, "kv_cache_tokens": self.plan.kv_cache_tokens,
                "page_size": self.page_size, "pages": a.usable, "pages_free": a.n_free,
                "pages_reserved": a.reserved,
                "pages_in_sequences": a.in_use() - self.cache.pages(),
                "pages_in_prefix_cache": self.cache.pages(),
                "arenas": list(self.arenas.sizes),
                "slots": int(sum(x.nbytes for s in self.slots for x in jax.tree.leaves(s))),
                "pending": int(sum(x.nbytes for x in jax.tree.leaves(self.pending))),
                "weights": self.plan.weights}

    def stats(self) -> dict:
        """Counters: steps by kind, tokens committed, zombie rows, and the prefix cache's
        hits, misses, inserts, evictions and current entries."""
        c = self.cache
        return {**dict(self.counters),
                "prefix_cache": {"enabled": c.enabled, "hits": c.hits, "misses": c.misses,
                                 "inserts": c.inserts, "evictions": c.evictions,
                                 "entries": len(c.entries),
                                 "pinned": sum(1 for e in c.entries.values() if e.pins)}}

    def submit(self, req: Request) -> Handle:
        """Queue a request; never blocks on the device.  A request that cannot run fails
        its own handle (the error names the input) and costs nothing else."""
        return self.submit_many([req])[0]

    def submit_many(self, reqs: list[Request]) -> list[Handle]:
        """Queue several requests at once: the scheduler sees them together, so they can
        share their prefill launches and every decode step."""
        if not self.alive or self._closing:
            raise EngineError("the engine is closed" if self.failure is None else
                              f"the engine stopped after an error: {self.failure}")
        handles, seqs = [], []
        for req in reqs:
            h = Handle(self, req)
            handles.append(h)
            try:
                seqs.append(self._admit(h))
            except (RequestError, ValueError, TypeError) as e:
                h._finish(error=e)
        self._inbox.put(seqs)
        self._wake.set()
        if not self.alive:   # the scheduler exited between the check above and the put
            for h in handles:
                h._finish(error=EngineError("the engine is closed"))
        return handles

    def encode(self, image) -> Handle:
        """Encode an image into the prefix cache and pin it there: the handle's result is an
        `EncodedImage` (release it, or drop it, to unpin)."""
        return self.submit(Request("encode", [], image))

    def _admit(self, h: Handle) -> _Seq:
        req, cfg = h.request, self.cfg
        if req.skill not in ("text", "detect", "point", "segment", "encode"):
            raise RequestError(f"unknown skill {req.skill!r}; expected text, detect, point or "
                               "segment")
        encode = req.skill == "encode"
        if encode and req.image is None:
            raise RequestError("nothing to encode: the image is None")
        if not req.prompt and not encode:
            raise RequestError("empty prompt")
        base = 0 if req.image is None else cfg.prefix_len
        p_end = base + len(req.prompt)
        if p_end > self.max_context:
            raise RequestError(
                f"prompt of {len(req.prompt)} tokens (+{base} image positions) exceeds the "
                f"context of {self.max_context} tokens; shorten the question")
        seq = _Seq(h, base, p_end, None if encode else self._new_skill(req, h, p_end))
        h.id = seq.id
        if encode:
            seq.need_pages = self.prefix_pages
        else:
            budget = min(p_end + seq.skill.budget, self.max_context)
            seq.need_pages = pages_for(budget, self.page_size)
        if seq.need_pages > self.alloc.usable:
            raise RequestError(
                f"this request needs {seq.need_pages * self.page_size} KV positions (prompt "
                f"{p_end} + up to {0 if encode else seq.skill.budget} generated), more than "
                f"the whole KV pool ({self.plan.kv_cache_tokens} tokens); raise "
                "kv_cache_tokens (--kv-cache-tokens) or lower max_tokens / max_objects")
        if req.region:
            if req.image is None:
                raise RequestError("spatial refs need an image")
            seq.kinds, seq.values = region_inputs(req.prompt, req.region, cfg.tokenizer)
        img = req.image
        if isinstance(img, EncodedImage):
            if img._engine is not self:
                raise RequestError("this EncodedImage was made by another model or engine; "
                                   "encode the image with this one")
            if img.released:
                raise RequestError("this EncodedImage was released; encode the image again")
            seq.key = img.key
        if isinstance(img, PreparedImage):
            seq.key = img.key
        if img is None or isinstance(img, (EncodedImage, PreparedImage, ImagePrefix)):
            seq.image, seq.ready = img, True
        else:
            seq.prep = self._pool.submit(frontend.prepare_image, self.model, img,
                                         self._cached)
            seq.prep.add_done_callback(lambda _: self._wake.set())
        return seq

    def _cached(self, key: bytes) -> bool:
        """(Any thread.) Is this image prefix cached?  A hint for skipping its crops: if the
        entry is gone by the time the request is admitted, it is prepared again."""
        return self.cache.enabled and key in self.cache.entries

    def _unpin(self, key: bytes) -> None:
        """(Any thread, including a finalizer.)  Queued for the scheduler thread."""
        if self.alive:
            self._unpins.put(key)
            self._wake.set()

    def close(self, timeout: float | None = None) -> None:
        """Finish every accepted request, stop the scheduler thread, free device buffers
        (and every page of the pool: cached prefixes are dropped, pinned or not)."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise EngineError(f"the scheduler did not stop within {timeout} s")
        self._pool.shutdown(wait=True)
        self.cache.clear()
        for leaf in jax.tree.leaves((self.pool, self.slots, self.pending, self.tables)):
            if not leaf.is_deleted():
                leaf.delete()

    def wait_warm(self, timeout: float | None = None) -> None:
        """Block until start-up warm-up (`warmup=True`) has compiled every shape; raises the
        engine's error if it failed."""
        if not self._warm.wait(timeout):
            raise EngineError(f"warm-up did not finish within {timeout} s")
        if self.failure is not None:
            raise EngineError(f"the engine failed during warm-up: {self.failure!r}") \
                from self.failure

    def step_log(self) -> list[dict]:
        """Per committed step: kind, rows, host seconds in launch / finalize / commit (commit
        excludes the wait for the host copy), the wait, and the step's end time.  A step is
        logged before the results it finished go out."""
        keys = ("kind", "rows", "launch_s", "finalize_s", "commit_s", "wait_s", "t0", "t_end")
        return [dict(zip(keys, r)) for r in list(self.steps_log)]

    # -- scheduler thread -----------------------------------------------------------------

    def _compile_decode_shapes(self) -> None:
        """Compile decode for every (row bucket, number of arenas read) and the four sampling
        variants for every row bucket, so steady decoding never waits for the compiler.
        Every row is the dummy row and page 0: nothing real is touched."""
        P, params = self.programs, self.model.params
        for rb in step_mod.row_buckets(self.max_batch_size):
            meta = jax.device_put(np.zeros((4 + self.max_pages, rb), _I32), self.device)
            samp = np.zeros((step_mod.S_ALLOW + 1, rb), _I32)
            samp[step_mod.S_ALLOW] = -1
            samp = jax.device_put(samp, self.device)
            for n in range(1, self.arenas_count + 1):
                pages = np.zeros((2, self.arenas.pages_in(n)), _I32)
                pages[0] = rb
                part, self.slots[0] = P.forward(params, self.pool.arenas(n), self.slots[0],
                                                self.pending, meta,
                                                jax.device_put(pages, self.device))
                self.pool = self.pool.merge(part)
            for sampler in P.sample_step.values():
                self.slots[0], self.pending = sampler(params, self.slots[0], self.pending,
                                                      self.tables, samp)
        jax.block_until_ready(self.pending)

    def _compile_prefill_shapes(self) -> None:
        """Compile the prompt prefill for every prefill row bucket, prompts of up to 32
        tokens (captions and short questions), after an image prefix and text-only; the
        prefix page writes and copies; and the vision encoder for the crop layouts of
        4:3, 3:4 and square images of at least 756 pixels a side (the common photo shapes;
        other layouts compile when first seen).  Padding rows write page 0 only."""
        P, params, cfg = self.programs, self.model.params, self.cfg
        put = lambda a: jax.device_put(a, self.device)  # noqa: E731
        for rb in step_mod.prefill_row_buckets(self.max_batch_size):
            for tb in (16, 32):
                for start in (cfg.prefix_len, 0):
                    kv_len = step_mod.kv_bucket(start + tb, self.max_context)
                    kv_len = -(-kv_len // self.page_size) * self.page_size
                    pre, write, table = pack_prefill([], [], [], [], [], rb, tb, kv_len,
                                                     self.page_size)
                    z = np.zeros((rb, tb), _I32)
                    self.pool, self.slots[1] = P.prefill_slot(
                        params, self.pool, self.slots[1], put(z), put(z),
                        put(np.zeros((rb, tb, 2), np.float32)), put(pre), put(write),
                        put(table))
        zero = [0] * self.prefix_pages
        self.pool = P.copy_pages(self.pool, put(np.asarray(zero, _I32)),
                                 put(np.asarray(zero, _I32)))
        for hw in ((768, 1024), (1024, 768), (1024, 1024)):
            prep = frontend.prepare_image(self.model, np.full((*hw, 3), 128, np.uint8))
            self._write_prefix(frontend.encode_prepared(self.model, prep), zero)
        jax.block_until_ready(self.pool)

    @property
    def arenas_count(self) -> int:
        return len(self.arenas.sizes)

    def _loop(self) -> None:
        try:
            if self._warmup:
                self._compile_decode_shapes()
                self._compile_prefill_shapes()
            self._warm.set()
            while True:
                self._wake.clear()
                self._take_inbox()
                self._settle_cancels()
                progressed = self._tick()
                if not progressed:
                    if self._closing and self._drained():
                        break
                    self._check_stuck()
                    self._wake.wait(0.05)
        except BaseException as e:  # a device or engine error: every request fails
            self.failure = e
            self._fail_everything(e)
        finally:
            self.alive = False
            self._warm.set()
            self._fail_everything(EngineError("the engine stopped"))

    def _drained(self) -> bool:
        return (not self.waiting and not self.encodes and not self.running
                and self.pipe.idle() and self._inbox.empty())

    def _check_stuck(self) -> None:
        # Nothing in flight, nothing launchable, yet rows are held: a scheduler bug.  Fail
        # loudly rather than let callers wait forever.
        if self.pipe.idle() and self.running and not any(
                s.inflight_refs or s.handle.cancel_requested for s in self.running):
            if not self._eligible():
                raise EngineError(f"scheduler stuck with {len(self.running)} resident rows")
        # A request that waits for pages nothing will ever free (nothing runs; the rest of
        # the pool is pinned by EncodedImage handles) fails alone rather than hang.
        if self.pipe.idle() and not self.running:
            for q in (self.waiting, self.encodes):
                for s in list(q):
                    if s.ready and s.need_pages > (self.alloc.available()
                                                   + self.cache.evictable_pages()):
                        q.remove(s)
                        pinned = self.cache.pages() - self.cache.evictable_pages()
                        s.handle._finish(error=RequestError(
                            f"this request needs {s.need_pages} KV pages and only "
                            f"{self.alloc.available() + self.cache.evictable_pages()} can be "
                            f"freed: {pinned} are pinned by EncodedImage handles; release "
                            "them or raise kv_cache_tokens"))

    def _take_inbox(self) -> None:
        while True:
            try:
                for s in self._inbox.get_nowait():
                    (self.encodes if s.skill is None else self.waiting).append(s)
            except queue.Empty:
                break
        while True:
            try:
                self.cache.unpin(self._unpins.get_nowait())
            except queue.Empty:
                return

    def _settle_cancels(self) -> None:
        for q in (self.waiting, self.encodes):
            for s in list(q):
                if s.handle.cancel_requested:
                    q.remove(s)
                    if s.prep is not None:
                        s.prep.cancel()
                    s.handle._finish(None if s.skill is None else s.skill.result("cancelled"))
        for s in list(self.running):
            if s.handle.cancel_requested and not s.finalized and s.inflight_refs == 0:
                self._finalize_seq(s, "cancelled")
        self._flush_outbox()

    def _tick(self) -> bool:
        if self.encodes:
            self._run_encodes()
        if self.pipelined:
            progressed = False
            if self.pipe.queue:
                self._commit()
                progressed = True
            if self.pipe.launch is not None:
                self._finalize()
                progressed = True
            if self.pipe.can_launch() and self._launch():
                progressed = True
            return progressed
        if not self._launch():
            return False
        self._finalize()
        self._commit()
        return True

    # admission -------------------------------------------------------------------------

    def _resolve(self, s: _Seq) -> bool:
        """Is the request's image prepared?  A failed preparation fails the request alone."""
        if not s.ready and s.prep is not None and s.prep.done():
            try:
                s.image, s.ready = s.prep.result(), True
                s.key = s.image.key
            except Exception as e:  # unreadable image etc.: this request alone fails
                (self.encodes if s.skill is None else self.waiting).remove(s)
                s.handle._finish(error=e)
                return False
        return s.ready

    def _source(self, s: _Seq):
        """Where the request's image prefix comes from: ("hit", entry), ("miss", None), None
        (no image, or a dense prefix), or "later" (a skipped crop whose entry was evicted:
        prepared again)."""
        if s.key is None:
            return None
        entry = self.cache.get(s.key)
        if entry is not None:
            return ("hit", entry)
        if isinstance(s.image, EncodedImage):
            raise RequestError("this EncodedImage was released and its prefix evicted; "
                               "encode the image again")
        if not s.image.has_crops:   # predicted a hit that was evicted since: crop it now
            s.ready, s.image = False, None
            s.prep = self._pool.submit(frontend.prepare_image, self.model, s.req.image)
            s.prep.add_done_callback(lambda _: self._wake.set())
            return "later"
        return ("miss", None)

    def _admit_pages(self, s: _Seq, keep: set) -> bool:
        """Reserve the request's pages (evicting unpinned cached prefixes least recently used
        first if needed) and assign those of its prompt.  False: not now (it waits)."""
        need = s.need_pages
        if self.alloc.available() < need:
            self.cache.evict_for(need, keep)
            if self.alloc.available() < need:
                return False
        self.alloc.reserve(need)
        s.reserved = need
        n = pages_for(s.prompt_end, self.page_size) if s.skill is not None else 0
        s.pages = self.alloc.take(n, reserved=True)
        s.reserved -= n
        return True

    def _cache_miss(self, s: _Seq, keep: set):
        """A cache entry for a miss's prefix (evicting older ones if needed), or None when
        caching is off or the pool has no room for it."""
        if not self.cache.enabled:
            return None
        if self.alloc.available() < self.prefix_pages:
            self.cache.evict_for(self.prefix_pages, keep)
        return self.cache.insert(s.key, self.prefix_pages, s.image.tiling)

    def _run_encodes(self) -> None:
        """`Engine.encode` jobs: pin the image's entry, computing it if it is not cached."""
        for s in list(self.encodes):
            if not self._resolve(s):
                continue
            src = self._source(s)
            if src == "later":
                continue
            if src[0] == "hit":
                self.cache.pin(s.key)
                self.cache.count_hit()
            else:
                if self.alloc.available() < self.prefix_pages:
                    self.cache.evict_for(self.prefix_pages)
                entry = self.cache.insert(s.key, self.prefix_pages, s.image.tiling, pin=True)
                if entry is None:
                    continue   # waits for pages
                self.cache.count_miss()
                with hostsync.sync_free():
                    enc = frontend.encode_prepared(self.model, s.image)
                    self._write_prefix(enc, entry.pages)
            self.encodes.remove(s)
            s.handle._finish(EncodedImage(self, s.key, self.cache.entries[s.key].tiling))

    # launch ---------------------------------------------------------------------------

    def _eligible(self) -> list[_Seq]:
        return [s for s in self.running
                if not s.finalized and s.pending_ready and s.inflight_refs < 2
                and not s.handle.cancel_requested and s.skill.feedable(s.n_tokens - 1)]

    def _launch(self) -> bool:
        slot = self.pipe.free_slot()
        decode = self._eligible()
        batch = self._plan_prefill(bool(decode))
        if batch and self.prefill_drains and not self.pipe.idle():
            self._unplan(batch)
            return False   # let the steps in flight commit first
        if batch:
            self._launch_prefill(batch, slot)
        elif decode:
            self._launch_decode(decode, slot)
        else:
            return False
        return True

    def _plan_prefill(self, decode_waiting: bool) -> list[_Seq]:
        # Prefill first, but never twice in a row while decode rows wait: a stream of
        # arrivals must not starve the rows already generating.  Requests are admitted in
        # arrival order: one that cannot get its pages now waits, and so do those behind it.
        if not self.free_rows or (decode_waiting and self._last_kind == "prefill"):
            return []
        batch, tokens, keep = [], 0, set()
        for s in list(self.waiting):
            if not self._resolve(s):
                continue
            if len(batch) == min(len(self.free_rows), self.max_batch_size) or (
                    batch and tokens + s.prompt_end > self.prefill_tokens):
                break
            try:
                src = self._source(s)
            except RequestError as e:
                self.waiting.remove(s)
                s.handle._finish(error=e)
                continue
            if src == "later":
                continue
            if not self._admit_pages(s, keep):
                break
            if src is not None:
                keep.add(s.key)
                if src[0] == "miss":
                    src = ("miss", self._cache_miss(s, keep))
            s.source = src
            batch.append(s)
            tokens += s.prompt_end
        return batch

    def _unplan(self, batch: list[_Seq]) -> None:
        """Give back what planning reserved (the prefill is not launched this tick)."""
        for s in batch:
            self._free_pages(s)
            if s.source and s.source[0] == "miss" and s.source[1] is not None:
                self.cache.entries.pop(s.key, None)
                self.alloc.give_back(s.source[1].pages)
            s.source = None

    def _free_pages(self, s: _Seq) -> None:
        self.alloc.give_back(s.pages)
        self.alloc.unreserve(s.reserved)
        s.pages, s.reserved = [], 0

    def _new_skill(self, req: Request, h: Handle, prompt_end: int):
        tok = self.cfg.tokenizer
        common = dict(prompt_end=prompt_end, max_context=self.max_context,
                      eos_id=tok.eos_id, ignore_eos=req.ignore_eos)
        text = dict(max_tokens=req.settings.max_tokens, decode=self.model.prompts.decode,
                    on_text=h._put_text, repeat_stop=req.settings.repeat_stop, **common)
        if req.skill == "text" and req.reasoning:
            return skills.ReasoningSkill(
                answer_id=tok.answer_id, coord_id=tok.coord_id,
                chunk_ids=(tok.start_ground_points_id, tok.end_ground_id),
                on_reasoning=h._set_reasoning, **text)
        if req.skill == "text":
            return skills.TextSkill(**text)
        if req.skill == "segment":
            return skills.SegmentSkill(coord_id=tok.coord_id, size_id=tok.size_id,
                                       **{**text, "on_text": None})
        return skills.PointsSkill(with_size=req.skill == "detect",
                                  max_objects=req.settings.max_objects, **common)

    def _prefix_slots(self, pages: list[int]):
        """Page and offset of each prefix position, for pages in logical order."""
        pos = np.arange(self.cfg.prefix_len)
        return np.asarray(pages, _I32)[pos // self.page_size], (pos % self.page_size).astype(_I32)

    def _write_prefix(self, enc: ImagePrefix, pages: list[int]) -> None:
        page_s, off_s = self._prefix_slots(pages)
        put = lambda a: jax.device_put(a, self.device)  # noqa: E731
        self.pool = self.programs.write_prefix_pages(self.pool, enc.k, enc.v, put(page_s),
                                                     put(off_s))

    def _launch_prefill(self, batch: list[_Seq], slot: int) -> None:
        t0 = time.perf_counter()
        P, params, cfg = self.programs, self.model.params, self.cfg
        n = len(batch)
        rb = step_mod.prefill_row_bucket(n, self.max_batch_size)
        lens = [len(s.req.prompt) for s in batch]
        tb = step_mod.prompt_bucket(max(lens))
        ids = np.zeros((rb, tb), _I32)
        kinds = np.zeros((rb, tb), _I32)
        values = np.zeros((rb, tb, 2), np.float32)
        for i, s in enumerate(batch):
            self.waiting.remove(s)
            s.row = self.free_rows.pop()
            if self.events is not None:
                self.events.append(("acquire", s.id, self._commits, s.row))
            self.running.append(s)
            ids[i, :lens[i]] = s.req.prompt
            if s.kinds is not None:
                kinds[i, :lens[i]], values[i, :lens[i]] = s.kinds, s.values
        starts = [s.prefix for s in batch]
        kv_len = step_mod.kv_bucket(max(starts) + tb, self.max_context)
        kv_len = -(-kv_len // self.page_size) * self.page_size
        pre, write, table = pack_prefill([s.row for s in batch], starts, starts, lens,
                                         [s.pages for s in batch], rb, tb, kv_len,
                                         self.page_size)
        put = lambda a: jax.device_put(a, self.device)  # noqa: E731
        with hostsync.sync_free():
            for s in batch:
                src, img = s.source, s.image
                s.handle._input_tokens = s.prompt_end
                if src is not None:
                    s.handle._prefix_hit = src[0] == "hit"
                if src is not None and src[0] == "hit":
                    self.cache.count_hit()
                    dst = s.pages[:self.prefix_pages]
                    self.pool = P.copy_pages(self.pool, put(np.asarray(src[1].pages, _I32)),
                                             put(np.asarray(dst, _I32)))
                elif isinstance(img, ImagePrefix):
                    self._write_prefix(img, s.pages)
                elif src is not None:   # a miss: encode, into its pages and the new entry's
                    self.cache.count_miss()
                    enc = frontend.encode_prepared(self.model, img)
                    self._write_prefix(enc, s.pages)
                    if src[1] is not None:
                        self._write_prefix(enc, src[1].pages)
                s.image = s.source = None   # the prefix now lives in its pages
            meta_d = put(pre)
            self.pool, self.slots[slot] = P.prefill_slot(params, self.pool, self.slots[slot],
                                                         put(kinds), put(ids), put(values),
                                                         meta_d, put(write), put(table))
        for s in batch:
            s.length, s.n_tokens, s.inflight_refs = s.prompt_end, 1, 1
        st = _Step("prefill", slot, batch, [0] * n, meta_d)
        st.t0, st.t_launch = t0, time.perf_counter() - t0
        self.pipe.on_launch(st)
        self._last_kind = "prefill"

    def _launch_decode(self, rows: list[_Seq], slot: int) -> None:
        t0 = time.perf_counter()
        n = len(rows)
        rb = step_mod.row_bucket(n, self.max_batch_size)
        index = []
        for s in rows:
            # The page of the position this step writes: assigned from the reservation when
            # the sequence crosses into it.
            if s.length // self.page_size == len(s.pages):
                s.pages += self.alloc.take(1, reserved=True)
                s.reserved -= 1
            index.append(s.n_tokens)
        meta, pages, n_arenas = pack_decode([s.row for s in rows], [s.length for s in rows],
                                            [s.pages for s in rows], rb, self.max_pages,
                                            self.page_size, self.arenas)
        with hostsync.sync_free():
            meta_d = jax.device_put(meta, self.device)
            part, self.slots[slot] = self.programs.forward(
                self.model.params, self.pool.arenas(n_arenas), self.slots[slot], self.pending,
                meta_d, jax.device_put(pages, self.device))
            self.pool = self.pool.merge(part)
        for s in rows:
            s.inflight_refs += 1
            s.n_tokens += 1
            s.length += 1
            s.pending_ready = False
        st = _Step("decode", slot, rows, index, meta_d)
        st.t0, st.t_launch = t0, time.perf_counter() - t0
        self.pipe.on_launch(st)
        self._last_kind = "decode"

    # finalize (sample) -------------------------------------------------------------------

    def _finalize(self) -> None:
        t0 = time.perf_counter()
        st = self.pipe.launch
        rb = st.meta.shape[1]
        allowed = [None if s.finalized else s.skill.allowed(i)
                   for s, i in zip(st.seqs, st.index)]
        # The general path: per-row allowed ids, -1 padded to a power-of-two width (1 when
        # no row restricts), so the common step keeps one compiled shape.
        width = step_mod.row_bucket(max((len(a) for a in allowed if a), default=1), 1 << 20)
        samp = np.zeros((step_mod.S_ALLOW + width, rb), _I32)
        samp[step_mod.S_ALLOW:] = -1
        for i, a in enumerate(allowed):
            if a:
                samp[step_mod.S_ALLOW:step_mod.S_ALLOW + len(a), i] = a
        temps = np.zeros(rb, np.float32)
        top_ps = np.ones(rb, np.float32)
        for i, s in enumerate(st.seqs):
            samp[step_mod.S_ROW, i] = s.row
            if s.finalized:   # a zombie: sampled unconstrained and greedy, result discarded
                self.counters["zombie_rows"] += 1
                continue
            idx = st.index[i]
            if s.skill.count != idx:
                raise EngineError(f"sampling token {idx} of a request that committed "
                                  f"{s.skill.count}: the pipeline lost its order")
            cfg = s.req.settings
            samp[step_mod.S_CONSTRAINT, i] = s.skill.constraint(idx)
            samp[step_mod.S_INDEX, i] = idx
            samp[step_mod.S_SEED, i] = cfg.seed
            if not s.skill.spatial:   # detect / point are greedy, as in the reference
                temps[i], top_ps[i] = cfg.temperature, cfg.top_p
        samp[step_mod.S_TEMP] = temps.view(_I32)
        samp[step_mod.S_TOP_P] = top_ps.view(_I32)
        # The program variant, known here without asking the device: does any row draw at
        # random, can any row's constraint yield a coordinate or size?
        sampler = self.programs.sampler(bool(np.any(temps > 0)), bool(np.isin(
            samp[step_mod.S_CONSTRAINT, :len(st.seqs)], self._region_constraints).any()))
        with hostsync.sync_free():
            samp_d = jax.device_put(samp, self.device)
            self.slots[st.slot], self.pending = sampler(
                self.model.params, self.slots[st.slot], self.pending, self.tables, samp_d)
            st.out = self.slots[st.slot].out
            st.out.copy_to_host_async()
        for s in st.seqs:
            s.pending_ready = True
        self.pipe.on_sampled(st)
        st.t_finalize = time.perf_counter() - t0

    # commit ------------------------------------------------------------------------------

    def _commit(self) -> None:
        st = self.pipe.pop_oldest()
        self._commits += 1
        t0 = time.perf_counter()
        host = np.array(st.out)   # a copy: a live view would defeat the slot's donation
        t1 = time.perf_counter()
        st.out = None
        values = host[:, 1:3].view(np.float32)
        for i, s in enumerate(st.seqs):
            s.inflight_refs -= 1
            if s.finalized:
                if s.inflight_refs == 0:
                    self._release(s)
                continue
            h = s.handle
            h._output_tokens += 1
            if h._t_first is None:
                h._t_first = t1
            try:
                reason = s.skill.consume(int(host[i, 0]), values[i])
            except Exception as e:  # e.g. a tokenizer failure: this request alone fails
                self._finalize_seq(s, "error", error=e)
                continue
            if reason is None and s.handle.cancel_requested:
                reason = "cancelled"
            if reason is not None:
                self._finalize_seq(s, reason)
            self.counters["tokens"] += 1
        if self.host_work_s:
            end = t1 + self.host_work_s
            while time.perf_counter() < end:
                pass
        self.pipe.on_step_completed()
        t2 = time.perf_counter()
        self.counters[st.kind] += 1
        self.steps_log.append((st.kind, len(st.seqs), st.t_launch, st.t_finalize, t2 - t1,
                               t1 - t0, st.t0, t2))
        self._flush_outbox()

    def _flush_outbox(self) -> None:
        for handle, outcome in self._outbox:
            handle._finish(*outcome)
        self._outbox.clear()

    def _finalize_seq(self, s: _Seq, reason: str, error: BaseException | None = None) -> None:
        """Finalize early: the result goes out now (cancellations: at release)."""
        s.finalized, s.finish_reason = True, reason
        if self.events is not None:
            self.events.append(("finalize", s.id, self._commits, reason, s.inflight_refs))
        if error is None:
            result = s.skill.result(reason)
            if reason == "cancelled":
                s.outcome = (result, None)
            else:
                self._outbox.append((s.handle, (result, None)))
        else:
            self._outbox.append((s.handle, (None, error)))
        if s.inflight_refs == 0:
            self._release(s)

    def _release(self, s: _Seq) -> None:
        """Release late: the row is free only when no launched step contains it."""
        assert s.inflight_refs == 0 and s.finalized
        if self.events is not None:
            self.events.append(("release", s.id, self._commits, s.row))
        self.running.remove(s)
        self.free_rows.append(s.row)
        self.free_rows.sort(reverse=True)
        self._free_pages(s)
        s.row = -1
        if s.outcome is not None:
            self._outbox.append((s.handle, s.outcome))

    def _fail_everything(self, err: BaseException) -> None:
        self._flush_outbox()   # results that were finished before the failure still count
        self._take_inbox()
        for s in itertools.chain(self.waiting, self.encodes, self.running):
            s.handle._finish(error=err if isinstance(err, EngineError) else
                             EngineError(f"the engine failed: {err!r}"))
        for s in self.running:
            self._free_pages(s)
        self.waiting.clear()
        self.encodes.clear()
        self.running.clear()
