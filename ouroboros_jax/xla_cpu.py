"""The XLA:CPU flag the library sets before JAX starts its CPU backend, and why.

From jaxlib 0.9 on, XLA:CPU hands dots to YNNPACK (`--xla_cpu_experimental_ynn_fusion_type`).
Its kernel is as fast as XLA's own for one row and much slower for a few: measured here
(jaxlib 0.10.2, 2 AVX-512 cores, fp32 x[T, 8192] @ w[8192, 16384], `python bench/...` in the
note of this change), T = 1/2/4/8/16 took 21/47/57/71/102 ms with YNNPACK and 21/30/37/53/63 ms
without it. Speculative decoding lives on those few rows: a round's verification forward has
T = gamma + 1 tokens (a tree of 5-30), so with YNNPACK a 5-token target forward cost ~2.7x a
1-token one, where llama.cpp's costs ~1.4x on the same CPU, and speculation hardly paid.

`apply()` appends the flag with an empty value (no YNNPACK fusions) to `XLA_FLAGS` when:
- jaxlib is 0.9 or later (older jaxlibs do not know the flag, and XLA aborts on an unknown one);
- the user's `XLA_FLAGS` does not set it already (theirs wins);
- `OUROBOROS_JAX_KEEP_XLA_FLAGS` is not set to a non-empty value (the opt-out);
- the process has one CPU device: neither `--xla_force_host_platform_device_count` in
  `XLA_FLAGS` nor `JAX_NUM_CPU_DEVICES` asks for more (issue 51, docs/exactness.md). With
  several CPU devices in one process and XLA's own dots (multi-threaded Eigen/oneDNN), the
  speculative methods returned tokens vanilla does not (demo pair, a 2 x 1 mesh with two rows
  per device, first wrong token at 17-30; an AMD EPYC with AVX2); YNNPACK's dots (XLA's
  default) or single-threaded Eigen gave vanilla's tokens there. A multi-device CPU process is
  a test or development mesh, so it keeps XLA's default and pays YNNPACK's few-row cost;
- our few-row kernel will not run the few-row products (`kernel_expected`, stop 65): where it
  will (one device, AVX-512, a C++ compiler), the 2-16 row products YNNPACK slowed are the
  kernel's, and YNNPACK's dots stay on for the rest, whose many rows they run faster (a
  200-token prefill of the real 1.5B target 1.74 s against 2.31 s).
It must run before JAX creates its CPU client, so the package calls it first thing; a process
that ran JAX computations before importing ouroboros_jax keeps the flags it started with (and
`check_mesh_flags` warns where a multi-device CPU mesh then runs with the flag on). On GPU and
TPU the flag changes nothing (it only affects the CPU backend).
"""

from __future__ import annotations

import os
from importlib import metadata
from typing import Mapping, Optional

FLAG = "--xla_cpu_experimental_ynn_fusion_type"
OPT_OUT = "OUROBOROS_JAX_KEEP_XLA_FLAGS"
FIRST_JAXLIB = (0, 9)  # the first jaxlib whose XLA has the flag (checked in the wheels' binaries)
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
DEVICE_COUNT_ENV = "JAX_NUM_CPU_DEVICES"  # jax's `jax_num_cpu_devices`, read from the environment
KERNEL_ENV = "OUROBOROS_JAX_FEW_ROWS"  # "0" turns the few-row kernel off (models/few_rows.py)


def _version(text: str) -> tuple[int, ...]:
    """'0.10.2' -> (0, 10, 2); stops at the first part that is not a number ('0.9.0.dev1')."""
    out = []
    for part in text.split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def flags_with_ours(xla_flags: str, jaxlib_version: Optional[str],
                    env: Mapping[str, str], kernel: bool = False) -> str:
    """The XLA_FLAGS value to run under: xla_flags with the flag appended, or unchanged when the
    jaxlib is older (or not installed: None), the user set the flag, or opted out, or the
    few-row kernel will run the few-row products (kernel: `kernel_expected`)."""
    if env.get(OPT_OUT) or jaxlib_version is None or kernel:
        return xla_flags
    if _version(jaxlib_version) < FIRST_JAXLIB or FLAG in xla_flags:
        return xla_flags
    if cpu_device_count(xla_flags, env) > 1:
        return xla_flags
    return f"{xla_flags} {FLAG}=".strip()


def cpu_device_count(xla_flags: str, env: Mapping[str, str]) -> int:
    """The CPU devices a process started with these flags and environment will have: the last
    `--xla_force_host_platform_device_count=N` in xla_flags, else `JAX_NUM_CPU_DEVICES`, else 1
    (a value that is not a number counts as 1: XLA or JAX refuses it itself)."""
    count = None
    for part in xla_flags.split():
        name, _, value = part.partition("=")
        if name == DEVICE_COUNT_FLAG:
            count = value
    if count is None:
        count = env.get(DEVICE_COUNT_ENV)
    try:
        return max(1, int(count)) if count is not None else 1
    except ValueError:
        return 1


def flag_in_effect(xla_flags: str) -> bool:
    """Whether xla_flags turn YNNPACK's dots off (our flag, or the user's, with an empty value)."""
    return any(part == f"{FLAG}=" for part in xla_flags.split())


def check_mesh_flags(mesh) -> None:
    """Warns once where a mesh of several CPU devices runs with YNNPACK's dots off: `apply()`
    leaves them on in such a process, so this happens only where the device count was set after
    `import ouroboros_jax` (`jax.config.update("jax_num_cpu_devices", n)`) or the user turned
    them off. That combination gave wrong tokens on one CPU (module docstring)."""
    devices = getattr(mesh, "devices", None)
    if devices is None or devices.size < 2 or devices.flat[0].platform != "cpu":
        return
    if not flag_in_effect(os.environ.get("XLA_FLAGS", "")):
        return
    from .notices import say_once

    say_once("xla_cpu_mesh", f"a mesh of {devices.size} CPU devices runs with {FLAG}= (YNNPACK "
             "dots off), which gave tokens vanilla does not give on some CPUs (docs/exactness.md); "
             f"set the device count in XLA_FLAGS ({DEVICE_COUNT_FLAG}=N) or {DEVICE_COUNT_ENV} "
             "before importing ouroboros_jax, so that it keeps XLA's default dots")


def cpu_has_avx512(cpuinfo: str = "/proc/cpuinfo", flag: str = "avx512f") -> bool:
    """Whether the CPU reports AVX-512 Foundation, or another of its flags (Linux's cpuinfo
    flags; False elsewhere)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return flag in line.split()
    except OSError:
        pass
    return False


def kernel_expected(env: Mapping[str, str]) -> bool:
    """Whether this process will run our few-row kernel (`models/few_rows.py`; judged before
    JAX starts, so from what its `enabled()` will find: one CPU device, AVX-512, a C++
    compiler, not turned off). Where it runs, the products of 2-16 rows that YNNPACK slowed
    are the kernel's, and YNNPACK's dots stay on for the rest: a prefill's many rows ran
    faster with them (real 1.5B target, 200 prompt tokens: 1.74 s against 2.31 s with the flag;
    32 rows 385 against 438 ms; one row 143 against 141 ms; AMD Zen 5)."""
    import shutil

    if env.get(KERNEL_ENV, "1") == "0" or cpu_device_count(env.get("XLA_FLAGS", ""), env) > 1:
        return False
    return cpu_has_avx512() and shutil.which(env.get("CXX", "g++")) is not None


def apply() -> None:
    """Sets os.environ["XLA_FLAGS"] as `flags_with_ours` says (before JAX's CPU client exists)."""
    try:
        version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        version = None
    flags = os.environ.get("XLA_FLAGS", "")
    new = flags_with_ours(flags, version, os.environ, kernel_expected(os.environ))
    if new != flags:
        os.environ["XLA_FLAGS"] = new
