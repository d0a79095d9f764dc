"""Streaming reader for `.safetensors` files and sharded indexes.

Reads the JSON header itself and each tensor with one positioned read into a fresh buffer, so
peak memory is one tensor (no memory map keeps touched pages resident) and truncated or
malformed files produce an error naming the file and the tensor.

Checkpoints come from the internet, so everything the files say is checked before it is used,
and every refusal is a `SafetensorsError` naming the file, the tensor or field, and the fix:

- the header: its declared length (at most 100 MB, and within the file) before it is read;
  then that it is UTF-8 JSON, an object, with no key given twice and no absurd nesting;
- each entry: an object whose `dtype` is a safetensors dtype, whose `shape` is a list of
  non-negative integers (JSON `true` and `2.0` are not integers here), and whose
  `data_offsets` is a pair of integers 0 <= begin <= end that lies within the file and holds
  exactly shape x dtype bytes; no two tensors' bytes overlap (gaps are tolerated: each tensor
  is read from its own range, so a gap can mislead nothing);
- an index: a JSON object (at most 100 MB) whose `weight_map` maps tensor names to shard
  file names, every tensor found in the shard the index names.

Files are confined to the snapshot folder (`snapshot_file`): a shard name must be a relative
path without `..`, and whatever the name resolves to through symlinks must lie inside the
snapshot folder -- or, for a snapshot inside a Hugging Face cache
(`.../models--ORG--NAME/snapshots/REV/`, whose files are symlinks to `../../blobs/`), inside
that repo's folder, and for a folder outside any cache (an `hf download --local-dir` by
huggingface_hub < 0.23 linked big files into the cache), a Hugging Face cache blob
(`.../models--ORG--NAME/blobs/FILE`).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
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
# Every dtype the safetensors format defines, in bits per element: a header entry's byte
# length must follow from it.  Dtypes photon-convert cannot use (F64, I32, ...) pass the
# header check so that the converter's report can list them by tensor; any other name is a
# corrupt header.
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
              "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "C64": 64, "I64": 64, "U64": 64, "F64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}

MAX_HEADER_BYTES = 100_000_000   # the safetensors library's own limit
MAX_INDEX_BYTES = 100_000_000    # a real index is ~100 KB
MAX_DIMS = 64                    # numpy's limit
# A bound on a shape's extent (its dims with zeros counted as 1): a zero-size tensor's other
# dims are otherwise unbounded, and numpy refuses shapes whose extent overflows.
MAX_EXTENT = 1 << 48

ST_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_REDOWNLOAD = "the file is corrupt or was not written as safetensors; re-download it"


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


# -- small checks ---------------------------------------------------------------------------


def _is_int(v) -> bool:
    # JSON true/false arrive as bool, a subclass of int; 2.0 arrives as float.  Neither is a
    # size or an offset.
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v, limit: int = 80) -> str:
    """repr(v), shortened: a hostile header's values may be megabytes long."""
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + "..."


_KIND = {dict: "an object", list: "an array", str: "a string", int: "a number",
         float: "a number", bool: "a boolean", type(None): "null"}


def _kind(v) -> str:
    return _KIND.get(type(v), type(v).__name__)


class _RepeatedKey(Exception):
    def __init__(self, key):
        self.key = key


def _unique_keys(pairs):
    # json's default keeps the last of two equal keys silently: a tensor listed twice would
    # be read from whichever entry came last.
    out = {}
    for k, v in pairs:
        if k in out:
            raise _RepeatedKey(k)
        out[k] = v
    return out


def _parse_json(raw: bytes, where: str):
    """JSON text -> value, every failure as one SafetensorsError naming `where`."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _RepeatedKey as e:
        raise SafetensorsError(
            f"{where}: the key {_show(e.key)} appears twice (a tensor or field given twice is "
            f"ambiguous); {_REDOWNLOAD}") from None
    except RecursionError:
        raise SafetensorsError(f"{where}: unreadable JSON (nested too deeply); "
                               f"{_REDOWNLOAD}") from None
    except ValueError as e:   # UnicodeDecodeError, JSONDecodeError, int too long to convert
        raise SafetensorsError(f"{where}: unreadable JSON ({_show(str(e), 200)}); "
                               f"{_REDOWNLOAD}") from None


def _open_regular(path: str, what: str):
    """`path` opened for reading, refusing anything but a regular file; O_NONBLOCK so that a
    FIFO planted under a weights file's name cannot hang the open."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot open the {what} ({e.strerror or e})") from None
    f = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        f.close()
        raise SafetensorsError(f"{path}: the {what} is not a regular file; replace it with the "
                               "downloaded file")
    return f, st.st_size


# -- one .safetensors file ------------------------------------------------------------------


def read_header(path) -> dict[str, TensorRef]:
    """name -> TensorRef of every tensor of one .safetensors file, all checked (module doc)."""
    path = os.fspath(path)
    f, size = _open_regular(path, "weights file")
    try:
        with f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: truncated (no header); re-download the file")
            (n,) = struct.unpack("<Q", head)
            # Both bounds before the read: the length is the file's word, not ours.
            if n > MAX_HEADER_BYTES:
                raise SafetensorsError(
                    f"{path}: header length {n} bytes exceeds the {MAX_HEADER_BYTES:,}-byte "
                    f"limit; {_REDOWNLOAD}")
            if n > size - 8:
                raise SafetensorsError(
                    f"{path}: corrupt or truncated header: header length {n} bytes, but the "
                    f"file has {size} bytes; re-download the file")
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot read the header ({e.strerror or e})") from None
    if len(raw) != n:
        raise SafetensorsError(f"{path}: truncated header; re-download the file")
    meta = _parse_json(raw, f"{path}: header")
    if not isinstance(meta, dict):
        raise SafetensorsError(
            f"{path}: the header is {_kind(meta)}, not a JSON object of tensor name -> "
            f"{{dtype, shape, data_offsets}}; {_REDOWNLOAD}")
    if not isinstance(meta.get("__metadata__", {}), dict):
        raise SafetensorsError(
            f"{path}: header field __metadata__ is {_kind(meta['__metadata__'])}, not an "
            f"object of strings; {_REDOWNLOAD}")
    base = 8 + n
    out = {}
    for name, info in meta.items():
        if name != "__metadata__":
            out[name] = _entry(path, name, info, base, size)
    _refuse_overlaps(path, out, base, size)
    return out


def _entry(path: str, name: str, info, base: int, size: int) -> TensorRef:
    where = f"{path}: tensor {_show(name, 300)}"
    if not isinstance(info, dict):
        raise SafetensorsError(f"{where}: the header entry is {_kind(info)}, not an object "
                               f"with dtype, shape and data_offsets; {_REDOWNLOAD}")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in info:
            raise SafetensorsError(f"{where}: the header entry has no {field}; {_REDOWNLOAD}")
    dt, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dt, str) or dt not in DTYPE_BITS:
        raise SafetensorsError(
            f"{where}: dtype {_show(dt)} is not a safetensors dtype ({', '.join(DTYPE_BITS)}); "
            f"{_REDOWNLOAD}")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(_is_int(d) and d >= 0 for d in shape)):
        raise SafetensorsError(
            f"{where}: shape {_show(shape)} is not a list of at most {MAX_DIMS} non-negative "
            f"integers; {_REDOWNLOAD}")
    if math.prod(max(d, 1) for d in shape) > MAX_EXTENT:
        raise SafetensorsError(f"{where}: shape {_show(shape)} is absurdly large; {_REDOWNLOAD}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise SafetensorsError(
            f"{where}: data_offsets {_show(offsets)} is not a pair of integers [begin, end]; "
            f"{_REDOWNLOAD}")
    a, b = offsets
    if a < 0 or b < a:
        raise SafetensorsError(
            f"{where}: data_offsets [{a}, {b}] is not a byte range (0 <= begin <= end); "
            f"{_REDOWNLOAD}")
    if base + b > size:
        raise SafetensorsError(
            f"{path}: truncated: tensor {_show(name, 300)} ends at byte {base + b} but the "
            f"file has {size} bytes; re-download the file")
    bits = math.prod(shape) * DTYPE_BITS[dt]
    if bits % 8 or b - a != bits // 8:
        raise SafetensorsError(
            f"{where}: data_offsets [{a}, {b}] hold {b - a} bytes, but {dt}{shape} takes "
            f"{bits / 8:g} bytes; {_REDOWNLOAD}")
    return TensorRef(name, path, dt, tuple(shape), base + a, b - a)


def _refuse_overlaps(path: str, refs: dict[str, TensorRef], base: int, size: int) -> None:
    # Two tensors sharing bytes would both read them; bytes no tensor owns (a gap, a tail)
    # are what the safetensors library itself refuses ("incomplete buffer"): a file that
    # is not what its header says.  Both refused, whatever the reason.
    spans = sorted((r.start, r.start + r.nbytes, r.name) for r in refs.values() if r.nbytes)
    end, last = base, None
    for a, b, name in spans:
        if a < end:
            raise SafetensorsError(
                f"{path}: tensors {_show(last[2], 300)} (data_offsets [{last[0] - base}, "
                f"{last[1] - base}]) and {_show(name, 300)} ([{a - base}, {b - base}]) "
                f"overlap; each tensor needs bytes of its own; {_REDOWNLOAD}")
        if a > end:
            raise SafetensorsError(
                f"{path}: bytes [{end - base}, {a - base}) of the data belong to no tensor "
                f"(before {_show(name, 300)}); a safetensors file's tensors fill its data "
                f"exactly; {_REDOWNLOAD}")
        end, last = b, (a, b, name)
    if end != size:
        raise SafetensorsError(
            f"{path}: the last {size - end} bytes belong to no tensor; a safetensors file's "
            f"tensors fill its data exactly; {_REDOWNLOAD}")


def read_tensor(ref: TensorRef) -> np.ndarray:
    dt = RAW_DTYPES.get(ref.dtype)
    if dt is None:
        raise SafetensorsError(f"{ref.file}: tensor {ref.name!r} has dtype {ref.dtype}, which "
                               "no Moondream checkpoint uses")
    # Checked again here: refs also come from the torch-zip reader, and a file may have
    # changed since its header was read.  Python ints: numpy's product could overflow.
    if not all(_is_int(d) and d >= 0 for d in ref.shape):
        raise SafetensorsError(f"{ref.file}: tensor {ref.name!r} has shape {_show(ref.shape)}")
    count = math.prod(ref.shape)
    if count * dt.itemsize != ref.nbytes:
        raise SafetensorsError(
            f"{ref.file}: tensor {ref.name!r} has {ref.nbytes} bytes, expected "
            f"{count * dt.itemsize} for {ref.dtype}{list(ref.shape)}"
        )
    if ref.start < 0:
        raise SafetensorsError(f"{ref.file}: tensor {ref.name!r} starts at byte {ref.start}, "
                               f"before the file's start; {_REDOWNLOAD}")
    f, size = _open_regular(ref.file, "weights file")
    with f:
        if ref.start + ref.nbytes > size:   # before the buffer is allocated
            raise SafetensorsError(
                f"{ref.file}: truncated: tensor {ref.name!r} ends at byte "
                f"{ref.start + ref.nbytes} but the file has {size} bytes; re-download the file")
        buf = bytearray(ref.nbytes)
        try:
            f.seek(ref.start)
            got = f.readinto(buf)
        except OSError as e:
            raise SafetensorsError(f"{ref.file}: cannot read tensor {ref.name!r} "
                                   f"({e.strerror or e})") from None
    if got != ref.nbytes:
        raise SafetensorsError(f"{ref.file}: truncated while reading tensor {ref.name!r}")
    return np.frombuffer(buf, dtype=dt).reshape(ref.shape)


# -- files of a snapshot --------------------------------------------------------------------

_CACHE_REPO = ("models--", "datasets--", "spaces--")
_DRIVE = re.compile(r"[A-Za-z]:")


def _inside(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:   # different drives
        return False


def _hf_cache_repo(real_dir: str) -> str | None:
    """The repo folder of a snapshot inside a Hugging Face cache (REPO/snapshots/REV), else
    None."""
    snapshots = os.path.dirname(real_dir)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and \
            os.path.basename(repo).startswith(_CACHE_REPO):
        return repo
    return None


def _is_hf_blob(real: str) -> bool:
    blobs = os.path.dirname(real)
    return (os.path.basename(blobs) == "blobs"
            and os.path.basename(os.path.dirname(blobs)).startswith(_CACHE_REPO))


def snapshot_file(hf_dir, name: str, *, listed_in: str | None = None) -> str:
    """The path of `name` in the snapshot folder `hf_dir`, refused (SafetensorsError) when the
    name or a symlink on its way leads out of the folder (rule: module doc).  `listed_in`:
    the index that gave the name, for the error.  The file need not exist."""
    hf_dir = os.fspath(hf_dir)
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name \
            or os.path.isabs(name) or _DRIVE.match(name) or ".." in name.split("/"):
        raise SafetensorsError(
            f"{listed_in or hf_dir}: file name {_show(name, 400)} does not stay inside the "
            "snapshot folder (absolute paths, '..' and backslashes are refused); the index is "
            "corrupt or crafted: list the shards by their file names, or re-download it")
    path = os.path.join(hf_dir, os.path.normpath(name))
    root = os.path.realpath(hf_dir)
    real = os.path.realpath(path)
    if _inside(real, root):
        return path
    repo = _hf_cache_repo(root)
    if (_inside(real, repo) if repo else _is_hf_blob(real)):
        return path
    allowed = f"the snapshot folder {root}" + (
        f" and its Hugging Face cache repo {repo}" if repo else
        " (links into a Hugging Face cache's blobs/ are the one exception)")
    raise SafetensorsError(
        f"{path}" + (f" (listed in {listed_in})" if listed_in else "")
        + f": a symlink that resolves to {real}, outside {allowed}; refusing to read it: "
        "copy the file into the snapshot folder instead of linking it")


def _read_index(index: str) -> dict[str, str]:
    f, size = _open_regular(index, "index")
    with f:
        if size > MAX_INDEX_BYTES:
            raise SafetensorsError(f"{index}: {size:,} bytes, over the {MAX_INDEX_BYTES:,}-byte "
                                   "limit for an index; re-download it")
        try:
            raw = f.read()
        except OSError as e:
            raise SafetensorsError(f"{index}: cannot read the index ({e.strerror or e})") \
                from None
    doc = _parse_json(raw, index)
    if not isinstance(doc, dict) or "weight_map" not in doc:
        raise SafetensorsError(f"{index}: unreadable index: expected a JSON object with a "
                               f"'weight_map', found {_kind(doc)}; re-download it")
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()
    ):
        raise SafetensorsError(f"{index}: 'weight_map' must map tensor names to file names; "
                               "re-download it")
    return weight_map


def index_checkpoint(hf_dir: str) -> tuple[dict[str, TensorRef], list[str]]:
    """All tensors of `model.safetensors` or of a sharded `model.safetensors.index.json`."""
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.lexists(index):
        index = snapshot_file(hf_dir, INDEX_FILE)
        weight_map = _read_index(index)
        shard_path = {s: snapshot_file(hf_dir, s, listed_in=index)
                      for s in sorted(set(weight_map.values()))}
        files = sorted(set(shard_path.values()))
    elif os.path.lexists(os.path.join(hf_dir, ST_FILE)):
        files, weight_map = [snapshot_file(hf_dir, ST_FILE)], None
    else:
        raise SafetensorsError(
            f"{hf_dir}: no model.safetensors or model.safetensors.index.json found"
        )
    tensors: dict[str, TensorRef] = {}
    for fpath in files:
        if not os.path.isfile(fpath):
            if os.path.lexists(fpath):
                raise SafetensorsError(f"{fpath}: not a regular file; replace it with the "
                                       "downloaded shard")
            raise SafetensorsError(f"shard listed in the index is missing: {fpath}")
        for name, ref in read_header(fpath).items():
            if name in tensors:
                raise SafetensorsError(f"tensor {name!r} appears in two shards: "
                                       f"{tensors[name].file} and {fpath}")
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
        # The index is what other loaders follow: a tensor found elsewhere than where it
        # says means the index and the shards disagree.
        moved = sorted(n for n, s in weight_map.items() if tensors[n].file != shard_path[s])
        if moved:
            n = moved[0]
            raise SafetensorsError(
                f"{index}: lists {len(moved)} tensor(s) in the wrong shard, e.g. {n!r} in "
                f"{weight_map[n]!r} while it is in "
                f"{os.path.relpath(tensors[n].file, hf_dir)!r}; re-download the index")
    return tensors, files
