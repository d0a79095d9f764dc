"""Image decoding's bounds (model/pixels.py): the format allow-list, the pixel cap read
from the header, 16-bit grey in integer arithmetic (bitwise the float rounding it
replaced), and the reduced decode photon-serve uses for images far larger than the crops
need."""

import io

import numpy as np
import pytest
from PIL import Image

from photon_jax.model import pixels as P
from photon_jax.model.config import VisionConfig

V = VisionConfig()


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _float_grey16(a: np.ndarray) -> np.ndarray:
    # The float64 path this replaced (and the reference's behaviour it kept).
    a = a.astype(np.float64)
    hi = 65535.0 if a.max(initial=0) > 255 else 255.0
    return np.round(a * (255.0 / hi)).clip(0, 255).astype(np.uint8)


@pytest.mark.parametrize("hi", [65536, 256, 70000])
def test_grey16_integer_scaling_equals_the_float_rounding(hi):
    rng = np.random.default_rng(hi)
    a = rng.integers(0, hi, (300, 257)).astype(np.int64 if hi > 65536 else np.uint16)
    a[0, :4] = [0, 128, 129, 65535 if hi > 256 else 255]   # the rounding's edges
    assert np.array_equal(P._grey16_to_8(a), _float_grey16(np.clip(a, 0, None)))


def test_16_bit_png_decodes_as_before():
    a = np.random.default_rng(0).integers(0, 65536, (40, 50), dtype=np.uint16)
    raw = _encode(Image.fromarray(a), "PNG")
    got = np.asarray(P.load_image(raw))
    assert np.array_equal(got, np.repeat(_float_grey16(a)[:, :, None], 3, axis=2))


@pytest.mark.parametrize("fmt", ["EPS", "PPM", "ICO", "TGA", "PCX", "SGI"])
def test_formats_outside_the_allow_list_are_refused(fmt, tmp_path):
    raw = _encode(Image.new("RGB", (16, 16)), fmt)
    with pytest.raises(P.ImageError, match="accepted format"):
        P.load_image(raw)
    path = tmp_path / f"x.{fmt.lower()}"
    path.write_bytes(raw)
    with pytest.raises(P.ImageError, match="accepted format"):
        P.load_image(str(path))
    with pytest.raises(P.ImageError, match="accepted format"):
        P.probe(raw)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
def test_allowed_formats_open(fmt):
    raw = _encode(Image.new("RGB", (20, 10), (200, 10, 10)), fmt)
    assert P.load_image(raw).size == (20, 10)
    assert P.probe(raw)[:3] == (fmt, 20, 10)


def test_pixel_cap_is_read_from_the_header():
    raw = _encode(Image.new("1", (9000, 9000)), "PNG")    # ~10 KB, 81 Mpx
    with pytest.raises(P.ImageError, match="81000000 pixels"):
        P.probe(raw, max_pixels=50_000_000)
    with pytest.raises(P.ImageError, match="at most 50000000"):
        P.load_image(raw, max_pixels=50_000_000)
    assert P.probe(raw)[1:3] == (9000, 9000)   # under the API's default cap


@pytest.mark.parametrize("size,fmt", [((8000, 6000), "JPEG"), ((6000, 8000), "PNG"),
                                      ((3000, 2000), "JPEG")])
def test_reduced_decode_stays_twice_the_crop_targets(size, fmt):
    w, h = size
    im = Image.fromarray(np.random.default_rng(1).integers(0, 255, (h, w, 3), np.uint8))
    # (stored, not deflated: random pixels do not compress; deflating them took 5.3 s, storing 2.9)
    raw = _encode(im, fmt, **({"quality": 90} if fmt == "JPEG" else {"compress_level": 0}))
    exact = P.load_image(raw)
    reduced = P.load_image(raw, reduce_for=V)
    assert exact.size == (w, h)
    k = P._reduce_by((w, h), V)
    if k == 1:   # close to what the crops need: decoded exactly, as the API does
        assert np.array_equal(np.asarray(reduced), np.asarray(exact))
        return
    rw, rh = reduced.size
    assert rw < w and rh < h
    th, tw = P.crop_tiling(rh, rw, V)
    margin = V.enc_patch_size * V.overlap_margin
    window = (V.grid - 2 * V.overlap_margin) * V.enc_patch_size
    assert rw >= 2 * max(tw * window + 2 * margin, V.crop_size) - 8
    assert rh >= 2 * max(th * window + 2 * margin, V.crop_size) - 8
    # Same picture: the reduced image resized to the exact one's crop size is close.
    a = np.asarray(reduced.resize((378, 378)), np.float32)
    b = np.asarray(exact.resize((378, 378)), np.float32)
    assert np.abs(a - b).mean() < 40   # random pixels: only the averaging differs


def test_reduced_decode_keeps_exif_rotation():
    im = Image.new("RGB", (8000, 4000), (255, 0, 0))
    im.paste((0, 0, 255), (0, 0, 4000, 4000))   # left half blue
    exif = Image.Exif()
    exif[0x0112] = 6   # rotate 90 degrees clockwise to show
    raw = _encode(im, "JPEG", exif=exif, quality=90)
    for reduce_for in (None, V):
        out = np.asarray(P.load_image(raw, reduce_for=reduce_for))
        assert out.shape[0] > out.shape[1]             # portrait once rotated
        top, bottom = out[5, out.shape[1] // 2], out[-5, out.shape[1] // 2]
        assert top[2] > 200 and bottom[0] > 200, (top, bottom)   # blue on top


def test_costs_are_known_before_decoding():
    small = P.decode_cost(1000, 1000, "RGB", False)
    assert small >= 1000 * 1000 * (4 + 4 + 6)     # pixels, conversion, crops' copies
    assert P.decode_cost(7000, 7000, "1", True) < P.decode_cost(7000, 7000, "RGB", True)
