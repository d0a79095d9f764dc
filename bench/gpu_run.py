"""The GPU run: one command for the H200 image as it is, every result written to the output
folder as soon as it exists, so a kill at any point keeps what finished.

The image has no network and no photon_jax: nothing is installed, the checkout is put on
PYTHONPATH (`bench/gpu_run.sh` does it; `photon_jax.convert` is found in the checkout) and
the image's own jax, flax, orbax, numpy, pillow, tokenizers and safetensors are used.

    bash bench/gpu_run.sh                    # on the GPU machine: results in $OUT
    python bench/gpu_run.py --dry-run        # the steps and the seconds each is given
    python bench/gpu_run.py --cpu-smoke      # every step at a tiny config on CPU (CI)

Steps, in order of value; each runs in its own process under a time limit (its allotment
plus what earlier steps left unused, never past the run's budget, 480 s by default); a step
that overruns is killed and the next one starts:

  env      versions, devices, memory, the private JAX APIs photon_jax relies on (`compat`)
  kernels  the Pallas kernel tests on the real GPU (tests/test_gpu_attention.py: our decode
           attention, every split and pool dtype; tests/test_pool.py,
           tests/test_gpu_lowering.py and the 8-bit ones of tests/test_kv8.py)
  engine   the engine end to end on the tiny fixture (float32) with the host-sync detector
           on top of the engine's transfer guard: every public surface
           (`tests/helpers.surfaces`) on the GPU, pipelined and blocking, against the same
           calls on the machine's CPU backend
  md2      full-size Moondream 2, random bf16 weights, batch 1, 8 and 32
           (`bench/gpu_md2.py`): ceiling, blocking and pipelined tokens/s, pipelined with
           bursts of 8 (`--burst 8`, the GPU's default: the host's share per token,
           docs/host.md), the step
           against the 4.8 TB/s floor, the bubble
  caption  photon-caption images/s at full size, 24 mixed-size images (`bench/caption.py`);
           then 4 streams while 4 new 13-crop images arrive, their encodes sliced between
           decode steps and whole (`bench/arrivals.py`: gaps over the median, arrivals' time)
  md3      Moondream 3 at full size (bf16), batch 1 and 32, every loop, the pool sized to
           the run (`bench/gpu_md2.py --md3-only --md3-loops`)
  md2_fp8  the md2 step with float8_e4m3fn K/V (`--kv-dtype`), on whatever time the steps
           above left; then Moondream 3's MoE schedules timed on one full-size layer
           (`bench/moe.py --layer md3`: dense, blocks, ragged_dot at 1, 746, 2048 tokens);
           then the md2 ceiling with int8 weights (`--weights int8`) at batch 1/8/32, in
           this step because the device returns 8 files

Every step shares one persistent compile cache (`--work`/xla).  Output folder (`--out`,
default $OUT): `summary.jsonl`, one line per step (status, seconds, allotment, and the
step's JSON results), and `NN-STEP.log`, the step's whole output: 8 files, the most the
device machine returns.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (name, seconds on the GPU, seconds in --cpu-smoke, what it answers)
STEPS = [
    ("env", 25, 60, "versions, devices, memory, the private JAX APIs"),
    ("kernels", 95, 90, "the Pallas kernel tests on the real GPU"),
    ("engine", 80, 240, "every public surface on the GPU (pipelined, blocking) vs the CPU"),
    ("md2", 150, 240, "Moondream 2 full size, batch 1/8/32: loops, bursts of 8, floor, "
                      "bubble"),
    ("caption", 100, 240, "photon-caption images/s at full size, 24 images; streams while "
                          "images arrive, sliced and whole"),
    ("md3", 30, 240, "Moondream 3 full size, batch 1/32, pool sized to the run"),
    # No time of its own: it runs on what the steps above left of the budget.
    ("md2_fp8", 0, 240, "Moondream 2 full size, batch 1/8/32, float8 K/V, then int8 weights "
                        "(if time is left)"),
]
BUDGET_S = 480


# -- the steps, each run in a child process ----------------------------------------------

def emit(**row) -> None:
    print(json.dumps(row, default=str), flush=True)


def step_env(smoke: bool, work: str) -> None:
    import importlib.metadata as md
    import platform

    import jax

    from photon_jax.base import compat
    from photon_jax.engine import hostsync
    from photon_jax.model import platforms

    pkgs = {}
    for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
                 "flax", "orbax-checkpoint", "chex", "numpy", "pillow", "tokenizers",
                 "safetensors", "torch", "pytest", "pytest-xdist"):
        try:
            pkgs[name] = md.version(name)
        except md.PackageNotFoundError:
            pkgs[name] = None
    checks = {}
    for name, call in (("array_impl", compat.array_impl),
                       ("d2h_guard_reader", compat.d2h_guard_reader),
                       ("pallas_triton", compat.pallas_triton)):
        try:
            call()
            checks[name] = "ok"
        except Exception as e:   # the report is the result
            checks[name] = f"{type(e).__name__}: {e}"
    devices = []
    for d in jax.devices():
        stats = d.memory_stats() or {}
        devices.append({"device": str(d), "kind": d.device_kind, "platform": d.platform,
                        "bytes_limit": stats.get("bytes_limit"),
                        "bytes_in_use": stats.get("bytes_in_use")})
    smi = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,"
                              "clocks.max.sm,clocks.max.mem", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    emit(step="env", python=sys.version.split()[0], platform=platform.platform(),
         packages=pkgs, backend=jax.default_backend(), devices=devices, nvidia_smi=smi,
         compat=checks, tested_jax=compat.TESTED_JAX,
         default_attention=platforms.default_attention(jax.default_backend()),
         gpu_rules_emulated=hostsync.emulating_gpu_transfers(), cpu_count=os.cpu_count())


def _stream(cmd: list[str], env: dict | None = None) -> tuple[int, str]:
    """Run `cmd` in the checkout, echoing its output; -> (exit code, last line)."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env={**os.environ, **(env or {})})
    last = ""
    for line in p.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if line.strip():
            last = line.strip()
    return p.wait(), last


def step_kernels(smoke: bool, work: str) -> None:
    # addopts cleared: the project's "-n 2" needs pytest-xdist, and one process is what a
    # single GPU wants.  The smoke run only collects (the suite runs these tests itself).
    # Our kernel's own tests first (every split and pool dtype against float64 on the GPU).
    cmd = [sys.executable, "-m", "pytest", "tests/test_gpu_attention.py", "tests/test_pool.py",
           "tests/test_gpu_lowering.py", "tests/test_kv8.py", "-k",
           "(gpu_attention and not warms) or gpu_lowering or pallas or decode_paths or "
           "lowers_for_cuda",
           "-o", "addopts=", "-q", "-rfEs",
           "-p", "no:cacheprovider"] + (["--collect-only"] if smoke else [])
    code, last = _stream(cmd)
    emit(step="kernels", exit_code=code, pytest=last, collect_only=smoke)
    if code != 0:
        raise SystemExit(code)


def _fixture_ckpt(name: str, work: str) -> str:
    from photon_jax.convert import convert

    out = os.path.join(work, f"{name}-f32")
    if not os.path.isfile(os.path.join(out, "config.json")):
        convert(os.path.join(ROOT, "tests", "fixtures", name), out, dtype="float32",
                overwrite=True, log=lambda s: None)
    return out


def step_engine(smoke: bool, work: str) -> None:
    import jax

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import MD3_BIASES, biased_model, run_surfaces

    from photon_jax.engine import hostsync
    from photon_jax.model import Model

    md2 = _fixture_ckpt("moondream2-tiny", work)
    md3 = None if smoke else _fixture_ckpt("moondream3-tiny", work)
    hostsync.install_detector()   # any host read or wait inside launch/finalize raises
    main, cpu = jax.devices()[0], jax.devices("cpu")[0]
    targets = [main] if main == cpu else [main, cpu]
    runs = {}
    for dev in targets:
        t0 = time.perf_counter()
        models = (Model.load(md2, device=dev),
                  None if md3 is None else biased_model(md3, MD3_BIASES, device=dev))
        for pipelined in (True, False):
            # A pool for the run, not most of an accelerator's memory (the smoke run on CPU:
            # the default pool, whose programs the test suite's surface runs share).
            runs[(dev.platform, pipelined)] = run_surfaces(
                models, pipelined, kv_cache_tokens=None if smoke else 16384)
        emit(step="engine", device=str(dev), seconds=round(time.perf_counter() - t0, 1))
    plat = main.platform
    ref = runs[("cpu", True)]
    out = runs[(plat, True)]
    same_loop = same_cpu = 0
    for key in out:
        a, b, c = out[key], runs[(plat, False)][key], ref[key]
        same_loop += a == b
        same_cpu += a == c
        emit(step="engine", surface=key, pipelined_equals_blocking=a == b,
             equals_cpu=a == c, result=a, **({} if a == c else {"cpu_result": c}))
    emit(step="engine", platform=plat, surfaces=len(out), pipelined_equals_blocking=same_loop,
         equals_cpu=same_cpu, all_equal=same_loop == same_cpu == len(out))


def _bench(script: str, args: list[str], process: bool = False) -> None:
    """Run a bench script's main(args) in this step's process: the step is already the
    unit that a crash or a hang costs, and a new process would pay the imports and the
    device's start again.  `process`: in a process of its own (a script that restarts
    itself with other environment variables, as caption.py does for the CPU allocator)."""
    if process:
        code, _ = _stream([sys.executable, os.path.join("bench", script), *args])
    else:
        import importlib

        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        code = importlib.import_module(script.removesuffix(".py")).main(args)
        sys.stdout.flush()
    if code:
        raise SystemExit(code)


def step_md2(smoke: bool, work: str) -> None:
    _bench("gpu_md2.py", ["--config", "tiny", "--batch", "2", "--steps", "2", "--position",
                          "760", "--no-md3", "--burst", "2"] if smoke else
           ["--batch", "1", "8", "32", "--steps", "32", "--no-md3", "--burst", "8"])


def step_caption(smoke: bool, work: str) -> None:
    cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
    args = (["--config", "tiny", "--images", "3", "--batch", "2", "--max-tokens", "3",
             "--ckpt-dtype", "float32", "--compile-cache", cache] if smoke else
            ["--config", "md2", "--images", "24", "--batch", "32", "--max-tokens", "64",
             "--ckpt-dtype", "bfloat16", "--compile-cache", cache,
             "--keep", os.path.join(work, "caption")])
    _bench("caption.py", args, process=True)
    # Then (in this step: the machine returns 8 files) streams while new images arrive, their
    # encodes sliced or whole (`bench/arrivals.py`): 4 streams, 4 images of 13 crops.
    _bench("arrivals.py", ["--config", "tiny", "--streams", "1", "--arrivals", "1",
                           "--crops", "2", "--reps", "1", "--stream-tokens", "80"] if smoke else
           ["--config", "md2", "--streams", "4", "--arrivals", "4", "--crops", "13",
            "--reps", "2", "--stream-tokens", "4000"], process=True)


def step_md3(smoke: bool, work: str) -> None:
    # The smoke run takes the ceiling only: the loops' code is md2's, and CI's time is short.
    _bench("gpu_md2.py", ["--config", "tiny", "--md3-only", "--batch", "2",
                          "--steps", "2", "--position", "760"] if smoke else
           ["--md3-only", "--md3-loops", "--batch", "1", "32", "--steps", "16"])


def step_md2_fp8(smoke: bool, work: str) -> None:
    _bench("gpu_md2.py", ["--config", "tiny", "--batch", "2", "--steps", "2", "--position",
                          "760", "--no-md3", "--kv-dtype", "float8_e4m3fn"] if smoke else
           ["--batch", "1", "8", "32", "--steps", "32", "--no-md3",
            "--kv-dtype", "float8_e4m3fn"])
    # Then (in this step: the machine returns 8 files) Moondream 3's MoE schedules on one
    # full-size layer, which picks GPU's prefill schedule (`platforms.default_grouped`).
    _bench("moe.py", ["--tokens", "1", "--reps", "1", "--no-full"] if smoke else
           ["--layer", "md3", "--tokens", "1", "746", "2048", "--reps", "5", "--no-full"])
    # Then int8 weights (`model.quant`): the ceiling at batch 1/8/32, its bytes against the
    # bf16 rows of the md2 step.
    _bench("gpu_md2.py", ["--config", "tiny", "--batch", "2", "--steps", "2", "--position",
                          "760", "--no-md3", "--ceiling-only", "--weights", "int8"] if smoke
           else ["--batch", "1", "8", "32", "--steps", "32", "--no-md3", "--ceiling-only",
                 "--weights", "int8"])


CHILD = {"env": step_env, "kernels": step_kernels, "engine": step_engine, "md2": step_md2,
         "caption": step_caption, "md3": step_md3,
         "md2_fp8": step_md2_fp8}


# -- the parent: budget, processes, files ---------------------------------------------------

def _json_lines(path: str) -> list[dict]:
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    return rows


def _clock(s: float) -> str:
    return f"{int(s) // 60}:{int(s) % 60:02d}"


def run(args) -> int:
    smoke = args.cpu_smoke
    steps = [s for s in STEPS if not args.steps or s[0] in args.steps]
    budget = args.budget or (sum(s[2] for s in steps) if smoke else BUDGET_S)
    if args.dry_run:
        print(f"{len(steps)} steps, budget {budget} s ({'cpu smoke' if smoke else 'GPU'}); "
              f"output {args.out}, work {args.work}")
        for i, (name, gpu_s, smoke_s, what) in enumerate(steps, 1):
            print(f"  {i}. {name:8s} {smoke_s if smoke else gpu_s:4d} s  {what}")
        print("  (a step may also use what earlier steps left of their allotments)")
        return 0
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in os.environ.get(
               "PYTHONPATH", "").split(os.pathsep) if p]),
           "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR") or
           os.path.join(args.work, "xla"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
    summary = os.path.join(args.out, "summary.jsonl")
    t_run = time.perf_counter()
    carry = 0.0
    failed = 0
    for i, (name, gpu_s, smoke_s, what) in enumerate(steps, 1):
        allot = smoke_s if smoke else gpu_s
        left = budget - (time.perf_counter() - t_run)
        limit = min(allot + carry, left)
        log = os.path.join(args.out, f"{i:02d}-{name}.log")
        row = {"step": name, "allotted_s": allot, "limit_s": round(limit, 1)}
        if limit < 5:
            row.update(status="skipped", reason="no time left in the budget")
            failed += 1
        else:
            t0 = time.perf_counter()
            with open(log, "w") as f:
                f.write(f"# step {i} {name}: {what} (limit {limit:.0f} s)\n")
                f.flush()
                p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                      name, "--work", args.work] +
                                     (["--cpu-smoke"] if smoke else []),
                                     cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                     start_new_session=True)
                try:
                    code = p.wait(timeout=limit)
                    status = "ok" if code == 0 else f"failed (exit {code})"
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    status = "timed out"
            used = time.perf_counter() - t0
            carry = max(0.0, limit - used) if status == "ok" else max(0.0, allot + carry - used)
            failed += status != "ok"
            row.update(status=status, seconds=round(used, 1), results=_json_lines(log))
        row["run_s"] = round(time.perf_counter() - t_run, 1)
        with open(summary, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        print(f"[{i}/{len(steps)} {name}] {row['status']} in {row.get('seconds', 0):.1f} s "
              f"(allotted {allot} s, limit {limit:.0f} s); run {_clock(row['run_s'])} of "
              f"{_clock(budget)}", flush=True)
    print(f"done: {len(steps) - failed} of {len(steps)} steps ok in "
          f"{_clock(time.perf_counter() - t_run)}; results in {args.out}")
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu_run_out"),
                    help="where summary.jsonl and the step logs go (default: $OUT)")
    ap.add_argument("--work", default="/tmp/photon-gpu-run",
                    help="checkpoints, images and the shared compile cache")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole run (default {BUDGET_S}; smoke: the sum)")
    ap.add_argument("--steps", nargs="+", choices=[s[0] for s in STEPS],
                    help="run only these steps")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="every step at a tiny config on the CPU backend")
    ap.add_argument("--dry-run", action="store_true", help="print the plan only")
    ap.add_argument("--child", choices=list(CHILD), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        CHILD[args.child](args.cpu_smoke, args.work)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
