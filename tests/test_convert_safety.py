"""photon-convert (and the model-source resolver, which indexes snapshots with the same reader)
against hostile checkpoints: every malformed safetensors header, every index whose shard names
leave the snapshot, every symlink that points out of it, is refused with the converter's error
(naming the file, the tensor or field, and the fix) before anything large is allocated -- never
a traceback, never a silent conversion.  The CLI exits 2 with `photon-convert: error:`.

Two levels: the header reader alone on a two-tensor file (fast, many cases), and the same
defects planted in a copy of the tiny fixture's own weights, so that nothing but the planted
defect can make the conversion fail.

The symlink rule tested here: a weights file, index, config.json or tokenizer.json of the
snapshot may be a symlink only when its target resolves inside the snapshot folder; for a
snapshot inside a Hugging Face cache (`models--ORG--NAME/snapshots/REV/`) inside that repo's
folder (its `blobs/`); and for a folder outside any cache (an old `hf download --local-dir`,
which linked big files into the cache) to a Hugging Face cache blob.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct

import numpy as np
import pytest

from photon_jax.cli.convert import main
from photon_jax.convert import ConvertError, convert
from photon_jax.convert.safetensors_io import (SafetensorsError, TensorRef, read_header,
                                               read_tensor)

from helpers import MD3_FIXTURE_DIR, make_hf, read_safetensors, write_safetensors

ST = "model.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def src(fixture_dir):
    return read_safetensors(os.path.join(fixture_dir, ST))


# -- writing hostile files ------------------------------------------------------------------


def write_raw(path, header, data: bytes = b"", *, length: int | None = None) -> None:
    """A file laid out as safetensors: u64 length, `header` (a JSON value, or raw bytes as
    they are), `data`.  `length` overrides the declared header length."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h) if length is None else length) + h + data)


def split_file(path) -> tuple[dict, bytes]:
    """(header, data) of a file written by `write_safetensors`, read without photon_jax."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        return header, f.read()


def edit_header(path, edit) -> None:
    header, data = split_file(path)
    edit(header)
    write_raw(path, header, data)


def refused(hf, tmp_path, capsys, words) -> str:
    """photon-convert refuses `hf` with a ConvertError holding `words`, writes nothing, and
    the CLI exits 2 with its usual one-line prefix and no traceback."""
    parent = tmp_path / "outparent"
    parent.mkdir(exist_ok=True)
    out = parent / "out"
    with pytest.raises(ConvertError) as e:
        convert(str(hf), str(out), dtype="float32", log=lambda s: None)
    msg = str(e.value)
    for w in words:
        assert w in msg, f"{w!r} not in error message: {msg}"
    assert os.listdir(parent) == []
    capsys.readouterr()
    rc = main([str(hf), str(out), "--dtype", "float32"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "photon-convert: error:" in err and "Traceback" not in err
    for w in words:
        assert w in err
    assert os.listdir(parent) == []
    return msg


def converts(hf, tmp_path) -> None:
    out = tmp_path / "converted"
    convert(str(hf), str(out), dtype="float32", log=lambda s: None)
    assert os.path.isdir(out / "params")


# -- the header of one file: defects, each as an edit of tensor `t` (whose neighbour in the
# file is `u`, of the same dtype and shape) ---------------------------------------------------


def _set(key, value):
    def edit(h, t, u):
        h[t][key] = value
    return edit


def _drop(key):
    def edit(h, t, u):
        del h[t][key]
    return edit


def _shape(fn):
    def edit(h, t, u):
        h[t]["shape"] = fn(h[t]["shape"])
    return edit


def _offsets(fn):
    def edit(h, t, u):
        h[t]["data_offsets"] = fn(*h[t]["data_offsets"])
    return edit


def _overlap_same(h, t, u):
    h[u]["data_offsets"] = list(h[t]["data_offsets"])


def _overlap_part(h, t, u):
    a, b = h[t]["data_offsets"]
    half = (b - a) // 2
    h[u]["data_offsets"] = [a + half, b + half]


# (case id, edit, words the error must hold besides the file's name; "{t}": the tensor's name)
ENTRY_CASES = [
    ("entry_is_list", lambda h, t, u: h.__setitem__(t, [1, 2]), ["{t}"]),
    ("entry_is_string", lambda h, t, u: h.__setitem__(t, "F32"), ["{t}"]),
    ("entry_is_null", lambda h, t, u: h.__setitem__(t, None), ["{t}"]),
    ("dtype_missing", _drop("dtype"), ["{t}", "dtype"]),
    ("dtype_number", _set("dtype", 7), ["{t}", "dtype"]),
    ("dtype_null", _set("dtype", None), ["{t}", "dtype"]),
    ("dtype_unknown", _set("dtype", "XYZ"), ["{t}", "dtype", "XYZ"]),
    ("dtype_lowercase", _set("dtype", "f32"), ["{t}", "dtype", "f32"]),
    ("shape_missing", _drop("shape"), ["{t}", "shape"]),
    ("shape_string", _set("shape", "2x2"), ["{t}", "shape"]),
    ("shape_object", _set("shape", {"0": 2}), ["{t}", "shape"]),
    ("shape_null", _set("shape", None), ["{t}", "shape"]),
    ("shape_negative", _shape(lambda s: [-s[0], -s[1]]), ["{t}", "shape"]),
    ("shape_one_negative", _shape(lambda s: [s[0], -s[1]]), ["{t}", "shape"]),
    ("shape_float", _shape(lambda s: [float(d) for d in s]), ["{t}", "shape"]),
    ("shape_string_entries", _shape(lambda s: [str(d) for d in s]), ["{t}", "shape"]),
    ("shape_bool_entry", _shape(lambda s: [True, *s]), ["{t}", "shape"]),
    ("shape_nested", _shape(lambda s: [[d] for d in s]), ["{t}", "shape"]),
    ("shape_null_entry", _shape(lambda s: [None, *s]), ["{t}", "shape"]),
    ("shape_huge_with_zero", _shape(lambda s: [0, 2**62, 2**62]), ["{t}", "shape"]),
    ("offsets_missing", _drop("data_offsets"), ["{t}", "data_offsets"]),
    ("offsets_null", _set("data_offsets", None), ["{t}", "data_offsets"]),
    ("offsets_string", _set("data_offsets", "0,16"), ["{t}", "data_offsets"]),
    ("offsets_one", _offsets(lambda a, b: [a]), ["{t}", "data_offsets"]),
    ("offsets_three", _offsets(lambda a, b: [a, b, b]), ["{t}", "data_offsets"]),
    ("offsets_string_entries", _offsets(lambda a, b: [str(a), str(b)]), ["{t}", "data_offsets"]),
    ("offsets_float", _offsets(lambda a, b: [float(a), float(b)]), ["{t}", "data_offsets"]),
    ("offsets_bool", _offsets(lambda a, b: [False, b] if a == 0 else [a, True]),
     ["{t}", "data_offsets"]),
    ("offsets_nan", _offsets(lambda a, b: [float("nan"), b]), ["{t}", "data_offsets"]),
    ("offsets_negative_begin", _offsets(lambda a, b: [a - 8, b - 8] if a < 8 else [-8, b - a - 8]),
     ["{t}", "data_offsets"]),
    ("offsets_both_negative", _offsets(lambda a, b: [-(b - a) - 8, -8]), ["{t}", "data_offsets"]),
    ("offsets_begin_after_end", _offsets(lambda a, b: [b, a]), ["{t}", "data_offsets"]),
    ("offsets_past_end", _offsets(lambda a, b: [a + 10**9, b + 10**9]), ["{t}", "truncated"]),
    ("offsets_huge", _offsets(lambda a, b: [2**70, 2**70 + b - a]), ["{t}", "truncated"]),
    ("length_short", _offsets(lambda a, b: [a, b - 4]), ["{t}", "bytes"]),
    ("length_long", _offsets(lambda a, b: [a, b + 4]), ["{t}", "bytes"]),
    ("length_zero", _offsets(lambda a, b: [a, a]), ["{t}", "bytes"]),
    ("overlap_same_range", _overlap_same, ["{t}", "{u}", "overlap"]),
    ("overlap_partial", _overlap_part, ["{t}", "{u}", "overlap"]),
]

# Defects of the header as a whole: (case id, raw header bytes or JSON value, declared length
# or None, words).
HEADER_CASES = [
    ("header_list", [{"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}], None, ["object"]),
    ("header_number", 42, None, ["object"]),
    ("header_string", "abc", None, ["object"]),
    ("header_null", None, None, ["object"]),
    ("header_true", True, None, ["object"]),
    ("metadata_list", {"__metadata__": [1, 2]}, None, ["__metadata__"]),
    ("header_deeply_nested", b"[" * 200_000, None, ["header"]),
    ("entry_deeply_nested", b'{"a": {"dtype": ' + b"[" * 200_000 + b"}}", None, ["header"]),
    ("header_huge_integer", b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000
     + b'], "data_offsets": [0, 16]}}', None, ["header"]),
    ("header_duplicate_tensor",
     b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
     b'"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}', None, ["'a'"]),
    ("header_not_json", b"{not json", None, ["header"]),
    ("header_not_utf8", b'{"\xff\xfe": 1}', None, ["header"]),
    ("header_empty", b"", None, ["header"]),
    ("length_past_file", {}, 10**6, ["header"]),
    ("length_u64_max", {}, 2**64 - 1, ["header"]),
]


def _two_tensor_file(path, edit=None):
    header = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 32]}}
    if edit is not None:
        edit(header, "a", "b")
    write_raw(path, header, np.arange(8, dtype=np.float32).tobytes())


def _words(words, t, u):
    return [w.replace("{t}", t).replace("{u}", u) for w in words]


@pytest.mark.parametrize("case,edit,words", ENTRY_CASES, ids=[c[0] for c in ENTRY_CASES])
def test_header_entry_refused(case, edit, words, tmp_path):
    path = tmp_path / ST
    _two_tensor_file(path, edit)
    with pytest.raises(SafetensorsError) as e:
        read_header(str(path))
    msg = str(e.value)
    for w in [str(path), *_words(words, "'a'", "'b'")]:
        assert w in msg, f"{w!r} not in: {msg}"


@pytest.mark.parametrize("case,header,length,words", HEADER_CASES,
                         ids=[c[0] for c in HEADER_CASES])
def test_header_refused(case, header, length, words, tmp_path):
    path = tmp_path / ST
    write_raw(path, header, bytes(32), length=length)
    with pytest.raises(SafetensorsError) as e:
        read_header(str(path))
    msg = str(e.value)
    for w in [str(path), *words]:
        assert w in msg, f"{w!r} not in: {msg}"


def test_header_over_100mb_refused_before_reading_it(tmp_path):
    # A sparse file: the declared length fits the file but exceeds the header limit.
    path = tmp_path / ST
    n = 100_000_008
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n))
        f.truncate(8 + n + 16)
    with pytest.raises(SafetensorsError, match="header"):
        read_header(str(path))


def test_good_header_still_reads(tmp_path):
    """What the checks must keep accepting: __metadata__, padding, zero-size tensors,
    and a dtype photon-convert refuses later by name (F64)."""
    path = tmp_path / ST
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "e": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [16, 16]},
              "s": {"dtype": "F64", "shape": [], "data_offsets": [16, 24]},
              "g": {"dtype": "U8", "shape": [8], "data_offsets": [24, 32]}}
    write_raw(path, header, np.arange(8, dtype=np.float32).tobytes())
    refs = read_header(str(path))
    assert sorted(refs) == ["a", "e", "g", "s"]
    assert refs["e"].shape == (0, 3) and refs["s"].shape == ()
    np.testing.assert_array_equal(read_tensor(refs["a"]), np.arange(4.0).reshape(2, 2))
    assert read_tensor(refs["e"]).shape == (0, 3)


@pytest.mark.parametrize("offsets,data,what", [
    ({"a": [0, 16], "g": [20, 24]}, 24, "bytes [16, 20)"),     # a gap
    ({"a": [0, 16], "g": [16, 20]}, 24, "last 4 bytes"),       # a tail no tensor owns
    ({"a": [4, 20], "g": [20, 24]}, 24, "bytes [0, 4)"),       # a hole at the start
])
def test_bytes_no_tensor_owns_are_refused(offsets, data, what, tmp_path):
    """As the safetensors library does: a file whose tensors do not fill its data exactly
    is not what its header says."""
    path = tmp_path / ST
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": offsets["a"]},
              "g": {"dtype": "U8", "shape": [4], "data_offsets": offsets["g"]}}
    write_raw(path, header, bytes(data))
    with pytest.raises(SafetensorsError, match="belong to no tensor") as e:
        read_header(str(path))
    assert what in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("start,nbytes", [(-1, 16), (-16, 16), (10**9, 16), (8, -4)])
def test_read_tensor_refuses_ranges_outside_the_file(start, nbytes, tmp_path):
    # TensorRefs also come from the torch-zip reader; read_tensor checks them again.
    path = tmp_path / ST
    _two_tensor_file(path)
    ref = TensorRef("a", str(path), "F32", (2, 2), start, nbytes)
    with pytest.raises(SafetensorsError) as e:
        read_tensor(ref)
    assert str(path) in str(e.value) and "'a'" in str(e.value)


# -- the same defects in a whole snapshot: photon-convert and its CLI refuse them -------------

T, U = "model.text.blocks.0.attn.qkv.weight", "model.text.blocks.1.attn.qkv.weight"


@pytest.mark.parametrize("case,edit,words", ENTRY_CASES, ids=[c[0] for c in ENTRY_CASES])
def test_convert_refuses_bad_entry(case, edit, words, fixture_dir, tmp_path, capsys):
    hf = make_hf(fixture_dir, tmp_path)
    edit_header(hf / ST, lambda h: edit(h, T, U))
    refused(hf, tmp_path, capsys, [ST, *_words(words, T, U)])


_E2E_HEADER = [c for c in HEADER_CASES if c[0] in (
    "header_list", "header_number", "header_null", "header_deeply_nested",
    "header_huge_integer", "header_duplicate_tensor", "metadata_list", "length_past_file")]


@pytest.mark.parametrize("case,header,length,words", _E2E_HEADER, ids=[c[0] for c in _E2E_HEADER])
def test_convert_refuses_bad_header(case, header, length, words, fixture_dir, tmp_path, capsys):
    hf = make_hf(fixture_dir, tmp_path)
    write_raw(hf / ST, header, bytes(64), length=length)
    refused(hf, tmp_path, capsys, [ST, *words])


def test_scalar_fused_tau_is_refused(tmp_path, capsys):
    # Kestrel's fused tau weight (Moondream 3) is split by rows; a scalar one has none.
    t = read_safetensors(os.path.join(MD3_FIXTURE_DIR, ST))
    del t["model.text.blocks.0.attn.tau.wq"], t["model.text.blocks.0.attn.tau.wv"]
    t["model.text.blocks.0.attn.tau.wqwv"] = np.ones(1, np.float32)
    hf = make_hf(MD3_FIXTURE_DIR, tmp_path, t)
    edit_header(hf / ST, lambda h: h["model.text.blocks.0.attn.tau.wqwv"].__setitem__("shape", []))
    refused(hf, tmp_path, capsys, ["text.blocks.0.attn.tau.wqwv", "shape"])


# -- config.json is part of the checkpoint too ------------------------------------------------


def _config_text(fixture_dir, edit) -> str:
    with open(os.path.join(fixture_dir, "config.json")) as f:
        c = json.load(f)
    edit(c)
    return json.dumps(c)


CONFIG_CASES = [
    ("deeply_nested", lambda fx: '{"config": ' + "[" * 200_000),
    ("huge_integer", lambda fx: '{"config": {"text": {"dim": ' + "9" * 5000 + "}}}"),
    ("infinite_number", lambda fx: _config_text(
        fx, lambda c: c["config"]["text"].__setitem__("dim", 1e400))),
    # listing 10^8 layers' tensor names would take an hour and gigabytes
    ("absurd_layer_count", lambda fx: _config_text(
        fx, lambda c: c["config"]["text"].__setitem__("n_layers", 10**8))),
]


@pytest.mark.parametrize("case,text", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_hostile_config_is_refused(case, text, fixture_dir, tmp_path, capsys):
    hf = make_hf(fixture_dir, tmp_path)
    (hf / "config.json").write_text(text(fixture_dir))
    refused(hf, tmp_path, capsys, ["config.json"])


def test_oversized_config_is_refused_unread(fixture_dir, tmp_path, capsys):
    hf = make_hf(fixture_dir, tmp_path)
    with open(hf / "config.json", "r+b") as f:
        f.truncate(50_000_000)   # sparse: no disk, and never read
    refused(hf, tmp_path, capsys, ["config.json", "too large"])


# -- shard names and symlinks: confined to the snapshot ---------------------------------------


def shard_snapshot(fixture_dir, tmp_path, shard_name: str, name="hf"):
    """The fixture with its weights moved out of model.safetensors and an index whose every
    tensor lives in `shard_name`."""
    hf = make_hf(fixture_dir, tmp_path, name=name)
    header, _ = split_file(hf / ST)
    os.remove(hf / ST)
    with open(hf / INDEX, "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: shard_name for n in header}}, f)
    return hf


def outside_weights(fixture_dir, tmp_path) -> str:
    """A complete, valid weights file outside the snapshot."""
    d = tmp_path / "outside"
    d.mkdir(exist_ok=True)
    shutil.copyfile(os.path.join(fixture_dir, ST), d / ST)
    return str(d / ST)


def test_index_shard_name_with_dotdot_is_refused(fixture_dir, tmp_path, capsys):
    outside_weights(fixture_dir, tmp_path)
    hf = shard_snapshot(fixture_dir, tmp_path, "../outside/model.safetensors")
    refused(hf, tmp_path, capsys, [INDEX, "../outside/model.safetensors"])


def test_index_shard_name_to_etc_passwd_is_refused(fixture_dir, tmp_path, capsys):
    hf = shard_snapshot(fixture_dir, tmp_path, "../../../../../../../../etc/passwd")
    refused(hf, tmp_path, capsys, [INDEX, "../../../../../../../../etc/passwd"])


def test_index_absolute_shard_name_is_refused(fixture_dir, tmp_path, capsys):
    target = outside_weights(fixture_dir, tmp_path)
    hf = shard_snapshot(fixture_dir, tmp_path, target)
    refused(hf, tmp_path, capsys, [INDEX, target])


def test_index_shard_symlink_out_of_snapshot_is_refused(fixture_dir, tmp_path, capsys):
    target = outside_weights(fixture_dir, tmp_path)
    hf = shard_snapshot(fixture_dir, tmp_path, "model-00001-of-00001.safetensors")
    os.symlink(target, hf / "model-00001-of-00001.safetensors")
    refused(hf, tmp_path, capsys, ["model-00001-of-00001.safetensors", "symlink"])


def test_index_shard_in_symlinked_folder_out_of_snapshot_is_refused(fixture_dir, tmp_path,
                                                                    capsys):
    outside_weights(fixture_dir, tmp_path)
    hf = shard_snapshot(fixture_dir, tmp_path, "sub/model.safetensors")
    os.symlink(tmp_path / "outside", hf / "sub")
    refused(hf, tmp_path, capsys, ["sub/model.safetensors"])


def test_single_file_symlink_out_of_snapshot_is_refused(fixture_dir, tmp_path, capsys):
    target = outside_weights(fixture_dir, tmp_path)
    hf = make_hf(fixture_dir, tmp_path)
    os.remove(hf / ST)
    os.symlink(target, hf / ST)
    refused(hf, tmp_path, capsys, [ST, "symlink"])


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", INDEX])
def test_other_snapshot_files_symlinked_out_are_refused(name, fixture_dir, tmp_path, capsys):
    hf = shard_snapshot(fixture_dir, tmp_path, "model-00001-of-00001.safetensors")
    shutil.copyfile(os.path.join(fixture_dir, ST), hf / "model-00001-of-00001.safetensors")
    (tmp_path / "outside").mkdir()
    os.replace(hf / name, tmp_path / "outside" / name)
    os.symlink(tmp_path / "outside" / name, hf / name)
    refused(hf, tmp_path, capsys, [name, "symlink"])


def test_index_shard_that_is_not_a_regular_file_is_refused(fixture_dir, tmp_path, capsys):
    hf = shard_snapshot(fixture_dir, tmp_path, "model-00001-of-00001.safetensors")
    os.mkfifo(hf / "model-00001-of-00001.safetensors")   # opening it would block
    refused(hf, tmp_path, capsys, ["model-00001-of-00001.safetensors"])


def test_index_names_the_wrong_shard_for_a_tensor(src, fixture_dir, tmp_path, capsys):
    hf = make_hf(fixture_dir, tmp_path)
    os.remove(hf / ST)
    names = list(src)
    write_safetensors(hf / "a.safetensors", {n: src[n] for n in names[:100]})
    write_safetensors(hf / "b.safetensors", {n: src[n] for n in names[100:]})
    wm = {n: "a.safetensors" if i < 100 else "b.safetensors" for i, n in enumerate(names)}
    wm[names[0]] = "b.safetensors"
    with open(hf / INDEX, "w") as f:
        json.dump({"weight_map": wm}, f)
    refused(hf, tmp_path, capsys, [INDEX, names[0], "a.safetensors"])


def hf_cache_snapshot(fixture_dir, root, *, sharded: bool):
    """A Hugging Face cache repo folder: blobs named by sha256, snapshots/<rev>/ of relative
    symlinks into ../../blobs."""
    repo = root / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    files = {"config.json": os.path.join(fixture_dir, "config.json"),
             "tokenizer.json": os.path.join(fixture_dir, "tokenizer.json")}
    staging = root / "staging"
    staging.mkdir()
    if sharded:
        t = read_safetensors(os.path.join(fixture_dir, ST))
        names = list(t)
        for i, part in enumerate((names[:150], names[150:])):
            p = staging / f"model-0000{i + 1}-of-00002.safetensors"
            write_safetensors(p, {n: t[n] for n in part})
            files[p.name] = str(p)
        with open(staging / INDEX, "w") as f:
            json.dump({"weight_map": {n: f"model-0000{1 + (i >= 150)}-of-00002.safetensors"
                                      for i, n in enumerate(names)}}, f)
        files[INDEX] = str(staging / INDEX)
    else:
        files[ST] = os.path.join(fixture_dir, ST)
    for name, path in files.items():
        with open(path, "rb") as f:
            blob = repo / "blobs" / hashlib.sha256(f.read()).hexdigest()
        shutil.copyfile(path, blob)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    return snap


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_hf_cache_snapshot_symlinks_into_blobs_still_convert(sharded, fixture_dir, tmp_path):
    snap = hf_cache_snapshot(fixture_dir, tmp_path, sharded=sharded)
    converts(snap, tmp_path)


def test_hf_cache_snapshot_symlink_out_of_its_repo_is_refused(fixture_dir, tmp_path, capsys):
    snap = hf_cache_snapshot(fixture_dir, tmp_path, sharded=False)
    target = outside_weights(fixture_dir, tmp_path)
    os.remove(snap / ST)
    os.symlink(os.path.relpath(target, snap), snap / ST)
    refused(snap, tmp_path, capsys, [ST, "symlink"])


def test_local_dir_symlinked_into_the_hf_cache_still_converts(fixture_dir, tmp_path):
    # huggingface_hub < 0.23 `--local-dir` linked big files to the cache's blobs.
    snap = hf_cache_snapshot(fixture_dir, tmp_path, sharded=False)
    hf = make_hf(fixture_dir, tmp_path)
    os.remove(hf / ST)
    os.symlink(os.path.realpath(snap / ST), hf / ST)
    converts(hf, tmp_path)


def test_snapshot_folder_reached_through_a_symlink_still_converts(fixture_dir, tmp_path):
    hf = make_hf(fixture_dir, tmp_path)
    os.symlink(hf, tmp_path / "link")
    converts(tmp_path / "link", tmp_path)


# -- the model-source resolver reads snapshots with the same reader ---------------------------


def test_resolver_refuses_hostile_snapshots_with_its_errors(fixture_dir, tmp_path, monkeypatch):
    from photon_jax import sources

    monkeypatch.setenv("PHOTON_JAX_CACHE", str(tmp_path / "cache"))
    bad_header = make_hf(fixture_dir, tmp_path, name="bad_header")
    write_raw(bad_header / ST, [1, 2, 3], bytes(16))
    outside_weights(fixture_dir, tmp_path)
    escaping = shard_snapshot(fixture_dir, tmp_path, "../outside/model.safetensors",
                              name="escaping")
    for hf, word in ((bad_header, "object"), (escaping, "../outside/model.safetensors")):
        with pytest.raises(sources.errors()) as e:
            sources.resolve(str(hf), log=lambda s: None)
        assert word in str(e.value)
    cache = tmp_path / "cache"
    assert not os.path.isdir(cache) or not [e for e in os.listdir(cache) if e[0] != "."]
