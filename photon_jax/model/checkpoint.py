"""The photon_jax checkpoint directory: write it, recognise it, restore it.

Layout: `params/` (an orbax checkpoint of the plain nested param dict), `config.json` (the
effective config and a format version), `tokenizer.json`, `provenance.json` (source file
sha256s, dtype, converter version).  Restoring always goes through an abstract tree of
`jax.ShapeDtypeStruct` with an explicit sharding, so a checkpoint written anywhere loads on
CPU or any single device, in its own dtype or cast to another.
"""

from __future__ import annotations

import json
import os

import jax

from .config import (FORMAT_VERSION, QUANTIZED_FORMAT_VERSION, READ_FORMAT_VERSIONS,
                     MoondreamConfig)
from .params import abstract_params


class CheckpointError(ValueError):
    pass


def is_hf_snapshot(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f))
               for f in ("model.safetensors", "model.safetensors.index.json", "model_fp8.pt"))


def read_config(path: str) -> MoondreamConfig:
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory not found: {path}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(os.path.join(path, "params")) or not os.path.isfile(cfg_path):
        if is_hf_snapshot(path):
            raise CheckpointError(
                f"{path} is a Hugging Face checkpoint, not a photon_jax one; convert it first: "
                f"photon-convert {path} OUT_DIR --tokenizer PATH/TO/tokenizer.json"
            )
        raise CheckpointError(
            f"{path} is not a photon_jax checkpoint (expected params/ and config.json, as "
            "written by photon-convert)"
        )
    with open(cfg_path) as f:
        d = json.load(f)
    version = d.get("format_version")
    if version not in READ_FORMAT_VERSIONS:
        raise CheckpointError(
            f"{cfg_path}: checkpoint format version {version!r}, this photon_jax reads "
            f"{' or '.join(map(str, READ_FORMAT_VERSIONS))}; re-run photon-convert"
        )
    return MoondreamConfig.from_dict(d["model"])


def write_metadata(path: str, cfg: MoondreamConfig, provenance: dict) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        version = QUANTIZED_FORMAT_VERSION if cfg.weights.any else FORMAT_VERSION
        json.dump({"format_version": version, "model": cfg.to_dict()}, f, indent=1)
    with open(os.path.join(path, "provenance.json"), "w") as f:
        json.dump(provenance, f, indent=1)


def save_params(path: str, params: dict) -> None:
    import orbax.checkpoint as ocp

    ck = ocp.StandardCheckpointer()
    ck.save(os.path.abspath(os.path.join(path, "params")), params)
    ck.wait_until_finished()


def restore_params(path: str, cfg: MoondreamConfig, dtype=None, device=None, tp=None) -> dict:
    """The params onto `device`, or with `tp` (`sharding.TensorParallel`) each array straight
    onto the chips of its mesh that hold it (no chip ever holds the whole model)."""
    import orbax.checkpoint as ocp

    device = device or jax.devices()[0]
    target = abstract_params(cfg, dtype or cfg.dtype,
                             sharding=jax.sharding.SingleDeviceSharding(device))
    if tp is not None:
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                              target, tp.param_shardings(target))
    ck = ocp.StandardCheckpointer()
    return ck.restore(os.path.abspath(os.path.join(path, "params")), target)
