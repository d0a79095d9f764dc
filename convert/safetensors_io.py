"""Streaming reader for `.safetensors` files and sharded indexes.

Reads the JSON header itself and each tensor with one positioned read into a fresh buffer, so
peak memory is one tensor (no memory map keeps touched pages resident) and truncated or
malformed files produce an error naming the file and the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

# Float storage dtypes a weight may have; the codes and scales of the published quantized
# layouts (convert/quantized.py) may also be these raw types.
DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16)}
RAW_DTYPES = {**DTYPES, "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
              "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8)}


class SafetensorsError(ValueError):
    pass


@dataclass(frozen=True)
class TensorRef:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: str) -> dict[str, TensorRef]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: truncated (no header); re-download the file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise SafetensorsError(f"{path}: corrupt or truncated header; re-download the file")
        try:
            meta = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: unreadable header ({e}); re-download the file") from None
    base = 8 + n
    out = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (a, b) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: malformed entry for tensor {name!r}") from None
        if base + b > size:
            raise SafetensorsError(
                f"{path}: truncated: tensor {name!r} ends at byte {base + b} but the file has "
                f"{size} bytes; re-download the file"
            )
        out[name] = TensorRef(name, path, dt, shape, base + a, b - a)
    return out


def index_checkpoint(hf_dir: str) -> tuple[dict[str, TensorRef], list[str]]:
    """All tensors of `model.safetensors` or of a sharded `model.safetensors.index.json`."""
    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{index}: unreadable index ({e!r})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise SafetensorsError(f"{index}: 'weight_map' must map tensor names to file names")
        files = sorted({os.path.join(hf_dir, v) for v in weight_map.values()})
    elif os.path.isfile(single):
        files, weight_map = [single], None
    else:
        raise SafetensorsError(
            f"{hf_dir}: no model.safetensors or model.safetensors.index.json found"
        )
    tensors: dict[str, TensorRef] = {}
    for fpath in files:
        if not os.path.isfile(fpath):
            raise SafetensorsError(f"shard listed in the index is missing: {fpath}")
        for name, ref in read_header(fpath).items():
            if name in tensors:
                raise SafetensorsError(f"tensor {name!r} appears in two shards")
            tensors[name] = ref
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise SafetensorsError(f"tensors listed in the index but absent: {missing[:10]}")
        unlisted = sorted(set(tensors) - set(weight_map))
        if unlisted:
            raise SafetensorsError(
                f"{index}: shards hold tensors the index does not list: {unlisted[:10]}"
            )
    return tensors, files


def read_tensor(ref: TensorRef) -> np.ndarray:
    dt = RAW_DTYPES.get(ref.dtype)
    if dt is None:
        raise SafetensorsError(f"{ref.file}: tensor {ref.name!r} has dtype {ref.dtype}, which "
                               "no Moondream checkpoint uses")
    count = int(np.prod(ref.shape)) if ref.shape else 1
    if count * dt.itemsize != ref.nbytes:
        raise SafetensorsError(
            f"{ref.file}: tensor {ref.name!r} has {ref.nbytes} bytes, expected "
            f"{count * dt.itemsize} for {ref.dtype}{list(ref.shape)}"
        )
    buf = bytearray(ref.nbytes)
    with open(ref.file, "rb") as f:
        f.seek(ref.start)
        got = f.readinto(buf)
    if got != ref.nbytes:
        raise SafetensorsError(f"{ref.file}: truncated while reading tensor {ref.name!r}")
    return np.frombuffer(buf, dtype=dt).reshape(ref.shape)
