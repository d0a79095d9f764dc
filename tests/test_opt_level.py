"""The suite compiles at XLA's -O0 on CPU, with its older elemental emitters
(tests/conftest.py, helpers.SUITE_FLAGS: much less compile time, measured on the surfaces run);
this file runs the golden parity tests, the engine's pipelined == blocking == reference
test and the image slices' bit-for-bit test again at XLA's default level, in a process of its own, so that what users run (the
default level) is held to the reference fixtures too."""

import os
import re
import subprocess
import sys

import helpers
from helpers import SUITE_FLAGS, suite_xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))


def test_the_default_optimization_level_passes_the_parity_tests():
    # Without the suite's flags, and with conftest told not to add them back.
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in SUITE_FLAGS:
        flags = flags.replace(flag, "")
    env = {**os.environ, "XLA_FLAGS": " ".join(flags.split()),
           "PHOTON_JAX_TEST_XLA_OPT": "default"}
    child = suite_xla_flags(env)          # what the child's conftest will set
    assert not any(flag in child for flag in SUITE_FLAGS), child
    tests = [os.path.join(HERE, "test_parity.py"),
             os.path.join(HERE, "test_engine.py::test_pipelined_equals_blocking_equals_reference"),
             # (Moondream 3 and bfloat16: where the default level's fusions could differ.)
             *(os.path.join(HERE, "test_slicing.py::test_slices_give_the_one_program_prefix_"
                                  f"bit_for_bit[{case}]")
               for case in ("moondream3", "moondream2-bf16"))]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", *tests],
        cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    # Every test ran and passed: none skipped or deselected.
    summary = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed in [\d.]+s( \(\S+\))?", summary.strip("= ")), summary


def test_the_suite_flags_are_added_once_and_never_over_the_callers_own(monkeypatch):
    """conftest's decision: both flags on a CPU-only install, none where an accelerator plugin
    is installed or PHOTON_JAX_TEST_XLA_OPT=default, and a level the caller set kept as is
    (two settings of one flag in XLA_FLAGS: appending ours could silently override theirs)."""
    monkeypatch.setattr(helpers, "_accelerator_plugin", lambda: False)
    assert suite_xla_flags({}).split() == list(SUITE_FLAGS)
    assert suite_xla_flags({"XLA_FLAGS": suite_xla_flags({})}).split() == list(SUITE_FLAGS)
    own = suite_xla_flags({"XLA_FLAGS": "--xla_backend_optimization_level=2 --xla_dump_to=/d"})
    assert own.split() == ["--xla_backend_optimization_level=2", "--xla_dump_to=/d",
                           "--xla_cpu_use_fusion_emitters=false",
                           "--xla_cpu_multi_thread_eigen=false"]
    assert suite_xla_flags({"XLA_FLAGS": "--a=1", "PHOTON_JAX_TEST_XLA_OPT": "default"}) == "--a=1"
    monkeypatch.setattr(helpers, "_accelerator_plugin", lambda: True)
    assert suite_xla_flags({"XLA_FLAGS": "--a=1"}) == "--a=1"
