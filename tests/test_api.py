"""The public API on the converted fixture model: results equal the reference's, every input
kind works, bad input gets a clear error, calls are thread-safe."""

import inspect
import os
import threading

import numpy as np
import pytest
from PIL import Image

from photon_jax import Moondream
from photon_jax.api import BatchError
from photon_jax.convert.adapters import AdapterError
from photon_jax.engine.request import RequestError
from photon_jax.engine.settings import SettingsError
from photon_jax.model.checkpoint import CheckpointError
from photon_jax.model.pixels import ImageError, load_image

from helpers import FIXTURE_DIR

LAND = os.path.join(FIXTURE_DIR, "img_land800x600.png")
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def md(tiny_ckpt):
    with Moondream.load(tiny_ckpt) as m:
        yield m


@pytest.fixture(scope="module")
def ref(cases):
    return cases["fp32"]["land800x600"]["cases"]


def test_outputs_match_reference(md, ref, cases):
    q, obj = cases["settings"]["query"], cases["settings"]["object"]
    for length in ("short", "normal", "long"):
        assert md.caption(LAND, length, settings=GREEDY) == {
            "caption": ref[f"caption_{length}"]["text"]}
    assert md.query(LAND, q, settings=GREEDY) == {"answer": ref["query"]["text"]}
    det = md.detect(LAND, obj, settings={"max_objects": 5})
    assert list(det) == ["objects"] and len(det["objects"]) == len(ref["detect"]["result"])
    for a, b in zip(det["objects"], ref["detect"]["result"]):
        assert set(a) == {"x_min", "y_min", "x_max", "y_max"}
        assert all(abs(a[k] - b[k]) < 1e-6 for k in a)
    pts = md.point(LAND, obj, settings={"max_objects": 5})
    assert pts == {"points": ref["point"]["result"]}


def test_image_kinds_agree(md):
    pil = Image.open(LAND)
    arr = np.asarray(pil.convert("RGB"))
    outs = [md.caption(x, "short", settings=GREEDY)["caption"]
            for x in (LAND, pil, arr, md.encode_image(LAND))]
    assert len(set(outs)) == 1


def test_encoded_image_reuse(md, ref):
    enc = md.encode_image(LAND)
    assert enc.key in md.engine.sched.cache.entries and not enc.released   # pinned in the pool
    a = md.caption(enc, "normal", settings=GREEDY)["caption"]
    b = md.caption(enc, "normal", settings=GREEDY)["caption"]
    assert a == b == ref["caption_normal"]["text"]


def test_return_metrics_adds_how_each_result_ended(md, ref, cases):
    """Opt-in "metrics": the same result otherwise; finish reason, token counts, the
    prefix-cache hit of a repeated image, time to first token, decode rate."""
    img = os.path.join(FIXTURE_DIR, "img_photo512x600.png")   # not cached by other tests
    first = md.caption(img, "short", settings=GREEDY, return_metrics=True)
    again = md.caption(img, "short", settings=GREEDY, return_metrics=True)
    plain = md.caption(img, "short", settings=GREEDY)
    assert {k: v for k, v in first.items() if k != "metrics"} == plain
    m, m2 = first["metrics"], again["metrics"]
    assert set(m) == {"finish_reason", "input_tokens", "output_tokens", "prefix_cache_hit",
                      "cached_tokens", "time_to_first_token_s", "decode_tokens_per_s"}
    assert (m["cached_tokens"], m2["cached_tokens"]) == (0, md.config.prefix_len)
    prompt = md.engine.model.prompts.caption("short")
    assert m["input_tokens"] == md.config.prefix_len + len(prompt)
    assert m["finish_reason"] in ("stop", "length") and 0 < m["output_tokens"] <= 12
    assert (m["finish_reason"] == "length") == (m["output_tokens"] == 12)
    assert (m["prefix_cache_hit"], m2["prefix_cache_hit"]) == (False, True)
    assert m["time_to_first_token_s"] > 0
    assert m["output_tokens"] < 2 or m["decode_tokens_per_s"] > 0
    # every method, lists included; text-only queries have no image prefix to hit
    q = md.query(None, "Hello?", settings=GREEDY, return_metrics=True)["metrics"]
    assert q["prefix_cache_hit"] is None and q["input_tokens"] > 0
    pts = md.point([LAND, LAND], "w7", settings={"max_objects": 2}, return_metrics=True)
    assert all(p["metrics"]["finish_reason"] in ("stop", "max_objects") for p in pts)
    with pytest.raises(ValueError, match="return_metrics needs stream=False"):
        md.caption(img, stream=True, return_metrics=True)


def test_streaming_joins_to_the_same_text(md, ref):
    out = md.caption(LAND, "normal", stream=True, settings=GREEDY)["caption"]
    pieces = list(out)
    assert len(pieces) > 1
    assert "".join(pieces) == ref["caption_normal"]["text"]


def test_sampling_is_seeded(md):
    s = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}
    a = md.query(LAND, "w5 w6", settings={**s, "seed": 1})["answer"]
    b = md.query(LAND, "w5 w6", settings={**s, "seed": 1})["answer"]
    others = {md.query(LAND, "w5 w6", settings={**s, "seed": k})["answer"] for k in range(2, 8)}
    assert a == b
    assert others - {a}, "other seeds should give other samples"


def test_text_only_query(md):
    out = md.query(None, "w100 w200", settings=GREEDY)
    assert isinstance(out["answer"], str)
    with pytest.raises(ValueError, match="question"):
        md.query(LAND, None)


def test_keyword_only_signatures():
    for name, positional in (("caption", ["image", "length"]), ("query", ["image", "question"]),
                             ("detect", ["image", "object"]), ("point", ["image", "object"])):
        sig = inspect.signature(getattr(Moondream, name))
        params = [p for p in sig.parameters.values() if p.name != "self"]
        pos = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert pos == positional, name
        assert all(p.kind == p.KEYWORD_ONLY for p in params[len(pos):]), name


@pytest.mark.parametrize("settings,match", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_objects": 0}, "max_objects"),
    ({"temprature": 0.1}, "unknown settings key"),
])
def test_bad_settings(md, settings, match):
    with pytest.raises(SettingsError, match=match):
        md.caption(LAND, settings=settings)


def test_an_unknown_variant_is_refused_by_name_and_changes_nothing(md, monkeypatch, tmp_path):
    """A model loaded with no adapter options takes variants (its slots come on first
    need, tests/test_lora.py); one that is not loaded and cannot be found offline is
    refused by name before anything runs, and no slot tables are made for it."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AdapterError, match="variant 'abc' is not loaded.*HF_HUB_OFFLINE"):
        md.caption(LAND, "short", settings={"variant": "abc", **GREEDY})
    assert md.engine.lora is None and md.adapters == []


def test_bad_inputs(md, tmp_path):
    with pytest.raises(ValueError, match="length"):
        md.caption(LAND, "medium")
    with pytest.raises(ImageError, match="not found"):
        md.caption(str(tmp_path / "nope.png"))
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(ImageError, match="not an image in an accepted format"):
        md.caption(str(bad))
    with pytest.raises(ImageError, match="uint8"):
        md.caption(np.zeros((10, 10, 3), np.float32))
    with pytest.raises(ImageError, match="unsupported image type"):
        md.caption(12345)
    with pytest.raises(ValueError, match="object"):
        md.detect(LAND, "")
    for call in (lambda: md.caption(None), lambda: md.start(None, question="w1")):
        with pytest.raises(ValueError, match="image is required; pass a path"):
            call()
    with pytest.raises(ValueError, match="question"):
        md.start(LAND, question=" ")


def test_load_rejects_garbage(tmp_path):
    # (A Hugging Face snapshot folder now loads: tests/test_sources.py.)
    with pytest.raises(ValueError, match="not found"):
        Moondream.load(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="not a photon_jax checkpoint"):
        Moondream.load(tmp_path)


def test_threads_get_the_same_answers(md, ref):
    results, errors = [], []

    def work(i):
        try:
            if i % 2:
                results.append(("c", md.caption(LAND, "normal", settings=GREEDY)["caption"]))
            else:
                results.append(("p", md.point(LAND, "w42", settings={"max_objects": 5})))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert len(results) == 6
    for kind, out in results:
        if kind == "c":
            assert out == ref["caption_normal"]["text"]
        else:
            assert out == {"points": ref["point"]["result"]}


def test_dtype_override_and_close(tiny_ckpt):
    md = Moondream.load(tiny_ckpt, dtype="bfloat16", device=0)
    assert md.config.dtype == "bfloat16"
    out = md.caption(LAND, "short", settings=GREEDY)
    assert isinstance(out["caption"], str)
    md.close()
    with pytest.raises(RuntimeError, match="closed"):
        md.caption(LAND)


# -- image loading --------------------------------------------------------------------


def test_image_modes_and_exif(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 255, (20, 30, 3), np.uint8)
    for mode in ("RGBA", "P", "L", "CMYK"):
        im = Image.fromarray(rgb).convert(mode)
        out = load_image(im)
        assert out.mode == "RGB" and out.size == (30, 20)
    # EXIF orientation 6 (rotate 90 CW to display): a 30x20 stored image displays as 20x30.
    p = tmp_path / "rot.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(rgb).save(p, exif=exif)
    assert load_image(str(p)).size == (20, 30)
    with pytest.raises(ImageError, match="empty"):
        load_image(np.zeros((0, 5, 3), np.uint8))
    gif = tmp_path / "anim.gif"
    frames = [Image.fromarray(np.full((8, 8, 3), v, np.uint8)) for v in (10, 200)]
    frames[0].save(gif, save_all=True, append_images=frames[1:])
    first = np.asarray(load_image(str(gif)))
    assert abs(int(first[0, 0, 0]) - 10) < 8


# -- lists and the engine ----------------------------------------------------------------


def test_lists_run_as_one_batch_in_input_order(md, ref, tmp_path):
    imgs = [os.path.join(FIXTURE_DIR, f) for f in
            ("img_land800x600.png", "img_sq378.png", "img_land800x600.png")]
    singles = [md.caption(p, "normal", settings=GREEDY) for p in imgs]
    assert md.caption(imgs, "normal", settings=GREEDY) == singles
    assert singles[0] == {"caption": ref["caption_normal"]["text"]}
    qs = ["w5 w6", "w7", "w8 w9"]
    answers = md.query(imgs, qs, settings=GREEDY)
    assert answers == [md.query(p, q, settings=GREEDY) for p, q in zip(imgs, qs)]
    # The three requests run together: a decode step holds all three rows.  (Encoded
    # images, so that no request waits on an image decode: on a loaded machine the third
    # image's decode can outlast the first two requests' few tokens.)
    encs = [md.encode_image(p) for p in imgs]
    before = len(md.engine.step_log())
    assert md.query(encs, qs, settings=GREEDY) == answers
    steps = md.engine.step_log()[before:]
    assert max(s["rows"] for s in steps if s["kind"] in ("decode", "burst")) == 3
    for e in encs:
        e.release()
    pts = md.point(imgs[:2], "w42", settings={"max_objects": 5})
    assert pts[0] == {"points": ref["point"]["result"]}
    assert len(md.detect(imgs[:2], ["w1", "w2"])) == 2
    assert md.query(None, ["w1", "w2"], settings=GREEDY) == [
        md.query(None, q, settings=GREEDY) for q in ("w1", "w2")]


def test_list_with_a_bad_item_raises_after_the_rest(md, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"junk")
    with pytest.raises(BatchError, match="1 of 3 items failed") as e:
        md.caption([LAND, str(bad), LAND], "short", settings=GREEDY)
    assert e.value.results[0] == e.value.results[2] == md.caption(LAND, "short",
                                                                  settings=GREEDY)
    assert e.value.results[1] is None and isinstance(e.value.errors[1], ImageError)
    with pytest.raises(ValueError, match="2 images but 3"):
        md.query([LAND, LAND], ["a", "b", "c"])
    with pytest.raises(ValueError, match="stream=True"):
        md.caption([LAND, LAND], stream=True)


def test_blocking_twin_gives_the_same_results(tiny_ckpt, md):
    with Moondream.load(tiny_ckpt, pipelined=False, max_batch_size=2) as slow:
        assert not slow.engine.pipelined
        for call in (lambda m: m.caption([LAND, LAND], "long", settings=GREEDY),
                     lambda m: m.detect(LAND, "w3", settings={"max_objects": 3}),
                     lambda m: m.query(LAND, "w9", settings={"temperature": 1.0, "seed": 4,
                                                             "max_tokens": 9})):
            assert call(slow) == call(md)


def test_more_bad_inputs_fail_only_their_call(md, tmp_path):
    with pytest.raises(ValueError, match="question must be a non-empty string"):
        md.query(LAND, "  ")
    # A 20000 x 20000 PNG: only its header is read before it is refused.
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    huge = tmp_path / "huge.png"
    huge.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000,
                                                                     8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\x00" * 100)) + chunk(b"IEND", b""))
    with pytest.raises(ImageError, match="too large"):
        md.caption(str(huge))
    for mode in ("CMYK", "P", "RGBA", "I;16"):
        im = Image.new(mode, (40, 30))
        assert isinstance(md.caption(im if mode != "I;16" else np.asarray(
            load_image(_png_bytes(im))), "short", settings=GREEDY)["caption"], str)
    assert md.caption(LAND, "short", settings=GREEDY) == md.caption(
        LAND, "short", settings=GREEDY)   # the engine kept serving after all of that


def _png_bytes(im):
    import io

    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def test_interrupted_call_cancels_its_requests(md, ref, monkeypatch):
    # Ctrl-C while a call waits (simulated: result() raises KeyboardInterrupt) must cancel
    # the call's requests, not leave them decoding in the background.
    from photon_jax.engine import core as engine_mod

    real_result, real_submit_many = engine_mod.Handle.result, md.engine.submit_many
    seen = []

    def spy(reqs):
        seen.extend(real_submit_many(reqs))
        return seen[-len(reqs):]

    def interrupted(self, timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(md.engine, "submit_many", spy)
    monkeypatch.setattr(engine_mod.Handle, "result", interrupted)
    long = {"max_tokens": 200}
    with pytest.raises(KeyboardInterrupt):
        md.caption([LAND, LAND, LAND], "long", settings=long)
    with pytest.raises(KeyboardInterrupt):
        md.query(LAND, "w5", settings=long)
    monkeypatch.setattr(engine_mod.Handle, "result", real_result)
    assert len(seen) == 4
    assert [h.result(timeout=120)["finish_reason"] for h in seen] == ["cancelled"] * 4
    # The rows were released: the next call runs normally.
    assert md.caption(LAND, "normal", settings=GREEDY) == {
        "caption": ref["caption_normal"]["text"]}


def test_attention_can_be_chosen_at_load(tiny_ckpt, md):
    """`Moondream.load(..., attention="xla")`, as the README offers it: the XLA formulation
    gives the same results, and the load-time memory plan is the engine's (arenas)."""
    with Moondream.load(tiny_ckpt, attention="xla", max_batch_size=2) as xla:
        assert xla.engine.model.attention == "xla" and xla.engine.sweep
        assert xla.caption(LAND, "short", settings=GREEDY) == md.caption(LAND, "short",
                                                                         settings=GREEDY)
    with pytest.raises(ValueError, match="attention must be one of"):
        Moondream.load(tiny_ckpt, attention="flash")
