"""Every `docs/algorithm.md section N` cited in the code names a section that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITE = re.compile(r"docs/algorithm\.md,? sections? ([0-9.]+)(?: and ([0-9.]+))?")


def test_algorithm_citations_resolve():
    doc = (ROOT / "docs" / "algorithm.md").read_text()
    sections = {s.rstrip(".") for s in re.findall(r"^#{2,3} ([0-9.]+) ", doc, flags=re.M)}
    cited = []
    for path in [*ROOT.glob("ouroboros_jax/**/*.py"), *ROOT.glob("ouroboros_jax/**/*.md"),
                 *ROOT.glob("tests/*.py"), ROOT / "README.md"]:
        for m in CITE.finditer(path.read_text()):
            cited += [(path.name, n.rstrip(".")) for n in m.groups() if n]
    assert cited, "no citation found: the pattern no longer matches the code's"
    missing = [(f, n) for f, n in cited if n not in sections]
    assert not missing, f"cited sections missing from docs/algorithm.md: {missing}"
