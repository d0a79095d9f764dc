"""The conversion itself: validate everything first, then stream tensors into the output tree,
then write the checkpoint into a temporary sibling directory and rename it into place.

Nothing is written until every name, shape and dtype has been checked, and a failure while
writing leaves no half-written OUT_DIR behind.  Peak memory is the output tree plus one
source tensor and its converted copy.

The family (Moondream 2 or 3) comes from config.json (`model_type`, or Moondream 3-only keys)
and from the tensor names (tau, router, region LayerNorm: Moondream 3 whatever config.json
says); a Moondream 3 config is merged onto the Moondream 3 defaults.  fp8 expert checkpoints
are refused (see `_MD3_BF16_HINT`).
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
from photon_jax.model.config import ConfigError, from_hf_config_json, MoondreamConfig
from photon_jax.model.params import flatten, param_shapes
from photon_jax.model.tokenizer import load_tokenizer, TokenizerError

from .names import Target, canonical_name, fp8_expert_names, hf_table, looks_md3, stored_shape
from .safetensors_io import DTYPES, SafetensorsError, index_checkpoint, read_tensor

CONVERTER_VERSION = "1"
_NP = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


class ConvertError(ValueError):
    pass


_MD3_BF16_HINT = ("convert the bf16 Hugging Face release (moondream/moondream3-preview, "
                  "model*.safetensors) instead")


def _leaf_shapes(cfg):
    return flatten(param_shapes(cfg))


def plan(cfg: MoondreamConfig, tensors: dict) -> list[tuple[object, Target, bool]]:
    """Match stored tensors to the tree; raise ConvertError listing every problem."""
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
        if ref.dtype not in DTYPES:
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


def _to_target(arr: np.ndarray, tgt: Target, transposed: bool, dt: np.dtype) -> np.ndarray:
    if tgt.transform == "T" or transposed:
        arr = np.swapaxes(arr, -1, -2)
    elif tgt.transform == "squeeze0":
        arr = arr[0]
    # float16/bfloat16 -> float32 is exact; -> bfloat16 rounds to nearest even.
    return arr.astype(dt)


def sha256_file(path: str) -> str:
    """sha256 hex digest of a file's bytes, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def convert(hf_dir: str, out_dir: str, *, dtype: str = "bfloat16", tokenizer: str | None = None,
            overwrite: bool = False, log=print) -> MoondreamConfig:
    """Convert the HF snapshot `hf_dir` into a photon_jax checkpoint at `out_dir`."""
    try:
        dtype = canonical(dtype)
    except ValueError as e:
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
    try:
        with open(cfg_path) as f:
            cfg_json = json.load(f)
        cfg = from_hf_config_json(cfg_json, dtype=dtype)
    except json.JSONDecodeError as e:
        raise ConvertError(f"{cfg_path}: not valid JSON ({e})") from None
    except ConfigError as e:
        raise ConvertError(f"{cfg_path}: {e}") from None
    tok_path = tokenizer or os.path.join(hf_dir, "tokenizer.json")
    try:
        load_tokenizer(tok_path)
    except TokenizerError as e:
        raise ConvertError(str(e)) from None
    if (os.path.isfile(os.path.join(hf_dir, "model_fp8.pt"))
            and not os.path.isfile(os.path.join(hf_dir, "model.safetensors"))):
        raise ConvertError(f"{hf_dir}/model_fp8.pt is kestrel's fp8 torch pickle, which is not "
                           "supported; " + _MD3_BF16_HINT)
    try:
        tensors, files = index_checkpoint(hf_dir)
    except SafetensorsError as e:
        raise ConvertError(str(e)) from None
    fp8 = fp8_expert_names(tensors) or sorted(
        n for n, r in tensors.items() if r.dtype.startswith("F8"))
    if fp8:
        raise ConvertError(
            f"fp8-quantized expert weights ({_short(fp8, 4)}): the fp8 layout of "
            "moondream3.1-9B-A2B (scales per expert and output channel) is not documented "
            "well enough to dequantize with confidence, so it is refused rather than guessed; "
            + _MD3_BF16_HINT)
    if cfg.family != "moondream3" and looks_md3(tensors):
        # Weights with tau / router / region.ln tensors are Moondream 3 whatever config.json's
        # model_type says.
        try:
            cfg = from_hf_config_json(cfg_json, dtype=dtype, md3=True)
        except ConfigError as e:
            raise ConvertError(f"{cfg_path}: {e}") from None
    work = plan(cfg, tensors)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    index_files = [index] if os.path.isfile(index) else []

    # Validation done: build the output tree, one stored tensor at a time.
    dt = _NP[dtype]
    leaves = {path: np.empty(shape, dt) for path, shape in _leaf_shapes(cfg).items()}
    for ref, tgt, transposed in work:
        try:
            arr = _to_target(read_tensor(ref), tgt, transposed, dt)
        except SafetensorsError as e:
            raise ConvertError(str(e)) from None
        if tgt.layer is None:
            leaves[tgt.path][...] = arr
        else:
            leaves[tgt.path][tgt.layer] = arr
        del arr
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
    log(f"wrote {out_dir}: {provenance['n_params']:,} parameters ({dtype}) from "
        f"{len(work)} tensors")
    return cfg
