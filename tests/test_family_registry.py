"""Model families live one per file in `ouroboros_jax/models/families/` (issue 54): every file
there is registered, a file added there registers itself, nothing outside the package
branches on a family's name, and a family's identifying names (its model_type, transformers
class, GGUF architecture, fused tensors) are written in its own file only.

The behaviour of each family (logits, greedy tokens, GGUF files against transformers) is
tested in tests/test_families.py, test_gemma.py, test_gguf.py and test_hub_configs.py; here,
the layout that lets a family be added by adding one file."""

import ast
import os
import sys

import pytest

from ouroboros_jax.models import families
from ouroboros_jax.models.config import ModelConfig
from ouroboros_jax.models.families import BY_GGUF_ARCH, BY_MODEL_TYPE, Family

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(families.__file__)))
PACKAGE = os.path.dirname(PACKAGE)  # ouroboros_jax/
FAMILY_DIR = os.path.dirname(os.path.abspath(families.__file__))
# every model_type the loaders accepted before the families moved here (issue 54)
KNOWN = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "qwen3_moe",
         "mixtral", "olmoe")


def _sources(skip_families=True):
    """(path relative to the package's parent, parsed module) of every module of the package,
    models/families/ left out unless asked."""
    for root, _, names in os.walk(PACKAGE):
        if skip_families and os.path.abspath(root).startswith(FAMILY_DIR):
            continue
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    yield os.path.relpath(path, os.path.dirname(PACKAGE)), ast.parse(f.read())


def _docstrings(tree) -> set:
    """ids of the docstring nodes of a module (they may name families freely)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


# the GGUF tokenizer's tables (models/gguf_tokenizer.py), allowed to name families: GGUF
# architecture -> the transformers model type whose tokenizer class AutoTokenizer picks, and ->
# its files' SentencePiece spelling (transformers keys both by architecture: a file does not
# say); llama.cpp's own tokenizer names, which share families' names ("llama" is its
# SentencePiece kind for every model, "qwen2" a tokenizer.ggml.pre split regex); and the
# tokenizer class transformers maps each of those model types to (keyed by the model type)
TOKENIZER_TABLES = ("TOKENIZER_MODEL_TYPES", "SENTENCEPIECE_VARIANTS", "TOKENIZER_KINDS",
                    "PRE_TOKENIZER_SPLITS", "TOKENIZER_CLASSES")


def _tokenizer_table(tree) -> list:
    """The values of the `TOKENIZER_TABLES` wherever they are assigned (the tokenizer's
    business, not the loaders')."""
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id in TOKENIZER_TABLES for t in node.targets)]


def _family_names() -> set:
    return set(BY_MODEL_TYPE) | set(BY_GGUF_ARCH)


def _branches(tree) -> list:
    """Line numbers of the family branches in a module: a comparison with a family's name (or
    a tuple of them), an ==/!= on something called model_type or arch, a dict literal keyed by
    family names. The tokenizer's tables (`TOKENIZER_TABLES`, outside the loaders' job) are the
    one exception."""
    names = _family_names()

    def is_family(node):
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_family(e) for e in node.elts)
        if isinstance(node, ast.BinOp):
            return is_family(node.left) or is_family(node.right)
        return False

    def is_family_key(node):
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        return name in ("model_type", "arch")

    exempt = {id(node) for node in _tokenizer_table(tree)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            eq = any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)
            if any(is_family(s) for s in sides) or (eq and any(is_family_key(s) for s in sides)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and id(node) not in exempt:
            if any(k is not None and is_family(k) for k in node.keys):
                lines.append(node.lineno)
    return lines


def test_every_family_module_is_registered():
    files = sorted(n[:-3] for n in os.listdir(FAMILY_DIR)
                   if n.endswith(".py") and n not in ("__init__.py", "base.py"))
    assert [m.__name__.rsplit(".", 1)[1] for m in families.MODULES] == files
    for module in families.MODULES:
        assert module.FAMILIES and all(isinstance(f, Family) for f in module.FAMILIES)
    registered = {f.model_type for m in families.MODULES for f in m.FAMILIES}
    assert registered == set(BY_MODEL_TYPE) == set(families.SUPPORTED_MODEL_TYPES)
    assert set(KNOWN) <= registered  # none of the families the loaders took was lost
    assert set(families.GGUF_ARCHITECTURES) == {"llama", "qwen2", "qwen3", "phi3", "gemma2",
                                                "gemma3", "qwen3moe", "olmoe"}
    for arch, family in BY_GGUF_ARCH.items():
        assert family.gguf_arch == arch and BY_MODEL_TYPE[family.model_type] is family


def test_a_file_added_to_the_package_registers_itself(tmp_path, monkeypatch):
    """What adding a family is: one file in models/families/ exporting FAMILIES. Here a toy
    file in a directory added to the package's search path is found and indexed, and a file
    that registers nothing is refused by name instead of being skipped."""
    (tmp_path / "toyfam.py").write_text(
        "from ouroboros_jax.models.families.base import Family\n"
        "FAMILIES = (Family(model_type='toyfam', hf_class='ToyForCausalLM',"
        " gguf_arch='toy', features={'qkv_bias': True}),)\n")
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    try:
        modules = families.discover_modules()
        assert "ouroboros_jax.models.families.toyfam" in [m.__name__ for m in modules]
        assert families.index_by(modules, "model_type")["toyfam"].hf_class == "ToyForCausalLM"
        assert families.index_by(modules, "gguf_arch")["toy"].model_type == "toyfam"
        (tmp_path / "broken.py").write_text("X = 1\n")
        with pytest.raises(ImportError, match=r"families\.broken: a family module must "
                                              "export FAMILIES"):
            families.discover_modules()
        (tmp_path / "broken.py").write_text(
            "from ouroboros_jax.models.families.base import Family\n"
            "FAMILIES = (Family(model_type='qwen2', hf_class='Again'),)\n")
        sys.modules.pop("ouroboros_jax.models.families.broken", None)
        with pytest.raises(ImportError, match="model_type 'qwen2' is registered twice"):
            families.index_by(families.discover_modules(), "model_type")
    finally:
        for name in ("toyfam", "broken"):
            sys.modules.pop(f"ouroboros_jax.models.families.{name}", None)


def test_no_family_branches_outside_the_families_package():
    found = {path: lines for path, tree in _sources() if (lines := _branches(tree))}
    assert not found, f"family branches outside models/families/ (path: lines): {found}"


def test_the_branch_finder_finds_branches():
    """The check above would see the branches the families replaced."""
    tree = ast.parse("if arch == 'phi3': pass\n"
                     "x = model_type in ('qwen2', 'qwen3')\n"
                     "y = config.model_type != other\n"
                     "z = arch not in ('phi3',) + GEMMA\n"
                     "FUSED = {'phi3': {}}\n"
                     "ok = model_type in SUPPORTED\n")
    assert _branches(tree) == [1, 2, 3, 4, 5]


def _constants(tree) -> set:
    """The string constants of a module, its docstrings and tokenizer table left out."""
    skip = _docstrings(tree) | {id(n) for t in _tokenizer_table(tree) for n in ast.walk(t)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in skip}


# a family's name written outside its file, and why that is not a family branch
ALLOWED = {("ouroboros_jax/models/config.py", "llama")}  # ModelConfig's default model_type


@pytest.mark.parametrize("model_type", sorted(BY_MODEL_TYPE))
def test_a_family_file_alone_defines_its_names(model_type):
    """The names by which config.json, transformers and GGUF files know the family, and its
    fused tensor names, appear (outside docstrings) in no other module of the package (a
    fused tensor named as a plain one, Phi-3's GGUF ffn_up, is the plain one's elsewhere)."""
    from ouroboros_jax.models.gguf import GGUF_NAMES
    from ouroboros_jax.models.params import LEAVES

    family = BY_MODEL_TYPE[model_type]
    own = next(m for m in families.MODULES if family in m.FAMILIES)
    names = {family.model_type, family.hf_class, *family.hf_fused, *family.gguf_fused}
    names |= {family.gguf_arch} if family.gguf_arch else set()
    with open(own.__file__) as f:
        assert names <= _constants(ast.parse(f.read()))  # its own file does write them
    names -= set(GGUF_NAMES.values()) | {leaf.hf for leaf in LEAVES}
    elsewhere = [(path, n) for path, tree in _sources(skip_families=False)
                 if os.path.abspath(os.path.join(os.path.dirname(PACKAGE), path))
                 != os.path.abspath(own.__file__)
                 for n in sorted(names & _constants(tree)) if (path, n) not in ALLOWED]
    assert not elsewhere


@pytest.mark.parametrize("model_type", sorted(BY_MODEL_TYPE))
def test_every_family_translates_both_ways(model_type):
    """Each family's presets (or, with none, a small config of it) survive config.json and
    back: its `to_hf` writes what its `from_hf` reads."""
    family = BY_MODEL_TYPE[model_type]
    from ouroboros_jax.models.presets import PRESETS

    configs = [PRESETS[n] for n in family.presets]
    if not configs:
        configs = [ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                               num_layers=2, num_heads=4, num_kv_heads=2,
                               model_type=model_type, **family.features)]
    for c in configs:
        d = c.to_hf_dict()
        assert d["model_type"] == model_type and d["architectures"] == [family.hf_class]
        assert ModelConfig.from_hf_dict(d) == c
