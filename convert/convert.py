"""The conversion itself: validate everything first, then stream tensors into the output tree,
then write the checkpoint into a temporary sibling directory and rename it into place.

Nothing is written until every name, shape and dtype has been checked, and a failure while
writing leaves no half-written OUT_DIR behind.  Peak memory is the output tree plus one
source tensor and its converted copy.

The family (Moondream 2 or 3) comes from config.json (`model_type`, or Moondream 3-only keys)
and from the tensor names (tau, router, region LayerNorm: Moondream 3 whatever config.json
says); a Moondream 3 config is merged onto the Moondream 3 defaults.

Quantized weights (`photon_jax.model.quant`).  The published quantized layouts (Moondream
3.1's and 3-preview's FP8 experts, Moondream 2's 4-bit text layers: `quantized.py`) are
kept as they are published, code for code.  `weights` ("int8", "fp8", "int4") quantizes the
weights still in float (`config.Weights.of`: the text linears, the experts, the head); the
vision encoder stays in `dtype`.  The output's config.json records which leaves are
quantized (`weights`), so loading needs no option.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import jax
import ml_dtypes
import numpy as np

from photon_jax.base.dtypes import canonical
from photon_jax.model import checkpoint
from dataclasses import asdict

from photon_jax.model import quant
from photon_jax.model.config import ConfigError, from_hf_config_json, MoondreamConfig, Weights
from photon_jax.model.params import flatten, param_shapes, param_specs, weight_format
from photon_jax.model.tokenizer import load_tokenizer, TokenizerError

from . import quantized
from .names import Target, canonical_name, hf_table, looks_md3, stored_shape
from .safetensors_io import (DTYPES, SafetensorsError, index_checkpoint, read_tensor,
                             snapshot_file)

CONVERTER_VERSION = "2"   # 2: published quantized layouts, --weights
_NP = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_MAX_CONFIG_BYTES = 10_000_000


class ConvertError(ValueError):
    pass


def _leaf_shapes(cfg):
    return flatten(param_shapes(cfg))


def plan(cfg: MoondreamConfig, tensors: dict) -> list[tuple[object, Target, bool]]:
    """Match stored tensors to the tree; raise ConvertError listing every problem."""
    # Every layer stores at least one tensor.  A config.json claiming more layers than the
    # checkpoint has tensors cannot match it, and listing the names of, say, 10^8 layers
    # would take an hour and gigabytes before saying so.
    layers = cfg.text.n_layers + cfg.vision.enc_n_layers
    if layers > len(tensors):
        raise ConvertError(
            f"config.json describes {cfg.text.n_layers} text and {cfg.vision.enc_n_layers} "
            f"vision layers, but the checkpoint holds only {len(tensors)} tensors: the "
            "config does not belong to these weights; use the snapshot's own config.json")
    table = hf_table(cfg)
    leaves = _leaf_shapes(cfg)
    matched, unexpected, misshapen, bad_dtype, dup = {}, [], [], [], []
    for name, ref in tensors.items():
        hf, transposed = canonical_name(name)
        tgt = table.get(hf)
        if tgt is None:
            unexpected.append(name)
            continue
        if hf in matched:
            dup.append(f"{name} and {matched[hf][0].name} both map to {hf}")
            continue
        full = leaves[tgt.path]
        want = stored_shape(full[1:] if tgt.layer is not None else full, tgt, transposed)
        if isinstance(ref, quantized.Md2Pending):
            if ref.groups * 128 != int(np.prod(want)):
                misshapen.append(f"{name}: {ref.groups} groups of 128 values, expected "
                                 f"{list(want)}")
                continue
            try:
                ref = ref.resolve(want)
            except quantized.QuantizedLayoutError as e:
                raise ConvertError(str(e)) from None
        if ref.dtype not in DTYPES and ref.dtype != "Q":
            bad_dtype.append(f"{name}: {ref.dtype}")
        if tuple(ref.shape) != want:
            misshapen.append(f"{name}: stored {list(ref.shape)}, expected {list(want)}")
        matched[hf] = (ref, tgt, transposed)
    missing = sorted(set(table) - set(matched))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_short(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {_short(sorted(unexpected))}")
    if misshapen:
        problems.append(f"{len(misshapen)} tensor(s) with the wrong shape: {_short(misshapen)}")
    if bad_dtype:
        problems.append(
            f"{len(bad_dtype)} tensor(s) with an unsupported dtype (F16, BF16 and F32 are "
            f"accepted): {_short(bad_dtype)}"
        )
    problems += dup
    if problems:
        family = "Moondream 3" if cfg.family == "moondream3" else "Moondream 2"
        raise ConvertError(
            f"the checkpoint does not match the {family} config in config.json:\n  - "
            + "\n  - ".join(problems)
        )
    return list(matched.values())


def _short(items, n=12):
    s = ", ".join(items[:n])
    return s + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def _read_float(ref) -> np.ndarray:
    return ref.read_float() if hasattr(ref, "read_float") else read_tensor(ref)


def _to_target(arr: np.ndarray, tgt: Target, transposed: bool, dt: np.dtype) -> np.ndarray:
    if tgt.transform == "T" or transposed:
        arr = np.swapaxes(arr, -1, -2)
    elif tgt.transform == "squeeze0":
        arr = arr[0]
    # float16/bfloat16 -> float32 is exact; -> bfloat16 rounds to nearest even.
    return arr.astype(dt)


def index_weights(hf_dir: str):
    """(name -> tensor ref, weight files) of a snapshot: `model.safetensors` or a sharded
    index, else kestrel's `model_fp8.pt` (a torch zip, read without torch)."""
    pt = os.path.join(hf_dir, "model_fp8.pt")
    if os.path.isfile(pt) and not any(os.path.isfile(os.path.join(hf_dir, f)) for f in (
            "model.safetensors", "model.safetensors.index.json")):
        from .torch_zip import index_torch_checkpoint

        pt = snapshot_file(hf_dir, "model_fp8.pt")   # no symlink out of the snapshot
        return index_torch_checkpoint(pt), [pt]
    return index_checkpoint(hf_dir)


def sha256_file(path: str) -> str:
    """sha256 hex digest of a file's bytes, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def convert(hf_dir: str, out_dir: str, *, dtype: str = "bfloat16", tokenizer: str | None = None,
            overwrite: bool = False, weights: str | None = None, log=print) -> MoondreamConfig:
    """Convert the HF snapshot `hf_dir` into a photon_jax checkpoint at `out_dir`.
    `weights`: quantize the float text weights ("int8", "fp8", "int4"; None: keep them)."""
    try:
        dtype = canonical(dtype)
        requested = Weights.of(weights)
    except (ValueError, ConfigError) as e:
        raise ConvertError(str(e)) from None
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"input directory not found: {hf_dir}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConvertError(f"output path exists and is not a directory: {out_dir}")
    src_abs, out_abs = os.path.realpath(hf_dir), os.path.realpath(out_dir)
    if src_abs == out_abs or src_abs.startswith(out_abs + os.sep):
        raise ConvertError(
            f"output directory {out_dir} is (or contains) the input {hf_dir}; choose another "
            "OUT_DIR (--overwrite would delete the input)"
        )
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ConvertError(f"output directory {out_dir} is not empty; pass --overwrite to replace it")
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConvertError(f"{cfg_path} not found: the HF snapshot's config.json is needed")
    # The snapshot's own files are read only inside it (safetensors_io.snapshot_file: a
    # symlink may lead into the snapshot or its Hugging Face cache blobs, nowhere else); a
    # --tokenizer the user names is theirs to choose.
    try:
        snapshot_file(hf_dir, "config.json")
        if tokenizer is None:
            snapshot_file(hf_dir, "tokenizer.json")
    except SafetensorsError as e:
        raise ConvertError(str(e)) from None
    if os.path.getsize(cfg_path) > _MAX_CONFIG_BYTES:   # a real one is a few KB
        raise ConvertError(f"{cfg_path}: {os.path.getsize(cfg_path):,} bytes, too large for a "
                           "model config; re-download it")
    try:
        with open(cfg_path) as f:
            cfg_json = json.load(f)
        cfg = from_hf_config_json(cfg_json, dtype=dtype)
    except RecursionError:
        raise ConvertError(f"{cfg_path}: not valid JSON (nested too deeply)") from None
    except ConfigError as e:
        raise ConvertError(f"{cfg_path}: {e}") from None
    except (ValueError, OverflowError) as e:   # JSONDecodeError, 5000-digit ints, 1e400
        raise ConvertError(f"{cfg_path}: not valid JSON or an impossible value "
                           f"({str(e)[:200]})") from None
    tok_path = tokenizer or os.path.join(hf_dir, "tokenizer.json")
    try:
        load_tokenizer(tok_path)
    except TokenizerError as e:
        raise ConvertError(str(e)) from None
    try:
        tensors, files = index_weights(hf_dir)
    except (SafetensorsError, ValueError) as e:
        raise ConvertError(str(e)) from None
    if cfg.family != "moondream3" and looks_md3(tensors):
        # Weights with tau / router / region.ln tensors are Moondream 3 whatever config.json's
        # model_type says.
        try:
            cfg = from_hf_config_json(cfg_json, dtype=dtype, md3=True)
        except ConfigError as e:
            raise ConvertError(f"{cfg_path}: {e}") from None
        except (ValueError, OverflowError) as e:
            raise ConvertError(f"{cfg_path}: an impossible value ({str(e)[:200]})") from None
    try:
        tensors, published = quantized.group(tensors, cfg.text.n_heads)
    except quantized.QuantizedLayoutError as e:
        raise ConvertError(str(e)) from None
    if cfg.weights.linear == "int4" and "int4" not in published:
        raise ConvertError(
            f"{cfg_path} sets text.group_size (Moondream 2's 4-bit layout: X.weight.packed, "
            "X.weight.scale, X.weight.zero_point) but the weights are float; remove "
            "group_size from config.json, or pass --weights int4 to quantize them")
    found = Weights(linear="int4" if "int4" in published else "",
                    experts="fp8" if "fp8 experts" in published else "")
    try:
        cfg = cfg.with_weights(found).with_weights(requested)
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    work = plan(cfg, tensors)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    index_files = [index] if os.path.isfile(index) else []

    # Validation done: build the output tree, one stored tensor at a time.
    dt = _NP[dtype]
    leaves = {path: np.empty(shape, sdt) for path, (shape, sdt) in
              flatten(param_specs(cfg, dtype)).items()}

    def put(path, arr):
        if tgt.layer is None:
            leaves[path][...] = arr
        else:
            leaves[path][tgt.layer] = arr

    for ref, tgt, transposed in work:
        fmt = weight_format(tgt.path, cfg)
        try:
            if fmt and isinstance(ref, quantized.Quantized) and ref.fmt == fmt:
                parts = ref.read_quant()          # as published, code for code
            elif fmt:
                parts = quant.quantize(_to_target(_read_float(ref), tgt, transposed,
                                                  np.dtype(np.float32)), fmt)
            else:
                parts = None
                put(tgt.path, _to_target(_read_float(ref), tgt, transposed, dt))
        except SafetensorsError as e:
            raise ConvertError(str(e)) from None
        for part, arr in (parts or {}).items():
            put((*tgt.path, part), arr)
        del parts
    # Hand orbax device arrays, one leaf at a time: given NumPy leaves it copies the whole tree
    # before writing (measured: peak = 2x the output), given jax.Arrays it does not.
    tree: dict = {}
    for path in list(leaves):
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = jax.device_put(leaves.pop(path), jax.devices("cpu")[0])

    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".photon-convert-", dir=parent)
    try:
        # mkdtemp makes a 0700 directory; give the checkpoint the usual umask-based mode.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        checkpoint.save_params(tmp, tree)
        shutil.copyfile(tok_path, os.path.join(tmp, "tokenizer.json"))
        provenance = {
            "converter_version": CONVERTER_VERSION,
            "dtype": dtype,
            "weights": asdict(cfg.weights),
            "source_dir": os.path.abspath(hf_dir),
            "source_sha256": {os.path.basename(p): sha256_file(p)
                              for p in [*files, *index_files, cfg_path]},
            "tokenizer_sha256": sha256_file(tok_path),
            "n_tensors": len(work),
            "n_params": int(sum(a.size for a in jax.tree.leaves(tree))),
        }
        checkpoint.write_metadata(tmp, cfg, provenance)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    nbytes = sum(a.nbytes for a in jax.tree.leaves(tree))
    log(f"wrote {out_dir}: {provenance['n_params']:,} values, {nbytes / 2**30:.2f} GiB "
        f"({dtype}; quantized: {cfg.weights.describe()}) from {len(work)} tensors")
    return cfg
