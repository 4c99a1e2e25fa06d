"""The XLA:CPU flag the package sets at import (`ouroboros_jax/xla_cpu.py`): when it is added,
when it is left alone, and that the programs of this process are compiled without YNNPACK dots
while an opted-out process gets them."""

import os
import subprocess
import sys
from importlib import metadata

import jax
import jax.numpy as jnp
import pytest

from ouroboros_jax import xla_cpu

HAS_FLAG = xla_cpu._version(metadata.version("jaxlib")) >= xla_cpu.FIRST_JAXLIB
PROBE = ("import ouroboros_jax, jax, jax.numpy as jnp\n"
         "f = jax.jit(lambda x, w: x @ w)\n"
         "print('__ynn_fusion' in f.lower(jnp.ones((4, 64)), jnp.ones((64, 128)))"
         ".compile().as_text())\n")


def test_flag_appended_for_new_jaxlibs():
    assert xla_cpu.flags_with_ours("", "0.10.2", {}) == f"{xla_cpu.FLAG}="
    assert (xla_cpu.flags_with_ours("--xla_force_host_platform_device_count=8", "0.9.0", {})
            == f"--xla_force_host_platform_device_count=8 {xla_cpu.FLAG}=")


@pytest.mark.parametrize("flags, version, env", [
    ("", "0.8.3", {}),                                  # XLA aborts on a flag it does not know
    ("", "0.6.2", {}),
    ("", None, {}),                                     # no jaxlib installed
    (f"{xla_cpu.FLAG}=dot", "0.10.2", {}),              # the user's own setting wins
    ("", "0.10.2", {xla_cpu.OPT_OUT: "1"}),             # opted out
])
def test_flag_left_alone(flags, version, env):
    assert xla_cpu.flags_with_ours(flags, version, env) == flags


def test_version_parts():
    assert xla_cpu._version("0.10.2") == (0, 10, 2)
    assert xla_cpu._version("0.9.0.dev20260101") == (0, 9, 0)
    assert xla_cpu._version("0.9.0rc1") == (0, 9)


@pytest.mark.skipif(not HAS_FLAG, reason="this jaxlib has no YNNPACK dots to turn off")
def test_dots_compile_without_ynnpack_unless_opted_out():
    """This process imported ouroboros_jax before its first computation: its dots are XLA's
    own. A process that opts out compiles the same dot into a YNNPACK fusion (so the check
    above is one that can fail)."""
    assert xla_cpu.FLAG in os.environ["XLA_FLAGS"]
    f = jax.jit(lambda x, w: x @ w)
    assert "__ynn_fusion" not in f.lower(jnp.ones((4, 64)), jnp.ones((64, 128))).compile().as_text()
    env = dict(os.environ, XLA_FLAGS="", **{xla_cpu.OPT_OUT: "1"})
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
