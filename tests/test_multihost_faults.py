"""Faults over processes: a follower killed while a request streams, and engines built again
after stop() in the same processes.

The kill test starts `ouroboros-jax serve` twice, joined by `jax.distributed` on localhost
(process 0 serving HTTP, process 1 following; the model split over both), streams a long
request, SIGKILLs process 1 after the first tokens, and checks what the leader does: it names
the dead process (its id, host and pid), fails the open request with an error instead of
leaving it hanging, and exits with a clear error and status 1, not aborted by JAX's runtime
(134 / -6, SIGABRT, as before `liveness`). `liveness.lost`'s rule (dead once a beat has not
moved for the timeout) is checked on its own against a fake key-value store.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.request

import ouroboros_jax as oj
import multihost_worker as worker
from test_multihost import _free_port, _kill_group, mh_pair, run_workers, worker_env  # noqa: F401

SERVE = "from ouroboros_jax.cli import main; main()"


def _serve(model: str, i: int, coordinator: str, http_port: int, tmp) -> tuple:
    """Process i of a two-process `serve` -> (its Popen, its log file: stdout and stderr)."""
    log = open(os.path.join(tmp, f"serve_{i}.txt"), "w+")
    cmd = [sys.executable, "-c", SERVE, "serve", "--model", model, "--method", "vanilla",
           "--slots", "2", "--max-model-len", "512", "--port", str(http_port),
           "--drain-timeout", "5", "--coordinator", coordinator, "--num-processes", "2",
           "--process-id", str(i)]
    p = subprocess.Popen(cmd, env=worker_env(str(tmp)), stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    return p, log


def _wait_healthy(url: str, procs: list, timeout: float) -> None:
    """Until the leader's /health answers 200 (AssertionError if a process exits first)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        assert codes == [None] * len(procs), f"a serve process exited early: {codes}"
        assert time.monotonic() < deadline, f"not serving after {timeout} s"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)


def _stream(url: str, lines: list) -> None:
    """A long greedy streamed completion; each line received goes to lines as (time, text),
    an exception that ends the stream as (time, 'EXCEPTION ...')."""
    body = json.dumps({"prompt": worker.PROMPTS[0], "max_tokens": 400, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                lines.append((time.monotonic(), line.decode()))
    except Exception as e:  # noqa: BLE001  (recorded: the test says what it expected)
        lines.append((time.monotonic(), f"EXCEPTION {e!r}"))


def test_a_killed_follower_is_named_and_the_leader_exits_without_abort(mh_pair, tmp_path):
    coordinator, http = f"127.0.0.1:{_free_port()}", _free_port()
    (leader, llog), (follower, flog) = (_serve(mh_pair[0], i, coordinator, http, tmp_path)
                                        for i in range(2))
    lines: list = []
    try:
        url = f"http://127.0.0.1:{http}"
        _wait_healthy(url, [leader, follower], timeout=240)
        t = threading.Thread(target=_stream, args=(url, lines), daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while not any('"text"' in s for _, s in lines):  # tokens are streaming
            assert time.monotonic() < deadline and t.is_alive(), lines
            time.sleep(0.02)
        os.killpg(follower.pid, signal.SIGKILL)
        killed = time.monotonic()
        t.join(90)
        rc = leader.wait(90)
        exited = time.monotonic()
    finally:
        for p in (leader, follower):
            _kill_group(p)
        llog.seek(0)
        log = llog.read()
        llog.close()
        flog.close()
    stream = "".join(s for _, s in lines)
    print(f"follower killed: the request failed {lines[-1][0] - killed:.1f} s later, the "
          f"leader exited {exited - killed:.1f} s later (rc {rc})")
    assert not t.is_alive()  # the request ended, not left hanging
    assert not re.search(r'"finish_reason":\s*"length"', stream)  # it did not finish...
    assert '"error"' in stream and "process 1" in stream, stream[-2000:]  # ...it failed
    name = f"process 1 (host {socket.gethostname()}, pid {follower.pid}) of 2 died"
    assert name in log, log[-3000:]
    assert "ouroboros-jax serve: error: the engine stopped: " + name in log
    assert rc == 1, log[-3000:]  # a clean non-zero exit: not 134 or -6 (SIGABRT)
    assert "Terminating process" not in log and "Check failure" not in log


def _single_process_tokens(target) -> list:
    return [oj.generate(target, [worker.PROMPTS[i]], max_new_tokens=n, config=None).tokens[0]
            for i, n in worker.SERVE_REQUESTS]


def test_engines_built_again_in_the_same_processes_serve_alike(mh_pair):
    outs = run_workers({"target": mh_pair[0], "draft": mh_pair[1], "mode": "restart",
                        "mesh": [2, 3], "load_mesh": [1, 6]}, timeout=300)
    leader, follower = (o["restart"] for o in outs)
    want = _single_process_tokens(oj.load_model(mh_pair[0], "float32"))
    assert leader["tokens"] == [want, want]  # the second engine answers as the first
    # process 1 followed each engine until its stop(), then returned
    assert len(follower["device_calls"]) == 2 and min(follower["device_calls"]) > 0
    assert "build a new Engine on every process" in leader["again"]


def test_a_stopped_single_process_engine_starts_again_and_is_built_again(mh_pair):
    from ouroboros_jax.serving import Engine, RequestParams

    target = oj.load_model(mh_pair[0], "float32")
    want = _single_process_tokens(target)
    got = []
    for _ in range(2):  # a new engine over the same model...
        engine = Engine(target, method="vanilla", config=None, **worker.SERVE_KW)
        for _ in range(2):  # ...and the same engine started again after stop()
            engine.start()
            hs = [engine.submit(worker.PROMPTS[i], RequestParams(max_tokens=n))
                  for i, n in worker.SERVE_REQUESTS]
            got.append([h.result().token_ids for h in hs])
            engine.stop()
            assert engine.fault is None
    assert got == [want] * 4


class _FakeClient:
    """The key-value store of a coordination service, as `liveness` uses it."""

    def __init__(self):
        self.store, self.gone = {}, False

    def key_value_try_get(self, key):
        if self.gone:
            raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
        if key not in self.store:
            raise RuntimeError(f"NOT_FOUND: {key} not found")
        return self.store[key]


def test_a_process_counts_dead_once_its_beat_stops_moving(monkeypatch):
    from ouroboros_jax import liveness

    client, now = _FakeClient(), [100.0]
    monkeypatch.setattr(liveness, "_client", lambda: client)
    monkeypatch.setattr(liveness.jax, "process_count", lambda: 3)
    monkeypatch.setattr(liveness.jax, "process_index", lambda: 0)
    monkeypatch.setitem(liveness._state, "beater", "on")
    monkeypatch.setattr(liveness, "_seen", {})
    monkeypatch.setattr(liveness, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    client.store.update({"ouroboros_jax/beat/1": "1", "ouroboros_jax/beat/2": "1",
                         "ouroboros_jax/process/2": "host h2, pid 7"})
    assert liveness.lost() == []
    now[0] += 6
    client.store["ouroboros_jax/beat/1"] = "2"  # process 1 beats on, process 2 stopped
    assert liveness.lost() == []  # 6 s without a beat: not yet
    now[0] += liveness.HEARTBEAT_TIMEOUT_S - 6 + 1
    assert liveness.lost() == [2]  # process 1's beat moved 5 s ago: alive
    err = liveness.ProcessLost([2])
    assert str(err).startswith("process 2 (host h2, pid 7) of 3 died or stopped answering")
    assert str(liveness.ProcessLost([1])).startswith("process 1 of 3")  # never announced
    client.gone = True  # no service any more: process 0, which held it, is gone
    assert liveness.lost() == [0]
