"""The image front end: from a user's image to what the device needs, and the handles users
keep.  Used by the engine, the API and the one-request path alike.

- `prepare_image` (any thread): decode the image (EXIF rotation, RGB), hash its pixels (the
  prefix cache's key), cut the overlap crops and upload them with the pooling operands:
  a `PreparedImage`.  When the caller lists the key as cached already, the crops are skipped.
- `encode_prepared` (device only, asynchronous): vision encoder, projection and the prefix
  prefill of BOS + image tokens: an `ImagePrefix`, the 730 positions' K/V as dense arrays.
- `EncodedImage`: what `Moondream.encode_image` returns, a handle on an image prefix kept in
  the engine's KV pool (pinned there until the handle is released or garbage-collected).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from functools import partial
from typing import Container

import jax
import numpy as np

from ..model import pixels as image_mod


@dataclass(frozen=True)
class ImagePrefix:
    """An image prefix (BOS + image tokens) as per-layer K/V: [L, 730, K, H] each, dense.
    The one-request path's encoded image; the engine writes it into a request's pages.
    Not a persistence format (it depends on this version's layout and the model's dtype)."""
    k: jax.Array
    v: jax.Array
    tiling: tuple[int, int]

    @property
    def pos(self) -> int:
        """-> positions of the prefix (BOS + image tokens)."""
        return self.k.shape[1]


@dataclass(frozen=True)
class PreparedImage:
    """An image's content key and, unless it was known to be cached, its crops and pooling
    operands, already uploaded: what the device needs to encode it."""
    key: bytes
    tiling: tuple[int, int]
    crops: jax.Array | None = None   # [C, crop, crop, 3] uint8
    src: jax.Array | None = None
    ph: jax.Array | None = None
    pw: jax.Array | None = None

    @property
    def has_crops(self) -> bool:
        """-> False when the crops were skipped (the prefix was cached when prepared)."""
        return self.crops is not None


def image_key(pixels: np.ndarray) -> bytes:
    """The prefix cache's key of an image: a hash of its decoded RGB pixels and shape (the
    crops are a function of these and the model's fixed vision config)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(pixels.shape, np.int64).tobytes())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.digest()


def prepare_image(model, img, skip_crops_for: Container[bytes] = frozenset()) -> PreparedImage:
    """Decode + hash (+ crop and upload, unless the key is in `skip_crops_for`: prefixes
    cached already).  Host work only; explicit uploads (no implicit transfer later)."""
    rgb = image_mod.load_image(img)
    pixels = np.asarray(rgb)
    key = image_key(pixels)
    tiling = image_mod.crop_tiling(pixels.shape[0], pixels.shape[1], model.cfg.vision)
    if key in skip_crops_for:
        return PreparedImage(key, tiling)
    crops = image_mod.make_crops(rgb, model.cfg.vision)
    src, ph, pw = image_mod.pool_operands(crops.tiling, model.cfg.vision)
    put = partial(jax.device_put, device=model.placement)
    return PreparedImage(key, crops.tiling, put(crops.crops), put(src), put(ph), put(pw))


def encode_prepared(image_kv, params, prep: PreparedImage, *adapter) -> ImagePrefix:
    """Device only (asynchronous): vision encoder, projection and the image prefix KV, by
    the caller's `image_kv` program (`step.EnginePrograms.image_kv`).  `adapter`: the LoRA
    slot tables and the slot ([1] int32) the prefix is computed under, or nothing."""
    if not prep.has_crops:
        raise ValueError("this PreparedImage has no crops (its prefix was cached)")
    k, v = image_kv(params, prep.crops, prep.src, prep.ph, prep.pw, *adapter)
    return ImagePrefix(k, v, prep.tiling)


class EncodedImage:
    """An image encoded once for many questions: its prefix lives in the engine's KV pool,
    pinned (never evicted) until `release()` or garbage collection.  Accepted by every
    method of the `Moondream` that made it, in place of an image.  Valid for that loaded
    model only; not a persistence format."""

    def __init__(self, engine, key: bytes, tiling: tuple[int, int], adapter=None):
        self._engine, self.key, self.tiling = engine, key, tiling
        # The variant the prefix was computed under (None: the base model).  Any request may
        # read it as it is, whatever its own variant (as the reference uses the caches of an
        # EncodedImage it is handed).
        self.variant = None if adapter is None else adapter.name
        self._lock = threading.Lock()
        self._released = False

    @property
    def released(self) -> bool:
        """-> True once `release()` unpinned the prefix (it may then be evicted)."""
        return self._released

    def release(self) -> None:
        """Unpin the prefix (the cache may then evict it).  Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._engine.release_prefix(self.key)

    def __del__(self):
        try:
            self.release()
        except Exception:   # interpreter shutdown: nothing to unpin any more
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "pinned"
        v = "" if self.variant is None else f", variant={self.variant!r}"
        return f"EncodedImage({self.key.hex()[:12]}, tiling={self.tiling}{v}, {state})"
