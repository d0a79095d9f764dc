"""`photon-caption` on the tiny model: inputs, outputs, resume, crash safety, bad images,
several devices and the Ray integration.  Expected captions come from the Python API on the
same checkpoint (itself checked against the reference elsewhere)."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from photon_jax import Moondream
from photon_jax.cli.caption import build_parser, main, run

SETTINGS = {"max_tokens": 8, "temperature": 0.0}
ARGS = ["--max-tokens", "8", "--quiet"]


def noise(seed: int, w: int = 48, h: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8)


def make_tree(root, n: int = 5, seed: int = 0):
    """root/a{i}.png, root/sub/b.png, root/notes.md (not an image), root/.hidden.png."""
    os.makedirs(root / "sub", exist_ok=True)
    paths = []
    for i in range(n):
        p = root / f"a{i}.png"
        Image.fromarray(noise(seed + i, 40 + 4 * i)).save(p)
        paths.append(str(p))
    Image.fromarray(noise(seed + 100)).save(root / "sub" / "b.png")
    (root / "notes.md").write_text("not an image")
    Image.fromarray(noise(seed + 200)).save(root / ".hidden.png")
    return paths + [str(root / "sub" / "b.png")]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def caption_of(sidecar):
    with open(sidecar) as f:
        return f.read()


@pytest.fixture(scope="module")
def md(tiny_ckpt):
    m = Moondream.load(tiny_ckpt, max_batch_size=8)
    yield m
    m.close()


@pytest.fixture(scope="module")
def expect(md):
    """Expected caption of an image (path or array), from the API, memoised."""
    memo = {}

    def get(img, settings=SETTINGS):
        key = img if isinstance(img, str) else img.tobytes() + bytes(img.shape)
        if key not in memo:
            memo[key] = md.caption(img, settings=settings)["caption"]
        return memo[key]

    return get


def test_folder_glob_and_list_inputs(tiny_ckpt, tmp_path, expect):
    d = tmp_path / "data"
    paths = make_tree(d)
    other = tmp_path / "other"
    other.mkdir()
    Image.fromarray(noise(50)).save(other / "x.jpg")
    Image.fromarray(noise(51)).save(other / "y.jpg")
    listed = tmp_path / "lists" / "l.txt"
    listed.parent.mkdir()
    listed.write_text("# two images by relative path\n../other/y.jpg\n\n" + paths[0] + "\n")
    jl = tmp_path / "out.jsonl"
    rc = main([str(d), "--recursive", str(tmp_path / "other" / "*.jpg"), str(listed),
               "--model", tiny_ckpt, "--jsonl", str(jl), "--batch-size", "3", *ARGS])
    assert rc == 0
    recs = read_jsonl(jl)
    got = {os.path.abspath(r["path"]): r for r in recs}
    want = [*paths, str(other / "x.jpg"), str(other / "y.jpg")]
    # Each image once (the listed a0.png and y.jpg were also found by the folder / glob);
    # hidden files and non-images are not inputs.
    assert len(recs) == len(got) == len(want)
    assert sorted(got) == sorted(os.path.abspath(p) for p in want)
    for p in want:
        r = got[os.path.abspath(p)]
        assert set(r) == {"path", "caption", "finish_reason", "output_tokens", "error"}
        assert r["error"] is None and r["caption"] == expect(p)
        assert r["finish_reason"] in ("stop", "length") and 0 < r["output_tokens"] <= 8
        assert caption_of(os.path.splitext(p)[0] + ".txt") == r["caption"]
    assert not os.path.exists(d / ".hidden.txt")

    # A second run finds everything done and writes nothing.
    stamp = {p: os.stat(os.path.splitext(p)[0] + ".txt").st_mtime_ns for p in want}
    rc = main([str(d), "-r", str(other / "*.jpg"), str(listed), "--model", tiny_ckpt,
               "--jsonl", str(jl), *ARGS])
    assert rc == 0 and len(read_jsonl(jl)) == len(want)
    assert stamp == {p: os.stat(os.path.splitext(p)[0] + ".txt").st_mtime_ns for p in want}

    # --overwrite redoes them and keeps one record per image.
    assert main([str(other), "--model", tiny_ckpt, "--jsonl", str(jl), "--overwrite",
                 *ARGS]) == 0
    recs = read_jsonl(jl)
    assert len(recs) == len(want) and len({r["path"] for r in recs}) == len(want)


def test_output_dir_query_mode_and_affixes(tiny_ckpt, tmp_path, md):
    d = tmp_path / "data"
    paths = make_tree(d, n=2, seed=10)
    out = tmp_path / "captions"
    jl = tmp_path / "q.jsonl"
    q = "what is this?"
    rc = main([str(d), "-r", "--model", tiny_ckpt, "--output-dir", str(out), "--prompt", q,
               "--prepend", "photo, ", "--append", ".", "--jsonl", str(jl), *ARGS])
    assert rc == 0
    for p in paths:
        rel = os.path.relpath(os.path.splitext(p)[0], d) + ".txt"
        answer = md.query(p, q, settings=SETTINGS)["answer"]
        assert caption_of(out / rel) == "photo, " + answer + "."
        assert not os.path.exists(os.path.splitext(p)[0] + ".txt")   # nothing beside images
    recs = read_jsonl(jl)
    assert {r["prompt"] for r in recs} == {q} and len(recs) == len(paths)
    for r in recs:   # the JSONL holds the same text as the sidecar, affixes included
        rel = os.path.relpath(os.path.splitext(r["path"])[0], d) + ".txt"
        assert r["caption"] == caption_of(out / rel)


def test_no_sidecar_resumes_from_the_jsonl(tiny_ckpt, tmp_path):
    d = tmp_path / "data"
    paths = make_tree(d, n=3, seed=20)
    jl = tmp_path / "o.jsonl"
    argv = [str(d), "-r", "--model", tiny_ckpt, "--no-sidecar", "--jsonl", str(jl), *ARGS]
    assert main(argv) == 0
    assert not any(os.path.exists(os.path.splitext(p)[0] + ".txt") for p in paths)
    assert main(argv) == 0
    assert len(read_jsonl(jl)) == len(paths)


def test_torn_jsonl_and_half_written_outputs_are_repaired(tiny_ckpt, tmp_path, expect):
    """The states a kill can leave: a sidecar without its JSONL record, a torn last line, a
    temporary sidecar never renamed.  The next run repairs all of them."""
    d = tmp_path / "data"
    paths = make_tree(d, n=4, seed=30)
    jl = tmp_path / "o.jsonl"
    argv = [str(d), "-r", "--model", tiny_ckpt, "--jsonl", str(jl), *ARGS]
    assert main(argv) == 0
    lines = open(jl).read().splitlines(keepends=True)
    by_path = {json.loads(x)["path"]: x for x in lines}
    # p0: sidecar written, record lost; p1: record torn mid-write; p2: only a temp sidecar.
    p0, p1, p2 = paths[:3]
    sc = lambda p: os.path.splitext(p)[0] + ".txt"  # noqa: E731
    os.remove(sc(p2))
    with open(sc(p2) + ".photon-tmp", "w") as f:
        f.write("half a cap")
    keep = [x for p, x in by_path.items() if p not in (p0, p1, p2)]
    with open(jl, "w") as f:
        f.write("".join(keep) + by_path[p1][: len(by_path[p1]) // 2])
    assert main(argv) == 0
    recs = read_jsonl(jl)
    assert sorted(r["path"] for r in recs) == sorted(paths)
    for r in recs:
        assert r["caption"] == expect(r["path"]) == caption_of(sc(r["path"]))
    assert not os.path.exists(sc(p2) + ".photon-tmp")


def _png_header_only(w: int, h: int) -> bytes:
    """A PNG whose header claims w x h (no pixel data): a 'huge' image without the bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_bad_images_fail_alone_and_the_rest_are_captioned(tiny_ckpt, tmp_path, expect,
                                                          capfd):
    d = tmp_path / "bad"
    d.mkdir()
    base = noise(60, 64, 48)
    Image.fromarray(base).save(d / "good.png")
    (d / "garbage.jpg").write_bytes(b"this is not an image")
    (d / "empty.png").write_bytes(b"")
    Image.fromarray(noise(61, 64, 48)).save(d / "full.png")
    data = (d / "full.png").read_bytes()
    (d / "truncated.png").write_bytes(data[: len(data) // 2])
    os.remove(d / "full.png")
    (d / "huge.png").write_bytes(_png_header_only(20000, 20000))
    expected = {"good.png": expect(base)}
    # Animated: the first frame is captioned.
    frames = [Image.fromarray(noise(62 + i, 64, 48)).convert("P") for i in range(2)]
    frames[0].save(d / "anim.gif", save_all=True, append_images=frames[1:], duration=50)
    with Image.open(d / "anim.gif") as im:
        expected["anim.gif"] = expect(np.asarray(im.convert("RGB")))
    # EXIF orientation 6 (rotate 90 clockwise to display): the rotation is honoured.
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(noise(64, 64, 48)).save(d / "rotated.jpg", exif=exif, quality=95)
    with Image.open(d / "rotated.jpg") as im:
        stored = np.asarray(im.convert("RGB"))
    upright = np.ascontiguousarray(np.rot90(stored, -1))
    assert upright.shape == (64, 48, 3)
    expected["rotated.jpg"] = expect(upright)
    # CMYK, palette and RGBA: converted to RGB (alpha dropped, as the reference does).
    Image.fromarray(noise(65, 64, 48)).convert("CMYK").save(d / "cmyk.jpg", quality=95)
    Image.fromarray(noise(66, 64, 48)).convert("P").save(d / "palette.png")
    rgba = np.concatenate([noise(67, 64, 48), noise(68, 64, 48)[..., :1]], axis=2)
    Image.fromarray(rgba, "RGBA").save(d / "rgba.png")
    for name in ("cmyk.jpg", "palette.png", "rgba.png"):
        with Image.open(d / name) as im:
            expected[name] = expect(np.asarray(im.convert("RGB")))

    jl = tmp_path / "o.jsonl"
    capfd.readouterr()
    rc = main([str(d), "--model", tiny_ckpt, "--jsonl", str(jl), "--batch-size", "4", *ARGS])
    err = capfd.readouterr().err
    assert rc == 1   # some images failed
    recs = {os.path.basename(r["path"]): r for r in read_jsonl(jl)}
    reasons = {"garbage.jpg": "not an image in an accepted format", "empty.png": "empty (0 bytes)",
               "truncated.png": "truncated", "huge.png": "too large"}
    assert set(recs) == set(expected) | set(reasons)
    for name, why in reasons.items():
        assert recs[name]["caption"] is None and why in recs[name]["error"], recs[name]
        assert not os.path.exists(d / (os.path.splitext(name)[0] + ".txt"))
        assert f"{name}: " in err    # listed in the summary
    for name, cap in expected.items():
        assert recs[name]["error"] is None and recs[name]["caption"] == cap, name
    assert "4 failed" in err and "captioned" in err and "images/s" in err
    # The failures are retried on the next run (and fail again); the rest are skipped.
    summary = run(build_parser().parse_intermixed_args(
        [str(d), "--model", tiny_ckpt, "--jsonl", str(jl), *ARGS]))
    assert (summary.captioned, summary.failed, summary.skipped, summary.not_done,
            summary.exit_code) == (0, len(reasons), len(expected), 0, 1)
    assert len(read_jsonl(jl)) == len(recs) + len(reasons)


def test_usage_errors(tiny_ckpt, tmp_path, capfd):
    d = tmp_path / "d"
    d.mkdir()
    Image.fromarray(noise(70)).save(d / "a.png")
    Image.fromarray(noise(71)).save(d / "a.jpg")
    (tmp_path / "x.csv").write_text("a,b\n")
    cases = [([str(tmp_path / "missing")], "does not exist"),
             ([str(tmp_path / "x.csv")], "neither an image"),
             ([str(d), "--no-sidecar"], "needs --jsonl"),
             ([str(d)], "share a sidecar"),
             ([str(d / "a.png"), "--devices", "7"], "devices 0..")]
    for argv, msg in cases:
        capfd.readouterr()
        assert main([*argv, "--model", tiny_ckpt, *ARGS]) == 2
        assert msg in capfd.readouterr().err, argv


def _cli(args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "photon_jax.cli.caption", *args],
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _lines(path):
    try:
        with open(path) as f:
            return f.read().count("\n")
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_killed_run_then_rerun_captions_every_image_once(tiny_ckpt, tmp_path, sig, expect):
    d = tmp_path / "data"
    d.mkdir()
    n = 14
    paths = []
    for i in range(n):
        p = str(d / f"img{i:02d}.png")
        Image.fromarray(noise(300 + i, 48 + i, 40)).save(p)
        paths.append(p)
    jl = tmp_path / "o.jsonl"
    argv = [str(d), "--model", tiny_ckpt, "--jsonl", str(jl), "--batch-size", "1",
            "--max-tokens", "8", "--quiet"]
    proc = _cli(argv)
    deadline = time.time() + 120
    while _lines(jl) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    done_before = _lines(jl)
    assert 2 <= done_before < n, (done_before, err)   # it really stopped midway
    if sig != signal.SIGKILL:   # Ctrl-C and a plain kill stop cleanly, with a summary
        assert proc.returncode == 130 and "interrupted" in err and "not done" in err, err
    _rerun_finishes(argv, jl, paths, expect)


def _rerun_finishes(argv, jl, paths, expect):
    # The rerun needs no process of its own (what is tested is the file the stopped run
    # left): in this one, it reuses the programs this file's other runs traced.
    assert main(argv) == 0
    recs = read_jsonl(jl)
    assert sorted(r["path"] for r in recs) == sorted(paths)   # each exactly once
    for r in recs:
        assert r["error"] is None
        assert r["caption"] == caption_of(os.path.splitext(r["path"])[0] + ".txt")
        assert r["caption"] == expect(r["path"])


# Runs photon-caption with Ctrl-C sent at a chosen point of its bookkeeping: "start" as the
# CLI gives a just-started request its done callback, "finish" from the engine's thread as a
# request finishes, i.e. while the CLI takes it off its queue.  When KeyboardInterrupt could
# land anywhere, both moments lost a handle and the drain waited for it forever: "start"
# hung every run, "finish" 5 runs of 6.
_INJECT = """
import os, signal, sys
from photon_jax.cli import caption
from photon_jax.engine import core as engine
at, when = int(os.environ["AT"]), os.environ["WHEN"]
add, n = engine.Handle.add_done_callback, [0]
def kill(*_):
    os.kill(os.getpid(), signal.SIGINT)
def patched(self, fn):
    n[0] += 1
    if n[0] == at:
        if when == "start":
            kill()
        else:
            add(self, kill)
    return add(self, fn)
engine.Handle.add_done_callback = patched
sys.exit(caption.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("when", ["start", "finish"])
def test_ctrl_c_at_any_point_of_the_bookkeeping_stops_cleanly(tiny_ckpt, tmp_path, when,
                                                              expect):
    d = tmp_path / "data"
    d.mkdir()
    paths = []
    for i in range(6):
        p = str(d / f"img{i}.png")
        Image.fromarray(noise(320 + i, 40, 44 + i)).save(p)
        paths.append(p)
    script = tmp_path / "inject.py"
    script.write_text(_INJECT)
    jl = tmp_path / "o.jsonl"
    argv = [str(d), "--model", tiny_ckpt, "--jsonl", str(jl), "--batch-size", "1", *ARGS]
    proc = subprocess.Popen([sys.executable, str(script), *argv], text=True,
                            env={**os.environ, "AT": "3", "WHEN": when},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"Ctrl-C at {when} of a request hung the run: {proc.communicate()[1]}")
    assert proc.returncode == 130 and "interrupted" in err, err
    recs = read_jsonl(jl)
    assert 1 <= len(recs) < len(paths), err
    for r in recs:   # what was recorded is whole: its sidecar says the same
        assert r["caption"] == caption_of(os.path.splitext(r["path"])[0] + ".txt")
    _rerun_finishes(argv, jl, paths, expect)


def test_all_devices_give_the_same_captions(tiny_ckpt, tmp_path, expect):
    d = tmp_path / "data"
    paths = make_tree(d, n=5, seed=80)
    jl = tmp_path / "o.jsonl"
    proc = _cli([str(d), "-r", "--model", tiny_ckpt, "--jsonl", str(jl), "--devices", "all",
                 *ARGS], env={"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") +
                          " --xla_force_host_platform_device_count=2"})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "on 2 device(s)" in err
    recs = read_jsonl(jl)
    assert sorted(r["path"] for r in recs) == sorted(paths)
    for r in recs:
        assert r["caption"] == expect(r["path"])


class _Deprecations(list):
    """The deprecations reported while the block runs: DeprecationWarning (Ray's
    RayDeprecationWarning is one) and Ray's deprecation log lines (Ray Data logs some, e.g.
    for `map_batches(concurrency=)`, instead of warning)."""

    def __enter__(self):
        import logging
        import warnings

        found = self

        class Catch(logging.Handler):
            def emit(self, record):
                if "deprecat" in record.getMessage().lower():
                    found.append(record.getMessage())

        self._handler = Catch(logging.WARNING)
        self._loggers = [logging.getLogger("ray"), logging.getLogger("ray.data")]
        for lg in self._loggers:
            lg.addHandler(self._handler)
        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._warnings.__exit__(*exc)
        for lg in self._loggers:
            lg.removeHandler(self._handler)
        self.extend(f"{w.category.__name__}: {w.message}" for w in self._caught
                    if issubclass(w.category, DeprecationWarning))
        return False


def test_ray_data_integration_matches_the_cli(tiny_ckpt, tmp_path):
    ray = pytest.importorskip("ray")
    from photon_jax.integrations.ray import caption_dataset

    d = tmp_path / "data"
    paths = make_tree(d, n=4, seed=90)
    (d / "broken.png").write_bytes(b"\x89PNG broken")
    paths.append(str(d / "broken.png"))
    jl = tmp_path / "o.jsonl"
    assert main([str(d), "-r", "--model", tiny_ckpt, "--jsonl", str(jl), "--no-sidecar",
                 *ARGS]) == 1
    cli = {r["path"]: r for r in read_jsonl(jl)}

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        # 6 rows in batches of 2: the actor works on two batches at once, so batches
        # overlap on its engine; every row must still come out once, with its own result.
        ds = ray.data.from_items([{"image": open(p, "rb").read(), "path": p} for p in paths])
        with _Deprecations() as deprecations:
            ds = caption_dataset(ds, tiny_ckpt, batch_size=2, settings=SETTINGS)
        out = ds.take_all()
    finally:
        ray.shutdown()
    assert deprecations == [], "Ray deprecates an argument caption_dataset passes"
    assert sorted(r["path"] for r in out) == sorted(paths)
    for r in out:
        assert "image" not in r
        want = cli[r["path"]]
        for k in ("caption", "finish_reason", "output_tokens"):
            assert r[k] == want[k], (r["path"], k)
        assert (r["error"] is None) == (want["error"] is None)


def test_captioner_accepts_paths_structs_arrays_and_nulls(tiny_ckpt, tmp_path, expect):
    """The Ray callable on its own (no cluster): every image-cell form Ray Data produces,
    and two calls at once on one Captioner (as Ray runs them: batches_in_flight)."""
    from concurrent.futures import ThreadPoolExecutor

    from photon_jax.integrations.ray import Captioner

    p = str(tmp_path / "a.png")
    Image.fromarray(noise(95)).save(p)
    q = str(tmp_path / "b.png")
    Image.fromarray(noise(96)).save(q)
    cells = [p, {"bytes": open(p, "rb").read(), "path": None}, {"bytes": None, "path": p},
             noise(95), None]
    with _Deprecations() as deprecations:
        cap = Captioner(tiny_ckpt, settings=SETTINGS, batch_size=2, prepend="<", append=">",
                        keep_image=True)
        try:
            column = np.empty(len(cells), dtype=object)   # one object per cell, as Ray gives
            column[:] = cells
            batches = [{"image": column, "id": np.arange(len(cells))},
                       {"image": np.array([q, p, q]), "id": np.arange(3)}]
            with ThreadPoolExecutor(2) as pool:
                out, other = pool.map(cap, batches)
        finally:
            cap.close()
    assert deprecations == []
    assert out["id"].tolist() == list(range(len(cells))) and len(out["image"]) == len(cells)
    want = "<" + expect(p) + ">"
    assert out["caption"].tolist() == [want] * 4 + [None]
    assert out["error"][:4].tolist() == [None] * 4 and "empty" in out["error"][4]
    assert other["caption"].tolist() == ["<" + expect(q) + ">", want, "<" + expect(q) + ">"]
    with pytest.raises(KeyError, match="image_column"):
        Captioner.__call__(cap, {"img": np.array([p])})


def test_engine_failure_stops_the_run_and_a_rerun_finishes(tiny_ckpt, tmp_path, monkeypatch,
                                                           capfd, expect):
    from photon_jax.api import Moondream as MD
    from photon_jax.engine.request import EngineError

    d = tmp_path / "data"
    paths = make_tree(d, n=4, seed=110)
    jl = tmp_path / "o.jsonl"
    argv = [str(d), "-r", "--model", tiny_ckpt, "--jsonl", str(jl), "--batch-size", "1",
            *ARGS]
    real, calls = MD.start, []

    def flaky(self, *a, **k):
        calls.append(1)
        if len(calls) > 3:
            raise EngineError("the engine stopped after an error: simulated")
        return real(self, *a, **k)

    monkeypatch.setattr(MD, "start", flaky)
    capfd.readouterr()
    summary = run(build_parser().parse_intermixed_args(argv))
    err = capfd.readouterr().err
    assert "stopped: the engine stopped after an error: simulated" in err
    assert summary.exit_code == 1 and summary.failed == 0
    assert summary.captioned == len(read_jsonl(jl)) == len(paths) - summary.not_done < 4
    assert f"{summary.not_done} not done" in err
    monkeypatch.setattr(MD, "start", real)
    assert main(argv) == 0
    recs = read_jsonl(jl)
    assert sorted(r["path"] for r in recs) == sorted(paths)
    assert all(r["caption"] == expect(r["path"]) for r in recs)


def test_moondream3_checkpoint_through_the_cli(md3_ckpt, tmp_path):
    """The CLI needs nothing model-specific: a Moondream 3 checkpoint captions the same way,
    and its captions equal the API's on that checkpoint."""
    d = tmp_path / "data"
    paths = make_tree(d, n=2, seed=120)
    jl = tmp_path / "o.jsonl"
    assert main([str(d), "-r", "--model", md3_ckpt, "--jsonl", str(jl), *ARGS]) == 0
    with Moondream.load(md3_ckpt, max_batch_size=4) as m3:
        assert m3.config.family == "moondream3"
        want = {p: m3.caption(p, settings=SETTINGS)["caption"] for p in paths}
    recs = read_jsonl(jl)
    assert {r["path"]: r["caption"] for r in recs} == want


def test_photon_caption_and_photon_serve_share_one_set_of_engine_flags():
    """`cli/flags.add_engine_flags` defines the engine flags once: both commands have the
    same ones, with the defaults that differ passed in (photon-serve warms up, tensor
    parallelism is off in two ways), both take every spelling they took before, and both
    map them to the same `Moondream.load` keywords."""
    from photon_jax.cli import flags, serve

    cap, srv = build_parser(), serve.build_parser()
    engine = {"--model", "--revision", "--dtype", "--batch-size", "--max-context",
              "--kv-cache-tokens", "--kv-dtype", "--weights", "--tensor-parallel", "--workers",
              "--prefix-cache", "--no-prefix-cache", "--compile-cache", "--no-compile-cache",
              "--warmup", "--no-warmup", "--adapter", "--max-adapters", "--max-lora-rank"}
    for ap in (cap, srv):
        assert engine <= {o for a in ap._actions for o in a.option_strings}
    c = cap.parse_intermixed_args(["img.png", "--model", "m"])
    s = srv.parse_args(["--model", "m"])
    assert (c.warmup, s.warmup) == (False, True)
    assert (c.tensor_parallel, s.tensor_parallel) == (1, None)
    old = ["--no-prefix-cache", "--no-compile-cache", "--kv-dtype", "int8", "--batch-size", "3"]
    c = cap.parse_intermixed_args(["img.png", "--model", "m", "--warmup", *old])
    s = srv.parse_args(["--model", "m", "--no-warmup", *old])
    assert flags.engine_options(c) == {**flags.engine_options(s), "warmup": True}
    assert flags.engine_options(s) == dict(
        dtype=None, max_batch_size=3, max_context=None, kv_cache_tokens=None,
        kv_dtype="int8", weights=None, prefix_cache=False, compile_cache=False, warmup=False,
        workers=s.workers, adapters=None, max_adapters=None, max_lora_rank=16)
    s = srv.parse_args(["--model", "m", "--adapter", "a=x.pt", "--adapter", "b@1=y.pt",
                        "--max-adapters", "2", "--max-lora-rank", "64"])
    assert {k: flags.engine_options(s)[k] for k in ("adapters", "max_adapters",
                                                     "max_lora_rank")} == \
        {"adapters": {"a": "x.pt", "b@1": "y.pt"}, "max_adapters": 2, "max_lora_rank": 64}
    assert "NAME=PATH" in flags.engine_flag_error(srv.parse_args(["--model", "m",
                                                                  "--adapter", "x.pt"]))
    for argv, flag in ((["--workers", "0"], "--workers"), (["--batch-size", "0"], "--batch-size"),
                       (["--tensor-parallel", "0"], "--tensor-parallel")):
        assert flag in flags.engine_flag_error(srv.parse_args(["--model", "m", *argv]))
        assert main(["img.png", "--model", "m", *argv]) == 2
