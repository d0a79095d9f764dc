"""A model of the same family that the fixture is not: another config (grouped-query
attention, other widths, config.json listing only the changed fields), other weights, other
image sizes and modes, through photon-convert + Moondream.load + the API, end to end."""

import pytest

from photon_jax import Moondream
from photon_jax.cli.convert import main
from photon_jax.model.config import MoondreamConfig

from helpers import make_hf, odd_images, random_hf_tensors

CONFIG = {
    "text": {"dim": 256, "n_heads": 4, "n_kv_heads": 2, "n_layers": 3, "ff_dim": 192},
    "vision": {"enc_dim": 24, "enc_n_heads": 3, "enc_ff_dim": 40, "proj_out_dim": 256,
               "proj_inner_dim": 48, "max_crops": 6},
    "region": {"dim": 256, "inner_dim": 64},
}


@pytest.fixture(scope="module")
def md(fixture_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("holdout")
    cfg = MoondreamConfig.from_dict(CONFIG)
    hf = make_hf(fixture_dir, root, random_hf_tensors(cfg, seed=2024),
                 config={"model_type": "moondream1", "config": CONFIG})
    assert main([str(hf), str(root / "out")]) == 0          # default: bf16
    with Moondream.load(str(root / "out"), dtype="float32") as m:
        yield m


def test_config_and_dtype(md):
    c = md.config
    assert (c.text.n_heads, c.text.n_kv_heads, c.text.n_layers) == (4, 2, 3)
    assert c.vision.max_crops == 6 and c.dtype == "float32"


def test_every_skill_on_odd_images(md):
    greedy = {"temperature": 0, "max_tokens": 6}
    for img in odd_images():
        cap = md.caption(img, "short", settings=greedy)["caption"]
        assert isinstance(cap, str)
        ans = md.query(img, "w11 w12", settings=greedy)["answer"]
        assert isinstance(ans, str)
        for o in md.detect(img, "w7", settings={"max_objects": 3})["objects"]:
            assert set(o) == {"x_min", "y_min", "x_max", "y_max"}
            assert o["x_min"] <= o["x_max"] and o["y_min"] <= o["y_max"]
        pts = md.point(img, "w7", settings={"max_objects": 3})["points"]
        assert len(pts) <= 3
        for p in pts:
            assert 0 <= p["x"] < 1 and 0 <= p["y"] < 1


def test_grayscale_equals_its_rgb_conversion(md):
    img = odd_images()[-2]  # mode L
    greedy = {"temperature": 0, "max_tokens": 6}
    assert (md.caption(img, "normal", settings=greedy)
            == md.caption(img.convert("RGB"), "normal", settings=greedy))


def test_encoded_image_matches_direct_calls(md):
    img = odd_images()[3]
    enc = md.encode_image(img)
    s = {"temperature": 0.8, "top_p": 0.9, "max_tokens": 8, "seed": 11}
    assert md.query(enc, "w100", settings=s) == md.query(img, "w100", settings=s)
    assert md.detect(enc, "w3") == md.detect(img, "w3")
