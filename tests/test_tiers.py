"""The fast tier's list of slow modules (tests/conftest.py SLOW_MODULES) names real files: a
renamed module would otherwise leave the list silently and run in the fast tier."""

import os

from conftest import FIRST, SLOW_MODULES

HERE = os.path.dirname(os.path.abspath(__file__))


def test_every_listed_module_exists():
    missing = sorted(name for name in SLOW_MODULES | set(FIRST)
                     if not os.path.isfile(os.path.join(HERE, name)))
    assert not missing, f"tests/conftest.py lists modules that do not exist: {missing}"
