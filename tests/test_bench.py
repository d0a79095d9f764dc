"""The benchmark scripts run end to end on a tiny configuration, so they cannot rot.  Nothing
here looks at the numbers: timings are never asserted in tests."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pipeline_bench_smoke():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "pipeline.py"), "--config", "tiny",
           "--batch", "2", "--steps", "4", "--reps", "1", "--modes", "default", "pinned"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["mode"] for row in rows] == ["default", "pinned"]
    for row in rows:
        for key in ("config", "batch", "mode", "steps", "blocking_tok_s", "pipelined_tok_s",
                    "ceiling_tok_s", "host_ms", "forward_ms", "sample_ms"):
            assert key in row
        assert row["batch"] == 2 and row["steps"] == 4
        assert min(row["blocking_tok_s"], row["pipelined_tok_s"], row["ceiling_tok_s"]) > 0
