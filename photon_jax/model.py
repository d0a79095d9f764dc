"""A loaded model: config, params on one device or over a mesh, compiled programs and the
tokenizer.

`programs` are the engine's (`step.EnginePrograms`); `oracle_programs`, built on first use,
the one-request path's (`step.OraclePrograms`: `reference`, the parity tests).  The params
keep the text layers as lists of per-layer dicts, unstacked once here
(`text.unstack_layers`): the serving programs unroll the layer loop over them.
`attention` picks the decode attention (`step.ATTENTION`; by default `step.choose`'s).
`mesh` (one axis, "model"): the params and the engine's programs split over its devices
(`sharding`); `placement` is where host data for a program goes (the one device, or
replicated over the mesh)."""

from __future__ import annotations

import os
from functools import cached_property
from typing import Callable

import jax

from . import checkpoint, sharding, step, text
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
    def __init__(self, cfg: MoondreamConfig, params: dict, tokenizer, device=None,
                 attention: str | None = None, mesh=None, *, free_stacked: bool = False):
        """`params` stacked (the checkpoint layout) or already unstacked.  `free_stacked`:
        delete each stacked array once sliced (params no one else holds: `load`'s)."""
        self.cfg = cfg
        if mesh is not None and device is not None:
            raise ValueError("pass device or mesh, not both")
        self.device = (resolve_device(device) if mesh is None else
                       sharding.check_mesh(mesh).devices.flat[0])
        self.platform = step.choose(cfg, self.device.platform, attention)
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
        self.programs = step.build_for(cfg, self.platform, tp=self.tp)
        self.prompts = Prompts(tokenizer, cfg.tokenizer)

    @cached_property
    def oracle_programs(self) -> step.OraclePrograms:
        return step.oracle_for(self.cfg, self.platform)

    @property
    def mesh(self):
        return None if self.tp is None else self.tp.mesh

    @classmethod
    def load(cls, path: str, *, dtype=None, device=None, attention: str | None = None,
             mesh=None,
             preflight: Callable[[MoondreamConfig, jax.Device], None] | None = None
             ) -> "Model":
        """dtype None: the checkpoint's dtype on an accelerator; float32 on CPU
        (`step.default_dtype`).
        `attention`: the decode attention (`step.ATTENTION`; None: the device's default).
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
                             step.default_dtype(dev.platform, cfg.dtype))
        if preflight is not None:
            preflight(cfg, dev)
        tp = None if mesh is None else sharding.TensorParallel(mesh)
        params = checkpoint.restore_params(path, cfg, device=dev, tp=tp)
        tok = load_tokenizer(os.path.join(path, "tokenizer.json"))
        return cls(cfg, params, tok, device=None if mesh is not None else dev,
                   attention=attention, mesh=mesh, free_stacked=True)
