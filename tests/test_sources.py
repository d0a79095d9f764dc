"""Loading from a Hugging Face download: hub ids, snapshot directories and the converted cache
(photon_jax/sources.py), with no network.

Every test runs with HF_HUB_OFFLINE=1 and HF_HOME / HF_HUB_CACHE / PHOTON_JAX_CACHE in
tmp_path; a Hugging Face cache is laid out there from the tiny fixture as huggingface_hub lays
it out (`models--ORG--NAME/blobs/<sha256>`, `snapshots/<commit>/<file>` symlinks to the blobs,
`refs/<branch or tag>` holding the commit).  The bad snapshots are photon-convert's
(`helpers.BAD_SNAPSHOTS`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import types

import pytest

from photon_jax import sources
from photon_jax.api import Moondream
from photon_jax.cli.caption import main as caption_main
from photon_jax.convert import ConvertError
from photon_jax.model.checkpoint import read_config
from helpers import BAD_SNAPSHOTS, gpt2_tokenizer, make_hf, read_safetensors

REPO = "moondream-test/tiny"
REV_MAIN, REV_TAG, REV_STARMIE = "a" * 40, "b" * 40, "c" * 40
TAG = "2025-06-21"
IMAGE = "img_sq378.png"
SETTINGS = {"temperature": 0, "max_tokens": 6}
SNAPSHOT_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def add_snapshot(hub, repo: str, rev: str, files: dict, refs=()):
    """One commit of `repo` in the Hugging Face cache `hub`: {name: source file}."""
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for name, path in files.items():
        with open(path, "rb") as f:
            blob = repo_dir / "blobs" / hashlib.sha256(f.read()).hexdigest()
        if not blob.exists():
            shutil.copyfile(path, blob)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    (repo_dir / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo_dir / "refs" / ref).write_text(rev)   # as huggingface_hub writes it: no newline
    return snap


@pytest.fixture(autouse=True)
def env(tmp_path, monkeypatch):
    """Offline, with every cache in tmp_path."""
    hub = tmp_path / "hf-home" / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PHOTON_JAX_CACHE", str(tmp_path / "photon-cache"))
    return types.SimpleNamespace(hub=hub, cache=tmp_path / "photon-cache")


@pytest.fixture
def conversions(monkeypatch):
    """The snapshots `sources` converted, in order."""
    calls = []
    real = sources._convert

    def spy(hf_dir, out_dir, **kw):
        calls.append(hf_dir)
        return real(hf_dir, out_dir, **kw)

    monkeypatch.setattr(sources, "_convert", spy)
    return calls


@pytest.fixture(scope="module")
def src(fixture_dir):
    return read_safetensors(os.path.join(fixture_dir, "model.safetensors"))


def fixture_files(fixture_dir, names=SNAPSHOT_FILES) -> dict:
    return {n: os.path.join(fixture_dir, n) for n in names}


def entries(cache) -> list[str]:
    """The cache's entries and any temporary leftovers (not its lock / hash memo files)."""
    if not os.path.isdir(cache):
        return []
    return sorted(e for e in os.listdir(cache)
                  if not e.startswith(".") or ".tmp-" in e)


def caption(source, fixture_dir, **kw) -> str:
    md = Moondream.load(source, max_batch_size=2, **kw)
    try:
        return md.caption(os.path.join(fixture_dir, IMAGE), "short",
                          settings=SETTINGS)["caption"]
    finally:
        md.close()


# -- every kind of source, one conversion -------------------------------------------------


def test_every_kind_of_source_gives_the_same_caption(env, conversions, fixture_dir, tiny_ckpt,
                                                      tmp_path):
    files = fixture_files(fixture_dir)
    snap_main = add_snapshot(env.hub, REPO, REV_MAIN, files, refs=["main"])
    snap_tag = add_snapshot(env.hub, REPO, REV_TAG, files, refs=[TAG])
    local = make_hf(fixture_dir, tmp_path, name="md2")   # as `hf download --local-dir md2`
    assert sources.hub_snapshot(REPO) == str(snap_main)
    assert sources.hub_snapshot(REPO, revision=TAG) == str(snap_tag)

    got = {
        "hub id": caption(REPO, fixture_dir),
        "hub id @ revision": caption(REPO, fixture_dir, revision=TAG),
        "snapshot directory": caption(str(local), fixture_dir),
        "photon-convert directory": caption(tiny_ckpt, fixture_dir),
    }
    assert len(set(got.values())) == 1 and got["hub id"], got
    # Keyed by content: the two commits and the --local-dir copy hold the same files, so the
    # first load converted and the others reused its entry.
    assert conversions == [str(snap_main)]
    (entry,) = entries(env.cache)
    assert entry.startswith("bfloat16-")   # bf16 weights -> a bf16 cache; dtype=None
    path = os.path.join(env.cache, entry)
    assert read_config(path).dtype == "bfloat16"
    stamp = os.stat(os.path.join(path, "config.json")).st_mtime_ns
    assert sources.resolve(REPO) == path
    assert sources.resolve(str(local)) == path
    assert conversions == [str(snap_main)]
    assert os.stat(os.path.join(path, "config.json")).st_mtime_ns == stamp
    assert sources.resolve(tiny_ckpt) == tiny_ckpt   # a photon-convert directory: as it is


def test_dtype_and_a_killed_conversion(env, conversions, fixture_dir, tmp_path):
    local = str(make_hf(fixture_dir, tmp_path, name="md2"))
    f32 = sources.resolve(local, dtype="float32")
    assert os.path.basename(f32).startswith("float32-")
    assert read_config(f32).dtype == "float32"
    bf16 = sources.resolve(local, dtype="bfloat16")
    assert os.path.basename(bf16).startswith("bfloat16-")
    assert len(conversions) == 2

    # A conversion killed before its rename leaves only a temporary directory, which is not
    # an entry; the next load converts again and removes it.
    shutil.rmtree(f32)
    name = os.path.basename(f32)
    os.makedirs(os.path.join(env.cache, f".{name}.tmp-killed", "ckpt", "params"))
    assert sources.resolve(local, dtype="float32") == f32
    assert len(conversions) == 3
    assert entries(env.cache) == sorted([os.path.basename(bf16), name])

    # An interrupt mid-conversion: no entry, no leftovers.
    def interrupted(hf_dir, out_dir, **kw):
        os.makedirs(os.path.join(out_dir, "params"))
        raise KeyboardInterrupt

    shutil.rmtree(f32)
    real = sources._convert
    sources._convert = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            sources.resolve(local, dtype="float32")
    finally:
        sources._convert = real
    assert entries(env.cache) == [os.path.basename(bf16)]


# -- the tokenizer --------------------------------------------------------------------------


@pytest.mark.parametrize("hub_module", [True, False], ids=["huggingface_hub", "cache-layout"])
def test_starmie_tokenizer_from_the_hf_cache(env, fixture_dir, tmp_path, monkeypatch,
                                             hub_module):
    if not hub_module:   # look in the cache layout directly
        monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    starmie = add_snapshot(env.hub, sources.STARMIE_REPO, REV_STARMIE,
                           fixture_files(fixture_dir, ["tokenizer.json"]), refs=["main"])
    snap = make_hf(fixture_dir, tmp_path, name="md2")
    assert sources.find_tokenizer(str(snap)) == (str(snap / "tokenizer.json"), "")

    os.remove(snap / "tokenizer.json")
    path, note = sources.find_tokenizer(str(snap))
    assert path == str(starmie / "tokenizer.json") and "no tokenizer.json" in note

    gpt2_tokenizer(snap / "tokenizer.json")   # the one old Moondream 2 snapshots carry
    path, note = sources.find_tokenizer(str(snap))
    assert path == str(starmie / "tokenizer.json") and "GPT-2" in note


def test_no_tokenizer_says_what_to_fetch_and_where(env, fixture_dir, tmp_path):
    snap = make_hf(fixture_dir, tmp_path, name="md2")
    os.remove(snap / "tokenizer.json")
    with pytest.raises(sources.SourceError) as e:
        sources.resolve(str(snap))
    msg = str(e.value)
    assert "no tokenizer.json" in msg and "HF_HUB_OFFLINE" in msg
    assert f"hf download moondream/starmie-v1 tokenizer.json --local-dir {snap}" in msg

    # In the Hugging Face cache: fetched into that cache, not over the snapshot's symlinks.
    add_snapshot(env.hub, REPO, REV_MAIN, fixture_files(fixture_dir, SNAPSHOT_FILES[:2]),
                 refs=["main"])
    with pytest.raises(sources.SourceError) as e:
        sources.resolve(REPO)
    assert "hf download moondream/starmie-v1 tokenizer.json (it goes into the Hugging Face " \
           "cache" in str(e.value)
    assert entries(env.cache) == []


# -- bad sources: the converter's messages; photon-caption exits 2 ------------------------


BAD = {"missing_tensor": BAD_SNAPSHOTS["missing_tensor"],
       "wrong_shape": BAD_SNAPSHOTS["wrong_shape"],
       "gpt2_tokenizer": BAD_SNAPSHOTS["gpt2_tokenizer"],
       "int4_checkpoint": BAD_SNAPSHOTS["quantized_config"]}


def caption_cli(fixture_dir, tmp_path, capfd, *model_args):
    capfd.readouterr()
    rc = caption_main([os.path.join(fixture_dir, IMAGE), *model_args, "--output-dir",
                       str(tmp_path / "captions"), "--quiet"])
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("photon-caption: error:")]
    assert len(errors) == 1, err
    # Besides the one-line reason, only the conversion's own notes.
    assert all(ln.startswith("photon_jax: ") for ln in err.splitlines() if ln not in errors)
    assert not os.path.exists(tmp_path / "captions")
    return rc, errors[0]


@pytest.mark.parametrize("case", list(BAD))
def test_bad_snapshot(case, env, src, fixture_dir, tmp_path, capfd):
    hf = make_hf(fixture_dir, tmp_path)
    words = BAD[case](src, hf, fixture_dir)
    with pytest.raises((ConvertError, sources.SourceError)) as e:
        Moondream.load(str(hf), max_batch_size=2)
    for w in words:
        assert w in str(e.value), f"{w!r} not in {e.value}"
    assert entries(env.cache) == []   # no entry, no half-written leftovers

    rc, line = caption_cli(fixture_dir, tmp_path, capfd, "--model", str(hf))
    assert rc == 2
    for w in words:
        assert w in line, f"{w!r} not in {line}"


@pytest.mark.parametrize("model_args, words", [
    (["--model", "/nonexistent/md2"], ["model not found", "/nonexistent/md2"]),
    (["--model", "nobody/nothing"], ["nobody/nothing", "HF_HUB_OFFLINE", "hf download"]),
    (["--model", REPO, "--revision", "no-such-tag"], ["no-such-tag", "HF_HUB_OFFLINE"]),
], ids=["missing_dir", "hub_id_not_cached", "revision_not_cached"])
def test_bad_model_argument_exits_2(model_args, words, env, fixture_dir, tmp_path, capfd):
    add_snapshot(env.hub, REPO, REV_MAIN, fixture_files(fixture_dir), refs=["main"])
    rc, line = caption_cli(fixture_dir, tmp_path, capfd, *model_args)
    assert rc == 2
    for w in words:
        assert w in line, f"{w!r} not in {line}"


def test_revision_needs_a_hub_id(tiny_ckpt):
    with pytest.raises(sources.SourceError, match="hub id"):
        Moondream.load(tiny_ckpt, revision=TAG)


def test_hub_id_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(sources.SourceError, match=r"photon_jax\[hf\]"):
        sources.resolve(REPO)
