"""The caller's side of a generation: `Request` (what to run), `Handle` (its result, stream,
cancel and metrics) and the two errors.

The API, the CLI and the Ray integration use these without importing the scheduler.  A
handle has one writer, `scheduler.Outbox`: everything a request learns (its prefill, each
committed token, text pieces, the reasoning, its result or error) arrives through the
handle's `deliver_*` methods, called from there only, in order.  A handle only needs its
runner to wake it (after `cancel`) and to say whether it is still alive (`Runner`).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from .settings import Settings

_END = object()


class Runner(Protocol):
    """What a handle needs from the engine that runs it."""
    alive: bool
    failure: BaseException | None

    def wake(self) -> None:
        """Look at cancellations now (the scheduler may be waiting for work)."""


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
    `PreparedImage`, `ImagePrefix` (dense K/V, e.g. the one-request path's) or None: the
    image at the start (BOS + image, bidirectional); `blocks` places more inside the prompt."""
    skill: str
    prompt: list
    image: Any = None
    settings: Settings = field(default_factory=Settings)
    region: list | None = None  # (v0, v1) per coord / size token of the prompt (spatial refs)
    # Image blocks inside the prompt (a conversation's images after its start, text skill):
    # (offset, image) pairs, the image's Z = prefix_len - 1 positions being prompt[offset:
    # offset + Z] (placeholders; their inputs are the image's embeddings, attended
    # bidirectionally across the block).  Sorted, apart, and ending before the prompt does.
    blocks: tuple = ()
    reasoning: bool = False     # text: MD2 grounded reasoning before the answer
    ignore_eos: bool = False    # benchmarks: decode a fixed number of tokens


class Handle:
    """The caller's side of a request: `result()`, `cancel()`, `text_stream()`."""

    def __init__(self, engine: "Runner", request: Request):
        self._engine, self.request = engine, request
        self.id = None
        self._done = threading.Event()
        self._result = self._error = None
        self._reasoning = None
        self._reasoned = threading.Event()
        self._texts: queue.SimpleQueue = queue.SimpleQueue()
        self._logprobs: collections.deque = collections.deque()
        self.cancel_requested = False
        # Someone reads its text as it comes (`text_stream` or `take_texts` called): the
        # engine slices new images' encodes to keep such rows flowing (`engine.slicing`).
        self.streamed = False
        self._callbacks: list = []
        self._cb_lock = threading.Lock()
        self._progress: list = []   # fn(handle) after each text piece / the reasoning (aio)
        # For `metrics()`: submit / first-token / end times, prompt positions, tokens
        # committed, whether the image prefix came from the cache.
        self._t_submit = time.perf_counter()
        self._t_first = self._t_end = None
        self._input_tokens = self._output_tokens = 0
        self._prefix_hit: bool | None = None
        self._cached_tokens = 0

    def done(self) -> bool:
        """-> True once the request finished (result, error or cancellation)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request finished or `timeout` seconds passed -> `done()`."""
        return self._done.wait(timeout)

    def metrics(self) -> dict:
        """How the request ended and what it cost, once it finished: {"finish_reason"
        ("stop", "length", "repeat", "max_objects", "cancelled", "error"), "input_tokens"
        (prompt positions, the image prefix included), "output_tokens" (as in the result),
        "prefix_cache_hit" (True / False; None without an image or with the cache off),
        "cached_tokens" (leading prompt positions read from the caches, not computed: an
        image prefix, earlier turns of a conversation),
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
                "cached_tokens": self._cached_tokens,
                "time_to_first_token_s": ttft, "decode_tokens_per_s": rate}

    def result(self, timeout: float | None = None):
        """Wait for the request -> the skill's result: text {"text", "ids", "finish_reason",
        "output_tokens"[, "reasoning"]}; detect / point {"objects", "finish_reason",
        "output_tokens"}; segment {"path", "bbox", "ids", "finish_reason", "output_tokens"};
        an encode job its `EncodedImage` (`Moondream` reshapes these into Moondream's
        results).  Raises the request's error, or TimeoutError after `timeout` seconds."""
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

    def add_progress_callback(self, fn) -> None:
        """Call `fn(handle)` after each text piece is queued and when the reasoning is ready
        (on the scheduler thread: quick, never blocking).  For callers that cannot block on
        `text_stream` (the asyncio bridge, `aio`); pair it with `take_texts` and
        `add_done_callback`."""
        self._progress.append(fn)

    def take_texts(self) -> tuple[list[str], bool]:
        """Without waiting: the text pieces queued since the last call, and whether the
        stream has ended (the request finished).  Not to be mixed with `text_stream`."""
        self.streamed = True
        pieces = []
        while True:
            try:
                item = self._texts.get_nowait()
            except queue.Empty:
                return pieces, False
            if item is _END:
                return pieces, True
            pieces.append(item)

    def reasoning_ready(self) -> bool:
        """-> True once `reasoning()` would return without waiting."""
        return self._reasoned.is_set()

    def cancel(self) -> None:
        """Stop generating; the result (finish_reason "cancelled") arrives once the engine
        has released the request's row."""
        self.cancel_requested = True
        self._engine.wake()

    def text_stream(self):
        """Text pieces as the engine commits tokens; closing the iterator cancels."""
        self.streamed = True
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

    # The delivery side: called by `scheduler.Outbox` only (see the module docstring).

    def deliver_prefill(self, input_tokens: int, prefix_hit: bool | None,
                        cached_tokens: int = 0) -> None:
        """The request's prefill was launched: its prompt positions, image prefix included,
        whether that prefix came from the cache (None: no image prefix), and how many
        leading positions were read from the caches instead of computed."""
        self._input_tokens, self._prefix_hit = input_tokens, prefix_hit
        self._cached_tokens = cached_tokens

    def deliver_token(self, now: float) -> None:
        """One of its tokens was committed at `now` (perf_counter)."""
        self._output_tokens += 1
        if self._t_first is None:
            self._t_first = now

    def deliver_logprob(self, entry: dict) -> None:
        """An answer token's log-probability entry (settings "logprobs"), delivered before
        the text piece that holds the token."""
        self._logprobs.append(entry)

    def take_logprobs(self) -> list:
        """The log-probability entries delivered since the last call (a stream sends them
        with the text they came with), in token order."""
        out = []
        while self._logprobs:   # one taker; the scheduler thread only appends
            out.append(self._logprobs.popleft())
        return out

    def deliver_text(self, piece: str) -> None:
        self._texts.put(piece)
        self._notify()

    def deliver_reasoning(self, reasoning: dict) -> None:
        self._reasoning = reasoning
        self._reasoned.set()
        self._notify()

    def _notify(self) -> None:
        for fn in self._progress:
            try:
                fn(self)
            except Exception:   # a caller's bug must not stop the scheduler
                logging.getLogger(__name__).exception("progress callback failed")

    def deliver_result(self, result=None, error: BaseException | None = None) -> None:
        """The request finished: its result, or its error.  The first delivery counts (a
        request that failed alone is not failed again when the engine stops)."""
        with self._cb_lock:
            if self._done.is_set():
                return
            self._result, self._error = result, error
            self._t_end = time.perf_counter()
            if self._reasoning is None and isinstance(result, dict):
                self._reasoning = result.get("reasoning")
            self._reasoned.set()
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        self._texts.put(_END)
        for fn in callbacks:
            try:
                fn(self)
            except Exception:   # a caller's bug must not stop the scheduler
                logging.getLogger(__name__).exception("done callback failed")
