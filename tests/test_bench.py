"""The benchmark scripts run end to end on a tiny configuration, so they cannot rot.  Nothing
here looks at the numbers: timings are never asserted in tests."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def test_pipeline_bench_smoke():
    rows = run("pipeline.py", "--config", "tiny", "--batch", "2", "--steps", "4", "--reps",
               "1", "--modes", "default", "pinned", "--busy")
    loops = [r for r in rows if r["kind"] == "loops"]
    assert [row["mode"] for row in loops] == ["default", "pinned"]
    for row in loops:
        for key in ("config", "batch", "mode", "steps", "blocking_tok_s", "pipelined_tok_s",
                    "ceiling_tok_s", "host_ms", "forward_ms", "sample_ms",
                    "predicted_blocking_ms", "predicted_pipelined_ms"):
            assert key in row
        assert row["batch"] == 2 and row["steps"] == 4
        assert min(row["blocking_tok_s"], row["pipelined_tok_s"], row["ceiling_tok_s"]) > 0
    busy = [r for r in rows if r["kind"] == "busy"]
    assert len(busy) == 2 and all(0 < r["pipelined_busy"] <= 1 for r in busy)


def test_prefill_bench_smoke():
    rows = run("prefill.py", "--quick", "--reps", "1")
    kinds = {r["kind"] for r in rows}
    assert kinds == {"images", "crops", "mix"}
    assert {r["prefill"] for r in rows if r["kind"] == "mix"} == {"in_pipeline", "drained"}
    assert all(r["images_per_s"] > 0 for r in rows if "images_per_s" in r)


def test_gpu_script_and_knobs_run_on_cpu():
    assert run("gpu_md2.py", "--help") == []   # imports and parses without a GPU
    # The host-work sweep and the zombie counter, at the smallest size.
    rows = run("pipeline.py", "--config", "tiny", "--batch", "2", "--steps", "4", "--reps",
               "1", "--modes", "default", "--host-work", "0", "1", "--zombies")
    work = [r for r in rows if r["kind"] == "host_work"]
    assert [r["host_work_ms"] for r in work] == [0.0, 1.0]
    z = [r for r in rows if r["kind"] == "zombies"]
    assert [r["batch"] for r in z] == [1, 32] and all(r["decode_rows"] > 0 for r in z)


def test_caption_bench_smoke():
    rows = run("caption.py", "--config", "tiny", "--images", "3", "--batch", "1", "2",
               "--max-tokens", "3")
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["images"] == 3 and r["images_per_s"] > 0 and r["tokens_per_s"] > 0
               for r in rows)
