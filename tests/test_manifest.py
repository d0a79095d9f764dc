"""The full-size Moondream 2 checkpoint's tensor list (tests/fixtures/moondream2-manifest.json)
against our parameter tree at the default config, without allocating any weights."""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
import pytest

from photon_jax.convert import ConvertError, names
from photon_jax.convert.convert import plan
from photon_jax.convert.safetensors_io import TensorRef
from photon_jax.model.config import moondream2
from photon_jax.model.params import count_params, flatten, init_params

MANIFEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                        "moondream2-manifest.json")


@pytest.fixture(scope="module")
def manifest():
    with open(MANIFEST) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def cfg():
    return moondream2()


@pytest.fixture(scope="module")
def abstract(cfg):
    tree = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), cfg))
    return tree, flatten(tree)


def test_abstract_tree_is_not_allocated(abstract, cfg):
    tree, flat = abstract
    for leaf in flat.values():
        assert isinstance(leaf, jax.ShapeDtypeStruct)
        assert leaf.dtype == jax.numpy.bfloat16
    # spot checks of the real model's dimensions
    assert flat[("text", "wte")].shape == (51200, 2048)
    assert flat[("text", "blocks", "qkv", "w")].shape == (24, 2048, 6144)
    assert flat[("vision", "blocks", "fc1", "w")].shape == (27, 1152, 4304)
    assert flat[("vision", "pos_emb")].shape == (729, 1152)
    assert flat[("vision", "proj_mlp", "fc1", "w")].shape == (2304, 8192)
    assert flat[("region", "coord_features")].shape == (1, 128)


def test_manifest_totals(manifest, abstract):
    tensors = manifest["tensors"]
    assert manifest["n_tensors"] == len(tensors) == 592
    assert len({t["name"] for t in tensors}) == 592
    total = sum(math.prod(t["shape"]) for t in tensors)
    assert manifest["n_params"] == total == 1_927_237_104
    assert count_params(abstract[0]) == 1_927_237_104


def test_every_manifest_tensor_fits_the_tree(manifest, abstract, cfg):
    _, flat = abstract
    table = names.hf_table(cfg)
    covered: dict = {}
    for t in manifest["tensors"]:
        hf, transposed = names.canonical_name(t["name"])
        assert not transposed
        tgt = table.get(hf)
        assert tgt is not None, f"{t['name']} has no place in the tree"
        assert tgt.path in flat, (t["name"], tgt.path)
        full = flat[tgt.path].shape
        one = full[1:] if tgt.layer is not None else full
        if tgt.layer is not None:
            assert 0 <= tgt.layer < full[0], t["name"]
        want = names.stored_shape(one, tgt, transposed)
        assert list(want) == t["shape"], (t["name"], want, t["shape"])
        slot = (tgt.path, tgt.layer)
        assert slot not in covered, f"{t['name']} and {covered[slot]} fill the same slot"
        covered[slot] = t["name"]
    want_slots = set()
    for path, leaf in flat.items():
        if "blocks" in path:
            want_slots |= {(path, i) for i in range(leaf.shape[0])}
        else:
            want_slots.add((path, None))
    assert set(covered) == want_slots
    assert len(table) == 592


def test_manifest_layout_by_hand(manifest):
    """A few shapes of the real checkpoint as published (torch [out, in])."""
    shapes = {t["name"]: tuple(t["shape"]) for t in manifest["tensors"]}
    assert shapes["model.text.blocks.23.attn.qkv.weight"] == (6144, 2048)
    assert shapes["model.text.lm_head.weight"] == (51200, 2048)
    assert shapes["model.vision.pos_emb"] == (1, 729, 1152)
    assert shapes["model.vision.blocks.26.mlp.fc1.weight"] == (4304, 1152)
    assert shapes["model.region.size_features"] == (2, 256)
    assert sum(n.startswith("model.text.blocks.") for n in shapes) == 24 * 10
    assert sum(n.startswith("model.vision.blocks.") for n in shapes) == 27 * 12


def _refs(manifest, rename=lambda n: n):
    out = {}
    for t in manifest["tensors"]:
        shape = tuple(t["shape"])
        name = rename(t["name"])
        out[name] = TensorRef(name=name, file="/nonexistent/model.safetensors", dtype=t["dtype"],
                              shape=shape, start=0, nbytes=2 * math.prod(shape))
    return out


def test_plan_accepts_manifest_without_reading_data(manifest, cfg, monkeypatch):
    import importlib

    convert_mod = importlib.import_module("photon_jax.convert.convert")
    sio = importlib.import_module("photon_jax.convert.safetensors_io")

    def no_reads(*a, **k):
        raise AssertionError("plan() must not read tensor data")

    monkeypatch.setattr(convert_mod, "read_tensor", no_reads)
    monkeypatch.setattr(sio, "read_tensor", no_reads)
    monkeypatch.setattr("builtins.open", no_reads)
    refs = _refs(manifest)
    work = plan(cfg, refs)
    monkeypatch.undo()
    assert len(work) == 592
    assert {ref.name for ref, _, _ in work} == set(refs)
    by_name = {ref.name: (tgt, tr) for ref, tgt, tr in work}
    tgt, tr = by_name["model.text.blocks.5.attn.qkv.weight"]
    assert (tgt.path, tgt.layer, tgt.transform, tr) == (("text", "blocks", "qkv", "w"), 5, "T",
                                                        False)
    tgt, _ = by_name["model.vision.pos_emb"]
    assert tgt.transform == "squeeze0"


def test_plan_accepts_manifest_without_model_prefix(manifest, cfg):
    work = plan(cfg, _refs(manifest, lambda n: n[len("model."):]))
    assert len(work) == 592


def test_plan_rejects_manifest_mistakes(manifest, cfg):
    refs = _refs(manifest)
    missing = dict(refs)
    del missing["model.text.blocks.23.mlp.fc2.bias"]
    with pytest.raises(ConvertError, match=r"1 missing tensor\(s\): text.blocks.23.mlp.fc2.bias"):
        plan(cfg, missing)
    wrong = dict(refs)
    r = refs["model.vision.blocks.0.attn.qkv.weight"]
    wrong[r.name] = TensorRef(r.name, r.file, r.dtype, (1152, 3456), r.start, r.nbytes)
    with pytest.raises(ConvertError, match=r"stored \[1152, 3456\], expected \[3456, 1152\]"):
        plan(cfg, wrong)
    fp8 = dict(refs)
    r = refs["model.text.wte"]
    fp8[r.name] = TensorRef(r.name, r.file, "F8_E4M3", r.shape, r.start, r.nbytes // 2)
    with pytest.raises(ConvertError, match="model.text.wte: F8_E4M3"):
        plan(cfg, fp8)
    # the full-size tensor list does not fit the tiny config
    from photon_jax.model.config import tiny

    with pytest.raises(ConvertError, match="wrong shape"):
        plan(tiny(), refs)


def test_abstract_tree_matches_param_count_in_bytes(abstract):
    # 1.93e9 bf16 parameters: ~3.6 GiB, which eval_shape never allocated
    tree, flat = abstract
    nbytes = sum(np.prod(v.shape) * v.dtype.itemsize for v in flat.values())
    assert nbytes == 2 * 1_927_237_104
