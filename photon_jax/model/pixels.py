"""Host-side image preprocessing, bit-identical to the reference's PIL path.

Owns: loading an image from a path / PIL image / numpy array into RGB uint8, the tiling
choice, the LANCZOS resizes and overlap crops (uint8), the pixel-normalisation table (the
reference normalises in bf16 even in float32 mode, so this is a 256-entry lookup), and the
matrix that stitches the local crops' patch features and adaptive-average-pools them to the
patch grid.  Everything here is numpy/PIL; nothing touches the device.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import threading
from dataclasses import dataclass
from functools import lru_cache

import ml_dtypes
import numpy as np
from PIL import Image, ImageOps

from .config import VisionConfig

# Decompression-bomb guard of PIL, made explicit: images above this many pixels are refused.
# (photon-serve passes its own, lower cap: --max-image-pixels.)
MAX_PIXELS = 178_956_970

# The formats an image may be in.  PIL knows ~40 (EPS hands the file to Ghostscript, PSD,
# ICNS, SGI, ... each a decoder nobody here tests); only these common photo and screenshot
# formats are opened.  (PIL's JPEG opener also yields MPO, the multi-picture JPEG of phone
# cameras.)
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
FORMAT_NAMES = "JPEG, PNG, WebP, GIF, BMP or TIFF"
Image.init()   # registers every plugin, so `formats=` can name WEBP and TIFF

# Bytes PIL holds per pixel in each decoded mode (multi-band images are stored 4 bytes per
# pixel whatever their band count): what `decode_cost` budgets.
_MODE_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2}


class ImageError(ValueError):
    """An input that is not a usable image."""


# PIL decodes an `Image.open` image lazily, on first pixel access, and that lazy load is not
# thread-safe: two threads touching the same unloaded image race in the decoder (an
# AssertionError in PngImagePlugin, "image file is truncated").  Striped by object id, so
# one image's readers queue while different images load in parallel.
_PIL_LOCKS = [threading.Lock() for _ in range(64)]


def pil_pixels(image: Image.Image) -> np.ndarray:
    """A PIL image's pixels as a private HxWx3 uint8 copy, exactly what `load_image` would
    hand on (RGB conversion only), taken under a per-image lock.  Callers' threads call this
    when they submit, so the request owns its pixels: the caller may close or change the
    image afterwards, and threads sharing one lazily opened image do not race."""
    with _PIL_LOCKS[id(image) % len(_PIL_LOCKS)]:
        return np.array(_to_rgb(image, "the PIL image"), dtype=np.uint8)


def load_image(image, max_pixels: int | None = None, reduce_for=None) -> Image.Image:
    """An image file (path or encoded bytes), a PIL image or an HxWx{1,3,4} uint8 array -> RGB
    PIL image.

    Files and bytes are decoded here, in one of `FORMATS` only: EXIF rotation applied, first
    frame of an animation, 16-bit grey scaled to 8 bits, any other mode converted with
    `convert("RGB")` (alpha dropped, as the reference does), and images above `max_pixels`
    (default MAX_PIXELS) refused from their header, before decoding.  PIL images and arrays
    given directly are only converted to RGB.

    `reduce_for` (a VisionConfig; photon-serve's choice) decodes a large file at a reduced
    size first (JPEG's DCT scaling, `Image.reduce` for the rest), never below twice the size
    the crops are resized to, so a 50-megapixel upload costs a fraction of its full decode.
    The result then differs from the reference's full-size resize: the default (None) keeps
    the reference's exact path."""
    cap = MAX_PIXELS if max_pixels is None else max_pixels
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        try:
            return _decode(path, repr(path), cap, reduce_for)
        except FileNotFoundError:
            raise ImageError(f"image file not found: {path!r}") from None
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _decode(io.BytesIO(bytes(image)), f"the {len(image)}-byte image", cap,
                       reduce_for)
    if isinstance(image, Image.Image):
        with _PIL_LOCKS[id(image) % len(_PIL_LOCKS)]:   # lazy load: see pil_pixels
            rgb = _to_rgb(image, "the PIL image", cap)
            return rgb.copy() if rgb is image else rgb   # loaded, and ours from here on
    if isinstance(image, np.ndarray):
        a = image
        if a.dtype != np.uint8:
            raise ImageError(
                f"numpy image must be uint8 HxWx3, got dtype {a.dtype}; convert with "
                "np.clip(x, 0, 255).astype(np.uint8)"
            )
        if a.ndim == 3 and a.shape[2] == 1:
            a = a[:, :, 0]
        if not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] in (3, 4))):
            raise ImageError(f"numpy image must have shape HxWx3, got {a.shape}")
        return _to_rgb(Image.fromarray(np.ascontiguousarray(a)), "the numpy image", cap)
    raise ImageError(
        f"unsupported image type {type(image).__name__}; pass a PIL image, an HxWx3 uint8 "
        "numpy array, a file path or the file's bytes"
    )


def probe(raw: bytes, max_pixels: int | None = None) -> tuple[str, int, int, str]:
    """(format, width, height, mode) of an encoded image, from its header only (nothing is
    decoded): refused like `load_image` would refuse it (format, size)."""
    cap = MAX_PIXELS if max_pixels is None else max_pixels
    what = f"the {len(raw)}-byte image"
    if not raw:
        raise ImageError(f"{what} is empty (0 bytes)")
    with _opened(io.BytesIO(raw), what) as im:
        _check_size(im, what, cap)
        return im.format, im.size[0], im.size[1], im.mode


def decode_cost(width: int, height: int, mode: str, reduced: bool) -> int:
    """Bytes of host memory decoding such an image takes at its peak (an upper estimate:
    the decoded pixels, their RGB conversion and the copies `make_crops` takes; a reduced
    decode keeps only the decoded pixels and one conversion at full size)."""
    n = width * height
    native = _MODE_BYTES.get(mode, 4) * n
    return 2 * native + 4 * n if reduced else 2 * native + 4 * n + 2 * 3 * n


def reduce_factor(width: int, height: int, cfg: VisionConfig) -> int:
    """The integer factor a `width` x `height` image may be shrunk by before `make_crops`
    while staying at least twice the size of every resize target make_crops uses for it
    (LANCZOS from there loses nothing visible); 1 for an image already near them."""
    th, tw = crop_tiling(height, width, cfg)
    margin = cfg.enc_patch_size * cfg.overlap_margin
    window = (cfg.grid - 2 * cfg.overlap_margin) * cfg.enc_patch_size
    tw_px = max(tw * window + 2 * margin, cfg.crop_size)
    th_px = max(th * window + 2 * margin, cfg.crop_size)
    return max(1, min(width // (2 * tw_px), height // (2 * th_px)))


@contextlib.contextmanager
def _opened(src, what: str):
    """`Image.open` limited to FORMATS, with PIL's errors as ImageErrors."""
    try:
        with Image.open(src, formats=FORMATS) as im:
            yield im
    except FileNotFoundError:
        raise
    except Image.UnidentifiedImageError:
        raise ImageError(f"{what} is not an image in an accepted format (a {FORMAT_NAMES} "
                         "file); convert it to JPEG or PNG") from None
    except Image.DecompressionBombError as e:   # PIL's own check fired first, at open
        raise ImageError(f"{what} is too large ({e}); downscale it") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"cannot read image {what}: {e}") from None


def _decode(src, what: str, cap: int, reduce_for) -> Image.Image:
    empty = src.getbuffer().nbytes == 0 if isinstance(src, io.BytesIO) else \
        os.path.getsize(src) == 0
    if empty:
        raise ImageError(f"{what} is empty (0 bytes)")
    with _opened(src, what) as im:
        _check_size(im, what, cap)   # before decoding: a huge file costs nothing
        im.seek(0)  # animated: first frame
        if reduce_for is None or _reduce_by(im.size, reduce_for) == 1:
            im = ImageOps.exif_transpose(im)
            im.load()
            if im.mode.startswith("I;16") or im.mode == "I":
                im = Image.fromarray(_grey16_to_8(np.asarray(im)))
            return _to_rgb(im, what, cap)
        # Reduced: shrink first, rotate the small result (the factor holds either way up).
        orientation = im.getexif().get(0x0112, 1)
        if im.format in ("JPEG", "MPO"):
            # DCT scaling (1/2, 1/4, 1/8) while decoding; never below the size asked for.
            k = _reduce_by(im.size, reduce_for)
            im.draft("RGB", (im.size[0] // k, im.size[1] // k))
        im.load()
        if im.mode.startswith("I;16") or im.mode == "I":
            im = Image.fromarray(_grey16_to_8(np.asarray(im)))
        k = _reduce_by(im.size, reduce_for)
        if k > 1:
            if im.mode not in ("L", "LA", "RGB", "RGBA", "F", "CMYK"):
                im = im.convert("RGBA" if "transparency" in im.info else "RGB")
            im = im.reduce(k)
        if orientation in _ORIENT:
            im = im.transpose(_ORIENT[orientation])
        return _to_rgb(im, what, cap)


# EXIF orientation -> the transpose that shows the image upright (as ImageOps.exif_transpose).
_ORIENT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
           4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
           6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
           8: Image.Transpose.ROTATE_90}


def _reduce_by(size: tuple[int, int], cfg: VisionConfig) -> int:
    """`reduce_factor` that holds whichever way up the image is shown (EXIF rotation)."""
    w, h = size
    return min(reduce_factor(w, h, cfg), reduce_factor(h, w, cfg))


def _grey16_to_8(a: np.ndarray) -> np.ndarray:
    """16-bit (or 32-bit integer) grey -> 8 bits: round(v * 255 / 65535) when the image
    uses more than 8 bits, else v, clipped; in integer arithmetic (255 * 257 = 65535, so
    the rounding is (v + 128) // 257 exactly) and in row blocks, so a large image never
    holds a float64 copy (8 bytes a pixel)."""
    wide = int(a.max(initial=0)) > 255
    out = np.empty(a.shape, np.uint8)
    rows = max(1, (1 << 20) // max(1, a.shape[1]))
    for r in range(0, a.shape[0], rows):
        blk = np.clip(a[r:r + rows].astype(np.int64), 0, 65535 if wide else 255)
        out[r:r + rows] = (blk + 128) // 257 if wide else blk
    return out


def _check_size(im: Image.Image, what: str, cap: int | None = None) -> None:
    cap = MAX_PIXELS if cap is None else cap   # (read at call time: tests lower it)
    w, h = im.size
    if w < 1 or h < 1:
        raise ImageError(f"{what} is empty ({w}x{h})")
    if w * h > cap:
        raise ImageError(f"{what} is too large ({w}x{h} = {w * h} pixels); downscale it to "
                         f"at most {cap} pixels")


def _to_rgb(im: Image.Image, what: str, cap: int | None = None) -> Image.Image:
    _check_size(im, what, cap)
    return im if im.mode == "RGB" else im.convert("RGB")


def select_tiling(height: int, width: int, crop_size: int, max_crops: int) -> tuple[int, int]:
    """(rows, cols) of local tiles, exactly as the reference chooses them."""
    if height <= crop_size or width <= crop_size:
        return (1, 1)
    min_h = math.ceil(height / crop_size)
    min_w = math.ceil(width / crop_size)
    if min_h * min_w > max_crops:
        ratio = math.sqrt(max_crops / (min_h * min_w))
        return (max(1, math.floor(min_h * ratio)), max(1, math.floor(min_w * ratio)))
    th = max(math.floor(math.sqrt(max_crops * height / width)), min_h)
    tw = max(math.floor(math.sqrt(max_crops * width / height)), min_w)
    if th * tw > max_crops:
        if tw > th:
            tw = math.floor(max_crops / th)
        else:
            th = math.floor(max_crops / tw)
    return (max(1, th), max(1, tw))


@dataclass(frozen=True)
class Crops:
    crops: np.ndarray          # [C, crop, crop, 3] uint8; crop 0 is the global view
    tiling: tuple[int, int]    # (rows, cols) of local tiles; C = 1 + rows * cols


def crop_tiling(height: int, width: int, cfg: VisionConfig) -> tuple[int, int]:
    """(rows, cols) of the local tiles `make_crops` cuts from an image of this size."""
    margin = cfg.enc_patch_size * cfg.overlap_margin
    window = (cfg.grid - 2 * cfg.overlap_margin) * cfg.enc_patch_size
    return select_tiling(height - 2 * margin, width - 2 * margin, window, cfg.max_crops)


def make_crops(image: Image.Image, cfg: VisionConfig) -> Crops:
    """Global crop + overlapping local tiles (uint8), as the reference's PIL fallback does."""
    arr = np.asarray(image)
    h, w = arr.shape[:2]
    patch, base = cfg.enc_patch_size, cfg.crop_size
    margin = patch * cfg.overlap_margin
    window = (cfg.grid - 2 * cfg.overlap_margin) * patch
    th, tw = crop_tiling(h, w, cfg)
    crops = np.zeros((1 + th * tw, base, base, arr.shape[2]), np.uint8)
    pil = Image.fromarray(arr)
    resized = np.asarray(pil.resize((tw * window + 2 * margin, th * window + 2 * margin),
                                    resample=Image.Resampling.LANCZOS))
    crops[0] = np.asarray(pil.resize((base, base), resample=Image.Resampling.LANCZOS))
    for i in range(th):
        for j in range(tw):
            tile = resized[i * window:i * window + base, j * window:j * window + base]
            crops[1 + i * tw + j, :tile.shape[0], :tile.shape[1]] = tile
    return Crops(crops, (th, tw))


@lru_cache(maxsize=None)
def pixel_lut() -> np.ndarray:
    """uint8 value -> normalised pixel, with the reference's bf16 rounding after every step
    (cast, /255, -0.5, /0.5).  Returned as float32 holding exact bf16 values."""
    bf16 = ml_dtypes.bfloat16
    x = np.arange(256, dtype=np.float32).astype(bf16).astype(np.float32)
    x = (x / np.float32(255.0)).astype(bf16).astype(np.float32)
    x = (x - np.float32(0.5)).astype(bf16).astype(np.float32)
    x = (x / np.float32(0.5)).astype(bf16).astype(np.float32)
    return x


def stitch_sources(tiling: tuple[int, int], cfg: VisionConfig) -> np.ndarray:
    """[H, W, 2] int: (local crop index 1.., patch index) feeding each stitched feature cell.

    Tile (i, j) keeps its patch rows/cols minus `overlap_margin` on every inner edge; the
    kept blocks abut on a grid of (grid - 2*margin) patches.
    """
    th, tw = tiling
    g, m = cfg.grid, cfg.overlap_margin
    step = g - 2 * m
    out = np.zeros((step * th + 2 * m, step * tw + 2 * m, 2), np.int64)
    for i in range(th):
        r0, r1 = (0 if i == 0 else m), (g if i == th - 1 else g - m)
        for j in range(tw):
            c0, c1 = (0 if j == 0 else m), (g if j == tw - 1 else g - m)
            rr, cc = np.meshgrid(np.arange(r0, r1), np.arange(c0, c1), indexing="ij")
            block = out[i * step + r0:i * step + r1, j * step + c0:j * step + c1]
            block[..., 0] = 1 + i * tw + j
            block[..., 1] = rr * g + cc
    return out


def _adaptive_pool_weights(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] averaging weights of PyTorch's adaptive_avg_pool along one axis:
    output i averages inputs [floor(i*n_in/n_out), ceil((i+1)*n_in/n_out))."""
    w = np.zeros((n_out, n_in), np.float32)
    for i in range(n_out):
        lo, hi = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
        w[i, lo:hi] = 1.0 / (hi - lo)
    return w


@lru_cache(maxsize=64)
def pool_operands(tiling: tuple[int, int], cfg: VisionConfig):
    """What the device needs to stitch and pool the local crops' features for `tiling`:
    `src` [H, W] int32 flat indices into the local features [n_local * patches], and the
    separable pooling weights `ph` [grid, H] and `pw` [grid, W]."""
    g = cfg.grid
    src = stitch_sources(tiling, cfg)
    flat = ((src[..., 0] - 1) * g * g + src[..., 1]).astype(np.int32)
    ph = _adaptive_pool_weights(flat.shape[0], g)
    pw = _adaptive_pool_weights(flat.shape[1], g)
    for a in (flat, ph, pw):
        a.setflags(write=False)
    return flat, ph, pw
