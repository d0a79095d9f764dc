"""Images/s of the public Moondream 2 reference (PyTorch) captioning a dataset one image at a
time, on the same random weights and images as `bench/caption.py`: photon_jax's baseline.

The reference is `moondream/torch` of https://github.com/vikhyat/moondream (checked at commit
44146f1, the code behind the HF `vikhyatk/moondream2` revision 2025-06-21, the one the test
fixtures come from).  It is not a dependency of this project and is never imported by it:
this script runs it from a source checkout (`--reference-src`) in a separate virtualenv that
has torch.  It captions the way its README does, one image per call:
`model.caption(image, length="normal", settings={"max_tokens": N, "temperature": 0})`
(greedy), eager mode (no `model.compile()`), torch using every core.

Three modes, one file:

  --write-hf DIR --config NAME   (the project's .venv: imports jax, photon_jax, convert/)
      Builds the random model of `bench/common.build_model(NAME)` (PRNGKey(0): the weights of
      bench/caption.py) and writes it as a Hugging Face Moondream 2 snapshot: config.json
      (the HF repo's schema, the model in its nested "config" dict), model.safetensors (HF
      names `model.vision...` / `model.text...` / `model.region...`, torch [out, in] linear
      weights: the inverse of convert/names.py), tokenizer.json (the fixture tokenizer).
      The config round trip through photon-convert's parser is checked every time; with
      --check the snapshot is converted by photon-convert (float32) and every converted
      parameter is compared bit for bit with build_model's.
  --write-images DIR --count N   (any Python with numpy and Pillow)
      The N images of `bench/caption.py --images N` (its `write_images`: same seed, same
      names, same bytes), in a folder both sides can read.
  --hf-dir DIR --images DIR      (the torch venv; never imports jax)
      Loads the reference from the snapshot (its own loader, then every tensor is checked
      against the file), captions every image of the folder (sorted names) and prints one
      JSON line per pass, `cold` (first pass: torch's lazy initialisation and first-use
      allocations) and `warm` (the same images again):

        {"bench": "reference_caption", "config", "dtype", "images", "max_tokens", "pass",
         "images_per_s", "tokens_per_s", "wall_s", "load_s", "threads", "torch"}

      images_per_s and tokens_per_s are over the captioning (first image opened to last
      caption, model load excluded), like photon-caption's Summary; wall_s is the whole pass
      with the model load (load_s), like bench/caption.py's wall_s.  Tokens are the tokens
      each caption emitted (at most --max-tokens; random weights rarely emit EOS).  With
      --out FILE.jsonl the last pass's captions are written one JSON line per image:
      {"path", "caption", "finish_reason", "output_tokens", "token_ids"}, the fields of
      photon-caption's --jsonl records ("path" is DIR joined with the file name, as
      photon-caption writes it when given DIR), plus the emitted ids.

What is adapted around the reference, without editing its files (module attributes are
wrapped at load time):

  * tokenizer: it downloads `moondream/starmie-v1`; the snapshot's tokenizer.json is used.
  * float32 mode: it always normalises crops in bfloat16 (also what photon_jax reproduces);
    the bf16 crops are cast to float32 before the vision encoder, which otherwise refuses
    mixed dtypes.  In bfloat16 mode the cast is a no-op.  (The test fixtures' float32 mode.)
  * text.max_context: its decode masks are 2048 wide whatever the config says, so the
    reference is built with 2048 (config small_v27 says 1024; only the KV cache's capacity
    differs, no result).
  * `settings` gets "variant": None (that commit's encode_image reads settings["variant"]).
  * the emitted token ids are recorded by wrapping its `text_encoder` (the embedding lookup
    of each emitted token); nothing it computes changes.
  * images are decoded with EXIF rotation applied (as photon-caption does), then handed to
    the reference as PIL images, which it converts to RGB itself.  If pyvips is installed the
    reference resizes with it instead of PIL; it is turned off here (photon_jax matches PIL).

The reference can only run models whose vision tower has 27 layers (it takes the layer count
as the patch grid side) and whose text head dimension is 64; hence config small_v27
(bench/caption.py's default): "small"'s text model (width 512, 4 layers) with the fixture's
27-layer vision tower.  "small" (1 vision layer) and the MoE configs are refused.

Reproduce (from the repository root; /work/refsrc/moondream is `git archive` of the
reference repository; the torch venv: `python3 -m venv /work/refvenv &&
/work/refvenv/bin/pip install torch numpy pillow safetensors tokenizers`):

  D=/tmp/refbench
  .venv/bin/python bench/reference_caption.py --write-hf $D/hf --config small_v27 --check
  .venv/bin/python bench/reference_caption.py --write-images $D/images --count 24
  .venv/bin/photon-convert $D/hf $D/ckpt-f32 --dtype float32
  .venv/bin/photon-convert $D/hf $D/ckpt-bf16 --dtype bfloat16
  # photon side: the throughput runs (same weights, same 24 images, written by itself) ...
  .venv/bin/python bench/caption.py --config small_v27 --images 24 --batch 1 32
  # ... and the captions of this folder, to compare with the reference's:
  .venv/bin/photon-caption $D/images --model $D/ckpt-f32 --max-tokens 64 --batch-size 1 \\
      --no-sidecar --jsonl $D/photon-f32.jsonl --quiet --overwrite
  # reference side:
  /work/refvenv/bin/python bench/reference_caption.py --reference-src /work/refsrc/moondream \\
      --hf-dir $D/hf --images $D/images --max-tokens 64 --dtype float32 bfloat16 \\
      --out $D/reference.jsonl
  # --out with two dtypes writes $D/reference-float32.jsonl and $D/reference-bfloat16.jsonl

With a LoRA adapter (the reference loads it as a published variant, from its cache folder):

  /work/refvenv/bin/python bench/reference_caption.py --reference-src /work/refsrc/moondream \\
      --hf-dir $D/hf --images $D/images --max-tokens 64 --dtype float32 --lora-rank 8 \\
      --adapter-out $D/lora8.pt --out $D/reference-lora8.jsonl
  .venv/bin/photon-caption $D/images --model $D/ckpt-f32 --max-tokens 64 --batch-size 32 \\
      --adapter bench=$D/lora8.pt --variant bench --max-lora-rank 8 --no-sidecar \\
      --jsonl $D/photon-lora8.jsonl --quiet --overwrite

Greedy float32 captions of the two should be identical token for token (a near-tie of two
logits could flip one on some weights; bfloat16 ones are only expected to agree mostly, the
two round differently).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURE_TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "moondream2-tiny", "tokenizer.json")
IMAGE_EXTS = frozenset(
    ".jpg .jpeg .jpe .jfif .png .apng .webp .bmp .dib .gif .tif .tiff .ppm .pgm .pbm .pnm "
    ".tga .ico .avif".split())   # photon-caption's (photon_jax/dataset/files.py)
# The reference's config schema (moondream/torch/config.py): config.json's "config" dict
# holds these keys only (photon-convert refuses keys outside the reference's schema too).
REF_TEXT_KEYS = ("dim", "ff_dim", "n_layers", "vocab_size", "max_context", "n_heads",
                 "n_kv_heads", "prefix_attn", "group_size")
REF_VISION_KEYS = ("enc_dim", "enc_patch_size", "enc_n_layers", "enc_ff_dim", "enc_n_heads",
                   "proj_out_dim", "crop_size", "in_channels", "max_crops", "overlap_margin",
                   "proj_inner_dim")
REF_REGION_KEYS = ("dim", "coord_feat_dim", "coord_out_dim", "size_feat_dim", "size_out_dim",
                   "inner_dim", "group_size")
REF_TOKENIZER_KEYS = ("bos_id", "eos_id", "answer_id", "thinking_id", "coord_id", "size_id",
                      "start_ground_points_id", "end_ground_id")
REF_CONTEXT = 2048   # the reference's decode masks are this wide, whatever the config says


# -- --write-hf: photon_jax's random model as a Hugging Face snapshot (jax side) ---------------

def hf_config_json(cfg, name: str) -> dict:
    """The HF repo's config.json for `cfg` (a Moondream 2 config the reference can build)."""
    t, v, r, tok = cfg.text, cfg.vision, cfg.region, cfg.tokenizer
    problems = []
    if cfg.family != "moondream2" or t.moe is not None or t.tau:
        problems.append("not a Moondream 2 model (the reference here is Moondream 2's)")
    if (t.rope_theta, t.rope_dim) != (10000.0, 32):
        problems.append(f"rope theta/dim {(t.rope_theta, t.rope_dim)}: the reference "
                        "hard-codes (10000, 32)")
    if (r.decoder_arch, r.use_ln) != ("mlp", False):
        problems.append("Moondream 3 region heads")
    if problems:
        raise SystemExit(f"--write-hf: config {name!r} cannot be written for the reference: "
                         + "; ".join(problems))
    templates = tok.templates_dict()
    return {
        "architectures": ["HfMoondream"],
        "auto_map": {"AutoConfig": "hf_moondream.HfConfig",
                     "AutoModelForCausalLM": "hf_moondream.HfMoondream"},
        "config": {
            "text": {k: getattr(t, k) for k in REF_TEXT_KEYS},
            "vision": {k: getattr(v, k) for k in REF_VISION_KEYS},
            "region": {k: getattr(r, k) for k in REF_REGION_KEYS},
            "tokenizer": {**{k: getattr(tok, k) for k in REF_TOKENIZER_KEYS},
                          "templates": templates},
        },
        "model_type": "moondream1",
        "torch_dtype": cfg.dtype,
        # Ignored by photon-convert (unknown top-level keys) and by the reference.
        "photon_bench": {"config": name, "weights": "bench/common.py build_model: "
                         "init_params(PRNGKey(0))"},
    }


def write_safetensors(path: str, tensors: dict) -> None:
    """A .safetensors file from {name: numpy array} (float32 or bfloat16), names sorted."""
    import numpy as np

    codes = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    header, offset, order = {}, 0, sorted(tensors)
    for name in order:
        a = tensors[name]
        n = a.size * a.dtype.itemsize
        header[name] = {"dtype": codes[str(a.dtype)], "shape": list(a.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)   # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in order:
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


def write_hf(folder: str, name: str, check: bool) -> None:
    sys.path.insert(0, HERE)
    import jax
    import numpy as np
    from common import TOKENIZER, build_model

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from convert.names import hf_shapes, hf_table
    from photon_jax.model.config import from_hf_config_json
    from photon_jax.model.params import flatten
    from photon_jax.model.text import stack_layers

    model = build_model(name)   # bench/caption.py's weights (PRNGKey(0))
    cfg = model.cfg
    cfg_json = hf_config_json(cfg, name)
    back = from_hf_config_json(json.loads(json.dumps(cfg_json)), dtype=cfg.dtype)
    if back != cfg:
        raise SystemExit(f"--write-hf: config.json does not parse back to config {name!r}:\n"
                         f"  wrote  {cfg}\n  parsed {back}")
    leaves = flatten(jax.tree.map(np.asarray, stack_layers(model.params)))
    tensors, used = {}, set()
    for hf, tgt in hf_table(cfg).items():   # the inverse of convert/convert.py's _to_target
        a = leaves[tgt.path]
        used.add(tgt.path)
        if tgt.layer is not None:
            a = a[tgt.layer]
        if tgt.transform == "T":
            a = np.swapaxes(a, -1, -2)
        elif tgt.transform == "squeeze0":
            a = a[None]
        tensors["model." + hf] = np.ascontiguousarray(a)
    if used != set(leaves):
        raise SystemExit(f"--write-hf: parameters without an HF name: {sorted(set(leaves) - used)}")
    want = hf_shapes(cfg)
    bad = [n for n in want if tuple(tensors[n].shape) != tuple(want[n])]
    if bad or set(want) != set(tensors):
        raise SystemExit(f"--write-hf: shapes differ from convert/names.hf_shapes: {bad}")
    os.makedirs(folder, exist_ok=True)
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg_json, f, indent=1)
    shutil.copyfile(TOKENIZER, os.path.join(folder, "tokenizer.json"))
    n = sum(a.size for a in tensors.values())
    print(f"wrote {folder}: config {name}, {len(tensors)} tensors, {n:,} parameters "
          f"({cfg.dtype})", file=sys.stderr)
    if check:
        check_convert(folder, model)


def check_convert(folder: str, model) -> None:
    """photon-convert the snapshot (float32) and compare it with build_model's, bit for bit."""
    import jax
    import numpy as np

    from photon_jax.model import checkpoint
    from photon_jax.model.params import flatten
    from photon_jax.model.text import stack_layers

    try:
        from photon_jax.convert import convert
    except ImportError:
        from convert import convert
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ckpt")
        cfg = convert(folder, out, dtype="float32", log=lambda s: None)
        if cfg != model.cfg.with_dtype("float32") or \
                checkpoint.read_config(out) != model.cfg.with_dtype("float32"):
            raise SystemExit(f"--check: converted config differs:\n  {cfg}\n  {model.cfg}")
        got = flatten(jax.tree.map(np.asarray, checkpoint.restore_params(out, cfg)))
    want = flatten(jax.tree.map(lambda a: np.asarray(a, np.float32),
                                stack_layers(model.params)))
    diff = sorted(p for p in want if p not in got or got[p].shape != want[p].shape
                  or not np.array_equal(got[p], want[p]))
    if diff or set(got) != set(want):
        raise SystemExit(f"--check: {len(diff)} converted parameter(s) differ: {diff[:8]}")
    print(f"check: photon-convert --dtype float32 gives build_model's {len(want)} parameter "
          "arrays bit for bit", file=sys.stderr)


# -- --write-images ------------------------------------------------------------------------------

def write_images(folder: str, count: int) -> None:
    sys.path.insert(0, HERE)
    from caption import write_images as bench_write_images   # no jax at import

    os.makedirs(folder, exist_ok=True)
    bench_write_images(folder, count)
    print(f"wrote {count} images to {folder}", file=sys.stderr)


# -- captioning with the reference (torch side; never imports jax) -------------------------------

def list_images(folder: str) -> list[str]:
    names = sorted(n for n in os.listdir(folder) if not n.startswith(".")
                   and os.path.splitext(n)[1].lower() in IMAGE_EXTS
                   and os.path.isfile(os.path.join(folder, n)))
    if not names:
        raise SystemExit(f"no images in {folder}")
    return [os.path.join(folder, n) for n in names]


class Reference:
    """The reference model loaded from an HF snapshot, with the adaptations above."""

    def __init__(self, src: str, hf_dir: str, dtype: str, log=print):
        if "jax" in sys.modules:
            raise SystemExit("caption mode must not import jax")
        src = os.path.abspath(src)
        if not os.path.isfile(os.path.join(src, "moondream", "torch", "moondream.py")):
            raise SystemExit(f"--reference-src {src}: no moondream/torch/moondream.py there")
        if src not in sys.path:
            sys.path.insert(0, src)
        import torch
        from PIL import Image
        from tokenizers import Tokenizer

        from moondream.torch import image_crops, moondream as md
        from moondream.torch.config import MoondreamConfig
        from moondream.torch.weights import load_weights_into_model

        self.torch, self.md = torch, md
        self.tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        with open(os.path.join(hf_dir, "config.json")) as f:
            cfg_json = json.load(f)
        inner = dict(cfg_json.get("config") or {})
        text = dict(inner.get("text") or {})
        if text.get("max_context", REF_CONTEXT) != REF_CONTEXT:
            log(f"reference: text.max_context {text['max_context']} -> {REF_CONTEXT} (its "
                "decode masks are 2048 wide)")
        text["max_context"] = REF_CONTEXT
        config = MoondreamConfig.from_dict({**inner, "text": text})
        v, t = config.vision, config.text
        if v.enc_n_layers != v.crop_size // v.enc_patch_size:
            raise SystemExit(f"the reference takes vision.enc_n_layers ({v.enc_n_layers}) as "
                             f"the patch grid side ({v.crop_size // v.enc_patch_size}): it "
                             "cannot run this model (use config small_v27)")
        if t.dim // t.n_heads != 64:
            raise SystemExit(f"the reference needs text head dim 64, not {t.dim // t.n_heads}")
        self.config = config
        self.name = (cfg_json.get("photon_bench") or {}).get("config") or \
            os.path.basename(os.path.normpath(hf_dir))

        tok_path = os.path.join(hf_dir, "tokenizer.json")

        class LocalTokenizer:   # instead of downloading moondream/starmie-v1
            @staticmethod
            def from_pretrained(*args, **kwargs):
                return Tokenizer.from_file(tok_path)

        md.Tokenizer = LocalTokenizer
        if image_crops.HAS_VIPS:   # photon_jax reproduces the PIL path
            image_crops.HAS_VIPS, image_crops.Image = False, Image
            log("reference: pyvips found; using its PIL path instead")
        if not hasattr(md, "_bench_prepare_crops"):
            md._bench_prepare_crops, md._bench_text_encoder = md.prepare_crops, md.text_encoder
        tdtype, orig_prepare, orig_embed = self.tdtype, md._bench_prepare_crops, \
            md._bench_text_encoder

        def prepare_crops(image, config, device):   # bf16-normalised crops, in the model dtype
            crops, tiling = orig_prepare(image, config, device)
            return crops.to(tdtype), tiling

        self.embedded = []   # the ids given to text_encoder: BOS, the prompt, each emitted token

        def text_encoder(input_ids, w):
            self.embedded.append(input_ids)
            return orig_embed(input_ids, w)

        md.prepare_crops, md.text_encoder = prepare_crops, text_encoder
        self.model = md.MoondreamModel(config, dtype=self.tdtype)
        self.weights = os.path.join(hf_dir, "model.safetensors")
        load_weights_into_model(self.weights, self.model)
        self.model.eval()

    def check_weights(self) -> int:
        """Every tensor of the file is in the model, as stored (cast to the model dtype), and
        every parameter came from the file (its HF loader uses strict=False)."""
        from safetensors import safe_open

        torch = self.torch
        state = self.model.state_dict()
        expected = {k for k in state if ".kv_cache." not in k}
        seen, bad = set(), []
        with safe_open(self.weights, framework="pt") as f:
            for name in f.keys():
                k = name.replace("model.", "")
                seen.add(k)
                if k not in state or not torch.equal(state[k],
                                                     f.get_tensor(name).to(self.tdtype)):
                    bad.append(name)
        missing = sorted(expected - seen)
        if bad or missing:
            raise SystemExit(f"reference weights differ from {self.weights}: "
                             f"{len(bad)} differ ({bad[:5]}), {len(missing)} not loaded "
                             f"({missing[:5]})")
        return len(seen)

    def caption(self, path: str, max_tokens: int, variant: str | None = None) -> dict:
        from PIL import Image, ImageOps

        with Image.open(path) as im:
            image = ImageOps.exif_transpose(im)
            image.load()
        self.embedded.clear()
        settings = {"max_tokens": max_tokens, "temperature": 0.0, "variant": variant}
        with self.torch.inference_mode():
            text = self.model.caption(image, length="normal", settings=settings)["caption"]
        prompt = self.config.tokenizer.templates["caption"]["normal"]
        # embedded: BOS [1, 1], the prompt [1, P], then one [1, 1] per emitted token
        assert len(self.embedded) >= 2 and self.embedded[1].shape[-1] == len(prompt)
        ids = [int(x.item()) for x in self.embedded[2:]]
        return {"caption": text,
                "finish_reason": "length" if len(ids) >= max_tokens else "stop",
                "output_tokens": len(ids), "token_ids": ids}


def run_pass(args, dtype: str, name: str, paths: list[str], check: bool):
    import torch

    t0 = time.perf_counter()
    ref = Reference(args.reference_src, args.hf_dir, dtype,
                    log=lambda s: print(s, file=sys.stderr))
    load_s = time.perf_counter() - t0
    if check:   # not timed
        n = ref.check_weights()
        print(f"reference ({dtype}): {n} tensors loaded as stored", file=sys.stderr)
    t1 = time.perf_counter()
    records, tokens = [], 0
    for p in paths:
        r = ref.caption(p, args.max_tokens, VARIANT if args.lora_rank else None)
        tokens += r["output_tokens"]
        records.append({"path": p, **r})
    cap_s = time.perf_counter() - t1
    row = {"bench": "reference_caption", "config": ref.name, "dtype": dtype,
           "images": len(paths), "max_tokens": args.max_tokens, "pass": name,
           "images_per_s": round(len(paths) / cap_s, 3),
           "tokens_per_s": round(tokens / cap_s, 1),
           "wall_s": round(load_s + cap_s, 2), "load_s": round(load_s, 2),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "lora_rank": args.lora_rank}
    del ref
    gc.collect()
    return row, records


VARIANT = "bench-lora@1"


def write_adapter(hf_dir: str, rank: int, out: str) -> str:
    """A random LoRA adapter for the snapshot's text model, saved as a published variant's
    final.pt (a flat state dict under the training code's names, float32), and placed in a
    temporary HF_HUB_CACHE's md_variants/VARIANT/, where the reference looks it up."""
    import numpy as np
    import torch

    with open(os.path.join(hf_dir, "config.json")) as f:
        t = json.load(f)["config"]["text"]
    d, ff, nh = t["dim"], t["ff_dim"], t["n_heads"]
    nkv = t.get("n_kv_heads") or nh
    dims = {"mixer.Wqkv": (d, (nh + 2 * nkv) * (d // nh)), "mixer.out_proj": (d, d),
            "mlp.fc1": (d, ff), "mlp.fc2": (ff, d)}
    rng = np.random.default_rng(rank)
    sd = {}
    for i in range(t["n_layers"]):
        for name, (ind, outd) in dims.items():
            key = f"text_model.transformer.h.{i}.{name}.parametrizations.weight.0."
            sd[key + "A"] = torch.from_numpy(
                (rng.standard_normal((rank, ind)) / np.sqrt(ind)).astype(np.float32))
            sd[key + "B"] = torch.from_numpy(
                (rng.standard_normal((outd, rank)) * 0.5 / np.sqrt(rank)).astype(np.float32))
    torch.save(sd, out)
    cache = tempfile.mkdtemp(prefix="refbench-hub-")
    os.makedirs(os.path.join(cache, "md_variants", VARIANT))
    shutil.copyfile(out, os.path.join(cache, "md_variants", VARIANT, "final.pt"))
    os.environ["HF_HUB_CACHE"] = cache
    return out


def caption_main(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    paths = list_images(args.images)
    if args.lora_rank:
        out = args.adapter_out or os.path.join(tempfile.mkdtemp(), "final.pt")
        write_adapter(args.hf_dir, args.lora_rank, out)
        print(f"wrote the adapter {out} (rank {args.lora_rank}); captioning with "
              f"variant {VARIANT}", file=sys.stderr)
    for dtype in args.dtype:
        for i, name in enumerate(args.passes):
            row, records = run_pass(args, dtype, name, paths, check=i == 0)
            print(json.dumps(row), flush=True)
        if args.out:
            out = args.out
            if len(args.dtype) > 1:
                stem, ext = os.path.splitext(args.out)
                out = f"{stem}-{dtype}{ext or '.jsonl'}"
            with open(out, "w") as f:
                for rec in records:
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            print(f"wrote {out}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write-hf", metavar="DIR",
                      help="write config --config as an HF snapshot (project .venv, jax)")
    mode.add_argument("--write-images", metavar="DIR",
                      help="write bench/caption.py's first --count images")
    mode.add_argument("--hf-dir", metavar="DIR",
                      help="caption with the reference from this HF snapshot (torch venv)")
    ap.add_argument("--config", default="small_v27",
                    help="--write-hf: a config of bench/common.py")
    ap.add_argument("--check", action="store_true",
                    help="--write-hf: photon-convert the snapshot and compare it with "
                         "build_model's parameters")
    ap.add_argument("--count", type=int, default=24, help="--write-images: how many")
    ap.add_argument("--reference-src", default="/work/refsrc/moondream",
                    help="a checkout of github.com/vikhyat/moondream (has moondream/torch)")
    ap.add_argument("--images", metavar="DIR", help="the images to caption (sorted names)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"],
                    help="the reference model's dtype (weights and compute)")
    ap.add_argument("--passes", nargs="+", default=["cold", "warm"],
                    help="one timed pass over the images per name, each loading the model")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="torch intra-op threads (default: every core)")
    ap.add_argument("--out", metavar="FILE.jsonl",
                    help="the last pass's captions (with several --dtype: FILE-<dtype>.jsonl)")
    ap.add_argument("--lora-rank", type=int, default=0, metavar="R",
                    help="caption under a random LoRA adapter of rank R, written as a "
                         "variant's final.pt and loaded by the reference from its cache "
                         "folder (settings variant); float32 only (the adapter is float32)")
    ap.add_argument("--adapter-out", metavar="FILE.pt",
                    help="with --lora-rank: where the adapter is kept (for photon-caption "
                         "--adapter NAME=FILE.pt --variant NAME)")
    args = ap.parse_args(argv)
    if args.write_hf:
        write_hf(args.write_hf, args.config, args.check)
        return 0
    if args.write_images:
        write_images(args.write_images, args.count)
        return 0
    if not args.images:
        ap.error("--hf-dir needs --images DIR")
    if args.lora_rank and args.dtype != ["float32"]:
        ap.error("--lora-rank needs --dtype float32 (the reference's F.linear refuses a "
                 "float32 adapter in a bfloat16 model)")
    return caption_main(args)


if __name__ == "__main__":
    sys.exit(main())
