"""Docs that cannot rot: every `docs/algorithm.md section N` cited in the code exists; every
snippet marked runnable in README.md and docs/ runs; every CLI flag and `generate` parameter is
documented; the README's links resolve. (CI also builds the site with `mkdocs build --strict`.)"""

import re
from pathlib import Path

import pytest

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


# --------------------------------------------------------------- docs that cannot rot
# A Python snippet in README.md or docs/ is runnable when the line before its fence is this
# marker; the test below runs every one (on the shipped demo pair, with tiny generations).
RUNNABLE = "<!-- runnable -->"
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


def runnable_snippets(text: str) -> list[tuple[int, str]]:
    """(line number, code) of every fenced ```python block whose fence follows the marker
    line; a marker before anything else is an error (a snippet it meant would go unrun)."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip() != RUNNABLE:
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```python":
            raise AssertionError(f"line {i + 1}: {RUNNABLE} must come right before a ```python "
                                 "fence")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        out.append((i + 3, "\n".join(lines[i + 2:end])))
    return out


def test_runnable_snippet_finder_sees_markers_and_rejects_stray_ones():
    text = f"a\n{RUNNABLE}\n```python\nx = 1\n```\n```python\ny = 2\n```\n"
    assert runnable_snippets(text) == [(4, "x = 1")]  # the unmarked block is not run
    with pytest.raises(AssertionError, match="must come right before"):
        runnable_snippets(f"{RUNNABLE}\n\n```python\nx = 1\n```\n")


SNIPPETS = [(p, n, code) for p in DOC_FILES for n, code in runnable_snippets(p.read_text())]


def test_readme_and_every_guide_with_python_have_runnable_snippets():
    where = {p.relative_to(ROOT).as_posix() for p, _, _ in SNIPPETS}
    assert {"README.md", "docs/getting-started.md", "docs/methods.md", "docs/auto.md"} <= where


def _snippet_id(s):
    return f"{s[0].relative_to(ROOT).as_posix()}:{s[1]}"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[_snippet_id(s) for s in SNIPPETS])
def test_runnable_snippet_runs(snippet, capsys):
    path, line, code = snippet
    # each in a fresh namespace, as a reader pasting it would run it; an assert in a snippet
    # (an exactness claim) fails the test
    exec(compile(code, f"{path.name}:{line}", "exec"), {"__name__": "__snippet__"})


# ------------------------------------------------------- every flag and parameter documented
def _parsers() -> dict:
    """{command: its argparse parser} of the `ouroboros-jax` CLI, `distill` included, taken
    from cli.main as it builds them (parse_args is stopped before it parses anything)."""
    import argparse
    from unittest import mock

    from ouroboros_jax import cli

    class Built(Exception):
        pass

    seen = []

    def stop(self, *a, **k):
        seen.append(self)
        raise Built

    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop):
        for argv in (["generate"], ["distill"]):
            try:
                cli.main(argv)
            except Built:
                pass
    top, distill = seen
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {name: p for name, p in sub.choices.items() if name != "distill"}
    parsers["distill"] = distill
    return parsers


def _flags(parser) -> list[str]:
    import argparse

    return [o for a in parser._actions if a.help != argparse.SUPPRESS
            for o in a.option_strings if o.startswith("--") and o != "--help"]


def _section(text: str, heading: str) -> str:
    """The text of a `## heading` section, up to the next level-2 heading."""
    start = text.index(heading)
    nxt = text.find("\n## ", start + len(heading))
    return text[start:nxt if nxt >= 0 else len(text)]


def test_every_cli_flag_is_documented_in_its_commands_section():
    cli_doc = (ROOT / "docs" / "cli.md").read_text()
    parsers = _parsers()
    assert {"generate", "serve", "demo", "memory", "bench", "tune", "distill"} <= set(parsers)
    missing = []
    for cmd, parser in parsers.items():
        heading = f"## `ouroboros-jax {cmd}`"
        if heading not in cli_doc:
            missing.append(heading)
            continue
        section = _section(cli_doc, heading)
        missing += [f"{cmd} {f}" for f in _flags(parser) if f"`{f}`" not in section]
    assert not missing, f"undocumented in docs/cli.md: {missing}"


def test_every_generate_parameter_is_documented():
    import inspect

    import ouroboros_jax as oj

    params = list(inspect.signature(oj.generate).parameters)
    assert params[:2] == ["target", "prompts"]
    guide = _section((ROOT / "docs" / "getting-started.md").read_text(),
                     "## The parameters of `generate`")
    # each parameter is a row of the table (and appears in the signature line above it)
    missing = [p for p in params if f"| `{p}` |" not in guide]
    assert not missing, f"generate parameters missing from docs/getting-started.md: {missing}"


def test_readme_links_resolve():
    """mkdocs --strict checks the site's links; the README is not part of the site, so its
    relative links (into docs/) are checked here."""
    text = (ROOT / "README.md").read_text()
    links = [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
             if not re.match(r"[a-z]+://", m)]
    assert links, "no relative link found: the pattern no longer matches the README's"
    missing = [m for m in links if not (ROOT / m).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    # no development history: no issue numbers, no dates
    assert not re.search(r"\bissue \d+|\b20\d\d-\d\d-\d\d\b", text, flags=re.I)
