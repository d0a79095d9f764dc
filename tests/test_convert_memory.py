"""photon-convert streams: peak memory is about the output tree, not the whole input as well.

A synthetic ~350 MB bf16 checkpoint (large vocab and text width, tiny vision) is converted in a
separate process and that process's peak RSS is measured.

Measuring: on Linux a child's ru_maxrss also counts the memory of the process it was spawned
from (fork/vfork + exec fold the old address space's high-water mark into the child's), so the
pytest process's own size would leak into the number.  The conversion therefore runs as the
child of a small launcher interpreter, which reports getrusage(RUSAGE_CHILDREN).ru_maxrss.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
import pytest

from photon_jax.convert import names
from photon_jax.model.config import MoondreamConfig

BF16 = np.dtype(ml_dtypes.bfloat16)
GiB = 1 << 30
MiB = 1 << 20

# Output ~320 MiB in bf16 with no single tensor above 64 MiB, so that "the output tree plus
# one tensor" and "two copies of the output tree" are far apart.
BIG = {
    "text": {"dim": 1024, "n_heads": 16, "n_kv_heads": 16, "n_layers": 8, "ff_dim": 4096,
             "vocab_size": 32768},
    "vision": {"enc_dim": 8, "enc_n_heads": 2, "enc_ff_dim": 16, "enc_n_layers": 1,
               "proj_out_dim": 1024, "proj_inner_dim": 32},
    "region": {"dim": 1024, "inner_dim": 32},
}

LAUNCHER = (
    "import resource, subprocess, sys\n"
    "r = subprocess.run(sys.argv[1:])\n"
    "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)\n"
    "sys.exit(r.returncode)\n"
)
CONVERT = (
    "import sys\n"
    "from photon_jax.convert import convert\n"
    "convert(sys.argv[1], sys.argv[2], dtype='bfloat16', log=lambda s: None)\n"
)
BASELINE = (  # the same imports and interpreter, no conversion
    "import jax, orbax.checkpoint, numpy\n"
    "from photon_jax.convert import convert\n"
)


def _hf_shapes(cfg):
    return names.hf_shapes(cfg)


def _write_streaming(path, shapes: dict, pool: np.ndarray) -> int:
    """Write a bf16 safetensors file without holding more than `pool` in memory."""
    header, off = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    raw = pool.tobytes()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for i, (name, shape) in enumerate(shapes.items()):
            n = int(np.prod(shape)) * 2
            start = (i * 4099 * 2) % (len(raw) // 2)  # vary the data between tensors
            while n:
                chunk = raw[start:start + n]
                f.write(chunk)
                n -= len(chunk)
                start = 0
    return off


def _peak_kib(args, env) -> int:
    # Run outside the checkout: `python -c` puts the working directory first on sys.path, and
    # the source tree's photon_jax/ (without the installed photon_jax.convert) would shadow
    # the installed package.
    r = subprocess.run([sys.executable, "-c", LAUNCHER, *args], capture_output=True, text=True,
                       env=env, timeout=300, cwd=tempfile.gettempdir())
    assert r.returncode == 0, r.stderr[-4000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("PEAK_KIB")][-1]
    return int(line.split()[1])


@pytest.fixture(scope="module")
def measured(tmp_path_factory, fixture_dir):
    """Convert the synthetic checkpoint once in a child process; its peak RSS and sizes."""
    tmp = tmp_path_factory.mktemp("mem")
    cfg = MoondreamConfig.from_dict(BIG)
    shapes = _hf_shapes(cfg)
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    out_bytes = 2 * n_params  # bf16
    largest = max(int(np.prod(s)) for s in shapes.values()) * 2
    assert 300 * MiB < out_bytes < 420 * MiB
    assert largest == 32768 * 1024 * 2

    hf = tmp / "hf"
    hf.mkdir()
    shutil.copyfile(os.path.join(fixture_dir, "tokenizer.json"), hf / "tokenizer.json")
    with open(hf / "config.json", "w") as f:
        json.dump({"architectures": ["HfMoondream"], "config": BIG}, f)
    rng = np.random.default_rng(0)
    pool = (0.02 * rng.standard_normal(4 * MiB, dtype=np.float32)).astype(BF16)
    assert _write_streaming(hf / "model.safetensors", shapes, pool) == out_bytes
    del pool

    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    out = tmp / "out"
    t0 = time.time()
    peak = _peak_kib([sys.executable, "-c", CONVERT, str(hf), str(out)], env) * 1024
    seconds = time.time() - t0
    base = _peak_kib([sys.executable, "-c", BASELINE], env) * 1024
    report = (f"synthetic checkpoint: {n_params:,} params, output {out_bytes / MiB:.0f} MiB "
              f"(largest tensor {largest / MiB:.0f} MiB); converter peak RSS "
              f"{peak / MiB:.0f} MiB, import-only baseline {base / MiB:.0f} MiB, above "
              f"baseline {(peak - base) / MiB:.0f} MiB = {(peak - base) / out_bytes:.2f} x "
              f"output; conversion {seconds:.1f} s")
    print("\n" + report)
    with open(out / "provenance.json") as f:
        prov = json.load(f)
    from photon_jax.model import checkpoint

    got_cfg = checkpoint.read_config(str(out))
    yield dict(peak=peak, base=base, out_bytes=out_bytes, largest=largest, prov=prov,
               n_params=n_params, report=report, cfg=cfg, got_cfg=got_cfg)
    shutil.rmtree(tmp, ignore_errors=True)  # ~650 MiB of files


def test_conversion_completes(measured):
    assert measured["prov"]["n_params"] == measured["n_params"]
    # text: 8 blocks x 10 + wte, post_ln, lm_head; vision: 1 block x 12 + 9; region: 14
    assert measured["prov"]["n_tensors"] == 8 * 10 + 5 + 12 + 9 + 14
    assert measured["prov"]["dtype"] == "bfloat16"
    assert measured["got_cfg"] == measured["cfg"]


def test_peak_rss_within_output_plus_1gb(measured):
    m = measured
    assert m["peak"] <= m["out_bytes"] + GiB, m["report"]


def test_peak_rss_below_two_output_trees(measured):
    """Streaming, made scale-free: above the interpreter's own footprint (same imports, no
    conversion) the converter may hold the output tree plus transients (one source tensor, its
    converted copy, writer buffers; here each tensor is at most 1/5 of the output), but never
    a second full copy of the output tree or the whole input next to it: that alone would be
    2 x the output.  (convert.py documents "the output tree plus one source tensor and its
    converted copy", i.e. ~1.4 x here.)"""
    m = measured
    assert m["largest"] * 5 <= m["out_bytes"]
    bound = 2 * m["out_bytes"]
    assert m["peak"] - m["base"] < bound, (
        f"{m['report']}; bound above baseline {bound / MiB:.0f} MiB")
