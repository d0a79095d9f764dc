"""A tiny random-weights Moondream 2 in the layout of Moondream 2's 4-bit release.

`write_md2_int4(out_dir, seed=0)` writes `out_dir/model.safetensors`, `out_dir/config.json` and
`out_dir/tokenizer.json`: a Hugging Face snapshot like tests/fixtures/moondream2-tiny, except that
every text block's `attn.qkv`, `attn.proj`, `mlp.fc1` and `mlp.fc2` is stored the way the public
reference's `QuantizedLinear` (vikhyat/moondream `moondream/torch/layers.py` at 44146f1) loads it
(docs/quantized-formats.md section 2):

  X.weight.packed      uint8   [out*in/256, 128]
  X.weight.scale       float32 [out*in/128, 1]
  X.weight.zero_point  float32 [out*in/128, 1]
  X.bias               bfloat16 [out]

The flattened row-major [out, in] weight is cut into G = out*in/128 groups of 128 adjacent
values; packed row r holds group r in its high nibble and group r + G/2 in its low nibble, which
is exactly what the reference's `dequantize_tensor` undoes
(`W_r[:G/2] = packed >> 4; W_r[G/2:] = packed & 15; W_r.sub_(zero).mul_(scale)`).
Quantization is asymmetric min/max per group: scale = (max - min) / 15,
zero_point = -min / scale (a float, not rounded), codes = clip(rint(w / scale + zero), 0, 15),
all in float32.  Every other tensor is bfloat16, named as in the tiny fixture.  The region model
is not quantized (`config.region.group_size` is null), as the reference allows.

Configuration: text dim 128 (2 heads of 64, 2 KV heads), ff_dim 256, 2 layers, vocab 32768, so
every quantized `in` (128, 256) is a multiple of 128; vision as in the tiny fixture (16 wide,
27 layers) but projecting to 128; region dim 128 (= text dim), inner 128.

Weights are drawn like the tiny fixture's (its README, "How the weights were drawn"): for every
parameter, named as in the reference state dict without `model.`, `z` = standard normals from
`np.random.default_rng([seed, zlib.crc32(name)])` (float64, C order), scaled per kind of tensor.
The output is bit-for-bit deterministic for a given seed (tests/fixtures/moondream2-int4/
golden.json records the sha256 of model.safetensors for seed 0).

Pure numpy + ml_dtypes + safetensors: runs in the project venv and in a torch venv alike.
tests/fixtures/moondream2-int4/make_golden.py runs the reference on the checkpoint this writes.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import zlib

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "fixtures", "moondream2-tiny")

GROUP = 128   # the reference hard-codes it; config.text.group_size only switches quantization on
QUANTIZED = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")   # per text block

TEXT = {"dim": 128, "ff_dim": 256, "n_layers": 2, "vocab_size": 32768, "max_context": 2048,
        "n_heads": 2, "n_kv_heads": 2, "prefix_attn": 730, "group_size": GROUP}
VISION = {"enc_dim": 16, "enc_patch_size": 14, "enc_n_layers": 27, "enc_ff_dim": 32,
          "enc_n_heads": 2, "proj_out_dim": 128, "crop_size": 378, "in_channels": 3,
          "max_crops": 12, "overlap_margin": 4, "proj_inner_dim": 128}
REGION = {"dim": 128, "coord_feat_dim": 256, "coord_out_dim": 1024, "size_feat_dim": 512,
          "size_out_dim": 2048, "inner_dim": 128, "group_size": None}


def config_json() -> dict:
    """config.json in the HF repo's schema (the tiny fixture's, with this model's sizes)."""
    with open(os.path.join(TINY, "config.json")) as f:
        cfg = json.load(f)
    cfg = copy.deepcopy(cfg)
    cfg["config"]["text"] = dict(TEXT)
    cfg["config"]["vision"] = dict(VISION)
    cfg["config"]["region"] = dict(REGION)
    return cfg


# -- the 4-bit layout ---------------------------------------------------------------------------

def quantize_int4(w: np.ndarray):
    """[out, in] weight -> (packed uint8 [G/2, 128], scale f32 [G, 1], zero_point f32 [G, 1]).
    The groups are flat, as the reference's are: where `in` is not a multiple of 128 a group
    runs over a row's end, so only out*in must be a multiple of 256 (an even G)."""
    out, inn = w.shape
    if (out * inn) % (2 * GROUP):
        raise ValueError(f"cannot pack a [{out}, {inn}] weight in an even number of groups of "
                         f"{GROUP}")
    g = np.asarray(w, np.float32).reshape(-1, GROUP)   # group k = values 128k .. 128k+127
    lo = g.min(axis=1, keepdims=True)
    hi = g.max(axis=1, keepdims=True)
    scale = (hi - lo) / np.float32(15)
    zero = -lo / scale
    q = np.clip(np.rint(g / scale + zero), 0, 15).astype(np.uint8)
    half = q.shape[0] // 2
    packed = (q[:half] << 4) | q[half:]   # high nibble: group r, low nibble: group r + G/2
    return packed, scale.astype(np.float32), zero.astype(np.float32)


def unpack_codes(packed: np.ndarray, shape) -> np.ndarray:
    """The 4-bit codes as uint8 [out, in], in the reference's order."""
    return np.concatenate([packed >> 4, packed & 15]).reshape(shape)


def dequantize_reference(packed, scale, zero, shape) -> np.ndarray:
    """The reference's `dequantize_tensor` emulated in numpy: codes into a bf16 buffer, then
    `sub_(zero)` and `mul_(scale)` in place, each computed in float32 and rounded to bf16.
    Returns the bf16 values as float32 [out, in]."""
    bf16 = ml_dtypes.bfloat16
    q = np.concatenate([packed >> 4, packed & 15]).astype(np.float32)
    t = (q - np.asarray(zero, np.float32)).astype(bf16).astype(np.float32)
    w = (t * np.asarray(scale, np.float32)).astype(bf16).astype(np.float32)
    return w.reshape(shape)


# -- the weights --------------------------------------------------------------------------------

def _shapes() -> dict:
    """Reference state-dict name (no `model.`) -> shape, as stored in the HF snapshot.  The
    quantized weights are listed as their [out, in] dense shape."""
    t, v, r = TEXT, VISION, REGION
    s = {}
    e, p = v["enc_dim"], v["enc_patch_size"]
    s["vision.patch_emb.weight"] = (e, p * p * v["in_channels"])
    s["vision.patch_emb.bias"] = (e,)
    s["vision.pos_emb"] = (1, (v["crop_size"] // p) ** 2, e)
    for i in range(v["enc_n_layers"]):
        b = f"vision.blocks.{i}."
        s[b + "ln1.weight"] = s[b + "ln1.bias"] = (e,)
        s[b + "attn.qkv.weight"], s[b + "attn.qkv.bias"] = (3 * e, e), (3 * e,)
        s[b + "attn.proj.weight"], s[b + "attn.proj.bias"] = (e, e), (e,)
        s[b + "ln2.weight"] = s[b + "ln2.bias"] = (e,)
        s[b + "mlp.fc1.weight"], s[b + "mlp.fc1.bias"] = (v["enc_ff_dim"], e), (v["enc_ff_dim"],)
        s[b + "mlp.fc2.weight"], s[b + "mlp.fc2.bias"] = (e, v["enc_ff_dim"]), (e,)
    s["vision.post_ln.weight"] = s["vision.post_ln.bias"] = (e,)
    s["vision.proj_mlp.fc1.weight"] = (v["proj_inner_dim"], 2 * e)
    s["vision.proj_mlp.fc1.bias"] = (v["proj_inner_dim"],)
    s["vision.proj_mlp.fc2.weight"] = (v["proj_out_dim"], v["proj_inner_dim"])
    s["vision.proj_mlp.fc2.bias"] = (v["proj_out_dim"],)

    d, qkv = t["dim"], int(t["dim"] * (1 + 2 * t["n_kv_heads"] / t["n_heads"]))
    s["text.wte"] = (t["vocab_size"], d)
    for i in range(t["n_layers"]):
        b = f"text.blocks.{i}."
        s[b + "ln.weight"] = s[b + "ln.bias"] = (d,)
        s[b + "attn.qkv.weight"], s[b + "attn.qkv.bias"] = (qkv, d), (qkv,)
        s[b + "attn.proj.weight"], s[b + "attn.proj.bias"] = (d, d), (d,)
        s[b + "mlp.fc1.weight"], s[b + "mlp.fc1.bias"] = (t["ff_dim"], d), (t["ff_dim"],)
        s[b + "mlp.fc2.weight"], s[b + "mlp.fc2.bias"] = (d, t["ff_dim"]), (d,)
    s["text.post_ln.weight"] = s["text.post_ln.bias"] = (d,)
    s["text.lm_head.weight"], s["text.lm_head.bias"] = (t["vocab_size"], d), (t["vocab_size"],)

    rd, ri = r["dim"], r["inner_dim"]
    s["region.coord_encoder.weight"] = (rd, r["coord_feat_dim"])
    s["region.coord_encoder.bias"] = (rd,)
    s["region.coord_decoder.fc1.weight"], s["region.coord_decoder.fc1.bias"] = (ri, rd), (ri,)
    s["region.coord_decoder.fc2.weight"] = (r["coord_out_dim"], ri)
    s["region.coord_decoder.fc2.bias"] = (r["coord_out_dim"],)
    s["region.size_encoder.weight"] = (rd, r["size_feat_dim"])
    s["region.size_encoder.bias"] = (rd,)
    s["region.size_decoder.fc1.weight"], s["region.size_decoder.fc1.bias"] = (ri, rd), (ri,)
    s["region.size_decoder.fc2.weight"] = (r["size_out_dim"], ri)
    s["region.size_decoder.fc2.bias"] = (r["size_out_dim"],)
    s["region.coord_features"] = (1, r["coord_feat_dim"] // 2)
    s["region.size_features"] = (2, r["size_feat_dim"] // 2)
    return s


def _rank_prior(seed: int, name: str, n: int, top: float, slope: float) -> np.ndarray:
    """`top - slope * ln(rank)`, rank = 1 + a seeded permutation of 0..n-1 (a Zipf-like prior)."""
    rank = 1 + np.random.default_rng([seed, zlib.crc32((name + "#rank").encode())]).permutation(n)
    return top - slope * np.log(rank)


def _draw(seed: int, name: str, shape) -> np.ndarray:
    """The float64 value of one parameter (the tiny fixture's recipe)."""
    z = np.random.default_rng([seed, zlib.crc32(name.encode())]).standard_normal(shape)
    leaf = name.rsplit(".", 1)[-1]
    if ".ln" in name or "post_ln" in name:
        return 1 + 0.2 * z if leaf == "weight" else 0.1 * z
    if name == "text.wte":
        return 0.7 * z
    if name == "vision.pos_emb":
        return 0.5 * z
    if name in ("region.coord_features", "region.size_features"):
        return 2.0 * z
    if leaf == "weight":   # a linear [out, in]
        w = z / np.sqrt(shape[1])
        if name.endswith("attn.qkv.weight"):
            n_qk = 2 * shape[1] if name.startswith("text.") else 2 * shape[0] // 3
            w[:n_qk] *= 1.6 if name.startswith("text.") else 1.4
        elif name.endswith("attn.proj.weight"):
            w *= 1.5
        elif name.endswith("fc2.weight"):
            w -= w.mean(axis=1, keepdims=True)
        elif name == "text.lm_head.weight":
            w[[0, 3]] *= 0.5
        return w
    b = 0.05 * z   # a bias
    if name == "text.lm_head.bias":
        n = shape[0]
        b[10:] += _rank_prior(seed, name, n - 10, 3.5, 0.3)
        b[[1, 2, 4, 5, 6, 7, 8, 9]] = -10.0
        b[0], b[3] = 5.0, 5.3
    elif name == "region.coord_decoder.fc2.bias":
        b += _rank_prior(seed, name, shape[0], 3.0, 1.0)
    elif name == "region.size_decoder.fc2.bias":
        half = shape[0] // 2
        b[:half] += _rank_prior(seed, name + "#w", half, 3.0, 1.0)
        b[half:] += _rank_prior(seed, name + "#h", half, 3.0, 1.0)
    return b


def is_quantized(name: str) -> bool:
    """`name` (reference state-dict name, no `model.`) is a quantized layer's dense weight."""
    return (name.startswith("text.blocks.") and name.endswith(".weight")
            and any(name.endswith(q + ".weight") for q in QUANTIZED))


def build_tensors(seed: int = 0) -> dict:
    """{HF name: numpy array} of the whole checkpoint (what write_md2_int4 saves)."""
    out = {}
    for name, shape in _shapes().items():
        value = _draw(seed, name, shape)
        if is_quantized(name):
            packed, scale, zero = quantize_int4(value.astype(np.float32))
            out[f"model.{name}.packed"] = packed
            out[f"model.{name}.scale"] = scale
            out[f"model.{name}.zero_point"] = zero
        else:
            out[f"model.{name}"] = np.ascontiguousarray(value.astype(ml_dtypes.bfloat16))
    return out


def write_md2_int4(out_dir, *, seed: int = 0) -> str:
    """Write the 4-bit tiny Moondream 2 snapshot into `out_dir` (created if needed): model.safetensors,
    config.json and tokenizer.json (copied from the tiny fixture).  Returns the sha256 of
    model.safetensors (bit-for-bit the same for the same seed)."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "model.safetensors")
    save_file(build_tensors(seed), path, metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_json(), f, indent=1)
        f.write("\n")
    shutil.copyfile(os.path.join(TINY, "tokenizer.json"), os.path.join(out_dir, "tokenizer.json"))
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


if __name__ == "__main__":   # python tests/md2_int4_fixture.py OUT_DIR [SEED]
    import sys

    print(write_md2_int4(sys.argv[1], seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0))
