"""The public Python API, shaped like Moondream's own (`caption`, `query`, `detect`, `point`,
`encode_image`, and `segment` for Moondream 3; the same argument names, settings keys and
return dicts).  The model kind (Moondream 2 or 3) comes from the checkpoint's config.

Every call runs through the one pipelined `Engine` of this `Moondream` (docs/architecture.md).
Each method takes one image or a list: a list is submitted at once, runs as one continuous batch
and returns `list[dict]` in input order (questions / objects: one shared string or a list of
the same length).  If some items of a list fail, the call raises `BatchError` after every
item finished; it carries the per-item results and errors.  Calls are safe from several
threads: they only submit requests and wait for their own results.

Each method has an asyncio twin (`acaption`, `aquery`, `adetect`, `apoint`, `asegment`,
`aencode_image`): the same requests, awaited on the event loop through `aio` (no thread per
request); a stream is an async iterator.  Cancelling the awaiting task cancels the request.
The HTTP server (`photon_jax.serve`) is built on them.

`return_metrics=True` (every method except streams) adds "metrics" to each result dict:
{"finish_reason", "input_tokens", "output_tokens", "prefix_cache_hit", "cached_tokens",
"time_to_first_token_s", "decode_tokens_per_s"} (`request.Handle.metrics`).  Without it the
result dicts are exactly Moondream's.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import math
import os
from typing import TYPE_CHECKING, Any, Union

import jax
from tqdm.auto import tqdm

from . import aio, sources
from .convert import adapters as adapters_mod
from .engine import compile_cache as compile_cache_mod, kvpool, memory
from .engine.core import Engine
from .engine.frontend import EncodedImage, PreparedImage, prepare_image
from .engine.request import EngineError, Handle, Request, RequestError
from .engine.settings import MAX_TOP_LOGPROBS, SettingsError, parse
from .model import lora, platforms, sharding
from .model.config import MoondreamConfig, Weights
from .model.loaded import Model
from .model import pixels
from .model.pixels import ImageError
from .model.sharding import make_mesh
from .model.chat import ChatError, parse_messages, render
from .model.tokenizer import spatial_refs_prompt

# What callers (and the command lines and the server above this module) use by name: the
# errors a call can raise, the handles it returns, and the mesh helper of `load(mesh=)`.
__all__ = ["Moondream", "BatchError", "EncodedImage", "Handle", "EngineError",
           "RequestError", "SettingsError", "ImageError", "ChatError", "make_mesh"]

if TYPE_CHECKING:
    import numpy as np
    import PIL.Image

# What every method accepts as an image: a path, the file's bytes, a PIL image, an HxWx3 uint8
# array, or an EncodedImage of this model.
ImageLike = Union[str, os.PathLike, bytes, "PIL.Image.Image", "np.ndarray", EncodedImage]

# Adapter slots a model loaded without `max_adapters` makes when it first needs them.
DEFAULT_ADAPTER_SLOTS = 4
NEED_IMAGE = ("image is required; pass a path, PIL image, HxWx3 uint8 array or an "
              "EncodedImage")


class BatchError(RuntimeError):
    """Some items of a list call failed.  `results[i]` is item i's output (None if it failed),
    `errors[i]` its exception (None if it succeeded)."""

    def __init__(self, results: list, errors: list):
        self.results, self.errors = results, errors
        failed = [i for i, e in enumerate(errors) if e is not None]
        first = errors[failed[0]]
        super().__init__(f"{len(failed)} of {len(errors)} items failed (first: item "
                         f"{failed[0]}: {type(first).__name__}: {first})")


class Moondream:
    """A loaded Moondream model with its running engine: Moondream's own API (`caption`,
    `query`, `detect`, `point`, `segment`, `encode_image`) on one image or a list, with
    streaming, `return_metrics` and a context manager that closes the engine.  Make one with
    `Moondream.load`; methods are safe to call from several threads."""

    def __init__(self, model: Model, engine: Engine):
        self._model, self._engine = model, engine

    @classmethod
    def load(cls, path, *, revision: str | None = None, dtype=None, pipelined: bool = True,
             max_batch_size: int = 32,
             max_context: int | None = None, kv_cache_tokens: int | None = None,
             prefix_cache: bool = True, device=None, workers: int = 2,
             compile_cache: bool = True, warmup: bool = False,
             attention: str | None = None, kv_dtype: str | None = None, mesh=None,
             tensor_parallel: int | None = None, weights: str | None = None,
             adapters: dict | None = None, max_adapters: int | None = None,
             max_lora_rank: int = 16, decode_burst: int | None = None,
             slice_images: bool = True, slice_ratio: float | None = None) -> "Moondream":
        """Load a model and start its engine.  `path`: a directory written by
        `photon-convert`, a Hugging Face snapshot directory (config.json + model.safetensors
        or a sharded index), or a hub id such as "vikhyatk/moondream2" (`revision`: a branch,
        tag or commit; needs huggingface_hub).  A snapshot is converted on first use into a
        per-user cache and reused after (`photon_jax.sources`).

        dtype: None keeps the checkpoint's dtype (a snapshot's: bfloat16 weights convert to
            bfloat16, float16/float32 ones to float32); "bfloat16" or "float32" converts or
            casts to it.
        pipelined: False selects the blocking twin of the engine (no overlap; same results).
        max_batch_size: rows decoded together.
        max_context: the longest sequence (prompt + output) one request may reach (None =
            the model's context); it reserves nothing.
        kv_cache_tokens: positions the paged KV pool holds, shared by every request and the
            image-prefix cache (None: most of the free device memory on an accelerator, room
            for max_batch_size full-context sequences on CPU).  A request reserves pages for
            its prompt + max_tokens when it starts; requests that do not fit now wait.
        prefix_cache: keep image prefixes in the pool and reuse them when the same image
            comes again (results are identical either way).
        device: a `jax.Device`, a device index, or None for the default device.
        workers: threads that decode and crop images ahead of the device.
        compile_cache: keep compiled programs in JAX's persistent cache (`compile_cache`),
            so the next load compiles nothing it compiled before.
        warmup: compile before returning every decode shape, the sampling variants, the
            common prefill shapes and the vision encoder for common photo layouts, so the
            first requests do not wait for the compiler (with a warm compile cache this
            mostly reads the cache).
        attention: the decode attention (`model.platforms.ATTENTION`): None picks the device's
            ("pallas" on GPU, "cpu-kernel" on CPU when the C++ kernel builds), "xla" the
            XLA formulation on any device.
        kv_dtype: the KV pool's format: None (the model's dtype), "int8" or
            "float8_e4m3fn" (8-bit codes with a float32 scale per kv head and position:
            about half a bfloat16 pool's bytes per token, so ~1.9x the tokens in the same
            memory; decode reads half the KV bytes).  Results differ slightly from the
            unquantized cache (bench/README.md, "8-bit KV cache").
        mesh: a `jax.sharding.Mesh` with one axis named "model": one engine over its
            devices, the weights split by output columns (experts by expert), the KV pool by
            kv heads; results equal one device's token for token (`photon_jax.model.sharding`).
        tensor_parallel: K, shorthand for a mesh over the first K local devices.
        weights: "int8", "fp8" or "int4": the text model's linear layers, experts and LM head
            held quantized on the device (`photon_jax.model.quant`; int4: the head int8),
            quantized as they load; None keeps the checkpoint's weights (a checkpoint
            converted with `photon-convert --weights`, or a published quantized one, is
            already quantized).  Results differ slightly from the float weights
            (docs/quantization.md gives the measured agreement).
        adapters: {name: path} of LoRA adapters (finetune variants: a `final.pt` as the
            reference downloads it -- Moondream 3's in kestrel's layout, per-expert
            adapters included -- or a .safetensors file with its names), checked and
            loaded now; requests pick one with settings={"variant": name}.  A variant id
            not loaded is looked up in the reference's cache folder (`md_variants/<id>/
            final.pt`) and downloaded where the reference would download it.
        max_adapters: adapter slots on the device, one per adapter in use at a time.
            None (the default): max(4, len(adapters)) made now if `adapters` is given, else
            4 made on first need -- the first `load_adapter` or variant request allocates
            them and the programs compile again with adapter products (logged once); until
            then nothing runs or compiles differently, and only their bytes are set aside in
            the memory plan (docs/lora.md).  0: no slots, variants refused.
        max_lora_rank: the largest adapter rank a slot holds (smaller ones are padded;
            Moondream 3's experts hold max_lora_rank / experts_per_token each, as kestrel).
        decode_burst: decode steps one launch runs for plain text rows, in steps of up to 8
            rows (None: the platform's: 8 on a GPU or TPU, 1 on a CPU; 1: every step
            single), so the host's per-launch work is paid once per that many tokens; the
            tokens are the same, and streams get them in groups of up to that many
            (docs/host.md).
        slice_images: while rows decode, a new image's encode and prefix prefill run a slice
            (a few layers) between decode steps, so streams keep flowing (docs/slicing.md);
            same results.  False: one program per image, the rows wait for it.
        slice_ratio: the longest gap a decoding row should see while images are sliced, in
            its median gaps (None: the engine's default, 3.5).
        Nothing is downloaded but a hub id's files missing from the Hugging Face cache (and
        the starmie tokenizer, when the snapshot lacks it) and variants named by requests,
        unless HF_HUB_OFFLINE is set.
        """
        on_demand = max_adapters is None and not adapters
        if max_adapters is None:
            max_adapters = max(4, len(adapters)) if adapters else DEFAULT_ADAPTER_SLOTS
        if adapters is not None and not isinstance(adapters, dict):
            raise TypeError(f"adapters must be a dict name -> path, got "
                            f"{type(adapters).__name__}")
        if adapters and max_adapters == 0:
            raise ValueError("adapters were given but max_adapters=0: no slot could hold "
                             "them; drop max_adapters (4 by default) or raise it")
        Weights.of(weights)   # a bad value is refused before anything loads
        if tensor_parallel is not None:
            if mesh is not None:
                raise ValueError("pass mesh or tensor_parallel, not both")
            mesh = sharding.make_mesh(tensor_parallel)
        if mesh is not None:
            sharding.check_mesh(mesh)
            if device is not None:
                raise ValueError("pass device or mesh / tensor_parallel, not both")
        path = sources.resolve(path, revision=revision, dtype=dtype)
        if compile_cache:
            compile_cache_mod.enable()
        registry = {}

        def preflight(cfg, dev):
            # Adapters checked against the config and weights + pool + slots + workspace
            # against the device's free memory, before a byte of the weights is placed:
            # refused by name or with the numbers, not mid-run.  (Bad argument types are
            # left to the engine, whose errors name them; kv_dtype is checked here, before
            # the weights load.)
            for name, p in (adapters or {}).items():
                registry[name] = adapters_mod.read_adapter(p, cfg, name=name,
                                                           max_rank=max_lora_rank)
            kv = kvpool.canonical_kv_dtype(kv_dtype, cfg.dtype)
            if not isinstance(max_batch_size, int) or not isinstance(max_context or 0, int):
                return
            rec = platforms.choose(cfg, dev.platform, attention, kv)
            memory.check(memory.plan(cfg, platform=rec, max_batch_size=max_batch_size,
                                     max_context=max_context or cfg.text.max_context,
                                     page_size=64, kv_cache_tokens=kv_cache_tokens,
                                     free=memory.device_free(dev), kv_dtype=kv,
                                     mesh_size=1 if mesh is None else mesh.size,
                                     # (on-demand slots: the engine's plan sets their
                                     # bytes aside where they fit, `Engine`)
                                     adapter_bytes=lora.table_bytes(cfg, max_adapters,
                                                                    max_lora_rank)
                                     if isinstance(max_adapters, int) and max_adapters > 0
                                     and isinstance(max_lora_rank, int) and not on_demand
                                     else 0),
                         cfg, max_context=max_context or cfg.text.max_context,
                         weights_loaded=False)

        model = Model.load(os.fspath(path), dtype=dtype, device=device, attention=attention,
                           mesh=mesh, weights=weights, preflight=preflight)
        engine = Engine(model, max_batch_size=max_batch_size, max_context=max_context,
                        kv_cache_tokens=kv_cache_tokens, prefix_cache=prefix_cache,
                        pipelined=pipelined, workers=workers, warmup=warmup,
                        kv_dtype=kv_dtype, max_adapters=max_adapters,
                        max_lora_rank=max_lora_rank, adapters=registry,
                        adapters_on_demand=on_demand, decode_burst=decode_burst,
                        slice_images=slice_images,
                        **({} if slice_ratio is None else {"slice_ratio": slice_ratio}))
        if warmup:
            try:
                engine.wait_warm()
            except BaseException:
                engine.close()
                raise
        return cls(model, engine)

    @property
    def config(self) -> "MoondreamConfig":
        """The model's configuration (shapes, tokenizer ids, dtype)."""
        return self._m.cfg

    @property
    def engine(self) -> Engine:
        """The engine serving this model (`memory()`, `stats()`, `step_log()`)."""
        if self._model is None:
            raise RuntimeError("this Moondream instance is closed")
        return self._engine

    @property
    def _m(self) -> Model:
        if self._model is None:
            raise RuntimeError("this Moondream instance is closed")
        return self._model

    def close(self) -> None:
        """Finish running requests, stop the engine and free its device memory."""
        if self._model is not None:
            self._engine.close()
            for leaf in jax.tree.leaves(self._model.params):
                leaf.delete()
            self._model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _image_costs(self, raw: bytes, max_pixels: int | None = None) -> tuple[int, int]:
        """(photon-serve, before decoding.)  (peak host bytes of `_prepare_image(raw,
        max_pixels, reduce=True)`, bytes of its crops), from the header alone; an
        ImageError for a file that would be refused (format, pixel count)."""
        _, w, h, mode = pixels.probe(raw, max_pixels)
        v = self.config.vision
        reduced = pixels.reduce_factor(w, h, v) > 1 or pixels.reduce_factor(h, w, v) > 1
        tiles = max(math.prod(pixels.crop_tiling(h, w, v)), math.prod(pixels.crop_tiling(w, h, v)))
        crops = (1 + tiles) * v.crop_size * v.crop_size * 3   # either way up (EXIF)
        return pixels.decode_cost(w, h, mode, reduced), crops

    def _prepare_image(self, raw: bytes, max_pixels: int | None = None,
                       reduce: bool = False) -> PreparedImage:
        """(photon-serve's decoder threads.)  An encoded image -> its crops on the device,
        under `max_pixels` (checked from the header) and, with `reduce`, decoded at a
        reduced size when it is much larger than the crops need (`pixels.load_image`).
        Accepted by every skill in place of the image.  Always cropped: the engine could
        not prepare these bytes again if a predicted prefix-cache hit were evicted."""
        rgb = pixels.load_image(raw, max_pixels, self.config.vision if reduce else None)
        return prepare_image(self._model, rgb)

    # -- skills -------------------------------------------------------------------------

    def encode_image(self, image: ImageLike | list[ImageLike], *, variant: str | None = None
                     ) -> EncodedImage | list[EncodedImage]:
        """Encode once, query many times: the image's prefix is computed into the engine's
        KV pool and pinned there; the returned `EncodedImage` is accepted by every method of
        this Moondream in place of the image.  `release()` it (or drop it) to unpin.  Valid
        for this loaded model only; not a persistence format.  `variant`: a finetune (as
        settings["variant"]; the reference's encode_image settings): the prefix is computed
        under its adapter, as the reference prefills an image through the adapted decoder.
        Calls use an EncodedImage as it is, whatever their own variant (as the reference
        does): encode under the variant you will ask with."""
        images = image if isinstance(image, list) else [image]
        handles = self._encodes(images, variant)
        out = [h.result() for h in handles]
        return out if isinstance(image, list) else out[0]

    async def aencode_image(self, image: ImageLike | list[ImageLike], *,
                            variant: str | None = None):
        """`encode_image` for asyncio (see `acaption`)."""
        images = image if isinstance(image, list) else [image]
        out = await aio.results(self._encodes(images, variant))
        return out if isinstance(image, list) else out[0]

    def _encodes(self, images: list, variant: str | None) -> list:
        if variant is not None:
            self._parse({"variant": variant})   # loaded now if needed; refused by name
        return [self.engine.encode(x, variant) for x in images]

    def caption(self, image: ImageLike | list[ImageLike], length: str = "normal", *,
                stream: bool = False, settings: dict | None = None, progress: bool = False,
                return_metrics: bool = False) -> dict | list[dict]:
        """Caption an image (or a list): {"caption": str} each, or with stream=True
        {"caption": iterator of text pieces}.  length: "short", "normal" or "long"."""
        return self._caption(image, length, stream, settings, return_metrics).wait(progress)

    async def acaption(self, image: ImageLike | list[ImageLike], length: str = "normal", *,
                       stream: bool = False, settings: dict | None = None,
                       return_metrics: bool = False) -> dict | list[dict]:
        """`caption` for asyncio: the same arguments (but `progress`) and results; a stream
        is an async iterator.  Waiting costs no thread (`aio`): many concurrent calls share
        the engine's batch.  Cancelling the awaiting task (or closing the stream) cancels
        the request.  The `a*` twins of every method work the same way."""
        return await self._caption(image, length, stream, settings,
                                   return_metrics).wait_async()

    def _caption(self, image, length, stream, settings, return_metrics) -> "_Call":
        return self._submit(image, _Shared(None), stream, self._caption_maker(length, settings),
                            lambda r: _scored({"caption": r["text"]}, r), key="caption",
                            return_metrics=return_metrics)

    def start(self, image: ImageLike, *, question: str | None = None, length: str = "normal",
              settings: dict | None = None) -> Handle:
        """Submit one caption (or, with `question`, one query) and return its engine
        `Handle` at once: `result()` gives {"text", "finish_reason", "output_tokens", ...},
        `cancel()` stops it, `add_done_callback(fn)` reports completion.  For callers that
        keep a window of requests in flight (the captioning CLI, the Ray integration)."""
        if question is None:
            make = self._caption_maker(length, settings)
        else:
            _check_strings(question, "question")
            make = self._query_maker(self._parse(settings), False, None)
        if image is None:
            raise ValueError(NEED_IMAGE)
        return self.engine.submit(make(image, question))

    def query(self, image: ImageLike | list[ImageLike] | None = None,
              question: str | list[str] | None = None, *, reasoning: bool = False,
              spatial_refs: list | None = None, stream: bool = False,
              settings: dict | None = None, progress: bool = False,
              return_metrics: bool = False) -> dict | list[dict]:
        """Answer a question about an image (or, with image=None, a text-only question):
        {"answer": str} (stream=True: {"answer": iterator of text pieces}).

        reasoning: Moondream 2's grounded reasoning first; the result gains
        "reasoning": {"text", "grounding": [{"start_idx", "end_idx", "points"}]}.
        spatial_refs: points [x, y] and boxes [x_min, y_min, x_max, y_max] (normalised) the
        question refers to; they need an image."""
        return self._query(image, question, reasoning, spatial_refs, stream, settings,
                           return_metrics).wait(progress)

    async def aquery(self, image: ImageLike | list[ImageLike] | None = None,
                     question: str | list[str] | None = None, *, reasoning: bool = False,
                     spatial_refs: list | None = None, stream: bool = False,
                     settings: dict | None = None,
                     return_metrics: bool = False) -> dict | list[dict]:
        """`query` for asyncio (see `acaption`)."""
        return await self._query(image, question, reasoning, spatial_refs, stream, settings,
                                 return_metrics).wait_async()

    def _query(self, image, question, reasoning, spatial_refs, stream, settings,
               return_metrics) -> "_Call":
        questions = _check_strings(question, "question")

        def shape(r):
            return _scored({"reasoning": r["reasoning"], "answer": r["text"]} if reasoning
                           else {"answer": r["text"]}, r)

        return self._submit(image, questions, stream,
                            self._query_maker(self._parse(settings), reasoning, spatial_refs), shape,
                            key="answer", optional_image=True, return_metrics=return_metrics)

    def detect(self, image: ImageLike | list[ImageLike], object: str | list[str], *,
               settings: dict | None = None, progress: bool = False,
               return_metrics: bool = False) -> dict | list[dict]:
        """Boxes of `object`: {"objects": [{"x_min", "y_min", "x_max", "y_max"}, ...]}
        (normalised to the image, not clamped); always greedy, up to max_objects."""
        return self._locate("detect", "objects", image, object, settings,
                            return_metrics).wait(progress)

    async def adetect(self, image: ImageLike | list[ImageLike], object: str | list[str], *,
                      settings: dict | None = None,
                      return_metrics: bool = False) -> dict | list[dict]:
        """`detect` for asyncio (see `acaption`)."""
        return await self._locate("detect", "objects", image, object, settings,
                                  return_metrics).wait_async()

    def point(self, image: ImageLike | list[ImageLike], object: str | list[str], *,
              settings: dict | None = None, progress: bool = False,
              return_metrics: bool = False) -> dict | list[dict]:
        """Centre points of `object`: {"points": [{"x", "y"}, ...]} (normalised)."""
        return self._locate("point", "points", image, object, settings,
                            return_metrics).wait(progress)

    async def apoint(self, image: ImageLike | list[ImageLike], object: str | list[str], *,
                     settings: dict | None = None,
                     return_metrics: bool = False) -> dict | list[dict]:
        """`point` for asyncio (see `acaption`)."""
        return await self._locate("point", "points", image, object, settings,
                                  return_metrics).wait_async()

    def segment(self, image: ImageLike | list[ImageLike], object: str | list[str], *,
                spatial_refs: list | None = None, settings: dict | None = None,
                progress: bool = False, return_metrics: bool = False) -> dict | list[dict]:
        """Moondream 3 only: {"path": SVG path text, "bbox": {x_min, y_min, x_max, y_max} or
        None}.  The box comes from the first coordinate pair and size the model emits, the
        path from the text tokens after it (kestrel's separate refiner network is not run)."""
        return self._segment(image, object, spatial_refs, settings,
                             return_metrics).wait(progress)

    async def asegment(self, image: ImageLike | list[ImageLike], object: str | list[str], *,
                       spatial_refs: list | None = None, settings: dict | None = None,
                       return_metrics: bool = False) -> dict | list[dict]:
        """`segment` for asyncio (see `acaption`)."""
        return await self._segment(image, object, spatial_refs, settings,
                                   return_metrics).wait_async()

    @property
    def can_segment(self) -> bool:
        """-> True when this model has `segment` (Moondream 3)."""
        cfg = self._m.cfg
        return cfg.family == "moondream3" and bool(cfg.tokenizer.segment_prefix)

    def _segment(self, image, object, spatial_refs, settings, return_metrics) -> "_Call":
        m = self._m
        if not self.can_segment:
            raise ValueError(f"segment needs a Moondream 3 model; this checkpoint is "
                             f"{m.cfg.family}")
        s = self._parse(settings)
        objs = _check_strings(object, "object")
        spatial, region = ((), None)
        if spatial_refs is not None:
            spatial, region = spatial_refs_prompt(spatial_refs, m.cfg.tokenizer)
        return self._submit(image, objs, False,
                            lambda img, o: Request("segment",
                                                   m.prompts.segment(o, spatial=spatial),
                                                   img, s, region=region),
                            lambda r: {"path": r["path"], "bbox": r["bbox"]},
                            return_metrics=return_metrics)

    def load_adapter(self, name: str, path) -> None:
        """Load a LoRA adapter (a `final.pt` or .safetensors file) under `name`, checked
        against the model first (a bad one is refused by name and changes nothing).  It
        takes a device slot when a request first uses it: no program is compiled again.
        Loading another file under a loaded name replaces it for new requests."""
        engine = self.engine
        if not engine.max_adapters:
            raise ValueError(f"cannot load adapter {name!r}: {engine.no_slots}")
        if not isinstance(name, str) or not name or len(name) > 256:
            raise ValueError(f"adapter name must be a non-empty string of at most 256 "
                             f"characters, got {str(name)[:80]!r}")
        adapter = adapters_mod.read_adapter(path, self._m.cfg, name=name,
                                            max_rank=engine.max_lora_rank)
        engine.enable_adapters()   # the first adapter: the slots' tables, made once
        engine.adapters[name] = adapter

    def unload_adapter(self, name: str) -> None:
        """Forget the adapter `name` (its host copy): new requests for it are refused (or,
        for a variant id, read from the cache folder again); running ones finish with it,
        and its device slot is reused when needed."""
        if self.engine.adapters.pop(name, None) is None:
            raise KeyError(f"no adapter {name!r} is loaded; loaded: {self.adapters[:20]}")

    @property
    def adapters(self) -> list:
        """The names of the loaded adapters."""
        return sorted(self.engine.adapters)

    def _parse(self, settings):
        """Parse a call's settings; a variant not loaded yet is loaded from the reference's
        variant cache (downloaded as the reference would, unless offline)."""
        s = parse(settings)
        v = s.variant
        if v is not None:
            if v not in self.engine.adapters and self.engine.max_adapters:
                self.load_adapter(v, adapters_mod.variant_path(v))
            self.engine.adapter(v)   # refused here, by name, when it cannot run
        return s

    def check_settings(self, settings: dict | None) -> None:
        """Check `settings` now and compile their output shape (json_schema / regex /
        choices) into the engine's cache, so that a bad one raises here, by name
        (`SettingsError`, `RequestError`).  Calls do this themselves; the server calls it
        on a worker thread, keeping a large schema's compile off its event loop."""
        s = self._parse(settings)
        if s.shape is not None:
            self.engine.grammars.matcher(*s.shape)

    def chat(self, messages: list, *, reasoning: bool | None = None, stream: bool = False,
             settings: dict | None = None, return_metrics: bool = False):
        """Answer the last user message of a conversation, rendered as Moondream's own engine
        (kestrel 0.9.2) renders chat: one query block per user turn, a system message folded
        into the first user turn (photon_jax.model.chat).

        messages: OpenAI-shaped {"role": "system" | "user" | "assistant", "content": text or
        a list of {"type": "text", "text"} and image parts}; an image part is
        {"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}} or
        {"type": "image", "image": <anything `query` takes as an image>}, in any user
        turn; an image right after BOS is the cached image prefix, any other an image block
        inside the prompt (an `EncodedImage` only as the former).
        reasoning: Moondream's grounded reasoning before the answer; None = on, as kestrel's
        chat defaults.  settings: `query`'s, with "json_schema" / "regex" / "choices" to hold
        the answer to a shape, and "logprobs" (True, or 0-20 alternatives per token).
        -> {"message": {"role": "assistant", "content", ["reasoning", "reasoning_details":
        {"grounding"}]}, "finish_reason"[, "logprobs"]}.  stream=True: an iterator of deltas,
        {"reasoning", "reasoning_details"} first when reasoning, then {"content": piece} per
        text piece, then {"finish_reason"}; with "logprobs", each delta after the reasoning
        carries the entries of the tokens committed since the one before."""
        call = self._chat(messages, reasoning, stream, settings, return_metrics)
        if stream:
            return _chat_deltas(call.handles[0])
        return call.wait()

    async def achat(self, messages: list, *, reasoning: bool | None = None,
                    stream: bool = False, settings: dict | None = None,
                    return_metrics: bool = False):
        """`chat` for asyncio; stream=True returns an async iterator of the same deltas."""
        call = self._chat(messages, reasoning, stream, settings, return_metrics)
        if stream:
            return _achat_deltas(call.handles[0])
        return await call.wait_async()

    def _chat(self, messages, reasoning, stream, settings, return_metrics,
              n: int = 1) -> "_Call":
        """`chat`'s requests.  `n` > 1 (the server's OpenAI `n`): that many answers of one
        conversation, answer i sampled with seed + i, as one batch (they share the image
        prefix through the cache); with `stream`, each handle streams its own answer."""
        m = self._m
        if reasoning is None:
            reasoning = True
        if not isinstance(reasoning, bool):
            raise ValueError(f"reasoning must be True, False or None, got {reasoning!r}")
        s = self._parse(settings)
        turns = parse_messages(messages, _chat_image)
        c = render(turns, family=m.cfg.family, query_prefix=m.cfg.tokenizer.query_prefix,
                   encode=m.prompts.encode, reasoning=reasoning)
        # Checked before any image is decoded: each takes Z positions (BOS and the text the
        # rest), and the engine would refuse the whole only after preparing them all.
        need = 1 + len(c.ids) + (m.cfg.prefix_len - 1) * len(c.images)
        if c.images and need > self.engine.max_context:
            raise RequestError(
                f"the conversation takes {need} positions ({len(c.images)} images of "
                f"{m.cfg.prefix_len - 1} and {1 + len(c.ids)} tokens), which exceeds the "
                f"context of {self.engine.max_context}: send fewer images or a shorter "
                "conversation")
        image, prompt, blocks = _chat_prompt(m, c)
        req = Request("text", prompt, image, s, reasoning=reasoning, blocks=blocks)
        shape = lambda r: _chat_result(r, reasoning)  # noqa: E731
        if n == 1:
            return self._submit(image, _Shared(None), stream, lambda img, _: req, shape,
                                optional_image=True, return_metrics=return_metrics)
        seeded = lambda img, i: dataclasses.replace(  # noqa: E731
            req, settings=dataclasses.replace(s, seed=(s.seed + i) % 2**31))
        if stream:
            if return_metrics:
                raise ValueError("return_metrics needs stream=False")
            handles = self.engine.submit_many([seeded(image, i) for i in range(n)])
            return _Call(handles, True, True, None, lambda h: shape(h.result()))
        return self._submit([image] * n, list(range(n)), False, seeded, shape,
                            optional_image=True, return_metrics=return_metrics)

    # -- plumbing -----------------------------------------------------------------------

    def _caption_maker(self, length: str, settings):
        s = self._parse(settings)
        prompt = self._m.prompts.caption(length)  # validates `length` before any work
        return lambda img, _: Request("text", prompt, img, s)

    def _query_maker(self, s, reasoning: bool, spatial_refs):
        m = self._m
        spatial, region = ((), None)
        if spatial_refs is not None:
            spatial, region = spatial_refs_prompt(spatial_refs, m.cfg.tokenizer)

        def request(img, q):
            prompt = m.prompts.query(q, spatial=spatial, reasoning=reasoning)
            if img is None:
                if region:
                    raise ValueError("spatial_refs need an image")
                # Text-only query, as the reference builds it: BOS, then the prompt from
                # position 0, purely causal.
                return Request("text", [m.cfg.tokenizer.bos_id] + prompt, None, s,
                               reasoning=reasoning)
            return Request("text", prompt, img, s, region=region, reasoning=reasoning)

        return request

    def _locate(self, skill: str, key: str, image, obj, settings, return_metrics) -> "_Call":
        """detect / point: the same request shape, differing in prompt and result key."""
        s = self._parse(settings)
        objs = _check_strings(obj, "object")
        prompt = getattr(self._m.prompts, skill)
        return self._submit(image, objs, False,
                            lambda img, o: Request(skill, prompt(o), img, s),
                            lambda r: {key: r["objects"]}, return_metrics=return_metrics)

    def _submit(self, image, args, stream, make, shape, key=None, optional_image=False,
                return_metrics=False) -> "_Call":
        """Check a call's arguments, submit its requests (never blocking) -> a `_Call`
        that the sync method waits on with threads and the async twin with the event loop."""
        engine = self.engine
        if return_metrics:
            if stream:
                raise ValueError("return_metrics needs stream=False (a stream's handle has "
                                 "no result yet when it is returned)")
            plain = shape

            def shape(h):
                return {**plain(h.result()), "metrics": h.metrics()}
        else:
            plain = shape

            def shape(h):
                return plain(h.result())
        batch = isinstance(image, list) or not isinstance(args, _Shared)
        if not batch:
            if image is None and not optional_image:
                raise ValueError(NEED_IMAGE)
            return _Call([engine.submit(make(image, args.value))], False, stream, key, shape)
        if stream:
            raise ValueError("stream=True works on one image at a time; for a list, call "
                             "without stream (results come back in input order)")
        images = image if isinstance(image, list) else [image] * len(args)
        if isinstance(args, _Shared):
            args = [args.value] * len(images)
        if len(args) != len(images):
            raise ValueError(f"{len(images)} images but {len(args)} questions/objects; pass one "
                             "string for all, or a list of the same length")
        if not optional_image and any(x is None for x in images):
            raise ValueError("image is required for every item of the list")
        handles = engine.submit_many([make(img, a) for img, a in zip(images, args)])
        return _Call(handles, True, False, key, shape)


class _Call:
    """One method call's submitted requests and how to shape their results: `wait` blocks
    the calling thread, `wait_async` awaits on the event loop (`aio`)."""

    def __init__(self, handles: list[Handle], batch: bool, stream: bool, key, shape):
        self.handles, self.batch, self.stream, self.key, self.shape = \
            handles, batch, stream, key, shape

    def wait(self, progress: bool = False):
        handles = self.handles
        with _cancel_on_interrupt(handles):
            if not self.batch:
                h = handles[0]
                if self.stream:
                    reasoning = h.reasoning() if h.request.reasoning else None
                    out = {self.key: h.text_stream()}
                    return out if reasoning is None else {"reasoning": reasoning, **out}
                return self.shape(h)
            if progress:
                _progress(handles)
            return self._gather()

    async def wait_async(self):
        h = self.handles[0]
        if not self.batch:
            if self.stream:
                reasoning = await aio.reasoning(h) if h.request.reasoning else None
                out = {self.key: aio.text_stream(h)}
                return out if reasoning is None else {"reasoning": reasoning, **out}
            await aio.wait(h)
            return self.shape(h)
        await aio.wait_all(self.handles)
        return self._gather()

    def _gather(self) -> list:
        results, errors = [], []
        for h in self.handles:
            try:
                results.append(self.shape(h))
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - reported per item below
                results.append(None)
                errors.append(e)
        if any(e is not None for e in errors):
            raise BatchError(results, errors)
        return results


def _chat_image(part: dict, where: str):
    """A chat image part -> what `Request` takes as an image."""
    if part.get("type") == "image":
        if part.get("image") is None:
            raise ChatError(f"{where}: an image part needs 'image' (a path, bytes, PIL image, "
                            "array or EncodedImage)")
        return part["image"]
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise ChatError(f"{where}: an image_url part needs {{\"image_url\": {{\"url\": "
                        "\"data:image/...;base64,...\"}}")
    head, sep, data = url.strip().partition(",")
    if not (head.startswith("data:") and head.endswith(";base64") and sep):
        raise ChatError(f"{where}: an image_url must be a base64 data: URL "
                        "(data:image/...;base64,...); for a file, use {\"type\": \"image\", "
                        "\"image\": path}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ChatError(f"{where}: the image_url's base64 payload is malformed") from None


def _chat_prompt(m: Model, c) -> tuple:
    """A rendered conversation (`chat.render`) -> the request's (image, prompt, blocks): an
    image right after BOS is the image prefix (BOS joins its block, as kestrel's mask has
    it); every other image is a block of Z placeholder positions inside the prompt
    (`Request.blocks`), prepared by the engine's workers."""
    z = m.cfg.prefix_len - 1
    images, at = list(c.images), list(c.image_at)
    image = None
    if images and at[0] == 0:
        image, images, at = images[0], images[1:], at[1:]
    prompt = list(c.ids) if image is not None else [m.cfg.tokenizer.bos_id] + list(c.ids)
    shift = 0 if image is not None else 1
    blocks = []
    for img, a in zip(images, at):
        off = a + shift
        prompt[off:off] = [0] * z
        blocks.append((off, img))
        shift += z
    return image, prompt, tuple(blocks)


def _chat_result(r: dict, reasoning: bool) -> dict:
    """A text request's result -> kestrel's chat output."""
    message = {"role": "assistant", "content": r["text"]}
    if reasoning and r.get("reasoning") is not None:
        message["reasoning"] = r["reasoning"]["text"]
        if r["reasoning"]["grounding"]:
            message["reasoning_details"] = {"grounding": r["reasoning"]["grounding"]}
    return _scored({"message": message, "finish_reason": r["finish_reason"]}, r)


def _scored(out: dict, r: dict) -> dict:
    """A result with the answer tokens' log-probabilities when its settings asked for them:
    "logprobs", a list of {"id", "token", "bytes", "logprob", "top_logprobs"} (OpenAI's
    entries, plus the token id)."""
    return out if "logprobs" not in r else {**out, "logprobs": r["logprobs"]}


def _reasoning_delta(rs: dict) -> dict:
    d = {"reasoning": rs["text"]}
    if rs["grounding"]:
        d["reasoning_details"] = {"grounding": rs["grounding"]}
    return d


def _chat_deltas(h: Handle):
    with _cancel_on_interrupt([h]):
        if h.request.reasoning:
            rs = h.reasoning()
            if rs is not None:
                yield _reasoning_delta(rs)
        for piece in h.text_stream():
            yield _scored_delta(h, {"content": piece})
        h.result()
        yield _scored_delta(h, {"finish_reason": h.metrics()["finish_reason"]})


async def _achat_deltas(h: Handle):
    if h.request.reasoning:
        rs = await aio.reasoning(h)
        if rs is not None:
            yield _reasoning_delta(rs)
    async for piece in aio.text_stream(h):
        yield _scored_delta(h, {"content": piece})
    yield _scored_delta(h, {"finish_reason": h.metrics()["finish_reason"]})


def _scored_delta(h: Handle, d: dict) -> dict:
    """A chat stream's delta with the log-probability entries of the tokens committed since
    the last delta, when the request asked for them (the final delta carries any left)."""
    if h.request.settings.logprobs is None:
        return d
    return {**d, "logprobs": h.take_logprobs()}


@contextlib.contextmanager
def _cancel_on_interrupt(handles):
    """Ctrl-C (a notebook's interrupt) while a call waits cancels its unfinished requests:
    otherwise they would go on decoding, holding rows that later calls wait for."""
    try:
        yield
    except BaseException:
        for h in handles:
            if not h.done():
                h.cancel()
        raise


def _progress(handles) -> None:
    """A tqdm bar that advances as requests finish, in whatever order they do."""
    with tqdm(total=len(handles), unit="req") as bar:
        pending = list(handles)
        while pending:
            pending[0].wait(0.1)
            left = [h for h in pending if not h.done()]
            bar.update(len(pending) - len(left))
            pending = left


@dataclasses.dataclass(frozen=True)
class _Shared:
    """One question/object (or None) for every image of a call, as opposed to a list of
    one per image: a single image with it is a single call, not a batch."""
    value: Any


def _check_strings(x, name: str) -> "list | _Shared":
    items = x if isinstance(x, list) else [x]
    for v in items:
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"{name} must be a non-empty string (or a list of them), got {v!r}")
    return items if isinstance(x, list) else _Shared(x)
