"""Multi-host: one model over two processes joined by `jax.distributed` on localhost (3 CPU
devices each), started here as subprocesses running tests/multihost_worker.py.

Each process must return the tokens a single process returns (vanilla, Ouroboros, config="auto"
and sampled runs), read only the weight slices its own devices hold, and refuse by name a call
whose arguments differ between processes. The same run then serves: process 0 answers HTTP
requests with a `serving.Engine` whose every device call process 1 follows (lockstep), and
each answer must equal single-process `generate`'s. A failing process must not leave its peer
hanging: the harness kills every worker's process group as soon as one fails or the time runs
out.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from safetensors import safe_open

import ouroboros_jax as oj
from conftest import TEST_XLA_FLAGS, make_hf_model

sys.path.insert(0, os.path.dirname(__file__))
import multihost_worker as worker  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_worker.py")
VOCAB = 96  # divisible by the model axes used (3 and 6), so every matrix is split


class WorkerFailed(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def _worker_xla_flags() -> str:
    """3 CPU devices per process, and the suite's compile settings (as the single-process
    reference runs here)."""
    flags = dict(TEST_XLA_FLAGS, xla_force_host_platform_device_count="3")
    return " ".join(f"--{k}={v}" for k, v in flags.items())


def worker_env(tmp: str) -> dict:
    """A worker's environment: CPU devices (`_worker_xla_flags`), this checkout's package, and
    the auto cache under tmp."""
    return dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
                XLA_FLAGS=_worker_xla_flags(),
                OUROBOROS_JAX_CACHE=os.path.join(tmp, "auto_cache"),
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_workers(spec: dict, num_processes: int = 2, timeout: float = 900.0, during=None
                ) -> list[dict]:
    """Runs the workers to the end and returns each one's output; the first to fail (or the
    timeout) kills every worker's process group and raises WorkerFailed with its stderr.
    during: called here once the workers are started (the reference run, overlapping theirs).
    Everything is written under a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="oj_multihost_") as tmp:
        spec = dict(spec, port=_free_port(), num_processes=num_processes, out_dir=tmp)
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = worker_env(tmp)
        procs, logs = [], []
        try:
            for i in range(num_processes):
                log = open(os.path.join(tmp, f"stderr_{i}.txt"), "w+")
                logs.append(log)
                procs.append(subprocess.Popen([sys.executable, WORKER, spec_path, str(i)],
                                              env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
            deadline = time.monotonic() + timeout
            if during is not None:
                during()
            while True:
                codes = [p.poll() for p in procs]
                failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    i = failed[0] if failed else None
                    for p in procs:
                        _kill_group(p)
                    if i is None:
                        raise WorkerFailed(f"workers still running after {timeout:.0f}s: killed")
                    tails = []
                    for j, log in enumerate(logs):  # every worker's: the first to exit may
                        log.flush()                 # be the peer of the one that broke
                        log.seek(0)
                        tails.append(f"--- worker {j} (exit {codes[j]}):\n{log.read()[-3000:]}")
                    raise WorkerFailed(f"worker {i} exited with {codes[i]}:\n" + "\n".join(tails))
                if all(c == 0 for c in codes):
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                _kill_group(p)
            for log in logs:
                log.close()
        outs = []
        for i in range(num_processes):
            with open(os.path.join(tmp, f"process_{i}.json")) as f:
                outs.append(json.load(f))
        return outs


@pytest.fixture(scope="module")
def mh_pair(tmp_path_factory):
    """(target dir, draft dir): every head count, FFN width and the vocabulary divisible by
    3 and by 6, so both models are split whole over a 'model' axis of either size."""
    td, dd = tmp_path_factory.mktemp("mh_target"), tmp_path_factory.mktemp("mh_draft")
    make_hf_model(td, vocab=VOCAB, hidden=48, heads=6, kv_heads=6, inter=96, layers=2, seed=4)
    make_hf_model(dd, vocab=VOCAB, hidden=24, heads=6, kv_heads=6, inter=48, layers=1, seed=5)
    return str(td), str(dd)


def single_process_tokens(target_dir: str, draft_dir: str) -> dict:
    """The workers' calls in this one process, without a mesh: what every worker must return."""
    target, draft = oj.load_model(target_dir, "float32"), oj.load_model(draft_dir, "float32")
    out = {}
    for name, method, kw in worker.CALLS:
        if name.endswith("auto"):  # auto may choose another config here: greedy tokens are
            continue               # the same for every config (compared with vanilla's)
        r = oj.generate(target, worker.PROMPTS, draft=draft if method in worker.DRAFTED else None,
                        method=method, max_new_tokens=worker.MAX_NEW,
                        **worker.call_kwargs(method, kw))
        out[name] = r.tokens
    out["serve"] = [oj.generate(target, [worker.PROMPTS[i]], draft=draft, method="ouroboros",
                                config=worker.serve_config()[1], max_new_tokens=n).tokens[0]
                    for i, n in worker.SERVE_REQUESTS]
    return out


@pytest.fixture(scope="module")
def runs(mh_pair):
    """(both workers' outputs: generation on a data=2 x model=3 mesh, loading onto 1 x 6;
    the single-process reference, computed while they run)."""
    ref = {}
    t0 = time.perf_counter()
    outs = run_workers({"target": mh_pair[0], "draft": mh_pair[1], "mode": "run",
                        "mesh": [2, 3], "load_mesh": [1, 6]},
                       during=lambda: ref.update(single_process_tokens(*mh_pair)))
    print(f"two workers: {time.perf_counter() - t0:.1f}s", [o["seconds"] for o in outs])
    return outs, ref


@pytest.fixture(scope="module")
def two_processes(runs):
    return runs[0]


@pytest.fixture(scope="module")
def one_process(runs):
    return runs[1]


def test_two_processes_see_one_global_mesh(two_processes):
    for i, o in enumerate(two_processes):
        assert (o["process"], o["devices"], o["local_devices"]) == (i, 6, 3)


@pytest.mark.parametrize("name", ["vanilla", "vanilla_sampled", *worker.GREEDY_METHODS])
def test_tokens_equal_single_process(two_processes, one_process, name):
    assert any(len(t) > 4 for t in one_process[name])  # not all stopped at once by an EOS
    for o in two_processes:
        assert o[name] == one_process[name], name


def test_greedy_methods_equal_vanilla(two_processes, one_process):
    for name in worker.GREEDY_METHODS:  # on the data 2 x model 3 mesh: two rows per data shard
        assert one_process[name] == one_process["vanilla"], name
        assert all(o[name] == one_process["vanilla"] for o in two_processes), name
    for o in two_processes:
        assert o["ouroboros_auto"] == one_process["vanilla"]
        # a second call starting from the first one's pool (gathered, then placed again)
        assert o["ouroboros_with_pool"] == one_process["vanilla"]
        assert o["pool_hit_rate"][1] >= o["pool_hit_rate"][0]


def test_auto_choice_is_process_zeros_on_every_process(two_processes):
    a, b = (o["ouroboros_auto_choice"] for o in two_processes)
    assert a == b and a["asked"] == "ouroboros"


def test_sampling_differs_from_greedy(one_process):
    # the sampled comparison is not greedy decoding under another name
    assert one_process["vanilla_sampled"] != one_process["vanilla"]


def test_disagreeing_processes_are_refused_by_name(two_processes):
    for o in two_processes:
        assert o["disagree"] is not None and "seed differ between processes" in o["disagree"]
        assert "prompts" not in o["disagree"]


def test_two_process_serving_answers_like_generate(two_processes, one_process):
    # three requests at once over two slots, on process 0's HTTP server: each its own
    # single-process generate's tokens, through both load levels
    leader = two_processes[0]["serve"]
    want = one_process["serve"]
    assert len({len(t) for t in want}) > 1  # different lengths: rows finish apart
    assert leader["tokens"] == want
    assert {k.split(":")[0] for k in leader["levels"]} == {"1 busy", "2 busy"}
    assert leader["pool_entries"] > 0  # the pool, gathered from both processes


def test_serving_follower_runs_every_device_call_then_returns(two_processes):
    leader, follower = (o["serve"] for o in two_processes)
    # the follower got the leader's records in the leader's order (idle heartbeats included)
    # and returned at "stop" (its worker exited 0), having run exactly the calls the leader
    # made; it refuses requests itself
    assert follower["ops"] == leader["ops"]
    assert leader["ops"].count("insert") == len(worker.SERVE_REQUESTS)
    assert "idle" in leader["ops"] and leader["ops"][-1] == "stop"
    assert follower["device_calls"] == leader["device_calls"] == \
        len(leader["ops"]) - leader["ops"].count("idle") - 1
    assert leader["running"] == [True, False]
    assert "follows process 0" in follower["submit"]
    for o in (leader, follower):  # engines that differ are refused by name on both
        assert o["disagree"] is not None and "slots differ between processes" in o["disagree"]


def _tensor_bytes(path: str) -> tuple[int, int]:
    """(bytes of the tensors a 'model' axis splits, of the ones it leaves whole: the norms)."""
    split = whole = 0
    with safe_open(os.path.join(path, "model.safetensors"), framework="np") as f:
        for k in f.keys():
            n = f.get_tensor(k).nbytes
            if "norm" in k:
                whole += n
            else:
                split += n
    return split, whole


@pytest.mark.parametrize("which", ["target", "draft"])
def test_each_process_reads_only_its_slices(two_processes, mh_pair, which):
    # 1 x 6 over 2 processes: each holds 3 of the 6 blocks of every split tensor, and the
    # norms whole (each block read once, however many local devices hold it)
    split, whole = _tensor_bytes(mh_pair[0 if which == "target" else 1])
    assert split > 10 * whole
    for o in two_processes:
        assert o[f"{which}_bytes_read"] == split // 2 + whole


def test_a_failing_process_does_not_leave_its_peer_hanging(mh_pair):
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailed, match="worker 1 fails on purpose"):
        run_workers({"target": mh_pair[0], "draft": mh_pair[1], "mode": "fail",
                     "mesh": [2, 3], "load_mesh": [1, 6]}, timeout=120)
    # worker 0 would wait for its peer in the first collective: killed, not waited for
    assert time.perf_counter() - t0 < 100


def test_single_process_generate_unchanged_by_the_hooks(mh_pair):
    # on one process the distributed helpers are identities: a mesh on local devices only
    from ouroboros_jax.sharding import load_sharded, make_mesh

    mesh = make_mesh(2, 3)
    target = load_sharded(mh_pair[0], mesh, dtype="float32")
    plain = oj.load_model(mh_pair[0], "float32")
    a = oj.generate(target, worker.PROMPTS, max_new_tokens=8, mesh=mesh, config=None)
    b = oj.generate(plain, worker.PROMPTS, max_new_tokens=8, config=None)
    assert a.tokens == b.tokens
    for x, y in zip(jax_leaves(target.params), jax_leaves(plain.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_engine_on_a_mesh_compiles_once_and_equals_generate(mh_pair):
    # one process, a data=2 x model=3 mesh: the engine's state keeps one placement, so its
    # one step and one insert compile once each (left to XLA, an insert or a step returns
    # the state placed otherwise and the next call compiles again), and answers equal generate's
    from ouroboros_jax.serving import Engine, RequestParams
    from ouroboros_jax.serving import engine as engine_mod
    from ouroboros_jax.sharding import make_mesh

    def compiled():
        return (engine_mod._device_step._cache_size(), engine_mod._device_insert._cache_size())

    target = oj.load_model(mh_pair[0], "float32")
    before = compiled()
    eng = Engine(target, method="vanilla", mesh=make_mesh(2, 3), **worker.SERVE_KW)
    want = [oj.generate(target, [worker.PROMPTS[i]], max_new_tokens=n, config=None).tokens[0]
            for i, n in worker.SERVE_REQUESTS]
    for wave in range(2):  # the second wave's requests enter slots the first ones used
        hs = [eng.submit(worker.PROMPTS[i], RequestParams(max_tokens=n))
              for i, n in worker.SERVE_REQUESTS]
        while eng.step():
            pass
        assert [h.result().token_ids for h in hs] == want
        assert [a - b for a, b in zip(compiled(), before)] == [1, 1]


def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_memory_reports_per_host_bytes(capsys):
    from ouroboros_jax.cli import main
    from ouroboros_jax.models.presets import PRESETS
    from ouroboros_jax.sharding import memory_plan

    # Llama-2-70B: 68,976,648,192 parameters (its published safetensors index), bf16. On a
    # data=2 x model=8 mesh over 4 hosts of 4 devices, each device holds an eighth of every
    # matrix (norms, a millionth of the bytes, whole), so a host holds half the model.
    p = memory_plan(PRESETS["llama-2-70b"], 2, 8, 1, 4096, "bfloat16", hosts=4)
    assert p["devices_per_host"] == 4
    assert abs(p["params_per_host_bytes"] / (68_976_648_192 * 2 / 2) - 1) < 1e-3
    main(["memory", "--mesh", "2x8", "--hosts", "4", "--preset", "llama-2-70b"])
    out = capsys.readouterr().out
    assert "total/host" in out and f"{p['total_per_host_bytes'] / 2**30:.2f}GiB" in out
    with pytest.raises(SystemExit, match="--hosts 3 must divide the mesh's 16 devices"):
        main(["memory", "--mesh", "2x8", "--hosts", "3"])


@pytest.mark.parametrize("flags,error", [
    (["--coordinator", "127.0.0.1:1234"],
     "--coordinator, --num-processes and --process-id go together"),
    (["--coordinator", "host0", "--num-processes", "2", "--process-id", "0"],
     "--coordinator must be HOST:PORT"),
    (["--coordinator", "host0:1234", "--num-processes", "0", "--process-id", "0"],
     "--num-processes must be >= 1"),
    (["--coordinator", "host0:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in [0, 2)"),
    (["--mesh", "2by3"], "--mesh must look like DATAxMODEL"),
    (["--mesh", "4x4"], "--mesh: mesh data=4 x model=4 needs 16 devices"),
])
def test_serve_refuses_bad_multi_process_flags_by_name(flags, error):
    # refused before jax.distributed starts or a model loads
    from ouroboros_jax.cli import main

    with pytest.raises(SystemExit, match=re.escape(error)):
        main(["serve", *flags])
