"""LoRA adapters (finetune "variants") read as published: a variant's `final.pt`, or a
safetensors file with the same names, into host arrays checked against the model.

Two published layouts are read.

Moondream 2's is the public reference's (`moondream/torch/lora.py`): a flat state dict
whose keys name each text block's adapted layer in the training code's names, e.g.
`text_model.transformer.h.0.mixer.Wqkv.parametrizations.weight.0.A`.  The reference renames
`text_model.transformer.h` -> `text.blocks`, `.mixer` -> `.attn`, `.out_proj` -> `.proj`,
`.Wqkv` -> `.qkv` and drops `.parametrizations.weight.0`, giving
`text.blocks.<i>.{attn.qkv, attn.proj, mlp.fc1, mlp.fc2}.{A, B}`; either spelling is taken
here.  A is [rank, in], B [out, rank], used as stored (no scale).

Moondream 3's is kestrel's (0.9.2, `models/moondream/lora.py`; `cloud/adapter_provider.py`
reads a finetune checkpoint as `torch.load(...)["lora_state_dict"]` into its `LoRA`
module): `text_lora.dense.<i>.{up,down}_{a,b}` for the dense layers (up = fc1, down = fc2;
a [rank, in], b [out, rank]) and `text_lora.moe.<j>.{up,down}_{a,b}` for mixture-of-experts
layer start_layer + j (up_a [E, rank/k, D], up_b [E, 2I, rank/k] in the checkpoint's
gate-then-up order, down_a [E, rank/k, I], down_b [E, D, rank/k]).  Its `LoRA` module
registers the text adapters twice (`_text` and `text_lora`), so its `state_dict()` holds
every tensor under both prefixes: both are read, and must agree.  The dense names fit a
Moondream 2 model's fc1 and fc2 too.  kestrel refuses a vision adapter
(`vision_lora.proj_fc2`, "Vision LoRA is not supported"); so does this reader, by name.

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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from photon_jax.model import lora
from photon_jax.model.config import MoondreamConfig
from .safetensors_io import SafetensorsError, read_header, read_tensor
from .torch_zip import TorchZipError, index_torch_checkpoint

_RENAMES = (("text_model.transformer.h", "text.blocks"), (".mixer", ".attn"),
            (".out_proj", ".proj"), (".Wqkv", ".qkv"), (".parametrizations.weight.0", ""))
_KEY = re.compile(r"text\.blocks\.(\d+)\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(A|B)")
_KESTREL = re.compile(r"(?:(text_lora|_text)\.)?(dense|moe)\.(\d+)\.(up|down)_(a|b)")
_VISION = re.compile(r"(?:vision_lora|_vision)\..*")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
MAX_FILE_BYTES = 4 << 30


class AdapterError(ValueError):
    pass


@dataclass(frozen=True, eq=False)
class Adapter:
    """One adapter on the host: `layers[i][target]` = (A, B) float32 for every text layer
    and target the file adapts (`lora.layout`'s shapes at the adapter's own ranks), its
    total rank (a per-expert rank counts k times: kestrel's rank), `digest`, a hash of its
    contents (the namespace of the prefix caches it fills), and the model config."""
    name: str
    rank: int
    layers: tuple
    digest: bytes
    cfg: MoondreamConfig
    # padded() results by (rank, dtype): `read_adapter` fills the engine's form on the
    # loading thread, so the scheduler thread, which writes a slot when a request first
    # uses the adapter, does not build it (0.32 GB of float32 for Moondream 3 at rank 64).
    _padded: dict = field(default_factory=dict, repr=False)

    def padded(self, rank: int, dtype) -> list:
        """The slot-table form (`lora.init_tables` without the slot axis) at total rank
        `rank`: every target of `lora.layout`, zeros where the file adapts nothing.
        Built once per (rank, dtype); treat the arrays as read-only."""
        key = (rank, np.dtype(dtype).str)
        if key in self._padded:
            return self._padded[key]
        out = []
        for layer, shapes in zip(self.layers, lora.layout(self.cfg, rank)):
            d = {}
            for t, (sa, sb) in shapes.items():
                pa, pb = np.zeros(sa, dtype), np.zeros(sb, dtype)
                if t in layer:
                    a, b = layer[t]
                    r = a.shape[-2]
                    pa[..., :r, :], pb[..., :r] = a, b
                d[t] = {"A": pa, "B": pb}
            out.append(d)
        self._padded[key] = out
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
            return index_torch_checkpoint(path, nested=("lora_state_dict",))
        return read_header(path)
    except (SafetensorsError, TorchZipError) as e:
        raise AdapterError(f"adapter {path}: {e}") from None


def _parse_key(key: str, cfg: MoondreamConfig):
    """(text layer, target, "A" | "B", alias) of a published adapter key, else None.
    `alias`: kestrel's module prefix (`_text` or `text_lora`), which names the same
    tensor twice."""
    m = _KESTREL.fullmatch(key)
    if m is not None:
        prefix, group, idx, proj, ab = m.groups()
        li = int(idx) + (cfg.text.n_dense if group == "moe" else 0)
        if group == "dense":
            target = "fc1" if proj == "up" else "fc2"
        else:
            target = proj
        return li, target, ab.upper(), prefix or ""
    m = _KEY.fullmatch(canonical_key(key))
    if m is not None:
        return int(m.group(1)), m.group(2).split(".")[1], m.group(3), ""
    return None


def read_adapter(path, cfg: MoondreamConfig, *, name: str, max_rank: int) -> Adapter:
    """Read and check one adapter file for the model `cfg` (a `.pt` zip archive as
    `torch.save` writes it, or `.safetensors`)."""
    path = os.fspath(path)
    why = lora.supported(cfg, max_rank)
    if why is not None:
        raise AdapterError(f"adapter {name!r}: {why}")
    refs = _index(path)
    shapes = lora.layout(cfg, 1)   # rank 1: where each target's rank axis lies
    k = cfg.text.moe.experts_per_token if cfg.text.moe else 1
    found: dict = {}
    for key, ref in refs.items():
        if _VISION.fullmatch(key):
            raise AdapterError(f"adapter {name!r} ({path}): tensor {key!r} adapts the vision "
                               "projection, which neither Moondream's own engine (kestrel "
                               "0.9.2: 'Vision LoRA is not supported') nor photon_jax "
                               "applies; remove the vision_lora tensors to serve its text "
                               "adapters")
        parsed = _parse_key(key, cfg)
        if parsed is None:
            raise AdapterError(f"adapter {name!r} ({path}): tensor {key!r} is not a Moondream "
                               "text adapter weight (Moondream 2: text blocks' qkv, proj, "
                               "fc1, fc2 A/B; Moondream 3: text_lora.dense.<i> / "
                               "text_lora.moe.<j> up/down a/b)")
        li, target, ab, alias = parsed
        if li >= cfg.text.n_layers:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is for text layer {li}, but "
                               f"the model has {cfg.text.n_layers}: an adapter of another model")
        if target not in shapes[li]:
            kind = "mixture-of-experts" if li >= cfg.text.n_dense else "dense"
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} adapts text layer {li}'s {target}, which "
                f"this model's adapters do not have (layer {li} is a {kind} layer; its "
                f"targets: {sorted(shapes[li])}): an adapter of another model")
        slot = found.setdefault((li, target), {})
        entry = slot.setdefault(ab, {})
        if alias in entry or (entry and (alias == "" or "" in entry)):
            # both spellings of one weight: which one is meant is not ours to guess
            other = next(iter(entry.values()))[0]
            raise AdapterError(f"adapter {name!r}: tensors {other!r} and {key!r} are the "
                               "same weight under two names; keep one")
        entry[alias] = (key, ref)
    if not found:
        raise AdapterError(f"adapter {name!r} ({path}) holds no adapter weights")
    h = hashlib.blake2b(digest_size=16)
    ranks = set()
    layers = [dict() for _ in range(cfg.text.n_layers)]
    for (li, target), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: text layer {li} {target} has only "
                               f"{sorted(pair)}; it needs both A and B")
        (ka, ra), (kb, rb) = (next(iter(pair[x].values())) for x in ("A", "B"))
        sa, sb = shapes[li][target]
        want_a = sa[:-2] + (None, sa[-1])   # None: the rank
        want_b = sb[:-1] + (None,)
        fits = (len(ra.shape) == len(sa) and len(rb.shape) == len(sb)
                and all(w is None or w == g for w, g in zip(want_a, ra.shape))
                and all(w is None or w == g for w, g in zip(want_b, rb.shape))
                and ra.shape[-2] == rb.shape[-1])
        if not fits:
            show = lambda w: "[" + ", ".join("rank" if x is None else str(x) for x in w) + "]"  # noqa: E731
            raise AdapterError(
                f"adapter {name!r}: text layer {li} {target}: A {list(ra.shape)} and B "
                f"{list(rb.shape)} do not fit this model (expected A {show(want_a)}, "
                f"B {show(want_b)}): an adapter of another model")
        r = ra.shape[-2]
        total = r * k if target in lora.EXPERT_TARGETS else r
        if r < 1 or total > max_rank:
            per = f" ({r} per expert, {k} experts per token)" if total != r else ""
            raise AdapterError(f"adapter {name!r} has rank {total}{per} (text layer {li} "
                               f"{target}), over this engine's max_lora_rank {max_rank}; "
                               "raise max_lora_rank")
        ranks.add(total)
        arrays = []
        for x_name in ("A", "B"):
            got = None
            for key, ref in pair[x_name].values():
                if ref.dtype not in ("F32", "F16", "BF16"):
                    raise AdapterError(f"adapter {name!r}: tensor {key!r} is {ref.dtype}; "
                                       "adapters are float32, float16 or bfloat16")
                try:
                    x = read_tensor(ref).astype(np.float32)
                except SafetensorsError as e:
                    raise AdapterError(f"adapter {name!r}: {e}") from None
                if not np.isfinite(x).all():
                    raise AdapterError(f"adapter {name!r}: tensor {key!r} holds NaN or inf")
                if got is not None and (x.shape != got[1].shape or
                                        not np.array_equal(x, got[1])):
                    raise AdapterError(f"adapter {name!r}: tensors {got[0]!r} and {key!r} "
                                       "name one weight (kestrel's two module prefixes) but "
                                       "differ; keep one")
                got = (key, x)
            arrays.append(got[1])
            h.update(f"{li}.{target}".encode())
            h.update(got[1].tobytes())
        layers[li][target] = tuple(arrays)
    adapter = Adapter(name, max(ranks), tuple(layers), h.digest(), cfg)
    adapter.padded(max_rank, np.float32)   # the engine's slot form, built here (above)
    return adapter
