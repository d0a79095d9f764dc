"""A loaded model: config, params on one device, compiled programs and the tokenizer."""

from __future__ import annotations

import os

import jax

from . import checkpoint, step
from .config import MoondreamConfig
from .dtypes import canonical
from .tokenizer import Prompts, load_tokenizer


def resolve_device(device):
    if device is None:
        return jax.devices()[0]
    if isinstance(device, int):
        devs = jax.devices()
        if not 0 <= device < len(devs):
            raise ValueError(f"device index {device} out of range: {len(devs)} device(s)")
        return devs[device]
    if isinstance(device, jax.Device):
        return device
    raise TypeError(f"device must be a jax.Device, an index or None, got {device!r}")


class Model:
    def __init__(self, cfg: MoondreamConfig, params: dict, tokenizer, device=None):
        self.cfg = cfg
        self.params = params
        self.device = resolve_device(device)
        self.programs = step.build(cfg)
        self.prompts = Prompts(tokenizer, cfg.tokenizer)

    @classmethod
    def load(cls, path: str, *, dtype=None, device=None) -> "Model":
        path = os.fspath(path)
        cfg = checkpoint.read_config(path)
        if dtype is not None:
            cfg = cfg.with_dtype(canonical(dtype))
        dev = resolve_device(device)
        params = checkpoint.restore_params(path, cfg, device=dev)
        tok = load_tokenizer(os.path.join(path, "tokenizer.json"))
        return cls(cfg, params, tok, device=dev)
