"""A loaded model: config, params on one device or over a mesh, the tokenizer's prompts,
and the platform record of what that device runs (`platforms.choose`).

The params keep the text layers as lists of per-layer dicts, unstacked once here
(`text.unstack_layers`): the serving programs unroll the layer loop over them.
`attention` picks the decode attention (`platforms.ATTENTION`; by default the device's).
`mesh` (one axis, "model"): the params split over its devices (`sharding`); `placement` is
where host data for a program goes (the one device, or replicated over the mesh).

A `Model` holds no compiled program: the engine builds its programs from `cfg`, `platform`
and `tp` (`engine.step.programs_of`), cached per config, so two engines on one model share
them.  It is all that `functional`'s pure functions need (`cfg`, `params`, `prompts`)."""

from __future__ import annotations

import os
from typing import Callable

import jax

from ..base.dtypes import canonical
from . import checkpoint, platforms, sharding, text
from .config import MoondreamConfig
from .params import quantize_params
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
    def __init__(self, cfg: MoondreamConfig, params: dict, tokenizer, device=None,
                 attention: str | None = None, mesh=None, *, free_stacked: bool = False):
        """`params` stacked (the checkpoint layout) or already unstacked.  `free_stacked`:
        delete each stacked array once sliced (params no one else holds: `load`'s)."""
        self.cfg = cfg
        if mesh is not None and device is not None:
            raise ValueError("pass device or mesh, not both")
        self.device = (resolve_device(device) if mesh is None else
                       sharding.check_mesh(mesh).devices.flat[0])
        self.platform = platforms.choose(cfg, self.device.platform, attention)
        params = text.unstack_layers(params, free=free_stacked)
        if mesh is None:
            self.tp = None
            self.placement = jax.sharding.SingleDeviceSharding(self.device)
            self.params = params
        else:
            self.tp = sharding.TensorParallel(mesh, pack=self.platform.pack)
            self.placement = self.tp.replicated
            # A no-op for params `load` read onto the mesh; places any others.
            self.params = jax.device_put(params, self.tp.param_shardings(params))
        self.attention = self.platform.attention
        self.prompts = Prompts(tokenizer, cfg.tokenizer)

    @property
    def mesh(self):
        return None if self.tp is None else self.tp.mesh

    @classmethod
    def load(cls, path: str, *, dtype=None, device=None, attention: str | None = None,
             mesh=None, weights: str | None = None,
             preflight: Callable[[MoondreamConfig, jax.Device], None] | None = None
             ) -> "Model":
        """dtype None: the checkpoint's dtype on an accelerator; float32 on CPU
        (`platforms.default_dtype`).
        `weights`: "int8", "fp8" or "int4" quantizes the text model's linear layers, experts
        and head as they load (`config.Weights.of`; weights the checkpoint already holds
        quantized stay as they are).  The float weights are read onto the host and each is
        quantized there before it moves: the device only ever holds the codes.
        `attention`: the decode attention (`platforms.ATTENTION`; None: the device's default).
        `mesh`: a `jax.sharding.Mesh` with the one axis "model": each weight is read
        straight onto the chips that hold it (`sharding`).  `preflight(cfg, device)` runs
        before any weight is read (the memory check; `device`: the mesh's first)."""
        path = os.fspath(path)
        cfg = checkpoint.read_config(path)
        if mesh is not None:
            if device is not None:
                raise ValueError("pass device or mesh, not both")
            dev = sharding.check_mesh(mesh).devices.flat[0]
        else:
            dev = resolve_device(device)
        cfg = cfg.with_dtype(canonical(dtype) if dtype is not None else
                             platforms.default_dtype(dev.platform, cfg.dtype))
        stored = cfg
        if weights is not None:
            cfg = cfg.with_weights(weights)
        if preflight is not None:
            preflight(cfg, dev)
        tp = None if mesh is None else sharding.TensorParallel(mesh)
        if cfg.weights == stored.weights:
            params = checkpoint.restore_params(path, cfg, device=dev, tp=tp)
        else:
            host = jax.devices("cpu")[0]
            params = quantize_params(checkpoint.restore_params(path, stored, device=host),
                                     cfg, free=True)
            if mesh is None:
                moved = jax.device_put(params, dev)
                if dev != host:
                    jax.tree.map(lambda a: a.delete(), params)
                params = moved
        tok = load_tokenizer(os.path.join(path, "tokenizer.json"))
        return cls(cfg, params, tok, device=None if mesh is not None else dev,
                   attention=attention, mesh=mesh, free_stacked=True)
