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
    assert (xla_cpu.flags_with_ours("--xla_force_host_platform_device_count=1", "0.9.0", {})
            == f"--xla_force_host_platform_device_count=1 {xla_cpu.FLAG}=")
    assert (xla_cpu.flags_with_ours("--xla_cpu_max_isa=AVX2", "0.10.2", {"JAX_NUM_CPU_DEVICES": "1"})
            == f"--xla_cpu_max_isa=AVX2 {xla_cpu.FLAG}=")


@pytest.mark.parametrize("flags, version, env", [
    ("", "0.8.3", {}),                                  # XLA aborts on a flag it does not know
    ("", "0.6.2", {}),
    ("", None, {}),                                     # no jaxlib installed
    (f"{xla_cpu.FLAG}=dot", "0.10.2", {}),              # the user's own setting wins
    ("", "0.10.2", {xla_cpu.OPT_OUT: "1"}),             # opted out
    # several CPU devices in the process: XLA's default dots (issue 51, docs/exactness.md)
    ("--xla_force_host_platform_device_count=2", "0.10.2", {}),
    ("--xla_force_host_platform_device_count=1 --xla_force_host_platform_device_count=8",
     "0.10.2", {}),
    ("", "0.10.2", {"JAX_NUM_CPU_DEVICES": "4"}),
])
def test_flag_left_alone(flags, version, env):
    assert xla_cpu.flags_with_ours(flags, version, env) == flags


def test_kernel_keeps_ynnpack(monkeypatch):
    """Where the few-row kernel will run, the flag is not added; kernel_expected reads the
    kernel's switch, the device count, the CPU and the compiler."""
    assert xla_cpu.flags_with_ours("", "0.10.2", {}, kernel=True) == ""
    monkeypatch.setattr(xla_cpu, "cpu_has_avx512", lambda *a, **k: True)
    gxx = {"CXX": "sh"}  # a program every machine has, standing for the compiler
    assert xla_cpu.kernel_expected(gxx)
    assert not xla_cpu.kernel_expected({**gxx, xla_cpu.KERNEL_ENV: "0"})
    assert not xla_cpu.kernel_expected({**gxx, "JAX_NUM_CPU_DEVICES": "2"})
    assert not xla_cpu.kernel_expected({"CXX": "no-such-compiler-here"})
    monkeypatch.setattr(xla_cpu, "cpu_has_avx512", lambda *a, **k: False)
    assert not xla_cpu.kernel_expected(gxx)


def test_version_parts():
    assert xla_cpu._version("0.10.2") == (0, 10, 2)
    assert xla_cpu._version("0.9.0.dev20260101") == (0, 9, 0)
    assert xla_cpu._version("0.9.0rc1") == (0, 9)


def test_cpu_device_count():
    count = xla_cpu.cpu_device_count
    assert count("", {}) == 1
    assert count("--xla_force_host_platform_device_count=6", {}) == 6
    assert count("--xla_force_host_platform_device_count=6", {"JAX_NUM_CPU_DEVICES": "2"}) == 6
    assert count("--xla_cpu_max_isa=AVX2", {"JAX_NUM_CPU_DEVICES": "3"}) == 3
    assert count("--xla_force_host_platform_device_count=x", {}) == 1


def _compiles_ynn_dots(xla_flags: str, **env) -> bool:
    """Whether a fresh process that imports ouroboros_jax under these flags compiles a dot into
    a YNNPACK fusion."""
    env = {**{k: v for k, v in os.environ.items() if k != xla_cpu.OPT_OUT},
           "XLA_FLAGS": xla_flags, **env}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "True"


@pytest.mark.skipif(not HAS_FLAG, reason="this jaxlib has no YNNPACK dots to turn off")
def test_dots_compile_without_ynnpack_on_one_device_only():
    """A one-device process compiles XLA's own dots; one with several CPU devices (this test
    process has 8) and an opted-out one keep YNNPACK's, so each check is one that can fail."""
    assert not xla_cpu.flag_in_effect(os.environ["XLA_FLAGS"])
    f = jax.jit(lambda x, w: x @ w)
    assert "__ynn_fusion" in f.lower(jnp.ones((4, 64)), jnp.ones((64, 128))).compile().as_text()
    assert not _compiles_ynn_dots("", **{xla_cpu.KERNEL_ENV: "0"})
    # where our few-row kernel will run, YNNPACK's dots stay on (the kernel takes 2-16 rows)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_cpu.KERNEL_ENV)}
    assert _compiles_ynn_dots("", **{xla_cpu.KERNEL_ENV: "1"}) is xla_cpu.kernel_expected(env)
    assert _compiles_ynn_dots("", **{xla_cpu.OPT_OUT: "1"})
    assert _compiles_ynn_dots("--xla_force_host_platform_device_count=2")


def test_mesh_flag_warning(capsys, monkeypatch):
    """A CPU mesh of several devices under YNNPACK-off flags is named on stderr, once."""
    from jax.sharding import Mesh
    import numpy as np
    from ouroboros_jax import notices

    monkeypatch.setattr(notices, "_said", set())
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    monkeypatch.setenv("XLA_FLAGS", "")
    xla_cpu.check_mesh_flags(mesh)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {xla_cpu.FLAG}=")
    xla_cpu.check_mesh_flags(Mesh(np.array(jax.devices()[:1]), ("data",)))
    assert capsys.readouterr().err == ""
    xla_cpu.check_mesh_flags(mesh)
    xla_cpu.check_mesh_flags(mesh)
    err = capsys.readouterr().err
    assert err.count("mesh of 2 CPU devices") == 1 and "JAX_NUM_CPU_DEVICES" in err
