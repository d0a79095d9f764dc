"""The README's Python snippet runs as written against the converted fixture model."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_python_block_runs(tiny_ckpt, tmp_path, monkeypatch, capsys):
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(r"## Python API.*?```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "out").mkdir()
    os.symlink(tiny_ckpt, tmp_path / "out" / "tiny")
    os.symlink(os.path.join(ROOT, "tests"), tmp_path / "tests")
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "'caption'" in out and "'reasoning'" in out and "'objects'" in out


def test_readme_functional_block_runs(tiny_ckpt, tmp_path, monkeypatch, capsys, cases):
    """The JAX-functions example jits a user function and prints the reference's ids."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(r"## JAX functions.*?```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "out").mkdir()
    os.symlink(tiny_ckpt, tmp_path / "out" / "tiny")
    os.symlink(os.path.join(ROOT, "tests"), tmp_path / "tests")
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    want = cases["fp32"]["land800x600"]["cases"]["caption_short"]["text"]
    assert want in out
