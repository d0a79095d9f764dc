"""Tiny random-weights checkpoints in kestrel's published "md3" FP8 layout
(docs/quantized-formats.md, section 1), built from the Hugging Face-named Moondream 3 tiny
fixture, and the same model dequantized back to the fixture's bf16 layout, so a test can run
one engine on each and compare.

Names follow kestrel 0.9.2 `kestrel/models/moondream/weights.py` (`_assign_md3_text_weights`,
`_assign_md3_vision_weights`, `_assign_md3_region_weights`, `_capture_moe_scales`) name for
name.  The `.pt` container is torch's zip archive, written here without torch by
`write_torch_zip`, in the layout torch 2.x's `torch.save` writes.  numpy / ml_dtypes only, and
no photon_jax import (the torch-side checks import this module in a venv without JAX).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zlib

import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8_MAX = 448.0

# numpy dtype -> (safetensors dtype, torch storage class or None, torch dtype name).  torch >= 2.1
# saves dtypes without a legacy storage class (float8) through `_rebuild_tensor_v3` with an
# UntypedStorage and the dtype object; the rest through `_rebuild_tensor_v2` and a typed storage.
_DTYPES = {
    np.dtype(np.float32): ("F32", "FloatStorage", "float32"),
    BF16: ("BF16", "BFloat16Storage", "bfloat16"),
    np.dtype(np.float16): ("F16", "HalfStorage", "float16"),
    FP8: ("F8_E4M3", None, "float8_e4m3fn"),
    np.dtype(np.uint8): ("U8", "ByteStorage", "uint8"),
    np.dtype(np.int8): ("I8", "CharStorage", "int8"),
    np.dtype(np.int32): ("I32", "IntStorage", "int32"),
    np.dtype(np.int64): ("I64", "LongStorage", "int64"),
    np.dtype(np.bool_): ("BOOL", "BoolStorage", "bool"),
}
_NP = {"F32": np.dtype(np.float32), "BF16": BF16, "F16": np.dtype(np.float16), "F8_E4M3": FP8,
       "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8)}


# ---------------------------------------------------------------------------------------------
# Containers

def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a single safetensors file (safetensors' numpy API has no bfloat16; no
    photon_jax import, so the torch-side checks can use this module too)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {name: np.frombuffer(data[a:b], _NP[h["dtype"]]).reshape(h["shape"])
            for name, h in header.items() for a, b in [h["data_offsets"]]}


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file: u64 header size, JSON header padded to 8 bytes, tensors back to back."""
    header, off = {}, 0
    for name in sorted(tensors):
        a = tensors[name]
        header[name] = {"dtype": _DTYPES[a.dtype][0], "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name in sorted(tensors):
            f.write(tensors[name].tobytes(order="C"))


# Pickle protocol 2 opcodes, emitted by hand: the globals torch's pickle names (torch._utils...)
# cannot be pickled by reference without torch installed.
def _int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)
    if -2**31 <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _tuple(items: list[bytes]) -> bytes:
    if len(items) <= 3:
        return b"".join(items) + [b")", b"\x85", b"\x86", b"\x87"][len(items)]
    return b"(" + b"".join(items) + b"t"


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _contiguous_strides(shape) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def torch_pickle(tensors: dict[str, np.ndarray]) -> tuple[bytes, list[bytes]]:
    """data.pkl for a dict name -> tensor, one storage per tensor (key = its index), as torch.save
    writes it; returns (pickle, storages' bytes)."""
    body, storages = [], []
    for key, (name, a) in enumerate(tensors.items()):
        _, storage_cls, dtype_name = _DTYPES[a.dtype]
        storages.append(a.tobytes(order="C"))  # (np.ascontiguousarray would make 0-d 1-d)
        if storage_cls is None:  # v3: untyped storage, numel in bytes, dtype passed separately
            stype = _global("torch.storage", "UntypedStorage")
            rebuild, numel = "_rebuild_tensor_v3", a.nbytes
        else:
            rebuild, stype, numel = "_rebuild_tensor_v2", _global("torch", storage_cls), a.size
        pid = _tuple([_str("storage"), stype, _str(str(key)), _str("cpu"), _int(numel)]) + b"Q"
        args = [pid, _int(0), _tuple([_int(n) for n in a.shape]),
                _tuple([_int(s) for s in _contiguous_strides(a.shape)]), b"\x89",
                _global("collections", "OrderedDict") + b")R"]  # backward hooks: OrderedDict()
        if storage_cls is None:
            args.append(_global("torch", dtype_name))
        body.append(_str(name) + _global("torch._utils", rebuild) + _tuple(args) + b"R")
    return b"\x80\x02}(" + b"".join(body) + b"u.", storages


def write_torch_zip(path: str, tensors: dict[str, np.ndarray]) -> None:
    """What `torch.save(dict_of_tensors, path)` writes (torch 2.x): a zip whose records live under
    `<file stem>/`, every record stored uncompressed with its data aligned to 64 bytes (torch pads
    the local header's extra field with an 'FB' record), byteorder 'little', version '3'."""
    write_torch_archive(path, *torch_pickle(tensors))


def write_torch_archive(path: str, pkl: bytes, storages: list[bytes], *,
                        byteorder: bytes = b"little") -> None:
    """The zip container alone, around a given data.pkl and storages `data/0`, `data/1`, ...
    (tests use it to craft bad files)."""
    root = os.path.splitext(os.path.basename(path))[0]
    records = [("data.pkl", pkl), (".format_version", b"1"), (".storage_alignment", b"64"),
               ("byteorder", byteorder)]
    records += [(f"data/{k}", s) for k, s in enumerate(storages)] + [("version", b"3\n")]
    central, out = [], bytearray()
    for rel, data in records:
        name = f"{root}/{rel}".encode()
        offset = len(out)
        pad = -(offset + 30 + len(name) + 4) % 64
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        crc = zlib.crc32(data)
        # signature, version needed, flags, method (stored), time, date, crc, sizes, name/extra len
        fields = struct.pack("<HHHHHIIIHH", 20, 0, 0, 0, 0x21, crc, len(data), len(data),
                             len(name), len(extra))
        out += b"PK\x03\x04" + fields + name + extra + data
        central.append(b"PK\x01\x02" + struct.pack("<H", 20) + fields[:-2] + struct.pack(
            "<HHHHII", 0, 0, 0, 0, 0, offset) + name)
    cd = b"".join(central)
    if len(out) + len(cd) >= 2**32:
        raise ValueError("write_torch_zip writes no zip64 records: keep test files under 4 GiB")
    eocd = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, len(records), len(records), len(cd),
                                       len(out), 0)
    with open(path, "wb") as f:
        f.write(bytes(out) + cd + eocd)


# ---------------------------------------------------------------------------------------------
# Quantization (kestrel scripts/quantize_moe_fp8.py without the HQQ refinement: same format)

def quantize_experts(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, N, K] weight -> (float8_e4m3fn codes [E, N, K], float32 scale [E, N]): one scale per
    (expert, output row), absmax over K / 448; an all-zero row gets scale 1."""
    w = w.astype(np.float32)
    scale = np.abs(w).max(axis=-1) / np.float32(FP8_MAX)
    scale = np.where(scale == 0, np.float32(1), scale).astype(np.float32)
    codes = np.clip(w / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
    return codes, scale


def dequantize_experts(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The doc's dequantization: bf16(f32(fp8) * f32(scale[..., None])), rounded once."""
    return (codes.astype(np.float32) * scale.astype(np.float32)[..., None]).astype(BF16)


# ---------------------------------------------------------------------------------------------
# Hugging Face names (without `model.`) -> md3 names

_VIS = "vision_encoder.encoder.model.visual"
_B, _H = r"text\.blocks\.(\d+)\.", r"text_model.transformer.h.\1."
_RENAMES = [(re.compile(a + r"\Z"), b) for a, b in [
    (r"text\.wte", "text_model.transformer.embd.wte.weight"),
    (_B + r"ln\.(weight|bias)", _H + r"ln.\2"),
    (_B + r"attn\.qkv\.(weight|bias)", _H + r"mixer.Wqkv.\2"),
    (_B + r"attn\.proj\.(weight|bias)", _H + r"mixer.out_proj.\2"),
    (_B + r"attn\.tau\.alpha", _H + "tau_alpha"),
    (_B + r"mlp\.router\.(weight|bias)", _H + r"gate.\2"),
    (_B + r"mlp\.(fc1|fc2)\.(weight|bias)", _H + r"mlp.\2.\3"),  # dense layers
    (r"text\.post_ln\.(weight|bias)", r"text_model.lm_head.ln.\1"),
    (r"text\.lm_head\.(weight|bias)", r"text_model.lm_head.linear.\1"),
    (r"vision\.patch_emb\.(weight|bias)", _VIS + r".patch_embed.linear.\1"),
    (r"vision\.pos_emb", _VIS + ".pos_embed"),
    (r"vision\.blocks\.(\d+)\.ln1\.(weight|bias)", _VIS + r".blocks.\1.norm1.\2"),
    (r"vision\.blocks\.(\d+)\.ln2\.(weight|bias)", _VIS + r".blocks.\1.norm2.\2"),
    (r"vision\.blocks\.(\d+)\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)",
     _VIS + r".blocks.\1.\2.\3"),
    (r"vision\.post_ln\.(weight|bias)", _VIS + r".norm.\1"),
    (r"vision\.proj_mlp\.(fc1|fc2)\.(weight|bias)", r"vision_encoder.projection.mlp.\1.\2"),
    (r"region\.coord_encoder\.(weight|bias)", r"region_model.coordinate_encoder.\1"),
    (r"region\.size_encoder\.(weight|bias)", r"region_model.size_encoder.\1"),
    (r"region\.coord_decoder\.(weight|bias)", r"region_model.coordinate_head.\1"),
    (r"region\.size_decoder\.(weight|bias)", r"region_model.size_head.\1"),
    (r"region\.ln\.(weight|bias)", r"region_model.ln.\1"),
]]
# Stored transposed in md3 (kestrel copies `.T` of them).
_TRANSPOSED = {"region.coord_features": "region_model.coordinate_features.weight",
               "region.size_features": "region_model.size_features.weight"}
_EXPERTS = re.compile(r"text\.blocks\.(\d+)\.mlp\.(fc1|fc2)\.weight\Z")
_TAU = re.compile(r"text\.blocks\.(\d+)\.attn\.tau\.(wq|wv)\Z")


def _src(src_dir: str) -> dict[str, np.ndarray]:
    t = read_safetensors(os.path.join(src_dir, "model.safetensors"))
    if not all(k.startswith("model.") for k in t):
        raise ValueError(f"{src_dir}: expected Hugging Face names model.*")
    return {k[len("model."):]: v for k, v in t.items()}


def _with_orig_mod(name: str) -> str:
    # Where torch.compile's wrapper would leave it if the text blocks were compiled one by one
    # (the real file's placement is unknown; kestrel removes every '._orig_mod' wherever it is).
    return re.sub(r"^(text_model\.transformer\.h\.\d+)\.", r"\1._orig_mod.", name)


def md3_tensors(src_dir: str, *, fused_tau: bool = True) -> dict[str, np.ndarray]:
    """The fixture's tensors under md3 names, experts quantized to FP8 with float32 scales."""
    src, out, tau = _src(src_dir), {}, {}
    for name, a in src.items():
        m = _EXPERTS.match(name)
        if m and a.ndim == 3:  # MoE layer: [E, 2I, H] up / [E, H, I] down
            i, which = m.groups()
            codes, scale = quantize_experts(a)
            h = f"text_model.transformer.h.{i}"
            kind = ("experts", "up_scale") if which == "fc1" else ("output_experts", "down_scale")
            out[f"{h}.mlp.{kind[0]}.weight"] = codes
            out[f"{h}.moe_quant.{kind[1]}"] = scale
            continue
        if m := _TAU.match(name):
            tau[(m.group(1), m.group(2))] = a
            continue
        if name in _TRANSPOSED:
            out[_TRANSPOSED[name]] = np.ascontiguousarray(a.T)
            continue
        for pat, repl in _RENAMES:
            if pat.match(name):
                out[pat.sub(repl, name)] = a
                break
        else:
            raise ValueError(f"{src_dir}: no md3 name for {name!r}")
    for i in sorted({i for i, _ in tau}, key=int):
        h = f"text_model.transformer.h.{i}"
        if fused_tau:  # kestrel: torch.cat([tau_wq, tau_wv], dim=0), wq rows first
            out[f"{h}.tau_wqwv"] = np.concatenate([tau[(i, "wq")], tau[(i, "wv")]], axis=0)
        else:
            out[f"{h}.tau_wq"], out[f"{h}.tau_wv"] = tau[(i, "wq")], tau[(i, "wv")]
    return out


def _copy_side_files(src_dir: str, out_dir: str) -> None:
    for f in ("config.json", "tokenizer.json"):
        shutil.copyfile(os.path.join(src_dir, f), os.path.join(out_dir, f))


def write_md3_fp8(src_dir: str, out_dir: str, *, container: str = "safetensors",
                  fused_tau: bool = True, orig_mod: bool | None = None) -> str:
    """kestrel md3 FP8 checkpoint of the fixture in `out_dir`: `model.safetensors` (the 3.1
    layout) or `model_fp8.pt` (the 3-preview layout, torch zip; names carry `._orig_mod` unless
    `orig_mod=False`), plus config.json and tokenizer.json.  Returns the weights' path."""
    if container not in ("safetensors", "pt"):
        raise ValueError(f"container must be 'safetensors' or 'pt', not {container!r}")
    tensors = md3_tensors(src_dir, fused_tau=fused_tau)
    os.makedirs(out_dir, exist_ok=True)
    _copy_side_files(src_dir, out_dir)
    if container == "safetensors":
        path = os.path.join(out_dir, "model.safetensors")
        write_safetensors(path, tensors)
    else:
        if orig_mod is None or orig_mod:
            tensors = {_with_orig_mod(k): v for k, v in tensors.items()}
        path = os.path.join(out_dir, "model_fp8.pt")
        write_torch_zip(path, tensors)
    return path


def dequantized_md3(src_dir: str, out_dir: str) -> str:
    """The fixture in its own bf16 Hugging Face layout with every expert weight replaced by its
    FP8 round trip bf16(f32(fp8) * f32(scale)): the weights `write_md3_fp8` stores, dequantized."""
    src = _src(src_dir)
    out = {}
    for name, a in src.items():
        if _EXPERTS.match(name) and a.ndim == 3:
            a = dequantize_experts(*quantize_experts(a))
        out["model." + name] = a
    os.makedirs(out_dir, exist_ok=True)
    _copy_side_files(src_dir, out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    write_safetensors(path, out)
    return path
