"""One CLI vocabulary: --model (alias --target) and --draft on every command that takes a
target, errors naming the flag before anything loads, --help with choices and defaults, a
--max-new-tokens cut said on stderr, --stats with compile time and decode speed apart; and
serve's sizing flags checked before any load."""

import json
import os
import re
import types

import pytest

import ouroboros_jax as oj
from ouroboros_jax import cli
from ouroboros_jax.bounds import kv_bytes_per_token

from test_docs import _parsers

METHOD_CHOICES = "{lookahead,ouroboros,prompt_lookup,speculative,vanilla}"


@pytest.fixture
def no_loading(monkeypatch):
    """Every way the CLI loads a model raises: a test passing with it loaded nothing."""
    import ouroboros_jax.demo_assets
    import ouroboros_jax.models

    def refuse(*a, **k):
        raise AssertionError(f"a model was loaded: {a}")

    for mod, name in ((oj, "load_model"), (ouroboros_jax.models, "load_model"),
                      (ouroboros_jax.demo_assets, "demo_pair")):
        monkeypatch.setattr(mod, name, refuse)


def _args(cmd, argv):
    return _parsers()[cmd].parse_args(argv)


@pytest.mark.parametrize("cmd,dest", [("generate", "model"), ("serve", "model"),
                                      ("memory", "model"), ("bench", "target"),
                                      ("tune", "target"), ("distill", "target")])
def test_model_and_target_are_one_flag(cmd, dest):
    extra = ["--out", "o"] if cmd == "distill" else []
    a, b = _args(cmd, ["--model", "m.gguf"] + extra), _args(cmd, ["--target", "m.gguf"] + extra)
    assert getattr(a, dest) == getattr(b, dest) == "m.gguf"
    if cmd != "distill":  # distill's draft is what it makes (--init, --draft-config)
        assert _args(cmd, ["--draft", "d"]).draft == "d"


@pytest.mark.parametrize("argv,error", [
    (["generate", "--model", "t", "--prompt", "x", "--method", "speculative"],
     "--method speculative needs --draft"),
    (["generate", "--model", "t", "--prompt", "x", "--method", "ouroboros"],
     "--method ouroboros needs --draft"),
    (["generate", "--prompt", "x", "--config", "{bad"], "--config is not valid JSON"),
    (["generate", "--prompt", "x", "--config", "[1]"], "--config must be a JSON object"),
    (["generate", "--prompt", "x", "--method", "speculative", "--config", '{"gama": 3}'],
     "--config for --method speculative: "),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["generate", "--prompt", "x", "--mesh", "2by2"], "--mesh must look like DATAxMODEL"),
    (["serve", "--model", "t", "--method", "speculative"], "--method speculative needs --draft"),
    (["serve", "--memory-fraction", "0"], "--memory-fraction must be in (0, 1]"),
    (["serve", "--memory-fraction", "1.5"], "--memory-fraction must be in (0, 1]"),
    (["serve", "--max-model-len", "1"], "--max-model-len must be an integer >= 2"),
    (["serve", "--max-cache-len", "0"], "--max-cache-len must be an integer >= 2"),
    (["serve", "--config", "{bad"], "--config is not valid JSON"),
    (["memory", "--preset", "nope"], "--preset: unknown preset 'nope'"),
])
def test_errors_name_the_flag_before_anything_loads(no_loading, argv, error):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert error in str(e.value) and str(e.value).startswith(f"ouroboros-jax {argv[0]}: error")


def test_help_shows_choices_and_defaults(capsys):
    for cmd, wants in (("generate", [METHOD_CHOICES, "(default: ouroboros with a draft, else "
                                     "vanilla;", "(default: 128)",
                                     "(default: 0.0)", "--model PATH, --target PATH"]),
                       ("serve", [METHOD_CHOICES, "(default: 8)", "(default: 0.1)",
                                  "(default: 2048, or the model's context", "wins over"])):
        with pytest.raises(SystemExit) as e:
            cli.main([cmd, "--help"])
        assert e.value.code == 0
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        missing = [w for w in wants if w not in text]
        assert not missing, (cmd, missing)
        assert "(default: None)" not in text and "(default: False)" not in text


def test_a_cut_by_max_new_tokens_is_said_on_stderr(capsys):
    out = types.SimpleNamespace(tokens=[[5, 6, 7], [5, 2], [5, 6, 2], [4]])
    cli._note_cut(out, (2, 9), 3)
    err = capsys.readouterr().err.splitlines()
    # prompt 1 is cut; 2 stopped early; 3 ended with EOS at the limit; 4 is short
    assert err == ["ouroboros-jax generate: prompt 1: stopped at --max-new-tokens 3; pass a "
                   "larger value for more"]
    cli._note_cut(types.SimpleNamespace(tokens=[[5, 6]]), None, 2)  # no EOS: cut
    assert "stopped at --max-new-tokens 2;" in capsys.readouterr().err


def test_generate_says_the_cut_and_reports_compile_and_decode_apart(capsys):
    # first in this module: its loop is traced (and compiled or read from the disk cache) here
    cli.main(["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "5", "--stats",
              "--method", "vanilla"])
    cap = capsys.readouterr()
    target = oj.demo_pair()[0]
    want = oj.generate(target, ["def add(a, b):"], max_new_tokens=5)
    assert cap.out == want.texts[0] + "\n"
    cut = len(want.tokens[0]) == 5 and want.tokens[0][-1] not in (target.config.eos_token_id,)
    assert ("stopped at --max-new-tokens 5; pass a larger value for more" in cap.err) == cut
    stats = json.loads(cap.err[cap.err.index("{"):])
    c, s = stats["compile_seconds"], stats["seconds"]
    assert 0 < c < s  # tracing at least happens, even with programs from the disk cache
    assert stats["decode_tokens_per_second"] == pytest.approx(stats["new_tokens"] / (s - c))
    assert stats["decode_tokens_per_second"] > stats["tokens_per_second"]
    assert "tokens/s" in cap.err and "compiling" in cap.err


def test_generate_constrains_the_output_with_response_format(capsys, tmp_path):
    # the flag's format reaches generate: the text printed matches the pattern in full, and
    # equals the library's constrained call (the same automaton on the same pair)
    fmt = {"type": "regex", "pattern": "[a-z ]{3,20}\\."}
    path = tmp_path / "fmt.json"
    path.write_text(json.dumps(fmt))
    cli.main(["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--method",
              "vanilla", "--response-format", "@" + str(path)])
    out = capsys.readouterr().out
    want = oj.generate(oj.demo_pair()[0], ["def add(a, b):"], max_new_tokens=24,
                       response_format=fmt)
    assert out == want.texts[0] + "\n" and re.fullmatch(fmt["pattern"], want.texts[0])


@pytest.mark.parametrize("value, message", [
    ("{not json", "--response-format is not valid JSON"),
    ('{"type": "yaml"}', "--response-format.type: must be"),
    ('{"type": "regex"}', "--response-format.pattern: must be a non-empty string"),
    ("@/nonexistent/fmt.json", "--response-format: cannot read"),
])
def test_a_bad_response_format_names_the_flag_before_loading(no_loading, value, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        cli.main(["generate", "--prompt", "x", "--response-format", value])


def test_memory_plans_a_model_from_its_config_alone(tiny_pair, capsys, monkeypatch):
    target, draft, _ = tiny_pair
    import ouroboros_jax.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    cli.main(["memory", "--model", target.path, "--draft", draft.path, "--mesh", "1x1",
              "--batch", "64", "--cache-len", "65536", "--dtype", "float32"])
    lines = capsys.readouterr().out.splitlines()
    # the mesh plan: the header, the column names, the target and the draft
    kv = 64 * 65536 * kv_bytes_per_token(target.config, 4)  # fp32: 4 bytes an element
    assert kv > 2**30 and f"{kv / 2**30:.2f}GiB" in lines[2]
    # then the pair on one device (`footprint`): a row per model, the pair's, the peak
    assert lines[4] == "" and lines[5].startswith("one device, float32")
    assert [ln.split()[0] for ln in lines[7:10]] == [os.path.basename(target.path),
                                                      os.path.basename(draft.path), "pair"]
    assert f"{kv / 1e9:.2f}GB" in lines[7] and lines[10].startswith("expected peak")
    with pytest.raises(SystemExit, match="--preset and --model/--draft each choose"):
        cli.main(["memory", "--model", target.path, "--preset", "llama-3-8b"])


def test_memory_plans_the_draft_as_generate_loads_it(tiny_pair, capsys):
    """--draft-quantize int8: the draft's row is named for it and its weights are the bytes of
    the model quantized so (codes, per-channel scales, the float embedding and norms)."""
    from ouroboros_jax.footprint import footprint
    from ouroboros_jax.models.quant import params_nbytes, quantize_params

    target, draft, _ = tiny_pair
    cli.main(["memory", "--model", target.path, "--draft", draft.path, "--mesh", "1x1",
              "--dtype", "float32", "--draft-quantize", "int8"])
    lines = capsys.readouterr().out.splitlines()
    row = next(ln for ln in lines if ln.startswith(os.path.basename(draft.path) + " (int8)"))
    held = params_nbytes(quantize_params(draft.params, draft.config, "int8"))
    assert footprint("d", draft.config, 4, 1, 8, code_bytes=1.0).weights == held
    assert held < params_nbytes(draft.params) and f"{held / 1e9:.2f}GB" in row


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_footprint_counts_the_arrays_a_model_holds(tiny_pair, dtype):
    """`memory`'s breakdown from a config alone equals the bytes of the arrays themselves: the
    weights, the fused packed copy a GPU makes (`layout.pack`), the KV cache generate
    allocates."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from ouroboros_jax.footprint import PEAK_FACTOR, footprint, peak_bound
    from ouroboros_jax.models import layout
    from ouroboros_jax.models.kv_cache import init_cache

    target, draft, _ = tiny_pair
    for m in (target, draft):
        m = dataclasses.replace(m, params=jax.tree.map(lambda x: x.astype(dtype), m.params))
        item = jnp.dtype(dtype).itemsize
        f = footprint("m", m.config, item, 3, 40)
        assert f.weights == layout.weight_bytes(m.params)
        own = {id(x) for x in jax.tree.leaves(m.params)}  # arrays the copy shares
        packed = jax.tree.leaves(layout.pack(m.params, m.config))
        assert f.packed_gpu == sum(x.nbytes for x in packed if id(x) not in own)
        assert f.packed_cpu == 0
        cache = init_cache(m.config, 3, 40, dtype)
        assert f.kv_cache == cache.k.nbytes + cache.v.nbytes
        assert f.total("gpu") == f.weights + f.packed_gpu + f.kv_cache
        assert peak_bound([f, f], "cpu") == int(PEAK_FACTOR * 2 * f.total("cpu"))


def test_method_defaults_to_ouroboros_with_a_draft():
    """generate's and serve's --method: ouroboros with a draft (--draft, or the demo pair's,
    which comes without --model), else vanilla; a given --method wins."""
    ns = lambda **kw: types.SimpleNamespace(**{"method": None, "model": None,  # noqa: E731
                                               "draft": None, **kw})
    assert cli._method(ns()) == "ouroboros"  # the demo pair brings its draft
    assert cli._method(ns(model="t.gguf")) == "vanilla"
    assert cli._method(ns(model="t.gguf", draft="d.gguf")) == "ouroboros"
    assert cli._method(ns(model="t.gguf", draft="d.gguf", method="speculative")) == "speculative"
