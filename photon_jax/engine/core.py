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
   seen it), else a decode step of every eligible row, with slices of new images' prefixes
   in front of it while streamed rows decode (`slicing`, docs/slicing.md).

Dispatch is asynchronous, so forward t+1 runs on the device while the host commits step t;
the host blocks only inside commit, on a copy started one step earlier.  The blocking twin
(`pipelined=False`) runs the same code as launch -> finalize -> commit with no overlap.

Memory: K/V live in one paged pool (`kvpool`, `pages`).  A request is admitted when a row
and the pages of its whole budget (prompt + what it may generate) are free, evicting cached
image prefixes least-recently-used if needed; pages are assigned lowest-first as it grows
and come back when its row does.  A request whose image is in the prefix cache reads the
cached prefix pages in place (the kernels; the XLA sweep copies them) instead of running the
vision encoder and the prefix prefill; so does a prompt that continues a finished sequence
with the conversation cache's pages.

Invariants the tests check: at most two steps in flight; a slot is donated again only after
the commit that read it finished (`inflight.PipelineState`); a row and its pages are reused
only after the last step containing it was committed (`inflight_refs`); length caps are
predicted at dispatch so they make no zombie; the launch path never syncs with the device
(`hostsync`); every page is free again after `close()`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import numpy as np
import PIL.Image

from ..model import lora
from ..model.config import KIND_IMAGE
from ..model.loaded import Model
from ..model.pixels import pil_pixels
from ..model.tokenizer import region_inputs
from . import constraints, frontend, grammar, hostmem, hostsync, kvpool, memory, skills, \
    slicing, step as step_mod
from .frontend import EncodedImage, ImagePrefix, PreparedImage
from .inflight import PipelineState
from .pages import pages_for
from .request import EngineError, Handle, Request, RequestError
from .scheduler import Origin, Outbox, Scheduler, Seq, adapter_key
from .settings import parse as parse_settings
from .stepmeta import M_TABLE, pack_decode, pack_prefill

_I32 = np.int32
_log = logging.getLogger(__name__)


class StepTiming(NamedTuple):
    """One committed step in `Engine.step_log`: host seconds spent in launch, finalize and
    commit (commit excludes the wait for the host copy), that wait, and the step's start
    and end times (perf_counter)."""
    kind: str          # "prefill" / "decode" / "burst" (decode_burst steps at once)
    rows: int
    launch_s: float
    finalize_s: float
    commit_s: float
    wait_s: float
    t0: float
    t_end: float
    slice_flops: float = 0.0   # image slices launched in front of it (`slicing`)


class _InFlightStep:
    __slots__ = ("kind", "slot", "seqs", "index", "meta", "out", "logprobs", "t_launch",
                 "t_finalize", "t0", "slices")

    def __init__(self, kind, slot, seqs, index, meta):
        self.kind, self.slot, self.seqs, self.index, self.meta = kind, slot, seqs, index, meta
        self.out = self.logprobs = None
        self.slices = {}   # flops by kind of the image slices launched just before it
        self.t_launch = self.t_finalize = 0.0
        self.t0 = time.perf_counter()


class Engine:
    """The runner of one model on one device: a scheduler thread that packs the scheduler's
    decisions into arrays, dispatches the device programs and commits their results (see
    the module docstring).  `submit` / `submit_many` / `encode` from any thread; `close()`
    drains and frees the device buffers."""

    def __init__(self, model: Model, *, max_batch_size: int = 32, max_context: int | None = None,
                 kv_cache_tokens: int | None = None, page_size: int = 64,
                 prefix_cache: bool = True, pipelined: bool = True,
                 prefill_tokens: int = 2048, workers: int = 2, log_steps: int = 100_000,
                 record_events: bool = False, warmup: bool = False,
                 prefill_drains: bool = False, host_work_ms: float = 0.0,
                 kv_dtype: str | None = None, programs: step_mod.EnginePrograms | None = None,
                 max_adapters: int = 0, max_lora_rank: int = 16, adapters: dict | None = None,
                 adapters_on_demand: bool = False, decode_burst: int | None = None,
                 burst_rows: int | None = None, slice_images: bool = True,
                 slice_ratio: float = 3.5, slice_groups: tuple | None = None,
                 slice_budget: float | None = None):
        cfg = model.cfg
        if not isinstance(max_adapters, int) or isinstance(max_adapters, bool) or \
                not 0 <= max_adapters <= 256:
            raise ValueError(f"max_adapters must be an int in [0, 256], got {max_adapters!r}")
        if not isinstance(max_lora_rank, int) or isinstance(max_lora_rank, bool) or \
                not 1 <= max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be an int in [1, 512], got {max_lora_rank!r}")
        # Why this engine has no adapter slots when a request names a variant (None: it has).
        self.no_slots = None if max_adapters else (
            "this engine was started with max_adapters=0 (no adapter slots); load the model "
            "without max_adapters (slots come on first use) or with max_adapters > 0 "
            "(--max-adapters)")
        if max_adapters and lora.supported(cfg, max_lora_rank) is not None:
            if not adapters_on_demand:
                raise ValueError(f"max_adapters={max_adapters}: "
                                 f"{lora.supported(cfg, max_lora_rank)}")
            self.no_slots = lora.supported(cfg, max_lora_rank)
            max_adapters = 0
        # The LoRA adapters requests may name (name -> `convert.adapters.Adapter`; the face
        # that loads them shares this dict) and the slots that hold them on the device.
        self.max_adapters, self.max_lora_rank = max_adapters, max_lora_rank
        self.adapters = adapters if adapters is not None else {}
        if decode_burst is not None and (not isinstance(decode_burst, int) or isinstance(
                decode_burst, bool) or not 1 <= decode_burst <= 64):
            raise ValueError(f"decode_burst must be None or an int in [1, 64], got "
                             f"{decode_burst!r}")
        if burst_rows is not None and (not isinstance(burst_rows, int) or isinstance(
                burst_rows, bool) or burst_rows < 1):
            raise ValueError(f"burst_rows must be None or a positive int, got {burst_rows!r}")
        if not isinstance(slice_ratio, (int, float)) or isinstance(slice_ratio, bool) or \
                not slice_ratio > 1:
            raise ValueError(f"slice_ratio must be a number > 1 (the longest gap a decoding "
                             f"row may see, in its median gaps), got {slice_ratio!r}")
        if slice_budget is not None and (not isinstance(slice_budget, (int, float)) or
                                         isinstance(slice_budget, bool) or slice_budget < 0):
            raise ValueError(f"slice_budget must be None (measured) or flops >= 0 per "
                             f"decode launch, got {slice_budget!r}")
        if slice_groups is not None:
            slice_groups = slicing.check_groups(cfg, slice_groups)
        # The pool's format: None (the model's dtype) or 8-bit codes + scales (`kvpool`).
        self.kv_dtype = kvpool.canonical_kv_dtype(kv_dtype, cfg.dtype)
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        ctx = cfg.text.max_context if max_context is None else max_context
        if not isinstance(ctx, int) or not cfg.prefix_len < ctx <= cfg.text.max_context:
            raise ValueError(f"max_context must be an int in ({cfg.prefix_len}, "
                             f"{cfg.text.max_context}], got {max_context!r}")
        if page_size not in (16, 32, 64, 128, 256):
            raise ValueError(f"page_size must be 16, 32, 64, 128 or 256, got {page_size!r}")
        # What the device's platform means (`platforms.Platform`), with this engine's pool format.
        plat = self.platform = model.platform.with_kv_dtype(self.kv_dtype)
        # Decode steps one launch may run for rows that need no host work between tokens
        # (`_burst_len`): the host's per-launch cost is paid once per `decode_burst` tokens.
        self.decode_burst = plat.decode_burst if decode_burst is None else decode_burst
        # ... for steps of at most this many rows (larger steps already hide the host).
        self.burst_rows = plat.burst_rows if burst_rows is None else burst_rows
        self.model, self.cfg = model, cfg
        self.programs = step_mod.programs_of(model) if programs is None else programs
        self.max_batch_size, self.max_context, self.pipelined = max_batch_size, ctx, pipelined
        # The device (the mesh's first, for its platform and free memory) and where host
        # data for a program goes: that device, or replicated over the mesh.
        self.device, self.placement = model.device, model.placement
        # The GPU kernel's split plan counts programs per SM (None off a GPU: an H200's).
        self.sms = getattr(self.device, "core_count", None) if plat.plans_splits else None
        # Memory: planned from shapes and the device's free memory (the weights are placed
        # already), refused with numbers if it cannot work.
        free = memory.device_free(self.device)

        def planned(slots: int) -> memory.MemoryPlan:
            return memory.check(
                memory.plan(cfg, platform=plat, max_batch_size=max_batch_size,
                            max_context=ctx, page_size=page_size,
                            kv_cache_tokens=kv_cache_tokens, free=free, weights_loaded=True,
                            kv_dtype=self.kv_dtype, prefill_tokens=prefill_tokens,
                            mesh_size=1 if model.tp is None else model.tp.n,
                            adapter_bytes=lora.table_bytes(cfg, slots, max_lora_rank)
                            if slots else 0),
                cfg, max_context=ctx, weights_loaded=True)

        # On-demand slots are planned (their tables' bytes set aside, so the first variant
        # request always finds room) but allocated, and the programs compiled with adapter
        # products, only when the first adapter is loaded (`enable_adapters`).  A plan that
        # fits only without them keeps the model loadable and says so to a variant request.
        try:
            self.plan = planned(max_adapters)
        except memory.MemoryError_ as e:
            if not (adapters_on_demand and max_adapters):
                raise
            self.plan = planned(0)
            self.no_slots = (f"no device memory was left for {max_adapters} adapter slots "
                             f"({e}); lower kv_cache_tokens (--kv-cache-tokens) or "
                             "max_batch_size so they fit, or pass max_adapters")
            max_adapters = 0
        self.max_adapters = max_adapters
        self.page_size, self.arenas = page_size, self.plan.arenas
        self.sweep = plat.sweeps   # page owners uploaded per step
        self.max_pages = pages_for(ctx, page_size)   # a row's page table
        self.dev = step_mod.DeviceState.init(cfg, arena_sizes=self.arenas.sizes,
                                             page_size=page_size,
                                             max_batch_size=max_batch_size, device=self.device,
                                             kv_dtype=self.kv_dtype, tp=model.tp,
                                             pack=plat.pack)
        # Slot tables of the adapters (slot 0: none); None compiles programs without them.
        # Over a mesh they are replicated, like the activations the adapters multiply (the
        # dense layers' outputs are gathered whole, `sharding`): each chip computes every
        # row's adapter product in full, as one chip does, so the sums are one chip's.
        self.lora = None
        self._lora_lock = threading.Lock()
        if max_adapters and not adapters_on_demand:
            self.enable_adapters()
        self.sched = Scheduler(max_batch_size=max_batch_size, n_pages=self.arenas.n_pages,
                               page_size=page_size, prefix_len=cfg.prefix_len,
                               prefill_tokens=prefill_tokens, prefix_cache=prefix_cache,
                               record_events=record_events, share_prefix=plat.shares_prefix,
                               prefill_cost=lambda rows, longest: (
                                   step_mod.prefill_row_bucket(rows, max_batch_size)
                                   * step_mod.prompt_bucket(longest)),
                               spatial_ids=(cfg.tokenizer.coord_id, cfg.tokenizer.size_id),
                               adapter_slots=max_adapters)
        self.pipe = PipelineState()
        # Output shapes: compiled against this model's tokenizer on first use, then cached.
        self.grammars = grammar.Grammars(model.prompts.tok, cfg.text.vocab_size,
                                         cfg.tokenizer.eos_id)
        self.steps_log: collections.deque[StepTiming] = collections.deque(maxlen=log_steps)
        self.counters = collections.Counter()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._unpins: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._closing = False
        self.failure: BaseException | None = None
        self.alive = True
        self._warmup = warmup
        self._warm = threading.Event()   # set once warm-up compiled (or was not asked)
        # Benchmark knobs: drain the pipeline before each prefill (Photon's older rule), and
        # burn this much host time per commit (to chart the gain against the host's share).
        self.prefill_drains, self.host_work_s = prefill_drains, host_work_ms / 1e3
        # Image prefixes computed a slice at a time while rows decode (`slicing`,
        # docs/slicing.md): the jobs in order, the budget between decode launches, and the
        # flops by kind launched since the last one.
        self.slice_images = bool(slice_images)
        self.slice_groups = slice_groups or slicing.default_groups(
            cfg, plat.name, sum(x.nbytes for x in jax.tree.leaves(model.params["text"])),
            float(slice_ratio))
        self.slicer = slicing.SliceBudget(float(slice_ratio), slicing.default_rate(plat.name),
                                          slice_budget)
        self._jobs: collections.OrderedDict = collections.OrderedDict()
        self._slice_work = dict.fromkeys(slicing.SliceBudget.KINDS, 0.0)
        self._last_decode_commit = None   # when the last committed step (a decode) ended
        self._text_layers = slicing.text_layers(model.params, cfg)
        self._text_kinds = slicing.text_kinds(cfg)
        self._scalars: dict = {}   # int32 scalars on the device (a slice's first layer)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="photon-prep")
        self._thread = threading.Thread(target=self._loop, name="photon-scheduler", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------------

    def wake(self) -> None:
        """Let the scheduler thread look at its inbox and cancellations now."""
        self._wake.set()

    def memory(self) -> dict:
        """The device buffers allocated at start-up and how the KV pool is used now (pages
        of `page_size` positions; `kv_cache_tokens` = usable pages x page size; `kv_dtype`:
        the pool's format, `kv_bytes_per_token`: K + V of a position over every layer,
        scales included; `weights`: the weights' bytes on the device, codes and scales of
        quantized ones included, `weights_format`: which are quantized; `adapter_slots`
        and `adapter_tables`: the LoRA slots and their tables' bytes)."""
        a, c = self.sched.alloc, self.sched.cache
        return {"kv_pool": self.plan.pool, "kv_cache_tokens": self.plan.kv_cache_tokens,
                "kv_dtype": self.kv_dtype or self.cfg.dtype,
                "kv_bytes_per_token": memory.bytes_per_token(self.cfg, kv_dtype=self.kv_dtype,
                                                              pack=self.platform.pack),
                "page_size": self.page_size, "pages": a.usable, "pages_free": a.n_free,
                "pages_reserved": a.reserved,
                "pages_in_sequences": a.in_use() - c.pages() - len(self.sched.text.pages),
                "pages_in_prefix_cache": c.pages(),
                "pages_in_conversation_cache": len(self.sched.text.pages),
                "arenas": list(self.arenas.sizes),
                "slots": self.dev.nbytes()["slots"], "pending": self.dev.nbytes()["pending"],
                "weights": self.plan.weights,
                "weights_format": self.cfg.weights.describe(),
                "adapter_slots": self.max_adapters, "adapter_tables": self.plan.adapters}

    def stats(self) -> dict:
        """Counters: steps by kind, tokens committed, zombie rows, and the prefix cache's
        hits, misses, inserts, evictions, current entries and pinned ones (held by
        `encode_image` handles or by running requests reading their pages), and the
        conversation cache's pages read, inserted, evicted, held and pinned, the LoRA
        adapters' slots, those running rows hold, and the slot writes so far, and the image
        slicing's state (`slices` and `sliced_images` so far are counters)."""
        c, t = self.sched.cache, self.sched.text
        b = self.slicer
        gap = b.median_gap
        return {**dict(self.counters),
                "slicing": {"enabled": self.slice_images, "groups": list(self.slice_groups),
                            "ratio": b.ratio, "budget_s": b.seconds(),
                            "rates_flops_per_s": dict(b.rates), "margin": b.margin,
                            "median_decode_gap_ms": None if gap is None else 1e3 * gap,
                            "jobs": len(self._jobs)},
                "prefix_cache": {"enabled": c.enabled, "hits": c.hits, "misses": c.misses,
                                 "inserts": c.inserts, "evictions": c.evictions,
                                 "entries": len(c.entries),
                                 "pinned": sum(1 for e in c.entries.values() if e.pins)},
                "conversation_cache": {"enabled": t.enabled, "hit_pages": t.hit_pages,
                                       "inserts": t.inserts, "evictions": t.evictions,
                                       "pages": len(t.pages),
                                       "pinned": sum(1 for p in t.pages.values() if p.pins)},
                "adapters": {"slots": self.max_adapters, "loaded": len(self.adapters),
                             "slots_in_use": self.sched.adapters.in_use(),
                             "slot_loads": self.sched.adapters.loads}}

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
        failed = Outbox()   # requests refused here, before the scheduler sees them
        pixels = {}   # id(PIL image) -> its pixels: a list sharing one image copies it once
        for req in reqs:
            h = Handle(self, req)
            handles.append(h)
            try:
                if isinstance(req.image, PIL.Image.Image):
                    # On the caller's thread, before submit returns: the request owns a copy
                    # of the pixels (`pil_pixels`), so threads sharing one lazily opened
                    # image do not race in PIL's loader, and the caller may close or change
                    # the image afterwards.
                    if id(req.image) not in pixels:
                        pixels[id(req.image)] = pil_pixels(req.image)
                    h.request = dataclasses.replace(req, image=pixels[id(req.image)])
                seqs.append(self._admit(h))
            except (RequestError, ValueError, TypeError) as e:
                failed.result(h, error=e)
        failed.flush()
        self._inbox.put(seqs)
        self._wake.set()
        if not self.alive:   # the scheduler exited between the check above and the put
            late = Outbox()   # (its own last flush may have failed them too: first wins)
            for h in handles:
                late.result(h, error=EngineError("the engine is closed"))
            late.flush()
        return handles

    def encode(self, image, variant: str | None = None) -> Handle:
        """Encode an image into the prefix cache and pin it there: the handle's result is an
        `EncodedImage` (release it, or drop it, to unpin).  `variant`: a loaded adapter's
        name, the image prefix computed under it (checked as settings["variant"] is: a bad
        value raises `SettingsError` by name here)."""
        return self.submit(Request("encode", [], image, parse_settings({"variant": variant})))

    def _admit(self, h: Handle) -> Seq:
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
        shape = None
        if req.settings.shape is not None and not encode:
            if req.skill != "text":
                raise RequestError(f"settings[{req.settings.shape[0]!r}] shapes a text answer "
                                   f"(caption, query, chat); {req.skill} output has its own "
                                   "format: drop the setting")
            shape = self.grammars.matcher(*req.settings.shape)
        if req.settings.logprobs is not None and not encode and req.skill != "text":
            raise RequestError(f"settings['logprobs'] is for text answers (caption, query, "
                               f"chat); {req.skill} output has no answer tokens to score: "
                               "drop the setting")
        skill = None if encode else skills.for_request(
            req, cfg.tokenizer, prompt_end=p_end, max_context=self.max_context,
            decode=self.model.prompts.decode,
            on_text=functools.partial(self.sched.outbox.text, h),
            on_reasoning=functools.partial(self.sched.outbox.reasoning, h), shape=shape,
            token_bytes=self.model.prompts.token_bytes,
            on_logprob=functools.partial(self.sched.outbox.logprob, h))
        seq = Seq(h, base, p_end, skill)
        h.id = seq.id
        if req.settings.variant is not None:
            seq.adapter = self.adapter(req.settings.variant)
        seq.need_pages = self.sched.budget_pages(seq, self.max_context)
        if seq.need_pages > self.sched.alloc.usable:
            raise RequestError(
                f"this request needs {seq.need_pages * self.page_size} KV positions (prompt "
                f"{p_end} + up to {0 if encode else seq.skill.budget} generated), more than "
                f"the whole KV pool ({self.plan.kv_cache_tokens} tokens); raise "
                "kv_cache_tokens (--kv-cache-tokens) or lower max_tokens / max_objects")
        if req.region:
            if req.image is None:
                raise RequestError("spatial refs need an image")
            seq.kinds, seq.values = region_inputs(req.prompt, req.region, cfg.tokenizer)
        if req.blocks:
            self._admit_blocks(seq, base)
        img = req.image
        if isinstance(img, EncodedImage):
            if img._engine is not self:
                raise RequestError("this EncodedImage was made by another model or engine; "
                                   "encode the image with this one")
            if img.released:
                raise RequestError("this EncodedImage was released; encode the image again")
            seq.key, seq.encoded = img.key, True
        if isinstance(img, PreparedImage):
            seq.key = adapter_key(img.key, seq.adapter)
        if img is None or isinstance(img, (EncodedImage, PreparedImage, ImagePrefix)):
            seq.image, seq.ready = img, True
        else:
            # The cache's keys now, a hint for skipping the crops of a cached image: if the
            # entry is gone by the time the request is admitted, it is prepared again.
            c = self.sched.cache
            self._prepare(seq, c.keys if c.enabled else frozenset())
        return seq

    def _admit_blocks(self, seq: Seq, base: int) -> None:
        """Check a request's image blocks (`Request.blocks`) and prepare their images on a
        worker thread, as the front image is (decoded, cropped and uploaded; never on the
        caller's thread, which may be an event loop; encoded at the prefill)."""
        req, z = seq.req, self.cfg.prefix_len - 1
        if req.skill != "text" or req.region:
            raise RequestError("image blocks inside a prompt are for text answers without "
                               "spatial refs (chat, query)")
        end = 1 if req.image is None else 0   # a text-only prompt starts with BOS
        for i, block in enumerate(req.blocks):
            off, img = block
            if isinstance(off, bool) or not isinstance(off, int) or off < end or \
                    off + z >= len(req.prompt):
                raise RequestError(
                    f"blocks[{i}] at prompt offset {off!r}: an image block takes {z} "
                    f"placeholder positions from its offset, after the one before it "
                    f"(offset {end} or more) and before the prompt's last token")
            if isinstance(img, (EncodedImage, ImagePrefix)):
                raise RequestError(
                    f"blocks[{i}]: an image after the start of a conversation is encoded in "
                    f"its context, so an {type(img).__name__} (a prefix encoded alone) cannot "
                    "stand there; pass the image itself")
            if isinstance(img, PreparedImage):
                if not img.has_crops:
                    raise RequestError(f"blocks[{i}]: this PreparedImage has no crops")
                prep = img
            else:   # a Future: the scheduler waits for it (`Scheduler.resolve`)
                if isinstance(img, PIL.Image.Image):   # its pixels copied, as the front's
                    img = pil_pixels(img)
                prep = self._pool.submit(frontend.prepare_image, self.model, img)
                prep.add_done_callback(lambda _: self._wake.set())
            seq.blocks.append((base + off, z, getattr(prep, "key", None)))
            seq.block_images.append(prep)
            end = off + z

    def _prepare(self, seq: Seq, skip_crops_for=frozenset()) -> None:
        """Decode, hash and crop the request's image on a worker thread (`seq.prep`)."""
        seq.prep = self._pool.submit(frontend.prepare_image, self.model, seq.req.image,
                                     skip_crops_for)
        seq.prep.add_done_callback(lambda _: self._wake.set())

    def release_prefix(self, key: bytes) -> None:
        """Unpin the prefix-cache entry of image key `key` (`EncodedImage.release`).  Any
        thread, including a finalizer: queued for the scheduler thread."""
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
        if self.platform.host_memory:   # what it compiled on first use (hostmem says why)
            hostmem.warn_mappings(_log)
        self.sched.cache.clear()
        self.sched.text.clear()
        for leaf in jax.tree.leaves(self.dev):
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
        return [r._asdict() for r in list(self.steps_log)]

    # -- scheduler thread -----------------------------------------------------------------

    def _compile_decode_shapes(self) -> None:
        """Compile decode for every (row bucket, number of arenas read) and the four sampling
        variants for every row bucket, so steady decoding never waits for the compiler.
        Every row is the dummy row and page 0: nothing real is touched."""
        P, params = self.programs, self.model.params
        for rb in step_mod.row_buckets(self.max_batch_size):
            meta = jax.device_put(np.zeros((M_TABLE + self.max_pages, rb), _I32), self.placement)
            samp = np.zeros((step_mod.S_ALLOW + 1, rb), _I32)
            samp[step_mod.S_ALLOW] = -1
            samp = jax.device_put(samp, self.placement)
            for n in range(1, self.arenas_count + 1):
                pages = np.zeros((2, self.arenas.pages_in(n) if self.sweep else 1), _I32)
                pages[0] = rb
                for splits in P.split_variants(rb, self.sms):
                    dev = self.dev
                    part, dev.slots[0] = P.forward(params, dev.pool.arenas(n), dev.slots[0],
                                                   dev.pending, meta,
                                                   jax.device_put(pages, self.placement), splits,
                                                   *self._lora_arg())
                    dev.pool = dev.pool.merge(part)
                self._compile_bursts(rb, n, pages, samp)
            for (_, _, logprobs), sampler in P.sample_step.items():
                if logprobs:   # compiled on first use: few requests ask for them
                    continue
                dev = self.dev
                dev.slots[0], dev.pending = sampler(params, dev.slots[0], dev.pending,
                                                    dev.tables, samp)
        jax.block_until_ready(self.dev.pending)

    def _compile_bursts(self, rb: int, n_arenas: int, pages, samp) -> None:
        """Compile the burst programs (greedy and sampled) of one (row bucket, arenas read),
        as `_compile_decode_shapes` does forward's: every row the dummy row and page 0."""
        k, P = self.decode_burst, self.programs
        if k == 1 or rb > step_mod.row_bucket(min(self.burst_rows, self.max_batch_size),
                                              self.max_batch_size):
            return   # no step of this bucket bursts
        metas = jax.device_put(np.zeros((k, M_TABLE + self.max_pages, rb), _I32),
                               self.placement)
        pages_k = jax.device_put(np.stack([pages] * k), self.placement)
        for stochastic in (False, True):
            for splits in P.split_variants(rb, self.sms):
                dev = self.dev
                part, dev.slots[0], dev.pending, _ = P.burst[stochastic](
                    self.model.params, dev.pool.arenas(n_arenas), dev.slots[0], dev.pending,
                    dev.tables, metas, pages_k, samp, splits, *self._lora_arg())
                dev.pool = dev.pool.merge(part)

    def _compile_prefill_shapes(self) -> None:
        """Compile the prompt prefill for every prefill row bucket, prompts of up to 32
        tokens (captions and short questions), after an image prefix and text-only; the
        prefix page writes and copies; and the vision encoder and image prefix, whole and
        in slices, for the crop layouts of 4:3, 3:4 and square images of at least 756
        pixels a side (the common photo shapes; other layouts compile when first seen).
        Padding rows write page 0 only."""
        P, params, cfg = self.programs, self.model.params, self.cfg
        put = lambda a: jax.device_put(a, self.placement)  # noqa: E731
        for rb in step_mod.prefill_row_buckets(self.max_batch_size):
            for tb in (16, 32):
                for start in (cfg.prefix_len, 0):
                    kv_len = step_mod.kv_bucket(start + tb, self.max_context)
                    kv_len = -(-kv_len // self.page_size) * self.page_size
                    pre, write, table = pack_prefill([], [], [], [], [], rb, tb, kv_len,
                                                     self.page_size)
                    z = np.zeros((rb, tb), _I32)
                    dev = self.dev
                    dev.pool, dev.slots[1] = P.prefill_slot(
                        params, dev.pool, dev.slots[1], put(z), put(z),
                        put(np.zeros((rb, tb, 2), np.float32)), put(pre), put(write),
                        put(table), *self._lora_arg())
        zero = [0] * self.sched.prefix_pages
        copied = np.zeros(self.sched.prefix_pages - self.sched.shared_pages, _I32)
        if copied.size:
            self.dev.pool = P.copy_pages(self.dev.pool, put(copied), put(copied))
        for hw in ((768, 1024), (1024, 768), (1024, 1024)):
            prep = frontend.prepare_image(self.model, np.full((*hw, 3), 128, np.uint8))
            self._write_prefix(self._encode(prep), zero)
            if self.slice_images:   # ... and its slices (their results are dropped)
                job = slicing.ImageJob(b"", None, prep, slicing.plan(
                    cfg, prep.crops.shape[0], self.slice_groups))
                slot = None if self.lora is None else self._scalar_row(0)
                for sl in job.slices:
                    slicing.launch(P, params, self._text_layers, self._text_kinds, job, sl,
                                   self._scalar, self.lora, slot)
        jax.block_until_ready(self.dev.pool)

    def _lora_arg(self) -> tuple:
        """The slot tables as the programs' last argument (none without adapters: the
        programs then compile without the adapter products)."""
        return () if self.lora is None else (self.lora,)

    @property
    def arenas_count(self) -> int:
        """-> the number of pool arenas (decode compiles one program per count it reads)."""
        return len(self.arenas.sizes)

    def _loop(self) -> None:
        try:
            if self._warmup:
                self._compile_decode_shapes()
                self._compile_prefill_shapes()
                hostmem.warn_mappings(_log)   # many compiled programs: near the map limit?
            self._warm.set()
            while True:
                self._wake.clear()
                self._take_inbox()
                self.sched.settle_cancels()
                progressed = self._tick()
                for s in self.sched.take_unprepared():
                    self._prepare(s)
                self.sched.flush_outbox()   # what the tick decided outside a commit
                if not progressed:
                    if (self._closing and self.sched.drained() and self.pipe.idle()
                            and not self._jobs and self._inbox.empty()):
                        break
                    self.sched.check_stuck(self.pipe.idle())
                    self._wake.wait(0.05)
        except BaseException as e:  # a device or engine error: every request fails
            self.failure = e
            self._fail_everything(e)
        finally:
            self.alive = False
            self._warm.set()
            self._fail_everything(EngineError("the engine stopped"))

    def _take_inbox(self) -> None:
        while True:
            try:
                self.sched.add(self._inbox.get_nowait())
            except queue.Empty:
                break
        while True:
            try:
                self.sched.cache.unpin(self._unpins.get_nowait())
            except queue.Empty:
                return

    def _tick(self) -> bool:
        if self.sched.encodes:
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

    def _run_encodes(self) -> None:
        """`Engine.encode` jobs: pin the image's entry, computing it if it is not cached
        (a slice at a time while rows decode: the handle comes when the last is launched)."""
        while (job := self.sched.next_encode()) is not None:
            s, src = job
            if not src.hit and self.slice_images and self._streaming():
                self._start_job(s, src.entry, s.adapter_slot,
                                functools.partial(self._encoded, s, src.entry))
                s.adapter_slot = 0   # the job holds the slot now
                continue
            if not src.hit:
                with hostsync.sync_free():
                    if s.adapter_slot:
                        self._write_adapters([s])
                    self._write_prefix(self._encode(s.image, s.adapter_slot),
                                       src.entry.pages)
                # Free at once: the launched encode has no later step reading the slot, and
                # a rewrite of the tables is a new value (JAX orders a donated write after
                # the reads launched before it).
                self.sched.adapters.release(s.adapter_slot)
                s.adapter_slot = 0
            self._encoded(s, src.entry)

    def _encoded(self, s: Seq, entry) -> None:
        self.sched.finish_encode(s, EncodedImage(self, s.key, entry.tiling, s.adapter))

    # image slices (`slicing`) ------------------------------------------------------------

    def _streaming(self) -> bool:
        """Are rows generating for a reader of their stream (whom an image's whole encode
        would freeze)?  Rows whose caller waits for the result alone lose nothing to a
        whole encode (their total time is the same or shorter: slices run slower between
        decode steps than back to back), so they are not sliced for: a batch job keeps its
        full throughput."""
        return any(not s.finalized and s.handle.streamed for s in self.sched.running)

    def _slices(self, decoding: bool) -> None:
        """Before a decode launch: slices of the oldest jobs up to the budget (at least one,
        so every job advances with each decode step: none starves); an image whose whole
        encode fits what is left of the budget runs as the one program.  With no streamed row
        decoding (`decoding` False), every job runs to its end now, and a job not started
        yet runs as the one-program encode: no slicing overhead when no stream waits."""
        for job in list(self._jobs.values()):
            h = job.seq.handle
            if h.cancel_requested or h.done():
                self._drop_job(job)
        budget = self.slicer.limit() if decoding else float("inf")
        spent = 0.0
        with hostsync.sync_free():
            while self._jobs:
                job = next(iter(self._jobs.values()))
                if not decoding and not job.started:
                    self._whole(job)
                    continue
                if not job.started:   # an image that fits what is left: one program
                    whole = sum(self.slicer.cost(x) for x in job.slices)
                    if spent + whole <= budget:
                        for x in job.slices:
                            self._slice_work[slicing.rate_kind(x)] += x.flops
                        self._whole(job)
                        spent += whole
                        continue
                sl = job.peek()
                cost = self.slicer.cost(sl)
                if spent and spent + cost > budget:
                    break
                self._run_slice(job, sl)
                spent += cost
                self._slice_work[slicing.rate_kind(sl)] += sl.flops

    def _start_jobs(self) -> None:
        """Jobs for the waiting requests whose image is a miss, in arrival order, while
        rows are free for them (an image nobody can take a row for would only hold pages).
        Called while streamed rows decode, before each decode launch: it looks at the
        first `max_batch_size` waiting requests only (those the next prefills can take),
        so a long queue costs the step nothing more.  The jobs fill prefix-cache entries:
        with the cache off, images are encoded whole."""
        sched = self.sched
        room = max(1, len(sched.free_rows)) - len(self._jobs)
        if room <= 0 or not sched.cache.enabled:
            return
        blocked = -1   # (computed on the first request naming an adapter)
        for s in list(itertools.islice(sched.waiting, self.max_batch_size)):
            if room <= 0:
                return
            if not sched.resolve(s) or s.key is None or s.key in self._jobs or \
                    not isinstance(s.image, PreparedImage) or not s.image.has_crops:
                continue
            try:
                src = sched.source(s)
            except RequestError:
                continue   # the prefill plan fails it
            if src is None or src.origin is not Origin.MISS:
                continue
            slot = 0
            if s.adapter is not None:   # computed under the adapter, as the reference does
                if blocked == -1:
                    blocked = sched.slot_blocked()
                if blocked is not None and s.id > blocked:
                    continue
                slot = sched.adapters.acquire(s.adapter)
                if slot is None:
                    continue
            if sched.alloc.available() < sched.prefix_pages:
                sched.evict_for(sched.prefix_pages)
            entry = sched.cache.insert(s.key, sched.prefix_pages, s.image.tiling, pin=True)
            if entry is None:   # no pages now: the prefill plan encodes it whole
                sched.adapters.release(slot)
                continue
            sched.cache.count_miss()
            self._start_job(s, entry, slot)
            room -= 1

    def _start_job(self, s: Seq, entry, slot: int, on_done=None) -> None:
        entry.pending = True
        if slot:
            held, s.adapter_slot = s.adapter_slot, slot
            self._write_adapters([s])
            s.adapter_slot = held
        crops = s.image.crops.shape[0]
        self._jobs[s.key] = slicing.ImageJob(
            s.key, entry, s.image, slicing.plan(self.cfg, crops, self.slice_groups), slot,
            on_done, s)

    def _scalar_row(self, n: int):
        """[1] int32 holding n, on the device (an adapter slot's id; uploaded once)."""
        a = self._scalars.get(("row", n))
        if a is None:
            a = self._scalars[("row", n)] = jax.device_put(np.full(1, n, _I32), self.placement)
        return a

    def _scalar(self, n: int):
        a = self._scalars.get(n)
        if a is None:
            a = self._scalars[n] = jax.device_put(np.int32(n), self.placement)
        return a

    def _run_slice(self, job: slicing.ImageJob, sl: slicing.Slice) -> None:
        """Launch one slice of `job` (asynchronous), and its page write after the last."""
        slot = None if self.lora is None else self._scalar_row(job.adapter_slot)
        enc = slicing.launch(self.programs, self.model.params, self._text_layers,
                             self._text_kinds, job, sl, self._scalar, self.lora, slot)
        self.counters["slices"] += 1
        if enc is not None:
            self.counters["sliced_images"] += 1
            self._end_job(job, enc)

    def _whole(self, job: slicing.ImageJob) -> None:
        """A job not started yet, as the one-program encode (nothing decodes now)."""
        self._end_job(job, self._encode(job.prep, job.adapter_slot))

    def _drop_job(self, job: slicing.ImageJob) -> None:
        """The job's request was cancelled or failed: stop computing its image, and give
        back its adapter slot and its entry's pages (nothing on the device writes them
        before the last slice; requests for the same image find a miss and start again)."""
        del self._jobs[job.key]
        job.x = job.h = job.k = job.v = job.prep = None
        self.sched.adapters.release(job.adapter_slot)
        if self.sched.cache.remove(job.key) is not None:
            self.sched.alloc.give_back(job.entry.pages)
        self.counters["dropped_slice_jobs"] += 1

    def _end_job(self, job: slicing.ImageJob, enc: ImagePrefix) -> None:
        """The prefix into the entry's pages; its requests may read it from now on (the
        device runs launches in order)."""
        if job.entry is not None:
            self._write_prefix(enc, job.entry.pages)
        del self._jobs[job.key]
        job.x = job.h = job.k = job.v = job.prep = None
        self.sched.adapters.release(job.adapter_slot)
        if job.entry is not None:
            job.entry.pending = False
            if job.on_done is not None:
                job.on_done()   # an `Engine.encode`: its pin passes to the handle
            else:
                # An ordinary cache entry from now on: its request reads it as a hit, and
                # pressure may evict it first (then the request encodes it again), so no
                # pin outlives the job for a request that may not fit the pool yet.
                self.sched.cache.unpin(job.key)

    # launch ---------------------------------------------------------------------------

    def _launch(self) -> bool:
        slot = self.pipe.free_slot()
        decode = self.sched.eligible()
        decoding = self.slice_images and self._streaming()
        if decoding:
            self._start_jobs()   # before the plan: a miss becomes a job, not a whole encode
        batch = self.sched.plan_prefill(bool(decode))
        if batch and self.prefill_drains and not self.pipe.idle():
            self.sched.unplan(batch)
            return False   # let the steps in flight commit first
        if self._jobs and not decoding:
            self._slices(decoding=False)   # no stream waits: every job to its end now
        if batch:
            # No slices in front of a prefill: it is this gap's work already.
            self._slice_work = dict.fromkeys(self._slice_work, 0.0)   # (not measured)
            self._launch_prefill(batch, slot)
        elif decode:
            if self._jobs:
                self._slices(decoding=True)
            k = self._burst_len(decode)
            if k > 1:
                self._launch_burst(decode, slot, k)
            else:
                self._launch_decode(decode, slot)
        else:
            return bool(self._jobs) and not decoding   # (ran them all: progress)
        return True

    def _burst_len(self, rows: list[Seq]) -> int:
        """`decode_burst` if every row can take that many tokens with no host work between
        them, else 1.  Such a row is plain text (no output shape, no log-probabilities, no
        reasoning or spatial skill): its constraint is the same for every token past the
        first, no host mask is computed for it, and stops (EOS, stop strings, repeats) are
        found at commit, the tokens after them dropped.  Every row must also have k more
        tokens in its budget and context, so a burst never writes past a reservation.  Steps
        of more than `burst_rows` rows stay single: their device step already outlasts the
        host's launch."""
        k = self.decode_burst
        if k == 1 or len(rows) > self.burst_rows:
            return 1
        for s in rows:
            sk = s.skill
            if type(sk) is not skills.TextSkill or sk.shape is not None or \
                    s.req.settings.logprobs is not None or \
                    not sk.feedable(s.n_tokens + k - 2):
                return 1
        return k

    def _prefix_slots(self, pages: list[int]):
        """Page and offset of each prefix position, for pages in logical order."""
        pos = np.arange(self.cfg.prefix_len)
        return np.asarray(pages, _I32)[pos // self.page_size], (pos % self.page_size).astype(_I32)

    def _encode(self, prep: PreparedImage, slot: int = 0) -> ImagePrefix:
        extra = () if self.lora is None else (
            self.lora, jax.device_put(np.full(1, slot, _I32), self.placement))
        return frontend.encode_prepared(self.programs.image_kv, self.model.params, prep, *extra)

    def adapter(self, name: str):
        """The loaded adapter `name` (a request's settings["variant"]), refused by name.
        Its slot tables exist once this returns (made now, on first need)."""
        if not self.max_adapters:
            raise RequestError(f"variant {name!r}: {self.no_slots}")
        a = self.adapters.get(name)
        if a is None:
            raise RequestError(f"variant {name!r} is not loaded; loaded: "
                               f"{sorted(self.adapters)[:20]} (load_adapter(name, path))")
        self.enable_adapters()
        return a

    def enable_adapters(self) -> None:
        """Allocate the adapter slots' tables (zeros: slot 0 is "no adapter"), once; any
        thread.  From the next launch on, the programs take them as their last argument and
        compile again with the adapter products (once per shape, as on first use).  Rows
        already running go on at slot 0, which adds exact zeros.  A request naming an
        adapter is only queued after this returned (`adapter`), so no launch can read a slot
        before its tables exist."""
        if self.lora is not None:
            return
        if not self.max_adapters:
            raise RequestError(self.no_slots)
        with self._lora_lock:
            if self.lora is not None:
                return
            with jax.default_device(self.device):
                tables = jax.device_put(lora.init_tables(self.cfg, self.max_adapters,
                                                         self.max_lora_rank), self.placement)
            # One assignment: the scheduler thread reads None or the tables, never half.
            self.lora = tables
        logging.getLogger(__name__).info(
            "adapter slots enabled: %d slots of rank %d (%.1f MiB); programs compile again "
            "with adapter products", self.max_adapters, self.max_lora_rank,
            self.plan.adapters / 2**20)

    def _write_adapters(self, batch: list[Seq]) -> None:
        """Write the adapters this launch reads into their slots (a device write between
        steps: the slot tables are an argument of the programs, nothing recompiles)."""
        slots = self.sched.adapters
        for s in batch:
            if slots.stale(s.adapter_slot):
                # float32 on the host; the write casts to the tables' dtype on the device.
                tables = s.adapter.padded(self.max_lora_rank, np.float32)
                self.lora = self.programs.write_adapter(
                    self.lora, jax.device_put(np.int32(s.adapter_slot), self.placement),
                    jax.device_put(tables, self.placement))
                slots.mark_written(s.adapter_slot)

    def _write_prefix(self, enc: ImagePrefix, pages: list[int]) -> None:
        page_s, off_s = self._prefix_slots(pages)
        put = lambda a: jax.device_put(a, self.placement)  # noqa: E731
        self.dev.pool = self.programs.write_prefix_pages(self.dev.pool, enc.k, enc.v,
                                                         put(page_s), put(off_s))

    def _copy_unshared(self, s: Seq, entry) -> None:
        """The prefix pages of `entry` the request does not read in place, copied into its
        own: all of them for the XLA sweep, the last, partial one for the kernels.  (With
        the XLA sweep, a partial page the conversation cache continues is copied from there.)"""
        a, b = self.sched.n_shared(s), self.sched.prefix_pages
        if s.text_copies:
            b = min(b, s.prefix // self.page_size)
        if b > a:
            put = lambda x: jax.device_put(np.asarray(x, _I32), self.placement)  # noqa: E731
            self.dev.pool = self.programs.copy_pages(self.dev.pool, put(entry.pages[a:b]),
                                                     put(s.pages[a:b]))

    def _copy_text(self, s: Seq) -> None:
        """The XLA sweep's conversation-cache hit: the cached pages copied into the request's
        own, in one program per power-of-two count (padded with page 0 onto itself: page 0
        is the pool's dummy page, never handed out).  Dispatched before the prefill that reads
        them and before any later program that reuses the cached pages, so the cache's pins
        end here."""
        n = step_mod.row_bucket(len(s.text_copies), 1 << 20)
        pairs = np.zeros((2, n), _I32)
        pairs[:, :len(s.text_copies)] = np.asarray(s.text_copies, _I32).T
        put = lambda x: jax.device_put(x, self.placement)  # noqa: E731
        self.dev.pool = self.programs.copy_pages(self.dev.pool, put(pairs[0]), put(pairs[1]))
        self.sched.text.unpin(s.text_keys)
        s.text_keys, s.text_copies = [], []

    def _launch_prefill(self, batch: list[Seq], slot: int) -> None:
        t0 = time.perf_counter()
        P, params = self.programs, self.model.params
        n = len(batch)
        rb = step_mod.prefill_row_bucket(n, self.max_batch_size)
        # Each row computes its prompt from `start`: past its image prefix, and past the
        # conversation-cache pages it reads.
        lens = [s.prompt_end - s.start for s in batch]
        tb = step_mod.prompt_bucket(max(lens))
        ids = np.zeros((rb, tb), _I32)
        kinds = np.zeros((rb, tb), _I32)
        values = np.zeros((rb, tb, 2), np.float32)
        self.sched.start_prefill(batch)   # rows taken, clocks started
        blocks = {}   # image key -> (index, PreparedImage): the images this prefill encodes
        for i, s in enumerate(batch):
            ids[i, :lens[i]] = s.req.prompt[s.start - s.prefix:]
            if s.kinds is not None:   # (spatial refs: never after cached pages)
                kinds[i, :lens[i]], values[i, :lens[i]] = s.kinds, s.values
            for (a, z, key), prep in zip(s.blocks, s.block_images):
                if a + z <= s.start:   # read from the conversation cache's pages
                    continue
                # Patch a + j of the block feeds the image's embedding j (image z + j); positions
                # before `start` (cached pages) are not computed again.  An image's
                # embeddings depend on it alone: rows showing the same image share them.
                image = blocks.setdefault(key, (len(blocks), prep))[0]
                j = np.arange(max(a, s.start) - a, z)
                kinds[i, a + j - s.start] = KIND_IMAGE
                ids[i, a + j - s.start] = image * z + j
            s.block_images = []   # their crops are no longer needed once launched
        starts = [s.start for s in batch]
        kv_len = step_mod.kv_bucket(max(starts) + tb, self.max_context)
        kv_len = -(-kv_len // self.page_size) * self.page_size
        pre, write, table = pack_prefill([s.row for s in batch], starts,
                                         [s.prefix for s in batch], lens,
                                         [s.pages for s in batch], rb, tb, kv_len,
                                         self.page_size, [s.adapter_slot for s in batch])
        put = lambda a: jax.device_put(a, self.placement)  # noqa: E731
        with hostsync.sync_free():
            if self.lora is not None:
                self._write_adapters(batch)
            for s in batch:
                src, img = s.source, s.image
                if src is not None and src.hit:
                    self.sched.cache.count_hit()
                    self._copy_unshared(s, src.entry)
                elif isinstance(img, ImagePrefix):
                    self._write_prefix(img, s.pages)
                elif src is not None:   # a miss: encode once, into the new entry if any
                    self.sched.cache.count_miss()
                    enc = self._encode(img, s.adapter_slot)
                    if src.entry is None:
                        self._write_prefix(enc, s.pages)
                    else:
                        self._write_prefix(enc, src.entry.pages)
                        self._copy_unshared(s, src.entry)
                s.image = s.source = None   # the prefix now lives in its pages
                if s.text_copies:
                    self._copy_text(s)
            meta_d = put(pre)
            extra = {}
            if blocks:   # one compiled program per count bucket (1, 2, 4, ...), not layout
                embs = [P.image_embeddings(params, b.crops, b.src, b.ph, b.pw)
                        for _, b in blocks.values()]
                nb = step_mod.row_bucket(len(embs), 1 << 20)
                extra["images"] = P.stack_images(tuple(embs + embs[:1] * (nb - len(embs))))
            dev = self.dev
            dev.pool, dev.slots[slot] = P.prefill_slot(params, dev.pool, dev.slots[slot],
                                                       put(kinds), put(ids), put(values),
                                                       meta_d, put(write), put(table),
                                                       *self._lora_arg(), **extra)
        st = _InFlightStep("prefill", slot, batch, [0] * n, meta_d)
        st.t0, st.t_launch = t0, time.perf_counter() - t0
        self.pipe.on_launch(st)

    def _launch_decode(self, rows: list[Seq], slot: int) -> None:
        t0 = time.perf_counter()
        n = len(rows)
        rb = step_mod.row_bucket(n, self.max_batch_size)
        index = self.sched.grow(rows)   # each row's page of the position it writes
        meta, pages, n_arenas = pack_decode([s.row for s in rows], [s.length for s in rows],
                                            [s.pages for s in rows], rb, self.max_pages,
                                            self.page_size, self.arenas, owners=self.sweep,
                                            adapters=[s.adapter_slot for s in rows])
        # The GPU kernel's splits, from the real rows' attended lengths (position + 1): a
        # static variant of forward, all of them compiled at start (1 off the GPU kernel).
        splits = self.programs.decode_splits([s.length + 1 for s in rows], self.page_size,
                                             self.sms)
        with hostsync.sync_free():
            meta_d = jax.device_put(meta, self.placement)
            dev = self.dev
            part, dev.slots[slot] = self.programs.forward(
                self.model.params, dev.pool.arenas(n_arenas), dev.slots[slot], dev.pending,
                meta_d, jax.device_put(pages, self.placement), splits, *self._lora_arg())
            dev.pool = dev.pool.merge(part)
        self.sched.start_decode(rows)
        st = _InFlightStep("decode", slot, rows, index, meta_d)
        st.slices, self._slice_work = self._slice_work, dict.fromkeys(self._slice_work, 0.0)
        st.t0, st.t_launch = t0, time.perf_counter() - t0
        self.pipe.on_launch(st)

    def _launch_burst(self, rows: list[Seq], slot: int, k: int) -> None:
        """k decode + sample steps of `rows` in one program (`step._burst`): the metadata of
        every step packed now (the rows' pages for all k positions taken first, so every
        step reads the same arenas), the sampling rows as `_finalize` would build them for
        the first token (the program advances the token index)."""
        t0 = time.perf_counter()
        n = len(rows)
        rb = step_mod.row_bucket(n, self.max_batch_size)
        index = self.sched.grow(rows, k)
        tables, ids = [s.pages for s in rows], [s.row for s in rows]
        adapters = [s.adapter_slot for s in rows]
        packed = [pack_decode(ids, [s.length + j for s in rows], tables, rb, self.max_pages,
                              self.page_size, self.arenas, owners=self.sweep,
                              adapters=adapters) for j in range(k)]
        n_arenas = packed[0][2]
        metas = np.stack([p[0] for p in packed])
        pages = np.stack([p[1] for p in packed])
        # The first token's sampling rows, as `_finalize` builds them (the program advances
        # the token index); every row is free text, so nothing is restricted or masked.
        samp, temps = self._sampling_rows(rows, index, rb, width=1)
        splits = self.programs.decode_splits([s.length + k for s in rows], self.page_size,
                                             self.sms)
        with hostsync.sync_free():
            put = lambda a: jax.device_put(a, self.placement)  # noqa: E731
            meta_d = put(metas)
            dev = self.dev
            part, dev.slots[slot], dev.pending, outs = self.programs.burst[bool(
                np.any(temps > 0))](self.model.params, dev.pool.arenas(n_arenas),
                                    dev.slots[slot], dev.pending, dev.tables, meta_d,
                                    put(pages), put(samp), splits, *self._lora_arg())
            dev.pool = dev.pool.merge(part)
        self.sched.start_decode(rows, k)
        st = _InFlightStep("burst", slot, rows, index, meta_d)
        st.out = outs
        st.slices, self._slice_work = self._slice_work, dict.fromkeys(self._slice_work, 0.0)
        st.t0, st.t_launch = t0, time.perf_counter() - t0
        self.pipe.on_launch(st)

    # finalize (sample) -------------------------------------------------------------------

    def _sampling_rows(self, seqs: list[Seq], index: list[int], rb: int, width: int):
        """The sampler's per-row operands for `seqs` at token `index` (`step.S_*` rows; the
        allowed-ids block, `width` rows from S_ALLOW, left -1 for the caller): row, skill
        constraint, token index, seed, temperature and top-p.  A zombie row is sampled
        greedy and unconstrained, its result discarded.  -> (samp [S_ALLOW + width, rb],
        temperatures [rb])."""
        samp = np.zeros((step_mod.S_ALLOW + width, rb), _I32)
        samp[step_mod.S_ALLOW:] = -1
        temps = np.zeros(rb, np.float32)
        top_ps = np.ones(rb, np.float32)
        for i, s in enumerate(seqs):
            samp[step_mod.S_ROW, i] = s.row
            if s.finalized:
                self.counters["zombie_rows"] += 1
                continue
            idx, cfg = index[i], s.req.settings
            samp[step_mod.S_CONSTRAINT, i] = s.skill.constraint(idx)
            samp[step_mod.S_INDEX, i] = idx
            samp[step_mod.S_SEED, i] = cfg.seed
            if not s.skill.spatial:   # detect / point are greedy, as in the reference
                temps[i], top_ps[i] = cfg.temperature, cfg.top_p
        samp[step_mod.S_TEMP] = temps.view(_I32)
        samp[step_mod.S_TOP_P] = top_ps.view(_I32)
        return samp, temps

    def _finalize(self) -> None:
        t0 = time.perf_counter()
        st = self.pipe.launch
        if st.kind == "burst":   # sampled by its own program: only the host copy to start
            st.out.copy_to_host_async()
            for s in st.seqs:
                s.pending_ready = True
            self.pipe.on_sampled(st)
            st.t_finalize = time.perf_counter() - t0
            return
        rb = st.meta.shape[1]
        allowed = [None if s.finalized else s.skill.allowed(i)
                   for s, i in zip(st.seqs, st.index)]
        # The general path: per-row allowed ids, -1 padded to a power-of-two width (1 when
        # no row restricts), so the common step keeps one compiled shape.
        width = step_mod.row_bucket(max((len(a) for a in allowed if a), default=1), 1 << 20)
        for s, idx in zip(st.seqs, st.index):
            if not s.finalized and s.skill.count != idx:
                raise EngineError(f"sampling token {idx} of a request that committed "
                                  f"{s.skill.count}: the pipeline lost its order")
        samp, temps = self._sampling_rows(st.seqs, st.index, rb, width)
        for i, a in enumerate(allowed):
            if a:
                samp[step_mod.S_ALLOW:step_mod.S_ALLOW + len(a), i] = a
        # Output shapes: each shaped row's grammar mask for this token, computed now (the
        # token before it committed just above) while this step's forward runs; rows
        # without a shape allow everything.  Only a step with a shaped row uploads masks.
        masks = [None if s.finalized else s.skill.mask(i) for s, i in zip(st.seqs, st.index)]
        mask = None
        if any(m is not None for m in masks):
            mask = np.full((rb, (self.cfg.text.vocab_size + 31) // 32), -1, _I32)
            for i, m in enumerate(masks):
                if m is not None:
                    mask[i] = m
        # The program variant, known here without asking the device: does any row draw at
        # random, can any row's constraint yield a coordinate or size, is any row shaped?
        # And does any row want log-probabilities (a variant that also writes them)?
        logprobs = any(not s.finalized and s.req.settings.logprobs is not None
                       for s in st.seqs)
        sampler = self.programs.sampler(bool(np.any(temps > 0)), bool(np.isin(
            samp[step_mod.S_CONSTRAINT, :len(st.seqs)], constraints.REGION).any()), logprobs)
        with hostsync.sync_free():
            samp_d = jax.device_put(samp, self.placement)
            extra = () if mask is None else (jax.device_put(mask, self.placement),)
            dev = self.dev
            dev.slots[st.slot], dev.pending = sampler(
                self.model.params, dev.slots[st.slot], dev.pending, dev.tables, samp_d,
                *extra)
            st.out = self.dev.slots[st.slot].out
            if logprobs:
                st.logprobs = self.dev.slots[st.slot].logprobs
        # Started outside the guard: on an accelerator jaxlib applies the device-to-host
        # guard inside copy_to_host_async itself (CPU buffers are zero-copy and exempt).
        # Starting a copy only enqueues it; commit waits for it a step later.
        st.out.copy_to_host_async()
        if logprobs:
            st.logprobs.copy_to_host_async()
        for s in st.seqs:
            s.pending_ready = True
        self.pipe.on_sampled(st)
        st.t_finalize = time.perf_counter() - t0

    # commit ------------------------------------------------------------------------------

    def _commit(self) -> None:
        st = self.pipe.pop_oldest()
        t0 = time.perf_counter()
        host = np.array(st.out)   # a copy: a live view would defeat the slot's donation
        lps = None if st.logprobs is None else np.array(st.logprobs)
        t1 = time.perf_counter()
        # The slice budget's measure: the gap since the previous decode step's end.
        if st.kind == "prefill":
            self._last_decode_commit = None
        else:
            if self._last_decode_commit is not None:
                self.slicer.observe(t1 - self._last_decode_commit, st.slices)
            self._last_decode_commit = t1
        st.out = st.logprobs = None
        if st.kind == "burst":   # [k, R, 3]: k tokens per row
            n = self.sched.commit_burst(st.seqs, host[:, :, 0],
                                        host[:, :, 1:3].view(np.float32), t1)
            self.counters["tokens"] += n
            # Row-steps computed for rows that had finished (their tokens dropped).
            self.counters["zombie_rows"] += host.shape[0] * len(st.seqs) - n
        else:
            self.counters["tokens"] += self.sched.commit(st.seqs, host[:, 0],
                                                         host[:, 1:3].view(np.float32), t1,
                                                         lps)
        if self.host_work_s:
            end = t1 + self.host_work_s
            while time.perf_counter() < end:
                pass
        self.pipe.on_step_completed()
        t2 = time.perf_counter()
        self.counters[st.kind] += 1
        self.steps_log.append(StepTiming(st.kind, len(st.seqs), st.t_launch, st.t_finalize,
                                         t2 - t1, t1 - t0, st.t0, t2,
                                         sum(st.slices.values()) if st.slices else 0.0))
        self.sched.flush_outbox()

    def _fail_everything(self, err: BaseException) -> None:
        self._jobs.clear()   # (their requests fail below; the pool is gone with the engine)
        self.sched.flush_outbox()   # results finished before the failure still count
        self._take_inbox()
        self.sched.fail_all(err)
