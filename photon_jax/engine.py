"""The Photon engine: pipelined continuous batching over one KV cache, two donated slots and
device-resident pending inputs, driven by one scheduler thread.

Each tick of the scheduler thread does, in this order (PHOTON.md 1.5, DESIGN.md 3):

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

Invariants the tests check: at most two steps in flight; a slot is donated again only after
the commit that read it finished (`pipeline.PipelineState`); a row is reused only after the
last step containing it was committed (`inflight_refs`); length caps are predicted at
dispatch so they make no zombie; the launch path never syncs with the device (`hostsync`).
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

from . import hostsync, reference, skills, step as step_mod
from .model import Model
from .pipeline import PipelineState
from .reference import EncodedImage, PreparedImage
from .settings import Settings
from .text import init_cache

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
    `image`: a path, PIL image, array, `EncodedImage`, `PreparedImage` or None."""
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

    def done(self) -> bool:
        return self._done.is_set()

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
        if self._reasoning is None and result is not None:
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
    """Scheduler-side state of one request (PHOTON.md 1.11: two clocks, refs, finalized)."""
    _ids = itertools.count()

    def __init__(self, handle: Handle, prefix: int, prompt_end: int, skill):
        self.id = next(self._ids)
        self.handle, self.req = handle, handle.request
        self.prefix, self.prompt_end, self.skill = prefix, prompt_end, skill
        self.kinds = self.values = None   # per prompt position, when spatial refs are given
        self.prep = None          # Future of a PreparedImage while preprocessing
        self.image = None         # EncodedImage / PreparedImage / None once ready
        self.ready = False
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
                 pipelined: bool = True, prefill_tokens: int = 2048, workers: int = 2,
                 log_steps: int = 100_000, record_events: bool = False,
                 warmup: bool = False, prefill_drains: bool = False,
                 host_work_ms: float = 0.0):
        cfg = model.cfg
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        ctx = cfg.text.max_context if max_context is None else max_context
        if not isinstance(ctx, int) or not cfg.prefix_len < ctx <= cfg.text.max_context:
            raise ValueError(f"max_context must be an int in ({cfg.prefix_len}, "
                             f"{cfg.text.max_context}], got {max_context!r}")
        self.model, self.cfg, self.programs = model, cfg, model.programs
        self.max_batch_size, self.max_context, self.pipelined = max_batch_size, ctx, pipelined
        self.prefill_tokens = prefill_tokens
        self.device = model.device
        rows = max_batch_size + 1   # row 0 is the dummy row padding points at
        with jax.default_device(self.device):
            self.kv = init_cache(cfg, rows, ctx)
            self.slots = [step_mod.init_slot(cfg, max_batch_size) for _ in range(2)]
            self.pending = step_mod.init_pending(rows)
            self.tables = step_mod.Tables(**jax.device_put(step_mod.make_tables(cfg),
                                                            self.device))
        self.pipe = PipelineState()
        self.free_rows = list(range(rows - 1, 0, -1))   # pop() hands out the lowest row
        self.waiting: collections.deque[_Seq] = collections.deque()
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
        self._wake = threading.Event()
        self._closing = False
        self._last_kind = None
        self.failure: BaseException | None = None
        self.alive = True
        self._warmup = warmup
        # Benchmark knobs: drain the pipeline before each prefill (Photon's older rule), and
        # burn this much host time per commit (to chart the gain against the host's share).
        self.prefill_drains, self.host_work_s = prefill_drains, host_work_ms / 1e3
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="photon-prep")
        self._thread = threading.Thread(target=self._loop, name="photon-scheduler", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------------

    def memory(self) -> dict:
        """Bytes of the buffers allocated once at start-up."""
        slot = sum(x.nbytes for s in self.slots for x in jax.tree.leaves(s))
        return {"kv_cache": self.kv.nbytes, "slots": int(slot),
                "pending": int(sum(x.nbytes for x in jax.tree.leaves(self.pending)))}

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

    def _admit(self, h: Handle) -> _Seq:
        req, cfg = h.request, self.cfg
        if req.skill not in ("text", "detect", "point", "segment"):
            raise RequestError(f"unknown skill {req.skill!r}; expected text, detect, point or "
                               "segment")
        if not req.prompt:
            raise RequestError("empty prompt")
        base = 0 if req.image is None else cfg.prefix_len
        p_end = base + len(req.prompt)
        if p_end > self.max_context:
            raise RequestError(
                f"prompt of {len(req.prompt)} tokens (+{base} image positions) exceeds the "
                f"context of {self.max_context} tokens; shorten the question")
        seq = _Seq(h, base, p_end, self._new_skill(req, h, p_end))
        h.id = seq.id
        if req.region:
            if req.image is None:
                raise RequestError("spatial refs need an image")
            seq.kinds, seq.values = reference.region_inputs(req.prompt, req.region,
                                                            cfg.tokenizer)
        img = req.image
        if img is None or isinstance(img, (EncodedImage, PreparedImage)):
            seq.image, seq.ready = img, True
        else:
            seq.prep = self._pool.submit(reference.prepare_image, self.model, img)
            seq.prep.add_done_callback(lambda _: self._wake.set())
        return seq

    def close(self, timeout: float | None = None) -> None:
        """Finish every accepted request, stop the scheduler thread, free device buffers."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise EngineError(f"the scheduler did not stop within {timeout} s")
        self._pool.shutdown(wait=True)
        for leaf in jax.tree.leaves((self.kv, self.slots, self.pending, self.tables)):
            if not leaf.is_deleted():
                leaf.delete()

    def step_log(self) -> list[dict]:
        """Per committed step: kind, rows, host seconds in launch / finalize / commit (commit
        excludes the wait for the host copy), the wait, and the step's end time.  A step is
        logged before the results it finished go out."""
        keys = ("kind", "rows", "launch_s", "finalize_s", "commit_s", "wait_s", "t0", "t_end")
        return [dict(zip(keys, r)) for r in list(self.steps_log)]

    # -- scheduler thread -----------------------------------------------------------------

    def _compile_decode_shapes(self) -> None:
        """Compile decode + sample for every (row bucket, attended-length bucket), so steady
        decoding never waits for the compiler.  Every row is the dummy row: nothing real is
        touched."""
        P, params = self.programs, self.model.params
        for rb in step_mod.row_buckets(self.max_batch_size):
            meta = jax.device_put(np.zeros((4, rb), _I32), self.device)
            samp = np.zeros((step_mod.S_ALLOW + 1, rb), _I32)
            samp[step_mod.S_ALLOW] = -1
            for kv_len in step_mod.kv_buckets(self.max_context):
                self.kv, self.slots[0] = P.forward(params, self.kv, self.slots[0], self.pending,
                                                   meta, kv_len)
            self.slots[0], self.pending = P.sample_step(params, self.slots[0], self.pending,
                                                        self.tables, meta,
                                                        jax.device_put(samp, self.device))
        jax.block_until_ready(self.pending)

    def _loop(self) -> None:
        try:
            if self._warmup:
                self._compile_decode_shapes()
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
            self._fail_everything(EngineError("the engine stopped"))

    def _drained(self) -> bool:
        return not self.waiting and not self.running and self.pipe.idle() and self._inbox.empty()

    def _check_stuck(self) -> None:
        # Nothing in flight, nothing launchable, yet rows are held: a scheduler bug.  Fail
        # loudly rather than let callers wait forever.
        if self.pipe.idle() and self.running and not any(
                s.inflight_refs or s.handle.cancel_requested for s in self.running):
            if not self._eligible():
                raise EngineError(f"scheduler stuck with {len(self.running)} resident rows")

    def _take_inbox(self) -> None:
        while True:
            try:
                self.waiting.extend(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _settle_cancels(self) -> None:
        for s in list(self.waiting):
            if s.handle.cancel_requested:
                self.waiting.remove(s)
                if s.prep is not None:
                    s.prep.cancel()
                s.handle._finish(s.skill.result("cancelled"))
        for s in list(self.running):
            if s.handle.cancel_requested and not s.finalized and s.inflight_refs == 0:
                self._finalize_seq(s, "cancelled")
        self._flush_outbox()

    def _tick(self) -> bool:
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
        # arrivals must not starve the rows already generating.
        if not self.free_rows or (decode_waiting and self._last_kind == "prefill"):
            return []
        batch, tokens = [], 0
        for s in list(self.waiting):
            if not s.ready and s.prep is not None and s.prep.done():
                try:
                    s.image, s.ready = s.prep.result(), True
                except Exception as e:  # unreadable image etc.: this request alone fails
                    self.waiting.remove(s)
                    s.handle._finish(error=e)
                    continue
            if not s.ready:
                continue
            if len(batch) == min(len(self.free_rows), self.max_batch_size) or (
                    batch and tokens + s.prompt_end > self.prefill_tokens):
                break
            batch.append(s)
            tokens += s.prompt_end
        return batch

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

    def _launch_prefill(self, batch: list[_Seq], slot: int) -> None:
        t0 = time.perf_counter()
        P, params, cfg = self.programs, self.model.params, self.cfg
        n = len(batch)
        rb = step_mod.row_bucket(n, self.max_batch_size)
        starts = [0 if s.image is None else cfg.prefix_len for s in batch]
        lens = [len(s.req.prompt) for s in batch]
        tb = step_mod.prompt_bucket(max(lens))
        ids = np.zeros((rb, tb), _I32)
        kinds = np.zeros((rb, tb), _I32)
        values = np.zeros((rb, tb, 2), np.float32)
        meta = np.zeros((4, rb), _I32)
        for i, s in enumerate(batch):
            self.waiting.remove(s)
            s.row = self.free_rows.pop()
            if self.events is not None:
                self.events.append(("acquire", s.id, self._commits, s.row))
            self.running.append(s)
            ids[i, :lens[i]] = s.req.prompt
            if s.kinds is not None:
                kinds[i, :lens[i]], values[i, :lens[i]] = s.kinds, s.values
            meta[:, i] = (s.row, starts[i], starts[i], lens[i] - 1)
        kv_len = step_mod.kv_bucket(max(starts) + tb, self.max_context)
        with hostsync.sync_free():
            put = lambda a: jax.device_put(a, self.device)  # noqa: E731
            for s in batch:
                img = s.image
                if isinstance(img, PreparedImage):
                    img = reference.encode_prepared(self.model, img)
                if img is not None:
                    self.kv = P.write_prefix(self.kv, img.k, img.v, put(_I32(s.row)))
                s.image = None   # the prefix now lives in the row; drop the buffers
            meta_d = put(meta)
            self.kv, self.slots[slot] = P.prefill_slot(params, self.kv, self.slots[slot],
                                                       put(kinds), put(ids), put(values),
                                                       meta_d, kv_len)
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
        meta = np.zeros((4, rb), _I32)
        index = []
        for i, s in enumerate(rows):
            meta[:3, i] = (s.row, s.length, s.prefix)
            index.append(s.n_tokens)
        kv_len = step_mod.kv_bucket(int(meta[1, :n].max()) + 1, self.max_context)
        with hostsync.sync_free():
            meta_d = jax.device_put(meta, self.device)
            self.kv, self.slots[slot] = self.programs.forward(
                self.model.params, self.kv, self.slots[slot], self.pending, meta_d, kv_len)
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
        with hostsync.sync_free():
            samp_d = jax.device_put(samp, self.device)
            self.slots[st.slot], self.pending = self.programs.sample_step(
                self.model.params, self.slots[st.slot], self.pending, self.tables, st.meta,
                samp_d)
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
        s.row = -1
        if s.outcome is not None:
            self._outbox.append((s.handle, s.outcome))

    def _fail_everything(self, err: BaseException) -> None:
        self._flush_outbox()   # results that were finished before the failure still count
        self._take_inbox()
        for s in itertools.chain(self.waiting, self.running):
            s.handle._finish(error=err if isinstance(err, EngineError) else
                             EngineError(f"the engine failed: {err!r}"))
        self.waiting.clear()
        self.running.clear()
