"""The benchmark scripts run end to end on a tiny configuration, so they cannot rot.  Nothing
here looks at the numbers: timings are never asserted in tests."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    """The script in a process of its own (one that sets up JAX itself, or runs children)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def _bench_module(script):
    """bench/<script> imported as a module; its own imports (`common`) from bench/, as when
    it runs as a script (a test run alone has no other test to have put bench/ on the path)."""
    import importlib.util

    if os.path.join(ROOT, "bench") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "bench"))

    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}",
                                                  os.path.join(ROOT, "bench", script))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_here(script, *args):
    """The script's main(args) in this process: a new one would import JAX and trace the
    tiny model's programs again (most of a smoke run's time).  With the CPU allocator's
    settings in the environment already, the script does not restart itself to set them
    (bench/common.py), and any child it starts inherits them."""
    import contextlib
    import io
    from unittest import mock

    mod, out = _bench_module(script), io.StringIO()
    with mock.patch.dict(os.environ, _bench_module("common.py").CPU_ALLOCATOR_ENV), \
            contextlib.redirect_stdout(out):
        code = mod.main(list(args))
    assert not code, out.getvalue()[-3000:]
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


def test_pipeline_bench_smoke():
    """Every part of bench/pipeline.py in one short run: both modes, the loops, the
    host-work sweep, the zombie counter and the profiler's busy fraction."""
    rows = run("pipeline.py", "--config", "tiny", "--batch", "2", "--steps", "4", "--reps",
               "1", "--modes", "default", "pinned", "--busy", "--host-work", "0", "1",
               "--zombies", "--zombie-len", "6", "--zombie-batches", "1", "2", "--aux-batch", "2",
               "--burst", "4")
    loops = [r for r in rows if r["kind"] == "loops"]
    assert [row["mode"] for row in loops] == ["default", "pinned"]
    for row in loops:
        for key in ("config", "batch", "mode", "steps", "blocking_tok_s", "pipelined_tok_s",
                    "ceiling_tok_s", "host_ms", "forward_ms", "sample_ms", "device_ms",
                    "predicted_blocking_ms", "predicted_pipelined_ms"):
            assert key in row
        assert row["batch"] == 2 and row["steps"] == 4
        assert min(row["blocking_tok_s"], row["pipelined_tok_s"], row["ceiling_tok_s"]) > 0
    busy = [r for r in rows if r["kind"] == "busy"]
    assert len(busy) == 2 and all(0 < r[k] <= 1 for r in busy
                                  for k in ("blocking_busy", "pipelined_busy"))
    work = [r for r in rows if r["kind"] == "host_work"]
    assert [r["host_work_ms"] for r in work] == [0.0, 1.0] * 2
    z = [r for r in rows if r["kind"] == "zombies"]
    assert [(r["mode"], r["batch"]) for r in z] == [("default", 1), ("default", 2)]
    assert all(r["decode_rows"] > 0 for r in z)


def test_prefill_bench_smoke():
    rows = run_here("prefill.py", "--smoke", "--reps", "1")
    kinds = {r["kind"] for r in rows}
    assert kinds == {"images", "crops", "mix"}
    assert {r["prefill"] for r in rows if r["kind"] == "mix"} == {"in_pipeline", "drained"}
    for r in rows:
        if r["kind"] == "mix":   # the decoding rows' gaps while images arrive
            assert r["median_gap_ms"] > 0, r
            assert r["max_gap_over_median"] >= r["p99_gap_over_median"] >= 1.0, r
    assert all(r["images_per_s"] > 0 for r in rows if "images_per_s" in r)


def test_gpu_run_smoke_runs_every_step_on_cpu(tmp_path):
    """bench/gpu_run.sh --cpu-smoke: every step of the GPU run at a tiny config, through the
    same wrapper the GPU machine runs, results written step by step."""
    out = tmp_path / "out"
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_run.sh"), "--cpu-smoke",
                        "--out", str(out), "--work", str(tmp_path / "work")], cwd=ROOT,
                       capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    assert [(x["step"], x["status"]) for x in rows] == [
        (s, "ok") for s in ("env", "kernels", "engine", "md2", "caption", "md3", "md2_fp8")]
    assert sorted(os.listdir(out)) == ["01-env.log", "02-kernels.log", "03-engine.log",
                                       "04-md2.log", "05-caption.log", "06-md3.log",
                                       "07-md2_fp8.log", "summary.jsonl"]   # a device returns 8
    res = {x["step"]: x["results"] for x in rows}
    env = res["env"][0]
    assert env["backend"] == "cpu" and env["gpu_rules_emulated"]
    assert set(env["compat"].values()) == {"ok"}
    assert "collected" in res["kernels"][-1]["pytest"]
    assert res["engine"][-1]["all_equal"] and res["engine"][-1]["surfaces"] >= 14
    md2, md3 = res["md2"][-1], res["md3"][-1]
    assert (md2["config"], md2["batch"], md3["config"]) == ("tiny", 2, "tiny_md3")
    for key in ("ceiling_tok_s", "pipelined_tok_s", "blocking_tok_s", "floor_ratio_4.8",
                "bubble_blocking", "bubble_pipelined"):
        assert key in md2
    assert md3["ceiling_tok_s"] > 0 and md3["first_position"] == 760
    assert [c["pass"] for c in res["caption"] if "pass" in c] == ["cold", "warm"]
    # ... then streams while images arrive, sliced and whole (bench/arrivals.py).
    arr = {c["mode"]: c for c in res["caption"] if c.get("summary") == "median"}
    assert set(arr) == {"whole", "sliced"} and arr["whole"]["arrivals_s"] > 0
    assert [c["slices"] > 0 for c in res["caption"] if "rep" in c] == [False, True]
    gpu_rows = [x for x in res["md2_fp8"] if x.get("kind") == "gpu"]
    fp8 = [x for x in gpu_rows if x["kv_dtype"] == "float8_e4m3fn"][-1]
    assert fp8["kv_dtype"] == "float8_e4m3fn" and md2["kv_dtype"] == "float32"
    # ... and last, int8 weights: their bytes against the float32 step's
    w8 = gpu_rows[-1]
    assert w8["weights"] == "linear int8, head int8" and w8["ceiling_tok_s"] > 0
    assert w8["weights_bytes"] < md2["weights_bytes"] / 2
    # The last step then times the MoE schedules (one layer; small on CPU).
    moe_rows = [x for x in res["md2_fp8"] if x.get("kind") == "moe"]
    assert {x["schedule"] for x in moe_rows} >= {"dense", "blocks", "ragged", "chosen"}
    assert all(x["ms"] > 0 and x["max_abs_diff"] < 1e-3 for x in moe_rows), moe_rows
    assert fp8["floor_bytes"] < md2["floor_bytes"]
    # Each step reports its share of the budget as it ends.
    assert len(re.findall(r"^\[\d/7 \w+\] ok in [\d.]+ s \(allotted \d+ s, limit \d+ s\); "
                          r"run \d+:\d\d of \d+:\d\d$", r.stdout, re.M)) == 7


def test_gpu_run_dry_run_prints_the_plan():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_run.py"),
                        "--dry-run"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    assert "budget 480 s" in lines[0]
    assert [ln.split()[1] for ln in lines[1:8]] == ["env", "kernels", "engine", "md2",
                                                   "caption", "md3", "md2_fp8"]
    assert sum(int(ln.split()[2]) for ln in lines[1:8]) <= 480


def test_gpu_compile_script_lowers_every_program_without_the_cuda_plugin():
    """bench/gpu_compile.py builds the same kernel and program arguments for its deviceless
    H200 compile; here they are lowered for CUDA instead (no plugin in CI)."""
    rows = run("gpu_compile.py", "--lower-only", "--models", "tiny", "--batch", "4")
    assert rows and all(r["ok"] and r["lower_only"] for r in rows), rows
    programs = {r["program"] for r in rows if r["what"] == "program"}
    assert programs == {"forward", "forward_s16", "ceiling", "burst4", "prefill_slot",
                        "prefill_slot_images",
                        "image_kv", "write_prefix_pages",
                        "copy_pages",
                        "sample_step(False, False)", "sample_step(False, True)",
                        "sample_step(True, False)", "sample_step(True, True)",
                        "sample_step(True, True)_logprobs", "sample_step_masked",
                        # an image prefix's slices (docs/slicing.md)
                        "vision_embed", "vision_blocks", "prefix_input", "prefix_attention",
                        "prefix_mlp", "prefix_layers", "prefix_kv"}
    kernels = [r for r in rows if r["what"] == "kernel"]
    # Our kernel: every split variant at full Moondream 2 and 3 shapes, every pool dtype.
    assert {(r["model"], r["kv_dtype"], r["splits"]) for r in kernels if r["page_size"] == 64
            } == {(m, kv, s) for m in ("md2", "md3")
                  for kv in ("bfloat16", "float32", "float8_e4m3fn", "int8")
                  for s in (1, 2, 4, 8, 16)}
    assert {r["page_size"] for r in kernels} == {16, 32, 64, 128, 256}


def test_gpu_traffic_script_counts_both_kernels():
    """bench/gpu_traffic.py (bench/README's table): JAX's kernel at 1k of a 2k table has half
    its programs empty and writes 14% of the K/V; ours none empty, and at batch 32 (no
    split) writes its output only, under the 5% target."""
    rows = {(r["kernel"], r["batch"]): r for r in run("gpu_traffic.py")}
    assert set(rows) == {(k, b) for k in ("jax paged_attention", "gpu_attention")
                         for b in (1, 8, 32)}
    for b in (1, 8, 32):
        old, new = rows["jax paged_attention", b], rows["gpu_attention", b]
        assert old["kv_attended"] == new["kv_attended"]
        assert 2 * old["empty"] == old["programs"] and new["empty"] == 0
        assert old["written_over_kv"] > 0.1 > new["written_over_kv"]
    assert rows["gpu_attention", 32]["splits"] == 1
    assert rows["gpu_attention", 32]["written_over_kv"] <= 0.05


def test_pipeline_bench_times_kv_formats_in_turns():
    """Several --kv-dtype: each format's loops, then one "kv_side_by_side" line whose
    ceilings were timed in alternation, with each format's ratio to the first and its
    bytes (an 8-bit pool's step reads fewer)."""
    rows = run("pipeline.py", "--config", "tiny", "--batch", "2", "--steps", "4", "--reps",
               "1", "--modes", "default", "--kv-dtype", "float32", "int8", "--side-reps", "2")
    loops = [r for r in rows if r["kind"] == "loops"]
    assert [r["kv_dtype"] for r in loops] == ["float32", "int8"]
    (side,) = [r for r in rows if r["kind"] == "kv_side_by_side"]
    assert set(side["ceiling_tok_s"]) == {"float32", "int8"} and side["over_first"]["float32"] == 1
    assert all(len(v) == 2 and min(v) > 0 for v in side["runs_tok_s"].values())
    assert side["bytes_accessed"]["int8"] < side["bytes_accessed"]["float32"]


def test_weights_side_by_side_names_formats_by_their_weights():
    """`--weights float32 int8 --kv-dtype int8`: the float32 model's 8-bit pool must not
    name it "int8" (it did, and the two formats' rows collapsed into one).  The timing and
    cost functions are stand-ins: only the naming is under test."""
    from types import SimpleNamespace
    from unittest import mock

    mod = _bench_module("pipeline.py")
    cfg = SimpleNamespace(dtype="float32")
    models = [SimpleNamespace(cfg=cfg, bench_weights=w, bench_kv_dtype="int8", attention="x")
              for w in (None, "int8")]
    with mock.patch.object(mod, "ceiling_run", lambda m, *a, **k: 2.0 if m.bench_weights else 1.0), \
            mock.patch.object(mod, "decode_cost", lambda *a, **k: {"bytes_accessed": 1,
                                                                   "floor_bytes": 1}), \
            mock.patch.object(mod, "start", lambda m: 0):
        side = mod.kv_side_by_side(models, "tiny", 1, 2, "default", 2)
    assert side["kind"] == "weights_side_by_side" and side["kv_dtype"] == "int8"
    assert side["ceiling_tok_s"] == {"float32": 1.0, "int8": 2.0}
    assert side["over_first"] == {"float32": 1.0, "int8": 2.0}


def test_weights_fidelity_bench_smoke():
    """bench/weights.py over two draws of the random weights: a line per draw, then the
    summary of the agreeing steps (all draws, and the worst one)."""
    rows = run_here("weights.py", "--config", "tiny", "--steps", "2", "--formats", "int8",
                    "--seeds", "0", "1")
    assert [r.get("seed") for r in rows[:2]] == [0, 1]
    assert all(r["int8"]["steps"] == 2 and 0 < r["int8"]["max_rel_logit_error"] < 0.05
               for r in rows[:2])
    # The summary counts each draw's agreeing steps from its own line.
    per_seed = [round(r["int8"]["top1_agreement"] * 2) for r in rows[:2]]
    s = rows[-1]["tiny/int8"]
    assert rows[-1]["kind"] == "summary" and rows[-1]["seeds"] == [0, 1]
    assert (s["per_seed"], s["agree"], s["steps"], s["worst"]) == (
        per_seed, sum(per_seed), 4, min(per_seed))


def test_images_bench_smoke():
    """bench/images.py: a line per image count, each against one image.  Three images do
    not fit the fixture's 2048 positions: the bench raises the context (`with_context`)."""
    rows = run_here("images.py", "--config", "tiny", "--images", "1", "3", "--reps", "1",
                    "--answer-tokens", "3")
    assert [(r["kind"], r["images"]) for r in rows] == [("images", 1), ("images", 3)]
    # each image after the first is a 729-position block: the image prefix less its BOS
    assert rows[0]["prompt_tokens"] + 2 * 729 == rows[1]["prompt_tokens"] > 2048
    assert all(r["ttft_s"] > 0 and r["decode_tok_s"] > 0 for r in rows)
    assert rows[0]["ttft_over_one"] == 1.0 and rows[1]["ttft_over_one"] > 0


def test_caption_bench_smoke(tmp_path):
    # The cold passes read the session's compile cache (`--compile-cache`, as
    # bench/gpu_run.py's caption step does); `--processes`' fresh_cache pass still compiles
    # from an empty cache of its own, so it runs for one KV format only (the 8-bit one: its
    # flag reaches the new processes too).  The two runs share images and checkpoint.
    common = ["--config", "tiny", "--images", "3", "--batch", "2", "--max-tokens", "3",
              "--ckpt-dtype", "float32", "--keep", str(tmp_path),
              "--compile-cache", os.environ["JAX_COMPILATION_CACHE_DIR"]]
    rows = run_here("caption.py", *common, "--kv-dtype", "model", "int8")
    assert [(r["kv_dtype"], r["pass"]) for r in rows] == [
        (kv, p) for kv in ("model", "int8") for p in ("cold", "warm")]
    # The 8-bit run is compared with the unquantized one, image by image.
    assert all("same_caption" not in r for r in rows[:2])
    assert all(0.0 <= r["same_caption"] <= 1.0 for r in rows[2:])
    more = run_here("caption.py", *common, "--kv-dtype", "int8", "--processes")
    assert [(r["kv_dtype"], r["pass"]) for r in more] == [
        ("int8", p) for p in ("cold", "warm", "fresh_cache", "warm_cache")]
    assert all(r["first_caption_s"] > 0 and r["load_s"] > 0
               for r in more if r["pass"].endswith("cache"))
    assert all(r["images"] == 3 and r["images_per_s"] > 0 and r["tokens_per_s"] > 0
               for r in rows + more)


def test_prefix_bench_smoke():
    rows = run_here("prefix.py", "--config", "tiny", "--images", "2", "--questions", "2",
                    "--max-tokens", "2", "--batch-size", "4")
    on, off = rows
    assert (on["cache"], off["cache"]) == (True, False)
    assert on["hits"] == 2 and on["misses"] == 2 and off["hits"] == 0 and off["misses"] == 4
    assert off["same_answers"] is True


def test_shapes_bench_smoke():
    (row,) = run_here("shapes.py", "--config", "tiny", "--batch", "4", "--constrained", "0", "2",
                      "--steps", "8", "--reps", "1")
    assert row["kind"] == "shapes" and set(row["step_ms"]) == {"0", "2"}
    assert row["mask_bytes"]["2"] == 4 * 4 * 1024 and row["mask_us"] > 0
    (row,) = run_here("shapes.py", "--config", "tiny", "--batch", "4", "--constrained", "0", "2",
                      "--steps", "8", "--reps", "1", "--logprobs", "3")
    assert row["kind"] == "logprobs" and row["copy_bytes"] == {"0": 0, "2": 4 * 41 * 4}


def test_lora_bench_smoke():
    (row,) = run_here("lora.py", "--config", "tiny", "--batch", "4", "--ranks", "4", "--distinct",
                      "2", "--modes", "gather", "--steps", "2", "--reps", "1", "--slots", "2",
                      "--no-engine")
    assert row["kind"] == "lora" and set(row["tok_s"]) == {"none", "r4/2/gather"}
    # tiny: 2 layers, sum(in + out) = 1024 per layer, rank 4, 4 rows, float32
    assert row["adapter_bytes"] == {"r4/gather": 4 * 4 * 1024 * 2 * 4}
    assert row["load_ms"]["4"] > 0


def test_conversation_bench_smoke():
    rows = run_here("conversation.py", "--config", "tiny", "--turns", "2", "--answer-tokens", "4",
                    "--shared", "2")
    turns = [r for r in rows if r["kind"] == "conversation"]
    assert len(turns) == 4 and all(r["same_answer"] for r in turns)
    cached = [r["cached_tokens"] for r in turns if r["cache"]]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    share = rows[-1]
    assert share["kind"] == "prefix_sharing" and share["peak_pages"]["shared"] > 0


def test_kv_bench_smoke():
    rows = run_here("kv.py", "--config", "tiny", "--batch", "2", "--pages", "64", "--reps", "1",
                    "--position", "100")
    assert {r["formulation"] for r in rows} == {"dense_scan", "paged_gather", "paged_sweep",
                                                "paged_sweep_mul", "paged_kernel"}
    assert all(r["ms"] > 0 and r["bytes_accessed"] > 0 for r in rows)


def test_moe_bench_smoke():
    out = run_here("moe.py", "--reps", "1", "--tokens", "1", "8")
    rows = [r for r in out if r["kind"] == "moe"]
    assert {(r["schedule"], r["tokens"]) for r in rows} == {
        (s, n) for s in ("dense", "gather", "blocks", "ragged", "chosen") for n in (1, 8)}
    assert all(r["max_abs_diff"] < 1e-3 and r["bytes_accessed"] > 0 for r in rows)
    # Full Moondream 3 layer shapes, compiled only: XLA's cost analysis is deterministic, so
    # the bound is checked here -- at 32 decode tokens the chosen schedule reads at
    # most 1.2x the selected experts' weights.
    full = {(r["dtype"], r["schedule"], r["tokens"]): r for r in out if r["kind"] == "moe_full"}
    assert {(d, n) for d, _, n in full} == {(d, n) for d in ("float32", "bfloat16")
                                            for n in (1, 8, 32)}
    for dtype in ("float32", "bfloat16"):
        assert full[(dtype, "chosen", 32)]["bytes_over_selected"] <= 1.2


def test_caption_bench_runs_the_source_tree_it_is_given(tmp_path):
    """`bench/caption.py --source-tree DIR` runs DIR's photon_jax, not the checkout it was
    started from (a child started with `python -c` puts its working directory first on
    sys.path).  A fake tree whose photon-caption only reports where it lives."""
    fake = tmp_path / "tree" / "photon_jax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "caption.py").write_text(
        "import types\n"
        "def build_parser():\n"
        "    return types.SimpleNamespace(parse_intermixed_args=lambda argv: argv)\n"
        "def run(args):\n"
        "    return types.SimpleNamespace(exit_code=0, images_per_s=1.0, tokens_per_s=2.0)\n")
    bench = _bench_module("caption.py")
    work = tmp_path / "work"
    work.mkdir()
    rows = bench._child(["_passes", "ckpt", "imgs", "2", "3", str(work / "o.jsonl"), ""],
                        {"PYTHONPATH": str(tmp_path / "tree")}, str(work))
    assert [r["pass"] for r in rows] == ["cold", "warm"]
    assert {r["photon_jax_dir"] for r in rows} == {str(tmp_path / "tree")}
    assert rows[0]["images_per_s"] == 1.0


def test_decode_cost_counts_what_the_kernels_read():
    """bench/common.decode_cost (the bytes-over-floor figure): XLA's cost analysis counts a
    custom call as reading nothing, so with the CPU kernels -- attention and, at 4 rows in
    float32, every dense layer and the LM head -- the step must still be charged at least
    its floor (the weights it multiplies by, the attended KV, the logits).  Without the
    kernels' own byte counts it would be charged a fraction of its weights."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import common
    from photon_jax.kernels import cpukernel
    from photon_jax.model.config import tiny

    cfg = tiny()
    for attention in ("xla", "cpu-kernel"):
        r = common.decode_cost(cfg, 4, 100, attention=attention)
        assert r["floor_bytes"] <= r["bytes_accessed"] <= 2 * r["floor_bytes"], r
        if attention == "cpu-kernel" and cpukernel.dense_fast():
            assert r["kernel_bytes"] > r["weights_bytes"] / 2, r



def test_tpu_compile_lower_only_lowers_every_serving_program_for_tpu():
    """bench/tpu_compile.py --lower-only (no libtpu): the tiny config's serving programs
    lower to StableHLO for TPU, the decode step with the Pallas TPU kernel in every layer
    and no other program calling it."""
    rows = run("tpu_compile.py", "--lower-only")
    assert rows and all(r["lowered"] for r in rows), [r.get("error") for r in rows]
    progs = {r["program"] for r in rows}
    assert {"forward", "prefill_slot", "write_prefix_pages", "copy_pages", "encode_image",
            "image_kv", "sample_step_masked", "prefill_slot_images"} <= progs
    assert "sample_step(True, True)_logprobs" in progs
    # 4 variants, the widest with logprobs, the masked
    assert sum(p.startswith("sample_step") for p in progs) == 6
    # The tiny config's two layers, at every row bucket, and in a decode burst's scanned
    # step; nothing else calls a TPU kernel.
    assert [r["tpu_kernels"] for r in rows if r["program"] == "forward"] == [2, 2, 2]
    assert [r["tpu_kernels"] for r in rows if r["program"] == "burst4"] == [2]
    assert {r["tpu_kernels"] for r in rows
            if r["program"] not in ("forward", "burst4")} == {0}


# Optimized XLA:TPU HLO of `jax.lax.while_loop(lambda s: s[0] < n, ...)` (n an argument)
# and of `jax.lax.fori_loop(0, 3, ...)`, compiled for a described v6e (trimmed): XLA:TPU
# annotates neither with a known trip count; only the condition tells them apart.
_TPU_WHILE = """
%wide.region_3.4 (wide.arg_tuple.3: (s32[], f32[3], s32[], s32[])) -> pred[] {
  %wide.arg_tuple.3 = (s32[]{:T(128)}, f32[3]{0:T(128)S(1)}, s32[]{:T(128)}, s32[]{:T(128)}) parameter(0)
  %get-tuple-element.19 = s32[]{:T(128)} get-tuple-element(%wide.arg_tuple.3), index=2
  %get-tuple-element.18 = s32[]{:T(128)} get-tuple-element(%wide.arg_tuple.3), index=0
  ROOT %lt.0 = pred[]{:T(512)} compare(%get-tuple-element.18, %get-tuple-element.19), direction=LT
}

ENTRY %main.5 (x.5: f32[3], n.1: s32[]) -> f32[3] {
  %while = (s32[]{:T(128)}, f32[3]{0:T(128)S(1)}, s32[]{:T(128)}, s32[]{:T(128)}) while(%tuple.18), condition=%wide.region_3.4, body=%wide.region_2.3.sunk
}
"""
_TPU_FORI = """
%wide.region_1.3 (wide.arg_tuple.3: (s32[], f32[3], s32[])) -> pred[] {
  %constant.8 = s32[]{:T(128)} constant(3)
  %wide.arg_tuple.3 = (s32[]{:T(128)}, f32[3]{0:T(128)S(1)}, s32[]{:T(128)}) parameter(0)
  %get-tuple-element.10 = s32[]{:T(128)} get-tuple-element(%wide.arg_tuple.3), index=0
  ROOT %lt.0 = pred[]{:T(512)} compare(%get-tuple-element.10, %constant.8), direction=LT
}

ENTRY %main.4 (x.1: f32[3]) -> f32[3] {
  %while = (s32[]{:T(128)}, f32[3]{0:T(128)S(1)}, s32[]{:T(128)}) while(%tuple.13), condition=%wide.region_1.3, body=%wide.region_0.2.sunk
  %cond.1.clone = (f32[3]{0:T(128)}) conditional(%convert_element_type.1, %tuple.3, %tuple.3), branch_computations={%region_0.1, %region_1.2}
}
"""


def test_tpu_compiles_audit_tells_a_data_dependent_loop_from_a_counted_one():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from tpu_compile import audit_counts

    assert audit_counts(_TPU_WHILE) == (0, 1)
    assert audit_counts(_TPU_FORI) == (1, 0)
    # XLA:CPU and XLA:GPU annotate a counted loop themselves.
    assert audit_counts('%w = s32[] while(%t), condition=%c, backend_config='
                        '{"known_trip_count":{"n":"3"}}') == (0, 0)


def test_megablox_grid_reads_each_selected_expert_once_at_decode():
    """bench/tpu_compile.py --moe's count of megablox's weight reads, from the kernel's own
    metadata: one token's 8 experts are 8 visits (one 16-row tile); an image prompt's 746
    tokens visit every expert, some twice (a 128-row tile spans two); over 4 chips a chip
    visits only its own experts."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from tpu_compile import megablox_grid

    one = megablox_grid(1, 64, 8, 1, expert_bytes=10)
    assert one == {"tile_rows": 16, "experts_used": 8, "grid_visits": 8,
                   "grid_weight_bytes": 80}
    prompt = megablox_grid(746, 64, 8, 1, expert_bytes=10)
    assert prompt["experts_used"] == 64 and 64 < prompt["grid_visits"] <= 64 + 47 - 1
    split = megablox_grid(746, 64, 8, 4, expert_bytes=10)
    assert split["experts_used"] == 16 and split["grid_visits"] < prompt["grid_visits"] / 2
