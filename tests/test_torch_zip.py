"""The torch zip-archive reader (convert/torch_zip.py): a file real torch wrote, the test writer
(tests/quantized_checkpoints.py) round-tripped for every dtype, and refusals of hostile or broken
files.  No JAX, no torch."""

import os
import pickle
import zipfile

import ml_dtypes
import numpy as np
import pytest

from helpers import MD3_FIXTURE_DIR
from photon_jax.convert.safetensors_io import read_tensor
from photon_jax.convert.torch_zip import TorchZipError, index_torch_checkpoint
import quantized_checkpoints as qc

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "torch_zip")


def _raw(ref) -> bytes:
    with open(ref.file, "rb") as f:
        f.seek(ref.start)
        return f.read(ref.nbytes)


def test_golden_written_by_torch():
    """golden.pt came from torch.save (make_golden.py): typed and untyped storages, views at a
    storage offset sharing a storage with another tensor, a 0-d tensor."""
    refs = index_torch_checkpoint(os.path.join(GOLDEN, "golden.pt"))
    want = np.load(os.path.join(GOLDEN, "golden.npz"))
    dtypes = dict(s.split(":") for s in want["_dtypes"])
    assert set(refs) == set(dtypes)
    for name, ref in refs.items():
        a, e = read_tensor(ref), want[name]
        assert ref.dtype == dtypes[name], name
        assert a.shape == e.shape, name
        assert a.tobytes() == e.tobytes(), name
    # The views really are offsets into the storage their base uses, not copies.
    assert refs["f32_tail"].start == refs["f32_base"].start + 3 * 4
    assert refs["bf16_tail"].start == refs["bf16"].start + 2 * 2
    assert refs["fp8_row1"].start == refs["fp8"].start + 5


ROUND_TRIP = {
    "f32": np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4),
    "bf16": np.linspace(-3, 3, 10).astype(ml_dtypes.bfloat16),
    "f16": np.linspace(-3, 3, 6).astype(np.float16).reshape(3, 2),
    "fp8": np.array([0, -0.0, 1, -2.5, 448, -448, 0.001953125, np.nan],
                    np.float32).astype(ml_dtypes.float8_e4m3fn).reshape(2, 2, 2),
    "u8": np.arange(70_000, dtype=np.int64).astype(np.uint8),  # numel needs a 4-byte int
    "i8": np.array([-128, -1, 0, 1, 127], np.int8).reshape(1, 1, 1, 5),  # rank 4: MARK tuple
    "scalar": np.array(2.5, np.float32),
    "empty": np.zeros((0, 3), ml_dtypes.bfloat16),
}


def test_writer_reader_round_trip(tmp_path):
    path = str(tmp_path / "rt.pt")
    extra = {"i32": np.array([-(2**31), 5], np.int32), "i64": np.array([2**40], np.int64),
             "bool": np.array([True, False])}
    qc.write_torch_zip(path, {**ROUND_TRIP, **extra})
    refs = index_torch_checkpoint(path)
    assert list(refs) == list(ROUND_TRIP) + list(extra)
    for name, a in ROUND_TRIP.items():
        got = read_tensor(refs[name])
        assert got.dtype == a.dtype and got.shape == a.shape, name
        assert got.tobytes() == a.tobytes(), name
    # dtypes no Moondream checkpoint stores: indexed right (read_tensor itself refuses them)
    for name, a in extra.items():
        assert refs[name].shape == a.shape and _raw(refs[name]) == a.tobytes(), name
    assert [refs[n].dtype for n in extra] == ["I32", "I64", "BOOL"]
    # torch aligns every record's data to 64 bytes
    assert all(r.start % 64 == 0 for r in refs.values())


def test_md3_fp8_pt_reads_back(tmp_path):
    path = qc.write_md3_fp8(MD3_FIXTURE_DIR, str(tmp_path), container="pt")
    refs = index_torch_checkpoint(path)
    want = qc.md3_tensors(MD3_FIXTURE_DIR)
    assert any("._orig_mod" in n for n in refs)
    got = {n.replace("._orig_mod", ""): r for n, r in refs.items()}
    assert set(got) == set(want)
    for name, a in want.items():
        assert read_tensor(got[name]).tobytes() == a.tobytes(), name
    assert {got[n].dtype for n in got if n.endswith("experts.weight")} == {"F8_E4M3"}
    assert {got[n].dtype for n in got if "moe_quant" in n} == {"F32"}


class _Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("protocol", [2, 4])  # GLOBAL and STACK_GLOBAL
def test_forbidden_global_is_refused(tmp_path, protocol):
    marker = tmp_path / "executed"
    path = str(tmp_path / "evil.pt")
    pkl = pickle.dumps({"w": _Boom(marker)}, protocol=protocol)
    qc.write_torch_archive(path, pkl, [])
    with pytest.raises(TorchZipError, match=r"evil\.pt.*(posix|os)\.system.*refusing"):
        index_torch_checkpoint(path)
    assert not marker.exists()


def test_forbidden_global_inside_a_tensor_record(tmp_path):
    pkl, storages = qc.torch_pickle({"w": np.ones(3, np.float32)})
    pkl = pkl.replace(b"ccollections\nOrderedDict\n", b"cbuiltins\neval\n")
    path = str(tmp_path / "evil.pt")
    qc.write_torch_archive(path, pkl, storages)
    with pytest.raises(TorchZipError, match=r"builtins\.eval"):
        index_torch_checkpoint(path)


def test_compressed_member_is_refused(tmp_path):
    good, bad = str(tmp_path / "good.pt"), str(tmp_path / "bad.pt")
    qc.write_torch_zip(good, {"layer.w": np.zeros(4096, np.float32)})
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), zipfile.ZIP_DEFLATED)
    with pytest.raises(TorchZipError, match=r"bad\.pt.*'layer\.w'.*compressed"):
        index_torch_checkpoint(bad)


def test_truncated_file_is_refused(tmp_path):
    path = str(tmp_path / "cut.pt")
    qc.write_torch_zip(path, {"w": np.zeros(4096, np.float32)})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(TorchZipError, match=r"cut\.pt.*truncated.*re-download"):
        index_torch_checkpoint(path)


def test_storage_shorter_than_its_record_is_refused(tmp_path):
    pkl, storages = qc.torch_pickle({"w": np.zeros(16, np.float32)})
    path = str(tmp_path / "short.pt")
    qc.write_torch_archive(path, pkl, [storages[0][:20]])
    with pytest.raises(TorchZipError, match=r"short\.pt.*'w'.*shorter"):
        index_torch_checkpoint(path)


def _one_tensor_pickle(shape, stride, offset=0, numel=64):
    pid = qc._tuple([qc._str("storage"), qc._global("torch", "FloatStorage"), qc._str("0"),
                     qc._str("cpu"), qc._int(numel)]) + b"Q"
    args = [pid, qc._int(offset), qc._tuple([qc._int(n) for n in shape]),
            qc._tuple([qc._int(s) for s in stride]), b"\x89",
            qc._global("collections", "OrderedDict") + b")R"]
    rebuild = qc._global("torch._utils", "_rebuild_tensor_v2")
    return b"\x80\x02}(" + qc._str("t") + rebuild + qc._tuple(args) + b"Ru."


def test_layout_checks(tmp_path):
    path, data = str(tmp_path / "x.pt"), [np.arange(64, dtype=np.float32).tobytes()]
    qc.write_torch_archive(path, _one_tensor_pickle((4, 3), (1, 4)), data)  # a transpose
    with pytest.raises(TorchZipError, match=r"'t' is not contiguous"):
        index_torch_checkpoint(path)
    # size-1 dimensions may carry any stride; the offset is honoured
    qc.write_torch_archive(path, _one_tensor_pickle((1, 5), (99, 1), offset=7), data)
    assert read_tensor(index_torch_checkpoint(path)["t"]).tolist() == [[7, 8, 9, 10, 11]]
    qc.write_torch_archive(path, _one_tensor_pickle((8,), (1,), offset=60), data)
    with pytest.raises(TorchZipError, match=r"'t' runs past the end of its storage"):
        index_torch_checkpoint(path)


def test_other_refusals(tmp_path):
    path = str(tmp_path / "x.pt")
    pkl, storages = qc.torch_pickle({"w": np.ones(3, np.float32)})
    qc.write_torch_archive(path, pkl, storages, byteorder=b"big")
    with pytest.raises(TorchZipError, match="big-endian"):
        index_torch_checkpoint(path)
    nested = pkl.replace(b"\x80\x02}(", b"\x80\x02}(X\x05\x00\x00\x00model}(", 1)[:-2] + b"uu."
    qc.write_torch_archive(path, nested, storages)
    with pytest.raises(TorchZipError, match="not a flat dict"):
        index_torch_checkpoint(path)
    with open(path, "wb") as f:
        f.write(pickle.dumps({"w": 1}, protocol=2))  # pre-1.6 torch.save starts with a pickle
    with pytest.raises(TorchZipError, match="legacy"):
        index_torch_checkpoint(path)


def _archive(path, pkl: bytes):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
    return path


def test_a_nested_state_dict_is_read_only_beside_plain_values(tmp_path):
    """Moondream's finetune checkpoints hold their weights in `lora_state_dict`: read when
    asked for, beside plain values; refused otherwise, or beside a value nested deeper than
    16 containers (a pickle nests 100,000 lists without Python recursion, which a
    recursive check would hit: RecursionError instead of a refusal by name)."""
    ok = pickle.dumps({"lora_state_dict": {}, "step": 7, "config": {"rank": [4, 8]}}, 2)
    assert index_torch_checkpoint(_archive(tmp_path / "ok.pt", ok),
                                  nested=("lora_state_dict",)) == {}
    with pytest.raises(TorchZipError, match="not a flat dict"):
        index_torch_checkpoint(tmp_path / "ok.pt")   # without nested=: the old refusal
    deep = 100_000   # lists pushed, then appended into each other: no recursion to build
    pkl = (b"\x80\x02}(X\x0f\x00\x00\x00lora_state_dict}X\x04\x00\x00\x00deep"
           + b"]" * deep + b"a" * (deep - 1) + b"u.")
    with pytest.raises(TorchZipError, match="not a flat dict"):
        index_torch_checkpoint(_archive(tmp_path / "deep.pt", pkl),
                               nested=("lora_state_dict",))


def test_an_oversized_pickle_is_refused_before_unpickling(tmp_path, monkeypatch):
    """data.pkl is a tensor index (about 150 bytes a tensor); one far larger, or a deflated
    one that expands (a few KB on disk, gigabytes of Python objects unpickled), is refused
    by its declared size before it is read."""
    import photon_jax.convert.torch_zip as tz

    monkeypatch.setattr(tz, "MAX_PICKLE_BYTES", 1 << 20)
    pkl = b"\x80\x02]" + b"]a" * (1 << 20) + b"."   # 2 MB of nested empty lists
    path = tmp_path / "bomb.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", pkl)
    assert path.stat().st_size < 64 << 10
    with pytest.raises(TorchZipError, match="data.pkl is 2,097,156 bytes, over the 1,048,576"):
        index_torch_checkpoint(path)
