"""photon-convert: a Hugging Face Moondream 2 snapshot -> a photon_jax checkpoint directory.

Inputs are built from the tiny fixture (tests/fixtures/moondream2-tiny): its folder is copied
into tmp_path and its model.safetensors rewritten (renamed, resharded, recast, broken).  The
expected placement of every tensor is derived here independently of convert/names.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

import photon_jax.model.checkpoint as checkpoint
from photon_jax.cli.convert import main
from photon_jax.convert import convert, ConvertError
from photon_jax.model.config import FORMAT_VERSION, tiny
from photon_jax.model.params import flatten

from helpers import BAD_SNAPSHOTS, BF16, make_hf, read_safetensors, write_safetensors

# -- helpers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def src(fixture_dir):
    """The fixture's tensors (bf16 numpy arrays), in file order."""
    return read_safetensors(os.path.join(fixture_dir, "model.safetensors"))


def restore(path) -> dict:
    """{tree path tuple: numpy array} of a converted checkpoint, in its own dtype."""
    cfg = checkpoint.read_config(str(path))
    tree = checkpoint.restore_params(str(path), cfg)
    return {k: np.asarray(v) for k, v in flatten(tree).items()}


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert np.array_equal(bits(a[k]), bits(b[k])), f"{k} differs"


_NORMS = {"ln", "ln1", "ln2", "post_ln"}


def expected_place(hf_name: str):
    """Independent model of the HF layout: name -> (tree path, layer or None, transform)."""
    n = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
    parts = n.split(".")
    layer = None
    if "blocks" in parts:
        i = parts.index("blocks")
        layer = int(parts.pop(i + 1))
    parts = [p for p in parts if p not in ("attn", "mlp")]
    if parts[-1] in ("weight", "bias"):
        leaf = "w" if parts[-1] == "weight" else "b"
        module = parts[-2]
        transform = "T" if leaf == "w" and module not in _NORMS else "id"
        return (*parts[:-1], leaf), layer, transform
    if parts == ["vision", "pos_emb"]:
        return tuple(parts), layer, "squeeze0"
    return tuple(parts), layer, "id"  # wte, coord_features, size_features


def place(arr, transform):
    if transform == "T":
        return arr.T
    if transform == "squeeze0":
        assert arr.shape[0] == 1
        return arr[0]
    return arr


def hf_to_training(n: str) -> tuple[str, bool]:
    """HF name (without `model.`) -> (training-format name, stored transposed?), by hand."""
    p = n.split(".")
    vis = "vision_encoder.encoder.model.visual"
    if n == "vision.pos_emb":
        return f"{vis}.pos_embed", False
    if p[:2] == ["vision", "patch_emb"]:
        return f"{vis}.patch_embed.linear.{p[2]}", False
    if p[:2] == ["vision", "blocks"]:
        i, rest = p[2], p[3:]
        if rest[0] in ("ln1", "ln2"):
            rest = ["norm" + rest[0][-1], *rest[1:]]
        return f"{vis}.blocks.{i}." + ".".join(rest), False
    if p[:2] == ["vision", "post_ln"]:
        return f"{vis}.norm.{p[2]}", False
    if p[:2] == ["vision", "proj_mlp"]:
        return "vision_encoder.projection.mlp." + ".".join(p[2:]), False
    if n == "text.wte":
        return "text_model.transformer.embd.wte.weight", False
    if p[:2] == ["text", "blocks"]:
        i, rest = p[2], ".".join(p[3:])
        rest = rest.replace("attn.qkv", "mixer.Wqkv").replace("attn.proj", "mixer.out_proj")
        return f"text_model.transformer.h.{i}.{rest}", False
    if p[:2] == ["text", "post_ln"]:
        return f"text_model.lm_head.ln.{p[2]}", False
    if p[:2] == ["text", "lm_head"]:
        return f"text_model.lm_head.linear.{p[2]}", False
    if n == "region.coord_features":
        return "region_model.coordinate_features.weight", True
    if n == "region.size_features":
        return "region_model.size_features.weight", True
    region = {"coord_encoder": "coordinate_encoder", "size_encoder": "size_encoder",
              "coord_decoder": "coordinate_decoder", "size_decoder": "size_decoder"}
    if p[0] == "region" and p[1] in region:
        return "region_model." + ".".join([region[p[1]], *p[2:]]), False
    raise AssertionError(f"no training name for {n}")


def no_leftovers(parent) -> None:
    left = [e for e in os.listdir(parent) if e.startswith(".photon-convert-")]
    assert not left, f"temporary directories left behind: {left}"


# -- the fixture converts, with the documented layout ----------------------------------------


@pytest.fixture(scope="module")
def cli_out(fixture_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "out"
    rc = main([fixture_dir, str(out), "--dtype", "float32"])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def ref_params(cli_out):
    return restore(cli_out)


def test_cli_writes_checkpoint_directory(cli_out, fixture_dir):
    assert sorted(os.listdir(cli_out)) == ["config.json", "params", "provenance.json",
                                           "tokenizer.json"]
    assert os.path.isdir(cli_out / "params") and os.listdir(cli_out / "params")
    with open(cli_out / "config.json") as f:
        meta = json.load(f)
    assert meta["format_version"] == FORMAT_VERSION
    # The nested "config" of the HF config.json was applied: the tiny model, not the default.
    assert checkpoint.read_config(str(cli_out)) == tiny("float32")
    with open(cli_out / "tokenizer.json", "rb") as a, \
            open(os.path.join(fixture_dir, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()
    no_leftovers(cli_out.parent)


def test_provenance(cli_out, fixture_dir, src):
    with open(cli_out / "provenance.json") as f:
        prov = json.load(f)

    def sha(name):
        with open(os.path.join(fixture_dir, name), "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()

    assert prov["source_sha256"] == {"model.safetensors": sha("model.safetensors"),
                                     "config.json": sha("config.json")}
    assert prov["tokenizer_sha256"] == sha("tokenizer.json")
    assert prov["dtype"] == "float32"
    assert isinstance(prov["converter_version"], str) and prov["converter_version"]
    assert prov["n_tensors"] == len(src) == 372
    assert prov["n_params"] == sum(a.size for a in src.values()) == 4_883_408


def test_sampled_tensors_hand_checked(ref_params, src):
    p = ref_params
    f32 = np.float32
    qkv1 = src["model.text.blocks.1.attn.qkv.weight"]
    assert qkv1.shape == (192, 64)  # (n_heads + 2 kv heads) * 64 rows, torch [out, in]
    assert p[("text", "blocks", "qkv", "w")].shape == (2, 64, 192)
    np.testing.assert_array_equal(p[("text", "blocks", "qkv", "w")][1], qkv1.T.astype(f32))
    np.testing.assert_array_equal(p[("text", "blocks", "qkv", "b")][0],
                                  src["model.text.blocks.0.attn.qkv.bias"].astype(f32))
    pos = src["model.vision.pos_emb"]
    assert pos.shape == (1, 729, 16)
    assert p[("vision", "pos_emb")].shape == (729, 16)
    np.testing.assert_array_equal(p[("vision", "pos_emb")], pos[0].astype(f32))
    cf = src["model.region.coord_features"]
    assert cf.shape == (1, 128) and p[("region", "coord_features")].shape == (1, 128)
    np.testing.assert_array_equal(p[("region", "coord_features")], cf.astype(f32))
    assert p[("region", "size_features")].shape == (2, 256)
    np.testing.assert_array_equal(p[("region", "size_features")],
                                  src["model.region.size_features"].astype(f32))
    np.testing.assert_array_equal(p[("text", "wte")], src["model.text.wte"].astype(f32))
    np.testing.assert_array_equal(p[("text", "lm_head", "w")],
                                  src["model.text.lm_head.weight"].T.astype(f32))
    # Norms are not transposed; a vision block's layer index selects the stacked row.
    np.testing.assert_array_equal(p[("vision", "blocks", "ln2", "w")][26],
                                  src["model.vision.blocks.26.ln2.weight"].astype(f32))
    np.testing.assert_array_equal(p[("vision", "blocks", "fc2", "w")][13],
                                  src["model.vision.blocks.13.mlp.fc2.weight"].T.astype(f32))
    np.testing.assert_array_equal(p[("vision", "proj_mlp", "fc1", "w")],
                                  src["model.vision.proj_mlp.fc1.weight"].T.astype(f32))
    np.testing.assert_array_equal(p[("text", "post_ln", "b")],
                                  src["model.text.post_ln.bias"].astype(f32))


def test_every_tensor_lands_once(ref_params, src):
    covered = {}
    for name, arr in src.items():
        path, layer, transform = expected_place(name)
        assert path in ref_params, (name, path)
        leaf = ref_params[path]
        got = leaf if layer is None else leaf[layer]
        want = place(arr, transform).astype(np.float32)
        assert got.shape == want.shape, name
        assert np.array_equal(bits(got), bits(want)), name
        assert (path, layer) not in covered, (name, covered.get((path, layer)))
        covered[(path, layer)] = name
    # ... and every leaf (every layer of a stacked leaf) was filled by some tensor.
    want_slots = set()
    for path, leaf in ref_params.items():
        if "blocks" in path:
            want_slots |= {(path, i) for i in range(leaf.shape[0])}
        else:
            want_slots.add((path, None))
    assert set(covered) == want_slots


def test_bfloat16_output_is_exact_for_bf16_source(tiny_ckpt_bf16, ref_params):
    p16 = restore(tiny_ckpt_bf16)
    assert checkpoint.read_config(tiny_ckpt_bf16) == tiny("bfloat16")
    assert p16.keys() == ref_params.keys()
    for k, a in p16.items():
        assert a.dtype == BF16, k
        assert np.array_equal(bits(a), bits(ref_params[k].astype(BF16))), k


def test_photon_jax_loader_refuses_hf_dir(fixture_dir, tmp_path, src):
    with pytest.raises(checkpoint.CheckpointError, match="photon-convert"):
        checkpoint.read_config(fixture_dir)
    # a sharded snapshot too
    d = make_hf(fixture_dir, tmp_path, {})
    os.remove(d / "model.safetensors")
    write_safetensors(d / "model-00001-of-00001.safetensors", src)
    with open(d / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {n: "model-00001-of-00001.safetensors" for n in src}}, f)
    with pytest.raises(checkpoint.CheckpointError, match="photon-convert") as e:
        checkpoint.read_config(str(d))
    assert "Hugging Face" in str(e.value)


# -- other key schemes, shards and storage dtypes give the same params ----------------------


def _convert_quiet(hf, out, **kw):
    kw.setdefault("dtype", "float32")
    return convert(str(hf), str(out), log=lambda s: None, **kw)


def _training_name(hf_name: str, orig_mod: bool) -> tuple[str, bool]:
    name, transposed = hf_to_training(hf_name[len("model."):])
    if orig_mod:
        head, rest = name.split(".", 1)
        name = f"{head}._orig_mod.{rest}"
    return name, transposed


@pytest.mark.parametrize("scheme", ["no_prefix", "training", "training_orig_mod",
                                    "orig_mod_prefix"])
def test_key_schemes_give_identical_params(scheme, src, fixture_dir, tmp_path, ref_params):
    renamed = {}
    for name, arr in src.items():
        if scheme == "no_prefix":
            renamed[name[len("model."):]] = arr
        elif scheme == "orig_mod_prefix":
            renamed["_orig_mod." + name] = arr
        else:
            new, transposed = _training_name(name, scheme == "training_orig_mod")
            renamed[new] = np.ascontiguousarray(arr.T) if transposed else arr
    assert len(renamed) == len(src)
    if scheme.startswith("training"):
        mid = "._orig_mod" if scheme == "training_orig_mod" else ""
        assert renamed[f"region_model{mid}.coordinate_features.weight"].shape == (128, 1)
        assert renamed[f"region_model{mid}.size_features.weight"].shape == (256, 2)
        assert not any(n.startswith(("model.", "vision.", "text.", "region.")) for n in renamed)
    if scheme == "training_orig_mod":
        assert "text_model._orig_mod.transformer.h.0.mixer.Wqkv.weight" in renamed
    hf = make_hf(fixture_dir, tmp_path, renamed)
    _convert_quiet(hf, tmp_path / "out")
    assert_same_params(restore(tmp_path / "out"), ref_params)


def test_duplicate_names_across_schemes_are_refused(src, fixture_dir, tmp_path):
    t = dict(src)
    t["text_model.transformer.embd.wte.weight"] = src["model.text.wte"]
    hf = make_hf(fixture_dir, tmp_path, t)
    with pytest.raises(ConvertError) as e:
        _convert_quiet(hf, tmp_path / "out")
    assert "text_model.transformer.embd.wte.weight" in str(e.value)
    assert "model.text.wte" in str(e.value)
    assert not os.path.exists(tmp_path / "out")


def test_sharded_checkpoint(src, fixture_dir, tmp_path, ref_params):
    hf = make_hf(fixture_dir, tmp_path, {})
    os.remove(hf / "model.safetensors")
    names = list(src)
    # interleave so that both shards hold pieces of every part of the model
    shards = {"model-00001-of-00002.safetensors": names[0::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, ns in shards.items():
        write_safetensors(hf / fname, {n: src[n] for n in ns})
        weight_map.update({n: fname for n in ns})
    with open(hf / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    _convert_quiet(hf, tmp_path / "out")
    assert_same_params(restore(tmp_path / "out"), ref_params)
    with open(tmp_path / "out" / "provenance.json") as f:
        prov = json.load(f)
    for fname in shards:
        with open(hf / fname, "rb") as fh:
            assert prov["source_sha256"][fname] == hashlib.sha256(fh.read()).hexdigest()


def test_f32_source_is_bit_identical(src, fixture_dir, tmp_path, ref_params):
    hf = make_hf(fixture_dir, tmp_path, {n: a.astype(np.float32) for n, a in src.items()})
    _convert_quiet(hf, tmp_path / "out")
    assert_same_params(restore(tmp_path / "out"), ref_params)


def test_f16_and_f32_sources_mixed(src, fixture_dir, tmp_path):
    rng = np.random.default_rng(0)
    t = dict(src)
    # values that bf16 cannot hold exactly: the bf16 output must round to nearest even
    wf32 = rng.standard_normal(src["model.text.blocks.0.mlp.fc1.weight"].shape).astype(np.float32)
    wf16 = rng.standard_normal(src["model.vision.blocks.3.attn.proj.weight"].shape).astype(np.float16)
    bf16 = rng.standard_normal(src["model.text.lm_head.bias"].shape).astype(np.float16)
    t["model.text.blocks.0.mlp.fc1.weight"] = wf32
    t["model.vision.blocks.3.attn.proj.weight"] = wf16
    t["model.text.lm_head.bias"] = bf16
    assert not np.array_equal(wf32.astype(BF16).astype(np.float32), wf32)
    hf = make_hf(fixture_dir, tmp_path, t)
    for dt, npdt in (("float32", np.float32), ("bfloat16", BF16)):
        out = tmp_path / f"out-{dt}"
        _convert_quiet(hf, out, dtype=dt)
        p = restore(out)
        np.testing.assert_array_equal(bits(p[("text", "blocks", "fc1", "w")][0]),
                                      bits(wf32.T.astype(npdt)))
        np.testing.assert_array_equal(bits(p[("vision", "blocks", "proj", "w")][3]),
                                      bits(wf16.T.astype(np.float32).astype(npdt)))
        np.testing.assert_array_equal(bits(p[("text", "lm_head", "b")]),
                                      bits(bf16.astype(np.float32).astype(npdt)))
        # untouched bf16 tensors next to them
        np.testing.assert_array_equal(bits(p[("text", "wte")]),
                                      bits(src["model.text.wte"].astype(npdt)))


def test_external_tokenizer_option(src, fixture_dir, tmp_path):
    hf = make_hf(fixture_dir, tmp_path)
    os.remove(hf / "tokenizer.json")
    tok = tmp_path / "starmie" / "tokenizer.json"
    tok.parent.mkdir()
    shutil.copyfile(os.path.join(fixture_dir, "tokenizer.json"), tok)
    assert main([str(hf), str(tmp_path / "out"), "--tokenizer", str(tok)]) == 0
    with open(tmp_path / "out" / "tokenizer.json", "rb") as a, open(tok, "rb") as b:
        assert a.read() == b.read()
    with open(tmp_path / "out" / "provenance.json") as f:
        prov = json.load(f)
    assert prov["dtype"] == "bfloat16"  # the CLI default
    assert checkpoint.read_config(str(tmp_path / "out")).dtype == "bfloat16"


def test_existing_empty_out_dir_is_fine(fixture_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _convert_quiet(fixture_dir, out)
    assert os.path.isdir(out / "params")
    no_leftovers(tmp_path)


# -- bad input (helpers.BAD_SNAPSHOTS): a clear error, a non-zero exit, nothing written -----


@pytest.mark.parametrize("case", list(BAD_SNAPSHOTS))
def test_bad_input(case, src, fixture_dir, tmp_path, capsys):
    hf = make_hf(fixture_dir, tmp_path)
    words = BAD_SNAPSHOTS[case](src, hf, fixture_dir)
    parent = tmp_path / "outparent"
    parent.mkdir()
    out = parent / "out"
    with pytest.raises(ConvertError) as e:
        _convert_quiet(hf, out)
    msg = str(e.value)
    for w in words:
        assert w in msg, f"{w!r} not in error message: {msg}"
    assert not os.path.exists(out)
    assert os.listdir(parent) == []
    capsys.readouterr()
    rc = main([str(hf), str(out), "--dtype", "float32"])
    assert rc != 0
    err = capsys.readouterr().err
    assert "photon-convert: error:" in err
    for w in words:
        assert w in err
    assert not os.path.exists(out)
    assert os.listdir(parent) == []


def test_non_empty_out_dir_needs_overwrite(fixture_dir, tmp_path, capsys, ref_params):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(ConvertError, match="--overwrite") as e:
        _convert_quiet(fixture_dir, out)
    assert "not empty" in str(e.value)
    assert main([fixture_dir, str(out)]) != 0
    assert "not empty" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"
    no_leftovers(tmp_path)
    assert main([fixture_dir, str(out), "--overwrite", "--dtype", "float32"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "params", "provenance.json",
                                       "tokenizer.json"]
    assert_same_params(restore(out), ref_params)
    no_leftovers(tmp_path)


@pytest.mark.parametrize("where", ["same", "parent"])
def test_overwrite_never_deletes_the_input(fixture_dir, tmp_path, where):
    """`photon-convert DIR DIR --overwrite` (or OUT_DIR above HF_DIR) must be refused, not
    replace the Hugging Face snapshot by the converted checkpoint."""
    hf = make_hf(fixture_dir, tmp_path / "ckpts")
    out = hf if where == "same" else hf.parent
    before = sorted(os.listdir(hf))
    with pytest.raises(ConvertError) as e:
        _convert_quiet(hf, out, overwrite=True)
    assert str(hf) in str(e.value) or "input" in str(e.value)
    assert sorted(os.listdir(hf)) == before
    no_leftovers(out.parent)


def test_out_path_is_a_file(fixture_dir, tmp_path):
    out = tmp_path / "out"
    out.write_text("x")
    with pytest.raises(ConvertError, match="not a directory"):
        _convert_quiet(fixture_dir, out, overwrite=True)
    assert out.read_text() == "x"


def test_failure_while_writing_keeps_old_out_dir(fixture_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(checkpoint, "write_metadata", boom)
    with pytest.raises(OSError, match="simulated"):
        _convert_quiet(fixture_dir, out, overwrite=True)
    assert os.listdir(out) == ["keep.txt"]
    no_leftovers(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_bad_dtype_argument(fixture_dir, tmp_path):
    with pytest.raises(ConvertError, match="float16"):
        _convert_quiet(fixture_dir, tmp_path / "out", dtype="float16")
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(SystemExit) as e:
        main([fixture_dir, str(tmp_path / "out"), "--dtype", "float16"])
    assert e.value.code != 0


def test_missing_input_dir(tmp_path):
    with pytest.raises(ConvertError, match="not found"):
        _convert_quiet(tmp_path / "nope", tmp_path / "out")
    assert main([str(tmp_path / "nope"), str(tmp_path / "out")]) != 0
    assert os.listdir(tmp_path) == []


# -- a partial config.json: overrides on the defaults (grouped-query attention) ------------

PARTIAL = {
    "text": {"dim": 128, "n_heads": 2, "n_kv_heads": 1, "n_layers": 1, "ff_dim": 64,
             "vocab_size": 32768},
    "vision": {"enc_dim": 8, "enc_n_heads": 2, "enc_ff_dim": 16, "proj_out_dim": 128,
               "proj_inner_dim": 32},
    "region": {"dim": 128, "inner_dim": 32},
}

# Shapes written out by hand (torch layout), not derived from the library.
HAND_SHAPES = {
    "model.text.blocks.0.attn.qkv.weight": (256, 128),  # (2 q + 2 * 1 kv heads) * 64
    "model.text.blocks.0.attn.qkv.bias": (256,),
    "model.text.blocks.0.attn.proj.weight": (128, 128),
    "model.text.blocks.0.mlp.fc1.weight": (64, 128),
    "model.text.blocks.0.mlp.fc2.weight": (128, 64),
    "model.text.wte": (32768, 128),
    "model.text.lm_head.weight": (32768, 128),
    "model.vision.patch_emb.weight": (8, 588),
    "model.vision.pos_emb": (1, 729, 8),
    "model.vision.blocks.26.attn.qkv.weight": (24, 8),  # 27 vision layers: the default
    "model.vision.blocks.26.mlp.fc1.weight": (16, 8),
    "model.vision.proj_mlp.fc1.weight": (32, 16),
    "model.vision.proj_mlp.fc2.weight": (128, 32),
    "model.region.coord_features": (1, 128),
    "model.region.size_features": (2, 256),
    "model.region.coord_encoder.weight": (128, 256),
    "model.region.size_encoder.weight": (128, 512),
    "model.region.coord_decoder.fc1.weight": (32, 128),
    "model.region.coord_decoder.fc2.weight": (1024, 32),
    "model.region.size_decoder.fc2.weight": (2048, 32),
}


def test_partial_config_overrides_defaults_gqa(fixture_dir, tmp_path, src):
    from photon_jax.convert import names
    from photon_jax.model.config import MoondreamConfig

    cfg = MoondreamConfig.from_dict(PARTIAL)
    hf_shapes = names.hf_shapes(cfg)
    for n, s in HAND_SHAPES.items():
        assert hf_shapes[n] == s, n
    # The names are the fixture's (27 vision blocks) minus text block 1.
    assert set(hf_shapes) == {n for n in src if not n.startswith("model.text.blocks.1.")}
    assert len(hf_shapes) == 362

    rng = np.random.default_rng(1)
    tensors = {n: rng.standard_normal(s).astype(np.float32).astype(BF16)
               for n, s in hf_shapes.items()}
    hf_cfg = {"architectures": ["HfMoondream"], "config": PARTIAL, "model_type": "moondream1"}
    hf = make_hf(fixture_dir, tmp_path, tensors, config=hf_cfg)
    assert main([str(hf), str(tmp_path / "out"), "--dtype", "float32"]) == 0

    got = checkpoint.read_config(str(tmp_path / "out"))
    assert got.dtype == "float32"
    assert (got.text.dim, got.text.n_heads, got.text.n_kv_heads, got.text.n_layers) == (128, 2, 1, 1)
    assert got.text.qkv_dim == 256 and got.text.head_dim == 64
    # everything not listed keeps its default
    assert got.text.max_context == 2048 and got.text.prefix_attn == 730
    assert got.vision.enc_n_layers == 27 and got.vision.crop_size == 378
    assert got.region.coord_feat_dim == 256 and got.region.size_out_dim == 2048
    assert got.tokenizer.caption_normal == (1, 32708, 2, 6382, 3)

    p = restore(tmp_path / "out")
    f32 = np.float32
    assert p[("text", "blocks", "qkv", "w")].shape == (1, 128, 256)
    np.testing.assert_array_equal(p[("text", "blocks", "qkv", "w")][0],
                                  tensors["model.text.blocks.0.attn.qkv.weight"].T.astype(f32))
    np.testing.assert_array_equal(p[("vision", "pos_emb")],
                                  tensors["model.vision.pos_emb"][0].astype(f32))
    np.testing.assert_array_equal(p[("region", "size_decoder", "fc2", "w")],
                                  tensors["model.region.size_decoder.fc2.weight"].T.astype(f32))
    for name, arr in tensors.items():
        path, layer, transform = expected_place(name)
        got_arr = p[path] if layer is None else p[path][layer]
        assert np.array_equal(got_arr, place(arr, transform).astype(f32)), name


def test_partial_config_with_fixture_weights_is_refused(fixture_dir, tmp_path):
    # the fixture's weights (1 q head, 2 text layers) do not fit the GQA partial config
    hf = make_hf(fixture_dir, tmp_path, config={"config": PARTIAL})
    with pytest.raises(ConvertError) as e:
        _convert_quiet(hf, tmp_path / "out")
    msg = str(e.value)
    assert "wrong shape" in msg and "unexpected" in msg
    assert "model.text.blocks.1.attn.qkv.weight" in msg
    assert not os.path.exists(tmp_path / "out")
