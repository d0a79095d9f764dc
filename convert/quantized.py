"""The published quantized layouts, read as what they stand for.

Three published checkpoints store some weights as codes plus scales (docs/quantized-formats.md
gives the formats and where each fact comes from):

- Moondream 3.1 (`model.safetensors`) and Moondream 3 preview (`model_fp8.pt`), kestrel's
  "md3" layout: each MoE layer's `mlp.experts.weight` [E, 2I, H] and
  `mlp.output_experts.weight` [E, H, I] are float8_e4m3fn codes with float32 scales
  `moe_quant.up_scale` [E, 2I] / `down_scale` [E, H], one per expert and output row:
  W = f32(code) * scale.  (Also accepted under Hugging Face names, `mlp.fc1.weight` /
  `mlp.fc2.weight` in F8 beside `moe_quant.*_scale`, as moondream-station reads them.)
- Moondream 2's 4-bit release: each text layer's qkv / proj / fc1 / fc2 (and the region
  model's linears when its config says so) as `X.weight.packed` uint8 [out*in/256, 128],
  `X.weight.scale` and `X.weight.zero_point` [out*in/128, 1]: groups of 128 adjacent values
  of the row-major [out, in] weight, the high nibbles of packed row r holding group r and
  the low nibbles group r + G/2, W = (code - zero) * scale.  A group may run over a row's
  end when `in` is not a multiple of 128 (the reference's groups are flat).

How a 4-bit layer is kept (`Quantized.read_quant`): repacked into photon_jax's row-aligned
int4 layout, whose groups are g = gcd(128, in) input rows.  That is exact for every even
`in`, with no re-rounding: g divides 128 and `in`, so each run of g values of a row starts at
a multiple of g in the flat weight and lies inside one of the reference's groups of 128;
giving every such run its group's scale and zero point (each flat group's pair repeated
128/g times) reproduces W value for value, both bfloat16 roundings included.  At in % 128 ==
0 (every published layer) g = 128 and nothing is repeated.  Chosen over widening such a layer
to float because it keeps the layer 4-bit like its neighbours (the config's `weights` names
one format for all the text linears) and costs only larger scales (128/g times).  What the
layout cannot hold is refused by name: an odd `in` (two input rows share each byte) and a
stored shape that does not fit the layer.

`group(tensors)` replaces each such set of stored tensors by one `Quantized` entry under the
float weight's name, so the name table, the shape checks and the missing/unexpected report
work on them as on any tensor.  An entry reads as photon_jax's own quantized layout
(`photon_jax.model.quant`: codes for codes, no re-rounding) or, where the target leaf is
float, as its float32 values.  Kestrel's fused tau weight (`tau_wqwv`, wq's rows first) is
split here the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from photon_jax.model import quant

from .names import canonical_name
from .safetensors_io import TensorRef, read_tensor

FP8 = "F8_E4M3"


class QuantizedLayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Quantized:
    """One float weight stored as codes + scales.  `shape`/`dtype` as the float tensor
    would be stored (torch [.., out, in]); `fmt` photon_jax's format of it."""
    name: str
    fmt: str                      # "fp8" (per output row) or "int4" (flat groups of 128)
    shape: tuple[int, ...]
    parts: tuple[TensorRef, ...]  # fp8: (codes, scale); int4: (packed, scale, zero_point)
    dtype: str = "Q"

    def read_quant(self) -> dict:
        """photon_jax's layout, transposed to [.., in, out] as the converter's "T" does."""
        if self.fmt == "fp8":
            codes, scale = (read_tensor(r) for r in self.parts)
            return {"q": np.ascontiguousarray(np.swapaxes(codes, -1, -2)),
                    "s": scale.astype(np.float32)}
        packed, scale, zero = (read_tensor(r) for r in self.parts)
        out, inn = self.shape
        codes = np.concatenate([packed >> 4, packed & 15], axis=0).reshape(out, inn)
        s, z = (row_groups(v, out, inn) for v in (scale, zero))
        return {"q4": quant.pack_nibbles(np.ascontiguousarray(codes.T)),
                "s4": np.ascontiguousarray(s.T), "z4": np.ascontiguousarray(z.T)}

    def read_float(self) -> np.ndarray:
        """The weight as float32, in the stored (torch) orientation."""
        w = quant.dequantize(self.read_quant(), np.float32, xp=np)
        return np.ascontiguousarray(np.swapaxes(w, -1, -2))


def row_groups(per_flat_group: np.ndarray, out: int, inn: int) -> np.ndarray:
    """A value per flat group of 128 ([out*in/128, 1], the reference's scale or zero point)
    -> float32 [out, in/g], one per row-aligned group of g = gcd(128, in) (`quant.group_size`):
    run m of row o is flat elements (o*in + m*g) .. +g, inside flat group (o*in + m*g) // 128,
    so the flat t-th run takes value t // (128/g)."""
    g = quant.group_size(inn)
    v = per_flat_group.astype(np.float32).reshape(-1)
    return np.repeat(v, quant.GROUP // g).reshape(out, inn // g)


@dataclass(frozen=True)
class RowSlice:
    """Rows [start, stop) of a stored tensor (kestrel's fused `tau_wqwv`)."""
    name: str
    ref: TensorRef
    start: int
    stop: int

    @property
    def shape(self):
        return (self.stop - self.start, *self.ref.shape[1:])

    @property
    def dtype(self):
        return self.ref.dtype

    def read_float(self) -> np.ndarray:
        return read_tensor(self.ref)[self.start:self.stop]


_EXPERTS = re.compile(r"text\.blocks\.(\d+)\.mlp\.(fc1|fc2)\.weight\Z")


def group(tensors: dict, n_heads: int) -> tuple[dict, list[str]]:
    """Stored tensors (name -> TensorRef) -> the same with each published quantized set as
    one `Quantized` entry under its weight's stored name (and fused tau split in two
    `RowSlice`s); every other tensor keeps its stored name, so errors name what the file
    holds.  Also returns the published formats found ("fp8 experts", "int4")."""
    by_canon: dict[str, tuple[str, object]] = {}
    for name, ref in tensors.items():
        hf, transposed = canonical_name(name)
        if transposed:
            continue
        if hf in by_canon:
            raise QuantizedLayoutError(
                f"{name} and {by_canon[hf][0]} both name {hf} (after removing `model.` and "
                "`._orig_mod`); the checkpoint holds a tensor twice")
        by_canon[hf] = (name, ref)
    found: list[str] = []
    out = dict(tensors)

    def take(hf):
        name, ref = by_canon[hf]
        out.pop(name)
        return name, ref

    for hf, (name, ref) in by_canon.items():
        if hf.endswith(".weight.scales") or (hf.endswith(".weight.packed")
                                             and len(ref.shape) != 2):
            raise QuantizedLayoutError(
                f"{name}: an early layout of Moondream 2's 4-bit weights "
                f"(packed {list(ref.shape)}{', scales' if hf.endswith('scales') else ''}) "
                "that the published release does not use; download the current release")
        if hf.endswith(".weight.packed"):
            base = hf[: -len(".packed")]
            if base + ".scale" not in by_canon or base + ".zero_point" not in by_canon:
                raise QuantizedLayoutError(
                    f"{name} has no {base}.scale / {base}.zero_point beside it")
            scale, zero = by_canon[base + ".scale"][1], by_canon[base + ".zero_point"][1]
            g = int(np.prod(scale.shape))
            if ref.dtype != "U8" or g % 2 or tuple(ref.shape) != (g // 2, 128) or \
                    tuple(zero.shape) != tuple(scale.shape):
                raise QuantizedLayoutError(
                    f"{name}: {ref.dtype}{list(ref.shape)} with scale {list(scale.shape)}: "
                    "not the 4-bit layout (uint8 [G/2, 128] for an even number G of groups of "
                    "128)")
            for k in (hf, base + ".scale", base + ".zero_point"):
                take(k)
            out[name[: -len(".packed")]] = Md2Pending(base, g, (ref, scale, zero))
            if "int4" not in found:
                found.append("int4")
        m = _EXPERTS.match(hf)
        if m and ref.dtype == FP8:
            i, which = m.groups()
            sname = f"text.blocks.{i}.moe_quant.{'up' if which == 'fc1' else 'down'}_scale"
            if sname not in by_canon:
                raise QuantizedLayoutError(
                    f"{name} is float8 but its scale {sname} (kestrel: "
                    f"text_model.transformer.h.{i}.moe_quant.*) is missing")
            scale = by_canon[sname][1]
            if len(ref.shape) != 3 or tuple(scale.shape) != tuple(ref.shape[:2]):
                raise QuantizedLayoutError(
                    f"{name} {list(ref.shape)} with scale {list(scale.shape)}: expected "
                    "[E, out, in] codes and an [E, out] scale")
            take(sname)
            out[name] = Quantized(hf, "fp8", tuple(ref.shape), (ref, scale))
            if "fp8 experts" not in found:
                found.append("fp8 experts")
        if hf.endswith(".attn.tau.wqwv"):
            base = hf[: -len("wqwv")]
            if len(ref.shape) != 2 or ref.shape[0] != 2 * n_heads:
                raise QuantizedLayoutError(
                    f"{name}: shape {list(ref.shape)}, expected [2 x {n_heads} heads, dim] "
                    "(wq's rows, then wv's)")
            rows = ref.shape[0]
            take(hf)
            out[base + "wq"] = RowSlice(base + "wq", ref, 0, n_heads)
            out[base + "wv"] = RowSlice(base + "wv", ref, n_heads, rows)
    return out, found


@dataclass(frozen=True)
class Md2Pending:
    """A 4-bit weight whose [out, in] comes from the target leaf (the file stores only the
    group count): `resolve(out, in)` makes the `Quantized` entry."""
    name: str
    groups: int
    parts: tuple
    dtype: str = "Q"

    def resolve(self, shape: tuple[int, ...]) -> Quantized:
        """`shape`: the layer's [out, in], whose out*in the caller has matched to the
        groups.  Any `in` that photon_jax's int4 layout holds loads exactly (a group running
        over a row's end included: `row_groups`); an odd one is refused."""
        out, inn = shape
        if out * inn != self.groups * quant.GROUP:
            raise QuantizedLayoutError(
                f"{self.name}: {self.groups} groups of 128 values cannot be a [{out}, {inn}] "
                "weight; the checkpoint does not belong to this config.json")
        if inn % 2:
            raise QuantizedLayoutError(
                f"{self.name}: a [{out}, {inn}] 4-bit layer; photon_jax's 4-bit layout packs "
                f"two input rows per byte and needs an even input dimension, not {inn}; "
                "convert the float release of this model instead")
        return Quantized(self.name, "int4", (out, inn), self.parts)
