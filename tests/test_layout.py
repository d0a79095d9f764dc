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


def private_writes(path: str) -> list[str]:
    """Assignments (plain, augmented, annotated, tuple targets, setattr with a literal name)
    to a private attribute (`_x`, not a dunder) of anything but `self` / `cls`."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)

    def targets(node):
        if isinstance(node, ast.Assign):
            return node.targets
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            return [node.target]
        return []

    def flat(t):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from flat(e)
        elif isinstance(t, ast.Starred):
            yield from flat(t.value)
        else:
            yield t

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    def own(obj) -> bool:
        return isinstance(obj, ast.Name) and obj.id in ("self", "cls")

    found = []
    for node in ast.walk(tree):
        for t in (x for tt in targets(node) for x in flat(tt)):
            if isinstance(t, ast.Attribute) and private(t.attr) and not own(t.value):
                found.append(f"{os.path.relpath(path, ROOT)}:{t.lineno}: "
                             f"{ast.unparse(t)} = ...")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "setattr" and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and private(node.args[1].value)
                and not own(node.args[0])):
            found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: setattr(...)")
    return found


def package_files() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "photon_jax", "**", "*.py"), recursive=True)
                  + glob.glob(os.path.join(ROOT, "convert", "*.py")))


def test_no_module_writes_another_objects_private_attributes():
    """A private attribute has one writer, its own class: a request's Handle, for one, is
    written only through its `deliver_*` methods by `scheduler.Outbox`."""
    found = [w for p in package_files() for w in private_writes(p)]
    assert not found, "writes to another object's private attributes:\n" + "\n".join(found)


def test_the_private_write_check_sees_each_form(tmp_path):
    """The check above is not vacuous: each form of the write is found, own writes are not."""
    p = tmp_path / "m.py"
    p.write_text("h._a = 1\nh._b += 1\nx, h._c = 1, 2\nh._d: int = 3\n"
                 "setattr(h, '_e', 4)\nself._ok = 5\ncls._ok = 6\nh.public = 7\n"
                 "h.__dict__ = {}\n")
    got = private_writes(str(p))
    assert [g.split(": ", 1)[1] for g in got] == [
        "h._a = ...", "h._b = ...", "h._c = ...", "h._d = ...", "setattr(...)"]


def test_handles_are_delivered_to_from_the_outbox_only():
    """`Handle.deliver_*` (results, errors, text, reasoning, metrics) is called from
    `scheduler.Outbox` alone: one ordered writer of every request's handle."""
    found = []
    for path in package_files():
        if path.endswith(os.path.join("photon_jax", "scheduler.py")):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.Attribute) and node.attr.startswith("deliver_"):
                if not (path.endswith(os.path.join("photon_jax", "request.py"))
                        and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not found, f"Handle.deliver_* used outside scheduler.Outbox: {found}"
