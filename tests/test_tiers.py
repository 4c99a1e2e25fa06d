"""The fast tier's lists (tests/conftest.py SLOW_MODULES and SLOW_TESTS) name real modules and
test functions: a renamed module or test would otherwise leave its list silently and run in the
fast tier."""

import os
import re

from conftest import FIRST, SLOW_MODULES, SLOW_TESTS

HERE = os.path.dirname(os.path.abspath(__file__))


def test_every_listed_module_exists():
    missing = sorted(name for name in SLOW_MODULES | set(FIRST)
                     if not os.path.isfile(os.path.join(HERE, name)))
    assert not missing, f"tests/conftest.py lists modules that do not exist: {missing}"


def test_every_listed_test_exists():
    missing = []
    for entry in sorted(SLOW_TESTS):
        module, func = entry.split("::")
        path = os.path.join(HERE, module)
        text = open(path).read() if os.path.isfile(path) else ""
        if not re.search(rf"^def {re.escape(func)}\(", text, re.M):
            missing.append(entry)
    assert not missing, f"tests/conftest.py SLOW_TESTS names tests that do not exist: {missing}"


def test_the_fast_tier_keeps_a_greedy_exactness_test_per_method():
    """Each method module keeps at least one test that compares greedy tokens with vanilla's (or
    transformers') outside the slow tier."""
    for module in ("test_vanilla.py", "test_speculative.py", "test_lookahead.py",
                   "test_prompt_lookup.py", "test_ouroboros.py", "test_engine.py"):
        text = open(os.path.join(HERE, module)).read()
        greedy = re.findall(r"^def (test_greedy\w*)\(", text, re.M)
        kept = [f for f in greedy if f"{module}::{f}" not in SLOW_TESTS]
        assert kept, f"{module}: every greedy test is in SLOW_TESTS"
