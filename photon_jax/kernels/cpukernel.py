"""The CPU decode kernels: paged attention (`csrc/paged_attention.cc`, `attend`) and the
skinny dense products (`csrc/dense.cc`, `dense`), compiled together with the machine's C++
compiler on first use, cached on disk, and registered with XLA as FFI custom calls.

Why a hand-written kernel on CPU.  The decode step's attention must read each row's pages
where they lie and nothing else.  On GPU JAX ships a Pallas kernel that does; Pallas has no
CPU lowering, and the best XLA:CPU formulation we measured (the arena sweep of `kvpool`)
runs its batched products at about half the machine's read rate and reads every page up to
the pool's high-water mark (1.35x the attended KV at 32 rows).  The kernel walks each row's
page table up to its own length, one online-softmax pass per (row, kv head), spread over
XLA's intra-op threads: every attended K/V element is read once, and only those.

Why the dense kernel.  A decode step multiplies a few rows by every weight matrix; XLA:CPU
runs these float32 products at 15-25 GFLOP/s on 2 cores, about a third of what the same cores
reach on a large product, so at 32 rows they were most of the step.  `dense` packs 16-column
panels of the weight and runs register-blocked tiles over them (AVX2 + FMA; built for other
CPUs it reports so through `dense_fast()` and the step keeps XLA's products).  A quantized
weight (`model.quant`: 8-bit codes with channel scales, 4-bit codes with group scales and
zeros) goes in as its codes and is widened while its panels are packed, so the call reads 1
byte (int8, fp8) or half a byte (int4) per weight instead of 4, and computes bitwise what
the float32 call on the dequantized weight computes.  At 1-4 rows (decode at small batch) a
quantized [K, N] weight is not packed but streamed: its codes are widened in registers and
multiplied where they lie, row after row, each output still summed in k order (the same
bits), at about the rate memory delivers the codes.

Building.  `c++` (or `$CXX`) with `-O3 -march=native`, against the FFI headers of the
installed jaxlib; the library goes to `$XDG_CACHE_HOME/photon_jax/kernels` (default
`~/.cache/photon_jax/kernels`, or `$PHOTON_JAX_KERNEL_DIR`), named by a hash of the source,
the flags, the jaxlib version and the CPU, so a change of any of them builds anew.  It takes
a few seconds once.  Without a compiler (or if the build fails) `load()` is False with
the reason (`reason()`), and CPU models fall back to the XLA sweep (`platforms.default_attention`), with one
warning naming the reason and the fix.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from ..base.dtypes import F32

TARGET = "photon_paged_attention"
DENSE_TARGET = "photon_dense"
_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = tuple(os.path.join(_CSRC, name) for name in ("paged_attention.cc", "dense.cc"))
_HEADERS = (os.path.join(_CSRC, "parallel.h"),)
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict = {}   # "ok": bool, "reason": str, "path": str, "lib": the loaded library


def kernel_dir() -> str:
    d = os.environ.get("PHOTON_JAX_KERNEL_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "photon_jax", "kernels")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or \
        shutil.which("clang++")


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _library_path(cxx: str) -> str:
    srcs = []
    for name in (*_SOURCES, *_HEADERS):
        with open(name, "rb") as f:
            srcs.append(f.read())
    h = hashlib.sha256()
    for part in (*srcs, " ".join(_FLAGS).encode(), cxx.encode(), jaxlib.__version__.encode(),
                 platform.machine().encode(), _cpu_id().encode()):
        h.update(part)
        h.update(b"\0")
    return os.path.join(kernel_dir(), f"photon_cpu-{h.hexdigest()[:20]}.so")


def _build(cxx: str, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Build beside the target and rename: concurrent first uses (test workers, processes)
    # never load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        cmd = [cxx, *_FLAGS, "-I", jax.ffi.include_dir(), *_SOURCES, "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> bool:
    """Build (once per machine) and register the kernel; True if it is usable.  Never
    raises: a failure is kept as `reason()`."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        try:
            cxx = _compiler()
            if cxx is None:
                raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
            path = _library_path(cxx)
            if not os.path.exists(path):
                _build(cxx, path)
            lib = ctypes.cdll.LoadLibrary(path)
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.PhotonPagedAttention),
                                        platform="cpu")
            jax.ffi.register_ffi_target(DENSE_TARGET, jax.ffi.pycapsule(lib.PhotonDense),
                                        platform="cpu")
            _state.update(ok=True, reason="", path=path, lib=lib,
                          dense_fast=bool(lib.photon_dense_simd()))
        except Exception as e:   # noqa: BLE001 -- any failure means: use the XLA sweep
            _state.update(ok=False, reason=f"{type(e).__name__}: {e}")
            _log.warning("photon_jax: the CPU paged-attention kernel is not available (%s); "
                         "decode attention falls back to the slower XLA sweep. The kernel needs "
                         "a C++ compiler (g++, or $CXX) and jaxlib's FFI headers.",
                         _state["reason"])
        return _state["ok"]


def reason() -> str:
    """Why the kernel is not available ("" if it is, or was never tried)."""
    return _state.get("reason", "")


def attend(k_KPBH, v_KPBH, q_RQH, pt_RM, length_R, ks_KPB=None, vs_KPB=None):
    """[R, Q, H] in q's dtype: each row's query heads against its pages pt_RM[r, :] up to
    length_R[r] positions (0: a padding row, output zeros).  Pages are indices into the one
    arena given.  8-bit pages (int8, float8_e4m3fn) come with their float32 scales [K, P, B]
    (the kernel widens code x scale as it reads).  Must run on CPU; call `load()` first (the
    engine's program builder does)."""
    if not load():
        raise RuntimeError(f"the CPU paged-attention kernel is not available: {reason()}")
    if ks_KPB is None:   # float32 / bfloat16 pages: empty scales, never read
        ks_KPB = vs_KPB = jnp.zeros((0,), F32)
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_RQH.shape, F32))(
        q_RQH.astype(F32), k_KPBH, v_KPBH, ks_KPB, vs_KPB, pt_RM.astype(jnp.int32),
        length_R.astype(jnp.int32), scale=np.float32(q_RQH.shape[-1] ** -0.5))
    return out.astype(q_RQH.dtype)


def dense_fast() -> bool:
    """Whether `dense` beats XLA's products here: the kernels load and were built with AVX2
    and FMA (x86-64 CPUs since 2013-2015).  The decode step uses it only then."""
    return load() and _state["dense_fast"]


def dense_isa(use: str | None = None) -> str | None:
    """The vectors `dense` streams 8-bit codes in at 1-4 rows: "avx512" (where the build
    targets AVX-512 F/BW/VL), "avx2", or None (no kernel, or no AVX2 + FMA).  The results
    are the same bits either way; benchmarks report it because the speed is not.  `use`
    ("avx2" / "avx512") switches the stream for this process's later calls, where built
    (tests check the 256-bit stream's bits that way; a benchmark can time both)."""
    if use not in (None, "avx2", "avx512"):
        raise ValueError(f"dense_isa: use must be 'avx2' or 'avx512', not {use!r}")
    if not dense_fast():
        return None
    on = -1 if use is None else int(use == "avx512")
    return "avx512" if _state["lib"].photon_dense_gemv512(on) else "avx2"


def _dense_weight(w, transposed: bool):
    """(codes or floats, scales, zeros) for the kernel: a float weight as float32 with empty
    scales and zeros; a quantized dict (`model.quant`'s layouts: {"q", "s"} int8 or
    float8_e4m3fn codes with float32 scales [N]; {"q4", "s4", "z4"} 4-bit) as its parts.
    The codes' dtype tells the kernel their kind."""
    empty = jnp.zeros((0,), F32)
    if not isinstance(w, dict):
        return w.astype(F32), empty, empty
    if "q" in w:
        q = w["q"]
        if np.dtype(q.dtype) not in (np.dtype(np.int8), np.dtype(jnp.float8_e4m3fn)):
            raise ValueError(f"dense: 8-bit codes must be int8 or float8_e4m3fn, not {q.dtype}")
        return q, w["s"].astype(F32), empty
    if "q4" in w:
        if transposed:
            raise ValueError("dense: a 4-bit weight is never held transposed")
        return w["q4"].astype(jnp.uint8), w["s4"].astype(F32), w["z4"].astype(F32)
    raise ValueError(f"dense: not a weight: a dict with keys {sorted(w)}")


def dense(x_MK, w, b_N, transposed: bool = False):
    """[M, N] float32: x @ w + b, w [K, N] (or [N, K] with `transposed`), summed in k order
    in float32, the bias added last.  `w` is a float array or a quantized weight dict
    (`model.quant`: int8 / float8_e4m3fn codes with per-channel scales, or 4-bit codes
    with group scales and zeros), widened in the kernel as it packs W's panels (at 1-4 rows
    of a [K, N] weight: as it streams them), value for value as
    `quant.dequantize(w, float32, transposed)` widens it (4-bit: both steps rounded to
    bfloat16): the result is bitwise `dense` on that float32 weight.  Must run
    on CPU; call `load()` first."""
    if not load():
        raise RuntimeError(f"the CPU kernels are not available: {reason()}")
    q, s, z = _dense_weight(w, transposed)
    n = q.shape[0] if transposed else q.shape[1]
    return jax.ffi.ffi_call(DENSE_TARGET, jax.ShapeDtypeStruct((x_MK.shape[0], n), F32))(
        x_MK.astype(F32), q, b_N.astype(F32), s, z, transposed=transposed)


def linear(x, p):
    """`layers.linear` through `dense`: x [..., K] times p["w"] [K, N] or p["w_vd"] [N, K]
    (a float array or a quantized dict, passed through as it is), plus p["b"], in x's
    dtype."""
    transposed = "w_vd" in p
    y = dense(x.reshape(-1, x.shape[-1]), p["w_vd" if transposed else "w"], p["b"], transposed)
    return y.reshape(*x.shape[:-1], y.shape[-1]).astype(x.dtype)


def bytes_accessed(kv_bytes: int, n_layers: int, rows: int, n_heads: int, head_dim: int) -> int:
    """What the kernel reads and writes in one decode step over every layer: each attended
    K/V element once (`kv_bytes`), the float32 queries and outputs.  XLA's cost analysis sees
    a custom call as reading nothing, so benchmarks add this to its figure."""
    return kv_bytes + 2 * n_layers * rows * n_heads * head_dim * 4


def dense_bytes_accessed(jaxpr) -> int:
    """What the `dense` calls of a traced program (`jax.make_jaxpr`, nested jaxprs included)
    read and write: each reads its x, weight (float32, or its codes, scales and zeros at
    their own widths) and bias whole and writes its output.  XLA's cost analysis counts
    these custom calls as nothing, like the attention kernel's."""
    total = 0
    stack = [getattr(jaxpr, "jaxpr", jaxpr)]
    while stack:
        jp = stack.pop()
        for eqn in jp.eqns:
            if eqn.primitive.name == "ffi_call" and eqn.params.get("target_name") == DENSE_TARGET:
                total += sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
                             for v in (*eqn.invars, *eqn.outvars))
            for val in eqn.params.values():
                for sub in (val if isinstance(val, (tuple, list)) else (val,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        stack.append(inner)
    return total

