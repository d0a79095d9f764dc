"""`photon-caption`'s outputs under hostile conditions, on the tiny model: file names that are
not UTF-8, a resume from another working directory, a full disk (at a sidecar, at a JSONL
line, at the JSONL's final flush), short writes, and a symlink planted where a temporary file
would go.  The full disk and short writes are simulated by patching `os.write` / `os.fsync`
for the files under the test's folder (found through /proc/self/fd), so no root or tmpfs."""

import base64
import errno
import io
import json
import os
import re
import sys

import numpy as np
import pytest
from PIL import Image

from photon_jax.cli.caption import build_parser, main, run

# (The tiny model's caption may be empty: the prefix gives every sidecar bytes to write.)
ARGS = ["--max-tokens", "8", "--quiet", "--batch-size", "1", "--prepend", "c: "]
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"),
                                reason="finds a descriptor's file through /proc/self/fd")


def png_bytes(seed: int) -> bytes:
    a = np.random.default_rng(seed).integers(0, 256, (40, 44 + seed % 7, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def images(folder, n: int, seed: int = 0) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    paths = []
    for i in range(n):
        p = os.path.join(str(folder), f"a{i}.png")
        with open(p, "wb") as f:
            f.write(png_bytes(seed + i))
        paths.append(p)
    return paths


def strict_records(path) -> list[dict]:
    """The JSONL as a strict parser sees it: UTF-8 bytes, one JSON object per line, and no
    string holding a lone surrogate (which `json.loads` accepts from a "\\udce9" escape and
    strict parsers refuse)."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8")
    recs = []
    for line in text.splitlines():
        rec = json.loads(line)
        for v in rec.values():
            if isinstance(v, str):
                v.encode("utf-8")
        recs.append(rec)
    return recs


def raw_path(rec: dict) -> bytes:
    """A record's image path, exactly, as bytes."""
    if "path_b64" in rec:
        return base64.b64decode(rec["path_b64"])
    return rec["path"].encode("utf-8")


def sidecar_text(image_path: str) -> str:
    with open(os.path.splitext(image_path)[0] + ".txt", encoding="utf-8") as f:
        return f.read()


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def summarize(argv):
    return run(build_parser().parse_intermixed_args(argv))


def temp_files(root) -> list[str]:
    return [os.path.join(dp, n) for dp, _, names in os.walk(str(root)) for n in names
            if "photon-tmp" in n]


# -- 1. file names that are not UTF-8 -------------------------------------------------------

@pytest.mark.skipif(sys.platform != "linux", reason="Linux file names are bytes")
@pytest.mark.parametrize("mode", ["sidecar", "no-sidecar", "output-dir"])
def test_non_utf8_file_names_give_strict_json_and_resume_exactly(tiny_ckpt, tmp_path, mode):
    d = tmp_path / "data"
    d.mkdir()
    raw_dir = os.fsencode(str(d))
    names = [b"caf\xe9.png", b"plain.png", "na\u00efve.png".encode("utf-8")]
    for i, name in enumerate(names):
        with open(os.path.join(raw_dir, name), "wb") as f:
            f.write(png_bytes(i))
    jl = tmp_path / "o.jsonl"
    argv = [str(d), "--model", tiny_ckpt, "--jsonl", str(jl), *ARGS]
    out = tmp_path / "captions"
    argv += {"sidecar": [], "no-sidecar": ["--no-sidecar"],
             "output-dir": ["--output-dir", str(out)]}[mode]
    assert main(argv) == 0

    recs = strict_records(jl)
    want = {os.path.join(raw_dir, n) for n in names}
    assert {raw_path(r) for r in recs} == want and len(recs) == len(names)
    for r in recs:
        assert r["error"] is None and r["caption"]
        exact = raw_path(r)
        if exact.endswith(b"caf\xe9.png"):
            # Readable (a replacement character where the byte was) and exact (base64).
            assert r["path"] == os.path.join(str(d), "caf\ufffd.png")
            assert base64.b64decode(r["path_b64"]) == exact
        else:
            assert "path_b64" not in r and r["path"] == exact.decode("utf-8")
        folder = raw_dir if mode == "sidecar" else os.fsencode(str(out))
        sidecar = os.path.join(folder, os.path.basename(exact)[:-4] + b".txt")
        if mode == "no-sidecar":
            assert not os.path.exists(os.path.join(raw_dir, os.path.basename(sidecar)))
        else:
            with open(sidecar, "rb") as f:
                assert f.read().decode("utf-8") == r["caption"]

    # The resume reads every record back exactly: nothing is captioned again.
    s = summarize(argv)
    assert (s.captioned, s.skipped, s.exit_code) == (0, len(names), 0)
    assert len(strict_records(jl)) == len(names)
    # --overwrite finds the old records by their exact path and replaces them.
    assert main([*argv, "--overwrite"]) == 0
    recs = strict_records(jl)
    assert len(recs) == len(names) and {raw_path(r) for r in recs} == want


@pytest.mark.skipif(sys.platform != "linux", reason="Linux file names are bytes")
def test_a_list_file_may_name_files_that_are_not_utf8(tiny_ckpt, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    with open(os.path.join(os.fsencode(str(d)), b"caf\xe9.png"), "wb") as f:
        f.write(png_bytes(3))
    # The list holds the name's raw bytes; the folder finds the same image again.
    (tmp_path / "list.txt").write_bytes(b"# Latin-1\ndata/caf\xe9.png\n")
    jl = tmp_path / "o.jsonl"
    assert main([str(tmp_path / "list.txt"), str(d), "--model", tiny_ckpt, "--no-sidecar",
                 "--jsonl", str(jl), *ARGS]) == 0
    (rec,) = strict_records(jl)
    assert raw_path(rec) == os.path.join(os.fsencode(str(d)), b"caf\xe9.png")
    assert rec["error"] is None


def test_text_arguments_that_are_not_utf8_are_refused(tiny_ckpt, tmp_path, capfd):
    images(tmp_path / "d", 1)
    for flag in ("--prepend", "--append", "--prompt"):
        capfd.readouterr()
        # How Python hands over a command-line byte that is not UTF-8 (surrogateescape).
        rc = main([str(tmp_path / "d"), "--model", tiny_ckpt, "--jsonl",
                   str(tmp_path / "o.jsonl"), *ARGS, flag, "x\udce9"])
        assert rc == 2 and f"{flag} is not valid UTF-8" in capfd.readouterr().err
    assert not os.path.exists(tmp_path / "o.jsonl")


# -- 2. resuming from another working directory ---------------------------------------------

@pytest.mark.parametrize("no_sidecar", [False, True], ids=["sidecar", "no-sidecar"])
def test_resume_from_another_working_directory_skips_done_images(tiny_ckpt, tmp_path,
                                                                 monkeypatch, no_sidecar):
    d = tmp_path / "data"
    paths = images(d, 3, seed=10)
    extra = ["--no-sidecar"] if no_sidecar else []
    monkeypatch.chdir(tmp_path)
    assert main(["data", "--model", tiny_ckpt, "--jsonl", "o.jsonl", *ARGS, *extra]) == 0
    recs = strict_records(tmp_path / "o.jsonl")
    # Recorded by absolute path, whatever the input's spelling.
    assert sorted(r["path"] for r in recs) == sorted(paths)

    monkeypatch.chdir(d)
    s = summarize([".", "--model", tiny_ckpt, "--jsonl", "../o.jsonl", *ARGS, *extra])
    assert (s.captioned, s.skipped, s.exit_code) == (0, 3, 0)
    assert len(strict_records(tmp_path / "o.jsonl")) == 3


def test_records_of_the_previous_version_still_resume(tiny_ckpt, tmp_path, monkeypatch):
    """The previous version wrote relative paths as given: they still count, read against
    the working directory (as that version read them)."""
    d = tmp_path / "data"
    paths = images(d, 2, seed=20)
    old = ""
    for p in paths:
        rel = os.path.relpath(p, tmp_path)
        with open(os.path.splitext(p)[0] + ".txt", "w") as f:
            f.write("old caption")
        old += json.dumps({"path": rel, "caption": "old caption", "finish_reason": "stop",
                           "output_tokens": 2, "error": None}) + "\n"
    (tmp_path / "o.jsonl").write_text(old)
    monkeypatch.chdir(tmp_path)
    argv = ["data", "--model", tiny_ckpt, "--jsonl", "o.jsonl", *ARGS]
    s = summarize(argv)
    assert (s.captioned, s.skipped) == (0, 2)
    # --overwrite replaces the old relative records with new absolute ones.
    assert main([*argv, "--overwrite"]) == 0
    recs = strict_records(tmp_path / "o.jsonl")
    assert sorted(r["path"] for r in recs) == sorted(paths)
    assert all(r["caption"] != "old caption" for r in recs)


# -- 3. a full disk, short writes, a planted symlink -----------------------------------------

def _fail_after(n_ok: int, match):
    """-> a replacement for os.write / os.fsync that raises ENOSPC on a matching descriptor
    once `n_ok` matching calls have succeeded."""
    calls = [0]

    def install(real):
        def patched(fd, *a):
            if match(fd_path(fd)):
                calls[0] += 1
                if calls[0] > n_ok:
                    raise ENOSPC
            return real(fd, *a)
        return patched

    return install


@linux_only
@pytest.mark.parametrize("where", ["jsonl-write", "jsonl-fsync", "sidecar-write",
                                   "sidecar-fsync"])
def test_full_disk_stops_cleanly_with_a_summary(tiny_ckpt, tmp_path, monkeypatch, capfd,
                                                where):
    d = tmp_path / "data"
    paths = images(d, 5, seed=30)
    jl = tmp_path / "o.jsonl"
    argv = [str(d), "--model", tiny_ckpt, "--jsonl", str(jl), *ARGS]
    target, call = where.split("-")
    if target == "jsonl":
        match, n_ok = (lambda p: p == str(jl)), (2 if call == "write" else 0)
    else:
        match, n_ok = (lambda p: p.startswith(str(d) + os.sep)), 2
    monkeypatch.setattr(os, call, _fail_after(n_ok, match)(getattr(os, call)))
    capfd.readouterr()
    rc = main(argv)        # returns: no traceback
    err = capfd.readouterr().err
    monkeypatch.undo()

    assert rc == 1, err
    assert "No space left on device" in err and "stopped" in err, err
    named = re.search(r"cannot write (\S+?):", err)
    assert named, err
    if target == "jsonl":
        assert named.group(1) == str(jl)
    else:
        assert named.group(1) in {os.path.splitext(p)[0] + ".txt" for p in paths}
    assert "free" in err and "re-run" in err      # the fix
    m = re.search(r"(\d+) captioned, 0 failed, 0 skipped \(done before\), (\d+) not done", err)
    assert m, err
    captioned, not_done = int(m.group(1)), int(m.group(2))
    assert captioned + not_done == len(paths)
    if where != "jsonl-fsync":
        assert not_done > 0
    recs = strict_records(jl)          # whole lines only, and no image marked failed
    assert len(recs) == captioned and all(r["error"] is None for r in recs)
    assert temp_files(tmp_path) == []

    # Space is back: the re-run finishes, each image with exactly one record.
    assert main(argv) == 0
    recs = strict_records(jl)
    assert sorted(r["path"] for r in recs) == sorted(paths)
    assert all(r["caption"] == sidecar_text(r["path"]) for r in recs)


@linux_only
def test_short_writes_are_completed(tiny_ckpt, tmp_path, monkeypatch):
    d = tmp_path / "data"
    paths = images(d, 3, seed=40)
    jl = tmp_path / "o.jsonl"
    real = os.write

    def short(fd, data):   # at most 5 bytes per call, as a nearly full disk may do
        if fd_path(fd).startswith(str(tmp_path) + os.sep):
            return real(fd, bytes(data)[:5])
        return real(fd, data)

    monkeypatch.setattr(os, "write", short)
    assert main([str(d), "--model", tiny_ckpt, "--jsonl", str(jl), *ARGS]) == 0
    monkeypatch.undo()
    recs = strict_records(jl)
    assert sorted(r["path"] for r in recs) == sorted(paths)
    assert all(r["caption"] and r["caption"] == sidecar_text(r["path"]) for r in recs)


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
def test_a_planted_temporary_symlink_is_not_followed(tiny_ckpt, tmp_path):
    d = tmp_path / "data"
    paths = images(d, 2, seed=50)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for p in paths:   # the old fixed temporary name of each sidecar
        os.symlink(victim, os.path.splitext(p)[0] + ".txt.photon-tmp")
    assert main([str(d), "--model", tiny_ckpt, *ARGS]) == 0
    assert victim.read_text() == "precious"
    for p in paths:
        sc = os.path.splitext(p)[0] + ".txt"
        assert not os.path.islink(sc) and os.path.isfile(sc) and sidecar_text(p)
        assert not os.path.lexists(sc + ".photon-tmp")   # stale temporaries are removed
    assert sorted(os.listdir(d)) == sorted(["a0.png", "a0.txt", "a1.png", "a1.txt"])
