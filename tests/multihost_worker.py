"""One process of a multi-process run, started by tests/test_multihost.py (never by pytest).

    python tests/multihost_worker.py SPEC.json PROCESS_ID

SPEC.json: {"port", "num_processes", "target", "draft", "out_dir", "mode", "mesh": [data, model],
"load_mesh": [data, model]}; mode "restart" only builds, serves with and stops two engines in
turn (`restart`). The process joins the others through `jax.distributed` on
localhost, loads both models straight onto the mesh (each process reading only its slices;
the bytes it reads are counted by wrapping safetensors' reader, outside the code under test),
runs the calls `CALLS` lists, then serves `SERVE_REQUESTS` with one `serving.Engine` over
both processes (process 0 behind HTTP, process 1 following), and writes what it got to
out_dir/process_<i>.json. Its device count comes from the parent's XLA_FLAGS.
"""

import json
import os
import sys

# the calls every process makes, the same on every one (SPMD); the parent test runs them in
# one process to compare: (name, method, generate keyword arguments)
CALLS = [
    ("vanilla", "vanilla", dict(config=None)),
    ("ouroboros", "ouroboros", dict(config="quick")),
    ("vanilla_sampled", "vanilla", dict(config=None, temperature=0.9, top_k=20, seed=7)),
    ("ouroboros_auto", "ouroboros", dict(config="auto")),
    # every other method, greedy: each must give single-process vanilla's tokens (issue 51)
    ("speculative", "speculative", dict(config="quick")),
    ("lookahead", "lookahead", dict(config="quick")),
    ("prompt_lookup", "prompt_lookup", dict(config="quick")),
]
GREEDY_METHODS = ("ouroboros", "speculative", "lookahead", "prompt_lookup")
DRAFTED = ("speculative", "ouroboros")  # the methods that take the draft model
PROMPTS = [[1, 5, 9, 14, 3, 22], [1, 40, 41, 7], [1, 8, 8, 8, 30, 31, 32, 60], [1, 3]]
MAX_NEW = 16
# serving: (prompt index, max_tokens) of the greedy requests sent to process 0 at once, one
# more than there are slots, so one enters a slot another has freed; speculation at one busy
# slot, plain rounds at two, so steps switch load level
SERVE_REQUESTS = [(0, 12), (1, 5), (2, 8)]
SERVE_KW = dict(slots=2, max_cache_len=64, rounds_per_step=2)


def serve_config() -> dict:
    from ouroboros_jax.decoding import METHODS

    return {1: METHODS["ouroboros"].quick_config(), 2: "off"}


def call_kwargs(method: str, kw: dict) -> dict:
    """A CALLS entry's keyword arguments, with "quick" as the method's quick config."""
    from ouroboros_jax.decoding import METHODS

    kw = dict(kw)
    if kw.get("config") == "quick":
        kw["config"] = METHODS[method].quick_config()
    return kw


def _count_reads(counter: dict) -> None:
    """Wraps safetensors.safe_open so every tensor or slice read adds its bytes to counter."""
    import safetensors

    real = safetensors.safe_open

    class Slice:
        def __init__(self, s):
            self._s = s

        def __getitem__(self, idx):
            out = self._s[idx]
            counter["bytes"] += out.nbytes
            return out

        def __getattr__(self, name):
            return getattr(self._s, name)

    class Handle:
        def __init__(self, *a, **k):
            self._h = real(*a, **k)

        def __enter__(self):
            self._f = self._h.__enter__()
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def get_tensor(self, key):
            out = self._f.get_tensor(key)
            counter["bytes"] += out.nbytes
            return out

        def get_slice(self, key):
            return Slice(self._f.get_slice(key))

        def keys(self):
            return self._f.keys()

    safetensors.safe_open = Handle


def _complete(url: str, prompt: list, max_tokens: int) -> list:
    """One greedy /v1/completions request on token ids -> the generated ids."""
    import urllib.request

    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["choices"][0]["token_ids"]


def _record_ops(lockstep) -> list:
    """Wraps the engine's broadcast (its lockstep protocol's) so that the kind of every record
    it sends (process 0) or receives (the others) is listed, in order (outside the code under
    test)."""
    kinds = []
    real = lockstep.broadcast

    def recording(value):
        op = real(value)
        kinds.append(op.kind)
        return op

    lockstep.broadcast = recording
    return kinds


def serve(target, draft, mesh, pid: int) -> dict:
    """The serving engine over both processes: process 0 answers SERVE_REQUESTS over HTTP,
    all at once, then stops its server (which stops the engine and releases the follower);
    process 1 follows. -> what each saw."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ouroboros_jax.serving import Engine
    from ouroboros_jax.serving import lockstep

    out = {"ops": _record_ops(lockstep)}
    lockstep.IDLE_HEARTBEAT_S = 0.2  # idle records before the requests arrive
    try:  # engines that differ between processes are refused by name, on both
        Engine(target, draft, method="ouroboros", config=serve_config(), mesh=mesh,
               **dict(SERVE_KW, slots=2 + pid))
        out["disagree"] = None
    except ValueError as e:
        out["disagree"] = str(e)
    engine = Engine(target, draft, method="ouroboros", config=serve_config(), mesh=mesh,
                    **SERVE_KW)
    if pid != 0:
        try:
            engine.submit(PROMPTS[0])
        except RuntimeError as e:
            out["submit"] = str(e)
        out["device_calls"] = engine.follow()
        return out
    from ouroboros_jax.serving.server import ServerThread, create_app

    srv = ServerThread(create_app(engine)).start()
    try:
        time.sleep(1.0)  # idle: the follower gets heartbeats
        with ThreadPoolExecutor(len(SERVE_REQUESTS)) as ex:
            out["tokens"] = list(ex.map(lambda r: _complete(srv.url, PROMPTS[r[0]], r[1]),
                                        SERVE_REQUESTS))
        pool = engine.pool  # gathered from both processes
        out["pool_entries"] = int((pool.keys >= 0).sum())
        m = engine.metrics()
        out["levels"] = m["steps_per_level"]
        # what the follower must have run: every insert, every step, the pool read
        out["device_calls"] = len(SERVE_REQUESTS) + m["steps"] + 1
        out["running"] = [engine.running]
    finally:
        srv.stop()  # its shutdown stops the engine, which sends the follower "stop"
    # /health's answer: 503 once the followers have left
    out.setdefault("running", []).append(engine.running)
    return out


def restart(target, mesh, pid: int) -> dict:
    """Two engines, one after the other, over the same models in the same processes: each
    serves SERVE_REQUESTS (greedy, vanilla) and is stopped, process 1 following each in turn.
    -> the tokens of each engine (process 0) or the device calls each ran (process 1)."""
    from ouroboros_jax.serving import Engine, RequestParams

    out = {"tokens": [], "device_calls": []}
    for _ in range(2):
        engine = Engine(target, method="vanilla", config=None, mesh=mesh, **SERVE_KW)
        if pid != 0:
            out["device_calls"].append(engine.follow())
            continue
        engine.start()
        hs = [engine.submit(PROMPTS[i], RequestParams(max_tokens=n)) for i, n in SERVE_REQUESTS]
        out["tokens"].append([h.result().token_ids for h in hs])
        engine.stop()
        try:  # the same multi-process engine refuses to start again, saying what to do
            engine.start()
        except RuntimeError as e:
            out["again"] = str(e)
    return out


def main(spec_path: str, pid: int) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import jax

    import ouroboros_jax as oj
    from ouroboros_jax import distributed
    from ouroboros_jax.sharding import load_sharded, make_mesh

    distributed.initialize(f"127.0.0.1:{spec['port']}", spec["num_processes"], pid,
                           initialization_timeout=60)
    out = {"process": jax.process_index(), "devices": jax.device_count(),
           "local_devices": jax.local_device_count()}
    if spec["mode"] == "fail" and pid == 1:
        raise RuntimeError("worker 1 fails on purpose")

    import time

    if spec["mode"] == "restart":
        mesh = make_mesh(*spec["mesh"])
        out["restart"] = restart(load_sharded(spec["target"], mesh, dtype="float32"), mesh, pid)
        with open(os.path.join(spec["out_dir"], f"process_{pid}.json"), "w") as f:
            json.dump(out, f)
        return
    t0 = time.perf_counter()
    counter = {"bytes": 0}
    _count_reads(counter)
    load_mesh = make_mesh(*spec["load_mesh"])
    for name in ("target", "draft"):
        counter["bytes"] = 0
        load_sharded(spec[name], load_mesh, dtype="float32")
        out[f"{name}_bytes_read"] = counter["bytes"]

    out["seconds"] = {"load": round(time.perf_counter() - t0, 1)}
    mesh = make_mesh(*spec["mesh"])
    target = load_sharded(spec["target"], mesh, dtype="float32")
    draft = load_sharded(spec["draft"], mesh, dtype="float32")
    for name, method, kw in CALLS:
        r = oj.generate(target, PROMPTS, draft=draft if method in DRAFTED else None,
                        method=method, max_new_tokens=MAX_NEW, mesh=mesh,
                        **call_kwargs(method, kw))
        out[name] = r.tokens
        out.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        if "auto" in r.stats:
            out[name + "_choice"] = r.stats["auto"]
        if name == "ouroboros":  # its pool, a local copy, placed again by the next call
            again = oj.generate(target, PROMPTS, draft=draft, method=method,
                                max_new_tokens=MAX_NEW, mesh=mesh, pool=r.pool,
                                **call_kwargs(method, kw))
            out["ouroboros_with_pool"] = again.tokens
            out["pool_hit_rate"] = [r.stats["pool_hit_rate"], again.stats["pool_hit_rate"]]
    # processes that disagree are refused by name, on every process, and then carry on
    try:
        oj.generate(target, PROMPTS, max_new_tokens=4, mesh=mesh, config=None, seed=pid)
        out["disagree"] = None
    except ValueError as e:
        out["disagree"] = str(e)
    out["serve"] = serve(target, draft, mesh, pid)
    out["seconds"]["serve"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(spec["out_dir"], f"process_{pid}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    try:
        main(sys.argv[1], int(sys.argv[2]))
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        # at once: a normal exit waits in jax.distributed's shutdown barrier for the peers
        os._exit(1)
