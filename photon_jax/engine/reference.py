"""The plain reference path: one request at a time, exactly the reference's control flow.

Built from the same model functions as the engine (`step.OraclePrograms`, and the engine's
own image program), so the engine can be checked against it token for token.  Semantics
(Moondream 2, normative): the first text token is sampled without suppression, every later
one with the answer id banned; detect/point are greedy and continue while the
full-vocabulary argmax is not EOS; x, y (and size) are read by the region heads from the
hidden state before post_ln and fed back as embeddings; coordinates are bin/1024, sizes
2^(bin*10/1023 - 10), boxes are not clamped.  Segment (Moondream 3, no oracle): free
sampling, coord / size ids fed back as the values their hidden states decode to, output
parsed by `skills.parse_segment`.

`trace` (a dict) collects the intermediate arrays the parity tests compare.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..model import lora
from ..model.config import KIND_COORD, KIND_SIZE, KIND_TOKEN
from ..model.loaded import Model
from ..model.text import init_cache
from ..model.tokenizer import region_inputs
from . import constraints, step
from .frontend import ImagePrefix, PreparedImage, encode_prepared, prepare_image
from .settings import Settings
from .skills import box, parse_segment, reasoning_result
from .step import kv_bucket, prompt_bucket
from .streaming import TextStreamer

_I32 = np.int32


class ContextOverflow(ValueError):
    pass


def adapter_tables(model: Model, adapter) -> tuple:
    """(slot tables holding `adapter` in slot 1, the slot as a [1] array): the arguments
    that apply a LoRA adapter (`convert.adapters.Adapter`) to a one-row program; () for
    None."""
    if adapter is None:
        return ()
    tables = lora.write_slot(lora.init_tables(model.cfg, 1, adapter.rank), 1,
                             jax.tree.map(jnp.asarray, adapter.padded(adapter.rank,
                                                                      np.float32)))
    return jax.device_put(tables, model.placement), np.ones(1, _I32)


def encode_image(model: Model, img, trace: dict | None = None, adapter=None) -> ImagePrefix:
    """An image's prefix K/V, dense (an `ImagePrefix` is returned as is), computed under
    `adapter` (a LoRA adapter, as the reference prefills the image through it) if given."""
    if isinstance(img, ImagePrefix):
        return img
    prep = prepare_image(model, img)
    enc = encode_prepared(step.programs_of(model).image_kv, model.params, prep,
                          *adapter_tables(model, adapter))
    if trace is not None:
        feats, emb = step.oracle_of(model).encode_image(model.params, prep.crops, prep.src,
                                                        prep.ph, prep.pw)
        trace.update(crops=np.array(prep.crops), tiling=prep.tiling, vision_out=feats,
                     img_emb=emb, prefix_k=enc.k, prefix_v=enc.v)
    return enc


def embed_image(model: Model, img):
    """An image's patch embeddings ([Z, D]: vision encoder and projection), as an image
    block inside a prompt feeds them."""
    prep = img if isinstance(img, PreparedImage) else prepare_image(model, img)
    return step.oracle_of(model).encode_image(model.params, prep.crops, prep.src, prep.ph,
                                              prep.pw)[1]


class _Session:
    """One sequence in a one-row cache.  With `routes` (a trace of a model with MoE layers),
    the MoE routing of the prompt's last position and of every decode step is collected in
    `self.routes`."""

    def __init__(self, model: Model, enc: ImagePrefix | None, routes: bool = False,
                 adapter=None):
        self.m, self.P, self.cfg = model, step.oracle_of(model), model.cfg
        self.lora = adapter_tables(model, adapter)   # the programs' last arguments
        self.routes = [] if routes and self.cfg.text.n_moe else None
        self.cache = init_cache(self.cfg, rows=1)
        if enc is not None:
            self.cache = self.P.write_prefix(self.cache, enc.k, enc.v, 0)
            self.pos, self.prefix = enc.pos, enc.pos
        else:
            self.pos, self.prefix = 0, 0
        self.rows = np.zeros(1, _I32)
        self.prefix_R = np.full(1, self.prefix, _I32)

    @property
    def max_context(self):
        return self.cfg.text.max_context

    def prefill(self, ids: list[int], region=None, blocks=()):
        """`region`: values (v0, v1) of the prompt's coord / size tokens (spatial refs).
        `blocks`: (offset, image) of image blocks inside the prompt (`Request.blocks`):
        ids[offset:offset + Z] are placeholders fed the image's embeddings instead, and
        attend the whole block and what precedes it."""
        t = len(ids)
        if self.pos + t > self.max_context:
            raise ContextOverflow(
                f"prompt of {t} tokens at position {self.pos} exceeds the context of "
                f"{self.max_context} tokens; shorten the question"
            )
        tb = prompt_bucket(t)
        padded = np.zeros((1, tb), _I32)
        padded[0, :t] = ids
        pos = (self.pos + np.arange(tb, dtype=_I32))[None]
        kinds = np.zeros((1, tb), _I32)
        values = np.zeros((1, tb, 2), np.float32)
        if region:
            kinds[0, :t], values[0, :t] = region_inputs(ids, region, self.cfg.tokenizer)
        emb = self.P.embed_prompt(self.m.params, kinds, padded, values)
        extra = {}
        if blocks:
            vis = pos.copy()
            for off, img in blocks:
                z = embed_image(self.m, img)
                vis[0, off:off + len(z)] = pos[0, off + len(z) - 1]
                emb = emb.at[0, off:off + len(z)].set(z.astype(emb.dtype))
            extra["vis_RT"] = vis
        prog = self.P.prefill if self.routes is None else self.P.prefill_routes
        self.cache, hid, last, lg, *routes = prog(
            self.m.params, self.cache, emb, pos, self.rows, self.prefix_R,
            np.full(1, t - 1, _I32), kv_bucket(self.pos + tb, self.max_context), *self.lora,
            **extra)
        self._keep(routes)
        self.pos += t
        return hid[0, :t], last, lg

    def _keep(self, routes):
        if routes:
            self.routes.append(routes[0])

    def routes_trace(self) -> dict:
        """{"router_ids", "router_w"}: [Lm, 1 + steps, k] (row 0: the prompt's last
        position), as the fixtures record them."""
        if not self.routes:
            return {}
        ids, w = (np.stack([np.asarray(r[i])[:, 0] for r in self.routes], 1) for i in (0, 1))
        return {"router_ids": ids, "router_w": w}

    def room(self, n: int = 1) -> bool:
        return self.pos + n <= self.max_context

    def decode(self, kind: int, token: int = 0, value=(0.0, 0.0)):
        prog = self.P.decode if self.routes is None else self.P.decode_routes
        self.cache, h, lg, *routes = prog(
            self.m.params, self.cache, np.full(1, kind, _I32), np.full(1, token, _I32),
            np.asarray([value], np.float32), np.full(1, self.pos, _I32), self.rows,
            self.prefix_R, kv_bucket(self.pos + 1, self.max_context), *self.lora)
        self._keep(routes)
        self.pos += 1
        return h, lg


class _Sampler:
    """The reference's sampling of one request: token i uses key (seed, i)."""

    def __init__(self, model: Model, s: Settings):
        self.P = step.oracle_of(model)
        self.prog = self.P.sample if s.temperature > 0 else self.P.greedy
        self.samp = (np.full(1, s.temperature, np.float32), np.full(1, s.top_p, np.float32),
                     np.full(1, s.seed, _I32))

    def __call__(self, lg, ban: list[int], index: int) -> int:
        b = np.array([ban or [-1]], _I32)
        return int(self.prog(lg, b, *self.samp, np.full(1, index, _I32))[0])


def _reason(model: Model, sess: _Session, h, lg, s: Settings, sample: _Sampler):
    """MD2 grounded reasoning, as the reference runs it: sample until the answer id (or
    max_tokens), EOS and size banned after the first token; a coord token is fed as the
    coordinate its hidden state decodes to, and pairs of them ground the current chunk (7 and
    9 open new chunks).  Then the answer id is fed.  Returns (logits, index of the next
    token, {"text", "grounding"}, finish_reason or None)."""
    tok = model.cfg.tokenizer
    chunks, coords = [[]], [[]]
    i, finish = 0, None
    nxt = sample(lg, [], 0)
    while nxt != tok.answer_id and i < s.max_tokens:
        if nxt in (tok.start_ground_points_id, tok.end_ground_id):
            chunks.append([])
            coords.append([])
        chunks[-1].append(nxt)
        cv = None
        if nxt == tok.coord_id:
            cv = float(step.oracle_of(model).region_heads(model.params, h)[1][0])
            coords[-1].append(cv)
        if not sess.room():
            finish = "length"
            break
        if cv is not None:
            h, lg = sess.decode(KIND_COORD, value=(cv, 0.0))
        else:
            h, lg = sess.decode(KIND_TOKEN, nxt)
        i += 1
        nxt = sample(lg, constraints.banned(constraints.REASON, tok), i)
    if finish is None:
        # The answer id ends the reasoning (sampled, or in place of the token past
        # max_tokens) and is fed like a one-token prompt.
        if sess.room():
            h, lg = sess.decode(KIND_TOKEN, tok.answer_id)
        else:
            finish = "length"
    return lg, i + 1, reasoning_result(model.prompts.decode, chunks, coords), finish


def iter_text(model: Model, enc: ImagePrefix | None, prompt: list[int], s: Settings,
              trace: dict | None = None, region=None, reasoning: bool = False, adapter=None,
              blocks=()):
    """Caption / query answer as a generator of flushed text pieces (the reference's streaming
    rules).  Its return value (StopIteration.value) is {"text", "ids", "finish_reason"} and,
    with `reasoning`, "reasoning": {"text", "grounding"} (computed before the first piece).
    `adapter`: a LoRA adapter applied to the prompt and the answer (`enc` made under it
    too: `encode_image(..., adapter=)`).  `blocks`: image blocks inside the prompt
    (`_Session.prefill`)."""
    cfg = model.cfg
    tok_cfg = cfg.tokenizer
    sess = _Session(model, enc, routes=trace is not None, adapter=adapter)
    hid, last, lg = sess.prefill(prompt, region, blocks)
    sample = _Sampler(model, s)
    if trace is not None:
        trace["prefill_logits"] = lg[0]
    extra, index0 = {}, 0
    if reasoning:
        lg, index0, extra["reasoning"], finish = _reason(model, sess, last, lg, s, sample)
        if finish is not None:
            return {"text": "", "ids": [], "finish_reason": finish, **extra}
    streamer = TextStreamer(model.prompts.decode)
    pieces, ids, steps = [], [], []
    nxt = sample(lg, [], index0)
    finish = "length"
    while True:
        if nxt == tok_cfg.eos_id:
            finish = "stop"
            break
        if len(ids) >= s.max_tokens:
            break
        ids.append(nxt)
        piece = streamer.push(nxt)
        if piece:
            pieces.append(piece)
            yield piece
        # The reference decodes the last emitted token too; its logits are never used, so skip
        # it unless a trace wants the hidden state.
        if len(ids) == s.max_tokens and trace is None:
            break
        if not sess.room():
            break
        h, lg = sess.decode(KIND_TOKEN, nxt)
        steps.append(h[0])
        nxt = sample(lg, constraints.banned(constraints.BAN_ANSWER, tok_cfg),
                     index0 + len(ids))
    tail = streamer.flush()
    if tail:
        pieces.append(tail)
        yield tail
    if trace is not None:
        trace.update(prefill_hidden=hid, step_hidden=jnp.stack(steps) if steps else None,
                     **sess.routes_trace())
    return {"text": "".join(pieces), "ids": ids, "finish_reason": finish, **extra}


def generate_text(model: Model, enc: ImagePrefix | None, prompt: list[int], s: Settings,
                  trace: dict | None = None, region=None, reasoning: bool = False,
                  adapter=None, blocks=()) -> dict:
    """iter_text run to completion: {"text", "ids", "finish_reason"[, "reasoning"]}."""
    gen = iter_text(model, enc, prompt, s, trace, region, reasoning, adapter, blocks)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def generate_points(model: Model, enc: ImagePrefix, prompt: list[int], *, with_size: bool,
                    max_objects: int, trace: dict | None = None, adapter=None) -> dict:
    """detect (with_size) / point.  Returns {"objects": [...], "bins": [...],
    "finish_reason"}."""
    cfg, P = model.cfg, step.oracle_of(model)
    eos = cfg.tokenizer.eos_id
    sess = _Session(model, enc, routes=trace is not None, adapter=adapter)
    hid, h, lg = sess.prefill(prompt)
    per_object = 3 if with_size else 2
    objects, bins, steps = [], [], []
    finish = "stop"

    def heads(h):
        cb, cv, sb, sv = P.region_heads(model.params, h)
        return int(cb[0]), float(cv[0]), np.array(sb[0]), np.array(sv[0])

    if trace is not None:
        trace["prefill_logits"] = lg[0]
    while True:
        if int(np.argmax(np.array(lg[0]))) == eos:
            break
        if len(objects) >= max_objects:
            finish = "max_objects"
            break
        if not sess.room(per_object):
            finish = "length"
            break
        xb, x, _, _ = heads(h)
        h, _ = sess.decode(KIND_COORD, value=(x, 0.0))
        steps.append(h[0])
        yb, y, _, _ = heads(h)
        h, lg = sess.decode(KIND_COORD, value=(y, 0.0))
        steps.append(h[0])
        if with_size:
            _, _, sb, (w, hh) = heads(h)
            h, lg = sess.decode(KIND_SIZE, value=(float(w), float(hh)))
            steps.append(h[0])
            objects.append(box(x, y, float(w), float(hh)))
            bins.append([xb, yb, int(sb[0]), int(sb[1])])
        else:
            objects.append({"x": x, "y": y})
            bins.append([xb, yb])
    if trace is not None:
        trace.update(prefill_hidden=hid, step_hidden=jnp.stack(steps) if steps else None,
                     **sess.routes_trace())
    return {"objects": objects, "bins": bins, "finish_reason": finish}


def generate_segment(model: Model, enc: ImagePrefix, prompt: list[int], s: Settings,
                     region=None) -> dict:
    """Moondream 3 segment, one request: {"path", "bbox", "ids", "finish_reason"}.  Tokens
    are sampled freely; a coord / size id is fed back as the coordinate / size decoded from
    the hidden state that produced it (the engine's `skills.SegmentSkill` rules)."""
    tok = model.cfg.tokenizer
    sess = _Session(model, enc)
    _, h, lg = sess.prefill(prompt, region)
    sample = _Sampler(model, s)
    ids, values, finish = [], [], "length"
    nxt = sample(lg, [], 0)
    while True:
        if nxt == tok.eos_id:
            finish = "stop"
            break
        if len(ids) >= s.max_tokens:
            break
        kind, value = KIND_TOKEN, (0.0, 0.0)
        if nxt in (tok.coord_id, tok.size_id):
            _, cv, _, sv = step.oracle_of(model).region_heads(model.params, h)
            kind, value = ((KIND_COORD, (float(cv[0]), 0.0)) if nxt == tok.coord_id
                           else (KIND_SIZE, tuple(float(v) for v in np.array(sv[0]))))
        ids.append(nxt)
        values.append(value)
        if len(ids) == s.max_tokens or not sess.room():
            break
        h, lg = sess.decode(kind, nxt, value)
        nxt = sample(lg, [], len(ids))
    seg = parse_segment(ids, values, model.prompts.decode, tok.coord_id, tok.size_id)
    return {**seg, "ids": ids, "finish_reason": finish}
