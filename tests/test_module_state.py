"""No mutable module-level state in auto/, decoding/ or generate.py: constants and registries only.

config="auto" once kept twelve process globals (a store memo, warnings given, signatures,
compile counts, agreements measured, choices, and the switch's compiled loops) and registered
jax's monitoring listeners at import; tests reset it by monkeypatching those globals. Now an
`auto.AutoTuner` holds that state, and this test keeps it there: it reads each module's syntax
tree and refuses

- a `global` statement anywhere;
- a module-level (or class-level) name bound to a mutable container: a dict, list or set
  display or comprehension, or a call that builds one (`dict()`, `defaultdict`, `deque`,
  `WeakSet`, `threading.Lock()`, ...), or an instance of a class the module defines that is
  not a frozen dataclass;
- a module-level function cached by `functools.lru_cache` / `functools.cache` (a memo is
  process state);
- a call to `jax.monitoring` at module level (a listener registered at import).

Allowed, and why:

- UPPER_CASE constants holding a container that nothing in the module mutates (no item or
  attribute assignment, no `append`/`update`/`setdefault`/..., no augmented assignment):
  tables of numbers such as `prices.CALIBRATION`;
- `REGISTRIES` below: a registry is filled once at import or holds weak references to the
  objects that own the state (the method registry; the compile counters jax's listeners
  dispatch to; the one documented default tuner);
- `PURE_MEMOS` below: caches of pure functions of immutable arguments whose results are
  immutable (a second call returns what the first computed, whatever happened between).
"""

import ast
import gc
import re
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import jax
import pytest

PKG = Path(__file__).resolve().parents[1] / "ouroboros_jax"
SCOPE = sorted((PKG / "auto").glob("*.py")) + sorted((PKG / "decoding").glob("*.py")) + [
    PKG / "generate.py"]

# (module path relative to the package, name): registries, each with why it may be mutable
REGISTRIES = {
    ("decoding/__init__.py", "METHODS"): "the method registry, filled by `register` at import",
    ("auto/compiles.py", "COUNTERS"): "weak references to the live tuners' compile counters, "
                                      "which jax's listeners (registered once) dispatch to",
    ("auto/tuner.py", "DEFAULT"): "the one documented default tuner, made on first use",
}
# (module path, function): memoized pure functions
PURE_MEMOS = {
    ("decoding/spec.py", "_default_grid"): "a method's knob grid at its own values: frozen configs",
    ("decoding/speculative.py", "_rule_runner"): "the loop of a test hook's accept rule: one "
                                                 "jitted function per rule",
    ("decoding/cost.py", "_chain_agreement"): "the one agreement a chain's expected tokens "
                                              "imply: numbers in, a number out",
}
# containers: an UPPER_CASE one that nothing mutates is a constant
CONTAINER_CALLS = {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "deque",
                   "Counter", "ChainMap"}
# objects whose every use changes them: state whatever their name
STATEFUL_CALLS = {"WeakSet", "WeakValueDictionary", "WeakKeyDictionary", "Lock", "RLock",
                  "Condition", "Event", "Semaphore", "BoundedSemaphore", "Queue", "SimpleQueue",
                  "LifoQueue", "count"}
CONSTANT = re.compile(r"_?[A-Z][A-Z0-9_]*")
MUTATING_METHODS = {"append", "extend", "insert", "add", "update", "setdefault", "pop",
                    "popitem", "clear", "remove", "discard", "__setitem__", "appendleft"}
MEMO_DECORATORS = {"lru_cache", "cache"}


def _name(node) -> str:
    """The last name of a call's function or a decorator (`functools.lru_cache(...)` ->
    "lru_cache")."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _stateless_classes(tree) -> set:
    """Classes of this module whose instances hold no mutable state: frozen dataclasses,
    NamedTuples, Enums."""
    out = set()
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        frozen = any(isinstance(d, ast.Call) and _name(d) == "dataclass" and any(
            k.arg == "frozen" and getattr(k.value, "value", False) for k in d.keywords)
            for d in node.decorator_list)
        bases = {_name(b) for b in node.bases}
        if frozen or bases & {"NamedTuple", "Enum", "IntEnum"}:
            out.add(node.name)
    return out


def _builds(value, local_classes: set, stateless: set) -> str:
    """"container" (a display, comprehension or container call), "stateful" (a lock, a weak
    set, an instance of a class of this module that is not frozen, ...) or ""."""
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                          ast.SetComp)):
        return "container"
    if isinstance(value, ast.Call):
        name = _name(value)
        if name in CONTAINER_CALLS:
            return "container"
        if name in STATEFUL_CALLS or (name in local_classes and name not in stateless):
            return "stateful"
    return ""


def _mutated_names(tree) -> set:
    """Names the module mutates anywhere: item or attribute assignment or deletion,
    augmented assignment, or a mutating method call on the name."""
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
        for t in targets:
            if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name):
                out.add(t.value.id)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATING_METHODS and isinstance(node.func.value, ast.Name)):
            out.add(node.func.value.id)
    return out


def violations(source: str, rel: str) -> list[str]:
    """What in one module's source is mutable module-level state (see the module docstring);
    rel: its path relative to the package, which the allowed lists name."""
    tree = ast.parse(source)
    local_classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    stateless = _stateless_classes(tree)
    mutated = _mutated_names(tree)
    out = [f"{rel}:{n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree)
           if isinstance(n, ast.Global)]
    bodies = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
    for body in bodies:
        for node in body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                kind = _builds(node.value, local_classes, stateless)
                if not kind:
                    continue
                for t in targets:
                    name = t.id if isinstance(t, ast.Name) else ast.unparse(t)
                    if (rel, name) in REGISTRIES or name == "__all__":
                        continue
                    if kind == "container" and CONSTANT.fullmatch(name) and name not in mutated:
                        continue  # a constant
                    out.append(f"{rel}:{node.lineno}: {name} = {ast.unparse(node.value)[:40]}")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(_name(d) in MEMO_DECORATORS for d in node.decorator_list) and (
                    (rel, node.name) not in PURE_MEMOS):
                out.append(f"{rel}:{node.lineno}: memoized {node.name}")
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and (
                _dotted(node.value.func).startswith("jax.monitoring.")):
            out.append(f"{rel}:{node.lineno}: {_dotted(node.value.func)} at import")
    return out


def test_auto_decoding_and_generate_keep_no_mutable_module_state():
    found = [v for path in SCOPE
             for v in violations(path.read_text(), str(path.relative_to(PKG)))]
    assert not found, "mutable module-level state:\n" + "\n".join(found)


def test_the_allowed_names_exist():
    """Every allowed registry and memo is still there (a stale entry would allow its name
    back in unnoticed)."""
    for rel, name in list(REGISTRIES) + list(PURE_MEMOS):
        tree = ast.parse((PKG / rel).read_text())
        names = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                 if isinstance(t, ast.Name)}
        names |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, (rel, name)


# What config="auto" looked like with its state in module globals (decoding/auto.py and
# auto_switch.py before the AutoTuner): each line one kind of state the check must refuse.
OLD_STATE = textwrap.dedent("""
    import functools
    import threading
    import jax

    _MEMO: dict = {}
    _WARNED: set = set()
    _COMPILES = [0]
    _LOCK = threading.Lock()
    SEEN = {}


    class Cache:
        pass


    _CACHE = Cache()
    jax.monitoring.register_event_listener(print)


    def remember(k, v):
        global _COMPILES
        SEEN[k] = v
        _MEMO[k] = v
        _WARNED.add(k)
        _COMPILES[0] += 1


    @functools.lru_cache(maxsize=256)
    def _choose_memo(method):
        return method
""")


def test_the_check_refuses_each_kind_of_module_state():
    found = violations(OLD_STATE, "auto/old.py")
    for what in ("_MEMO = {}", "_WARNED = set()", "_COMPILES = [0]", "_LOCK = threading.Lock()",
                 "SEEN = {}", "_CACHE = Cache()", "register_event_listener at import",
                 "global _COMPILES", "memoized _choose_memo"):
        assert any(what in v for v in found), (what, found)
    # and lets constants, frozen values and registries through
    fine = textwrap.dedent("""
        import dataclasses
        TABLE = {"cpu": (1, 2)}
        SIZES = [1, 2]

        @dataclasses.dataclass(frozen=True)
        class Knob:
            field: str

        GAMMA = Knob("gamma")
        METHODS = {}

        def register(name, spec):
            METHODS[name] = spec
    """)
    assert violations(fine, "decoding/__init__.py") == []
    # a registry is one only where REGISTRIES names it
    assert [v.split(": ", 1)[1] for v in violations(fine, "decoding/other.py")] == [
        "METHODS = {}"]


IMPORT_ONLY = """
import sys
import jax.monitoring as m

callers = []
for name in [n for n in dir(m) if n.startswith("register_")]:
    def wrapped(*a, _real=getattr(m, name), _name=name, **k):
        callers.append((sys._getframe(1).f_globals.get("__name__", ""), _name))
        return _real(*a, **k)
    setattr(m, name, wrapped)

import importlib, pkgutil
import ouroboros_jax
for pkg in ("ouroboros_jax.auto", "ouroboros_jax.decoding", "ouroboros_jax.serving"):
    for info in pkgutil.iter_modules(importlib.import_module(pkg).__path__):
        importlib.import_module(f"{pkg}.{info.name}")
import ouroboros_jax.generate, ouroboros_jax.cli
ours = lambda: sorted(n for who, n in callers if who.startswith("ouroboros_jax"))
assert ours() == [], ours()
from ouroboros_jax.auto import AutoTuner
AutoTuner(), AutoTuner()
assert ours() == ["register_event_duration_secs_listener", "register_event_listener"], ours()
print("ok")
"""


def test_importing_registers_no_listener_and_tuners_register_once():
    """Importing every module of the package registers no jax.monitoring listener; the first
    tuner registers jax's two, once for every tuner after it."""
    r = subprocess.run([sys.executable, "-c", IMPORT_ONLY], capture_output=True, text=True,
                       cwd=PKG.parent, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_every_live_tuner_counts_compiles_and_a_dropped_one_is_let_go():
    from ouroboros_jax.auto import AutoTuner

    a, b = AutoTuner(), AutoTuner()
    before = (a.compiles.programs, b.compiles.programs)
    ones = jax.numpy.ones(7)
    jax.jit(lambda x: x * 3.25 + 0.5)(ones).block_until_ready()  # a new program
    assert a.compiles.programs - before[0] == b.compiles.programs - before[1] >= 1
    dropped = weakref.ref(b)
    del b
    gc.collect()
    assert dropped() is None  # the registry holds weak references only
    counted = a.compiles.programs
    jax.jit(lambda x: x * 5.5 - 2.0)(ones).block_until_ready()
    assert a.compiles.programs > counted


if __name__ == "__main__":
    pytest.main([__file__])
