"""The README's Python snippets run as written against the converted fixture model."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_block(heading: str, tiny_ckpt, tmp_path, monkeypatch, capsys) -> str:
    """Run the first ```python block after `heading` in README.md from a folder laid out as
    a clone after README's first command (out/tiny, tests/) -> what it printed."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(heading + r".*?```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "out").mkdir()
    os.symlink(tiny_ckpt, tmp_path / "out" / "tiny")
    os.symlink(os.path.join(ROOT, "tests"), tmp_path / "tests")
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    return capsys.readouterr().out


def test_readme_python_block_runs(tiny_ckpt, tmp_path, monkeypatch, capsys):
    out = run_block("## Python API", tiny_ckpt, tmp_path, monkeypatch, capsys)
    assert "'caption'" in out and "'reasoning'" in out and "'objects'" in out


def test_readme_functional_block_runs(tiny_ckpt, tmp_path, monkeypatch, capsys, cases):
    """The JAX-functions example jits a user function and prints the reference's ids."""
    out = run_block("## JAX functions", tiny_ckpt, tmp_path, monkeypatch, capsys)
    want = cases["fp32"]["land800x600"]["cases"]["caption_short"]["text"]
    assert want in out
