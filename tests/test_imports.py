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
