"""Checkpoint tensor names -> places in the photon_jax parameter tree.

One table per config: each Hugging Face name (without the `model.` prefix) maps to a tree path,
the layer it fills in a stacked [L, ...] leaf (or None), and how the stored tensor becomes our
layout ("T": torch [..., out, in] -> [..., in, out], the last two axes swapped, which also
turns Moondream 3's [E, out, in] expert tensors into [E, in, out]; "id": as stored;
"squeeze0": drop a leading 1).  Moondream 3's layers go to the dense or the mixture-of-experts
group of the tree by the config's layer split (`text.moe.start_layer`).
Training-format names (the reference's legacy `_load_weights` names, also the MD3 naming) are
rewritten to HF names first; `._orig_mod` (torch.compile) is stripped everywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from photon_jax.model.config import MoondreamConfig
from photon_jax.model.params import flatten, param_shapes


@dataclass(frozen=True)
class Target:
    path: tuple[str, ...]
    layer: int | None
    transform: str  # "T" | "id" | "squeeze0"


def _linear(table, hf, path, layer=None):
    table[f"{hf}.weight"] = Target((*path, "w"), layer, "T")
    table[f"{hf}.bias"] = Target((*path, "b"), layer, "id")


def _norm(table, hf, path, layer=None):
    table[f"{hf}.weight"] = Target((*path, "w"), layer, "id")
    table[f"{hf}.bias"] = Target((*path, "b"), layer, "id")


def hf_table(cfg: MoondreamConfig) -> dict[str, Target]:
    t: dict[str, Target] = {}
    _linear(t, "vision.patch_emb", ("vision", "patch_emb"))
    t["vision.pos_emb"] = Target(("vision", "pos_emb"), None, "squeeze0")
    for i in range(cfg.vision.enc_n_layers):
        b, p = f"vision.blocks.{i}", ("vision", "blocks")
        _norm(t, f"{b}.ln1", (*p, "ln1"), i)
        _norm(t, f"{b}.ln2", (*p, "ln2"), i)
        _linear(t, f"{b}.attn.qkv", (*p, "qkv"), i)
        _linear(t, f"{b}.attn.proj", (*p, "proj"), i)
        _linear(t, f"{b}.mlp.fc1", (*p, "fc1"), i)
        _linear(t, f"{b}.mlp.fc2", (*p, "fc2"), i)
    _norm(t, "vision.post_ln", ("vision", "post_ln"))
    _linear(t, "vision.proj_mlp.fc1", ("vision", "proj_mlp", "fc1"))
    _linear(t, "vision.proj_mlp.fc2", ("vision", "proj_mlp", "fc2"))
    t["text.wte"] = Target(("text", "wte"), None, "id")
    tc = cfg.text
    for i in range(tc.n_layers):
        b = f"text.blocks.{i}"
        dense = i < tc.n_dense
        p, j = (("text", "blocks"), i) if dense else (("text", "moe_blocks"), i - tc.n_dense)
        _norm(t, f"{b}.ln", (*p, "ln"), j)
        _linear(t, f"{b}.attn.qkv", (*p, "qkv"), j)
        _linear(t, f"{b}.attn.proj", (*p, "proj"), j)
        if tc.tau:
            t[f"{b}.attn.tau.wq"] = Target((*p, "tau", "wq"), j, "T")
            t[f"{b}.attn.tau.wv"] = Target((*p, "tau", "wv"), j, "T")
            t[f"{b}.attn.tau.alpha"] = Target((*p, "tau", "alpha"), j, "id")
        if dense:
            _linear(t, f"{b}.mlp.fc1", (*p, "fc1"), j)
            _linear(t, f"{b}.mlp.fc2", (*p, "fc2"), j)
        else:
            _linear(t, f"{b}.mlp.router", (*p, "moe", "router"), j)
            t[f"{b}.mlp.fc1.weight"] = Target((*p, "moe", "fc1"), j, "T")
            t[f"{b}.mlp.fc2.weight"] = Target((*p, "moe", "fc2"), j, "T")
    _norm(t, "text.post_ln", ("text", "post_ln"))
    _linear(t, "text.lm_head", ("text", "lm_head"))
    t["region.coord_features"] = Target(("region", "coord_features"), None, "id")
    t["region.size_features"] = Target(("region", "size_features"), None, "id")
    _linear(t, "region.coord_encoder", ("region", "coord_encoder"))
    _linear(t, "region.size_encoder", ("region", "size_encoder"))
    for head in ("coord_decoder", "size_decoder"):
        if cfg.region.decoder_arch == "linear":
            _linear(t, f"region.{head}", ("region", head))
        else:
            _linear(t, f"region.{head}.fc1", ("region", head, "fc1"))
            _linear(t, f"region.{head}.fc2", ("region", head, "fc2"))
    if cfg.region.use_ln:
        _norm(t, "region.ln", ("region", "ln"))
    return t


# Names only Moondream 3 checkpoints have (HF layout, or kestrel's training format).
_MD3_MARKERS = re.compile(r"(^|\.)(attn\.tau\.|tau_w|tau_alpha|mlp\.router\.|gate\.weight|"
                          r"region\.ln\.|region_model\.ln\.|coordinate_head|"
                          r"mlp\.experts\.|output_experts|moe_quant\.)")


def looks_md3(names) -> bool:
    """Do these tensor names belong to a Moondream 3 checkpoint?"""
    return any(_MD3_MARKERS.search(n) for n in names)


# Training-format name -> HF name.  Tensors marked "transpose" are stored transposed in that
# format (the Fourier feature matrices are [F, I] there, [I, F] in the HF layout).
_TRAINING = [
    (r"vision_encoder\.encoder\.model\.visual\.patch_embed\.linear\.(weight|bias)", r"vision.patch_emb.\1"),
    (r"vision_encoder\.encoder\.model\.visual\.pos_embed", r"vision.pos_emb"),
    (r"vision_encoder\.encoder\.model\.visual\.blocks\.(\d+)\.norm1\.(weight|bias)", r"vision.blocks.\1.ln1.\2"),
    (r"vision_encoder\.encoder\.model\.visual\.blocks\.(\d+)\.norm2\.(weight|bias)", r"vision.blocks.\1.ln2.\2"),
    (r"vision_encoder\.encoder\.model\.visual\.blocks\.(\d+)\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)", r"vision.blocks.\1.\2.\3"),
    (r"vision_encoder\.encoder\.model\.visual\.norm\.(weight|bias)", r"vision.post_ln.\1"),
    (r"vision_encoder\.projection\.mlp\.(fc1|fc2)\.(weight|bias)", r"vision.proj_mlp.\1.\2"),
    (r"text_model\.transformer\.embd\.wte\.weight", r"text.wte"),
    (r"text_model\.transformer\.h\.(\d+)\.ln\.(weight|bias)", r"text.blocks.\1.ln.\2"),
    (r"text_model\.transformer\.h\.(\d+)\.mixer\.Wqkv\.(weight|bias)", r"text.blocks.\1.attn.qkv.\2"),
    (r"text_model\.transformer\.h\.(\d+)\.mixer\.out_proj\.(weight|bias)", r"text.blocks.\1.attn.proj.\2"),
    (r"text_model\.transformer\.h\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", r"text.blocks.\1.mlp.\2.\3"),
    (r"text_model\.lm_head\.ln\.(weight|bias)", r"text.post_ln.\1"),
    (r"text_model\.lm_head\.linear\.(weight|bias)", r"text.lm_head.\1"),
    (r"region_model\.coordinate_encoder\.(weight|bias)", r"region.coord_encoder.\1"),
    (r"region_model\.size_encoder\.(weight|bias)", r"region.size_encoder.\1"),
    (r"region_model\.coordinate_decoder\.(fc1|fc2)\.(weight|bias)", r"region.coord_decoder.\1.\2"),
    (r"region_model\.size_decoder\.(fc1|fc2)\.(weight|bias)", r"region.size_decoder.\1.\2"),
    # kestrel's "md3" names (Moondream 3.1, 3-preview's model_fp8.pt): docs/quantized-formats.md
    (r"text_model\.transformer\.h\.(\d+)\.gate\.(weight|bias)", r"text.blocks.\1.mlp.router.\2"),
    (r"text_model\.transformer\.h\.(\d+)\.mlp\.experts\.weight", r"text.blocks.\1.mlp.fc1.weight"),
    (r"text_model\.transformer\.h\.(\d+)\.mlp\.output_experts\.weight", r"text.blocks.\1.mlp.fc2.weight"),
    (r"text_model\.transformer\.h\.(\d+)\.moe_quant\.(up_scale|down_scale)", r"text.blocks.\1.moe_quant.\2"),
    (r"text_model\.transformer\.h\.(\d+)\.tau_(wqwv|wq|wv|alpha)", r"text.blocks.\1.attn.tau.\2"),
    (r"region_model\.coordinate_head\.(weight|bias)", r"region.coord_decoder.\1"),
    (r"region_model\.size_head\.(weight|bias)", r"region.size_decoder.\1"),
    (r"region_model\.ln\.(weight|bias)", r"region.ln.\1"),
]
_TRAINING_TRANSPOSED = {
    "region_model.coordinate_features.weight": "region.coord_features",
    "region_model.size_features.weight": "region.size_features",
}
_TRAINING_RE = [(re.compile(a + r"\Z"), b) for a, b in _TRAINING]


def canonical_name(name: str) -> tuple[str, bool]:
    """Stored name -> (HF name without `model.`, stored transposed?)."""
    n = name.replace("._orig_mod", "")
    if n.startswith("_orig_mod."):
        n = n[len("_orig_mod."):]
    if n.startswith("model."):
        n = n[len("model."):]
    if n in _TRAINING_TRANSPOSED:
        return _TRAINING_TRANSPOSED[n], True
    for pat, repl in _TRAINING_RE:
        if pat.match(n):
            return pat.sub(repl, n), False
    return n, False


def stored_shape(target_shape: tuple[int, ...], tgt: Target, transposed: bool) -> tuple[int, ...]:
    """The shape a tensor must have on disk to fill `target_shape` (one layer's slice)."""
    if tgt.transform == "T" or transposed:
        return (*target_shape[:-2], target_shape[-1], target_shape[-2])
    if tgt.transform == "squeeze0":
        return (1, *target_shape)
    return tuple(target_shape)


def hf_shapes(cfg: MoondreamConfig, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `cfg` holds, with its stored shape."""
    leaves = flatten(param_shapes(cfg))
    out = {}
    for hf, tgt in hf_table(cfg).items():
        full = leaves[tgt.path]
        out[prefix + hf] = stored_shape(full[1:] if tgt.layer is not None else full, tgt, False)
    return out
