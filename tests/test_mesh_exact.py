"""Every method on a mesh gives single-device vanilla's greedy tokens (issue 51).

The demo pair, four of its held-out code prompts, 48 new tokens, fp32, greedy. The reference is
vanilla decoding in a fresh process with one CPU device, so it runs with the flags a user's
one-device process gets (`xla_cpu.apply`: YNNPACK dots off); the meshes run here, in this
8-device process (XLA's default dots, as `apply` leaves a multi-device process). Meshes:
2 x 1 with two rows per device (the shape that returned wrong tokens when a multi-device process
ran with YNNPACK's dots off and multi-threaded XLA dots), 1 x 2 (tensor parallel) and 2 x 2.
Across two processes, tests/test_multihost.py runs every method the same way.
"""

import json
import os
import subprocess
import sys

import pytest

import ouroboros_jax as oj
from conftest import TEST_XLA_FLAGS
from ouroboros_jax.sharding import make_mesh

N_NEW = 48
N_PROMPTS = 4
MESHES = [(2, 1), (1, 2), (2, 2)]
CONFIGS = {"vanilla": None,
           "speculative": oj.SpeculativeConfig(gamma=4),
           "ouroboros": oj.OuroborosConfig(gamma=4),
           "lookahead": oj.LookaheadConfig(),
           "prompt_lookup": oj.PromptLookupConfig()}
NEEDS_DRAFT = ("speculative", "ouroboros")

REFERENCE = f"""
import json, ouroboros_jax as oj
target, _ = oj.demo_pair()
prompts = [p["text"] for p in oj.demo_prompts()][:{N_PROMPTS}]
out = oj.generate(target, prompts, method="vanilla", config=None, max_new_tokens={N_NEW})
print(json.dumps({{"tokens": [list(map(int, t)) for t in out.tokens]}}))
"""


def _one_device_env() -> dict:
    """This suite's compile settings with one CPU device, and the library's own flag logic."""
    flags = " ".join(f"--{k}={v}" for k, v in TEST_XLA_FLAGS.items()
                     if k != "xla_force_host_platform_device_count")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OUROBOROS_JAX_KEEP_XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    return dict(env, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def reference():
    """Single-device vanilla tokens, from a one-device process."""
    out = subprocess.run([sys.executable, "-c", REFERENCE], env=_one_device_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens"]


@pytest.fixture(scope="module")
def demo():
    target, draft = oj.demo_pair()
    prompts = [p["text"] for p in oj.demo_prompts()][:N_PROMPTS]
    return target, draft, prompts


def test_reference_is_this_process_vanilla(reference, demo):
    """The one-device process runs vanilla with the library's flag (no YNNPACK dots); this
    process does not. Their tokens agree, so the mesh comparisons below compare methods, not
    dot kernels."""
    target, _, prompts = demo
    out = oj.generate(target, prompts, method="vanilla", config=None, max_new_tokens=N_NEW)
    assert len(reference) == N_PROMPTS and all(len(t) == N_NEW for t in reference)
    assert [list(map(int, t)) for t in out.tokens] == reference


@pytest.mark.parametrize("method", list(CONFIGS))
@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_method_on_mesh_equals_single_device_vanilla(reference, demo, method, mesh_shape):
    target, draft, prompts = demo
    out = oj.generate(target, prompts, draft=draft if method in NEEDS_DRAFT else None,
                      method=method, config=CONFIGS[method], max_new_tokens=N_NEW,
                      mesh=make_mesh(*mesh_shape))
    got = [list(map(int, t)) for t in out.tokens]
    first = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None)
             for g, r in zip(got, reference)]
    assert got == reference, f"first differing token per prompt: {first}"
