"""Package structure: what `import ouroboros_jax` pulls in, and no import circle in the bench.

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
