"""Reasoning, spatial refs, repeat_stop, progress and the image loader: the engine against the
one-request reference path, and the API's shapes and errors.

Reasoning uses the fixture model with biases on the answer, coord and grounding ids, so that
reasoning traces contain grounding chunks and coordinates and end in every possible way
(answer id sampled, answer id forced at max_tokens)."""

import io
import os

import numpy as np
import pytest
from PIL import Image

from photon_jax import Moondream
from photon_jax.api import BatchError
from photon_jax.engine import constraints, reference, skills
from photon_jax.engine.core import Engine
from photon_jax.engine.request import Request
from photon_jax.engine.settings import parse, Settings, SettingsError
from photon_jax.model.pixels import ImageError, load_image
from photon_jax.model.tokenizer import spatial_refs_prompt

from helpers import FIXTURE_DIR, biased_model

LAND = os.path.join(FIXTURE_DIR, "img_land800x600.png")
SQ = os.path.join(FIXTURE_DIR, "img_sq378.png")


# The fixture's LM head biases special ids to -10 (and EOS up): lift coord (5) and the
# grounding ids (7, 9) so reasoning mixes words, chunks and coordinates.  Set "natural" keeps
# the answer id likely (reasoning often ends by itself); set "capped" makes it impossible, so
# reasoning always runs into max_tokens and the answer id is forced.
BIASES = {"natural": {5: 15.5, 7: 13.0, 9: 13.0},
          "capped": {3: -30.0, 5: 15.5, 7: 13.0, 9: 13.0}}


@pytest.fixture(scope="module", params=sorted(BIASES))
def rmodel(tiny_ckpt, request):
    return biased_model(tiny_ckpt, BIASES[request.param])


@pytest.fixture(scope="module")
def enc(rmodel):
    return [reference.encode_image(rmodel, p) for p in (LAND, SQ)]


def reasoning_cases(model, enc):
    tok = model.cfg.tokenizer
    rng = np.random.default_rng(11)
    cases = []
    for i in range(10):
        refs = [[0.2, 0.3], [0.1, 0.1, 0.5, 0.7]][: i % 3] or None
        spatial, region = spatial_refs_prompt(refs, tok) if refs else ((), None)
        prompt = model.prompts.query(f"w{rng.integers(20, 900)} w4", spatial=spatial,
                                     reasoning=i % 4 != 3)
        hot = i % 2 == 0
        s = Settings(temperature=0.6 if hot else 0.0, top_p=0.9, seed=i,
                     max_tokens=int(rng.integers(3, 12)))
        cases.append(Request("text", prompt, enc[i % 2], s, region=region,
                             reasoning=i % 4 != 3))
    return cases


def test_reasoning_and_spatial_refs_match_the_reference(rmodel, enc):
    reqs = reasoning_cases(rmodel, enc)
    want = [reference.generate_text(rmodel, r.image, r.prompt, r.settings, region=r.region,
                                    reasoning=r.reasoning) for r in reqs]
    grounded = [w for w in want if w.get("reasoning", {}).get("grounding")]
    assert grounded, "the biased model should ground some reasoning"
    assert any(w["reasoning"]["text"] for w in grounded), "and mix text with grounding"
    for pipelined in (True, False):
        eng = Engine(rmodel, max_batch_size=3, pipelined=pipelined)
        try:
            got = [h.result(timeout=300) for h in [eng.submit(r) for r in reqs]]
        finally:
            eng.close()
        for g, w in zip(got, want):
            g = {k: v for k, v in g.items() if k != "output_tokens"}
            assert g == w


def test_spatial_refs_change_the_prompt_embedding(rmodel, enc):
    s = Settings(temperature=0, max_tokens=8)
    pr = rmodel.prompts
    sp, region = spatial_refs_prompt([[0.1, 0.1, 0.9, 0.4]], rmodel.cfg.tokenizer)
    assert sp == [5, 5, 6] and region == [(0.5, 0.0), (0.25, 0.0), (0.8, pytest.approx(0.3))]
    logits = []
    for reg in (region, region, [(0.9, 0.0), (0.9, 0.0), (0.1, 0.1)]):
        trace = {}
        reference.generate_text(rmodel, enc[0], pr.query("w5", spatial=sp), s, trace=trace,
                                region=reg)
        logits.append(np.array(trace["prefill_logits"]))
    # The values are embedded: same refs give the same logits, other refs other logits.
    assert np.array_equal(logits[0], logits[1]) and not np.allclose(logits[0], logits[2])


def test_reasoning_skill_forces_the_answer_id_at_the_budget():
    r = skills.ReasoningSkill(max_tokens=2, prompt_end=10, max_context=100, eos_id=0,
                              answer_id=3, coord_id=5, chunk_ids=(7, 9),
                              decode=lambda ids: "".join(f"w{i} " for i in ids if i > 9))
    assert r.constraint(0) == constraints.REASON_FIRST and r.constraint(1) == constraints.REASON
    assert r.allowed(1) is None and r.allowed(2) == [3]
    assert r.consume(7, (0, 0)) is None and r.consume(5, (0.25, 0)) is None
    assert r.consume(3, (0, 0)) is None      # the forced answer id: the answer starts at 3
    assert r.constraint(3) == constraints.FREE and r.constraint(4) == constraints.BAN_ANSWER
    assert r.consume(42, (0, 0)) is None and r.consume(43, (0, 0)) == "length"
    out = r.result("length")
    assert out["text"] == "w42 w43 " and out["reasoning"] == {"text": "", "grounding": []}


def test_repeat_stop():
    assert skills.repeats([1, 2, 3, 2, 3, 2, 3], 3)
    assert not skills.repeats([1, 2, 3, 2, 3, 2, 4], 3)
    assert skills.repeats([7, 7, 7, 7], 4) and not skills.repeats([7, 7, 7], 4)
    t = skills.TextSkill(max_tokens=50, prompt_end=0, max_context=100, eos_id=0,
                         decode=lambda ids: "", repeat_stop=3)
    outs = [t.consume(x, None) for x in [4, 5, 6, 5, 6, 5, 6, 8]]
    assert outs == [None] * 6 + ["repeat", None]
    with pytest.raises(SettingsError, match="repeat_stop"):
        parse({"repeat_stop": 1})
    assert parse({"repeat_stop": 4}).repeat_stop == 4 and parse({}).repeat_stop is None


@pytest.fixture(scope="module")
def md(tiny_ckpt):
    with Moondream.load(tiny_ckpt, max_batch_size=4) as m:
        yield m


def test_api_reasoning_shapes_and_streaming(md):
    s = {"temperature": 0, "max_tokens": 6}
    out = md.query(LAND, "w5 w6", reasoning=True, settings=s)
    assert set(out) == {"reasoning", "answer"}
    assert set(out["reasoning"]) == {"text", "grounding"}
    streamed = md.query(LAND, "w5 w6", reasoning=True, stream=True, settings=s)
    assert streamed["reasoning"] == out["reasoning"]
    assert "".join(streamed["answer"]) == out["answer"]
    assert set(md.query(None, "w5", reasoning=True, settings=s)) == {"reasoning", "answer"}
    with pytest.raises(ValueError, match="spatial_refs"):
        md.query(LAND, "w5", spatial_refs=[[0.5, 1.5]])
    with pytest.raises(ValueError, match="need an image"):
        md.query(None, "w5", spatial_refs=[[0.5, 0.5]])
    refs = md.query(LAND, "w5", spatial_refs=[[0.5, 0.5], [0.1, 0.2, 0.3, 0.4]], settings=s)
    assert isinstance(refs["answer"], str)


def test_api_repeat_stop_and_progress(md):
    s = {"temperature": 0, "max_tokens": 60}
    full = md.engine.submit(Request("text", md._m.prompts.caption("normal"), LAND,
                                    Settings(temperature=0, max_tokens=60))).result()
    cut = md.engine.submit(Request("text", md._m.prompts.caption("normal"), LAND,
                                   Settings(temperature=0, max_tokens=60, repeat_stop=2))
                           ).result()
    # The tiny model's greedy caption of this image loops; repeat_stop ends it early.
    assert cut["finish_reason"] == "repeat" and len(cut["ids"]) < len(full["ids"])
    assert cut["ids"] == full["ids"][:len(cut["ids"])]
    outs = md.caption([LAND, SQ], "short", settings=s, progress=True)
    assert len(outs) == 2


def test_image_loader_bytes_16bit_and_limits(tmp_path, monkeypatch):
    raw = open(LAND, "rb").read()
    assert np.array_equal(np.asarray(load_image(raw)), np.asarray(load_image(LAND)))
    grey = np.array([[0, 32768, 65535]], np.uint16).repeat(4, 0)
    buf = io.BytesIO()
    Image.fromarray(grey).save(buf, format="PNG")
    out = np.asarray(load_image(buf.getvalue()))
    assert out.shape == (4, 3, 3) and out[0, :, 0].tolist() == [0, 128, 255]
    with pytest.raises(ImageError, match="cannot read image"):
        load_image(raw[: len(raw) // 2])      # truncated
    with pytest.raises(ImageError, match="empty \\(0 bytes\\)"):
        load_image(b"")
    monkeypatch.setattr("photon_jax.model.pixels.MAX_PIXELS", 1000)
    with pytest.raises(ImageError, match="too large"):
        load_image(LAND)


def test_list_of_bytes_and_a_bad_item(md):
    raw = open(LAND, "rb").read()
    s = {"temperature": 0, "max_tokens": 5}
    with pytest.raises(BatchError) as e:
        md.caption([raw, b"garbage", LAND], "short", settings=s)
    r = e.value.results
    assert r[0] == r[2] and r[1] is None and isinstance(e.value.errors[1], ImageError)
