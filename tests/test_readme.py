"""The README's Python snippets run as written against the converted fixture model, and every
keyword argument and command-line flag it shows exists."""

import glob
import inspect
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


def readme() -> str:
    return open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


# The user-facing pages whose keywords and flags are checked with the README's.
DOCS = ("docs/memory.md", "docs/platforms.md", "docs/serving.md", "docs/fidelity.md")


def documented() -> str:
    return readme() + "".join(open(os.path.join(ROOT, p), encoding="utf-8").read()
                              for p in DOCS)


def test_readmes_stay_short():
    """Issue 28: the README is an entry point (design lives in docs/), bench/README the
    current results (history lives in git)."""
    for path, most in (("README.md", 300), ("bench/README.md", 180)):
        n = len(open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines())
        assert n <= most, f"{path} has {n} lines; at most {most}"


def test_every_moondream_load_keyword_in_the_readme_exists():
    from photon_jax import Moondream

    text = documented()
    shown = set()
    for m in re.finditer(r"Moondream\.load\(", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        shown |= set(re.findall(r"(\w+)=", text[m.end():i]))
    assert {"revision", "dtype", "warmup", "attention"} <= shown   # the scan finds them
    params = set(inspect.signature(Moondream.load).parameters)
    assert shown <= params, f"README shows Moondream.load keywords that do not exist: " \
                            f"{sorted(shown - params)}"


def test_every_command_line_flag_in_the_readme_exists():
    from photon_jax.cli import caption, convert, serve

    ours = set()
    for parser in (caption.build_parser(), serve.build_parser(), convert.build_parser()):
        ours |= {o for a in parser._actions for o in a.option_strings}
    bench = "".join(open(f).read() for f in glob.glob(os.path.join(ROOT, "bench", "*.py")))
    other = {"--no-deps", "--local-dir", "--help"}   # pip's and hf's
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", documented()))
    missing = {f for f in flags - ours - other if f'"{f}"' not in bench}
    assert not missing, f"README shows flags no command has: {sorted(missing)}"
