"""Moondream 3 through the unchanged engine and API: pipelined == blocking == the one-request
reference path on randomized workloads (segment included), segment refused on Moondream 2,
and a hold-out-like Moondream 3 (other seed, expert count, top-k and layer split, a partial
config.json) through photon-convert + Moondream.load + every API method."""

import numpy as np
import pytest

from photon_jax import Moondream
from photon_jax.cli.convert import main
from photon_jax.engine import reference
from photon_jax.engine.core import Engine
from photon_jax.engine.request import Request
from photon_jax.engine.settings import Settings
from photon_jax.model.config import from_hf_config_json

from helpers import (ENGINE_IMAGES as IMAGES, MD3_FIXTURE_DIR, biased_model, make_hf, odd_images,
                     random_hf_tensors, reference_output, run_in_waves, strip, workload)

EOS_BIAS = 0.8


@pytest.fixture(scope="module")
def model(md3_ckpt):
    # EOS for varied lengths; coord / size ids (the fixture's head biases them by -10) so
    # segment emits boxes and feeds values back.
    return biased_model(md3_ckpt, {0: EOS_BIAS, 5: 17.0, 6: 16.0})


@pytest.fixture(scope="module")
def encoded(model):
    return [reference.encode_image(model, p) for p in IMAGES]


def segment_workload(model, encoded, seed, n):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = rng.integers(len(IMAGES))
        s = Settings(temperature=float(rng.choice([0.0, 0.9])), top_p=0.8,
                     seed=int(rng.integers(100)), max_tokens=int(rng.integers(2, 10)))
        req = Request("segment", model.prompts.segment(f"w{rng.integers(50, 900)}"),
                      IMAGES[k], s)
        r = reference.generate_segment(model, encoded[k], req.prompt, s)
        out.append((req, r))
    return out


def test_pipelined_equals_blocking_equals_reference(model, encoded):
    items = workload(model, encoded, 3, 5) + segment_workload(model, encoded, 4, 3)
    order = np.random.default_rng(5).permutation(len(items))
    items = [items[i] for i in order]
    reqs = [r for r, _ in items]
    outs = {}
    for pipelined in (True, False):
        eng = Engine(model, max_batch_size=2, max_context=1024, pipelined=pipelined)
        try:
            outs[pipelined] = run_in_waves(eng, reqs)
        finally:
            eng.close()
    boxes = 0
    for (req, want), got_p, got_b in zip(items, outs[True], outs[False]):
        assert strip(got_p) == strip(got_b), req.skill
        if req.skill == "segment":
            got = {k: got_p[k] for k in ("path", "bbox", "ids", "finish_reason")}
            assert got == want
            boxes += want["bbox"] is not None
        else:
            assert strip(got_p) == want, req.skill
    assert boxes, "the workload never produced a segment box"


def test_segment_is_moondream3_only(tiny_ckpt, model):
    with Moondream.load(tiny_ckpt, max_batch_size=1) as md2:
        with pytest.raises(ValueError, match="segment needs a Moondream 3 model"):
            md2.segment(IMAGES[1], "w42")
    # Moondream 3's prompt: the object without a leading space, after the template.
    assert model.prompts.segment("w42") == [1, 17374, 2, 42, 3]
    assert model.prompts.segment("w42", spatial=(5, 5)) == [1, 17374, 2, 5, 5, 42, 3]


# -- hold-out-like Moondream 3 ------------------------------------------------------------

HOLDOUT = {
    "text": {"dim": 128, "n_heads": 2, "n_kv_heads": 2, "n_layers": 3, "ff_dim": 160,
             "max_context": 1024,
             "moe": {"num_experts": 6, "start_layer": 1, "experts_per_token": 3,
                     "expert_inner_dim": 48}},
    "vision": {"enc_dim": 24, "enc_n_heads": 3, "enc_ff_dim": 40, "enc_n_layers": 3,
               "proj_out_dim": 128, "proj_inner_dim": 48, "max_crops": 4},
    "region": {"dim": 128},
}


@pytest.fixture(scope="module")
def holdout(tmp_path_factory):
    root = tmp_path_factory.mktemp("md3-holdout")
    cfg_json = {"model_type": "moondream3", "config": HOLDOUT}
    cfg = from_hf_config_json(cfg_json)
    tensors = random_hf_tensors(cfg, seed=77)
    hf = make_hf(MD3_FIXTURE_DIR, root, tensors, config=cfg_json)
    assert main([str(hf), str(root / "out")]) == 0
    with Moondream.load(str(root / "out"), dtype="float32", max_batch_size=4) as m:
        yield m


def test_holdout_config(holdout):
    t = holdout.config.text
    assert holdout.config.family == "moondream3" and t.tau and t.rope_theta == 1.5e6
    assert (t.n_dense, t.n_moe, t.moe.num_experts, t.moe.experts_per_token) == (1, 2, 6, 3)
    assert holdout.config.region.decoder_arch == "linear"


def test_holdout_every_skill_matches_the_reference(holdout):
    m = holdout._m
    greedy = Settings(temperature=0.0, max_tokens=6)
    for img in (odd_images()[2], odd_images()[4]):
        enc = reference.encode_image(m, img)
        got = holdout.caption(img, "short", settings={"temperature": 0, "max_tokens": 6})
        want = reference.generate_text(m, enc, m.prompts.caption("short"), greedy)
        assert got == {"caption": want["text"]}
        got = holdout.query(img, "w11 w12", settings={"temperature": 0, "max_tokens": 6})
        want = reference.generate_text(m, enc, m.prompts.query("w11 w12"), greedy)
        assert got == {"answer": want["text"]}
        for skill, key in (("detect", "objects"), ("point", "points")):
            got = getattr(holdout, skill)(img, "w7", settings={"max_objects": 2})
            want = reference_output(m, [enc], Request(skill, getattr(m.prompts, skill)("w7"),
                                                      enc, Settings(max_objects=2)))
            assert got == {key: want["objects"]}
        got = holdout.segment(img, "w7", settings={"temperature": 0, "max_tokens": 5})
        want = reference.generate_segment(m, enc, m.prompts.segment("w7"),
                                          Settings(temperature=0.0, max_tokens=5))
        assert got == {"path": want["path"], "bbox": want["bbox"]}


def test_md3_weights_under_a_plain_config_json_are_read_as_md3(tmp_path):
    """The family also comes from the tensors: with no model_type and no Moondream 3 keys in
    config.json, tau / region.ln tensors still mean Moondream 3 (here with the default layer
    split, which leaves these 4 layers dense)."""
    plain = {"text": {k: v for k, v in HOLDOUT["text"].items() if k != "moe"},
             "vision": HOLDOUT["vision"], "region": HOLDOUT["region"]}
    plain["text"]["n_layers"] = 4
    cfg = from_hf_config_json({"config": plain}, md3=True)
    assert cfg.family == "moondream3" and cfg.text.n_moe == 0
    assert from_hf_config_json({"config": plain}).family == "moondream2"
    hf = make_hf(MD3_FIXTURE_DIR, tmp_path, random_hf_tensors(cfg, seed=1), config={"config": plain})
    assert main([str(hf), str(tmp_path / "out")]) == 0
    from photon_jax.model.checkpoint import read_config

    assert read_config(str(tmp_path / "out")) == cfg


def test_fp8_experts_without_their_scales_are_refused_clearly(tmp_path, capsys):
    # FP8 experts load with their per-row scales (tests/test_quantized.py); codes alone
    # cannot be dequantized, and the error names the tensor and the scale it lacks.
    import ml_dtypes

    cfg = from_hf_config_json({"model_type": "moondream3", "config": HOLDOUT})
    tensors = random_hf_tensors(cfg, seed=2)
    name = "model.text.blocks.1.mlp.fc1.weight"
    tensors[name] = tensors[name].astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    hf = make_hf(MD3_FIXTURE_DIR, tmp_path, tensors,
                 config={"model_type": "moondream3", "config": HOLDOUT})
    assert main([str(hf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "float8" in err and name in err and "moe_quant.up_scale" in err
