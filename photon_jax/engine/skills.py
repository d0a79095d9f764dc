"""Per-request skill state machines: what a request may sample next, what a committed token
means, when it is finished.  Pure Python, no JAX; the engine calls them only at commit (and
asks for the next constraint right after), so they always see committed state.

Semantics are the Moondream 2 reference's (normative, see `reference.py`):

- text (caption, query): the first token is sampled freely, every later one with the answer
  id banned.  EOS ends the request ("stop"); after `max_tokens` tokens, or when the context is
  full, it ends with "length" and the last token is kept.
- detect / point: objects are (x, y[, size]) cycles.  At an x step the argmax over the full
  vocabulary decides: EOS ends the request, anything else is read as a coordinate.  y and size
  steps are forced.  A new object starts only while fewer than `max_objects` exist and the
  context has room for a whole object.

- query with reasoning (MD2 grounded reasoning): reasoning tokens until the answer id, the
  first free, the rest with EOS and size banned; a coord id there is fed as the coordinate
  its hidden state decodes to, and pairs of them ground the current chunk (ids 7 and 9 open
  new chunks).  The answer id is fed, then the answer is generated as plain text.  At
  `max_tokens` reasoning tokens the answer id is forced (the per-row allowed-set path).

- an answer held to a shape (settings json_schema / regex / choices): a text skill whose
  every token is also masked by its grammar matcher (`grammar.Matcher`), which advances as
  tokens commit; `mask(index)` hands the engine the next token's allow-bitmask.  With
  reasoning, the shape applies to the answer.

- segment (Moondream 3): free sampling; a sampled coord / size id carries the coordinate /
  (width, height) its hidden state decodes to and is fed back as that value.  The result is
  parsed by `parse_segment`: a box from the first coordinate pair and the first size, then
  the SVG path from the text tokens.

Every stopping rule except EOS (and `repeat_stop`) depends only on the token index and the
committed tokens before it, so the engine predicts it at dispatch (`feedable`) and a capped
request never rides an extra step as a zombie.  `budget` bounds the tokens a request may
generate: the engine reserves KV pages for prompt + budget at admission.

Each step a skill names a constraint (`constraints`: ids and what each one does); the
device applies it.  `for_request` is the factory from a request to its skill.
"""

from __future__ import annotations

from typing import Callable

from .constraints import (BAN_ANSWER, FORCE_COORD, FORCE_SIZE, FREE, REASON, REASON_FIRST,
                          SEGMENT, SPATIAL_X)
from .streaming import TextStreamer


MAX_REPEAT_NGRAM = 16


def box(x: float, y: float, w: float, h: float) -> dict:
    """The box of centre (x, y) and size (w, h), as Moondream returns it: {"x_min", "y_min",
    "x_max", "y_max"}, not clamped to [0, 1] (the reference does not clamp)."""
    return {"x_min": x - w / 2, "y_min": y - h / 2, "x_max": x + w / 2, "y_max": y + h / 2}


def repeats(ids: list[int], times: int) -> bool:
    """Does `ids` end with some n-gram (n <= MAX_REPEAT_NGRAM) repeated `times` times?"""
    for n in range(1, MAX_REPEAT_NGRAM + 1):
        if n * times > len(ids):
            break
        tail = ids[-n:]
        if all(ids[-(k + 1) * n: len(ids) - k * n] == tail for k in range(1, times)):
            return True
    return False


class TextSkill:
    spatial = False

    def __init__(self, *, max_tokens: int, prompt_end: int, max_context: int, eos_id: int,
                 decode: Callable, on_text: Callable | None = None, ignore_eos: bool = False,
                 repeat_stop: int | None = None, shape=None, stop: tuple = (),
                 logprobs: int | None = None, token_bytes: Callable | None = None,
                 on_logprob: Callable | None = None):
        self.max_tokens, self.prompt_end, self.max_context = max_tokens, prompt_end, max_context
        self.eos_id, self.ignore_eos, self.repeat_stop = eos_id, ignore_eos, repeat_stop
        self.on_text = on_text
        # Log-probabilities (settings "logprobs"): an entry per answer token, EOS excluded.
        self.logprobs, self.token_bytes, self.on_logprob = logprobs, token_bytes, on_logprob
        self.entries: list[dict] = []
        self.shape = shape   # a grammar.Matcher, or None
        # Stop strings (settings "stop"): the answer ends before the first one, which is
        # not part of it.  Text that could be the start of one is held back from the
        # stream until it is known not to be.
        self.stop, self._held = tuple(stop), ""
        self.streamer = TextStreamer(decode)
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self.count = 0   # tokens committed (including a final EOS)

    @property
    def budget(self) -> int:
        return self.max_tokens

    def constraint(self, index: int) -> int:
        return FREE if index == 0 else BAN_ANSWER

    def allowed(self, index: int) -> list[int] | None:
        return None

    def mask(self, index: int):
        """The shape's allow-bitmask for token `index` (None: no shape)."""
        return None if self.shape is None else self.shape.mask()

    def feedable(self, index: int) -> bool:
        """May token `index` be fed back to produce token index + 1 (unless it is EOS)?"""
        return index + 1 < self.max_tokens and self.prompt_end + index + 1 <= self.max_context

    def consume(self, token: int, value, logprobs=None) -> str | None:
        """`logprobs`: the step's `step.Slot.logprobs` row of this request, when it asked
        for them."""
        i = self.count
        self.count += 1
        if token == self.eos_id and not self.ignore_eos:
            return "stop"
        if self.shape is not None:
            self.shape.consume(token)
        self.ids.append(token)
        if logprobs is not None and self.logprobs is not None:
            self._logprob(token, logprobs)
        piece = self.streamer.push(token)
        # The unreleased tail is decoded again only when a stop string could hide in it.
        if self._release(piece, self.streamer.pending() if self.stop else ""):
            return "stop"
        if self.repeat_stop and repeats(self.ids, self.repeat_stop):
            return "repeat"
        return None if self.feedable(i) else "length"

    def _logprob(self, token: int, row) -> None:
        """OpenAI's entry for one answer token: its text, bytes and log-probability, and its
        position's `self.logprobs` most likely alternatives, best first.  Delivered before the
        token's text, so a stream that sends a piece has the entries of its tokens."""
        k = (len(row) - 1) // 2
        lps = row[:1 + k].view("float32")
        entry = self._token(token, lps[0])
        entry["top_logprobs"] = [self._token(int(t), lp)
                                 for t, lp in zip(row[1 + k:1 + k + self.logprobs],
                                                  lps[1:1 + self.logprobs])]
        self.entries.append(entry)
        if self.on_logprob is not None:
            self.on_logprob(entry)

    def _token(self, token: int, logprob) -> dict:
        raw = self.token_bytes(token)
        return {"id": token, "token": raw.decode("utf-8", errors="replace"),
                "bytes": list(raw), "logprob": float(logprob)}

    def _release(self, piece: str, pending: str = "") -> bool:
        """Emit a piece the streamer released, minding the stop strings -> a stop string
        was found (the text before it is emitted, the rest never is)."""
        if not self.stop:
            self._emit(piece)
            return False
        self._held += piece
        text = self._held + pending
        hits = [k for k in (text.find(s) for s in self.stop) if k >= 0]
        if hits:
            self._emit(text[:min(hits)])
            self._held, self.stop = "", ()
            self.streamer = _Ended()
            return True
        # Hold back the longest tail that could begin a stop string.
        keep = max((k for s in self.stop for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)
        n = min(len(self._held), len(text) - keep)
        self._emit(self._held[:n])
        self._held = self._held[n:]
        return False

    def _emit(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            if self.on_text is not None:
                self.on_text(piece)

    def result(self, finish_reason: str) -> dict:
        if not self._release(self.streamer.flush()):
            self._emit(self._held)
            self._held = ""
        out = {"text": "".join(self.pieces), "ids": list(self.ids),
               "finish_reason": finish_reason, "output_tokens": self.count}
        if self.logprobs is not None:
            out["logprobs"] = list(self.entries)
        return out


class _Ended:
    """The streamer of an answer cut at a stop string: nothing more is released."""

    def push(self, token: int) -> str:
        return ""

    def pending(self) -> str:
        return ""

    def flush(self) -> str:
        return ""


def parse_segment(ids: list[int], values: list, decode: Callable, coord_id: int,
                  size_id: int) -> dict:
    """Moondream 3's segment output -> {"path": str, "bbox": {x_min, y_min, x_max, y_max} or
    None}.  The model emits a box as coord (centre x), coord (centre y), size (w, h), then
    the SVG path as text (M/L/C/Z commands with numbers); `values[i]` is the value carried by
    `ids[i]` (unused for text tokens).  The box comes from the first coordinate pair and the
    first size after it (None if the output has no complete box); the path is the text of
    every other token, coordinate and size tokens left out."""
    coords, size, path = [], None, []
    for tok, val in zip(ids, values):
        if tok == coord_id:
            if size is None:
                coords.append(float(val[0]))
        elif tok == size_id:
            if size is None and len(coords) >= 2:
                size = (float(val[0]), float(val[1]))
        else:
            path.append(tok)
    bbox = None
    if size is not None:
        (x, y), (w, h) = coords[:2], size
        bbox = box(x, y, w, h)
    return {"path": decode(path).strip(), "bbox": bbox}


class SegmentSkill(TextSkill):
    """Moondream 3 segment: text rules (EOS, max_tokens, context), spatial ids carry values,
    the result is `parse_segment`'s."""

    def __init__(self, *, coord_id: int, size_id: int, **text):
        super().__init__(**text)
        self.coord_id, self.size_id = coord_id, size_id
        self.values: list[tuple[float, float]] = []

    def constraint(self, index: int) -> int:
        return SEGMENT

    def consume(self, token: int, value) -> str | None:
        n = len(self.ids)
        reason = super().consume(token, value)
        if len(self.ids) > n:
            self.values.append((float(value[0]), float(value[1])))
        return reason

    def result(self, finish_reason: str) -> dict:
        out = super().result(finish_reason)
        seg = parse_segment(self.ids, self.values, self.streamer.decode, self.coord_id,
                            self.size_id)
        return {**seg, "ids": out["ids"], "finish_reason": finish_reason,
                "output_tokens": self.count}


def reasoning_result(decode, chunks, coords) -> dict:
    """{"text", "grounding"} of MD2 reasoning: each chunk's text, and for chunks with at least
    two coordinates their (x, y) pairs and the chunk's character range in the text."""
    texts = [decode(c) for c in chunks]
    grounding, start = [], 0
    for text, cs in zip(texts, coords):
        if len(cs) > 1:
            pts = [(cs[k], cs[k + 1]) for k in range(0, len(cs) - len(cs) % 2, 2)]
            grounding.append({"start_idx": start, "end_idx": start + len(text), "points": pts})
        start += len(text)
    return {"text": "".join(texts), "grounding": grounding}


class ReasoningSkill:
    """A query with grounded reasoning: a reasoning phase, then a `TextSkill` answer."""
    spatial = False

    def __init__(self, *, max_tokens: int, prompt_end: int, max_context: int, eos_id: int,
                 answer_id: int, coord_id: int, chunk_ids: tuple, decode: Callable,
                 on_text: Callable | None = None, on_reasoning: Callable | None = None,
                 ignore_eos: bool = False, repeat_stop: int | None = None, shape=None,
                 stop: tuple = (), **answer):
        """`answer`: the answer's log-probability arguments (`TextSkill`'s; the reasoning's
        tokens get none)."""
        self.max_tokens, self.prompt_end, self.max_context = max_tokens, prompt_end, max_context
        self.answer_id, self.coord_id, self.chunk_ids = answer_id, coord_id, chunk_ids
        self.decode, self.on_reasoning = decode, on_reasoning
        self._answer_args = dict(max_tokens=max_tokens, max_context=max_context, eos_id=eos_id,
                                 decode=decode, on_text=on_text, ignore_eos=ignore_eos,
                                 repeat_stop=repeat_stop, shape=shape, stop=stop, **answer)
        self.chunks: list[list[int]] = [[]]
        self.coords: list[list[float]] = [[]]
        self.answer: TextSkill | None = None
        self.start = 0      # index of the first answer token
        self.count = 0

    @property
    def budget(self) -> int:
        # max_tokens of reasoning, the answer id (forced at the latest after them), and
        # max_tokens of answer.
        return 2 * self.max_tokens + 1

    def constraint(self, index: int) -> int:
        if self.answer is not None:
            return self.answer.constraint(index - self.start)
        return REASON_FIRST if index == 0 else REASON

    def allowed(self, index: int) -> list[int] | None:
        if self.answer is None and index >= self.max_tokens:
            return [self.answer_id]   # the reasoning budget is spent: the answer id comes next
        return None

    def mask(self, index: int):
        if self.answer is not None:
            return self.answer.mask(index - self.start)
        return None

    def feedable(self, index: int) -> bool:
        if self.answer is not None and index >= self.start:
            return self.answer.feedable(index - self.start)
        return self.prompt_end + index + 1 <= self.max_context

    def consume(self, token: int, value, logprobs=None) -> str | None:
        i = self.count
        self.count += 1
        if self.answer is not None:
            return self.answer.consume(token, value, logprobs)
        if token == self.answer_id:
            self.start = i + 1
            self.answer = TextSkill(prompt_end=self.prompt_end + self.start, **self._answer_args)
            if self.on_reasoning is not None:
                self.on_reasoning(self.reasoning())
        else:
            if token in self.chunk_ids:
                self.chunks.append([])
                self.coords.append([])
            self.chunks[-1].append(token)
            if token == self.coord_id:
                self.coords[-1].append(float(value[0]))
        return None if self.feedable(i) else "length"

    def reasoning(self) -> dict:
        return reasoning_result(self.decode, self.chunks, self.coords)

    def result(self, finish_reason: str) -> dict:
        if self.answer is None:
            out = {"text": "", "ids": [], "finish_reason": finish_reason}
        else:
            out = self.answer.result(finish_reason)
        return {**out, "reasoning": self.reasoning(), "output_tokens": self.count}


class PointsSkill:
    spatial = True

    def __init__(self, *, with_size: bool, max_objects: int, prompt_end: int, max_context: int,
                 eos_id: int, ignore_eos: bool = False):
        self.with_size = with_size
        self.per_object = 3 if with_size else 2
        self.max_objects, self.prompt_end, self.max_context = max_objects, prompt_end, max_context
        self.eos_id, self.ignore_eos = eos_id, ignore_eos
        self.objects: list[dict] = []
        self.count = 0
        self._x = self._y = 0.0

    @property
    def budget(self) -> int:
        # Whole objects up to max_objects, then the x step that ends it (EOS or the cap).
        return self.per_object * self.max_objects + 1

    def constraint(self, index: int) -> int:
        return (SPATIAL_X, FORCE_COORD, FORCE_SIZE)[index % self.per_object]

    def allowed(self, index: int) -> list[int] | None:
        return None

    def mask(self, index: int):
        return None

    def _may_start_object(self, index: int) -> bool:
        return (index // self.per_object < self.max_objects
                and self.prompt_end + index + self.per_object <= self.max_context)

    def feedable(self, index: int) -> bool:
        return index % self.per_object != 0 or self._may_start_object(index)

    def consume(self, token: int, value) -> str | None:
        i = self.count
        self.count += 1
        phase = i % self.per_object
        if phase == 0:
            if token == self.eos_id and not self.ignore_eos:
                return "stop"
            if not self._may_start_object(i):
                return "max_objects" if len(self.objects) >= self.max_objects else "length"
            self._x = float(value[0])
        elif phase == 1:
            self._y = float(value[0])
            if not self.with_size:
                self.objects.append({"x": self._x, "y": self._y})
        else:
            self.objects.append(box(self._x, self._y, float(value[0]), float(value[1])))
        return None

    def result(self, finish_reason: str) -> dict:
        return {"objects": list(self.objects), "finish_reason": finish_reason,
                "output_tokens": self.count}


def for_request(req, tok, *, prompt_end: int, max_context: int, decode: Callable,
                on_text: Callable | None = None, on_reasoning: Callable | None = None,
                shape=None, token_bytes: Callable | None = None,
                on_logprob: Callable | None = None):
    """The skill state machine of one request (a `request.Request`; tok: its model's
    `TokenizerConfig`): text (caption / query), reasoning query, segment, detect or point.
    `shape`: the request's `grammar.Matcher` (text skills only); `token_bytes` and
    `on_logprob`: a text answer's log-probability entries (settings "logprobs")."""
    common = dict(prompt_end=prompt_end, max_context=max_context, eos_id=tok.eos_id,
                  ignore_eos=req.ignore_eos)
    text = dict(max_tokens=req.settings.max_tokens, decode=decode, on_text=on_text,
                repeat_stop=req.settings.repeat_stop, **common)
    answer = dict(shape=shape, stop=req.settings.stop, logprobs=req.settings.logprobs,
                  token_bytes=token_bytes, on_logprob=on_logprob)
    if req.skill == "text" and req.reasoning:
        return ReasoningSkill(answer_id=tok.answer_id, coord_id=tok.coord_id,
                              chunk_ids=(tok.start_ground_points_id, tok.end_ground_id),
                              on_reasoning=on_reasoning, **answer, **text)
    if req.skill == "text":
        return TextSkill(**answer, **text)
    if req.skill == "segment":
        return SegmentSkill(coord_id=tok.coord_id, size_id=tok.size_id,
                            **{**text, "on_text": None})
    return PointsSkill(with_size=req.skill == "detect", max_objects=req.settings.max_objects,
                       **common)
