"""`bench --serve --peer`: our server and a peer's under the same streamed chat load, one at a
time. Here "ours" is the tiny chat model served in this process, the peer a stub OpenAI server
(a script the bench starts as a command with {port}, as it starts llama-cpp-python's)."""

import argparse
import sys
import textwrap

import pytest

from ouroboros_jax.bench.http_load import concurrency_levels
from ouroboros_jax.bench.serve_peer import (CONCURRENCY, Server, method_ran, parse_peer,
                                            peer_markdown, peer_servers, run_peer_bench)
from ouroboros_jax.cli import main
from ouroboros_jax.serving.engine import Engine
from ouroboros_jax.serving.server import ServerThread, create_app

STUB = textwrap.dedent('''
    """A stub OpenAI server: streamed chat answers of max_tokens words, one chunk each."""
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "stub"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            chunks = [{"delta": {"role": "assistant"}, "finish_reason": None}]
            chunks += [{"delta": {"content": f"w{i} "}, "finish_reason": None}
                       for i in range(req["max_tokens"])]
            chunks += [{"delta": {}, "finish_reason": "length"}]
            for ch in chunks:
                ev = {"object": "chat.completion.chunk", "choices": [{"index": 0, **ch}]}
                self.wfile.write(f"data: {json.dumps(ev)}\\n\\n".encode())
            self.wfile.write(b"data: [DONE]\\n\\n")
            self.wfile.flush()
            self.close_connection = True

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')

TEXTS = ["hello there", "what is two and two", "tell me a story"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def ours(tiny_chat_pair):
    engine = Engine(tiny_chat_pair[0], method="vanilla", slots=4, max_cache_len=256)
    srv = ServerThread(create_app(engine, model_names=["tiny"])).start()
    yield srv
    srv.stop(cancel=True)


def test_peer_bench_rows_for_every_server_and_level(ours, tmp_path):
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    servers = [Server("ours-a", "ours", url=ours.url),
               Server("ours-b", "ours", url=ours.url),  # a second client of the same server
               parse_peer(f"stub={sys.executable} {stub} {{port}}"),
               parse_peer(f"broken={sys.executable} -c 'raise SystemExit(3)' {{port}}")]
    conc = (1, 3)
    res = run_peer_bench(servers, TEXTS, concurrency=conc, requests=2, max_tokens=MAX_TOKENS,
                         log_dir=str(tmp_path / "logs"))
    assert list(res["servers"]) == ["ours-a", "ours-b", "stub", "broken"]
    for name in ("ours-a", "ours-b", "stub"):
        levels = res["servers"][name]["levels"]
        assert [r["concurrency"] for r in levels] == list(conc)
        for r in levels:
            assert r["requests"] == max(2, r["concurrency"]) and r["unfinished"] == 0
            assert r["tok_per_s"] > 0 and r["ttft_p50_s"] <= r["latency_p50_s"]
            assert r["latency_p50_s"] <= r["latency_p95_s"]
    # the stub streams max_tokens chunks and no usage; ours sends the usage chunk
    for r in res["servers"]["stub"]["levels"]:
        assert r["tokens_counted_by"] == ["chunks"]
        assert r["completion_tokens"] == r["requests"] * MAX_TOKENS
    assert res["servers"]["ours-a"]["levels"][0]["tokens_counted_by"] == ["usage"]
    # the bench started the stub on a free port, then stopped it
    assert "{port}" not in " ".join(res["servers"]["stub"]["command"])
    assert servers[2].proc.poll() is not None
    assert "exited with 3" in res["servers"]["broken"]["error"]
    # greedy answers: ours equal each other; the stub's words are not the model's
    assert res["agreement"]["ours-b"] == {"same": 2, "of": 2}
    assert res["agreement"]["stub"]["same"] == 0
    md = peer_markdown(res).splitlines()
    for name in ("ours-a", "ours-b", "stub"):
        for c in conc:
            assert sum(ln.startswith(f"| {name} |") and ln.split(" | ")[2] == str(c)
                       for ln in md) == 1
    assert sum(ln.startswith("| broken | failed:") for ln in md) == 1


def _args(**kw):
    base = dict(target="m.gguf", draft=None, peer=[])
    return argparse.Namespace(**{**base, **kw})


def test_peer_servers_commands_and_flag_errors():
    servers = peer_servers(_args(peer=["llama.cpp=python -m llama_cpp.server --port {port}",
                                       "up=http://127.0.0.1:9/"]), None)
    assert [s.name for s in servers] == ["ouroboros-jax vanilla", "ouroboros-jax prompt_lookup",
                                         "ouroboros-jax lookahead", "llama.cpp", "up"]
    cmd = servers[1].command
    assert cmd[cmd.index("--model") + 1] == "m.gguf"
    assert cmd[cmd.index("--method") + 1] == "prompt_lookup" and cmd[-2:] == ["--port", "{port}"]
    assert servers[3].command[-2:] == ["--port", "{port}"] and servers[4].url == "http://127.0.0.1:9"
    with pytest.raises(ValueError, match="--peer must look like NAME=URL"):
        parse_peer("no-equals-sign")
    with pytest.raises(ValueError, match=r"must contain \{port\}"):
        parse_peer("x=python -m server")
    with pytest.raises(ValueError, match="--draft"):
        peer_servers(_args(), ["speculative"])
    with pytest.raises(ValueError, match="--peer needs --model"):
        peer_servers(_args(target=None), None)
    with pytest.raises(ValueError, match="--serve-concurrency"):
        concurrency_levels("1,0", CONCURRENCY)
    assert concurrency_levels("1,4,16", CONCURRENCY) == (1, 4, 16)
    assert concurrency_levels(None, CONCURRENCY) == (1, 4, 16)
    with pytest.raises(SystemExit, match="--peer goes with --serve"):
        main(["bench", "--peer", "x=http://127.0.0.1:9"])


def test_method_ran_reads_the_startup_line():
    lines = ["ouroboros-jax serve: building the engine (prompt_lookup, auto probing each load "
             "level) ... 3.0 s",
             "ouroboros-jax serve: m (prompt_lookup, 6 slots) on http://127.0.0.1:8000/v1"]
    assert method_ran(lines) == "prompt_lookup"
    assert method_ran(lines[:1]) is None
