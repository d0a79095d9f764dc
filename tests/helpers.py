"""Helpers shared by tests, and by `bench/gpu_run.py` (which runs the same surfaces on a GPU).
Test files import what they share from here only, never from each other or from conftest:
the fixtures' paths, a model with biased logits, one call of every public surface, Hugging
Face snapshots (good and broken) built from the fixtures, the engine's randomized workloads
against the one-request path, and the parity checks against the reference's golden cases.
Imports nothing from JAX at module level (conftest imports this before it sets JAX's
environment)."""

import dataclasses
import functools
import json
import os
import shutil
import struct
import threading
import time

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE_DIR = os.path.join(HERE, "fixtures", "moondream2-tiny")
MD3_FIXTURE_DIR = os.path.join(HERE, "fixtures", "moondream3-tiny")
LAND = os.path.join(FIXTURE_DIR, "img_land800x600.png")
SQ = os.path.join(FIXTURE_DIR, "img_sq378.png")
GREEDY = {"temperature": 0, "max_tokens": 6}
# The suite's XLA settings on CPU (conftest says why): -O0, and XLA:CPU's older elemental
# emitters instead of its MLIR fusion emitters (test_engine.py ran in 29 s against 40 s with
# -O0 alone, 16 tests, a fresh compile cache each).  Results may differ in their last bits,
# never in tokens the goldens check: tests/test_opt_level.py holds XLA's defaults to them too.
# And Eigen's matrix products on one thread: the suite runs two workers and their
# subprocesses on two cores, where each process's Eigen pool (as wide as the machine) spun
# and switched against the others' (the two mesh processes side by side: 92.7 s -> 86.5 s).
SUITE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
               "--xla_cpu_multi_thread_eigen=false")
# conftest.py releases a worker's compiled programs between files past this share of its
# memory-mapping limit (docs/testing.md, "The worker crashes"): a worker reached ~64,000
# mappings without it, and one file added up to ~7,000 with XLA's parts per program at 1
# (~17,000 estimated at the default 2.5x), so 0.4 of 65,530 leaves room for the largest.
SUITE_MAPPINGS_SHARE = 0.4
# Python's cyclic garbage collector less often in the suite's own processes (conftest.py,
# mesh_check.py): tracing and lowering allocate millions of short-lived objects, and at
# Python's default (700, 10, 10) one process spent 3.8-4.1 s of 77 s collecting in
# test_engine.py + test_lora.py (about 2,100 collections), 1.5-1.7 s at these (10); the
# 2-device mesh process 4.75 s, then 0.57 s (timed with gc.callbacks).  Only garbage held in
# reference cycles waits longer: reference counting still frees the rest at once, and what
# the tests check is released explicitly (engines' close, EncodedImage.release), not by
# the collector.  Users' processes keep Python's defaults.
SUITE_GC_THRESHOLD = (100_000, 50, 1000)


def _accelerator_plugin() -> bool:
    import importlib.metadata

    names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    return any(n.startswith(("jax-cuda", "jax_cuda", "jax-rocm", "libtpu")) for n in names)


def suite_xla_flags(environ) -> str:
    """The XLA_FLAGS a test process gets from `environ` (tests/test_opt_level.py checks that
    its child, told PHOTON_JAX_TEST_XLA_OPT=default, really compiles with XLA's defaults)."""
    flags = environ.get("XLA_FLAGS", "")
    if environ.get("PHOTON_JAX_TEST_XLA_OPT", "0") != "default" and not _accelerator_plugin():
        # A setting the caller gave for the same flag (any value) is theirs to keep.
        given = {f.split("=", 1)[0] for f in flags.split()}
        flags = " ".join([flags] + [f for f in SUITE_FLAGS if f.split("=", 1)[0] not in given])
    return flags.strip()


# Moondream 3's tiny fixture: EOS for varied lengths, and its coordinate and size ids (the
# fixture's head biases them by -10) so that segment emits a box.
MD3_BIASES = {0: 0.8, 5: 17.0, 6: 16.0}


# The CPU kernel's paths (`photon_jax/kernels/csrc/paged_attention.cc`), (head dim, page size):
# head dims that are a multiple of 8 are vectorized -- Moondream's 64 (values 64 lanes at a
# time), 96 (then 32 more), 24 with a page of 12 positions (8 lanes, a softmax padded to 16)
# -- and any other runs element by element (20).
CPU_KERNEL_SHAPES = [(64, 16), (96, 16), (24, 12), (20, 16)]
CPU_KERNEL_SHAPE_IDS = ["h64", "h96", "h24-page12", "h20"]

def biased_model(ckpt: str, biases: dict, device=None):
    """The checkpoint's model with `biases` ({token id: value}) added to the LM head's bias:
    random weights rarely emit EOS, coordinates or grounding ids on their own."""
    import jax

    from photon_jax.model import Model

    base = Model.load(ckpt, device=device)
    params = jax.tree.map(lambda x: x, base.params)
    head = dict(params["text"]["lm_head"])
    for tok, val in biases.items():
        head["b"] = head["b"].at[tok].add(val)
    params["text"] = {**params["text"], "lm_head": head}
    return Model(base.cfg, params, base.prompts.tok, device=base.device)


def surfaces(md, md3) -> dict:
    """One call of every public surface of a Moondream 2 (`md`) and a Moondream 3 (`md3`):
    each skill, a list, streams (whole and closed early), reasoning, spatial refs, text-only,
    seeded sampling, prefix-cache hits (an encoded image and repeated images), a chat with
    two images, a cancel, and segment.  Every value is plain data, comparable between runs."""
    g = GREEDY
    out = {"caption": md.caption(LAND, "short", settings=g),
           "list": md.caption([LAND, SQ, LAND], "short", settings=g),
           "query": md.query(SQ, "w5 w6", settings=g),
           "reasoning": md.query(LAND, "w9", reasoning=True, settings=g),
           "spatial": md.query(LAND, "w9", spatial_refs=[[0.3, 0.4], [0.1, 0.1, 0.6, 0.7]],
                               settings=g),
           "text_only": md.query(None, "w100 w200", settings=g),
           "sampled": md.query(LAND, "w5", settings={"temperature": 1.0, "seed": 3,
                                                     "max_tokens": 6}),
           "detect": md.detect(LAND, "w7", settings={"max_objects": 3}),
           "point": md.point(SQ, "w7", settings={"max_objects": 3}),
           "stream": "".join(md.caption(SQ, "normal", stream=True, settings=g)["caption"]),
           # Two images: the prefix, and a block inside the prompt (a later turn).
           "chat_images": md.chat([
               {"role": "user", "content": [{"type": "image", "image": LAND},
                                            {"type": "text", "text": "w9"}]},
               {"role": "assistant", "content": "w41 w51"},
               {"role": "user", "content": [{"type": "image", "image": SQ},
                                            {"type": "text", "text": "w5"}]}],
               reasoning=False, settings=g)}
    early = md.query(LAND, "w3", stream=True, settings={"max_tokens": 64})["answer"]
    out["stream_first_piece"] = next(iter(early))
    early.close()   # closing the stream cancels its request
    enc = md.encode_image(SQ)
    out["encoded"] = [md.caption(enc, "short", settings=g), md.query(enc, "w8", settings=g)]
    enc.release()
    h = md.start(LAND, settings={"max_tokens": 200})
    h.cancel()
    out["cancelled"] = h.result(timeout=120)["finish_reason"]
    out["after_cancel"] = md.caption(LAND, "short", settings=g)
    if md3 is not None:
        out["md3"] = [md3.caption(LAND, "short", settings=g),
                      md3.segment(LAND, "w7", settings={"temperature": 0, "max_tokens": 8}),
                      md3.detect(LAND, "w7", settings={"max_objects": 2})]
    return out


def run_surfaces(models, pipelined: bool, kv_cache_tokens: int | None = None) -> dict:
    """`surfaces` on fresh engines over already loaded models (md2, md3 or None); the
    engines are closed after, the models' weights are kept for the next run."""
    from photon_jax import Moondream
    from photon_jax.engine.core import Engine

    mds = [None if m is None else
           Moondream(m, Engine(m, max_batch_size=4, pipelined=pipelined,
                               kv_cache_tokens=kv_cache_tokens)) for m in models]
    try:
        return surfaces(*mds)
    finally:
        for md in mds:
            if md is not None:
                md.engine.close()


def in_threads(fn, n: int, timeout: float = 240) -> list:
    """`fn()` on `n` threads released together (a barrier) -> their results; raises the
    first error any of them met."""
    barrier = threading.Barrier(n)
    results, errors = [], []

    def work():
        try:
            barrier.wait(timeout=30)
            results.append(fn())
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert len(results) == n, f"{n - len(results)} threads did not finish in {timeout} s"
    return results


def pallas_attention() -> str:
    """Our Pallas decode-attention kernel (`gpu_attention`) as this backend runs it: for
    real on a GPU (a GPU pass of the kernel tests), under the Pallas interpreter elsewhere."""
    import jax

    return "pallas" if jax.default_backend() == "gpu" else "pallas-interpret"


# -- Hugging Face snapshots built from the fixtures ---------------------------------------

BF16 = np.dtype(ml_dtypes.bfloat16)
_ST_CODE = {
    BF16: "BF16",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.int8): "I8",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
}
_HF_FILES = ("config.json", "tokenizer.json")  # copied from the fixture besides the weights



def write_safetensors(path, tensors: dict) -> None:
    """Minimal safetensors writer (numpy's saver may not do bfloat16)."""
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        raw = arr.tobytes()
        header[name] = {"dtype": _ST_CODE[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)


def read_safetensors(path) -> dict:
    from photon_jax.convert.safetensors_io import read_header, read_tensor

    return {name: read_tensor(ref) for name, ref in read_header(str(path)).items()}


def make_hf(fixture_dir, root, tensors: dict | None = None, name="hf", config=None):
    """A copy of the fixture's HF folder under `root`, optionally with other weights/config."""
    d = root / name
    d.mkdir(parents=True)
    for f in _HF_FILES:
        shutil.copyfile(os.path.join(fixture_dir, f), d / f)
    if tensors is None:
        shutil.copyfile(os.path.join(fixture_dir, "model.safetensors"), d / "model.safetensors")
    else:
        write_safetensors(d / "model.safetensors", tensors)
    if config is not None:
        with open(d / "config.json", "w") as f:
            json.dump(config, f)
    return d



# Broken snapshots (photon-convert's and the loader's bad inputs): each writes one fault into
# the copy `hf` of the fixture `fx` (tensors `src`) and returns words its error must hold.

def gpt2_tokenizer(path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"!": 0, '"': 1, "a": 2, "<|endoftext|>": 50256}
    Tokenizer(WordLevel(vocab, unk_token="!")).save(str(path))


def no_specials_tokenizer(path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2}
    Tokenizer(WordLevel(vocab, unk_token="a")).save(str(path))


def other_id0_tokenizer(path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<unk>": 0, "<|endoftext|>": 1, "a": 2}
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(path))


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    cut = 8 + n + (size - 8 - n) // 2
    with open(path, "r+b") as f:
        f.truncate(cut)


def _config(fixture_dir, edit):
    with open(os.path.join(fixture_dir, "config.json")) as f:
        c = json.load(f)
    edit(c)
    return c


def bad_missing(src, hf, fx):
    t = dict(src)
    del t["model.text.blocks.1.attn.qkv.weight"]
    write_safetensors(hf / "model.safetensors", t)
    return ["missing", "text.blocks.1.attn.qkv.weight"]


def bad_extra(src, hf, fx):
    t = dict(src)
    t["model.text.blocks.2.ln.weight"] = src["model.text.blocks.1.ln.weight"]
    t["model.vision.foo"] = src["model.vision.post_ln.bias"]
    write_safetensors(hf / "model.safetensors", t)
    return ["unexpected", "model.text.blocks.2.ln.weight", "model.vision.foo"]


def bad_shape(src, hf, fx):
    t = dict(src)
    t["model.text.blocks.0.attn.qkv.weight"] = np.ascontiguousarray(
        src["model.text.blocks.0.attn.qkv.weight"].T)
    write_safetensors(hf / "model.safetensors", t)
    return ["shape", "model.text.blocks.0.attn.qkv.weight", "[64, 192]", "[192, 64]"]


def bad_pos_emb_unsqueezed(src, hf, fx):
    t = dict(src)
    t["model.vision.pos_emb"] = np.ascontiguousarray(src["model.vision.pos_emb"][0])
    write_safetensors(hf / "model.safetensors", t)
    return ["shape", "model.vision.pos_emb", "[1, 729, 16]"]


def bad_dtype_i8(src, hf, fx):
    t = dict(src)
    t["model.text.post_ln.weight"] = np.ones(src["model.text.post_ln.weight"].shape, np.int8)
    write_safetensors(hf / "model.safetensors", t)
    return ["dtype", "model.text.post_ln.weight", "I8"]


def bad_dtype_f64(src, hf, fx):
    t = dict(src)
    t["model.region.coord_features"] = src["model.region.coord_features"].astype(np.float64)
    write_safetensors(hf / "model.safetensors", t)
    return ["dtype", "model.region.coord_features", "F64"]


def bad_truncated(src, hf, fx):
    _truncate(hf / "model.safetensors")
    return ["truncated", "model.safetensors"]


def bad_offsets(src, hf, fx):
    # a header whose byte range is too short for the declared shape: caught while streaming
    t = dict(src)
    write_safetensors(hf / "model.safetensors", t)
    path = hf / "model.safetensors"
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    name = "model.text.post_ln.bias"
    a, b = header[name]["data_offsets"]
    header[name]["data_offsets"] = [a, b - 2]
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return ["model.text.post_ln.bias", "bytes"]


def bad_missing_tokenizer(src, hf, fx):
    os.remove(hf / "tokenizer.json")
    return ["tokenizer", "not found", "starmie"]


def bad_gpt2_tokenizer(src, hf, fx):
    gpt2_tokenizer(hf / "tokenizer.json")
    return ["GPT-2", "starmie"]


def bad_id0_tokenizer(src, hf, fx):
    other_id0_tokenizer(hf / "tokenizer.json")
    return ["id 0", "<unk>", "starmie"]


def bad_no_specials_tokenizer(src, hf, fx):
    no_specials_tokenizer(hf / "tokenizer.json")
    return ["special", "starmie"]


def bad_unknown_config_key(src, hf, fx):
    c = _config(fx, lambda c: c["config"]["text"].__setitem__("foo", 3))
    with open(hf / "config.json", "w") as f:
        json.dump(c, f)
    return ["foo", "text", "config.json"]


def bad_unknown_config_section(src, hf, fx):
    c = _config(fx, lambda c: c["config"].__setitem__("audio", {}))
    with open(hf / "config.json", "w") as f:
        json.dump(c, f)
    return ["audio", "config.json"]


def bad_full_size_config(src, hf, fx):
    # no nested "config": the defaults (full-size model) do not fit the tiny tensors
    c = _config(fx, lambda c: c.pop("config"))
    with open(hf / "config.json", "w") as f:
        json.dump(c, f)
    return ["220 missing", "wrong shape", "expected [2048, 2048]"]


def bad_quantized_config(src, hf, fx):
    c = _config(fx, lambda c: c["config"]["text"].__setitem__("group_size", 128))
    with open(hf / "config.json", "w") as f:
        json.dump(c, f)
    return ["group_size", "int4"]


def bad_no_config(src, hf, fx):
    os.remove(hf / "config.json")
    return ["config.json", "not found"]


def bad_no_weights(src, hf, fx):
    os.remove(hf / "model.safetensors")
    return ["model.safetensors"]


def bad_missing_shard(src, hf, fx):
    os.remove(hf / "model.safetensors")
    names = list(src)
    write_safetensors(hf / "model-00001-of-00002.safetensors", {n: src[n] for n in names[:100]})
    wm = {n: ("model-00001-of-00002.safetensors" if i < 100
              else "model-00002-of-00002.safetensors") for i, n in enumerate(names)}
    with open(hf / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": wm}, f)
    return ["missing", "model-00002-of-00002.safetensors"]


def bad_null_config_value(src, hf, fx):
    # "group_size": null is legitimate; a null size is not a model and must be a clean error
    c = _config(fx, lambda c: c["config"]["text"].__setitem__("dim", None))
    with open(hf / "config.json", "w") as f:
        json.dump(c, f)
    return ["text.dim", "config.json"]


def bad_index_not_object(src, hf, fx):
    os.rename(hf / "model.safetensors", hf / "model-00001-of-00001.safetensors")
    with open(hf / "model.safetensors.index.json", "w") as f:
        json.dump(["model-00001-of-00001.safetensors"], f)
    return ["model.safetensors.index.json"]


BAD_SNAPSHOTS = {
    "missing_tensor": bad_missing,
    "extra_tensor": bad_extra,
    "wrong_shape": bad_shape,
    "pos_emb_without_leading_1": bad_pos_emb_unsqueezed,
    "dtype_i8": bad_dtype_i8,
    "dtype_f64": bad_dtype_f64,
    "truncated_file": bad_truncated,
    "short_byte_range": bad_offsets,
    "missing_tokenizer": bad_missing_tokenizer,
    "gpt2_tokenizer": bad_gpt2_tokenizer,
    "id0_not_endoftext": bad_id0_tokenizer,
    "tokenizer_without_specials": bad_no_specials_tokenizer,
    "unknown_config_key": bad_unknown_config_key,
    "unknown_config_section": bad_unknown_config_section,
    "full_size_config_for_tiny_weights": bad_full_size_config,
    "quantized_config": bad_quantized_config,
    "no_config_json": bad_no_config,
    "no_weights": bad_no_weights,
    "missing_shard": bad_missing_shard,
    "null_config_value": bad_null_config_value,
    "index_not_an_object": bad_index_not_object,
}


def random_hf_tensors(cfg, seed):
    """Random bf16 weights for `cfg` under the HF names, scaled so that activations stay
    O(1) and captions run a few tokens before EOS."""
    from photon_jax.convert import names

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in names.hf_shapes(cfg, prefix="").items():
        hf = name
        z = rng.standard_normal(shape)
        if (hf.endswith(("weight", "tau.wq", "tau.wv")) and len(shape) >= 2
                and "features" not in hf):
            z = z / np.sqrt(shape[-1])   # [out, in] or Moondream 3's [experts, out, in]
        elif ".ln" in hf or "post_ln" in hf:
            z = 1 + 0.1 * z if hf.endswith("weight") else 0.05 * z
        elif hf.endswith("bias"):
            z = 0.05 * z
        out["model." + hf] = z.astype(np.float32).astype(BF16)
    # Keep EOS and the answer id from dominating so captions have a few tokens.
    out["model.text.lm_head.bias"][:10] = -4
    return out


def odd_images():
    """PIL images of awkward shapes and modes: 1x1, just over a crop, very wide and tall,
    grey and RGBA."""
    from PIL import Image

    rng = np.random.default_rng(5)
    sizes = [(1, 1), (379, 379), (2000, 300), (300, 2000), (640, 480), (1234, 987)]
    out = [Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)) for w, h in sizes]
    out.append(out[4].convert("L"))
    out.append(out[4].convert("RGBA"))
    return out


# -- the engine against the one-request path ----------------------------------------------

ENGINE_IMAGES = [os.path.join(FIXTURE_DIR, f) for f in ("img_land800x600.png",
                                                       "img_sq378.png")]


def workload(model, encoded, seed, n, adapters=None, followups=False):
    """Random mixed requests over ENGINE_IMAGES (`encoded`: their reference encodings):
    (Request, the one-request path's output).  "shared" requests are text-only behind one
    145-token system prompt (two full pages of 64): once one of them has finished, the
    others read its pages from the conversation cache, and must still equal the reference.
    `adapters` (name -> LoRA `Adapter`): half the requests, drawn after the rest, name one
    (those with an image pass its path: an encoded prefix is the base model's).
    `followups`: about a third of the requests continue an earlier text request's
    conversation (its prompt, the answer tokens it fed, a new question; its image and
    adapter): submitted after it has finished, they read its pages from the conversation
    cache."""
    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import Settings

    rng = np.random.default_rng(seed)
    pr = model.prompts
    out = []
    for i in range(n):
        k = rng.integers(len(ENGINE_IMAGES))
        image = ENGINE_IMAGES[k] if rng.random() < 0.5 else encoded[k]
        hot = rng.random() < 0.5
        s = Settings(temperature=0.9 if hot else 0.0, top_p=0.8, seed=int(rng.integers(100)),
                     max_tokens=int(rng.integers(1, 14)), max_objects=int(rng.integers(1, 4)))
        kind = rng.choice(["caption", "query", "text_only", "detect", "point", "shared"])
        if kind == "caption":
            req = Request("text", pr.caption(str(rng.choice(["short", "normal", "long"]))),
                          image, s)
        elif kind == "query":
            req = Request("text", pr.query(f"w{rng.integers(50, 900)} w7"), image, s)
        elif kind == "text_only":
            req = Request("text", [0] + pr.query(f"w{rng.integers(50, 900)}"), None, s)
        elif kind == "shared":
            system = pr.encode(" ".join(f"w{1000 + j}" for j in range(140)))
            req = Request("text", [0] + system + pr.query(f"w{rng.integers(50, 900)}"), None, s)
        else:
            req = Request(kind, (pr.detect if kind == "detect" else pr.point)(
                f"w{rng.integers(50, 900)}"), image, s)
        if adapters and rng.random() < 0.5:
            req.settings = dataclasses.replace(s, variant=str(rng.choice(sorted(adapters))))
            if req.image is not None:
                req.image = ENGINE_IMAGES[k]
        texts = [j for j, (r, _) in enumerate(out) if r.skill == "text"]
        if followups and texts and rng.random() < 0.35:
            prev, got = out[texts[int(rng.integers(len(texts)))]]
            fed = got["ids"][:-1] if got["finish_reason"] == "length" else got["ids"]
            req = Request("text", list(prev.prompt) + fed + pr.query(
                f"w{rng.integers(50, 900)}"), prev.image,
                dataclasses.replace(s, variant=prev.settings.variant))
        out.append((req, reference_output(model, encoded, req, adapters)))
    return out


def reference_output(model, encoded, req, adapters=None):
    """What the one-request reference path gives `req`, in the engine's result form (under
    its LoRA adapter, looked up in `adapters`, if it names one)."""
    from photon_jax.engine import reference
    from photon_jax.engine.frontend import ImagePrefix

    adapter = None if req.settings.variant is None else adapters[req.settings.variant]
    if adapter is not None and req.image is not None:
        enc = reference.encode_image(model, req.image, adapter=adapter)
    else:
        enc = None if req.image is None else (
            req.image if isinstance(req.image, ImagePrefix)
            else encoded[ENGINE_IMAGES.index(req.image)])
    if req.skill == "text":
        r = reference.generate_text(model, enc, req.prompt, req.settings, adapter=adapter)
        return {"text": r["text"], "ids": r["ids"], "finish_reason": r["finish_reason"]}
    r = reference.generate_points(model, enc, req.prompt, with_size=req.skill == "detect",
                                  max_objects=req.settings.max_objects, adapter=adapter)
    return {"objects": r["objects"], "finish_reason": r["finish_reason"]}


def strip(result):
    """A result without its token count (which the reference does not report)."""
    return {k: v for k, v in result.items() if k != "output_tokens"}


def run_in_waves(engine, reqs, waves=3, cancel=()):
    """Submit in staggered waves (later waves join while earlier ones decode)."""
    handles = []
    per = -(-len(reqs) // waves)
    for w in range(waves):
        for i, r in enumerate(reqs[w * per:(w + 1) * per], start=w * per):
            handles.append(engine.submit(r))
            if i in cancel:
                handles[-1].cancel()
        time.sleep(0.05)
    return [h.result(timeout=300) for h in handles]


# -- parity with the reference's golden cases (tests/fixtures/*/cases.json) ---------------

PARITY_TOL = 1e-4
PARITY_IMAGES = ["sq378", "land800x600", "wide1500x400", "photo512x600"]
PARITY_CASES = ["caption_short", "caption_normal", "caption_long", "query", "detect", "point"]


def rel_err(mine, ref):
    """max |mine - ref| relative to max |ref|."""
    mine = np.asarray(mine, np.float32)
    assert mine.shape == ref.shape, (mine.shape, ref.shape)
    return float(np.abs(mine - ref).max() / np.abs(ref).max())


def image_file(cases, iid, fixture_dir=FIXTURE_DIR):
    """The file of a fixture's image id."""
    return os.path.join(fixture_dir, next(i["file"] for i in cases["images"] if i["id"] == iid))


def encode_images(model, cases, fixture_dir=FIXTURE_DIR):
    """{image id: (EncodedImage, trace)} for the fixture's images."""
    from photon_jax.engine import reference as R

    out = {}
    for iid in PARITY_IMAGES:
        tr = {}
        out[iid] = (R.encode_image(model, image_file(cases, iid, fixture_dir), trace=tr), tr)
    return out


def check_greedy_outcome(model, enc, ref, case, settings, trace):
    """Run one fixture case on the reference path; its ids / text / bins / objects and stop
    reason must equal the fixture's."""
    from photon_jax.engine import reference as R
    from photon_jax.engine.settings import parse

    if case in ("detect", "point"):
        out = R.generate_points(model, enc, ref["prompt_ids"], with_size=case == "detect",
                                max_objects=settings["max_objects"], trace=trace)
        assert out["bins"] == ref["bins"]
        assert len(out["objects"]) == len(ref["result"])
        for mine, want in zip(out["objects"], ref["result"]):
            assert mine.keys() == want.keys()
            for k in mine:
                assert abs(mine[k] - want[k]) < 1e-6, (k, mine, want)
        stop = {"eos": "stop", "max_objects": "max_objects"}[ref["stop"]]
        assert out["finish_reason"] == stop
    else:
        s = parse({"temperature": settings["temperature"], "max_tokens": settings["max_tokens"]})
        out = R.generate_text(model, enc, ref["prompt_ids"], s, trace=trace)
        assert out["ids"] == ref["ids"]
        assert out["text"] == ref["text"]
        assert out["finish_reason"] == {"eos": "stop", "max_tokens": "length"}[ref["stop"]]


def check_prompt_ids(model, cases):
    """Our prompt templates give the reference's token ids for every skill."""
    q = cases["settings"]["query"]
    obj = cases["settings"]["object"]
    ref = cases["fp32"]["sq378"]["cases"]
    assert model.prompts.query(q) == ref["query"]["prompt_ids"]
    assert model.prompts.detect(obj) == ref["detect"]["prompt_ids"]
    assert model.prompts.point(obj) == ref["point"]["prompt_ids"]
    for length in ("short", "normal", "long"):
        assert model.prompts.caption(length) == ref[f"caption_{length}"]["prompt_ids"]


# -- the model without the engine ---------------------------------------------------------

def full_forward(cfg, params, x_TD, prefix):
    """Everything in one call on a fresh cache (no cached state at all).  One compiled
    program per (config, prefix, length): run op by op, the forward compiled each of its
    several hundred small ops (about 4 s of a test file's time)."""
    return _jit_full_forward()(cfg, params, x_TD, prefix)


@functools.lru_cache(maxsize=1)
def _jit_full_forward():
    import jax

    return jax.jit(_full_forward, static_argnums=(0, 3))


def _full_forward(cfg, params, x_TD, prefix):
    import jax.numpy as jnp

    from photon_jax.model import text

    t = x_TD.shape[0]
    cache = text.init_cache(cfg, rows=1, length=t)
    hidden, _, _ = text.forward(params["text"], cfg.text, x_TD[None], jnp.arange(t)[None],
                                cache, text.DenseAccess(jnp.zeros(1, jnp.int32),
                                                        jnp.full(1, prefix), t))
    return hidden[0]


# -- LoRA adapters ---------------------------------------------------------------------------

LORA_DIR = os.path.join(HERE, "fixtures", "lora")


def lora_tensors(rank: int, seed: int, *, dim=64, ff=256, qkv=192, layers=2,
                 b_scale=0.5) -> dict:
    """A random Moondream 2 adapter for the tiny fixture (its shapes by default) under the
    reference's renamed names (`text.blocks.<i>.attn.qkv.A`, ...), float32."""
    dims = {"attn.qkv": (dim, qkv), "attn.proj": (dim, dim), "mlp.fc1": (dim, ff),
            "mlp.fc2": (ff, dim)}
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(layers):
        for t, (ind, outd) in dims.items():
            out[f"text.blocks.{i}.{t}.A"] = (rng.standard_normal((rank, ind))
                                             / np.sqrt(ind)).astype(np.float32)
            out[f"text.blocks.{i}.{t}.B"] = (rng.standard_normal((outd, rank))
                                             * b_scale / np.sqrt(rank)).astype(np.float32)
    return out


def write_lora(path, rank: int, seed: int, **kw) -> str:
    """`lora_tensors` as a .safetensors file at `path` -> path."""
    write_safetensors(path, lora_tensors(rank, seed, **kw))
    return str(path)


def mesh_cases(devices: int, cases: list[str]) -> dict:
    """tests/mesh_check.py's results for `cases` on a mesh of `devices` CPU devices, run in
    a process of its own (JAX fixes its CPU device count when it starts).  The process
    inherits XLA_FLAGS (the suite's optimization level); mesh_check adds the device count."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__),
                                                        "mesh_check.py"),
                           str(devices), ",".join(cases)], capture_output=True, text=True,
                          timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MESH-RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("MESH-RESULT "):])


def mesh_assert_same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want)
    for key in want:
        assert got[key] == want[key], f"{what}: {key} differs"


def release_programs() -> None:
    """Free every compiled program this process holds that nothing else references: jax's
    caches, photon_jax's per-model and per-config program caches, then a collection (the
    suite's raised GC threshold keeps cycles, and executables in them, alive longer).  The
    suite calls it between files once a worker holds half its mapping limit (conftest.py;
    docs/testing.md, "The worker crashes")."""
    import gc

    import jax

    from photon_jax.engine import step

    step._MODEL_PROGRAMS.clear()
    step._MODEL_ORACLES.clear()
    step._build.cache_clear()
    step.build_oracle.cache_clear()
    jax.clear_caches()
    gc.collect()


# -- HLO audits (tests/test_hlo_audit.py, tests/test_slicing.py) ----------------------------

def audit(hlo_text: str) -> list[str]:
    """The offending instructions of an optimized HLO module: every `conditional`, and every
    `while` without XLA's known-trip-count annotation."""
    bad = []
    for line in hlo_text.splitlines():
        inst = line.strip()
        if " conditional(" in inst:
            bad.append(inst[:200])
        elif " while(" in inst and '"known_trip_count"' not in inst:
            bad.append(inst[:200])
    return bad
