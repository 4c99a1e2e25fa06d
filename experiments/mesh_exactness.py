"""Do speculative methods on a multi-device CPU mesh give vanilla's tokens? (issue 51; the
answer and the tables are in docs/exactness.md, "Meshes, CPUs and the XLA flags").

    python -m experiments.mesh_exactness sweep 2x1,6x1 speculative,ouroboros [ROWS]
    python -m experiments.mesh_exactness race [DEVICES] [ROWS] [TOKENS] [RUNS]

`sweep`: the demo pair's held-out prompts in groups of ROWS (4), each method against vanilla on
each mesh, 48 tokens; prints the first differing token per prompt (None: identical).
`race`: a data-sharded MLP run RUNS times, compared bit for bit with its first run and with its
one-device run (a race in the dot library would make runs differ).

Run it under the XLA_FLAGS to test, e.g. the flags before issue 51's fix:
`XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_cpu_experimental_ynn_fusion_type="`,
and `ONEDNN_MAX_CPU_ISA=AVX2` for oneDNN's AVX2 kernels on an AVX-512 machine.
"""

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import numpy as np  # noqa: E402

import ouroboros_jax as oj  # noqa: E402  (applies the library's flag logic first)

N_NEW = 48


def first_diff(a, b):
    a, b = list(map(int, a)), list(map(int, b))
    d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return d if d is not None or len(a) == len(b) else min(len(a), len(b))


def sweep(meshes: str, methods: str, rows: int = 4) -> None:
    from ouroboros_jax.sharding import make_mesh

    configs = {"speculative": oj.SpeculativeConfig(gamma=4), "ouroboros": oj.OuroborosConfig(gamma=4),
               "lookahead": oj.LookaheadConfig(), "prompt_lookup": oj.PromptLookupConfig(),
               "vanilla": None}
    target, draft = oj.demo_pair()
    prompts = [p["text"] for p in oj.demo_prompts()]
    shapes = [tuple(map(int, m.split("x"))) for m in meshes.split(",")]
    for g in range(0, len(prompts), rows):
        group = prompts[g:g + rows]
        ref = oj.generate(target, group, method="vanilla", config=None, max_new_tokens=N_NEW)
        for d, m in shapes:
            for method in methods.split(","):
                kw = {"draft": draft} if method in ("speculative", "ouroboros") else {}
                out = oj.generate(target, group, method=method, config=configs[method],
                                  max_new_tokens=N_NEW, mesh=make_mesh(data=d, model=m), **kw)
                diffs = [first_diff(a, b) for a, b in zip(ref.tokens, out.tokens)]
                print(f"prompts {g}-{g + len(group) - 1} mesh {d}x{m} {method}: "
                      f"first differing token {diffs}", flush=True)


def race(devices: int = 2, rows: int = 2, tokens: int = 5, runs: int = 200) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    H, F = 256, 1024
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    w1, w2 = jax.random.normal(k[0], (H, F)) / 16, jax.random.normal(k[1], (F, H)) / 32
    x = jax.random.normal(k[2], (devices * rows, tokens, H))

    @jax.jit
    def mlp(x):
        for _ in range(4):
            x = x + jnp.tanh(x @ w1) @ w2
        return x

    one = np.asarray(mlp(jax.device_put(x, jax.devices()[0])))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    first = np.asarray(mlp(xs))
    differing = sum(not np.array_equal(np.asarray(mlp(xs)), first) for _ in range(runs))
    print(f"XLA_FLAGS={os.environ['XLA_FLAGS']!r}: {differing} of {runs} runs differ from the "
          f"first; max |sharded - one device| = {np.abs(first - one).max():.3g}")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "sweep":
        sweep(args[0], args[1], *(int(a) for a in args[2:]))
    elif cmd == "race":
        race(*(int(a) for a in args))
    else:
        sys.exit(__doc__)
