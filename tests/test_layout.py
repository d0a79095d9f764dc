"""How the code base holds together, checked by reading it: test files share code through
tests/helpers.py only."""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imported_modules(path: str) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_tests_share_code_through_helpers_only():
    """A test file that imports another (or conftest) couples the two and runs the other's
    module code; what tests share lives in tests/helpers.py."""
    bad = {}
    for path in glob.glob(os.path.join(ROOT, "tests", "*.py")):
        mods = {m for m in imported_modules(path) if m.startswith("test_") or m == "conftest"}
        if mods:
            bad[os.path.basename(path)] = sorted(mods)
    assert not bad, f"test files importing other test modules: {bad}"
