"""Moondream 2's 4-bit layers whose groups run over a row's end load as the reference computes
them.

The public reference's `QuantizedLinear` (vikhyat/moondream `moondream/torch/layers.py`;
docs/quantized-formats.md section 2) cuts the row-major [out, in] weight into FLAT groups of
128 values, so where 128 does not divide `in` a group holds the end of one row and the start
of the next under one scale and zero point.  These tests store such layers (in = 96 and 192)
in the reference's layout with numpy, dequantize them here straight from that description
(`reference_weight`, which shares no code with photon_jax), and check what photon_jax makes
of them: the converter's entry for one layer (its repacked int4 parts, its float values, a
product through the int4 linear), and a whole tiny checkpoint converted and loaded.  What
cannot be loaded is refused by the layer's name.
"""

import json
import math
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import md2_int4_fixture as F
from quantized_checkpoints import read_safetensors, write_safetensors

from photon_jax.convert import convert, quantized
from photon_jax.convert.safetensors_io import read_header
from photon_jax.model import layers, quant
from photon_jax.model.loaded import Model



def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def reference_weight(packed, scale, zero, out, inn):
    """The reference's `dequantize_tensor`, one flat group at a time: group r's codes are the
    high nibbles of packed row r, group r + G/2's the low nibbles of packed row r; the codes
    sit in a bfloat16 buffer, `sub_(zero)` then `mul_(scale)` each round to bfloat16; the
    G x 128 values, read in order, are the row-major [out, in] weight."""
    n_groups = scale.shape[0]
    flat = np.empty(n_groups * 128, np.float32)
    for r in range(n_groups):
        row = packed[r] >> 4 if r < n_groups // 2 else packed[r - n_groups // 2] & 15
        t = _bf16(row.astype(np.float32) - np.float32(zero[r, 0]))
        flat[128 * r:128 * (r + 1)] = _bf16(t * np.float32(scale[r, 0]))
    return flat.reshape(out, inn)


def test_reference_weight_is_what_the_torch_reference_computed():
    # Anchors the transcription: on the 4-bit fixture (in = 256) it gives, bit for bit, the
    # weight the reference itself dequantized (tests/fixtures/moondream2-int4/golden.npz,
    # made with torch by make_golden.py).
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "moondream2-int4")
    with open(os.path.join(fixture, "golden.json")) as f:
        seed = json.load(f)["checkpoint"]["seed"]
    golden = np.load(os.path.join(fixture, "golden.npz"))
    t = F.build_tensors(seed)
    name = "text.blocks.0.mlp.fc2.weight"
    stored = [t[f"model.{name}.{part}"] for part in ("packed", "scale", "zero_point")]
    np.testing.assert_array_equal(reference_weight(*stored, *golden[name].shape), golden[name])


def _store_layer(tmp_path, name, out, inn, seed):
    """One [out, in] layer in the reference's layout, in a .safetensors file: (refs, arrays)."""
    w = np.random.default_rng(seed).normal(size=(out, inn)).astype(np.float32)
    packed, scale, zero = F.quantize_int4(w)
    path = tmp_path / "model.safetensors"
    save_file({name + ".packed": packed, name + ".scale": scale, name + ".zero_point": zero},
              str(path))
    return read_header(path), (packed, scale, zero)


@pytest.mark.parametrize("out,inn", [(40, 96), (24, 192)])
def test_a_layer_whose_groups_run_over_row_ends_loads_as_the_reference(tmp_path, out, inn):
    name = "model.text.blocks.0.mlp.fc2.weight"
    refs, (packed, scale, zero) = _store_layer(tmp_path, name, out, inn, seed=inn)
    want = reference_weight(packed, scale, zero, out, inn)
    # the groups really straddle rows: some group's first and last values lie in two rows
    assert any(128 * r // inn != (128 * r + 127) // inn for r in range(scale.shape[0]))

    grouped, found = quantized.group(refs, n_heads=1)
    assert found == ["int4"]
    layer = grouped[name].resolve((out, inn))
    parts = layer.read_quant()
    g = math.gcd(128, inn)                    # 32 at in = 96, 64 at in = 192
    assert parts["q4"].shape == (inn // 2, out)
    assert parts["s4"].shape == parts["z4"].shape == (inn // g, out)
    # value for value, on the host and in a program, and as float32 where the leaf is float
    np.testing.assert_array_equal(quant.dequantize(parts, np.float32, xp=np).T, want)
    dev = {k: jnp.asarray(v) for k, v in parts.items()}
    np.testing.assert_array_equal(np.asarray(quant.dequantize(dev, jnp.float32)).T, want)
    np.testing.assert_array_equal(layer.read_float(), want)

    # a product through the int4 linear is the product with the reference's weight
    x = np.random.default_rng(1).normal(size=(5, inn)).astype(np.float32)
    b = np.linspace(-1, 1, out, dtype=np.float32)
    y = layers.linear(jnp.asarray(x), {"w": dev, "b": jnp.asarray(b)})
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ want.T + b,
                               rtol=1e-5, atol=1e-4)


def test_what_the_int4_layout_cannot_hold_is_refused_by_name(tmp_path):
    name = "model.region.coord_decoder.fc2.weight"
    # an odd input dimension: photon_jax packs two input rows per byte
    with pytest.raises(quantized.QuantizedLayoutError,
                       match=r"region\.coord_decoder\.fc2\.weight.*even input dimension.*95"):
        quantized.Md2Pending("region.coord_decoder.fc2.weight", 760, ()).resolve((1024, 95))
    # groups that are not the layer's size
    with pytest.raises(quantized.QuantizedLayoutError, match=r"fc2\.weight: 30 groups.*\[40, 64\]"):
        quantized.Md2Pending("text.blocks.0.mlp.fc2.weight", 30, ()).resolve((40, 64))
    # an odd number of groups: the packed rows hold two groups each
    save_file({name + ".packed": np.zeros((1, 128), np.uint8),
               name + ".scale": np.ones((3, 1), np.float32),
               name + ".zero_point": np.zeros((3, 1), np.float32)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(quantized.QuantizedLayoutError,
                       match=r"coord_decoder\.fc2\.weight\.packed.*even number G"):
        quantized.group(read_header(tmp_path / "m.safetensors"), n_heads=1)


def test_converted_checkpoint_with_row_end_groups_holds_the_references_weights(tmp_path,
                                                                               monkeypatch):
    # The 4-bit tiny Moondream 2 with ff_dim 192 (each text fc2 is [128, 192]: g = 64) and a
    # 4-bit region model of inner_dim 96 (each decoder fc2 is [out, 96]: g = 32), through
    # photon-convert and Model.load.
    monkeypatch.setitem(F.TEXT, "ff_dim", 192)
    monkeypatch.setitem(F.REGION, "inner_dim", 96)
    monkeypatch.setitem(F.REGION, "group_size", 128)
    hf = tmp_path / "hf"
    F.write_md2_int4(hf)
    t = read_safetensors(str(hf / "model.safetensors"))
    region = [n for n in t if n.startswith("model.region.") and n.endswith(".weight")
              and "features" not in n]
    assert len(region) == 6
    for n in region:
        packed, scale, zero = F.quantize_int4(t.pop(n).astype(np.float32))
        t[n + ".packed"], t[n + ".scale"], t[n + ".zero_point"] = packed, scale, zero
    write_safetensors(str(hf / "model.safetensors"), t)
    assert json.loads((hf / "config.json").read_text())["config"]["region"]["inner_dim"] == 96

    ckpt = str(tmp_path / "ckpt")
    c = convert(str(hf), ckpt, dtype="float32", log=lambda s: None)
    assert c.weights.linear == "int4" and c.weights.region == "int4"
    params = Model.load(ckpt).params
    leaves = {  # stored name -> (the leaf, its [out, in])
        "model.text.blocks.1.mlp.fc2.weight": (params["text"]["blocks"][1]["fc2"]["w"], (128, 192)),
        "model.text.blocks.0.mlp.fc1.weight": (params["text"]["blocks"][0]["fc1"]["w"], (192, 128)),
        "model.region.coord_decoder.fc2.weight":
            (params["region"]["coord_decoder"]["fc2"]["w"], (1024, 96)),
        "model.region.size_decoder.fc2.weight":
            (params["region"]["size_decoder"]["fc2"]["w"], (2048, 96)),
        "model.region.size_decoder.fc1.weight":
            (params["region"]["size_decoder"]["fc1"]["w"], (96, 128)),
    }
    for name, (w, (out, inn)) in leaves.items():
        assert set(w) == {"q4", "s4", "z4"}, name
        assert w["s4"].shape == (inn // math.gcd(128, inn), out), name
        want = reference_weight(t[name + ".packed"], t[name + ".scale"],
                                t[name + ".zero_point"], out, inn)
        np.testing.assert_array_equal(np.asarray(quant.dequantize(w, jnp.float32)).T, want,
                                      err_msg=name)
