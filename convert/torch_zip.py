"""Index a torch zip-archive checkpoint (`torch.save` since torch 1.6) without importing torch.

Owns one thing: turning a `.pt` file that holds a flat dict name -> tensor (Moondream 3
preview's `model_fp8.pt`, read by kestrel with `torch.load(weights_only=True, mmap=True)`)
into the same `TensorRef`s the safetensors reader makes, so `read_tensor(ref)` reads each
tensor with one positioned read.  The archive is a zip holding `<root>/data.pkl` (a pickle
whose tensors point at storages by persistent id), `<root>/data/<key>` (each storage's raw
bytes, stored uncompressed) and `<root>/byteorder`.

The pickle is unpickled with an allow-list: only the few globals a plain state dict names
(tensor rebuild functions, storage classes, dtype objects, OrderedDict) resolve, each to an
inert stand-in of ours, so unpickling builds descriptions and runs nothing from the file.
"""

from __future__ import annotations

import collections
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass

from .safetensors_io import TensorRef


class TorchZipError(ValueError):
    pass


# Storage classes `torch.save` names for the legacy dtypes (the tensor's dtype comes from the
# storage class, through `_rebuild_tensor_v2`) -> safetensors dtype strings.
_STORAGE_CLASSES = {
    "FloatStorage": "F32", "BFloat16Storage": "BF16", "HalfStorage": "F16",
    "ByteStorage": "U8", "CharStorage": "I8", "IntStorage": "I32", "LongStorage": "I64",
    "BoolStorage": "BOOL",
}
# dtype objects (`torch.float8_e4m3fn` ...): torch >= 2.1 saves dtypes that have no legacy
# storage class (the float8 types among them) through `_rebuild_tensor_v3` with an
# `UntypedStorage` and the dtype as a separate argument.
_DTYPE_OBJECTS = {
    "float32": "F32", "bfloat16": "BF16", "float16": "F16", "float8_e4m3fn": "F8_E4M3",
    "uint8": "U8", "int8": "I8", "int32": "I32", "int64": "I64", "bool": "BOOL",
}
# The pickle (data.pkl) holds only the names, shapes and storage keys of the tensors: about
# 150 bytes a tensor, so a few hundred KB for a whole Moondream checkpoint.  Unpickling can
# cost ~60 bytes of Python objects per pickle byte (an empty list per opcode), and a zip
# member may be deflated, so its declared size is bounded before anything is unpickled.
MAX_PICKLE_BYTES = 16 << 20
ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1, "I8": 1, "I32": 4,
            "I64": 8, "BOOL": 1}


@dataclass(frozen=True)
class _StorageType:
    dtype: str | None  # None: UntypedStorage (its numel counts bytes)


@dataclass(frozen=True)
class _Dtype:
    dtype: str


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: str | None
    nbytes: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int  # in elements of `dtype`
    shape: tuple
    stride: tuple
    dtype: str


def _tensor(storage, offset, shape, stride, dtype):
    if not (isinstance(storage, _Storage) and isinstance(offset, int)
            and isinstance(shape, tuple) and isinstance(stride, tuple)
            and all(isinstance(v, int) and v >= 0 for v in (offset, *shape, *stride))
            and len(shape) == len(stride)):
        raise pickle.UnpicklingError("malformed tensor record")
    return _Tensor(storage, offset, shape, stride, dtype)


# The rebuild functions' signatures are torch's (torch/_utils.py); requires_grad, the
# backward-hook dict and the metadata carry nothing a weight file needs, hence their leading
# underscores (the pickle's REDUCE passes every argument by position, so the names are ours).
def _rebuild_tensor(storage, offset, shape, stride):
    if not isinstance(storage, _Storage) or storage.dtype is None:
        raise pickle.UnpicklingError("_rebuild_tensor needs a typed storage")
    return _tensor(storage, offset, shape, stride, storage.dtype)


def _rebuild_tensor_v2(storage, offset, shape, stride, _requires_grad, _hooks, _metadata=None):
    return _rebuild_tensor(storage, offset, shape, stride)


def _rebuild_tensor_v3(storage, offset, shape, stride, _requires_grad, _hooks, dtype,
                       _metadata=None):
    if not isinstance(dtype, _Dtype):
        raise pickle.UnpicklingError("_rebuild_tensor_v3 without a dtype")
    if storage.dtype is not None and storage.dtype != dtype.dtype:
        raise pickle.UnpicklingError("tensor dtype differs from its storage's")
    return _tensor(storage, offset, shape, stride, dtype.dtype)


def _rebuild_parameter(data, _requires_grad, _hooks):
    # A dict of nn.Parameters (e.g. built from named_parameters()) holds the same bytes.
    if not isinstance(data, _Tensor):
        raise pickle.UnpicklingError("_rebuild_parameter without a tensor")
    return data


_FUNCTIONS = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch.storage", "UntypedStorage"): _StorageType(None),
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, fp, path):
        super().__init__(fp)
        self._path = path

    def find_class(self, module, name):
        # Every global of the pickle passes here (GLOBAL, STACK_GLOBAL, extension codes):
        # anything off the list is refused, so nothing the file names can run.
        if (module, name) in _FUNCTIONS:
            return _FUNCTIONS[(module, name)]
        if module == "torch" and name in _STORAGE_CLASSES:
            return _StorageType(_STORAGE_CLASSES[name])
        if module == "torch" and name in _DTYPE_OBJECTS:
            return _Dtype(_DTYPE_OBJECTS[name])
        raise TorchZipError(
            f"{self._path}: the checkpoint's pickle names the global {module}.{name}, which a "
            "plain state dict of tensors does not need; refusing to load it (re-save the "
            "weights as a dict of tensors, or as .safetensors)"
        )

    def persistent_load(self, pid):
        # torch writes ('storage', <storage class>, key, location, numel); numel counts
        # elements of a typed storage, bytes of an UntypedStorage.
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
                and isinstance(pid[4], int) and pid[4] >= 0):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        dtype = pid[1].dtype
        return _Storage(pid[2], dtype, pid[4] * (ITEMSIZE[dtype] if dtype else 1))


def _archive_root(path: str, names: list[str]) -> str:
    roots = {n[: -len("/data.pkl")] for n in names if n.endswith("/data.pkl") and n.count("/") == 1}
    if len(roots) != 1:
        raise TorchZipError(
            f"{path}: not a torch checkpoint (expected one <root>/data.pkl in the zip, "
            f"found {len(roots)})"
        )
    return roots.pop()


def _member_start(path: str, f, info: zipfile.ZipInfo, size: int) -> int:
    """Absolute offset of a stored member's first data byte, from its local file header."""
    f.seek(info.header_offset)
    head = f.read(30)
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        raise TorchZipError(f"{path}: corrupt zip entry {info.filename}; re-download the file")
    method, = struct.unpack_from("<H", head, 8)
    name_len, extra_len = struct.unpack_from("<HH", head, 26)
    start = info.header_offset + 30 + name_len + extra_len
    if method != zipfile.ZIP_STORED or start + info.file_size > size:
        raise TorchZipError(f"{path}: corrupt or truncated zip entry {info.filename}; "
                            "re-download the file")
    return start


def _contiguous(shape: tuple, stride: tuple) -> bool:
    expect = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n > 1 and s != expect:  # a size-1 (or empty) dimension's stride is never used
            return False
        expect *= n
    return True


def _plain(v, depth: int = 0) -> bool:
    """A value a checkpoint may carry beside its weights (a step count, a name, a config),
    at most 16 containers deep: a pickle can nest lists far deeper than Python recursion
    allows, and such a file is refused by name like any other odd one, not with a
    RecursionError."""
    if isinstance(v, (type(None), bool, int, float, str)):
        return True
    if depth >= 16:
        return False
    if isinstance(v, (list, tuple)):
        return all(_plain(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _plain(x, depth + 1) for k, x in v.items())
    return False


def index_torch_checkpoint(path, nested: tuple = ()) -> dict[str, TensorRef]:
    """Every tensor of a torch zip-archive checkpoint holding a flat dict name -> tensor, or
    (a key of `nested` in it) a dict holding that flat dict under the key beside plain
    values: Moondream's finetune checkpoints put their weights in `lora_state_dict`."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        with open(path, "rb") as f:
            magic = f.read(2)
        if magic == b"\x80\x02":
            raise TorchZipError(
                f"{path}: legacy (pre-1.6, non-zip) torch.save format; re-save it with a "
                "current torch (torch.save(torch.load(p), p)) or as .safetensors"
            ) from None
        raise TorchZipError(f"{path}: not a zip archive, or truncated; re-download the "
                            "file") from None
    with zf, open(path, "rb") as f:
        infos = {i.filename: i for i in zf.infolist()}
        root = _archive_root(path, list(infos))
        byteorder = f"{root}/byteorder"
        # Files from torch < 1.10 have no byteorder record; they were written little-endian
        # on every platform torch supports in practice.
        if byteorder in infos and zf.read(byteorder).strip() != b"little":
            raise TorchZipError(f"{path}: saved big-endian ({zf.read(byteorder)!r}); re-save "
                                "it on a little-endian machine")
        pkl = infos.get(f"{root}/data.pkl")
        if pkl is not None and pkl.file_size > MAX_PICKLE_BYTES:
            raise TorchZipError(f"{path}: its data.pkl is {pkl.file_size:,} bytes, over the "
                                f"{MAX_PICKLE_BYTES:,} a checkpoint's tensor index needs; "
                                "not a torch state dict checkpoint")
        try:
            obj = _Unpickler(zf.open(f"{root}/data.pkl"), path).load()
        except TorchZipError:
            raise
        except Exception as e:  # a damaged pickle raises all sorts of errors
            raise TorchZipError(f"{path}: unreadable data.pkl ({e!r}); re-download the "
                                "file") from None
        inner = [k for k in nested if isinstance(obj, dict) and isinstance(obj.get(k), dict)]
        if inner and all(_plain(v) for k, v in obj.items() if k != inner[0]):
            obj = obj[inner[0]]
        if not isinstance(obj, dict) or not all(
            isinstance(k, str) and isinstance(v, _Tensor) for k, v in obj.items()
        ):
            raise TorchZipError(
                f"{path}: holds {type(obj).__name__}, not a flat dict of name -> tensor; "
                "save the model's state_dict() itself"
            )
        out: dict[str, TensorRef] = {}
        starts: dict[str, int] = {}
        for name, t in obj.items():
            member = f"{root}/data/{t.storage.key}"
            info = infos.get(member)
            if info is None:
                raise TorchZipError(f"{path}: tensor {name!r}: storage {member} is missing; "
                                    "re-download the file")
            if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1:
                raise TorchZipError(
                    f"{path}: tensor {name!r} is stored compressed or encrypted in the zip "
                    "(torch.save never does that); re-save it with torch.save"
                )
            if t.storage.nbytes > info.file_size:
                raise TorchZipError(f"{path}: tensor {name!r}: storage {member} is shorter "
                                    "than its record; re-download the file")
            if not _contiguous(t.shape, t.stride):
                raise TorchZipError(
                    f"{path}: tensor {name!r} is not contiguous (shape {list(t.shape)}, "
                    f"stride {list(t.stride)}); save tensor.contiguous() instead"
                )
            item = ITEMSIZE[t.dtype]
            count = 1
            for n in t.shape:
                count *= n
            a, nbytes = t.offset * item, count * item
            if count and a + nbytes > t.storage.nbytes:
                raise TorchZipError(f"{path}: tensor {name!r} runs past the end of its "
                                    "storage; re-download the file")
            if member not in starts:
                starts[member] = _member_start(path, f, info, size)
            out[name] = TensorRef(name, path, t.dtype, tuple(t.shape), starts[member] + a, nbytes)
    return out
