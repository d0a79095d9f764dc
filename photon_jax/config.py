"""Model configuration: frozen, hashable dataclasses and the presets.

Owns the one description of a Moondream model's shape (`MoondreamConfig`), the presets
`moondream2()` and `tiny()`, and the translation from the reference's config dict (the nested
`config` section of a Hugging Face `config.json`, applied as overrides on the reference
defaults) into it.  Everything is a tuple or scalar so a config can be a static argument of
`jax.jit`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields, replace
from typing import Any

# Version of the checkpoint directory layout written by `photon-convert`.
FORMAT_VERSION = 1


class ConfigError(ValueError):
    """A config dict that does not describe a model this package can run."""


@dataclass(frozen=True)
class TextConfig:
    dim: int = 2048
    ff_dim: int = 8192
    n_layers: int = 24
    vocab_size: int = 51200
    max_context: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 32
    prefix_attn: int = 730
    group_size: int | None = None
    # Not in the reference's config dict: the reference hard-codes these two.
    rope_theta: float = 10000.0
    rope_dim: int = 32

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim


@dataclass(frozen=True)
class VisionConfig:
    enc_dim: int = 1152
    enc_patch_size: int = 14
    enc_n_layers: int = 27
    enc_ff_dim: int = 4304
    enc_n_heads: int = 16
    proj_out_dim: int = 2048
    crop_size: int = 378
    in_channels: int = 3
    max_crops: int = 12
    overlap_margin: int = 4
    proj_inner_dim: int = 8192

    @property
    def grid(self) -> int:
        """Patches per crop side (27)."""
        return self.crop_size // self.enc_patch_size

    @property
    def n_patches(self) -> int:
        return self.grid * self.grid

    @property
    def patch_dim(self) -> int:
        return self.enc_patch_size * self.enc_patch_size * self.in_channels


@dataclass(frozen=True)
class RegionConfig:
    dim: int = 2048
    coord_feat_dim: int = 256
    coord_out_dim: int = 1024
    size_feat_dim: int = 512
    size_out_dim: int = 2048
    inner_dim: int = 8192
    group_size: int | None = None


def _tup(x):
    return tuple(int(i) for i in x)


@dataclass(frozen=True)
class TokenizerConfig:
    bos_id: int = 0
    eos_id: int = 0
    answer_id: int = 3
    thinking_id: int = 4
    coord_id: int = 5
    size_id: int = 6
    start_ground_points_id: int = 7
    end_ground_id: int = 9
    caption_short: tuple[int, ...] = (1, 32708, 2, 12492, 3)
    caption_normal: tuple[int, ...] = (1, 32708, 2, 6382, 3)
    caption_long: tuple[int, ...] = (1, 32708, 2, 4059, 3)
    query_prefix: tuple[int, ...] = (1, 15381, 2)
    query_suffix: tuple[int, ...] = (3,)
    detect_prefix: tuple[int, ...] = (1, 7235, 476, 2)
    detect_suffix: tuple[int, ...] = (3,)
    point_prefix: tuple[int, ...] = (1, 2581, 2)
    point_suffix: tuple[int, ...] = (3,)

    def templates_dict(self) -> dict:
        """The reference's nested `templates` schema."""
        return {
            "caption": {
                "short": list(self.caption_short),
                "normal": list(self.caption_normal),
                "long": list(self.caption_long),
            },
            "query": {"prefix": list(self.query_prefix), "suffix": list(self.query_suffix)},
            "detect": {"prefix": list(self.detect_prefix), "suffix": list(self.detect_suffix)},
            "point": {"prefix": list(self.point_prefix), "suffix": list(self.point_suffix)},
        }

    def max_template_id(self) -> int:
        return max(
            max(v)
            for f in fields(self)
            if isinstance(v := getattr(self, f.name), tuple) and v
        )


@dataclass(frozen=True)
class MoondreamConfig:
    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    region: RegionConfig = field(default_factory=RegionConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    family: str = "moondream2"
    # Name of the compute/storage dtype ("float32" or "bfloat16"); see `photon_jax.dtypes`.
    dtype: str = "bfloat16"

    @property
    def prefix_len(self) -> int:
        """BOS + image tokens: the bidirectional prefix (730)."""
        return 1 + self.vision.n_patches

    def with_dtype(self, dtype: str) -> "MoondreamConfig":
        return replace(self, dtype=dtype)

    def validate(self) -> "MoondreamConfig":
        t, v, r, tok = self.text, self.vision, self.region, self.tokenizer
        problems = []
        if t.group_size is not None or r.group_size is not None:
            problems.append(
                "group_size is set: int4-quantized Moondream checkpoints are not supported; "
                "convert the bf16 release instead"
            )
        if t.dim % t.n_heads:
            problems.append(f"text.dim {t.dim} is not divisible by text.n_heads {t.n_heads}")
        elif t.n_heads % t.n_kv_heads:
            problems.append(
                f"text.n_heads {t.n_heads} is not a multiple of text.n_kv_heads {t.n_kv_heads}"
            )
        elif t.rope_dim > t.head_dim or t.rope_dim % 2:
            problems.append(f"rotary dim {t.rope_dim} does not fit head dim {t.head_dim}")
        if v.enc_dim % v.enc_n_heads:
            problems.append(
                f"vision.enc_dim {v.enc_dim} is not divisible by vision.enc_n_heads {v.enc_n_heads}"
            )
        if v.crop_size % v.enc_patch_size:
            problems.append("vision.crop_size is not a multiple of vision.enc_patch_size")
        if v.grid <= 2 * v.overlap_margin:
            problems.append("vision.overlap_margin leaves no crop window")
        if v.proj_out_dim != t.dim or r.dim != t.dim:
            problems.append(
                f"vision.proj_out_dim ({v.proj_out_dim}) and region.dim ({r.dim}) must equal "
                f"text.dim ({t.dim})"
            )
        if r.size_out_dim != 2 * r.coord_out_dim:
            problems.append("region.size_out_dim must be 2 * region.coord_out_dim")
        if r.coord_feat_dim % 2 or r.size_feat_dim % 2:
            problems.append("region feature dims must be even (cos and sin halves)")
        if tok.max_template_id() >= t.vocab_size:
            problems.append(
                f"a prompt template uses id {tok.max_template_id()} but text.vocab_size is "
                f"{t.vocab_size}"
            )
        if t.max_context <= self.prefix_len:
            problems.append(f"text.max_context {t.max_context} leaves no room after the image")
        if problems:
            raise ConfigError("invalid Moondream config: " + "; ".join(problems))
        return self

    # -- serialization -------------------------------------------------------------------

    def to_dict(self) -> dict:
        tok = {f.name: getattr(self.tokenizer, f.name) for f in fields(TokenizerConfig)}
        tok = {k: v for k, v in tok.items() if not isinstance(v, tuple)}
        tok["templates"] = self.tokenizer.templates_dict()
        return {
            "family": self.family,
            "dtype": self.dtype,
            "text": dataclasses.asdict(self.text),
            "vision": dataclasses.asdict(self.vision),
            "region": dataclasses.asdict(self.region),
            "tokenizer": tok,
        }

    @classmethod
    def from_dict(cls, d: dict, *, base: "MoondreamConfig | None" = None,
                  extra_text_keys: bool = True) -> "MoondreamConfig":
        """Apply a reference-schema dict as overrides on `base` (default: Moondream 2).

        Unknown sections or keys are refused: a silently ignored key would build a model of the
        wrong shape.  `extra_text_keys` allows our own additions (rope_theta, rope_dim), which
        the reference's schema does not have.
        """
        base = base or moondream2()
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a dict, got {type(d).__name__}")
        allowed_top = {"text", "vision", "region", "tokenizer", "family", "dtype"}
        unknown = sorted(set(d) - allowed_top)
        if unknown:
            raise ConfigError(
                f"unknown config section(s) {unknown}; expected some of "
                "['text', 'vision', 'region', 'tokenizer']"
            )
        text = _override(base.text, d.get("text", {}), "text",
                         skip=() if extra_text_keys else ("rope_theta", "rope_dim"))
        vision = _override(base.vision, d.get("vision", {}), "vision")
        region = _override(base.region, d.get("region", {}), "region")
        tok = _tokenizer_override(base.tokenizer, d.get("tokenizer", {}))
        out = MoondreamConfig(
            text=text, vision=vision, region=region, tokenizer=tok,
            family=d.get("family", base.family), dtype=d.get("dtype", base.dtype),
        )
        return out.validate()


def _override(obj, overrides: Any, section: str, skip: tuple = ()):
    if not isinstance(overrides, dict):
        raise ConfigError(f"config section {section!r} must be a dict")
    names = {f.name: f for f in fields(obj)}
    for s in skip:
        names.pop(s, None)
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {unknown} in config section {section!r}; known keys: "
            f"{sorted(names)}"
        )
    kw = {}
    for k, val in overrides.items():
        default = getattr(obj, k)
        if val is None:
            if default is not None:
                raise ConfigError(f"config {section}.{k} must not be null")
            kw[k] = None
        elif isinstance(default, str):
            kw[k] = str(val)
        elif isinstance(default, float) and not isinstance(val, bool):
            kw[k] = float(val)
        elif isinstance(val, bool) or not isinstance(val, (int, float)) or int(val) != val:
            raise ConfigError(f"config {section}.{k} must be an integer, got {val!r}")
        else:
            kw[k] = int(val)
        if isinstance(kw[k], int) and not isinstance(kw[k], bool) and kw[k] <= 0 and default:
            raise ConfigError(f"config {section}.{k} must be positive, got {val!r}")
    return replace(obj, **kw)


_TEMPLATE_FIELDS = {
    ("caption", "short"): "caption_short",
    ("caption", "normal"): "caption_normal",
    ("caption", "long"): "caption_long",
    ("query", "prefix"): "query_prefix",
    ("query", "suffix"): "query_suffix",
    ("detect", "prefix"): "detect_prefix",
    ("detect", "suffix"): "detect_suffix",
    ("point", "prefix"): "point_prefix",
    ("point", "suffix"): "point_suffix",
}


def _tokenizer_override(base: TokenizerConfig, d: Any) -> TokenizerConfig:
    if not isinstance(d, dict):
        raise ConfigError("config section 'tokenizer' must be a dict")
    d = dict(d)
    templates = d.pop("templates", None)
    tok = _override(
        base, d, "tokenizer",
        skip=tuple(_TEMPLATE_FIELDS.values()),
    )
    if templates is None:
        return tok
    if not isinstance(templates, dict):
        raise ConfigError("config tokenizer.templates must be a dict")
    kw = {}
    for skill, sub in templates.items():
        if sub is None:
            raise ConfigError(
                f"config tokenizer.templates.{skill} is null: models without the {skill} "
                "skill are not supported"
            )
        if not isinstance(sub, dict):
            raise ConfigError(f"config tokenizer.templates.{skill} must be a dict")
        for part, ids in sub.items():
            key = (skill, part)
            if key not in _TEMPLATE_FIELDS:
                raise ConfigError(f"unknown template tokenizer.templates.{skill}.{part}")
            if not isinstance(ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
            ):
                raise ConfigError(
                    f"template tokenizer.templates.{skill}.{part} must be a list of token ids"
                )
            kw[_TEMPLATE_FIELDS[key]] = _tup(ids)
    return replace(tok, **kw)


# -- presets ------------------------------------------------------------------------------


def moondream2(dtype: str = "bfloat16") -> MoondreamConfig:
    """The real Moondream 2 (HF vikhyatk/moondream2, revision 2025-06-21)."""
    return MoondreamConfig(dtype=dtype)


def tiny(dtype: str = "float32") -> MoondreamConfig:
    """The fixture model of tests/fixtures/moondream2-tiny (and its hold-out siblings' family)."""
    return MoondreamConfig(
        text=TextConfig(dim=64, ff_dim=256, n_layers=2, vocab_size=32768, n_heads=1,
                        n_kv_heads=1),
        vision=VisionConfig(enc_dim=16, enc_ff_dim=32, enc_n_heads=2, proj_out_dim=64,
                            proj_inner_dim=128),
        region=RegionConfig(dim=64, inner_dim=128),
        dtype=dtype,
    )


def from_hf_config_json(cfg_json: dict, dtype: str = "bfloat16") -> MoondreamConfig:
    """The effective config of a Hugging Face Moondream 2 `config.json`.

    The reference's own HF wrapper ignores the nested `config` dict; `MoondreamConfig.from_dict`
    of the reference applies it on the defaults, and so do we.  Unknown top-level keys
    (auto_map, architectures, torch_dtype, ...) are ignored; unknown keys inside `config` are
    refused.
    """
    if not isinstance(cfg_json, dict):
        raise ConfigError("config.json must hold a JSON object")
    inner = cfg_json.get("config", {}) or {}
    if not isinstance(inner, dict):
        raise ConfigError("config.json: 'config' must be an object")
    unknown = sorted(set(inner) - {"text", "vision", "region", "tokenizer"})
    if unknown:
        raise ConfigError(
            f"config.json: unknown key(s) {unknown} in 'config'; expected some of "
            "['text', 'vision', 'region', 'tokenizer']"
        )
    return MoondreamConfig.from_dict(inner, base=moondream2(dtype), extra_text_keys=False)
