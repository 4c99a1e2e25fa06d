"""Package structure: what `import ouroboros_jax` pulls in, no import circle, and no module reading
another module's private names.

Subprocesses, so the modules this test session already imported do not hide an import.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ouroboros_jax"
NO_TRAINING = ("import sys; {imports}; "
               "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'optax' "
               "or m.startswith('ouroboros_jax.training')); "
               "assert not bad, bad")


@pytest.mark.parametrize("imports", [
    "import ouroboros_jax",
    "import ouroboros_jax.demo, ouroboros_jax.cli, ouroboros_jax.bench",
    "import ouroboros_jax as oj; oj.demo_prompts()",
])
def test_inference_imports_no_training_code(imports):
    """Generating (and the demo, the bench) needs neither optax nor `ouroboros_jax.training`."""
    r = subprocess.run([sys.executable, "-c", NO_TRAINING.format(imports=imports)],
                       capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr[-2000:]


def test_training_assets_still_importable():
    from ouroboros_jax import demo_assets
    from ouroboros_jax.training import assets

    assert assets.demo_pair is demo_assets.demo_pair and assets.DEMO_DIR == demo_assets.DEMO_DIR


def _bench_imports(path: Path) -> set[str]:
    """Sibling bench modules `path` imports anywhere (top level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "ouroboros_jax.bench."):
            out.add(node.module.split(".")[2])
    return out


def test_bench_has_no_import_circle():
    mods = {p.stem: p for p in (PKG / "bench").glob("*.py") if p.stem != "__init__"}
    graph = {m: _bench_imports(p) & set(mods) for m, p in mods.items()}
    state: dict = {}

    def visit(m, stack):
        state[m] = "open"
        for n in graph[m]:
            assert state.get(n) != "open", f"import circle: {' -> '.join(stack + [m, n])}"
            if n not in state:
                visit(n, stack + [m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])


def _project_imports(path: Path, name: str, modules: set) -> set:
    """Project modules `path` (module `name`) imports anywhere, top level or in functions.
    `from pkg import x` counts as importing pkg.x when that is a module, else pkg itself."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        out.update(t for t in targets if t in modules and t != name)
    return out


def _package_graph() -> dict:
    paths = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return {m: _project_imports(p, m, set(paths)) for m, p in paths.items()}


def test_package_has_no_import_circle():
    """No module reaches itself through imports, counting function-level ones: an import put
    inside a function to dodge a circle hides the circle, it does not remove it."""
    graph = _package_graph()
    state: dict = {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            assert state.get(n) != "open", f"import circle: {' -> '.join(stack + [n])}"
            if n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_method_modules_never_import_auto():
    """Methods describe themselves (cost model, knobs); auto asks the registry, never the
    other way round."""
    graph = _package_graph()
    methods = [m for m in graph if m.startswith("ouroboros_jax.decoding.")
               and (PKG / "decoding" / (m.split(".")[-1] + ".py")).read_text().count("SPEC = ")]
    assert "ouroboros_jax.decoding.speculative" in methods
    for m in methods:
        assert not {n for n in graph[m] if n.startswith(("ouroboros_jax.auto",
                                                        "ouroboros_jax.decoding.auto"))}, m


def test_generate_names_no_method():
    """generate and the serving layer dispatch through the registry alone: they compare
    against no method name."""
    from ouroboros_jax.decoding import METHODS

    for path in [PKG / "generate.py"] + sorted((PKG / "serving").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Compare, ast.Subscript)):
                for c in ast.walk(node):
                    assert not (isinstance(c, ast.Constant) and c.value in METHODS), (
                        f"{path.name} line {node.lineno} names method {c.value!r}")


def test_serving_modules_stay_small_and_read_no_private_attributes():
    """serving/ split by job: no module over 450 lines, no function there (nor in generate.py,
    request.py) over 100, and no `x._name` read of another object's private attribute."""
    serving = sorted((PKG / "serving").glob("*.py"))
    for path in serving + [PKG / "generate.py", PKG / "request.py"]:
        src = path.read_text()
        tree = ast.parse(src)
        if path in serving:
            assert len(src.splitlines()) <= 450, path.name
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 100, f"{path.name}: {node.name}"
            if path in serving and isinstance(node, ast.Attribute) \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                assert isinstance(node.value, ast.Name) and node.value.id == "self", (
                    f"{path.name} line {node.lineno} reads {ast.unparse(node)}")


# ------------------------------------------------------- no private reads across modules
# A leading underscore says "this module's business": another module that imports such a name,
# reads it off a project module, or reaches into another module's objects for one, couples
# itself to what the owner is free to change. Third-party internals are out of this check's
# scope (what a dependency keeps private is its own business, not this package's layout).


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _modules(root: Path) -> dict:
    """{dotted module name: path} of the package at `root`."""
    out = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _own_privates(tree: ast.Module) -> set:
    """Private attribute names the module's own classes define (`self._x = ...`, a `_x` field
    or class attribute, a `_x` method): reading those on any object of the module is its own
    business."""
    own = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for b in ast.walk(cls):
            if isinstance(b, ast.Attribute) and isinstance(b.value, ast.Name) \
                    and b.value.id in ("self", "cls"):
                own.add(b.attr)
            elif isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                own.add(b.name)
            elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                own.add(b.target.id)
            elif isinstance(b, ast.Assign):
                own.update(t.id for t in b.targets if isinstance(t, ast.Name))
    return {n for n in own if _private(n)}


def _bindings(tree: ast.Module, name: str, is_pkg: bool, mods: dict, pkg: str):
    """(local name -> project module it names, local names bound to other libraries,
    [(line, module, private name)] imported from project modules)."""
    project, external, imported = {}, set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(base[:len(base) - (node.level - 1)]
                                + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            ours = base == pkg or base.startswith(pkg + ".")
            for a in node.names:
                local = a.asname or a.name
                if not ours:
                    external.add(local)
                elif f"{base}.{a.name}" in mods:
                    project[local] = f"{base}.{a.name}"
                elif _private(a.name):
                    imported.append((node.lineno, base, a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                if a.name.split(".")[0] == pkg:
                    project[local] = a.name if a.asname else pkg
                else:
                    external.add(local)
    return project, external, imported


def private_reads(root: Path) -> list[str]:
    """Every place in the package at `root` that imports another module's private name, reads
    one off a project module (`executor._HEAD`), or reaches for a private attribute its own
    module's classes do not define (`model._packed` outside the module of `Model`)."""
    mods, pkg, found = _modules(root), root.name, []
    for name, path in sorted(mods.items()):
        tree = ast.parse(path.read_text())
        where = path.relative_to(root.parent)
        project, external, imported = _bindings(tree, name, path.name == "__init__.py",
                                                mods, pkg)
        found += [f"{where}:{line} imports {n} from {base}" for line, base, n in imported]
        own = _own_privates(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain, root_node = [], node.value
            while isinstance(root_node, ast.Attribute):
                chain.insert(0, root_node.attr)
                root_node = root_node.value
            if not isinstance(root_node, ast.Name) or root_node.id in external:
                continue
            if root_node.id in project:
                owner = ".".join([project[root_node.id]] + chain)
                if owner in mods:
                    found.append(f"{where}:{node.lineno} reads {owner}.{node.attr}")
                    continue
            if (chain or root_node.id not in ("self", "cls")) and node.attr not in own:
                found.append(f"{where}:{node.lineno} reaches {ast.unparse(node)}, a private "
                             "attribute its module does not define")
    return found


def test_no_module_reads_another_modules_private_names():
    """Across ouroboros_jax/: no `from x import _name`, no `module._name`, no `obj._attr` of a
    class defined elsewhere. An accessor or a public name with a docstring is the way in."""
    found = private_reads(PKG)
    assert not found, "private names read across modules:\n" + "\n".join(found)


def test_private_read_check_catches_each_kind(tmp_path):
    """The check on a small package: each kind of offence found, at its line; a module's own
    private attributes, `self._x`, and other libraries' internals let through."""
    pkg = tmp_path / "ouroboros_jax"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "sub/__init__.py": "",
        "owner.py": "_LIMIT = 3\n\nclass Model:\n    def __init__(self):\n"
                    "        self._cache = {}\n",
        "imports_it.py": "from .owner import _LIMIT\n",
        "sub/reads_module.py": "from .. import owner\n\nx = owner._LIMIT\n",
        "sub/absolute.py": "import ouroboros_jax.owner as o\n\ny = o._LIMIT\n",
        "writes_object.py": "def keep(model, v):\n    model._cache['k'] = v\n",
        "through_self.py": "class Holder:\n    def get(self):\n"
                           "        return self.model._cache\n",
        "own_class.py": "class Box:\n    def __init__(self):\n        self._items = []\n\n"
                        "def size(box):\n    return len(box._items)\n",
        "library.py": "import numpy as np\nfrom gguf import quants\n\n"
                      "a = np._NoValue\nb = quants._type_traits\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    found = private_reads(pkg)
    assert sorted(f.split(" ")[0] for f in found) == sorted([
        "ouroboros_jax/imports_it.py:1", "ouroboros_jax/sub/reads_module.py:3",
        "ouroboros_jax/sub/absolute.py:3", "ouroboros_jax/through_self.py:3",
        "ouroboros_jax/writes_object.py:2"]), found
    assert any("reads ouroboros_jax.owner._LIMIT" in f for f in found)
    assert any("imports _LIMIT from ouroboros_jax.owner" in f for f in found)
