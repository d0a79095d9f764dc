"""Model configuration: frozen, hashable dataclasses and the presets.

Owns the one description of a Moondream model's shape (`MoondreamConfig`), the presets
`moondream2()`, `tiny()`, `moondream3()` and `tiny_md3()`, and the translation from the
reference's config dict (the nested `config` section of a Hugging Face `config.json`, applied
as overrides on the reference defaults of its family) into it.  Everything is a tuple, scalar
or frozen dataclass so a config can be a static argument of `jax.jit`.

Moondream 3 differs from Moondream 2 only by data in here: `text.moe` (which layers are
mixtures of experts, how many experts, top-k, expert width), `text.tau` (tau attention),
`text.rope_theta`, and the region heads' `decoder_arch` / `use_ln`.  Model code reads these
fields; it never branches on the family name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields, replace
from typing import Any

# Version of the checkpoint directory layout written by `photon-convert`: 2 for a checkpoint
# with quantized weights (a `weights` section; readers of version 1 refuse it cleanly), 1
# otherwise, so float checkpoints written before quantization existed still load.
FORMAT_VERSION = 1
QUANTIZED_FORMAT_VERSION = 2
READ_FORMAT_VERSIONS = (1, 2)


class ConfigError(ValueError):
    """A config dict that does not describe a model this package can run."""


@dataclass(frozen=True)
class MoEConfig:
    """Layers `start_layer`.. of the text model replace the MLP with a mixture of experts."""
    num_experts: int = 64
    start_layer: int = 4
    experts_per_token: int = 8
    expert_inner_dim: int = 1024


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
    # Not in the Moondream 2 reference's config dict: it hard-codes these two (Moondream 3's
    # schema has rope_theta).
    rope_theta: float = 10000.0
    rope_dim: int = 32
    moe: MoEConfig | None = None
    # Tau attention (Moondream 3): per-token, per-head scales of q and v.
    tau: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_dense(self) -> int:
        """Leading layers with the dense MLP; the rest (if any) are mixture-of-experts."""
        return self.n_layers if self.moe is None else self.moe.start_layer

    @property
    def n_moe(self) -> int:
        return self.n_layers - self.n_dense

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
    # "mlp" (Moondream 2: fc1 -> GELU -> fc2) or "linear" (Moondream 3: one linear layer).
    decoder_arch: str = "mlp"
    # Moondream 3: a LayerNorm (`region.ln`) before the decoders.
    use_ln: bool = False


def _tup(x):
    return tuple(int(i) for i in x)


# What a position of the text model's input feeds (`text.input_embeddings`): a token id, a
# coordinate value or a (w, h) size.  Prompts with spatial refs (`tokenizer.region_inputs`)
# and detect / point decoding feed region values back this way.
KIND_TOKEN, KIND_COORD, KIND_SIZE = range(3)
# A prompt position inside an image block (a conversation's image after its start): its
# input is that image's embedding, and attention is bidirectional across the block.
KIND_IMAGE = 3


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
    # Moondream 3 only (empty: the model has no segment skill).
    segment_prefix: tuple[int, ...] = ()
    segment_suffix: tuple[int, ...] = ()

    def templates_dict(self) -> dict:
        """The reference's nested `templates` schema."""
        seg = ({"segment": {"prefix": list(self.segment_prefix),
                            "suffix": list(self.segment_suffix)}}
               if self.segment_prefix else {})
        return {
            "caption": {
                "short": list(self.caption_short),
                "normal": list(self.caption_normal),
                "long": list(self.caption_long),
            },
            "query": {"prefix": list(self.query_prefix), "suffix": list(self.query_suffix)},
            "detect": {"prefix": list(self.detect_prefix), "suffix": list(self.detect_suffix)},
            "point": {"prefix": list(self.point_prefix), "suffix": list(self.point_suffix)},
            **seg,
        }

    def max_template_id(self) -> int:
        return max(
            max(v)
            for f in fields(self)
            if isinstance(v := getattr(self, f.name), tuple) and v
        )


# The quantized weight formats (`quant.FORMATS`; kept here so the config imports nothing).
WEIGHT_FORMATS = ("int8", "fp8", "int4")


@dataclass(frozen=True)
class Weights:
    """Which weights are stored quantized, and in which format ("": the model dtype).
    `linear`: the text layers' qkv, proj and dense MLP; `experts`: the mixture-of-experts
    stacks; `head`: the LM head (8-bit only); `region`: the region model's linear layers
    (Moondream 2's 4-bit release quantizes them when its config sets region.group_size)."""
    linear: str = ""
    experts: str = ""
    head: str = ""
    region: str = ""

    @classmethod
    def of(cls, fmt: str | None) -> "Weights":
        """The preset `--weights FMT` asks for: every text linear layer and expert in FMT,
        the head in FMT (int8 for int4: the head is read whole every step and its error
        reaches every logit directly)."""
        if not fmt:
            return cls()
        if fmt not in WEIGHT_FORMATS:
            raise ConfigError(f"weights={fmt!r} is not a weight format; choose one of "
                              f"{', '.join(WEIGHT_FORMATS)}")
        return cls(linear=fmt, experts=fmt, head="int8" if fmt == "int4" else fmt)

    def fill(self, other: "Weights") -> "Weights":
        """These formats, with `other`'s where these are unset (a published checkpoint's
        quantized weights stay as published; the rest take the requested format)."""
        return Weights(*(a or b for a, b in zip(dataclasses.astuple(self),
                                                 dataclasses.astuple(other))))

    @property
    def any(self) -> bool:
        return any(dataclasses.astuple(self))

    def describe(self) -> str:
        parts = [f"{f.name} {getattr(self, f.name)}" for f in fields(self)
                 if getattr(self, f.name)]
        return ", ".join(parts) or "unquantized"


@dataclass(frozen=True)
class MoondreamConfig:
    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    region: RegionConfig = field(default_factory=RegionConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    family: str = "moondream2"
    # Name of the compute/storage dtype ("float32" or "bfloat16"); see `photon_jax.base.dtypes`.
    dtype: str = "bfloat16"
    # Quantized weights (`quant`): which leaves hold codes and scales.
    weights: Weights = field(default_factory=Weights)

    @property
    def prefix_len(self) -> int:
        """BOS + image tokens: the bidirectional prefix (730)."""
        return 1 + self.vision.n_patches

    def with_dtype(self, dtype: str) -> "MoondreamConfig":
        return replace(self, dtype=dtype)

    def with_weights(self, more: "Weights | str | None") -> "MoondreamConfig":
        """This config with `more` quantized (a `Weights`, or a format name for
        `Weights.of`) where its weights are still float; a model without experts drops
        the experts' format."""
        more = more if isinstance(more, Weights) else Weights.of(more)
        w = self.weights.fill(more)
        if self.text.moe is None:
            w = replace(w, experts="")
        return replace(self, weights=w).validate()

    def validate(self) -> "MoondreamConfig":
        t, v, r, tok = self.text, self.vision, self.region, self.tokenizer
        problems = []
        for f in fields(Weights):
            fmt = getattr(self.weights, f.name)
            if fmt and fmt not in WEIGHT_FORMATS:
                problems.append(f"weights.{f.name} {fmt!r} is not one of {WEIGHT_FORMATS}")
        if self.weights.head == "int4":
            problems.append("weights.head int4: the LM head is kept in 8 bits")
        if self.weights.experts and t.moe is None:
            problems.append("weights.experts is set but the model has no experts")
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
        if t.moe is not None:
            m = t.moe
            if not 0 <= m.start_layer <= t.n_layers:
                problems.append(f"text.moe.start_layer {m.start_layer} is not in [0, "
                                f"{t.n_layers}] (text.n_layers)")
            if not 1 <= m.experts_per_token <= m.num_experts:
                problems.append(f"text.moe.experts_per_token {m.experts_per_token} is not in "
                                f"[1, {m.num_experts}] (text.moe.num_experts)")
        if r.decoder_arch not in ("mlp", "linear"):
            problems.append(f"region.decoder_arch {r.decoder_arch!r} is not 'mlp' or 'linear'")
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
            **({"weights": dataclasses.asdict(self.weights)} if self.weights.any else {}),
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
        allowed_top = {"text", "vision", "region", "tokenizer", "family", "dtype", "weights"}
        unknown = sorted(set(d) - allowed_top)
        if unknown:
            raise ConfigError(
                f"unknown config section(s) {unknown}; expected some of "
                "['text', 'vision', 'region', 'tokenizer']"
            )
        text = _text_override(base.text, d.get("text", {}), extra_text_keys)
        vision = _override(base.vision, d.get("vision", {}), "vision")
        region = _override(base.region, d.get("region", {}), "region")
        tok = _tokenizer_override(base.tokenizer, d.get("tokenizer", {}))
        out = MoondreamConfig(
            text=text, vision=vision, region=region, tokenizer=tok,
            family=d.get("family", base.family), dtype=d.get("dtype", base.dtype),
            weights=_override(base.weights, d.get("weights", {}), "weights"),
        )
        return out.validate()


# Our own additions to the text section, not in the reference's schema (rope_theta is in
# Moondream 3's schema, so a Moondream 3 config may set it).
_OWN_TEXT_KEYS = ("rope_theta", "rope_dim", "tau")


def _text_override(base: TextConfig, d: Any, extra_keys: bool) -> TextConfig:
    if not isinstance(d, dict):
        raise ConfigError("config section 'text' must be a dict")
    d = dict(d)
    moe = base.moe
    if "moe" in d:
        m = d.pop("moe")
        if m is None:
            moe = None
        elif not isinstance(m, dict):
            raise ConfigError("config text.moe must be a dict (or null for no experts)")
        else:
            # start_layer 0 (every layer a mixture of experts) is valid: checked in validate.
            start = m.get("start_layer")
            moe = _override(base.moe or MoEConfig(), {k: v for k, v in m.items()
                                                      if k != "start_layer"}, "text.moe")
            if start is not None:
                if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                    raise ConfigError(f"config text.moe.start_layer must be an integer >= 0, "
                                      f"got {start!r}")
                moe = replace(moe, start_layer=start)
    if extra_keys:
        skip = ()
    elif base.moe is not None or base.tau:
        skip = ("rope_dim", "tau")
    else:
        skip = _OWN_TEXT_KEYS
    return replace(_override(base, d, "text", skip=skip + ("moe",)), moe=moe)


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
        elif isinstance(default, bool):
            if not isinstance(val, bool):
                raise ConfigError(f"config {section}.{k} must be true or false, got {val!r}")
            kw[k] = val
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
    ("segment", "prefix"): "segment_prefix",
    ("segment", "suffix"): "segment_suffix",
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


def moondream3(dtype: str = "bfloat16", max_context: int = 32768) -> MoondreamConfig:
    """Moondream 3 (HF moondream/moondream3-preview; 9.3B parameters, ~2B active per token):
    Moondream 2's shapes plus tau attention, RoPE theta 1.5e6, layers 4-23 mixtures of 64
    experts (top-8, expert width 1024), linear region decoders after a LayerNorm, and the
    segment skill.  Context 32768 (kestrel's); the HF code's default is 4096 (`HF_MD3_CONTEXT`,
    what a config.json without max_context gets)."""
    return MoondreamConfig(
        text=TextConfig(max_context=max_context, rope_theta=1.5e6, moe=MoEConfig(), tau=True),
        region=RegionConfig(decoder_arch="linear", use_ln=True),
        tokenizer=TokenizerConfig(segment_prefix=(1, 17374, 2), segment_suffix=(3,)),
        family="moondream3",
        dtype=dtype,
    )


# The Moondream 3 reference code's default context: the base a config.json is merged onto.
HF_MD3_CONTEXT = 4096


def tiny_md3(dtype: str = "float32") -> MoondreamConfig:
    """The fixture model of tests/fixtures/moondream3-tiny: the MD2 tiny shapes, 4 layers,
    layers 2-3 mixtures of 8 experts (top-2, width 32)."""
    base, md3 = tiny(dtype), moondream3(dtype)
    return replace(
        md3,
        text=replace(base.text, n_layers=4, rope_theta=1.5e6, tau=True,
                     moe=MoEConfig(num_experts=8, start_layer=2, experts_per_token=2,
                                   expert_inner_dim=32)),
        vision=base.vision,
        region=replace(md3.region, dim=64),
    )


def is_md3_config_json(cfg_json: dict) -> bool:
    """Does a Hugging Face config.json describe Moondream 3?  By `model_type`, or (for a
    config.json without it) by keys only Moondream 3's schema has."""
    if str(cfg_json.get("model_type", "")).startswith("moondream3"):
        return True
    inner = cfg_json.get("config") or {}
    if not isinstance(inner, dict):
        return False
    text, region = inner.get("text") or {}, inner.get("region") or {}
    return (isinstance(text, dict) and "moe" in text) or (
        isinstance(region, dict) and ("decoder_arch" in region or "use_ln" in region))


def from_hf_config_json(cfg_json: dict, dtype: str = "bfloat16",
                        md3: bool | None = None) -> MoondreamConfig:
    """The effective config of a Hugging Face Moondream 2 or 3 `config.json`.

    The family is `md3` if given (the converter also looks at the tensor names), else
    `is_md3_config_json`.  Moondream 3 configs are merged onto `moondream3()` with the
    reference code's context (`HF_MD3_CONTEXT`).

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
    if md3 is None:
        md3 = is_md3_config_json(cfg_json)
    base = moondream3(dtype, max_context=HF_MD3_CONTEXT) if md3 else moondream2(dtype)
    cfg = MoondreamConfig.from_dict(inner, base=base, extra_text_keys=False)
    # The reference's switch for its 4-bit layers (QuantizedLinear, groups of 128 whatever
    # the value): the text layers, and the region model's when its own group_size is set.
    if cfg.text.group_size is not None or cfg.region.group_size is not None:
        cfg = replace(cfg, weights=Weights(
            linear="int4" if cfg.text.group_size is not None else "",
            region="int4" if cfg.region.group_size is not None else "")).validate()
    return cfg
