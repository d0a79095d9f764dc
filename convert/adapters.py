"""Moondream 2 LoRA adapters (finetune "variants") read as published: a variant's `final.pt`,
or a safetensors file with the same names, into host arrays checked against the model.

The published layout is the public reference's (`moondream/torch/lora.py`): a flat state
dict whose keys name each text block's adapted layer in the training code's names, e.g.
`text_model.transformer.h.0.mixer.Wqkv.parametrizations.weight.0.A`.  The reference renames
`text_model.transformer.h` -> `text.blocks`, `.mixer` -> `.attn`, `.out_proj` -> `.proj`,
`.Wqkv` -> `.qkv` and drops `.parametrizations.weight.0`, giving
`text.blocks.<i>.{attn.qkv, attn.proj, mlp.fc1, mlp.fc2}.{A, B}`; either spelling is taken
here.  A is [rank, in], B [out, rank], used as stored (no scale).

Where a variant id lives: the reference caches `final.pt` under
`$HF_HUB_CACHE/md_variants/<id>/`, else `$HF_HOME/hub/md_variants/<id>/`, else
`~/.cache/huggingface/hub/md_variants/<id>/`, and downloads a missing one from
`$MOONDREAM_ENDPOINT` (default https://api.moondream.ai) `/v1/variants/<id>/download` with
`User-Agent: moondream-torch` and, when `MOONDREAM_API_KEY` is set, `X-Moondream-Auth`.
`variant_path` does the same, except that with `HF_HUB_OFFLINE=1` it refuses a missing one
by name instead of downloading, and that the download goes to a temporary file first.

A bad adapter is refused by name (`AdapterError`) before anything reaches a device: an
unknown key, a layer the model does not have, a wrong shape, a rank over the limit, a
non-float or non-finite tensor.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from photon_jax.model import lora
from photon_jax.model.config import MoondreamConfig
from .safetensors_io import SafetensorsError, read_header, read_tensor
from .torch_zip import TorchZipError, index_torch_checkpoint

_RENAMES = (("text_model.transformer.h", "text.blocks"), (".mixer", ".attn"),
            (".out_proj", ".proj"), (".Wqkv", ".qkv"), (".parametrizations.weight.0", ""))
_KEY = re.compile(r"text\.blocks\.(\d+)\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(A|B)")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
MAX_FILE_BYTES = 4 << 30


class AdapterError(ValueError):
    pass


@dataclass(frozen=True, eq=False)
class Adapter:
    """One adapter on the host: `layers[i][target]` = (A [rank, in], B [out, rank]) float32
    for every text layer and target the file adapts (absent ones are zeros), its rank, and
    `digest`, a hash of its contents (the namespace of the prefix caches it fills)."""
    name: str
    rank: int
    layers: tuple
    digest: bytes

    def padded(self, rank: int, dtype) -> list:
        """The slot-table form (`lora.init_tables` without the slot axis) at `rank`."""
        out = []
        for layer in self.layers:
            d = {}
            for t, (a, b) in layer.items():
                pa = np.zeros((rank, a.shape[1]), dtype)
                pb = np.zeros((b.shape[0], rank), dtype)
                pa[:a.shape[0]], pb[:, :b.shape[1]] = a, b
                d[t] = {"A": pa, "B": pb}
            out.append(d)
        return out


def canonical_key(key: str) -> str:
    for old, new in _RENAMES:
        key = key.replace(old, new)
    return key


def variant_cache_dir() -> Path:
    """The reference's variant cache folder (`md_variants`)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]) / "md_variants"
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub" / "md_variants"
    return Path("~/.cache/huggingface/hub").expanduser() / "md_variants"


def variant_path(variant_id: str, *, download: bool = True) -> Path:
    """The cached `final.pt` of a variant id, downloaded where the reference would download
    it (never with HF_HUB_OFFLINE=1, nor with `download=False`)."""
    if not isinstance(variant_id, str) or not _ID.fullmatch(variant_id) or ".." in variant_id:
        raise AdapterError(f"variant {str(variant_id)[:80]!r} is not a variant id (letters, "
                           "digits, '.', '_', '-', '@'; at most 128)")
    dest = variant_cache_dir() / variant_id / "final.pt"
    if dest.is_file():
        return dest
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if offline or not download:
        why = "HF_HUB_OFFLINE is set" if offline else "downloads are off"
        raise AdapterError(f"variant {variant_id!r} is not loaded and not in {dest.parent} "
                           f"({why}); load it with load_adapter(name, path) or place its "
                           "final.pt there")
    endpoint = os.environ.get("MOONDREAM_ENDPOINT", "https://api.moondream.ai")
    headers = {"User-Agent": "moondream-torch"}
    if os.environ.get("MOONDREAM_API_KEY") is not None:
        headers["X-Moondream-Auth"] = os.environ["MOONDREAM_API_KEY"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    req = urllib.request.Request(f"{endpoint}/v1/variants/{variant_id}/download",
                                 headers=headers)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, suffix=".part")
    try:
        with urllib.request.urlopen(req, timeout=60) as r, os.fdopen(fd, "wb") as f:
            shutil.copyfileobj(r, f)
        os.replace(tmp, dest)
    except OSError as e:
        raise AdapterError(f"variant {variant_id!r}: download from {endpoint} failed ({e}); "
                           "check the id, MOONDREAM_API_KEY and the network") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dest


def _index(path: str) -> dict:
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise AdapterError(f"adapter {path}: cannot read it ({e.strerror})") from None
    if size > MAX_FILE_BYTES:
        raise AdapterError(f"adapter {path} is {size} bytes; a LoRA adapter is far smaller "
                           "(is this a whole model?)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic[:2] == b"PK":
            return index_torch_checkpoint(path)
        return read_header(path)
    except (SafetensorsError, TorchZipError) as e:
        raise AdapterError(f"adapter {path}: {e}") from None


def read_adapter(path, cfg: MoondreamConfig, *, name: str, max_rank: int) -> Adapter:
    """Read and check one adapter file for the model `cfg` (a `.pt` zip archive as
    `torch.save` writes it, or `.safetensors`)."""
    path = os.fspath(path)
    why = lora.supported(cfg)
    if why is not None:
        raise AdapterError(f"adapter {name!r}: {why}")
    refs = _index(path)
    dims = lora.target_dims(cfg)
    found: dict = {}
    for key, ref in refs.items():
        m = _KEY.fullmatch(canonical_key(key))
        if m is None:
            raise AdapterError(f"adapter {name!r} ({path}): tensor {key!r} is not a Moondream 2 "
                               "text adapter weight (text blocks' qkv, proj, fc1, fc2 A/B)")
        li, target, ab = int(m.group(1)), m.group(2).split(".")[1], m.group(3)
        if li >= cfg.text.n_layers:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is for text layer {li}, but "
                               f"the model has {cfg.text.n_layers}: an adapter of another model")
        slot = found.setdefault((li, target), {})
        if ab in slot:   # both spellings of one weight: which one is meant is not ours to guess
            raise AdapterError(f"adapter {name!r}: tensors {slot[ab][0]!r} and {key!r} are the "
                               "same weight under two names; keep one")
        slot[ab] = (key, ref)
    if not found:
        raise AdapterError(f"adapter {name!r} ({path}) holds no adapter weights")
    h = hashlib.blake2b(digest_size=16)
    ranks = set()
    layers = [dict() for _ in range(cfg.text.n_layers)]
    for (li, target), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: text layer {li} {target} has only "
                               f"{sorted(pair)}; it needs both A and B")
        (ka, ra), (kb, rb) = pair["A"], pair["B"]
        i, o = dims[target]
        if len(ra.shape) != 2 or len(rb.shape) != 2 or ra.shape[1] != i or rb.shape[0] != o \
                or ra.shape[0] != rb.shape[1]:
            raise AdapterError(
                f"adapter {name!r}: text layer {li} {target}: A {list(ra.shape)} and B "
                f"{list(rb.shape)} do not fit this model (expected A [rank, {i}], "
                f"B [{o}, rank]): an adapter of another model")
        r = ra.shape[0]
        if not 1 <= r <= max_rank:
            raise AdapterError(f"adapter {name!r} has rank {r} (text layer {li} {target}), "
                               f"over this engine's max_lora_rank {max_rank}; raise "
                               "max_lora_rank")
        ranks.add(r)
        arrays = []
        for key, ref in ((ka, ra), (kb, rb)):
            if ref.dtype not in ("F32", "F16", "BF16"):
                raise AdapterError(f"adapter {name!r}: tensor {key!r} is {ref.dtype}; adapters "
                                   "are float32, float16 or bfloat16")
            try:
                x = read_tensor(ref).astype(np.float32)
            except SafetensorsError as e:
                raise AdapterError(f"adapter {name!r}: {e}") from None
            if not np.isfinite(x).all():
                raise AdapterError(f"adapter {name!r}: tensor {key!r} holds NaN or inf")
            arrays.append(x)
            h.update(f"{li}.{target}".encode())
            h.update(x.tobytes())
        layers[li][target] = tuple(arrays)
    rank = max(ranks)
    for li, layer in enumerate(layers):   # targets the file leaves out add nothing
        for t, (i, o) in dims.items():
            layer.setdefault(t, (np.zeros((rank, i), np.float32), np.zeros((o, rank),
                                                                           np.float32)))
    return Adapter(name, rank, tuple(layers), h.digest())
