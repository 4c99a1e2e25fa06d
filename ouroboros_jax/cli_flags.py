"""The `ouroboros-jax` command's flags: one parser per subcommand, each flag with its help and
default. cli.py checks the flags and runs the commands; `bench` and `tune` add their own
(bench/suite.py, bench/tune.py); `distill` parses its own (training/distill.py)."""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from . import compile_cache
from .bench.suite import add_bench_args
from .bench.tune import add_tune_args
from .decoding import METHODS
from .serving.sizing import DEFAULT_MAX_MODEL_LEN, DEFAULT_MEMORY_FRACTION


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with "(default: X)" after each flag that has a default its help does not already
    state (argparse lists choices itself)."""

    def _get_help_string(self, action):
        text = action.help or ""
        # identity: 0 and 0.0 are defaults to show, though they equal False
        if action.default is None or action.default is False \
                or action.default == argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


def command(sub, name: str, text: str, models: Optional[tuple] = None):
    """A subcommand's parser, its --help with defaults; models: the help of its --model (alias
    --target) and --draft, the flags every command that takes a model has."""
    p = sub.add_parser(name, formatter_class=HelpFormatter, help=text)
    if models is not None:
        p.add_argument("--model", "--target", dest="model", metavar="PATH", help=models[0])
        p.add_argument("--draft", metavar="PATH", help=models[1])
    return p


def add_compile_cache_arg(p) -> None:
    """--compile-cache, for the commands that compile (generate, serve)."""
    p.add_argument("--compile-cache", metavar="DIR",
                   help="keep compiled programs here, so the next start reads them back; "
                        f"'off' keeps none (default: ${compile_cache.ENV}, else "
                        "~/.cache/ouroboros-jax/xla)")


def add_weights_cache_arg(p) -> None:
    """--weights-cache, for the commands that load GGUF files (generate, serve)."""
    p.add_argument("--weights-cache", metavar="DIR",
                   help="keep a GGUF's dequantized weights in DIR ('on': "
                        "~/.cache/ouroboros-jax/weights), written during the first load's "
                        "process, so later loads map them instead of dequantizing; 'off' "
                        "(the default, else $OUROBOROS_JAX_WEIGHTS_CACHE) keeps none")


def add_draft_quantize_arg(p) -> None:
    """--draft-quantize, for the commands that load a draft (generate, serve)."""
    p.add_argument("--draft-quantize", choices=["auto", "off", "int8", "int4", "w8a8"],
                   default="auto",
                   help="how --draft is loaded: 'auto' keeps its linear weights as int8 codes "
                        "on a CPU whose few-row kernel reads them (float32), and where the CPU "
                        "has AVX512-VNNI quantizes its activations too ('w8a8': integer dot "
                        "products); the draft only proposes, so no output changes (its "
                        "one-token forward 2x faster, its weights ~3x smaller); else as "
                        "--quantize; 'off': as --quantize")


def add_serve_gate_args(s) -> None:
    """serve's limit and access flags (`cli._serve_gate` reads them; serving/guard.py enforces)."""
    s.add_argument("--max-body-bytes", type=int, default=8 * 2 ** 20,
                   help="largest request body; larger ones get HTTP 413 (default: %(default)s)")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive; slower ones get HTTP 408 "
                        "(default: %(default)s)")
    s.add_argument("--api-key", default=None,
                   help="key every /v1/ request must send as 'Authorization: Bearer KEY', else "
                        "HTTP 401 (default: $OUROBOROS_JAX_API_KEY, else none)")
    s.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names served besides the bound address (and "
                        "localhost when bound to loopback); '*' for any (default: none)")
    s.add_argument("--allowed-origins", default=None,
                   help="comma-separated browser origins allowed, with CORS headers for them; "
                        "'*' for any (default: none: cross-origin requests get HTTP 403)")
    s.add_argument("--docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json (default: off)")


def build_parser(handlers: dict[str, Callable]) -> argparse.ArgumentParser:
    """The `ouroboros-jax` parser; handlers: {command: the function that runs it}, set as each
    subcommand's `fn` (`distill` has none: cli.main hands it its own parser first)."""
    ap = argparse.ArgumentParser(prog="ouroboros-jax",
                                 description="Ouroboros speculative decoding for JAX")
    sub = ap.add_subparsers(dest="cmd", required=True)

    methods = sorted(METHODS)
    g = command(sub, "generate", "generate text from a Hugging Face model directory or a GGUF "
                                  "file (default: the shipped demo pair)",
                 ("target model: an HF directory or a .gguf file (default: the shipped demo "
                  "target, with its draft)", "draft model directory or .gguf file (same "
                                             "tokenizer)"))
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--chat", action="append", help="a user message to an instruct model, "
                   "rendered with its chat template (repeatable: one conversation each)")
    g.add_argument("--system", help="a system message put before each --chat message")
    g.add_argument("--method", default=None, choices=methods,
                   help="decoding method (default: ouroboros with a draft, else vanilla; "
                        "speculative and ouroboros need --draft with --model)")
    g.add_argument("--config", help='method config as JSON, e.g. \'{"gamma": 6, "window": 6}\' '
                                    "(default: auto)")
    g.add_argument("--max-new-tokens", type=int, default=128,
                   help="the most new tokens per prompt (a cut is said on stderr)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus filtering (1.0: off)")
    g.add_argument("--top-k", type=int, default=0, help="top-k filtering (0: off)")
    g.add_argument("--seed", type=int, default=0, help="the random stream of sampling")
    g.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="weights kept as int8 or int4 codes with scales (every linear "
                        "layer, target and draft: see --draft-quantize; on a CPU without "
                        "the few-row kernel slower than float: for memory)")
    add_draft_quantize_arg(g)
    g.add_argument("--response-format", metavar="JSON|@FILE",
                   help='constrain the output, as the OpenAI API\'s response_format: '
                        '\'{"type": "json_object"}\', {"type": "json_schema", "json_schema": '
                        '{"schema": ...}} or {"type": "regex", "pattern": ...}; @FILE reads it '
                        "from a file (needs the structured extra: docs/structured.md)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="parameter and cache dtype")
    g.add_argument("--mesh", help="DATAxMODEL device mesh, e.g. 1x8")
    add_compile_cache_arg(g)
    add_weights_cache_arg(g)
    g.add_argument("--stats", action="store_true", help="print compile time, decode speed and "
                                                        "every stat (JSON) on stderr")
    g.set_defaults(fn=handlers["generate"])

    s = command(sub, "serve", "an OpenAI-compatible server (continuous batching, one shared "
                               "phrase pool); default: the demo pair",
                 ("target: a Hugging Face directory or a .gguf file (default: the shipped demo "
                  "pair)", "draft model (same tokenizer); default with the demo pair: its draft"))
    s.add_argument("--method", default=None, choices=methods,
                   help="decoding method (default: ouroboros with a draft, else vanilla)")
    s.add_argument("--config", help="method config as JSON (default: auto, per load level)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--slots", type=int, default=8,
                   help="requests decoded together, at most (fewer when --memory-fraction "
                        "holds fewer); more wait in the queue")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a slot before new ones get HTTP 429")
    s.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION,
                   help="share of the device's memory (on a CPU the host's) the slots' KV "
                        "caches may take; it bounds the slots")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + max_tokens of one request, at most; longer ones get HTTP "
                        f"400 (default: {DEFAULT_MAX_MODEL_LEN}, or the model's context if "
                        "smaller)")
    s.add_argument("--max-cache-len", type=int, default=None,
                   help="explicit override of --max-model-len (wins over it; may be up to "
                        "the model's context)")
    s.add_argument("--served-model-name", help="the model name clients send (default: the "
                                               "model's directory or file name; "
                                               "ouroboros-demo for the demo pair)")
    s.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="weights kept as int8 or int4 codes with scales (every linear "
                        "layer, target and draft: see --draft-quantize; on a CPU without "
                        "the few-row kernel slower than float: for memory)")
    add_draft_quantize_arg(s)
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="parameter and cache dtype")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds requests in flight get to finish on Ctrl-C or SIGTERM before "
                        "they are cancelled (default: %(default)s)")
    add_serve_gate_args(s)
    add_compile_cache_arg(s)
    add_weights_cache_arg(s)
    s.add_argument("--mesh", help="DATAxMODEL device mesh, e.g. 1x8 (default: none on one "
                                  "process; processes x local devices over several)")
    s.add_argument("--coordinator", help="multi-process: HOST:PORT of process 0, the same on "
                                         "every process (jax.distributed); process 0 serves "
                                         "HTTP, the others follow its steps")
    s.add_argument("--num-processes", type=int, help="multi-process: how many processes")
    s.add_argument("--process-id", type=int, help="multi-process: this process's index, 0 "
                                                  "to N-1")
    s.set_defaults(fn=handlers["serve"])

    d = command(sub, "demo", "the shipped pair: vanilla vs the fastest method")
    d.add_argument("--num-prompts", type=int, default=None,
                   help="held-out prompts to run (default 6; 2 when CI is set)")
    d.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    d.add_argument("--method", default=None, choices=methods,
                   help="run only this method beside vanilla")
    d.set_defaults(fn=handlers["demo"])

    m = command(sub, "memory", "per-device and per-host bytes of params and KV cache on a mesh",
                 ("plan this model (an HF directory or a .gguf file; its config only is read) "
                  "instead of the presets", "plan this draft model too"))
    m.add_argument("--preset", action="append", help="llama-2-70b, yi-34b, llama-3-8b, ... "
                                                     "(default: every preset)")
    m.add_argument("--mesh", default="1x8", help="DATAxMODEL, e.g. 1x8")
    m.add_argument("--batch", type=int, default=1, help="rows decoded together")
    m.add_argument("--cache-len", type=int, default=4096, help="KV cache tokens per row")
    m.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="parameter and cache dtype")
    m.add_argument("--hosts", type=int, default=1,
                   help="hosts the mesh spans (equal device counts): adds per-host bytes")
    m.add_argument("--draft-quantize", choices=["auto", "off", "int8", "int4", "w8a8"],
                   default="auto",
                   help="with --draft: plan it as generate loads it here (auto: int8 codes, "
                        "w8a8 with VNNI, where the few-row kernel runs and --dtype is float32; "
                        "off: as --dtype)")
    m.add_argument("--quantize", action="append", choices=["int8", "int4"],
                   help="the quantized-weights plan instead: target + draft with bf16 and "
                        "these weights on 1/2/4/8 devices of 80 and 141 GB (default targets "
                        "llama-3.1-70b and yi-34b, draft llama-3.2-1b; --preset/--model and "
                        "--draft choose others); repeat for both")
    m.set_defaults(fn=handlers["memory"])

    b = command(sub, "bench", "benchmark methods and transformers peers: JSON, markdown, plots")
    add_bench_args(b)
    b.set_defaults(fn=handlers["bench"])

    t = command(sub, "tune", "the paper's Algorithm 1: pick gamma, then W/N, then K")
    add_tune_args(t)
    t.set_defaults(fn=handlers["tune"])

    sub.add_parser("distill", help="distil a draft model from a target: ouroboros-jax distill -h")
    return ap
