"""How the code base holds together, checked by reading it: the package's layers import
downward only (docs/architecture.md, "The layers"), test files share code through
tests/helpers.py only, and private state has one writer."""

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -- the layers -----------------------------------------------------------------------------

# Every layer of the package, bottom up, and the layers each may import besides its own.
# The faces are the top-level modules; `convert` is the top-level convert/ folder,
# installed as photon_jax.convert; "top" is the package's __init__, "entry" any `__main__`
# (`python -m photon_jax`, `python -m photon_jax.convert`).
LAYERS = {
    "base": set(),
    "kernels": {"base"},
    "model": {"kernels", "base"},
    "convert": {"model", "base"},
    "engine": {"model", "kernels", "base"},
    "faces": {"engine", "model", "kernels", "base", "convert"},
    "serve": {"faces", "base"},
    "dataset": {"faces", "base"},
    "integrations": {"dataset", "faces", "base"},
    "cli": {"serve", "dataset", "faces", "convert", "base"},
    "top": {"faces", "base"},
    "entry": {"top", "cli", "dataset", "serve", "faces", "convert", "base"},
}
FACES = ("api", "aio", "functional", "sources")
FOLDERS = ("base", "kernels", "model", "engine", "serve", "dataset", "integrations", "cli")
MAX_TOP_MODULES = 6   # the faces, and room for few more: anything else belongs in a layer


def module_name(path: str, root: str) -> str:
    """photon_jax/model/text.py -> "photon_jax.model.text"; convert/names.py ->
    "photon_jax.convert.names" (where it is installed); a package's __init__ -> the
    package."""
    rel = os.path.relpath(path, root)[:-3].split(os.sep)
    if rel[0] == "convert":
        rel = ["photon_jax"] + rel
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel)


def layer_of(module: str) -> str | None:
    """The layer a photon_jax module belongs to (None: not ours)."""
    parts = module.split(".")
    if parts[0] != "photon_jax":
        return None
    if parts[-1] == "__main__":
        return "entry"
    if len(parts) == 1:
        return "top"
    if parts[1] in FACES:
        return "faces"
    if parts[1] == "convert":
        return "convert"
    if parts[1] in FOLDERS:
        return parts[1]
    raise AssertionError(f"{module}: in no layer; add its folder to LAYERS")


def imports_of(path: str, module: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every photon_jax module `path` imports: module level or inside a
    function, absolute or relative, `from pkg import name` counted as pkg.name when that is
    a module."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("photon_jax")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("photon_jax"):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((node.lineno, sub if sub in modules else target))
    return out


def layer_violations(root: str) -> list[str]:
    """Every import in the tree at `root` that goes up a layer or sideways (to a layer its
    own may not import), as "path:line: module (layer) -> module (layer)"."""
    paths = sorted(glob.glob(os.path.join(root, "photon_jax", "**", "*.py"), recursive=True)
                   + glob.glob(os.path.join(root, "convert", "*.py")))
    modules = {module_name(p, root) for p in paths}
    found = []
    for p in paths:
        mod = module_name(p, root)
        mine = layer_of(mod)
        for line, target in imports_of(p, mod, modules):
            theirs = layer_of(target)
            if theirs != mine and theirs not in LAYERS[mine]:
                found.append(f"{os.path.relpath(p, root)}:{line}: {mod} ({mine}) -> "
                             f"{target} ({theirs})")
    return found


def test_every_import_goes_down_a_layer():
    found = layer_violations(ROOT)
    assert not found, "imports that go up a layer or sideways:\n" + "\n".join(found)


def import_cycles(root: str) -> list[list[str]]:
    """The groups of modules that import each other in a ring (any import, at module level
    or in a function), by Tarjan's strongly connected components."""
    paths = sorted(glob.glob(os.path.join(root, "photon_jax", "**", "*.py"), recursive=True)
                   + glob.glob(os.path.join(root, "convert", "*.py")))
    modules = {module_name(p, root) for p in paths}
    graph = {module_name(p, root): {t for _, t in imports_of(p, module_name(p, root), modules)
                                    if t in modules} for p in paths}
    index, low, stack, on, rings = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v] - {v}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            ring = []
            while not ring or ring[-1] != v:
                ring.append(stack.pop())
                on.discard(ring[-1])
            if len(ring) > 1:
                rings.append(sorted(ring))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return rings


def test_no_import_cycles():
    assert import_cycles(ROOT) == []


def test_the_layer_check_sees_upward_and_sideways_imports(tmp_path):
    """The checks above are not vacuous: on a copy of the package, an upward import
    (absolute, relative, inside a function), a sideways one (serve -> engine) and a ring of
    two modules are each found, and the copy without them is clean."""
    import shutil

    shutil.copytree(os.path.join(ROOT, "photon_jax"), tmp_path / "photon_jax",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "csrc"))
    shutil.copytree(os.path.join(ROOT, "convert"), tmp_path / "convert",
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert layer_violations(str(tmp_path)) == [] and import_cycles(str(tmp_path)) == []
    (tmp_path / "photon_jax" / "model" / "upward.py").write_text(
        "from ..engine import step\n"
        "def f():\n    import photon_jax.serve.app\n")
    (tmp_path / "photon_jax" / "kernels" / "upward.py").write_text(
        "from photon_jax.model.config import TextConfig\n")
    (tmp_path / "photon_jax" / "serve" / "sideways.py").write_text(
        "from ..engine.core import Engine\nfrom .. import api\n")
    (tmp_path / "photon_jax" / "engine" / "ring_a.py").write_text("from . import ring_b\n")
    (tmp_path / "photon_jax" / "engine" / "ring_b.py").write_text(
        "def f():\n    from .ring_a import x\n")
    assert import_cycles(str(tmp_path)) == [["photon_jax.engine.ring_a",
                                             "photon_jax.engine.ring_b"]]
    got = layer_violations(str(tmp_path))
    assert [g.split(": ", 1)[1] for g in got] == [
        "photon_jax.kernels.upward (kernels) -> photon_jax.model.config (model)",
        "photon_jax.model.upward (model) -> photon_jax.engine.step (engine)",
        "photon_jax.model.upward (model) -> photon_jax.serve.app (serve)",
        "photon_jax.serve.sideways (serve) -> photon_jax.engine.core (engine)"], got


def test_each_layer_is_a_folder_that_says_what_it_owns_and_may_import():
    """Each layer's __init__ opens with a docstring that ends its say with "May import:"
    and the layers of LAYERS, by name (the faces by their modules)."""
    for folder in FOLDERS:
        init = os.path.join(ROOT, "photon_jax", folder, "__init__.py")
        doc = ast.get_docstring(ast.parse(open(init, encoding="utf-8").read())) or ""
        m = re.search(r"May import:(.*)", doc, re.S)
        assert m, f"{folder}/__init__.py: no 'May import:' in its docstring"
        named = set(re.findall(r"`(\w+)`", m.group(1)))
        said = {"faces" if n in FACES else n for n in named}
        assert said == LAYERS[folder], (folder, said, LAYERS[folder])


def test_the_top_level_holds_the_faces_only():
    top = sorted(os.path.basename(p)[:-3]
                 for p in glob.glob(os.path.join(ROOT, "photon_jax", "*.py"))
                 if os.path.basename(p) not in ("__init__.py", "__main__.py"))
    assert top == sorted(FACES) and len(top) <= MAX_TOP_MODULES, top
    folders = sorted(d for d in os.listdir(os.path.join(ROOT, "photon_jax"))
                     if os.path.isfile(os.path.join(ROOT, "photon_jax", d, "__init__.py")))
    assert folders == sorted(FOLDERS), folders


def test_architecture_md_opens_with_the_layers():
    """docs/architecture.md's first section is the layers, one line each, in LAYERS' order."""
    text = open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8").read()
    first = text.split("\n## ")[1]
    assert first.startswith("The layers"), first[:40]
    lines = [ln for ln in first.splitlines() if ln.startswith("| `")]
    named = [re.match(r"\| `(\w+)", ln).group(1) for ln in lines]
    want = [name for name in LAYERS if name not in ("top", "entry")]
    assert named == want, named


# -- tests stand alone ----------------------------------------------------------------------


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
        if path.endswith(os.path.join("photon_jax", "engine", "scheduler.py")):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.Attribute) and node.attr.startswith("deliver_"):
                if not (path.endswith(os.path.join("photon_jax", "engine", "request.py"))
                        and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not found, f"Handle.deliver_* used outside scheduler.Outbox: {found}"
